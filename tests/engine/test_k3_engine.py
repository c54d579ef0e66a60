"""Kimi K3 through the real local engine (loader, owner thread, batch, chunked prefill, prefix cache, memo, expert
pool, int8) on the tiny K3 in the released layout, every feature on. The oracle is the checkpoint's own model
code (the reference `modeling_kimi_linear.py`, tests/k3_reference.py) on the same weights: the engine's greedy
tokens are the reference's, alone, four at once, through chunked prefill, from the prefix cache and through the
expert pool."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from deltafin.engine import EngineFront, Finished, GenerationJob, TextDelta
from deltafin.engine.local.engine import LocalEngine
from deltafin.engine.weights.loader import load_model
from deltafin.protocol.sampling import SamplingParams
from deltafin.tiny import write_tiny_model
from deltafin.tiny.kimi_k3 import kimi_k3, save_k3
from tests.conftest import tiny_config
from tests.k3_reference import checkpoint_state, reference_greedy, reference_model


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_tiny_model("kimi_k3", tmp_path_factory.mktemp("k3") / "k3")


@pytest.fixture(scope="module")
def loaded(folder):
    config = tiny_config("kimi_k3", folder)
    return load_model(config.model, config.placement)


def oracle_of(folder):
    """The reference model on the folder's checkpoint: ids, n -> its greedy tokens."""
    text = json.loads((folder / "config.json").read_text())["text_config"]
    reference = reference_model(text, checkpoint_state(folder))
    return lambda ids, n: reference_greedy(reference, ids, n)


@pytest.fixture(scope="module")
def oracle(folder):
    return oracle_of(folder)


@pytest.fixture
def run(loop):
    return loop.run_until_complete


def front_for(loaded, *, memo_entries: int = 0, prefill_chunk: int = 128, max_batch: int = 8) -> EngineFront:
    engine = LocalEngine(loaded, prefix_cache_min_tokens=4, max_batch=max_batch, prefill_chunk=prefill_chunk)
    return EngineFront(engine, max_waiting=16, timeout_s=120.0, memo_entries=memo_entries)


def prompt(n: int, seed: int, vocab: int = 500) -> tuple[int, ...]:
    return tuple(torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist())


def job(ids, n: int = 10) -> GenerationJob:
    return GenerationJob(tuple(ids), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


async def collect(front: EngineFront, jobs) -> tuple[list[int], Finished]:
    stream = await front.start(jobs)
    tokens, finished = [], None
    async for event in stream:
        if isinstance(event, TextDelta):
            tokens.extend(event.token_ids)
        elif isinstance(event, Finished):
            finished = event
    return tokens, finished


def test_greedy_tokens_alone_are_the_references(loaded, oracle, run):
    front = front_for(loaded)
    for ids in (prompt(9, 1), prompt(30, 2)):
        tokens, _ = run(collect(front, [job(ids, 12)]))
        assert tokens == oracle(ids, 12)
    run(front.client.aclose())


def test_four_concurrent_requests_are_the_references(loaded, oracle, run):
    """One long request decodes; three more arrive while it does and join its batch (left-padded MLA latents,
    KDA states joined row by row)."""
    front = front_for(loaded)
    prompts = [prompt(n, seed) for n, seed in ((7, 3), (31, 4), (3, 5), (18, 6))]
    jobs = [job(prompts[0], 40)] + [job(p, 12) for p in prompts[1:]]

    async def together():
        events = aiter(await front.start([jobs[0]]))
        first = list(getattr(await anext(events), "token_ids", ()))
        others = [asyncio.ensure_future(collect(front, [j])) for j in jobs[1:]]
        async for event in events:
            first.extend(getattr(event, "token_ids", ()))
        return [first] + [tokens for tokens, _ in await asyncio.gather(*others)]

    batched = run(together())
    assert max(front.client.step_sizes) == 4, "the requests did not decode together"
    assert batched == [oracle(p, j.params.max_tokens) for p, j in zip(prompts, jobs)]
    run(front.client.aclose())


def test_chunked_prefill_is_the_references(loaded, oracle, run):
    """A 45-token prompt prefilled 7 positions at a time (KDA chunks of 16 cut across windows) while another
    request decodes."""
    front = front_for(loaded, prefill_chunk=7)
    long, short = prompt(45, 7), prompt(5, 8)

    async def both():
        return await asyncio.gather(collect(front, [job(short, 20)]), collect(front, [job(long, 10)]))

    (short_tokens, _), (long_tokens, _) = run(both())
    prefills = [n for kind, n in front.client.schedule if kind == "prefill"]
    assert len(prefills) >= 45 // 7 and max(prefills) <= 7
    assert long_tokens == oracle(long, 10) and short_tokens == oracle(short, 20)
    run(front.client.aclose())


def test_a_conversation_from_the_prefix_cache_is_the_references(loaded, oracle, run):
    """Turn two extends turn one's prompt and answer: it starts from the KDA states and MLA latents saved when
    turn one's row left the batch, and its tokens are the reference's for the whole prompt."""
    front = front_for(loaded)
    first = prompt(20, 9)
    answer, end = run(collect(front, [job(first, 6)]))
    assert end.cached_tokens == 0
    second = (*first, *answer, *prompt(6, 10))
    tokens, end = run(collect(front, [job(second)]))
    assert end.cached_tokens == len(first) + len(answer) - 1
    assert tokens == oracle(second, 10)
    run(front.client.aclose())


def test_the_memo_replays_it(loaded, oracle, run):
    front = front_for(loaded, memo_entries=4)
    ids = prompt(11, 11)
    cold, cold_end = run(collect(front, [job(ids)]))
    warm, warm_end = run(collect(front, [job(ids)]))
    assert warm_end.memo_hit and not cold_end.memo_hit and warm == cold == oracle(ids, 10)
    run(front.client.aclose())


#: a K3 whose routed experts outweigh a small pool: 16 latent experts per layer of 0.375 MiB (float32)
POOLED = {"num_experts": 16, "moe_intermediate_size": 1024}


@pytest.fixture(scope="module")
def pooled_folder(tmp_path_factory):
    return write_tiny_model(
        "kimi_k3",
        tmp_path_factory.mktemp("k3") / "pooled",
        architecture=lambda vocab: kimi_k3(vocab, **POOLED),
        save=save_k3,
    )


@pytest.mark.parametrize("prefetch", [True, False], ids=["prefetch", "no-prefetch"])
def test_through_the_expert_pool_it_is_the_references(pooled_folder, run, prefetch):
    """The routed experts read on demand from the released layout (per-expert w1/w2/w3 under language_model.)
    into 10 slots of 64 experts: evicted and read again, prefetched by the next layer's router applied to the
    full-width input (a latent MoE's experts get a narrower one), and the tokens are the reference's."""
    overrides = ["placement.experts.pool_mb=4", f"placement.experts.prefetch={str(prefetch).lower()}"]
    config = tiny_config("kimi_k3", pooled_folder, overrides)
    loaded = load_model(config.model, config.placement, max_batch=2)
    pool = loaded.experts
    assert pool is not None and pool.slots.count == 10 and len(pool.index.layers) == 4
    front = front_for(loaded, max_batch=2)
    oracle = oracle_of(pooled_folder)
    prompts = [prompt(14, 12), prompt(6, 13)]

    async def both():
        return await asyncio.gather(*(collect(front, [job(p, 10)]) for p in prompts))

    results = run(both())
    assert [tokens for tokens, _ in results] == [oracle(p, 10) for p in prompts]
    stats = pool.stats()
    assert stats.misses > pool.slots.count  # more reads than slots: experts were evicted and read again
    assert (stats.prefetch_reads > 0) == prefetch
    run(front.client.aclose())


def test_int8_quantizes_its_linear_layers_and_serves(folder, run):
    """placement.quantize=int8: every projection of K3's layers becomes int8 (the attention-residual scores, the
    router and the KDA gate parameters are not linear layers and stay float), and it generates."""
    from deltafin.engine.quant.linear import Int8Linear

    config = tiny_config("kimi_k3", folder, ["placement.quantize=int8"])
    loaded = load_model(config.model, config.placement)
    layer = loaded.model.model.layers[3]  # MLA, MoE
    assert isinstance(layer.self_attn.kv_b_proj, Int8Linear) and isinstance(layer.self_attn.g_proj, Int8Linear)
    assert isinstance(layer.block_sparse_moe.routed_expert_down_proj, Int8Linear)
    assert isinstance(loaded.model.model.layers[0].self_attn.g_proj, Int8Linear)  # KDA's full-rank gate
    assert layer.mlp_res_proj.weight.dtype == torch.float32
    front = front_for(loaded)
    tokens, end = run(collect(front, [job(prompt(10, 14), 8)]))
    assert len(tokens) == 8 and end is not None
    run(front.client.aclose())
