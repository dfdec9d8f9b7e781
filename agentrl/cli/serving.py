"""`agentrl sample`, `serve` and `serve-tinker`: a model answering, in the terminal or over HTTP."""

from __future__ import annotations

import argparse
import asyncio
import time

from agentrl.cli.output import console, tag


def sample(args: argparse.Namespace) -> int:
    from agentrl.chat import ChatSession
    from agentrl.inference.base import SamplingParams
    from agentrl.inference.embedded import EMBEDDED_NAME, load_tokenizer
    from agentrl.inference.local import LocalSampler

    with console.status(f"loading {EMBEDDED_NAME}..."):
        sampler = LocalSampler.embedded()
        tokenizer = load_tokenizer()
    session = ChatSession(tokenizer, [{"role": "user", "content": args.prompt}])
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
    )

    async def one() -> tuple[str, float, int, str, int]:
        try:
            start = time.perf_counter()
            c = await sampler.generate(session.prompt_ids, params, session_id="cli")
            seconds = time.perf_counter() - start
        finally:
            await sampler.close()
        text = session.add_sampled(c.token_ids, c.finish_reason)
        return text, seconds, len(c.token_ids), c.finish_reason, c.policy_version

    text, seconds, n, finish, version = asyncio.run(one())
    console.print(tag("user:", "bold", args.prompt))
    console.print(tag(f"{EMBEDDED_NAME}:", "bold", text.strip()))
    console.print(
        f"{n} tokens in {seconds:.2f} s ({n / max(seconds, 1e-9):.1f} tok/s), "
        f"finish_reason={finish}, policy_version={version}, "
        f"prompt {len(session.prompt_ids)} tokens",
        style="dim",
    )
    return 0


def serve(args: argparse.Namespace) -> int:
    from pathlib import Path

    from agentrl.errors import ConfigError
    from agentrl.inference.embedded import EMBEDDED_NAME, model_tokenizer
    from agentrl.inference.local import LocalSampler
    from agentrl.inference.serve import serve

    if args.model != "embedded" and not (Path(args.model) / "config.json").is_file():
        raise ConfigError(
            f"--model {args.model}: not a model folder (no config.json)",
            fix="pass embedded, or a folder written by save_pretrained",
        )
    name = EMBEDDED_NAME if args.model == "embedded" else Path(args.model).resolve().name
    with console.status(f"loading {name}..."):
        sampler = LocalSampler.for_model(args.model)
        tokenizer = sampler.tokenizer or model_tokenizer(args.model)
    server, url = serve(sampler, tokenizer, port=args.port, model_name=name)
    root = url.removesuffix("/v1")
    try:
        serve_until_stopped(
            f"serving {name} at {url}",
            f"use it with: agentrl run TASK --policy openai:{url}, or as one of the replicas "
            f"of agentrl train CONFIG --servers {root},...   (Ctrl-C stops)",
        )
    finally:
        server.close()
        asyncio.run(sampler.close())
    return 0


def serve_until_stopped(*lines: str) -> None:
    """Say `lines` (the URL first: a client may act on it at once), then block until
    Ctrl-C (or SIGTERM, which `_terminate` turns into one); a stop that comes while they
    are said is a stop like any other, not an interruption. The wait wakes every 0.2 s:
    the kernel may deliver the signal to a server thread, and Python runs its handler
    only when the main thread next runs bytecode (a main thread blocked on a lock, or in
    an hour's sleep, missed a Ctrl-C: `agentrl view` hung, seen under load)."""
    try:
        for line in lines:
            console.print(line)
        while True:
            time.sleep(0.2)
    except KeyboardInterrupt:
        console.print("stopping")


def serve_tinker(args: argparse.Namespace) -> int:
    from agentrl.tinker_server.server import serve

    server = serve(
        args.model,
        name=args.name,
        host=args.host,
        port=args.port,
        state_dir=args.state_dir,
        max_models=args.max_models,
        keep_samplers=args.keep_samplers,
        api_key=args.api_key,
    )
    config = server.service.config
    try:
        serve_until_stopped(
            f"serving the Tinker API for {config.name} at {server.url}",
            f"use it with: tinker.ServiceClient(base_url={server.url!r}, api_key='tml-...'); "
            f"save_state writes to {config.state_dir}   (Ctrl-C stops)",
        )
    finally:
        server.close()
    return 0


def export(args: argparse.Namespace) -> int:
    from agentrl.inference.checkpoints import export_model

    with console.status(f"exporting {args.checkpoint} ..."):
        out = export_model(args.checkpoint, args.out)
    console.print(f"{out}: a model folder (`vllm serve {out}` or `agentrl serve --model {out}`)")
    return 0
