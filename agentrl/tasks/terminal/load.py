"""Reading a Terminal-Bench (`task.yaml`) or Harbor (`task.toml`) folder into a Task, as
the folder is: its instruction, its image or Dockerfile, its timeouts and tests, its
reference solution.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from agentrl.errors import ConfigError
from agentrl.sandbox.images import folder_hash
from agentrl.tasks.spec import (
    EpisodeLimits,
    Instance,
    PromptConfig,
    PythonGrader,
    SandboxConfig,
    Task,
    TaskSpec,
)
from agentrl.tasks.terminal import DEFAULT_TEST_TIMEOUT_S, TESTS_DIR, Format
from agentrl.tasks.terminal.verifier import harbor_verifier
from agentrl.yamlfile import load_yaml

DEFAULT_AGENT_TIMEOUT_S = 1800.0
WORKDIR_OF_IMAGE = "/"
"""A folder whose Dockerfile sets no WORKDIR works where its image does (resolved then)."""
GRADE = "agentrl.tasks.terminal.grade"
SYSTEM_PROMPT = (
    "You are an expert at solving tasks in a Linux terminal. You work inside a sandboxed "
    "container without network access. Use the tools to inspect the environment, make the "
    "changes the task asks for, check your work, and call finish when the task is done."
)


def detect_format(folder: Path) -> Format:
    """`harbor` for a task.toml folder, `terminal-bench` for a task.yaml one."""
    if (folder / "task.toml").is_file():
        return "harbor"
    if (folder / "task.yaml").is_file():
        from agentrl.tasks.formats import task_yaml_kind

        if task_yaml_kind(folder) == "task":  # the one place a task.yaml is told apart
            raise ConfigError(
                f"{folder / 'task.yaml'} is an agentrl task, not a Terminal-Bench one",
                fix="load it with agentrl.tasks.formats.load_any",
            )
        return "terminal-bench"
    raise ConfigError(
        f"{folder} is neither a Terminal-Bench task (task.yaml) nor a Harbor task (task.toml)",
        fix="point at the task's own folder",
    )


def load_terminal_task(folder: Path | str) -> Task:
    """The task in a Terminal-Bench or Harbor folder, its format detected."""
    root = Path(folder).resolve()
    kind = detect_format(root)
    build = _terminal_bench if kind == "terminal-bench" else _harbor
    fields, sandbox, grader, agent_timeout = build(root)
    try:
        spec = TaskSpec(
            name=root.name,
            description=f"{kind} task {root.name}",
            sandbox=sandbox,
            instances=[{"id": root.name, **fields}],
            prompt=PromptConfig(system=SYSTEM_PROMPT, instance="{instruction}"),
            limits=EpisodeLimits(
                episode_timeout=agent_timeout, tool_timeout=min(60.0, agent_timeout)
            ),
            grader=grader,
        )
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise ConfigError(f"{root}: {where}: {first['msg']}") from None
    instance = Instance(id=root.name, fields=fields)
    return Task(
        spec=spec,
        path=str(root),
        base_dir=str(root),
        instances=[instance],
        hash=folder_hash(root),
        env="agentrl.tasks.terminal.env:TerminalEnv",
        format=kind,
    )


def prebuilt_image(folder: Path) -> str | None:
    """The image a harness would use rather than build: the name Terminal-Bench's harness
    builds a folder's Dockerfile as; Harbor's `environment.docker_image`."""
    if detect_format(folder) == "terminal-bench":
        return f"tb__{folder.name}".replace(".", "-") + "__client"
    environment = _table(tomllib.loads((folder / "task.toml").read_text()), "environment")
    return str(environment["docker_image"]) if environment.get("docker_image") else None


def oracle_script(folder: Path | str) -> Path:
    """The reference solution: `solution.sh` or `solution.yaml` (Terminal-Bench: commands
    its oracle types into the terminal, in order), `solution/solve.sh` (Harbor)."""
    root = Path(folder)
    harbor = detect_format(root) == "harbor"
    names = ["solution/solve.sh"] if harbor else ["solution.sh", "solution.yaml"]
    script = next((root / n for n in names if (root / n).is_file()), None)
    if script is None:
        raise ConfigError(
            f"{root} has no {' or '.join(names)}", fix="add the task's reference solution"
        )
    return script


def solution_commands(path: Path) -> str:
    """A solution.yaml's commands as one script, in the order the oracle types them."""
    data = _yaml_list(path)
    commands = [e.get("command") if isinstance(e, dict) else None for e in data]
    texts = [c.rstrip("\n") for c in commands if isinstance(c, str)]
    if not texts or len(texts) != len(commands):
        raise ConfigError(f"{path}: expected a list of entries with a `command`")
    return "\n".join(texts) + "\n"


def _terminal_bench(
    root: Path,
) -> tuple[dict[str, Any], SandboxConfig, PythonGrader, float]:
    data = _yaml(root / "task.yaml")
    instruction = data.get("instruction")
    if not instruction:  # the older layout: a list of descriptions, `base` first
        described = [d for d in data.get("descriptions") or [] if isinstance(d, dict)]
        base = next((d for d in described if d.get("key") == "base"), None)
        instruction = (base or (described[0] if described else {})).get("description")
    if not isinstance(instruction, str) or not instruction.strip():
        raise ConfigError(f"{root / 'task.yaml'}: instruction: missing or empty")
    for required in ("Dockerfile", "run-tests.sh"):
        if not (root / required).is_file():
            raise ConfigError(f"{root} has no {required}", fix="add it (Terminal-Bench layout)")
    _single_container(root / "docker-compose.yaml")
    test_timeout = float(data.get("max_test_timeout_sec", DEFAULT_TEST_TIMEOUT_S))
    agent_timeout = float(data.get("max_agent_timeout_sec", DEFAULT_AGENT_TIMEOUT_S))
    files = {TESTS_DIR: "tests"} if (root / "tests").is_dir() else {}
    files[f"{TESTS_DIR}/run-tests.sh"] = "run-tests.sh"
    grader = PythonGrader(
        type="python",
        function=f"{GRADE}:grade_terminal_bench",
        files=files,
        timeout=test_timeout + 60,
        network=True,  # the harness's tests download what they need
        outputs=_declared_outputs(data.get("agentrl"), root / "task.yaml"),
    )
    workdir = _workdir(root / "Dockerfile") or WORKDIR_OF_IMAGE
    sandbox = SandboxConfig(recipe=".", workdir=workdir, env={"TEST_DIR": TESTS_DIR})
    fields = {"instruction": instruction.strip(), "test_timeout_sec": test_timeout}
    return fields, sandbox, grader, agent_timeout


def _harbor(root: Path) -> tuple[dict[str, Any], SandboxConfig, PythonGrader, float]:
    try:
        data = tomllib.loads((root / "task.toml").read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{root / 'task.toml'}: {exc}") from None
    instruction_file = root / "instruction.md"
    if not instruction_file.is_file() or not instruction_file.read_text().strip():
        raise ConfigError(f"{root} has no instruction.md (or it is empty)")
    _refuse_unsupported(data, root / "task.toml")
    checks = harbor_verifier(data, root)
    test_sh = root / "tests" / "test.sh"
    if not test_sh.is_file() and checks.image is None:  # a verifier image brings its own
        raise ConfigError(f"{root} has no tests/test.sh", fix="add it (Harbor layout)")
    environment = _table(data, "environment")
    image = environment.get("docker_image") or None
    dockerfile = root / "environment" / "Dockerfile"
    if image is None and not dockerfile.is_file():
        raise ConfigError(f"{root}: no environment/Dockerfile and no environment.docker_image")
    built = dockerfile.is_file()  # a named image is used if present, else the Dockerfile built
    workdir = environment.get("workdir") or (_workdir(dockerfile) if built else None)
    sandbox = SandboxConfig(
        image=None if built else image,
        recipe="environment" if built else None,
        workdir=workdir or WORKDIR_OF_IMAGE,
        cpus=float(environment.get("cpus", 1)),
        memory_mb=_memory_mb(environment),
        disk_mb=_mib(environment, "storage", "10G"),
        env={str(k): str(v) for k, v in _table(environment, "env").items()},
        network=environment.get("allow_internet") is True,
    )
    verifier = _table(data, "verifier")
    test_timeout = float(verifier.get("timeout_sec", DEFAULT_TEST_TIMEOUT_S))
    declared = _declared_outputs(_table(data, "metadata").get("agentrl"), root / "task.toml")
    grader = PythonGrader(
        type="python",
        function=f"{GRADE}:grade_harbor",
        files={} if checks.bundled_tests else {TESTS_DIR: "tests"},
        timeout=test_timeout + 60,
        network=True,  # the harness's tests download what they need
        # what the task collects for its verifier is the agent's work, in either mode
        outputs=list(dict.fromkeys([*declared, *checks.artifacts])),
    )
    agent_timeout = float(_table(data, "agent").get("timeout_sec", DEFAULT_AGENT_TIMEOUT_S))
    fields = {
        "instruction": instruction_file.read_text().strip(),
        "test_timeout_sec": test_timeout,
        "verifier_env": {str(k): str(v) for k, v in _table(verifier, "env").items()},
        "pytest": test_sh.is_file() and "pytest" in test_sh.read_text(errors="replace"),
    }
    return fields, sandbox, grader, agent_timeout


def _declared_outputs(extension: object, path: Path) -> list[str]:
    """agentrl's one extension of these formats: `outputs` the grader sees beyond the
    workdir and the paths the tests name (`agentrl: {outputs: [...]}` in task.yaml,
    `[metadata.agentrl] outputs = [...]` in task.toml, where Harbor keeps free metadata)."""
    if extension is None:
        return []
    outputs = extension.get("outputs", []) if isinstance(extension, dict) else None
    if not isinstance(outputs, list) or not all(
        isinstance(o, str) and o.startswith("/") for o in outputs
    ):
        raise ConfigError(
            f"{path}: agentrl.outputs must be a list of absolute paths or patterns",
            fix='e.g. outputs = ["/usr/local/bin/mytool"]',
        )
    return outputs


def _yaml(path: Path) -> dict[str, Any]:
    data = load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def _yaml_list(path: Path) -> list[Any]:
    data = load_yaml(path)
    if not isinstance(data, list):
        raise ConfigError(f"{path}: expected a list at the top level")
    return data


def _table(data: dict[str, Any], key: str) -> dict[str, Any]:
    value = data.get(key) or {}
    if not isinstance(value, dict):
        raise ConfigError(f"task.toml: [{key}] must be a table")
    return value


def _single_container(compose: Path) -> None:
    if not compose.is_file():
        return
    services = (_yaml(compose).get("services") or {}).keys()
    if len(services) > 1:
        raise ConfigError(
            f"{compose}: services {', '.join(services)}: multi-container tasks are not supported",
            fix="agentrl starts one sandbox per episode, from the task's Dockerfile",
        )


def _workdir(dockerfile: Path) -> str | None:
    """The last WORKDIR of the Dockerfile's last stage (None if it sets none)."""
    workdir: str | None = None
    text = dockerfile.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        keyword, _, rest = line.strip().partition(" ")
        if keyword.upper() == "FROM":
            workdir = None
        elif keyword.upper() == "WORKDIR" and rest.strip():
            value = rest.strip().strip('"')
            workdir = value if value.startswith("/") else f"{workdir or ''}/{value}"
    return workdir


def _memory_mb(environment: dict[str, Any]) -> int:
    return _mib(environment, "memory", "2048M")


def _mib(environment: dict[str, Any], key: str, default: str) -> int:
    """`key`_mb, or `key` as older task.toml files write it ("2G", "10G")."""
    if f"{key}_mb" in environment:
        return int(environment[f"{key}_mb"])
    text = str(environment.get(key, default))
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", text, re.IGNORECASE)
    if match is None:
        raise ConfigError(f"task.toml: environment.{key}: cannot read {text!r}", fix='e.g. "2G"')
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[match.group(2).upper()]
    return max(64, int(float(match.group(1)) * scale))


UNSUPPORTED = (
    (("steps",), "multi-step tasks ([[steps]]) are not supported", "run each step as a task"),
    (("environment", "gpus"), "tasks that need GPUs are not supported", "drop environment.gpus"),
    (("environment", "mcp_servers"), "MCP servers beside the task are not supported", None),
)
"""What of Harbor's task.toml would change how an episode runs or is graded and agentrl
does not do: refused, never ignored (a task graded otherwise than Harbor grades it is a
wrong reward)."""


def _refuse_unsupported(data: dict[str, Any], path: Path) -> None:
    for keys, what, fix in UNSUPPORTED:
        value: Any = data
        for key in keys:
            value = value.get(key) if isinstance(value, dict) else None
        if value not in (None, [], {}, 0):
            raise ConfigError(
                f"{path}: {'.'.join(keys)}: {what}",
                fix=fix or "agentrl grades one sandbox per episode from the task's own image",
            )
