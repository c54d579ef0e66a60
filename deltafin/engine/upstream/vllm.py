"""vLLM (and any server speaking vLLM's token-id completions, Deltafin included).

Primary: `POST /inference/v1/generate` (token ids in, token ids out; a stock `vllm serve` registers it only with
`--enable-scale-out` and answers 403 without). Fallback, chosen once when that endpoint is disabled (403) or absent
(404, 405), or set with `engine.api=completions`: `POST /v1/completions` with `prompt: list[int]` and
`return_token_ids: true`.
Either way no stop strings are sent (Deltafin matches them on the returned ids), special tokens are not skipped,
and logprobs come as "token_id:N" (`return_tokens_as_token_ids`) so they map back to ids exactly. A thinking
budget goes as vLLM's `thinking_token_budget`, until a server without a reasoning parser refuses it.
"""

from __future__ import annotations

import json
from typing import Any

import structlog

from deltafin.engine.events import GenerationJob, TokenLogprob
from deltafin.engine.upstream.engine import Adapter, UpstreamSettings
from deltafin.engine.upstream.sampling import common_knobs
from deltafin.engine.upstream.wire import Chunk, Garbled, error_event, id_from_token_string, token_logprob

log = structlog.get_logger("deltafin.upstream")

GENERATE = "/inference/v1/generate"
COMPLETIONS = "/v1/completions"
#: what the token-id endpoint answers where it cannot be used: disabled (403, a stock `vllm serve`: "Scale-out
#: endpoints are disabled. Restart vllm serve with --enable-scale-out"), absent (404), or another method (405)
UNUSABLE = frozenset({403, 404, 405})
#: what vLLM's 400 says of a thinking budget on a server without a reasoning parser ("thinking_token_budget is set
#: but reasoning_config is not configured. Please set --reasoning-config ...")
BUDGET_REFUSED = b"thinking_token_budget is set but"


class VllmAdapter(Adapter):
    engine = "vllm"

    def __init__(self, settings: UpstreamSettings, api: str = "auto") -> None:
        super().__init__(settings)
        # "auto" starts with the token-id endpoint and settles on completions if the server lacks it.
        self.path = COMPLETIONS if api == "completions" else GENERATE
        self._may_fall_back = api == "auto"
        #: a thinking budget goes as vLLM's own `thinking_token_budget` until the server refuses it (started
        #: without --reasoning-parser / --reasoning-config); Deltafin's own watch holds it from then on
        self.native_budget = True

    def fallback(self, status: int, path: str, body: bytes) -> bool:
        if status == 400 and BUDGET_REFUSED in body:
            if self.native_budget:
                self.native_budget = False
                log.warning(
                    "upstream_budget_fallback",
                    engine=self.engine,
                    upstream=self.settings.url,
                    answer=body[:300].decode("utf-8", "replace"),
                    hint="start vLLM with --reasoning-parser (or --reasoning-config) for its own thinking budget; "
                    "Deltafin stops and resumes generations at the budget meanwhile",
                )
            return True
        if not self._may_fall_back or path != GENERATE or status not in UNUSABLE:
            return False
        # Requests sent before the switch come back here too: each is retried once on completions, the switch
        # and its log line happen once.
        if self.path == GENERATE:
            self.path = COMPLETIONS
            log.warning(
                "upstream_api_fallback",
                engine=self.engine,
                upstream=self.settings.url,
                status=status,
                endpoint=COMPLETIONS,
                answer=body[:300].decode("utf-8", "replace"),
                hint="start vLLM with --enable-scale-out for /inference/v1/generate",
            )
        return True

    def request(self, job: GenerationJob, request_id: str, stop_ids: frozenset[int]) -> tuple[str, dict[str, Any]]:
        params = job.params
        knobs: dict[str, Any] = {
            **common_knobs(params),
            "max_tokens": params.max_tokens,
            "seed": params.seed,
            "logit_bias": {str(token): bias for token, bias in params.logit_bias} or None,
            "stop_token_ids": sorted(stop_ids),
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "logprobs": params.top_logprobs if params.logprobs else None,
        }
        if params.constraint is not None:
            knobs["structured_outputs"] = _structured(params.constraint.kind, params.constraint.value)
        if params.reasoning_budget is not None and self.native_budget:
            # past max_tokens a budget changes nothing; clamped, it stays a number any server takes
            knobs["thinking_token_budget"] = min(params.reasoning_budget.tokens, params.max_tokens)
        if self.path == GENERATE:
            body: dict[str, Any] = {
                "token_ids": list(job.prompt_ids),
                "sampling_params": knobs,
                "stream": True,
                "request_id": request_id,
            }
        else:
            body = {
                "prompt": list(job.prompt_ids),
                **knobs,
                "n": 1,
                "stream": True,
                "stream_options": {"include_usage": True, "continuous_usage_stats": False},
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
                "request_id": request_id,
            }
        if self.settings.model is not None:
            body["model"] = self.settings.model
        return self.path, body

    def parse(self, payload: Any, state: Any) -> Chunk:
        failed = error_event(self.engine, payload)
        if failed is not None:
            return failed
        chunk = Chunk()
        usage = payload.get("usage")
        if isinstance(usage, dict):
            chunk.prompt_tokens = usage.get("prompt_tokens")
            details = usage.get("prompt_tokens_details") or {}
            chunk.cached_tokens = details.get("cached_tokens") if isinstance(details, dict) else None
        choices = payload.get("choices")
        if not isinstance(choices, list):
            raise Garbled("vLLM sent a chunk without choices")
        if not choices:
            return chunk  # the usage-only chunk at the end
        choice = choices[0]
        ids = choice.get("token_ids")
        if ids is None and choice.get("text"):
            raise Garbled("vLLM sent text without token_ids (is it older than 0.10.2, without return_token_ids?)")
        chunk.token_ids = [int(i) for i in ids or ()]
        chunk.logprobs = _logprobs(choice.get("logprobs"))
        chunk.finish_reason = choice.get("finish_reason")
        chunk.stop_reason = choice.get("stop_reason")
        return chunk


def _structured(kind: str, value: str) -> dict[str, Any]:
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        return {"json": json.loads(value)}
    return {"structural_tag": value}  # vLLM takes the structural tag as a JSON string


def _logprobs(raw: Any) -> list[TokenLogprob | None]:
    """Both shapes vLLM answers: legacy completions (`tokens`/`token_logprobs`/`top_logprobs` dicts) and the
    chat-style `content` list of the generate endpoint."""
    if not raw:
        return []
    out: list[TokenLogprob | None] = []
    if isinstance(raw, dict) and "content" in raw:
        for entry in raw["content"] or ():
            token_id = entry.get("token_id", id_from_token_string(entry.get("token", "")))
            tops = [
                (t.get("token_id", id_from_token_string(t.get("token", ""))), t["logprob"])
                for t in entry.get("top_logprobs") or ()
            ]
            out.append(
                token_logprob(token_id, entry["logprob"], [(t, lp) for t, lp in tops if t is not None])
                if token_id is not None
                else None
            )
        return out
    tokens = raw.get("tokens") or ()
    values = raw.get("token_logprobs") or ()
    tops_list = raw.get("top_logprobs") or [None] * len(tokens)
    for token, value, tops in zip(tokens, values, tops_list):
        token_id = id_from_token_string(token)
        if token_id is None or value is None:
            out.append(None)
            continue
        top = [(id_from_token_string(t), lp) for t, lp in (tops or {}).items()]
        out.append(token_logprob(token_id, value, [(t, lp) for t, lp in top if t is not None]))
    return out
