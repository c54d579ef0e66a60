"""Kimi K3's own model code as a test oracle (never vendored: it is under the Kimi K3 licence).

The PyPI wheel `llmcompressor==0.14.0.1` carries a copy of the checkpoint's remote code in
`llmcompressor/modeling/kimi_k3/` (`modeling_kimi_linear.py`: the language model, `configuration_kimi_k3.py`).
The wheel is downloaded once with pip (`pip download --no-deps`), checked against its sha256 and cached
under ~/.cache/deltafin/oracles; the modules are read from it in the test. The language model's kernels come
from flash-linear-attention (GPU only), so the few names it imports from `fla` are stood in for by modules of
the same parameters: enough to build the model and read its parameter names and shapes, not to run it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import subprocess
import sys
import tempfile
import types
import zipfile
from functools import cache
from pathlib import Path
from typing import Any

WHEEL = "llmcompressor-0.14.0.1-py3-none-any.whl"
SHA256 = "fedc804a45bf3e353b84b8181147474c324ffba3356c9ecebceae29dfc3c5f00"
PACKAGE = "llmcompressor/modeling/kimi_k3/"


def wheel() -> Path:
    folder = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deltafin" / "oracles"
    path = folder / WHEEL
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=folder) as work:
            subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "download",
                    "--quiet",
                    "--no-deps",
                    "-d",
                    work,
                    "llmcompressor==0.14.0.1",
                ],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            os.replace(Path(work) / WHEEL, path)  # one step: a concurrent session never reads half a wheel
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SHA256:
        raise RuntimeError(f"{path}: sha256 {digest}, expected {SHA256}")
    return path


@cache
def _modules() -> types.ModuleType:
    """The reference package `k3ref` (configuration_kimi_k3, modeling_kimi_linear) imported from the wheel."""
    import torch
    from torch import nn

    class ShortConvolution(nn.Conv1d):  # fla.modules.ShortConvolution: a depthwise Conv1d
        def __init__(self, hidden_size: int, kernel_size: int, bias: bool = False, activation: Any = None, **_: Any):
            super().__init__(
                hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=bias, padding=kernel_size - 1
            )

    class FusedRMSNormGated(nn.Module):  # fla.modules.FusedRMSNormGated: one weight of the head size
        def __init__(self, hidden_size: int, eps: float = 1e-5, activation: Any = None, **_: Any):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(hidden_size))

    stand_ins = {
        "fla.modules": {"ShortConvolution": ShortConvolution, "FusedRMSNormGated": FusedRMSNormGated},
        "fla.ops.kda": {"chunk_kda": None, "fused_recurrent_kda": None},
        "fla.ops.utils.index": {"prepare_cu_seqlens_from_mask": None, "prepare_lens_from_mask": None},
        "fla.utils": {"tensor_cache": lambda f: f},
        "einops": {"rearrange": None},
        "llmcompressor.modeling.moe.context": {"get_calibrate_all_experts_flag": lambda: False},
    }
    saved = {name: sys.modules.get(name) for name in _parents(stand_ins)}
    for name in _parents(stand_ins):
        sys.modules[name] = types.ModuleType(name)
    for name, attributes in stand_ins.items():
        sys.modules[name].__dict__.update(attributes)
    source = Path(tempfile.mkdtemp(prefix="k3ref-"))
    with zipfile.ZipFile(wheel()) as archive:
        for member in ("configuration_kimi_k3.py", "modeling_kimi_linear.py"):
            (source / member).write_bytes(archive.read(PACKAGE + member))
    package = types.ModuleType("k3ref")
    package.__path__ = [str(source)]
    sys.modules["k3ref"] = package
    try:
        for member in ("configuration_kimi_k3", "modeling_kimi_linear"):
            spec = importlib.util.spec_from_file_location(f"k3ref.{member}", source / f"{member}.py")
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            setattr(package, member, module)
    finally:  # the stand-ins served the imports only
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    return package


def _parents(names: dict[str, Any]) -> list[str]:
    out: list[str] = []
    for name in names:
        parts = name.split(".")
        out += [".".join(parts[: i + 1]) for i in range(len(parts)) if ".".join(parts[: i + 1]) not in out]
    return out


def reference_kimi_linear(text_config: dict[str, Any]) -> Any:
    """The reference `KimiLinearForCausalLM` (K3's language model class) built on `text_config`, random
    weights: for its parameter names and shapes."""
    package = _modules()
    config = package.configuration_kimi_k3.KimiLinearConfig(**text_config)
    config._attn_implementation = "eager"
    return package.modeling_kimi_linear.KimiLinearForCausalLM(config)
