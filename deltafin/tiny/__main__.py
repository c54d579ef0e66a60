"""`python -m deltafin.tiny --family F [--variant V] --out DIR`: write a tiny random-weight model of family F."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from deltafin.families import FAMILIES
from deltafin.tiny.multimodal import write_k3_checkpoint
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
        "--multimodal",
        action="store_true",
        help="kimi_k3 only: the real checkpoint's layout (vision tower + language_model.*)",
    )
    args = parser.parse_args()
    if args.multimodal and args.family != "kimi_k3":
        parser.error("--multimodal is the layout of Kimi K3 checkpoints: --family kimi_k3 only")
    if args.multimodal:
        with tempfile.TemporaryDirectory() as scratch:
            tiny = write_tiny_model(args.family, Path(scratch), seed=args.seed, context=args.context)
            out = write_k3_checkpoint(tiny, args.out)
    else:
        out = write_tiny_model(args.family, args.out, variant=args.variant, seed=args.seed, context=args.context)
    print(f"wrote a tiny {args.family} model to {out}")


if __name__ == "__main__":
    main()
