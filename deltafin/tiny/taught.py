"""Teach a tiny model a script: for each prompt, exactly this reply (a few hundred optimizer steps on CPU).

Random weights give nearly flat logits, where small float differences between engines could flip a greedy pick;
taught tokens win by a wide margin, so the tests that serve a tiny model through a foreign engine (llama-server,
vLLM) or expect a given tool call teach it first.

The replies are raw model output in the family's own markup, so serving them exercises the real engine,
detokenizer, parser and SSE path end to end. `taught` caches the result by what it is made from: teaching the
tiny Kimi K3 (Deltafin's own K3 class, its KDA layers training through the chunked torch form) takes a minute or
two of CPU, the other families' a few seconds. A model is loaded the way the engine loads it and written back in
its own layout (the tiny K3: the released checkpoint's).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer


def _load(model_dir: Path) -> Any:
    """The model as the engine builds it (Deltafin's own class for a K3 checkpoint), in float32."""
    from deltafin.engine.weights.architecture import model_source, read_config

    source, problem = model_source(read_config(model_dir))
    if problem is not None:
        raise ValueError(f"{model_dir}: {problem}")
    if source is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return (source.model_class or AutoModelForCausalLM).from_pretrained(
        model_dir, config=source.config, key_mapping=source.key_mapping, dtype=torch.float32
    )


def _save(model: Any, model_dir: Path) -> None:
    from deltafin.engine.weights.architecture import read_config

    if read_config(model_dir).get("model_type") == "kimi_k3":
        from deltafin.tiny.kimi_k3 import save_k3

        save_k3(model, model_dir)
    else:
        model.save_pretrained(model_dir)


def teach(model_dir: Path, examples: list[tuple[list[int], str]], *, steps: int = 400, lr: float = 3e-3) -> None:
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = _load(model_dir)
    rows = []
    for prompt_ids, reply in examples:
        reply_ids = tokenizer(reply, add_special_tokens=False).input_ids
        rows.append((list(prompt_ids) + reply_ids, [-100] * len(prompt_ids) + reply_ids))
    width = max(len(ids) for ids, _ in rows)
    pad = tokenizer.pad_token_id or 0
    input_ids = torch.tensor([ids + [pad] * (width - len(ids)) for ids, _ in rows])
    labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in rows])
    mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids)) for ids, _ in rows])
    torch.manual_seed(0)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    # One thread: a tiny model's matrices are too small to share, and an OpenMP team waiting on a busy machine's
    # other jobs made a step of the tiny K3 15-40x slower (0.7 s alone, 10-30 s beside a loaded suite).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(steps):
            loss = model(input_ids=input_ids, attention_mask=mask, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if loss.item() < 1e-3:
                break
    finally:
        torch.set_num_threads(threads)
    model.eval()
    _save(model, model_dir)


def taught(model_dir: Path, examples: list[tuple[list[int], str]], *, lr: float = 3e-3, steps: int = 400) -> Path:
    """`model_dir` (an untaught tiny model) taught `examples`, from ~/.cache/deltafin/tiny-taught when it was
    taught before: the key is the untaught model's bytes, the examples and this module's code, so a new recipe,
    tokenizer, prompt render or teaching setting teaches again. `model_dir` itself is left untaught."""
    setting = repr(lr) + ("" if steps == 400 else f" steps={steps}")  # (400: the key models taught before had)
    digest = hashlib.sha256((json.dumps([[list(ids), reply] for ids, reply in examples]) + setting).encode())
    digest.update(inspect.getsource(teach).encode())
    digest.update(inspect.getsource(_load).encode() + inspect.getsource(_save).encode())
    for path in sorted(p for p in model_dir.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    root = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deltafin" / "tiny-taught"
    meta = model_dir / "deltafin_tiny.json"
    name = (
        (json.loads(meta.read_text())["variant"] or json.loads(meta.read_text())["family"])
        if meta.exists()
        else model_dir.name
    )
    cached = root / f"{name}-{digest.hexdigest()[:16]}"
    if cached.exists():
        return cached
    staging = root / f".{cached.name}.{os.getpid()}"
    shutil.copytree(model_dir, staging)
    try:
        teach(staging, examples, lr=lr, steps=steps)
        staging.rename(cached)  # one step: a concurrent session never sees a half-taught model
    except OSError:
        if not cached.exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return cached


def reshape_heads(folder: Path, head_dim: int) -> None:
    """The tiny model in `folder` re-initialised with attention heads of `head_dim` (vLLM's CPU attention takes
    32 and up; the tiny recipes use 16): the same architecture class and config, fresh seeded weights, saved by
    transformers."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    config.head_dim = head_dim
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
