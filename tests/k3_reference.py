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
    """The reference package `k3ref` (configuration_kimi_k3, modeling_kimi_linear) imported from the wheel, its
    `fla` / `einops` imports served by the computing stand-ins of tests/k3_standins.py."""
    from transformers.activations import ACT2FN
    from transformers.pytorch_utils import ALL_LAYERNORM_LAYERS

    from tests.k3_standins import MODULES

    saved = {name: sys.modules.get(name) for name in _parents(MODULES)}
    layernorms = list(ALL_LAYERNORM_LAYERS)
    for name in _parents(MODULES):
        sys.modules[name] = types.ModuleType(name)
    for name, attributes in MODULES.items():
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
    finally:
        # The stand-ins served the imports only: left in sys.modules, transformers' own Kimi Linear would find a
        # "fla" and call them with its argument convention. The reference also registers globally what it binds
        # by name anyway (ACT2FN["situ"], its RMSNorm among the layer norms): undone, so no other model sees them.
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
        ACT2FN.pop("situ", None)
        ALL_LAYERNORM_LAYERS[:] = layernorms
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


def reference_model(text_config: dict[str, Any], state_dict: dict[str, Any], dtype: Any = None) -> Any:
    """The reference `KimiLinearForCausalLM` on `text_config` with the weights `state_dict` (names without the
    `language_model.` prefix; every parameter must be there: the reference's initialisation is a no-op and would
    leave uninitialised memory), in eval mode."""
    import torch

    package = _modules()
    config = package.configuration_kimi_k3.KimiLinearConfig(**text_config)
    config._attn_implementation = "eager"
    with torch.device("meta"):
        model = package.modeling_kimi_linear.KimiLinearForCausalLM(config)
    model.load_state_dict(state_dict, strict=True, assign=True)
    if dtype is not None:
        model.to(dtype)
    return model.eval()


def checkpoint_state(folder: Any) -> dict[str, Any]:
    """The language model's weights of a K3-layout folder, under the reference's names (prefix stripped)."""
    from safetensors.torch import load_file

    prefix = "language_model."
    state: dict[str, Any] = {}
    for file in sorted(Path(folder).glob("*.safetensors")):
        for name, tensor in load_file(str(file)).items():
            if name.startswith(prefix):
                state[name.removeprefix(prefix)] = tensor
    return state


def reference_greedy(model: Any, ids: list[int], n: int) -> list[int]:
    """The reference model's greedy continuation of `ids`, `n` tokens, through its own cache (its `generate` does
    not run its cache under transformers 5: it is fed one token without its past)."""
    import torch

    with torch.inference_mode():
        out = model(input_ids=torch.tensor([list(ids)]), use_cache=True)
        cache, tokens = out.past_key_values, []
        for _ in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
    return tokens
