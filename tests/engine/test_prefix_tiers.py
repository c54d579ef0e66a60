"""The prefix cache's tiers through the real local engine, on every engine path: the default SmolLM2 GGUF in its
own blocks (native), dequantized to float32, int8 weights, and a MoE whose experts are read into a pool. The
oracle is the same engine with the prefix cache off: a prompt served from RAM or disk, after a restart, in a
batch or in chunks, gives the cold run's tokens."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import pytest
import torch

from deltafin.engine import EngineFront, Finished, GenerationJob, TextDelta
from deltafin.engine.kv import cache_layers, disk_tier
from deltafin.engine.local.build import prefix_cache_settings
from deltafin.engine.local.cache_identity import cache_identity
from deltafin.engine.local.engine import LocalEngine
from deltafin.engine.weights.loader import load_model
from deltafin.protocol.sampling import SamplingParams
from deltafin.tiny.moe import MoeShape, write_moe
from tests.conftest import compose_config

BLOCK = 16
PATHS = ["native", "float", "int8", "experts"]


@pytest.fixture(scope="module")
def models(loaded_model, float_model, tmp_path_factory):
    """path -> (its config overrides, the loaded model), loaded on first use."""
    built: dict[str, tuple[list[str], object]] = {
        "native": ([], loaded_model),
        "float": (["model.gguf_weights=dequantize"], float_model),
    }

    def get(path: str):
        if path not in built:
            if path == "int8":
                overrides = ["placement.quantize=int8"]
            else:
                folder = write_moe("deepseek_v3", tmp_path_factory.mktemp("moe"), MoeShape(experts=16, layers=3))
                overrides = ["model=kimi_k2", f"model.path={folder}", "placement.experts.pool_mb=2"]
            config = compose_config(overrides)
            built[path] = (overrides, load_model(config.model, config.placement, max_batch=4))
        return built[path]

    return get


def front_for(overrides, loaded, folder=None, *, prefill_chunk=64, **options) -> EngineFront:
    settings = [f"server.prefix_cache.disk_block_tokens={BLOCK}"]
    if folder is not None:
        settings.append(f"server.prefix_cache.disk_dir={folder}")
    settings += [f"server.prefix_cache.{key}={value}" for key, value in options.items()]
    config = compose_config([*overrides, *settings])
    engine = LocalEngine(
        loaded, max_batch=4, prefill_chunk=prefill_chunk, prefix_cache=prefix_cache_settings(config, loaded)
    )
    return EngineFront(engine, max_waiting=16, timeout_s=120, memo_entries=0)


def cold_front(overrides, loaded) -> EngineFront:
    return front_for(overrides, loaded, enabled="false")


def job(ids, n=8) -> GenerationJob:
    return GenerationJob(tuple(ids), SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))


async def collect(front: EngineFront, ids, n=8) -> tuple[list[int], Finished]:
    stream = await front.start([job(ids, n)])
    tokens: list[int] = []
    finished = None
    async for event in stream:
        if isinstance(event, TextDelta):
            tokens.extend(event.token_ids)
        elif isinstance(event, Finished):
            finished = event
    assert finished is not None
    return tokens, finished


def prompt(loaded, n: int, seed: int) -> list[int]:
    vocab = min(len(loaded.tokenizer), loaded.model.config.vocab_size) - 10
    return torch.randint(5, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def run():
    loop = asyncio.new_event_loop()
    yield loop.run_until_complete
    loop.close()


@pytest.mark.parametrize("path", PATHS)
def test_a_restarted_engine_reads_the_prefix_back_and_answers_as_cold(models, path, run, tmp_path):
    overrides, loaded = models(path)
    cold = cold_front(overrides, loaded)
    first_prompt = prompt(loaded, 70, 1)
    second_prompt = [*first_prompt, *prompt(loaded, 9, 2)]
    before = front_for(overrides, loaded, tmp_path)
    tokens, end = run(collect(before, first_prompt))
    assert end.cached_tokens == 0 and tokens == run(collect(cold, first_prompt))[0]
    assert before.client.prefix_cache.flush(30)
    run(before.aclose())

    after = front_for(overrides, loaded, tmp_path)  # a new process: nothing but the folder is shared
    tokens, end = run(collect(after, second_prompt))
    stats = after.client.prefix_cache.stats
    assert end.cached_tokens == 64 and stats.hits["disk"] == 1 and stats.hit_tokens["disk"] == 64
    assert tokens == run(collect(cold, second_prompt))[0]
    # Its next turn is a RAM hit: the answer's positions too, except on int8, whose decode-step kernel computes
    # positions with other rounding than its prefill (so a cache over generated tokens was never exact there)
    answer = tokens[:-1] if path != "int8" else []
    third = [*second_prompt, *answer, *prompt(loaded, 5, 3)]
    tokens, end = run(collect(after, third))
    assert end.cached_tokens == len(second_prompt) + len(answer) and stats.hits["ram"] == 1
    assert tokens == run(collect(cold, third))[0]
    for front in (after, cold):
        run(front.aclose())


def test_the_ram_budget_holds_and_the_oldest_prompt_comes_back_from_disk(models, run, tmp_path):
    overrides, loaded = models("native")
    per_position = 2 * 30 * 3 * 64 * 4  # keys and values, 30 layers, 3 KV heads of 64, float32
    budget = 3 * 80 * per_position
    front = front_for(overrides, loaded, tmp_path, max_bytes=budget)
    cache = front.client.prefix_cache
    prompts = [prompt(loaded, 60, 10 + n) for n in range(8)]
    for ids in prompts:
        run(collect(front, ids, 4))
        held = [t for entry in cache.entries for t in cache_layers.cache_tensors(entry.cache)]
        # the budget holds, and the count is what the tensors' storages really take
        assert cache.bytes_held <= budget and cache_layers.storage_bytes(held) <= cache.bytes_held
    assert cache.stats.evictions["ram"] >= 5 and cache.flush(30)
    again = [*prompts[0], *prompt(loaded, 6, 99)]
    tokens, end = run(collect(front, again))
    assert end.cached_tokens == 48 and cache.stats.hits["disk"] == 1
    cold = cold_front(overrides, loaded)
    assert tokens == run(collect(cold, again))[0]
    for each in (front, cold):
        run(each.aclose())


def test_a_disk_read_never_holds_up_the_running_rows(models, run, tmp_path, monkeypatch):
    """While a prompt's prefix is read (the reader held here), the running row decodes step after step; the
    prompt then joins the batch, both answers as cold, with a prefill chunk of 16 positions."""
    overrides, loaded = models("native")
    long_prompt, reused = prompt(loaded, 20, 20), prompt(loaded, 70, 21)
    writer = front_for(overrides, loaded, tmp_path)
    run(collect(writer, reused, 2))
    assert writer.client.prefix_cache.flush(30)
    run(writer.aclose())

    reading, release = threading.Event(), threading.Event()
    read = disk_tier.DiskTier._read

    def held(self, plan):
        reading.set()
        release.wait(60)
        return read(self, plan)

    monkeypatch.setattr(disk_tier.DiskTier, "_read", held)
    front = front_for(overrides, loaded, tmp_path, prefill_chunk=16)
    engine = front.client
    extended = [*reused, *prompt(loaded, 7, 22)]

    async def both():
        stream = await front.start([job(long_prompt, 48)])
        events = aiter(stream)
        first = list(getattr(await anext(events), "token_ids", ()))  # the long row decodes
        second = asyncio.ensure_future(collect(front, extended))
        while not reading.is_set():
            await asyncio.sleep(0.01)
        steps_before = sum(1 for kind, _ in engine.schedule if kind == "step")
        deadline = time.monotonic() + 60
        while sum(1 for kind, _ in engine.schedule if kind == "step") < steps_before + 5:
            assert time.monotonic() < deadline, "the running row stopped while a prefix was read"
            await asyncio.sleep(0.01)
        release.set()
        async for event in events:
            first.extend(getattr(event, "token_ids", ()))
        return first, await second

    engine.schedule.clear()
    first, (tokens, end) = run(both())
    assert end.cached_tokens == 64 and engine.prefix_cache.stats.hits["disk"] == 1
    assert max(engine.step_sizes) == 2  # the prompt joined the running row
    cold = cold_front(overrides, loaded)
    assert tokens == run(collect(cold, extended))[0]
    assert first == run(collect(cold, long_prompt, 48))[0]
    for each in (front, cold):
        run(each.aclose())


def test_n_choices_of_a_disk_hit_share_its_prefill(models, run, tmp_path):
    overrides, loaded = models("native")
    ids = prompt(loaded, 50, 30)
    writer = front_for(overrides, loaded, tmp_path)
    run(collect(writer, ids, 2))
    assert writer.client.prefix_cache.flush(30)
    run(writer.aclose())
    front = front_for(overrides, loaded, tmp_path)
    params = [SamplingParams(max_tokens=6, temperature=1.0, seed=s, ignore_eos=True) for s in (1, 2)]

    async def together():
        stream = await front.start([GenerationJob(tuple([*ids, 7, 8]), p) for p in params])
        out: dict[int, list[int]] = {0: [], 1: []}
        ends = {}
        async for event in stream:
            if isinstance(event, TextDelta):
                out[event.choice].extend(event.token_ids)
            elif isinstance(event, Finished):
                ends[event.choice] = event
        return out, ends

    out, ends = run(together())
    assert ends[0].cached_tokens == ends[1].cached_tokens == 48
    cold = cold_front(overrides, loaded)

    async def alone(p):
        stream = await cold.start([GenerationJob(tuple([*ids, 7, 8]), p)])
        return [t for event in [e async for e in stream] if isinstance(event, TextDelta) for t in event.token_ids]

    assert [out[0], out[1]] == [run(alone(p)) for p in params]
    for each in (front, cold):
        run(each.aclose())


def test_another_weights_format_or_template_never_reads_the_blocks(models, run, tmp_path):
    native_overrides, native = models("native")
    float_overrides, floating = models("float")
    config = compose_config([f"server.prefix_cache.disk_dir={tmp_path}"])
    namespace, facts = cache_identity(config, native)
    float_namespace, float_facts = cache_identity(compose_config(float_overrides), floating)
    assert namespace != float_namespace and facts["format"] != float_facts["format"]
    assert facts["weights"] == float_facts["weights"]  # the same file, served another way
    retemplated = dataclasses.replace(native, tokenizer=_with_template(native.tokenizer, "{{ messages }}"))
    assert cache_identity(config, retemplated)[0] != namespace

    ids = prompt(native, 50, 40)
    writer = front_for(native_overrides, native, tmp_path)
    run(collect(writer, ids, 2))
    assert writer.client.prefix_cache.flush(30)
    run(writer.aclose())
    for overrides, loaded in ((float_overrides, floating), (native_overrides, retemplated)):
        other = front_for(overrides, loaded, tmp_path)
        _, end = run(collect(other, [*ids, 5], 2))
        assert end.cached_tokens == 0 and other.client.prefix_cache.stats.hits["disk"] == 0
        run(other.aclose())
    again = front_for(native_overrides, native, tmp_path)
    assert run(collect(again, [*ids, 5], 2))[1].cached_tokens == 48  # the blocks are still there for their model
    run(again.aclose())


def test_damaged_blocks_cost_the_request_nothing_but_their_reuse(models, run, tmp_path):
    """Every block of a prefix damaged on disk: the read stops at the first, removes it, and the prompt is
    prefilled from scratch with the cold run's answer (no error reaches the request)."""
    overrides, loaded = models("native")
    ids = prompt(loaded, 50, 60)
    writer = front_for(overrides, loaded, tmp_path)
    run(collect(writer, ids, 2))
    assert writer.client.prefix_cache.flush(30)
    run(writer.aclose())
    files = list(tmp_path.rglob("*.safetensors"))
    for path in files:
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    front = front_for(overrides, loaded, tmp_path)
    tokens, end = run(collect(front, [*ids, 9]))
    stats = front.client.prefix_cache.stats
    assert end.cached_tokens == 0 and stats.disk_files_removed == 1 and stats.hits["disk"] == 0
    cold = cold_front(overrides, loaded)
    assert tokens == run(collect(cold, [*ids, 9]))[0]
    for each in (front, cold):
        run(each.aclose())


def test_disabled_stores_nothing_anywhere(models, run, tmp_path):
    overrides, loaded = models("native")
    front = front_for(overrides, loaded, tmp_path, enabled="false")
    ids = prompt(loaded, 40, 50)
    run(collect(front, ids, 3))
    _, end = run(collect(front, [*ids, 4], 3))
    assert end.cached_tokens == 0 and len(front.client.prefix_cache) == 0
    assert not list(tmp_path.rglob("*.safetensors"))
    run(front.aclose())


def _with_template(tokenizer, template: str):
    import copy

    other = copy.deepcopy(tokenizer)
    other.chat_template = template
    return other
