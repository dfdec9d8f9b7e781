"""What sampling over HTTP and through the router costs per request, against in-process.

    .venv/bin/python benchmarks/serving.py [--requests 40]

Starts one `agentrl serve` process (the embedded model) and, in this process, a
LocalSampler over the same model. Every workload sends the same request through three
paths, interleaved request by request so that drift on a shared machine hits all three
alike:

  in-process   LocalSampler.generate
  http         OpenAISampler -> agentrl serve (token ids in and out, keep-alive)
  router       Router with that one replica -> agentrl serve (adds the router's own
               thread hop, session bookkeeping and version stamping)

Workloads: one request at a time with 1 new token (the fixed cost shows most) and with
32 new tokens (a typical short ReAct action), and a wave of 8 concurrent sessions of 32
tokens each (batched by the sampler in every path). Greedy, so each path samples the
same tokens. Writes benchmarks/results/serving.json: median and mean milliseconds per
path, and the overheads http - in-process and router - http in ms and in % of the
cheaper path.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx2

from agentrl.http import free_port
from agentrl.inference.base import Sampler, SamplingParams
from agentrl.inference.embedded import load_tokenizer
from agentrl.inference.local import LocalSampler
from agentrl.inference.openai import OpenAISampler
from agentrl.inference.router import Router

RESULTS = Path(__file__).parent / "results"
PROMPT = "You are in a Linux shell. Create a file named notes.txt that holds the word hello."


def start_server() -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    cmd = [sys.executable, "-m", "agentrl.cli", "serve", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    while True:
        if proc.poll() is not None:
            raise SystemExit("agentrl serve exited")
        try:
            if httpx2.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx2.HTTPError:
            time.sleep(0.3)


def summary(ms: list[float]) -> dict[str, float]:
    return {"median_ms": round(statistics.median(ms), 2), "mean_ms": round(statistics.mean(ms), 2)}


def overhead(slow: dict[str, float], fast: dict[str, float]) -> dict[str, float]:
    ms = slow["median_ms"] - fast["median_ms"]
    return {"ms": round(ms, 2), "pct": round(100 * ms / fast["median_ms"], 1)}


async def measure(
    paths: dict[str, Sampler], make: Callable[[Sampler, int], Awaitable[Any]], rounds: int
) -> dict[str, Any]:
    times: dict[str, list[float]] = {name: [] for name in paths}
    for sampler in paths.values():  # warm up: connections, first batch
        await make(sampler, -1)
    for i in range(rounds):
        for name, sampler in paths.items():
            start = time.perf_counter()
            await make(sampler, i)
            times[name].append(1000 * (time.perf_counter() - start))
    stats = {name: summary(ms) for name, ms in times.items()}
    return {
        **stats,
        "http_over_in_process": overhead(stats["http"], stats["in-process"]),
        "router_over_http": overhead(stats["router"], stats["http"]),
    }


async def run(url: str, requests: int) -> dict[str, Any]:
    tokenizer = load_tokenizer()
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], tokenize=False, add_generation_prompt=True
    )
    prompt = tokenizer.encode(str(text), add_special_tokens=False)
    local = LocalSampler.embedded()
    http = OpenAISampler(url)
    router = Router([url], health_interval=60.0)
    paths: dict[str, Sampler] = {"in-process": local, "http": http, "router": router}
    results: dict[str, Any] = {"prompt_tokens": len(prompt)}
    try:
        for tokens in (1, 32):
            params = SamplingParams(max_tokens=tokens, temperature=0.0)

            async def one(s: Sampler, i: int, params: SamplingParams = params) -> None:
                await s.generate(prompt, params, session_id=f"s{i}")

            results[f"sequential_{tokens}_tokens"] = await measure(paths, one, requests)

        wave_params = SamplingParams(max_tokens=32, temperature=0.0)

        async def wave(s: Sampler, i: int) -> None:
            await asyncio.gather(
                *(s.generate(prompt, wave_params, session_id=f"w{i}-{k}") for k in range(8))
            )

        results["wave_of_8_x_32_tokens"] = await measure(paths, wave, max(4, requests // 4))
    finally:
        await router.close()
        await http.close()
        await local.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=40, help="rounds per workload")
    parser.add_argument("--out", type=Path, default=RESULTS / "serving.json")
    args = parser.parse_args()
    proc, url = start_server()
    try:
        results = asyncio.run(run(url, args.requests))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    report = {"requests_per_workload": args.requests, **results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    for name, row in results.items():
        if not isinstance(row, dict):
            continue
        print(
            f"{name}: in-process {row['in-process']['median_ms']} ms, http "
            f"{row['http']['median_ms']} ms (+{row['http_over_in_process']['ms']} ms, "
            f"{row['http_over_in_process']['pct']}%), router {row['router']['median_ms']} ms "
            f"(+{row['router_over_http']['ms']} ms, {row['router_over_http']['pct']}% over http)"
        )


if __name__ == "__main__":
    main()
