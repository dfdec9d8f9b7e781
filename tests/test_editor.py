"""str_replace_editor against real sandboxes: every command, every agent mistake, bytes kept."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Awaitable, Callable

import pytest

from agentrl.errors import ConfigError
from agentrl.sandbox import provider
from agentrl.sandbox.base import ExecRequest, Sandbox, SandboxSpec
from agentrl.tools.base import Observation, schema, tool_class
from agentrl.tools.editor import COMMANDS, EditorTool, clip

PROVIDERS = ["local", pytest.param("docker", marks=pytest.mark.docker)]

Body = Callable[[Sandbox, EditorTool], Awaitable[None]]
Run = Callable[..., None]


@pytest.fixture(params=PROVIDERS)
def run(request: pytest.FixtureRequest) -> Run:
    """Runs a test body against a fresh sandbox of the provider and a fresh tool."""

    def go(body: Body, **tool_options: int) -> None:
        async def main() -> None:
            spec = SandboxSpec(run_id=f"test-editor-{uuid.uuid4().hex[:8]}")
            sandbox = await provider(request.param).start(spec)
            tool = EditorTool(**tool_options)
            try:
                await body(sandbox, tool)
            finally:
                await tool.close()
                await sandbox.close()

        asyncio.run(asyncio.wait_for(main(), timeout=120))

    return go


def ok(observation: Observation) -> str:
    assert not observation.error, observation.text
    assert not observation.done
    return observation.text


def refused(observation: Observation, *fragments: str) -> str:
    assert observation.error, observation.text
    for fragment in fragments:
        assert fragment in observation.text, observation.text
    return observation.text


def at(sandbox: Sandbox, name: str) -> str:
    return f"{sandbox.spec.workdir}/{name}"


# -- schema -------------------------------------------------------------------------------


def test_schema_is_an_object_schema_with_the_command_enum() -> None:
    tool = EditorTool()
    parameters = tool.parameters
    assert parameters["type"] == "object"
    assert parameters["additionalProperties"] is False
    assert parameters["required"] == ["command", "path"]
    assert parameters["properties"]["command"]["enum"] == list(COMMANDS)
    assert COMMANDS == ("view", "create", "str_replace", "insert", "undo_edit")
    for name, prop in parameters["properties"].items():
        assert prop["type"] in {"string", "integer", "array"}, name
        assert prop["description"], name
    assert parameters["properties"]["view_range"]["items"] == {"type": "integer"}
    rendered = json.loads(json.dumps(schema(tool)))
    assert rendered["name"] == "str_replace_editor"
    assert tool_class("str_replace_editor") is EditorTool


def test_clip_keeps_head_and_tail_within_the_limit() -> None:
    text = "".join(f"line {i}\n" for i in range(5000))
    clipped = clip(text, 1000)
    assert len(clipped) <= 1000
    assert clipped.startswith("line 0\n")
    assert clipped.endswith("line 4999\n")
    assert "<response clipped:" in clipped
    assert clip("short", 1000) == "short"
    with pytest.raises(ConfigError, match="too small"):
        EditorTool(max_output_chars=100)


# -- view ---------------------------------------------------------------------------------


def test_view_numbers_lines_like_cat_n(run: Run) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        path = at(sandbox, "hello.py")
        await sandbox.write_file(path, "def hi():\n\treturn 'héllo ✓ 世界'\n".encode())
        text = ok(await tool(sandbox, command="view", path=path))
        assert text == (
            f"Here's the result of running `cat -n` on {path}:\n"
            "     1\tdef hi():\n"
            "     2\t\treturn 'héllo ✓ 世界'"
        )

    run(body)


def test_view_range_shows_part_and_rejects_bad_ranges(run: Run) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        path = at(sandbox, "five.txt")
        await sandbox.write_file(path, b"one\ntwo\nthree\nfour\nfive\n")
        text = ok(await tool(sandbox, command="view", path=path, view_range=[2, 3]))
        assert text.endswith("     2\ttwo\n     3\tthree")
        text = ok(await tool(sandbox, command="view", path=path, view_range="[4, -1]"))
        assert text.endswith("     4\tfour\n     5\tfive")
        assert "three" not in text
        for bad, fragment in [
            ([0, 2], "first element 0 must be within [1, 5]"),
            ([6, -1], "first element 6 must be within [1, 5]"),
            ([3, 2], "second element 2 must be at least its first 3"),
            ([2, 9], "past the end of the file (5 lines)"),
            ([1], "must be a list of two integers"),
            ("1-3", "must be a list of two integers"),
            ([1, "x"], "must be an integer"),
            ("[1, 2", "must be a list of two integers"),
        ]:
            refused(await tool(sandbox, command="view", path=path, view_range=bad), fragment)
        empty = at(sandbox, "empty.txt")
        await sandbox.write_file(empty, b"")
        assert ok(await tool(sandbox, command="view", path=empty)).endswith("(the file is empty)")
        refused(await tool(sandbox, command="view", path=empty, view_range=[1, 1]), "empty")
        refused(
            await tool(sandbox, command="view", path=sandbox.spec.workdir, view_range=[1, 2]),
            "not allowed when `path` is a directory",
        )

    run(body)


def test_view_of_a_long_file_is_clipped_with_a_view_range_hint(
    run: Run,
) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        path = at(sandbox, "long.txt")
        await sandbox.write_file(path, "".join(f"row {i}\n" for i in range(1, 5001)).encode())
        text = ok(await tool(sandbox, command="view", path=path))
        assert len(text) <= 2000
        assert "     1\trow 1\n" in text
        assert "row 5000" not in text
        assert "of 5000; use `view_range` to see the rest" in text
        text = ok(await tool(sandbox, command="view", path=path, view_range=[4990, -1]))
        assert text.endswith("  5000\trow 5000")

    run(body, max_output_chars=2000)


def test_view_of_a_directory_lists_two_levels_without_hidden_items(
    run: Run,
) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        root = at(sandbox, "proj")
        for name in ["a.py", "src/b.py", "src/deep/c.py", ".env", ".git/config", "src/.cache"]:
            await sandbox.write_file(f"{root}/{name}", b"x\n")
        text = ok(await tool(sandbox, command="view", path=root))
        assert text.splitlines() == [
            f"Here's the files and directories up to 2 levels deep in {root}, "
            "excluding hidden items:",
            f"{root}/",
            f"{root}/a.py",
            f"{root}/src/",
            f"{root}/src/b.py",
            f"{root}/src/deep/",
        ]
        # A hidden directory named explicitly is still listed.
        text = ok(await tool(sandbox, command="view", path=f"{root}/.git"))
        assert f"{root}/.git/config" in text

    run(body)


def test_view_of_a_binary_file_gives_its_size_not_its_bytes(run: Run) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        path = at(sandbox, "blob.bin")
        await sandbox.write_file(path, bytes(range(256)))
        text = ok(await tool(sandbox, command="view", path=path))
        assert "binary file (256 bytes)" in text
        assert "\x00" not in text
        nul = at(sandbox, "nul.txt")
        await sandbox.write_file(nul, b"text\x00more\n")
        assert "binary file (10 bytes)" in ok(await tool(sandbox, command="view", path=nul))

    run(body)


# -- create -------------------------------------------------------------------------------


def test_create_writes_exact_bytes_and_makes_parent_directories(
    run: Run,
) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        path = at(sandbox, "new/pkg/mod.py")
        content = "# ünïcode ✓\n\tx = 1\r\nno newline at the end"
        text = ok(await tool(sandbox, command="create", path=path, file_text=content))
        assert text == f"File created successfully at: {path}"
        assert await sandbox.read_file(path) == content.encode()
        empty = at(sandbox, "empty.txt")
        ok(await tool(sandbox, command="create", path=empty, file_text=""))
        assert await sandbox.read_file(empty) == b""

    run(body)


def test_create_refuses_an_existing_file_or_a_directory(run: Run) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        path = at(sandbox, "keep.txt")
        await sandbox.write_file(path, b"original\n")
        refused(
            await tool(sandbox, command="create", path=path, file_text="new\n"),
            "File already exists at",
            "use `str_replace`",
        )
        assert await sandbox.read_file(path) == b"original\n"
        refused(
            await tool(sandbox, command="create", path=sandbox.spec.workdir, file_text="x"),
            "is a directory",
        )
        refused(
            await tool(sandbox, command="create", path=at(sandbox, "n.txt")),
            "`file_text` argument is required for command `create`",
        )

    run(body)


# -- str_replace --------------------------------------------------------------------------


SOURCE = "".join(f"line {i}\n" for i in range(1, 21)).replace("line 10\n", "\tcore = 1\n")


def test_str_replace_edits_exactly_and_shows_a_numbered_snippet(
    run: Run,
) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        path = at(sandbox, "src.py")
        await sandbox.write_file(path, SOURCE.encode())
        text = ok(
            await tool(
                sandbox,
                command="str_replace",
                path=path,
                old_str="\tcore = 1",
                new_str="\tcore = 2",
            )
        )
        expected = SOURCE.replace("\tcore = 1", "\tcore = 2")
        assert await sandbox.read_file(path) == expected.encode()  # tab kept, nothing else moved
        numbered = "\n".join(f"{i:6}\t{line}" for i, line in enumerate(expected.splitlines(), 1))
        snippet = "\n".join(numbered.splitlines()[5:14])  # lines 6..14: the edit ±4
        assert text == (
            f"The file {path} has been edited. Here's the result of running `cat -n` on a "
            f"snippet of {path}:\n{snippet}\n"
            "Review the changes and make sure they are as expected. Edit the file again if "
            "necessary."
        )

    run(body)


def test_str_replace_with_an_empty_new_str_deletes(run: Run) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        path = at(sandbox, "del.txt")
        await sandbox.write_file(path, b"keep\ndrop me\nkeep too\n")
        ok(await tool(sandbox, command="str_replace", path=path, old_str="drop me\n", new_str=""))
        assert await sandbox.read_file(path) == b"keep\nkeep too\n"
        ok(await tool(sandbox, command="str_replace", path=path, old_str="keep too\n"))
        assert await sandbox.read_file(path) == b"keep\n"

    run(body)


def test_str_replace_refuses_zero_or_several_matches(run: Run) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        path = at(sandbox, "dup.py")
        content = b"x = 1\ny = 2\nx = 1\n\n\nx = 1\n"
        await sandbox.write_file(path, content)
        refused(
            await tool(sandbox, command="str_replace", path=path, old_str="z = 3", new_str="z"),
            "old_str `z = 3` did not appear verbatim in",
        )
        refused(
            await tool(sandbox, command="str_replace", path=path, old_str="x = 1", new_str="x"),
            "Multiple occurrences of old_str `x = 1`",
            "starting on lines 1, 3, 6.",
        )
        refused(
            await tool(sandbox, command="str_replace", path=path, old_str=" x = 1", new_str="x"),
            "did not appear verbatim",
        )
        refused(
            await tool(sandbox, command="str_replace", path=path, old_str="", new_str="x"),
            "`old_str` must not be empty",
        )
        refused(
            await tool(sandbox, command="str_replace", path=path, old_str="y = 2", new_str="y = 2"),
            "identical",
        )
        refused(
            await tool(sandbox, command="str_replace", path=path, new_str="x"),
            "`old_str` argument is required for command `str_replace`",
        )
        assert await sandbox.read_file(path) == content

    run(body)


def test_crlf_and_a_missing_final_newline_are_kept(run: Run) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        crlf = at(sandbox, "dos.txt")
        await sandbox.write_file(crlf, b"alpha\r\nbeta\r\ngamma\r\n")
        text = ok(await tool(sandbox, command="view", path=crlf))
        assert "     2\tbeta\n" in text
        assert "\r" not in text
        # The agent writes "\n"; the file keeps "\r\n" everywhere.
        ok(
            await tool(
                sandbox, command="str_replace", path=crlf, old_str="alpha\nbeta", new_str="A\nB"
            )
        )
        ok(await tool(sandbox, command="insert", path=crlf, insert_line=3, new_str="delta\nomega"))
        assert await sandbox.read_file(crlf) == b"A\r\nB\r\ngamma\r\ndelta\r\nomega\r\n"

        bare = at(sandbox, "bare.txt")
        await sandbox.write_file(bare, b"one\ntwo")
        ok(await tool(sandbox, command="str_replace", path=bare, old_str="two", new_str="2"))
        assert await sandbox.read_file(bare) == b"one\n2"
        ok(await tool(sandbox, command="insert", path=bare, insert_line=2, new_str="three"))
        assert await sandbox.read_file(bare) == b"one\n2\nthree"

    run(body)


def test_binary_files_are_refused_and_left_byte_identical(run: Run) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        path = at(sandbox, "all.bin")
        blob = bytes(range(256)) * 4
        await sandbox.write_file(path, blob)
        refused(
            await tool(sandbox, command="str_replace", path=path, old_str="A", new_str="B"),
            "binary file (1024 bytes)",
        )
        refused(
            await tool(sandbox, command="insert", path=path, insert_line=0, new_str="x"),
            "binary file",
        )
        refused(await tool(sandbox, command="undo_edit", path=path), "No edit history")
        assert await sandbox.read_file(path) == blob

    run(body)


def test_editing_keeps_the_file_mode(run: Run) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        path = at(sandbox, "run.sh")
        await sandbox.write_file(path, b"#!/bin/sh\necho one\n", mode=0o755)
        ok(await tool(sandbox, command="str_replace", path=path, old_str="one", new_str="two"))
        result = await sandbox.exec(ExecRequest(command="./run.sh"))
        assert (result.exit_code, result.output) == (0, "two\n")

    run(body)


# -- insert -------------------------------------------------------------------------------


def test_insert_at_the_top_middle_and_end(run: Run) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        path = at(sandbox, "ins.txt")
        await sandbox.write_file(path, b"b\nd\n")
        text = ok(await tool(sandbox, command="insert", path=path, insert_line=0, new_str="a"))
        assert "     1\ta\n     2\tb\n     3\td\n" in text
        assert "Review the changes" in text
        ok(await tool(sandbox, command="insert", path=path, insert_line=2, new_str="c\n"))
        ok(await tool(sandbox, command="insert", path=path, insert_line=4, new_str="e\nf"))
        assert await sandbox.read_file(path) == b"a\nb\nc\nd\ne\nf\n"
        empty = at(sandbox, "empty.txt")
        await sandbox.write_file(empty, b"")
        ok(await tool(sandbox, command="insert", path=empty, insert_line=0, new_str="first"))
        assert await sandbox.read_file(empty) == b"first\n"

    run(body)


def test_insert_validates_its_arguments(run: Run) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        path = at(sandbox, "ins.txt")
        await sandbox.write_file(path, b"1\n2\n3\n")
        for line in (-1, 4):
            refused(
                await tool(sandbox, command="insert", path=path, insert_line=line, new_str="x"),
                f"Invalid `insert_line` {line}: it must be within [0, 3]",
            )
        refused(
            await tool(sandbox, command="insert", path=path, new_str="x"),
            "`insert_line` argument is required",
        )
        refused(
            await tool(sandbox, command="insert", path=path, insert_line=True, new_str="x"),
            "must be an integer",
        )
        refused(
            await tool(sandbox, command="insert", path=path, insert_line=1),
            "`new_str` argument is required for command `insert`",
        )
        assert await sandbox.read_file(path) == b"1\n2\n3\n"
        ok(await tool(sandbox, command="insert", path=path, insert_line="3", new_str="4"))
        assert await sandbox.read_file(path) == b"1\n2\n3\n4\n"

    run(body)


# -- undo_edit ----------------------------------------------------------------------------


def test_undo_reverts_edits_in_reverse_order(run: Run) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        path = at(sandbox, "u.txt")
        original = "α\r\nβ\r\n".encode()
        await sandbox.write_file(path, original)
        ok(await tool(sandbox, command="str_replace", path=path, old_str="α", new_str="a"))
        after_replace = await sandbox.read_file(path)
        ok(await tool(sandbox, command="insert", path=path, insert_line=2, new_str="γ"))
        text = ok(await tool(sandbox, command="undo_edit", path=path))
        assert text.startswith(f"Last edit to {path} undone successfully.")
        assert "     1\ta\n     2\tβ" in text
        assert await sandbox.read_file(path) == after_replace
        ok(await tool(sandbox, command="undo_edit", path=path))
        assert await sandbox.read_file(path) == original
        refused(await tool(sandbox, command="undo_edit", path=path), "No edit history found")

    run(body)


def test_undo_of_create_removes_the_file(run: Run) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        path = at(sandbox, "made/new.txt")
        ok(await tool(sandbox, command="create", path=path, file_text="v1\n"))
        ok(await tool(sandbox, command="str_replace", path=path, old_str="v1", new_str="v2"))
        ok(await tool(sandbox, command="undo_edit", path=path))
        assert await sandbox.read_file(path) == b"v1\n"
        text = ok(await tool(sandbox, command="undo_edit", path=path))
        assert "it was created by `create`, so it was removed" in text
        refused(await tool(sandbox, command="view", path=path), "does not exist")
        refused(await tool(sandbox, command="undo_edit", path=path), "No edit history found")
        # Created again, the history is per tool instance and ends with the episode.
        ok(await tool(sandbox, command="create", path=path, file_text="v3\n"))
        await tool.close()
        refused(await tool(sandbox, command="undo_edit", path=path), "No edit history found")
        assert await sandbox.read_file(path) == b"v3\n"

    run(body)


# -- agent mistakes -----------------------------------------------------------------------


def test_agent_mistakes_are_error_observations(run: Run) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        missing = at(sandbox, "nope.txt")
        workdir = sandbox.spec.workdir
        cases: list[tuple[dict[str, object], str]] = [
            ({"command": "view", "path": "src/a.py"}, f"Maybe you meant {workdir}/src/a.py?"),
            ({"command": "view"}, "the `path` argument is required"),
            ({"command": "view", "path": 7}, "`path` must be a string, got int"),
            ({"command": "view", "path": "/a\x00b"}, "The `path` argument is required"),
            ({"command": "delete", "path": missing}, "unknown command 'delete'; use one of: view"),
            ({"path": missing}, "the `command` argument is required; use one of: view, create"),
            ({"command": "view", "path": missing, "colour": "red"}, "unknown argument(s) colour"),
            ({"command": "view", "path": missing}, f"The path {missing} does not exist"),
            ({"command": "str_replace", "path": missing, "old_str": "a"}, "does not exist"),
            ({"command": "insert", "path": missing, "insert_line": 0, "new_str": "a"}, "exist"),
            ({"command": "str_replace", "path": workdir, "old_str": "a"}, "is a directory"),
            ({"command": "create", "path": missing, "file_text": 3}, "must be a string, got int"),
        ]
        for arguments, fragment in cases:
            observation = await tool(sandbox, **arguments)
            refused(observation, fragment)
            assert "Traceback" not in observation.text

    run(body)


def test_long_observations_are_clipped(run: Run) -> None:
    async def body(sandbox: Sandbox, tool: EditorTool) -> None:
        path = at(sandbox, "small.txt")
        await sandbox.write_file(path, b"small\n")
        huge = "no such text " * 1000
        observation = await tool(sandbox, command="str_replace", path=path, old_str=huge)
        refused(observation, "<response clipped:")
        assert len(observation.text) <= 500

    run(body, max_output_chars=500)
