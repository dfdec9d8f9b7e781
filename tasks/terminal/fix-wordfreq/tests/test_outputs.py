"""wordfreq.py counts words case-insensitively and ranks them as specified."""

import subprocess
from pathlib import Path

SCRIPT = "/app/wordfreq.py"


def run(tmp_path: Path, text: str, *args: str) -> str:
    source = tmp_path / "input.txt"
    source.write_text(text)
    done = subprocess.run(
        ["python3", SCRIPT, str(source), *args], capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_sample_from_the_instructions(tmp_path: Path) -> None:
    text = "The cat sat. The dog sat, too!\nA cat is not a dog; the CAT knows it.\n"
    assert run(tmp_path, text, "-n", "3") == "cat 3\nthe 3\na 2\n"


def test_default_is_ten_words(tmp_path: Path) -> None:
    text = " ".join(f"w {chr(97 + i)}" for i in range(12))
    lines = run(tmp_path, text).splitlines()
    assert len(lines) == 10
    assert lines[0] == "w 12"
    assert lines[1:] == [f"{chr(97 + i)} 1" for i in range(9)]


def test_punctuation_digits_and_case_separate_words(tmp_path: Path) -> None:
    text = "Hello, hello! HELLO? world's end--end;end 42end x1y"
    assert run(tmp_path, text, "-n", "4") == "end 4\nhello 3\ns 1\nworld 1\n"


def test_ties_are_alphabetical(tmp_path: Path) -> None:
    assert run(tmp_path, "pear apple fig apple fig pear", "-n", "5") == (
        "apple 2\nfig 2\npear 2\n"
    )


def test_empty_file(tmp_path: Path) -> None:
    assert run(tmp_path, "") == ""
