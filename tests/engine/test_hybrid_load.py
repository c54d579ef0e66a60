"""What the local engine loads, decided at load: architectures it cannot run are refused with one line naming
them and why (before any weight is read), and Kimi K3's multimodal checkpoint is served for text through its
Kimi Linear language model, the vision tower left out. The K3 layout is checked against the reference model
code of the checkpoint (`modeling_kimi_linear.py`, as carried by the llmcompressor wheel: tests/k3_reference.py)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from deltafin.engine.weights.loader import ModelLoadError, load_model
from deltafin.tiny import write_tiny_model
from deltafin.tiny.multimodal import write_k3_checkpoint
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def kimi_linear(tmp_path_factory):
    return write_tiny_model("kimi_k3", tmp_path_factory.mktemp("k3") / "text")


@pytest.fixture(scope="module")
def k3_folder(kimi_linear, tmp_path_factory):
    return write_k3_checkpoint(kimi_linear, tmp_path_factory.mktemp("k3") / "multimodal")


def load(family: str, path, *extra: str):
    config = tiny_config(family, path, list(extra))
    return load_model(config.model, config.placement)


def with_config(folder, dest, change) -> object:
    """`folder`'s config.json changed by `change` (dict -> None) in `dest`, without its weights: a refusal
    must come from the config alone."""
    dest.mkdir()
    config = json.loads((folder / "config.json").read_text())
    change(config)
    (dest / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (dest / name).write_bytes((folder / name).read_bytes())
    return dest


class TestRefusedAtLoad:
    def test_sliding_window_attention(self, tmp_path):
        """A Qwen3 with sliding-window layers: the batched cache keeps every position, a window would be cut
        across rows of different lengths."""
        from transformers import Qwen3Config

        path = write_tiny_model("qwen3", tmp_path / "m")
        config = json.loads((path / "config.json").read_text())
        config.update(use_sliding_window=True, sliding_window=8, max_window_layers=0)
        config.pop("layer_types", None)
        (path / "config.json").write_text(json.dumps(config))
        assert "sliding_attention" in Qwen3Config.from_pretrained(path).layer_types
        with pytest.raises(ModelLoadError) as refused:
            load("qwen3", path)
        message = str(refused.value)
        assert "\n" not in message
        assert message.startswith("model.path: Qwen3ForCausalLM (qwen3) cannot run on the local engine: layers 0-1")
        assert "sliding-window attention" in message

    def test_kimi_k3_features_transformers_does_not_implement(self, k3_folder, tmp_path):
        """The real K3's language model: its config says KimiLinearForCausalLM, its features are not in
        transformers' class. Refused by name, before any weight is read (this folder has none)."""

        def real_k3(config):
            text = config["text_config"]
            text.update(
                attn_res_block_size=12, routed_expert_hidden_size=32, hidden_act="situ", mla_use_output_gate=True
            )
            text["linear_attn_config"].update(gate_lower_bound=-5.0, use_full_rank_gate=True)

        folder = with_config(k3_folder, tmp_path / "k3", real_k3)
        with pytest.raises(ModelLoadError) as refused:
            load("kimi_k3", folder)
        message = str(refused.value)
        assert "\n" not in message
        assert message.startswith(
            "model.path: KimiK3ForConditionalGeneration (kimi_k3) cannot run on the local "
            "engine: it uses attention residuals (attn_res_block_size), a latent MoE"
        )
        for feature in ("hidden_act=situ", "mla_use_output_gate", "gate_lower_bound", "use_full_rank_gate"):
            assert feature in message

    def test_a_multimodal_checkpoint_without_its_language_model_config(self, k3_folder, tmp_path):
        folder = with_config(k3_folder, tmp_path / "k3", lambda config: config.pop("text_config"))
        with pytest.raises(ModelLoadError, match="KimiK3ForConditionalGeneration .kimi_k3. has no text_config"):
            load("kimi_k3", folder)


class TestKimiK3Checkpoint:
    def test_its_language_model_is_served_with_the_vision_tower_left_out(self, kimi_linear, k3_folder):
        direct, wrapped = load("kimi_k3", kimi_linear), load("kimi_k3", k3_folder)
        assert type(wrapped.model).__name__ == "KimiLinearForCausalLM"
        assert not any("vision" in name or "mm_projector" in name for name, _ in wrapped.model.named_parameters())
        for (name, theirs), (_, ours) in zip(direct.model.state_dict().items(), wrapped.model.state_dict().items()):
            assert torch.equal(theirs, ours), name
        assert wrapped.stop_token_ids == direct.stop_token_ids and wrapped.context_length == direct.context_length
        # K3's A_log layout was accepted during that load only: transformers' own table is back
        from transformers import conversion_mapping

        table = conversion_mapping.get_checkpoint_conversion_mapping("kimi_linear")
        assert not any(type(op).__name__ == "ViewAsParameter" for t in table for op in getattr(t, "operations", ()))
        assert "kimi_linear" not in conversion_mapping.USER_REGISTERED_MAPPINGS

    def test_the_layout_is_the_reference_models(self, k3_folder):
        """Every `language_model.` tensor is a parameter of the checkpoint's own Kimi Linear (the reference
        code, built on the folder's text_config), with its shape, and none is missing."""
        from tests.k3_reference import reference_kimi_linear

        config = json.loads((k3_folder / "config.json").read_text())
        reference = {
            name: tuple(t.shape) for name, t in reference_kimi_linear(config["text_config"]).state_dict().items()
        }
        with safe_open(str(k3_folder / "model.safetensors"), "pt") as weights:
            names = weights.keys()  # safetensors 0.8's handles are not iterable themselves
            ours = {
                name.removeprefix("language_model."): tuple(weights.get_slice(name).get_shape())
                for name in names
                if name.startswith("language_model.")
            }
            others = {name.split(".")[0] for name in names if not name.startswith("language_model.")}
        assert ours == reference
        assert others == {"vision_tower", "mm_projector"}
