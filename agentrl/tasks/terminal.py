"""Terminal-Bench and Harbor task folders, loaded as they are (no conversion step).

Terminal-Bench (laude-institute/terminal-bench): `task.yaml` (`instruction`,
`max_agent_timeout_sec`, `max_test_timeout_sec`), a `Dockerfile` at the folder root,
`run-tests.sh`, `tests/`, `solution.sh`. The image is the one its harness would use if
present (`tb__<task>__client`), else the Dockerfile built with the network
(`AGENTRL_BUILD_NETWORK`, default host); the container has `TEST_DIR=/tests` as the
task's docker-compose.yaml sets. After the agent, its harness copies `run-tests.sh` and
`tests/` into `/tests`, runs `bash /tests/run-tests.sh` and parses pytest's `-rA` summary
with its PytestParser: the test name is what follows the first `::`, a FAILED line loses
its ` - message`, and the task is resolved when every parsed test passed (skipped and
xfail count as passed). agentrl does the same; a run whose output has no summary, or
none with a test in it, did not run (`DidNotRun`).

Harbor: `task.toml` (`[agent]`/`[verifier]` `timeout_sec`, `[environment]` `cpus`,
`memory_mb`, `docker_image`), `instruction.md`, `environment/Dockerfile`,
`tests/test.sh`, `solution/solve.sh`. Its verifier uploads `tests/` to `/tests`, runs
`/tests/test.sh` and reads the reward from `/logs/verifier/reward.txt` (or
`reward.json`). A missing reward file, or a pytest-based test.sh whose output has no
pytest summary, did not run.

Without internet, the standard uv/pytest bootstrap of these tests runs on agentrl's
offline test runtime (`agentrl.tasks.offline`), recorded in the grade's evidence.
Either way the result is a `Task` with one instance; tests reach the sandbox at EVAL.
"""

from __future__ import annotations

import asyncio
import re
import shlex
import tomllib
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import ValidationError

from agentrl.errors import ConfigError, SandboxError, SandboxFileNotFound
from agentrl.sandbox.base import ExecRequest, ExecResult, Sandbox, SandboxSpec
from agentrl.sandbox.images import docker_client, folder_hash
from agentrl.tasks import offline
from agentrl.tasks.env import TaskEnv, put_path
from agentrl.tasks.graders import (
    DidNotRun,
    Grade,
    check_collected,
    count_tests,
    parse_reward,
    ran,
    tail,
)
from agentrl.tasks.spec import (
    EpisodeLimits,
    Instance,
    PromptConfig,
    PythonGrader,
    SandboxConfig,
    Task,
    TaskSpec,
)

Format = Literal["terminal-bench", "harbor"]

TESTS_DIR = "/tests"
REWARD_DIR = "/logs/verifier"
TB_ORACLE = "/oracle/solution.sh"
HARBOR_SOLUTION_DIR = "/solution"
DEFAULT_AGENT_TIMEOUT_S = 1800.0
DEFAULT_TEST_TIMEOUT_S = 120.0
WORKDIR_OF_IMAGE = "/"
"""A folder whose Dockerfile sets no WORKDIR works where its image does (resolved then)."""
TB_PASSING = ("PASSED", "XFAIL", "SKIPPED")
TB_STATUSES = ("PASSED", "FAILED", "SKIPPED", "XFAIL", "XPASS", "ERROR")
RUNTIME = f"if [ -f {offline.ENV_FILE} ]; then . {offline.ENV_FILE}; fi; "
"""Prefix of every test command: the offline test runtime, where EVAL installed it."""
_SUMMARY = re.compile(r"=+\s*short test summary info\s*=+", re.IGNORECASE)
SYSTEM_PROMPT = (
    "You are an expert at solving tasks in a Linux terminal. You work inside a sandboxed "
    "container without network access. Use the tools to inspect the environment, make the "
    "changes the task asks for, check your work, and call finish when the task is done."
)
# Harbor clears the verifier folder, runs test.sh as an executable and keeps its output.
HARBOR_VERIFY = (
    f"rm -rf {REWARD_DIR} && mkdir -p {REWARD_DIR} && chmod +x {TESTS_DIR}/test.sh && "
    f"{TESTS_DIR}/test.sh 2>&1 | tee {REWARD_DIR}/test-stdout.txt; "
    f"if [ ! -e {REWARD_DIR}/reward.txt ] && [ -e {REWARD_DIR}/reward.json ]; then "
    f"cp {REWARD_DIR}/reward.json {REWARD_DIR}/reward.txt; fi"
)


def detect_format(folder: Path) -> Format:
    """`harbor` for a task.toml folder, `terminal-bench` for a task.yaml one."""
    if (folder / "task.toml").is_file():
        return "harbor"
    if (folder / "task.yaml").is_file():
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
        env=f"{__name__}:TerminalEnv",
        format=kind,
    )


class TerminalEnv(TaskEnv):
    """A Terminal-Bench or Harbor folder's runtime: the harness's own image if present, the
    offline test runtime at EVAL, the reference solution run as the harness runs it."""

    _image_workdir: str | None = None

    async def _resolve_image(self) -> str:
        prebuilt = prebuilt_image(Path(self.task.path))
        if (
            self.task.spec.sandbox.recipe
            and prebuilt
            and self.provider.name == "docker"
            and await asyncio.to_thread(_present, prebuilt)
        ):
            return prebuilt
        return await super()._resolve_image()

    async def spec(self, instance: Instance, name: str) -> SandboxSpec:
        """The task's sandbox; where the task names no working directory, the image's
        (as the harness's terminal starts there)."""
        spec = await super().spec(instance, name)
        if self.task.spec.sandbox.workdir != WORKDIR_OF_IMAGE or self.provider.name != "docker":
            return spec
        if self._image_workdir is None:
            self._image_workdir = await asyncio.to_thread(_working_dir, spec.image)
        return spec.model_copy(update={"workdir": self._image_workdir})

    async def grade(self, sandbox: Sandbox, instance: Instance) -> Grade:
        needs = offline.read_scripts(verifier_scripts(Path(self.task.path)))
        offline_only = needs.uses_bootstrap and self.eval_network() is None
        brought = await offline.install(sandbox, needs) if offline_only else []
        try:
            graded = await super().grade(sandbox, instance)
        except DidNotRun as failed:
            failed.evidence.substitutions = brought + await offline.substitutions(sandbox)
            if any(offline.NO_PYTHON in line for line in brought):
                failed.fix = (
                    "the tests need a Python the sandbox does not have and none could be "
                    "brought: build the image with it, or grade where uv can download one"
                )
            raise
        graded.evidence.substitutions = brought + await offline.substitutions(sandbox)
        return graded

    async def run_oracle(self, sandbox: Sandbox, instance: Instance) -> str:
        done = await run_oracle(self.task, sandbox)
        if done.exit_code != 0:
            how = "timed out" if done.timed_out else f"exited {done.exit_code}"
            raise SandboxError(f"the reference solution {how}: {tail(done.output)}")
        return done.output


def prebuilt_image(folder: Path) -> str | None:
    """The image a harness would use rather than build: the name Terminal-Bench's harness
    builds a folder's Dockerfile as; Harbor's `environment.docker_image`."""
    if detect_format(folder) == "terminal-bench":
        return f"tb__{folder.name}".replace(".", "-") + "__client"
    environment = _table(tomllib.loads((folder / "task.toml").read_text()), "environment")
    return str(environment["docker_image"]) if environment.get("docker_image") else None


def _working_dir(image: str) -> str:
    client = docker_client()
    try:
        return str(client.images.get(image).attrs["Config"].get("WorkingDir") or "/")
    finally:
        client.close()


def verifier_scripts(folder: Path) -> list[str]:
    """The shell scripts a task's tests run: run-tests.sh and every .sh under tests/."""
    paths = [folder / "run-tests.sh", *sorted((folder / "tests").rglob("*.sh"))]
    return [p.read_text(errors="replace") for p in paths if p.is_file()]


def _present(image: str) -> bool:
    client = docker_client()
    try:
        return bool(client.images.list(name=image))
    finally:
        client.close()


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


async def run_oracle(task: Task, sandbox: Sandbox, timeout: float = 600.0) -> ExecResult:
    """Copy the reference solution in as each harness does, and run it in the workdir."""
    root, script = Path(task.path), oracle_script(task.path)
    if detect_format(root) == "harbor":
        await put_path(sandbox, script.parent, HARBOR_SOLUTION_DIR)
        command = f"bash {HARBOR_SOLUTION_DIR}/{script.name}"
    elif script.suffix == ".yaml":
        await sandbox.write_file(TB_ORACLE, solution_commands(script).encode(), mode=0o755)
        command = f"bash {TB_ORACLE}"
    else:
        await put_path(sandbox, script, TB_ORACLE)
        command = f"bash {TB_ORACLE}"
    return await sandbox.exec(ExecRequest(command=command, timeout=timeout))


async def grade_terminal_bench(sandbox: Sandbox, instance: Instance) -> Grade:
    """Terminal-Bench's grading: run /tests/run-tests.sh, parse pytest's summary from it."""
    timeout = float(instance.fields.get("test_timeout_sec", DEFAULT_TEST_TIMEOUT_S))
    command = f"bash {TESTS_DIR}/run-tests.sh"
    request = ExecRequest(command=RUNTIME + command, timeout=timeout, env={"TEST_DIR": TESTS_DIR})
    result = await sandbox.exec(request)
    evidence = ran(result, "run-tests.sh", "terminal-bench", command)
    tests = parse_tb_pytest(result.output)
    evidence.tests = tests
    check_collected(result.output, evidence)
    if not tests:
        found = "no pytest summary" if not _SUMMARY.search(result.output) else "no test in it"
        raise DidNotRun(
            f"run-tests.sh (exit {result.exit_code}): {found}: {tail(result.output)}", evidence
        )
    resolved = all(status in TB_PASSING for status in tests.values())
    components = {"resolved": resolved, "exit_code": result.exit_code}
    components |= count_tests(tests, TB_PASSING)
    return Grade(
        reward=1.0 if resolved else 0.0, components=components, evidence=evidence, seconds=0.0
    )


def parse_tb_pytest(output: str) -> dict[str, str]:
    """Test name -> status as Terminal-Bench's PytestParser reads a `pytest -rA` run: what
    follows the first `short test summary info` line, a name after its first `::`, a
    FAILED line's ` - message` cut off."""
    parts = _SUMMARY.split(output, maxsplit=1)
    if len(parts) < 2:
        return {}
    tests: dict[str, str] = {}
    for line in parts[1].splitlines():
        if line.startswith("FAILED") and " - " in line:
            line = " - ".join(line.split(" - ")[:-1])
        words = line.split(maxsplit=1)
        if len(words) < 2 or words[0].strip(":") not in TB_STATUSES:
            continue
        name = words[1].strip().split("::", maxsplit=1)[-1]
        if name:
            tests[name] = words[0].strip(":")
    return tests


async def grade_harbor(sandbox: Sandbox, instance: Instance) -> Grade:
    """Harbor's verifier: run /tests/test.sh, read /logs/verifier/reward.txt (or .json)."""
    exports = "".join(
        f"export {k}={shlex.quote(str(v))}; " for k, v in instance.fields["verifier_env"].items()
    )
    timeout = float(instance.fields.get("test_timeout_sec", DEFAULT_TEST_TIMEOUT_S))
    result = await sandbox.exec(
        ExecRequest(command=RUNTIME + exports + HARBOR_VERIFY, timeout=timeout)
    )
    evidence = ran(result, "tests/test.sh", "harbor", f"{TESTS_DIR}/test.sh")
    tests = parse_tb_pytest(result.output)
    evidence.tests = tests
    check_collected(result.output, evidence)
    try:
        data = await sandbox.read_file(f"{REWARD_DIR}/reward.txt")
    except SandboxFileNotFound:
        raise DidNotRun(
            f"tests/test.sh exited {result.exit_code} and wrote no {REWARD_DIR}/reward.txt: "
            f"{tail(result.output)}",
            evidence,
        ) from None
    reward, extra = parse_reward(data.decode(errors="replace"), f"{REWARD_DIR}/reward.txt")
    if instance.fields.get("pytest") and not tests:  # reward 0 because pytest never ran
        raise DidNotRun(
            f"tests/test.sh wrote reward {reward:g} but pytest reported no test: "
            f"{tail(result.output)}",
            evidence,
        )
    components = {"exit_code": result.exit_code, **extra}
    if tests:
        components |= count_tests(tests, TB_PASSING)
    return Grade(reward=reward, components=components, evidence=evidence, seconds=0.0)


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
        function=f"{__name__}:grade_terminal_bench",
        files=files,
        timeout=test_timeout + 60,
        network=True,  # the harness's tests download what they need
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
    if not (root / "tests" / "test.sh").is_file():
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
    )
    verifier = _table(data, "verifier")
    test_timeout = float(verifier.get("timeout_sec", DEFAULT_TEST_TIMEOUT_S))
    grader = PythonGrader(
        type="python",
        function=f"{__name__}:grade_harbor",
        files={TESTS_DIR: "tests"},
        timeout=test_timeout + 60,
        network=True,  # the harness's tests download what they need
    )
    agent_timeout = float(_table(data, "agent").get("timeout_sec", DEFAULT_AGENT_TIMEOUT_S))
    fields = {
        "instruction": instruction_file.read_text().strip(),
        "test_timeout_sec": test_timeout,
        "verifier_env": {str(k): str(v) for k, v in _table(verifier, "env").items()},
        "pytest": "pytest" in (root / "tests" / "test.sh").read_text(errors="replace"),
    }
    return fields, sandbox, grader, agent_timeout


def _yaml(path: Path) -> dict[str, Any]:
    data = _load_yaml(path)
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return data


def _yaml_list(path: Path) -> list[Any]:
    data = _load_yaml(path)
    if not isinstance(data, list):
        raise ConfigError(f"{path}: expected a list at the top level")
    return data


def _load_yaml(path: Path) -> object:
    try:
        return yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None


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
    if "memory_mb" in environment:
        return int(environment["memory_mb"])
    memory = str(environment.get("memory", "2048M"))  # older task.toml files: "2G"
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*", memory, re.IGNORECASE)
    if match is None:
        raise ConfigError(f"task.toml: environment.memory: cannot read {memory!r}", fix='e.g. "2G"')
    scale = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[match.group(2).upper()]
    return max(64, int(float(match.group(1)) * scale))
