"""Isolation, by hand: how much a long prompt or a hostile schema holds up streams that are already running.

    .venv/bin/python bench/isolation.py chunks [--chunks 64 128 256 512 8192] [--prompt-tokens 6000]
    .venv/bin/python bench/isolation.py server [--streams 2] [--prompt-tokens 6000] [-- HYDRA OVERRIDES]
    .venv/bin/python bench/isolation.py gil

`chunks` (in process, the default model, the local engine): for each engine.prefill_chunk_tokens, one greedy
stream decodes while a prompt of --prompt-tokens arrives; reports the stream's inter-token latency while that
prompt is in prefill (p50, p99, max), the prompt's own prefill time (its TTFT), and the stream's ITL alone.
8192 (more than the prompt) is the unchunked prefill: one forward pass.

`server` (a real `python -m deltafin` on loopback): --streams streamed chat requests decode; their inter-token
latency (p50, p99, max) is measured in three windows side by side: quiet, while a ~--prompt-tokens prompt
arrives and prefills, and while hostile constraints are sent (a 12000-fold pattern, refused by the limits; a
schema of 10000 optional properties, killed at the compile budget; each resent). Also /health latency in each.

`gil`: whether xgrammar holds the GIL. Each step of grammar work (building the tokenizer info, reading a
hostile schema, compiling, serializing, deserializing) runs on a thread while this thread ticks every 5 ms;
reports the work's time and the largest tick gap (a gap as long as the work: the GIL was held throughout).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

STORY = (
    "The lighthouse keeper climbed the stairs every evening, counting the steps and listening to the sea. "
    "Ships passed far out, their lights small and steady, and the keeper wrote each one in a book. "
)


def percentiles(gaps: list[float]) -> dict[str, float]:
    if not gaps:
        return {"n": 0}
    ordered = sorted(gaps)
    pick = lambda q: ordered[min(len(ordered) - 1, int(q * len(ordered)))]  # noqa: E731
    return {
        "n": len(gaps),
        "p50_ms": round(statistics.median(ordered) * 1000, 1),
        "p99_ms": round(pick(0.99) * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1),
    }


def long_text(tokenizer, tokens: int) -> str:
    text = STORY
    while len(tokenizer(text, add_special_tokens=False).input_ids) < tokens:
        text += STORY
    return text


# -- chunks: in process ---------------------------------------------------------------------------------------


async def chunk_run(
    loaded, chunk: int, prompt_ids: tuple[int, ...], running_ids: tuple[int, ...], threads: int
) -> dict:
    from deltafin.engine import EngineFront, GenerationJob, TextDelta
    from deltafin.engine.local.engine import LocalEngine
    from deltafin.protocol.sampling import SamplingParams

    front = EngineFront(
        LocalEngine(loaded, prefill_chunk=chunk, prefix_cache_min_tokens=None, threads=threads),
        max_waiting=4,
        timeout_s=600,
        memo_entries=0,
    )
    arrivals: list[float] = []
    stream = await front.start(
        [GenerationJob(running_ids, SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True))]
    )
    events = stream.__aiter__()

    async def read() -> None:
        async for event in events:
            if isinstance(event, TextDelta) and event.token_ids:
                arrivals.append(time.perf_counter())

    reader = asyncio.ensure_future(read())
    while len(arrivals) < 20:  # the stream is decoding steadily
        await asyncio.sleep(0.01)
    alone_from = len(arrivals) - 1
    await asyncio.sleep(2.0)
    alone = [b - a for a, b in zip(arrivals[alone_from:], arrivals[alone_from + 1 :])]
    sent = time.perf_counter()
    long_stream = await front.start([GenerationJob(prompt_ids, SamplingParams(max_tokens=1, temperature=0.0))])
    async for event in long_stream:
        if isinstance(event, TextDelta):
            break
    first_token = time.perf_counter()
    while arrivals[-1] < first_token:  # the stream's first token after the prefill closes the last gap
        await asyncio.sleep(0.005)
    during = [b - a for a, b in zip(arrivals, arrivals[1:]) if b > sent and a < first_token]
    stream.close()
    await asyncio.gather(reader, return_exceptions=True)
    await front.aclose()
    return {
        "chunk": chunk,
        "prefill_s": round(first_token - sent, 2),
        "itl_during_prefill": percentiles(during),
        "itl_alone": percentiles(alone),
    }


def chunks(args: argparse.Namespace) -> dict:
    import torch

    from deltafin.engine.weights.loader import load_model
    from deltafin.testing import compose_config

    config = compose_config(args.overrides)
    # As the server does (build_local_engine): load with one thread, run the engine's own with the configured number.
    threads = config.placement.num_threads or torch.get_num_threads()
    torch.set_num_threads(1)
    loaded = load_model(config.model, config.placement)
    tokenizer = loaded.tokenizer

    def chat(text: str) -> tuple[int, ...]:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
        )
        return tuple(ids["input_ids"] if hasattr(ids, "keys") else ids)

    prompt_ids = chat("Summarise: " + long_text(tokenizer, args.prompt_tokens))
    running_ids = chat("Count from one to a thousand.")
    runs = [asyncio.run(chunk_run(loaded, chunk, prompt_ids, running_ids, threads)) for chunk in args.chunks]
    return {"model": config.model.name, "prompt_tokens": len(prompt_ids), "torch_threads": threads, "runs": runs}


# -- gil: does xgrammar release the GIL? ----------------------------------------------------------------------


def on_a_thread(fn) -> tuple[float, float]:
    """(seconds `fn` took on a thread, largest gap between 5 ms ticks of this thread meanwhile)."""
    done = threading.Event()
    took: list[float] = []

    def work() -> None:
        started = time.perf_counter()
        try:
            fn()
        finally:
            took.append(time.perf_counter() - started)
            done.set()

    thread = threading.Thread(target=work)
    gaps, last = [0.0], time.perf_counter()
    thread.start()
    while not done.is_set():
        time.sleep(0.005)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    thread.join()
    return took[0], max(gaps)


def gil(args: argparse.Namespace) -> dict:
    import xgrammar as xgr

    from deltafin.engine.weights.tokenizer_only import load_tokenizer_only
    from deltafin.testing import compose_config

    bundle = load_tokenizer_only(compose_config(args.overrides).model)
    info_of = lambda: xgr.TokenizerInfo.from_huggingface(  # noqa: E731
        bundle.tokenizer, vocab_size=bundle.vocab_size, stop_token_ids=sorted(bundle.stop_token_ids)
    )
    info = info_of()
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    pattern = json.dumps({"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]{3000}$"}}})
    deep: dict = {"type": "object"}
    for _ in range(200):
        deep = {"type": "object", "properties": {"x": deep}, "required": ["x"]}
    optional = json.dumps({"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1000)}})
    out: dict[str, dict] = {}

    def step(name: str, fn) -> None:
        took, gap = on_a_thread(fn)
        out[name] = {"work_s": round(took, 3), "largest_tick_gap_s": round(gap, 3)}
        print(name, out[name], file=sys.stderr, flush=True)

    step("tokenizer_info", info_of)
    kept: dict = {}
    step("schema_pattern_3000", lambda: kept.setdefault("p", xgr.Grammar.from_json_schema(pattern)))
    step("schema_depth_200", lambda: xgr.Grammar.from_json_schema(json.dumps(deep)))
    step("schema_1000_optional", lambda: kept.setdefault("o", xgr.Grammar.from_json_schema(optional)))
    step("compile_1000_optional", lambda: kept.setdefault("c", compiler.compile_grammar(kept["o"])))
    step("serialize_compiled", lambda: kept.setdefault("s", kept["c"].serialize_json()))
    step("deserialize_compiled", lambda: xgr.CompiledGrammar.deserialize_json(kept["s"], info))
    out["serialized_mb"] = {"size": round(len(kept["s"]) / 1e6, 2)}
    return out


# -- server: a real process -----------------------------------------------------------------------------------


class Streams:
    """`count` streamed chats, each token's arrival time recorded; /health polled every 50 ms."""

    def __init__(self, base_url: str, count: int) -> None:
        self.base_url = base_url
        self.arrivals: list[list[float]] = [[] for _ in range(count)]
        self.health: list[tuple[float, float]] = []  # (sent, latency)
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._stream, args=(i,), daemon=True) for i in range(count)]
        self.threads.append(threading.Thread(target=self._health, daemon=True))

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def _stream(self, index: int) -> None:
        body = {
            "messages": [{"role": "user", "content": f"Stream {index}: count from one to a thousand."}],
            "max_tokens": 7000,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        with httpx.Client(timeout=600) as client:
            with client.stream("POST", f"{self.base_url}/v1/chat/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: {"):
                        self.arrivals[index].append(time.perf_counter())
                    if self.stop.is_set():
                        return

    def _health(self) -> None:
        with httpx.Client(timeout=600) as client:
            while not self.stop.is_set():
                sent = time.perf_counter()
                try:
                    client.get(f"{self.base_url}/health")
                except httpx.HTTPError:  # counted as the time it took to fail
                    pass
                self.health.append((sent, time.perf_counter() - sent))
                time.sleep(0.05)

    def wait_past(self, moment: float) -> None:
        """Until every stream has a token after `moment` (so the gap across it is known)."""
        while not all(arrivals and arrivals[-1] > moment for arrivals in self.arrivals):
            time.sleep(0.01)

    def window(self, start: float, end: float) -> dict:
        """Every gap between two tokens that overlaps [start, end] (the one spanning a stall included)."""
        gaps = [b - a for arrivals in self.arrivals for a, b in zip(arrivals, arrivals[1:]) if a < end and b > start]
        health = [latency for sent, latency in self.health if start <= sent <= end]
        return {"itl": percentiles(gaps), "health": percentiles(health)}


def hostile_bodies() -> list[dict]:
    def chat(schema: dict) -> dict:
        return {
            "messages": [{"role": "user", "content": "JSON please"}],
            "max_tokens": 8,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
        }

    slow = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(10000)}}
    pattern = {"type": "object", "properties": {"a": {"type": "string", "pattern": "^[a-z]{12000}$"}}}
    return [chat(pattern), chat(slow), chat(pattern), chat(slow)]


def server(args: argparse.Namespace) -> dict:
    from deltafin.testing import LiveServer

    live = LiveServer(args.overrides)
    try:
        live.wait_ready()
        base = live.base_url
        text = "Summarise: " + STORY * max(1, args.prompt_tokens // 40)
        count = httpx.post(f"{base}/tokenize", json={"prompt": text}, timeout=60).json()["count"]
        streams = Streams(base, args.streams)
        streams.start()
        while min(len(a) for a in streams.arrivals) < 20:
            time.sleep(0.05)
        t0 = time.perf_counter()
        time.sleep(args.window_s)
        t1 = time.perf_counter()
        long_answer = httpx.post(
            f"{base}/v1/chat/completions",
            timeout=3600,
            json={"messages": [{"role": "user", "content": text}], "max_tokens": 1},
        )
        streams.wait_past(time.perf_counter())
        t2 = time.perf_counter()
        statuses = []
        for body in hostile_bodies():
            statuses.append(httpx.post(f"{base}/v1/chat/completions", json=body, timeout=3600).status_code)
        streams.wait_past(time.perf_counter())
        t3 = time.perf_counter()
        streams.stop.set()
        return {
            "streams": args.streams,
            "long_prompt_tokens": count,
            "long_prompt_status": long_answer.status_code,
            "long_prompt_s": round(t2 - t1, 2),
            "hostile_statuses": statuses,
            "hostile_s": round(t3 - t2, 2),
            "quiet": streams.window(t0, t1),
            "during_long_prefill": streams.window(t1, t2),
            "during_hostile_compiles": streams.window(t2, t3),
        }
    finally:
        live.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    c = sub.add_parser("chunks")
    c.add_argument("--chunks", type=int, nargs="+", default=[64, 128, 256, 512, 8192])
    c.add_argument("--prompt-tokens", type=int, default=6000)
    c.add_argument("overrides", nargs="*")
    s = sub.add_parser("server")
    s.add_argument("--streams", type=int, default=2)
    s.add_argument("--prompt-tokens", type=int, default=6000)
    s.add_argument("--window-s", type=float, default=5.0)
    s.add_argument("overrides", nargs="*")
    g = sub.add_parser("gil")
    g.add_argument("overrides", nargs="*")
    parsed = parser.parse_args()
    print(json.dumps({"chunks": chunks, "server": server, "gil": gil}[parsed.mode](parsed), indent=2))
