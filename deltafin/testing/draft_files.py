"""A smaller Llama GGUF cut from a bigger one (its first layers, the same embedding, head and tokenizer): a draft
model for tests and benchmarks of speculative decoding, served natively like its source (nothing can be
downloaded here, and the default model is the smallest of its family)."""

from __future__ import annotations

import os
from pathlib import Path


def first_layers(source: Path, target: Path, layers: int) -> Path:
    """`source` (a Llama GGUF) with only its first `layers` blocks, written to `target` (kept if it exists): the
    same metadata but `llama.block_count`, the same tensors but those of later blocks, byte for byte."""
    import gguf

    if target.exists():
        return target
    reader = gguf.GGUFReader(str(source))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    writer = gguf.GGUFWriter(str(target) + ".tmp", arch)
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = layers if field.name == f"{arch}.block_count" else field.contents()
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        if tensor.name.startswith("blk.") and int(tensor.name.split(".")[1]) >= layers:
            continue
        if tensor.tensor_type in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
            writer.add_tensor(tensor.name, tensor.data)
        else:
            writer.add_tensor(tensor.name, tensor.data, raw_shape=tensor.data.shape, raw_dtype=tensor.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.rename(str(target) + ".tmp", target)
    return target
