"""Kimi K3's language model: a Kimi Linear (KDA linear attention, NoPE MLA, MoE) with what transformers' Kimi
Linear lacks, written from the math of the checkpoint's own `modeling_kimi_linear.py` (never copied from it):

- attention residuals (`attn_res_block_size`): a layer's attention and MLP read a softmax mix, per token, of the
  running block sum and the block sums banked before it (the embedding first), scored by an RMS-normed dot product;
  the output mixes them once more. Nothing carries over time: no cache;
- a latent MoE (`routed_expert_hidden_size`, `latent_moe_use_norm`): routed experts run in a narrower space,
  between a down and an up projection (the router and the shared experts read the full input);
- SiTU (`hidden_act=situ`): beta tanh(g / beta) sigmoid(g) times beta_l tanh(u / beta_l), in every MLP;
- an MLA output gate (`mla_use_output_gate`), sigmoid(g_proj(x)) on the attention output;
- the KDA gate's lower bound (`gate_lower_bound`: lb sigmoid(...) instead of -softplus) and a full-rank KDA
  output gate (`use_full_rank_gate`: g_proj instead of g_b_proj(g_a_proj));
- the router's activation (`moe_router_activation_func`: sigmoid or softmax), grouped top-k, renormalisation only
  for k > 1; the reference's config defaults (`KimiK3Config`), which are not transformers'.

Parameters carry the checkpoint's own names (`language_model.` stripped): separate q/k/v short convolutions,
`A_log` [heads], `block_sparse_moe.` for MoE layers and `mlp.` for dense ones. The one conversion is the routed
experts', stored per expert (`experts.E.w1/w2/w3`) and held fused as transformers' experts modules hold them
(`gate_up_proj` [E, 2I, H], `down_proj` [E, H, I]), so the experts interface (`@use_experts_implementation`:
transformers' kernels, Deltafin's expert pool) computes them. The caches are transformers' own layer kinds:
a `LinearAttentionLayer` per KDA layer (convolution window [B, 3 Dk, W] and recurrent state [B, H, K, V], float32)
and a `DynamicLayer` per MLA layer holding the normed latent [B, 1, S, kv_lora_rank] as keys and the shared key
part [B, 1, S, qk_rope_head_dim] as values, as transformers' Kimi Linear keeps them: batching, the prefix cache
and the memo handle them as they handle any model's. There are no positions (NoPE; KDA orders by recurrence).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedConfig, PreTrainedModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.integrations import use_experts_implementation
from transformers.modeling_outputs import CausalLMOutputWithPast
from transformers.modeling_utils import slice_logits_to_keep

from deltafin.engine.models import kda


class KimiK3Config(PreTrainedConfig):
    """The language model's config as the checkpoint's `text_config` spells it, with the reference's defaults
    (a key the checkpoint leaves out means what the reference code makes of it, not what transformers' Kimi
    Linear would). `layer_types` (derived) tells transformers' cache which layers are KDA."""

    model_type = "kimi_k3_text"
    keys_to_ignore_at_inference = ["past_key_values"]

    vocab_size: int = 163840
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    hidden_act: str = "silu"
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = 0
    bos_token_id: int | None = 1
    eos_token_id: int | list[int] | None = 2
    tie_word_embeddings: bool = False
    moe_intermediate_size: int | None = None
    moe_renormalize: bool = True
    moe_router_activation_func: str = "sigmoid"
    num_experts: int | None = None
    num_experts_per_token: int | None = None
    num_shared_experts: int | None = 0
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    num_expert_group: int = 1
    topk_group: int = 1
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    mla_use_nope: bool | None = False
    mla_use_output_gate: bool | None = False
    linear_attn_config: dict | None = None
    attn_res_block_size: int | None = None
    latent_moe_use_norm: bool = False
    activation_situ_beta: float | None = None
    activation_situ_linear_beta: float | None = None
    routed_expert_hidden_size: int | None = None
    max_position_embeddings: int = 4096
    layer_types: list[str] | None = None

    def __post_init__(self, **kwargs: Any) -> None:
        kwargs.pop("model_type", None)  # the checkpoint says kimi_linear: this class is not transformers' config
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self.layer_types = [
            "linear_attention" if self.is_kda(i) else "full_attention" for i in range(self.num_hidden_layers)
        ]
        super().__post_init__(**kwargs)

    def need(self, key: str) -> int:
        """A width the layers this config builds cannot do without (the reference would fail without it too)."""
        value = getattr(self, key)
        if value is None:
            raise ValueError(f"the Kimi K3 config sets no {key}, which its layers need")
        return int(value)

    def is_kda(self, layer: int) -> bool:
        return (layer + 1) in self.kda_settings.get("kda_layers", ())

    def is_moe(self, layer: int) -> bool:
        return bool(
            self.num_experts is not None
            and layer >= self.first_k_dense_replace
            and layer % (self.moe_layer_freq or 1) == 0
        )

    @property
    def is_mla(self) -> bool:
        """The reference builds MLA for every non-KDA layer when any MLA key is set."""
        keys = (self.q_lora_rank, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim)
        return any(key is not None for key in keys) or self.mla_use_nope is True

    @property
    def kda_settings(self) -> dict[str, Any]:
        return self.linear_attn_config or {}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """K3's RMSNorm: normalised in float32, cast back, then scaled in the weight's dtype."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class KimiK3RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def gated_activation(config: KimiK3Config) -> Any:
    """(gate, up) -> the MLP's hidden activation: SiTU, or act(gate) * up for an ACT2FN activation."""
    if config.hidden_act == "situ":
        beta = config.activation_situ_beta or 1.0
        linear_beta = config.activation_situ_linear_beta

        def situ(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
            g, u = gate.float(), up.float()
            if linear_beta is not None:
                u = linear_beta * torch.tanh(u / linear_beta)
            return (beta * torch.tanh(g / beta) * torch.sigmoid(g) * u).to(gate.dtype)

        return situ
    act = ACT2FN[config.hidden_act]
    return lambda gate, up: act(gate) * up


class KimiK3MLP(nn.Module):
    """The dense layers' MLP and the shared experts."""

    def __init__(self, config: KimiK3Config, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, config.hidden_size, bias=False)
        self.activation = gated_activation(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.activation(self.gate_proj(x), self.up_proj(x)))


@use_experts_implementation
class KimiK3Experts(nn.Module):
    """The routed experts, fused as transformers' experts modules are: `gate_up_proj` [E, 2I, H] (w1 rows, then
    w3's) and `down_proj` [E, H, I], H the latent width when the MoE is latent. The experts interface chooses who
    computes them (this forward, transformers' grouped kernels, or the expert pool); `_apply_gate` is the
    activation every one of them applies."""

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__()
        hidden = config.routed_expert_hidden_size or config.hidden_size
        inner = config.need("moe_intermediate_size")
        self.num_experts = config.need("num_experts")
        self.gate_up_proj = nn.Parameter(torch.empty(self.num_experts, 2 * inner, hidden))
        self.down_proj = nn.Parameter(torch.empty(self.num_experts, hidden, inner))
        self.activation = gated_activation(config)

    def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return self.activation(gate, up)

    def forward(self, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor) -> torch.Tensor:
        """hidden [N, H]; top_k_index, top_k_weights [N, k] -> [N, H]: each expert's output in hidden's dtype,
        weighted and summed in float32 (the reference's order), cast once."""
        if hidden.shape[0] == 1:  # a decode step of one row: its k experts in turn, no gathering
            weights = top_k_weights[0].float().tolist()
            total = None
            for expert, weight in zip(top_k_index[0].tolist(), weights):
                inner = self._apply_gate(F.linear(hidden, self.gate_up_proj[expert]))
                part = F.linear(inner, self.down_proj[expert]).float() * weight
                total = part if total is None else total + part
            assert total is not None
            return total.to(hidden.dtype)
        out = torch.zeros(hidden.shape[0], self.down_proj.shape[1], dtype=torch.float32, device=hidden.device)
        for expert in torch.unique(top_k_index).tolist():
            tokens, choice = torch.where(top_k_index == expert)
            inner = self._apply_gate(F.linear(hidden[tokens], self.gate_up_proj[expert]))
            projected = F.linear(inner, self.down_proj[expert])
            out.index_add_(0, tokens, projected.float() * top_k_weights[tokens, choice].float().unsqueeze(-1))
        return out.to(hidden.dtype)


class KimiK3Router(nn.Module):
    """Scores every expert on the full-width input, float32; picks the top k by score plus the correction bias
    (optionally within the best expert groups); weighs the picks by their score alone."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__()
        self.top_k = config.need("num_experts_per_token")
        self.num_experts = config.need("num_experts")
        self.softmax = config.moe_router_activation_func == "softmax"
        self.groups, self.topk_group = config.num_expert_group or 1, config.topk_group or 1
        self.renormalize, self.scale = config.moe_renormalize, config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, config.hidden_size))
        self.register_buffer("e_score_correction_bias", torch.zeros(self.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [N, D] -> (logits [N, E], weights [N, k] float32, indices [N, k])."""
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(dim=-1) if self.softmax else logits.sigmoid()
        choice = scores + self.e_score_correction_bias.float()
        if self.groups > 1 and self.groups > self.topk_group:
            grouped = choice.view(x.shape[0], self.groups, -1)
            best = grouped.topk(2, dim=-1).values.sum(-1).topk(self.topk_group, dim=-1).indices  # [N, topk_group]
            keep = torch.zeros_like(grouped[..., 0], dtype=torch.bool).scatter_(1, best, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(choice)
        indices = choice.topk(self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        if self.top_k > 1 and self.renormalize:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, weights * self.scale, indices


class KimiK3MoE(nn.Module):
    def __init__(self, config: KimiK3Config) -> None:
        super().__init__()
        self.gate = KimiK3Router(config)
        self.experts = KimiK3Experts(config)
        self.latent = config.routed_expert_hidden_size is not None
        if self.latent:
            width = config.need("routed_expert_hidden_size")
            self.routed_expert_down_proj = nn.Linear(config.hidden_size, width, bias=False)
            self.routed_expert_up_proj = nn.Linear(width, config.hidden_size, bias=False)
            if config.latent_moe_use_norm:
                self.routed_expert_norm = KimiK3RMSNorm(width, eps=config.rms_norm_eps)
        self.shared_experts = (
            KimiK3MLP(config, config.need("moe_intermediate_size") * config.need("num_shared_experts"))
            if config.num_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])  # [N, D]
        _, weights, indices = self.gate(flat)
        routed_in = self.routed_expert_down_proj(flat) if self.latent else flat
        # The expert pool applies the next MoE layer's router early (prefetch); routers read the full-width
        # input, not the latent one the experts get.
        self.experts.router_input = flat
        try:
            y = self.experts(routed_in, indices, weights)
        finally:
            del self.experts.router_input
        if self.latent:
            if hasattr(self, "routed_expert_norm"):
                y = self.routed_expert_norm(y)
            y = self.routed_expert_up_proj(y)
        y = y.view(shape)
        if self.shared_experts is not None:
            y = y + self.shared_experts(x)
        return y


class KimiK3KDA(nn.Module):
    """A Kimi Delta Attention layer: q/k/v projections through SiLU short convolutions, the gated delta rule
    (`deltafin.engine.models.kda`), a gated RMS norm per head, the output projection."""

    def __init__(self, config: KimiK3Config, layer: int) -> None:
        super().__init__()
        settings = config.kda_settings
        self.layer = layer
        self.heads, self.head_dim = settings["num_heads"], settings["head_dim"]
        self.kernel = settings["short_conv_kernel_size"]
        self.lower_bound = settings.get("gate_lower_bound")
        width, hidden = self.heads * self.head_dim, config.hidden_size
        self.q_proj = nn.Linear(hidden, width, bias=False)
        self.k_proj = nn.Linear(hidden, width, bias=False)
        self.v_proj = nn.Linear(hidden, width, bias=False)
        self.q_conv1d = nn.Conv1d(width, width, self.kernel, groups=width, bias=False)
        self.k_conv1d = nn.Conv1d(width, width, self.kernel, groups=width, bias=False)
        self.v_conv1d = nn.Conv1d(width, width, self.kernel, groups=width, bias=False)
        self.f_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
        self.f_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.A_log = nn.Parameter(torch.zeros(self.heads))
        self.dt_bias = nn.Parameter(torch.zeros(width))
        self.b_proj = nn.Linear(hidden, self.heads, bias=False)
        self.full_rank_gate = bool(settings.get("use_full_rank_gate", False))
        if self.full_rank_gate:
            self.g_proj = nn.Linear(hidden, width, bias=False)
        else:
            self.g_a_proj = nn.Linear(hidden, self.head_dim, bias=False)
            self.g_b_proj = nn.Linear(self.head_dim, width, bias=False)
        self.o_norm = KimiK3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.o_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor, cache: Any, padding: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, D] (normed); `padding` [B, T] (1 = a token) on a batch's first pass, else None."""
        batch, tokens, _ = x.shape
        if padding is not None:  # padded positions read as zeros: a left-padded row starts as if alone
            x = x * padding.unsqueeze(-1).to(x.dtype)
        heads = (batch, tokens, self.heads, self.head_dim)
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1).transpose(1, 2)  # [B, 3Dk, T]
        state = None
        if cache is not None:
            state = cache.get_recurrent_state(self.layer)  # None on a sequence's first pass
            mixed = cache.update_conv_state(mixed, self.layer, conv_kernel_size=self.kernel)  # the window
        weight = torch.cat([self.q_conv1d.weight, self.k_conv1d.weight, self.v_conv1d.weight])[:, 0]  # [3Dk, W]
        qkv = F.silu(kda.short_conv(mixed, weight, tokens)).to(x.dtype)
        q, k, v = (part.reshape(heads) for part in qkv.chunk(3, dim=-1))
        q = kda.l2norm(q) * self.head_dim**-0.5
        k = kda.l2norm(k)
        g = kda.gate(self.f_b_proj(self.f_a_proj(x)).view(heads), self.A_log, self.dt_bias, self.lower_bound)
        beta = torch.sigmoid(self.b_proj(x).float())
        if state is None:
            state = x.new_zeros(batch, self.heads, self.head_dim, self.head_dim, dtype=torch.float32)
        run = kda.recurrent if tokens == 1 else kda.chunked
        o, state = run(q, k, v.float(), g, beta, state.float())
        if cache is not None:
            cache.update_recurrent_state(state, self.layer)
        gate = self.g_proj(x) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x))
        o = o.to(x.dtype).float()
        o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.o_norm.eps) * self.o_norm.weight.float()
        o = (o * torch.sigmoid(gate.view(heads).float())).to(x.dtype)
        return self.o_proj(o.reshape(batch, tokens, -1))


class KimiK3MLA(nn.Module):
    """Multi-head latent attention without rotary positions: every head's key is its k_nope (from the cached
    latent) beside one shared, unrotated k_rot; an optional sigmoid gate on the output.

    With a float `kv_b_proj`, attention runs in the latent space (`absorb`, as llama.cpp and vLLM run MLA):
    each head's query is taken through its slice of kv_b_proj to the latent's width, scored against the cached
    latents themselves, and the probability-weighted latent taken through the value slice: the cache is never
    expanded to per-head keys and values, which for a long context cost more than the rest of a decode step.
    A quantized kv_b_proj (placement.quantize) expands the latents instead; both are the same math."""

    def __init__(self, config: KimiK3Config, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.heads = config.num_attention_heads
        self.nope, self.rope = config.need("qk_nope_head_dim"), config.need("qk_rope_head_dim")
        self.v_dim, self.rank = config.need("v_head_dim"), config.need("kv_lora_rank")
        self.scale = (self.nope + self.rope) ** -0.5
        self.absorb = True
        hidden, q_width = config.hidden_size, self.heads * (self.nope + self.rope)
        if config.q_lora_rank is not None:
            rank = config.need("q_lora_rank")
            self.q_a_proj = nn.Linear(hidden, rank, bias=False)
            self.q_a_layernorm = KimiK3RMSNorm(rank)  # eps 1e-6 in the reference, whatever the config
            self.q_b_proj = nn.Linear(rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = KimiK3RMSNorm(self.rank)
        self.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, hidden, bias=False)
        if config.mla_use_output_gate:
            self.g_proj = nn.Linear(hidden, self.heads * self.v_dim, bias=False)

    def forward(self, x: torch.Tensor, cache: Any, mask: torch.Tensor | None) -> torch.Tensor:
        """x [B, T, D] (normed); mask [B, 1, T, S] additive (None: no masking)."""
        batch, tokens, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if hasattr(self, "q_a_proj") else self.q_proj(x)
        q = q.view(batch, tokens, self.heads, -1).transpose(1, 2)  # [B, H, T, dn + dr]
        q_nope, q_rot = q.split([self.nope, self.rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent).unsqueeze(1)  # [B, 1, T, rank]
        k_rot = k_rot.unsqueeze(1)  # [B, 1, T, dr]
        if cache is not None:
            latent, k_rot = cache.update(latent, k_rot, self.layer)  # [B, 1, S, .]
        rope_scores = q_rot @ k_rot.transpose(-1, -2)  # [B, H, T, S]: k_rot is every head's
        if self.absorb and type(self.kv_b_proj) is nn.Linear:
            weight = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.rank)
            k_up, v_up = weight.split([self.nope, self.v_dim], dim=1)  # [H, dn, rank], [H, dv, rank]
            scores = (q_nope @ k_up) @ latent.transpose(-1, -2) + rope_scores
            probs = self._probs(scores, mask, x.dtype)
            out = (probs @ latent) @ v_up.transpose(-1, -2)  # [B, H, T, dv]
        else:
            positions = latent.shape[2]
            kv = self.kv_b_proj(latent[:, 0]).view(batch, positions, self.heads, -1).transpose(1, 2)
            k_nope, value = kv.split([self.nope, self.v_dim], dim=-1)  # [B, H, S, dn], [B, H, S, dv]
            probs = self._probs(q_nope @ k_nope.transpose(-1, -2) + rope_scores, mask, x.dtype)
            out = probs @ value
        out = out.transpose(1, 2).reshape(batch, tokens, -1)  # [B, T, H dv]
        if hasattr(self, "g_proj"):
            out = out * torch.sigmoid(self.g_proj(x))
        return self.o_proj(out)

    def _probs(self, scores: torch.Tensor, mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        scores = scores * self.scale
        if mask is not None:
            scores = scores + mask
        return scores.softmax(dim=-1, dtype=torch.float32).to(dtype)


class ResidualScore(nn.Module):
    """An attention-residual projection ([1, D], as the checkpoint stores it): only its product with the res
    norm's weight is ever used (a nn.Linear would be quantized away by placement.quantize)."""

    def __init__(self, size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, size))


def mix(sources: list[torch.Tensor], norm: KimiK3RMSNorm, proj: ResidualScore) -> torch.Tensor:
    """The attention-residual mix of `sources` ([B, T, D] each), per token: softmax over the sources of their
    RMS-normed dot product with norm.weight * proj.weight, then the weighted sum of the raw sources (float32)."""
    values = torch.stack(sources, dim=-2).float()  # [B, T, n, D]
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + norm.eps)
    scores = (keys * (norm.weight.float() * proj.weight[0].float())).sum(-1)  # [B, T, n]
    return (scores.softmax(-1).unsqueeze(-1) * values).sum(-2).to(sources[-1].dtype)


class KimiK3DecoderLayer(nn.Module):
    def __init__(self, config: KimiK3Config, layer: int) -> None:
        super().__init__()
        self.kda = config.is_kda(layer)
        self.self_attn = KimiK3KDA(config, layer) if self.kda else KimiK3MLA(config, layer)
        if config.is_moe(layer):
            self.block_sparse_moe = KimiK3MoE(config)
        else:
            self.mlp = KimiK3MLP(config, config.intermediate_size)
        self.input_layernorm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.block = config.attn_res_block_size
        self.block_start = self.block is not None and layer % self.block == 0
        if self.block is not None:
            self.self_attention_res_norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.self_attention_res_proj = ResidualScore(config.hidden_size)
            self.mlp_res_norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp_res_proj = ResidualScore(config.hidden_size)

    def ffn(self, x: torch.Tensor) -> torch.Tensor:
        return self.block_sparse_moe(x) if hasattr(self, "block_sparse_moe") else self.mlp(x)

    def attend(self, x: torch.Tensor, cache: Any, masks: dict[str, Any]) -> torch.Tensor:
        x = self.input_layernorm(x)
        return self.self_attn(x, cache, masks["kda" if self.kda else "mla"])

    def forward(
        self, hidden: torch.Tensor, blocks: list[torch.Tensor], cache: Any, masks: dict[str, Any]
    ) -> torch.Tensor:
        """hidden: the running sum (attention residuals: of this block so far; the embedding before layer 0);
        `blocks`: the sums banked so far (appended to at a block's first layer)."""
        if self.block is None:  # the plain pre-norm residual
            hidden = hidden + self.attend(hidden, cache, masks)
            return hidden + self.ffn(self.post_attention_layernorm(hidden))
        x = mix([*blocks, hidden], self.self_attention_res_norm, self.self_attention_res_proj) if blocks else hidden
        if self.block_start:
            blocks.append(hidden)
        attended = self.attend(x, cache, masks)
        hidden = attended if self.block_start else hidden + attended
        x = mix([*blocks, hidden], self.mlp_res_norm, self.mlp_res_proj)
        return hidden + self.ffn(self.post_attention_layernorm(x))


class KimiK3PreTrainedModel(PreTrainedModel):
    config_class = KimiK3Config
    config: KimiK3Config
    base_model_prefix = "model"
    _no_split_modules = ["KimiK3DecoderLayer"]
    _is_stateful = True
    # a K3 checkpoint's vision tower and projector sit beside the language model and are never read
    _keys_to_ignore_on_load_unexpected = [r"^vision_tower\.", r"^mm_projector\."]
    _keep_in_fp32_modules_strict = ["e_score_correction_bias", "gate.weight", "dt_bias", "A_log"]

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        """Unless asked otherwise, the routed experts run this class's own forward: it computes only the experts
        the tokens chose, where transformers' grouped kernel, on a CPU, loops over every expert of the layer
        (896 in the release, 16 of them chosen per token)."""
        return super().get_correct_experts_implementation("eager" if requested_experts is None else requested_experts)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, KimiK3KDA):  # fla's: rates in [1, 16], dt_bias the inverse softplus of [1e-3, 0.1]
            init.copy_(module.A_log, torch.empty_like(module.A_log).uniform_(1, 16).log())
            dt = torch.empty_like(module.dt_bias).uniform_(1e-3, 1e-1)
            init.copy_(module.dt_bias, dt + torch.log(-torch.expm1(-dt)))
        elif isinstance(module, KimiK3Experts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)
        elif isinstance(module, KimiK3Router):
            init.normal_(module.weight, mean=0.0, std=std)
            init.zeros_(module.e_score_correction_bias)
        elif isinstance(module, KimiK3RMSNorm):
            init.ones_(module.weight)
        elif isinstance(module, ResidualScore):
            init.zeros_(module.weight)


class KimiK3Model(KimiK3PreTrainedModel):
    def __init__(self, config: KimiK3Config) -> None:
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(KimiK3DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.attn_res_block_size is not None:
            self.output_attn_res_norm = KimiK3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.output_attn_res_proj = ResidualScore(config.hidden_size)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        masks = self._masks(hidden, attention_mask, cache)
        blocks: list[torch.Tensor] = []
        for layer in self.layers:
            hidden = layer(hidden, blocks, cache, masks)
        if self.config.attn_res_block_size is not None:
            hidden = mix([*blocks, hidden], self.output_attn_res_norm, self.output_attn_res_proj)
        return self.norm(hidden)

    def _masks(self, hidden: torch.Tensor, attention_mask: torch.Tensor | None, cache: Any) -> dict[str, Any]:
        """MLA: an additive [B, 1, T, S] mask, causal and hiding padding (None for one unpadded token). KDA: the
        padding [B, T] of a first pass (None once the rows have state: a decode step feeds every row a token)."""
        batch, tokens = hidden.shape[:2]
        kinds = self.config.layer_types or []
        mla_layer = next((i for i, kind in enumerate(kinds) if kind == "full_attention"), None)
        past = cache.get_seq_length(mla_layer) if cache is not None and mla_layer is not None else 0
        kda_layer = next((i for i, kind in enumerate(kinds) if kind == "linear_attention"), None)
        fresh = cache is None or kda_layer is None or cache.get_recurrent_state(kda_layer) is None
        padded = attention_mask is not None and not bool(attention_mask.all())
        kda_padding = attention_mask[:, -tokens:] if attention_mask is not None and padded and fresh else None
        if tokens == 1 and not padded:
            return {"mla": None, "kda": kda_padding}
        keys = torch.arange(past + tokens, device=hidden.device)
        queries = torch.arange(past, past + tokens, device=hidden.device)
        allowed = (keys[None, :] <= queries[:, None]).expand(batch, tokens, past + tokens)
        if attention_mask is not None:
            allowed = allowed & attention_mask[:, None, -(past + tokens) :].bool()
        # The dtype's lowest value, not -inf: a fully masked row (a padding query) stays finite
        mask = torch.zeros(allowed.shape, dtype=hidden.dtype, device=hidden.device)
        mask = mask.masked_fill(~allowed, torch.finfo(hidden.dtype).min).unsqueeze(1)
        return {"mla": mask, "kda": kda_padding}


class KimiK3ForCausalLM(KimiK3PreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: KimiK3Config) -> None:
        super().__init__(config)
        self.model = KimiK3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def forward(
        self,
        input_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,  # accepted and unused: K3 has no positions
        cache: Any = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Any,
    ) -> CausalLMOutputWithPast:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        if use_cache and cache is None:
            from transformers import DynamicCache

            cache = DynamicCache(config=self.config)
        hidden = self.model(input_ids, attention_mask, cache if use_cache is not False else None, inputs_embeds)
        logits = self.lm_head(slice_logits_to_keep(hidden, logits_to_keep))
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return CausalLMOutputWithPast(loss=loss, logits=logits, cache=cache)


def _register_conversion() -> None:
    """How checkpoint keys become this class's parameters, registered under the class name (transformers applies
    a mapping to a class of its own only when registered so): the per-expert w1/w3 (gate, up) and w2 (down)
    merged into the fused experts' tensors. Reversed, it is also how `save_pretrained` writes them back."""
    from transformers import conversion_mapping
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    conversion_mapping.register_checkpoint_conversion_mapping(
        KimiK3ForCausalLM.__name__,
        [
            WeightConverter(
                source_patterns=[r"\.experts.*.w1.weight", r"\.experts.*.w3.weight"],
                target_patterns=r"\.experts.gate_up_proj",
                operations=[MergeModulelist(dim=0), Concatenate(dim=1)],
            ),
            WeightConverter(
                source_patterns=r"\.experts.*.w2.weight",
                target_patterns=r"\.experts.down_proj",
                operations=[MergeModulelist(dim=0)],
            ),
        ],
        overwrite=True,
    )


_register_conversion()
