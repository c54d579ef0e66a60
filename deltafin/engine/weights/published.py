"""Loading a published quantized checkpoint (its config.json carries a `quantization_config`) in its own form.

The format comes from the config (`deltafin.engine.quant.formats.config`; anything not served refuses with one
line naming the field), which modules are quantized from the tensors. transformers never sees the quantization
config: its quantizers would need the compressed-tensors package (int4, MXFP4) or dequantize FP8 blocks of
partial size wrongly on CPU. Instead the model is built from the float tensors (`experts.model.load_dense`),
each quantized dense Linear becomes a module over its stored tensors, and the routed experts stay packed: in
an expert pool (`placement.experts.pool_mb` > 0) or all resident, behind the same experts hook.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from deltafin.engine.models import ModelSource
from deltafin.engine.quant import formats
from deltafin.engine.weights.paths import ModelLoadError


def published_format(raw: dict[str, Any]) -> formats.PublishedFormat | None:
    """The format a config.json names (None: not quantized); ModelLoadError naming the field it refuses."""
    try:
        return formats.read(raw)
    except formats.UnsupportedQuantization as exc:
        raise ModelLoadError(f"model.path: config.json {exc}") from None


def refusal(published: formats.PublishedFormat, placement: Any) -> str | None:
    """Why `placement` cannot serve this checkpoint in its own form, or None."""
    if placement.quantize != "none":
        return (
            f"placement.quantize: {placement.quantize} requantizes float weights; this checkpoint is published as "
            f"{published.title}, served as it is (set placement.quantize=none)"
        )
    if placement.device != "cpu" or placement.device_map:
        return (
            f"placement.device: {published.title} weights are served by CPU kernels; "
            "set placement.device=cpu and no placement.device_map"
        )
    return None


def load(
    folder: Path,
    published: formats.PublishedFormat,
    source: ModelSource | None,
    placement: Any,
    *,
    dtype: Any,
    trust_remote_code: bool,
    max_batch: int,
    cache_dir: Path,
) -> tuple[Any, Any]:
    """(the model, its expert pool or None). `source`: how the model is built (`architecture.model_source`: an
    own class such as K3's, a multimodal checkpoint's language model; None: transformers' Auto classes)."""
    from deltafin.engine import experts as expert_pool

    problem = refusal(published, placement)
    if problem:
        raise ModelLoadError(problem)
    view = expert_pool.CheckpointView(source=source, published=published)
    try:
        if placement.experts.pool_mb:
            return expert_pool.load_pooled_model(
                folder,
                placement,
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                max_batch=max_batch,
                cache_dir=cache_dir,
                view=view,
            )
        model = expert_pool.load_packed_model(
            folder, placement, dtype=dtype, trust_remote_code=trust_remote_code, view=view
        )
        return model, None
    except (formats.UnsupportedQuantization, expert_pool.CheckpointLayoutError) as exc:
        raise ModelLoadError(f"model.path: {exc}") from None
