"""The decode step for Llama-architecture decoders (SmolLM2, Llama, Mistral-style without sliding windows),
written as one function over fused projections instead of transformers' module tree.

Why: a decode step of a small model is mostly overhead. transformers runs ~40 small operators and Python
frames per layer (separate q/k/v and gate/up projections, rotary through helpers, the cache's update
bookkeeping, mask construction per layer); at one token per row a 135M model spends more time there than in
its matmuls. Here each layer is: RMSNorm, one qkv projection, rotary on q and k together, the cache append,
SDPA (grouped-query heads handled by the kernel), the output projection, RMSNorm, one gate+up projection,
SiLU-gate, the down projection. Measured on the default model: docs/benchmarks.md (bench/step_cpu.py).

The step keeps transformers' semantics exactly where they matter to other code: the KV cache is the same
`DynamicCache` (keys stored rotated, left-padded rows, `BatchKV` unchanged), prefill still runs the
transformers model, and logits equal the module tree's up to float reassociation (tests/engine/test_fused_llama.py).
A model whose architecture or options this step does not cover gets None, and the engine keeps the
transformers forward.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from deltafin.engine.quant.linear import Int8Linear

ARCHITECTURES = ("llama",)
#: positions of spare room a layer's KV buffer gets when it is (re)allocated
ROOM = 256


class _SideBySide(nn.Module):
    """Projections of a kind whose weights cannot be concatenated (int4's packed layout): run one after the
    other, outputs concatenated, so the rest of the step stays the same."""

    def __init__(self, parts: list[nn.Module]) -> None:
        super().__init__()
        self.parts = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def _fuse(parts: list[Any]) -> nn.Module:
    """One projection computing `parts` side by side.

    float: the parts' weights become views into the fused weight (no second copy; prefill keeps using them).
    int8: a fused copy (the C kernel wants one contiguous matrix; int8 weights are a quarter of float ones)."""
    if all(type(p) is nn.Linear for p in parts):
        weight = torch.cat([p.weight.detach() for p in parts])
        has_bias = any(p.bias is not None for p in parts)
        fused = nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device=weight.device, dtype=weight.dtype)
        fused.weight = nn.Parameter(weight, requires_grad=False)
        if has_bias:
            fused.bias = nn.Parameter(
                torch.cat([p.bias.detach() if p.bias is not None else weight.new_zeros(p.out_features) for p in parts]),
                requires_grad=False,
            )
        start = 0
        for p in parts:
            end = start + p.out_features
            p.weight = nn.Parameter(fused.weight[start:end], requires_grad=False)
            if p.bias is not None:
                p.bias = nn.Parameter(fused.bias[start:end], requires_grad=False)
            start = end
        return fused
    if all(type(p) is Int8Linear for p in parts):
        return Int8Linear.fused(parts)
    return _SideBySide(parts)


@dataclass
class _Layer:
    input_norm: torch.Tensor
    qkv: nn.Module
    o_proj: nn.Module
    post_norm: torch.Tensor
    gate_up: nn.Module
    down: nn.Module


class FusedLlamaStep:
    """Callable like `generator.decode_step`: (model, tokens [B, 1], mask [B, L+1], positions [B, 1], cache)."""

    def __init__(self, model: Any, layers: list[_Layer]) -> None:
        config = model.config
        attention = model.model.layers[0].self_attn
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling
        self.eps = config.rms_norm_eps
        self.intermediate = config.intermediate_size
        self.embed = model.model.embed_tokens
        self.rotary = model.model.rotary_emb
        self.final_norm = model.model.norm.weight
        self.head = model.lm_head
        self.layers = layers
        #: per cache layer: the (keys, values) buffers its tensors are views of. Weak keys: a finished batch's
        #: layers take their buffers with them (and a new layer can never inherit an old one's buffer).
        self._room: weakref.WeakKeyDictionary[Any, tuple[torch.Tensor, torch.Tensor]] = weakref.WeakKeyDictionary()

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
        layers = cache.layers
        return self.forward(tokens, attention_mask, positions, lambda i, k, v: self._append(layers[i], k, v))

    def forward(
        self,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor,
        write: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """tokens [B, 1], attention_mask [B, S] (0 = hidden), positions [B, 1] -> logits [B, V].
        `write(layer, keys, values)` stores the new position's keys and values [B, Hk, 1, D] in the layer's
        cache and returns the keys and values to attend over ([B, Hk, S, D]): the eager step appends
        (`_append`), the static one writes into a preallocated buffer (`deltafin.engine.llama.fused_static`)."""
        return self.forward_tokens(tokens, attention_mask, positions, write)[:, -1]

    def forward_tokens(
        self,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor,
        write: Callable[[int, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """`forward` for C tokens of each row at once (C = 1: a decode step; more: a speculative draft checked in
        one pass), written at the last C columns of the mask: tokens [B, C], attention_mask [B, S], positions
        [B, C] -> logits [B, C, V]. Token j sees the columns its row's mask shows up to its own (S - C + j)."""
        rows, count = tokens.shape
        heads, kv_heads, dim = self.heads, self.kv_heads, self.head_dim
        x = self.embed(tokens)  # [B, C, H]
        width = x.shape[-1]
        cos, sin = self.rotary(x, positions)  # [B, C, D] each
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, C, D]: broadcast over heads
        half = dim // 2
        # Additive mask, once per step: padding columns get -inf (a boolean mask is converted in every call).
        visible = (attention_mask != 0)[:, None, None, :]  # [B, 1, 1, S]
        if count > 1:  # each token sees the columns up to its own
            columns = torch.arange(attention_mask.shape[1], device=tokens.device)
            own = attention_mask.shape[1] - count + torch.arange(count, device=tokens.device)
            visible = visible & (columns[None, :] <= own[:, None])[None, None]  # [B, 1, C, S]
        hidden = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill_(~visible, float("-inf"))
        for i, layer in enumerate(self.layers):
            h = F.rms_norm(x, (width,), layer.input_norm, self.eps)
            qkv = layer.qkv.forward(h).view(rows, count, heads + 2 * kv_heads, dim).transpose(1, 2)  # [B, Hq+2Hk, C, D]
            qk = qkv[:, : heads + kv_heads]
            qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin  # rotary, q and k at once
            keys, values = write(i, qk[:, heads:], qkv[:, heads + kv_heads :])
            attended = F.scaled_dot_product_attention(
                qk[:, :heads], keys, values, attn_mask=hidden, scale=self.scaling, enable_gqa=True
            )  # [B, Hq, C, D]
            x = x + layer.o_proj.forward(attended.transpose(1, 2).reshape(rows, count, heads * dim))
            h = F.rms_norm(x, (width,), layer.post_norm, self.eps)
            gate_up = layer.gate_up.forward(h)
            x = x + layer.down.forward(F.silu(gate_up[..., : self.intermediate]) * gate_up[..., self.intermediate :])
        x = F.rms_norm(x, (width,), self.final_norm, self.eps)
        return self.head(x)  # [B, C, V]

    def verify(
        self, tokens: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor, cache: Any
    ) -> torch.Tensor:
        """Several tokens of each row appended to the cache in one pass: tokens [B, C], attention_mask
        [B, L + C], positions [B, C] -> logits [B, C, V] (see `forward_tokens`)."""
        layers = cache.layers
        return self.forward_tokens(tokens, attention_mask, positions, lambda i, k, v: self._append(layers[i], k, v))

    def _append(self, kv: Any, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Appends the new positions to a layer's cache in place when the layer's tensors are views of a buffer
        this step allocated with room to spare; otherwise copies them into a new such buffer. A `torch.cat`
        per step would copy the whole cache twice per layer per token.

        Safe because writes only ever go to the column right after the current width: views handed out
        earlier (a row's cache given to the prefix cache) end at or before it, and `BatchKV` replaces the
        tensors (cat, index_select) whenever rows join or leave, which drops the buffer.
        Eager only: under placement.compile the static step (`deltafin.engine.llama.fused_static`) owns the buffers."""
        room = self._room.get(kv)
        length, count = kv.keys.shape[2], keys.shape[2]
        if (
            room is None
            or room[0].data_ptr() != kv.keys.data_ptr()
            or room[0].shape[:2] != kv.keys.shape[:2]
            or kv.keys.stride() != room[0].stride()
            or length + count > room[0].shape[2]
        ):
            rows, kv_heads, _, dim = kv.keys.shape
            capacity = length + count + ROOM
            room = (
                kv.keys.new_empty(rows, kv_heads, capacity, dim),
                kv.values.new_empty(rows, kv_heads, capacity, dim),
            )
            room[0][:, :, :length] = kv.keys
            room[1][:, :, :length] = kv.values
            self._room[kv] = room
        if count == 1:
            room[0][:, :, length] = keys[:, :, 0]
            room[1][:, :, length] = values[:, :, 0]
        else:
            room[0][:, :, length : length + count] = keys
            room[1][:, :, length : length + count] = values
        kv.keys, kv.values = room[0][:, :, : length + count], room[1][:, :, : length + count]
        return kv.keys, kv.values


def fused_llama_step(model: Any) -> FusedLlamaStep | None:
    """The fused step for `model`, or None where it does not apply (another architecture, or options this
    step does not implement: sliding windows, tensor-parallel slices, another activation)."""
    config = model.config
    if getattr(config, "model_type", None) not in ARCHITECTURES:
        return None
    if getattr(config, "pretraining_tp", 1) != 1 or getattr(config, "hidden_act", "silu") != "silu":
        return None
    if getattr(config, "sliding_window", None) or getattr(config, "use_sliding_window", False):
        return None
    layers = []
    for block in model.model.layers:
        attention, mlp = block.self_attn, block.mlp
        layers.append(
            _Layer(
                block.input_layernorm.weight,
                _fuse([attention.q_proj, attention.k_proj, attention.v_proj]),
                attention.o_proj,
                block.post_attention_layernorm.weight,
                _fuse([mlp.gate_proj, mlp.up_proj]),
                mlp.down_proj,
            )
        )
    return FusedLlamaStep(model, layers)
