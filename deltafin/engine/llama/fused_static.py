"""The fused Llama decode step with static shapes, for `placement.compile`: one graph per (row bucket,
capacity bucket), the shapes CUDA graphs need and torch.compile(dynamic=False) specializes on.

Per step the batch's B rows are padded to a row bucket R (1, 2, 4, 8, ...) and its cache width L + 1 to a
capacity bucket C (a multiple of `CAPACITY_BUCKET`). Keys and values live in per-layer buffers
[R, Hk, C, D]; the new position is written with `index_copy_` at a tensor index (data, not a constant of the
graph), and attention runs over all C columns with a mask hiding left padding and unused capacity. Dummy rows
(B..R) attend every column of their own zero-initialized, finite buffer rows, so they cannot produce NaN;
their logits are sliced off.

`BatchKV` keeps seeing what it always saw: each layer's tensors are views of the buffers, rows [:B] and
columns [:L + 1], so `row_cache` and the prefix cache work unchanged. Writes only go to the column after the
current width, past every view handed out. When `BatchKV` replaced the tensors (rows joined or left) or the
width outgrows the capacity, the cache is copied into fresh buffers, never into the old ones, which views
handed to the prefix cache may still point into. The eager fused step (`FusedLlamaStep`) stays the default:
it pays no padding.
"""

from __future__ import annotations

import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from deltafin.engine.llama.fused import FusedLlamaStep

#: cache capacity is padded to a multiple of this many positions
CAPACITY_BUCKET = 256


def row_bucket(rows: int) -> int:
    """The power of two at or above `rows`."""
    return 1 << (rows - 1).bit_length()


def capacity_bucket(width: int, bucket: int = CAPACITY_BUCKET) -> int:
    return -(-width // bucket) * bucket


def _static_body(
    step: FusedLlamaStep,
    tokens: torch.Tensor,
    mask: torch.Tensor,
    positions: torch.Tensor,
    index: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
) -> torch.Tensor:
    """tokens [R, 1], mask [R, C], positions [R, 1], index [1] (the column to write), per-layer buffers
    [R, Hk, C, D] -> logits [R, V]."""

    def write(i: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return keys[i].index_copy_(2, index, k), values[i].index_copy_(2, index, v)

    return step.forward(tokens, mask, positions, write)


def _compiled_body(shape: tuple[int, int], backend: str) -> Callable[..., torch.Tensor]:
    """`_static_body` compiled for one bucket pair. dynamo keeps its graphs per code object, so each bucket
    gets its own copy of the code: one graph each, no guard checks across buckets, and no recompile limit
    (8 per code object) to raise however many buckets a long context reaches."""
    code = _static_body.__code__.replace(co_name=f"static_step_{shape[0]}x{shape[1]}")
    body = types.FunctionType(code, _static_body.__globals__, code.co_name)
    return torch.compile(body, backend=backend, dynamic=False, fullgraph=True)


class StaticFusedStep:
    """Callable like `generator.decode_step`: (model, tokens [B, 1], mask [B, L+1], positions [B, 1], cache)."""

    def __init__(self, fused: FusedLlamaStep, *, backend: str = "inductor", bucket: int = CAPACITY_BUCKET) -> None:
        self.fused = fused
        self.backend = backend
        self.bucket = bucket
        #: one compiled function per (row bucket, capacity bucket) seen
        self.graphs: dict[tuple[int, int], Callable[..., torch.Tensor]] = {}
        self._buffers: list[tuple[torch.Tensor, torch.Tensor]] = []
        #: the per-layer views last given to the cache: still there means the buffers still hold the cache
        self._views: list[tuple[torch.Tensor, torch.Tensor]] = []

    def __call__(
        self,
        model: Any,
        tokens: torch.Tensor,
        attention_mask: torch.Tensor,
        positions: torch.Tensor,
        cache: Any,
        *,
        cache_arg: str = "cache",
    ) -> torch.Tensor:
        rows, width = attention_mask.shape  # width = L + 1
        shape = (row_bucket(rows), capacity_bucket(width, self.bucket))
        self._ensure_buffers(cache.layers, shape)
        graph = self.graphs.get(shape)
        if graph is None:
            graph = self.graphs[shape] = _compiled_body(shape, self.backend)
        pad = shape[0] - rows
        mask = attention_mask.new_zeros(shape)
        mask[:rows, :width] = attention_mask
        mask[rows:] = 1  # dummy rows attend everything (finite zeros): no row of -inf, so no NaN
        index = torch.tensor([width - 1], device=tokens.device)
        logits = graph(
            self.fused,
            F.pad(tokens, (0, 0, 0, pad)),
            mask,
            F.pad(positions, (0, 0, 0, pad)),
            index,
            [k for k, _ in self._buffers],
            [v for _, v in self._buffers],
        )  # [R, V]
        self._views = [(k[:rows, :, :width], v[:rows, :, :width]) for k, v in self._buffers]
        for layer, (k, v) in zip(cache.layers, self._views):
            layer.keys, layer.values = k, v
        return logits[:rows]

    def _ensure_buffers(self, layers: list[Any], shape: tuple[int, int]) -> None:
        """Buffers of `shape` holding the cache: the current ones when the cache still holds their views and
        the shape is the same, else fresh zeros with the cache copied in."""
        current = len(self._views) == len(layers) and all(
            layer.keys is k and layer.values is v for layer, (k, v) in zip(layers, self._views)
        )
        if current and self._buffers[0][0].shape[0] == shape[0] and self._buffers[0][0].shape[2] == shape[1]:
            return
        self._buffers = [(self._fresh(layer.keys, shape), self._fresh(layer.values, shape)) for layer in layers]

    @staticmethod
    def _fresh(t: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
        """t [B, Hk, L, D] copied into zeros [R, Hk, C, D]: zeros, so masked columns stay finite."""
        buffer = t.new_zeros(shape[0], t.shape[1], shape[1], t.shape[3])
        buffer[: t.shape[0], :, : t.shape[2]] = t
        return buffer
