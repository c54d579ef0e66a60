"""KDA's torch ops (deltafin.engine.models.kda): the chunked prefill is the recurrence, token for token, whatever
the length, the chunk boundaries, the initial state or the gate's range; the short convolution run in windows
is one pass; the gate is fla's formula in both of its forms."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltafin.engine.models import kda


def inputs(batch: int, tokens: int, heads: int, dim: int, lowest: float, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    q = kda.l2norm(torch.randn(batch, tokens, heads, dim, generator=generator)) * dim**-0.5
    k = kda.l2norm(torch.randn(batch, tokens, heads, dim, generator=generator))
    v = torch.randn(batch, tokens, heads, dim, generator=generator)
    g = lowest * torch.rand(batch, tokens, heads, dim, generator=generator)
    beta = torch.rand(batch, tokens, heads, generator=generator)
    state = torch.randn(batch, heads, dim, dim, generator=generator)
    return q, k, v, g, beta, state


@pytest.mark.parametrize("tokens", [1, 15, 16, 17, 48, 77])
@pytest.mark.parametrize("lowest", [-5.0, -40.0], ids=["bounded", "steep"])
def test_the_chunked_form_is_the_recurrence(tokens, lowest):
    """-5: K3's bounded gate (the factorised decays); -40: a gate whose 16-token decay leaves float32's range
    there (the pairwise decays). Both from a non-zero initial state."""
    q, k, v, g, beta, state = inputs(2, tokens, 3, 16, lowest)
    expected, expected_state = kda.recurrent(q, k, v, g, beta, state)
    out, final = kda.chunked(q, k, v, g, beta, state)
    assert torch.allclose(out, expected, atol=1e-5) and torch.allclose(final, expected_state, atol=1e-5)


def test_a_prefill_in_pieces_is_one_prefill():
    q, k, v, g, beta, state = inputs(1, 70, 2, 8, -5.0, seed=1)
    whole, whole_state = kda.chunked(q, k, v, g, beta, state)
    pieces, carried = [], state
    for start, end in [(0, 5), (5, 37), (37, 38), (38, 70)]:
        run = kda.recurrent if end - start == 1 else kda.chunked
        out, carried = run(*(x[:, start:end] for x in (q, k, v, g, beta)), carried)
        pieces.append(out)
    assert torch.allclose(torch.cat(pieces, dim=1), whole, atol=1e-5)
    assert torch.allclose(carried, whole_state, atol=1e-5)


def test_the_recurrence_is_the_delta_rule():
    """One token by hand: decay, then write beta times the residual of v against what the state returns."""
    q, k, v, g, beta, state = inputs(1, 1, 1, 4, -1.0, seed=2)
    decayed = state[0, 0] * g[0, 0, 0].exp().unsqueeze(-1)
    residual = v[0, 0, 0] - decayed.T @ k[0, 0, 0]
    updated = decayed + beta[0, 0, 0] * torch.outer(k[0, 0, 0], residual)
    out, final = kda.recurrent(q, k, v, g, beta, state)
    assert torch.allclose(final[0, 0], updated, atol=1e-6)
    assert torch.allclose(out[0, 0, 0], updated.T @ q[0, 0, 0], atol=1e-6)


def test_the_short_convolution_in_windows_is_one_pass():
    """The window is what transformers' linear-attention cache layer returns: the last W inputs (zeros before the
    start), then the new ones."""
    generator = torch.Generator().manual_seed(3)
    inputs_ = torch.randn(2, 6, 19, generator=generator)  # [B, D, T]
    weight = torch.randn(6, 4, generator=generator)
    whole = kda.short_conv(inputs_, weight, 19)
    expected = F.conv1d(F.pad(inputs_, (3, 0)), weight.unsqueeze(1), groups=6).transpose(1, 2)
    assert torch.allclose(whole, expected, atol=1e-6)
    state = torch.zeros(2, 6, 4)
    pieces = []
    for start, end in [(0, 2), (2, 3), (3, 11), (11, 19)]:
        window = torch.cat([state, inputs_[..., start:end]], dim=-1)
        pieces.append(kda.short_conv(window, weight, end - start))
        state = window[..., -4:]
    assert torch.allclose(torch.cat(pieces, dim=1), whole, atol=1e-6)


def test_the_gate():
    """With a lower bound: lb * sigmoid(exp(A) (raw + dt_bias)), in [lb, 0]; without: -exp(A) softplus(...)."""
    generator = torch.Generator().manual_seed(4)
    raw = torch.randn(5, 2, 3, generator=generator) * 4
    a_log, dt_bias = torch.randn(2, generator=generator), torch.randn(6, generator=generator)
    x = raw + dt_bias.view(2, 3)
    rate = a_log.exp().view(2, 1)
    bounded = kda.gate(raw, a_log, dt_bias, -5.0)
    assert torch.allclose(bounded, -5.0 * torch.sigmoid(rate * x))
    assert bool((bounded >= -5).all() and (bounded <= 0).all())
    assert torch.allclose(kda.gate(raw, a_log, dt_bias, None), -rate * F.softplus(x))


@pytest.mark.parametrize("lowest", [-5.0, -40.0], ids=["bounded", "steep"])
def test_serving_and_teaching_run_the_same_chunked_steps(lowest):
    """Serving (no autograd) updates the state in place; teaching a tiny model (autograd) runs the same steps out
    of place: the same outputs and state, and gradients that reach every input."""
    q, k, v, g, beta, state = inputs(2, 40, 3, 16, lowest, seed=2)
    with torch.inference_mode():
        served, served_state = kda.chunked(q, k, v, g, beta, state)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta)]
    taught, taught_state = kda.chunked(*leaves, state)
    assert torch.allclose(taught, served, atol=1e-5) and torch.allclose(taught_state, served_state, atol=1e-5)
    (taught.square().sum() + taught_state.square().sum()).backward()
    assert all(x.grad is not None and torch.isfinite(x.grad).all() and x.grad.abs().sum() > 0 for x in leaves)
