"""Tiny random-weight models of each family (real architecture class, family tokens and chat format).

    python -m deltafin.tiny --family kimi_k3 --out /tmp/tiny-k3
    python -m deltafin model=kimi_k3 model.path=/tmp/tiny-k3
"""

from deltafin.tiny.families import FAMILIES, write_tiny_model

__all__ = ["FAMILIES", "write_tiny_model"]
