"""Speculative decoding for the local engine (`engine.speculative`): guess each row's next tokens cheaply, check
the guesses in the pass that computes its next token, keep the ones the model itself would have produced.

- `speculation`: the step (draft, one pass over every row's draft, take tokens, roll back the rest);
- `forward`: that pass for each kind of decode step (native GGUF, fused torch, transformers);
- `planner`: how many tokens each row drafts, from its acceptance;
- drafters: `ngram` (prompt lookup), `draft_model` (a smaller model with the same tokenizer), `mtp` (the
  checkpoint's multi-token-prediction layers).
"""

from __future__ import annotations

from typing import Any

from deltafin.config import SpeculativeConfig
from deltafin.engine.local.speculative.forward import many_token_forward
from deltafin.engine.local.speculative.ngram import NgramDrafter
from deltafin.engine.local.speculative.speculation import Speculation, Verification
from deltafin.engine.weights.loader import LoadedModel

__all__ = ["Speculation", "Verification", "speculation_for"]


def speculation_for(
    settings: SpeculativeConfig | None, loaded: LoadedModel, decode: Any, cache_arg: str, *, draft: Any = None
) -> Speculation | None:
    """The engine's speculation for `settings` (None for method none). `draft`: the draft model (method draft)."""
    if settings is None or settings.method == "none":
        return None
    model = loaded.model
    device = next(model.parameters()).device
    drafter: Any
    if settings.method == "ngram":
        drafter = NgramDrafter(settings.ngram_min, settings.ngram_max)
    elif settings.method == "draft":
        from deltafin.engine.local.speculative.draft_model import DraftModelDrafter

        if draft is None:
            raise ValueError("engine.speculative.method=draft needs its draft model loaded")
        drafter = DraftModelDrafter(draft, main=loaded)
    else:
        from deltafin.engine.local.speculative.mtp import MtpDrafter

        drafter = MtpDrafter.for_model(loaded)
    forward = many_token_forward(model, decode, cache_arg=cache_arg, device=device)
    return Speculation(
        drafter, forward, model=model, decode=decode, cache_arg=cache_arg, device=device, most=settings.tokens
    )
