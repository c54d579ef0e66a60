"""Speculative decoding on the default model: Deltafin with `engine.speculative.method=ngram` against the same
config without speculation and against llama-server with its own n-gram speculation, on the same GGUF, in one run.

    .venv/bin/python bench/speculative.py [--reps 3] [--streams 8] [--llama-types ngram-simple ngram-map-k ...]

Every server is started first (Deltafin without speculation, Deltafin with n-gram speculation, llama-server
without speculation and once per `--spec-type` tried), then the requests go round-robin over them, `--reps`
times, so slow and quiet moments of the machine are shared; figures are medians (llama-server's n-gram kinds
are tried once each first, and the best per task is the one repeated). Single stream, through the chat
endpoint, greedy:
- copy-heavy: an agent's edit, the ~300-token function of COPY renamed (`max_tokens` 400, the model stops where
  it stops: every Deltafin gives the same tokens, llama-server nearly the same);
- open-ended: a story (`max_tokens` 256, `ignore_eos`).
Completion tokens over the request's wall time (its short prefill included; both servers reuse the repeated
prompt's cache), and over the CPU time the server process spent on it (/proc: what the request costs whatever
else the machine runs; spinning threads count too). Then `--streams` concurrent copy-heavy requests (each a different rename) on the two Deltafins:
total completion tokens over the wall time. Acceptance comes from the Deltafin request log lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from deltafin.engine.weights.paths import resolve_model_path  # noqa: E402
from deltafin.testing import LiveServer, compose_config  # noqa: E402
from deltafin.testing.llama_server import llama_server_binary, start_llama_server  # noqa: E402

FUNCTION = '''def summarize_orders(orders, tax_rate, discount_codes):
    """Return the subtotal, discount, tax and total of a list of orders."""
    subtotal = 0.0
    discount = 0.0
    for order in orders:
        for line in order["lines"]:
            price = float(line["unit_price"])
            quantity = int(line["quantity"])
            subtotal += price * quantity
        code = order.get("discount_code")
        if code is not None and code in discount_codes:
            rate = discount_codes[code]
            discount += subtotal * rate
    taxable = max(subtotal - discount, 0.0)
    tax = round(taxable * tax_rate, 2)
    total = round(taxable + tax, 2)
    report = {
        "orders": len(orders),
        "subtotal": round(subtotal, 2),
        "discount": round(discount, 2),
        "tax": tax,
        "total": total,
    }
    if total > 1000:
        report["note"] = "large order: check stock before shipping"
    elif total == 0:
        report["note"] = "empty order: nothing to ship"
    return report
'''
SYSTEM = "You are a careful refactoring assistant. Answer with the complete rewritten code only."
NEW_NAMES = ["order_summary", "summarize_sales", "orders_report", "compute_totals", "tally_orders", "order_totals",
             "sales_summary", "report_orders"]  # fmt: skip
STORY = "Write a detailed story about a lighthouse keeper who finds a message in a bottle."
#: llama-server's n-gram kinds (`--spec-type`, its own defaults), and one with n-gram sizes like Deltafin's
LLAMA_KINDS = {
    "ngram-simple": ["--spec-type", "ngram-simple"],
    "ngram-simple n=3 m=16": [
        "--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "16",
    ],
    "ngram-map-k": ["--spec-type", "ngram-map-k"],
    "ngram-map-k4v": ["--spec-type", "ngram-map-k4v"],
    "ngram-mod": ["--spec-type", "ngram-mod"],
    "ngram-cache": ["--spec-type", "ngram-cache"],
}  # fmt: skip


def copy_messages(name: str = NEW_NAMES[0]) -> list[dict]:
    task = f"Rename the function summarize_orders to {name} and change nothing else:\n\n```python\n{FUNCTION}```"
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def chat(base: str, messages: list[dict], tokens: int, *, ignore_eos: bool = False) -> tuple[int, float, str]:
    """(completion tokens, seconds, request id) of one greedy chat request."""
    request_id = uuid.uuid4().hex
    body = {"messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": ignore_eos}
    started = time.perf_counter()
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=3600, headers={"x-request-id": request_id})
    seconds = time.perf_counter() - started
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"], seconds, request_id


def measured(base: str, pid: int, messages: list[dict], tokens: int, ignore_eos: bool) -> tuple[float, float, str]:
    """(tokens per wall second, tokens per CPU second of the server process, request id)."""
    cpu = cpu_seconds(pid)
    count, seconds, request_id = chat(base, messages, tokens, ignore_eos=ignore_eos)
    return count / seconds, count / max(cpu_seconds(pid) - cpu, 1e-6), request_id


def streams(base: str, count: int) -> float:
    """Total completion tokens over wall time, `count` copy-heavy requests at once (each its own rename)."""
    counts = [0] * count

    def client(i: int) -> None:
        counts[i] = chat(base, copy_messages(NEW_NAMES[i % len(NEW_NAMES)]), 400)[0]

    threads = [threading.Thread(target=client, args=(i,)) for i in range(count)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / (time.perf_counter() - started)


TASKS = {
    "copy-heavy": (copy_messages(), 400, False),
    "open-ended": ([{"role": "user", "content": STORY}], 256, True),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--llama-types", nargs="*", default=list(LLAMA_KINDS), help="llama-server kinds to try")
    args = parser.parse_args()
    common = ["server.memo.entries=0", "server.queue.timeout_s=3600", "server.queue.max_waiting=64"]
    deltafins = {
        "deltafin none": LiveServer([*common, "engine.speculative.method=none"]),
        "deltafin ngram": LiveServer([*common, "engine.speculative.method=ngram"]),
    }
    llamas: dict[str, tuple] = {}
    try:
        for server in deltafins.values():
            server.wait_ready(timeout=600)
        servers = {name: (server.base_url, server.process.pid) for name, server in deltafins.items()}
        if llama_server_binary().exists():
            gguf = resolve_model_path(compose_config().model.path)
            for name in ["none", *args.llama_types]:
                extra = [] if name == "none" else LLAMA_KINDS[name]
                process, base = start_llama_server(gguf, parallel=1, context=4096, threads=2, ready_s=600, extra=extra)
                llamas[f"llama-server {name}"] = (process, base)
                servers[f"llama-server {name}"] = (base, process.pid)
        else:
            print(f"llama-server not found at {llama_server_binary()} (scripts/build-llama-server): no comparison")
        for base, _ in servers.values():  # warm-up: kernels, the prompt caches
            for messages, _, _ in TASKS.values():
                chat(base, messages, 4)
        # llama-server's kinds, once each: the best per task joins the repeated measurements
        best: dict[str, str] = {}
        for task, (messages, tokens, ignore_eos) in TASKS.items():
            tried = {
                name: measured(base, pid, messages, tokens, ignore_eos)[0]
                for name, (base, pid) in servers.items()
                if name.startswith("llama-server ngram")
            }
            print(f"screening, {task}: " + json.dumps({k: round(v, 1) for k, v in tried.items()}), flush=True)
            if tried:
                best[task] = max(tried, key=tried.get)  # type: ignore[arg-type]
        wall: dict[tuple[str, str], list[float]] = {}
        cpu: dict[tuple[str, str], list[float]] = {}
        acceptance: dict[str, list[float]] = {}
        for rep in range(args.reps):
            for task, (messages, tokens, ignore_eos) in TASKS.items():
                names = [
                    "deltafin none",
                    "deltafin ngram",
                    *(["llama-server none", best[task]] if task in best else []),
                ]
                for name in names if rep % 2 == 0 else names[::-1]:
                    base, pid = servers[name]
                    per_wall, per_cpu, request_id = measured(base, pid, messages, tokens, ignore_eos)
                    wall.setdefault((task, name), []).append(per_wall)
                    cpu.setdefault((task, name), []).append(per_cpu)
                    if name == "deltafin ngram":
                        line = deltafins[name].request_log(request_id)
                        acceptance.setdefault(task, []).append(line.get("spec_acceptance", 0.0))
                    print(f"rep {rep} {task} {name}: {per_wall:.1f} tok/s, {per_cpu:.1f} tok/CPU-s", flush=True)
        stream_rates: dict[str, list[float]] = {}
        for rep in range(args.reps):
            order = list(deltafins.items()) if rep % 2 == 0 else list(deltafins.items())[::-1]
            for name, server in order:
                stream_rates.setdefault(name, []).append(streams(server.base_url, args.streams))
                print(f"rep {rep} {args.streams} streams {name}: {stream_rates[name][-1]:.1f} tok/s", flush=True)
    finally:
        for server in deltafins.values():
            server.stop()
        for process, _ in llamas.values():
            process.terminate()
            process.wait(timeout=15)

    print(f"reps {args.reps}, load average {os.getloadavg()[0]:.1f}")
    for label, rates in (("wall", wall), ("CPU", cpu)):
        median = {key: statistics.median(values) for key, values in rates.items()}
        print(f"{label} figures: " + json.dumps({f"{t} | {n}": round(v, 1) for (t, n), v in median.items()}))
        for task in TASKS:
            own, none = median[(task, "deltafin ngram")], median[(task, "deltafin none")]
            line = f"{label}, {task}: deltafin ngram / none {own / none:.2f}x"
            if task in best:
                line += (f", / llama-server's best n-gram kind ({best[task]}) {own / median[(task, best[task])]:.2f}x"
                         f", llama-server none / deltafin none {median[(task, 'llama-server none')] / none:.2f}x")  # fmt: skip
            print(line + f" (acceptance {statistics.median(acceptance.get(task, [0.0])):.2f})")
    own, none = statistics.median(stream_rates["deltafin ngram"]), statistics.median(stream_rates["deltafin none"])
    print(f"{args.streams} streams, copy-heavy: deltafin ngram {own:.1f} tok/s, none {none:.1f}: {own / none:.2f}x")


if __name__ == "__main__":
    main()
