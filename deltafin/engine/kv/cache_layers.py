"""The kinds of transformers cache layer the engine runs, and what batching does with each.

A model's cache is one layer object per decoder layer, of the kind its config names (`DynamicCache(config=...)`):

- attention (`DynamicLayer`): keys and values per position, [B, H, S, D]. A batch keeps them left-padded to one
  width behind an attention mask; a row's cache is a slice of positions, and a prefix of it is a valid cache.
- linear attention (`LinearAttentionLayer`: Kimi Linear's KDA, Qwen3-Next's gated delta net): per row, a
  convolution state (the last kernel-size inputs) and a recurrent state, fixed in size whatever the length.
  They are joined along the batch dimension and never padded: a row joins with the state of its own prompt, and
  a decode step feeds one real token per row (transformers gives linear layers no mask for a one-token step,
  so padding must never be what they read). A state holds exactly the tokens it was computed for: it cannot be
  cut back to a prefix, and transformers updates it in place, so every copy that leaves a batch is a clone.
- both in one layer (`LinearAttentionAndFullAttentionLayer`), and `DummyLayer` (layers with no cache).

Any other kind (sliding-window, chunked or indexed attention, quantized or static layers) is refused at load by
`unsupported_layers`, with the reason, never met per request.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import (
    DummyLayer,
    DynamicIndexedLayer,
    DynamicLayer,
    DynamicSlidingWindowLayer,
    LinearAttentionAndFullAttentionLayer,
    LinearAttentionCacheLayerMixin,
    LinearAttentionLayer,
)

#: the layer classes the engine batches (exact classes: a subclass such as a sliding-window layer behaves otherwise)
SUPPORTED = (DynamicLayer, LinearAttentionLayer, LinearAttentionAndFullAttentionLayer, DummyLayer)

#: why a layer kind cannot run, for the one-line load error
_REASONS = {
    DynamicSlidingWindowLayer: "sliding-window attention (the batched cache keeps every position: a window "
    "would be cropped across rows of different lengths)",
    DynamicIndexedLayer: "indexed sparse attention (its indexer keys are not carried by the batched cache)",
}


def has_kv(layer: Any) -> bool:
    return isinstance(layer, DynamicLayer)


def has_states(layer: Any) -> bool:
    return isinstance(layer, LinearAttentionCacheLayerMixin)


def cache_of(layers: list[Any]) -> DynamicCache:
    """A `DynamicCache` holding exactly `layers` (a bare `DynamicCache()` would add plain attention layers
    lazily, whatever kind the model's layers are)."""
    cache = DynamicCache()
    cache.layers, cache.layer_class_to_replicate = layers, None
    return cache


def unsupported_layers(model_config: Any) -> str | None:
    """Why the engine cannot run a model with this config (None: it can), from the cache the engine would
    build for it: layer kinds it does not batch, or no attention layer at all (positions and masks come from
    the attention layers' length)."""
    try:
        layers = DynamicCache(config=model_config).layers
    except Exception as exc:  # a config transformers cannot build a cache from
        return f"no cache can be built from its config ({exc})"
    by_reason: dict[str, list[int]] = {}
    for index, layer in enumerate(layers):
        kind = type(layer)
        if kind not in SUPPORTED:
            reason = next((text for base, text in _REASONS.items() if issubclass(kind, base)), None)
            by_reason.setdefault(reason or f"cache layers of kind {kind.__name__}", []).append(index)
    if by_reason:
        return "; ".join(f"layers {_ranges(indices)} use {reason}" for reason, indices in by_reason.items())
    if layers and not any(has_kv(layer) for layer in layers):
        return "it has no attention layer (the engine takes positions and masks from the attention cache)"
    return None


def empty_like(layer: Any) -> Any:
    """A layer of the same kind holding nothing yet."""
    if has_states(layer):
        return type(layer)(number_of_states=layer.number_of_states)
    return type(layer)()


def _pad_left(t: torch.Tensor, n: int) -> torch.Tensor:
    """t: [B, H, S, D] -> [B, H, n + S, D] with zeros in front."""
    if n == 0:
        return t
    return torch.cat([t.new_zeros(*t.shape[:2], n, t.shape[3]), t], dim=2)


def join(into: Any, row: Any, *, width: int, copies: int) -> None:
    """Appends `copies` rows starting from `row` (a one-row layer) to the batch layer `into`, whose attention
    positions are left-padded to `width` (the new rows' too)."""
    if has_kv(row) and row.is_initialized:
        # [B, H, L, D] + [copies, H, S, D] -> [B + copies, H, width, D]
        keys = _pad_left(row.keys, width - row.keys.shape[2]).expand(copies, -1, -1, -1)
        values = _pad_left(row.values, width - row.values.shape[2]).expand(copies, -1, -1, -1)
        if into.is_initialized:
            keys = torch.cat([_pad_left(into.keys, width - into.keys.shape[2]), keys])
            values = torch.cat([_pad_left(into.values, width - into.values.shape[2]), values])
        else:  # a copy, as `DynamicLayer.update` would make: the row's cache goes on to the prefix cache
            into.lazy_initialization(keys, values)
            keys, values = keys.clone(memory_format=_DENSE), values.clone(memory_format=_DENSE)
        into.keys, into.values = keys, values
    if has_states(row):
        # torch.cat always allocates: the batch never shares a state with the row's cache (both are updated in
        # place by later forward passes)
        for i, table in _initialized(row):
            new = getattr(row, table)[i]
            old = getattr(into, table)[i]
            new = new.expand(copies, *new.shape[1:])
            getattr(into, table)[i] = torch.cat([new] if old is None else [old, new])
        _copy_state_facts(into, row)


def select(layer: Any, index: torch.Tensor, trim: int) -> None:
    """Keeps the rows `index` (in that order) and drops `trim` leading attention positions."""
    if has_kv(layer) and layer.is_initialized:
        layer.keys = layer.keys.index_select(0, index)[:, :, trim:]
        layer.values = layer.values.index_select(0, index)[:, :, trim:]
    if has_states(layer):
        for i, table in _initialized(layer):
            getattr(layer, table)[i] = getattr(layer, table)[i].index_select(0, index)


def single_row(layer: Any, row: int, pad: int) -> Any:
    """A one-row layer holding row `row`'s cache, its `pad` leading attention positions left out. Attention
    tensors are views (the batch replaces, never writes, them); states are clones (the batch writes them)."""
    out = empty_like(layer)
    if has_kv(layer) and layer.is_initialized:
        keys, values = layer.keys[row : row + 1, :, pad:], layer.values[row : row + 1, :, pad:]
        out.lazy_initialization(keys, values)
        out.keys, out.values = keys, values
    if has_states(layer):
        for i, table in _initialized(layer):
            getattr(out, table)[i] = getattr(layer, table)[i][row : row + 1].clone()
        _copy_state_facts(out, layer)
    return out


_DENSE = torch.contiguous_format
#: a linear-attention layer's state tables, each with the table of flags saying which entries hold a state
_STATE_TABLES = (("conv_states", "is_conv_states_initialized"), ("recurrent_states", "is_recurrent_states_initialized"))


def _initialized(layer: Any) -> list[tuple[int, str]]:
    """(state index, table name) of every state `layer` holds."""
    return [(i, table) for table, flags in _STATE_TABLES for i, ready in getattr(layer, flags).items() if ready]


def _copy_state_facts(into: Any, source: Any) -> None:
    """What transformers keeps beside the states: which are there, their kernel size, whether a forward pass
    has run (the next one then continues them instead of starting a prompt), device and dtype."""
    for _table, flags in _STATE_TABLES:
        getattr(into, flags).update(getattr(source, flags))
    into.conv_kernel_size.update(source.conv_kernel_size)
    into.has_previous_state.update(source.has_previous_state)
    into.device, into.dtype = source.device, source.dtype


def _ranges(indices: list[int]) -> str:
    """[0, 1, 2, 5] -> "0-2, 5"."""
    spans: list[list[int]] = []
    for i in indices:
        if spans and spans[-1][1] == i - 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def exact_length_only(cache: Any) -> bool:
    """The cache holds state that is valid only at exactly its length (it cannot be cut back to a prefix).
    transformers' own `is_croppable` says True for convolution-only layers, which `crop` still refuses
    unless past recording was on: any state at all counts here."""
    return any(has_states(layer) for layer in getattr(cache, "layers", ()))
