"""Speculative decoding on the default model: Deltafin with `engine.speculative.method=ngram` against the same
config without speculation and against llama-server with its own n-gram speculation, on the same GGUF, in one run.

    .venv/bin/python bench/speculative.py [--reps 3] [--streams 8] [--llama-types ngram-simple ngram-map-k ...]

Every server is started first (Deltafin without speculation, Deltafin with n-gram speculation, llama-server
without speculation and once per `--spec-type` tried), then the requests go round-robin over them, `--reps`
times, so slow and quiet moments of the machine are shared; figures are medians. Single stream, through the
chat endpoint, greedy:
- copy-heavy: an agent's edit, the ~300-token function of COPY renamed (`max_tokens` 400, the model stops where
  it stops: every Deltafin gives the same tokens, llama-server nearly the same);
- open-ended: a story (`max_tokens` 256, `ignore_eos`).
Completion tokens over the request's wall time (its short prefill included; both servers reuse the repeated
prompt's cache). Then `--streams` concurrent copy-heavy requests (each a different rename) on the two Deltafins:
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


def chat(base: str, messages: list[dict], tokens: int, *, ignore_eos: bool = False) -> tuple[int, float, str]:
    """(completion tokens, seconds, request id) of one greedy chat request."""
    request_id = uuid.uuid4().hex
    body = {"messages": messages, "max_tokens": tokens, "temperature": 0, "ignore_eos": ignore_eos}
    started = time.perf_counter()
    response = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=900, headers={"x-request-id": request_id})
    seconds = time.perf_counter() - started
    response.raise_for_status()
    return response.json()["usage"]["completion_tokens"], seconds, request_id


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--llama-types", nargs="*", default=list(LLAMA_KINDS), help="llama-server kinds to try")
    args = parser.parse_args()
    common = ["server.memo.entries=0", "server.queue.timeout_s=900", "server.queue.max_waiting=64"]
    deltafins = {
        "deltafin none": LiveServer(common),
        "deltafin ngram": LiveServer([*common, "engine.speculative.method=ngram"]),
    }
    llamas: dict[str, tuple] = {}
    try:
        for server in deltafins.values():
            server.wait_ready(timeout=600)
        if llama_server_binary().exists():
            gguf = resolve_model_path(compose_config().model.path)
            for name in ["none", *args.llama_types]:
                extra = [] if name == "none" else LLAMA_KINDS[name]
                llamas[f"llama-server {name}"] = start_llama_server(
                    gguf, parallel=1, context=4096, threads=2, ready_s=600, extra=extra
                )
        else:
            print(f"llama-server not found at {llama_server_binary()} (scripts/build-llama-server): no comparison")
        bases = {name: server.base_url for name, server in deltafins.items()}
        bases.update({name: base for name, (_, base) in llamas.items()})
        tasks = {
            "copy-heavy": (copy_messages(), 400, False),
            "open-ended": ([{"role": "user", "content": STORY}], 256, True),
        }
        for base in bases.values():  # warm-up: kernels, the prompt caches
            for messages, _, _ in tasks.values():
                chat(base, messages, 4)
        rates: dict[tuple[str, str], list[float]] = {}
        acceptance: dict[str, list[float]] = {}
        for rep in range(args.reps):
            for task, (messages, tokens, ignore_eos) in tasks.items():
                order = list(bases.items())
                order = order if rep % 2 == 0 else order[::-1]
                for name, base in order:
                    count, seconds, request_id = chat(base, messages, tokens, ignore_eos=ignore_eos)
                    rates.setdefault((task, name), []).append(count / seconds)
                    if name == "deltafin ngram":
                        line = deltafins[name].request_log(request_id)
                        acceptance.setdefault(task, []).append(line.get("spec_acceptance", 0.0))
        stream_rates: dict[str, list[float]] = {}
        for rep in range(args.reps):
            order = list(deltafins.items()) if rep % 2 == 0 else list(deltafins.items())[::-1]
            for name, server in order:
                stream_rates.setdefault(name, []).append(streams(server.base_url, args.streams))
    finally:
        for server in deltafins.values():
            server.stop()
        for process, _ in llamas.values():
            process.terminate()
            process.wait(timeout=15)

    median = {key: statistics.median(values) for key, values in rates.items()}
    print(f"reps {args.reps}, load average {os.getloadavg()[0]:.1f}")
    print("figures: " + json.dumps({f"{t} | {n}": round(v, 1) for (t, n), v in median.items()}))
    for task in ("copy-heavy", "open-ended"):
        own, none = median[(task, "deltafin ngram")], median[(task, "deltafin none")]
        print(f"{task}: deltafin ngram {own:.1f} tok/s, none {none:.1f}: {own / none:.2f}x "
              f"(acceptance {statistics.median(acceptance.get(task, [0.0])):.2f})")  # fmt: skip
        speculating = {n: v for (t, n), v in median.items() if t == task and n.startswith("llama-server ngram")}
        if speculating:
            best = max(speculating, key=speculating.get)  # type: ignore[arg-type]
            print(f"  llama-server's best n-gram kind here: {best} {speculating[best]:.1f} tok/s: "
                  f"{own / speculating[best]:.2f}x; llama-server none {median[(task, 'llama-server none')]:.1f}")  # fmt: skip
    own, none = statistics.median(stream_rates["deltafin ngram"]), statistics.median(stream_rates["deltafin none"])
    print(f"{args.streams} streams, copy-heavy: deltafin ngram {own:.1f} tok/s, none {none:.1f}: {own / none:.2f}x")


if __name__ == "__main__":
    main()
