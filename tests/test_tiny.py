"""`python -m deltafin.tiny` writes a servable tiny model of each family."""

import json
import subprocess
import sys

import pytest
from transformers import AutoTokenizer

from tests.conftest import REPO, TINY_FAMILIES

ARCHITECTURE = {
    "kimi_k3": "KimiK3ForConditionalGeneration",  # the released layout; its language model: Deltafin's own class
    "kimi_k2": "DeepseekV3ForCausalLM",
    "glm45": "Glm4MoeForCausalLM",
    "glm47": "Glm4MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
MARKERS = {
    "kimi_k3": "<|open|>",
    "kimi_k2": "<|tool_call_begin|>",
    "glm45": "<arg_value>",
    "glm47": "<|observation|>",
    "qwen3": "<tool_call>",
}


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_tiny_model_has_the_family_architecture_tokens_and_small_context(tiny_models, family):
    path = tiny_models[family]
    config = json.loads((path / "config.json").read_text())
    text = config.get("text_config", config)  # K3: the language model's config inside the wrapper's
    assert config["architectures"] == [ARCHITECTURE[family]] and text["max_position_embeddings"] == 4096
    tokenizer = AutoTokenizer.from_pretrained(path)
    marker = MARKERS[family]
    assert tokenizer(marker, add_special_tokens=False).input_ids == [tokenizer.convert_tokens_to_ids(marker)]
    assert (path / "model.safetensors").exists()
    assert bool(tokenizer.chat_template) == (family != "kimi_k3")  # K3's prompt is rendered by Deltafin


def test_command_line(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "deltafin.tiny", "--family", "glm", "--variant", "glm47", "--out", str(tmp_path / "m")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    written = json.loads((tmp_path / "m" / "deltafin_tiny.json").read_text())
    assert (written["family"], written["variant"]) == ("glm", "glm47")


def test_command_line_writes_k3_as_published(tmp_path):
    """K3's released layout with MXFP4 routed experts: the quantization config under text_config, each
    expert projection as weight_packed (U8) and weight_scale (E8M0 bytes), everything else as it was."""
    from deltafin.engine.experts.checkpoint import read_header

    out = tmp_path / "k3"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "deltafin.tiny",
            "--family",
            "kimi_k3",
            "--quant",
            "mxfp4",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["text_config"]["quantization_config"]["format"] == "mxfp4-pack-quantized"
    header = read_header(out / "model.safetensors")
    expert = "language_model.model.layers.1.block_sparse_moe.experts.3.w1"
    assert header[f"{expert}.weight_packed"]["dtype"] == header[f"{expert}.weight_scale"]["dtype"] == "U8"
    assert f"{expert}.weight" not in header
    assert header["language_model.model.layers.1.self_attn.q_proj.weight"]["dtype"] == "F32"


def test_command_line_refuses_an_unknown_variant(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "deltafin.tiny", "--family", "glm", "--variant", "glm46", "--out", str(tmp_path / "m")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "glm46" in result.stderr


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_gguf_conversion_names_the_gpt2_pre_tokenizer_only_where_it_is_one(tiny_models, family):
    """deltafin/tiny/gguf.py's one override of llama.cpp's converter: every tiny tokenizer splits text as GPT-2's
    byte-level BPE does, so it is `gpt-2`; a tokenizer that splits otherwise is still refused."""
    from tokenizers import pre_tokenizers

    from deltafin.tiny.gguf import gpt2_pre_tokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_models[family])
    assert gpt2_pre_tokenizer(tokenizer) == "gpt-2"
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    with pytest.raises(NotImplementedError):
        gpt2_pre_tokenizer(tokenizer)
