"""What a cached prompt position depends on besides its tokens, as the prefix cache's disk namespace: the weights
(their bytes, sampled), the format they are served in (GGUF blocks, float, int8/int4, an expert pool's int8
copy: the module classes that run them), the dtype and device, the model's config, the tokenizer and the chat
template. Blocks written under one namespace are never read under another: another model, weights format, dtype
or template starts a cache of its own in the same folder.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from deltafin.config import DeltafinConfig
from deltafin.engine.weights.loader import LoadedModel
from deltafin.engine.weights.paths import resolve_model_path

#: bumped whenever the block layout or what a position holds changes
LAYOUT = "deltafin-kv/1"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
#: bytes read from each end of a weights file (its size and ends identify it; hashing a 100 GB checkpoint would not do)
_SAMPLE = 1 << 20


def cache_identity(config: DeltafinConfig, loaded: LoadedModel) -> tuple[str, dict[str, str]]:
    """(namespace digest, the facts it is made of)."""
    model = loaded.model
    parameters = list(model.parameters())
    settings = model.config.to_dict()
    settings.pop("_name_or_path", None)
    tokenizer = loaded.tokenizer
    template = getattr(tokenizer, "chat_template", None)
    facts = {
        "layout": LAYOUT,
        "weights": _weights_fingerprint(resolve_model_path(config.model.path)),
        "format": ",".join(sorted({type(module).__name__ for module in model.modules()})),
        "dtype": str(parameters[0].dtype).removeprefix("torch.") if parameters else "none",
        "device": parameters[0].device.type if parameters else "cpu",
        "model_config": _digest(json.dumps(settings, sort_keys=True, default=str)),
        "tokenizer": _digest(json.dumps(sorted(tokenizer.get_vocab().items())) + str(tokenizer.all_special_ids)),
        "chat_format": str(config.model.chat_format),
        "chat_template": _digest(json.dumps(template, sort_keys=True, default=str)),
        "model_type": str(getattr(model.config, "model_type", "")),
    }
    return _digest(json.dumps(facts, sort_keys=True)), facts


def _weights_fingerprint(path: Path) -> str:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.suffix in _WEIGHT_SUFFIXES)
    digest = hashlib.sha256()
    for file in files:
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as handle:
            digest.update(handle.read(_SAMPLE))
            handle.seek(max(0, size - _SAMPLE))
            digest.update(handle.read(_SAMPLE))
    return digest.hexdigest()[:32]


def _digest(text: Any) -> str:
    return hashlib.sha256(str(text).encode()).hexdigest()[:32]
