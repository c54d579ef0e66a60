"""The decode step of a Llama model loaded with its GGUF blocks (`gguf_native`): all layers in one C call
(deltafin/engine/kernels/llama_step.c), for every row of the batch.

Callable like `generator.decode_step`: (model, tokens [B, 1], mask [B, L+1], positions [B, 1], cache) ->
logits [B, V]. The cache keeps transformers' semantics, as the fused torch step's does: each layer's keys and
values are views [B, Hk, L+1, D] of buffers with spare room ([B, Hk, capacity, D]); the C step writes the new
position at column L of every layer's buffers. The buffers are reallocated (the cache copied in) whenever
`BatchKV` replaced the layers' tensors (rows joined or left) or the room ran out, so a view handed out earlier
(a row's cache given to the prefix cache) is never written: writes only go past its end, into the buffers it
shares, or into new buffers.
"""

from __future__ import annotations

import ctypes
import weakref
from typing import Any

import torch

from deltafin.engine.kernels import ggml
from deltafin.engine.qlinear import GGMLEmbedding, GGMLLinear

#: positions of spare room a layer's KV buffer gets when it is (re)allocated
ROOM = 256


class _Matrix(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("type", ctypes.c_int64), ("rows", ctypes.c_int64),
                ("cols", ctypes.c_int64), ("row_bytes", ctypes.c_int64)]


class _Layer(ctypes.Structure):
    _fields_ = [("attn_norm", ctypes.c_void_p), ("ffn_norm", ctypes.c_void_p),
                *[(name, _Matrix) for name in ("q", "k", "v", "o", "gate", "up", "down")],
                ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p)]


class _Model(ctypes.Structure):
    _fields_ = [*[(name, ctypes.c_int64) for name in
                  ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab")],
                ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("layer", ctypes.POINTER(_Layer)),
                ("embed", _Matrix), ("head", _Matrix), ("norm", ctypes.c_void_p)]


def _matrix(linear: GGMLLinear) -> _Matrix:
    return _Matrix(linear.blocks.data_ptr(), linear.ggml_type, linear.out_features, linear.in_features,
                   linear.row_bytes)


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
                block.input_layernorm.weight.data_ptr(), block.post_attention_layernorm.weight.data_ptr(),
                *[_matrix(p) for p in (a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj, m.up_proj, m.down_proj)],
                None, None,
            )
        self._model = _Model(
            len(inner.layers), config.hidden_size, config.num_attention_heads, config.num_key_value_heads,
            self.head_dim, config.intermediate_size, self.vocab, config.rms_norm_eps, attention.scaling,
            self._layers, _matrix(inner.embed_tokens.table), _matrix(model.lm_head), inner.norm.weight.data_ptr(),
        )
        self._step = ggml().deltafin_llama_step  # type: ignore[union-attr]
        self._cos = self._sin = torch.empty(0, self.head_dim // 2)
        #: per layer, the (keys, values) views last given to the cache (views of buffers with room)
        self._views: list[tuple[weakref.ref, weakref.ref]] = []
        self._capacity = 0

    def __call__(self, model: Any, tokens: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor,
                 cache: Any, *, cache_arg: str = "cache") -> torch.Tensor:
        rows, width = attention_mask.shape  # width = L + 1: the new position is column L
        self._ensure_rotary(int(positions.max()) + 1)
        capacity = self._ensure_buffers(cache.layers, width)
        tokens = tokens.reshape(rows).to(torch.int64).contiguous()
        positions = positions.reshape(rows).to(torch.int64).contiguous()
        mask = attention_mask.to(torch.int64).contiguous()
        logits = torch.empty(rows, self.vocab, dtype=torch.float32)
        failed = self._step(ctypes.byref(self._model), tokens.data_ptr(), positions.data_ptr(), mask.data_ptr(),
                            rows, width, capacity, self._cos.data_ptr(), self._sin.data_ptr(), logits.data_ptr(),
                            torch.get_num_threads())
        if failed:
            raise MemoryError(f"the native decode step failed ({failed}): out of memory for its work buffers")
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

    def _ensure_buffers(self, layers: list[Any], width: int) -> int:
        """Sets every layer's keys/values to views [B, Hk, width, D] of buffers with room; returns the capacity.
        Only weak references are kept: a finished batch's cache takes its buffers with it."""
        current = len(self._views) == len(layers) and all(
            layer.keys is k() and layer.values is v() for layer, (k, v) in zip(layers, self._views)
        )
        if current and self._capacity >= width:
            # Same buffers (the views keep their storage alive, and the struct points into it): one column more.
            buffers = [(layer.keys, layer.values) for layer in layers]
        else:
            buffers = []
            for i, layer in enumerate(layers):
                rows, heads, length, dim = layer.keys.shape
                pair = []
                for t in (layer.keys, layer.values):
                    buffer = t.new_empty(rows, heads, length + ROOM, dim)
                    buffer[:, :, :length] = t
                    pair.append(buffer)
                buffers.append((pair[0], pair[1]))
                self._layers[i].keys, self._layers[i].values = pair[0].data_ptr(), pair[1].data_ptr()
            self._capacity = buffers[0][0].shape[2]
        self._views = []
        for layer, (k, v) in zip(layers, buffers):
            rows, heads, _, dim = k.shape
            layer.keys = k.as_strided((rows, heads, width, dim), k.stride())
            layer.values = v.as_strided((rows, heads, width, dim), v.stride())
            self._views.append((weakref.ref(layer.keys), weakref.ref(layer.values)))
        return self._capacity


def native_llama_step(model: Any) -> NativeLlamaStep | None:
    """The native step for a model whose projections are all GGML blocks without biases, else None."""
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
