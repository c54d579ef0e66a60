"""Kimi K3 on the CPU: Deltafin's own K3 model against llama-server on the same checkpoint converted to GGUF by
llama.cpp's converter (f32, exact), measured in one run on the same prompt ids; and KDA's prefill per 1k tokens.

    flock /tmp/deltafin-bench.lock .venv/bin/python bench/k3.py [--prompt 512] [--tokens 64] [--reps 3]

The model is K3-shaped and not trivial (written once, cached under ~/.cache/deltafin/bench): the released
layout with every feature on, 12 layers (KDA with an MLA layer every fourth, as the release), hidden 1024, 8 KDA
heads and 8 MLA heads of the release's widths (128; MLA 128 + 64, latent 256), a dense first layer, then latent
MoE layers of 48 experts (4 per token, width 384 in a 512-wide latent space) with two shared experts; about
430 M parameters, 1.7 GB in float32.

Deltafin runs in this process through its local engine (float32, the engine's prefill windows, a greedy request
at a time: its prefill rate from the time to the first token of a 1-token answer, its decode rate from a
`--tokens` answer's tokens after the first); llama-server (`-t` the same thread count, `-np 1`, prompt cache
off) reports its own prompt and generation timings. The two alternate, request by request, so both see the same
load. Printed: each one's prefill tokens/s of a `--prompt`-token prompt and decode tokens/s (medians), their
ratios, the load average, and the CPU time of KDA's chunked prefill over 1k tokens for one layer (one thread) at
this model's shape and at the released K3's (96 heads of 128): the gate, convolution and recurrence, without
the projections.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deltafin.engine import EngineFront, GenerationJob, TextDelta  # noqa: E402
from deltafin.engine.local.engine import LocalEngine  # noqa: E402
from deltafin.engine.models import kda  # noqa: E402
from deltafin.engine.weights.loader import load_model  # noqa: E402
from deltafin.protocol.sampling import SamplingParams  # noqa: E402
from deltafin.testing import compose_config  # noqa: E402
from deltafin.testing.llama_server import start_llama_server  # noqa: E402
from deltafin.tiny import write_tiny_model  # noqa: E402
from deltafin.tiny.gguf import cache_root, tiny_gguf  # noqa: E402
from deltafin.tiny.kimi_k3 import kimi_k3, save_k3  # noqa: E402

SHAPE = {
    "hidden_size": 1024,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 384,
    "kv_lora_rank": 256,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_experts": 48,
    "num_experts_per_token": 4,
    "moe_intermediate_size": 384,
    "routed_expert_hidden_size": 512,
    "attn_res_block_size": 4,
    "linear_attn_config": {
        "kda_layers": [i for i in range(1, 13) if i % 4],
        "full_attn_layers": [4, 8, 12],
        "head_dim": 128,
        "num_heads": 8,
        "short_conv_kernel_size": 4,
        "gate_lower_bound": -5.0,
        "use_full_rank_gate": True,
    },
}
#: the released K3's KDA layer: heads x head width
RELEASED_KDA = (96, 128)


def model_folder() -> Path:
    """Written once: keyed by the shape and the tiny K3 writer's code."""
    from deltafin.tiny import kimi_k3 as writer

    source = Path(writer.__file__).read_bytes()
    key = hashlib.sha256(json.dumps(SHAPE, sort_keys=True).encode() + source).hexdigest()[:12]
    folder = cache_root() / "bench" / f"k3-shaped-{key}"
    if not (folder / "config.json").exists():
        staging = folder.with_name(folder.name + f".{os.getpid()}")
        write_tiny_model("kimi_k3", staging, architecture=lambda vocab: kimi_k3(vocab, **SHAPE), save=save_k3)
        staging.rename(folder)
    return folder


def prompt_ids(tokens: int) -> list[int]:
    return torch.randint(10, 400, (tokens,), generator=torch.Generator().manual_seed(0)).tolist()


class DeltafinSide:
    """The K3 folder served by Deltafin's local engine in this process (float32, the engine's prefill windows)."""

    def __init__(self, folder: Path, threads: int) -> None:
        config = compose_config(["model=kimi_k3", f"model.path={folder}"])
        loaded = load_model(config.model, config.placement)
        self.engine = LocalEngine(loaded, prefix_cache_min_tokens=None, max_batch=1, threads=threads)
        self.front = EngineFront(self.engine, max_waiting=4, timeout_s=3600, memo_entries=0)
        self.loop = asyncio.new_event_loop()

    def _run(self, ids: list[int], n: int) -> tuple[float, float]:
        async def run() -> tuple[float, float]:
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            started = time.perf_counter()
            stream = await self.front.start([GenerationJob(tuple(ids), params)])
            first = None
            async for event in stream:
                if isinstance(event, TextDelta) and first is None:
                    first = time.perf_counter()
            assert first is not None
            return first - started, time.perf_counter() - started

        return self.loop.run_until_complete(run())

    def measure(self, ids: list[int], tokens: int) -> tuple[float, float]:
        """(prefill tokens/s, decode tokens/s) of one request each: a 1-token answer, a `tokens` one."""
        ttft, _ = self._run(ids, 1)
        first, total = self._run(ids, tokens)
        return len(ids) / ttft, (tokens - 1) / (total - first)

    def close(self) -> None:
        self.loop.run_until_complete(self.engine.aclose())
        self.loop.close()


def llama_measure(url: str, ids: list[int], tokens: int) -> tuple[float, float]:
    """(prefill tokens/s, decode tokens/s) from llama-server's own timings, prompt cache off."""
    body = {"prompt": ids, "n_predict": tokens, "temperature": 0, "ignore_eos": True, "cache_prompt": False}
    timings = httpx.post(f"{url}/completion", json=body, timeout=3600).json()["timings"]
    return timings["prompt_per_second"], timings["predicted_per_second"]


def kda_prefill_cpu_s(heads: int, dim: int, tokens: int = 1024, reps: int = 3) -> float:
    """CPU seconds (process time: a busy machine's other jobs do not count) for one KDA layer's gate, short
    convolution and chunked recurrence over `tokens` tokens."""
    generator = torch.Generator().manual_seed(0)
    width = heads * dim
    mixed = torch.randn(1, 3 * width, tokens, generator=generator)
    weight = torch.randn(3 * width, 4, generator=generator) * 0.5
    raw = torch.randn(1, tokens, heads, dim, generator=generator)
    a_log, dt_bias = torch.rand(heads, generator=generator).log1p(), torch.randn(width, generator=generator)
    beta = torch.rand(1, tokens, heads, generator=generator)
    times = []
    with torch.inference_mode():
        for _ in range(reps):
            started = time.process_time()
            qkv = torch.nn.functional.silu(kda.short_conv(mixed, weight, tokens))
            q, k, v = (part.reshape(1, tokens, heads, dim) for part in qkv.chunk(3, dim=-1))
            g = kda.gate(raw, a_log, dt_bias, -5.0)
            state = torch.zeros(1, heads, dim, dim)
            kda.chunked(kda.l2norm(q) * dim**-0.5, kda.l2norm(k), v, g, beta, state)
            times.append(time.process_time() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    folder = model_folder()
    gguf = tiny_gguf(folder)
    size = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e9
    print(f"model {folder.name}: {size:.2f} GB float32; GGUF {gguf.stat().st_size / 1e9:.2f} GB", flush=True)
    print(f"load average at start: {os.getloadavg()[0]:.1f}", flush=True)
    ids = prompt_ids(args.prompt)
    ours, theirs = DeltafinSide(folder, args.threads), []
    mine = []
    process, url = start_llama_server(gguf, parallel=1, context=4096, threads=args.threads)
    try:
        llama_measure(url, ids[:16], 2), ours.measure(ids[:16], 2)  # warm-up
        for _ in range(args.reps):  # alternating, so both sides see the same load
            theirs.append(llama_measure(url, ids, args.tokens))
            mine.append(ours.measure(ids, args.tokens))
    finally:
        process.terminate()
        process.wait(timeout=30)
        ours.close()
    llama = [statistics.median(run[i] for run in theirs) for i in (0, 1)]
    deltafin = [statistics.median(run[i] for run in mine) for i in (0, 1)]
    print(f"llama-server: prefill {llama[0]:.1f} tok/s, decode {llama[1]:.2f} tok/s")
    print(f"deltafin:     prefill {deltafin[0]:.1f} tok/s, decode {deltafin[1]:.2f} tok/s")
    print(f"deltafin/llama-server: prefill {deltafin[0] / llama[0]:.2f}x, decode {deltafin[1] / llama[1]:.2f}x")
    print(f"load average at end: {os.getloadavg()[0]:.1f}", flush=True)
    torch.set_num_threads(1)
    heads, dim = SHAPE["linear_attn_config"]["num_heads"], SHAPE["linear_attn_config"]["head_dim"]
    print(f"KDA prefill per 1k tokens, one layer, {heads} heads of {dim}: {kda_prefill_cpu_s(heads, dim):.2f} CPU s")
    heads, dim = RELEASED_KDA
    print(
        f"KDA prefill per 1k tokens, one layer, released K3 ({heads} heads of {dim}): "
        f"{kda_prefill_cpu_s(heads, dim):.2f} CPU s"
    )


if __name__ == "__main__":
    main()
