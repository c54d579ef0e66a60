"""The C kernels. int8: built and loaded on this machine, exact against a float reference of the same int8
weights, the same bits for a row alone or in a batch, and Int8Linear's fallback where it is off. GGUF block
formats: against the `gguf` package's own quantizer and dequantizer, the same bits alone or in a batch and in
every CPU variant, and the run-time dispatcher."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from deltafin.engine import kernels
from deltafin.engine.kernels import int8_matvec
from deltafin.engine.qlinear import MATVEC_ROWS, GGMLLinear, Int8Linear


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
        "import torch; from deltafin.engine.kernels import int8_matvec; from deltafin.engine.qlinear import Int8Linear\n"
        "assert int8_matvec() is None\n"
        "for k in (64, 100):  # int8pack, then the dequantizing fallback for a width int8pack cannot read\n"
        "    p = Int8Linear.quantize(torch.randn(8, k)); layer = Int8Linear(p['weight'], p['scales'], None)\n"
        "    print(tuple(layer(torch.randn(1, k)).shape))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"DELTAFIN_KERNELS": "0", "PATH": "/usr/bin:/bin"}, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["(1,", "8)", "(1,", "8)"]


# GGUF block formats (deltafin/engine/kernels/ggml_quants.c): the `gguf` package (the format's reference
# implementation in Python) quantizes random weights and dequantizes them for the reference.

FORMATS = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"]


def ggml_layer(name: str, n: int, k: int, seed: int = 0) -> tuple[GGMLLinear, np.ndarray]:
    """A GGMLLinear of `n` random rows of width `k` in format `name`, and gguf's float64 dequantization of it."""
    import gguf

    qtype = gguf.GGMLQuantizationType[name]
    weights = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32)
    blocks = gguf.quants.quantize(weights, qtype)
    return GGMLLinear(torch.from_numpy(blocks.copy()), int(qtype), k), gguf.quants.dequantize(blocks, qtype).astype(np.float64)


def reference_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """llama.cpp's q8_0 of float32 rows, written independently: per block of 32, scale = max|x| / 127 and
    codes = round-half-even(x / scale). Returns (codes [M, K] int32, scales [M, K/32] float32)."""
    blocks = x.astype(np.float32).reshape(x.shape[0], -1, 32)
    scale = (np.abs(blocks).max(axis=2) / np.float32(127)).astype(np.float32)
    inverse = np.where(scale != 0, np.float32(1) / np.where(scale != 0, scale, 1), 0).astype(np.float32)
    codes = np.rint(blocks * inverse[:, :, None]).astype(np.int32)
    return codes.reshape(x.shape), scale


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


@pytest.mark.parametrize("name", FORMATS)
def test_ggml_rows_get_the_same_bits_alone_and_in_a_batch(name):
    layer, _ = ggml_layer(name, 45, 32 * 18)
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
    "from deltafin.engine.qlinear import GGMLLinear\n"
    "h = hashlib.sha256()\n"
    "for name in ('Q4_0', 'Q4_1', 'Q5_0', 'Q5_1', 'Q8_0'):\n"
    "    t = gguf.GGMLQuantizationType[name]\n"
    "    w = np.random.default_rng(0).standard_normal((37, 32 * 19)).astype(np.float32)\n"
    "    layer = GGMLLinear(torch.from_numpy(gguf.quants.quantize(w, t).copy()), int(t), 32 * 19)\n"
    "    torch.manual_seed(0); h.update(layer(torch.randn(21, 32 * 19)).numpy().tobytes())\n"
    "print(kernels.variant(), kernels.ggml().deltafin_kernel_variant(), h.hexdigest())\n"
)


def probe(variant: str) -> list[str]:
    env = {**os.environ, "DELTAFIN_KERNEL_VARIANT": variant}
    done = subprocess.run([sys.executable, "-c", VARIANT_PROBE], capture_output=True, text=True, env=env, timeout=300)
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
