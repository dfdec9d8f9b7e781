"""Embedded sampler: batched concurrent requests vs the same requests one at a time.

    .venv/bin/python benchmarks/sampler.py [--requests 8] [--max-tokens 48] [--out FILE]

Both arms run in this process on the same model with the same prompts and seeds, and
the EOS id is disabled so every request produces exactly --max-tokens tokens; the
result is tokens/s for each arm and their ratio (noise on a shared machine moves both).
Also records the cold load (GGUF conversion, only when the cache is empty) and the
warm load from the safetensors cache. Writes JSON (default
benchmarks/results/sampler.json) and prints it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import time
from pathlib import Path

import torch

from agentrl.inference import embedded
from agentrl.inference.base import SamplingParams
from agentrl.inference.local import LocalSampler

PROMPTS = [
    "List three uses of the `grep` command.",
    "Write a haiku about containers.",
    "What does `git rebase` do?",
    "Explain a Python list comprehension briefly.",
    "Name two HTTP methods and what they do.",
    "How do I count lines in a file on Linux?",
    "What is a race condition?",
    "Give a one-line summary of reinforcement learning.",
]


async def _arm(sampler: LocalSampler, prompts: list[list[int]], n_tokens: int, batched: bool):
    params = [
        SamplingParams(max_tokens=n_tokens, temperature=1.0, seed=i) for i in range(len(prompts))
    ]
    start = time.perf_counter()
    if batched:
        outs = await asyncio.gather(
            *(sampler.generate(p, q) for p, q in zip(prompts, params, strict=True))
        )
    else:
        outs = [await sampler.generate(p, q) for p, q in zip(prompts, params, strict=True)]
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "seconds": round(seconds, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "sampler.json")
    args = ap.parse_args()

    cached = (embedded.model_dir(convert=False) / "model.safetensors").is_file()
    t0 = time.perf_counter()
    embedded.model_dir()
    convert_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tokenizer = embedded.load_tokenizer()
    model = embedded.load_model()
    load_s = time.perf_counter() - t0
    # No EOS: every request runs to max_tokens, so both arms do identical work.
    sampler = LocalSampler(model, eos_token_ids=[], pad_token_id=tokenizer.pad_token_id)

    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(args.requests)
    ]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]

    async def run() -> dict[str, dict[str, float]]:
        try:
            await _arm(sampler, ids[:2], 4, batched=True)  # warm-up
            serial = await _arm(sampler, ids, args.max_tokens, batched=False)
            batched = await _arm(sampler, ids, args.max_tokens, batched=True)
            return {"serial": serial, "batched": batched}
        finally:
            await sampler.close()

    arms = asyncio.run(run())
    result = {
        "benchmark": "sampler",
        "machine": {"cpus": torch.get_num_threads(), "platform": platform.platform()},
        "model": embedded.EMBEDDED_NAME,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "gguf_conversion_s": None if cached else round(convert_s, 1),
        "warm_load_s": round(load_s, 2),
        **arms,
        "batched_over_serial_throughput": round(
            arms["batched"]["tokens_per_s"] / arms["serial"]["tokens_per_s"], 2
        ),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
