"""Gateway tests share the default model's tokenizer (tokenizer files only, as gateway mode loads them)."""

from __future__ import annotations

import pytest

from deltafin.engine.weights.tokenizer_only import TokenizerBundle, load_tokenizer_only


@pytest.fixture(scope="session")
def bundle(config) -> TokenizerBundle:
    return load_tokenizer_only(config.model)
