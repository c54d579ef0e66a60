"""Random-weight MoE checkpoints of the real transformers classes, with as many experts as a test or benchmark
needs, for the expert pool (deltafin/engine/experts).

    python -m deltafin.tiny.moe --arch qwen3_moe --out /tmp/moe --experts 16 --layers 4
    python -m deltafin.tiny.moe --arch qwen3_moe --out /tmp/big --experts 64 --layers 8 --hidden 1024 \\
        --intermediate 768 --top-k 4 --stream          # ~4.8 GB of routed experts, written without holding them

Each architecture is served under the family whose tokenizer and chat format it gets (`ARCHITECTURES`). The
checkpoint is written the way the Hub stores these models (one tensor per expert and projection: what
transformers 5's `save_pretrained` writes back), or with `fused=True` as the fused [E, 2I, H] tensors.

`embedding_std` redraws the token embeddings with that std. At transformers' init (0.02) a random model's
residual stream is soon dominated by what every position shares (attention averages, expert outputs), so the
deeper layers route almost every token to the same few experts (measured on bench/experts.py's model: 6 of
64 experts in layer 8 over 24 tokens); embeddings of std 1 keep each token's own direction dominant and the
routers then pick nearly uniformly (45-50 distinct experts of 64 per 96 picks in every layer, uniform
expectation 50): the worst case for a cache of experts, which a benchmark wants.

`stream=True` builds the model on the meta device, materializes only the dense weights (initialized by
transformers' own `initialize_weights`) and writes each expert's tensors as it draws them (normal, std
`initializer_range`, as transformers initializes experts), so a checkpoint of many GB is written in the memory
of its dense part. Names and shapes come from transformers' reverse conversion (`revert_weight_conversion`).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from deltafin.tiny.architectures import CONTEXT

#: architecture -> (family whose tokenizer and chat format it gets, model.variant)
ARCHITECTURES: dict[str, tuple[str, str | None]] = {
    "deepseek_v3": ("kimi_k2", None),  # Kimi K2
    "kimi_linear": ("kimi_k3", None),  # Kimi K3: linear attention (KDA) + MLA, MoE
    "glm4_moe": ("glm", "glm47"),  # GLM-4.5 / 4.7
    "qwen3_moe": ("qwen3", None),
    "mixtral": ("qwen3", None),  # no family of its own: any chat template serves a random model
}

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


@dataclass(frozen=True)
class MoeShape:
    experts: int = 16
    top_k: int = 2
    layers: int = 4  # decoder layers; the first is dense where the architecture has dense layers first
    hidden: int = 64
    intermediate: int = 32  # of one routed expert
    heads: int = 4


def build(arch: str, vocab: int, shape: MoeShape) -> Any:
    """The architecture's transformers model (random weights) of `shape`; under `torch.device("meta")`,
    shapes only."""
    import transformers as tf

    common: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_experts_per_tok=shape.top_k,
        max_position_embeddings=CONTEXT,
        tie_word_embeddings=False,
    )
    head_dim = shape.hidden // shape.heads
    if arch == "deepseek_v3":
        config: Any = tf.DeepseekV3Config(
            **common,
            intermediate_size=4 * shape.intermediate,
            moe_intermediate_size=shape.intermediate,
            num_key_value_heads=shape.heads,
            n_shared_experts=1,
            n_routed_experts=shape.experts,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            kv_lora_rank=16,
            q_lora_rank=32,
            qk_rope_head_dim=8,
            v_head_dim=head_dim,
            qk_nope_head_dim=head_dim,
        )
        return tf.DeepseekV3ForCausalLM(config)
    if arch == "kimi_linear":
        kinds = ["linear_attention" if i % 2 == 0 else "full_attention" for i in range(shape.layers)]
        config = tf.KimiLinearConfig(
            **common,
            intermediate_size=4 * shape.intermediate,
            moe_intermediate_size=shape.intermediate,
            num_key_value_heads=shape.heads,
            n_shared_experts=1,
            num_local_experts=shape.experts,
            kv_lora_rank=16,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            v_head_dim=head_dim,
            qk_nope_head_dim=head_dim,
            linear_head_dim=head_dim,
            linear_num_heads=shape.heads,
            layer_types=kinds,
            mlp_layer_types=["dense"] + ["sparse"] * (shape.layers - 1),
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
        )
        return tf.KimiLinearForCausalLM(config)
    if arch == "glm4_moe":
        config = tf.Glm4MoeConfig(
            **common,
            intermediate_size=4 * shape.intermediate,
            moe_intermediate_size=shape.intermediate,
            num_key_value_heads=max(1, shape.heads // 2),
            n_shared_experts=1,
            n_routed_experts=shape.experts,
            first_k_dense_replace=1,
        )
        return tf.Glm4MoeForCausalLM(config)
    if arch == "qwen3_moe":
        config = tf.Qwen3MoeConfig(
            **common,
            intermediate_size=4 * shape.intermediate,
            moe_intermediate_size=shape.intermediate,
            num_key_value_heads=max(1, shape.heads // 2),
            head_dim=head_dim,  # type: ignore[call-arg]  # a config attribute its __init__ takes through **kwargs
            num_experts=shape.experts,
        )
        return tf.Qwen3MoeForCausalLM(config)
    if arch == "mixtral":
        config = tf.MixtralConfig(
            **common,
            intermediate_size=shape.intermediate,
            num_key_value_heads=max(1, shape.heads // 2),
            num_local_experts=shape.experts,
        )
        return tf.MixtralForCausalLM(config)
    raise ValueError(f"unknown MoE architecture {arch!r} (known: {', '.join(ARCHITECTURES)})")


def write_moe(
    arch: str,
    out: Path,
    shape: MoeShape = MoeShape(),
    *,
    seed: int = 0,
    stream: bool = False,
    fused: bool = False,
    dtype: torch.dtype = torch.float32,
    shard_bytes: int = 2 << 30,
    embedding_std: float | None = None,
) -> Path:
    """A MoE checkpoint of `arch` in `out`, served as `ARCHITECTURES[arch]`'s family (see the module doc)."""
    from deltafin.tiny.writer import write_tiny_model

    family, variant = ARCHITECTURES[arch]
    if stream:

        def make(vocab: int) -> Any:
            with torch.device("meta"):
                return build(arch, vocab, shape)

        def save(model: Any, folder: Path) -> None:
            save_streamed(
                model, folder, seed=seed, fused=fused, dtype=dtype, shard_bytes=shard_bytes, embedding_std=embedding_std
            )
    else:

        def make(vocab: int) -> Any:
            return build(arch, vocab, shape).to(dtype)

        def save(model: Any, folder: Path) -> None:
            _redraw_embeddings(model, embedding_std, seed)
            if fused:  # the model's own names and fused tensors, no reverse conversion
                from safetensors.torch import save_model

                folder.mkdir(parents=True, exist_ok=True)
                model.config.save_pretrained(folder)
                model.generation_config.save_pretrained(folder)
                save_model(model, str(folder / "model.safetensors"))
            else:
                model.save_pretrained(folder)

    write_tiny_model(family, out, variant=variant, seed=seed, architecture=make, save=save)
    meta = json.loads((out / "deltafin_tiny.json").read_text())
    meta["moe"] = {
        "arch": arch,
        **shape.__dict__,
        "fused": fused,
        "dtype": str(dtype).removeprefix("torch."),
        "embedding_std": embedding_std,
    }
    (out / "deltafin_tiny.json").write_text(json.dumps(meta))
    return out


def _whole(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    yield tensor.contiguous()


def _drawn(
    shape: tuple[int, ...], pieces: int, generator: torch.Generator, std: float, dtype: torch.dtype
) -> Iterator[torch.Tensor]:
    """A tensor of `shape` drawn in `pieces` slices of its first dimension (one expert at a time)."""
    for _ in range(pieces):
        yield (torch.randn(shape[1:] if pieces > 1 else shape, generator=generator) * std).to(dtype)


def _redraw_embeddings(model: Any, std: float | None, seed: int) -> None:
    if std is not None:
        weight = model.get_input_embeddings().weight
        with torch.no_grad():
            weight.copy_(torch.randn(weight.shape, generator=torch.Generator().manual_seed(seed + 2)) * std)


def _experts(model: nn.Module) -> dict[str, nn.Module]:
    return {
        name: m for name, m in model.named_modules() if hasattr(m, "_is_expert_parallel") and hasattr(m, "gate_up_proj")
    }


def save_streamed(
    model: Any,  # a transformers PreTrainedModel
    folder: Path,
    *,
    seed: int,
    fused: bool,
    dtype: torch.dtype,
    shard_bytes: int,
    embedding_std: float | None = None,
) -> None:
    """Write `model` (built on the meta device) as safetensors shards, drawing each expert as it is written."""
    from transformers.core_model_loading import revert_weight_conversion

    experts = _experts(model)
    expert_shapes = {
        f"{n}.{p}": tuple(getattr(m, p).shape) for n, m in experts.items() for p in ("gate_up_proj", "down_proj")
    }
    for module in experts.values():  # the dense part only gets memory
        for part in ("gate_up_proj", "down_proj"):
            setattr(module, part, nn.Parameter(torch.empty(0, device="meta")))
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    model.initialize_weights()
    _redraw_embeddings(model, embedding_std, seed)
    model.to(dtype)
    dense = {k: v for k, v in model.state_dict().items() if k not in expert_shapes}
    std = float(getattr(model.config, "initializer_range", 0.02))
    if fused:
        names = dict(dense)
        drawn = {name: shape for name, shape in expert_shapes.items()}
    else:
        names = revert_weight_conversion(model, dense)
        with torch.device("meta"):
            shell = type(model)(model.config)  # names and shapes of the experts in the checkpoint's format
        drawn = {
            k: tuple(v.shape)
            for k, v in revert_weight_conversion(
                shell, {k: torch.empty(s, device="meta") for k, s in expert_shapes.items()}
            ).items()
        }
    generator = torch.Generator().manual_seed(seed + 1)

    def tensors() -> Iterator[tuple[str, tuple[int, ...], Callable[[], Iterator[torch.Tensor]]]]:
        for name, tensor in names.items():
            yield name, tuple(tensor.shape), functools.partial(_whole, tensor)
        for name, shape in drawn.items():
            # fused [E, rows, cols] tensors are drawn one expert at a time as well
            pieces = shape[0] if fused else 1
            yield name, shape, functools.partial(_drawn, shape, pieces, generator, std, dtype)

    _write_shards(folder, list(tensors()), dtype, shard_bytes)
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it (llama.cpp reads it)
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)


def _write_shards(folder: Path, tensors: list, dtype: torch.dtype, shard_bytes: int) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    size = torch.empty((), dtype=dtype).element_size()
    shards: list[list] = [[]]
    used = 0
    for entry in tensors:
        nbytes = math.prod(entry[1]) * size
        if shards[-1] and used + nbytes > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(entry)
        used += nbytes
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    weight_map = {}
    for shard, file_name in zip(shards, names):
        header, at = {}, 0
        for name, shape, _ in shard:
            nbytes = math.prod(shape) * size
            header[name] = {
                "dtype": _SAFETENSORS_DTYPES[dtype],
                "shape": list(shape),
                "data_offsets": [at, at + nbytes],
            }
            at += nbytes
            weight_map[name] = file_name
        header["__metadata__"] = {"format": "pt"}
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # data starts 8-byte aligned, as safetensors writes it
        with (folder / file_name).open("wb") as handle:
            handle.write(len(raw).to_bytes(8, "little") + raw)
            for _, _, chunks in shard:
                for chunk in chunks():
                    handle.write(chunk.contiguous().view(torch.uint8).numpy().tobytes())
    if len(shards) > 1:
        total = sum(math.prod(shape) * size for _, shape, _ in tensors)
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1)
        )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m deltafin.tiny.moe", description=__doc__.split("\n")[0])
    parser.add_argument("--arch", required=True, choices=sorted(ARCHITECTURES))
    parser.add_argument("--out", required=True, type=Path)
    for field, default in MoeShape().__dict__.items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=default)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stream", action="store_true", help="write experts as drawn (checkpoints of many GB)")
    parser.add_argument("--fused", action="store_true", help="fused [E, 2I, H] expert tensors, not one per expert")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument(
        "--embedding-std", type=float, default=None, help="redraw token embeddings (1.0: routing near uniform)"
    )
    args = parser.parse_args()
    shape = MoeShape(**{field: getattr(args, field) for field in MoeShape().__dict__})
    write_moe(
        args.arch,
        args.out,
        shape,
        seed=args.seed,
        stream=args.stream,
        fused=args.fused,
        dtype=getattr(torch, args.dtype),
        embedding_std=args.embedding_std,
    )
    print(f"wrote a {args.arch} MoE ({shape}) to {args.out}")


if __name__ == "__main__":
    main()
