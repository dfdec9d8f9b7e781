"""A short request behind a long one: time to answer with continuous vs static batching.

    .venv/bin/python benchmarks/serve_latency.py [--reps 3] [--long-tokens 150]

Serves the embedded model with `agentrl serve` in this process, twice over the same
weights: LocalSampler(continuous=True) (a request joins the running batch at the next
decode step) and continuous=False (the old static batching: a started batch takes no one
in). Each repetition sends a --long-tokens request over HTTP, waits until it decodes,
then sends a 2-token request and times its answer; the long request's own time is
recorded too. EOS is disabled so every request runs to its max_tokens; greedy, so both
arms do the same work. Also times the 2-token request alone (the floor). The arms
alternate repetition by repetition, so drift on a shared machine hits both. Writes
benchmarks/results/serve_latency.json: medians in seconds and the ratio static /
continuous of the short request's time to answer.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import torch

from agentrl.inference import embedded
from agentrl.inference.local import LocalSampler
from agentrl.inference.serve import serve

LONG_PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
SHORT_PROMPT = "Say hi."


def post(url: str, prompt: list[int], max_tokens: int) -> float:
    """One completion over HTTP; returns seconds to its answer."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0})
    request = urllib.request.Request(
        f"{url}/completions", body.encode(), {"Content-Type": "application/json"}
    )
    start = time.perf_counter()
    with urllib.request.urlopen(request, timeout=3600) as response:
        answer = json.loads(response.read())
    assert answer["usage"]["completion_tokens"] == max_tokens, answer["usage"]
    return time.perf_counter() - start


def behind_a_long_one(
    sampler: LocalSampler, url: str, long: list[int], short: list[int], n: int
) -> dict[str, float]:
    """Send the long request, wait until it decodes, then time the 2-token one."""
    times: dict[str, float] = {}

    def run_long() -> None:
        times["long_s"] = round(post(url, long, n), 3)

    thread = threading.Thread(target=run_long)
    thread.start()
    while sampler.stats.active == 0:
        time.sleep(0.005)  # the stats offer no event; poll until the long one started
    times["short_s"] = round(post(url, short, 2), 3)
    thread.join()
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--long-tokens", type=int, default=150)
    ap.add_argument(
        "--out", type=Path, default=Path(__file__).parent / "results" / "serve_latency.json"
    )
    args = ap.parse_args()

    tokenizer = embedded.load_tokenizer()
    model = embedded.load_model()

    def chat(text: str) -> list[int]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return list(tokenizer.encode(str(ids), add_special_tokens=False))

    long, short = chat(LONG_PROMPT), chat(SHORT_PROMPT)
    arms: dict[str, tuple[LocalSampler, Any, str]] = {}
    for name, continuous in (("continuous", True), ("static", False)):
        # No EOS: every request runs to its max_tokens, so both arms do identical work.
        sampler = LocalSampler(
            model, eos_token_ids=[], pad_token_id=tokenizer.pad_token_id, continuous=continuous
        )
        server, url = serve(sampler, tokenizer)
        arms[name] = (sampler, server, url)

    runs: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    alone: list[float] = []
    try:
        post(arms["continuous"][2], short, 2)  # warm-up
        for _ in range(args.reps):
            alone.append(post(arms["continuous"][2], short, 2))
            for name, (sampler, _, url) in arms.items():
                runs[name].append(behind_a_long_one(sampler, url, long, short, args.long_tokens))
    finally:
        for sampler, server, _ in arms.values():
            server.close()
            asyncio.run(sampler.close())

    def median(name: str, key: str) -> float:
        return round(statistics.median(r[key] for r in runs[name]), 3)

    result = {
        "benchmark": "serve_latency",
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform()},
        "model": embedded.EMBEDDED_NAME,
        "reps": args.reps,
        "long_tokens": args.long_tokens,
        "short_tokens": 2,
        "short_alone_s": round(statistics.median(alone), 3),
        **{
            name: {
                "short_behind_long_s": median(name, "short_s"),
                "long_s": median(name, "long_s"),
                "runs": runs[name],
            }
            for name in arms
        },
        "static_over_continuous_short_s": round(
            median("static", "short_s") / median("continuous", "short_s"), 1
        ),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
