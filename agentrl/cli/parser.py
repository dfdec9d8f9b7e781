"""The command line: every command, its arguments, and argparse errors as one line and a fix."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from agentrl import __version__
from agentrl.cli import configs, episodes, evaluate, machine, serving
from agentrl.cli.output import err_console, tag


class _Parser(argparse.ArgumentParser):
    """argparse, but a wrong command line reads like every other error: one line, a fix,
    exit code 1 (argparse's own is usage text and exit 2)."""

    def error(self, message: str) -> NoReturn:
        err_console.print(tag("error:", "red", f"{self.prog}: {message}"))
        err_console.print(tag("fix:", "yellow", f"{self.prog} --help lists the arguments"))
        sys.exit(1)


def _at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer >= `minimum`."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{value} is below {minimum}")
        return value

    return parse


def _temperature(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0 or value == float("inf"):  # NaN fails the first test
        raise argparse.ArgumentTypeError(f"{value} is not a temperature (0 or more)")
    return value


def _port(text: str) -> int:
    value = _at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"{value} is not a port (0-65535)")
    return value


POLICY_HELP = (
    "local (the embedded model), openai:URL, router:URL,URL,..., scripted:FILE, a model "
    "folder, or a train run's folder or checkpoint (its newest checkpoint, served in-process)"
)

PROVIDER_HELP = (
    "sandbox provider: docker, local (no isolation), or module:Class (a provider of your own)"
)


MODEL_HELP = (
    "the model folder whose tokenizer and chat template the policy's replies are in "
    "(default: the policy's own; the embedded model's for openai:, router: and scripted:)"
)


def _episode_options(p: argparse.ArgumentParser) -> None:
    """What `run` and `eval` share: the policy, the instances, sandboxes and limits."""
    p.add_argument("--policy", default="local", help=POLICY_HELP)
    p.add_argument("--model", help=MODEL_HELP)
    p.add_argument("--instances", help="only these instances (comma-separated ids)")
    p.add_argument("--provider", default="docker", help=PROVIDER_HELP)
    p.add_argument("--concurrency", type=_at_least(1), default=4, help="generation slots")
    p.add_argument(
        "--dispatcher",
        choices=["pipeline", "batch", "sync"],
        default="pipeline",
        help="how episodes share sandboxes and the sampler (default pipeline)",
    )
    p.add_argument("--max-turns", type=_at_least(1), help="override the task's limits.max_turns")
    p.add_argument("--max-new-tokens", type=_at_least(1), help="override limits.max_new_tokens")
    p.add_argument(
        "--agent",
        type=Path,
        help="a YAML file of an external agent harness (a task's agent: section) that plays "
        "every task instead of its own agent (docs/agents.md)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="agentrl", description="Train LLM agents with RL on tool-using tasks.")
    p.add_argument("--version", action="version", version=f"agentrl {__version__}")
    p.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("doctor", help="check this machine and say how to fix what is missing")
    d.set_defaults(func=machine.doctor)

    images = sub.add_parser("images", help="sandbox images")
    isub = images.add_subparsers(dest="images_command", required=True, metavar="ACTION")
    b = isub.add_parser("build", help="build sandbox images from sandboxes/<name>/")
    b.add_argument(
        "names",
        nargs="*",
        default=["base"],
        help="recipe names (default: base); a registry name such as ubuntu:24.04 builds its "
        "stand-in from sandboxes/standins/, and `standins` builds them all",
    )
    b.add_argument(
        "--method",
        choices=["auto", "dockerfile", "debootstrap"],
        default="auto",
        help="auto uses the Dockerfile when its base image can be had, else debootstrap",
    )
    b.add_argument("--force", action="store_true", help="rebuild even if up to date")
    b.set_defaults(func=machine.images_build)

    r = sub.add_parser("run", help="run a task's instances with a policy; trajectories + summary")
    r.add_argument("task", help="a task YAML file, or a Terminal-Bench / Harbor task folder")
    _episode_options(r)
    r.add_argument("-n", "--samples", type=_at_least(1), default=1, help="episodes per instance")
    r.add_argument("--out", type=Path, help="output folder (default runs/<task>-<time>)")
    again = r.add_mutually_exclusive_group()
    again.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out: keep its episodes, run only the missing ones "
        "(those a kill left in flight go on from their last snapshot)",
    )
    again.add_argument("--overwrite", action="store_true", help="replace the run in --out")
    r.add_argument(
        "--snapshots",
        type=_at_least(0),
        metavar="K",
        help="snapshot the sandbox after INIT and every K turns (0: off); overrides the task",
    )
    r.set_defaults(func=episodes.run)

    e = sub.add_parser(
        "eval",
        help="k attempts of every instance: pass@1 and pass@k, resumable; or --compare two",
    )
    e.add_argument("tasks", nargs="*", help="task files, task folders, row files")
    _episode_options(e)
    e.add_argument(
        "-k", "--attempts", type=_at_least(1), default=1, help="attempts per instance (default 1)"
    )
    e.add_argument(
        "--out",
        type=Path,
        help="evaluation folder (default runs/eval-<task>-<policy>); the same command resumes it",
    )
    e.add_argument("--overwrite", action="store_true", help="start the folder's evaluation again")
    e.add_argument(
        "--retry-infra",
        action="store_true",
        help="run again the attempts recorded as infrastructure failures",
    )
    e.add_argument(
        "--temperature", type=_temperature, help="override the tasks' sampling.temperature"
    )
    e.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("RUN_A", "RUN_B"),
        help="B against A: paired pass@1 difference with a bootstrap 95%% interval",
    )
    e.add_argument("--json", type=Path, help="--compare: also write the comparison here")
    e.set_defaults(func=evaluate.evaluate)

    ck = sub.add_parser(
        "check",
        help="run every instance's reference solution and a no-op through the real grader",
    )
    ck.add_argument("paths", nargs="+", type=Path, help="task files, task folders, row files")
    ck.add_argument("--instances", help="only these instances (comma-separated ids)")
    ck.add_argument("--json", type=Path, help="also write the table as JSON here")
    ck.add_argument("--provider", default="docker", help=PROVIDER_HELP)
    ck.add_argument("--concurrency", type=_at_least(1), default=2, help="instances at once")
    ck.set_defaults(func=episodes.check)

    rp = sub.add_parser(
        "replay", help="restore a recorded episode's sandbox and act on its replies again"
    )
    rp.add_argument("run_dir", type=Path, help="a folder `agentrl run` or `agentrl train` wrote")
    rp.add_argument("trajectory_id")
    rp.add_argument(
        "--from-turn", type=_at_least(0), default=0, help="restore the state before turn K"
    )
    how = rp.add_mutually_exclusive_group()
    how.add_argument("--shell", action="store_true", help="open a bash in the restored sandbox")
    how.add_argument(
        "--policy", help="let a policy continue from turn K (local, openai:URL, scripted:FILE)"
    )
    rp.add_argument("--model", help=MODEL_HELP)
    rp.set_defaults(func=episodes.replay)

    vw = sub.add_parser(
        "view", help="a run in the browser: metrics, the episodes table, one episode's tokens"
    )
    vw.add_argument(
        "run_dir",
        type=Path,
        help="a folder `agentrl run`, `eval` or `train` wrote, or ATIF trajectories (a .json "
        "file or a folder of them) another tool wrote",
    )
    vw.add_argument("--port", type=_port, default=8400, help="port (0 picks a free one)")
    vw.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    vw.add_argument("--model", help="whose tokenizer the ids are in (default: run.json's model)")
    vw.add_argument(
        "--export", type=Path, metavar="DIR", help="write a static copy to DIR (opens from disk)"
    )
    vw.set_defaults(func=episodes.view)

    ex = sub.add_parser(
        "export-trajectories", help="a run's episodes in another format (ATIF: one JSON each)"
    )
    ex.add_argument("run_dir", type=Path, help="a folder `agentrl run`, `eval` or `train` wrote")
    ex.add_argument("--format", choices=["atif"], default="atif", help="ATIF v1.8 (the default)")
    ex.add_argument("--out", type=Path, help="where to write them (default RUN_DIR/atif)")
    ex.set_defaults(func=episodes.export_trajectories)

    fl = sub.add_parser("failures", help="a run's failed episodes, grouped, with replay commands")
    fl.add_argument("run_dir", type=Path)
    fl.add_argument("--all", action="store_true", help="a replay command for every episode")
    fl.set_defaults(func=episodes.failures)

    t = sub.add_parser("train", help="train a model on tasks (the main job); see examples/")
    t.add_argument("config", type=Path, help="a train config YAML file")
    t.add_argument("--out", type=Path, help="output folder (default runs/<name>)")
    t.add_argument("--resume", action="store_true", help="continue from the newest checkpoint")
    t.add_argument("--overwrite", action="store_true", help="replace an existing run in --out")
    t.add_argument("--steps", type=int, help="override schedule.steps")
    t.add_argument("--seed", type=int, help="override seed (data order, RNGs)")
    t.add_argument(
        "--servers",
        help="sample on these servers (comma-separated URLs, e.g. agentrl serve replicas) "
        "behind the router instead of in-process; overrides servers.urls",
    )
    t.set_defaults(func=configs.train)

    g = sub.add_parser("gc", help="remove sandboxes (and snapshots) that dead runs left behind")
    g.add_argument(
        "--snapshots",
        action="store_true",
        help="also remove the snapshots of runs killed before they exited (with --run: that "
        "run's, even if it finished)",
    )
    g.add_argument("--run", help="only this run id")
    g.set_defaults(func=machine.gc)

    s = sub.add_parser("sample", help="one reply from the embedded model (a smoke test)")
    s.add_argument(
        "prompt", nargs="?", default="In one sentence, what does the bash command `ls -la` do?"
    )
    s.add_argument("--max-tokens", type=_at_least(1), default=64)
    s.add_argument("--temperature", type=_temperature, default=0.7)
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=serving.sample)

    sv = sub.add_parser(
        "serve", help="serve the embedded model over an OpenAI-compatible API on 127.0.0.1"
    )
    sv.add_argument("--port", type=_port, default=8000, help="port (0 picks a free one)")
    sv.add_argument(
        "--model", default="embedded", help="embedded (SmolLM2-135M-Instruct) or a model folder"
    )
    sv.set_defaults(func=serving.serve)

    x = sub.add_parser(
        "export", help="a train run's checkpoint as a model folder (vllm serve, agentrl serve)"
    )
    x.add_argument(
        "checkpoint",
        help="a train run folder (its newest), a checkpoint, or `embedded` (the embedded model)",
    )
    x.add_argument("out", type=Path, help="a new folder to write")
    x.set_defaults(func=serving.export)

    st = sub.add_parser(
        "serve-tinker",
        help="serve a model for training and sampling over the Tinker API (tinker SDK 0.38)",
    )
    st.add_argument(
        "--model", default="embedded", help="embedded (SmolLM2-135M-Instruct) or a model folder"
    )
    st.add_argument(
        "--name",
        help="the base_model name clients ask for (default: HuggingFaceTB/SmolLM2-135M-Instruct "
        "for embedded, else the folder's name)",
    )
    st.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    st.add_argument("--port", type=_port, default=8100, help="port (0 picks a free one)")
    st.add_argument(
        "--state-dir",
        type=Path,
        help="where save_state writes checkpoints (default: ~/.cache/agentrl/tinker-state, "
        "or $AGENTRL_CACHE/tinker-state)",
    )
    st.add_argument(
        "--max-models",
        type=_at_least(1),
        default=2,
        help="training models held at once (default 2)",
    )
    st.add_argument(
        "--keep-samplers",
        type=_at_least(1),
        default=2,
        help="sampling snapshots kept per training model; older ones are released (default 2)",
    )
    st.add_argument("--api-key", help="require this X-API-Key on every request (default: none)")
    st.set_defaults(func=serving.serve_tinker)

    v = sub.add_parser(
        "validate", help="validate task files (YAML, task folders) and trajectory files (JSONL)"
    )
    v.add_argument("files", nargs="+", type=Path)
    v.add_argument(
        "--model",
        default="embedded",
        help="count task prompts with this model's tokenizer: embedded (SmolLM2-135M-Instruct, "
        "the default) or a model folder",
    )
    v.set_defaults(func=configs.validate)

    cl = sub.add_parser(
        "cluster", help="a local multi-node Ray cluster on 127.0.0.1 (tests, trying Ray)"
    )
    cl.add_argument("--dir", help="state and logs (default ~/.cache/agentrl/cluster)")
    clsub = cl.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")
    cu = clsub.add_parser("up", help="start the head and worker nodes (restarts dead ones)")
    cu.add_argument("--workers", type=_at_least(0), default=2, help="worker nodes (default 2)")
    cu.add_argument("--sandboxes", type=_at_least(1), default=4, help="sandboxes per worker node")
    cu.add_argument("--cpus", type=_at_least(1), default=4, help="CPUs Ray schedules per node")
    clsub.add_parser("status", help="the nodes, whether Ray sees them, their containers")
    clsub.add_parser("down", help="stop every node")
    ck = clsub.add_parser("kill-node", help="SIGKILL one node, as a machine failure would")
    ck.add_argument("node", help="w1, w2, ...")
    cl.set_defaults(func=machine.cluster)
    return p
