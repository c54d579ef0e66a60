"""Tiny random-weight models of each family (real architecture class, family tokens and chat format).

    python -m deltafin.tiny --family kimi_k3 --out /tmp/tiny-k3
    python -m deltafin model=kimi_k3 model.path=/tmp/tiny-k3

The recipe of each lives in the family's module (deltafin/families/).
"""

from deltafin.tiny.writer import write_tiny_model

__all__ = ["write_tiny_model"]
