"""Sandbox and tool latency on the real Docker engine.

    .venv/bin/python benchmarks/sandbox.py [--n 200] [--out FILE]

Measures, in one run so the ratios compare like with like on a noisy machine:
- a command through the persistent bash tool vs one `docker exec` per command
  (the same trivial command, `true`), p50/p95, and their ratio;
- the same bash round trip on the local provider (no container at all);
- container start (start + ready) and close p50;
- snapshot (docker commit) and restore (start from the snapshot) p50;
- the bash round trip once the sandbox has written a SWE-sized tree (`--files` files:
  a repository's bytecode caches, an install), with its writable layer walked at every
  usage look (as before `DISK_RATE`) and walked again only once the room left under the
  disk limit could have been filled (now), alternating, and their ratio.
Writes JSON (default benchmarks/results/sandbox.json) and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from agentrl.sandbox.base import ExecRequest, SandboxSpec
from agentrl.sandbox.docker import DockerProvider, remove_run
from agentrl.sandbox.local import LocalProvider
from agentrl.tools.bash import BashTool


def stats_ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "n": len(ordered),
        "p50_ms": round(statistics.median(ordered) * 1000, 3),
        "p95_ms": round(ordered[int(0.95 * (len(ordered) - 1))] * 1000, 3),
        "mean_ms": round(statistics.fmean(ordered) * 1000, 3),
    }


async def timed(n: int, fn: Callable[[], Awaitable[Any]]) -> list[float]:
    samples = []
    for _ in range(n):
        start = time.perf_counter()
        await fn()
        samples.append(time.perf_counter() - start)
    return samples


async def layer_walks(docker: DockerProvider, spec: SandboxSpec, n: int, files: int) -> dict:
    """Bash round trips in a sandbox holding `files` written files: the layer walked at
    every look vs spaced by DISK_RATE (the two arms alternate in blocks of 10)."""
    from agentrl.sandbox.docker import host

    box = await docker.start(spec)
    bash = BashTool()
    spaced = host.DISK_RATE
    every: list[float] = []
    gap: list[float] = []
    try:
        tree = (
            f"mkdir -p /tmp/tree && cd /tmp/tree && for d in $(seq {files // 100}); "
            "do mkdir $d; (cd $d && seq 100 | xargs touch); done"
        )
        await box.exec(ExecRequest(command=tree, timeout=300))
        await bash(box, command="true")
        for _ in range(max(n // 20, 1)):
            for rate, into in ((float("inf"), every), (spaced, gap)):
                host.DISK_RATE = rate
                into += await timed(10, lambda: bash(box, command="true"))
    finally:
        host.DISK_RATE = spaced
        await bash.close()
        await box.close()
    return {
        "files": files,
        "walk_every_look": stats_ms(every),
        "walk_spaced": stats_ms(gap),
        "every_over_spaced_p50": round(statistics.median(every) / statistics.median(gap), 1),
    }


async def main(n: int, files: int) -> dict[str, Any]:
    run_id = f"bench-sandbox-{uuid.uuid4().hex[:6]}"
    spec = SandboxSpec(run_id=run_id)
    docker = DockerProvider()
    out: dict[str, Any] = {}
    try:
        box = await docker.start(spec)
        bash = BashTool()
        try:
            await bash(box, command="true")  # starts the shell
            out["bash_roundtrip_docker"] = stats_ms(
                await timed(n, lambda: bash(box, command="true"))
            )
            out["exec_per_command_docker"] = stats_ms(
                await timed(max(n // 5, 20), lambda: box.exec(ExecRequest(command="true")))
            )
            snaps: list[str] = []

            async def snap() -> None:
                snaps.append(await box.snapshot(f"bench-{len(snaps)}"))

            out["snapshot"] = stats_ms(await timed(5, snap))

            async def restore() -> None:
                restored = await docker.restore(snaps[-1], spec)
                await restored.close()

            out["restore_and_close"] = stats_ms(await timed(5, restore))
        finally:
            await bash.close()
            await box.close()

        starts, closes = [], []
        for _ in range(10):
            t0 = time.perf_counter()
            sandbox = await docker.start(spec)
            t1 = time.perf_counter()
            await sandbox.close()
            starts.append(t1 - t0)
            closes.append(time.perf_counter() - t1)
        out["container_start"] = stats_ms(starts)
        out["container_close"] = stats_ms(closes)

        out["swe_sized_layer"] = await layer_walks(docker, spec, n, files)

        local = await LocalProvider().start(spec)
        lbash = BashTool()
        try:
            await lbash(local, command="true")
            out["bash_roundtrip_local"] = stats_ms(
                await timed(n, lambda: lbash(local, command="true"))
            )
        finally:
            await lbash.close()
            await local.close()
    finally:
        remove_run(docker.client, run_id, snapshots=True)
    out["exec_over_bash_p50"] = round(
        out["exec_per_command_docker"]["p50_ms"] / out["bash_roundtrip_docker"]["p50_ms"], 1
    )
    return out


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=200, help="bash round trips per provider")
    ap.add_argument("--files", type=int, default=5000, help="files in the SWE-sized layer")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sandbox.json")
    args = ap.parse_args()
    outcome = asyncio.run(main(args.n, args.files))
    result = {"benchmark": "sandbox", "platform": platform.platform(), **outcome}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
