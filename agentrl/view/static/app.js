/* agentrl view: the browser side of the run viewer.
 *
 * One file, no modules, no build step: it must also run from file:// (the exported
 * static copy). It talks to the server (agentrl/view/server.py, docs/viewer.md) through
 * five JSON questions: run, rows, search, episode, stamp; an exported copy answers the
 * same from data/run.js and data/episodes/*.js. Every text that comes from a run is inserted with
 * textContent / createTextNode / setAttribute, never as HTML: trajectories are untrusted.
 *
 * Layout of this file:
 *   1. small helpers (DOM, formatting, errors)
 *   2. the data layer `api` (live: HTTP; static: window.AGENTRL_STATIC + chunk scripts)
 *   3. state: rows per file, the episodes query, filtering and sorting
 *   4. router
 *   5. page: run overview (charts)
 *   6. page: episodes table
 *   7. page: one episode (turns, tokens, branches)
 *   8. live polling, start-up
 */
(function () {
  'use strict';

  window.__agentrlLoads = (window.__agentrlLoads || 0) + 1;

  const STATIC = window.AGENTRL_STATIC;            // defined only in an exported copy
  const PAGE_SIZE = 100;
  const POLL_MS = 2000;
  const OBS_COLLAPSE_CHARS = 1500;                 // longer observations start collapsed
  const OBS_COLLAPSE_LINES = 30;
  let INFRA_STOPS = new Set();                     // the server's list (/api/run infra_stops)
  const STOP_COLORS = {
    finished: '#1a7f37', max_turns: '#d4731b', context_limit: '#8250df',
    sampler_length: '#0969da', episode_timeout: '#9a6700', sandbox_error: '#6e7781',
    eval_error: '#424a53', aborted: '#afb8c1',
  };
  const PALETTE = ['#0969da', '#d4731b', '#1a7f37', '#8250df', '#cf222e', '#9a6700',
    '#1b7c83', '#bf3989', '#57606a', '#4d2d00'];
  const VERSION_CLASSES = 12;                       // .vc0 … .vc11 in app.css
  const LP_CLASSES = 10;                            // .lp0 (p≈1) … .lp9 (p≈0)
  const STEP_INCRS = [1, 2, 5, 10, 20, 25, 50, 100, 200, 250, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000];

  // ---------------------------------------------------------------- 1. helpers

  /* el('div', {class: 'x', 'data-k': 1, onclick: f}, child, 'text', [more]) */
  function el(tag, attrs) {
    const node = document.createElement(tag);
    if (attrs) {
      for (const k in attrs) {
        const v = attrs[k];
        if (v === null || v === undefined || v === false) continue;
        if (k === 'class') node.className = v;
        else if (k === 'text') node.textContent = v;
        else if (k.startsWith('on')) node.addEventListener(k.slice(2), v);
        else if (v === true) node.setAttribute(k, '');
        else node.setAttribute(k, String(v));
      }
    }
    for (let i = 2; i < arguments.length; i++) append(node, arguments[i]);
    return node;
  }

  /* append(node, child, …): children may be nodes, strings (as text), arrays, or null. */
  function append(node) {
    for (let i = 1; i < arguments.length; i++) {
      const child = arguments[i];
      if (child === null || child === undefined || child === false) continue;
      if (Array.isArray(child)) child.forEach((c) => append(node, c));
      else node.appendChild(child instanceof Node ? child : document.createTextNode(String(child)));
    }
  }

  function clear(node) { while (node.firstChild) node.removeChild(node.firstChild); return node; }

  function $(sel, root) { return (root || document).querySelector(sel); }

  function isNum(v) { return typeof v === 'number' && isFinite(v); }

  function fmt(v, digits) {
    if (v === null || v === undefined) return '—';
    if (typeof v !== 'number') return String(v);
    if (!isFinite(v)) return String(v);
    if (Number.isInteger(v)) return String(v);
    const d = digits === undefined ? 3 : digits;
    const a = Math.abs(v);
    if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
    return String(Number(v.toFixed(d)));
  }

  function fmtCi(v, ci) {
    if (!isNum(v)) return '—';
    return isNum(ci) ? fmt(v) + ' ± ' + fmt(ci) : fmt(v);
  }

  function rewardClass(r) {
    if (!isNum(r)) return 'rnull';
    if (r >= 1) return 'r1';
    if (r <= 0) return 'r0';
    return 'rpart';
  }

  function episodeHash(file, row) {
    return '#/episode/' + encodeURIComponent(file) + '/' + row;
  }

  function episodesHash(params) {
    const q = new URLSearchParams();
    for (const k in params) if (params[k] !== '' && params[k] !== null && params[k] !== undefined) q.set(k, params[k]);
    const s = q.toString();
    return '#/episodes' + (s ? '?' + s : '');
  }

  function fileLabel(id) {
    const f = state.run && state.run.files.find((x) => x.id === id);
    return f ? f.label : id;
  }

  function debounce(fn, ms) {
    let t = null;
    return function () { clearTimeout(t); t = setTimeout(fn, ms); };
  }

  class ApiError extends Error {
    constructor(message, fix) { super(message); this.fix = fix || null; }
  }

  /* The #error banner. `source` lets the poller clear only the errors it raised. */
  let errorSource = null;
  function showError(err, source) {
    const box = $('#error');
    clear(box);
    const msg = err && err.message ? err.message : String(err);
    append(box, el('div', {class: 'error-msg'}, el('strong', {text: 'error: '}), msg));
    if (err && err.fix) append(box, el('div', {class: 'error-fix'}, el('strong', {text: 'fix: '}), err.fix));
    append(box, el('button', {class: 'error-close', title: 'dismiss', onclick: () => { box.hidden = true; }}, '×'));
    box.hidden = false;
    errorSource = source || 'page';
    if (!(err instanceof ApiError)) console.warn(err);   // a bug in this file: keep the stack
  }

  function clearError(source) {
    if (errorSource === source) { $('#error').hidden = true; errorSource = null; }
  }

  // ---------------------------------------------------------------- 2. data layer

  /* Search folds case the way the server does (agentrl/view/folder.py `fold`): ASCII
   * letters only, everything else compared as is. */
  function foldAscii(text) {
    return text.replace(/[A-Z]+/g, (m) => m.toLowerCase());
  }

  /* The server's /api/search rule, for the static copy: a plain substring of any turn's
   * action or observation. `folded` is the query after foldAscii. */
  function trajectoryMatches(traj, folded) {
    const turns = traj.turns || [];
    for (let i = 0; i < turns.length; i++) {
      const t = turns[i];
      if (foldAscii(t.action || '').includes(folded)) return true;
      if (foldAscii(t.observation || '').includes(folded)) return true;
    }
    return false;
  }

  function liveApi() {
    async function get(path) {
      let resp;
      try {
        resp = await fetch(path, {cache: 'no-store'});
      } catch (e) {
        throw new ApiError('cannot reach the agentrl view server (' + e.message + ')',
          'is `agentrl view` still running? Start it again and reload this page.');
      }
      let body = null;
      try { body = await resp.json(); } catch (e) { body = null; }
      if (!resp.ok) {
        throw new ApiError((body && body.error) || ('HTTP ' + resp.status + ' from ' + path),
          body && body.fix);
      }
      if (body === null) throw new ApiError('the server sent no JSON for ' + path, null);
      return body;
    }
    const q = encodeURIComponent;
    // Relative URLs: the page is served at the server's root.
    return {
      run: () => get('api/run'),
      rows: (file, since) => get('api/rows?file=' + q(file) + '&since=' + (since || 0)),
      search: (file, text, onProgress, since) =>
        get('api/search?file=' + q(file) + '&q=' + q(text) + '&since=' + (since || 0)),
      episode: (file, row) => get('api/episode?file=' + q(file) + '&row=' + row),
      stamp: () => get('api/stamp'),
    };
  }

  function staticApi() {
    const chunkSize = STATIC.chunk || 100;
    const chunks = new Map();   // "file/index" -> {promise, resolve, reject, started}

    function entry(file, idx) {
      const key = file + '/' + idx;
      let c = chunks.get(key);
      if (!c) {
        c = {started: false};
        c.promise = new Promise((res, rej) => { c.resolve = res; c.reject = rej; });
        chunks.set(key, c);
      }
      return c;
    }

    // Chunk scripts call this with their episodes, in row order.
    window.AGENTRL_CHUNK = function (file, idx, episodes) { entry(file, idx).resolve(episodes); };

    // fetch() of file:// is blocked in Chromium; <script> tags are not.
    function loadChunk(file, idx) {
      const c = entry(file, idx);
      if (!c.started) {
        c.started = true;
        const s = document.createElement('script');
        s.src = 'data/episodes/' + encodeURIComponent(file) + '/' + idx + '.js';
        s.onerror = () => {
          chunks.delete(file + '/' + idx);   // let a later call try again
          c.reject(new ApiError('cannot load ' + s.getAttribute('src') + ' of this static copy',
            'export the run again with `agentrl view RUN --export DIR`'));
        };
        document.head.appendChild(s);
      }
      return c.promise;
    }

    function rowsOf(file) {
      const r = STATIC.rows[file];
      if (!r) throw new ApiError('this static copy has no file ' + JSON.stringify(file), null);
      return r;
    }

    return {
      run: async () => STATIC.run,
      rows: async (file, since) => {
        const r = rowsOf(file);
        return Object.assign({}, r, {since: since || 0, rows: r.rows.slice(since || 0)});
      },
      episode: async (file, row) => {
        const idx = Math.floor(row / chunkSize);
        const eps = await loadChunk(file, idx);
        const ep = eps[row - idx * chunkSize];
        if (!ep) throw new ApiError(file + ' has no row ' + row + ' in this static copy', null);
        return ep;
      },
      // Loads every chunk of the file (4 at a time), reporting progress.
      search: async (file, text, onProgress) => {
        const total = rowsOf(file).total;
        const n = Math.ceil(total / chunkSize);
        const folded = foldAscii(text);
        const hits = [];
        let done = 0;
        for (let start = 0; start < n; start += 4) {
          const batch = [];
          for (let i = start; i < Math.min(n, start + 4); i++) batch.push(loadChunk(file, i));
          const loaded = await Promise.all(batch);
          loaded.forEach((eps, j) => {
            eps.forEach((ep, k) => {
              if (folded && trajectoryMatches(ep.trajectory, folded)) hits.push((start + j) * chunkSize + k);
            });
          });
          done += batch.length;
          if (onProgress) onProgress(done, n);
        }
        return {file: file, q: text, rows: hits};
      },
      stamp: async () => ({stamp: STATIC.run.stamp, files: {}}),
    };
  }

  const api = STATIC ? staticApi() : liveApi();

  // ---------------------------------------------------------------- 3. state, rows, filters

  const state = {
    run: null,
    rows: {},          // FILE -> array of row arrays, as ROWS sends them (index == row)
    lower: {},         // FILE -> {task: [], instance: [], replicas: [], node: [], agent: []} lower-cased
    loading: {},       // FILE -> promise of the first rows load
    col: null,         // column name -> index in a row array
    list: null,        // the episodes query: {file, task, …, sort, desc, page}
    filtered: [],      // keys "FILE:ROW" passing the query, in table order
    filteredIdx: [],   // the same as row indices
    search: null,      // {file, q, flags: Uint8Array | null, count}
    tokMode: 'mask',   // the token colouring, kept while stepping through episodes
    tokSpans: [],      // ledger k -> its response token spans (episode page)
    charts: [],        // live uPlot instances on the page (destroyed on navigation)
    page: null,        // 'overview' | 'episodes' | 'episode'
    nav: 0,            // bumped on every route: async renders check they are still current
  };

  // Query keys of the episodes page; `id` is the input's id.
  const FILTERS = [
    {id: 'f-task', key: 'task', kind: 'text', col: 'task'},
    {id: 'f-instance', key: 'instance', kind: 'text', col: 'instance'},
    {id: 'f-step', key: 'step', kind: 'int'},
    {id: 'f-reward-min', key: 'reward_min', kind: 'num'},
    {id: 'f-reward-max', key: 'reward_max', kind: 'num'},
    {id: 'f-stop', key: 'stop', kind: 'select'},
    {id: 'f-turns-min', key: 'turns_min', kind: 'num'},
    {id: 'f-tool-errors-min', key: 'tool_errors_min', kind: 'num'},
    {id: 'f-replica', key: 'replica', kind: 'text', col: 'replicas'},
    {id: 'f-node', key: 'node', kind: 'text', col: 'node'},
    {id: 'f-agent', key: 'agent', kind: 'text', col: 'agent'},
  ];
  const LIST_KEYS = ['file'].concat(FILTERS.map((f) => f.key), ['q', 'sort', 'desc', 'page']);

  function setColumns(columns) {
    const col = {};
    columns.forEach((c, i) => { col[c] = i; });
    state.col = col;
  }

  /* Append rows (from ROWS.rows) to a file, keeping the lower-cased copies used by the
   * substring filters in step (computed once per row, not once per filter run). */
  function appendRows(file, rows) {
    const C = state.col;
    const all = state.rows[file] || (state.rows[file] = []);
    const low = state.lower[file] || (state.lower[file] = {task: [], instance: [], replicas: [], node: [], agent: []});
    for (let i = 0; i < rows.length; i++) {
      const r = rows[i];
      all.push(r);
      low.task.push(String(r[C.task] || '').toLowerCase());
      low.instance.push(String(r[C.instance] || '').toLowerCase());
      low.replicas.push(String(r[C.replicas] || '').toLowerCase());
      low.node.push(String(r[C.node] || '').toLowerCase());
      // null agent = agentrl's own loop, so "loop" finds it
      low.agent.push(r[C.agent] === null || r[C.agent] === undefined ? 'loop' : String(r[C.agent]).toLowerCase());
    }
  }

  function resetRows(file) { delete state.rows[file]; delete state.lower[file]; }

  function ensureRows(file) {
    if (state.rows[file]) return Promise.resolve(state.rows[file]);
    if (!state.loading[file]) {
      state.loading[file] = api.rows(file, 0).then((r) => {
        setColumns(r.columns);
        resetRows(file);
        appendRows(file, r.rows);
        return state.rows[file];
      }).finally(() => { delete state.loading[file]; });
    }
    return state.loading[file];
  }

  function defaultList(file) {
    const l = {};
    LIST_KEYS.forEach((k) => { l[k] = ''; });
    l.file = file || (state.run.files[0] ? state.run.files[0].id : '');
    return l;
  }

  function listFromQuery(query) {
    const l = defaultList(query.get('file'));
    LIST_KEYS.forEach((k) => { if (k !== 'file' && query.has(k)) l[k] = query.get(k); });
    if (!state.run.files.some((f) => f.id === l.file) && state.run.files.length) l.file = state.run.files[0].id;
    return l;
  }

  function numOrNull(s) {
    if (s === '' || s === null || s === undefined) return null;
    const v = Number(s);
    return isFinite(v) ? v : null;
  }

  /* One predicate per active filter, built once per run of the filter (not per row). */
  function buildTests(list) {
    const C = state.col;
    const low = state.lower[list.file];
    const tests = [];
    FILTERS.forEach((f) => {
      const v = list[f.key];
      if (v === '' || v === undefined) return;
      if (f.kind === 'text') {
        const needle = v.toLowerCase();
        const arr = low[f.col];
        tests.push((r, i) => arr[i].includes(needle));
      }
    });
    const step = numOrNull(list.step);
    if (step !== null) tests.push((r) => r[C.step] === step);
    const rmin = numOrNull(list.reward_min), rmax = numOrNull(list.reward_max);
    // a null (ungraded) reward fails any reward bound
    if (rmin !== null) tests.push((r) => r[C.reward] !== null && r[C.reward] >= rmin);
    if (rmax !== null) tests.push((r) => r[C.reward] !== null && r[C.reward] <= rmax);
    const stop = list.stop;
    if (stop === 'infra') tests.push((r) => r[C.infra] === true);
    else if (stop === 'agent') tests.push((r) => r[C.infra] !== true);
    else if (stop) tests.push((r) => r[C.stop] === stop);
    const tmin = numOrNull(list.turns_min);
    if (tmin !== null) tests.push((r) => r[C.turns] >= tmin);
    const emin = numOrNull(list.tool_errors_min);
    if (emin !== null) tests.push((r) => r[C.tool_errors] >= emin);
    const s = state.search;
    if (list.q && s && s.file === list.file && s.q === list.q && s.flags) {
      const flags = s.flags;
      tests.push((r, i) => flags[i] === 1);
    }
    return tests;
  }

  /* Sort row indices by a column; nulls last in both directions; ties keep file order. */
  function sortIndices(idx, rows, colName, desc) {
    const ci = state.col[colName];
    if (ci === undefined) return idx;
    const sign = desc ? -1 : 1;
    idx.sort((a, b) => {
      const va = rows[a][ci], vb = rows[b][ci];
      const na = va === null || va === undefined, nb = vb === null || vb === undefined;
      if (na || nb) return na && nb ? a - b : (na ? 1 : -1);
      if (va < vb) return -sign;
      if (va > vb) return sign;
      return a - b;
    });
    return idx;
  }

  function computeFiltered() {
    const list = state.list;
    const rows = state.rows[list.file] || [];
    const tests = buildTests(list);
    const nt = tests.length;
    const out = [];
    outer: for (let i = 0; i < rows.length; i++) {
      const r = rows[i];
      for (let t = 0; t < nt; t++) if (!tests[t](r, i)) continue outer;
      out.push(i);
    }
    if (list.sort) sortIndices(out, rows, list.sort, list.desc === '1');
    const prefix = list.file + ':';
    const keys = new Array(out.length);
    for (let i = 0; i < out.length; i++) keys[i] = prefix + out[i];
    state.filteredIdx = out;
    state.filtered = keys;
  }

  // ---------------------------------------------------------------- 4. router

  function parseHash() {
    const h = location.hash.replace(/^#/, '') || '/';
    const qi = h.indexOf('?');
    const path = qi < 0 ? h : h.slice(0, qi);
    const query = new URLSearchParams(qi < 0 ? '' : h.slice(qi + 1));
    const parts = path.split('/').filter(Boolean).map((p) => {
      try { return decodeURIComponent(p); } catch (e) { return p; }   // a hand-typed bad %xx
    });
    return {parts: parts, query: query};
  }

  /* Change the hash without adding a history entry or re-rendering (filters typed in). */
  let ignoreHash = null;
  function replaceHash(hash) {
    if (location.hash === hash) return;
    try {
      history.replaceState(null, '', hash);
    } catch (e) {
      ignoreHash = hash;      // some file:// setups refuse replaceState: fall back
      location.replace(hash);
    }
    updateNav();
  }

  function route() {
    if (ignoreHash !== null && location.hash === ignoreHash) { ignoreHash = null; return; }
    ignoreHash = null;
    state.nav++;
    destroyCharts();
    const {parts, query} = parseHash();
    if (parts.length === 0) showOverview();
    else if (parts[0] === 'episodes') showEpisodes(query);
    else if (parts[0] === 'episode' && parts.length === 3) showEpisode(parts[1], parseInt(parts[2], 10));
    else {
      setPage(null);
      const main = clear($('#main'));
      append(main, el('p', null, 'no such page: ', el('code', {text: location.hash}), ' — ',
        el('a', {href: '#/'}, 'go to the overview')));
    }
  }

  function setPage(name) {
    state.page = name;
    updateNav();
  }

  function updateNav() {
    const o = $('#nav-overview'), e = $('#nav-episodes');
    o.classList.toggle('active', state.page === 'overview');
    e.classList.toggle('active', state.page === 'episodes' || state.page === 'episode');
    if (state.list) e.setAttribute('href', episodesHash(listParams(state.list)));
  }

  function renderHeader() {
    const run = state.run;
    $('#run-name').textContent = run.name;
    $('#run-name').title = run.dir;
    modeBadge($('#mode-badge'));
    document.title = run.name + ' · agentrl view';
  }

  /* Whether the page can change: a static copy never; a run that wrote its summary (and
   * nothing since) has ended, though the page still polls (a resume, replay branches). */
  const MODES = {
    static: ['static copy', 'an exported copy: no live updates'],
    finished: ['finished', 'the run has ended (it wrote its summary, and nothing since)'],
    live: ['live', 'updates while the run writes'],
  };
  function modeBadge(badge) {
    if (!badge) return;
    const mode = STATIC ? 'static' : (state.run.finished ? 'finished' : 'live');
    badge.textContent = MODES[mode][0];
    badge.className = 'badge ' + mode;
    badge.title = MODES[mode][1];
  }

  function loadingMain(text) {
    const main = clear($('#main'));
    append(main, el('p', {class: 'loading'}, text || 'loading…'));
    return main;
  }

  // ---------------------------------------------------------------- 5. overview

  function destroyCharts() {
    state.charts.forEach((c) => c.u.destroy());
    state.charts = [];
  }

  function trainRows() {
    return state.run.metrics.filter((m) => m.kind === 'train' && isNum(m.step)).sort((a, b) => a.step - b.step);
  }

  function evalRows() {
    return state.run.metrics.filter((m) => m.kind === 'eval' && isNum(m.step)).sort((a, b) => a.step - b.step);
  }

  async function showOverview() {
    const nav = state.nav;
    setPage('overview');
    const main = clear($('#main'));
    append(main, overviewHeader());
    const hasMetrics = state.run.metrics.some((m) => m.kind === 'train' || m.kind === 'eval');
    if (hasMetrics) {
      const charts = el('section', {id: 'charts', class: 'charts'});
      append(main, charts);
      buildCharts(charts);
      append(main, evalTable());
    }
    if (state.run.summary) {
      append(main, el('details', {class: 'summary-json'}, el('summary', {text: 'summary.json'}),
        el('pre', {class: 'json', text: JSON.stringify(state.run.summary, null, 2)})));
    }
    if (!hasMetrics) {
      // run / eval folders (or a train run before its first step): build from the rows
      const box = el('section', {id: 'rows-summary'});
      append(main, box);
      for (const f of state.run.files) {
        try {
          await ensureRows(f.id);
        } catch (e) { showError(e); continue; }
        if (nav !== state.nav) return;
        append(box, rowsSummary(f));
      }
      if (!state.run.files.length) append(box, el('p', {class: 'muted', text: 'no trajectory files in this folder yet'}));
    }
  }

  function overviewHeader() {
    const run = state.run;
    const files = el('ul', {class: 'files'});
    run.files.forEach((f) => {
      append(files, el('li', null,
        el('a', {href: episodesHash({file: f.id})}, f.label), ' ',
        el('span', {class: 'muted', text: '(' + f.path + ')'}), ': ',
        el('strong', {class: 'file-rows', 'data-file': f.id, text: String(f.rows)}), ' episodes'));
    });
    const mode = el('span', {id: 'live-indicator'});
    modeBadge(mode);
    return el('section', {id: 'run-header'},
      el('h1', null, run.name, ' ', el('span', {class: 'badge kind', text: run.kind}), ' ', mode),
      el('div', {class: 'muted run-dir', text: run.dir}),
      files,
      el('p', null, el('a', {href: episodesHash(state.list ? listParams(state.list) : {}), class: 'big-link'},
        'Browse the episodes →')));
  }

  /* ---- charts ---- */

  /* Values of `key` per step, aligned to xs. undefined = no row at that step (uPlot joins
   * the line across it); null = measured but NaN (uPlot leaves a gap). */
  function aligned(xs, rows, get) {
    const byStep = new Map();
    rows.forEach((r) => byStep.set(r.step, get(r)));
    return xs.map((x) => {
      if (!byStep.has(x)) return undefined;
      const v = byStep.get(x);
      return v === undefined ? undefined : (isNum(v) ? v : null);
    });
  }

  function hasKey(rows, key) { return rows.some((r) => r[key] !== undefined); }

  function chartBox(metric, title, note) {
    return el('div', {class: 'chart', 'data-metric': metric},
      el('h3', {text: title}), note ? el('div', {class: 'chart-note', text: note}) : null,
      el('div', {class: 'plot'}));
  }

  /* Line chart. lines: [{label, y, color, ci (half widths, optional), points, dash}].
   * A line with `ci` gets two hidden edge series and a shaded band between them; its
   * legend value reads "mean ± ci". */
  function lineChart(box, xs, lines, yRange) {
    const data = [xs];
    const series = [{label: 'step', value: (u, v) => (v === null || v === undefined
      ? (xs.length ? 'latest (' + fmt(xs[xs.length - 1]) + ')' : '—') : fmt(v))}];
    const bands = [];
    const hiddenLegend = [];
    lines.forEach((ln) => {
      const idx = data.length;
      data.push(ln.y);
      const ci = ln.ci;
      series.push({
        label: ln.label, stroke: ln.color, width: 2, dash: ln.dash,
        points: ln.points ? {show: true, size: 7, fill: ln.color} : {size: 5, fill: ln.color},
        value: (u, v, si, di) => {
          // cursor off the chart: the legend shows the latest value instead of nothing
          if (di === null || di === undefined) di = lastIndex(u.data[si]);
          v = di === null ? null : u.data[si][di];
          if (v === null || v === undefined) return '—';
          return ci && isNum(ci[di]) ? fmt(v) + ' ± ' + fmt(ci[di]) : fmt(v);
        },
      });
      if (ci) {
        const lo = ln.y.map((v, i) => (isNum(v) && isNum(ci[i]) ? v - ci[i] : (v === undefined ? undefined : null)));
        const hi = ln.y.map((v, i) => (isNum(v) && isNum(ci[i]) ? v + ci[i] : (v === undefined ? undefined : null)));
        data.push(lo, hi);
        series.push({label: ln.label + ' low', stroke: 'transparent', width: 0, points: {show: false}},
          {label: ln.label + ' high', stroke: 'transparent', width: 0, points: {show: false}});
        hiddenLegend.push(idx + 1, idx + 2);
        bands.push({series: [idx + 2, idx + 1], fill: hexAlpha(ln.color, 0.15)});
      }
    });
    return makePlot(box, data, series, bands, hiddenLegend, yRange);
  }

  function lastIndex(arr) {
    for (let i = arr.length - 1; i >= 0; i--) if (isNum(arr[i])) return i;
    return null;
  }

  function hexAlpha(hex, a) {
    const n = parseInt(hex.slice(1), 16);
    return 'rgba(' + ((n >> 16) & 255) + ',' + ((n >> 8) & 255) + ',' + (n & 255) + ',' + a + ')';
  }

  function plotWidth(box) {
    return Math.max(260, Math.floor(box.clientWidth || 480) - 4);
  }

  function makePlot(box, data, series, bands, hiddenLegend, yRange) {
    const target = $('.plot', box);
    const opts = {
      width: plotWidth(box),
      height: 220,
      scales: {x: {time: false}, y: yRange ? {range: yRange} : {}},
      series: series,
      bands: bands,
      axes: [
        // steps are integers: no 0.5 ticks
        {label: 'step', size: 36, labelSize: 16, incrs: STEP_INCRS},
        {size: 60, values: (u, splits) => splits.map((v) => fmt(v))},
      ],
      legend: {live: true},
      cursor: {drag: {x: true, y: false}},
    };
    const u = new uPlot(opts, data, target);
    // uPlot has no per-series "hide from legend": hide the band edges' rows ourselves
    const rows = u.root.querySelectorAll('.u-legend .u-series');
    hiddenLegend.forEach((i) => { if (rows[i]) rows[i].classList.add('legend-hidden'); });
    state.charts.push({u: u, box: box});
    return u;
  }

  function buildCharts(container) {
    const train = trainRows();
    const evals = evalRows();
    const steps = Array.from(new Set(train.map((r) => r.step).concat(evals.map((r) => r.step)))).sort((a, b) => a - b);
    const tsteps = train.map((r) => r.step);
    const specs = chartSpecs(train, evals, steps, tsteps);
    specs.forEach((spec) => {
      if (!spec.show) return;
      const box = chartBox(spec.metric, spec.title, spec.note);
      append(container, box);
      spec.build(box);
    });
    if (!container.firstChild) append(container, el('p', {class: 'muted', text: 'no metrics to chart yet'}));
  }

  /* One entry per chart: shown only when the run has that metric. */
  function chartSpecs(train, evals, steps, tsteps) {
    const T = (key) => aligned(tsteps, train, (r) => r[key]);
    const simple = (metric, title, keys, yRange) => ({
      metric: metric, title: title,
      show: keys.some((k) => hasKey(train, k[0])),
      build: (box) => lineChart(box, tsteps, keys.filter((k) => hasKey(train, k[0]))
        .map((k, i) => ({label: k[1], y: T(k[0]), color: PALETTE[i]})), yRange),
    });
    // uPlot spans a flat series 0..100: a reward or rate shows 0..1 at least, a count
    // 0..1 at least, a fraction 0..0.01 at least
    const fracRange = (u, min, max) => [0, Math.max(0.01, (max || 0) * 1.1)];
    const unitRange = (u, min, max) => [Math.min(0, min || 0), Math.max(1, max || 0)];
    const countRange = (u, min, max) => [0, Math.max(1, (max || 0) * 1.1)];
    return [
      {
        metric: 'reward', title: 'Reward (mean, shaded: 95% interval)',
        show: hasKey(train, 'reward_mean') || hasKey(evals, 'reward_mean'),
        build: (box) => lineChart(box, steps, [
          hasKey(train, 'reward_mean') && {label: 'train reward', color: PALETTE[0],
            y: aligned(steps, train, (r) => r.reward_mean), ci: aligned(steps, train, (r) => r.reward_ci95)},
          hasKey(evals, 'reward_mean') && {label: 'held-out eval reward', color: PALETTE[1], points: true,
            y: aligned(steps, evals, (r) => r.reward_mean), ci: aligned(steps, evals, (r) => r.reward_ci95)},
        ].filter(Boolean), unitRange),
      },
      {
        metric: 'pass_rate', title: 'Pass rate (train) and pass@1 (held-out)',
        show: hasKey(train, 'pass_rate') || hasKey(evals, 'pass_at_1'),
        build: (box) => lineChart(box, steps, [
          hasKey(train, 'pass_rate') && {label: 'train pass rate', color: PALETTE[0],
            y: aligned(steps, train, (r) => r.pass_rate)},
          hasKey(evals, 'pass_at_1') && {label: 'held-out pass@1', color: PALETTE[1], points: true,
            y: aligned(steps, evals, (r) => r.pass_at_1), ci: aligned(steps, evals, (r) => r.pass_at_1_ci95)},
        ].filter(Boolean), unitRange),
      },
      {
        metric: 'stop_reasons', title: 'Stop reasons (train episodes per step)',
        show: hasKey(train, 'stop_reasons'),
        build: (box) => stopReasonsChart(box, train, tsteps, countRange),
      },
      {
        metric: 'failures', title: 'Failures per step (train)',
        note: 'agent: graded episodes with reward < 1; infrastructure failures are never the agent\'s',
        show: hasKey(train, 'episodes') && hasKey(train, 'pass_rate'),
        build: (box) => lineChart(box, tsteps, [
          {label: 'agent failures', color: '#cf222e', y: aligned(tsteps, train, agentFailures)},
          {label: 'infrastructure (not the agent\'s)', color: '#8c959f', dash: [6, 4],
            y: aligned(tsteps, train, (r) => (isNum(r.infra_failures) ? r.infra_failures : (isNum(r.episodes) ? 0 : null)))},
        ], countRange),
      },
      simple('tokens', 'Tokens per step', [['sampled_tokens', 'sampled'], ['total_tokens', 'total'],
        ['branch_sampled_tokens', 'sampled in branches']]),
      simple('loss', 'Loss', [['loss', 'loss'], ['pg_loss', 'policy-gradient loss']]),
      simple('clip', 'Clipped token fraction', [['clip_high_frac', 'clip high'], ['clip_low_frac', 'clip low'],
        ['dual_clip_frac', 'dual clip']], fracRange),
      simple('mismatch', 'Logprob mismatch (learner vs sampler)', [['logprob_mismatch', 'mismatch']]),
      simple('lag', 'Policy lag (async)', [['lag_max', 'max lag (versions)'], ['stale_groups', 'stale groups']]),
    ];
  }

  /* Graded episodes that did not pass: episodes − infra − pass_rate·graded, rounded. */
  function agentFailures(r) {
    if (!isNum(r.episodes) || !isNum(r.pass_rate)) return null;
    const graded = r.episodes - (isNum(r.infra_failures) ? r.infra_failures : 0);
    return Math.round(graded - r.pass_rate * graded);
  }

  function stopReasonsChart(box, train, tsteps, yRange) {
    const totals = {};
    train.forEach((r) => {
      const s = r.stop_reasons || {};
      for (const k in s) totals[k] = (totals[k] || 0) + (isNum(s[k]) ? s[k] : 0);
    });
    const reasons = Object.keys(totals).sort((a, b) => totals[b] - totals[a]);
    const lines = reasons.map((reason, i) => ({
      label: reason + (INFRA_STOPS.has(reason) ? ' (infrastructure)' : ''),
      color: STOP_COLORS[reason] || PALETTE[i % PALETTE.length],
      dash: INFRA_STOPS.has(reason) ? [6, 4] : undefined,
      y: aligned(tsteps, train, (r) => (r.stop_reasons ? (r.stop_reasons[reason] || 0) : undefined)),
    }));
    return lineChart(box, tsteps, lines, yRange);
  }

  function evalTable() {
    const evals = evalRows();
    const box = el('section', {id: 'evals'}, el('h2', {text: 'Held-out evaluations'}));
    if (!evals.length) {
      append(box, el('p', {class: 'muted', text: 'no held-out evaluation yet'}));
      return box;
    }
    const fileIds = new Set(state.run.files.map((f) => f.id));
    const table = el('table', {class: 'data', id: 'eval-table'},
      el('thead', null, el('tr', null, ['step', 'reward', 'pass@1', 'pass@k', 'episodes', 'infra failures', '']
        .map((h) => el('th', {text: h})))));
    const body = el('tbody');
    evals.forEach((r) => {
      const pk = r.pass_at_k ? Object.keys(r.pass_at_k).sort((a, b) => a - b)
        .map((k) => 'k=' + k + ': ' + fmt(r.pass_at_k[k])).join(' · ') : '—';
      const fid = 'eval-step-' + String(r.step).padStart(6, '0');
      append(body, el('tr', null,
        el('td', {class: 'num', text: String(r.step)}),
        el('td', {class: 'num', text: fmtCi(r.reward_mean, r.reward_ci95)}),
        el('td', {class: 'num', text: fmtCi(r.pass_at_1, r.pass_at_1_ci95)}),
        el('td', {text: pk}),
        el('td', {class: 'num', text: fmt(r.episodes)}),
        el('td', {class: 'num' + (r.infra_failures ? ' infra-count' : ''), text: fmt(r.infra_failures)}),
        el('td', null, fileIds.has(fid) ? el('a', {href: episodesHash({file: fid})}, 'episodes') : null)));
    });
    append(table, body);
    append(box, table);
    return box;
  }

  /* ---- overview from rows (folders without metrics) ---- */

  function rowsSummary(file) {
    const C = state.col;
    const rows = state.rows[file.id] || [];
    let pass = 0, agentFail = 0, ungraded = 0, infra = 0, turns = 0, tokens = 0, secs = 0;
    const stops = {};
    const rewards = [];
    rows.forEach((r) => {
      const stop = r[C.stop] === null ? '(unreadable)' : r[C.stop];
      stops[stop] = (stops[stop] || 0) + 1;
      turns += r[C.turns] || 0;
      tokens += r[C.tokens] || 0;
      secs += r[C.seconds] || 0;
      if (r[C.infra]) { infra++; return; }
      const rw = r[C.reward];
      if (!isNum(rw)) { ungraded++; return; }
      rewards.push(rw);
      if (rw >= 1) pass++; else agentFail++;
    });
    const n = rows.length;
    const box = el('section', {class: 'rows-summary', 'data-file': file.id},
      el('h2', null, file.label, ' ', el('span', {class: 'muted', text: '(' + file.path + ')'})));
    const link = (params, text) => el('a', {href: episodesHash(Object.assign({file: file.id}, params))}, text);
    const counts = el('table', {class: 'data counts'}, el('tbody', null,
      el('tr', null, el('th', {text: 'episodes'}), el('td', {class: 'num'}, link({}, String(n)))),
      el('tr', null, el('th', {text: 'passed (reward ≥ 1)'}), el('td', {class: 'num r1'}, link({reward_min: 1}, String(pass)))),
      el('tr', null, el('th', {text: 'agent failures (graded, reward < 1)'}),
        el('td', {class: 'num r0'}, String(agentFail))),
      ungraded ? el('tr', null, el('th', {text: 'ungraded (not infrastructure)'}), el('td', {class: 'num', text: String(ungraded)})) : null,
      el('tr', {class: 'infra'}, el('th', {text: 'infrastructure failures (not the agent\'s)'}),
        el('td', {class: 'num'}, link({stop: 'infra'}, String(infra)))),
      el('tr', null, el('th', {text: 'turns (mean)'}), el('td', {class: 'num', text: n ? fmt(turns / n, 2) : '—'})),
      el('tr', null, el('th', {text: 'sampled tokens (mean)'}), el('td', {class: 'num', text: n ? fmt(tokens / n, 1) : '—'})),
      el('tr', null, el('th', {text: 'seconds (mean)'}), el('td', {class: 'num', text: n ? fmt(secs / n, 1) : '—'}))));
    const stopTable = el('table', {class: 'data stops'},
      el('thead', null, el('tr', null, el('th', {text: 'stop reason'}), el('th', {text: 'episodes'}))));
    const sb = el('tbody');
    Object.keys(stops).sort((a, b) => stops[b] - stops[a]).forEach((s) => {
      append(sb, el('tr', {class: INFRA_STOPS.has(s) ? 'infra' : null},
        el('td', null, link({stop: s}, s), INFRA_STOPS.has(s) ? el('span', {class: 'badge infra', text: 'infra'}) : null),
        el('td', {class: 'num', text: String(stops[s])})));
    });
    append(stopTable, sb);
    const hist = chartBox('reward_hist', 'Reward histogram (graded episodes)');
    append(box, el('div', {class: 'summary-grid'}, counts, stopTable, hist));
    // the box must be in the document before uPlot measures it: build after insertion
    setTimeout(() => { if (hist.isConnected) rewardHistogram(hist, rewards); }, 0);
    return box;
  }

  /* Bars on an evenly spaced category axis: one bar per distinct reward (≤ 12 of them),
   * else 10 equal bins; x is the bar's index, its tick label the reward or the bin. */
  function rewardHistogram(box, rewards) {
    if (!rewards.length) { append($('.plot', box), el('p', {class: 'muted', text: 'no graded episodes'})); return; }
    const distinct = Array.from(new Set(rewards)).sort((a, b) => a - b);
    let labels, ys;
    if (distinct.length <= 12) {
      labels = distinct.map((d) => fmt(d));
      ys = distinct.map((d) => rewards.filter((r) => r === d).length);
    } else {
      const lo = distinct[0], hi = distinct[distinct.length - 1], nb = 10, w = (hi - lo) / nb;
      labels = []; ys = [];
      for (let b = 0; b < nb; b++) { labels.push(fmt(lo + w * b, 2) + '…' + fmt(lo + w * (b + 1), 2)); ys.push(0); }
      rewards.forEach((r) => { ys[Math.min(nb - 1, Math.floor((r - lo) / w))]++; });
    }
    const xs = labels.map((_, i) => i);
    const u = new uPlot({
      width: plotWidth(box), height: 220,
      scales: {x: {time: false, range: () => [-0.5, xs.length - 0.5]}, y: {range: (u, min, max) => [0, Math.max(1, max * 1.1)]}},
      series: [
        {label: 'reward', value: (u, v) => (v === null || v === undefined ? '—' : labels[v])},
        {label: 'episodes', stroke: PALETTE[0], fill: hexAlpha(PALETTE[0], 0.35), width: 1,
          paths: uPlot.paths.bars({size: [0.7, 90]}), points: {show: false}},
      ],
      axes: [
        {label: 'reward', size: 36, labelSize: 16, splits: () => xs, values: (u, splits) => splits.map((i) => labels[i] || '')},
        {size: 50, values: (u, splits) => splits.map((v) => fmt(v))},
      ],
      cursor: {drag: {x: false, y: false}},
    }, [xs, ys], $('.plot', box));
    state.charts.push({u: u, box: box});
  }

  // ---------------------------------------------------------------- 6. episodes table

  const TABLE_COLS = [
    ['id', 'id'], ['task', 'task'], ['instance', 'instance'], ['step', 'step'], ['reward', 'reward'],
    ['stop', 'stop'], ['turns', 'turns'], ['tool_errors', 'tool errors'], ['tokens', 'tokens'],
    ['replicas', 'replica(s)'], ['node', 'node'], ['agent', 'agent'], ['branch_of', 'branch'],
    ['seconds', 'seconds'],
  ];
  const NUM_COLS = new Set(['step', 'reward', 'turns', 'tool_errors', 'tokens', 'seconds']);

  function listParams(list) {
    const p = {};
    LIST_KEYS.forEach((k) => { if (list[k] !== '' && list[k] !== undefined) p[k] = list[k]; });
    return p;
  }

  async function showEpisodes(query) {
    const nav = state.nav;
    setPage('episodes');
    state.list = listFromQuery(query);
    const main = loadingMain('loading episodes…');
    if (!state.list.file) { clear(main); append(main, el('p', {text: 'this run has no trajectory files yet'})); return; }
    try {
      await ensureRows(state.list.file);
    } catch (e) { showError(e); return; }
    if (nav !== state.nav) return;
    clear(main);
    append(main, filterBar(), countsLine(), episodesTable(), pager());
    syncInputs();
    updateNav();
    if (state.list.q) startSearch(state.list.q);
    refreshList();
  }

  function filterBar() {
    const fileSel = el('select', {id: 'f-file', title: 'trajectory file'});
    const field = (label, input) => el('label', {class: 'field'}, el('span', {text: label}), input);
    const text = (id, ph, title) => el('input', {id: id, type: 'text', placeholder: ph, title: title, autocomplete: 'off'});
    const num = (id, ph, step) => el('input', {id: id, type: 'number', placeholder: ph, step: step || 'any'});
    const bar = el('form', {id: 'filters', class: 'filters', onsubmit: (e) => e.preventDefault()},
      field('file', fileSel),
      field('task', text('f-task', 'substring')),
      field('instance', text('f-instance', 'substring')),
      field('step', num('f-step', '=', '1')),
      field('reward ≥', num('f-reward-min', 'min')),
      field('reward ≤', num('f-reward-max', 'max')),
      field('stop', el('select', {id: 'f-stop'})),
      field('turns ≥', num('f-turns-min', 'min', '1')),
      field('tool errors ≥', num('f-tool-errors-min', 'min', '1')),
      field('replica', text('f-replica', 'substring')),
      field('node', text('f-node', 'substring')),
      field('agent', text('f-agent', 'substring', '"loop" = agentrl\'s own loop')),
      field('search text', text('f-search', 'Enter to search actions + observations')),
      el('span', {id: 'search-status', class: 'muted'}),
      el('button', {type: 'button', id: 'f-clear', onclick: clearFilters}, 'clear filters'));
    fileSel.addEventListener('change', onFileChange);
    const typed = debounce(onFilterInput, 150);
    FILTERS.forEach((f) => {
      const input = $('#' + f.id, bar);
      input.addEventListener(f.kind === 'select' ? 'change' : 'input', f.kind === 'select' ? onFilterInput : typed);
    });
    const search = $('#f-search', bar);
    search.addEventListener('keydown', (e) => { if (e.key === 'Enter') { e.preventDefault(); onSearchEnter(); } });
    search.addEventListener('input', () => { if (search.value.trim() === '' && state.list.q) onSearchEnter(); });
    return bar;
  }

  function fillFileOptions() {
    const sel = $('#f-file');
    if (!sel) return;
    const files = state.run.files;
    const label = (f) => f.label + ' (' + f.rows + ')';
    const same = sel.options.length === files.length && files.every((f, i) => sel.options[i].value === f.id);
    if (same) {
      // only the counts moved (live): relabel in place, so an open menu stays open
      files.forEach((f, i) => { if (sel.options[i].textContent !== label(f)) sel.options[i].textContent = label(f); });
      return;
    }
    clear(sel);
    files.forEach((f) => append(sel, el('option', {value: f.id}, label(f))));
    sel.value = state.list.file;
  }

  function fillStopOptions() {
    const sel = $('#f-stop');
    if (!sel) return;
    const C = state.col;
    const present = new Set();
    (state.rows[state.list.file] || []).forEach((r) => { if (r[C.stop] !== null) present.add(r[C.stop]); });
    if (state.list.stop && !['infra', 'agent'].includes(state.list.stop)) present.add(state.list.stop);
    const want = [''].concat(Array.from(present).sort(), ['infra', 'agent']).join('\n');
    if (sel.getAttribute('data-options') === want) return;   // unchanged: keep the open menu alone
    clear(sel);
    append(sel, el('option', {value: ''}, 'any'));
    Array.from(present).sort().forEach((s) => append(sel, el('option', {value: s}, s + (INFRA_STOPS.has(s) ? ' (infra)' : ''))));
    append(sel, el('option', {value: 'infra'}, 'infrastructure failure (any)'));
    append(sel, el('option', {value: 'agent'}, 'not infrastructure'));
    sel.setAttribute('data-options', want);
    sel.value = state.list.stop || '';
  }

  function syncInputs() {
    fillFileOptions();
    fillStopOptions();
    FILTERS.forEach((f) => { $('#' + f.id).value = state.list[f.key] || ''; });
    $('#f-search').value = state.list.q || '';
  }

  function readInputs() {
    FILTERS.forEach((f) => {
      const input = $('#' + f.id);
      const v = input.value.trim();
      // type=number inputs report '' for unparsable text: mark them so it is not silent
      input.classList.toggle('invalid', input.validity && input.validity.badInput);
      state.list[f.key] = v;
    });
  }

  function writeListHash() {
    replaceHash(episodesHash(listParams(state.list)));
  }

  function onFilterInput() {
    if (state.page !== 'episodes') return;
    readInputs();
    state.list.page = '';
    writeListHash();
    refreshList();
  }

  async function onFileChange() {
    state.list.file = $('#f-file').value;
    state.list.page = '';
    state.search = null;
    writeListHash();
    const nav = state.nav;
    try { await ensureRows(state.list.file); } catch (e) { showError(e); return; }
    if (nav !== state.nav) return;
    fillStopOptions();
    if (state.list.q) startSearch(state.list.q);
    refreshList();
  }

  function clearFilters() {
    const file = state.list.file;
    state.list = defaultList(file);
    state.search = null;
    syncInputs();
    $('#search-status').textContent = '';
    writeListHash();
    refreshList();
  }

  function onSearchEnter() {
    const q = $('#f-search').value.trim();
    state.list.q = q;
    state.list.page = '';
    writeListHash();
    if (!q) { state.search = null; $('#search-status').textContent = ''; refreshList(); return; }
    startSearch(q);
  }

  /* Runs api.search; the table keeps its other filters meanwhile and applies the
   * matches when they arrive (if the query is still the current one). `again`: the same
   * search re-run because live rows arrived: keep the old matches applied meanwhile. */
  async function startSearch(q, again) {
    const file = state.list.file;
    const prev = state.search;
    const known = (state.rows[file] || []).length;
    // Live rows arrived: only they are searched (a file cut back is searched whole).
    const keep = again && prev && prev.file === file && prev.q === q && prev.flags &&
      prev.known <= known;
    const s = {file: file, q: q, flags: keep ? prev.flags : null, count: keep ? prev.count : 0,
      known: known};
    state.search = s;
    const status = $('#search-status');
    if (!keep) {
      status.textContent = 'searching…';
      status.classList.add('busy');
    }
    try {
      const res = await api.search(file, q, (done, n) => {
        if (state.search === s && !keep) status.textContent = 'searching… ' + done + '/' + n + ' chunks';
      }, keep ? prev.known : 0);
      if (state.search !== s) return;
      const flags = new Uint8Array(Math.max(known, 1) + 1024);
      if (keep) flags.set(prev.flags.subarray(0, Math.min(prev.flags.length, flags.length)));
      res.rows.forEach((r) => { if (r < flags.length) flags[r] = 1; });
      s.flags = flags;
      s.count = (keep ? prev.count : 0) + res.rows.length;
      status.textContent = res.rows.length + (res.rows.length === 1 ? ' episode contains "' : ' episodes contain "') + q + '"';
      status.classList.remove('busy');
      if (state.page === 'episodes') refreshList();
    } catch (e) {
      if (state.search !== s) return;
      status.textContent = 'search failed';
      status.classList.remove('busy');
      showError(e);
    }
  }

  function countsLine() {
    return el('div', {class: 'counts-line'},
      el('span', {id: 'episode-count', text: '0'}), ' of ', el('span', {id: 'episode-total', text: '0'}),
      ' episodes ', el('span', {class: 'muted', id: 'file-name'}));
  }

  function episodesTable() {
    const head = el('tr', null, TABLE_COLS.map((c) =>
      el('th', {'data-col': c[0], class: NUM_COLS.has(c[0]) ? 'num sortable' : 'sortable', title: 'sort by ' + c[1],
        tabindex: '0', 'aria-sort': 'none'}, c[1])));
    const table = el('table', {id: 'episodes', class: 'data episodes'}, el('thead', null, head), el('tbody'));
    // a header sorts on a click, or on Enter or Space when it has the keyboard focus
    head.addEventListener('keydown', (e) => {
      if ((e.key === 'Enter' || e.key === ' ') && e.target.closest('th[data-col]')) {
        e.preventDefault();
        e.target.click();
      }
    });
    head.addEventListener('click', (e) => {
      const th = e.target.closest('th[data-col]');
      if (!th) return;
      const col = th.getAttribute('data-col');
      if (state.list.sort === col) state.list.desc = state.list.desc === '1' ? '' : '1';
      else { state.list.sort = col; state.list.desc = ''; }
      state.list.page = '';
      writeListHash();
      refreshList();
    });
    // one listener for all rows (no closure per row); links inside keep their default
    $('tbody', table).addEventListener('click', (e) => {
      if (e.target.closest('a')) return;
      const tr = e.target.closest('tr[data-key]');
      if (!tr) return;
      const key = tr.getAttribute('data-key');
      const i = key.lastIndexOf(':');
      location.hash = episodeHash(key.slice(0, i), key.slice(i + 1));
    });
    return el('div', {class: 'table-wrap'}, table);
  }

  function pager() {
    const go = (d) => () => {
      const p = currentPage() + d;
      state.list.page = p > 1 ? String(p) : '';
      writeListHash();
      renderPage();
      window.scrollTo(0, 0);
    };
    return el('div', {class: 'pager'},
      el('button', {id: 'page-prev', type: 'button', onclick: go(-1)}, '← prev'),
      el('span', {id: 'page-info'}),
      el('button', {id: 'page-next', type: 'button', onclick: go(1)}, 'next →'));
  }

  function pageCount() { return Math.max(1, Math.ceil(state.filtered.length / PAGE_SIZE)); }

  function currentPage() {
    const p = parseInt(state.list.page, 10);
    return Math.min(Math.max(isFinite(p) ? p : 1, 1), pageCount());
  }

  /* Recompute filter + sort and redraw the current page (the page number is clamped, so
   * live appends and search results keep the reader where they are when possible). */
  function refreshList() {
    computeFiltered();
    $('#episode-count').textContent = String(state.filtered.length);
    $('#episode-total').textContent = String((state.rows[state.list.file] || []).length);
    $('#file-name').textContent = 'in ' + fileLabel(state.list.file);
    document.querySelectorAll('#episodes th[data-col]').forEach((th) => {
      const col = th.getAttribute('data-col');
      th.classList.toggle('sorted', col === state.list.sort);
      th.classList.toggle('desc', col === state.list.sort && state.list.desc === '1');
      th.setAttribute('aria-sort', col !== state.list.sort ? 'none' : state.list.desc === '1' ? 'descending' : 'ascending');
    });
    renderPage();
    updateNav();
  }

  function renderPage() {
    const page = currentPage();
    const start = (page - 1) * PAGE_SIZE;
    const idx = state.filteredIdx.slice(start, start + PAGE_SIZE);
    const rows = state.rows[state.list.file];
    const body = clear($('#episodes tbody'));
    const frag = document.createDocumentFragment();
    idx.forEach((i) => frag.appendChild(rowElement(state.list.file, rows[i])));
    body.appendChild(frag);
    if (!idx.length) {
      append(body, el('tr', {class: 'empty'}, el('td', {colspan: TABLE_COLS.length, text: 'no episodes match these filters'})));
    }
    const n = state.filtered.length;
    $('#page-info').textContent = n ? 'page ' + page + ' of ' + pageCount() + ' · rows ' + (start + 1) + '–' + (start + idx.length) : 'no rows';
    $('#page-prev').disabled = page <= 1;
    $('#page-next').disabled = page >= pageCount();
  }

  function rowElement(file, r) {
    const C = state.col;
    const row = r[C.row];
    const infra = r[C.infra] === true;
    const tr = el('tr', {'data-key': file + ':' + row, class: infra ? 'infra' : null});
    const td = (text, cls) => el('td', {class: cls || null, text: text});
    const reward = r[C.reward];
    const branch = r[C.branch_of] === null || r[C.branch_of] === undefined ? '' :
      r[C.branch_of] + ' @' + r[C.branch_turn] + (r[C.purpose] ? ' (' + r[C.purpose] + ')' : '');
    append(tr, [
      el('td', {class: 'id'}, el('a', {href: episodeHash(file, row)}, String(r[C.id]))),
      td(r[C.task]), td(r[C.instance]),
      td(fmt(r[C.step]), 'num'),
      td(isNum(reward) ? fmt(reward) : '—', 'num reward ' + rewardClass(reward)),
      // an unreadable line comes as a row of nulls (its id says so)
      el('td', {class: 'stop'}, r[C.stop] === null ? '—' : String(r[C.stop]), infra ? el('span', {class: 'badge infra', text: 'infra'}) : null),
      td(fmt(r[C.turns]), 'num'),
      td(fmt(r[C.tool_errors]), 'num' + (r[C.tool_errors] > 0 ? ' warn' : '')),
      td(fmt(r[C.tokens]), 'num'),
      td(r[C.replicas] || '—', r[C.replicas] ? null : 'muted'),
      td(r[C.node] || 'local', r[C.node] ? null : 'muted'),
      td(r[C.agent] === null || r[C.agent] === undefined ? 'loop' : r[C.agent], r[C.agent] ? null : 'muted'),
      td(branch, 'branch'),
      td(isNum(r[C.seconds]) ? r[C.seconds].toFixed(1) : '—', 'num'),
    ]);
    return tr;
  }

  // ---------------------------------------------------------------- 7. one episode

  async function showEpisode(file, row) {
    const nav = state.nav;
    setPage('episode');
    loadingMain('loading episode ' + file + ':' + row + '…');
    let ep;
    try {
      const both = await Promise.all([api.episode(file, row), ensureRows(file).catch(() => null)]);
      ep = both[0];
    } catch (e) {
      if (nav !== state.nav) return;
      showError(e);
      const main = clear($('#main'));
      append(main, el('p', null, 'could not load ', el('code', {text: file + ':' + row}), '. ',
        el('a', {href: episodesHash(state.list ? listParams(state.list) : {file: file})}, 'back to the episodes')));
      return;
    }
    if (nav !== state.nav) return;
    renderEpisode(ep);
  }

  function renderEpisode(ep) {
    const main = clear($('#main'));
    const t = ep.trajectory;
    const cont = branchStart(ep);
    append(main, episodeNav(ep), episodeHeader(ep),
      el('div', {class: 'ep-layout'},
        el('div', {class: 'ep-main'},
          gradeSection(ep), replaySection(ep), turnsSection(ep, cont), segmentsSection(ep), tokensSection(ep)),
        branchesSection(ep)));
    window.scrollTo(0, 0);
    if (ep.parent) markDivergence(ep, state.nav);
    document.title = t.trajectory_id + ' · ' + state.run.name;
  }

  /* The turn a continuation starts at (turns before it are the parent's), or null. */
  function branchStart(ep) {
    const b = ep.trajectory.branch_of;
    return b && isNum(b.turn) ? b.turn : null;
  }

  /* Prev/next through the current table order; falls back to file order when the
   * episode is not in the current list (opened from a link, or from another file). */
  function neighbours(ep) {
    const key = ep.file + ':' + ep.row;
    const inList = state.list && state.list.file === ep.file && state.rows[ep.file];
    if (inList) computeFiltered();      // rows may have arrived since the table was drawn
    const keys = state.filtered;
    const pos = inList ? keys.indexOf(key) : -1;
    if (pos < 0) {
      const n = state.rows[ep.file] ? state.rows[ep.file].length : 0;
      return {prev: ep.row > 0 ? episodeHash(ep.file, ep.row - 1) : null,
        next: ep.row + 1 < n ? episodeHash(ep.file, ep.row + 1) : null,
        text: 'row ' + (ep.row + 1) + ' of ' + n + ' in ' + fileLabel(ep.file)};
    }
    const at = (k) => { const i = k.lastIndexOf(':'); return episodeHash(k.slice(0, i), k.slice(i + 1)); };
    return {prev: pos > 0 ? at(keys[pos - 1]) : null, next: pos + 1 < keys.length ? at(keys[pos + 1]) : null,
      text: (pos + 1) + ' of ' + keys.length + ' in the filtered list'};
  }

  function episodeNav(ep) {
    const nb = neighbours(ep);
    const btn = (id, label, hash) => el('button', {id: id, type: 'button', disabled: !hash,
      onclick: () => { if (hash) location.hash = hash; }}, label);
    return el('div', {class: 'ep-nav'},
      el('a', {href: episodesHash(state.list ? listParams(state.list) : {file: ep.file})}, '← episodes'),
      btn('ep-prev', '‹ prev', nb.prev), el('span', {id: 'ep-pos', class: 'muted', text: nb.text}), btn('ep-next', 'next ›', nb.next),
      el('span', {class: 'muted keys', text: 'keys: j / k'}));
  }

  function kv(label, value, cls) {
    if (value === null || value === undefined || value === '') return null;
    return el('div', {class: 'kv' + (cls ? ' ' + cls : '')}, el('span', {class: 'k', text: label}), el('span', {class: 'v'}, value));
  }

  function episodeHeader(ep) {
    const t = ep.trajectory;
    const infra = INFRA_STOPS.has(t.stop_reason);
    const env = t.env || {};
    const secs = t.seconds || {};
    const secText = Object.keys(secs).map((k) => k + ' ' + fmt(secs[k], 1) + ' s').join(' · ');
    const head = el('section', {id: 'ep-header', class: infra ? 'infra' : null},
      el('div', {class: 'ep-title'},
        el('h1', {id: 'ep-id', text: t.trajectory_id}),
        el('div', {id: 'ep-reward', class: 'reward-big ' + rewardClass(t.reward), title: 'reward'},
          isNum(t.reward) ? fmt(t.reward) : 'ungraded')),
      el('div', {class: 'kvs'},
        kv('file', fileLabel(ep.file) + ' · row ' + ep.row),
        kv('task', t.task), kv('instance', t.group_id),
        kv('step', fmt(t.scheduled_step) + (isNum(t.consumed_step) ? ' (consumed at ' + t.consumed_step + ')' : '')),
        kv('stop', el('span', null, t.stop_reason, infra ? el('span', {class: 'badge infra', text: 'infra'}) : null)),
        kv('turns', String((t.turns || []).length)),
        kv('seconds', secText),
        ep.prompt_text != null ? kv('from', 'an ATIF document ' + t.task + ' wrote')
          : kv('env', [env.image, env.provider, env.node ? 'node ' + env.node : 'this machine'].filter(Boolean).join(' · ')),
        env.init_snapshot ? kv('init snapshot', env.init_snapshot) : null,
        ep.prompt_text != null ? null
          : t.agent ? kv('agent', agentInfo(t.agent)) : kv('agent', 'agentrl loop', 'muted')));
    if (t.error || t.fix) {
      append(head, el('div', {class: 'infra-error'},
        t.error ? el('div', null, el('strong', {text: infra ? 'infrastructure error: ' : 'error: '}), t.error) : null,
        t.fix ? el('div', null, el('strong', {text: 'fix: '}), t.fix) : null));
    }
    if (t.branch_of) append(head, branchOfLine(ep));
    return head;
  }

  function agentInfo(a) {
    const parts = [a.name];
    ['calls', 'edits', 'drift', 'exit_code'].forEach((k) => {
      if (a[k] !== undefined && a[k] !== null) parts.push(k + ' ' + (typeof a[k] === 'object' ? JSON.stringify(a[k]) : a[k]));
    });
    return el('span', null, parts.join(' · '),
      a.command ? el('div', null, el('code', {text: Array.isArray(a.command) ? a.command.join(' ') : String(a.command)})) : null,
      a.log_tail ? el('details', null, el('summary', {text: 'log tail'}), el('pre', {class: 'wrap', text: String(a.log_tail)})) : null);
  }

  function branchOfLine(ep) {
    const b = ep.trajectory.branch_of;
    const p = ep.parent;
    return el('div', {class: 'branch-of'}, 'continuation of ',
      p ? el('a', {href: episodeHash(p.file, p.row), class: 'parent-link'}, b.trajectory_id)
        : el('span', null, b.trajectory_id, el('span', {class: 'muted', text: ' (not found in this run)'})),
      ' from turn ' + b.turn + (b.purpose ? ' (' + b.purpose + ')' : ''));
  }

  /* ---- grade, replay ---- */

  function gradeSection(ep) {
    const t = ep.trajectory;
    const g = ep.grade;
    const box = el('section', {id: 'grade'}, el('h2', {text: 'Grade and evidence'}));
    const comps = t.reward_components || {};
    if (Object.keys(comps).length) {
      append(box, el('table', {class: 'data small components'}, el('tbody', null, Object.keys(comps).map((k) =>
        el('tr', null, el('th', {text: k}), el('td', {class: 'num', text: fmt(comps[k])}))))));
    }
    if ((t.turn_rewards || []).length) {
      append(box, el('div', {class: 'turn-rewards'}, 'turn rewards: ', t.turn_rewards.map((v) => fmt(v)).join(' · ')));
    }
    if (!g) {
      append(box, el('p', {class: 'muted', text: 'no grade evidence recorded'}));
      return box;
    }
    append(box, el('div', {class: 'kvs'},
      kv('grader', g.grader), kv('command', g.command ? el('code', {text: g.command}) : null),
      kv('exit code', g.exit_code === undefined ? null : fmt(g.exit_code)),
      (g.tampered || []).length ? kv('tampered', g.tampered.join(', '), 'warn') : null,
      (g.notes || []).length ? kv('notes', g.notes.join(' · ')) : null,
      g.reference ? kv('reference', g.reference) : null));
    const s = g.sealed;
    if (s) {  /* what of the agent's changes the grader saw (docs/tasks.md#what-a-grader-sees) */
      const rows = [
        ['carried into grading (outputs)', s.kept, ''],
        ['left out: outside the outputs, graded as the image has it', s.restored, 'warn'],
        ['dropped from the outputs: the grader would run it', s.dropped, 'warn'],
        ['processes stopped', s.stopped, ''],
        ['grading notes', s.notes, ''],
      ].filter((r) => (r[1] || []).length);
      if (rows.length) {
        append(box, el('details', {class: 'sealed', open: (s.dropped || []).length > 0},
          el('summary', {text: 'what the grader saw of the agent\'s changes'}),
          el('div', {class: 'kvs'}, rows.map((r) => kv(r[0] + ' (' + r[1].length + ')', r[1].join(' · '), r[2])))));
      }
    }
    const tests = testStatuses(g);
    if (tests) append(box, testsTable(tests));
    if (g.output) append(box, el('details', null, el('summary', {text: 'test output'}), el('pre', {class: 'wrap', text: g.output})));
    const json = JSON.stringify(g, null, 2);
    append(box, el('details', {class: 'grade-json'},
      el('summary', {text: 'evidence JSON'}), el('pre', {class: 'json', text: json})));
    return box;
  }

  /* A {test name: status string} mapping in the evidence (Evidence.tests), or null. */
  function testStatuses(g) {
    const cand = g.tests;
    if (!cand || typeof cand !== 'object' || Array.isArray(cand)) return null;
    const keys = Object.keys(cand);
    if (!keys.length || !keys.every((k) => typeof cand[k] === 'string')) return null;
    return cand;
  }

  function testsTable(tests) {
    const body = el('tbody');
    Object.keys(tests).forEach((k) => {
      const s = tests[k];
      const cls = /^(pass|passed|ok|success)$/i.test(s) ? 'r1' : /fail|error/i.test(s) ? 'r0' : 'muted';
      append(body, el('tr', null, el('td', {class: 'test-name', text: k}), el('td', {class: cls, text: s})));
    });
    return el('details', {class: 'tests', open: Object.keys(tests).length <= 30},
      el('summary', {text: 'tests (' + Object.keys(tests).length + ')'}),
      el('table', {class: 'data small'}, el('thead', null, el('tr', null, el('th', {text: 'test'}), el('th', {text: 'status'}))), body));
  }

  function replaySection(ep) {
    const box = el('section', {id: 'replay'}, el('h2', {text: 'Replay'}));
    (ep.replay || []).forEach((cmd) => {
      const code = el('code', {text: cmd});
      const btn = el('button', {type: 'button', class: 'copy', title: 'copy to the clipboard'}, 'copy');
      btn.addEventListener('click', () => copyText(cmd, btn));
      append(box, el('div', {class: 'replay-cmd'}, code, btn));
    });
    if (!(ep.replay || []).length) append(box, el('p', {class: 'muted', text: 'no replay commands'}));
    return box;
  }

  function copyText(text, btn) {
    const done = (ok) => {
      btn.textContent = ok ? 'copied' : 'copy failed';
      setTimeout(() => { btn.textContent = 'copy'; }, 1500);
    };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(() => done(true), () => done(fallbackCopy(text)));
    } else done(fallbackCopy(text));
  }

  function fallbackCopy(text) {
    const ta = el('textarea', {class: 'offscreen'});
    ta.value = text;
    document.body.appendChild(ta);
    ta.select();
    let ok = false;
    try { ok = document.execCommand('copy'); } catch (e) { ok = false; }
    ta.remove();
    return ok;
  }

  /* ---- conversation ---- */

  function turnsSection(ep, cont) {
    const t = ep.trajectory;
    const turns = t.turns || [];
    const box = el('section', {id: 'turns'}, el('h2', {text: 'Conversation (' + turns.length + ' turns)'}));
    append(box, taskPrompt(ep));
    turns.forEach((turn, k) => append(box, turnCard(ep, turn, k, cont)));
    if (!turns.length) append(box, el('p', {class: 'muted', text: 'no turns'}));
    return box;
  }

  function taskPrompt(ep) {
    const ids = ep.trajectory.prompt_ids || [];
    const texts = ep.tokens && ep.tokens[0] ? ep.tokens[0].prompt : null;
    if (ep.prompt_text != null) {  // an imported ATIF document: its opening steps, as written
      return el('details', {id: 'task-prompt', class: 'task-prompt', open: true},
        el('summary', {text: 'task prompt (the document\'s opening steps)'}),
        el('pre', {class: 'wrap', text: ep.prompt_text}));
    }
    const text = texts ? texts.join('') : ids.join(' ');
    return el('details', {id: 'task-prompt', class: 'task-prompt'},
      el('summary', {text: 'task prompt (' + ids.length + ' tokens' + (texts ? '' : ', ids only') + ')'}),
      el('pre', {class: 'wrap', text: text}));
  }

  function turnCard(ep, turn, k, cont) {
    const t = ep.trajectory;
    const parents = cont !== null && k < cont;
    const rewards = t.turn_rewards || [];
    const cls = ['turn'];
    if (turn.kind === 'summary') cls.push('summary-turn');
    if (turn.tool_error) cls.push('has-tool-error');
    if (parents) cls.push('parents');
    const meta = [
      turn.kind === 'summary' ? el('span', {class: 'badge summary', text: 'summary'}) : null,
      turn.tool_error ? el('span', {class: 'badge tool-error', text: 'tool error'}) : null,
      parents ? el('span', {class: 'badge parent', text: 'the parent\'s'}) : null,
      cont !== null && k === cont ? el('span', {class: 'badge branch', text: 'branch starts here'}) : null,
      metaItem('finish', turn.finish_reason), metaItem('exit', turn.exit_code),
      metaItem('gen', isNum(turn.gen_seconds) ? turn.gen_seconds.toFixed(2) + ' s' : null),
      metaItem('tool', isNum(turn.tool_seconds) ? turn.tool_seconds.toFixed(2) + ' s' : null),
      metaItem('replica', turn.replica), metaItem('snapshot', turn.snapshot_id),
      rewards.length && k < rewards.length ? metaItem('turn reward', fmt(rewards[k])) : null,
      turn.span ? metaItem('tokens', (turn.segment ? 'ledger ' + turn.segment + ' ' : '') + '[' + turn.span[0] + ', ' + turn.span[1] + ')') : null,
    ];
    const head = el('div', {class: 'turn-head', title: 'click: show this turn\'s tokens'},
      el('strong', {text: 'turn ' + k}), meta);
    head.addEventListener('click', () => showTurnTokens(ep, k));
    const call = turn.tool_call
      ? el('div', {class: 'tool-call'}, el('span', {class: 'label', text: 'tool call '}), el('code', {class: 'tool-name', text: turn.tool_call.name}),
        el('pre', {class: 'wrap json', text: argsText(turn.tool_call.arguments)}))
      : el('div', {class: 'tool-call none', text: turn.kind === 'summary' ? 'summary turn (no tool call)' : 'no tool call parsed'});
    return el('div', {class: cls.join(' '), 'data-turn': k},
      head,
      el('div', {class: 'label', text: 'action'}), el('pre', {class: 'wrap action', text: turn.action || ''}),
      call,
      observationBlock(turn.observation || ''));
  }

  /* Short arguments on one line, long ones pretty-printed. */
  function argsText(args) {
    const one = JSON.stringify(args);
    return one && one.length <= 100 ? one : JSON.stringify(args, null, 2);
  }

  function metaItem(label, value) {
    if (value === null || value === undefined || value === '') return null;
    return el('span', {class: 'meta'}, el('span', {class: 'k', text: label + ' '}), String(value));
  }

  function observationBlock(text) {
    const box = el('div', {class: 'observation'}, el('div', {class: 'label', text: 'observation'}));
    if (!text) { append(box, el('div', {class: 'muted', text: '(empty)'})); return box; }
    const lines = text.split('\n');
    const long = text.length > OBS_COLLAPSE_CHARS || lines.length > OBS_COLLAPSE_LINES;
    if (!long) { append(box, el('pre', {class: 'wrap', text: text})); return box; }
    const short = lines.slice(0, OBS_COLLAPSE_LINES).join('\n').slice(0, OBS_COLLAPSE_CHARS);
    const pre = el('pre', {class: 'wrap collapsed', text: short + '\n…'});
    const btn = el('button', {type: 'button', class: 'show-all'}, 'show all (' + lines.length + ' lines, ' + text.length + ' chars)');
    btn.addEventListener('click', () => {
      const open = pre.classList.toggle('collapsed');
      pre.textContent = open ? short + '\n…' : text;
      btn.textContent = open ? 'show all (' + lines.length + ' lines, ' + text.length + ' chars)' : 'show less';
    });
    append(box, pre, btn);
    return box;
  }

  /* ---- segments ---- */

  /* Ledger k: 0 is the top-level fields, k ≥ 1 is trajectory.segments[k-1]. */
  function ledgers(t) {
    const out = [{reason: 'start', prompt_ids: t.prompt_ids || [], response_ids: t.response_ids || [],
      loss_mask: t.loss_mask || [], logprobs: t.logprobs || [], token_versions: t.token_versions || []}];
    (t.segments || []).forEach((s) => out.push({reason: s.reason, prompt_ids: s.prompt_ids || [],
      response_ids: s.response_ids || [], loss_mask: s.loss_mask || [], logprobs: s.logprobs || [],
      token_versions: s.token_versions || []}));
    return out;
  }

  function segmentsSection(ep) {
    const t = ep.trajectory;
    if (!(t.segments || []).length) return null;
    const led = ledgers(t);
    const body = el('tbody');
    led.forEach((l, k) => {
      const sampled = l.loss_mask.reduce((a, m) => a + (m ? 1 : 0), 0);
      const turns = (t.turns || []).map((tu, i) => ((tu.segment || 0) === k ? i : null)).filter((i) => i !== null);
      append(body, el('tr', {'data-seg': k},
        el('td', {class: 'num', text: String(k)}), el('td', {text: k === 0 ? 'start (top level)' : String(l.reason)}),
        el('td', {class: 'num', text: String(l.prompt_ids.length)}), el('td', {class: 'num', text: String(l.response_ids.length)}),
        el('td', {class: 'num', text: String(sampled)}), el('td', {text: turns.length ? turns.join(', ') : '—'})));
    });
    return el('section', {id: 'segments'}, el('h2', {text: 'Segments (ledgers)'}),
      el('p', {class: 'muted', text: 'The context was rebuilt ' + t.segments.length + ' time(s); each ledger has its own prompt and response tokens.'}),
      el('table', {class: 'data small'}, el('thead', null, el('tr', null,
        ['ledger', 'reason', 'prompt tokens', 'response tokens', 'sampled', 'turns'].map((h) => el('th', {text: h})))), body));
  }

  /* ---- tokens ---- */

  function tokensSection(ep) {
    const box = el('section', {id: 'tokens'});
    const mode = el('select', {id: 'tok-mode'},
      el('option', {value: 'mask'}, 'sampled vs context'),
      el('option', {value: 'logprob'}, 'sampler probability'),
      el('option', {value: 'version'}, 'policy version'));
    mode.value = state.tokMode;
    const legend = el('div', {id: 'tok-legend', class: 'legend'});
    const scroll = el('div', {class: 'tok-scroll mode-' + state.tokMode});
    append(box, el('div', {class: 'tok-head'}, el('h2', {text: 'Tokens'}), el('label', null, 'colour: ', mode), legend));
    if (ep.token_note) append(box, el('p', {class: 'note', text: 'token texts not shown: ' + ep.token_note}));
    const led = ledgers(ep.trajectory);
    const versions = versionIndex(led);
    state.tokSpans = [];
    led.forEach((l, k) => append(scroll, ledgerBlock(ep, l, k, versions)));
    append(box, scroll);
    mode.addEventListener('change', () => {
      state.tokMode = mode.value;
      scroll.className = 'tok-scroll mode-' + mode.value;
      renderLegend(legend, mode.value, versions);
    });
    renderLegend(legend, state.tokMode, versions);
    scroll.addEventListener('click', (e) => {
      const s = e.target.closest('span.tok');
      if (s) showTokenTurn(ep, +s.getAttribute('data-seg'), +s.getAttribute('data-i'));
    });
    return box;
  }

  /* Sampled versions in this episode -> colour class index (rank, squeezed into the
   * palette when there are more versions than colours). */
  function versionIndex(led) {
    const seen = new Set();
    led.forEach((l) => l.token_versions.forEach((v, i) => { if (l.loss_mask[i]) seen.add(v); }));
    const list = Array.from(seen).sort((a, b) => a - b);
    const map = new Map();
    list.forEach((v, i) => map.set(v, list.length <= VERSION_CLASSES ? i : Math.floor(i * VERSION_CLASSES / list.length)));
    return {list: list, map: map};
  }

  function ledgerBlock(ep, l, k, versions) {
    const texts = ep.tokens && ep.tokens[k] ? ep.tokens[k] : null;
    const sampled = l.loss_mask.reduce((a, m) => a + (m ? 1 : 0), 0);
    const prompt = el('details', {class: 'prompt-toks'},
      el('summary', {text: 'prompt tokens (' + l.prompt_ids.length + ', all context)'}));
    // prompt tokens can be long and are all mask 0: build them only when opened
    prompt.addEventListener('toggle', () => {
      if (prompt.open && !prompt.querySelector('.ptoks')) append(prompt, promptTokens(l, texts));
    });
    const resp = el('div', {class: 'resp-toks' + (texts ? '' : ' ids'), 'data-seg': k});
    const spans = [];
    resp.appendChild(responseTokens(l, k, texts, versions, spans));
    state.tokSpans[k] = spans;
    return el('div', {class: 'ledger', 'data-seg': k},
      el('h3', {text: 'ledger ' + k + ' · ' + (k === 0 ? 'start' : l.reason) + ' · ' + l.response_ids.length +
        ' response tokens (' + sampled + ' sampled)'}),
      prompt, resp);
  }

  /* Token text as shown: newlines get a visible ↵ before the real line break, tabs a →,
   * an empty text a ∅ (so every token has something to hover). A token is empty when it
   * holds the first bytes of a character that a later token completes (the server says so). */
  function tokenDisplay(text) {
    if (text === '') return '∅';
    return text.replace(/\r/g, '␍').replace(/\t/g, '→\t').replace(/\n/g, '↵\n');
  }

  function lpClass(lp) {
    if (!isNum(lp)) return 'lpn';
    const p = Math.exp(lp);
    return 'lp' + Math.min(LP_CLASSES - 1, Math.max(0, Math.floor((1 - p) * LP_CLASSES)));
  }

  /* All spans of one ledger in one DocumentFragment (episodes can have 30,000 tokens). */
  function responseTokens(l, k, texts, versions, spans) {
    const frag = document.createDocumentFragment();
    const ids = l.response_ids, mask = l.loss_mask, lps = l.logprobs, vers = l.token_versions;
    const tx = texts ? texts.response : null;
    for (let i = 0; i < ids.length; i++) {
      const s = document.createElement('span');
      const m = mask[i] ? 1 : 0;
      const text = tx ? String(tx[i]) : String(ids[i]);
      const v = vers[i];
      s.className = m ? 'tok sampled ' + lpClass(lps[i]) + ' vc' + (versions.map.has(v) ? versions.map.get(v) : 0) : 'tok ctx';
      s.setAttribute('data-seg', k);
      s.setAttribute('data-i', i);
      s.setAttribute('data-id', ids[i]);
      s.setAttribute('data-mask', m);
      s.setAttribute('data-lp', lps[i] === undefined ? '' : lps[i]);
      s.setAttribute('data-v', v === undefined ? '' : v);
      const quoted = !tx ? '(text not decoded)' : text === '' ? '"" (no text alone: part of a later character)' : JSON.stringify(text);
      s.title = 'id ' + ids[i] + ' · ' + quoted + (m ? ' · logprob ' + (isNum(lps[i]) ? lps[i].toFixed(3) : '?') + ' · v' + v : ' · not sampled');
      s.textContent = tx ? tokenDisplay(text) : text;
      frag.appendChild(s);
      spans.push(s);
    }
    return frag;
  }

  function promptTokens(l, texts) {
    const box = el('div', {class: 'ptoks' + (texts ? '' : ' ids')});
    const frag = document.createDocumentFragment();
    const tx = texts ? texts.prompt : null;
    for (let i = 0; i < l.prompt_ids.length; i++) {
      const s = document.createElement('span');
      s.className = 'ptok';
      s.title = 'id ' + l.prompt_ids[i] + (tx ? ' · ' + JSON.stringify(String(tx[i])) : '') + ' · prompt (not sampled)';
      s.textContent = tx ? tokenDisplay(String(tx[i])) : String(l.prompt_ids[i]);
      frag.appendChild(s);
    }
    box.appendChild(frag);
    return box;
  }

  function renderLegend(legend, mode, versions) {
    clear(legend);
    const sw = (cls, label) => el('span', {class: 'sw-item'}, el('span', {class: 'sw ' + cls}), label);
    if (mode === 'mask') {
      append(legend, sw('sw-sampled', 'sampled by the policy (mask 1)'), sw('sw-ctx', 'context: prompt, observation, template (mask 0)'));
    } else if (mode === 'logprob') {
      const steps = [];
      for (let b = 0; b < LP_CLASSES; b++) steps.push(el('span', {class: 'sw lp' + b, title: 'p ' + (1 - b / LP_CLASSES).toFixed(1) + '…' + (1 - (b + 1) / LP_CLASSES).toFixed(1)}));
      append(legend, el('span', {class: 'sw-item'}, 'p = exp(logprob): 1 ', el('span', {class: 'scale'}, steps), ' 0'),
        sw('sw-ctx', 'context (not sampled)'));
    } else {
      if (!versions.list.length) append(legend, el('span', {class: 'muted', text: 'no sampled tokens'}));
      versions.list.forEach((v) => append(legend, sw('vc' + versions.map.get(v), 'v' + v)));
      append(legend, sw('sw-ctx', 'context'));
    }
  }

  let highlighted = [];
  function clearHighlight() {
    highlighted.forEach((s) => s.classList.remove('hl'));
    highlighted = [];
    document.querySelectorAll('.turn.active').forEach((c) => c.classList.remove('active'));
  }

  /* Turn header clicked: highlight its token range (turn.span in ledger turn.segment). */
  function showTurnTokens(ep, k) {
    const turn = (ep.trajectory.turns || [])[k];
    if (!turn || !turn.span) return;
    clearHighlight();
    const spans = state.tokSpans[turn.segment || 0] || [];
    for (let i = turn.span[0]; i < Math.min(turn.span[1], spans.length); i++) {
      spans[i].classList.add('hl');
      highlighted.push(spans[i]);
    }
    const card = $('.turn[data-turn="' + k + '"]');
    if (card) card.classList.add('active');
    if (highlighted.length) highlighted[0].scrollIntoView({block: 'center', behavior: 'smooth'});
  }

  /* Token clicked: find the turn whose span holds it and bring its card into view. */
  function showTokenTurn(ep, seg, i) {
    const turns = ep.trajectory.turns || [];
    const k = turns.findIndex((t) => (t.segment || 0) === seg && t.span && t.span[0] <= i && i < t.span[1]);
    if (k < 0) return;
    showTurnTokens(ep, k);
    const card = $('.turn[data-turn="' + k + '"]');
    if (card) card.scrollIntoView({block: 'start', behavior: 'smooth'});
  }

  /* ---- branches ---- */

  function branchesSection(ep) {
    const t = ep.trajectory;
    const box = el('aside', {id: 'branches'}, el('h2', {text: 'Branches'}));
    if (t.branch_of) {
      const p = ep.parent;
      append(box, el('div', {class: 'parent'},
        el('div', {class: 'label', text: 'parent'}),
        p ? el('a', {href: episodeHash(p.file, p.row), class: 'parent-link', 'data-key': p.file + ':' + p.row}, p.id)
          : el('span', {text: t.branch_of.trajectory_id + ' (not in this run)'}),
        el('div', {class: 'muted', text: 'continues from turn ' + t.branch_of.turn + (t.branch_of.purpose ? ' · ' + t.branch_of.purpose : '')}),
        el('div', {id: 'parent-divergence', class: 'muted', text: p ? 'looking for the first divergence…' : ''})));
    }
    const list = el('div', {class: 'branch-list'});
    (ep.branches || []).forEach((b) => {
      const d = b.divergence;
      const where = d ? 'diverges at turn ' + (d.turn === null || d.turn === undefined ? '?' : d.turn) + ', token ' + d.token +
        (d.segment ? ' of ledger ' + d.segment : '') : 'identical so far';
      append(list, el('a', {class: 'branch', href: episodeHash(b.file, b.row), 'data-key': b.file + ':' + b.row},
        el('div', {class: 'branch-id', text: b.id}),
        el('div', {class: 'branch-meta'}, 'turn ' + b.turn + (b.purpose ? ' · ' + b.purpose : '') + ' · ',
          el('span', {class: 'reward ' + rewardClass(b.reward), text: isNum(b.reward) ? 'reward ' + fmt(b.reward) : 'ungraded'}),
          ' · ' + b.stop, INFRA_STOPS.has(b.stop) ? el('span', {class: 'badge infra', text: 'infra'}) : null),
        el('div', {class: 'branch-div muted', text: where})));
    });
    const n = (ep.branches || []).length;
    append(box, el('h3', {text: 'branches from this episode' + (n ? ' (' + n + ')' : '')}));
    if ((ep.branches || []).length) append(box, list);
    else append(box, el('p', {class: 'muted', text: 'none'}));
    return box;
  }

  /* Where a continuation first differs from its parent. The contract gives the
   * divergence only on the parent's side (EPISODE.branches[].divergence), so fetch the
   * parent and find this episode in its branch list. */
  async function markDivergence(ep, nav) {
    const p = ep.parent;
    const line = $('#parent-divergence');
    let d = p.divergence;
    if (d === undefined) {
      try {
        const parent = await api.episode(p.file, p.row);
        if (nav !== state.nav) return;
        const me = (parent.branches || []).find((b) => b.file === ep.file && b.row === ep.row) ||
          (parent.branches || []).find((b) => b.id === ep.trajectory.trajectory_id);
        d = me ? me.divergence : undefined;
      } catch (e) {
        if (nav !== state.nav) return;
        if (line) line.textContent = 'could not load the parent: ' + e.message;
        return;
      }
    }
    if (!line) return;
    if (d === undefined) { line.textContent = 'the parent does not list this branch'; return; }
    if (d === null) { line.textContent = 'identical to the parent so far'; return; }
    line.textContent = 'first diverges at turn ' + (d.turn === null || d.turn === undefined ? '?' : d.turn) + ', token ' + d.token + (d.segment ? ' of ledger ' + d.segment : '');
    const spans = state.tokSpans[d.segment || 0] || [];
    const tok = spans[d.token];
    if (!tok) return;
    tok.classList.add('diverge');
    tok.parentNode.insertBefore(el('span', {class: 'diverge-marker', title: 'first token that differs from the parent', text: '⟶ diverges from the parent'}), tok);
    // scroll inside the token box only: the page stays at the top
    const box = tok.closest('.tok-scroll');
    if (box) box.scrollTop += tok.getBoundingClientRect().top - box.getBoundingClientRect().top - box.clientHeight / 3;
  }

  // ---------------------------------------------------------------- 8. live polling, start

  let polling = false;
  async function poll() {
    if (polling || !state.run) return;
    polling = true;
    try {
      const s = await api.stamp();
      clearError('poll');
      if (s.stamp === state.run.stamp) return;
      const old = state.run;
      const run = await api.run();
      state.run = run;
      const changed = {
        metrics: run.metrics.length !== old.metrics.length,
        files: run.files.map((f) => f.id).join('\n') !== old.files.map((f) => f.id).join('\n'),
        rows: [],               // loaded files that got new rows
      };
      for (const file of Object.keys(state.rows)) {
        const known = state.rows[file].length;
        const r = await api.rows(file, known);
        if (r.total < known) {          // truncated (a resumed run): start over
          const all = await api.rows(file, 0);
          resetRows(file);
          appendRows(file, all.rows);
          changed.rows.push(file);
        } else if (r.rows.length) {
          appendRows(file, r.rows);
          changed.rows.push(file);
        }
      }
      onLiveUpdate(changed);
    } catch (e) {
      showError(e, 'poll');
    } finally {
      polling = false;
    }
  }

  function onLiveUpdate(changed) {
    modeBadge($('#mode-badge'));
    const live = $('#live-indicator');
    modeBadge(live);
    if (live && !state.run.finished) live.title = 'last update ' + new Date().toLocaleTimeString();
    if (state.page === 'overview') {
      // Charts are rebuilt when there is something new to chart (a step's metrics, a
      // new file; for folders without metrics, new rows); a growing count alone is
      // updated in place so the charts do not flicker every 2 s during a run.
      const fromRows = !state.run.metrics.some((m) => m.kind === 'train' || m.kind === 'eval');
      if (changed.metrics || changed.files || (fromRows && changed.rows.length)) {
        const y = window.scrollY;
        state.nav++;            // a still-running earlier render must not append to this one
        destroyCharts();
        showOverview().then(() => window.scrollTo(0, y));
      } else {
        state.run.files.forEach((f) => {
          const n = $('.file-rows[data-file="' + CSS.escape(f.id) + '"]');
          if (n) n.textContent = String(f.rows);
        });
      }
    } else if (state.page === 'episodes') {
      fillFileOptions();
      if (changed.rows.includes(state.list.file)) {
        fillStopOptions();
        // the search matched the rows known then: search again so new rows can match
        if (state.list.q && state.search && state.search.file === state.list.file) startSearch(state.list.q, true);
        refreshList();
      }
    }
  }

  function onKey(e) {
    if (state.page !== 'episode' || e.ctrlKey || e.metaKey || e.altKey) return;
    if (e.target.closest && e.target.closest('input, select, textarea')) return;
    if (e.key === 'j') $('#ep-next') && $('#ep-next').click();
    else if (e.key === 'k') $('#ep-prev') && $('#ep-prev').click();
  }

  function onResize() {
    state.charts.forEach((c) => {
      if (c.box.isConnected) c.u.setSize({width: plotWidth(c.box), height: 220});
    });
  }

  async function start() {
    try {
      state.run = await api.run();
      INFRA_STOPS = new Set(state.run.infra_stops);
    } catch (e) {
      showError(e);
      clear($('#main'));
      return;
    }
    if (STATIC) {
      // every file's rows are already here
      Object.keys(STATIC.rows).forEach((f) => {
        const r = STATIC.rows[f];
        setColumns(r.columns);
        resetRows(f);
        appendRows(f, r.rows);
      });
    }
    renderHeader();
    window.addEventListener('hashchange', route);
    window.addEventListener('keydown', onKey);
    window.addEventListener('resize', debounce(onResize, 150));
    route();
    if (!STATIC) setInterval(poll, POLL_MS);
  }

  window.agentrlApp = {state: state, api: api};
  start();
})();
