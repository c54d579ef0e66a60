"""Forward passes of a Llama model loaded with its GGUF blocks (`gguf_native`), all layers in one C call
(deltafin/engine/kernels/llama_step.c): the batched decode step and prefill windows.

`NativeLlamaStep` is callable like `generator.decode_step`: (model, tokens [B, 1], mask [B, L+1], positions
[B, 1], cache) -> logits [B, V]; `verify` runs several tokens of each row in one pass (speculative decoding).
`install_native_forward` makes the model's own forward run prefill windows (one row, a `DynamicCache` or none,
no padding) through the same C code, so `generator.prefill`, chunked prefill and the prefix cache need nothing
special, and a prompt's bits do not depend on how it was windowed or how much
of it came from the prefix cache. Any other call (padded batches, `generate`, no cache) keeps transformers'
module tree, whose projections run the same GGML kernels.

The cache keeps transformers' semantics: each layer's keys and values are views [B, Hk, L, D] of buffers with
spare room ([B, Hk, capacity, D]); the C code writes new positions past the views' end. Buffers are
reallocated (the cache copied in) whenever the layers no longer hold the views this module gave them last
(`BatchKV` replaced them when rows joined or left; a cache cropped by the prefix cache) or the room ran out,
so a view handed out earlier (a row's cache given to the prefix cache) is never written: writes only go past
its end, into the buffers it shares, or into new buffers. One exception to the copy: a cache the prefix cache
handed out (`prefix_cache.SOLE_OWNER`) is appended in place when its views have room behind them, since nothing
else sees that storage; copying a reused 1.1k-token prompt's cache first was most of its TTFT under load.
"""

from __future__ import annotations

import ctypes
import types
import weakref
from typing import Any

import torch
from transformers import DynamicCache
from transformers.modeling_outputs import CausalLMOutputWithPast

from deltafin.engine.kernels import ggml
from deltafin.engine.kv.prefix_cache import SOLE_OWNER
from deltafin.engine.quant.linear import GGMLEmbedding, GGMLLinear

#: positions of spare room a layer's KV buffer gets when it is (re)allocated
ROOM = 256


class _Matrix(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("type", ctypes.c_int64),
        ("rows", ctypes.c_int64),
        ("cols", ctypes.c_int64),
        ("row_bytes", ctypes.c_int64),
    ]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("attn_norm", ctypes.c_void_p),
        ("ffn_norm", ctypes.c_void_p),
        *[(name, _Matrix) for name in ("q", "k", "v", "o", "gate", "up", "down")],
    ]


class _Model(ctypes.Structure):
    _fields_ = [
        *[
            (name, ctypes.c_int64)
            for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")
        ],
        ("eps", ctypes.c_float),
        ("scale", ctypes.c_float),
        ("layer", ctypes.POINTER(_Layer)),
        ("embed", _Matrix),
        ("head", _Matrix),
        ("norm", ctypes.c_void_p),
    ]


def _matrix(linear: GGMLLinear) -> _Matrix:
    return _Matrix(
        linear.blocks.data_ptr(), linear.ggml_type, linear.out_features, linear.in_features, linear.row_bytes
    )


class _Room:
    """The KV buffers one kind of call (decode steps, or prefill windows) last wrote, as weak references to the
    views it gave the cache layers, with the buffers' capacity and data pointers."""

    def __init__(self, layers: int) -> None:
        self.views: list[tuple[weakref.ref, weakref.ref]] = []
        self.capacity = 0
        self.keys = torch.zeros(layers, dtype=torch.int64)  # per layer: the buffer's address
        self.values = torch.zeros(layers, dtype=torch.int64)
        #: cache positions copied into new buffers so far, all layers counted (tests read it)
        self.copied = 0

    def ensure(self, layers: list[Any], length: int, width: int, owned: bool = False) -> int:
        """Sets every layer's keys/values to views [B, Hk, width, D] of buffers with room, the first `length`
        columns holding the cache's current contents; returns the capacity. `owned`: nothing else references
        the layers' storage past their current length (prefix_cache.SOLE_OWNER), so views with room behind
        them are written in place."""
        current = len(self.views) == len(layers) and all(
            layer.keys is k() and layer.values is v() for layer, (k, v) in zip(layers, self.views)
        )
        spare = _room_behind(layers, width) if owned and not current else 0
        if current and self.capacity >= width:
            # Same buffers (the views keep their storage alive, and the addresses point into it).
            buffers = [(layer.keys, layer.values) for layer in layers]
        elif spare:
            # A cache taken from the prefix cache (its tail cropped off, or a row of dropped batch buffers):
            # its own storage has room, and nothing else sees it; a repeated 1.1k-token prompt copied ~50 MB here.
            buffers = [(layer.keys, layer.values) for layer in layers]
            for i, (k, v) in enumerate(buffers):
                self.keys[i], self.values[i] = k.data_ptr(), v.data_ptr()
            self.capacity = spare
        else:
            buffers = []
            for i, layer in enumerate(layers):
                pair = []
                for t in (layer.keys, layer.values):
                    rows, heads, _, dim = t.shape
                    buffer = t.new_empty(rows, heads, width + ROOM, dim)
                    buffer[:, :, :length] = t[:, :, :length]
                    pair.append(buffer)
                self.copied += length
                buffers.append((pair[0], pair[1]))
                self.keys[i], self.values[i] = pair[0].data_ptr(), pair[1].data_ptr()
            self.capacity = width + ROOM
        self.views = []
        for layer, (k, v) in zip(layers, buffers):
            rows, heads, _, dim = k.shape
            layer.keys = k.as_strided((rows, heads, width, dim), k.stride())
            layer.values = v.as_strided((rows, heads, width, dim), v.stride())
            self.views.append((weakref.ref(layer.keys), weakref.ref(layer.values)))
        return self.capacity


def _room_behind(layers: list[Any], width: int) -> int:
    """The capacity (columns per kv head, the stride the C code indexes by) when every layer's keys and values
    are one-row views whose storage holds `width` columns from the view's first one, all with the same layout;
    else 0."""
    capacity = 0
    for layer in layers:
        for t in (layer.keys, layer.values):
            if t.dim() != 4 or t.shape[0] != 1 or t.dtype != torch.float32:
                return 0
            _, heads, _, dim = t.shape
            if t.stride(3) != 1 or t.stride(2) != dim or t.stride(1) % dim:
                return 0
            columns = t.stride(1) // dim
            if capacity and columns != capacity:
                return 0
            capacity = columns
            first = (t.storage_offset() % t.stride(1)) // dim  # the view's first column in its head's span
            end = t.storage_offset() + (heads - 1) * t.stride(1) + width * dim  # elements the writes may reach
            if first + width > columns or end * t.element_size() > t.untyped_storage().nbytes():
                return 0
    return capacity


class NativeLlamaStep:
    def __init__(self, model: Any) -> None:
        config = model.config
        inner = model.model
        attention = inner.layers[0].self_attn
        self.rotary = inner.rotary_emb
        self.kv_heads, self.head_dim = config.num_key_value_heads, attention.head_dim
        self.vocab = model.lm_head.out_features
        self._keep = model  # the structs below point into its buffers
        self._layers = (_Layer * len(inner.layers))()
        for i, block in enumerate(inner.layers):
            a, m = block.self_attn, block.mlp
            self._layers[i] = _Layer(
                block.input_layernorm.weight.data_ptr(),
                block.post_attention_layernorm.weight.data_ptr(),
                *[_matrix(p) for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)],
            )
        self._model = _Model(
            len(inner.layers),
            config.hidden_size,
            config.num_attention_heads,
            config.num_key_value_heads,
            self.head_dim,
            config.intermediate_size,
            self.vocab,
            config.rms_norm_eps,
            attention.scaling,
            self._layers,
            _matrix(inner.embed_tokens.table),
            _matrix(model.lm_head),
            inner.norm.weight.data_ptr(),
        )
        self._forward = ggml().deltafin_llama_forward  # type: ignore[union-attr]  # the native step is chosen only when ggml() loaded
        self._cos = self._sin = torch.empty(0, self.head_dim // 2)
        self._decode_room = _Room(len(inner.layers))
        self._prefill_room = _Room(len(inner.layers))

    def __call__(
        self,
        model: Any,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        *,
        cache_arg: str = "cache",
    ) -> torch.Tensor:
        """One decode step of the batch: each row's token written at column L (= width - 1) of its row."""
        rows, width = attention_mask.shape
        capacity = self._decode_room.ensure(cache.layers, width - 1, width)
        rows_index = torch.arange(rows)
        return self._run(
            tokens.reshape(rows),
            positions.reshape(rows),
            rows_index,
            torch.full((rows,), width - 1, dtype=torch.int64),
            attention_mask.to(torch.int64).contiguous(),
            width,
            capacity,
            self._decode_room,
            0,
        )

    def verify(
        self,
        tokens: torch.Tensor,
        rows: torch.Tensor,
        columns: torch.Tensor,
        positions: torch.Tensor,
        mask: torch.Tensor,
        cache: Any,
    ) -> torch.Tensor:
        """Several tokens of each row of the batch in one pass (a speculative draft checked as a short prefill:
        the weights are read once for all of them). tokens, rows, columns, positions: [T], a row's tokens one
        after another in column order; token t is written at column columns[t] of row rows[t] and sees the
        columns of its row that mask [B, W] shows, up to its own. Returns logits [T, V]: token t's are the bits a
        decode step feeding it alone would give (llama_step.c)."""
        width = mask.shape[1]
        capacity = self._decode_room.ensure(cache.layers, cache.layers[0].keys.shape[2], width)
        return self._run(
            tokens,
            positions,
            rows.to(torch.int64).contiguous(),
            columns.to(torch.int64).contiguous(),
            mask.to(torch.int64).contiguous(),
            width,
            capacity,
            self._decode_room,
            0,
        )

    def prefill(self, ids: torch.Tensor, cache: Any, logits_to_keep: int) -> torch.Tensor:
        """ids [T] of one row after the cache's L tokens -> logits [T or the last `logits_to_keep`, V]."""
        layers = cache.layers
        for layer in layers:
            if not layer.is_initialized:
                empty = torch.empty(1, self.kv_heads, 0, self.head_dim)
                layer.lazy_initialization(empty, empty)
                layer.keys, layer.values = empty, empty.clone()
        length = layers[0].keys.shape[2]
        count = ids.shape[0]
        owned = getattr(cache, SOLE_OWNER, False)
        capacity = self._prefill_room.ensure(layers, length, length + count, owned=owned)
        positions = torch.arange(length, length + count)
        first = 0 if not logits_to_keep else max(count - logits_to_keep, 0)
        return self._run(
            ids,
            positions,
            torch.zeros(count, dtype=torch.int64),
            positions,
            None,
            length + count,
            capacity,
            self._prefill_room,
            first,
        )

    def _run(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        kv_row: torch.Tensor,
        kv_col: torch.Tensor,
        mask: torch.Tensor | None,
        width: int,
        capacity: int,
        room: _Room,
        first: int,
    ) -> torch.Tensor:
        tokens = tokens.to(torch.int64).contiguous()
        positions = positions.to(torch.int64).contiguous()
        self._ensure_rotary(int(positions.max()) + 1)
        count = tokens.shape[0]
        logits = torch.empty(count - first, self.vocab, dtype=torch.float32)
        failed = self._forward(
            ctypes.byref(self._model),
            tokens.data_ptr(),
            positions.data_ptr(),
            kv_row.data_ptr(),
            kv_col.data_ptr(),
            None if mask is None else mask.data_ptr(),
            count,
            width,
            capacity,
            room.keys.data_ptr(),
            room.values.data_ptr(),
            self._cos.data_ptr(),
            self._sin.data_ptr(),
            logits.data_ptr(),
            first,
            torch.get_num_threads(),
        )
        if failed == -2:  # the loader (gguf_native.unsupported) refuses such files first
            raise ValueError("the native forward refused the model: a width is not whole blocks of its matrix's type")
        if failed:
            raise MemoryError(f"the native forward failed ({failed}): out of memory for its work buffers")
        return logits

    def _ensure_rotary(self, positions: int) -> None:
        """cos/sin [positions, head_dim / 2] from the model's own rotary module (its scaling included)."""
        if self._cos.shape[0] >= positions:
            return
        count = max(positions, 2 * self._cos.shape[0], 1024)
        probe = torch.zeros(1, 1, self.head_dim)
        cos, sin = self.rotary(probe, torch.arange(count).unsqueeze(0))  # [1, P, D], both halves equal
        half = self.head_dim // 2
        self._cos, self._sin = cos[0, :, :half].float().contiguous(), sin[0, :, :half].float().contiguous()


def _native_window(input_ids, attention_mask, position_ids, cache, kwargs) -> bool:
    """Whether a forward call is a prefill window the native code runs: one row, a DynamicCache of full
    attention layers, no padding, positions following the cache."""
    if input_ids is None or input_ids.dim() != 2 or input_ids.shape[0] != 1 or input_ids.shape[1] == 0:
        return False
    if cache is not None and not all(
        type(layer).__name__ == "DynamicLayer" for layer in getattr(cache, "layers", [None])
    ):
        return False
    if kwargs.get("inputs_embeds") is not None or kwargs.get("labels") is not None:
        return False
    if kwargs.get("output_attentions") or kwargs.get("output_hidden_states"):
        return False
    length = cache.get_seq_length() if cache is not None else 0
    if attention_mask is not None and (
        attention_mask.shape[-1] != length + input_ids.shape[1] or not bool(attention_mask.all())
    ):
        return False
    return not (
        position_ids is not None
        and not torch.equal(position_ids.reshape(-1).cpu(), torch.arange(length, length + input_ids.shape[1]))
    )


def install_native_forward(model: Any, step: NativeLlamaStep) -> None:
    """The model's forward runs prefill windows natively (see the module docstring); other calls run the model's own forward."""
    original = type(model).forward

    def forward(
        self,
        input_ids=None,
        attention_mask=None,
        position_ids=None,
        cache=None,
        use_cache=None,
        logits_to_keep=0,
        **kwargs,
    ):
        cache = cache if cache is not None else kwargs.pop("past_key_values", None)
        if not _native_window(input_ids, attention_mask, position_ids, cache, kwargs):
            return original(
                self,
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                logits_to_keep=logits_to_keep,
                **kwargs,
            )
        keep = logits_to_keep if isinstance(logits_to_keep, int) else 0
        own = cache if cache is not None else DynamicCache(config=self.config)  # a whole-prompt call: same bits
        logits = step.prefill(input_ids[0], own, keep)
        return CausalLMOutputWithPast(logits=logits.unsqueeze(0), cache=own if cache is not None or use_cache else None)

    model.forward = types.MethodType(forward, model)
    model.__dict__["_deltafin_native_step"] = step


def native_llama_step(model: Any) -> NativeLlamaStep | None:
    """The native step for a model whose projections are all GGML blocks without biases, else None.
    One per model: the one `install_native_forward` gave it, when it has one."""
    existing = model.__dict__.get("_deltafin_native_step")
    if existing is not None:
        return existing
    if ggml() is None or getattr(model.config, "model_type", None) != "llama":
        return None
    if model.model.layers[0].self_attn.head_dim % 32 or getattr(model.config, "hidden_act", "silu") != "silu":
        return None  # attention outputs are quantized head by head, in blocks of 32
    inner = model.model
    if not isinstance(inner.embed_tokens, GGMLEmbedding) or not isinstance(model.lm_head, GGMLLinear):
        return None
    for block in inner.layers:
        a, m = block.self_attn, block.mlp
        parts = (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)
        if not all(isinstance(p, GGMLLinear) and p.bias is None for p in parts):
            return None
    return NativeLlamaStep(model)
