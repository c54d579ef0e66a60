"""Pure-torch stand-ins for what K3's reference `modeling_kimi_linear.py` imports from flash-linear-attention
(`fla`, GPU-only Triton kernels) and `einops`, so the reference model runs on a CPU as the test oracle.

Each is the kernel's documented math, token by token where the kernel is a recurrence (plain, slow and obviously
right, as an oracle should be): fla's `ShortConvolution` (a depthwise causal conv with SiLU; its cache holds the
last W inputs), `FusedRMSNormGated` (float32 RMS norm times weight times sigmoid(gate)), and `chunk_kda` /
`fused_recurrent_kda` (the gated delta rule, with the gate computed in the kernel: lb * sigmoid(exp(A) (g + dt))
with a lower bound, -exp(A) softplus(g + dt) without; q and k l2-normalised, beta sigmoid, the state [N, H, V, K]
when `transpose_state_layout`). tests/engine/test_k3_reference.py proves them: with K3's features off the
reference running on them is transformers' Kimi Linear (whose own torch fallbacks are the independent oracle).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def rearrange(x: torch.Tensor, pattern: str, **axes: int) -> torch.Tensor:
    """The three einops patterns the reference uses."""
    pattern = " ".join(pattern.split())
    if pattern == "b s ... -> (b s) ...":
        return x.reshape(x.shape[0] * x.shape[1], *x.shape[2:])
    if pattern == "... (h d) -> ... h d":
        return x.reshape(*x.shape[:-1], -1, axes["d"])
    if pattern == "b t h d -> b t (h d)":
        return x.reshape(*x.shape[:2], -1)
    raise NotImplementedError(pattern)


def prepare_lens_from_mask(mask: torch.Tensor) -> torch.Tensor:
    return mask.sum(-1, dtype=torch.int32)


def prepare_cu_seqlens_from_mask(mask: torch.Tensor, dtype: torch.dtype = torch.int32) -> torch.Tensor:
    return F.pad(prepare_lens_from_mask(mask).cumsum(0, dtype=dtype), (1, 0))


def tensor_cache(fn: Any) -> Any:  # fla memoises on tensor identity; correctness needs none of it
    return fn


def _rows(batch: int, tokens: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch row, start, end) of each sequence: the rows, or the packed segments of a varlen batch of one."""
    if cu_seqlens is None:
        return [(b, 0, tokens) for b in range(batch)]
    bounds = cu_seqlens.tolist()
    return [(0, start, end) for start, end in zip(bounds[:-1], bounds[1:])]


class ShortConvolution(nn.Conv1d):
    """fla.modules.ShortConvolution: weight [D, 1, W]; cache and final state [N, D, W], the last W inputs (zeros
    before a sequence's start); the output at t reads inputs t-W+1..t."""

    def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, activation: str | None = "silu", **_):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=bias, padding=kernel_size - 1)
        self.activation = activation

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
        cache: torch.Tensor | None = None,
        output_final_state: bool = False,
        cu_seqlens: torch.Tensor | None = None,
        **_: Any,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if mask is not None:
            x = x * mask.unsqueeze(-1)
        width = self.kernel_size[0]
        outputs, finals = [], []
        for n, (b, start, end) in enumerate(_rows(x.shape[0], x.shape[1], cu_seqlens)):
            inputs = x[b, start:end].transpose(0, 1).float()  # [D, L]
            before = cache[n].float() if cache is not None else inputs.new_zeros(inputs.shape[0], width)
            window = torch.cat([before, inputs], dim=-1)
            out = F.conv1d(window[None, :, 1:], self.weight.float(), groups=inputs.shape[0])[0]  # [D, L]
            if self.activation in ("silu", "swish"):
                out = F.silu(out)
            outputs.append(out.transpose(0, 1))
            finals.append(window[:, -width:])
        y = torch.stack(outputs) if cu_seqlens is None else torch.cat(outputs)[None]
        if residual is not None:
            y = y + residual.float()
        final = torch.stack(finals).to(x.dtype) if (output_final_state or cache is not None) else None
        if cache is not None and final is not None and not torch.is_grad_enabled():
            cache.copy_(final)  # a decode step updates the kernel's cache in place
        return y.to(x.dtype), final


class FusedRMSNormGated(nn.Module):
    """fla.modules.FusedRMSNormGated: x rsqrt(mean x^2 + eps) weight act(g), all in float32, cast to x's dtype."""

    def __init__(self, hidden_size: int, elementwise_affine: bool = True, eps: float = 1e-5, activation="swish", **_):
        super().__init__()
        self.eps, self.activation = eps, activation
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, g: torch.Tensor, **_: Any) -> torch.Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        gate = torch.sigmoid(g.float()) if self.activation == "sigmoid" else F.silu(g.float())
        return (y * gate).to(x.dtype)


def _kda_gate(g: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    heads, dim = g.shape[-2:]
    x = g.float() + dt_bias.float().view(heads, dim)
    rate = a_log.float().view(heads, 1).exp()
    return lower_bound * torch.sigmoid(rate * x) if lower_bound is not None else -rate * F.softplus(x)


def _kda(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
    use_gate_in_kernel=False, use_beta_sigmoid_in_kernel=False, lower_bound=None, transpose_state_layout=False,
    cu_seqlens=None, A_log=None, dt_bias=None, **_,
):  # fmt: skip
    """The gated delta rule token by token, float32. q, k, g [B, T, H, K]; v [B, T, H, V]; beta [B, T, H]."""
    batch, tokens, heads, dim = q.shape
    scale = dim**-0.5 if scale is None else scale
    qf, kf, vf = q.float(), k.float(), v.float()
    if use_qk_l2norm_in_kernel:
        qf = qf / torch.sqrt((qf * qf).sum(-1, keepdim=True) + 1e-6)
        kf = kf / torch.sqrt((kf * kf).sum(-1, keepdim=True) + 1e-6)
    decay = _kda_gate(g, A_log, dt_bias, lower_bound) if use_gate_in_kernel else g.float()
    b = torch.sigmoid(beta.float()) if use_beta_sigmoid_in_kernel else beta.float()
    out = torch.zeros(batch, tokens, heads, v.shape[-1], dtype=torch.float32)
    finals = []
    for n, (row, start, end) in enumerate(_rows(batch, tokens, cu_seqlens)):
        state = q.new_zeros(heads, dim, v.shape[-1], dtype=torch.float32)  # [H, K, V]
        if initial_state is not None:
            state = initial_state[n].float().clone()
            state = state.transpose(-1, -2) if transpose_state_layout else state
        for t in range(start, end):
            state = state * decay[row, t].exp().unsqueeze(-1)
            residual = vf[row, t] - torch.einsum("hk,hkv->hv", kf[row, t], state)
            state = state + kf[row, t].unsqueeze(-1) * (b[row, t].unsqueeze(-1) * residual).unsqueeze(-2)
            out[row, t] = torch.einsum("hk,hkv->hv", qf[row, t] * scale, state)
        finals.append(state.transpose(-1, -2) if transpose_state_layout else state)
    return out.to(v.dtype), (torch.stack(finals) if output_final_state else None)


def chunk_kda(q, k, v, g, beta, **kwargs):
    kwargs.pop("safe_gate", None)  # picks a faster Triton path; the gate comes from lower_bound either way
    return _kda(q, k, v, g, beta, **kwargs)


def fused_recurrent_kda(q, k, v, g, beta, **kwargs):
    return _kda(q, k, v, g, beta, **kwargs)


#: module name -> the names the reference imports from it
MODULES: dict[str, dict[str, Any]] = {
    "einops": {"rearrange": rearrange},
    "fla.modules": {"ShortConvolution": ShortConvolution, "FusedRMSNormGated": FusedRMSNormGated},
    "fla.ops.kda": {"chunk_kda": chunk_kda, "fused_recurrent_kda": fused_recurrent_kda},
    "fla.ops.utils.index": {
        "prepare_cu_seqlens_from_mask": prepare_cu_seqlens_from_mask,
        "prepare_lens_from_mask": prepare_lens_from_mask,
    },
    "fla.utils": {"tensor_cache": tensor_cache},
    "llmcompressor.modeling.moe.context": {"get_calibrate_all_experts_flag": lambda: False},
}
