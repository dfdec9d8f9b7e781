from pathlib import Path


def test_done_file_exists():
    assert Path("/app/out/done").is_file()
