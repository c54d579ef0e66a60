"""`python -m deltafin.tiny --family F [--variant V] --out DIR [--quant int4|mxfp4|fp8]`: write a tiny
random-weight model of family F, optionally in a published quantized format (`deltafin.tiny.quantized`: Kimi
K2-Thinking's int4 or K3's MXFP4 routed experts, K2-Instruct's FP8 Linears)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from deltafin.families import FAMILIES
from deltafin.tiny.quantized import FORMATS, quantize_folder
from deltafin.tiny.writer import write_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m deltafin.tiny", description=__doc__)
    families = sorted(name for name, spec in FAMILIES.items() if spec.tiny_recipe(spec.variant(None)) is not None)
    parser.add_argument("--family", required=True, choices=families)
    parser.add_argument("--variant", default=None, help="model.variant of the family (e.g. glm47); default: its first")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context", type=int, default=None, help="max_position_embeddings (default: 4096)")
    parser.add_argument(
        "--quant",
        choices=FORMATS,
        default=None,
        help="store it as published: int4 / mxfp4 routed experts (K2-Thinking, K3), fp8 Linears (K2-Instruct)",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as work:
        target = Path(work) / "float" if args.quant else args.out
        out = write_tiny_model(args.family, target, variant=args.variant, seed=args.seed, context=args.context)
        if args.quant:
            out = quantize_folder(out, args.out, args.quant, "linear" if args.quant == "fp8" else "experts")
    print(f"wrote a tiny {args.family} model to {out}" + (f" ({args.quant})" if args.quant else ""))


if __name__ == "__main__":
    main()
