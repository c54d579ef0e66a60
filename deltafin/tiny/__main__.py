"""`python -m deltafin.tiny --family F [--variant V] --out DIR`: write a tiny random-weight model of family F."""

from __future__ import annotations

import argparse
from pathlib import Path

from deltafin.families import FAMILIES
from deltafin.tiny.writer import write_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m deltafin.tiny", description=__doc__)
    families = sorted(name for name, spec in FAMILIES.items() if spec.tiny_recipe(spec.variant(None)) is not None)
    parser.add_argument("--family", required=True, choices=families)
    parser.add_argument("--variant", default=None, help="model.variant of the family (e.g. glm47); default: its first")
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--context", type=int, default=None, help="max_position_embeddings (default: 4096)")
    args = parser.parse_args()
    out = write_tiny_model(args.family, args.out, variant=args.variant, seed=args.seed, context=args.context)
    print(f"wrote a tiny {args.family} model to {out}")


if __name__ == "__main__":
    main()
