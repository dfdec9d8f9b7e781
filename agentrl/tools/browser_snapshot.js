// The page as text: one line per heading, text run, image and interactive element,
// in document order. Evaluated by agentrl/tools/browser.py as a function of maxText.
(maxText) => {
  for (const e of document.querySelectorAll('[data-agentrl-ref]')) {
    e.removeAttribute('data-agentrl-ref');
  }
  const out = [];
  let ref = 0, buf = '', bufAbove = false;
  const clean = (s) => (s || '').replace(/\\s+/g, ' ').trim();
  const cut = (s, n) => (s.length > n ? s.slice(0, n - 1) + '…' : s);
  const q = (s, n = 100) => JSON.stringify(cut(clean(s), n));
  const above = (el) => el.getBoundingClientRect().bottom < 0;
  const flush = () => {
    const t = clean(buf);
    if (t) out.push(['text ' + JSON.stringify(cut(t, maxText)), bufAbove]);
    buf = '';
  };
  const SKIP = new Set(['script', 'style', 'noscript', 'template', 'head', 'iframe', 'object',
                        'embed', 'canvas', 'svg', 'math', 'video', 'audio', 'option']);
  const CONTROLS = 'a[href],button,input,select,textarea,[role=button],[role=link]';
  const ROLES = new Set(['button', 'link', 'checkbox', 'radio', 'switch', 'tab', 'menuitem',
                         'option', 'textbox', 'searchbox', 'combobox']);
  const kindOf = (el, style) => {
    const tag = el.localName, role = el.getAttribute('role');
    if (tag === 'a' && el.hasAttribute('href')) return 'link';
    if (tag === 'button' || tag === 'summary') return 'button';
    if (tag === 'input') {
      if (['submit', 'button', 'reset', 'image'].includes(el.type)) return 'button';
      if (el.type === 'checkbox' || el.type === 'radio') return el.type;
      return el.type === 'file' || el.type === 'hidden' ? null : 'textbox';
    }
    if (tag === 'textarea') return 'textbox';
    if (tag === 'select') return 'combobox';
    const parent = el.parentElement;
    if (el.isContentEditable && !(parent && parent.isContentEditable)) return 'textbox';
    if (role && ROLES.has(role)) return role;
    const pointer = style.cursor === 'pointer' && parent
                    && getComputedStyle(parent).cursor !== 'pointer';
    // A heuristic: a short, pointer-cursor or onclick element with no control inside.
    if ((pointer || el.hasAttribute('onclick')) && !el.querySelector(CONTROLS)
        && clean(el.innerText).length <= 200) return 'clickable';
    return null;
  };
  const nameOf = (el, kind) => {
    if (clean(el.getAttribute('aria-label'))) return el.getAttribute('aria-label');
    const by = (el.getAttribute('aria-labelledby') || '').split(/\\s+/).filter(Boolean);
    const byText = by.map((id) => (document.getElementById(id) || {}).innerText || '').join(' ');
    if (clean(byText)) return byText;
    const labels = el.labels ? Array.from(el.labels, (l) => l.innerText).join(' ') : '';
    if (clean(labels)) return labels;
    if (el.localName === 'input' && kind === 'button') return el.value || el.alt || el.type;
    if ((el.localName === 'input' || el.localName === 'textarea' || el.localName === 'select'))
      return el.placeholder || el.title || el.name || '';
    if (clean(el.innerText)) return el.innerText;
    const img = el.querySelector('img[alt]');
    return (img && img.alt) || el.title || '';
  };
  const details = (el, kind) => {
    let s = '';
    if (kind === 'textbox') {
      const v = el.isContentEditable ? el.innerText : el.value;
      if (v) s += ' value=' + (el.type === 'password' ? '"****"' : q(v, 300));
    }
    if (el.localName === 'select') {
      s += ' value=' + q(Array.from(el.selectedOptions, (o) => o.text).join(', '));
      const opts = Array.from(el.options, (o) => cut(clean(o.text), 40));
      s += ' options=' + JSON.stringify(opts.slice(0, 20)) + (opts.length > 20 ? '…' : '');
    }
    if (el.checked || el.getAttribute('aria-checked') === 'true') s += ' checked';
    if (el.disabled || el.getAttribute('aria-disabled') === 'true') s += ' disabled';
    if (kind === 'link') s += ' -> ' + cut(el.getAttribute('href'), 100);
    return s;
  };
  const children = (node) => (node.localName === 'slot' ? node.assignedNodes({flatten: true})
                              : (node.shadowRoot || node).childNodes);
  const walk = (node, quiet) => {
    for (const child of Array.from(children(node))) {
      if (child.nodeType === Node.TEXT_NODE) {
        if (quiet) continue;
        if (!clean(buf)) bufAbove = child.parentElement ? above(child.parentElement) : false;
        buf += child.data;
        continue;
      }
      if (child.nodeType !== Node.ELEMENT_NODE) continue;
      const el = child;
      if (SKIP.has(el.localName) || el.getAttribute('aria-hidden') === 'true') continue;
      if (!el.checkVisibility({visibilityProperty: true, checkVisibilityCSS: true})) continue;
      const style = getComputedStyle(el);
      const kind = kindOf(el, style);
      if (kind) {
        flush();
        el.setAttribute('data-agentrl-ref', String(++ref));
        out.push([`[${ref}] ${kind} ${q(nameOf(el, kind))}${details(el, kind)}`, above(el)]);
        continue;
      }
      const h = /^h([1-6])$/.exec(el.localName);
      const level = h ? h[1] : el.getAttribute('role') === 'heading'
                    ? (el.getAttribute('aria-level') || '2') : null;
      if (level && !quiet) {
        flush();
        out.push([`heading ${q(el.innerText, 200)} level=${level}`, above(el)]);
        walk(el, true);  // only the controls inside a heading: its text is on the line above
        continue;
      }
      if (el.localName === 'img') {
        if (!quiet && clean(el.alt)) { flush(); out.push(['img ' + q(el.alt), above(el)]); }
        continue;
      }
      const block = !style.display.startsWith('inline') || el.localName === 'br';
      if (block && !quiet) flush();
      walk(el, quiet || (el.localName === 'label' && !!el.control));
      if (block && !quiet) flush();
    }
  };
  if (document.body) walk(document.body, false);
  flush();
  const root = document.scrollingElement || document.documentElement;
  return {lines: out, title: document.title, scroll_y: Math.round(root.scrollTop),
          height: root.scrollHeight, viewport: innerHeight};
}
