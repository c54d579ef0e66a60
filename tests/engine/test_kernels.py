"""The C int8 kernel: built and loaded on this machine, exact against a float reference of the same int8
weights, the same bits for a row alone or in a batch, and Int8Linear's fallback where it is off."""

from __future__ import annotations

import subprocess
import sys

import torch

from deltafin.engine.kernels import int8_matvec
from deltafin.engine.qlinear import MATVEC_ROWS, Int8Linear


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
