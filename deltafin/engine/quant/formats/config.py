"""A checkpoint's `quantization_config`: the published format it names, or a one-line refusal.

Served (everything else in the config refuses, naming the first field that does, in reading order):

- `quant_method: compressed-tensors`, `format: pack-quantized`: int4 weights, symmetric, group-wise (any group
  size that is a multiple of 16), weights only (Kimi K2-Thinking / K2.5: the routed experts, group 32);
- `quant_method: compressed-tensors`, `format: mxfp4-pack-quantized`: FP4 E2M1 weights with an E8M0 scale per
  32 (OCP MX; Kimi K3's routed experts);
- `quant_method: fp8`, `fmt: e4m3`, `activation_scheme: dynamic`, `weight_block_size: [bn, bk]`: e4m3 weights
  with a float32 `weight_scale_inv` per block (DeepSeek-V3, Kimi K2-Instruct: every Linear but the router,
  the embeddings and the LM head). The reference quantizes the activations to FP8 per 128 values on the fly;
  Deltafin keeps them float32 (more exact, not the reference's rounding).

Which modules are quantized is read from the tensors (`tensors.py`): a published config's `ignore` list can be
incomplete (K3's leaves out modules stored in bfloat16), so it is only checked against them. A multimodal
checkpoint keeps the language model's config under `text_config` (K3); both places are read, and two
different configs refuse.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

#: the config keys that hold a quantization config, in the order they are read
PLACES = ("quantization_config", "text_config.quantization_config")

INT4, MXFP4, FP8 = "int4", "mxfp4", "fp8"
#: compressed-tensors format -> Deltafin's name of it
_COMPRESSED = {"pack-quantized": INT4, "mxfp4-pack-quantized": MXFP4}
#: int4 scale dtypes compressed-tensors may record (None: the observer's dtype, read from the tensor)
_INT4_SCALE_DTYPES = (None, "torch.bfloat16", "torch.float16", "torch.float32")


class UnsupportedQuantization(ValueError):
    """A quantization config Deltafin does not serve: the message names the field, its value and why."""

    def __init__(self, field: str, value: Any, why: str) -> None:
        super().__init__(f"{field}={_shown(value)}: {why}")
        self.field, self.value, self.why = field, value, why

    def within(self, where: str) -> UnsupportedQuantization:
        """The same refusal, its field named inside `where` (an expert of a layer)."""
        return UnsupportedQuantization(f"{where}: {self.field}", self.value, self.why)


def _shown(value: Any) -> str:
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


@dataclass(frozen=True)
class WeightGroup:
    """One compressed-tensors config group: the modules it targets and its group size."""

    name: str
    targets: tuple[str, ...]
    group_size: int

    def targets_module(self, module: str) -> bool:
        return any(matches(target, module) for target in self.targets)


@dataclass(frozen=True)
class PublishedFormat:
    """What a checkpoint's quantization config says about its weights."""

    name: str  # int4 | mxfp4 | fp8
    place: str  # where the config sits (PLACES)
    groups: tuple[WeightGroup, ...] = ()  # compressed-tensors
    ignore: tuple[str, ...] = ()  # compressed-tensors `ignore` (checked against the tensors)
    block: tuple[int, int] | None = None  # fp8: (rows, columns) of a scale block

    @property
    def title(self) -> str:
        return {
            INT4: "compressed-tensors pack-quantized int4",
            MXFP4: "compressed-tensors mxfp4-pack-quantized",
            FP8: f"fp8 e4m3 blocks of {self.block[0]}x{self.block[1]}" if self.block else "fp8",
        }[self.name]

    def ignored(self, module: str) -> bool:
        return any(matches(pattern, module) for pattern in self.ignore)

    def group_sizes(self, module: str) -> set[int]:
        """The group sizes the config allows for `module` (empty: no group targets it)."""
        return {group.group_size for group in self.groups if group.targets_module(module)}


def matches(pattern: str, module: str) -> bool:
    """compressed-tensors' matching of a target or ignore entry against a module name: `re:` entries are
    regular expressions matched at the start; others the exact name, or a class name (a name that is not a
    module path, e.g. `Linear`: every quantized module here is a Linear)."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return pattern == module or ("." not in pattern and pattern[:1].isupper())


def read(raw: dict[str, Any]) -> PublishedFormat | None:
    """The format `raw` (a parsed config.json) names, None for a checkpoint without a quantization config;
    UnsupportedQuantization for one Deltafin does not serve."""
    found = {}
    top = raw.get("quantization_config")
    if top is not None:
        found[PLACES[0]] = top
    text = raw.get("text_config")
    if isinstance(text, dict) and text.get("quantization_config") is not None:
        found[PLACES[1]] = text["quantization_config"]
    if not found:
        return None
    if len(found) == 2 and found[PLACES[0]] != found[PLACES[1]]:
        raise UnsupportedQuantization(
            PLACES[1], "...", f"differs from the top-level {PLACES[0]}: which one the weights follow is unclear"
        )
    place, config = next(iter(found.items()))
    if not isinstance(config, dict):
        raise UnsupportedQuantization(place, config, "a quantization config is a mapping")
    method = config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(place, config)
    if method == "fp8":
        return _fp8(place, config)
    raise UnsupportedQuantization(
        f"{place}.quant_method",
        method,
        "not a format Deltafin serves in its own form (served: compressed-tensors pack-quantized int4 and "
        "mxfp4-pack-quantized, fp8 e4m3 blocks)",
    )


def without_quantization(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` without its quantization configs (transformers must never act on them: it has no compressed-tensors
    kernels here, and it dequantizes FP8 blocks of partial size wrongly on CPU)."""
    out = {k: v for k, v in raw.items() if k != "quantization_config"}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = {k: v for k, v in out["text_config"].items() if k != "quantization_config"}
    return out


def _require(field: str, value: Any, allowed: tuple[Any, ...], why: str) -> None:
    # 1 == True in Python: compare types too, so `symmetric: 1` or `num_bits: true` refuse
    if not any(value == ok and type(value) is type(ok) for ok in allowed):
        raise UnsupportedQuantization(field, value, why)


def _empty(config: dict[str, Any], place: str, key: str, why: str) -> None:
    value = config.get(key)
    if value not in (None, {}):
        raise UnsupportedQuantization(f"{place}.{key}", value, why)


def _compressed_tensors(place: str, config: dict[str, Any]) -> PublishedFormat:
    top_format = config.get("format")
    if top_format is not None and top_format not in _COMPRESSED:
        raise UnsupportedQuantization(
            f"{place}.format", top_format, "served compressed-tensors formats: pack-quantized, mxfp4-pack-quantized"
        )
    status = config.get("quantization_status", "compressed")
    _require(
        f"{place}.quantization_status",
        status,
        ("compressed",),
        "only compressed checkpoints are served (frozen ones hold fake-quantized float weights)",
    )
    _empty(config, place, "sparsity_config", "sparse (compressed-tensors sparsity) weights are not served")
    _empty(config, place, "transform_config", "transformed weights (Hadamard, SpinQuant) are not served")
    _empty(config, place, "kv_cache_scheme", "a quantized KV cache is not served")
    ignore = config.get("ignore") or []
    if not isinstance(ignore, list) or not all(isinstance(entry, str) for entry in ignore):
        raise UnsupportedQuantization(f"{place}.ignore", ignore, "a list of module names or re: patterns")
    groups = config.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise UnsupportedQuantization(f"{place}.config_groups", groups, "at least one config group is needed")
    parsed, formats = [], set()
    for name, group in groups.items():
        field = f"{place}.config_groups.{name}"
        if not isinstance(group, dict):
            raise UnsupportedQuantization(field, group, "a config group is a mapping")
        fmt = group.get("format") or top_format
        if fmt not in _COMPRESSED:
            raise UnsupportedQuantization(
                f"{field}.format", fmt, "served compressed-tensors formats: pack-quantized, mxfp4-pack-quantized"
            )
        formats.add(_COMPRESSED[fmt])
        if len(formats) > 1:
            raise UnsupportedQuantization(f"{field}.format", fmt, "config groups in different formats are not served")
        parsed.append(_group(field, name, group, _COMPRESSED[fmt]))
    return PublishedFormat(formats.pop(), place, tuple(parsed), tuple(ignore))


def _group(field: str, name: str, group: dict[str, Any], fmt: str) -> WeightGroup:
    for key in ("input_activations", "output_activations"):
        if group.get(key) is not None:
            raise UnsupportedQuantization(
                f"{field}.{key}",
                group[key],
                "activation quantization (W4A4 / W4A8) is not served; Deltafin serves weight-only checkpoints "
                "with float activations",
            )
    targets = group.get("targets")
    if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or not targets:
        raise UnsupportedQuantization(f"{field}.targets", targets, "a non-empty list of module names or patterns")
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise UnsupportedQuantization(f"{field}.weights", weights, "weight-only checkpoints name their weights' scheme")
    at = f"{field}.weights"
    kind = "int" if fmt == INT4 else "float"
    _require(f"{at}.num_bits", weights.get("num_bits"), (4,), f"{fmt} weights are 4-bit")
    _require(f"{at}.type", weights.get("type"), (kind,), f"{fmt} weights are of type {kind}")
    _require(
        f"{at}.symmetric",
        weights.get("symmetric", True),
        (True,),
        "only symmetric weights are served (an asymmetric checkpoint has zero points)",
    )
    _require(
        f"{at}.strategy",
        weights.get("strategy"),
        ("group",),
        "only group-wise 4-bit weights (a scale per group of values of a row) are served",
    )
    _require(f"{at}.dynamic", weights.get("dynamic", False), (False,), "weights quantized on the fly are not served")
    if weights.get("block_structure") is not None:
        raise UnsupportedQuantization(f"{at}.block_structure", weights["block_structure"], "blocks are not served")
    size = weights.get("group_size")
    if fmt == MXFP4:
        _require(f"{at}.group_size", size, (32,), "MXFP4 scales groups of 32 values")
        _require(
            f"{at}.actorder", weights.get("actorder"), (None, False), "MXFP4 weights are stored in their own order"
        )
        _require(
            f"{at}.scale_dtype",
            weights.get("scale_dtype"),
            (None, "torch.uint8"),
            "MXFP4 scales are E8M0 bytes (torch.uint8)",
        )
    else:
        if type(size) is not int or size <= 0 or size % 16:
            raise UnsupportedQuantization(
                f"{at}.group_size", size, "groups of a positive multiple of 16 values are served"
            )
        _require(
            f"{at}.actorder",
            weights.get("actorder"),
            (None, False, "weight", "static"),
            "activation-ordered groups (a g_idx permutation) are not served",
        )
        _require(
            f"{at}.scale_dtype",
            weights.get("scale_dtype"),
            _INT4_SCALE_DTYPES,
            "int4 scales are bfloat16, float16 or float32",
        )
    assert isinstance(size, int)
    return WeightGroup(name, tuple(targets), size)


def _fp8(place: str, config: dict[str, Any]) -> PublishedFormat:
    _require(f"{place}.fmt", config.get("fmt", "e4m3"), ("e4m3",), "only e4m3 FP8 weights are served")
    _require(
        f"{place}.activation_scheme",
        config.get("activation_scheme", "dynamic"),
        ("dynamic",),
        "static activation scales are not served (dynamic: weights only, activations computed in float32)",
    )
    block = config.get("weight_block_size", [128, 128])
    if not (isinstance(block, list | tuple) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise UnsupportedQuantization(
            f"{place}.weight_block_size", block, "FP8 weights with a scale per block of [rows, columns] are served"
        )
    _require(
        f"{place}.scale_fmt",
        config.get("scale_fmt", "float"),
        ("float", "ue8m0"),
        "scales are float32 (or powers of two)",
    )
    _require(f"{place}.expert_dtype", config.get("expert_dtype", "fp8"), ("fp8",), "only FP8 experts are served")
    # modules_to_not_convert, dequantize: informational (the tensors say which modules are FP8)
    return PublishedFormat(FP8, place, block=(int(block[0]), int(block[1])))
