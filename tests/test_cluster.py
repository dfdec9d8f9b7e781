"""agentrl on a real Ray cluster of 3 nodes on 127.0.0.1 (head + 2 sandbox workers), each
node a separate `ray start` process group, sandboxes in the real Docker engine.

The dispatcher is the same; only where an episode's sandbox lives changes. Trajectories
must be the single-process ones field for field (but for the node that hosted them);
killing a node mid-rollout must account for every episode and leak no container; a
training step runs with sandboxes, sampler replicas and a trainer rank on the cluster.
No GPU here: sampler replicas and ranks run on CPU (gloo), which is the code path a GPU
node runs with nccl.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest

from agentrl.cluster import local
from agentrl.dispatch import PipelineConfig
from agentrl.episode import Episode
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.scripted import ScriptedSampler, load_script
from agentrl.sandbox.docker import DockerProvider
from agentrl.tasks.env import EpisodeEnv, TaskEnv
from agentrl.tasks.load import load_task
from agentrl.tasks.spec import Instance, Task
from agentrl.trajectory import INFRA_STOP_REASONS, StopReason, Trajectory, TrajectoryStore

pytestmark = [pytest.mark.docker, pytest.mark.model, pytest.mark.slow]
TESTS = Path(__file__).parent
DISPATCH = TESTS / "data" / "dispatch"
TRAIN = TESTS / "data" / "train"
SANDBOXES_PER_NODE = 3


CHILD = "AGENTRL_TEST_CLUSTER_DIR"
"""Set in the pytest subprocess a `driver` test runs in: the parent's cluster folder."""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[local.ClusterState]:
    if child := os.environ.get(CHILD):  # a driver test's subprocess: the parent's cluster
        state = local.load_state(Path(child))
        assert state is not None
        state.__dict__["folder"] = Path(child)
        yield state
        return
    folder = tmp_path_factory.mktemp("cluster")
    state = local.up(folder, workers=2, sandboxes=SANDBOXES_PER_NODE, cpus=4)
    state.__dict__["folder"] = folder
    warnings = _Warnings()
    logging.getLogger("agentrl.cluster.local").addHandler(warnings)
    try:
        yield state
    finally:
        local.down(folder)
        logging.getLogger("agentrl.cluster.local").removeHandler(warnings)
    # Every node stopped on SIGTERM, none had to be killed (Ray's drain held a head 30 s).
    assert not warnings.seen, warnings.seen


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.seen.append(record.getMessage())


@pytest.fixture(scope="module")
def connected(cluster: local.ClusterState) -> local.ClusterState:
    """The cluster, joined as a Ray driver only in a `driver` test's subprocess."""
    if os.environ.get(CHILD):
        from agentrl.cluster import connect

        connect(cluster.address)
    return cluster


DRIVER_TESTS: list[str] = []
"""The tests that join the cluster as a Ray driver: all of them run in one subprocess."""
_children: dict[str, tuple[dict[str, str], str]] = {}


def driver(test: Callable[..., None]) -> Callable[..., None]:
    """Run the test in a pytest subprocess: a Ray driver's threads make fork() unsafe in
    its process (seen: pty.fork segfaulting in later tests that start shells), so this
    process never joins the cluster. Every driver test of the module runs in one such
    subprocess (started by the first of them); each test then reports its own outcome."""
    DRIVER_TESTS.append(test.__name__)

    @functools.wraps(test)
    def wrapper(*args: Any, **kwargs: Any) -> None:
        if os.environ.get(CHILD):
            return test(*args, **kwargs)
        outcomes, output = _child_run(kwargs["connected"].__dict__["folder"])
        assert outcomes.get(test.__name__) == "PASSED", output[-8000:]
        return None

    return wrapper


def _child_run(folder: Path) -> tuple[dict[str, str], str]:
    """Outcome of every driver test (by name) in one pytest subprocess, and its output."""
    if str(folder) not in _children:
        nodeids = [f"{Path(__file__).relative_to(TESTS.parent)}::{n}" for n in DRIVER_TESTS]
        proc = subprocess.run(
            [sys.executable, "-m", "pytest", *nodeids, "-q", "-rA", "-p", "no:cacheprovider"]
            + ["-n", "0"],  # in that one process, not in pytest-xdist workers (addopts)
            capture_output=True,
            text=True,
            timeout=1800,
            cwd=TESTS.parent,
            env={**os.environ, CHILD: str(folder)},
        )
        outcomes = {}
        for line in proc.stdout.splitlines():
            word, _, rest = line.partition(" ")
            if word in ("PASSED", "FAILED", "ERROR", "SKIPPED") and "::" in rest:
                outcomes.setdefault(rest.split("::", 1)[1].split(" ", 1)[0], word)
        _children[str(folder)] = (outcomes, proc.stdout + proc.stderr)
    return _children[str(folder)]


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer()


@pytest.fixture(scope="module")
def probe() -> Task:
    return load_task(DISPATCH / "probe.yaml")


def instance(id: str, tool_s: float = 0.2) -> Instance:
    fields = {"fail_setup": "no", "crash_grader": "no", "init_s": 0, "tool_s": tool_s}
    return Instance(id=id, fields=fields)


def rollout(
    task: Task, tokenizer: Any, env: EpisodeEnv, instances: list[Instance], **options: Any
) -> list[Trajectory]:
    sampler = ScriptedSampler(load_script(DISPATCH / "sleeper.yaml"), tokenizer)
    episodes = [Episode(task, inst, 0, sampler, tokenizer, env) for inst in instances]
    dispatcher = PipelineConfig(**options).build()

    async def main() -> list[Trajectory]:
        async with aclosing(dispatcher.run(episodes)) as stream:
            return [t async for t in stream]

    return asyncio.run(main())


def on_cluster(task: Task, run_id: str, body: Any) -> Any:
    """Run `body(env, fleet)` with a fresh fleet on the cluster; the fleet closed after."""
    from agentrl.cluster.sandboxes import RemoteTaskEnv, SandboxFleet

    async def main() -> Any:
        fleet = SandboxFleet(run_id, refresh_s=1.0)
        await fleet.start()
        try:
            return await body(RemoteTaskEnv(task, fleet, run_id), fleet)
        finally:
            await fleet.close()

    return asyncio.run(main())


def node_containers(run_id: str) -> dict[str, list[dict[str, Any]]]:
    from agentrl.sandbox.images import docker_client

    client = docker_client()
    try:
        found = client.api.containers(all=True, filters={"label": f"agentrl.run={run_id}"})
    finally:
        client.close()
    by_node: dict[str, list[dict[str, Any]]] = {}
    for c in found:
        by_node.setdefault(c["Labels"].get("agentrl.node", ""), []).append(c)
    return by_node


def contract(t: Trajectory) -> dict[str, Any]:
    """Everything a trajectory carries, but where and how fast it ran."""
    data = t.model_dump(mode="json")
    data["env"].pop("node"), data.pop("seconds")
    for turn in data["turns"]:
        turn.pop("gen_seconds", None), turn.pop("tool_seconds", None)
    return data


@driver
def test_episodes_on_two_worker_nodes_are_the_single_process_trajectories(
    connected: local.ClusterState, probe: Task, tokenizer: Any, run_id: str
) -> None:
    instances = [instance(f"i{k}") for k in range(6)]
    here = rollout(probe, tokenizer, TaskEnv(probe, DockerProvider(), run_id), instances)

    async def there_body(env: EpisodeEnv, fleet: Any) -> list[Trajectory]:
        return await asyncio.to_thread(rollout, probe, tokenizer, env, instances, concurrency=6)

    there = on_cluster(probe, run_id, there_body)
    assert Counter(t.env.node for t in there) == {"w1": 3, "w2": 3}  # spread by load
    assert {t.env.node for t in here} == {None}
    by_id = {t.trajectory_id: t for t in here}
    assert sorted(by_id) == sorted(t.trajectory_id for t in there)
    for t in there:
        assert t.stop_reason == StopReason.finished and t.reward == 1.0
        assert contract(t) == contract(by_id[t.trajectory_id])


@driver
def test_branch_credit_restores_each_state_on_the_node_holding_its_snapshot(
    connected: local.ClusterState, tmp_path: Path, run_id: str
) -> None:
    """Episodes on two nodes, each branched before turns 1 and 2: every continuation runs
    where its parent's snapshot is, no node goes over its capacity, and every snapshot
    is reclaimed on its node."""
    from test_branch_credit import TASK, BranchConfig, branched_rollout, train_run

    task = load_task(TASK)
    peak: Counter[str] = Counter()

    async def body(env: EpisodeEnv, fleet: Any) -> list[Trajectory]:
        async def watch() -> None:
            while True:
                for w in fleet.alive():
                    peak[w.node] = max(peak[w.node], w.live)
                await asyncio.sleep(0.01)

        watcher = asyncio.create_task(watch())
        try:
            run = train_run(tmp_path, BranchConfig(k=2), env=env)
            return await branched_rollout(run, instances=2, samples=2)
        finally:
            watcher.cancel()

    trajs = on_cluster(task, run_id, body)
    fresh = {t.trajectory_id: t for t in trajs if t.branch_of is None}
    conts = [t for t in trajs if t.branch_of is not None]
    assert len(fresh) == 4 and len(conts) == 4 * 2 * 2
    assert all(t.trainable for t in trajs), [t.error for t in trajs if not t.trainable]
    for c in conts:
        assert c.branch_of is not None
        assert c.env.node == fresh[c.branch_of.trajectory_id].env.node
    assert len({t.env.node for t in fresh.values()}) == 2  # both nodes hosted episodes
    assert max(peak.values()) <= SANDBOXES_PER_NODE
    assert _snapshot_images(run_id) == []


def _snapshot_images(run_id: str) -> list[str]:
    from agentrl.sandbox.docker.engine import SNAPSHOT_OF
    from agentrl.sandbox.images import docker_client

    client = docker_client()
    try:
        images = client.api.images(filters={"label": f"{SNAPSHOT_OF}={run_id}"})
    finally:
        client.close()
    return [i["Id"] for i in images]


@driver
def test_a_nodes_sandbox_resource_is_a_hard_limit(
    connected: local.ClusterState, probe: Task, tokenizer: Any, run_id: str
) -> None:
    """Nine episodes at once on 2 nodes x 3 slots: the last three wait for a free slot."""
    peaks: Counter[str] = Counter()

    async def body(env: EpisodeEnv, fleet: Any) -> list[Trajectory]:
        instances = [instance(f"c{k}", tool_s=1) for k in range(9)]
        run = asyncio.create_task(
            asyncio.to_thread(rollout, probe, tokenizer, env, instances, concurrency=9)
        )
        while not run.done():
            for node, found in node_containers(run_id).items():
                peaks[node] = max(peaks[node], len(found))
            await asyncio.sleep(0.1)
        return await run

    trajs = on_cluster(probe, run_id, body)
    assert [t.stop_reason for t in trajs] == [StopReason.finished] * 9
    assert set(peaks) == {"w1", "w2"} and max(peaks.values()) <= SANDBOXES_PER_NODE


@driver
def test_a_tool_error_raised_on_a_node_reaches_the_driver_whole(
    connected: local.ClusterState, probe: Task, tokenizer: Any, run_id: str
) -> None:
    from agentrl.errors import SandboxError

    async def body(env: EpisodeEnv, fleet: Any) -> None:
        sandbox = await env.init(instance("e"), "e_0")
        try:
            with pytest.raises(SandboxError, match="not open on node") as e:
                await fleet.alive()[0].call("exec", "no-such-sandbox", None)
            assert type(e.value) is SandboxError and "\n" not in str(e.value)
            got = await sandbox.read_file("/tmp/tool_s")
            assert got.strip() == b"0.2"
        finally:
            await sandbox.close()
            await sandbox.close()  # idempotent

    on_cluster(probe, run_id, body)


@driver
def test_killing_a_worker_node_mid_rollout_accounts_for_every_episode_and_leaks_nothing(
    connected: local.ClusterState, probe: Task, tokenizer: Any, run_id: str
) -> None:
    folder = connected.__dict__["folder"]

    async def body(env: EpisodeEnv, fleet: Any) -> dict[str, Any]:
        instances = [instance(f"k{k}", tool_s=8) for k in range(6)]
        run = asyncio.create_task(
            asyncio.to_thread(rollout, probe, tokenizer, env, instances, concurrency=6)
        )
        deadline = time.monotonic() + 120
        while len(node_containers(run_id).get("w2", [])) < SANDBOXES_PER_NODE:
            assert time.monotonic() < deadline and not run.done(), "w2 never got its sandboxes"
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # most of them past INIT, in their 8 s tool call
        local.kill_node("w2", folder)
        # What the dead node left running, listed at once: their owners are dead, so any
        # agentrl process on this host may reap them from now on (another xdist worker's
        # new DockerProvider does), not only the node when it returns.
        orphans = node_containers(run_id).get("w2", [])
        killed = await run
        # The run goes on with the node left...
        after = await asyncio.to_thread(
            rollout, probe, tokenizer, env, [instance(f"a{k}") for k in range(3)]
        )
        # ...and the node comes back (`agentrl cluster up` restarts dead nodes).
        up = subprocess.run(
            [sys.executable, "-m", "agentrl.cli", "cluster", "--dir", str(folder), "up"],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert up.returncode == 0, up.stdout + up.stderr
        await fleet.refresh()
        back = await asyncio.to_thread(
            rollout, probe, tokenizer, env, [instance(f"b{k}") for k in range(6)], concurrency=6
        )
        return {"killed": killed, "after": after, "orphans": orphans, "back": back}

    got = on_cluster(probe, run_id, body)
    killed: list[Trajectory] = got["killed"]
    assert sorted(t.trajectory_id for t in killed) == [f"k{k}_0" for k in range(6)]
    lost = [t for t in killed if t.stop_reason == StopReason.sandbox_error]
    assert lost, "the kill ended no episode"
    for t in lost:  # in RUN on w2 (node recorded), or in its INIT there with no retry left
        assert t.env.node in ("w2", None) and not t.trainable
        assert "sandbox node w2 is gone" in (t.error or "")
    for t in killed:
        if t not in lost:  # on w1 all along, or INIT retried on w1 after w2 died
            assert (t.stop_reason, t.reward, t.env.node) == (StopReason.finished, 1.0, "w1")
    assert {(t.env.node, t.stop_reason) for t in got["after"]} == {("w1", StopReason.finished)}
    assert len(got["orphans"]) == SANDBOXES_PER_NODE  # left running by the dead node...
    assert "w2" not in node_containers(run_id)  # ...reaped once it returned
    assert {t.env.node for t in got["back"]} == {"w1", "w2"}
    assert all(t.stop_reason == StopReason.finished for t in got["back"])


def test_a_training_step_with_sandboxes_samplers_and_a_trainer_rank_on_the_cluster(
    connected: local.ClusterState, tiny_dir: Path, tmp_path: Path
) -> None:
    """Sandboxes on both workers, two sampler replicas behind the router, rank 1 as a
    Ray actor: the step trains on rank 0's whole batch (the loss equals one rank's on the
    recorded trajectories) and both replicas confirm the published version."""
    from agentrl.algorithms import compute_advantages
    from agentrl.backends.base import samples_from
    from agentrl.train.data import run_temperature
    from agentrl.train_config import load_train_config

    config = tmp_path / "train.yaml"
    config.write_text(
        f"name: tiny-cluster\ntasks: [{TRAIN / 'task.yaml'}]\nmodel: {tiny_dir}\n"
        "backend: {type: fsdp, lr: 1.0e-3}\n"
        "schedule: {type: sync, steps: 1, prompts_per_step: 3, n_samples_per_prompt: 4}\n"
        "dispatcher: {type: pipeline, concurrency: 6}\neval: {holdout_every: 4, samples: 1}\n"
        f"cluster:\n  address: {connected.address}\n"
        "  samplers: {replicas: 2, num_cpus: 0}\n  trainer: {ranks: 2, num_cpus: 1}\n"
        "seed: 5\n"
    )
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", str(config), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "NO_PROXY": "127.0.0.1,127.0.0.2,localhost"},
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert "Traceback" not in proc.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if r["kind"] == "train"]
    assert row["policy_version"] == 2 and row["sequences"] == 12
    assert [r["version"] for r in row["replicas"]] == [2, 2]
    assert all(r["healthy"] and not r["quarantined"] and r["served"] > 0 for r in row["replicas"])
    trajs = list(TrajectoryStore(out / "trajectories.jsonl"))
    assert {t.env.node for t in trajs} == {"w1", "w2"}
    assert all(t.stop_reason not in INFRA_STOP_REASONS and t.trainable for t in trajs), [
        (t.stop_reason, t.error) for t in trajs
    ]

    cfg = load_train_config(config)
    samples = samples_from(trajs, compute_advantages(trajs, cfg.algorithm.advantage))
    temperature = run_temperature([load_task(TRAIN / "task.yaml")])
    one = cfg.backend.model_copy(update={"temperature": temperature, "seed": cfg.seed})
    backend = one.build(str(tiny_dir))
    try:
        got = backend.forward_backward(samples, cfg.algorithm.loss)
        got.update(backend.optim_step())
    finally:
        backend.close()
    assert got["loss"] == pytest.approx(row["loss"], rel=1e-4, abs=1e-6)
    assert got["grad_norm"] == pytest.approx(row["grad_norm"], rel=1e-3)


def test_an_unreachable_cluster_is_one_clear_error(tmp_path: Path) -> None:
    from agentrl.http import free_port

    port = free_port()  # nothing listens there
    config = tmp_path / "train.yaml"
    config.write_text(
        (TRAIN / "train.yaml")
        .read_text()
        .replace("tasks: [task.yaml]", f"tasks: [{TRAIN}/task.yaml]")
        + f"cluster: {{address: '127.0.0.1:{port}'}}\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "train", str(config), "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "cannot join the Ray cluster at 127.0.0.1:" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_without_a_cluster_section_ray_is_never_imported(tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from agentrl.train_config import load_train_config\n"
        "import agentrl.train, agentrl.cli\n"
        f"load_train_config({str(TRAIN / 'train.yaml')!r})\n"
        "assert 'ray' not in sys.modules, 'ray was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_cluster_status_names_every_node(connected: local.ClusterState) -> None:
    folder = connected.__dict__["folder"]
    proc = subprocess.run(
        [sys.executable, "-m", "agentrl.cli", "cluster", "--dir", str(folder), "status"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert connected.address in proc.stdout
    for name in ("head", "w1", "w2"):
        assert name in proc.stdout
