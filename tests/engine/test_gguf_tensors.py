"""deltafin.engine.weights.gguf_tensors against the `gguf` package's own reader: the same tensors, types, shapes and bytes,
on the default model's file and on a K-quant file the repo writes (other types, another alignment of values)."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGUFReader

from deltafin.engine.weights.gguf_tensors import read_tensors
from deltafin.engine.weights.loader import resolve_model_path
from deltafin.testing import compose_config
from deltafin.testing.gguf_damage import DAMAGE, MODEL_DAMAGE, Layout


def assert_same_as_gguf_reader(path):
    ours, theirs = read_tensors(path), GGUFReader(str(path))
    field = theirs.fields["general.architecture"]
    assert ours.architecture == bytes(field.parts[field.data[0]]).decode()
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors):
        assert mine.tensor_type == reference.tensor_type and list(mine.shape) == list(reference.shape)
        assert mine.data.dtype == reference.data.dtype and mine.data.shape == reference.data.shape
        assert np.array_equal(np.asarray(mine.data), np.asarray(reference.data)), mine.name


def test_the_default_models_file_reads_as_the_gguf_package_reads_it():
    assert_same_as_gguf_reader(resolve_model_path(compose_config().model.path))


def test_every_metadata_type_and_a_custom_alignment_read_as_the_gguf_package_reads_them(tmp_path):
    """Metadata of each value type (arrays of numbers, strings and arrays included) is stepped over exactly, and
    tensors of float and block types land where the file's own alignment puts them."""
    import gguf

    path = tmp_path / "mixed.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_custom_alignment(64)
    for add, value in [
        ("add_uint8", 7),
        ("add_int8", -7),
        ("add_uint16", 700),
        ("add_int16", -700),
        ("add_uint32", 70000),
        ("add_int32", -70000),
        ("add_float32", 0.5),
        ("add_bool", True),
        ("add_uint64", 2**40),
        ("add_int64", -(2**40)),
        ("add_float64", 0.25),
        ("add_string", "é ok"),
    ]:
        getattr(writer, add)(f"test.{add}", value)
    writer.add_array("test.numbers", [1, 2, 3])
    writer.add_array("test.strings", ["a", "", "long " * 50])
    writer.add_array("test.nested", [[1, 2], [3]])
    rng = np.random.default_rng(0)
    writer.add_tensor("f32", rng.standard_normal((3, 5)).astype(np.float32))
    writer.add_tensor("f16", rng.standard_normal((7,)).astype(np.float16))
    rows = rng.standard_normal((4, 256)).astype(np.float32)
    for kind in (gguf.GGMLQuantizationType.Q8_0, gguf.GGMLQuantizationType.Q4_0):
        blocks = gguf.quants.quantize(rows, kind)
        writer.add_tensor(kind.name.lower(), blocks, raw_shape=blocks.shape, raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert_same_as_gguf_reader(path)
    assert read_tensors(path).architecture == "qwen3"


@pytest.mark.parametrize("cut", [100, 5000, 2_000_000, -1000])
def test_a_file_cut_short_is_a_value_error_naming_it(tmp_path, cut):
    source = resolve_model_path(compose_config().model.path).read_bytes()
    path = tmp_path / "cut.gguf"
    path.write_bytes(source[:cut])
    with pytest.raises(ValueError, match="damaged or truncated GGUF"):
        read_tensors(path)


@pytest.mark.parametrize("damage", [b"GGUX", b"GGUF\x09\x00\x00\x00"])
def test_a_file_that_is_not_a_gguf_v2_or_v3_is_a_value_error(tmp_path, damage):
    path = tmp_path / "bad.gguf"
    path.write_bytes(damage + b"\0" * 64)
    with pytest.raises(ValueError):
        read_tensors(path)


@pytest.fixture(scope="module")
def original():
    return resolve_model_path(compose_config().model.path).read_bytes()


class TestDamage:
    """A damaged file is refused with a sentence saying what is wrong with it, naming the file and the field
    (which tensor, which metadata entry, which length), never a struct, numpy or enum error."""

    @pytest.mark.parametrize("damage", sorted(DAMAGE))
    def test_the_reader_says_what_is_wrong(self, tmp_path, original, damage):
        make, says = DAMAGE[damage]
        path = tmp_path / "damaged.gguf"
        path.write_bytes(make(original, Layout.of(original)))
        with pytest.raises(ValueError) as refused:
            read_tensors(path)
        message = str(refused.value)
        assert message.startswith(f"{path}: a damaged or truncated GGUF file: "), message
        assert all(words in message for words in says), message

    @pytest.mark.parametrize("damage", sorted(MODEL_DAMAGE))
    def test_the_native_load_says_which_tensor_its_metadata_misses(self, tmp_path, original, loaded_model, damage):
        """The file reads, but is not the Llama its own metadata describes: the load names the tensor (it was a
        KeyError naming only the tensor, or a reshape error)."""
        from deltafin.engine.weights.gguf_native import load_native, unsupported

        make, says = MODEL_DAMAGE[damage]
        path = tmp_path / "damaged.gguf"
        path.write_bytes(make(original, Layout.of(original)))
        assert unsupported(path) is None  # as the loader asks first: the file is a Llama of served types
        with pytest.raises(ValueError) as refused:
            load_native(path, loaded_model.source)  # the default file's skeleton: the same metadata
        message = str(refused.value)
        assert message.startswith(f"{path}: a damaged GGUF file: ") and all(w in message for w in says), message
