"""The C kernels. int8: built and loaded on this machine, exact against a float reference of the same int8
weights, the same bits for a row alone or in a batch, and Int8Linear's fallback where it is off. GGUF block
formats: against the `gguf` package's own quantizer and dequantizer, the same bits alone or in a batch and in
every CPU variant, and the run-time dispatcher."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from deltafin.engine import kernels
from deltafin.engine.kernels import int8_matvec
from deltafin.engine.quant.linear import MATVEC_ROWS, GGMLLinear, Int8Linear


def quantized(n=96, k=200, bias=False):
    torch.manual_seed(0)
    parts = Int8Linear.quantize(torch.randn(n, k) * 0.05)  # k not a multiple of 16: the loop's tail runs too
    return Int8Linear(parts["weight"], parts["scales"], torch.randn(n) if bias else None)


def test_the_kernel_builds_here():
    assert int8_matvec() is not None  # this machine has a C compiler; CI's does too


def test_loading_it_leaves_the_process_floating_point_alone():
    """Built with -ffast-math, loading the library switched on flush-to-zero for the whole process: the
    smallest denormal compared equal to 0, and msgspec let `top_p: 0` through its `gt=0.0` check."""
    assert int8_matvec() is not None
    smallest = float.fromhex("0x0.0000000000001p-1022")
    assert smallest > 0.0
    assert torch.tensor([smallest], dtype=torch.float64).item() > 0.0


def test_matches_a_float_reference_of_the_same_weights():
    layer = quantized(bias=True)
    x = torch.randn(5, layer.in_features)
    reference = x.double() @ (layer.weight.double() * layer.scales.double()[:, None]).t() + layer.bias.double()
    got = layer(x)
    assert got.dtype == torch.float32
    assert float((got.double() - reference).abs().max()) < 1e-4


def test_a_row_gets_the_same_bits_alone_and_in_a_batch():
    layer = quantized()
    x = torch.randn(MATVEC_ROWS, layer.in_features)
    together = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(MATVEC_ROWS)])
    assert torch.equal(together, alone)


def test_prefill_sized_inputs_use_torchs_kernel_and_agree():
    layer = quantized(k=208)  # int8pack needs widths in steps of 16
    x = torch.randn(MATVEC_ROWS + 8, layer.in_features)
    by_torch = layer(x)  # int8pack with bfloat16 activations
    by_c = torch.cat([layer(x[i : i + 8]) for i in range(0, x.shape[0], 8)])
    assert float((by_torch - by_c).abs().max()) < 0.02 * float(by_c.abs().max())


def test_widths_torchs_kernel_cannot_read_run_in_c_at_any_row_count():
    layer = quantized(k=200)  # _weight_int8pack_mm crashed the process on this width
    x = torch.randn(3 * MATVEC_ROWS, layer.in_features)
    reference = x.double() @ (layer.weight.double() * layer.scales.double()[:, None]).t()
    assert float((layer(x).double() - reference).abs().max()) < 1e-4


def test_turned_off_the_layer_falls_back():
    code = (
        "import torch; from deltafin.engine.kernels import int8_matvec; from deltafin.engine.quant.linear import Int8Linear\n"
        "assert int8_matvec() is None\n"
        "for k in (64, 100):  # int8pack, then the dequantizing fallback for a width int8pack cannot read\n"
        "    p = Int8Linear.quantize(torch.randn(8, k)); layer = Int8Linear(p['weight'], p['scales'], None)\n"
        "    print(tuple(layer(torch.randn(1, k)).shape))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env={"DELTAFIN_KERNELS": "0", "PATH": "/usr/bin:/bin"},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["(1,", "8)", "(1,", "8)"]


# GGUF block formats (deltafin/engine/kernels/ggml_quants.c): the `gguf` package (the format's reference
# implementation in Python) quantizes random weights and dequantizes them for the reference.

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


#: K-quants: super-blocks of 256 values (gguf has no quantizer for them: random blocks, see `kquant_blocks`)
K_FORMATS = ["Q4_K", "Q5_K", "Q6_K"]


def kquant_blocks(name: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """`n` rows of width `k` (a multiple of 256) of random K-quant super-blocks, uint8 [n, k / 256 * bytes]:
    random codes, scales and mins, with the half scales (d, and dmin for Q4_K / Q5_K) set to small finite
    halves of either sign."""
    import gguf

    qtype = gguf.GGMLQuantizationType[name]
    size = gguf.GGML_QUANT_SIZES[qtype][1]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)

    def halves() -> np.ndarray:
        value = rng.uniform(1e-3, 0.05, size=(n, k // 256)) * rng.choice([-1.0, 1.0], size=(n, k // 256))
        return value.astype(np.float16)[..., None].view(np.uint8)

    if name == "Q6_K":
        blocks[..., 208:210] = halves()
    else:
        blocks[..., 0:2] = halves()
        blocks[..., 2:4] = halves()
    return blocks.reshape(n, -1)


def ggml_layer(name: str, n: int, k: int, seed: int = 0) -> tuple[GGMLLinear, np.ndarray]:
    """A GGMLLinear of `n` random rows of width `k` in format `name`, and gguf's float64 dequantization of it."""
    import gguf

    qtype = gguf.GGMLQuantizationType[name]
    if name in K_FORMATS:
        blocks = kquant_blocks(name, n, k, seed)
        return GGMLLinear(torch.from_numpy(blocks), int(qtype), k), gguf.quants.dequantize(blocks, qtype).astype(
            np.float64
        )
    weights = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = gguf.quants.quantize(weights, qtype)
    return GGMLLinear(torch.from_numpy(blocks.copy()), int(qtype), k), gguf.quants.dequantize(blocks, qtype).astype(
        np.float64
    )


def reference_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's q8_0 of float32 rows, written independently: per block of 32, scale = max|x| / 127 and
    codes = round-half-even(x / scale). Returns (codes [M, K] int32, scales [M, K/32] float32)."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    scale = (np.abs(blocks).max(axis=2) / np.float32(127)).astype(np.float32)
    inverse = np.where(scale != 0, np.float32(1) / np.where(scale != 0, scale, 1), 0).astype(np.float32)
    codes = np.rint(blocks * inverse[:, :, None]).astype(np.int32)
    return codes.reshape(x.shape), scale


#: the formats whose rows the AVX-512 kernels keep repacked (ggml_quants.c, row_times_repacked_body)
REPACKED_FORMATS = ["Q4_0", "Q4_1", "Q8_0"]
REPACKED = 0x10000


def file_layout_matmul(blocks: np.ndarray, qtype: int, k: int, x: torch.Tensor) -> torch.Tensor:
    """The kernel's matmul over the rows as the file has them (what GGMLLinear ran before it repacked)."""
    out = torch.empty(x.shape[0], blocks.shape[0], dtype=torch.float32)
    rows = torch.from_numpy(np.ascontiguousarray(blocks))
    assert not kernels.ggml().deltafin_ggml_matmul(
        x.data_ptr(), x.shape[0], rows.data_ptr(), qtype, blocks.shape[0], k, blocks.shape[1], None, out.data_ptr(), 2
    )
    return out


@pytest.mark.parametrize("name", REPACKED_FORMATS)
@pytest.mark.parametrize("blocks", [1, 15, 16, 18, 19, 31, 40, 48, 50])
def test_repacked_rows_give_the_file_layouts_bits(name, blocks):
    """Blocks before, at and past a group of 16 (the default model's widths: 18 and 48 blocks; 31 and 40 leave a
    whole group of 8 after the last 16), activation rows across the 16-row chunk: the repacked rows' matmul and
    lookups are the file layout's, bit for bit (Q8_0 codes of -128 too, which gguf's quantizer never writes)."""
    import gguf

    qtype = int(gguf.GGMLQuantizationType[name])
    k = 32 * blocks
    weights = np.random.default_rng(blocks).standard_normal((13, k)).astype(np.float32)
    file_rows = gguf.quants.quantize(weights, qtype)
    if name == "Q8_0":  # each block: 2 bytes of scale, then 32 signed codes
        file_rows.reshape(13, blocks, 34)[:, :, 2::5] = np.uint8(0x80)
    layer = GGMLLinear(torch.from_numpy(file_rows.copy()), qtype, k)
    repacked = kernels.variant() == "avx512"
    assert layer.ggml_type == (qtype | REPACKED if repacked else qtype)
    assert torch.equal(layer.blocks, torch.from_numpy(file_rows)) == (not repacked or blocks < 16)
    for rows in (1, 2, 5, 16, 17):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        assert torch.equal(layer(x), file_layout_matmul(file_rows, qtype, k, x))
    reference = gguf.quants.dequantize(file_rows, qtype)
    assert np.array_equal(layer.dequantized().numpy(), reference)
    ids = torch.tensor([12, 0, 7])
    assert np.array_equal(layer.dequantized(ids).numpy(), reference[[12, 0, 7]])


def test_a_layer_never_repacks_the_blocks_it_was_given():
    import gguf

    file_rows = gguf.quants.quantize(np.ones((4, 32 * 16), np.float32), gguf.GGMLQuantizationType.Q4_1)
    given = torch.from_numpy(file_rows.copy())
    GGMLLinear(given, int(gguf.GGMLQuantizationType.Q4_1), 32 * 16)
    assert torch.equal(given, torch.from_numpy(file_rows))


@pytest.mark.parametrize("name", FORMATS)
def test_dequantization_matches_the_gguf_package(name):
    layer, reference = ggml_layer(name, 7, 32 * 9)
    assert np.array_equal(layer.dequantized().double().numpy(), reference)


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("n, blocks, rows", [(37, 19, 5), (1, 1, 1), (8, 8, 21), (33, 7, 17)])
def test_matmul_matches_dequantize_then_matmul(name, n, blocks, rows):
    """Odd output counts, block counts below, at and across a group of 8, rows across the 16-row chunk."""
    layer, weights = ggml_layer(name, n, 32 * blocks, seed=n + blocks)
    torch.manual_seed(rows)
    x = torch.randn(rows, layer.in_features)
    got = layer(x).double().numpy()
    codes, scales = reference_activations(x.numpy())
    quantized_x = codes * np.repeat(scales.astype(np.float64), 32, axis=1)
    exact = quantized_x @ weights.T  # what the kernel computes, in float64
    assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()
    # Against float activations: each differs from its 8-bit code by at most half its block's scale.
    plain = x.double().numpy() @ weights.T
    bound = np.repeat(scales.astype(np.float64) / 2, 32, axis=1) @ np.abs(weights).T
    assert (np.abs(got - plain) <= bound * 1.0001 + 1e-6).all()


@pytest.mark.parametrize("name", K_FORMATS)
def test_kquant_dequantization_matches_the_gguf_package(name):
    import gguf

    layer, reference = ggml_layer(name, 7, 256 * 3, seed=1)
    got = layer.dequantized().numpy()
    assert np.array_equal(got.astype(np.float64), reference)
    assert np.array_equal(got, reference.astype(np.float32))  # and bit for bit as float32 (signs of zeros aside)
    assert kernels.ggml().deltafin_ggml_block_values(int(gguf.GGMLQuantizationType[name])) == 256
    assert (
        kernels.ggml().deltafin_ggml_block_bytes(int(gguf.GGMLQuantizationType[name]))
        == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[name]][1]
    )


@pytest.mark.parametrize("name", K_FORMATS)
@pytest.mark.parametrize("n, superblocks, rows", [(37, 3, 5), (1, 1, 1), (8, 1, 21), (33, 6, 17)])
def test_kquant_matmul_matches_dequantize_then_matmul(name, n, superblocks, rows):
    """Odd output counts, one and several super-blocks, rows across the 16-row chunk."""
    layer, weights = ggml_layer(name, n, 256 * superblocks, seed=n + superblocks)
    torch.manual_seed(rows)
    x = torch.randn(rows, layer.in_features)
    got = layer(x).double().numpy()
    codes, scales = reference_activations(x.numpy())
    quantized_x = codes * np.repeat(scales.astype(np.float64), 32, axis=1)
    exact = quantized_x @ weights.T
    assert np.abs(got - exact).max() <= 1e-5 * np.abs(exact).max()


def test_kquant_widths_must_be_whole_superblocks():
    import gguf

    library = kernels.ggml()
    blocks = kquant_blocks("Q4_K", 2, 256)
    out = torch.empty(2, 128)
    x = torch.randn(2, 128)
    ids = torch.arange(2)
    qtype = int(gguf.GGMLQuantizationType.Q4_K)
    assert (
        library.deltafin_ggml_matmul(x.data_ptr(), 2, blocks.ctypes.data, qtype, 2, 128, 72, None, out.data_ptr(), 1)
        == -1
    )
    assert library.deltafin_ggml_dequantize(blocks.ctypes.data, qtype, 128, 72, ids.data_ptr(), 2, out.data_ptr()) == -1


def test_activations_are_quantized_as_llama_cpp_does():
    torch.manual_seed(1)
    x = torch.randn(3, 96) * torch.tensor([1.0, 1e-3, 30.0])[:, None]
    x[1, :32] = 0.0  # an all-zero block: scale 0, codes 0
    q = torch.empty(3, 96, dtype=torch.int8)
    d = torch.empty(3, 3)
    s = torch.empty(3, 3, dtype=torch.int32)
    kernels.ggml().deltafin_ggml_quantize_activations(x.data_ptr(), 3, 96, q.data_ptr(), d.data_ptr(), s.data_ptr())
    codes, scales = reference_activations(x.numpy())
    assert np.array_equal(q.numpy(), codes) and np.array_equal(d.numpy(), scales)
    assert np.array_equal(s.numpy(), codes.reshape(3, 3, 32).sum(axis=2))


@pytest.mark.parametrize("name", FORMATS + K_FORMATS)
def test_ggml_rows_get_the_same_bits_alone_and_in_a_batch(name):
    layer, _ = ggml_layer(name, 45, 256 * 3 if name in K_FORMATS else 32 * 18)
    x = torch.randn(19, layer.in_features)
    together = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(x.shape[0])])
    assert torch.equal(together, alone)


def test_the_dispatcher_picks_the_best_variant_this_cpu_runs():
    runnable = kernels.supported_variants()
    assert runnable[-1] == "portable" and kernels.variant() == runnable[0]
    assert kernels.ggml().deltafin_kernel_variant() == ["portable", "avx2", "avx512"].index(kernels.variant())


VARIANT_PROBE = (
    "import hashlib, numpy as np, torch, gguf\n"
    "from deltafin.engine import kernels\n"
    "from deltafin.engine.quant.linear import GGMLLinear\n"
    "h = hashlib.sha256()\n"
    "for name in ('Q4_0', 'Q4_1', 'Q5_0', 'Q5_1', 'Q8_0'):\n"
    "    t = gguf.GGMLQuantizationType[name]\n"
    "    w = np.random.default_rng(0).standard_normal((37, 32 * 19)).astype(np.float32)\n"
    "    layer = GGMLLinear(torch.from_numpy(gguf.quants.quantize(w, t).copy()), int(t), 32 * 19)\n"
    "    torch.manual_seed(0); h.update(layer(torch.randn(21, 32 * 19)).numpy().tobytes())\n"
    "for name in ('Q4_K', 'Q5_K', 'Q6_K'):\n"
    "    t = gguf.GGMLQuantizationType[name]\n"
    "    layer = GGMLLinear(torch.from_numpy(kquant_blocks(name, 37, 256 * 3, seed=5)), int(t), 256 * 3)\n"
    "    torch.manual_seed(0); x = torch.randn(21, 256 * 3)\n"
    "    h.update(layer(x).numpy().tobytes()); h.update(layer.dequantized().numpy().tobytes())\n"
    "print(kernels.variant(), kernels.ggml().deltafin_kernel_variant(), h.hexdigest())\n"
)


def probe(variant: str) -> list[str]:
    env = {**os.environ, "DELTAFIN_KERNEL_VARIANT": variant}
    code = "import numpy as np\n" + inspect.getsource(kquant_blocks) + VARIANT_PROBE
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1].split()  # the last line: logging may come before


def test_the_fallback_is_taken_when_forced_and_every_variant_gives_the_same_bits():
    """DELTAFIN_KERNEL_VARIANT=portable forces the plain C build; the SIMD builds this CPU runs compute the
    very same bits (same integer dot products, same float operations in the same order)."""
    results = {variant: probe(variant) for variant in kernels.supported_variants()}
    assert results["portable"][:2] == ["portable", "0"]
    for variant, (name, number, _) in results.items():
        assert name == variant and int(number) == ["portable", "avx2", "avx512"].index(variant)
    assert len({digest for _, _, digest in results.values()}) == 1


def test_a_variant_the_cpu_cannot_run_or_an_unknown_name_is_refused():
    assert probe("no-such-variant")[0] == kernels.variant()
    if "avx512" not in kernels.supported_variants():
        assert probe("avx512")[0] == kernels.variant()
