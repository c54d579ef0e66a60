"""llama.cpp's `llama-server`: `POST /completion` with a token-id prompt, `tokens` and `n_probs` back.

Its sampling defaults are not neutral (DRY, top-k 40, top-p 0.95, min-p 0.05, a repeat penalty window of 64), so every
knob is sent, and the sampler chain is named so nothing else runs. It has no `stop_token_ids`: Deltafin's
decoder stops on the family's stop ids itself and closes the request, which llama-server aborts.
"""

from __future__ import annotations

import json
from typing import Any

from deltafin.engine.events import GenerationJob, TokenLogprob
from deltafin.engine.upstream.engine import Adapter
from deltafin.engine.upstream.wire import Chunk, Garbled, error_event, token_logprob
from deltafin.errors import InvalidRequestError

#: the samplers Deltafin's parameters describe, in llama.cpp's order; penalties first as in the local engine
SAMPLERS = ["penalties", "top_k", "top_p", "min_p", "temperature"]


class LlamaServerAdapter(Adapter):
    engine = "llama_server"

    def request(self, job: GenerationJob, request_id: str, stop_ids: frozenset[int]) -> tuple[str, dict[str, Any]]:
        params = job.params
        body: dict[str, Any] = {
            "prompt": list(job.prompt_ids),
            "n_predict": params.max_tokens,
            "stream": True,
            "return_tokens": True,
            "cache_prompt": True,
            "samplers": SAMPLERS,
            "temperature": params.temperature,
            "top_k": params.top_k,  # 0 = off in llama.cpp too
            "top_p": params.top_p,
            "min_p": params.min_p,
            "typical_p": 1.0,
            "repeat_penalty": params.repetition_penalty,
            # prompt + output, the window of the HF-style penalty Deltafin documents (-1 is refused by newer servers)
            "repeat_last_n": len(job.prompt_ids) + params.max_tokens,
            "presence_penalty": params.presence_penalty,
            "frequency_penalty": params.frequency_penalty,
            "dry_multiplier": 0.0,
            "xtc_probability": 0.0,
            "top_n_sigma": -1.0,
            "mirostat": 0,
            "seed": params.seed if params.seed is not None else -1,
            "ignore_eos": params.ignore_eos,
            "logit_bias": [[token, bias] for token, bias in params.logit_bias],
            "n_probs": params.top_logprobs if params.logprobs else 0,
            "post_sampling_probs": False,
        }
        if params.logprobs and params.top_logprobs == 0:
            body["n_probs"] = 1  # llama-server reports the chosen token's logprob only alongside alternatives
        if params.constraint is not None:
            kind, value = params.constraint.kind, params.constraint.value
            if kind == "json_object":
                body["json_schema"] = {"type": "object"}
            elif kind == "json_schema":
                body["json_schema"] = json.loads(value)
            else:
                # A structural tag (an enforced tool call, reasoning then JSON) is xgrammar's own format;
                # llama-server reads GBNF only, so it is refused rather than sent and misread.
                raise InvalidRequestError(
                    "Enforced tool calls (tool_choice `required` or a named function) and response_format with "
                    "reasoning are not available through a llama-server upstream; use tool_choice `auto`.",
                    param="tool_choice",
                )
        return "/completion", body

    def new_state(self, job: GenerationJob) -> int:
        return job.params.top_logprobs  # alternatives asked for (n_probs is at least 1, see above)

    def parse(self, payload: Any, state: int) -> Chunk:
        failed = error_event(self.engine, payload)
        if failed is not None:
            return failed
        if "tokens" not in payload and "stop" not in payload:
            raise Garbled("llama-server sent an event without tokens / stop")
        chunk = Chunk(token_ids=[int(t) for t in payload.get("tokens") or ()])
        chunk.logprobs = _logprobs(payload.get("completion_probabilities"), state)
        if payload.get("stop"):
            stop_type = payload.get("stop_type")
            chunk.finish_reason = "length" if stop_type == "limit" else "stop"
            chunk.stop_reason = payload.get("stopping_word") or None
            chunk.prompt_tokens = payload.get("tokens_evaluated")
            timings = payload.get("timings") or {}
            chunk.cached_tokens = timings.get("cache_n")
        return chunk


def _logprobs(raw: Any, top_k: int) -> list[TokenLogprob | None]:
    if not raw:
        return []
    out: list[TokenLogprob | None] = []
    for entry in raw:
        if "logprob" not in entry:  # post-sampling probabilities are not logprobs; never asked for
            out.append(None)
            continue
        tops = [(t["id"], t["logprob"]) for t in entry.get("top_logprobs") or () if "id" in t][:top_k]
        out.append(token_logprob(entry["id"], entry["logprob"], tops))
    return out
