"""One generation row's constraint: an xgrammar GrammarMatcher and its token bitmask.

The batched sampler calls, per step and per constrained row: `fill_mask(logits)` after penalties and
logit_bias and before temperature/top-k/top-p (so those only ever choose among allowed tokens), then
`accept(token)` with the token it drew, then `is_terminated()`: True ends the row with reason "stop".
"""

from __future__ import annotations

import structlog
import torch
import xgrammar as xgr

log = structlog.get_logger("deltafin.grammar")


class XGrammarRow:
    """deltafin.engine.local.matcher.RowMatcher over a compiled grammar. After the grammar is complete only
    stop tokens are allowed; accepting one terminates the matcher."""

    def __init__(self, compiled: xgr.CompiledGrammar, vocab_size: int) -> None:
        self._matcher = xgr.GrammarMatcher(compiled)
        # [1, ceil(V / 32)] int32 on the host: the matcher fills it there; it moves to the logits' device.
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._vocab_size = vocab_size
        self._rejected = False

    def fill_mask(self, logits: torch.Tensor) -> None:
        if self.is_terminated():
            return  # the row is ending; an all -inf row would make sampling fail instead
        # False: every token is allowed at this step (inside free text), so applying would be wasted work.
        if not self._matcher.fill_next_token_bitmask(self._bitmask):
            return
        bitmask = self._bitmask if logits.device.type == "cpu" else self._bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits.view(1, -1), bitmask, vocab_size=self._vocab_size)

    def accept(self, token_id: int) -> None:
        if self._rejected:
            return
        if not self._matcher.accept_token(token_id):
            # Only reachable if the sampler drew outside the mask; end the row rather than continue unconstrained.
            log.warning("grammar_rejected_token", token_id=token_id)
            self._rejected = True

    def is_terminated(self) -> bool:
        return self._rejected or self._matcher.is_terminated()
