"""Seams resolve implementations by short name or module:Class, and unknown names list choices."""

from __future__ import annotations

import pytest

from agentrl.errors import ConfigError
from agentrl.sandbox import provider
from agentrl.sandbox.local import LocalProvider
from agentrl.tools.base import REGISTRY, tool_class
from agentrl.tools.bash import BashTool


def test_short_names_and_paths_resolve() -> None:
    assert tool_class("bash") is BashTool
    assert tool_class("agentrl.tools.bash:BashTool") is BashTool
    assert isinstance(provider("local"), LocalProvider)
    for name in REGISTRY:
        assert isinstance(tool_class(name), type)


def test_unknown_names_list_the_choices() -> None:
    with pytest.raises(ConfigError) as info:
        tool_class("bsh")
    assert "unknown tool 'bsh'" in str(info.value) and "bash, browser" in info.value.fix
    with pytest.raises(ConfigError, match="unknown sandbox provider 'dokcer'"):
        provider("dokcer")
    with pytest.raises(ConfigError, match="cannot import"):
        tool_class("agentrl.tools.nope:Nope")
    with pytest.raises(ConfigError, match="bad options"):
        provider("local", colour="blue")
