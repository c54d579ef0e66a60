"""Hybrid caches (linear-attention state beside attention KV) at the level of the model steps: prefill in
windows, the batch's rows joining and leaving, a row's cache leaving the batch. Four models, so the mechanism is
not shaped after one: tiny Kimi Linear (KDA layers and MLA layers), tiny Qwen3-Next (gated delta net layers and
gated attention layers) and tiny Falcon-H1 (attention and Mamba-2 in one layer), real transformers classes, and
the tiny Kimi K3 (Deltafin's own class: KDA and MLA with K3's features, checked against the reference in
tests/engine/test_k3_model.py). The oracle is each model's own `generate`."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.masking_utils import create_recurrent_attention_mask

from deltafin.engine.kv.batch import BatchKV
from deltafin.engine.kv.cache_layers import exact_length_only, has_states, unsupported_layers
from deltafin.engine.local.generator import decode_step, prefill
from deltafin.tiny.architectures import falcon_h1, kimi_k3, kimi_linear, qwen3_next

VOCAB = 300
CPU = torch.device("cpu")


#: model class -> the cache layer kinds it has
KINDS = {
    "KimiK3ForCausalLM": {"LinearAttentionLayer", "DynamicLayer"},
    "KimiLinearForCausalLM": {"LinearAttentionLayer", "DynamicLayer"},
    "Qwen3NextForCausalLM": {"LinearAttentionLayer", "DynamicLayer"},
    "FalconH1ForCausalLM": {"LinearAttentionAndFullAttentionLayer"},
}


@pytest.fixture(scope="module", params=[kimi_k3, kimi_linear, qwen3_next, falcon_h1], ids=lambda make: make.__name__)
def model(request):
    torch.manual_seed(0)
    with torch.device("cpu"):
        return request.param(VOCAB).eval()


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def generate(model, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation (the oracle)."""
    with torch.inference_mode():
        # an explicit mask: left to itself, generate takes prompt tokens equal to pad_token_id for padding
        tensor = torch.tensor([ids])
        out = model.generate(
            tensor,
            attention_mask=torch.ones_like(tensor),
            max_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, len(ids) :].tolist()


def states(cache) -> list[torch.Tensor]:
    return [
        t
        for layer in cache.layers
        if has_states(layer)
        for table in (layer.conv_states, layer.recurrent_states)
        for t in table.values()
        if t is not None
    ]


def run_batch(model, kv: BatchKV, pending: list[int], steps: int) -> list[list[int]]:
    """`steps` greedy decode steps of every row in `kv`, starting from each row's `pending` token."""
    out = [[t] for t in pending]
    for _ in range(steps):
        mask, positions = kv.step_inputs()
        logits = decode_step(model, torch.tensor([[row[-1]] for row in out]), mask, positions, kv.cache)
        kv.advanced(mask)
        for row, token in zip(out, logits.argmax(-1).tolist()):
            row.append(token)
    return out


def test_each_family_has_its_layer_kinds_and_is_accepted(model):
    cache = DynamicCache(config=model.config)
    assert {type(layer).__name__ for layer in cache.layers} == KINDS[type(model).__name__]
    assert unsupported_layers(model.config) is None and exact_length_only(cache)


@pytest.mark.parametrize("window", [1, 3, 7])
def test_prefill_in_windows_leaves_the_state_one_call_would(model, window):
    """The chunked-prefill contract (docs: engine interfaces, item 1): the same prompt run in windows into one
    cache gives the next-token logits, the states and the greedy continuation of one call."""
    ids = prompt(37, seed=1)
    with torch.inference_mode():
        whole, pieces = DynamicCache(config=model.config), DynamicCache(config=model.config)
        expected, _ = prefill(model, ids, whole, 0)
        logits, _ = prefill(model, ids, pieces, 0, chunk=window)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)
    for got, want in zip(states(pieces), states(whole), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    kv = BatchKV(CPU)
    kv.add(pieces, len(ids))
    with torch.inference_mode():
        (tokens,) = run_batch(model, kv, [int(logits.argmax())], 11)
    assert tokens == generate(model, ids, 12)


def test_prefill_continues_a_cache_from_a_later_window(model):
    """Windows that start past the cache's length: what the prefix cache hands back (ids[:cached])."""
    ids = prompt(30, seed=2)
    with torch.inference_mode():
        whole, split = DynamicCache(config=model.config), DynamicCache(config=model.config)
        expected, _ = prefill(model, ids, whole, 0)
        prefill(model, ids[:13], split, 0)
        logits, _ = prefill(model, ids, split, 13, chunk=5)
    torch.testing.assert_close(logits, expected, rtol=0, atol=1e-5)


def test_rows_that_join_and_leave_give_their_solo_tokens(model):
    """Rows of different lengths (left padding in the attention layers), one joining after three steps as
    two copies, one leaving half-way: every row's tokens are transformers' greedy ones for its prompt."""
    prompts = [prompt(n, seed) for n, seed in ((9, 3), (23, 4), (4, 5), (15, 6))]
    expected = [generate(model, p, 9) for p in prompts]
    kv, caches, firsts = BatchKV(CPU), [], []
    with torch.inference_mode():
        for p in prompts:
            cache = DynamicCache(config=model.config)
            logits, _ = prefill(model, p, cache, 0)
            caches.append(cache)
            firsts.append(int(logits.argmax()))
        for i in range(3):
            kv.add(caches[i], len(prompts[i]))
        rows = run_batch(model, kv, firsts[:3], 3)
        kv.add(caches[3], len(prompts[3]), copies=2)  # a request with n=2: two rows from one prefill
        rows += [[firsts[3]], [firsts[3]]]
        pending = [row[-1] for row in rows]
        more = run_batch(model, kv, pending, 2)
        rows = [row + extra[1:] for row, extra in zip(rows, more)]
        kv.keep([0, 2, 3, 4])  # the longest row leaves: its padding columns go
        rows = [rows[i] for i in (0, 2, 3, 4)]
        more = run_batch(model, kv, [row[-1] for row in rows], 3)
        rows = [row + extra[1:] for row, extra in zip(rows, more)]
    assert rows[0] == expected[0] and rows[1] == expected[2]
    assert rows[2] == rows[3] == expected[3][:6]


def test_a_one_token_step_gives_linear_layers_no_padding_mask(model):
    """What the batch relies on: a one-token step gives linear-attention layers no mask (a generated token is
    never padding), so the left padding of the attention layers must never reach them; in a first, longer
    forward the mask zeroes padded inputs (a batch never prefills padded rows). transformers decides it for its
    classes; Deltafin's K3 decides it in its model, from whether the rows already hold state."""
    padded = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    longer = torch.zeros(2, 4, model.config.hidden_size)
    if type(model).__name__ == "KimiK3ForCausalLM":
        cache = DynamicCache(config=model.config)
        with torch.inference_mode():
            model(input_ids=torch.zeros(2, 4, dtype=torch.long), cache=cache, use_cache=True)
            step_mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])  # the batch's left padding, and the new token
            step = model.model._masks(torch.zeros(2, 1, model.config.hidden_size), step_mask, cache)
        assert step["kda"] is None
        assert model.model._masks(longer, padded, None)["kda"].tolist() == padded.tolist()
        return
    embeds = torch.zeros(2, 1, model.config.hidden_size)
    assert create_recurrent_attention_mask(model.config, embeds, padded) is None
    assert create_recurrent_attention_mask(model.config, longer, padded).tolist() == padded.tolist()


def test_a_row_cache_leaves_the_batch_detached(model):
    """`row_cache` copies the row's states: later steps of the batch (which update states in place) do not
    change it, and continuing from it gives the tokens the row gave in the batch."""
    a, b = prompt(11, 7), prompt(6, 8)
    kv = BatchKV(CPU)
    with torch.inference_mode():
        firsts = []
        for p in (a, b):
            cache = DynamicCache(config=model.config)
            logits, _ = prefill(model, p, cache, 0)
            kv.add(cache, len(p))
            firsts.append(int(logits.argmax()))
        rows = run_batch(model, kv, firsts, 2)
        saved = kv.row_cache(1)
        before = [t.clone() for t in states(saved)]
        rows = [row + extra[1:] for row, extra in zip(rows, run_batch(model, kv, [r[-1] for r in rows], 4))]
        for got, want in zip(states(saved), before, strict=True):
            assert torch.equal(got, want)
        alone = BatchKV(CPU)
        alone.add(saved, len(b) + 2)
        (continued,) = run_batch(model, alone, [rows[1][2]], 4)
    assert continued == rows[1][2:]
    assert rows[1] == generate(model, b, 7)


def test_the_batch_never_shares_state_with_the_cache_it_joined_from(model):
    """A prompt's cache joins the batch and is also offered to the prefix cache: decoding must not move it."""
    ids = prompt(8, 9)
    with torch.inference_mode():
        cache = DynamicCache(config=model.config)
        logits, _ = prefill(model, ids, cache, 0)
        before = [t.clone() for t in states(cache)]
        kv = BatchKV(CPU)
        kv.add(cache, len(ids), copies=2)
        run_batch(model, kv, [int(logits.argmax())] * 2, 3)
    for got, want in zip(states(cache), before, strict=True):
        assert torch.equal(got, want)
