"""What Deltafin adds in front of an upstream engine: TTFT and inter-token latency, gateway vs direct, same run,
and the gateway's own CPU per request and per token.

    .venv/bin/python bench/gateway.py --upstream llama-server --streams 16 --tokens 16 --reps 3 --pin --upstream-threads 1
    .venv/bin/python bench/gateway.py --upstream llama-server --streams 16 --tokens 16 --reps 3
    .venv/bin/python bench/gateway.py --upstream paced-fake --streams 16 --tokens 16 --reps 4
    .venv/bin/python bench/gateway.py --upstream paced-fake --streams 16 --tokens 16 --reps 4 --pin --stagger-ms 10
    .venv/bin/python bench/gateway.py --upstream deltafin --streams 4 --tokens 16 --reps 2
    .venv/bin/python bench/gateway.py --upstream fake --tokens 800

The upstream is a real llama-server (serving the default model's GGUF, `-np STREAMS`), a paced fake of it, or a
second Deltafin. Each rep sends STREAMS concurrent streamed chat requests through the gateway
(`engine=llama_server` / `engine=vllm`) and the same work straight to the upstream, alternating which goes
first. In front of llama-server (or the fake) the direct side sends the very request the gateway sends
(`completion_body`: the chat's token ids from the gateway's /tokenize, the adapter's own body), so both sides
ask the upstream for the same work; in front of a Deltafin, the same chat request. Figures are medians over every
request: TTFT (request sent to first content byte) and inter-token latency (mean gap between content chunks,
also over the second half of each stream). Then the gateway's CPU time (from /proc) per request and per token,
split by a burst with 4x the tokens in every rep: what the gateway costs, free of the upstream's noise.

`paced-fake` puts the gateway (a real process) in front of a fake llama-server in another process that sends each
token `--pace-ms` apart, as a GPU upstream would: the gateway's CPU and latency without a CPU-bound upstream beside
it (on 2 cores llama-server's own decoding competes with the gateway and inflates its figures). `--pin` keeps the
upstream on CPU 0 and the gateway and this client on the others; `--stagger-ms` starts the streams apart instead
of in one burst, whose median TTFT also waits for the requests ahead of it.

`fake` is an in-process llama-server stand-in that answers at once (no model; its HTTP runs over a socket pair
in the same process): the CPU the gateway's whole serving path (upstream HTTP and SSE parsing, decoding, chat
chunks, SSE out), the fake upstream and the test client included, spends per token.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deltafin.testing import LiveServer, compose_config  # noqa: E402
from deltafin.testing.llama_server import start_llama_server  # noqa: E402

PROMPT = [{"role": "user", "content": "Write a long story about a dragon who learns to bake bread."}]


def start_upstream_llama_server(streams: int, threads: int) -> tuple[subprocess.Popen, str]:
    from deltafin.engine.weights.loader import resolve_model_path

    return start_llama_server(
        resolve_model_path(compose_config().model.path), parallel=streams, context=1024 * streams, threads=threads
    )


def pinned(cpus: set[int] | None):
    """Run what follows (and the processes it starts, which inherit it) on `cpus` only; None: no change."""

    class Pin:
        def __enter__(self) -> None:
            self.before = os.sched_getaffinity(0)
            if cpus:
                os.sched_setaffinity(0, cpus)

        def __exit__(self, *exc: object) -> None:
            os.sched_setaffinity(0, self.before)

    return Pin()


def completion_body(prompt_ids: list[int], tokens: int) -> dict:
    """The very request the gateway sends llama-server for these chats (its adapter builds it): the direct side
    sends it too, so both sides ask the upstream for the same work. (llama-server's own chat endpoint templates,
    parses and samples with its defaults, top-k 40, DRY, ...: a different cost per step, which would show up as
    latency the gateway does not add or save.)"""
    from deltafin.engine.events import GenerationJob
    from deltafin.engine.upstream.engine import UpstreamSettings
    from deltafin.engine.upstream.llama_server import LlamaServerAdapter
    from deltafin.protocol.sampling import SamplingParams

    job = GenerationJob(tuple(prompt_ids), SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True))
    return LlamaServerAdapter(UpstreamSettings(url="")).request(job, "bench", frozenset())[1]


async def one_stream(client: httpx.AsyncClient, url: str, tokens: int) -> tuple[float, list[float]]:
    body = {"messages": PROMPT, "max_tokens": tokens, "temperature": 0, "stream": True, "ignore_eos": True}
    sent = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line and '"content":""' not in line:
                arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError(f"no content from {url}")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return arrivals[0] - sent, gaps


async def one_completion_stream(
    client: httpx.AsyncClient, url: str, tokens: int, prompt_ids: list[int]
) -> tuple[float, list[float]]:
    """The direct side in front of llama-server (or the paced fake): its `/completion`, the request the gateway
    sends."""
    body = completion_body(prompt_ids, tokens)
    sent = time.perf_counter()
    arrivals: list[float] = []
    async with client.stream("POST", url + "/completion", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            compact = line.replace(" ", "")  # llama-server writes compact JSON, the fake spaced
            if compact.startswith("data:{") and '"tokens":[' in compact and '"tokens":[]' not in compact:
                arrivals.append(time.perf_counter())
    if not arrivals:
        raise RuntimeError(f"no tokens from {url}")
    return arrivals[0] - sent, [b - a for a, b in zip(arrivals, arrivals[1:])]


#: --stagger-ms: stream i starts i * this later (0: all at once)
STAGGER_S = 0.0
#: --new-connections: every request opens its own connection (else one kept-alive client per side)
NEW_CONNECTIONS = False


class Clients:
    """One HTTP client per base URL, kept for the whole run (kept-alive connections, as the OpenAI SDK keeps
    them), or, with --new-connections, a fresh one per burst (a connection opened for every request)."""

    def __init__(self) -> None:
        self._clients: dict[str, httpx.AsyncClient] = {}

    def get(self, url: str) -> httpx.AsyncClient:
        if url not in self._clients:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            self._clients[url] = httpx.AsyncClient(timeout=600, limits=limits)
        return self._clients[url]

    async def after_burst(self, url: str) -> None:
        if NEW_CONNECTIONS:
            await self._clients.pop(url).aclose()

    async def aclose(self) -> None:
        for client in self._clients.values():
            await client.aclose()


async def burst(
    clients: Clients, url: str, streams: int, tokens: int, prompt_ids: list[int] | None = None
) -> list[tuple[float, list[float]]]:
    """STREAMS concurrent streams: chat completions, or (with `prompt_ids`) llama-server completions; started
    STAGGER_S apart (TTFT counts from each one's own start)."""
    client = clients.get(url)

    async def one(i: int) -> tuple[float, list[float]]:
        await asyncio.sleep(i * STAGGER_S)
        if prompt_ids is not None:
            return await one_completion_stream(client, url, tokens, prompt_ids)
        return await one_stream(client, url, tokens)

    try:
        return await asyncio.gather(*(one(i) for i in range(streams)))
    finally:
        await clients.after_burst(url)


def cpu_seconds(pid: int) -> float:
    """The process's CPU time in nanoseconds summed over its threads (/proc/PID/task/*/schedstat): /proc/PID/stat
    counts clock ticks (10 ms), a third of a 32-request burst's whole cost. The gateway's threads (event loop,
    prompt threads, template watchdog) live as long as it does, so no thread's time is lost by exiting."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):
            pass  # a thread that ended between the listing and the read
    return total / 1e9


def in_process(tokens: int) -> None:
    """The gateway app in this process, its upstream a fake that has every token ready: CPU per streamed token."""
    from litestar.testing import TestClient

    from deltafin.app.factory import build_app
    from deltafin.app.services import Services
    from deltafin.engine import EngineFront
    from deltafin.engine.upstream.llama_server import LlamaServerAdapter
    from deltafin.engine.weights.tokenizer_only import load_tokenizer_only
    from deltafin.testing.upstream_fakes import Fake, ScriptedBody, make_engine

    config = compose_config(["server.memo.entries=0"])
    bundle = load_tokenizer_only(config.model)
    ids = bundle.tokenizer(
        "The quick brown fox jumps over the lazy dog. " * (tokens // 8 + 1), add_special_tokens=False
    ).input_ids[:tokens]
    events = [{"content": "x", "tokens": [i], "stop": False} for i in ids]
    events.append({"content": "", "tokens": [], "stop": True, "stop_type": "limit", "timings": {"cache_n": 0}})
    # A 0.1 ms pause between events makes each token its own upstream read, as with a real upstream.
    fake = Fake(lambda body, path: ScriptedBody(events, delay=1e-4, tail=b""))
    engine = make_engine(LlamaServerAdapter, bundle, fake)
    app = build_app(
        config, Services.from_engine(config, EngineFront(engine, max_waiting=4, timeout_s=5, memo_entries=0))
    )
    body = {"messages": PROMPT, "max_tokens": tokens, "stream": True, "temperature": 0}
    with TestClient(app) as client:

        def one() -> int:
            with client.stream("POST", "/v1/chat/completions", json=body) as response:
                return sum(1 for line in response.iter_lines() if line.startswith("data: {"))

        one()  # warm up
        started = time.process_time()
        chunks = sum(one() for _ in range(5))
        spent = time.process_time() - started
    # Per token, not per chunk: tokens that arrive in one upstream read leave in one chunk.
    print(
        f"in-process gateway (fake upstream, client included): {spent * 1000 / (5 * len(ids)):.3f} ms CPU per "
        f"streamed token ({5 * len(ids)} tokens in {chunks} chunks)"
    )


def serve_paced_fake(pace_s: float) -> None:
    """A fake llama-server (`/completion`, `/health`) on a free loopback port that sends `n_predict` tokens
    `pace_s` apart, as a GPU upstream would; prints its URL. Runs until killed."""
    from deltafin.testing.upstream_fakes import Fake, ScriptedBody

    def respond(body: dict, path: str):
        if path != "/completion":
            return 200, {"status": "ok"}
        n = int(body["n_predict"])
        events = [{"content": "x", "tokens": [260 + i % 1000], "stop": False} for i in range(n)]
        events.append(
            {
                "content": "",
                "tokens": [],
                "stop": True,
                "stop_type": "limit",
                "tokens_evaluated": len(body["prompt"]),
                "timings": {"cache_n": 0},
            }
        )
        return ScriptedBody(events, delay=pace_s, tail=b"")

    async def run() -> None:
        server, url = await Fake(respond).serve_tcp()
        print(url, flush=True)
        async with server:
            await server.serve_forever()

    asyncio.run(run())


def start_paced_fake(pace_s: float) -> tuple[subprocess.Popen, str]:
    process = subprocess.Popen(
        [sys.executable, __file__, "--serve-paced-fake", str(pace_s)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    return process, process.stdout.readline().strip()


async def measure(
    args: argparse.Namespace,
    gateway: LiveServer,
    upstream_url: str,
    results: dict[str, list[tuple[float, list[float]]]],
    cpu: dict[str, float],
) -> None:
    """Every rep: STREAMS requests through the gateway and the same work straight to the upstream (alternating
    which goes first), then a burst with 4x the tokens for the CPU split. Adds to `results` and `cpu`."""
    clients = Clients()
    try:
        await burst(clients, gateway.base_url, 2, 4)  # warm both paths (connections, tokenizer caches)
        # In front of llama-server (or the fake) the direct side sends the gateway's own upstream request: the
        # chat rendered by the gateway's /tokenize, with the adapter's body (completion_body). In front of a
        # second Deltafin it sends the same chat request.
        prompt_ids = None
        if args.upstream != "deltafin":
            answer = await clients.get(gateway.base_url).post(gateway.base_url + "/tokenize", json={"messages": PROMPT})
            prompt_ids = answer.json()["tokens"]
            await clients.after_burst(gateway.base_url)
        await burst(clients, upstream_url, 2, 4, prompt_ids)
        for rep in range(args.reps):
            order = ["direct", "gateway"] if rep % 2 == 0 else ["gateway", "direct"]
            for side in order:
                before = cpu_seconds(gateway.process.pid)
                if side == "direct":
                    results[side] += await burst(clients, upstream_url, args.streams, args.tokens, prompt_ids)
                else:
                    results[side] += await burst(clients, gateway.base_url, args.streams, args.tokens)
                    cpu["short"] += cpu_seconds(gateway.process.pid) - before
            # The gateway's CPU per request is a + b * tokens: a burst with 4x the tokens in every rep (the
            # machine's state drifts, so both sizes are sampled throughout) separates a and b.
            before = cpu_seconds(gateway.process.pid)
            await burst(clients, gateway.base_url, args.streams, 4 * args.tokens)
            cpu["long"] += (cpu_seconds(gateway.process.pid) - before) / (args.streams * args.reps)
    finally:
        await clients.aclose()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--upstream", choices=("llama-server", "deltafin", "fake", "paced-fake"), default="llama-server"
    )
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--pace-ms", type=float, default=20.0, help="paced-fake: the gap between two tokens")
    parser.add_argument("--upstream-threads", type=int, default=2, help="llama-server: its -t")
    parser.add_argument(
        "--stagger-ms",
        type=float,
        default=0.0,
        help="start stream i i*STAGGER ms after the first (0: a burst of STREAMS at once, whose median "
        "TTFT also waits for the requests ahead of it in every server on the way)",
    )
    parser.add_argument(
        "--pin",
        action="store_true",
        help="the upstream on CPU 0, the gateway and this client on the others: the gateway's CPU then "
        "delays its own streams (the latency it adds) instead of slowing the upstream's steps",
    )
    parser.add_argument(
        "--new-connections",
        action="store_true",
        help="a new connection for every request (default: each side's client keeps its connections "
        "alive, as the OpenAI SDK does; llama-server closes each streamed one anyway)",
    )
    parser.add_argument("--serve-paced-fake", type=float, help=argparse.SUPPRESS)
    args = parser.parse_args()
    global STAGGER_S, NEW_CONNECTIONS
    STAGGER_S = args.stagger_ms / 1000
    NEW_CONNECTIONS = args.new_connections
    if args.serve_paced_fake is not None:
        serve_paced_fake(args.serve_paced_fake)
        return
    if args.upstream == "fake":
        in_process(args.tokens)
        return

    stop_upstream = None
    all_cpus = os.sched_getaffinity(0)
    upstream_cpus = {min(all_cpus)} if args.pin and len(all_cpus) > 1 else None
    if upstream_cpus:
        os.sched_setaffinity(0, all_cpus - upstream_cpus)  # this client, and the gateway it starts below
    if args.upstream in ("llama-server", "paced-fake"):
        with pinned(upstream_cpus):
            if args.upstream == "llama-server":
                process, upstream_url = start_upstream_llama_server(args.streams, args.upstream_threads)
            else:
                process, upstream_url = start_paced_fake(args.pace_ms / 1000)
        stop_upstream = process.kill
        engine = ["engine=llama_server", f"engine.max_inflight={args.streams}"]
    else:
        with pinned(upstream_cpus):
            up = LiveServer(
                ["server.memo.entries=0", f"server.queue.max_waiting={args.streams}", "server.queue.timeout_s=600"]
            )
        up.wait_ready()
        stop_upstream, upstream_url = up.stop, up.base_url
        engine = ["engine=vllm", "engine.max_inflight=1"]
    gateway = LiveServer(
        [
            *engine,
            f"engine.url={upstream_url}",
            "server.memo.entries=0",
            f"server.queue.max_waiting={args.streams}",
            "server.queue.timeout_s=600",
        ]
    )
    results: dict[str, list[tuple[float, list[float]]]] = {"direct": [], "gateway": []}
    cpu = {"short": 0.0, "long": 0.0}
    try:
        gateway.wait_ready()
        asyncio.run(measure(args, gateway, upstream_url, results, cpu))
    finally:
        gateway.stop()
        stop_upstream()
    gateway_cpu, long_cpu = cpu["short"], cpu["long"]

    def summary(side: str) -> tuple[float, float, float]:
        ttft = statistics.median(r[0] for r in results[side])
        itl = statistics.median(statistics.mean(r[1]) for r in results[side] if r[1])
        # The second half of each stream: by then every request of the burst is decoding, whatever order and
        # spacing they reached the upstream in (the gateway sends them a render apart, the direct client at
        # once, and an upstream that prefills late arrivals between decode steps slows the early streams).
        steady = statistics.median(statistics.mean(r[1][len(r[1]) // 2 :]) for r in results[side] if len(r[1]) > 1)
        return ttft * 1000, itl * 1000, steady * 1000

    requests = args.streams * args.reps
    tokens = requests * args.tokens
    g_ttft, g_itl, g_steady = summary("gateway")
    print(
        f"upstream: {args.upstream}, streams: {args.streams}, tokens/request: {args.tokens}, reps: {args.reps}"
        + (f", upstream pinned to CPU {min(upstream_cpus)}" if upstream_cpus else "")
        + (f", streams started {args.stagger_ms:g} ms apart" if args.stagger_ms else "")
        + (", a new connection per request" if args.new_connections else "")
    )
    d_ttft, d_itl, d_steady = summary("direct")
    print(f"direct : TTFT median {d_ttft:8.1f} ms, inter-token median {d_itl:6.2f} ms (second half {d_steady:6.2f})")
    print(f"gateway: TTFT median {g_ttft:8.1f} ms, inter-token median {g_itl:6.2f} ms (second half {g_steady:6.2f})")
    print(
        f"overhead: TTFT {g_ttft - d_ttft:+.1f} ms per request, inter-token {g_itl - d_itl:+.3f} ms per token "
        f"(second half {g_steady - d_steady:+.3f})"
    )
    short_cpu = gateway_cpu / requests
    per_token = (long_cpu - short_cpu) / (3 * args.tokens)
    per_request = short_cpu - per_token * args.tokens
    print(
        f"gateway CPU: {short_cpu * 1000:.2f} ms per {args.tokens}-token request, {long_cpu * 1000:.2f} ms per "
        f"{4 * args.tokens}-token request ({requests} + {requests} requests, {tokens} + {4 * tokens} tokens)"
    )
    print(f"gateway CPU split: {per_request * 1000:.2f} ms per request + {per_token * 1000:.3f} ms per token")


if __name__ == "__main__":
    main()
