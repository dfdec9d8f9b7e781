from pathlib import Path

import packaging.version  # installed by run-tests.sh (offline: from agentrl's wheelhouse)


def test_status_file_says_ready():
    assert Path("/app/status.txt").read_text() == "ready\n"


def test_the_test_dependencies_are_there():
    assert packaging.version.Version("24.2") > packaging.version.Version("1.0")
