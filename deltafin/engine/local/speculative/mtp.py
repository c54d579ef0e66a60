"""Drafts from the checkpoint's own multi-token-prediction (MTP) layer (DeepSeek-V3, GLM-4.5 / 4.7).

transformers' classes do not load these layers, so the head is Deltafin's own module, after the published
architecture (DeepSeek-V3 technical report, section 2.2; vLLM's deepseek_mtp.py serves it the same way): at
position i, from the main model's last hidden state h_i (after its final norm) and the next token t_{i+1},

    x_i = eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])     (the embedding is zero at position 0)
    y_i = block(x_i)                                       (a decoder layer of the model's own class and config,
                                                            attending over the earlier positions' y)
    logits_i = head(shared_norm(y_i))                      -> a guess at t_{i+2}

Further guesses chain: y_i stands in for the hidden state of the next position, with the guess as its token
(the one layer reused, as vLLM does for a checkpoint with one MTP layer).

The drafter keeps the layer's own batch cache (one row per main row). The main model's hidden states come from a
hook on its final norm: a prompt's from its prefill windows (`joined`), each step's from the pass that checked
the drafts (`verified`: the kept positions only). Each (h_i, t_{i+1}) pair enters the layer's cache once; the
chained guesses are cut off again after drafting (their inputs are the layer's own, not the model's). Positions
a prompt took from the prefix cache have no hidden state here: the layer's cache starts after them.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicLayer

from deltafin.engine.kv.batch import BatchKV
from deltafin.engine.kv.cache_layers import cache_of
from deltafin.engine.local.speculative.draft_model import weight_bytes
from deltafin.engine.weights.loader import LoadedModel, ModelLoadError
from deltafin.engine.weights.mtp_layers import mtp_layer_index

#: positions of a prompt fed to the layer per pass when a row joins (bounds the pass's activations)
WINDOW = 128


class MtpHead(nn.Module):
    """One MTP layer: (tokens, the model's hidden states) -> (its own hidden states, logits)."""

    def __init__(self, config: Any, block: nn.Module, embed: nn.Module, rotary: nn.Module, norm: type) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.enorm = norm(hidden, eps=config.rms_norm_eps)
        self.hnorm = norm(hidden, eps=config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.block = block
        self.shared_norm = norm(hidden, eps=config.rms_norm_eps)
        self.head = nn.Linear(hidden, config.vocab_size, bias=False)
        self.embed = embed  # the main model's (the layers share it), not a parameter of this module
        self.rotary = rotary

    def forward(
        self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens, positions [B, C]; hidden [B, C, H]; mask [B, 1, C, S] additive; cache: the layer's, one
        attention layer, S - C positions before these. Returns (y [B, C, H], logits [B, C, V])."""
        embeds = self.embed(tokens) * (positions != 0).unsqueeze(-1).to(hidden.dtype)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        out = self.block(
            x,
            attention_mask=mask,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            position_embeddings=self.rotary(x, positions),
        )
        y = out[0] if isinstance(out, tuple) else out
        return y, self.head(self.shared_norm(y))


def load_mtp_head(loaded: LoadedModel) -> MtpHead:
    """The checkpoint's first MTP layer, built on the main model's own decoder-layer class."""
    folder = Path(loaded.source)
    index, why = mtp_layer_index(folder)
    if index is None:
        raise ModelLoadError(f"engine.speculative.method: mtp needs the checkpoint's MTP layers; {why}")
    model = loaded.model
    inner = model.model
    config = model.config
    block = type(inner.layers[-1])(config, index)  # dense or MoE as the checkpoint's own layer `index` is
    block.self_attn.layer_idx = 0  # its cache is the head's own, one layer
    head = MtpHead(config, block, inner.embed_tokens, inner.rotary_emb, type(inner.norm))
    weights = _layer_weights(folder, index)
    names = {
        "enorm.weight": "enorm.weight",
        "hnorm.weight": "hnorm.weight",
        "eh_proj.weight": "eh_proj.weight",
        "shared_head.norm.weight": "shared_norm.weight",
        "shared_head.head.weight": "head.weight",
    }
    state: dict[str, torch.Tensor] = {}
    for name, tensor in weights.items():
        if name.startswith("embed_tokens."):
            continue  # the shared embedding: the main model's
        state[names.get(name, f"block.{name}")] = tensor
    if "head.weight" not in state:  # a checkpoint that shares the output layer too
        state["head.weight"] = model.get_output_embeddings().weight.detach()
    own = {k: v for k, v in head.state_dict().items() if not k.startswith(("embed.", "rotary."))}
    missing = sorted(set(own) - set(state))
    if missing:
        raise ModelLoadError(f"engine.speculative.method: the MTP layer {index} lacks {', '.join(missing[:5])}")
    head.load_state_dict(state, strict=False)
    parameter = next(model.parameters())
    return head.to(device=parameter.device, dtype=parameter.dtype).eval()


def _layer_weights(folder: Path, index: int) -> dict[str, torch.Tensor]:
    """The tensors under `...model.layers.{index}.`, by their name after that prefix."""
    from safetensors import safe_open

    marker = f"model.layers.{index}."
    index_file = folder / "model.safetensors.index.json"
    if index_file.exists():
        weight_map = json.loads(index_file.read_text())["weight_map"]
        files = sorted({file for name, file in weight_map.items() if marker in name})
    else:
        files = sorted(p.name for p in folder.glob("*.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(folder / file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118  (a safetensors handle is not iterable)
                if name.startswith(marker) or f".{marker}" in name:
                    out[name.split(marker, 1)[1]] = handle.get_tensor(name)
    return out


class _Capture:
    """The main model's final hidden states of each forward pass, filed under the cache that pass used."""

    def __init__(self, model: Any) -> None:
        self.by_cache: weakref.WeakKeyDictionary[Any, list[torch.Tensor]] = weakref.WeakKeyDictionary()
        self._last: torch.Tensor | None = None
        model.model.norm.register_forward_hook(self._norm)
        model.register_forward_hook(self._model, with_kwargs=True)

    def _norm(self, module: Any, args: Any, out: torch.Tensor) -> None:
        self._last = out

    def _model(self, module: Any, args: Any, kwargs: dict, out: Any) -> None:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if cache is not None and self._last is not None:
            self.by_cache.setdefault(cache, []).append(self._last.detach())
        self._last = None

    def take(self, cache: Any, *, last: bool = False) -> torch.Tensor | None:
        """[B, C, H]: the passes over `cache` since the last take, concatenated along the positions (a prompt's
        prefill windows), or only the latest one (`last`: a step of the batch)."""
        chunks = self.by_cache.pop(cache, None)
        if not chunks:
            return None
        return chunks[-1] if last else torch.cat(chunks, dim=1)


class _RowState:
    """One main row's pairs not yet in the layer's cache, and where that cache's positions start."""

    def __init__(self, start: int) -> None:
        self.start = start  # the position of the layer's first entry for this row
        self.hidden: list[torch.Tensor] = []  # [n, H] pieces
        self.tokens: list[int] = []  # t_{i+1} of each pending position i
        self.entries = 0  # pairs in the layer's cache


class MtpDrafter:
    def __init__(self, loaded: LoadedModel, head: MtpHead) -> None:
        self.head = head
        self.model = loaded.model
        self.device = next(head.parameters()).device
        self.capture = _Capture(loaded.model)
        # One pass of the layer and the output layer per guess: their share of the model's bytes.
        self.cost_per_token = weight_bytes(head) / max(1, weight_bytes(loaded.model))
        self._kv = BatchKV(self.device)
        self._rows: list[Any] = []
        self._states: weakref.WeakKeyDictionary[Any, _RowState] = weakref.WeakKeyDictionary()

    @classmethod
    def for_model(cls, loaded: LoadedModel) -> MtpDrafter:
        return cls(loaded, load_mtp_head(loaded))

    # The main engine's news.

    def joined(self, rows: Sequence[Any], work: Any) -> None:
        """Rows whose prompt `work` (a PromptPrefill) just finished: its hidden states start their pairs."""
        hidden = self.capture.take(work.cache)
        if hidden is None:
            return
        hidden = hidden[0]  # [P - cached, H]
        ids = list(work.ids)
        start = len(ids) - hidden.shape[0]
        for row in rows:
            state = self._states[row] = _RowState(start)
            state.hidden.append(hidden)
            state.tokens.extend(ids[start + 1 :] + [row.pending])

    def verified(self, rows: Sequence[Any], fed: Sequence[Sequence[int]], kept: Sequence[int], cache: Any) -> None:
        """A pass over the batch `cache` fed row i `fed[i]` and kept its first `kept[i]` tokens."""
        hidden = self.capture.take(cache, last=True)
        if hidden is None:
            return
        for i, row in enumerate(rows):
            state = self._states.get(row)
            if state is None or row.pending is None:
                continue
            keep = kept[i]
            state.hidden.append(hidden[i, :keep])
            state.tokens.extend([*fed[i][1:keep], row.pending])

    # Drafting.

    def propose(self, rows: Sequence[Any], limits: Sequence[int]) -> list[list[int]]:
        try:
            with torch.inference_mode():
                return self._propose(rows, limits)
        except Exception:
            self._kv, self._rows = BatchKV(self.device), []
            for state in self._states.values():
                state.entries = -1  # never in this batch again: the row drafts no more
            raise

    def _propose(self, rows: Sequence[Any], limits: Sequence[int]) -> list[list[int]]:
        present = {id(row) for row in rows}
        keep = [i for i, row in enumerate(self._rows) if id(row) in present]
        if len(keep) != len(self._rows):
            self._kv.keep(keep)
            self._rows = [self._rows[i] for i in keep]
        wanted = {
            id(row): limit
            for row, limit in zip(rows, limits)
            if limit > 0 and row in self._states and self._states[row].entries >= 0
        }
        guesses: dict[int, tuple[int, torch.Tensor]] = {}  # row -> (guess, y at its position)
        for row in rows:  # rows new to the layer: their pairs so far, alone, in windows
            if id(row) in wanted and row not in self._rows:
                guesses[id(row)] = self._join(row)
        feed = [
            len(self._states[row].tokens) if id(row) in wanted and id(row) not in guesses else 0 for row in self._rows
        ]
        if any(feed):
            pairs: list[tuple[torch.Tensor, list[int]] | None] = [
                self._pending_pairs(row) if n else None for row, n in zip(self._rows, feed)
            ]
            for i, out in self._pass(pairs).items():
                guesses[id(self._rows[i])] = out
        drafts: dict[int, list[int]] = {key: [guess] for key, (guess, _) in guesses.items()}
        lengths = list(self._kv.lengths)  # the layer's entries from the model's own hidden states
        while True:
            chain: list[tuple[torch.Tensor, list[int]] | None] = []
            for row in self._rows:
                draft = drafts.get(id(row))
                if draft is None or len(draft) >= wanted[id(row)]:
                    chain.append(None)
                    continue
                _, y = guesses[id(row)]
                chain.append((y.unsqueeze(0), [draft[-1]]))
            if not any(chain):
                break
            for i, out in self._pass(chain).items():
                key = id(self._rows[i])
                guesses[key] = out
                drafts[key].append(out[0])
        for i, length in enumerate(lengths):  # the chained entries leave the layer's cache
            self._kv.truncate(i, length)
        return [drafts.get(id(row), []) for row in rows]

    def _pending_pairs(self, row: Any) -> tuple[torch.Tensor, list[int]]:
        state = self._states[row]
        hidden, tokens = torch.cat(state.hidden), state.tokens
        state.hidden, state.tokens = [], []
        return hidden, tokens

    def _join(self, row: Any) -> tuple[int, torch.Tensor]:
        """A row's first pairs through the layer on a cache of its own (windows of WINDOW), then into the batch."""
        state = self._states[row]
        hidden, tokens = self._pending_pairs(row)
        cache = cache_of([DynamicLayer()])
        done, last = 0, None
        while done < len(tokens):
            n = min(WINDOW, len(tokens) - done)
            positions = torch.arange(state.start + done, state.start + done + n, device=self.device)[None]
            mask = _causal(torch.ones(1, done + n, dtype=torch.long, device=self.device), n, hidden.dtype)
            y, logits = self.head(
                torch.tensor([tokens[done : done + n]], device=self.device),
                hidden[None, done : done + n],
                positions,
                mask,
                cache,
            )
            last = (int(logits[0, -1].argmax()), y[0, -1])
            done += n
        self._kv.add(cache, len(tokens))
        self._rows.append(row)
        state.entries = len(tokens)
        assert last is not None
        return last

    def _pass(self, work: list[tuple[torch.Tensor, list[int]] | None]) -> dict[int, tuple[int, torch.Tensor]]:
        """One batched pass of the layer: row i fed the pairs `work[i]` (hidden [n, H], tokens [n]) or nothing.
        Returns, per fed row, (the greedy guess after its last pair, y there)."""
        counts = [0 if w is None else len(w[1]) for w in work]
        width = max(counts)
        placement = self._kv.place(counts, own_columns=False)
        hidden_size = self.head.eh_proj.out_features
        hidden = torch.zeros(len(work), width, hidden_size, device=self.device, dtype=self.head.eh_proj.weight.dtype)
        tokens = torch.zeros(len(work), width, dtype=torch.long, device=self.device)
        positions = torch.zeros(len(work), width, dtype=torch.long, device=self.device)
        for i, (row, w) in enumerate(zip(self._rows, work)):
            state = self._states[row]
            next_position = state.start + self._kv.lengths[i]
            positions[i] = torch.arange(next_position, next_position + width, device=self.device)
            if w is None:
                continue
            n = counts[i]
            hidden[i, :n], tokens[i, :n] = w[0], torch.tensor(w[1], device=self.device)
        mask = _causal(placement.mask, width, hidden.dtype)
        assert self._kv.cache is not None
        y, logits = self.head(tokens, hidden, positions, mask, self._kv.cache)
        self._kv.accept(placement, counts)
        out: dict[int, tuple[int, torch.Tensor]] = {}
        fed = [i for i, n in enumerate(counts) if n]
        picked = torch.stack([logits[i, counts[i] - 1] for i in fed]).argmax(dim=-1).tolist()
        for i, guess in zip(fed, picked):
            out[i] = (guess, y[i, counts[i] - 1])
            self._states[self._rows[i]].entries = self._kv.lengths[i]
        return out


def _causal(mask: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
    """mask [B, S] (1 = a real column) -> additive [B, 1, C, S]: the last C columns' tokens each see the real
    columns up to their own."""
    width = mask.shape[1]
    columns = torch.arange(width, device=mask.device)
    own = width - count + torch.arange(count, device=mask.device)
    visible = (mask != 0)[:, None, None, :] & (columns[None, :] <= own[:, None])[None, None]
    return torch.zeros(visible.shape, dtype=dtype, device=mask.device).masked_fill_(~visible, float("-inf"))
