"""The hardening attacks, one client per finding, against a real `python -m deltafin` on loopback, while a probe
(a streamed chat and /health every 100 ms) measures what the other clients feel.

    .venv/bin/python bench/attack.py responses      # previous_response_id on a 3.8 MB stored conversation (x4),
                                                    # and truncation: auto over 1,200 stored turns
    .venv/bin/python bench/attack.py parse          # /parse of 40,000 GLM tool calls (2.8 MB)
    .venv/bin/python bench/attack.py trailers       # 32 connections sending endless chunked trailers
    .venv/bin/python bench/attack.py store          # one key's 18 requests against another key's stored responses;
                                                    # a second process writing the same sqlite file
    .venv/bin/python bench/attack.py store-fail     # the sqlite store locked by another connection
    .venv/bin/python bench/attack.py prefill        # six long prompts, then a short request
    .venv/bin/python bench/attack.py grammar        # one key's 12 distinct slow schemas; another key's schema
    .venv/bin/python bench/attack.py all

Each prints one JSON object: the attack's own answers (statuses), the probe's largest /health latency and
inter-token gap during the attack, the 5xx count, and what the finding needs checked (a key's records kept,
RSS, the short request's wait). The verdict line says whether no other client froze over 2 s, no 5xx came
back, and nothing of one key was evicted by another. Run it under `flock /tmp/deltafin-bench.lock`.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

FREEZE_S = 2.0
STORY = "The lighthouse keeper climbed the stairs every evening, counting the steps and listening to the sea. "


class Probe:
    """Another client: one streamed chat (its inter-token gaps) and /health every 100 ms (its latency)."""

    def __init__(self, base_url: str, headers: dict[str, str] | None = None, max_tokens: int = 1000) -> None:
        self.base_url = base_url
        self.max_tokens = max_tokens  # within the attack's context (2,048 tokens for `responses`, 512 for `store`)
        self.headers = headers or {}
        self.arrivals: list[float] = []
        self.refused: list[int] = []  # the probe stream's own non-200 answers
        self.health: list[tuple[float, float, int]] = []  # (sent, latency, status)
        self.stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._stream, daemon=True),
            threading.Thread(target=self._poll, daemon=True),
        ]

    def __enter__(self) -> Probe:
        for thread in self._threads:
            thread.start()
        deadline = time.monotonic() + 120
        while len(self.arrivals) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        self.began = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.ended = time.perf_counter()
        self.stop.set()

    def _stream(self) -> None:
        body = {
            "messages": [{"role": "user", "content": "Count from one to a thousand."}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
        }
        while not self.stop.is_set():  # one stream after another, for as long as the attack lasts
            try:
                with httpx.Client(timeout=600, headers=self.headers) as client:
                    with client.stream("POST", f"{self.base_url}/v1/chat/completions", json=body) as response:
                        if response.status_code != 200:
                            self.refused.append(response.status_code)
                            time.sleep(1)
                            continue
                        for line in response.iter_lines():
                            if line.startswith("data: {"):
                                self.arrivals.append(time.perf_counter())
                            if self.stop.is_set():
                                return
            except httpx.HTTPError:
                time.sleep(0.1)

    def _poll(self) -> None:
        with httpx.Client(timeout=600) as client:
            while not self.stop.is_set():
                sent = time.perf_counter()
                try:
                    status = client.get(f"{self.base_url}/health").status_code
                except httpx.HTTPError:
                    status = 0
                self.health.append((sent, time.perf_counter() - sent, status))
                time.sleep(0.1)

    def report(self) -> dict[str, Any]:
        start, end = self.began, self.ended
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:]) if a < end and b > start]
        health = [latency for sent, latency, _ in self.health if start <= sent <= end]
        return {
            "stream_gap_max_s": round(max(gaps), 3) if gaps else None,
            "stream_gap_p50_s": round(statistics.median(gaps), 3) if gaps else None,
            "health_max_s": round(max(health), 3) if health else None,
            "health_polls": len(health),
            "health_5xx": sum(1 for sent, _, status in self.health if start <= sent <= end and status >= 500),
            "stream_refused": statuses(self.refused),
        }


def serve(overrides: list[str]) -> Any:
    from deltafin.testing import LiveServer

    live = LiveServer(overrides)
    live.wait_ready()
    return live


def statuses(codes: list[int]) -> dict[str, int]:
    return {str(code): count for code, count in sorted(Counter(codes).items())}


def parallel(calls: list[Callable[[], Any]]) -> list[Any]:
    results: list[Any] = [None] * len(calls)

    def run(i: int) -> None:
        try:
            results[i] = calls[i]()
        except Exception as exc:  # the attack's client failing is a result too
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def verdict(result: dict[str, Any]) -> dict[str, Any]:
    probe = result["probe"]
    froze = [v for v in (probe["stream_gap_max_s"], probe["health_max_s"]) if v is not None and v > FREEZE_S]
    answers = [result.get("statuses", {}), probe["stream_refused"]]
    fives = probe["health_5xx"] + sum(n for codes in answers for code, n in codes.items() if code.startswith("5"))
    result["verdict"] = {
        "no_freeze_over_2s": not froze,
        "no_5xx": fives == 0,
        "nothing_of_one_key_evicted_by_another": result.get("victim_records_kept", True),
    }
    return result


# --- 1. Responses: previous_response_id on a large stored conversation ---------------------------------------


def stored_conversation(path: Path, turns: int, turn_bytes: int) -> str:
    """A record of `turns` user/assistant turns written into a sqlite store before the server opens it."""
    from deltafin.serving.responses import store as stores

    if hasattr(stores, "Bounds"):
        store = stores.SqliteStore(str(path), stores.Bounds(1000, 1 << 30, 1000, 1 << 30))
    else:  # a Deltafin before per-key bounds (to measure the same attack on it, side by side)
        store = stores.SqliteStore(str(path), 1000, 1 << 30)
    context = []
    filler = (STORY * (turn_bytes // len(STORY) + 1))[:turn_bytes]
    for i in range(turns):
        context.append(
            {
                "type": "message",
                "id": f"msg_u{i}",
                "role": "user",
                "content": [{"type": "input_text", "text": f"{i} {filler}"}],
            }
        )
        context.append(
            {
                "type": "message",
                "id": f"msg_a{i}",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": f"Noted {i}.", "annotations": []}],
            }
        )
    rid = f"resp_stored{turns}"
    store.put("", rid, {"context": context, "input": [], "response": {"id": rid, "output": []}})
    store.close()
    return rid


def responses(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="attack-responses-"))
    big = stored_conversation(folder / "r.db", turns=1200 // args.scale, turn_bytes=3150)  # ~3.8 MB
    # a 2,048-token context: what the attack measures is the conversation's render, not the prefill of what fits
    live = serve(
        ["server.responses.store=sqlite", f"server.responses.path={folder / 'r.db'}", "model.context_length=2048"]
    )
    try:
        size = os.path.getsize(folder / "r.db")
        body = {"previous_response_id": big, "input": "And then?", "max_output_tokens": 4, "truncation": "auto"}
        with Probe(live.base_url) as probe:
            started = time.perf_counter()
            answers = parallel(
                [lambda: httpx.post(f"{live.base_url}/v1/responses", json=body, timeout=900) for _ in range(4)]
            )
            took = time.perf_counter() - started
        codes = [a.status_code if isinstance(a, httpx.Response) else 0 for a in answers]
        return verdict(
            {
                "finding": "1: previous_response_id on a 3.8 MB stored conversation, truncation auto, four at once",
                "store_file_mb": round(size / 1e6, 2),
                "statuses": statuses(codes),
                "attack_s": round(took, 1),
                "probe": probe.report(),
            }
        )
    finally:
        live.stop()


# --- 2. /parse of 40,000 GLM tool calls ----------------------------------------------------------------------


def parse(args: argparse.Namespace) -> dict[str, Any]:
    from deltafin.markup import MARKUPS
    from deltafin.tiny import write_tiny_model

    folder = Path(tempfile.mkdtemp(prefix="attack-parse-"))
    glm = write_tiny_model("glm", folder / "glm", variant="glm47")
    live = serve([f'+models.glm=["model=glm","model.path={glm}","model.variant=glm47","model.aliases=[]"]'])
    try:
        # the attack's shape: 40,000 small calls, 2.8 MB (under the 4 MiB body limit)
        text = MARKUPS["glm47"].write([("get", {"c": "x"}) for i in range(40000 // args.scale)])
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "get",
                    "parameters": {
                        "type": "object",
                        "properties": {"c": {"type": "string"}},
                    },
                },
            }
        ]
        with Probe(live.base_url) as probe:
            started = time.perf_counter()
            answer = httpx.post(
                f"{live.base_url}/parse", json={"model": "glm", "text": text, "tools": tools}, timeout=900
            )
            took = time.perf_counter() - started
        calls = len(answer.json()["message"]["tool_calls"]) if answer.status_code == 200 else None
        return verdict(
            {
                "finding": "2: /parse of 40,000 GLM calls",
                "text_mb": round(len(text) / 1e6, 2),
                "statuses": statuses([answer.status_code]),
                "calls_parsed": calls,
                "parse_s": round(took, 2),
                "probe": probe.report(),
            }
        )
    finally:
        live.stop()


# --- 3. Chunked trailers -------------------------------------------------------------------------------------


def rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmRSS:"))


def trailers(args: argparse.Namespace) -> dict[str, Any]:
    live = serve([])
    try:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\nX-T: "
        )
        answers: list[bytes] = []
        before = peak = rss(live.process.pid)

        def endless() -> None:
            sock = socket.create_connection(("127.0.0.1", live.port), timeout=30)
            try:
                sock.sendall(head)
                deadline = time.monotonic() + 10.5 / args.scale
                while time.monotonic() < deadline:
                    sock.sendall(b"a" * 65536)
            except OSError:
                pass
            try:
                answers.append(sock.recv(200))
            except OSError:
                answers.append(b"")
            sock.close()

        with Probe(live.base_url) as probe:
            threads = [threading.Thread(target=endless) for _ in range(32 // args.scale)]
            for thread in threads:
                thread.start()
            while any(thread.is_alive() for thread in threads):
                peak = max(peak, rss(live.process.pid))
                time.sleep(0.1)
        codes = [int(a.split(b" ")[1]) if a.startswith(b"HTTP/1.1 ") else 0 for a in answers]
        return verdict(
            {
                "finding": "3: 32 connections sending endless chunked trailers for 10.5 s",
                "statuses": statuses(codes),
                "rss_growth_mb": round((peak - before) / 2**20, 1),
                "probe": probe.report(),
            }
        )
    finally:
        live.stop()


# --- 4. The response store's bounds per key, and two processes on one file ----------------------------------


def store(args: argparse.Namespace) -> dict[str, Any]:
    """mallory floods the store with large conversations (each stored whole, however truncation cut its
    prompt), under a 2 MiB store (1 MiB a key); alice's three small responses must survive it."""
    folder = Path(tempfile.mkdtemp(prefix="attack-store-"))
    path = folder / "r.db"
    overrides = [
        "server.api_keys=[alice,mallory]",
        "server.responses.max_bytes=2097152",
        "model.context_length=512",  # each flood request prefills what fits: the attack is the store, not the engine
        "server.responses.store=sqlite",
        f"server.responses.path={path}",
    ]
    live = serve(overrides)
    try:
        base = live.base_url

        def ask(key: str, conversation: Any) -> httpx.Response:
            body = {"input": conversation, "max_output_tokens": 1, "temperature": 0, "truncation": "auto"}
            return httpx.post(
                f"{base}/v1/responses", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=900
            )

        alice = [ask("alice", f"Remember {i}.").json()["id"] for i in range(3)]
        turn = STORY * 30  # ~3 KB
        flood_input = [
            item
            for i in range(100)
            for item in ({"role": "user", "content": f"{i} {turn}"}, {"role": "assistant", "content": "ok"})
        ] + [{"role": "user", "content": "And?"}]
        with Probe(base, {"Authorization": "Bearer alice"}, max_tokens=400) as probe:
            flood = [ask("mallory", flood_input) for _ in range(18 // args.scale)]
            # a second process writing the same file (its own connection, as another server would)
            script = (
                "import sys\nfrom deltafin.serving.responses.store import Bounds, SqliteStore\n"
                "s = SqliteStore(sys.argv[1], Bounds(1000, 2097152, 1000, 1048576))\n"
                "r = {'response': {'id': 'r', 'output': []}, 'input': [], 'context': [], 'pad': 'p' * 100000}\n"
                "[s.put('other-process', f'o{i}', r) for i in range(30)]\n"
            )
            env = {**os.environ, "PYTHONPATH": str(REPO)}
            subprocess.run([sys.executable, "-c", script, str(path)], cwd=REPO, check=True, timeout=300, env=env)
            after = ask("alice", "One more.")
        kept = [
            httpx.get(f"{base}/v1/responses/{rid}", headers={"Authorization": "Bearer alice"}, timeout=60).status_code
            == 200
            for rid in alice
        ]
        rows, size = sqlite3.connect(path).execute("SELECT count(*), sum(size) FROM deltafin_responses").fetchone()
        stored = [a.json().get("store") for a in flood if a.status_code == 200]
        codes = [a.status_code for a in flood] + [after.status_code]
        return verdict(
            {
                "finding": "4: one key's 18 requests (0.6 MB conversations, stored whole) vs another key's 3 stored "
                "responses in a 2 MiB store; a second process writing 30 records of 0.1 MB into the same file",
                "statuses": statuses(codes),
                "flood_stored": sum(1 for s in stored if s),
                "victim_records_kept": all(kept),
                "file_rows": rows,
                "file_bytes": size,
                "bound_bytes": 2097152,
                "probe": probe.report(),
            }
        )
    finally:
        live.stop()


def store_fail(args: argparse.Namespace) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix="attack-storefail-"))
    path = folder / "r.db"
    live = serve(["server.responses.store=sqlite", f"server.responses.path={path}"])
    try:
        base = live.base_url
        rid = httpx.post(f"{base}/v1/responses", json={"input": "hi", "max_output_tokens": 2}, timeout=120).json()["id"]
        with Probe(base) as probe:
            other = sqlite3.connect(path, isolation_level=None)
            other.execute("BEGIN IMMEDIATE")  # another process's write, held for the whole attack
            answers = parallel(
                [
                    lambda: httpx.post(
                        f"{base}/v1/responses", json={"input": "hi", "max_output_tokens": 2}, timeout=120
                    )
                    for _ in range(3)
                ]
                + [
                    lambda: httpx.post(
                        f"{base}/v1/responses",
                        json={"input": "hi", "max_output_tokens": 2, "stream": True},
                        timeout=120,
                    )
                ]
            )
            other.execute("ROLLBACK")
            damaged = sqlite3.connect(path)
            damaged.execute("UPDATE deltafin_responses SET body = x'7b6e6f74' WHERE id = ?", (rid,))
            damaged.commit()
            read = httpx.get(f"{base}/v1/responses/{rid}", timeout=60)
        codes = [a.status_code if isinstance(a, httpx.Response) else 0 for a in answers] + [read.status_code]
        stored = [a.json().get("store") for a in answers[:3] if isinstance(a, httpx.Response) and a.status_code == 200]
        stream_end = answers[3].text.strip().splitlines()[-1] if isinstance(answers[3], httpx.Response) else ""
        return verdict(
            {
                "finding": "5: the sqlite store locked by another connection; then a damaged stored record",
                "statuses": statuses(codes),
                "answers_marked_store_false": stored,
                "stream_last_event": json.loads(stream_end[len("data: ") :])["type"]
                if stream_end.startswith("data: ")
                else stream_end,
                "damaged_record_status": read.status_code,
                "probe": probe.report(),
            }
        )
    finally:
        live.stop()


# --- 6. Admission by tokens ----------------------------------------------------------------------------------


def prefill(args: argparse.Namespace) -> dict[str, Any]:
    live = serve([f"server.queue.timeout_s={args.queue_timeout_s}"])
    try:
        base = live.base_url
        text = STORY * max(1, args.prompt_tokens // 20)
        long_codes: list[int] = []

        def long(i: int) -> None:
            body = {"messages": [{"role": "user", "content": f"{i} {text}"}], "max_tokens": 1}
            long_codes.append(httpx.post(f"{base}/v1/chat/completions", json=body, timeout=1800).status_code)

        with Probe(base) as probe:
            threads = [threading.Thread(target=long, args=(i,)) for i in range(max(2, 6 // args.scale))]
            for thread in threads:
                thread.start()
            time.sleep(3)  # the long prompts are admitted and prefilling
            started = time.perf_counter()
            first: float | None = None
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "stream": True}
            with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=600) as short:
                for line in short.iter_lines():
                    if first is None and line.startswith("data: {") and '"content": ""' not in line:
                        first = time.perf_counter()
            short_s = time.perf_counter() - started
            for thread in threads:
                thread.join()
        return verdict(
            {
                "finding": f"6: six ~{args.prompt_tokens}-token prompts, then an 8-token chat",
                "statuses": statuses([short.status_code]),
                "long_prompts": statuses(long_codes),
                "short_request_ttft_s": round(first - started, 2) if first else None,
                "short_request_s": round(short_s, 2),
                "probe": probe.report(),
            }
        )
    finally:
        live.stop()


# --- 7. Grammar workers under load ---------------------------------------------------------------------------


def grammar(args: argparse.Namespace) -> dict[str, Any]:
    live = serve(["server.api_keys=[alice,mallory]"])
    try:
        base = live.base_url

        def chat(key: str, schema: dict | None, tokens: int = 8) -> tuple[int, float]:
            body: dict[str, Any] = {"messages": [{"role": "user", "content": "JSON please"}], "max_tokens": tokens}
            if schema is not None:
                body["response_format"] = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
            started = time.perf_counter()
            response = httpx.post(
                f"{base}/v1/chat/completions", json=body, headers={"Authorization": f"Bearer {key}"}, timeout=900
            )
            return response.status_code, time.perf_counter() - started

        slow = [
            {"type": "object", "properties": {f"p{k}_{i}": {"type": "string"} for i in range(3000 // args.scale)}}
            for k in range(12 // args.scale)
        ]
        with Probe(base, {"Authorization": "Bearer alice"}) as probe:
            results: list[Any] = []
            flood = threading.Thread(
                target=lambda: results.extend(parallel([lambda s=s: chat("mallory", s) for s in slow]))
            )
            flood.start()
            time.sleep(2)  # the slow schemas are queued and compiling
            legit = chat("alice", {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]})
            plain = chat("alice", None)
            flood.join()
        codes = [r[0] if isinstance(r, tuple) else 0 for r in results] + [legit[0], plain[0]]
        return verdict(
            {
                "finding": "7: one key's 12 distinct slow schemas (3,000 optional properties each); another key's "
                "schema and 8-token chat",
                "statuses": statuses(codes),
                "flood_statuses": statuses(codes[:-2]),  # the slow schemas' key: past its queue, 429
                "legit_schema": {"status": legit[0], "s": round(legit[1], 2)},
                "plain_chat": {"status": plain[0], "s": round(plain[1], 2)},
                "probe": probe.report(),
            }
        )
    finally:
        live.stop()


ATTACKS = {
    "responses": responses,
    "parse": parse,
    "trailers": trailers,
    "store": store,
    "store-fail": store_fail,
    "prefill": prefill,
    "grammar": grammar,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("attack", choices=[*ATTACKS, "all"])
    parser.add_argument("--prompt-tokens", type=int, default=6000, help="prefill: each long prompt's size")
    parser.add_argument("--queue-timeout-s", type=float, default=30.0, help="prefill: server.queue.timeout_s")
    parser.add_argument("--scale", type=int, default=1, help="divide every attack's size by this (a quick check)")
    args = parser.parse_args()
    for name in ATTACKS if args.attack == "all" else [args.attack]:
        print(json.dumps({"attack": name, **ATTACKS[name](args)}), flush=True)


if __name__ == "__main__":
    main()
