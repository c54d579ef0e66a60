"""The expert pool on generated MoE checkpoints of every architecture it serves: the bytes it reads are the
checkpoint's, its tokens are the all-resident model's, alone, batched and through the engine."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from deltafin.engine import EngineFront, Finished, GenerationJob, TextDelta
from deltafin.engine.experts import (
    NotPoolable,
    PoolCounters,
    PoolTooSmall,
    charge,
    check_pool,
    load_pooled_model,
)
from deltafin.engine.experts.checkpoint import build_index
from deltafin.engine.experts.model import ModelShape, experts_modules, meta_model
from deltafin.engine.experts.policy import make_policy
from deltafin.engine.experts.reader import ExpertReader
from deltafin.engine.experts.sizing import MIB, plan_pool
from deltafin.engine.local.engine import LocalEngine
from deltafin.engine.weights.loader import ModelLoadError, load_model
from deltafin.protocol.sampling import SamplingParams
from deltafin.tiny.moe import ARCHITECTURES, MoeShape, write_moe
from tests.conftest import compose_config

#: 32 experts a layer, 96 KiB each in float32: 1 MiB of pool is 10 slots, an eighth or less of the experts
SHAPE = MoeShape(experts=32, top_k=2, layers=5, hidden=128, intermediate=64)
ARCHS = sorted(ARCHITECTURES)
PROMPTS = [[5, 17, 42, 99, 3, 7, 61, 200, 11], [9, 8, 7, 6, 5, 4, 3, 2, 1]]


@pytest.fixture(scope="session")
def moe(tmp_path_factory):
    """arch (and variant) -> a generated checkpoint, written on first use."""
    root = tmp_path_factory.mktemp("moe")
    written: dict[str, object] = {}

    def get(arch: str, variant: str = "plain"):
        key = f"{arch}-{variant}"
        if key not in written:
            written[key] = write_moe(
                arch,
                root / key,
                SHAPE,
                fused=variant == "fused",
                stream=variant == "stream",
                dtype=torch.bfloat16 if variant == "bf16" else torch.float32,
            )
        return written[key]

    return get


def placement(*overrides: str, pool_mb: int = 1):
    return compose_config([f"placement.experts.pool_mb={pool_mb}", *overrides]).placement


def resident(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def pooled(folder, *overrides: str, pool_mb: int = 1, max_batch: int = 2, cache_dir=None):
    return load_pooled_model(
        folder,
        placement(*overrides, pool_mb=pool_mb),
        dtype=torch.float32,
        trust_remote_code=False,
        max_batch=max_batch,
        cache_dir=cache_dir,
    )


_RESIDENT_TOKENS: dict[tuple[str, int], torch.Tensor] = {}


def resident_greedy(folder, new_tokens: int = 10) -> torch.Tensor:
    """The all-resident model's greedy tokens (computed once per checkpoint)."""
    key = (str(folder), new_tokens)
    if key not in _RESIDENT_TOKENS:
        _RESIDENT_TOKENS[key] = greedy(resident(folder), new_tokens)
    return _RESIDENT_TOKENS[key]


def greedy(model, new_tokens: int = 10) -> torch.Tensor:
    ids = torch.tensor(PROMPTS)
    with torch.inference_mode():
        return model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


class TestPolicy:
    def test_lru_evicts_the_least_recently_used_eligible_slot(self):
        policy = make_policy("lru", 3, half_life=4)
        for tick, slot in enumerate([0, 1, 2, 0]):
            policy.touch(slot, tick)
        assert policy.victim(lambda s: True) == 1
        assert policy.victim(lambda s: s != 1) == 2  # 1 is pinned: the next oldest goes

    def test_lfru_keeps_a_frequently_used_expert_over_a_recent_one(self):
        policy = make_policy("lfru", 2, half_life=100)
        for tick in range(5):
            policy.touch(0, tick)  # used five times
        policy.touch(1, 6)  # used once, more recently
        assert policy.victim(lambda s: True) == 1
        lru = make_policy("lru", 2, half_life=100)
        for tick in range(5):
            lru.touch(0, tick)
        lru.touch(1, 6)
        assert lru.victim(lambda s: True) == 0

    def test_lfru_forgets_old_frequency(self):
        policy = make_policy("lfru", 2, half_life=2)
        for tick in range(5):
            policy.touch(0, tick)
        policy.touch(1, 40)  # long after: expert 0's count has halved away
        assert policy.victim(lambda s: True) == 0

    def test_no_eligible_slot(self):
        policy = make_policy("lru", 2, half_life=2)
        policy.touch(0, 0)
        assert policy.victim(lambda s: False) is None
        assert policy.victim(lambda s: True) == 0  # what was passed over is still there


class TestCheckpointIndex:
    @pytest.mark.parametrize(
        "arch,variant",
        [
            ("qwen3_moe", "plain"),
            ("mixtral", "plain"),
            ("mixtral", "fused"),
            ("deepseek_v3", "stream"),
            ("kimi_linear", "plain"),
        ],
    )
    def test_pieces_hold_the_bytes_transformers_loads(self, moe, arch, variant):
        """Every expert read back from its byte ranges equals the fused tensors from_pretrained builds."""
        folder = moe(arch, variant)
        reference = resident(folder)
        _, _, meta = meta_model(folder, dtype=torch.float32, trust_remote_code=False)
        index = build_index(folder, meta, experts_modules(meta))
        modules = experts_modules(reference)
        assert list(modules) == index.layers and index.experts == SHAPE.experts
        reader = ExpertReader(index.files)
        try:
            for layer, name in enumerate(index.layers):
                for expert in (0, 1, SHAPE.experts - 1):
                    got = {"gate_up_proj": torch.empty(index.gate_up_shape), "down_proj": torch.empty(index.down_shape)}
                    for piece in index.pieces[layer][expert]:
                        got[piece.part][piece.rows[0] : piece.rows[1]] = reader.read(piece).view(
                            -1, got[piece.part].shape[1]
                        )
                    assert torch.equal(got["gate_up_proj"], modules[name].gate_up_proj[expert])
                    assert torch.equal(got["down_proj"], modules[name].down_proj[expert])
        finally:
            reader.close()
        assert (
            index.total_bytes
            == len(index.layers) * SHAPE.experts * (math.prod(index.gate_up_shape) + math.prod(index.down_shape)) * 4
        )

    def test_a_missing_expert_is_named(self, moe, tmp_path):
        import shutil

        from safetensors.torch import load_file, save_file

        folder = tmp_path / "broken"
        shutil.copytree(moe("qwen3_moe"), folder)
        tensors = load_file(folder / "model.safetensors")
        del tensors["model.layers.1.mlp.experts.7.up_proj.weight"]
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        _, _, meta = meta_model(folder, dtype=torch.float32, trust_remote_code=False)
        with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts: the checkpoint lacks rows of expert 7"):
            build_index(folder, meta, experts_modules(meta))


class TestGreedyTokens:
    """Pooled (a pool of an eighth of the experts or less) against every expert resident, at the model level
    with transformers' own generate: prefill windows that route to more experts than the pool has slots, and
    decode steps of two rows."""

    @pytest.mark.parametrize("arch", ARCHS)
    def test_match_the_resident_model(self, moe, arch):
        folder = moe(arch)
        model, pool = pooled(folder)
        try:
            stats = pool.stats()
            total = len(pool.index.layers) * SHAPE.experts
            assert stats.slots * 8 <= total
            assert torch.equal(greedy(model), resident_greedy(folder))
            stats = pool.stats()
            assert stats.misses > stats.slots and stats.hits > 0  # experts were evicted and read again
            assert stats.bytes_read >= stats.misses * pool.slot_bytes
        finally:
            pool.close()

    @pytest.mark.parametrize(
        "overrides",
        [["placement.experts.prefetch=false", "placement.experts.readers=1"], ["placement.experts.policy=lfru"]],
    )
    def test_match_with_every_setting(self, moe, overrides):
        folder = moe("qwen3_moe")
        model, pool = pooled(folder, *overrides)
        try:
            assert torch.equal(greedy(model), resident_greedy(folder))
        finally:
            pool.close()

    @pytest.mark.parametrize("variant", ["fused", "stream", "bf16"])
    def test_match_for_every_checkpoint_layout(self, moe, variant):
        """Fused [E, 2I, H] tensors, sharded streamed files, and bfloat16 weights served in float32."""
        folder = moe("qwen3_moe", variant)
        model, pool = pooled(folder)
        try:
            assert torch.equal(greedy(model), resident_greedy(folder))
        finally:
            pool.close()

    def test_prefetch_reads_ahead_and_is_used(self, moe):
        folder = moe("mixtral")
        model, pool = pooled(folder)
        try:
            greedy(model)
            with_prefetch = pool.stats()
        finally:
            pool.close()
        model, pool = pooled(folder, "placement.experts.prefetch=false")
        try:
            greedy(model)
            without = pool.stats()
        finally:
            pool.close()
        assert with_prefetch.prefetch_reads > 0 and with_prefetch.prefetch_hits > 0
        assert without.prefetch_reads == 0 and without.hits < with_prefetch.hits

    def test_int8_pool_matches_an_int8_pool_holding_every_expert(self, moe):
        """placement.quantize=int8 quantizes experts as they enter their slot: a small pool gives the tokens of
        one large enough for every expert, and the int8 slots are a quarter of the float ones."""
        folder = moe("qwen3_moe")
        small, small_pool = pooled(folder, "placement.quantize=int8")
        large, large_pool = pooled(folder, "placement.quantize=int8", pool_mb=64)
        try:
            assert large_pool.stats().slots == len(large_pool.index.layers) * SHAPE.experts
            assert small_pool.stats().slot_bytes * 3 < pooled_slot_bytes(torch.float32)
            tokens = greedy(small)
            assert torch.equal(tokens, greedy(large))
            agree = (tokens[:, len(PROMPTS[0]) :] == resident_greedy(folder)[:, len(PROMPTS[0]) :]).float().mean()
            assert agree >= 0.75  # int8 experts against float32 ones
        finally:
            small_pool.close()
            large_pool.close()

    @pytest.mark.parametrize("direct_io", ["true", "false"])
    def test_int8_copy_on_disk_gives_the_tokens_of_quantizing_each_miss(self, moe, tmp_path, direct_io):
        """With a cache folder, an int8 pool reads its misses from the int8 copy of the experts (written once,
        a quarter of the float32 bytes per miss), and computes what quantizing the checkpoint's bytes gives."""
        folder = moe("qwen3_moe")
        setting = f"placement.experts.direct_io={direct_io}"
        on_fill, on_fill_pool = pooled(folder, "placement.quantize=int8")
        from_copy, copy_pool = pooled(folder, "placement.quantize=int8", setting, cache_dir=tmp_path)
        try:
            assert type(on_fill_pool.source).__name__ == "CheckpointSource"
            assert on_fill_pool.compute_threads(2) == 1 and on_fill_pool.compute_threads(1) == 1  # a core to copy
            assert copy_pool.compute_threads(2) == (2 if copy_pool.source.direct else 1)
            copy = copy_pool.source
            assert type(copy).__name__ == "RecordCopy" and copy.path.parent == tmp_path / "experts"
            written = copy.path.stat().st_mtime_ns
            tokens = greedy(from_copy)
            assert torch.equal(tokens, greedy(on_fill))
            stats = copy_pool.stats()
            assert stats.bytes_read == (stats.misses + stats.prefetch_reads) * copy.stride
            assert copy.stride * 3 < pooled_slot_bytes(torch.float32)
        finally:
            on_fill_pool.close()
            copy_pool.close()
        again, again_pool = pooled(folder, "placement.quantize=int8", setting, cache_dir=tmp_path)
        try:
            assert again_pool.source.path.stat().st_mtime_ns == written  # read, not written again
            assert torch.equal(greedy(again), tokens)
        finally:
            again_pool.close()

    def test_an_unwritable_cache_folder_quantizes_each_miss_instead(self, moe, tmp_path):
        blocked = tmp_path / "not-a-folder"
        blocked.write_text("")
        model, pool = pooled(moe("qwen3_moe"), "placement.quantize=int8", cache_dir=blocked)
        try:
            assert type(pool.source).__name__ == "CheckpointSource"
        finally:
            pool.close()

    def test_a_failed_read_fails_that_call_and_the_pool_recovers(self, moe, monkeypatch):
        folder = moe("qwen3_moe")
        model, pool = pooled(folder)
        try:
            reference = resident_greedy(folder, new_tokens=4)
            original = pool.source.reader.read_into
            calls = {"n": 0}

            def flaky(piece, buffer):
                calls["n"] += 1
                if calls["n"] == 5:
                    raise OSError("disk gone")
                return original(piece, buffer)

            monkeypatch.setattr(pool.source.reader, "read_into", flaky)
            with pytest.raises(OSError, match="disk gone"):
                greedy(model, new_tokens=4)
            assert all(pins == 0 for pins in pool._pins)
            assert torch.equal(greedy(model, new_tokens=4), reference)
        finally:
            pool.close()


def pooled_slot_bytes(dtype: torch.dtype) -> int:
    return (2 * SHAPE.intermediate * SHAPE.hidden + SHAPE.hidden * SHAPE.intermediate) * torch.empty(
        (), dtype=dtype
    ).element_size()


class TestSizing:
    SHAPE = ModelShape(layers=4, experts=64, top_k=4, gate_up_shape=(512, 256), down_shape=(256, 256))

    def plan(self, pool_mb: int, *, prefetch: bool = True, max_batch: int = 8, quantize: str = "none"):
        return plan_pool(
            self.SHAPE, pool_mb=pool_mb, prefetch=prefetch, dtype=torch.float32, quantize=quantize, max_batch=max_batch
        )

    def test_the_rule(self):
        slot = (512 * 256 + 256 * 256) * 4  # 768 KiB
        plan = self.plan(48)
        assert plan.slot_bytes == slot and plan.slots == 48 * MIB // slot == 64
        assert plan.per_layer == 32 and plan.required == 64  # 8 rows x top-4, twice with prefetch
        assert self.plan(24, prefetch=False).required == 32
        assert self.plan(1 << 20).slots == 4 * 64  # never more slots than experts

    def test_too_small_is_one_line_naming_the_key(self):
        with pytest.raises(PoolTooSmall) as caught:
            self.plan(47)
        message = str(caught.value)
        assert "\n" not in message and message.startswith("placement.experts.pool_mb: 47 MiB holds 62 experts")
        assert "engine.max_batch=8" in message and "64 slots, 48 MiB" in message
        self.plan(47, prefetch=False)  # enough without prefetch
        self.plan(47, max_batch=7)  # or for fewer rows

    def test_int8_slots_are_a_quarter_and_a_bit(self):
        int8 = self.plan(48, quantize="int8")
        record = 512 * 256 + 256 * 256 + 4 * (512 + 256)  # weights + float32 row scales
        assert int8.slot_bytes == -(-record // 4096) * 4096  # a whole number of pages (direct reads)
        assert int8.slots == 48 * MIB // int8.slot_bytes == 250  # against 64 float32 slots


class TestStartupChecks:
    def test_pool_too_small_for_the_model(self, moe):
        folder = moe("qwen3_moe")
        with pytest.raises(PoolTooSmall, match=r"^placement\.experts\.pool_mb: 1 MiB holds 10 experts"):
            check_pool(folder, placement(pool_mb=1), dtype=torch.float32, trust_remote_code=False, max_batch=8)
        plan = check_pool(folder, placement(pool_mb=1), dtype=torch.float32, trust_remote_code=False, max_batch=2)
        assert plan.slots == 10 and plan.required == 8

    def test_a_dense_model_has_nothing_to_pool(self, tmp_path):
        from deltafin.tiny import write_tiny_model

        dense = write_tiny_model("qwen3", tmp_path / "dense")
        with pytest.raises(NotPoolable, match="no routed experts"):
            check_pool(dense, placement(), dtype=torch.float32, trust_remote_code=False, max_batch=2)

    @pytest.mark.parametrize(
        "overrides,message",
        [
            (
                ["placement.experts.pool_mb=1"],
                "placement.experts.pool_mb: 1 MiB holds 10 experts of 0.09 MiB; a decode step "
                "of engine.max_batch=8 rows needs up to 16 experts",
            ),
            (
                ["placement.experts.pool_mb=1", "placement.device_map=auto"],
                "placement.experts.pool_mb: the expert pool places",
            ),
            (["placement.experts.pool_mb=-1"], "placement.experts.pool_mb: -1 is outside"),
            (
                ["placement.experts.policy=fifo"],
                "placement.experts.policy: Invalid value 'fifo', expected one of [lru, lfru]",
            ),
            (["placement.experts.prefetch=maybe"], "placement.experts.prefetch: "),
        ],
    )
    def test_bad_pool_values_stop_the_server_with_one_line(self, moe, overrides, message):
        import subprocess
        import sys

        from tests.conftest import REPO

        result = subprocess.run(
            [sys.executable, "-m", "deltafin", "model=qwen3", f"model.path={moe('qwen3_moe')}", *overrides],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [result.stderr.strip()]  # one line, no traceback
        assert result.stderr.startswith(f"deltafin: config error: {message}")

    def test_load_model_names_the_key(self, moe):
        cfg = compose_config(["model=qwen3", f"model.path={moe('qwen3_moe')}", "placement.experts.pool_mb=1"])
        with pytest.raises(ModelLoadError, match=r"^placement\.experts\.pool_mb: 1 MiB holds 10 experts"):
            load_model(cfg.model, cfg.placement, max_batch=8)


def test_charge_shares_a_step_among_its_rows():
    rows = [{}, {}]
    for timings in rows:
        charge(timings, PoolCounters(hits=6, misses=2, bytes_read=1000), share=2, decode=True)
    charge(rows[0], PoolCounters(hits=1, misses=1, bytes_read=50), share=1, decode=False)
    assert rows[0] == {
        "expert_hits": 4.0,
        "expert_misses": 2.0,
        "expert_decode_bytes": 500.0,
        "expert_prefill_bytes": 50.0,
    }
    assert rows[1] == {"expert_hits": 3.0, "expert_misses": 1.0, "expert_decode_bytes": 500.0}


class TestEngine:
    """The local engine (continuous batching, prefix cache) on a pooled model gives the resident model's
    tokens, alone and in a batch, and reports each request's pool work."""

    @pytest.fixture(scope="class")
    @classmethod
    def engines(cls, moe):
        folder = moe("deepseek_v3")
        built = {}
        for name, pool_mb in (("resident", 0), ("pooled", 2)):
            cfg = compose_config(
                ["model=kimi_k2", f"model.path={folder}", f"placement.experts.pool_mb={pool_mb}", "engine.max_batch=4"]
            )
            loaded = load_model(cfg.model, cfg.placement, max_batch=4)
            built[name] = EngineFront(
                LocalEngine(loaded, max_batch=4, prefix_cache_min_tokens=4),
                max_waiting=16,
                timeout_s=60,
                memo_entries=0,
            )
        yield built
        loop = asyncio.new_event_loop()
        for front in built.values():
            loop.run_until_complete(front.aclose())
        loop.close()

    @staticmethod
    async def collect(front, prompt, max_tokens=10):
        stream = await front.start(
            [GenerationJob(tuple(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))]
        )
        tokens, finished = [], None
        async for event in stream:
            if isinstance(event, TextDelta):
                tokens.extend(event.token_ids)
            elif isinstance(event, Finished):
                finished = event
        return tokens, finished

    def run_all(self, front, prompts, together: bool):
        async def scenario():
            if together:
                return await asyncio.gather(*(self.collect(front, p) for p in prompts))
            return [await self.collect(front, p) for p in prompts]

        loop = asyncio.new_event_loop()
        try:
            return loop.run_until_complete(scenario())
        finally:
            loop.close()

    PROMPTS = [
        [5, 17, 42, 99, 3, 7, 61, 200, 11, 12],
        [9, 8, 7, 6, 5],
        [100, 101, 102, 103, 104, 105, 106],
        [33, 44, 55, 66, 77, 88, 99, 111, 222, 233, 244, 255],
    ]

    def test_alone_and_batched(self, engines):
        pool = engines["pooled"].client.experts
        assert pool is not None and engines["resident"].client.experts is None
        expected = [tokens for tokens, _ in self.run_all(engines["resident"], self.PROMPTS, together=False)]
        alone = self.run_all(engines["pooled"], self.PROMPTS, together=False)
        before = pool.stats()
        batched = self.run_all(engines["pooled"], self.PROMPTS, together=True)
        assert [tokens for tokens, _ in alone] == expected
        assert [tokens for tokens, _ in batched] == expected
        assert max(engines["pooled"].client.step_sizes) > 1  # they did share decode steps
        after = pool.stats()
        assert after.misses > before.misses and after.hits > before.hits
        for _, finished in batched:
            timings = finished.timings
            assert timings["expert_hits"] + timings["expert_misses"] > 0 and timings["expert_decode_bytes"] > 0
        total_hits = sum(f.timings["expert_hits"] for _, f in batched)
        assert total_hits == pytest.approx(after.hits - before.hits)  # the rows' shares add up to the pool's work

    def test_prefix_cache_reuse(self, engines):
        first = self.PROMPTS[3]
        longer = first + [7, 8, 9, 10, 11]
        expected = self.run_all(engines["resident"], [first, longer], together=False)
        got = self.run_all(engines["pooled"], [first, longer], together=False)
        assert [t for t, _ in got] == [t for t, _ in expected]
        assert got[1][1].cached_tokens >= len(first)
