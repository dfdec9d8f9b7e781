from pathlib import Path


def test_done():
    assert Path("/app/done").exists()
