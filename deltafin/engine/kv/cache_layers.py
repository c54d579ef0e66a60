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


def select(layer: Any, index: torch.Tensor, first: int, last: int) -> None:
    """Keeps the rows `index` (in that order) and the attention positions [first, last)."""
    if has_kv(layer) and layer.is_initialized:
        layer.keys = layer.keys.index_select(0, index)[:, :, first:last]
        layer.values = layer.values.index_select(0, index)[:, :, first:last]
    if has_states(layer):
        for i, table in _initialized(layer):
            getattr(layer, table)[i] = getattr(layer, table)[i].index_select(0, index)


def narrow(layer: Any, width: int) -> None:
    """Keeps the first `width` attention positions (a view: the columns after them are dropped)."""
    if has_kv(layer) and layer.is_initialized:
        layer.keys, layer.values = layer.keys[:, :, :width], layer.values[:, :, :width]


def gather_columns(layer: Any, index: torch.Tensor) -> None:
    """index [B, W]: row b's new column j is its old column index[b, j] (a copy into new tensors)."""
    if has_kv(layer) and layer.is_initialized:
        rows, heads, _, dim = layer.keys.shape
        where = index[:, None, :, None].expand(rows, heads, index.shape[1], dim)
        layer.keys, layer.values = layer.keys.gather(2, where), layer.values.gather(2, where)


def single_row(
    layer: Any, row: int, start: int = 0, end: int | None = None, *, columns: torch.Tensor | None = None
) -> Any:
    """A one-row layer holding row `row`'s cache: its attention positions [start, end), or the positions
    `columns` (a copy). Attention tensors are otherwise views (the batch replaces, or writes past, them);
    states are clones (the batch writes them)."""
    out = empty_like(layer)
    if has_kv(layer) and layer.is_initialized:
        if columns is not None:
            keys = layer.keys[row : row + 1].index_select(2, columns)
            values = layer.values[row : row + 1].index_select(2, columns)
        else:
            keys, values = layer.keys[row : row + 1, :, start:end], layer.values[row : row + 1, :, start:end]
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


# --- what the prefix cache does with a cache: cut the attention part, capture and restore states, count bytes ---


def attention_length(cache: Any) -> int:
    """Positions the attention layers hold (0 for a cache nothing ran into yet)."""
    for layer in getattr(cache, "layers", ()):
        if has_kv(layer) and layer.is_initialized and layer.keys.dim() == 4:
            return int(layer.keys.shape[2])
    return 0


def capture_states(cache: Any, *, copy: bool = True) -> list[Any]:
    """A copy of every layer's recurrent and convolution state (None for layers without), taken where the cache
    stands now: transformers writes states in place, so the copy is what a later cache can start from.
    `copy=False` takes the tensors themselves (for a cache no forward pass will run on again)."""
    out: list[Any] = []
    for layer in cache.layers:
        if not has_states(layer):
            out.append(None)
            continue
        tables = {
            (table, i): getattr(layer, table)[i].clone() if copy else getattr(layer, table)[i]
            for i, table in _initialized(layer)
        }
        out.append((tables, _state_facts(layer)))
    return out


def restore_states(layer: Any, captured: Any) -> None:
    """Puts a captured state (`capture_states`, one layer's entry) into `layer`, copied: the layer's forward
    passes write it in place, and the capture must stay as it was for the next cache that starts from it."""
    tables, facts = captured
    for (table, i), tensor in tables.items():
        getattr(layer, table)[i] = tensor.clone()
    _set_state_facts(layer, facts)


def prefix_of(cache: Any, length: int, states: list[Any] | None) -> DynamicCache:
    """A new cache holding the first `length` attention positions of `cache` (views: nothing is copied, and the
    forward passes of transformers and of the native step never write into a view they were not handed as
    their own) and, for state layers, `states` (`capture_states` taken at exactly `length`)."""
    layers = []
    for index, layer in enumerate(cache.layers):
        out = empty_like(layer)
        if has_kv(layer) and layer.is_initialized:
            keys, values = layer.keys[:, :, :length], layer.values[:, :, :length]
            out.lazy_initialization(keys, values)
            out.keys, out.values = keys, values
        if has_states(layer):
            assert states is not None and states[index] is not None, "a state layer needs its state at `length`"
            restore_states(out, states[index])
        layers.append(out)
    return cache_of(layers)


def fill(cache: Any, kv: dict[int, tuple[torch.Tensor, torch.Tensor]], length: int, states: list[Any] | None) -> None:
    """Puts positions read back into an empty cache: `kv` maps an attention layer's index to buffers
    [1, H, >= length, D] (the layer gets views of their first `length` positions, the room behind them free for
    the prompt's own positions), and state layers get `states` (captured at exactly `length`)."""
    for index, layer in enumerate(cache.layers):
        if index in kv:
            keys, values = kv[index][0][:, :, :length], kv[index][1][:, :, :length]
            layer.lazy_initialization(keys, values)
            layer.keys, layer.values = keys, values
        if has_states(layer):
            assert states is not None and states[index] is not None, "a state layer needs its state at `length`"
            restore_states(layer, states[index])


def crop_attention(cache: Any, length: int) -> None:
    """Cuts every attention layer of `cache` back to `length` positions in place (views); state layers are left
    alone (the caller replaces their state)."""
    for layer in cache.layers:
        if has_kv(layer) and layer.is_initialized and layer.keys.shape[2] > length:
            layer.keys, layer.values = layer.keys[:, :, :length], layer.values[:, :, :length]


def set_states(cache: Any, states: list[Any]) -> None:
    """Replaces every state layer's state with a copy of `states` (`capture_states`)."""
    for layer, captured in zip(cache.layers, states):
        if has_states(layer) and captured is not None:
            restore_states(layer, captured)


def attention_tensors(cache: Any) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
    """(layer index, keys, values) of every attention layer holding positions: [1, H, S, D] each."""
    return [
        (index, layer.keys, layer.values)
        for index, layer in enumerate(cache.layers)
        if has_kv(layer) and layer.is_initialized and layer.keys.dim() == 4
    ]


def state_tensors(states: list[Any]) -> list[tuple[int, str, int, torch.Tensor]]:
    """(layer index, table, state index, tensor) of a capture."""
    return [
        (index, table, i, tensor)
        for index, captured in enumerate(states)
        if captured is not None
        for (table, i), tensor in captured[0].items()
    ]


def storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the storages behind `tensors`, each storage counted once (views of one buffer share it)."""
    seen: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def cache_tensors(cache: Any) -> list[torch.Tensor]:
    """Every tensor a cache holds (attention keys and values, states)."""
    out: list[torch.Tensor] = []
    for layer in cache.layers:
        if has_kv(layer) and layer.is_initialized:
            out += [layer.keys, layer.values]
        if has_states(layer):
            out += [getattr(layer, table)[i] for i, table in _initialized(layer)]
    return out


def logical_bytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def compact(cache: Any) -> None:
    """Copies the attention tensors that are views of larger buffers (a row of a batch, spare room behind) into
    buffers of their own size, so a cache kept for later holds only its own positions."""
    for layer in cache.layers:
        if has_kv(layer) and layer.is_initialized:
            layer.keys = layer.keys.clone(memory_format=_DENSE)
            layer.values = layer.values.clone(memory_format=_DENSE)


def state_layer_count(cache: Any) -> int:
    return sum(1 for layer in getattr(cache, "layers", ()) if has_states(layer))


def _state_facts(layer: Any) -> dict[str, Any]:
    return {
        "flags": {flags: dict(getattr(layer, flags)) for _table, flags in _STATE_TABLES},
        "conv_kernel_size": dict(layer.conv_kernel_size),
        "has_previous_state": dict(layer.has_previous_state),
        "device": layer.device,
        "dtype": layer.dtype,
    }


def _set_state_facts(layer: Any, facts: dict[str, Any]) -> None:
    for _table, flags in _STATE_TABLES:
        getattr(layer, flags).update(facts["flags"][flags])
    layer.conv_kernel_size.update(facts["conv_kernel_size"])
    layer.has_previous_state.update(facts["has_previous_state"])
    layer.device, layer.dtype = facts["device"], facts["dtype"]
