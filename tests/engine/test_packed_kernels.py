"""The packed-weight kernels (deltafin/engine/kernels/packed_quants.c) against the formats' definitions written
independently in tests/engine/published_oracle.py: dequantization exact as float32, matmuls within float32
rounding of the float64 product, the same bits for a row alone or in a batch and in every CPU variant; and the
oracle itself checked against other implementations of the formats (gguf's MXFP4, torch's float8_e4m3fn)."""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from deltafin.engine import kernels
from deltafin.engine.quant.formats import linear
from tests.engine import published_oracle as oracle

SCALE_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def int4_weights(n: int, k: int, group: int = 32, dtype=torch.bfloat16, seed: int = 0):
    """Random codes and scales of both signs (bfloat16 subnormals among them), and the oracle's weights."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = (torch.randn(n, k // group, generator=g) * 0.05).to(dtype)
    if dtype == torch.bfloat16 and scales.numel() > 3:
        scales.view(-1)[:3] = torch.tensor([1e-39, -3e-40, 0.0]).to(dtype)  # subnormal, negative subnormal, zero
    return codes, scales, oracle.int4(codes.numpy(), scales.float().numpy())


def mxfp4_weights(n: int, k: int, seed: int = 0, edges=(0, 1, 2, 126, 127)):
    """Random codes, E8M0 scales mostly near 2^0, with the edge bytes `edges` among them (254 makes 6 * 2^127
    overflow float32, as the definition says: tested in dequantization only)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = torch.randint(118, 134, (n, k // 32), dtype=torch.uint8, generator=g)
    edges = torch.tensor(edges, dtype=torch.uint8)
    flat = scales.view(-1)
    flat[: min(len(edges), flat.numel())] = edges[: flat.numel()]
    return codes, scales, oracle.mxfp4(codes.numpy(), scales.numpy())


def fp8_weights(n: int, k: int, block=(128, 128), part_rows: int | None = None, seed: int = 0):
    """Random e4m3fn codes (no NaN; subnormals and +-448 among them) and positive float32 block scales."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), dtype=torch.uint8, generator=g)
    codes[(codes & 0x7F) == 0x7F] = 0x7E  # +-448 instead of NaN
    codes.view(-1)[:4] = torch.tensor([0x01, 0x81, 0x07, 0x7E], dtype=torch.uint8)  # subnormals, 448
    part_rows = part_rows or n
    grid_rows = (n // part_rows) * -(-part_rows // block[0])
    scale_inv = torch.rand(grid_rows, -(-k // block[1]), generator=g) * 0.01 + 1e-4
    return codes, scale_inv, oracle.fp8(codes.numpy(), scale_inv.numpy(), block, part_rows)


def check_matmul(got: torch.Tensor, x: torch.Tensor, weights: np.ndarray) -> None:
    """Within float32 rounding of the exact product: each of the K products and sums rounds once."""
    w32 = weights.astype(np.float32).astype(np.float64)  # the kernel's decoded weights (exact for 4-bit)
    exact = x.double().numpy() @ w32.T
    bound = 1e-6 * (np.abs(x.double().numpy()) @ np.abs(w32).T) * max(1, weights.shape[1] / 64)
    assert (np.abs(got.double().numpy() - exact) <= bound + 1e-30).all()


def test_the_library_builds_here_in_the_chosen_variant():
    library = kernels.packed()
    assert library is not None
    assert library.deltafin_packed_variant() == ["portable", "avx2", "avx512"].index(kernels.variant())


@pytest.mark.parametrize("dtype", SCALE_DTYPES)
@pytest.mark.parametrize("group", [16, 32, 128])
def test_int4_dequantization_is_the_definition(dtype, group):
    codes, scales, weights = int4_weights(7, 256, group, dtype, seed=group)
    got = linear.dequantized_packed4(codes, scales, "int4", group)
    assert np.array_equal(got.numpy(), weights.astype(np.float32))


def test_mxfp4_dequantization_is_the_definition_edge_scales_included():
    codes, scales, weights = mxfp4_weights(5, 96, edges=(0, 1, 2, 126, 127, 254))
    got = linear.dequantized_packed4(codes, scales, "mxfp4", 32)
    assert np.array_equal(got.numpy(), weights.astype(np.float32))
    assert (got[0, :32] != 0).any() and float(got[0, :32].abs().max()) <= 6 * 2.0**-127  # scale byte 0


@pytest.mark.parametrize(
    "shape", [(7, 256, (128, 128), None), (576, 300, (128, 128), None), (128, 192, (128, 128), 64)]
)
def test_fp8_dequantization_is_the_definition(shape):
    n, k, block, part_rows = shape
    codes, scale_inv, weights = fp8_weights(n, k, block, part_rows)
    got = linear.dequantized_fp8(codes, scale_inv, block, part_rows or n)
    assert np.array_equal(got.numpy(), weights.astype(np.float32))


@pytest.mark.parametrize("n, k, rows", [(37, 608, 5), (1, 32, 1), (8, 256, 21), (33, 224, 17), (6, 64, 4)])
@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_4bit_matmul(fmt, n, k, rows):
    """Odd output counts, rows across the 4-row tiles, widths of one and many groups."""
    codes, scales, weights = int4_weights(n, k) if fmt == "int4" else mxfp4_weights(n, k)
    torch.manual_seed(rows)
    x = torch.randn(rows, k)
    check_matmul(linear.packed4_matmul(x, codes, scales, fmt, 32), x, weights)


@pytest.mark.parametrize("dtype", SCALE_DTYPES)
@pytest.mark.parametrize("group", [16, 64])
def test_int4_matmul_other_groups_and_scale_dtypes(dtype, group):
    codes, scales, weights = int4_weights(19, 256, group, dtype, seed=3)
    x = torch.randn(6, 256)
    check_matmul(linear.packed4_matmul(x, codes, scales, "int4", group), x, weights)


@pytest.mark.parametrize(
    "n, k, rows, block, part_rows",
    [
        (37, 200, 5, (128, 128), None),  # partial blocks in both directions, a width not a multiple of 16
        (576, 300, 3, (128, 128), None),  # DeepSeek-V3's kv_a_proj_with_mqa rows: 4.5 blocks
        (128, 192, 17, (128, 128), 64),  # gate and up of 64 rows each, each its own grid
        (130, 7, 4, (16, 16), None),  # a width below one block and one lane group
        (9, 1, 1, (128, 128), None),
    ],
)
def test_fp8_matmul(n, k, rows, block, part_rows):
    codes, scale_inv, weights = fp8_weights(n, k, block, part_rows, seed=n)
    x = torch.randn(rows, k)
    check_matmul(linear.fp8_matmul(x, codes, scale_inv, block, part_rows or n), x, weights)


def test_bias_strides_and_output_slices():
    codes, scales, weights = mxfp4_weights(12, 64)
    x = torch.randn(6, 128)[:, :64]  # rows of stride 128
    bias = torch.randn(12)
    out = torch.zeros(6, 40)
    linear.packed4_matmul(x, codes, scales, "mxfp4", 32, bias=bias, out=out[:, 8:20])
    alone = linear.packed4_matmul(x.contiguous(), codes, scales, "mxfp4", 32) + bias
    assert torch.equal(out[:, 8:20], alone)
    assert not out[:, :8].any() and not out[:, 20:].any()


@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "fp8"])
def test_rows_get_the_same_bits_alone_and_in_a_batch(fmt):
    x = torch.randn(19, 224)
    if fmt == "fp8":
        codes, scale_inv, _ = fp8_weights(45, 224)

        def run(rows):
            return linear.fp8_matmul(rows, codes, scale_inv, (128, 128), 45)
    else:
        codes, scales, _ = int4_weights(45, 224) if fmt == "int4" else mxfp4_weights(45, 224)

        def run(rows):
            return linear.packed4_matmul(rows, codes, scales, fmt, 32)

    together = run(x)
    for size in (1, 2, 3, 4):  # 4-bit: up to four rows are decoded in registers, a batch's rows in a buffer
        assert torch.equal(together, torch.cat([run(x[i : i + size]) for i in range(0, x.shape[0], size)]))
    torch.set_num_threads(1)
    try:
        assert torch.equal(together, run(x))  # and with another thread count
    finally:
        torch.set_num_threads(os.cpu_count() or 1)


def test_a_call_large_enough_for_every_thread_gives_the_same_bits():
    """Past the kernel's threshold (8M multiply-adds) a call runs on every thread: the same bits as one row at
    a time, on one thread."""
    codes, scales, _ = mxfp4_weights(260, 4096)
    x = torch.randn(9, 4096)
    together = linear.packed4_matmul(x, codes, scales, "mxfp4", 32)
    assert torch.equal(
        together, torch.cat([linear.packed4_matmul(x[i : i + 1], codes, scales, "mxfp4", 32) for i in range(9)])
    )


@pytest.mark.parametrize("fmt", ["int4", "mxfp4", "fp8"])
def test_a_grouped_call_gives_each_matrix_the_bits_of_its_own_call(fmt):
    """A layer's experts in one call (one slot each, rows sorted by slot, some with none): the same bits as one
    call per expert."""
    counts = [3, 0, 1, 17, 2]
    x = torch.randn(sum(counts), 192)
    if fmt == "fp8":
        weights = [fp8_weights(128, 192, (128, 128), 64, seed=i)[:2] for i in range(len(counts))]
        shared = ("fp8", 0, (128, 128), 64)
    else:
        make = int4_weights if fmt == "int4" else mxfp4_weights
        weights = [make(128, 192, seed=i)[:2] for i in range(len(counts))]
        shared = (fmt, 32, (0, 0), 0)
    out = torch.full((x.shape[0], 128), float("nan"))
    linear.grouped_matmul(x, counts, weights, *shared, out)
    start = 0
    for count, (codes, scales) in zip(counts, weights):
        rows = x[start : start + count]
        if fmt == "fp8":
            alone = linear.fp8_matmul(rows, codes, scales, (128, 128), 64)
        else:
            alone = linear.packed4_matmul(rows, codes, scales, fmt, 32)
        assert torch.equal(out[start : start + count], alone)
        start += count


def test_arguments_the_kernel_does_not_take_are_refused():
    library = kernels.packed()
    codes, scales, _ = mxfp4_weights(2, 64)
    x, out = torch.randn(1, 64), torch.empty(1, 2)

    def call(k, scale_type, group, fmt):
        return library.deltafin_packed4_matmul(
            x.data_ptr(), 1, 64, k, codes.data_ptr(), 32, scales.data_ptr(), scale_type, 2, group, fmt, 2, None,
            out.data_ptr(), 2, 1,
        )  # fmt: skip

    assert call(64, 3, 32, 2) == 0
    assert call(48, 3, 32, 2) == -1  # a width not a multiple of 32
    assert call(64, 0, 32, 2) == -1  # MXFP4 with bfloat16 scales
    assert call(64, 3, 16, 2) == -1  # MXFP4 in groups of 16
    assert call(64, 3, 32, 1) == -1  # int4 with E8M0 scales
    assert call(64, 0, 8, 1) == -1  # int4 in groups of 8
    assert call(64, 3, 32, 7) == -1  # an unknown format


# The oracle against other implementations of the formats.


def test_the_fp8_oracle_is_torchs_float8_e4m3fn():
    codes = torch.arange(256, dtype=torch.uint8)
    reference = codes.view(torch.float8_e4m3fn).double().numpy()
    ours = oracle.e4m3fn(codes.numpy())
    nan = np.isnan(reference)
    assert list(np.flatnonzero(nan)) == [0x7F, 0xFF] and np.isnan(ours[nan]).all()
    assert np.array_equal(ours[~nan], reference[~nan])


def test_the_mxfp4_oracle_is_llama_cpps_repack_read_by_gguf():
    """llama.cpp's converter repacks compressed-tensors MXFP4 into ggml's block_mxfp4 (E8M0 byte, then 16 bytes
    holding element j low and j + 16 high); the gguf package's dequantization of that equals the oracle."""
    import gguf

    codes, scales, weights = mxfp4_weights(6, 128)
    n, k = 6, 128
    values = oracle.nibbles(codes.numpy()).reshape(n, k // 32, 32)
    qs = (values[..., :16] | (values[..., 16:] << 4)).astype(np.uint8)
    blocks = np.concatenate([scales.numpy()[..., None], qs], axis=-1).reshape(n, -1)
    reference = gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType.MXFP4).astype(np.float64)
    assert np.array_equal(weights, reference)


def test_the_int4_oracle_reads_pack_quantized_words():
    """compressed-tensors' pack_to_int32: eight codes u = q + 8 a little-endian word, element i at bits 4i."""
    q = np.array([[-8, -7, -1, 0, 1, 6, 7, 3, 2, -2, -3, 5, 4, -4, -5, -6] * 2])
    words = np.zeros((1, 4), dtype=np.uint32)
    for i in range(32):
        words[0, i // 8] |= np.uint32(q[0, i] + 8) << np.uint32(4 * (i % 8))
    scales = np.array([[0.5]], dtype=np.float32)
    assert np.array_equal(oracle.int4(words.view(np.uint8), scales), q * 0.5)


def test_the_tiny_writers_round_trip_through_the_oracle():
    from deltafin.tiny.quantized import fp8, int4, mxfp4

    w = torch.randn(64, 256, generator=torch.Generator().manual_seed(7)) * 0.02
    four = int4(w)
    back = oracle.int4(four["weight_packed"].numpy().view(np.uint8), four["weight_scale"].float().numpy())
    assert np.abs(back - w.numpy()).max() <= four["weight_scale"].float().max().item() * 0.51
    mx = mxfp4(w)
    back = oracle.mxfp4(mx["weight_packed"].numpy(), mx["weight_scale"].numpy())
    # at most half the widest E2M1 step (4 to 6) of the group's scale, which is below 2 / 1.75 / 4 of its max|w|
    group_max = np.repeat(np.abs(w.numpy()).reshape(64, 8, 32).max(-1), 32, axis=1)
    assert (np.abs(back - w.numpy()) <= 0.29 * group_max).all()
    assert (mx["weight_scale"].numpy() <= 254).all()
    f8 = fp8(w[:, :200])
    back = oracle.fp8(f8["weight"].view(torch.uint8).numpy(), f8["weight_scale_inv"].numpy())
    assert np.allclose(back, w[:, :200].numpy(), rtol=2**-3, atol=1e-6)
    assert f8["weight_scale_inv"].shape == (1, 2)


VARIANT_PROBE = (
    "import hashlib, torch\n"
    "from deltafin.engine import kernels\n"
    "from deltafin.engine.quant.formats import linear\n"
    "h = hashlib.sha256()\n"
    "torch.manual_seed(0); x = torch.randn(21, 256)\n"
    "for fmt, weights in (('int4', int4_weights(37, 256, 32, torch.bfloat16)), ('int4', int4_weights(37, 256, 64, torch.float32)),\n"
    "                     ('int4', int4_weights(37, 256, 16, torch.float16)), ('mxfp4', mxfp4_weights(37, 256))):\n"
    "    codes, scales, _ = weights; group = 256 // scales.shape[1]\n"
    "    for rows in (x, x[:1], x[:2], x[:3], x[:4]):  # a batch's shared decoded rows; a decode step's registers\n"
    "        h.update(linear.packed4_matmul(rows, codes, scales, fmt, group).numpy().tobytes())\n"
    "    h.update(linear.dequantized_packed4(codes, scales, fmt, group).numpy().tobytes())\n"
    "codes, scale_inv, _ = fp8_weights(130, 203, (128, 128), 65)\n"
    "x = torch.randn(21, 203)\n"
    "h.update(linear.fp8_matmul(x, codes, scale_inv, (128, 128), 65).numpy().tobytes())\n"
    "h.update(linear.dequantized_fp8(codes, scale_inv, (128, 128), 65).numpy().tobytes())\n"
    "print(kernels.variant(), kernels.packed().deltafin_packed_variant(), h.hexdigest())\n"
)


def probe(variant: str) -> list[str]:
    source = "\n".join(inspect.getsource(f) for f in (int4_weights, mxfp4_weights, fp8_weights))
    code = "import torch\nfrom tests.engine import published_oracle as oracle\n" + source + VARIANT_PROBE
    env = {**os.environ, "DELTAFIN_KERNEL_VARIANT": variant}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1].split()


def test_every_variant_gives_the_same_bits():
    """portable C, AVX2 and AVX-512 (those this CPU runs) decode the same exact weights and sum the same
    products in the same 16 lanes: the same bits, for batches (decoded rows shared) and for one to four rows
    (decoded in registers)."""
    results = {variant: probe(variant) for variant in kernels.supported_variants()}
    assert results["portable"][:2] == ["portable", "0"]
    for variant, (name, number, _) in results.items():
        assert name == variant and int(number) == ["portable", "avx2", "avx512"].index(variant)
    assert len({digest for _, _, digest in results.values()}) == 1


def test_without_the_kernels_the_definition_serves():
    code = (
        "import torch\nfrom deltafin.engine.kernels import packed\nfrom deltafin.engine.quant.formats import linear\n"
        "assert packed() is None\n"
        "codes = torch.randint(0, 256, (3, 32), dtype=torch.uint8); scales = torch.full((3, 2), 127, dtype=torch.uint8)\n"
        "x = torch.randn(2, 64)\n"
        "w = linear.dequantized_packed4(codes, scales, 'mxfp4', 32)\n"
        "print(torch.allclose(linear.packed4_matmul(x, codes, scales, 'mxfp4', 32), x @ w.T))\n"
    )
    env = {**os.environ, "DELTAFIN_KERNELS": "0"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split()[-1] == "True"
