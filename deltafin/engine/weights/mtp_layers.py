"""Where a checkpoint keeps its multi-token-prediction (MTP) layers, read from its files alone (no torch): the
command line refuses `engine.speculative.method=mtp` on a model without them before anything loads.

DeepSeek-V3 and GLM-4.5 / 4.7 publish `num_nextn_predict_layers` MTP layers after the decoder's own: layer
`num_hidden_layers + k`, under `model.layers.{index}.` (enorm, hnorm, eh_proj, shared_head, and a decoder
block). A config may name them while the files leave them out (transformers' classes do not load them, and
converted or pruned checkpoints drop them): both are needed.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path


def mtp_layer_index(folder: Path) -> tuple[int | None, str]:
    """(the index of the first MTP layer, "") when `folder` holds one; else (None, why not)."""
    if not folder.is_dir():
        return None, f"{folder.name} is not a Hugging Face folder (a GGUF file has no MTP layers)"
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        return None, f"its config.json cannot be read ({exc})"
    text = config.get("text_config") or config
    count = text.get("num_nextn_predict_layers") or 0
    layers = text.get("num_hidden_layers")
    if not count or layers is None:
        return None, f"its config ({text.get('model_type', 'unknown type')}) names no num_nextn_predict_layers"
    prefix = f"model.layers.{layers}."
    if not any(name.startswith(prefix) or f".{prefix}" in name for name in _tensor_names(folder)):
        return None, f"its config names {count} MTP layer(s) but its weights hold none ({prefix}*)"
    return int(layers), ""


def _tensor_names(folder: Path) -> set[str]:
    """Every tensor name of the folder's safetensors files (from the index, else the files' headers)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return set(json.loads(index.read_text()).get("weight_map", {}))
    names: set[str] = set()
    for file in folder.glob("*.safetensors"):
        with file.open("rb") as handle:
            (size,) = struct.unpack("<Q", handle.read(8))
            names.update(key for key in json.loads(handle.read(size)) if key != "__metadata__")
    return names
