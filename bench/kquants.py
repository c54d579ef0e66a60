"""A K-quant file of the default model, served natively, against float32.

    .venv/bin/python bench/kquants.py [--format Q4_K|Q5_K|Q6_K] [--rest Q8_0|keep] [--tokens 8] [--out /tmp/gguf-formats]

The default GGUF (SmolLM2-135M, Q4_1 with a Q8_0 embedding) is re-quantized (`deltafin.testing.kquant_files.requantize_k`): every matrix
whose input width is a multiple of 256 (here only ffn_down: 1536 wide; hidden 576 is not) goes to the K-quant
`--format`, the rest to `--rest` (Q8_0 by default, as K-quant files keep such matrices in another type;
`keep`: their original blocks, unchanged). It then checks that the file loads natively (no dequantizing
fallback: `gguf_native.unsupported` is None and ffn_down is a GGMLLinear of the K type) and prints mean
|delta logprob| / top-1 / greedy agreement against the float32 reference, as bench/gguf_quality.py does.

The quantizers are deltafin/testing/kquant_files.py's simple ones, NOT llama.cpp's optimized ones.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deltafin.testing.kquant_files import requantize_k  # noqa: E402


def main() -> None:
    import torch

    from bench.gguf_quality import native_figures, reference
    from deltafin.engine.weights import gguf_native
    from deltafin.engine.weights.loader import load_model, resolve_model_path
    from deltafin.testing import compose_config

    parser = argparse.ArgumentParser()
    parser.add_argument("--format", default="Q4_K", choices=["Q4_K", "Q5_K", "Q6_K"])
    parser.add_argument("--rest", default="Q8_0", help="type of the other matrices, or keep")
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("/tmp/gguf-formats"))
    args = parser.parse_args()
    source = resolve_model_path(compose_config().model.path)
    args.out.mkdir(parents=True, exist_ok=True)
    target = requantize_k(source, args.out / f"{source.stem}-{args.format}-{args.rest}.gguf", args.format, args.rest)
    reason = gguf_native.unsupported(target)
    print("unsupported:", reason)
    float_config = compose_config(["model.gguf_weights=dequantize"])
    refs = reference(load_model(float_config.model, float_config.placement), args.tokens)
    config = compose_config([f"model.path={target}"])
    loaded = load_model(config.model, config.placement)
    down = loaded.model.model.layers[0].mlp.down_proj
    print("ffn_down:", type(down).__name__, getattr(down, "ggml_type", None), "torch threads", torch.get_num_threads())
    print(args.format, f"rest {args.rest}", native_figures(loaded, refs, args.tokens))


if __name__ == "__main__":
    main()
