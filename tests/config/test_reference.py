"""docs/config.md is what the schema generates, and it documents every key once."""

from __future__ import annotations

import re

from omegaconf import OmegaConf

from deltafin.config.reference import render
from tests.conftest import REPO, compose_config


def test_docs_config_md_is_generated_from_the_schema():
    written = (REPO / "docs" / "config.md").read_text()
    assert written == render(), "regenerate: python -m deltafin.config.reference > docs/config.md"


def test_every_key_is_documented_once_with_its_meaning():
    rows = re.findall(r"^\| `([a-z_.]+)` \|.*\| (.*) \|$", render(), flags=re.MULTILINE)
    keys = [key for key, _ in rows]
    assert len(keys) == len(set(keys))
    assert all(what.strip() for _, what in rows), [key for key, what in rows if not what.strip()]

    def leaves(node, prefix=""):
        for name, value in node.items():
            if isinstance(value, dict) and name not in ("rules", "chat_template_kwargs", "max_memory", "models"):
                yield from leaves(value, f"{prefix}{name}.")
            else:
                yield prefix + name

    composed = OmegaConf.to_container(compose_config(), resolve=True)
    assert set(keys) == set(leaves(composed))
