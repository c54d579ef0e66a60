"""Weight-only quantized linear layers for the CPU (`placement.quantize`): the modules and their kernels.

int8: one scale per output channel. Decode steps (a few rows) run Deltafin's C kernel
(`deltafin/engine/kernels/int8_matvec.c`, float32 activations); measured on this 2-core AVX-512 CPU over
every matrix of the default model at one row, 7.1 ms against 15.5 ms for torch's `_weight_int8pack_mm` with
bfloat16 activations (float32 ones are 2-3x slower still). Prefill chunks (many rows, compute-bound) and
machines without a C compiler run `_weight_int8pack_mm`.

fbgemm's dynamic int8 GEMM was tried as well (as fast as the C kernel) and rejected: it quantizes the
activations to 8 bits too, which tripled the mean logprob error against float32 (0.18 against 0.055 on the
quality test's prompts), worse than int4.

int4: groups of INT4_GROUP input channels with a scale and a zero each, packed for
`_weight_int4pack_mm_for_cpu` (gpt-fast's recipe), bfloat16 activations.

GGML: a GGUF file's own blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0; Q4_K, Q5_K, Q6_K in super-blocks of 256 values,
so widths in multiples of 256), never dequantized: `GGMLLinear` and
`GGMLEmbedding` run Deltafin's C kernels (`deltafin/engine/kernels/ggml_quants.c`) at any row count, so
prefill and the decode step read the same bytes llama.cpp reads. Loaded by `deltafin.engine.weights.gguf_native`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deltafin.engine.kernels import ggml, int8_matvec

INT4_GROUP = 32
INT4_INNER_K_TILES = 2
#: activation dtype of the int8pack / int4pack kernels (2-3x faster than float32 activations on this CPU)
COMPUTE = torch.bfloat16
#: up to this many rows (a decode step's batch) run the C kernel; more rows (prefill) run int8pack
MATVEC_ROWS = 16
#: ggml_quants.c's bit on a GGUF type whose rows a kernel keeps repacked (deltafin_ggml_repack)
REPACKED = 0x10000
#: `_weight_int8pack_mm` needs the input width to be a multiple of this
INT8PACK_K = 16


@torch.library.custom_op("deltafin::int8_matvec", mutates_args=())
def int8_matvec_op(
    x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The C kernel as a torch operator, so torch.compile keeps it as one opaque call in the graph (a ctypes
    call would split the graph at every layer). Eager code calls the kernel directly: an operator call costs
    a few microseconds more, 121 times a step."""
    kernel = int8_matvec()
    assert kernel is not None, "the operator is only used where the kernel was built"
    return kernel(x, weight, scales, bias)


@int8_matvec_op.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0], dtype=torch.float32)


class Int8Linear(nn.Module):
    # buffers, declared for the type checker (nn.Module's __getattr__ types them as Tensor | Module)
    weight: torch.Tensor
    scales: torch.Tensor

    def __init__(self, weight: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight)  # [N, K] int8
        self.register_buffer("scales", scales.float())  # [N] float32
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self._scales_compute = self.scales.to(COMPUTE)  # int8pack's scale dtype
        self._matvec = int8_matvec()  # built (once per machine) at load, not at the first request

    @staticmethod
    def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """weight: [N, K] float -> int8 [N, K] and per-channel scales [N] float32 (symmetric, max-abs)."""
        w = weight.float()
        scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-8)  # [N]
        q = torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8)
        return {"weight": q, "scales": scales}

    @classmethod
    def fused(cls, parts: list[Int8Linear]) -> Int8Linear:
        """One layer computing `parts` side by side (q, k, v -> qkv): one kernel call instead of several."""
        if all(p.bias is None for p in parts):
            bias = None
        else:
            bias = torch.cat([p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts])
        return cls(torch.cat([p.weight for p in parts]), torch.cat([p.scales for p in parts]), bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features)
        # int8pack reads K in steps of 16 (K = 100 or 200 crashed it): other widths never reach it.
        packable = self.in_features % INT8PACK_K == 0
        if self._matvec is not None and (rows.shape[0] <= MATVEC_ROWS or not packable):
            bias = None if self.bias is None else self.bias.float()
            run = int8_matvec_op if torch.compiler.is_compiling() else self._matvec
            out = run(rows.float(), self.weight, self.scales, bias).to(x.dtype)
        elif packable:
            out = torch.ops.aten._weight_int8pack_mm(rows.to(COMPUTE), self.weight, self._scales_compute).to(x.dtype)
            if self.bias is not None:
                out = out + self.bias
        else:  # no compiler and an odd width: dequantize on the fly (slow, correct)
            out = F.linear(rows.float(), self.weight.float() * self.scales[:, None], self.bias).to(x.dtype)
        return out.reshape(*shape[:-1], self.out_features)


class Int4Linear(nn.Module):
    weight: torch.Tensor
    scales_zeros: torch.Tensor

    def __init__(
        self,
        packed: torch.Tensor,
        scales_zeros: torch.Tensor,
        bias: torch.Tensor | None,
        in_features: int,
        out_features: int,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("weight", packed)  # packed int4, layout owned by the kernel
        self.register_buffer("scales_zeros", scales_zeros)  # [K / group, N, 2]
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @staticmethod
    def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
        """weight: [N, K] -> 4-bit codes [N, K] (int32, 0..15) and (scale, zero) per group of INT4_GROUP."""
        w = weight.float()
        groups = w.reshape(-1, INT4_GROUP)  # [N * K / g, g]
        lo, hi = groups.amin(dim=1, keepdim=True), groups.amax(dim=1, keepdim=True)
        scales = (hi - lo).clamp(min=1e-6) / 15
        zeros = lo + scales * 8  # the kernel computes (q - 8) * scale + zero
        codes = groups.sub(lo).div(scales).round().clamp(0, 15).to(torch.int32).reshape_as(w)
        n = w.shape[0]
        scales_zeros = torch.cat([scales.reshape(n, -1, 1), zeros.reshape(n, -1, 1)], dim=2).transpose(0, 1)
        return {"codes": codes, "scales_zeros": scales_zeros.to(COMPUTE).contiguous()}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.reshape(-1, self.in_features).to(COMPUTE), self.weight, INT4_GROUP, self.scales_zeros
        ).to(x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)


class GGMLLinear(nn.Module):
    """A linear layer over a GGUF tensor's blocks: `blocks` uint8 [N, row bytes] (one weight row per line, in
    a 64-byte-aligned torch buffer), ggml type id `ggml_type`, float32 activations in and out.

    Where the kernel variant repacks the type (AVX-512: Q4_0, Q4_1, Q8_0; ggml_quants.c, row_times_repacked_body)
    the rows are kept repacked, a copy of the blocks given with each group of 16 blocks' words interleaved, and
    `ggml_type` carries the kernels' REPACKED bit: the same bits from every kernel, fewer instructions a row."""

    blocks: torch.Tensor

    def __init__(
        self, blocks: torch.Tensor, ggml_type: int, in_features: int, bias: torch.Tensor | None = None
    ) -> None:
        super().__init__()
        library = ggml()
        assert library is not None and library.deltafin_ggml_supported(ggml_type), "loader checks this first"
        self.ggml_type, self.in_features, self.out_features = ggml_type, in_features, blocks.shape[0]
        blocks = blocks.contiguous()
        if library.deltafin_ggml_supported(ggml_type | REPACKED):
            repacked = torch.empty_like(blocks)  # never in place: the caller's blocks stay as given
            kind = library.deltafin_ggml_repack(
                blocks.data_ptr(), ggml_type, self.out_features, in_features, blocks.shape[1], repacked.data_ptr()
            )
            if kind:
                self.ggml_type, blocks = kind, repacked
        self.register_buffer("blocks", blocks)
        self.bias = None if bias is None else nn.Parameter(bias.float(), requires_grad=False)
        self._matmul = library.deltafin_ggml_matmul

    @property
    def row_bytes(self) -> int:
        return int(self.blocks.shape[1])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        rows = x.reshape(-1, self.in_features).float().contiguous()
        out = torch.empty(rows.shape[0], self.out_features, dtype=torch.float32)
        bias = None if self.bias is None else self.bias.data_ptr()
        failed = self._matmul(
            rows.data_ptr(),
            rows.shape[0],
            self.blocks.data_ptr(),
            self.ggml_type,
            self.out_features,
            self.in_features,
            self.row_bytes,
            bias,
            out.data_ptr(),
            torch.get_num_threads(),
        )
        if failed:
            raise MemoryError("the GGML matmul could not allocate its activation buffer")
        return out.reshape(*shape[:-1], self.out_features).to(x.dtype)

    def dequantized(self, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight rows `rows` (all when None): for embedding lookups and tests, never kept."""
        ids = torch.arange(self.out_features) if rows is None else rows.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(ids.shape[0], self.in_features, dtype=torch.float32)
        library = ggml()
        assert library is not None  # a GGMLLinear exists only where the library loaded
        library.deltafin_ggml_dequantize(
            self.blocks.data_ptr(),
            self.ggml_type,
            self.in_features,
            self.row_bytes,
            ids.data_ptr(),
            ids.shape[0],
            out.data_ptr(),
        )
        return out


class GGMLEmbedding(nn.Module):
    """Token embeddings read from a GGUF tensor's blocks: each looked-up row is dequantized on the fly.
    Shares its blocks with the LM head of a model with tied embeddings."""

    def __init__(self, table: GGMLLinear) -> None:
        super().__init__()
        self.table = table
        self.num_embeddings, self.embedding_dim = table.out_features, table.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.table.dequantized(ids).reshape(*ids.shape, self.embedding_dim)
