"""`python -m deltafin.tiny --family F --out DIR`: write a tiny random-weight model of family F."""

from __future__ import annotations

import argparse
from pathlib import Path

from deltafin.tiny.families import FAMILIES, write_tiny_model


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m deltafin.tiny", description=__doc__)
    parser.add_argument("--family", required=True, choices=sorted(FAMILIES))
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    out = write_tiny_model(args.family, args.out, seed=args.seed)
    print(f"wrote a tiny {args.family} model to {out}")


if __name__ == "__main__":
    main()
