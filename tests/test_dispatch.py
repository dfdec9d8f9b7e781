"""The dispatchers on real Docker sandboxes with the scripted policy and a real tokenizer.

Every submitted episode comes back exactly once; one episode's failure (setup, grader,
a stage timeout) is its own failed trajectory; cancelling a run leaves no container;
the pipeline never has more live sandboxes than configured, as the engine counts them.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import pytest
from conftest import labelled_images
from pydantic import TypeAdapter

from agentrl.dispatch import DispatchConfig, PipelineConfig
from agentrl.episode import Episode
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.scripted import ScriptedSampler, load_script
from agentrl.sandbox.docker import RUN, DockerProvider
from agentrl.sandbox.images import docker_client
from agentrl.tasks.env import TaskEnv
from agentrl.tasks.load import load_task
from agentrl.tasks.spec import Instance, Task
from agentrl.trajectory import StopReason, Trajectory

pytestmark = [pytest.mark.docker, pytest.mark.model]
DATA = Path(__file__).parent / "data" / "dispatch"


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer()


@pytest.fixture(scope="module")
def task() -> Task:
    return load_task(DATA / "probe.yaml")


def instance(id: str, **fields: Any) -> Instance:
    base = {"fail_setup": "no", "crash_grader": "no", "init_s": 0, "tool_s": 0.2}
    return Instance(id=id, fields={**base, **fields})


def live(run_id: str) -> int:
    client = docker_client()
    try:
        return len(client.api.containers(all=True, filters={"label": f"{RUN}={run_id}"}))
    finally:
        client.close()


def episodes(task: Task, tokenizer: Any, instances: list[Instance], run_id: str) -> list[Episode]:
    env = TaskEnv(task, DockerProvider(), run_id)
    sampler = ScriptedSampler(load_script(DATA / "sleeper.yaml"), tokenizer)
    return [Episode(task, inst, 0, sampler, tokenizer, env) for inst in instances]


def dispatch(
    task: Task, tokenizer: Any, instances: list[Instance], name: str, **options: Any
) -> tuple[list[Trajectory], Any, str]:
    run_id = f"test-dispatch-{uuid.uuid4().hex[:8]}"
    dispatcher = TypeAdapter(DispatchConfig).validate_python({"type": name, **options}).build()

    async def main() -> list[Trajectory]:
        eps = episodes(task, tokenizer, instances, run_id)
        async with aclosing(dispatcher.run(eps)) as stream:
            return [traj async for traj in stream]

    trajs = asyncio.run(main())
    assert live(run_id) == 0
    return trajs, dispatcher.metrics, run_id


@pytest.mark.parametrize("name", ["batch", "pipeline", "sync"])
def test_every_episode_comes_back_exactly_once(task: Task, tokenizer: Any, name: str) -> None:
    instances = [instance(f"i{k}", tool_s=0.1 * k) for k in range(5)]
    trajs, metrics, _ = dispatch(task, tokenizer, instances, name, concurrency=2)
    assert Counter(t.trajectory_id for t in trajs) == {f"i{k}_0": 1 for k in range(5)}
    assert {(t.stop_reason, t.reward) for t in trajs} == {(StopReason.finished, 1.0)}
    assert metrics.episodes == 5 and metrics.peaks["generating"] <= 2
    assert 0 < metrics.utilisation_mean <= 1 and len(metrics.timings) == 5
    assert metrics.model_dump_json()


@pytest.mark.parametrize("name", ["batch", "pipeline", "sync"])
def test_one_crashing_episode_never_takes_the_others_down(
    task: Task, tokenizer: Any, name: str
) -> None:
    instances = [
        instance("ok0"),
        instance("badsetup", fail_setup="yes"),
        instance("crash", crash_grader="yes"),
        instance("ok1"),
    ]
    trajs, _, _ = dispatch(task, tokenizer, instances, name, concurrency=2, init_attempts=2)
    by_id = {t.trajectory_id: t for t in trajs}
    assert len(trajs) == 4 and set(by_id) == {"ok0_0", "badsetup_0", "crash_0", "ok1_0"}
    bad = by_id["badsetup_0"]
    assert bad.stop_reason == StopReason.sandbox_error and "setup command" in (bad.error or "")
    assert bad.env.init_attempts == 2 and not bad.trainable
    crash = by_id["crash_0"]
    assert crash.stop_reason == StopReason.eval_error and crash.reward is None and crash.error
    for ok in ("ok0_0", "ok1_0"):
        assert by_id[ok].stop_reason == StopReason.finished and by_id[ok].reward == 1.0
        assert by_id[ok].env.init_attempts == 1


def test_stage_timeouts_give_their_stop_reasons(task: Task, tokenizer: Any) -> None:
    instances = [instance("slowinit", init_s=30), instance("slowtool", tool_s=30), instance("ok")]
    started = time.monotonic()
    trajs, _, _ = dispatch(
        # 8 s: a container start on a loaded 2-core machine can take several seconds.
        task,
        tokenizer,
        instances,
        "pipeline",
        init_timeout=8,
        run_timeout=3,
        init_attempts=1,
    )
    assert time.monotonic() - started < 25  # neither sleep ran out
    by_id = {t.trajectory_id: t for t in trajs}
    assert by_id["slowinit_0"].stop_reason == StopReason.sandbox_error
    assert "INIT timed out" in (by_id["slowinit_0"].error or "")
    assert by_id["slowtool_0"].stop_reason == StopReason.episode_timeout
    assert by_id["slowtool_0"].reward == 1.0  # graded as the agent left it
    assert by_id["ok_0"].stop_reason == StopReason.finished


def test_a_run_that_times_out_before_its_first_completion_is_not_the_agents_failure(
    task: Task, tokenizer: Any
) -> None:
    """A sampler too slow to answer once (here: simulated, 1 s per decode step) leaves the
    agent nothing to be judged on: an aborted episode with zero loss mask, not a 0 reward."""
    from agentrl.inference.simulated import LatencyModel, Script, SimulatedSampler

    run_id = f"test-dispatch-{uuid.uuid4().hex[:8]}"
    script = {"ok_0": Script(replies=["never finished"], tokens=[1000])}
    sampler = SimulatedSampler(script, tokenizer, LatencyModel(base_s=1.0, per_request_s=0.0))
    env = TaskEnv(task, DockerProvider(), run_id)
    ep = Episode(task, instance("ok"), 0, sampler, tokenizer, env)

    async def main() -> list[Trajectory]:
        stream = PipelineConfig(run_timeout=2).build().run([ep])
        async with aclosing(stream):
            got = [traj async for traj in stream]
        await sampler.close()
        return got

    (traj,) = asyncio.run(main())
    assert live(run_id) == 0
    assert traj.stop_reason == StopReason.aborted and not traj.trainable
    assert "before the first completion" in (traj.error or "")
    assert sum(traj.loss_mask) == 0 and traj.reward is None


def test_a_slow_sampler_is_not_held_against_the_agents_episode_timeout(
    task: Task, tokenizer: Any
) -> None:
    """episode_timeout is the agent's own time: a sampler that takes 3 s a reply (shared,
    loaded) does not time out an agent with 2 s, whose tools take 0.2 s; a tool that takes
    5 s does."""
    from agentrl.inference.simulated import LatencyModel, Script, SimulatedSampler

    run_id = f"test-dispatch-{uuid.uuid4().hex[:8]}"
    limits = task.spec.limits.model_copy(update={"episode_timeout": 2.0, "tool_timeout": 2.0})
    short = task.model_copy(update={"spec": task.spec.model_copy(update={"limits": limits})})
    replies = load_script(DATA / "sleeper.yaml")
    script = {f"{i}_0": Script(replies=replies, tokens=[30, 30]) for i in ("slowgen", "slowtool")}
    sampler = SimulatedSampler(script, tokenizer, LatencyModel(base_s=0.1, per_request_s=0.0))
    env = TaskEnv(short, DockerProvider(), run_id)
    eps = [
        Episode(short, instance("slowgen"), 0, sampler, tokenizer, env),
        Episode(short, instance("slowtool", tool_s=5), 0, sampler, tokenizer, env),
    ]

    async def main() -> list[Trajectory]:
        async with aclosing(PipelineConfig(concurrency=1).build().run(eps)) as stream:
            got = [traj async for traj in stream]
        await sampler.close()
        return got

    by_id = {t.trajectory_id: t for t in asyncio.run(main())}
    assert live(run_id) == 0
    slow = by_id["slowgen_0"]
    assert sum(turn.gen_seconds for turn in slow.turns) > 2.0  # longer than episode_timeout
    assert slow.stop_reason == StopReason.finished and slow.reward == 1.0
    assert by_id["slowtool_0"].stop_reason == StopReason.episode_timeout


@pytest.mark.parametrize("name", ["batch", "pipeline", "sync"])
def test_cancelling_a_run_leaves_no_containers(task: Task, tokenizer: Any, name: str) -> None:
    run_id = f"test-dispatch-cancel-{uuid.uuid4().hex[:8]}"
    got: list[Trajectory] = []

    async def main() -> None:
        eps = episodes(task, tokenizer, [instance(f"c{k}", tool_s=60) for k in range(4)], run_id)
        dispatcher = (
            TypeAdapter(DispatchConfig).validate_python({"type": name, "concurrency": 2}).build()
        )

        async def consume() -> None:
            async with aclosing(dispatcher.run(eps)) as stream:
                got.extend([t async for t in stream])

        consumer = asyncio.create_task(consume())
        deadline = time.monotonic() + 30
        while await asyncio.to_thread(live, run_id) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # the tools are sleeping now
        consumer.cancel()  # what Ctrl-C does to asyncio.run's main task
        with pytest.raises(asyncio.CancelledError):
            await consumer

    asyncio.run(main())
    assert got == [] and live(run_id) == 0
    assert labelled_images(run_id) == []  # an INIT state committed as Ctrl-C came is removed too


def test_pipeline_never_has_more_live_sandboxes_than_configured(task: Task, tokenizer: Any) -> None:
    instances = [instance(f"b{k}", tool_s=0.6, init_s=0.2) for k in range(9)]
    run_id = f"test-dispatch-bp-{uuid.uuid4().hex[:8]}"
    seen: list[int] = []
    stop = threading.Event()

    def poll() -> Iterator[None]:
        while not stop.is_set():
            seen.append(live(run_id))
            time.sleep(0.05)
        yield

    watcher = threading.Thread(target=lambda: list(poll()), daemon=True)
    watcher.start()
    dispatcher = PipelineConfig(concurrency=2, max_sandboxes=3).build()

    async def main() -> list[Trajectory]:
        eps = episodes(task, tokenizer, instances, run_id)
        async with aclosing(dispatcher.run(eps)) as stream:
            return [t async for t in stream]

    try:
        trajs = asyncio.run(main())
    finally:
        stop.set()
        watcher.join()
    assert len(trajs) == 9 and all(t.stop_reason == StopReason.finished for t in trajs)
    assert max(seen) == 3  # the bound was reached and never exceeded, as the engine saw it
    assert dispatcher.metrics is not None and dispatcher.metrics.peaks["sandboxes"] <= 3


def test_teardown_ends_a_worker_that_swallowed_its_cancellation() -> None:
    """Python 3.11's wait_for can lose a cancel (the wrapped call finishing as it arrives);
    the worker then waits on its queue again. cancel_and_wait cancels it again."""
    from agentrl.dispatch.core import cancel_and_wait

    async def main() -> tuple[int, float]:
        queue: asyncio.Queue[int] = asyncio.Queue()
        swallowed = 0

        async def worker() -> None:
            nonlocal swallowed
            while True:
                try:
                    await queue.get()
                except asyncio.CancelledError:
                    if swallowed:
                        raise
                    swallowed += 1  # what a lost cancel looks like: loop and wait again

        async def failing() -> None:
            raise ValueError("a worker bug")

        tasks = [asyncio.create_task(worker()), asyncio.create_task(failing())]
        await asyncio.sleep(0.01)
        start = time.monotonic()
        await asyncio.wait_for(cancel_and_wait(tasks, every=0.05), 10)
        assert all(t.done() for t in tasks)
        return swallowed, time.monotonic() - start

    swallowed, seconds = asyncio.run(main())
    assert swallowed == 1 and seconds < 5
