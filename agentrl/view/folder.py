# Over 400 lines: everything the viewer's page asks of one run folder, behind one lock.
"""A run folder as the viewer shows it: its trajectory files (indexed), its metrics, and
one episode at a time with its tokens' texts, its grade, its branches and the commands
that replay it. Every answer is a JSON-ready dict: the HTTP server sends them as they
are and `--export` writes them into a static copy (the shapes: docs/viewer.md).
"""

from __future__ import annotations

import json
import shlex
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentrl.batch import finite
from agentrl.errors import ConfigError, first_line
from agentrl.trajectory import BRANCHES, INFRA_STOP_REASONS, Trajectory, run_files
from agentrl.view.imported import imported
from agentrl.view.index import COLUMNS, EpisodeIndex, record

SUMMARY, CONVERSATIONS = "summary.json", "conversations.jsonl"  # agentrl.runner's, unimported

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Progress = Callable[[str, int, int], None]
"""(what, done, total): how far indexing has got, in bytes."""

ENDED_SLACK_S = 2.0
"""A file changed this long after the run's summary still counts as before it (a folder
copied or checked out gets its files' times in any order)."""


@dataclass
class RunFile:
    """One trajectory file of the folder, under a short id the page can use."""

    id: str
    label: str
    path: Path
    index: EpisodeIndex


def fold(text: str) -> str:
    """Text as search compares it: ASCII letters lower-cased, nothing else changed (the
    page's static search folds the same way, and raw JSON bytes fold alike)."""
    return text.translate(_ASCII_LOWER)


_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")


def matches(turns: list[dict[str, Any]], folded_query: str) -> bool:
    """Whether any turn's action or observation holds the (folded) query."""
    return any(
        folded_query in fold(t.get("action") or "")
        or folded_query in fold(t.get("observation") or "")
        for t in turns
    )


SPLIT_TOKENS = 8
"""The most tokens one character's bytes are looked for across (UTF-8 needs at most 4)."""


def _whole_characters(
    ids: list[int], texts: list[str], tokenizer: PreTrainedTokenizerBase
) -> list[str]:
    """Per-token texts, with each character whose UTF-8 bytes are split across tokens made
    whole: alone, each piece decodes to U+FFFD; the token that completes the character shows
    it, the pieces before it show nothing (as an incremental detokenizer emits them). The
    texts then join to the decode of the whole."""
    out, i = list(texts), 0
    while i < len(ids):
        if "\ufffd" in out[i]:
            for j in range(i + 1, min(i + SPLIT_TOKENS, len(ids))):
                whole = str(
                    tokenizer.decode(
                        ids[i : j + 1],
                        skip_special_tokens=False,
                        clean_up_tokenization_spaces=False,
                    )
                )
                if "\ufffd" not in whole:
                    out[i : j + 1] = [""] * (j - i) + [whole]
                    i = j
                    break
        i += 1
    return out


class RunFolder:
    """What `agentrl view` serves of one run folder (thread-safe)."""

    def __init__(self, root: Path, model: str | None = None) -> None:
        root = root.expanduser()
        if not root.is_dir():
            raise ConfigError(
                f"{root}: no such run folder",
                fix="pass a folder that `agentrl run`, `agentrl eval` or `agentrl train` wrote",
            )
        if not any(
            (root / n).exists() for n in ("run.json", "trajectories.jsonl", "metrics.jsonl")
        ):
            raise ConfigError(
                f"{root} is not a run folder (no run.json, trajectories.jsonl or metrics.jsonl)",
                fix="pass a folder that `agentrl run`, `agentrl eval` or `agentrl train` wrote",
            )
        self.root = root.resolve()
        self.imported = imported(self.root)
        """What `agentrl view` imported into this folder (another tool's ATIF), or None."""
        self.model = model
        self.files: dict[str, RunFile] = {}
        self._lock = threading.RLock()
        self._where: dict[str, tuple[str, int]] = {}  # trajectory id -> (file, row)
        self._children: dict[str, list[tuple[str, int]]] = {}  # parent id -> its branches
        self._seen: dict[str, tuple[int, int]] = {}  # file -> (index generation, rows) mapped
        self._metrics: tuple[tuple[int, float], list[dict[str, Any]]] = ((-1, 0.0), [])
        self._tokenizer: PreTrainedTokenizerBase | None = None
        self._token_note: str | None = None
        self._tokenizer_lock = threading.Lock()
        self._texts: dict[int, str] = {}

    # --- what the folder holds -----------------------------------------------------

    @property
    def kind(self) -> str:
        if any((self.root / m).exists() for m in ("metrics.jsonl", "checkpoints", "eval")):
            return "train"
        # An `agentrl run` folder is an evaluation folder plus its conversations and summary.
        if any((self.root / n).exists() for n in (CONVERSATIONS, SUMMARY)):
            return "run"
        return "eval" if (self.root / "eval.json").is_file() else "run"

    def _discover(self) -> None:
        """Add the trajectory files that exist now (an evaluation folder appears mid-run)."""
        for path in run_files(self.root):
            rel = path.relative_to(self.root)
            if rel.name == BRANCHES:
                file_id, label = "branches", "replay branches"
            elif rel.parts[0] == "eval":
                file_id, label = f"eval-{rel.parts[1]}", f"held-out eval, {rel.parts[1]}"
            else:
                file_id = "train"
                label = "training episodes" if self.kind == "train" else "episodes"
            if file_id not in self.files:
                self.files[file_id] = RunFile(file_id, label, path, EpisodeIndex(path))

    def refresh(self, progress: Progress | None = None) -> None:
        """Index what the files gained since the last call."""
        with self._lock:
            self._discover()
            for f in self.files.values():
                report = (
                    (lambda done, total, f=f: progress(f.label, done, total)) if progress else None
                )
                f.index.refresh(report)
                self._enter(f)

    def _forget(self, file_id: str) -> None:
        self._where = {k: v for k, v in self._where.items() if v[0] != file_id}
        for key, kids in self._children.items():
            self._children[key] = [k for k in kids if k[0] != file_id]

    def _enter(self, f: RunFile) -> None:
        """Map the ids of `f`'s rows not mapped yet (all of them again when its index was
        rebuilt: a resume cut the file back, and its rows are other episodes now)."""
        generation, seen = self._seen.get(f.id, (f.index.generation, 0))
        if generation != f.index.generation:
            self._forget(f.id)
            seen = 0
        at_id, at_parent = COLUMNS.index("id"), COLUMNS.index("branch_of")
        for row in f.index.rows[seen:]:
            self._where.setdefault(row[at_id], (f.id, row[0]))
            if row[at_parent]:
                self._children.setdefault(row[at_parent], []).append((f.id, row[0]))
        self._seen[f.id] = (f.index.generation, len(f.index))

    def _file(self, file_id: str) -> RunFile:
        f = self.files.get(file_id)
        if f is None:
            raise ConfigError(
                f"no trajectory file {file_id!r} in {self.root}",
                fix=f"pick one of: {', '.join(self.files) or '(none yet)'}",
            )
        return f

    def metrics(self) -> list[dict[str, Any]]:
        """The rows of metrics.jsonl (re-read when the file changed; NaN as None)."""
        path = self.root / "metrics.jsonl"
        try:
            st = path.stat()
        except OSError:
            return []
        key = (st.st_size, st.st_mtime)
        if key != self._metrics[0]:
            rows = []
            for line in path.read_text(encoding="utf-8").splitlines():
                try:
                    rows.append(finite(json.loads(line)))
                except ValueError:
                    break  # a row being written
            self._metrics = (key, rows)
        return self._metrics[1]

    def _json(self, name: str) -> Any:
        try:
            return finite(json.loads((self.root / name).read_text(encoding="utf-8")))
        except (OSError, ValueError):
            return None

    def stamp(self) -> dict[str, Any]:
        """What changed since the page last looked: it polls this and fetches only then."""
        with self._lock:
            self.refresh()
            files = {f.id: len(f.index) for f in self.files.values()}
            path = self.root / "metrics.jsonl"
            size = path.stat().st_size if path.is_file() else 0
            ends = [f.index.end for f in self.files.values()]
            stamp = json.dumps([files, size, ends, self.finished()])
            return {"stamp": stamp, "files": files}

    def finished(self) -> bool:
        """Whether the run has ended: it wrote its last file (summary.json; an evaluation,
        results.json) and changed none of its episodes or metrics after that (a resumed
        run does; replay branches, added any time, do not count)."""
        if self.imported is not None:
            return True  # another tool's episodes, read once: nothing more comes
        last = self.root / ("results.json" if self.kind == "eval" else SUMMARY)
        try:
            ended = last.stat().st_mtime
        except OSError:
            return False
        summary = self._json(SUMMARY) if last.name == SUMMARY else None
        if isinstance(summary, dict) and summary.get("complete") is False:
            return False  # an interrupted run: `agentrl run --resume` continues it
        written = [f.path for f in self.files.values() if f.id != "branches"]
        for path in [*written, self.root / "metrics.jsonl"]:
            try:
                if path.stat().st_mtime > ended + ENDED_SLACK_S:
                    return False
            except OSError:
                continue
        return True

    # --- the page's questions ------------------------------------------------------

    def run(self) -> dict[str, Any]:
        with self._lock:
            stamp = self.stamp()["stamp"]
            files = [
                {
                    "id": f.id,
                    "label": f.label,
                    "path": str(f.path.relative_to(self.root)),
                    "rows": len(f.index),
                }
                for f in self.files.values()
            ]
            finished = self.finished()
        source = (self.imported or {}).get("source")
        return {
            "name": Path(source).name if source else self.root.name,
            "dir": str(self.root),
            "kind": self.kind,
            "files": files,
            "metrics": self.metrics(),
            "summary": self._json("summary.json"),
            "stamp": stamp,
            "finished": finished,
            "infra_stops": sorted(INFRA_STOP_REASONS),  # the page's one list of them
        }

    def rows(self, file_id: str, since: int = 0) -> dict[str, Any]:
        with self._lock:
            f = self._file(file_id)
            rows = f.index.rows[max(since, 0) :]
            return {
                "file": file_id,
                "since": since,
                "total": len(f.index),
                "columns": list(COLUMNS),
                "rows": rows,
            }

    def search(self, file_id: str, query: str, since: int = 0) -> dict[str, Any]:
        """Rows of `file_id` from `since` on whose actions or observations contain
        `query` (ASCII letters in any case; a live page asks only about new rows). Each
        line's raw JSON is tested first, as bytes: the JSON of a substring is a substring
        of the JSON, so only candidate lines are parsed."""
        folded = fold(query)
        needle = json.dumps(folded, ensure_ascii=False)[1:-1].encode().lower()
        with self._lock:
            f = self._file(file_id)
            rows = list(range(max(since, 0), len(f.index)))
        hits = []
        if folded:
            for row, raw in f.index.lines(rows):
                if needle in raw.lower():
                    try:
                        data = record(raw)
                    except ValueError:
                        continue
                    if matches(data.get("turns") or [], folded):
                        hits.append(row)
        return {"file": file_id, "q": query, "rows": hits}

    def trajectory(self, file_id: str, row: int) -> Trajectory:
        with self._lock:
            f = self._file(file_id)
            if not 0 <= row < len(f.index):
                raise ConfigError(
                    f"{file_id} has rows 0..{len(f.index) - 1}, not {row}",
                    fix="pick an episode from the table",
                )
            raw = f.index.line(row)
        if self.imported is not None:  # another tool's episodes: to look at, not to check
            return Trajectory.model_validate_json(raw)
        return Trajectory.from_json(raw, where=f"{f.path}: row {row}")

    def episode(self, file_id: str, row: int) -> dict[str, Any]:
        traj = self.trajectory(file_id, row)
        data = traj.model_dump(mode="json")
        tokens = self.token_texts(traj)
        with self._lock:
            where = self._where.get(traj.branch_of.trajectory_id) if traj.branch_of else None
            kids = list(self._children.get(traj.trajectory_id, []))
        parent = None
        if traj.branch_of is not None and where is not None:
            other = self.trajectory(*where)
            parent = {
                "file": where[0],
                "row": where[1],
                "id": other.trajectory_id,
                "turn": traj.branch_of.turn,
                "divergence": divergence(other, traj),
            }
        branches = []
        for kid_file, kid_row in kids:
            kid = self.trajectory(kid_file, kid_row)
            assert kid.branch_of is not None
            branches.append(
                {
                    "file": kid_file,
                    "row": kid_row,
                    "id": kid.trajectory_id,
                    "turn": kid.branch_of.turn,
                    "purpose": kid.branch_of.purpose,
                    "reward": finite(kid.reward),
                    "stop": kid.stop_reason.value,
                    "divergence": divergence(traj, kid),
                }
            )
        return {
            "file": file_id,
            "row": row,
            "trajectory": finite(data),
            "tokens": tokens,
            "token_note": self._token_note if tokens is None else None,
            "grade": self._grade(file_id, traj),
            "parent": parent,
            "branches": branches,
            "replay": [] if self.imported is not None else self.replay_commands(traj),
            "prompt_text": (self.imported or {}).get("prompts", {}).get(traj.trajectory_id),
        }

    def _grade(self, file_id: str, traj: Trajectory) -> Any:
        if not traj.grade_file:
            return None
        path = (self.files[file_id].path.parent / traj.grade_file).resolve()
        if not path.is_relative_to(self.root):  # a record may name any path: serve none
            return {"error": f"{traj.grade_file}: outside the run folder, not shown"}
        try:
            return finite(json.loads(path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as e:
            return {"error": f"{path}: {first_line(e)}"}

    def replay_commands(self, traj: Trajectory) -> list[str]:
        """`agentrl replay` for this episode: act its replies again, a shell before its
        last turn, and a policy going on from there."""
        run, tid = shlex.quote(str(self.root)), shlex.quote(traj.trajectory_id)
        commands = [f"agentrl replay {run} {tid}"]
        if traj.turns:
            last = len(traj.turns) - 1
            commands.append(f"agentrl replay {run} {tid} --from-turn {last} --shell")
            commands.append(
                f"agentrl replay {run} {tid} --from-turn {last} --policy {self._policy()}"
            )
        return commands

    def _policy(self) -> str:
        if (self.root / "checkpoints").is_dir():
            return shlex.quote(str(self.root))  # its newest checkpoint
        model = self.model or self._recorded_model()
        return "local" if model in (None, "embedded") else shlex.quote(model)

    def _recorded_model(self) -> str | None:
        info = self._json("run.json")
        return info.get("model") if isinstance(info, dict) else None

    # --- token texts ---------------------------------------------------------------

    def token_texts(self, traj: Trajectory) -> list[dict[str, Any]] | None:
        """Each ledger's prompt and response ids as text, one string per id (None when
        no tokenizer can be had: `_token_note` says why)."""
        tokenizer = self._load_tokenizer()
        if tokenizer is None:
            return None
        ledgers = traj.ledgers()
        with self._lock:
            missing = sorted(
                {i for s in ledgers for i in (*s.prompt_ids, *s.response_ids)} - self._texts.keys()
            )
            if missing:
                texts = tokenizer.batch_decode(
                    [[i] for i in missing],
                    skip_special_tokens=False,
                    clean_up_tokenization_spaces=False,
                )
                self._texts.update(zip(missing, texts, strict=True))
            known = self._texts

            def shown(ids: list[int]) -> list[str]:
                return _whole_characters(ids, [known[i] for i in ids], tokenizer)

            return [
                {
                    "reason": s.reason,
                    "prompt": shown(s.prompt_ids),
                    "response": shown(s.response_ids),
                }
                for s in ledgers
            ]

    def warm(self) -> None:
        """Load the tokenizer now, so the first episode opens fast."""
        self._load_tokenizer()

    def _load_tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The run's tokenizer, loaded on first use (`agentrl view` warms it up in the
        background: transformers takes seconds to import)."""
        with self._tokenizer_lock:
            return self._tokenizer or self._new_tokenizer()

    def _new_tokenizer(self) -> PreTrainedTokenizerBase | None:
        if self._token_note is not None:
            return None
        model = self.model or self._recorded_model()
        if model is None and self.imported is not None:
            self._token_note = (
                f"imported from {self.imported.get('source')}: its token ids are shown as "
                "ids; fix: agentrl view FILE --model MODEL_FOLDER (the model that made them)"
            )
            return None
        if model is None:
            self._token_note = (
                "run.json names no model (written before agentrl recorded it): token ids only; "
                "fix: agentrl view RUN --model embedded (or the model's folder)"
            )
            return None
        from agentrl.inference.embedded import model_tokenizer

        try:
            self._tokenizer = model_tokenizer(model)
        except ConfigError as e:
            self._token_note = f"{e.message}: token ids only" + (f"; fix: {e.fix}" if e.fix else "")
        return self._tokenizer


def divergence(parent: Trajectory, branch: Trajectory) -> dict[str, int] | None:
    """Where `branch`'s tokens first differ from `parent`'s: the ledger, the index into
    its response, and the branch's turn holding it (None: identical as far as both go)."""
    for k, (a, b) in enumerate(zip(parent.ledgers(), branch.ledgers(), strict=False)):
        n = min(len(a.response_ids), len(b.response_ids))
        at = next((i for i in range(n) if a.response_ids[i] != b.response_ids[i]), None)
        if at is None and len(a.response_ids) != len(b.response_ids):
            at = n
        if at is not None:
            turn = next(
                (j for j, t in enumerate(branch.turns) if t.segment == k and t.span[1] > at),
                len(branch.turns) - 1,
            )
            return {"segment": k, "token": at, "turn": turn}
    return None
