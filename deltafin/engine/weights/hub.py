"""`model.path` as a Hugging Face Hub id (ORG/NAME, `model.revision`): the local Hugging Face cache first, else a
download into it (huggingface_hub, with its progress bars), of only the files the engine reads.

What is fetched: the repository's top-level config, tokenizer, chat-template and generation-config files (its
`*.py` too with `trust_remote_code`), and, for the local engine, the weights its safetensors index names (or its
one `model.safetensors`; `pytorch_model*.bin` only where there is no safetensors). Other formats' copies
(`.gguf`, `original/*.pth`, `onnx/`, flax, a `.bin` beside safetensors), READMEs and images never are; neither
are the shards of a multimodal checkpoint that hold only the towers text serving leaves out (its vision tower,
projector): the engine then reads a text view of the snapshot (`text_view`: links to its files, with an index
of the shards it has), kept under `model.cache_dir`.

The cache layout is huggingface_hub's own (`HF_HOME`, `HF_HUB_CACHE`; `models--ORG--NAME/snapshots/COMMIT`), so
a model that vLLM, SGLang, transformers or `hf download` fetched is found here, and the other way round. Offline
(`HF_HUB_OFFLINE=1`) and not cached is one line naming the id and the cache folder. huggingface_hub is imported
only for a Hub id, and only when the cache does not hold it already: the command line checks `model.path` with
this module before torch loads.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deltafin.engine.weights.errors import ModelLoadError

#: ORG/NAME as the Hub spells repository ids (letters, digits, `-`, `_`, `.`; neither part starting with `.`)
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}")
_COMMIT = re.compile(r"[0-9a-f]{40}")

#: top-level files read besides the weights: config, tokenizer (fast, sentencepiece, tiktoken, BPE vocab and
#: merges), chat template, generation config, the weights' index
_META_SUFFIXES = (".json", ".txt", ".model", ".tiktoken", ".jinja")
_CODE_SUFFIX = ".py"  # the checkpoint's own code: only with trust_remote_code

#: the weights the engine loads, in order of preference: (index file, single file)
_WEIGHT_FORMATS = (
    ("model.safetensors.index.json", "model.safetensors"),
    ("pytorch_model.bin.index.json", "pytorch_model.bin"),
)

#: a function from a checkpoint's config.json to the weight-name prefixes text serving leaves out (its towers)
Towers = Callable[[dict[str, Any]], Sequence[str]]


@dataclass(frozen=True)
class HubModel:
    repo_id: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo_id if self.revision is None else f"{self.repo_id}@{self.revision}"


def hub_model(spec: str, revision: str | None = None) -> HubModel | None:
    """`spec` as a Hub repository id, or None: a `pkg:` path, an existing path, anything not shaped ORG/NAME."""
    if spec.startswith("pkg:") or not _REPO_ID.fullmatch(spec) or ".." in spec or spec.endswith(".gguf"):
        return None
    if Path(spec).expanduser().exists():  # a local folder of that name wins, as with vLLM
        return None
    return HubModel(spec, revision)


# --- the cache, without the network ---


def hub_cache() -> Path:
    """huggingface_hub's cache folder (HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _storage(model: HubModel) -> Path:
    return hub_cache() / ("models--" + model.repo_id.replace("/", "--"))


def _cached_commit(model: HubModel) -> str | None:
    """The commit the cache holds for the model's revision (a commit is itself; a branch or tag: its ref)."""
    revision = model.revision or "main"
    if _COMMIT.fullmatch(revision):
        return revision
    ref = _storage(model) / "refs" / revision
    try:
        commit = ref.read_text().strip()
    except OSError:
        return None
    return commit if _COMMIT.fullmatch(commit) else None


def cached(model: HubModel, *, weights: bool, views: Path) -> Path | None:
    """The cached folder holding everything the engine reads (the text view when there is one), or None."""
    commit = _cached_commit(model)
    if commit is None:
        return None
    for folder in (views / _storage(model).name / commit, _storage(model) / "snapshots" / commit):
        if folder.is_dir() and missing_files(folder, weights=weights) is None:
            return folder
    return None


def missing_files(folder: Path, *, weights: bool) -> str | None:
    """What the folder lacks that the engine reads (a config, the weights its index names), or None."""
    if not (folder / "config.json").is_file() and not (folder / "tokenizer_config.json").is_file():
        return "config.json"
    if not weights:
        return None
    for index, single in _WEIGHT_FORMATS:
        if (folder / index).is_file():
            shards = _index_shards(folder / index)
            absent = [shard for shard in shards if not (folder / shard).is_file()]
            return f"{len(absent)} of {len(shards)} weight files ({absent[0]} ...)" if absent else None
        if (folder / single).is_file():
            return None
    return "the weights (model.safetensors)"


def _index_shards(index: Path) -> list[str]:
    try:
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise ModelLoadError(f"model.path: {index} is not a weights index (no weight_map)") from None
    strange = [
        shard for shard in shards if not isinstance(shard, str) or Path(shard).name != shard or shard[:1] in ".~"
    ]
    if strange:  # an index naming files outside its folder is no checkpoint's
        raise ModelLoadError(f"model.path: {index} names a weight file outside its folder ({strange[0]!r})")
    return shards


# --- the command line's check ---


def check(model: HubModel, *, weights: bool, views: Path) -> None:
    """What the command line checks before anything loads: cached, or (online) a repository and revision the Hub
    has, with weights the engine loads. ModelLoadError with one line otherwise."""
    if cached(model, weights=weights, views=views) is not None:
        return
    if _offline():
        raise _not_cached(model, "HF_HUB_OFFLINE is set, so the Hub was not asked")
    names = [path for path, _ in _listing(model)]
    if weights:
        _weight_files(model, names)  # raises when the repository holds none the engine loads


def _not_cached(model: HubModel, why: str) -> ModelLoadError:
    return ModelLoadError(
        f"model.path: {model} is neither a local path nor in the Hugging Face cache ({hub_cache()}), and {why} "
        f"(fetch it where the Hub is reachable: hf download {model.repo_id}"
        + (f" --revision {model.revision}" if model.revision else "")
        + ")"
    )


def _listing(model: HubModel) -> list[tuple[str, int]]:
    """(path, size) of every file of the repository at the revision, in one request (the model's info, whose
    failure is not retried: a Hub that cannot be reached is said at once); Hub errors as one line each."""
    from huggingface_hub import HfApi

    with _hub_errors(model):
        info = HfApi().model_info(model.repo_id, revision=model.revision, files_metadata=True, timeout=30)
    return [(sibling.rfilename, int(sibling.size or 0)) for sibling in info.siblings or ()]


@contextmanager
def _hub_errors(model: HubModel) -> Iterator[None]:
    """What huggingface_hub raises, as ModelLoadError with one line naming the model."""
    try:
        yield
    except ModelLoadError:
        raise
    except Exception as exc:
        raise _one_line(model, exc) from None


def _one_line(model: HubModel, exc: Exception) -> ModelLoadError:
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    hub = constants.ENDPOINT
    if isinstance(exc, GatedRepoError):  # before RepositoryNotFoundError, its base
        return ModelLoadError(
            f"model.path: {model.repo_id} is gated on the Hub ({hub}): accept its terms there and set HF_TOKEN"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return ModelLoadError(
            f"model.path: {model.repo_id} is neither a local path nor a model on the Hub ({hub}) "
            "(a private one needs HF_TOKEN)"
        )
    if isinstance(exc, RevisionNotFoundError):
        return ModelLoadError(
            f"model.revision: {model.revision!r} is not a branch, tag or commit of {model.repo_id} on the Hub"
        )
    if isinstance(exc, LocalEntryNotFoundError):
        return _not_cached(model, f"the Hub ({hub}) cannot be reached")
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "?"
        return ModelLoadError(f"model.path: the Hub ({hub}) answered {status} for {model}")
    return _not_cached(model, f"the Hub ({hub}) cannot be reached ({type(exc).__name__}: {first_line(exc)})")


def first_line(exc: BaseException) -> str:
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), "")


# --- the download ---


def fetch(
    model: HubModel, *, weights: bool, trust_remote_code: bool, views: Path, towers: Towers | None = None
) -> Path:
    """The local folder of `model` with everything the engine reads: cached, else downloaded (progress on
    stderr). `weights`: the local engine's (False: an upstream engine's, which reads the tokenizer and config
    only); `towers`: what a multimodal checkpoint's text serving leaves out (None: nothing)."""
    found = cached(model, weights=weights, views=views)
    if found is not None:
        return found
    if _offline():
        raise _not_cached(model, "HF_HUB_OFFLINE is set, so the Hub was not asked")
    listing = _listing(model)
    top = [(path, size) for path, size in listing if "/" not in path]
    meta = [
        path for path, _ in top if path.endswith(_META_SUFFIXES) or (trust_remote_code and path.endswith(_CODE_SUFFIX))
    ]
    folder = _download(model, model.revision, meta)
    if not weights:
        return folder
    commit = folder.name  # the snapshot's commit: the weights come from the same one, whatever the branch does
    (choice,) = _weight_files(model, [path for path, _ in top])
    files, skipped = [choice], []
    if choice.endswith(".index.json"):  # its shards, less those that hold only towers text serving leaves out
        shards = _index_shards(folder / choice)
        skipped = _tower_shards(folder, choice, towers) if towers is not None else []
        files = [shard for shard in shards if shard not in skipped]
    sizes = dict(listing)
    started = time.perf_counter()
    _log().info(
        "model_download_start",
        model=str(model),
        files=len(files),
        bytes=sum(sizes.get(name, 0) for name in files),
        left_out=len(skipped),
        cache=str(hub_cache()),
    )
    _download(model, commit, files)
    _log().info("model_download_done", model=str(model), seconds=round(time.perf_counter() - started, 1))
    return text_view(folder, skipped, views) if skipped else folder


def _download(model: HubModel, revision: str | None, files: list[str]) -> Path:
    from huggingface_hub import snapshot_download

    with _hub_errors(model):
        # exact names as patterns (fnmatch), escaped in case a name holds [ ] * ?
        folder = snapshot_download(model.repo_id, revision=revision, allow_patterns=[glob.escape(f) for f in files])
    return Path(folder)


def _weight_files(model: HubModel, names: Sequence[str]) -> list[str]:
    """The weights the engine loads from a repository holding `names` (top level): an index's own name stands
    for its shards, which `fetch` reads from it once downloaded."""
    present = set(names)
    for index, single in _WEIGHT_FORMATS:
        if index in present:
            return [index]
        if single in present:
            return [single]
    ggufs = [name for name in names if name.endswith(".gguf")]
    hint = (
        f"; a GGUF repository: download one file (hf download {model.repo_id} {ggufs[0]}) and give its path"
        if ggufs
        else ""
    )
    raise ModelLoadError(
        f"model.path: {model} holds no weights the local engine loads (model.safetensors[.index.json], "
        f"pytorch_model.bin){hint}"
    )


def _tower_shards(folder: Path, index: str, towers: Towers) -> list[str]:
    """The shards of `index` whose every tensor lies under one of the config's tower prefixes."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return []
    prefixes = tuple(towers(config) if isinstance(config, dict) else ())
    if not prefixes:
        return []
    weight_map: dict[str, str] = json.loads((folder / index).read_text())["weight_map"]
    needed = {shard for name, shard in weight_map.items() if not name.startswith(prefixes)}
    return sorted(set(weight_map.values()) - needed)


def text_view(snapshot: Path, skipped: Sequence[str], views: Path) -> Path:
    """A folder of links to `snapshot`'s files but its weights index, rewritten to name the shards it has (the
    text model's), so transformers reads a complete checkpoint. Written beside its final place, then renamed:
    a concurrent boot never sees half of one."""
    target = views / snapshot.parent.parent.name / snapshot.name
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".view-", dir=target.parent))
    try:
        left_out = set(skipped)
        for entry in snapshot.iterdir():
            if entry.name in left_out:
                continue
            if entry.name.endswith(".index.json"):
                index = json.loads(entry.read_text())
                index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v not in left_out}
                (staging / entry.name).write_text(json.dumps(index, indent=2))
            else:
                os.symlink(entry.resolve() if entry.is_symlink() else entry, staging / entry.name)
        try:
            staging.rename(target)
        except OSError:  # another process made it first; its view is the same
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def _log() -> Any:
    import structlog

    return structlog.get_logger("deltafin.engine")
