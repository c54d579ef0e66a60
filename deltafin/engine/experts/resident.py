"""A published quantized checkpoint's routed experts held whole, as stored (`placement.experts.pool_mb=0`).

transformers cannot hold them (its experts parameters are float), so the experts implementation the pool
registers serves them too: every expert of every layer sits in its own slot of `slots.PackedSlots`, read
once at load from the checkpoint's bytes, never evicted, and computed by the same kernels as a pooled expert
(a pooled model's tokens are therefore this one's, bit for bit). The process holds the packed bytes only:
an int4 or MXFP4 expert about a quarter of its bfloat16 size.
"""

from __future__ import annotations

import torch

from deltafin.engine.experts.checkpoint import ExpertIndex
from deltafin.engine.experts.reader import ExpertReader
from deltafin.engine.experts.routing import FEW_PAIRS, combine, run_listed_pairs, run_pairs
from deltafin.engine.experts.slots import PackedSlots
from deltafin.engine.quant.formats import UnsupportedQuantization


class ResidentExperts:
    """Every expert loaded; the experts hook's binding (`forward.attach`), as an `ExpertPool` is."""

    def __init__(self, index: ExpertIndex, device: torch.device) -> None:
        assert index.packed is not None, "float experts stay transformers' own parameters"
        self.index = index
        count = len(index.layers) * index.experts
        self.slots = PackedSlots(count, index.gate_up_shape, index.down_shape, index.packed, device)
        reader = ExpertReader(index.files)
        try:
            for layer in range(len(index.layers)):
                for expert in range(index.experts):
                    slot = layer * index.experts + expert
                    try:  # read once: every value checked, the codes too
                        self.slots.encode(index.pieces[layer][expert], reader, self.slots.record(slot))
                    except UnsupportedQuantization as exc:
                        raise exc.within(f"{index.layers[layer]} expert {expert}") from None
                    self.slots.bind(slot)
        finally:
            reader.close()

    @property
    def nbytes(self) -> int:
        return self.slots.count * self.slots.layout.packed_bytes

    def forward(
        self, layer: int, module, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """hidden: [T, H]; top_k_index, top_k_weights: [T, k] -> the routed experts' output [T, H]."""
        tokens, k = top_k_index.shape
        ids = top_k_index.reshape(-1)
        if ids.numel() <= FEW_PAIRS:  # a decode step: its few pairs grouped in Python
            pair_experts = ids.tolist()
            slot_of = {expert: layer * self.index.experts + expert for expert in set(pair_experts)}
            out = run_listed_pairs(
                self.slots, module, hidden, pair_experts, top_k_weights.reshape(-1), k, slot_of, None
            )
            return combine(out, tokens, k, hidden.dtype)
        lut = torch.arange(self.index.experts, device=ids.device) + layer * self.index.experts
        out = run_pairs(self.slots, module, hidden, ids, top_k_weights.reshape(-1), k, lut, None)
        return combine(out, tokens, k, hidden.dtype)
