"""Kimi Delta Attention (KDA) in plain torch: the gate, the short convolution, and the gated delta rule in its
recurrent form (one token per step: decode) and its chunked form (a prompt window at once: prefill).

Per head, the state S is [K, V] in float32. Each token decays S per key channel, then writes the delta-rule
residual of its value against what S already returns for its key:

    S <- diag(exp(g_t)) S ;   u_t = beta_t (v_t - S^T k_t) ;   S <- S + k_t u_t^T ;   o_t = S^T q_t

The chunked form gives the same outputs C tokens at a time (the WY / UT-transform form fla's `chunk_kda` and
transformers' Kimi Linear fallback compute): everything that does not depend on the state is computed for every
chunk at once, and only the state is carried from chunk to chunk. Within a chunk, with G the cumulative gate
from the chunk start, the decay between tokens i >= j is exp(G_i - G_j) = exp(G_i) exp(-G_j): matrix products,
exact in float32 while |G| stays below ~80 (K3's bounded gate, g > lower_bound >= -5, over 16 tokens, always
does); a chunk whose cumulative gate goes further takes the pairwise decays instead.

Shapes: q, k [B, T, H, K]; v [B, T, H, V]; g (log decay) [B, T, H, K]; beta [B, T, H]; S [B, H, K, V].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

#: tokens per chunk of the chunked form (its factorised decays stay in float32's range for gates >= -5)
CHUNK = 16
#: |cumulative gate| up to which exp(G) and exp(-G) are both finite and accurate in float32 (exp(88) overflows)
_FACTOR_LIMIT = 80.0
#: fla's epsilons: the l2 norm of q and k adds it under the square root
L2_EPS = 1e-6


def gate(raw: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float | None) -> torch.Tensor:
    """The per-channel log decay, float32, from the gate projection's output `raw` [.., H, K]: with a lower bound
    (K3) `lb * sigmoid(exp(A) (raw + dt_bias))`, in (lb, 0); without, Kimi Linear's `-exp(A) softplus(raw +
    dt_bias)`. `a_log` [H] (one rate per head), `dt_bias` [H * K]."""
    heads, dim = raw.shape[-2:]
    x = raw.float() + dt_bias.float().view(heads, dim)
    rate = a_log.float().reshape(heads, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(rate * x)
    return -rate * F.softplus(x)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) over the last dimension, float32 (fla's, with the epsilon inside the root)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2_EPS)


def short_conv(window: torch.Tensor, weight: torch.Tensor, tokens: int) -> torch.Tensor:
    """The depthwise causal convolution's outputs for the last `tokens` inputs, before the activation.

    window: [B, D, W - 1 + tokens] or longer (the inputs, oldest first: the state then the new ones; shorter is
    padded with zeros in front, a sequence's start); weight [D, W]. Returns [B, tokens, D] float32."""
    width = weight.shape[-1]
    need = width - 1 + tokens
    if window.shape[-1] < need:
        window = F.pad(window, (need - window.shape[-1], 0))
    window = window[..., -need:].float()
    if tokens == 1:  # a decode step: one dot product per channel (a convolution call costs more than it)
        return (window * weight.float()).sum(-1).unsqueeze(1)
    out = F.conv1d(window, weight.float().unsqueeze(1), groups=weight.shape[0])  # [B, D, tokens]
    return out.transpose(1, 2)


def recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token (decode: T is 1). q, k l2-normed (q scaled), all float32. Returns o [B, T, H, V] and the
    new state [B, H, K, V] (a new tensor; `state` is not written)."""
    outputs = []
    for t in range(q.shape[1]):
        key = k[:, t].unsqueeze(-2)  # [B, H, 1, K]
        state = state * g[:, t].exp().unsqueeze(-1)
        residual = (v[:, t].unsqueeze(-2) - key @ state) * beta[:, t, :, None, None]  # [B, H, 1, V]
        state = state + key.transpose(-1, -2) @ residual
        outputs.append((q[:, t].unsqueeze(-2) @ state).squeeze(-2))
    return torch.stack(outputs, dim=1), state


def chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same outputs and final state as `recurrent`, `chunk` tokens at a time (see the module docstring)."""
    batch, tokens, heads, key_dim = q.shape
    value_dim = v.shape[-1]
    pad = -tokens % chunk
    # Padding tokens at the end have k = v = 0, g = 0, beta = 0: they neither decay nor write the state.
    q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
    beta = F.pad(beta, (0, 0, 0, pad))
    n, rows = (tokens + pad) // chunk, batch * heads

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, T, H, D] -> [N, B H, C, D]: a chunk's slice is contiguous
        return x.reshape(batch, n, chunk, heads, -1).permute(1, 0, 3, 2, 4).reshape(n, rows, chunk, -1).contiguous()

    q, k, v, g = chunks(q), chunks(k), chunks(v), chunks(g)
    beta = chunks(beta.unsqueeze(-1))  # [N, B H, C, 1]
    cum = g.cumsum(dim=2)  # decay from the chunk start through each token
    grow = cum.exp()
    k_grown, q_grown = k * grow, q * grow  # k_i exp(G_i), q_i exp(G_i)
    strict = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril(-1)
    inclusive = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    if cum.min() >= -_FACTOR_LIMIT:
        # k_j exp(-G_j); under autograd as exp(-G): the reciprocal's gradient, -1/exp(G)^2, overflows to NaN
        k_shrunk = k * ((-cum).exp() if torch.is_grad_enabled() else torch.reciprocal(grow))
        # kk[i, j] = k_i^T diag(exp(G_i - G_j)) k_j, qk likewise with q_i
        kk = k_grown @ k_shrunk.transpose(-1, -2)
        qk = q_grown @ k_shrunk.transpose(-1, -2)
        k_to_end = k_shrunk * grow[:, :, -1:]  # each token's key decayed to the chunk's end
    else:  # [.., C, C, K] pairwise decays, masked before the exp so nothing overflows
        diff = (cum.unsqueeze(-2) - cum.unsqueeze(-3)).masked_fill(~inclusive.unsqueeze(-1), float("-inf")).exp()
        kk = torch.einsum("nrik,nrijk,nrjk->nrij", k, diff, k)
        qk = torch.einsum("nrik,nrijk,nrjk->nrij", q, diff, k)
        k_to_end = k * (cum[:, :, -1:] - cum).exp()
    eye = torch.eye(chunk, dtype=q.dtype, device=q.device)
    lower = (beta * kk).masked_fill(~strict, 0.0)  # L[i, j] = beta_i k_i^T D_ij k_j, j < i
    inverse = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False, unitriangular=True)
    u = inverse @ (beta * v)  # [N, B H, C, V]
    w = inverse @ (beta * k_grown)  # [N, B H, C, K]
    qk = qk.masked_fill(~inclusive, 0.0)
    decay = grow[:, :, -1].unsqueeze(-1)  # [N, B H, K, 1]: the whole chunk's decay
    k_to_end = k_to_end.transpose(-1, -2).contiguous()  # [N, B H, K, C]
    state = state.reshape(rows, key_dim, value_dim).clone()  # updated in place below: never the caller's
    if torch.is_grad_enabled():  # teaching a tiny model: the same steps out of place, which autograd can follow
        outs = []
        for c in range(n):
            residual = u[c] - torch.bmm(w[c], state)
            outs.append(torch.bmm(qk[c], residual) + torch.bmm(q_grown[c], state))
            state = state * decay[c] + torch.bmm(k_to_end[c], residual)
        out = torch.stack(outs)
    else:
        out = q.new_empty(n, rows, chunk, value_dim)
        for c in range(n):  # only the state is sequential; in place, each chunk's tensors are used once
            residual = u[c].baddbmm_(w[c], state, alpha=-1)  # the delta-rule residuals given the chunk's start
            torch.bmm(qk[c], residual, out=out[c]).baddbmm_(q_grown[c], state)
            state.mul_(decay[c]).baddbmm_(k_to_end[c], residual)
    out = out.reshape(n, batch, heads, chunk, value_dim).permute(1, 0, 3, 2, 4).reshape(batch, n * chunk, heads, -1)
    return out[:, :tokens], state.reshape(batch, heads, key_dim, value_dim)
