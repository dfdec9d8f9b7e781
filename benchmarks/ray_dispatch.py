"""Ray dispatch: what a tool call costs through a sandbox worker actor, and how a
tool-bound rollout scales from one sandbox node to two.

    .venv/bin/python benchmarks/ray_dispatch.py [--calls 200] [--episodes 18]

Everything is real: a local Ray cluster (`agentrl cluster up`: the head and worker
nodes as separate process groups on loopback), Docker sandboxes, the bash tool, the
pipeline dispatcher and the scripted policy (no model: the policy's replies are fixed,
so only the sandbox side is measured).

1. Overhead: one sandbox, `--calls` bash tool calls (`true`), in this process (TaskEnv)
   vs through the node's SandboxWorker (RemoteTaskEnv): milliseconds per call, both
   paths measured alternately in rounds so that drift on a shared machine hits both.
2. Scaling: `--episodes` episodes of the dispatch probe task, each one tool call, on one
   sandbox node (3 sandboxes) and then on two (6), in two workloads:
   - wait-bound: the tool sleeps 3 s (a test suite waiting on I/O, a build fetching);
     the sandbox slots are the bottleneck, so a second node should nearly halve the time.
   - cpu-bound: the tool hashes 400 MB of zeros (~1 s of one core). All nodes share
     this machine's 2 cores, so a second node cannot add compute: a ratio near 1 here
     is the honest answer for one machine; on real machines each node brings its cores.

Writes benchmarks/results/ray_dispatch.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from contextlib import aclosing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from agentrl.cluster import connect, disconnect, local  # noqa: E402
from agentrl.cluster.sandboxes import RemoteTaskEnv, SandboxFleet  # noqa: E402
from agentrl.dispatch import PipelineConfig  # noqa: E402
from agentrl.episode import Episode  # noqa: E402
from agentrl.inference.embedded import load_tokenizer  # noqa: E402
from agentrl.inference.scripted import ScriptedSampler  # noqa: E402
from agentrl.sandbox.docker import DockerProvider, remove_run  # noqa: E402
from agentrl.tasks.env import EpisodeEnv, TaskEnv  # noqa: E402
from agentrl.tasks.load import load_task  # noqa: E402
from agentrl.tasks.spec import Instance, Task  # noqa: E402

PROBE = ROOT / "tests" / "data" / "dispatch" / "probe.yaml"
OUT = ROOT / "benchmarks" / "results" / "ray_dispatch.json"
PER_NODE = 3
TOOLS = {
    "wait": "sleep 3",
    "cpu": "head -c 400000000 /dev/zero | sha256sum >/dev/null",
}


def probe_instance(id: str) -> Instance:
    fields = {"fail_setup": "no", "crash_grader": "no", "init_s": 0, "tool_s": 0}
    return Instance(id=id, fields=fields)


async def per_call_ms(env: EpisodeEnv, task: Task, calls: int) -> list[float]:
    """Milliseconds of each of `calls` bash tool calls in one sandbox of `env`."""
    sandbox = await env.init(probe_instance(f"o{uuid.uuid4().hex[:6]}"), "overhead")
    tools = env.tools()
    try:
        await tools["bash"](sandbox, command="true")  # the shell starts on the first call
        times = []
        for _ in range(calls):
            start = time.perf_counter()
            obs = await tools["bash"](sandbox, command="true")
            times.append((time.perf_counter() - start) * 1000)
            assert obs.exit_code == 0, obs.text
        return times
    finally:
        for tool in tools.values():
            await tool.close()
        await sandbox.close()


async def rollout(env: EpisodeEnv, task: Task, tokenizer: Any, command: str, n: int) -> float:
    """Seconds for `n` one-tool-call episodes through the pipeline (sandboxes capped by
    the nodes' capacity, generation never the bottleneck)."""
    script = [
        '<tool_call>{"name": "bash", "arguments": {"command": '
        + json.dumps(command)
        + "}}</tool_call>",
        '<tool_call>{"name": "finish", "arguments": {"message": "done"}}</tool_call>',
    ]
    sampler = ScriptedSampler(script, tokenizer)
    tag = uuid.uuid4().hex[:6]
    episodes = [
        Episode(task, probe_instance(f"e{tag}{k}"), 0, sampler, tokenizer, env) for k in range(n)
    ]
    dispatcher = PipelineConfig(concurrency=2 * PER_NODE, max_sandboxes=2 * PER_NODE).build()
    start = time.monotonic()
    async with aclosing(dispatcher.run(episodes)) as stream:
        trajs = [t async for t in stream]
    seconds = time.monotonic() - start
    bad = [t for t in trajs if t.reward != 1.0]
    assert not bad, [(t.stop_reason, t.error) for t in bad]
    return seconds


async def main(args: argparse.Namespace) -> dict[str, Any]:
    task = load_task(PROBE)
    task = task.model_copy(
        update={"spec": task.spec.model_copy(update={"sandbox": task.spec.sandbox.model_copy(
            update={"cpus": 1.0, "memory_mb": 256})})}
    )  # fmt: skip
    tokenizer = load_tokenizer()
    folder = Path(tempfile.mkdtemp(prefix="agentrl-bench-cluster-"))
    run_id = f"bench-ray-{uuid.uuid4().hex[:6]}"
    result: dict[str, Any] = {"calls": args.calls, "episodes": args.episodes}
    try:
        state = local.up(folder, workers=1, sandboxes=PER_NODE)
        connect(state.address)
        fleet = SandboxFleet(run_id, refresh_s=0.5)
        await fleet.start()
        remote = RemoteTaskEnv(task, fleet, run_id)
        here = TaskEnv(task, DockerProvider(), run_id)

        rounds = 4
        local_ms: list[float] = []
        ray_ms: list[float] = []
        for _ in range(rounds):
            local_ms += await per_call_ms(here, task, args.calls // rounds)
            ray_ms += await per_call_ms(remote, task, args.calls // rounds)
        lo, ra = statistics.median(local_ms), statistics.median(ray_ms)
        result["tool_call_ms"] = {
            "local_median": round(lo, 3),
            "ray_median": round(ra, 3),
            "local_p90": round(statistics.quantiles(local_ms, n=10)[-1], 3),
            "ray_p90": round(statistics.quantiles(ray_ms, n=10)[-1], 3),
            "ray_overhead_ms": round(ra - lo, 3),
            "ray_over_local": round(ra / lo, 3),
        }
        print("tool call:", result["tool_call_ms"], flush=True)

        scaling: dict[str, Any] = {}
        one = {kind: await rollout(remote, task, tokenizer, cmd, args.episodes)
               for kind, cmd in TOOLS.items()}  # fmt: skip
        local.up(folder, workers=2, sandboxes=PER_NODE)  # the second node joins
        await fleet.refresh()
        assert len(fleet.alive()) == 2, [w.node for w in fleet.alive()]
        two = {kind: await rollout(remote, task, tokenizer, cmd, args.episodes)
               for kind, cmd in TOOLS.items()}  # fmt: skip
        for kind in TOOLS:
            scaling[kind] = {
                "one_node_s": round(one[kind], 2),
                "two_nodes_s": round(two[kind], 2),
                "speedup": round(one[kind] / two[kind], 3),
            }
            print(kind, scaling[kind], flush=True)
        result["scaling"] = scaling
        result["sandboxes_per_node"] = PER_NODE
        result["machine"] = "one machine, 2 cores: every node shares them"
        await fleet.close()
    finally:
        disconnect()
        local.down(folder)
        client = DockerProvider(reap_at_start=False).client
        remove_run(client, run_id)
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--episodes", type=int, default=18)
    args = parser.parse_args()
    result = asyncio.run(main(args))
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {OUT}")
