"""A tiny model's multi-token-prediction (MTP) layer, written where DeepSeek-V3 and GLM-4.5 checkpoints keep
theirs: layer `num_hidden_layers` (`model.layers.{N}.`: enorm, hnorm, eh_proj, shared_head.norm / .head,
embed_tokens, and a decoder block of the model's own class), in a safetensors file of its own beside the
model's, with `num_nextn_predict_layers: 1` in config.json. transformers' classes leave these weights out when
they load the model; Deltafin's MTP drafter (deltafin.engine.local.speculative.mtp) reads them.

    python -m deltafin.tiny --family glm --out /tmp/tiny-glm && python -m deltafin.tiny.mtp /tmp/tiny-glm
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def add_mtp_layer(folder: Path, *, seed: int = 0) -> Path:
    """Writes `folder`/mtp.safetensors (random weights, initialized as transformers initializes the family's
    layers; the shared head and embedding copies of the model's own) and names the layer in config.json."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(folder)
    layers = config.num_hidden_layers
    torch.manual_seed(seed)
    config.num_hidden_layers = layers + 1  # a model one layer deeper: its last layer initialized as the family's
    deeper = AutoModelForCausalLM.from_config(config)
    prefix = f"model.layers.{layers}."
    block = {f"{prefix}{k}": v for k, v in deeper.model.layers[layers].state_dict().items()}
    own = load_file(str(folder / "model.safetensors"))
    hidden = config.hidden_size
    head = own.get("lm_head.weight", own["model.embed_tokens.weight"])
    tensors = {
        **block,
        f"{prefix}enorm.weight": torch.ones(hidden),
        f"{prefix}hnorm.weight": torch.ones(hidden),
        f"{prefix}eh_proj.weight": torch.randn(hidden, 2 * hidden) * config.initializer_range,
        f"{prefix}shared_head.norm.weight": torch.ones(hidden),
        f"{prefix}shared_head.head.weight": head.clone(),
        f"{prefix}embed_tokens.weight": own["model.embed_tokens.weight"].clone(),
    }
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "mtp.safetensors"))
    raw = json.loads((folder / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(raw, indent=2))
    return folder


def teach_mtp_layer(
    folder: Path, prompts: list[list[int]], *, tokens: int = 40, steps: int = 200, seed: int = 0
) -> Path:
    """Trains the MTP layer of `folder` (written by `add_mtp_layer`) as DeepSeek-V3 trains its own: from the
    model's final hidden state h_i and the token t_{i+1}, predict t_{i+2}, here on the model's own greedy
    continuations of `prompts` (seconds of CPU). Random MTP weights guess almost nothing right; taught ones are
    accepted often on those prompts, so tests see drafts kept, several at a time."""
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from deltafin.engine.local.speculative.mtp import load_mtp_head
    from deltafin.engine.weights.loader import LoadedModel

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    loaded = LoadedModel(model, tokenizer, 4096, frozenset(), folder, 0.0)
    head = load_mtp_head(loaded)
    samples = []
    captured: list[torch.Tensor] = []  # the model's final hidden states (after its last norm)
    hook = model.model.norm.register_forward_hook(lambda m, a, out: captured.append(out))
    with torch.no_grad():
        for prompt_ids in prompts:
            prompt = torch.tensor([prompt_ids])
            ids = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                max_new_tokens=tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0]
            model(input_ids=ids[None])
            samples.append((ids, captured[-1][0]))
    hook.remove()
    trained = [p for name, p in head.named_parameters() if not name.startswith(("embed.", "rotary."))]
    for p in head.parameters():
        p.requires_grad_(False)
    for p in trained:
        p.requires_grad_(True)
    optimizer = torch.optim.AdamW(trained, lr=3e-3)
    torch.manual_seed(seed)
    head.train()
    for step in range(steps):
        ids, hidden = samples[step % len(samples)]
        n = len(ids) - 2  # pairs (h_i, t_{i+1}) -> t_{i+2}
        causal = torch.full((n, n), float("-inf")).triu(1)[None, None]
        _, logits = head(ids[None, 1 : n + 1], hidden[None, :n], torch.arange(n)[None], causal, DynamicCache())
        loss = F.cross_entropy(logits[0], ids[2:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    head.eval()
    prefix = f"model.layers.{model.config.num_hidden_layers}."
    names = {"shared_norm.weight": "shared_head.norm.weight", "head.weight": "shared_head.head.weight"}
    tensors = load_file(str(folder / "mtp.safetensors"))
    for name, value in head.state_dict().items():
        if name.startswith(("embed.", "rotary.")):
            continue
        key = names.get(name, name.removeprefix("block."))
        tensors[prefix + key] = value.detach().contiguous()
    save_file(tensors, str(folder / "mtp.safetensors"))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", type=Path)
    add_mtp_layer(parser.parse_args().folder)


if __name__ == "__main__":
    main()
