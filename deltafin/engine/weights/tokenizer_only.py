"""Gateway mode: what Deltafin needs of a model when an upstream engine holds the weights.

Only the tokenizer files and the model's config are read (a 1 TB checkpoint folder may hold nothing else here):
the tokenizer renders and detokenizes, the config gives the context length, vocabulary size and stop ids.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from deltafin.config import ModelConfig
from deltafin.engine.weights.loader import gguf_cache_key
from deltafin.engine.weights.paths import ModelLoadError, default_cache_dir, model_folder

log = structlog.get_logger("deltafin.engine")

DEFAULT_CONTEXT = 2048


@dataclass
class TokenizerBundle:
    tokenizer: Any
    context_length: int
    stop_token_ids: frozenset[int]
    vocab_size: int


def load_tokenizer_only(model_cfg: ModelConfig) -> TokenizerBundle:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    started = time.perf_counter()
    path = model_folder(model_cfg, weights=False)  # a Hub id: its tokenizer and config files only
    trust = model_cfg.trust_remote_code
    if path.is_file() and path.suffix == ".gguf":
        path = _converted_copy(path, model_cfg) or path
    if path.is_file() and path.suffix == ".gguf":
        # transformers reads a GGUF's tokenizer and config from its metadata, without dequantizing tensors.
        source: dict[str, Any] = {"pretrained_model_name_or_path": path.parent, "gguf_file": path.name}
    elif path.is_dir():
        source = {"pretrained_model_name_or_path": path}
    else:
        raise ModelLoadError(f"model.path: {path} is neither a model folder nor a .gguf file")
    tokenizer = AutoTokenizer.from_pretrained(**source, trust_remote_code=trust)
    try:
        config = AutoConfig.from_pretrained(**source, trust_remote_code=trust)
    except (OSError, ValueError):  # tokenizer files only: the context length must come from model.context_length
        config = None
    # A multimodal checkpoint (Kimi K3) keeps its language model's numbers in text_config.
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    context = model_cfg.context_length or getattr(text, "max_position_embeddings", None) or DEFAULT_CONTEXT
    # The embedding rows, not len(tokenizer): upstream engines accept (and may emit) padded-vocabulary ids.
    vocab = max(int(getattr(text, "vocab_size", 0) or 0), len(tokenizer))
    stops: set[int] = set()
    _add_ids(stops, getattr(config, "eos_token_id", None))
    if path.is_dir() and (path / "generation_config.json").exists():
        _add_ids(stops, GenerationConfig.from_pretrained(path).eos_token_id)
    if tokenizer.eos_token_id is not None:
        stops.add(int(tokenizer.eos_token_id))
    log.info("tokenizer_load_done", path=str(path), seconds=round(time.perf_counter() - started, 2))
    return TokenizerBundle(tokenizer, int(context), frozenset(stops), vocab)


def _add_ids(into: set[int], value: Any) -> None:
    if isinstance(value, int):
        into.add(value)
    elif value:
        into.update(int(v) for v in value)


def _converted_copy(gguf: Path, model_cfg: ModelConfig) -> Path | None:
    """The safetensors folder the local engine already converted this GGUF into, if any: reading its
    tokenizer takes a second, parsing the GGUF's metadata ten."""
    cache_dir = Path(model_cfg.cache_dir).expanduser() if model_cfg.cache_dir else default_cache_dir()
    folder = cache_dir / gguf_cache_key(gguf, cache_dir)
    return folder if (folder / "config.json").exists() else None
