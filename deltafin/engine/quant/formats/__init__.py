"""Published quantized checkpoints, served in their own form: compressed-tensors int4 (`pack-quantized`,
Kimi K2-Thinking / K2.5), compressed-tensors MXFP4 (`mxfp4-pack-quantized`, Kimi K3's routed experts) and
DeepSeek-V3's FP8 blocks (`quant_method: fp8`, Kimi K2-Instruct).

    config.read(raw_config)          the format a config.json names, or UnsupportedQuantization (one line)
    tensors.find_packed(headers, f)  which modules are stored quantized, checked against their format
    dequantize                       each format's definition (float32 weights from the packed tensors)
    linear                           the matmuls over packed tensors (C kernels) and the dense layers' modules
"""

from deltafin.engine.quant.formats.config import (
    FP8,
    INT4,
    MXFP4,
    PublishedFormat,
    UnsupportedQuantization,
    read,
    without_quantization,
)
from deltafin.engine.quant.formats.tensors import Header, PackedModule, find_packed

__all__ = [
    "FP8",
    "INT4",
    "MXFP4",
    "Header",
    "PackedModule",
    "PublishedFormat",
    "UnsupportedQuantization",
    "find_packed",
    "read",
    "without_quantization",
]
