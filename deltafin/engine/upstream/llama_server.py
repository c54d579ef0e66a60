"""llama.cpp's `llama-server`: `POST /completion` with a token-id prompt, `tokens` and `n_probs` back.

Constraints: JSON ones go in `json_schema` (llama-server converts them itself); a structural tag (an enforced
tool call, reasoning before a constrained answer) is translated to GBNF here and sent as `grammar`, with the
model's added tokens written as token ids (see deltafin.grammar.gbnf.rules).

Its sampling defaults are not neutral (DRY, top-k 40, top-p 0.95, min-p 0.05, a repeat penalty window of 64), so every
knob is sent, and the sampler chain is named so nothing else runs. It has no `stop_token_ids`: Deltafin's
decoder stops on the family's stop ids itself and closes the request, which llama-server aborts. A thinking budget
goes as llama-server's own (`reasoning_budget_tokens` and the family's tags).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any

from deltafin.engine.events import GenerationJob, TokenLogprob
from deltafin.engine.upstream.engine import Adapter, UpstreamSettings
from deltafin.engine.upstream.wire import Chunk, Garbled, error_event, token_logprob
from deltafin.errors import InvalidRequestError
from deltafin.grammar.gbnf import structural_tag_to_gbnf
from deltafin.protocol.sampling import ReasoningBudget

#: the samplers Deltafin's parameters describe, in llama.cpp's order; penalties first as in the local engine
SAMPLERS = ["penalties", "top_k", "top_p", "min_p", "temperature"]


class LlamaServerAdapter(Adapter):
    engine = "llama_server"

    def __init__(self, settings: UpstreamSettings, special_tokens: Mapping[str, int] | None = None) -> None:
        """special_tokens: the model's added tokens (text -> id), matched as tokens in a structural tag's grammar."""
        super().__init__(settings)
        specials = dict(special_tokens or {})
        # clients send the same tools request after request; failures are not cached (they raise)
        self._grammar = functools.lru_cache(maxsize=256)(lambda tag: structural_tag_to_gbnf(tag, specials))

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
            # 0 = off in llama.cpp too. Greedy: top-k 1 picks the same token (penalties and biases run before it)
            # without the final sampler softmaxing the whole vocabulary, per stream and step.
            "top_k": 1 if params.greedy else params.top_k,
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
        if params.reasoning_budget is not None:
            body.update(_reasoning_budget(params.reasoning_budget, params.max_tokens))
        if params.constraint is not None:
            kind, value = params.constraint.kind, params.constraint.value
            if kind == "json_object":
                body["json_schema"] = {"type": "object"}
            elif kind == "json_schema":
                body["json_schema"] = json.loads(value)
            else:
                body["grammar"] = self._structural_grammar(value)
        return "/completion", body

    def _structural_grammar(self, tag: str) -> str:
        try:
            return self._grammar(tag)
        except ValueError as exc:
            # tool calls always come as tags_with_separator; a tag without one is reasoning + response_format
            param = "tools" if '"tags_with_separator"' in tag else "response_format"
            raise InvalidRequestError(
                f"This constraint cannot be sent to the llama-server upstream: {exc}", param=param
            ) from exc

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


def _reasoning_budget(budget: ReasoningBudget, max_tokens: int) -> dict[str, Any]:
    """llama-server's own reasoning budget (common/reasoning-budget.cpp): counting starts at the start tag (the
    prompt's opener, fed to it as the generation prompt, or the tag the model may open reasoning with), the end
    tags end it, and the first of them is forced at the budget. The forced end is only set where
    `reasoning_budget_message` is given, so an empty one is sent."""
    fields: dict[str, Any] = {
        # past max_tokens a budget changes nothing; clamped, it stays within llama-server's int32 field
        "reasoning_budget_tokens": min(budget.tokens, max_tokens),
        "reasoning_budget_start_tag": budget.opened or budget.start or "",
        "reasoning_budget_end_tags": [budget.forced_text, *budget.ends],
        "reasoning_budget_message": "",
    }
    if budget.opened is not None:
        fields["generation_prompt"] = budget.opened  # the grammar (sent as a user grammar) is never fed it
    return fields


def added_tokens(tokenizer: Any, stop_ids: frozenset[int] = frozenset()) -> dict[str, int]:
    """The tokenizer's added tokens (control tokens and markers such as `<tool_call>`), text -> id. A tokenizer
    splits these out of any text before its vocabulary runs, so a marker the grammar spells is always that one
    token; single characters and whitespace are left out, they are text however they are tokenized.
    Stop tokens are left out too: llama.cpp lets an end-of-generation token through only once the grammar is
    complete, never through a `<[ID]>` element, so naming one mid-grammar would leave no token to sample."""
    get = getattr(tokenizer, "get_added_vocab", None)
    added = get() if callable(get) else {}
    return {
        text: int(i) for text, i in added.items() if len(text) > 1 and not text.isspace() and int(i) not in stop_ids
    }


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
