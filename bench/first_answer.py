"""How the default model answers the README's question at several sampling settings (a quality count, not a
timing: no lock needed for its figures, though it keeps the CPU busy).

    .venv/bin/python bench/first_answer.py [--samples 40] [--max-tokens 96]

For "What is the capital of France? One word." and the bare "What is the capital of France?", each setting's
`--samples` answers (rows of one request, n at a time, through the real app and engine in process, memo off):
how many name Paris, and how many run to `--max-tokens` (a loop, for a one-line answer). Settings: the model's
own defaults (no sampling field: SmolLM2's card, temperature 0.2 / top-p 0.9), OpenAI's neutral defaults
(temperature 1), llama-server's defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05), greedy, and
greedy or the card's values with llama-server's min-p or a repetition penalty.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

QUESTIONS = ("What is the capital of France? One word.", "What is the capital of France?")
SETTINGS = {
    "model defaults (card: t=0.2, top_p=0.9)": {},
    "OpenAI neutral (t=1)": {"temperature": 1.0, "top_p": 1.0},
    "llama-server (t=0.8, top_k=40, top_p=0.95, min_p=0.05)": {
        "temperature": 0.8,
        "top_k": 40,
        "top_p": 0.95,
        "min_p": 0.05,
    },
    "card + min_p=0.05": {"min_p": 0.05},
    "card + repetition_penalty=1.1": {"repetition_penalty": 1.1},
    "greedy": {"temperature": 0},
    "greedy + min_p=0.05": {"temperature": 0, "min_p": 0.05},
    "greedy + repetition_penalty=1.1": {"temperature": 0, "repetition_penalty": 1.1},
    "greedy + repetition_penalty=1.05": {"temperature": 0, "repetition_penalty": 1.05},
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    from litestar.testing import TestClient

    from deltafin.app import build_app
    from deltafin.app.services import Services
    from deltafin.testing import compose_config

    config = compose_config(["server.memo.entries=0", "server.max_n=8", "server.queue.timeout_s=600"])
    with TestClient(build_app(config, Services.load(config))) as client:
        for question in QUESTIONS:
            print(f"\n{question!r}: Paris / loops ({args.samples} answers each; max_tokens {args.max_tokens})")
            for name, fields in SETTINGS.items():
                greedy = fields.get("temperature") == 0
                answers: list[tuple[str, str]] = []
                while len(answers) < (1 if greedy else args.samples):
                    n = 1 if greedy else min(8, args.samples - len(answers))
                    body = {
                        "messages": [{"role": "user", "content": question}],
                        "max_tokens": args.max_tokens,
                        "n": n,
                        **fields,
                    }
                    response = client.post("/v1/chat/completions", json=body)
                    response.raise_for_status()
                    for choice in response.json()["choices"]:
                        answers.append((choice["message"]["content"], choice["finish_reason"]))
                paris = sum("Paris" in text for text, _ in answers)
                loops = sum(reason == "length" for _, reason in answers)
                example = answers[0][0].replace("\n", " ")[:70]
                print(f"  {name:58s} {paris:3d} / {len(answers):3d}   loops {loops:3d}   e.g. {example!r}")


if __name__ == "__main__":
    main()
