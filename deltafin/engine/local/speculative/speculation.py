"""A decode step with speculation: every row's draft checked in the one forward pass that computes its next token.

Each step (`verify`, then `settle`):
1. the planner says how many tokens each row may draft (none for a row whose guesses keep failing), and the
   drafter guesses them (n-gram lookup, a draft model, the checkpoint's MTP layers);
2. one pass feeds each row its pending token and its draft (rows with different draft lengths together), giving
   logits after each of them (deltafin.engine.local.speculative.forward);
3. each row samples its next token from the first logits exactly as a decode step would (same sampler, same seed
   generator, penalties, grammar mask); while the token is the draft's next one, the logits after that draft
   token are already there, so it samples again from them; the first token that differs from the draft (or the
   one after a wholly accepted draft) ends the row's step. Every token emitted is drawn from the distribution a
   plain decode step would have drawn it from, in the same order and with the same random draws: greedy output
   is token for token `none`'s, and so is a seeded sample. (For a draft that is one token per position, this is
   speculative rejection sampling: the draft token is accepted with probability p(token), and a rejected one is
   replaced by a draw from p without it, renormalized.) Logprobs, stop ids and strings, max_tokens and grammars
   act token by token through `Row.take`, as without speculation: a row that finishes inside its draft stops there.
4. the batch cache keeps the keys and values of the tokens that were fed and kept; the others are masked out
   (`BatchKV.accept`). A model with linear-attention layers gets each such row's state back from a copy taken
   before the pass, then feeds it the kept tokens again (`_refeed`): a recurrent state cannot be cut back.

The steps with no draft at all on a torch step run the engine's own decode step (compiled, under
placement.compile); the native step always runs its many-token pass, which writes each row at its own columns.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog
import torch

from deltafin.engine.kv import states
from deltafin.engine.kv.batch import BatchKV, Placement
from deltafin.engine.kv.cache_layers import cache_of, exact_length_only, single_row
from deltafin.engine.local.row import Row
from deltafin.engine.local.speculative.cost import TokenCost
from deltafin.engine.local.speculative.forward import ManyTokenForward
from deltafin.engine.local.speculative.planner import DraftPlanner

bound = structlog.contextvars.bound_contextvars

#: compact the batch cache (a copy of it) once the masked columns inside rows reach this share of its width ...
HOLES_SHARE = 0.25
#: ... and at least this many columns
HOLES_MIN = 64


@dataclass
class Verification:
    """One pass's outcome, before the rows take their tokens."""

    rows: list[Row]
    #: per row: what was fed (its pending token, then its draft)
    fed: list[list[int]]
    #: per row: logits [len(fed[i]), V]
    logits: list[torch.Tensor]
    #: per row: the argmax after each fed token, for rows whose sampler is plain greedy (one transfer), else None
    argmax: list[list[int] | None]
    #: where the pass wrote (None: a plain decode step, one token a row)
    placement: Placement | None
    #: the linear-attention states before the pass (a model with such layers, when some row was fed several tokens)
    saved: states.Snapshot | None = None
    #: the cache width before the pass
    width: int = 0
    #: when the step began (time.perf_counter): `settle` prices a token from the whole step's time
    started: float = 0.0


class Speculation:
    def __init__(
        self,
        drafter: Any,
        forward: ManyTokenForward,
        *,
        model: Any,
        decode: Any,
        cache_arg: str,
        device: torch.device,
        most: int,
    ) -> None:
        self.drafter = drafter
        self.forward = forward
        self.model = model
        self.decode = decode
        self.cache_arg = cache_arg
        self.device = device
        self.planner = DraftPlanner(most, TokenCost(forward.relative_cost + drafter.cost_per_token))
        #: whether a pass's time is known when `run` returns (on an accelerator it is queued, not done)
        self._timed = device.type == "cpu"
        #: totals since start (tests and benchmarks read them; requests get theirs on their log line)
        self.drafted = 0
        self.accepted = 0
        #: per step, the draft length of each row, the latest steps (tests read it)
        self.drafts: collections.deque[tuple[int, ...]] = collections.deque(maxlen=4096)

    def verify(self, rows: list[Row], kv: BatchKV) -> Verification:
        """Drafts, then one forward pass over every row's pending token and draft."""
        started = time.perf_counter()
        room = [max(0, row.max_new - row.decoder.count - 1) for row in rows]
        drafts = self.drafter.propose(rows, self.planner.limits(rows, room))
        drafts = [draft[:limit] for draft, limit in zip(drafts, room)]
        fed = [[row.pending, *draft] for row, draft in zip(rows, drafts)]
        self.drafts.append(tuple(len(draft) for draft in drafts))
        if max(len(f) for f in fed) == 1 and not self.forward.own_columns:
            return self._plain(rows, kv, fed, started)
        saved = states.snapshot(kv.cache) if exact_length_only(kv.cache) and max(map(len, fed)) > 1 else None
        width = kv.width
        placement = kv.place([len(f) for f in fed], own_columns=self.forward.own_columns)
        logits = self.forward.run(kv, fed, placement)
        return Verification(rows, fed, logits, self._argmax(rows, logits), placement, saved, width, started)

    def joined(self, rows: list[Row], work: Any) -> None:
        """Rows joined the batch from the prompt `work` (a PromptPrefill; a drafter that reads the model's
        hidden states takes the prompt's, and drops them when no row joined)."""
        hook = getattr(self.drafter, "joined", None)
        if hook is not None:
            hook(rows, work)

    def _plain(self, rows: list[Row], kv: BatchKV, fed: list[list[int]], started: float) -> Verification:
        """No row drafted: the engine's own decode step (timed too: it is what a guess is priced against, and
        the price keeps being measured while nothing is guessed, so a price once measured high can come down)."""
        tokens = torch.tensor(fed, device=self.device)  # [B, 1]
        mask, positions = kv.step_inputs()
        logits = self.decode(self.model, tokens, mask, positions, kv.cache, cache_arg=self.cache_arg)  # [B, V]
        kv.advanced(mask)
        per_row = [logits[i : i + 1] for i in range(len(rows))]
        return Verification(rows, fed, per_row, self._argmax(rows, per_row), None, started=started)

    @staticmethod
    def _argmax(rows: Sequence[Row], logits: list[torch.Tensor]) -> list[list[int] | None]:
        """Plain greedy rows' tokens at every position, in one device -> host transfer."""
        greedy = [i for i, row in enumerate(rows) if row.sampler.plain_greedy and logits[i].dtype == torch.float32]
        if not greedy:
            return [None] * len(rows)
        picked = torch.cat([logits[i].argmax(dim=-1) for i in greedy]).tolist()
        out: list[list[int] | None] = [None] * len(rows)
        at = 0
        for i in greedy:
            n = logits[i].shape[0]
            out[i], at = picked[at : at + n], at + n
        return out

    def settle(
        self, checked: Verification, kv: BatchKV, failed: set[int], fail_row: Callable[[Row, Exception], None]
    ) -> set[int]:
        """Each row takes its tokens (see the module docstring); the cache keeps what was kept. Returns the
        indices of rows that finished; a row whose request failed is recorded through `fail_row`."""
        finished: set[int] = set()
        kept: list[int] = []
        for i, row in enumerate(checked.rows):
            fed = checked.fed[i]
            emitted = matched = 0
            if id(row.submission) not in failed:
                with bound(**row.stream.log_context):
                    try:
                        emitted, matched, done = self._take(row, fed, checked.logits[i], checked.argmax[i])
                    except Exception as exc:  # e.g. a constraint object that raises: only its request fails
                        fail_row(row, exc)
                        done = False
                    if done:
                        finished.add(i)
            keep = max(1, emitted)  # the pending token's keys and values are valid whatever happened
            row.ids.extend(fed[:keep])
            kept.append(keep)
            if len(fed) > 1:
                self._count(row, len(fed) - 1, matched, min(emitted, len(fed) - 1))
            else:
                self.planner.record(row, 0, 0)
        if checked.placement is not None:
            kv.accept(checked.placement, kept)
        hook = getattr(self.drafter, "verified", None)
        if hook is not None:  # a drafter that reads the pass's hidden states (before a refeed runs another pass)
            hook(checked.rows, checked.fed, kept, kv.cache)
        if checked.placement is not None:
            if checked.saved is not None:
                for i, keep in enumerate(kept):
                    if keep < checked.placement.fed[i]:  # its state saw tokens it does not keep
                        self._refeed(kv, checked, i, checked.fed[i][:keep])
            if kv.holes >= max(HOLES_MIN, HOLES_SHARE * kv.width * kv.rows):
                kv.compact()
        if self._timed:  # the whole step (drafting, the pass, taking the tokens): what a token is priced from
            tokens = sum(checked.placement.fed) if checked.placement is not None else len(checked.rows)
            self.planner.cost.record(tokens, time.perf_counter() - checked.started)
        return finished

    def _take(self, row: Row, fed: list[int], logits: torch.Tensor, argmax: list[int] | None) -> tuple[int, int, bool]:
        """(tokens emitted, of them equal to the draft, whether the row finished)."""
        draft = fed[1:]
        emitted = matched = 0
        for j in range(len(fed)):
            token = argmax[j] if argmax is not None else int(row.sampler.sample(logits[j]))
            emitted += 1
            hit = j < len(draft) and token == draft[j]
            matched += hit
            if row.take(token, logits[j]):
                return emitted, matched, True
            if not hit:
                break
        return emitted, matched, False

    def _count(self, row: Row, drafted: int, matched: int, tested: int) -> None:
        self.planner.record(row, matched, tested)
        self.drafted += drafted
        self.accepted += matched
        timings = row.timings  # the request's log line and metrics (deltafin.serving.context.RequestStats)
        timings["spec_draft_tokens"] = timings.get("spec_draft_tokens", 0.0) + drafted
        timings["spec_accepted_tokens"] = timings.get("spec_accepted_tokens", 0.0) + matched

    def _refeed(self, kv: BatchKV, checked: Verification, row: int, tokens: list[int]) -> None:
        """Row `row`'s linear-attention state as a plain decode of `tokens` would leave it: its state from before
        the pass, then `tokens` fed again in a pass of its own over its cache from before the pass."""
        assert kv.cache is not None and checked.saved is not None
        columns = torch.nonzero(kv.mask[row, : checked.width]).squeeze(-1)
        narrow = [single_row(layer, row, columns=columns) for layer in kv.cache.layers]
        one = cache_of(narrow)
        states.restore_row(kv.cache, checked.saved, row, into=one)
        self.model(
            input_ids=torch.tensor([tokens], device=self.device),
            use_cache=True,
            logits_to_keep=1,
            **{self.cache_arg: one},
        )
        states.write_row(kv.cache, row, one)
