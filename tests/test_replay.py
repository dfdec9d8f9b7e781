"""Snapshots during RUN, `agentrl replay` and `agentrl failures`: real Docker, real tools,
the real tokenizer (and the real embedded model for branching)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pexpect
import pytest

from agentrl import replay
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.scripted import ScriptedSampler, load_script
from agentrl.runner import run_task
from agentrl.sandbox.docker import SNAPSHOT_OF, DockerProvider, gc
from agentrl.sandbox.images import docker_client
from agentrl.sandbox.shell import spawn_on_pty
from agentrl.tasks.formats import load_any
from agentrl.tasks.spec import SnapshotPolicy, Task
from agentrl.trajectory import Trajectory, TrajectoryStore

pytestmark = [pytest.mark.docker, pytest.mark.model]
ROOT = Path(__file__).parents[1]
DATA = Path(__file__).parent / "data" / "replay"
WORDFREQ = ROOT / "tasks" / "terminal" / "fix-wordfreq"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer()


def scripted_run(
    task: Task,
    script: Path,
    out: Path,
    tokenizer,
    *,
    every: int | None = 1,
    keep: float = 0.0,
    keep_every: int = 0,
) -> Trajectory:
    policy = (
        None
        if every is None
        else SnapshotPolicy(every=every, keep_successful=keep, keep_every=keep_every)
    )
    sampler = ScriptedSampler(load_script(script), tokenizer)
    asyncio.run(
        run_task(
            task, sampler, tokenizer, DockerProvider(), out, show_progress=False, snapshots=policy
        )
    )
    (traj,) = TrajectoryStore(out / "trajectories.jsonl")
    return traj


def images_of(ids: list[str]) -> list[str]:
    client = docker_client()
    try:
        have = {i["Id"] for i in client.api.images(all=True, filters={"label": SNAPSHOT_OF})}
    finally:
        client.close()
    return [i for i in ids if i in have]


def run_snapshots(run_dir: Path) -> list[str]:
    """Every snapshot image of the run that wrote `run_dir`."""
    run_id = json.loads((run_dir / "run.json").read_text())["run_id"]
    client = docker_client()
    try:
        images = client.api.images(all=True, filters={"label": f"{SNAPSHOT_OF}={run_id}"})
    finally:
        client.close()
    return [i["Id"] for i in images]


@pytest.fixture(scope="module")
def broken(tmp_path_factory, tokenizer) -> tuple[Path, Trajectory]:
    """fix-wordfreq, broken at turn 3 by a scripted agent, a snapshot after every turn."""
    out = tmp_path_factory.mktemp("broken")
    traj = scripted_run(load_any(WORDFREQ), DATA / "breaker.yaml", out, tokenizer)
    yield out, traj
    asyncio.run(_remove(replay.snapshot_ids([traj])))


async def _remove(ids: list[str]) -> None:
    provider = DockerProvider(reap_at_start=False)
    for i in ids:
        await provider.remove_snapshot(i)


def test_every_turn_is_snapshotted_and_a_failure_keeps_them(broken) -> None:
    _, traj = broken
    assert traj.reward == 0.0 and len(traj.turns) == 6
    ids = replay.snapshot_ids([traj])
    assert traj.env.init_snapshot and all(t.snapshot_id for t in traj.turns)
    assert len(ids) == 7 and images_of(ids) == ids  # INIT + 6 turns, all on disk


def test_keep_every_thins_a_finished_failure_and_replay_restores_the_nearest(
    tmp_path: Path, tokenizer
) -> None:
    """`every: 1, keep_every: 2`: while it runs, a snapshot after every turn (what a
    resume after a kill needs); once it is over, INIT's and every 2nd turn's stay, the
    others are removed and unrecorded, and a replay from turn 3 restores turn 2's."""
    traj = scripted_run(
        load_any(WORDFREQ), DATA / "breaker.yaml", tmp_path, tokenizer, keep_every=2
    )
    try:
        assert traj.reward == 0.0 and len(traj.turns) == 6
        assert traj.env.init_snapshot
        assert [t.snapshot_id is not None for t in traj.turns] == [False, True] * 3
        ids = replay.snapshot_ids([traj])
        assert len(ids) == 4 and sorted(run_snapshots(tmp_path)) == sorted(ids)
        late = asyncio.run(replay.replay(tmp_path, traj.trajectory_id, 3))
        assert late.matched and late.restored_at == 2 and late.replayed_turns == [2, 3, 4, 5]
    finally:
        asyncio.run(_remove(replay.snapshot_ids([traj])))


def test_replay_from_turn_0_and_from_turn_3_matches(broken) -> None:
    out, traj = broken
    whole = asyncio.run(replay.replay(out, traj.trajectory_id, 0))
    assert whole.matched and whole.restored_at == 0 and whole.snapshot == traj.env.init_snapshot
    assert whole.replayed_turns == [0, 1, 2, 3, 4, 5]
    assert whole.reward_replayed == whole.reward_recorded == 0.0

    late = asyncio.run(replay.replay(out, traj.trajectory_id, 3))
    assert late.matched and late.restored_at == 3 and late.snapshot == traj.turns[2].snapshot_id
    assert late.replayed_turns == [3, 4, 5]
    # From turn 4 the sandbox already holds the broken script: turn 4's `cat` shows it.
    after = asyncio.run(replay.replay(out, traj.trajectory_id, 4))
    assert after.matched and after.replayed_turns == [4, 5]
    assert "raise SystemExit(1)" in traj.turns[4].observation


def test_a_nondeterministic_command_is_the_divergence(tmp_path: Path, tokenizer) -> None:
    traj = scripted_run(load_any(WORDFREQ), DATA / "random.yaml", tmp_path, tokenizer)
    try:
        report = asyncio.run(replay.replay(tmp_path, traj.trajectory_id, 0))
        assert not report.matched and report.replayed_turns == [0, 1, 2]
        d = report.divergence
        assert d is not None and (d.turn, d.tool) == (2, "bash")
        assert d.recorded.startswith("roll ") and d.replayed.startswith("roll ")
        assert f"-{d.recorded.splitlines()[0]}" in d.diff
        assert f"+{d.replayed.splitlines()[0]}" in d.diff
        # The CLI says so, with the diff, and exits 3.
        res = subprocess.run(
            [sys.executable, "-m", "agentrl.cli", "replay", str(tmp_path), traj.trajectory_id],
            capture_output=True, text=True, timeout=300, check=False,
        )  # fmt: skip
        assert res.returncode == 3, res.stderr
        assert "diverged at turn 2 (bash)" in res.stdout and "+roll" in res.stdout
    finally:
        asyncio.run(_remove(replay.snapshot_ids([traj])))


def test_without_snapshots_replay_runs_init_again(tmp_path: Path, tokenizer) -> None:
    traj = scripted_run(load_any(WORDFREQ), DATA / "breaker.yaml", tmp_path, tokenizer, every=None)
    assert replay.snapshot_ids([traj]) == []  # the terminal task's default is off
    report = asyncio.run(replay.replay(tmp_path, traj.trajectory_id, 3))
    assert report.snapshot is None and report.restored_at == 0 and report.matched


def test_a_success_drops_its_snapshots_unless_sampled_for_keeping(
    tmp_path: Path, tokenizer
) -> None:
    task = load_any(DATA / "task.yaml")
    script = tmp_path / "solve.yaml"
    script.write_text("- |-\n  ```bash\n  touch notes.txt\n  ```\n")
    dropped = scripted_run(task, script, tmp_path / "a", tokenizer)
    assert dropped.reward == 1.0 and replay.snapshot_ids([dropped]) == []
    assert run_snapshots(tmp_path / "a") == []  # removed, not just unrecorded
    kept = scripted_run(task, script, tmp_path / "b", tokenizer, keep=1.0)
    ids = replay.snapshot_ids([kept])
    assert kept.reward == 1.0 and len(images_of(ids)) == len(ids) == 1 + len(kept.turns)
    asyncio.run(_remove(replay.snapshot_ids([kept])))


def test_branching_from_turn_2_keeps_the_original_prefix(
    tmp_path: Path, tokenizer, tiny_dir: Path
) -> None:
    """The branch's policy is the tiny model (SmolLM2's tokenizer, random weights): what
    it samples is incidental; that its tokens follow the original's prefix is the proof."""
    from agentrl.inference.local import LocalSampler

    task = load_any(DATA / "task.yaml")
    original = scripted_run(task, DATA / "wanderer.yaml", tmp_path, tokenizer)
    assert original.reward == 0.0 and len(original.turns) == 3
    sampler = LocalSampler.for_model(str(tiny_dir))
    try:
        branch, divergence = asyncio.run(
            replay.branch(tmp_path, original.trajectory_id, 2, sampler, tokenizer)
        )
    finally:
        asyncio.run(sampler.close())
    assert divergence is None
    branch.check()
    start = original.turns[2].span[0]  # where turn 2's sampled tokens began
    assert branch.prompt_ids == original.prompt_ids
    assert branch.response_ids[:start] == original.response_ids[:start]
    assert branch.loss_mask[:start] == original.loss_mask[:start]
    assert branch.logprobs[:start] == original.logprobs[:start]
    assert [t.action for t in branch.turns[:2]] == [t.action for t in original.turns[:2]]
    assert len(branch.turns) == 3  # max_turns counts the inherited turns
    # The model's new turn 2 was sampled by the current policy; its tokens are trainable.
    new = range(*branch.turns[2].span)
    assert all(branch.loss_mask[i] == 1 for i in new)
    assert branch.trajectory_id.startswith(f"{original.trajectory_id}~2-")
    (stored,) = TrajectoryStore(tmp_path / replay.BRANCHES)
    assert stored == branch
    # The branch inherits the original's restore points and never removes them.
    assert branch.env.init_snapshot == original.env.init_snapshot
    assert [t.snapshot_id for t in branch.turns[:2]] == [t.snapshot_id for t in original.turns[:2]]
    ids = replay.snapshot_ids([original])
    assert images_of(ids) == ids
    asyncio.run(_remove(replay.snapshot_ids([original, branch])))


def test_shell_opens_in_the_restored_sandbox_and_failures_lists_the_episode(broken) -> None:
    out, traj = broken
    argv = [sys.executable, "-m", "agentrl.cli", "replay", str(out), traj.trajectory_id]
    # on a terminal, as a person runs it (spawned with no Python between fork and exec)
    child, process = spawn_on_pty(
        [*argv, "--from-turn", "4", "--shell"], cwd=None, env=None, size=(24, 200)
    )
    child.timeout = 120
    child.expect(rb"[#$] ")
    child.sendline(b"cat /app/wordfreq.py; exit")
    child.expect(b"raise SystemExit")
    child.expect(pexpect.EOF)
    child.close()
    assert process.wait(timeout=60) == 0

    res = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "failures", str(out)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "finished" in res.stdout and "reward 0" in res.stdout
    assert f"#1  agentrl replay {out} {traj.trajectory_id}\n" in res.stdout
    assert "snapshots of these episodes: 7, " in res.stdout


def test_gc_reclaims_the_snapshots_of_a_killed_driver(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "agentrl.cli", "run", str(WORDFREQ), "--policy",
            f"scripted:{DATA / 'breaker.yaml'}", "--snapshots", "1", "--out", str(tmp_path),
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 300
    while not (tmp_path / "run.json").exists():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)

    def snapshots() -> list[str]:
        return run_snapshots(tmp_path)

    while len(snapshots()) < 2:  # INIT and at least one turn committed
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.1)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    left = snapshots()
    assert left  # the driver died holding them
    # Its journal offers the episode in flight a resume from them: gc leaves them...
    assert (tmp_path / "inflight.jsonl").is_file()
    gc(snapshots=True)
    assert set(left) <= set(snapshots())
    # ...until the run folder is gone (nothing can resume it any more).
    (tmp_path / "inflight.jsonl").unlink()
    report = gc(snapshots=True)
    assert snapshots() == []
    assert report.snapshots >= len(left) and report.snapshot_bytes > 0


def test_gc_keeps_a_finished_runs_snapshots_and_replay_goes_past_removed_ones(
    tmp_path: Path,
) -> None:
    """A newcomer's `agentrl gc --snapshots` after a finished run removed every snapshot it
    had, and replay then failed on the first missing image ("snapshot again")."""
    out = tmp_path / "run"
    cli = [sys.executable, "-m", "agentrl.cli"]
    done = subprocess.run(
        [*cli, "run", str(WORDFREQ), "--policy", f"scripted:{DATA / 'breaker.yaml'}",
         "--snapshots", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode in (0, 2), done.stderr  # 2: the episode failed, as scripted
    (traj,) = TrajectoryStore(out / "trajectories.jsonl")
    made = run_snapshots(out)
    assert len(made) == 7
    gc(snapshots=True)  # the run's process exited: its snapshots are kept for replay
    assert sorted(run_snapshots(out)) == sorted(made)

    # Two of them removed by hand: replay from turn 3 goes back to the one before turn 1.
    asyncio.run(_remove([traj.turns[2].snapshot_id or "", traj.turns[1].snapshot_id or ""]))
    report = asyncio.run(replay.replay(out, traj.trajectory_id, 3))
    assert report.restored_at == 1 and report.snapshot == traj.turns[0].snapshot_id
    assert len(report.gone) == 2 and "before turn 3" in report.gone[0]
    assert report.matched and report.reward_replayed == report.reward_recorded

    # Named, the run's snapshots go; replay then runs INIT again.
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    gone = subprocess.run(
        [*cli, "gc", "--run", run_id, "--snapshots"], capture_output=True, text=True, timeout=120
    )
    assert gone.returncode == 0, gone.stderr
    assert run_snapshots(out) == []
    again = asyncio.run(replay.replay(out, traj.trajectory_id, 2))
    assert again.restored_at == 0 and again.snapshot is None and len(again.gone) == 3
    assert again.matched and again.reward_replayed == again.reward_recorded


class _SlowCommits:
    """The real Docker provider, but each commit starts 1 s late and is timed: what a big
    sandbox's commit would look like."""

    name = "docker"

    def __init__(self, log: list[tuple[str, float]]) -> None:
        self.inner, self.log = DockerProvider(reap_at_start=False), log

    def __getattr__(self, attr: str):
        return getattr(self.inner, attr)

    async def start(self, spec):
        return _SlowSandbox(await self.inner.start(spec), self.log)


class _SlowSandbox:
    def __init__(self, inner, log: list[tuple[str, float]]) -> None:
        self.inner, self.log = inner, log

    def __getattr__(self, attr: str):
        return getattr(self.inner, attr)

    async def snapshot(self, label: str) -> str:
        await asyncio.sleep(1.0)
        snapshot_id = await self.inner.snapshot(label)
        self.log.append((f"committed {label}", time.monotonic()))
        return snapshot_id


class _Stamped(ScriptedSampler):
    def __init__(self, replies, tokenizer, log: list[tuple[str, float]]) -> None:
        super().__init__(replies, tokenizer)
        self.log = log

    async def generate(self, prompt_ids, params, session_id=None):
        self.log.append(("generate", time.monotonic()))
        return await super().generate(prompt_ids, params, session_id)


def test_a_commit_overlaps_the_next_generation_and_precedes_the_next_action(
    tmp_path: Path, tokenizer
) -> None:
    events: list[tuple[str, float]] = []
    task = load_any(DATA / "task.yaml")
    sampler = _Stamped(load_script(DATA / "wanderer.yaml"), tokenizer, events)
    asyncio.run(
        run_task(task, sampler, tokenizer, _SlowCommits(events), tmp_path, show_progress=False)
    )
    (traj,) = TrajectoryStore(tmp_path / "trajectories.jsonl")
    try:
        order = [name for name, _ in sorted(events, key=lambda e: e[1])]
        # Every generation after the first started while the previous commit was running.
        assert order == [
            "generate",
            "committed init",  # INIT's commit overlapped the first generation
            "generate",
            "committed turn-000",
            "generate",
            "committed turn-001",
            "committed turn-002",
        ]
        # And no action ran before its predecessor's commit: turn 2 deletes old.txt, and
        # the state restored from turn 1's snapshot still has it, so replay matches.
        report = asyncio.run(replay.replay(tmp_path, traj.trajectory_id, 2))
        assert report.matched and report.restored_at == 2
    finally:
        asyncio.run(_remove(replay.snapshot_ids([traj])))


def test_replay_on_the_local_provider(tmp_path: Path, tokenizer) -> None:
    """The same snapshots and replay with no Docker at all (folder copies)."""
    from agentrl.sandbox.local import LocalProvider

    task = load_any(DATA / "task.yaml")
    sampler = ScriptedSampler(load_script(DATA / "wanderer.yaml"), tokenizer)
    asyncio.run(run_task(task, sampler, tokenizer, LocalProvider(), tmp_path, show_progress=False))
    (traj,) = TrajectoryStore(tmp_path / "trajectories.jsonl")
    assert traj.env.provider == "local" and len(replay.snapshot_ids([traj])) == 4
    try:
        for k in (0, 2):
            report = asyncio.run(replay.replay(tmp_path, traj.trajectory_id, k))
            assert report.matched and report.restored_at == k
    finally:
        asyncio.run(_remove_local(replay.snapshot_ids([traj])))


async def _remove_local(ids: list[str]) -> None:
    from agentrl.sandbox.local import LocalProvider, snapshots_dir

    freed = [await LocalProvider().remove_snapshot(i) for i in ids]
    assert sum(freed) >= 3 * len("draft\n")  # old.txt, in every snapshot before turn 2's rm
    assert not any((snapshots_dir() / i).exists() for i in ids)


def test_restore_point_falls_back_to_the_latest_earlier_snapshot(broken) -> None:
    _, traj = broken
    sparse = traj.model_copy(
        update={
            "turns": [
                t.model_copy(update={"snapshot_id": t.snapshot_id if i % 2 else None})
                for i, t in enumerate(traj.turns)
            ]
        }
    )  # what `every: 2` records: after turns 1, 3, 5
    assert replay.restore_point(sparse, 3) == (2, traj.turns[1].snapshot_id)
    assert replay.restore_point(sparse, 1) == (0, traj.env.init_snapshot)
    bare = sparse.model_copy(update={"env": sparse.env.model_copy(update={"init_snapshot": None})})
    assert replay.restore_point(bare, 1) == (0, None)  # nothing before: INIT again


def test_keep_gb_holds_the_newest_failures_within_the_bound(tmp_path: Path, tokenizer) -> None:
    """`keep_gb`: four failed episodes, one after another, on the local provider (its
    snapshots are folder copies, so their sizes are exact). With room for two episodes'
    snapshots, the two that finished first lose theirs as the later ones finish, what is
    left is within the bound, and a replay of a removed one runs INIT again."""
    from agentrl.dispatch.base import PipelineConfig
    from agentrl.sandbox.local import LocalProvider

    task = load_any(DATA / "task.yaml")
    provider = LocalProvider()

    def run(out: Path, samples: int, keep_gb: float | None) -> list[Trajectory]:
        sampler = ScriptedSampler(load_script(DATA / "wanderer.yaml"), tokenizer)
        policy = SnapshotPolicy(every=1, keep_gb=keep_gb)
        asyncio.run(
            run_task(
                task, sampler, tokenizer, provider, out, show_progress=False, snapshots=policy,
                samples=samples, dispatcher=PipelineConfig(concurrency=1),
            )
        )  # fmt: skip
        return list(TrajectoryStore(out / "trajectories.jsonl"))

    async def sizes(ids: list[str]) -> list[int]:
        return [await provider.snapshot_bytes(i) for i in ids]

    (one,) = run(tmp_path / "one", 1, None)
    episode = sum(asyncio.run(sizes(replay.snapshot_ids([one]))))
    asyncio.run(_remove_local(replay.snapshot_ids([one])))
    assert episode > 0
    trajs = run(tmp_path / "four", 4, 2.5 * episode / 2**30)
    ids = [replay.snapshot_ids([t]) for t in trajs]  # as each recorded them, in finish order
    try:
        assert [t.reward for t in trajs] == [0.0] * 4 and all(len(i) == 4 for i in ids)
        on_disk = [sum(asyncio.run(sizes(i))) for i in ids]
        assert on_disk[:2] == [0, 0] and on_disk[2:] == [episode, episode]
        assert sum(on_disk) <= 2.5 * episode
        report = asyncio.run(replay.replay(tmp_path / "four", trajs[0].trajectory_id, 2))
        assert report.snapshot is None and report.restored_at == 0 and report.matched
    finally:
        asyncio.run(_remove_local([i for group in ids[2:] for i in group]))
