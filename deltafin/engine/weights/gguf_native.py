"""Loads a Llama-architecture GGUF file with its weights kept in the file's own quantization (the default for
GGUF models, `model.gguf_weights: native`).

The quantized blocks are copied from the memory-mapped file (deltafin/engine/weights/gguf_tensors.py) into 64-byte-aligned
torch buffers, one weight row per line, and served by `GGMLLinear` / `GGMLEmbedding` (deltafin/engine/quant/linear.py):
no float copy of a weight matrix is ever made. The model skeleton is transformers' own class built on the meta
device, so prefill, the KV cache and everything else that runs the module tree work unchanged; the decode step
runs all layers in C (deltafin/engine/llama/native.py).

Config, tokenizer and generation config come from transformers' GGUF readers and are kept in a small cached
folder without weights (`gguf-native-v{SKELETON_FORMAT}/<file key>` in the cache folder): the first boot takes
seconds, not the half minute of a full dequantizing conversion.

GGUF stores q and k projections with their rows permuted for llama.cpp's rotary layout; rows are whole
blocks, so they are put back in transformers' order (as transformers' own GGUF loader does) without touching
a block.
"""

from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import structlog
import torch
from torch import nn

from deltafin.engine.weights.gguf_tensors import DamagedGGUF, GGUFTensors, read_tensors

log = structlog.get_logger("deltafin.engine")

#: bumped when the cached skeleton folder changes meaning
SKELETON_FORMAT = 2
ARCHITECTURES = ("llama",)
#: ggml type ids served natively (ggml_quants.c); float ones (F32 / F16 / BF16) are for norms. The K-quants
#: (12-14) come in super-blocks of 256 values: a matrix in one of them needs an input width in multiples of 256
#: (llama.cpp stores other widths in another type, as Q4_K_M files do).
NATIVE_TYPES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
_PROJECTIONS = {
    "attn_q": ("self_attn", "q_proj"),
    "attn_k": ("self_attn", "k_proj"),
    "attn_v": ("self_attn", "v_proj"),
    "attn_output": ("self_attn", "o_proj"),
    "ffn_gate": ("mlp", "gate_proj"),
    "ffn_up": ("mlp", "up_proj"),
    "ffn_down": ("mlp", "down_proj"),
}


@functools.lru_cache(maxsize=2)  # `unsupported` then `load_native` read the same file once
def _reader(gguf: Path) -> GGUFTensors:
    return read_tensors(gguf)


def unsupported(gguf: Path) -> str | None:
    """Why `gguf` cannot be served natively here (the loader then dequantizes it), or None."""
    from deltafin.engine.kernels import ggml

    library = ggml()
    if library is None:
        return "the C kernels are unavailable (no compiler, or DELTAFIN_KERNELS=0)"
    reader = _reader(gguf)
    architecture = reader.architecture
    if architecture not in ARCHITECTURES:
        return f"architecture {architecture!r} has no native decode step"
    for tensor in reader.tensors:
        if _role(tensor.name) in (*_PROJECTIONS, "token_embd", "output"):
            kind = int(tensor.tensor_type)
            if kind not in NATIVE_TYPES:
                return (
                    f"tensor {tensor.name} is {tensor.tensor_type.name}, not one of {', '.join(NATIVE_TYPES.values())}"
                )
            values = int(library.deltafin_ggml_block_values(kind))
            if int(tensor.shape[0]) % values:
                return (
                    f"tensor {tensor.name} is {tensor.tensor_type.name} with rows of {int(tensor.shape[0])} values, "
                    f"not a multiple of its {values}-value blocks"
                )
    return None


def _role(name: str) -> str:
    """`attn_q` of `blk.0.attn_q.weight`, `token_embd` of `token_embd.weight` ("" for a name of another form)."""
    parts = name.split(".")
    return parts[-2] if len(parts) >= 2 else ""


def expected_shapes(config: Any) -> dict[str, tuple[int, ...]]:
    """Every tensor a Llama GGUF holds for `config` (its own metadata), in GGUF's order (row width first)."""
    hidden, layers = config.hidden_size, config.num_hidden_layers
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv, ffn = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim, config.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "token_embd.weight": (hidden, config.vocab_size),
        "output_norm.weight": (hidden,),
    }
    per_layer = {
        "attn_q": (hidden, q),
        "attn_k": (hidden, kv),
        "attn_v": (hidden, kv),
        "attn_output": (q, hidden),
        "ffn_gate": (hidden, ffn),
        "ffn_up": (hidden, ffn),
        "ffn_down": (ffn, hidden),
        "attn_norm": (hidden,),
        "ffn_norm": (hidden,),
    }
    for i in range(layers):
        shapes.update({f"blk.{i}.{short}.weight": shape for short, shape in per_layer.items()})
    return shapes


def check_tensors(gguf: Path, tensors: dict[str, Any], config: Any) -> None:
    """DamagedGGUF naming the first tensor the file's own metadata calls for that is missing or of another
    shape (a renamed or resized tensor would otherwise be a KeyError or a reshape error deep in the load)."""
    expected = expected_shapes(config)
    if "output.weight" in tensors:  # untied output head
        expected["output.weight"] = expected["token_embd.weight"]
    for name, shape in expected.items():
        tensor = tensors.get(name)
        if tensor is None:
            raise DamagedGGUF(
                f"{gguf}: a damaged GGUF file: it has no tensor {name!r}, which its metadata (a Llama of "
                f"{config.num_hidden_layers} layers) calls for"
            )
        found = tuple(int(d) for d in tensor.shape)
        if found != shape:
            raise DamagedGGUF(
                f"{gguf}: a damaged GGUF file: tensor {name!r} is {'x'.join(map(str, found))}, its metadata makes "
                f"it {'x'.join(map(str, shape))}"
            )


def skeleton_folder(gguf: Path, cache_dir: Path, key: str) -> Path:
    """config.json, generation config and tokenizer of `gguf` (no weights), made on first use."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    target = cache_dir / f"gguf-native-v{SKELETON_FORMAT}" / key
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".skeleton-", dir=target.parent))
    try:
        config = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
        data = config.to_dict()
        data.pop("quantization_config", None)
        # Named as a hub checkpoint names it, so the folder reads as a standard config (its weights are the GGUF's).
        data["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
        (staging / "config.json").write_text(json.dumps(data, indent=2))
        GenerationConfig.from_model_config(config).save_pretrained(staging)
        AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is as good as ours
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _blocks(tensor: Any) -> torch.Tensor:
    """The tensor's rows of blocks, uint8 [N, row bytes], copied into a torch (64-byte-aligned) buffer."""
    data = np.asarray(tensor.data)
    out = torch.empty(data.shape, dtype=torch.uint8)
    out.numpy()[...] = data
    return out


def _floats(tensor: Any) -> torch.Tensor:
    from gguf import quants

    return torch.from_numpy(np.array(quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))


def _unpermute(blocks: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's rotary row order -> transformers' (whole rows move; transformers' `_reverse_permute_weights`)."""
    rows = blocks.shape[0]
    dim = rows // heads // 2
    return blocks.reshape(heads, dim, 2, -1).transpose(1, 2).reshape(rows, -1).contiguous()


def load_native(gguf: Path, folder: Path) -> Any:
    """transformers' model class for `folder`'s config, with every weight taken from `gguf` in its own form."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from deltafin.engine.llama.native import install_native_forward, native_llama_step
    from deltafin.engine.quant.linear import GGMLEmbedding, GGMLLinear

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tensors = {t.name: t for t in _reader(gguf).tensors}
    check_tensors(gguf, tensors, config)

    def linear(name: str, heads: int | None = None) -> GGMLLinear:
        tensor = tensors[name]
        blocks = _blocks(tensor)
        if heads is not None:
            blocks = _unpermute(blocks, heads)
        return GGMLLinear(blocks, int(tensor.tensor_type), int(tensor.shape[0]))

    def norm(name: str) -> nn.Parameter:
        return nn.Parameter(_floats(tensors[name]), requires_grad=False)

    for i, block in enumerate(model.model.layers):
        for short, (part, attribute) in _PROJECTIONS.items():
            heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}.get(short)
            setattr(getattr(block, part), attribute, linear(f"blk.{i}.{short}.weight", heads))
        block.input_layernorm.weight = norm(f"blk.{i}.attn_norm.weight")
        block.post_attention_layernorm.weight = norm(f"blk.{i}.ffn_norm.weight")
    table = linear("token_embd.weight")
    model.model.embed_tokens = GGMLEmbedding(table)
    model.lm_head = linear("output.weight") if "output.weight" in tensors else table
    model.model.norm.weight = norm("output_norm.weight")
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)  # its inv_freq was made on meta
    left = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"GGUF file {gguf.name} left weights unset: {', '.join(left[:5])}")
    model.eval()
    step = native_llama_step(model)
    if step is not None:  # prefill windows through the same C code as the decode step
        install_native_forward(model, step)
    log.info("gguf_native_loaded", gguf=str(gguf), bytes=sum(t.numel() for t in model.buffers()))
    return model
