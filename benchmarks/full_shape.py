# Over 400 lines: one rehearsal, its workload model, its monitor and its report belong together.
"""The SWE run at full shape, rehearsed on one machine: genuine SWE-bench instance images,
many live sandboxes, long episodes of real tool calls, snapshots, the async admission
bound with a trainer stand-in, every episode graded by the SWE-bench harness.

    .venv/bin/python benchmarks/full_shape.py [--sandboxes 64] [--slots 32] [--minutes 60]
        [--levels 16 32 64 128] [--train-step-s 30] [--out FILE]

Needs the instance images `tests/build_swe_images.py` builds (`sweb.eval.x86_64.<id>`);
the rehearsal uses every SWE-bench Lite row of tests/corpus-swe.json whose image is here.

Two phases, both on the real Docker engine:

1. **Engine latency as concurrency grows** (`--levels`): at each level L, L sandboxes of an
   instance image are started at once, then each runs a command (`exec`), a command
   through the persistent bash tool, the host's usage look the bash tool takes around
   every command (`Metered.usage`), a commit (`snapshot`) and a start from that commit
   (`restore`), all L at once; p50/p95/max of each, and the errors by kind (what breaks).
2. **The rehearsal** (`--minutes`): groups of `--group` episodes of the rows' instances are
   admitted under the async schedule's staleness bound (`agentrl.train.admission`, B =
   `--batch` groups a step, S = `--staleness`); a trainer stand-in takes B finished groups,
   sleeps `--train-step-s`, and publishes a new version to the sampler (the engine pauses
   with requests kept, `--transfer-s`). Episodes run through the pipeline dispatcher
   (`--slots` generation slots, `--sandboxes` live sandboxes) with replay points every
   `--snapshot-every` turns and the run's journal (crash recovery at the turn; every
   `--probe-every-s` it counts the turns a kill then would lose), are
   graded by the instance's own tests in the grading copy, and are written to
   `trajectories.jsonl` as a run writes them. What finished episodes keep of their
   snapshots is bounded by `--keep-gb` (`snapshots.keep_gb`; 0: no bound).

Workload (seeded; lognormal = median * exp(sigma * N(0, 1)), clipped): turns per episode
lognormal(36, 0.3) in [30, 50] (the SWE recipe allows 50; SWE-agent rollouts average 18-24
turns in the SkyRL-Agent notes, ../shared/reference/skyrl-agent-notes.md section 2, and the
issue asks for 30 or more); decoded tokens per reply lognormal(250, 0.8) in [16, 2048]
(benchmarks/dispatch.py's model: most turns short, a long tail of thinking). A published
check: the SWE rows of modal-labs/autoinference-agentic-mix-v1 (Hugging Face; turns 44-100
of SWE agent trajectories, Qwen2.5 tokens) have 22-1,520 output tokens a turn, inside this
clip; its rows shown are 38-255, so a median of 250 errs long, which makes turns slower and
the per-second load on the control plane lower, not the cost of a turn. The replies'
decode time follows the simulated continuous-batching engine (`agentrl.inference.simulated`,
a fit to a measured vLLM sweep). What the replies do is real, in the instance's repository:
list and grep it, read its failing test file with sed and with the editor, write and edit a
scratch file with the editor, and every 6th turn run that test file with pytest; the last
turn applies the row's gold patch with probability `--solve` (so some episodes resolve) and
calls finish. No GPU is here: generation is the one simulated part.

Reported (JSON, default benchmarks/results/full_shape.json, and a plot beside it):
episodes and turns per hour; control-plane CPU per turn (this process, and the Docker
engine's daemons); generation-slot utilisation; sandbox memory and writable-layer disk
per episode (the most each container reached); snapshot images and bytes over time and
after reclamation (`agentrl gc` of the run), and what the keep_gb bound removed; this
process's resident memory and the engine's over time; the journal's and the trajectory
file's size; errors and infrastructure failures by kind.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import platform
import random
import resource
import shutil
import statistics
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter

from agentrl import corpus
from agentrl.dispatch import DispatchConfig
from agentrl.dispatch.core import Feed
from agentrl.episode import Episodes, make_env
from agentrl.episode.journal import Journal
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.simulated import LatencyModel, Script, SimulatedSampler
from agentrl.sandbox.base import ExecRequest, SandboxSpec
from agentrl.sandbox.docker import DockerProvider, remove_run
from agentrl.sandbox.docker.engine import SNAPSHOT_OF
from agentrl.snapshots import Retention
from agentrl.tasks.formats import load_any
from agentrl.tasks.spec import Instance, SnapshotPolicy, Task
from agentrl.tasks.swe.testbed import testbed_tag as image_tag
from agentrl.tools.bash import BashTool
from agentrl.train.admission import Admission, Group, GroupBuffer
from agentrl.train.branches import collect_group
from agentrl.trajectory import INFRA_STOP_REASONS, StopReason, Trajectory, TrajectoryStore

RESULTS = Path(__file__).parent / "results"
LATENCY = LatencyModel()
TESTBED = ". /opt/miniconda3/bin/activate testbed >/dev/null 2>&1; cd /testbed"


def lognormal(rng: random.Random, median: float, sigma: float, lo: float, hi: float) -> float:
    return min(hi, max(lo, median * math.exp(sigma * rng.gauss(0.0, 1.0))))


def stats(samples: list[float]) -> dict[str, float]:
    if not samples:
        return {"n": 0}
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50": round(statistics.median(ordered), 4),
        "p95": round(ordered[int(0.95 * (len(ordered) - 1))], 4),
        "max": round(ordered[-1], 4),
    }


# --- the instances -------------------------------------------------------------------


def swe_task() -> tuple[Task, list[str]]:
    """The SWE-bench Lite rows of the corpus whose instance images are on this machine."""
    import docker

    manifest = json.loads((corpus.MANIFESTS / "corpus-swe.json").read_text())
    ids = [row["instance_id"] for row in manifest["instances"]]
    client = docker.from_env()
    try:
        here = [i for i in ids if client.api.images(name=image_tag(i))]
    finally:
        client.close()
    rows = corpus.find("swe-bench/lite.jsonl")
    if rows is None or not here:
        raise SystemExit(
            "error: no SWE-bench Lite row with its image here\n"
            "fix: AGENTRL_CORPUS=../shared/corpus python tests/build_swe_images.py ID ..."
        )
    task = load_any(rows)
    chosen = [i for i in task.instances if i.id in here]
    return task.model_copy(update={"instances": chosen}), here


# --- the policy: real commands, simulated decode time -----------------------------------


def _call(name: str, **arguments: Any) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


def actions(instance: Instance, turns: int, solve: bool) -> list[str]:
    """What an episode of `instance` does, turn by turn, in its repository."""
    tests = json.loads(instance.fields["FAIL_TO_PASS"])
    test_file = tests[0].split("::")[0] if tests else "."
    path = f"/testbed/{test_file}"
    scratch = "/tmp/scratch.py"
    cycle = [
        _call("bash", command=f"{TESTBED}; git status --short | head; ls"),
        _call("bash", command=f"{TESTBED}; grep -n 'def test_' {test_file} | head -30"),
        _call("bash", command=f"{TESTBED}; sed -n '1,80p' {test_file}"),
        _call("str_replace_editor", command="view", path=path, view_range=[1, 60]),
        _call(
            "str_replace_editor",
            command="create",
            path=scratch,
            file_text="def probe():\n    return 1\n",
        ),
        _call(
            "str_replace_editor",
            command="str_replace",
            path=scratch,
            old_str="return 1",
            new_str="return 2",
        ),
        _call("bash", command=f"{TESTBED}; grep -rn 'import' --include=*.py . | wc -l"),
    ]
    out = []
    for k in range(turns - 1):
        if k % 6 == 5:  # the failing test file, run for real
            cmd = f"{TESTBED}; timeout 60 python -m pytest -x -q {test_file} 2>&1 | tail -3"
            out.append(_call("bash", command=cmd))
        else:
            out.append(cycle[k % len(cycle)])
        out[-1] = "Let me look.\n" + out[-1]
    if solve:
        patch = instance.fields["patch"]
        out[-1] = _call("bash", command=f"cd /testbed && git apply - <<'PATCH'\n{patch}\nPATCH")
    out.append(_call("finish", message="done"))
    return out


def policy(
    task: Task, seed: int, solve_rate: float
) -> tuple[Callable[[str], Script], dict[str, int]]:
    """A script per session (`<instance>_<sample>`), drawn when it first asks; and the
    planned turns of each."""
    planned: dict[str, int] = {}
    by_id = {i.id: i for i in task.instances}

    def make(session: str) -> Script:
        instance_id, _, sample = session.rpartition("_")
        rng = random.Random(f"{seed}/{session}")
        turns = int(round(lognormal(rng, 36, 0.3, 30, 50)))
        solve = rng.random() < solve_rate
        planned[session] = turns
        replies = actions(by_id[instance_id], turns, solve)
        tokens = [int(lognormal(rng, 250, 0.8, 16, 2048)) for _ in replies]
        return Script(replies=replies, tokens=tokens)

    return make, planned


# --- what the machine does, sampled over time ------------------------------------------


def _proc_stat(pid: int) -> tuple[float, int]:
    """(CPU seconds, resident bytes) of a process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / ticks
    rss = int(fields[21]) * os.sysconf("SC_PAGE_SIZE")
    return cpu, rss


def engine_pids() -> list[int]:
    out = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            with contextlib.suppress(OSError):
                if (proc / "comm").read_text().strip() in ("dockerd", "containerd"):
                    out.append(int(proc.name))
    return out


class Monitor:
    """Samples this process, the engine and the run's containers and snapshots."""

    def __init__(
        self,
        client: Any,
        run_id: str,
        journal: Path,
        trajectories: Path,
        every_s: float,
        log: Path | None = None,
        progress: Callable[[], str] = str,
        kept: Callable[[], int] = int,
    ) -> None:
        self.client, self.run_id, self.journal, self.every_s = client, run_id, journal, every_s
        self.trajectories = trajectories
        self.log, self.progress = log, progress  # a line a person can follow, each sample
        self.kept = kept  # bytes the finished episodes' snapshots keep (Retention)
        self.rows: list[dict[str, Any]] = []
        self.peak_memory: dict[str, int] = {}  # container name -> most bytes seen
        self.peak_disk: dict[str, int] = {}  # container name -> largest writable layer seen
        self.start = time.monotonic()
        self.engine = engine_pids()

    def cpu(self) -> tuple[float, float]:
        """(this process's CPU seconds, the engine daemons')."""
        mine = resource.getrusage(resource.RUSAGE_SELF)
        engine = 0.0
        for pid in self.engine:
            with contextlib.suppress(OSError):
                engine += _proc_stat(pid)[0]
        return mine.ru_utime + mine.ru_stime, engine

    def sample(self) -> None:
        api = self.client.api
        live = api.containers(filters={"label": f"agentrl.run={self.run_id}"}, size=True)
        memory = 0
        for c in live:
            name = (c.get("Labels") or {}).get("agentrl.name", c["Id"][:12])
            cgroup = Path(f"/sys/fs/cgroup/memory/docker/{c['Id']}/memory.usage_in_bytes")
            with contextlib.suppress(OSError, ValueError):
                used = int(cgroup.read_text())
                memory += used
                self.peak_memory[name] = max(self.peak_memory.get(name, 0), used)
            self.peak_disk[name] = max(self.peak_disk.get(name, 0), int(c.get("SizeRw") or 0))
        snaps = api.images(filters={"label": f"{SNAPSHOT_OF}={self.run_id}"})
        base = {}
        snapshot_bytes = 0
        for image in snaps:  # a snapshot's own bytes: its size less its parent's
            parent = image.get("ParentId") or ""
            if parent and parent not in base:
                with contextlib.suppress(Exception):
                    base[parent] = api.inspect_image(parent)["Size"]
            snapshot_bytes += max(0, image["Size"] - base.get(parent, 0))
        mine, engine = self.cpu()
        engine_rss = sum(_proc_stat(p)[1] for p in self.engine if Path(f"/proc/{p}").exists())
        self.rows.append(
            {
                "t": round(time.monotonic() - self.start, 1),
                "cpu_s": round(mine, 2),
                "engine_cpu_s": round(engine, 2),
                "rss_mb": round(_proc_stat(os.getpid())[1] / 2**20, 1),
                "engine_rss_mb": round(engine_rss / 2**20, 1),
                "containers": len(live),
                "container_memory_mb": round(memory / 2**20, 1),
                "snapshots": len(snaps),
                "snapshot_mb": round(snapshot_bytes / 2**20, 1),
                "kept_finished_mb": round(self.kept() / 2**20, 1),
                "docker_disk_gb": round(shutil.disk_usage("/var/lib/docker").used / 2**30, 2),
                "journal_mb": round(
                    self.journal.stat().st_size / 2**20 if self.journal.exists() else 0.0, 2
                ),
                "trajectories_mb": round(
                    self.trajectories.stat().st_size / 2**20 if self.trajectories.exists() else 0,
                    1,
                ),
            }
        )

    async def run(self) -> None:
        while True:
            await asyncio.to_thread(self.sample)
            r = self.rows[-1]
            line = (
                f"[full-shape] {r['t'] / 60:5.1f} min  {r['containers']} sandboxes "
                f"({r['container_memory_mb']:.0f} MB)  {self.progress()}  driver "
                f"{r['rss_mb']:.0f} MB  engine {r['engine_rss_mb']:.0f} MB  snapshots "
                f"{r['snapshots']} ({r['snapshot_mb']:.0f} MB)  docker disk "
                f"{r['docker_disk_gb']} GB  journal {1000 * r['journal_mb']:.0f} KB  "
                f"trajectories {r['trajectories_mb']:.0f} MB"
            )
            print(line, flush=True)
            if self.log is not None:
                with self.log.open("a") as f:
                    f.write(time.strftime("%H:%M:%S ") + line + "\n")
            await asyncio.sleep(self.every_s)


# --- phase 1: the engine as concurrency grows -------------------------------------------


async def engine_latency(image: str, levels: list[int]) -> list[dict[str, Any]]:
    provider = DockerProvider()
    out = []
    for level in levels:
        row = await _one_level(provider, image, level)
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


async def _one_level(provider: DockerProvider, image: str, level: int) -> dict[str, Any]:
    """`level` sandboxes at once through each engine operation; the times and errors."""
    run_id = f"bench-full-engine-{level}-{uuid.uuid4().hex[:6]}"
    times: dict[str, list[float]] = {}
    errors: Counter[str] = Counter()

    async def timed(op: str, work: Awaitable[Any]) -> Any:
        start = time.monotonic()
        try:
            result = await work
        except Exception as e:  # what breaks first is the finding
            errors[f"{op}: {type(e).__name__}: {str(e).splitlines()[0][:120]}"] += 1
            return None
        times.setdefault(op, []).append(time.monotonic() - start)
        return result

    spec = SandboxSpec(image=image, workdir="/testbed", run_id=run_id, memory_mb=1024)
    start = time.monotonic()
    started = await asyncio.gather(*(timed("create", provider.start(spec)) for _ in range(level)))
    boxes = [b for b in started if b is not None]
    tools = [BashTool() for _ in boxes]
    try:
        await asyncio.gather(*(timed("exec", b.exec(ExecRequest(command="true"))) for b in boxes))
        await asyncio.gather(
            *(timed("bash", t(b, command="true")) for t, b in zip(tools, boxes, strict=True))
        )
        await asyncio.gather(*(timed("usage_look", b.usage()) for b in boxes))
        snaps = await asyncio.gather(*(timed("commit", b.snapshot("bench")) for b in boxes))
        restored = await asyncio.gather(
            *(timed("restore", provider.restore(s, spec)) for s in snaps if s is not None)
        )
        await asyncio.gather(*(r.close() for r in restored if r is not None))
    finally:
        for t in tools:
            with contextlib.suppress(Exception):
                await t.close()
        await asyncio.gather(*(b.close() for b in boxes), return_exceptions=True)
        remove_run(provider.client, run_id, snapshots=True)
    return {
        "level": level,
        "started": len(boxes),
        "wall_s": round(time.monotonic() - start, 2),
        **{op: stats(v) for op, v in times.items()},
        "errors": dict(errors),
    }


# --- phase 2: the rehearsal ----------------------------------------------------------------


@dataclass(frozen=True)
class Back:
    """What the report needs of an episode that came back. The trajectory itself is let
    go, as a run lets it go once written, so the driver's memory over time is agentrl's
    and not this benchmark's list of every episode (a SWE episode's ledger is MBs)."""

    turns: list[tuple[float, float]]  # (tool seconds, generation seconds) of each turn
    reward: float | None
    stop_reason: StopReason
    error: str | None
    seconds: dict[str, float]

    @classmethod
    def of(cls, traj: Trajectory) -> Back:
        return cls(
            turns=[(u.tool_seconds, u.gen_seconds) for u in traj.turns],
            reward=traj.reward,
            stop_reason=traj.stop_reason,
            error=traj.error,
            seconds=dict(traj.seconds),
        )


async def rehearse(args: argparse.Namespace, task: Task, out_dir: Path) -> dict[str, Any]:
    import docker

    tokenizer = load_tokenizer()
    provider = DockerProvider()
    run_id = f"bench-full-shape-{uuid.uuid4().hex[:6]}"
    env = make_env(task, provider, run_id)
    make, planned = policy(task, args.seed, args.solve)
    sampler = SimulatedSampler(make, tokenizer, LATENCY, transfer_s=args.transfer_s)
    journal = Journal(out_dir / "inflight.jsonl")
    store = TrajectoryStore(out_dir / "trajectories.jsonl")
    retention = Retention()
    snapshots = SnapshotPolicy(
        every=args.snapshot_every,
        keep_successful=0.0,
        keep_every=args.keep_every,
        keep_gb=args.keep_gb or None,
    )
    factory = Episodes(sampler, tokenizer, {task.spec.name: env}, snapshots, journal, retention)
    B, n, S = args.batch, args.group, args.staleness
    buf = GroupBuffer(Admission.resumed(B, S, 0))
    feed, groups = Feed(), {}
    client = docker.from_env()
    trajs: list[Back] = []

    def progress() -> str:
        turns = sum(len(t.turns) for t in trajs)
        solved = sum(t.reward == 1.0 for t in trajs)
        return f"{len(trajs)} episodes back ({turns} turns, {solved} resolved), {len(steps)} steps"

    monitor = Monitor(
        client,
        run_id,
        journal.path,
        store.path,
        args.sample_s,
        out_dir / "progress.log",
        progress,
        lambda: retention.bytes(task.spec.name),
    )
    steps: list[dict[str, Any]] = []
    deadline = time.monotonic() + 60 * args.minutes
    admitted = 0

    async def produce() -> None:
        nonlocal admitted
        index = 0
        while time.monotonic() < deadline:
            scheduled = await buf.admit()
            instance = task.instances[index % len(task.instances)]
            group = Group(index, 0, instance.id, scheduled, n)
            for k in range(n):
                ep = factory.fresh(task, instance, index * n + k, scheduled_step=scheduled)
                live[ep.trajectory_id] = ep
                groups[ep.trajectory_id] = group
                feed.put(ep)
            index += 1
            admitted = index

    async def probe() -> None:
        """What a kill now would cost: the journal holds exactly what a kill leaves (its
        lines are fsynced as written), so each episode out loses the turns it completed
        past the state the journal would resume it from (all of them if none landed),
        besides the one in progress."""
        while True:
            await asyncio.sleep(args.probe_every_s)
            offers = Journal(journal.path).in_flight()
            out = [ep for ep in live.values() if ep.sandbox is not None and ep.stop is None]
            lost = []
            for ep in out:
                found = offers.get((task.spec.name, ep.trajectory_id))
                # completed turns: a turn whose tool call runs has no observation yet
                done = len(ep.turns) - bool(ep.turns and not ep.turns[-1].observation)
                lost.append(done - (found.turns if found is not None else 0))
            probes.append(
                {"t": round(time.monotonic() - monitor.start, 1), "episodes_out": len(out),
                 "turns_lost": sum(lost), "lost_per_episode": stats([float(x) for x in lost])}
            )  # fmt: skip

    async def train() -> None:
        step = 0
        while True:
            batch, _ = await buf.take(B)
            started = time.monotonic()
            await asyncio.sleep(args.train_step_s)
            version = sampler.policy_version + 1
            await asyncio.to_thread(sampler.update_weights, {}, version)
            await buf.advance()
            step += 1
            lags = [step - 1 - g.scheduled_step for g in batch]
            steps.append(
                {"step": step, "t": round(time.monotonic() - monitor.start, 1),
                 "lag_max": max(lags), "step_s": round(time.monotonic() - started, 2)}
            )  # fmt: skip

    dispatcher = TypeAdapter(DispatchConfig).validate_python(
        {
            "type": "pipeline",
            "concurrency": args.slots,
            "max_sandboxes": args.sandboxes,
            "eval_workers": args.eval_workers,
        }
    )
    built = dispatcher.build()
    cpu0 = monitor.cpu()
    live: dict[str, Any] = {}  # trajectory id -> its episode, until it is back
    probes: list[dict[str, Any]] = []
    workers = [
        asyncio.create_task(probe()),
        asyncio.create_task(produce()),
        asyncio.create_task(train()),
        asyncio.create_task(monitor.run()),
    ]
    done_groups = 0
    try:
        async with aclosing(built.run(feed)) as stream:
            async for traj in stream:
                trajs.append(Back.of(traj))
                await asyncio.to_thread(store.append, traj)  # as a run writes it
                live.pop(traj.trajectory_id, None)
                journal.closed(traj.task, traj.trajectory_id)  # as a run records it
                if (group := collect_group(traj, groups, feed, None)) is not None:
                    done_groups += 1
                    await buf.finish(group, keep=True)
                if time.monotonic() >= deadline and workers[0].done() is False:
                    workers[0].cancel()
                if time.monotonic() >= deadline and done_groups >= admitted and not groups:
                    feed.close()
    finally:
        for w in workers:
            w.cancel()
        await asyncio.gather(*workers, return_exceptions=True)
        await sampler.close()
    wall = time.monotonic() - monitor.start
    cpu1 = monitor.cpu()
    await asyncio.to_thread(monitor.sample)
    before_gc = monitor.rows[-1]
    freed = remove_run(provider.client, run_id, snapshots=True)
    await asyncio.to_thread(monitor.sample)
    client.close()
    turns = sum(len(t.turns) for t in trajs)
    control_ms = 1000 * (cpu1[0] - cpu0[0]) / max(turns, 1)
    engine_ms = 1000 * (cpu1[1] - cpu0[1]) / max(turns, 1)
    infra = Counter(t.stop_reason.value for t in trajs if t.stop_reason in INFRA_STOP_REASONS)
    metrics = built.metrics
    return {
        "run_id": run_id,
        "wall_s": round(wall, 1),
        "episodes": len(trajs),
        "episodes_per_hour": round(len(trajs) * 3600 / wall, 1),
        "turns": turns,
        "turns_per_episode": stats([len(t.turns) for t in trajs]),
        "planned_turns": stats(list(planned.values())),
        "resolved": sum(t.reward == 1.0 for t in trajs),
        "stop_reasons": dict(Counter(t.stop_reason.value for t in trajs)),
        "infra_failures": dict(infra),
        "errors": dict(Counter((t.error or "").splitlines()[0][:160] for t in trajs if t.error)),
        "control_plane_ms_per_turn": round(control_ms, 2),
        "engine_ms_per_turn": round(engine_ms, 2),
        "extrapolated_512": extrapolate(control_ms, engine_ms),
        "tool_s_per_turn": stats([tool for t in trajs for tool, _ in t.turns]),
        "gen_s_per_turn": stats([gen for t in trajs for _, gen in t.turns]),
        "init_s": stats([t.seconds.get("init", 0.0) for t in trajs]),
        "eval_s": stats([t.seconds.get("eval", 0.0) for t in trajs]),
        "slot_utilisation_mean": metrics.utilisation_mean if metrics else None,
        "slot_utilisation_steady": metrics.utilisation_steady if metrics else None,
        "peak_live_sandboxes": (metrics.peaks if metrics else {}),
        "sandbox_memory_mb_per_episode": stats([v / 2**20 for v in monitor.peak_memory.values()]),
        "sandbox_disk_mb_per_episode": stats([v / 2**20 for v in monitor.peak_disk.values()]),
        "keep_gb": args.keep_gb or None,
        "kept_mb_at_end": round(retention.bytes(task.spec.name) / 2**20, 1),
        "keep_gb_removed": {
            "episodes": retention.removed_episodes,
            "mb": round(retention.freed_bytes / 2**20, 1),
        },
        "trajectory_kb_per_episode": round(
            store.path.stat().st_size / 1024 / max(len(trajs), 1), 1
        ),
        "snapshots_before_gc": {k: before_gc[k] for k in ("snapshots", "snapshot_mb")},
        "reclaimed": freed.model_dump() if hasattr(freed, "model_dump") else str(freed),
        "after_gc": {k: monitor.rows[-1][k] for k in ("snapshots", "snapshot_mb")},
        "crash_probes": probes,
        "turns_lost_per_episode_out": stats(
            [float(p["lost_per_episode"].get("max", 0)) for p in probes if p["episodes_out"]]
        ),
        "trainer_steps": steps,
        "timeline": monitor.rows,
    }


def extrapolate(control_ms: float, engine_ms: float, sandboxes: int = 512) -> dict[str, Any]:
    """CPU cores the control plane and the engine would need with `sandboxes` episodes in
    flight on one node, if each turn costs what it cost here: an extrapolation, not a
    measurement. A sandbox turns over once per generation plus tool call; on a GPU node
    that is seconds (here the 2 CPUs stretch it), so the rate is a stated assumption."""
    out: dict[str, Any] = {"sandboxes": sandboxes, "assumes": "per-turn CPU as measured here"}
    for turn_s in (2.0, 5.0, 10.0):
        rate = sandboxes / turn_s
        out[f"turn_{turn_s:g}s"] = {
            "turns_per_s": round(rate, 1),
            "control_plane_cores": round(rate * control_ms / 1000, 2),
            "engine_cores": round(rate * engine_ms / 1000, 2),
        }
    return out


def plot(result: dict[str, Any], path: Path) -> None:
    from agentrl.figures import pyplot, save

    plt = pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    rows = result["rehearsal"]["timeline"] if result.get("rehearsal") else []
    t = [r["t"] / 60 for r in rows]
    ax = axes[0][0]
    ax.plot(t, [r["rss_mb"] for r in rows], label="driver RSS (MB)")
    ax.plot(t, [r["engine_rss_mb"] for r in rows], label="dockerd+containerd RSS (MB)")
    ax.plot(t, [r["container_memory_mb"] for r in rows], label="sandboxes' memory (MB)")
    ax.set_xlabel("minutes")
    ax.set_title("resident memory")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    ax.plot(t, [r["snapshot_mb"] for r in rows], label="snapshot layers (MB)")
    if any("kept_finished_mb" in r for r in rows):
        kept = [r.get("kept_finished_mb", 0) for r in rows]
        ax.plot(t, kept, label="of them, finished episodes' (MB)")
    ax.plot(t, [r["journal_mb"] for r in rows], label="journal (MB)")
    ax.plot(t, [r.get("trajectories_mb", 0) for r in rows], label="trajectories.jsonl (MB)")
    if keep := (result.get("rehearsal") or {}).get("keep_gb"):
        ax.axhline(1024 * keep, color="grey", ls="--", lw=1, label="keep_gb (finished episodes')")
    ax.set_xlabel("minutes")
    ax.set_title("disk (last point: after gc)")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    for op in ("create", "exec", "bash", "usage_look", "commit", "restore"):
        levels = [r for r in result.get("engine", []) if r.get(op, {}).get("n")]
        if levels:
            ax.plot([r["level"] for r in levels], [r[op]["p50"] for r in levels], "o-", label=op)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sandboxes at once")
    ax.set_ylabel("p50 seconds")
    ax.set_title("engine latency as concurrency grows")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    ax.plot(t, [r["containers"] for r in rows], label="live sandboxes")
    ax.set_xlabel("minutes")
    ax.set_title("live sandboxes")
    ax.legend(fontsize=8)
    fig.tight_layout()
    save(fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sandboxes", type=int, default=64)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--eval-workers", type=int, default=8)
    parser.add_argument("--minutes", type=float, default=60.0)
    parser.add_argument("--group", type=int, default=8, help="episodes per group")
    parser.add_argument("--batch", type=int, default=4, help="groups per trainer step (B)")
    parser.add_argument("--staleness", type=int, default=1, help="max_staleness_steps (S)")
    parser.add_argument("--train-step-s", type=float, default=30.0)
    parser.add_argument("--transfer-s", type=float, default=2.0)
    parser.add_argument("--snapshot-every", type=int, default=1)
    parser.add_argument("--keep-every", type=int, default=5, help="snapshots kept at close")
    parser.add_argument(
        "--keep-gb", type=float, default=1.0, help="snapshots.keep_gb (0: no bound)"
    )
    parser.add_argument("--probe-every-s", type=float, default=120.0, help="crash probes")
    parser.add_argument("--solve", type=float, default=0.3, help="share of gold-patch endings")
    parser.add_argument("--levels", type=int, nargs="*", default=[16, 32, 64, 128])
    parser.add_argument("--sample-s", type=float, default=15.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=RESULTS / "full_shape.json")
    args = parser.parse_args()
    task, images = swe_task()
    out_dir = args.out.parent / (args.out.stem + ".run")
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    result: dict[str, Any] = {
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "instances": images,
    }
    result["engine"] = asyncio.run(engine_latency(image_tag(images[0]), args.levels))
    if args.minutes > 0:
        result["rehearsal"] = asyncio.run(rehearse(args, task, out_dir))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    plot(result, args.out.with_suffix(".png"))
    summary = {k: v for k, v in result.get("rehearsal", {}).items() if k != "timeline"}
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
