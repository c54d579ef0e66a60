"""What the local engine loads, decided at load: architectures it cannot run are refused with one line naming
them and why (before any weight is read), and Kimi K3's multimodal checkpoint is served for text through
Deltafin's own K3 language model, the vision tower left out; a plain Kimi Linear stays transformers'."""

from __future__ import annotations

import json

import pytest
import torch

from deltafin.engine.weights.loader import ModelLoadError, load_model
from deltafin.tiny import write_tiny_model
from deltafin.tiny.architectures import kimi_linear
from tests.conftest import tiny_config


@pytest.fixture(scope="module")
def k3_folder(tmp_path_factory):
    return write_tiny_model("kimi_k3", tmp_path_factory.mktemp("k3") / "k3")


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

    def test_a_k3_turning_on_what_deltafin_lacks(self, k3_folder, tmp_path):
        """A K3 language model with rotary MLA (the reference asserts NoPE) and grouped key-value heads (the
        reference's shapes break): refused by name, in one line, before any weight is read (this folder has none)."""

        def unserved(config):
            config["text_config"].update(mla_use_nope=False, num_key_value_heads=2)

        folder = with_config(k3_folder, tmp_path / "k3", unserved)
        with pytest.raises(ModelLoadError) as refused:
            load("kimi_k3", folder)
        message = str(refused.value)
        assert "\n" not in message
        assert message.startswith(
            "model.path: KimiK3ForConditionalGeneration (kimi_k3) cannot run on the local engine: it uses rotary MLA "
            "(mla_use_nope is not true; the reference asserts NoPE), MLA with fewer key-value heads than heads "
            "(num_key_value_heads), which Deltafin's Kimi K3 does not implement"
        )

    def test_a_k3_config_missing_what_its_layers_need(self, k3_folder, tmp_path):
        """Keys the reference indexes (and fails without) and values no model runs with: named, one line."""

        def broken(config):
            text = config["text_config"]
            del text["linear_attn_config"]["head_dim"], text["kv_lora_rank"]
            text.update(attn_res_block_size=0, num_experts_per_token=99)

        with pytest.raises(ModelLoadError) as refused:
            load("kimi_k3", with_config(k3_folder, tmp_path / "k3", broken))
        assert str(refused.value) == (
            "model.path: KimiK3ForConditionalGeneration (kimi_k3) cannot run on the local engine: its config has no "
            "linear_attn_config.head_dim, num_experts_per_token=99 outside 1..num_experts (8), no kv_lora_rank, "
            "attn_res_block_size=0 (a positive number of layers)"
        )

    @pytest.mark.parametrize("where", ["text_config", "top level"])
    def test_a_quantization_format_not_served(self, k3_folder, tmp_path, where):
        """A K3 whose quantization_config (in text_config, or only at the wrapper's top level) names a format
        Deltafin does not serve in its own form is refused in one line naming the field and its value, before
        any weight is read (this folder has none)."""
        nvfp4 = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}

        def quantized(config):
            (config["text_config"] if where == "text_config" else config)["quantization_config"] = nvfp4

        with pytest.raises(ModelLoadError) as refused:
            load("kimi_k3", with_config(k3_folder, tmp_path / "k3", quantized))
        message = str(refused.value)
        assert "\n" not in message
        place = "text_config.quantization_config" if where == "text_config" else "quantization_config"
        assert message.startswith(f'model.path: config.json {place}.format="nvfp4-pack-quantized"')

    @pytest.mark.parametrize("where", ["text_config", "top level"])
    def test_the_released_mxfp4_experts_pass_the_own_models_check(self, k3_folder, where):
        """The released K3's MXFP4 experts (in text_config, or only at the wrapper's top level) are a format
        Deltafin serves: K3's own class takes the checkpoint (tests/engine/test_published.py serves it), while
        another format is refused by the own model's check too."""
        from deltafin.engine.weights import architecture
        from deltafin.tiny.quantized import quantization_config

        config = json.loads((k3_folder / "config.json").read_text())
        holder = config["text_config"] if where == "text_config" else config
        holder["quantization_config"] = quantization_config("mxfp4", "experts")
        source, problem = architecture.model_source(config)
        assert problem is None and source is not None and source.name == "Kimi K3"
        holder["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
        assert architecture.model_source(config)[1] == (
            "it uses quantized weights in a format not served (quantization_config), which Deltafin's Kimi K3 "
            "does not implement"
        )

    def test_a_multimodal_checkpoint_without_its_language_model_config(self, k3_folder, tmp_path):
        folder = with_config(k3_folder, tmp_path / "k3", lambda config: config.pop("text_config"))
        with pytest.raises(ModelLoadError, match="KimiK3ForConditionalGeneration .kimi_k3. has no text_config"):
            load("kimi_k3", folder)


class TestKimiK3Checkpoint:
    def test_its_language_model_is_deltafins_own_with_the_vision_tower_left_out(self, k3_folder):
        from safetensors.torch import load_file

        loaded = load("kimi_k3", k3_folder)
        assert type(loaded.model).__name__ == "KimiK3ForCausalLM"
        assert not any("vision" in name or "mm_projector" in name for name, _ in loaded.model.named_parameters())
        stored = load_file(str(k3_folder / "model.safetensors"))
        state = loaded.model.state_dict()
        assert torch.equal(
            state["model.layers.0.self_attn.A_log"], stored["language_model.model.layers.0.self_attn.A_log"]
        )
        experts = state["model.layers.2.block_sparse_moe.experts.gate_up_proj"]  # [E, 2I, H]: w1 rows, then w3
        prefix = "language_model.model.layers.2.block_sparse_moe.experts.5."
        assert torch.equal(experts[5], torch.cat([stored[prefix + "w1.weight"], stored[prefix + "w3.weight"]]))
        assert loaded.stop_token_ids == {json.loads((k3_folder / "config.json").read_text())["eos_token_id"]}

    def test_a_text_only_k3_language_model_is_deltafins_too(self, k3_folder, tmp_path):
        """The K3 language model without the wrapper (its text_config as config.json, no prefix): a Kimi Linear
        config turning on K3's features is not transformers' Kimi Linear's to run."""
        from safetensors.torch import load_file, save_file

        config = json.loads((k3_folder / "config.json").read_text())["text_config"]
        (tmp_path / "config.json").write_text(json.dumps(config))
        tensors = load_file(str(k3_folder / "model.safetensors"))
        save_file(
            {k.removeprefix("language_model."): v for k, v in tensors.items() if k.startswith("language_model.")},
            str(tmp_path / "model.safetensors"),
        )
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (tmp_path / name).write_bytes((k3_folder / name).read_bytes())
        assert type(load("kimi_k3", tmp_path).model).__name__ == "KimiK3ForCausalLM"

    def test_a_plain_kimi_linear_stays_transformers(self, tmp_path):
        folder = write_tiny_model("kimi_k3", tmp_path / "kimi_linear", architecture=kimi_linear)
        model = load("kimi_k3", folder).model
        assert type(model).__name__ == "KimiLinearForCausalLM" and type(model).__module__.startswith("transformers.")
