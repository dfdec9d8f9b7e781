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


def test_policy_strings_and_the_train_config_parse_into_one_sampler_union() -> None:
    from pydantic import TypeAdapter

    from agentrl.inference.config import (
        LocalSamplerConfig,
        RouterConfig,
        SamplerConfig,
        ScriptedSamplerConfig,
        parse_policy,
    )
    from agentrl.train_config import TrainConfig

    assert parse_policy("local") == LocalSamplerConfig()
    assert parse_policy("scripted:s.yaml") == ScriptedSamplerConfig(script="s.yaml")
    routed = parse_policy("router:http://a:1,http://b:2")
    assert routed == RouterConfig(urls=["http://a:1", "http://b:2"])
    union = TypeAdapter(SamplerConfig)
    assert union.validate_python({"type": "openai", "url": "http://a:1"}) == parse_policy(
        "openai:http://a:1"
    )
    for bad in ("locl", "router:,", "openai:", "local:x"):
        with pytest.raises(ConfigError, match="unknown policy") as info:
            parse_policy(bad)
        assert "--policy router:" in info.value.fix
    schedule = {"type": "sync", "steps": 1, "prompts_per_step": 1, "n_samples_per_prompt": 2}
    config = TrainConfig.model_validate(
        {
            "name": "x",
            "tasks": ["t.yaml"],
            "schedule": schedule,
            "servers": {"urls": ["http://a:1"]},
        }
    )
    assert config.servers == RouterConfig(urls=["http://a:1"])  # the same type as --policy router:
    assert config.sampler_config(["http://r:3"]).urls == ["http://a:1", "http://r:3"]  # type: ignore[union-attr]
    local = config.model_copy(update={"servers": None}).sampler_config()
    assert local == LocalSamplerConfig(model="embedded", publish_pause=None)
    asyncly = TrainConfig.model_validate(
        {"name": "x", "tasks": ["t.yaml"], "schedule": {**schedule, "type": "async"}}
    )
    assert asyncly.sampler_config() == LocalSamplerConfig(publish_pause="keep")
    assert asyncly.sampler_config(["http://r:3"]) == RouterConfig(urls=["http://r:3"])
