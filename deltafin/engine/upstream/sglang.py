"""SGLang's native `POST /generate` with `input_ids`.

Quirks handled here: streams are cumulative by default (each event repeats every id so far; with
`--incremental-streaming-output` they carry only the new ones; both are read correctly, told apart by
`meta_info.completion_tokens`); errors can arrive inside a 200 stream (`{"error": ...}` or a finish of type
"abort"); a client that leaves is aborted with `POST /abort_request {"rid"}` so the KV cache is freed at once.
SGLang reports logprobs after temperature scaling unless started with `--return-original-logprob`
(docs/gateway.md).
"""

from __future__ import annotations

import json
from typing import Any

from deltafin.engine.events import GenerationJob, TokenLogprob
from deltafin.engine.upstream.engine import Adapter
from deltafin.engine.upstream.sampling import common_knobs
from deltafin.engine.upstream.wire import Chunk, Garbled, error_event, token_logprob


class _Seen:
    """How many output ids of this choice were already passed on."""

    def __init__(self) -> None:
        self.ids = 0


class SglangAdapter(Adapter):
    engine = "sglang"

    def request(self, job: GenerationJob, request_id: str, stop_ids: frozenset[int]) -> tuple[str, dict[str, Any]]:
        params = job.params
        knobs = common_knobs(params)
        knobs.update(
            max_new_tokens=params.max_tokens,
            stop_token_ids=sorted(stop_ids),
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
            no_stop_trim=True,
        )
        if params.seed is not None:
            knobs["sampling_seed"] = params.seed
        if params.logit_bias:
            knobs["logit_bias"] = {str(token): bias for token, bias in params.logit_bias}
        if params.constraint is not None:
            kind, value = params.constraint.kind, params.constraint.value
            if kind == "json_object":
                knobs["json_schema"] = json.dumps({"type": "object"})
            else:  # json_schema and structural_tag: SGLang takes both as JSON strings
                knobs[kind] = value
        body: dict[str, Any] = {
            "input_ids": list(job.prompt_ids),
            "sampling_params": knobs,
            "stream": True,
            "rid": request_id,
        }
        if params.logprobs:
            body.update(return_logprob=True, top_logprobs_num=params.top_logprobs, logprob_start_len=-1)
        return "/generate", body

    def abort(self, request_id: str) -> tuple[str, dict[str, Any]] | None:
        return "/abort_request", {"rid": request_id}

    def new_state(self, job: GenerationJob) -> _Seen:
        return _Seen()

    def parse(self, payload: Any, state: _Seen) -> Chunk:
        failed = error_event(self.engine, payload)
        if failed is not None:
            return failed
        meta = payload.get("meta_info")
        ids = payload.get("output_ids")
        if not isinstance(meta, dict) or not isinstance(ids, list):
            raise Garbled("SGLang sent an event without output_ids / meta_info")
        finish = meta.get("finish_reason")
        if isinstance(finish, dict) and finish.get("type") == "abort":
            return Chunk(error=str(finish.get("message") or "the request was aborted"))
        total = meta.get("completion_tokens")
        # Cumulative: the list holds every id so far (its length is the completion count); else only new ones.
        new = ids[state.ids :] if total is not None and len(ids) == total and len(ids) >= state.ids else ids
        state.ids += len(new)
        chunk = Chunk(
            token_ids=[int(i) for i in new],
            prompt_tokens=meta.get("prompt_tokens"),
            cached_tokens=meta.get("cached_tokens"),
        )
        chunk.logprobs = _logprobs(meta, len(new))
        if isinstance(finish, dict):
            chunk.finish_reason = "length" if finish.get("type") == "length" else "stop"
            chunk.stop_reason = finish.get("matched")
        return chunk


def _logprobs(meta: dict[str, Any], count: int) -> list[TokenLogprob | None]:
    """The last `count` entries: in cumulative mode SGLang repeats the whole list each time too."""
    chosen = meta.get("output_token_logprobs") or []
    if not chosen or count == 0:
        return []
    tops = meta.get("output_top_logprobs") or [None] * len(chosen)
    out: list[TokenLogprob | None] = []
    for entry, top in zip(chosen[-count:], tops[-count:]):
        # entries are [logprob, token_id, text-or-null]
        alternatives = [(t[1], t[0]) for t in top or () if t and t[0] is not None]
        out.append(token_logprob(entry[1], entry[0], alternatives) if entry and entry[0] is not None else None)
    return out
