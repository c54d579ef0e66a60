"""Deltafin's hand-written parts against the library each stands beside, on the work each was written for.

- Incremental detokenization: the hand-written window of deltafin.engine.text.detokenizer (what a tokenizer
  without a direct Rust backend still uses) against tokenizers' `DecodeStream` (what a fast one now uses): text
  for each new token of a long answer, on the default model's tokenizer; the text each yields is checked equal,
  and the time per token compared.
- Chunked transfer decoding of an upstream's SSE stream: a Python decoder of the framing (the one
  deltafin.engine.upstream.http1 had; kept here as the baseline) against httptools' C parser
  (`HttpResponseParser`, the one uvicorn uses for requests), which ChunkedDecoder now wraps, fed the same reads.

    .venv/bin/python bench/handwritten.py [--tokens 4000] [--events 20000] [--reps 5]
"""

from __future__ import annotations

import argparse
import statistics
import time


def _tokenizer():
    from deltafin.config.compose import compose_config
    from deltafin.engine.weights.tokenizer_only import load_tokenizer_only

    return load_tokenizer_only(compose_config([]).model).tokenizer


def detokenizer(tokens: int, reps: int) -> dict[str, float]:
    from tokenizers.decoders import DecodeStream

    from deltafin.engine.text.detokenizer import IncrementalDetokenizer

    tokenizer = _tokenizer()
    text = "The capital of France is Paris. Café, naïve, 東京, emoji 🙂 and code: def f(x): return x ** 2\n" * 400
    ids = tokenizer(text, add_special_tokens=False).input_ids[:tokens]
    backend = tokenizer.backend_tokenizer

    def ours() -> str:
        detok = IncrementalDetokenizer(tokenizer)
        detok._stream = None  # the window, as for a tokenizer without a direct backend
        return "".join(detok.push(i) for i in ids)

    def library() -> str:
        stream = DecodeStream(skip_special_tokens=False)
        return "".join(piece or "" for piece in (stream.step(backend, i) for i in ids))

    assert ours() == library() == tokenizer.decode(ids), "the two disagree"
    return _time({"window (hand-written)": ours, "tokenizers.DecodeStream": library}, reps, len(ids))


def chunked(events: int, reps: int) -> dict[str, float]:
    import httptools

    event = b'data: {"id":"x","choices":[{"index":0,"text":" tok","token_ids":[1234]}]}\n\n'
    body = b"".join(b"%x\r\n%s\r\n" % (len(event), event) for _ in range(events)) + b"0\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    reads = [body[i : i + 4096] for i in range(0, len(body), 4096)]  # what one socket read brings
    expected = event * events

    def ours() -> bytes:
        return python_chunked(reads)

    def library() -> bytes:
        out: list[bytes] = []

        class Sink:
            def on_body(self, data: bytes) -> None:
                out.append(data)

        parser = httptools.HttpResponseParser(Sink())
        parser.feed_data(head)
        for data in reads:
            parser.feed_data(data)
        return b"".join(out)

    assert ours() == library() == expected, "the two disagree"
    return _time({"Python decoder": ours, "httptools": library}, reps, events)


def python_chunked(reads: list[bytes]) -> bytes:
    """Chunked coding undone in Python, one read at a time (size line, data, CRLF; trailers skipped)."""
    out: list[bytes] = []
    pending, left, state = b"", 0, "size"
    for data in reads:
        buf, pos = pending + data, 0
        while pos < len(buf):
            if state == "data":
                take = min(left, len(buf) - pos)
                out.append(buf[pos : pos + take])
                pos, left = pos + take, left - take
                state = "data" if left else "crlf"
                continue
            eol = buf.find(b"\n", pos)
            if eol < 0:
                break
            line, pos = buf[pos:eol].rstrip(b"\r"), eol + 1
            if state == "size":
                left = int(line.split(b";", 1)[0], 16)
                state = "data" if left else "trailer"
            elif state == "crlf":
                state = "size"
        pending = buf[pos:]
    return b"".join(out)


def _time(runs: dict, reps: int, units: int) -> dict[str, float]:
    """Median microseconds per unit (token or event) of each, the two alternating rep by rep."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            times[name].append((time.perf_counter() - started) / units * 1e6)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=4000)
    parser.add_argument("--events", type=int, default=20000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    for title, result in (
        ("detokenize, us per token", detokenizer(args.tokens, args.reps)),
        ("chunked SSE body, us per event", chunked(args.events, args.reps)),
    ):
        (ours, library) = result.items()
        print(f"{title}: {ours[0]} {ours[1]:.2f}, {library[0]} {library[1]:.2f}, ratio {ours[1] / library[1]:.2f}")


if __name__ == "__main__":
    main()
