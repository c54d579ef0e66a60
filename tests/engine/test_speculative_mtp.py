"""MTP speculation on a tiny GLM-4.5 (Glm4Moe, transformers' class) whose checkpoint carries an MTP layer as the
published ones do (deltafin.tiny.mtp): the output is the model's own without speculation, and every guess is the
published formula's, computed here in one pass over the whole sequence (no cache, no batch) from the model's
hidden states."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deltafin.config import SpeculativeConfig
from deltafin.engine import EngineFront, Finished, GenerationJob, TextDelta
from deltafin.engine.local.engine import LocalEngine
from deltafin.engine.local.speculative.mtp import MtpDrafter, load_mtp_head
from deltafin.engine.weights.loader import ModelLoadError, load_model
from deltafin.protocol.sampling import SamplingParams
from deltafin.tiny import write_tiny_model
from deltafin.tiny.mtp import add_mtp_layer, teach_mtp_layer
from tests.conftest import tiny_config

#: (prompt length, seed) of the test's prompts, which the MTP layer is taught on
PROMPTS = ((9, 1), (23, 2), (5, 3))


def prompt_ids(vocabulary: int, n: int, seed: int) -> tuple[int, ...]:
    ids = torch.randint(0, vocabulary - 20, (n,), generator=torch.Generator().manual_seed(seed))
    return tuple(ids.tolist())


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """A tiny GLM-4.5 with an MTP layer, taught on the model's own continuations of PROMPTS (so that its guesses
    are often kept, several at a time: the paths a random layer never reaches)."""
    path = add_mtp_layer(write_tiny_model("glm", tmp_path_factory.mktemp("glm-mtp"), variant="glm45"))
    from transformers import AutoTokenizer

    vocabulary = len(AutoTokenizer.from_pretrained(path))
    return teach_mtp_layer(path, [list(prompt_ids(vocabulary, n, seed)) for n, seed in PROMPTS], tokens=32, steps=100)


@pytest.fixture(scope="module")
def loaded(folder):
    config = tiny_config("glm45", folder)
    return load_model(config.model, config.placement)


@pytest.fixture
def run(loop):
    return loop.run_until_complete


def front_for(loaded, method: str) -> EngineFront:
    engine = LocalEngine(loaded, prefix_cache_min_tokens=None, speculative=SpeculativeConfig(method=method, tokens=4))
    return EngineFront(engine, max_waiting=8, timeout_s=60, memo_entries=0)


def prompt(loaded, n: int, seed: int) -> tuple[int, ...]:
    return prompt_ids(len(loaded.tokenizer), n, seed)


async def collect(front, jobs) -> dict[int, list[int]]:
    stream = await front.start(jobs)
    tokens: dict[int, list[int]] = {}
    async for event in stream:
        if isinstance(event, TextDelta):
            tokens.setdefault(event.choice, []).extend(event.token_ids)
        elif isinstance(event, Finished):
            tokens.setdefault(event.choice, [])
    return tokens


class Reference:
    """The published formula, from the checkpoint's tensors under their own names (model.layers.2.*), with a
    decoder block of the model's class of its own: one pass over a whole sequence, no cache, no batch."""

    def __init__(self, loaded, folder):
        from safetensors.torch import load_file

        self.model = loaded.model
        config = self.model.config
        prefix = f"model.layers.{config.num_hidden_layers}."
        tensors = {k[len(prefix) :]: v for k, v in load_file(str(folder / "mtp.safetensors")).items()}
        self.w = tensors
        self.block = type(self.model.model.layers[-1])(config, config.num_hidden_layers)
        self.block.load_state_dict(
            {k: v for k, v in tensors.items() if k.split(".")[0] in dict(self.block.named_children())}
        )
        self.block.self_attn.layer_idx = 0
        self.eps = config.rms_norm_eps

    def rms(self, x, weight):
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))

    def guesses(self, context: list[int], count: int) -> list[int]:
        """h_i: the model's final hidden states over context[:-1]; the layer over (h_i, t_{i+1}); its guesses
        chained through its own output y."""
        from transformers import DynamicCache

        captured = []
        hook = self.model.model.norm.register_forward_hook(lambda m, a, out: captured.append(out))
        try:
            self.model(input_ids=torch.tensor([context[:-1]]))
        finally:
            hook.remove()
        hidden = captured[-1][0]  # [n - 1, H]
        tokens = list(context[1:])
        guesses = []
        for _ in range(count):
            n = len(tokens)
            positions = torch.arange(n)
            embeds = self.w["embed_tokens.weight"][torch.tensor(tokens)] * (positions != 0)[:, None]
            x = torch.cat([self.rms(embeds, self.w["enorm.weight"]), self.rms(hidden, self.w["hnorm.weight"])], -1)
            x = (x @ self.w["eh_proj.weight"].T)[None]
            y = self.block(
                x,
                attention_mask=torch.full((n, n), float("-inf")).triu(1)[None, None],
                position_ids=positions[None],
                cache=DynamicCache(config=self.model.config),
                use_cache=True,
                position_embeddings=self.model.model.rotary_emb(x, positions[None]),
            )[0]
            logits = self.rms(y[-1], self.w["shared_head.norm.weight"]) @ self.w["shared_head.head.weight"].T
            guesses.append(int(logits.argmax()))
            hidden = torch.cat([hidden, y[-1:]])
            tokens.append(guesses[-1])
        return guesses


def test_mtp_guesses_are_the_formulas_and_change_nothing(loaded, folder, run):
    plain, spec = front_for(loaded, "none"), front_for(loaded, "mtp")
    drafter = spec.client.speculation.drafter
    assert isinstance(drafter, MtpDrafter)
    seen: list[tuple[list[int], list[int]]] = []
    propose = drafter.propose

    def spy(rows, limits):
        drafts = propose(rows, limits)
        seen.extend(([*row.ids, row.pending], draft) for row, draft in zip(rows, drafts) if draft)
        return drafts

    drafter.propose = spy
    # On a tiny model the MTP layer and its output layer are most of a pass's bytes: the planner's price of a
    # guess would stop it guessing. This test checks what guessing does, so guesses are made cheap.
    spec.client.speculation.planner.token_cost = 0.05
    (a, b, c) = [prompt(loaded, n, seed) for n, seed in PROMPTS]
    jobs = [
        GenerationJob(a, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)),
        GenerationJob(b, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)),
        GenerationJob(c, SamplingParams(max_tokens=20, temperature=0.9, seed=4, ignore_eos=True)),
    ]
    solo = [run(collect(plain, [job]))[0] for job in jobs]

    async def together():
        tasks = []
        for job in jobs:
            tasks.append(asyncio.ensure_future(collect(spec, [job])))
            await asyncio.sleep(0.02)
        return [tokens[0] for tokens in await asyncio.gather(*tasks)]

    speculation = spec.client.speculation
    assert run(together()) == solo
    assert len(seen) > 10 and speculation.accepted > 20 and speculation.accepted < speculation.drafted
    reference = Reference(loaded, folder)
    with torch.inference_mode():
        for context, draft in seen[::3]:
            assert draft == reference.guesses(context, len(draft))
    run(plain.client.aclose())
    run(spec.client.aclose())


def test_a_checkpoint_without_mtp_weights_is_refused(tmp_path):
    """The tiny GLM's config names one MTP layer (Glm4MoeConfig's default) but its weights hold none."""
    path = write_tiny_model("glm", tmp_path / "no-mtp", variant="glm45")
    config = tiny_config("glm45", path)
    loaded = load_model(config.model, config.placement)
    with pytest.raises(ModelLoadError, match="engine.speculative.method: mtp needs the checkpoint's MTP layers"):
        load_mtp_head(loaded)
