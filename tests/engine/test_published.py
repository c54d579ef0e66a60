"""Published quantized checkpoints served in their own form: tiny Kimi K2 (DeepseekV3) and K3 (Kimi Linear, and
K3's multimodal layout) written in compressed-tensors int4 and MXFP4 and DeepSeek-V3 FP8 blocks, the other MoE
architectures in one format each, against the oracle: the same weights dequantized by each format's definition
(tests/engine/published_oracle.py) and run in float32 by transformers' own classes. Resident and pooled, alone
and four at once through the engine; the pool's reads are the packed records; refusals name the field."""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest
import torch

from deltafin.engine import EngineFront, Finished, GenerationJob, TextDelta
from deltafin.engine.experts import routing
from deltafin.engine.local.engine import LocalEngine
from deltafin.engine.quant import formats
from deltafin.engine.weights.loader import ModelLoadError, load_model
from deltafin.protocol.sampling import SamplingParams
from deltafin.tiny.moe import ARCHITECTURES, MoeShape, write_moe
from deltafin.tiny.quantized import quantization_config, quantize_folder
from deltafin.tiny.writer import write_tiny_model
from tests.conftest import compose_config
from tests.engine.published_oracle import dequantized_folder

#: 64 experts a layer; hidden 192 and intermediate 96: FP8 blocks partial in both directions (gate's and up's
#: grids each of one partial block row), whole groups of 32 for the 4-bit formats. A packed expert is 29-55 KiB,
#: so the 1 MiB pool holds an eighth to a half of the experts. DeepseekV3 (and the others): a dense layer, then 2
#: MoE layers; Kimi Linear: a KDA layer with a dense MLP, then an MLA layer with routed experts (transformers'
#: reference KDA costs most of a step on CPU).
SHAPE = MoeShape(experts=64, top_k=2, layers=3, hidden=192, intermediate=96)
PROMPTS = [[5, 17, 42, 99, 3, 7, 61, 200, 11], [9, 8, 7, 6, 5, 4, 3, 2, 1]]
MODULES = {"int4": "experts", "mxfp4": "experts", "fp8": "linear"}  # as K2-Thinking, K3, K2-Instruct publish them


#: the tiny K3 (released layout, Deltafin's own class) with more and wider routed experts than deltafin.tiny's,
#: so that a 1 MiB pool of their packed records evicts
K3_EXPERTS = {"num_experts": 64, "routed_expert_hidden_size": 128, "moe_intermediate_size": 96}


def write_k3(folder):
    from deltafin.tiny.kimi_k3 import kimi_k3, save_k3

    return write_tiny_model("kimi_k3", folder, architecture=lambda vocab: kimi_k3(vocab, **K3_EXPERTS), save=save_k3)


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """(arch, format) -> (quantized folder, its float32 oracle folder, the float folder it was written from);
    arch `k3` is the tiny Kimi K3 in the released layout (quantization config under text_config)."""
    root = tmp_path_factory.mktemp("published")
    written: dict[tuple[str, str], tuple] = {}

    def get(arch: str, fmt: str):
        if (arch, fmt) not in written:
            source = root / f"{arch}-float"  # one float model per architecture, quantized in each format
            if not source.exists():
                if arch == "k3":
                    write_k3(source)
                else:
                    write_moe(arch, source, SHAPE, embedding_std=1.0)
            quantized = quantize_folder(source, root / f"{arch}-{fmt}", fmt, MODULES[fmt])
            written[(arch, fmt)] = (quantized, dequantized_folder(quantized, root / f"{arch}-{fmt}-oracle"), source)
        return written[(arch, fmt)]

    return get


def family(arch: str) -> str:
    return "kimi_k3" if arch == "k3" else ARCHITECTURES[arch][0]


@pytest.fixture(scope="session", autouse=True)
def _cache_dir(tmp_path_factory):
    """model.cache_dir of every load here (the pools' copies of the experts are written there)."""
    global CACHE
    CACHE = tmp_path_factory.mktemp("published-cache")


CACHE = None


def load(arch: str, folder, *overrides: str, pool_mb: int = 0, max_batch: int = 2):
    cfg = compose_config(
        [
            f"model={family(arch)}",
            f"model.path={folder}",
            f"placement.experts.pool_mb={pool_mb}",
            f"model.cache_dir={CACHE}",
            *overrides,
        ]
    )
    return load_model(cfg.model, cfg.placement, max_batch=max_batch)


def run(model, new_tokens: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(greedy tokens after the prompts, the logits each of them was chosen from: [steps, rows, vocabulary])."""
    ids = torch.tensor(PROMPTS)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            output_logits=True,
            return_dict_in_generate=True,
        )
    return out.sequences[:, ids.shape[1] :], torch.stack(out.logits)


_ORACLE: dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]] = {}


def oracle_run(arch: str, folder, new_tokens: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """A float32 model's tokens and logits (transformers' class, Deltafin's float path), once per folder."""
    key = (str(folder), new_tokens)
    if key not in _ORACLE:
        loaded = load(arch, folder)
        assert loaded.experts is None and not _packed_modules(loaded.model)
        _ORACLE[key] = run(loaded.model, new_tokens)
    return _ORACLE[key]


def _packed_modules(model) -> list[str]:
    return [name for name, m in model.named_modules() if type(m).__name__ in ("Packed4Linear", "FP8BlockLinear")]


def assert_matches_oracle(got, oracle, original) -> None:
    """Tokens equal; logits within float32 rounding of the oracle's, while the float model the checkpoint was
    quantized from is far off (so the comparison can tell the format's weights from others)."""
    tokens, logits = got
    assert torch.equal(tokens, oracle[0])
    scale = float(oracle[1].abs().max())
    served = float((logits - oracle[1]).abs().max())
    assert served <= 2e-5 * scale
    first_step = float((original[1][0] - oracle[1][0]).abs().max())
    assert first_step > 50 * max(served, 1e-6 * scale)


#: Kimi K2 (DeepseekV3) and K3 (the released layout, Deltafin's own class) in each format
K2_K3 = [(arch, fmt) for arch in ("deepseek_v3", "k3") for fmt in ("int4", "mxfp4", "fp8")]


class TestServedAsPublished:
    @pytest.mark.parametrize("arch,fmt", K2_K3)
    def test_resident_and_pooled_give_the_dequantized_models_tokens(self, checkpoints, arch, fmt):
        quantized, oracle_folder, source = checkpoints(arch, fmt)
        oracle = oracle_run(arch, oracle_folder)
        original = oracle_run(arch, source, new_tokens=1)
        resident = load(arch, quantized)
        assert resident.experts is None
        if arch == "k3":  # K3's language model is Deltafin's own class, its latent experts behind the same hook
            assert type(resident.model).__name__ == "KimiK3ForCausalLM"
        experts = [m for m in resident.model.modules() if hasattr(m, "_deltafin_pool")]
        assert experts and all(m.gate_up_proj.numel() == 0 for m in experts)  # no float copy of an expert
        assert bool(_packed_modules(resident.model)) == (fmt == "fp8")  # K2-Instruct's dense layers are FP8 too
        resident_run = run(resident.model)
        assert_matches_oracle(resident_run, oracle, original)

        pooled = load(arch, quantized, pool_mb=1)
        pool = pooled.experts
        try:
            assert pool.slots.kind == fmt and pool.stats().slots < len(pool.index.layers) * SHAPE.experts
            pooled_run = run(pooled.model)
            assert torch.equal(pooled_run[0], resident_run[0]) and torch.equal(pooled_run[1], resident_run[1])
            stats = pool.stats()
            assert stats.misses > stats.slots and stats.hits > 0  # experts were evicted and read again
        finally:
            pool.close()

    @pytest.mark.parametrize("arch,fmt", [("glm4_moe", "int4"), ("qwen3_moe", "mxfp4"), ("mixtral", "fp8")])
    def test_every_architecture_the_pool_serves(self, checkpoints, arch, fmt):
        quantized, oracle_folder, source = checkpoints(arch, fmt)
        pooled = load(arch, quantized, pool_mb=1)
        try:
            original = oracle_run(arch, source, new_tokens=1)
            assert_matches_oracle(run(pooled.model), oracle_run(arch, oracle_folder), original)
        finally:
            pooled.experts.close()

    @pytest.mark.parametrize("pool_mb", [0, 1])
    def test_a_call_of_many_pairs_gives_each_token_the_bits_of_its_own_call(self, checkpoints, pool_mb):
        """Calls of more than routing.FEW_PAIRS (token, choice) pairs group them by slot with torch ops, a decode
        step's few pairs are grouped in Python: a token's output is the same bits either way, resident and
        pooled (the pool here in waves: more experts than slots)."""
        quantized, _, _ = checkpoints("qwen3_moe", "mxfp4")
        loaded = load("qwen3_moe", quantized, pool_mb=pool_mb)
        try:
            module = next(m for m in loaded.model.modules() if hasattr(m, "_deltafin_pool"))
            experts, layer = module._deltafin_pool
            tokens = routing.FEW_PAIRS // SHAPE.top_k + 5
            g = torch.Generator().manual_seed(0)
            hidden = torch.randn(tokens, SHAPE.hidden, generator=g)
            index = torch.stack([torch.randperm(SHAPE.experts, generator=g)[: SHAPE.top_k] for _ in range(tokens)])
            weights = torch.rand(tokens, SHAPE.top_k, generator=g)
            with torch.inference_mode():
                together = experts.forward(layer, module, hidden, index, weights)
                alone = [experts.forward(layer, module, hidden[t : t + 1], index[t : t + 1], weights[t : t + 1])
                         for t in range(tokens)]  # fmt: skip
            assert torch.equal(together, torch.cat(alone))
            assert len(set(index.reshape(-1).tolist())) > (experts.stats().slots if pool_mb else 0)
        finally:
            if loaded.experts is not None:
                loaded.experts.close()


class TestPoolReads:
    @pytest.mark.parametrize("fmt", ["mxfp4", "fp8"])
    def test_a_miss_reads_the_packed_record(self, checkpoints, tmp_path, fmt):
        """From the checkpoint: the expert's codes and scales (six pieces); from the copy of the experts in
        the slots' records (written once, lossless): one read of the record, O_DIRECT or not. The same tokens."""
        quantized, _, _ = checkpoints("deepseek_v3", fmt)
        direct = load("deepseek_v3", quantized, "placement.experts.quantized_copy=false", pool_mb=1)
        pool = direct.experts
        try:
            assert type(pool.source).__name__ == "CheckpointSource"
            layout = pool.slots.layout
            assert all(len(pieces) == 6 for pieces in pool.index.pieces[0])
            assert pool.index.nbytes(0, 0) == layout.packed_bytes
            tokens = run(direct.model, new_tokens=4)[0]
            stats = pool.stats()
            assert stats.bytes_read == (stats.misses + stats.prefetch_reads) * layout.packed_bytes
            codes = 3 * SHAPE.hidden * SHAPE.intermediate * (1 if fmt == "fp8" else 0.5)
            assert codes < layout.packed_bytes < codes * 1.1  # packed: a quarter (MXFP4) or half (FP8) of bf16
        finally:
            pool.close()
        for direct_io in ("true", "false"):
            settings = [f"placement.experts.direct_io={direct_io}", f"model.cache_dir={tmp_path}"]
            copied = load("deepseek_v3", quantized, *settings, pool_mb=1)
            pool = copied.experts
            try:
                copy = pool.source
                assert type(copy).__name__ == "RecordCopy" and copy.stride == layout.stride
                assert copy.path.stat().st_size == len(pool.index.layers) * SHAPE.experts * layout.stride
                assert torch.equal(run(copied.model, new_tokens=4)[0], tokens)
                stats = pool.stats()
                assert stats.bytes_read == (stats.misses + stats.prefetch_reads) * copy.stride
                assert copy.stride == -(-layout.packed_bytes // 4096) * 4096
            finally:
                pool.close()

    @pytest.mark.parametrize(
        "fmt,hidden,intermediate,scale_dtype,record",
        [
            ("int4", 7168, 2048, "BF16", 24_772_608),  # Kimi K2-Thinking: 23.63 MiB against 84 MiB of bfloat16
            ("mxfp4", 3584, 3072, "U8", 17_547_264),  # Kimi K3: 16.73 MiB against 63 MiB
            ("fp8", 7168, 2048, "F32", 44_052_480),  # Kimi K2-Instruct: 42.0 MiB
        ],
    )
    def test_a_published_expert_is_a_quarter_or_half_of_bfloat16(self, fmt, hidden, intermediate, scale_dtype, record):
        """The records of the real models' experts: the same pool_mb holds ~4x (int4, MXFP4) or ~2x (FP8) the
        experts of a bfloat16 pool."""
        from deltafin.engine.experts.model import ModelShape
        from deltafin.engine.experts.records import PackedLayout, float_bytes
        from deltafin.engine.experts.sizing import plan_pool
        from deltafin.engine.quant.formats import PackedModule

        spec = PackedModule("m", fmt, intermediate, hidden, {}, scale_dtype, 32, (128, 128) if fmt == "fp8" else (0, 0))
        layout = PackedLayout(spec, (2 * intermediate, hidden), (hidden, intermediate))
        assert layout.stride == record and record % 4096 == 0
        shapes = ((2 * intermediate, hidden), (hidden, intermediate))
        bf16 = float_bytes(*shapes, torch.bfloat16)
        assert (3.4 if fmt != "fp8" else 1.9) < bf16 / record <= (4 if fmt != "fp8" else 2)
        model = ModelShape(60, 384, 8, *shapes)
        common = dict(pool_mb=64 << 10, prefetch=True, quantize="none", max_batch=8)
        packed = plan_pool(model, dtype=torch.float32, slot_bytes=record, **common)
        float_plan = plan_pool(model, dtype=torch.bfloat16, **common)
        assert packed.slots >= (3.4 if fmt != "fp8" else 1.9) * float_plan.slots


class TestEngine:
    """Continuous batching: four requests alone and at once, resident and pooled, against the oracle's tokens
    through the same engine."""

    PROMPTS = [
        [5, 17, 42, 99, 3, 7, 61, 200, 11, 12],
        [9, 8, 7, 6, 5],
        [100, 101, 102, 103, 104, 105, 106],
        [33, 44, 55, 66, 77, 88, 99, 111, 222, 233, 244, 255],
    ]

    @staticmethod
    def engine(loaded):
        return EngineFront(LocalEngine(loaded, max_batch=4), max_waiting=16, timeout_s=120, memo_entries=0)

    @staticmethod
    async def collect(front, prompt):
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        stream = await front.start([GenerationJob(tuple(prompt), params)])
        tokens = []
        async for event in stream:
            if isinstance(event, TextDelta):
                tokens.extend(event.token_ids)
            elif isinstance(event, Finished):
                finished = event
        return tokens, finished

    def run_all(self, front, together: bool):
        async def scenario():
            if together:
                return await asyncio.gather(*(self.collect(front, p) for p in self.PROMPTS))
            return [await self.collect(front, p) for p in self.PROMPTS]

        return asyncio.run(scenario())

    @pytest.mark.parametrize("arch,fmt", [("deepseek_v3", "int4"), ("k3", "mxfp4"), ("deepseek_v3", "fp8")])
    def test_alone_and_four_at_once(self, checkpoints, arch, fmt):
        quantized, oracle_folder, _ = checkpoints(arch, fmt)
        fronts = {}
        try:
            fronts["oracle"] = self.engine(load(arch, oracle_folder, max_batch=4))
            fronts["resident"] = self.engine(load(arch, quantized, max_batch=4))
            fronts["pooled"] = self.engine(load(arch, quantized, pool_mb=1, max_batch=4))
            expected = [tokens for tokens, _ in self.run_all(fronts["oracle"], together=False)]
            for name in ("resident", "pooled"):
                assert [t for t, _ in self.run_all(fronts[name], together=False)] == expected, name
                together = self.run_all(fronts[name], together=True)
                assert [t for t, _ in together] == expected, name
                assert max(fronts[name].client.step_sizes) > 1  # they did share decode steps
            pool_rows = [f.timings for _, f in together]
            assert all(t["expert_misses"] + t["expert_hits"] > 0 for t in pool_rows)
        finally:
            for front in fronts.values():
                asyncio.run(front.aclose())


class TestRefusals:
    K2_THINKING = quantization_config("int4", "experts")

    @pytest.mark.parametrize(
        "path,value,field",
        [
            (("quant_method",), "awq", 'quantization_config.quant_method="awq"'),
            (("format",), "nvfp4-pack-quantized", 'quantization_config.format="nvfp4-pack-quantized"'),
            (("quantization_status",), "frozen", 'quantization_config.quantization_status="frozen"'),
            (("transform_config",), {"h": 1}, "quantization_config.transform_config="),
            (("kv_cache_scheme",), {"num_bits": 8}, "quantization_config.kv_cache_scheme="),
            (
                ("config_groups", "group_0", "input_activations"),
                {"num_bits": 8},
                "quantization_config.config_groups.group_0.input_activations=",
            ),
            (("config_groups", "group_0", "weights", "num_bits"), 8, "config_groups.group_0.weights.num_bits=8"),
            (("config_groups", "group_0", "weights", "type"), "float", 'config_groups.group_0.weights.type="float"'),
            (("config_groups", "group_0", "weights", "symmetric"), False, "group_0.weights.symmetric=false"),
            (("config_groups", "group_0", "weights", "strategy"), "channel", 'group_0.weights.strategy="channel"'),
            (("config_groups", "group_0", "weights", "group_size"), 8, "group_0.weights.group_size=8"),
            (("config_groups", "group_0", "weights", "actorder"), "group", 'group_0.weights.actorder="group"'),
            (("config_groups", "group_0", "weights", "dynamic"), True, "group_0.weights.dynamic=true"),
            (("config_groups", "group_0", "weights", "scale_dtype"), "torch.float8_e4m3fn", "weights.scale_dtype="),
        ],
    )
    def test_a_compressed_tensors_config_is_refused_naming_the_field(self, path, value, field):
        config = json.loads(json.dumps(self.K2_THINKING))
        node = config
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(formats.UnsupportedQuantization) as caught:
            formats.read({"quantization_config": config})
        message = str(caught.value)
        assert field in message and "\n" not in message

    @pytest.mark.parametrize(
        "key,value,field",
        [
            ("fmt", "e5m2", 'quantization_config.fmt="e5m2"'),
            ("activation_scheme", "static", 'quantization_config.activation_scheme="static"'),
            ("weight_block_size", None, "quantization_config.weight_block_size=null"),
            ("weight_block_size", [128], "quantization_config.weight_block_size=[128]"),
            ("expert_dtype", "fp4", 'quantization_config.expert_dtype="fp4"'),
        ],
    )
    def test_an_fp8_config_is_refused_naming_the_field(self, key, value, field):
        config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
        config[key] = value
        with pytest.raises(formats.UnsupportedQuantization, match=f"^{field.replace('[', '.').replace(']', '.')}"):
            formats.read({"quantization_config": config})

    def test_the_published_configs_are_read(self):
        assert formats.read({}) is None
        assert formats.read({"quantization_config": quantization_config("int4", "experts")}).name == "int4"
        k3 = formats.read({"text_config": {"quantization_config": quantization_config("mxfp4", "experts")}})
        assert (k3.name, k3.place) == ("mxfp4", "text_config.quantization_config")
        assert k3.ignored("language_model.model.layers.3.self_attn.q_proj") and not k3.ignored(
            "language_model.model.layers.3.block_sparse_moe.experts.7.w1"
        )
        fp8 = formats.read({"quantization_config": quantization_config("fp8", "linear")})
        assert (fp8.name, fp8.block) == ("fp8", (128, 128))
        both = {"quantization_config": {"quant_method": "fp8"}, "text_config": {"quantization_config": {"x": 1}}}
        with pytest.raises(formats.UnsupportedQuantization, match="^text_config.quantization_config=.*differs"):
            formats.read(both)

    @pytest.mark.parametrize(
        "extra,message",
        [
            ({"m.weight_zero_point": ("I32", (4, 1))}, "m.weight_zero_point=[4, 1]: asymmetric weights"),
            ({"m.weight_g_idx": ("I32", (64,))}, "m.weight_g_idx=[64]: activation-ordered"),
            ({"m.weight_global_scale": ("F32", (1,))}, "two-level scales (NVFP4)"),
            ({"x.weight_packed": ("I32", (4, 8))}, "x.weight_packed=[4, 8]: has no x.weight_scale beside it"),
            ({"x.weight_scale": ("BF16", (4, 2))}, "x.weight_scale=[4, 2]: has no weight_packed beside it"),
            ({"self_attn.weight_packed": ("I32", (4, 8)), "self_attn.weight_scale": ("BF16", (4, 2))}, "ignore"),
        ],
    )
    def test_tensors_that_do_not_fit_the_format_are_named(self, extra, message):
        from deltafin.engine.quant.formats import Header, find_packed

        fmt = formats.read({"quantization_config": self.K2_THINKING})
        table = {
            "m.weight_packed": Header("I32", (4, 8)),
            "m.weight_scale": Header("BF16", (4, 2)),
            "m.weight_shape": Header("I64", (2,)),
        }
        assert find_packed(table, fmt)["m"].in_features == 64
        table.update({key: Header(dtype, shape) for key, (dtype, shape) in extra.items()})
        with pytest.raises(formats.UnsupportedQuantization) as caught:
            find_packed(table, fmt)
        assert message in str(caught.value)

    def test_wrong_scale_shapes_and_dtypes_are_named(self):
        from deltafin.engine.quant.formats import Header, find_packed

        int4 = formats.read({"quantization_config": self.K2_THINKING})
        bad_group = {"m.weight_packed": Header("I32", (4, 8)), "m.weight_scale": Header("BF16", (4, 1))}
        with pytest.raises(formats.UnsupportedQuantization, match=r"^m.weight_scale=\[4, 1\]: groups of 64 values"):
            find_packed(bad_group, int4)
        bad_dtype = {"m.weight_packed": Header("I32", (4, 8)), "m.weight_scale": Header("F8_E4M3", (4, 2))}
        with pytest.raises(formats.UnsupportedQuantization, match="m.weight_scale"):
            find_packed(bad_dtype, int4)
        fp8 = formats.read({"quantization_config": {"quant_method": "fp8"}})
        grid = {"m.weight": Header("F8_E4M3", (576, 300)), "m.weight_scale_inv": Header("F32", (4, 3))}
        with pytest.raises(formats.UnsupportedQuantization, match=r"is not the \[5, 3\] grid of 128x128 blocks"):
            find_packed(grid, fp8)
        grid["m.weight_scale_inv"] = Header("F32", (5, 3))
        assert find_packed(grid, fp8)["m"].scale_shape == (5, 3)

    def test_a_refused_config_stops_the_server_with_one_line(self, checkpoints, tmp_path):
        import subprocess
        import sys

        from tests.conftest import REPO

        quantized, _, _ = checkpoints("deepseek_v3", "int4")
        folder = tmp_path / "gptq"
        shutil.copytree(quantized, folder)
        config = json.loads((folder / "config.json").read_text())
        config["quantization_config"]["config_groups"]["group_0"]["weights"]["actorder"] = "group"
        (folder / "config.json").write_text(json.dumps(config))
        with pytest.raises(ModelLoadError) as caught:
            load("deepseek_v3", folder)
        expected = (
            'model.path: config.json quantization_config.config_groups.group_0.weights.actorder="group": '
            "activation-ordered groups (a g_idx permutation) are not served"
        )
        assert str(caught.value) == expected
        result = subprocess.run(
            [sys.executable, "-m", "deltafin", "model=kimi_k2", f"model.path={folder}"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 2
        assert result.stderr.strip().splitlines() == [f"deltafin: config error: {expected}"]

    def test_requantizing_a_published_checkpoint_is_refused(self, checkpoints):
        quantized, _, _ = checkpoints("deepseek_v3", "int4")
        with pytest.raises(ModelLoadError, match="^placement.quantize: int8 requantizes float weights"):
            load("deepseek_v3", quantized, "placement.quantize=int8")

    def test_undefined_values_are_refused_naming_the_tensor(self, checkpoints, tmp_path):
        """An E8M0 scale byte 255 in an expert, an FP8 NaN code in a dense layer: never served as numbers."""
        from safetensors.torch import load_file, save_file

        quantized, _, _ = checkpoints("deepseek_v3", "mxfp4")
        folder = tmp_path / "nan-scale"
        shutil.copytree(quantized, folder)
        tensors = load_file(folder / "model.safetensors")
        tensors["model.layers.2.mlp.experts.5.up_proj.weight_scale"][3, 1] = 255
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match=r"model.layers.2.mlp.experts expert 5: scales_gate_up=255: an E8M0"):
            load("deepseek_v3", folder)
        with pytest.raises(ModelLoadError, match=r"expert 5: scales_gate_up=255"):  # writing the pool's copy
            load("deepseek_v3", folder, f"model.cache_dir={tmp_path / 'cache'}", pool_mb=1)

        quantized, _, _ = checkpoints("deepseek_v3", "fp8")
        folder = tmp_path / "nan-code"
        shutil.copytree(quantized, folder)
        tensors = load_file(folder / "model.safetensors")
        tensors["model.layers.1.self_attn.o_proj.weight"].view(torch.uint8)[0, 2] = 0x7F
        save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ModelLoadError, match=r'model.layers.1.self_attn.o_proj.weight="0x7F": an FP8 e4m3fn NaN'):
            load("deepseek_v3", folder)


def test_the_resident_int4_process_holds_packed_experts(tmp_path):
    """RssAnon of a process that loaded an int4 MoE (384 MiB of experts in float32, 54 MiB packed): grows by
    the packed experts and the dense weights (and a few MiB of buffers), never by a float copy."""
    import subprocess
    import sys

    from tests.conftest import REPO

    shape = MoeShape(experts=64, top_k=2, layers=2, hidden=512, intermediate=512, heads=4)
    source = write_moe("qwen3_moe", tmp_path / "float", shape, stream=True, dtype=torch.bfloat16)
    quantized = quantize_folder(source, tmp_path / "int4", "int4", "experts")
    float32_experts = 2 * 64 * 3 * 512 * 512 * 4  # every Qwen3-MoE layer routes
    code = (
        "import json, torch\n"
        "from deltafin.engine.weights.loader import load_model\n"
        "from deltafin.testing import compose_config\n"
        "def anon():\n"
        "    status = dict(l.split(':', 1) for l in open('/proc/self/status').read().splitlines())\n"
        "    return int(status['RssAnon'].split()[0]) * 1024\n"
        f"cfg = compose_config(['model=qwen3', 'model.path={quantized}'])\n"
        "from deltafin.engine.kernels import packed\n"
        "import transformers, deltafin.engine.experts, deltafin.engine.weights.published\n"
        "packed(); transformers.Qwen3MoeForCausalLM  # imported and built before the count starts\n"
        "before = anon()\n"
        "loaded = load_model(cfg.model, cfg.placement)\n"
        "dense = sum(p.numel() * p.element_size() for p in loaded.model.parameters())\n"
        "packed = sum(b.numel() * b.element_size() for b in loaded.model.buffers())\n"
        "experts = next(m for m in loaded.model.modules() if hasattr(m, '_deltafin_pool'))._deltafin_pool[0].nbytes\n"
        "print(json.dumps({'grew': anon() - before, 'dense': dense + packed, 'experts': experts}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    assert figures["experts"] < float32_experts / 7
    assert figures["grew"] <= figures["experts"] + figures["dense"] + (32 << 20)
    assert figures["grew"] < float32_experts / 3  # float32 experts: 384 MiB (bfloat16: 192)
