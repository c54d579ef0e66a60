"""`+models.NAME=[OVERRIDES]`: each entry composed into a config of its own (deltafin.config.models)."""

from __future__ import annotations

import pytest

from deltafin.cli import checked_configs
from deltafin.config import ConfigError
from deltafin.config.models import PROCESS_KEYS, check_served_names, entry_overrides
from tests.conftest import compose_config


def entry(name: str, overrides: list[str]) -> str:
    return f"+models.{name}=[" + ",".join(f'"{item}"' for item in overrides) + "]"


def test_an_entry_is_composed_from_its_own_overrides_alone_and_served_as_its_name(tmp_path):
    main, kimi = checked_configs(
        [
            "model.context_length=1024",
            "server.port=9123",
            entry(
                "kimi",
                [
                    "model=kimi_k3",
                    f"model.path={tmp_path}",
                    "compat=para",
                    "engine.max_batch=2",
                    "server.queue.max_waiting=3",
                ],
            ),
        ]
    )
    assert (main.model.family, main.model.context_length, main.engine.max_batch) == ("smollm2", 1024, 8)
    assert (kimi.model.family, kimi.model.name, kimi.model.path) == ("kimi_k3", "kimi", str(tmp_path))
    assert kimi.model.context_length is None  # nothing of the main command line carried over
    assert (kimi.engine.max_batch, kimi.server.queue.max_waiting) == (2, 3)
    assert "force_tool_choice_auto" in kimi.compat.rules and not main.compat.rules  # compat=para, its own
    assert not compose_config().models and list(main.models) == ["kimi"]


def test_an_entry_that_names_itself_is_served_under_that_name(tmp_path):
    _, glm = checked_configs(
        [entry("glm", ["model=glm", "model.variant=glm47", f"model.path={tmp_path}", "model.name=glm-4.7"])]
    )
    assert glm.model.name == "glm-4.7"  # a name with a dot cannot be a key of `models`


@pytest.mark.parametrize("key", PROCESS_KEYS)
def test_process_wide_keys_are_refused_in_an_entry(key):
    with pytest.raises(ConfigError, match=f"^models.x: {key}.* belongs to the whole process"):
        entry_overrides("x", ["model=glm", f"{key}.y=1" if key.endswith(("connections", "responses")) else f"{key}=1"])


def test_per_model_server_keys_are_the_entrys_own():
    assert (
        entry_overrides("x", ["server.queue.max_waiting=1", "server.memo.entries=0", "server.grammar.workers=1"])[-1]
        == "model.name=x"
    )


def test_a_name_served_twice_names_the_later_entry():
    with pytest.raises(ConfigError, match="^models.b: the name 'x' is served by models.a already"):
        check_served_names([("", ["main"]), ("a", ["x"]), ("b", ["y", "x"])])
    with pytest.raises(ConfigError, match="^models.a: the name 'main' is served by the main model already"):
        check_served_names([("", ["main", "alias"]), ("a", ["main"])])
    check_served_names([("", ["main", "alias"]), ("a", ["a"])])


@pytest.mark.parametrize(
    "alias,name,matches",
    [
        ("claude-*", "claude-opus-5-5", True),
        ("claude-*", "claude-", True),
        ("claude-*", "claude", False),
        ("claude-*", "xclaude-opus", False),
        ("*-k3", "kimi-k3", True),
        ("a*b*c", "aXXbYYc", True),
        ("a*b*c", "acb", False),
        ("ab*ba", "aba", False),
        ("kimi", "kimi", True),
        ("kimi", "kimi-k3", False),
        ("a.b", "axb", False),  # only `*` is special
    ],
)
def test_alias_patterns(alias, name, matches):
    from deltafin.config.models import name_matches

    assert name_matches(alias, name) is matches
