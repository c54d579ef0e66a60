"""The typed schema of Deltafin's config: every key, its type, its default, its check and what it means.

The schema is registered in Hydra's ConfigStore and is the first entry of conf/config.yaml's defaults, so
composition itself refuses an unknown key, a wrong type or a value outside an Enum; the checks in field
metadata (ranges and the like) run right after, in `deltafin.config.validate.check_fields`. A conf/ option
file sets only what that option changes from these defaults. The comment on each field is the key's
documentation: docs/config.md is generated from it (`python -m deltafin.config.reference`).

Adding a key: one field in the right dataclass, with a type, a default and a one-line comment (a comment
right of the field, or lines of comments right above it); a number that has bounds takes
`ranged(default, low, high)`, a closed set of strings an Enum, any other rule `checked(check, default=...)`
with a check that returns None or the reason the value is wrong. Then regenerate docs/config.md.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Optional

from omegaconf import MISSING

#: A check in a field's metadata: the value -> None when it is acceptable, else why not (one line).
Check = Callable[[Any], Optional[str]]


@dataclass(frozen=True)
class Range:
    """A number in [low, high]; None passes when the field's default is None (the key is optional)."""

    low: float
    high: float
    nullable: bool = False

    def __call__(self, value: Any) -> str | None:
        if value is None and self.nullable:
            return None
        if value is None or not self.low <= value <= self.high:
            allowed = f"[{self.low}, {self.high}]" + (" or null" if self.nullable else "")
            return f"{value} is outside {allowed}"
        return None


def ranged(default: Any, low: float, high: float) -> Any:
    """A numeric field whose value must lie in [low, high] (or be null, when the default is null)."""
    return field(default=default, metadata={"check": Range(low, high, nullable=default is None)})


def checked(check: Check, *, default: Any = MISSING, default_factory: Any = None) -> Any:
    """A field whose value `check` accepts (checked after composition, like ranges)."""
    if default_factory is not None:
        return field(default_factory=default_factory, metadata={"check": check})
    return field(default=default, metadata={"check": check})


# --- closed choices: a value outside these fails composition itself ---


class Device(StrEnum):
    cpu = "cpu"
    cuda = "cuda"  # one CUDA device (choose it with CUDA_VISIBLE_DEVICES)
    auto = "auto"  # accelerate's device map decides (placement.device_map)


class Dtype(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class ModelDtype(StrEnum):
    auto = "auto"  # the placement's dtype
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Quantize(StrEnum):
    none = "none"
    int8 = "int8"
    int4 = "int4"


class ExpertPolicy(StrEnum):
    lru = "lru"
    lfru = "lfru"


class ResponseStoreKind(StrEnum):
    memory = "memory"  # gone at restart
    sqlite = "sqlite"  # kept in server.responses.path (the standard library's sqlite3, write-ahead log)


class UnsupportedTools(StrEnum):
    drop = "drop"  # left out of the prompt, named in a response header and the log
    reject = "reject"  # a 400 naming the tool


class GgufWeights(StrEnum):
    native = "native"  # the file's own quantized blocks through Deltafin's C kernels
    dequantize = "dequantize"  # transformers' float32 copy, cached as a standard HF folder


class ChatFormatName(StrEnum):
    template = "template"  # the checkpoint's own Jinja chat template
    xtml = "xtml"  # Kimi K3's XTML, rendered by Deltafin


class ContentFormat(StrEnum):
    string = "string"  # message content handed to the template as one string (text parts joined by "\n")
    openai = "openai"  # content handed over as OpenAI's list of parts


#: whose cached prompt prefixes a request may reuse (`global` is a keyword, hence the functional form)
CacheScope = StrEnum("CacheScope", {"global": "global", "api_key": "api_key"})


class SamplingSource(StrEnum):
    checkpoint = "checkpoint"  # the checkpoint's generation_config.json (as vLLM reads it), model.sampling for the rest
    config = "config"  # model.sampling only
    none = "none"  # neither: OpenAI's defaults (temperature 1, no top-p / top-k / min-p, no penalties)


class LogLevel(StrEnum):
    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


class SpeculativeMethod(StrEnum):
    none = "none"
    ngram = "ngram"
    draft = "draft"
    mtp = "mtp"


class UpstreamApi(StrEnum):
    auto = "auto"  # vLLM's /inference/v1/generate, falling back to /v1/completions once on a 403/404/405
    generate = "generate"
    completions = "completions"


#: Routes `server.open_routes` may exempt from the API key (`/schema` covers everything under it).
OPENABLE_ROUTES = ("/health", "/metrics", "/schema")


def _open_routes(routes: Any) -> str | None:
    """a subset of `/health`, `/metrics`, `/schema`"""
    for route in routes:
        if route not in OPENABLE_ROUTES:
            return f"{route!r} is not one of {', '.join(OPENABLE_ROUTES)}"
    return None


def _no_blank_keys(keys: Any) -> str | None:
    """no blank entry"""
    for index, key in enumerate(keys):
        if not str(key).strip():
            return f"entry {index} is blank: a key needs a non-space character (an empty list turns keys off)"
    return None


def _served_name(name: Any) -> str | None:
    """a non-blank name"""
    return None if str(name).strip() else "a served name needs a non-space character (requests send it as `model`)"


def _served_names(names: Any) -> str | None:
    """non-blank names"""
    for index, name in enumerate(names):
        if not str(name).strip():
            return f"entry {index} is blank: a served name needs a non-space character"
    return None


def _device_memory(limits: Any) -> str | None:
    """null, or a mapping of device (a GPU index, cpu, disk) to a size (20GiB, 64000MB, bytes)"""
    if limits is None:
        return None
    if not isinstance(limits, Mapping):
        return f"a mapping of device to size, e.g. {{0: 20GiB, cpu: 64GiB}} (got {limits!r})"
    for device, size in limits.items():
        if not (isinstance(device, int) or str(device) in ("cpu", "disk", "mps")):
            return f"{device!r} is not a device (a GPU index, cpu, disk or mps)"
        if not isinstance(size, (int, str)) or isinstance(size, bool):
            return f"{device}: {size!r} is not a size (e.g. 20GiB)"
    return None


def _http_url(url: Any) -> str | None:
    """`http://` or `https://` URL"""
    if url is not None and not str(url).startswith(("http://", "https://")):
        return f"an upstream engine needs http(s)://HOST:PORT (got {url!r})"
    return None


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9_-]{1,63}(?<!-)")  # `_` too: container names resolve with one


def _bindable_host(host: Any) -> str | None:
    """an IP address or a host name this machine can listen on

    A host name as RFC 1123 spells one: a dotted string of digits that is not an IPv4 address (999.1.1.1) is
    neither. Whether this machine can listen there is found out by binding the socket before anything loads
    (deltafin.cli)."""
    text = str(host)
    try:
        ipaddress.ip_address(text)
        return None
    except ValueError:
        pass
    labels = text.rstrip(".").split(".")
    if len(text) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels) or labels[-1].isdigit():
        return f"{text!r} is neither an IP address nor a host name"
    return None


def _open_unit(value: Any) -> str | None:
    """null, or a number in (0, 1]"""
    if value is None or 0 < value <= 1:
        return None
    return f"{value} is outside (0, 1] or null"


def _otlp_url(url: Any) -> str | None:
    """null, or an `http://` / `https://` URL"""
    if url is not None and not str(url).startswith(("http://", "https://")):
        return f"an OTLP/HTTP collector needs http(s)://HOST:PORT[/v1/traces] (got {url!r})"
    return None


def _revision(value: Any) -> str | None:
    """null, or a branch, tag or commit of the Hub repository `model.path` names"""
    text = str(value)
    if value is None or (text.strip() and ".." not in text and not any(c.isspace() for c in text)):
        return None
    return f"{value!r} is not a branch, tag or commit (null: the repository's default branch)"


# --- the groups ---


@dataclass
class SamplingConfig:
    """A model's default sampling: applied to each field a request leaves out (the request's own value always
    wins, and compat rules that pin a field win over both). null: no default of the model's (OpenAI's applies)."""

    temperature: Optional[float] = ranged(None, 0, 2)  # 0 = greedy
    top_p: Optional[float] = checked(_open_unit, default=None)  # nucleus: the smallest set of tokens this likely
    top_k: Optional[int] = ranged(None, -1, 1 << 30)  # 0 or -1 = off
    min_p: Optional[float] = ranged(None, 0, 1)  # tokens below this share of the likeliest one's probability are cut
    repetition_penalty: Optional[float] = ranged(None, 0.01, 10)  # HF style, over prompt and output (1 = off)
    presence_penalty: Optional[float] = ranged(None, -2, 2)  # OpenAI style, over generated tokens
    frequency_penalty: Optional[float] = ranged(None, -2, 2)  # OpenAI style, over generated tokens
    # completion tokens of a request that names none (bounded by the room its prompt leaves); null: chat runs to
    # EOS, completions take server.completion_default_max_tokens
    max_tokens: Optional[int] = ranged(None, 1, 1 << 30)


@dataclass
class ModelConfig:
    name: str = checked(_served_name)  # the id served by /v1/models and accepted in a request's `model`
    family: str = MISSING  # the model family (deltafin/families/): its parsers and family-scoped rules; never guessed
    # the checkpoint: a local HF folder, a .gguf file, `pkg:PACKAGE/FILE` (a file inside an installed Python
    # package), or a Hugging Face Hub id (ORG/NAME: the local Hugging Face cache, else downloaded into it; only the
    # files the engine reads); in gateway mode only the tokenizer files are read
    path: str = MISSING
    # with a Hub id in `path`: its branch, tag or commit (null: the default branch)
    revision: Optional[str] = checked(_revision, default=None)
    aliases: list[str] = checked(
        _served_names, default_factory=list
    )  # other names clients may send for this model (one with `*` is a pattern: claude-*)
    variant: Optional[str] = None  # a variant of the family (GLM: glm45 | glm47); null = the family's default
    # vLLM / SGLang parser names (`model.tool_parser=glm47`), accepted for familiarity: a family or variant name,
    # which only selects the variant; the family owns its parsers
    tool_parser: Optional[str] = None
    reasoning_parser: Optional[str] = None  # the same, for the reasoning parser's name
    # prompt + completion tokens; null = the checkpoint's max_position_embeddings
    context_length: Optional[int] = ranged(None, 1, 1 << 30)
    chat_format: ChatFormatName = ChatFormatName.template  # who renders the prompt
    content_format: ContentFormat = (
        ContentFormat.string
    )  # how the template reads message content (a string, or OpenAI's parts)
    thinking_kwarg: Optional[str] = None  # the chat_template_kwargs key that turns thinking on/off (/parse reads it)
    trust_remote_code: bool = False  # run the checkpoint's own model and tokenizer code
    dtype: ModelDtype = ModelDtype.auto  # the weights' dtype; auto = placement.dtype
    cache_dir: Optional[str] = None  # where converted GGUF and quantized weights are cached; null = ~/.cache/deltafin
    # a GGUF file: native = served in its own blocks (Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, Llama) through C kernels;
    # dequantize = a float32 copy (also what other files, placement.quantize and non-CPU placements get)
    gguf_weights: GgufWeights = GgufWeights.native
    # defaults passed to the chat template (enable_thinking, ...); a request's own chat_template_kwargs win
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # default sampling for what a request leaves out (docs/config.md; /v1/models shows what applies)
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    # where the defaults come from: checkpoint = generation_config.json's temperature, top_p, top_k, min_p,
    # repetition_penalty and max_new_tokens (as vLLM), model.sampling for the rest; config = model.sampling only;
    # none = no defaults
    sampling_source: SamplingSource = SamplingSource.checkpoint


@dataclass
class ExpertsConfig:
    """The expert pool (deltafin/engine/experts): routed experts of a MoE read from the checkpoint on demand."""

    pool_mb: int = ranged(0, 0, 1 << 30)  # MiB of expert slots; 0 = every expert resident (loaded whole, no pool)
    policy: ExpertPolicy = ExpertPolicy.lru  # which expert leaves a full pool (lfru: frequency-weighted recency)
    prefetch: bool = True  # read the next layer's predicted experts while this layer computes
    readers: int = ranged(4, 1, 256)  # threads reading experts from the checkpoint (parallel reads keep a disk busy)
    # write the experts once to model.cache_dir as the slots' records and read each miss from there in one read:
    # placement.quantize=int8's int8 copy (a quarter of float32's bytes), or a published quantized checkpoint's
    # packed records (lossless, as large as its experts); false = read the checkpoint (int8: quantize each miss)
    quantized_copy: bool = True
    # read that copy with O_DIRECT (no page-cache copy or page cache; false = through the page cache)
    direct_io: bool = True


@dataclass
class PlacementConfig:
    device: Device = Device.cpu  # where the weights live (auto: accelerate's device_map decides)
    dtype: Dtype = Dtype.float32  # the compute dtype (CPU bf16 matmuls are slower than float32)
    device_map: Optional[str] = None  # accelerate device map (auto, balanced, ...); null = the whole model on `device`
    # per-device limits for a device map, e.g. {0: 20GiB, cpu: 64GiB} (typed Any: OmegaConf cannot merge a command
    # line's dict into a null Optional[dict], and GPU indices are ints)
    max_memory: Any = checked(_device_memory, default=None)
    offload_folder: Optional[str] = None  # where accelerate offloads weights that fit nowhere else
    # torch threads of the engine; null = torch's default (one fewer beside an expert pool whose reads copy
    # through the page cache: docs/experts.md)
    num_threads: Optional[int] = ranged(None, 1, 4096)
    compile: bool = False  # torch.compile the batched decode step (static shapes per batch bucket)
    quantize: Quantize = Quantize.none  # weight-only quantized linear layers at load (CPU kernels; cached)
    experts: ExpertsConfig = field(default_factory=ExpertsConfig)  # the expert pool of a MoE (docs/experts.md)


@dataclass
class CompatConfig:
    # the rewrite rules, keyed by rule name so `~compat.rules.NAME` and `compat.rules.NAME.value=...` work on the
    # command line; each is `_target_` (the rule's class), its arguments and optionally `families: [...]`
    rules: dict[str, Any] = field(default_factory=dict)


@dataclass
class QueueConfig:
    max_waiting: int = ranged(16, 0, 1 << 20)  # requests waiting for the engine beyond this get 429 at once
    # a request that waited this long (for a prompt thread, then the engine) gets 429; 8 rows of 64-token answers
    # take ~9 s on 2 cores, so 16 waiters fit (docs/benchmarks.md)
    timeout_s: float = ranged(30.0, 0, 86400)
    large_body_bytes: int = ranged(
        65536, 1, 1 << 40
    )  # bodies this large have their prompt worked on in a lane of their own ...
    max_large_prompts: int = ranged(
        2, 1, 1 << 20
    )  # ... which holds at most this many (queued or running); past that, 429
    # smaller bodies have their prompt rendered on the event loop itself (~0.1 ms, less than the hop to a prompt
    # thread and back); 0 sends every prompt to a thread
    inline_body_bytes: int = ranged(8192, 0, 1 << 40)


@dataclass
class MemoConfig:
    entries: int = ranged(32, 0, 1 << 20)  # deterministic-response LRU size; 0 disables it


def _folder(path: Any) -> str | None:
    """null, or a folder path (created when missing)"""
    if path is not None and not str(path).strip():
        return "a folder path, or null (an empty string is neither)"
    return None


@dataclass
class PrefixCacheConfig:
    """The prefix cache (docs/prefix-cache.md): RAM under a byte budget, then an optional disk tier."""

    enabled: bool = (
        True  # reuse the KV cache of an earlier request's shared prefix (multi-turn, agents); false stores nothing
    )
    min_tokens: int = ranged(16, 1, 1 << 30)  # shorter shared prefixes are recomputed
    # bytes of RAM the cached attention positions, recurrent states and checkpoints take at most (least recently
    # used entries leave first, those never reused before those reused); the process may exceed it by the running
    # rows' own caches and the disk writer's queue (docs/prefix-cache.md)
    max_bytes: int = ranged(2 << 30, 0, 1 << 50)
    # a folder for the disk tier (survives restarts; several processes may share it); null = no disk tier
    disk_dir: Optional[str] = checked(_folder, default=None)
    disk_max_bytes: int = ranged(
        16 << 30, 0, 1 << 56
    )  # bytes of block files the disk folder holds at most (oldest go first)
    # prompt positions per block file; a prompt is reused from disk in whole blocks
    disk_block_tokens: int = ranged(64, 1, 1 << 20)
    # hybrid models (linear-attention layers): copy the recurrent and convolution states every N prompt tokens, so a
    # prompt that shares only part of an earlier one restarts from the last copy within it; null = only at the end
    # of each prompt and generation. Copies at block ends (a multiple of disk_block_tokens) reach the disk tier
    state_every_tokens: Optional[int] = field(default=512, metadata={"check": Range(1, 1 << 30, nullable=True)})
    # global: prefixes are reused across requests and API keys (the tokens are the request's own prompt, so reuse
    # changes timing only); api_key: only by requests with the same key (no timing side channel between keys)
    scope: CacheScope = CacheScope["global"]


@dataclass
class TemplateConfig:
    trust_request_chat_template: bool = (
        False  # true lets a request's chat_template_kwargs.chat_template replace the model's
    )
    render_timeout_s: float = ranged(
        2.0, 0.01, 600
    )  # a chat template render (the model's or a request's) past this is a 400
    max_rendered_chars: int = ranged(8 * 1024 * 1024, 1, 1 << 34)  # a rendered prompt larger than this is a 400


@dataclass
class ConnectionsConfig:
    max_open: int = ranged(256, 1, 1 << 20)  # concurrent connections beyond this get 503 at once
    header_timeout_s: float = ranged(10.0, 0.1, 3600)  # a client must send its request line and headers within this
    body_timeout_s: float = ranged(30.0, 0.1, 3600)  # ... and its whole body within this after the headers; else 408
    keep_alive_s: float = ranged(5.0, 0.1, 3600)  # idle keep-alive connections are closed after this
    # request line + headers larger than this: 431 and the connection closed, decided while they arrive (nginx's
    # default allows 32 KiB, Node's 16 KiB)
    max_header_bytes: int = ranged(32768, 1024, 1 << 30)


@dataclass
class GrammarConfig:
    """Constraints (response_format json_schema / json_object, enforced tool_choice) are checked and compiled in
    worker processes, never on the event loop or the engine's thread."""

    # processes that check and compile constraints (each compile runs in one; they run below the server's priority
    # and take turns between API keys); null = one fewer than the cores, at least one, a core left for decoding
    workers: Optional[int] = ranged(None, 1, 64)
    # a compile running longer is killed (its worker replaced): 400, the schema is too complex; refusals are cached
    # like compiled grammars, so a resend costs nothing
    compile_timeout_s: float = ranged(10.0, 0.1, 3600)


@dataclass
class ResponsesConfig:
    store: ResponseStoreKind = ResponseStoreKind.memory  # where `store: true` responses live (/v1/responses)
    path: Optional[str] = None  # the sqlite file (store=sqlite); its folder must exist, a foreign file stops start-up
    max_entries: int = ranged(1000, 0, 1 << 30)  # stored responses kept at most; the oldest leave first (0: none)
    max_bytes: int = ranged(64 * 1024 * 1024, 0, 1 << 40)  # bytes of stored responses kept at most
    # each API key's records at most (past it its own oldest leave); null = an equal share of max_entries among
    # server.api_keys (all of it without keys), so one key's responses never push out another's
    max_entries_per_key: Optional[int] = ranged(None, 0, 1 << 30)
    max_bytes_per_key: Optional[int] = ranged(
        None, 0, 1 << 40
    )  # each API key's bytes at most; null = an equal share of max_bytes
    # hosted tools (web_search, file_search, ...): drop (named in x-deltafin-dropped-tools) | reject (400)
    unsupported_tools: UnsupportedTools = UnsupportedTools.drop


@dataclass
class TracingConfig:
    """OpenTelemetry traces of generation requests (`pip install deltafin[tracing]`; docs/tracing.md)."""

    # the collector's OTLP/HTTP (protobuf) URL: http://HOST:4318 (spans go to /v1/traces) or the full traces URL;
    # null: tracing off, and nothing of OpenTelemetry is imported
    otlp_endpoint: Optional[str] = checked(_otlp_url, default=None)
    # the share of new traces recorded (by trace id); a request that brings a W3C traceparent follows its sampled flag
    sample_ratio: float = ranged(1.0, 0, 1)
    service_name: str = "deltafin"  # the service.name resource attribute of every span


@dataclass
class ServerConfig:
    host: str = checked(_bindable_host, default="127.0.0.1")  # the address to listen on (0.0.0.0: every interface)
    port: int = ranged(8000, 0, 65535)  # the TCP port to listen on (0: any free port)
    # non-empty: every request needs `Authorization: Bearer <key>` but those to server.open_routes
    api_keys: list[str] = checked(_no_blank_keys, default_factory=list)
    max_body_bytes: int = ranged(4 * 1024 * 1024, 1, 1 << 40)  # larger request bodies get 413
    completion_default_max_tokens: int = ranged(256, 1, 1 << 30)  # /v1/completions without max_tokens
    max_n: int = ranged(8, 1, 128)  # upper bound for `n`
    max_stop_sequences: int = ranged(16, 0, 1024)  # upper bound for the number of `stop` strings
    max_top_logprobs: int = ranged(20, 0, 1000)  # upper bound for `top_logprobs` / completions' `logprobs`
    log_level: LogLevel = LogLevel.info  # the server's log level (libraries log at warning and above)
    queue: QueueConfig = field(default_factory=QueueConfig)
    memo: MemoConfig = field(default_factory=MemoConfig)
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    # routes served without an API key when api_keys is set: a subset of /health, /metrics, /schema (/schema
    # covers /schema/openapi.json and the UIs); every other route, unknown paths included, needs the key
    open_routes: list[str] = checked(_open_routes, default_factory=lambda: list(OPENABLE_ROUTES))
    shutdown_grace_s: float = ranged(
        10.0, 0, 3600
    )  # SIGTERM/SIGINT: in-flight generations get this long, then end with an error event
    templates: TemplateConfig = field(default_factory=TemplateConfig)
    connections: ConnectionsConfig = field(default_factory=ConnectionsConfig)
    responses: ResponsesConfig = field(default_factory=ResponsesConfig)
    grammar: GrammarConfig = field(default_factory=GrammarConfig)
    tracing: TracingConfig = field(default_factory=TracingConfig)  # OpenTelemetry traces (off by default)


def _speculation(spec: Any) -> str | None:
    """ngram_min at most ngram_max; a draft_path with method draft"""
    # (a value outside its own range is named by its own check, which runs after this one)
    if spec.ngram_min > spec.ngram_max and spec.ngram_max >= 1 and spec.ngram_min <= 64:
        return f"ngram_min ({spec.ngram_min}) is above ngram_max ({spec.ngram_max})"
    if spec.method == SpeculativeMethod.draft and not spec.draft_path:
        return "method=draft needs a draft model (engine.speculative.draft_path=PATH)"
    return None


@dataclass
class SpeculativeConfig:
    """Speculative decoding (local engine): each step, a row's next tokens are guessed and the model checks the
    guesses in the same pass that computes its next token, so a step can give several tokens for one read of the
    weights. Lossless: greedy output is token for token what `none` gives; sampled output too for a given seed."""

    # ngram (guesses copied from the prompt and the text so far; rows whose guesses do not pay stop guessing) |
    # none | draft (a smaller model with the same tokenizer guesses: draft_path) | mtp (the checkpoint's own
    # multi-token-prediction layers guess); docs/benchmarks.md says why ngram is the default
    method: SpeculativeMethod = SpeculativeMethod.ngram
    tokens: int = ranged(
        16, 1, 64
    )  # most tokens guessed for a row in one step (each row's count adapts to its acceptance)
    ngram_min: int = ranged(2, 1, 64)  # ngram: shortest run of the latest tokens looked up earlier in the text
    ngram_max: int = ranged(8, 1, 64)  # ngram: longest such run (longer matches are tried first)
    # draft: the draft model, a HF folder, .gguf file or pkg:PACKAGE/FILE served by the same engine kinds as the
    # main model (a GGUF in its own blocks included); its tokenizer must be the main model's
    draft_path: Optional[str] = None


@dataclass
class EngineConfig:
    """One schema for every engine: conf/engine/*.yaml chooses the builder; a key marked local or upstream is
    read by those engines only."""

    # who generates: a callable `(config) -> EngineClient` (the local torch engine, or an upstream's builder)
    _target_: str = "deltafin.engine.local.build.build_local_engine"
    max_batch: int = ranged(
        8, 1, 1024
    )  # local: rows (choices of requests) decoded together in one step; more wait in the queue
    # local: prompt positions prefilled between two decode steps (chunked prefill): a running stream waits about one
    # chunk plus one step for its next token while a long prompt prefills; smaller chunks make that wait shorter and
    # a long prefill slower (docs/benchmarks.md: 64 prefills a 3k prompt as fast as 128, with half the wait)
    prefill_chunk_tokens: int = ranged(64, 16, 1 << 20)
    # local: admission by tokens: a prompt of this many tokens or more is a long prefill, and at most
    # max_long_prefills of them prefill at once, a row always left for other requests; a request waiting for that
    # turn holds no row and shorter ones pass it, so short requests start while long prompts prefill (vLLM's
    # long_prefill_token_threshold, max_long_partial_prefills); null: every prompt alike
    long_prefill_tokens: Optional[int] = ranged(1024, 1, 1 << 30)
    max_long_prefills: int = ranged(
        2, 1, 1024
    )  # local: long prefills at once (a row is always left for other requests)
    # local: speculative decoding (engine.speculative.method=ngram, ...); docs/benchmarks.md has its figures
    speculative: SpeculativeConfig = checked(_speculation, default_factory=SpeculativeConfig)
    url: Optional[str] = checked(_http_url, default=None)  # upstream: its base URL, e.g. http://gpu-node:8000
    api: UpstreamApi = UpstreamApi.auto  # vLLM upstream: its route (auto: /inference/v1/generate, else /v1/completions)
    model: Optional[str] = None  # upstream: the `model` field sent; null leaves it out (the upstream serves one model)
    api_key: Optional[str] = None  # upstream: sent as `Authorization: Bearer <key>` when set
    max_inflight: int = ranged(
        64, 1, 1 << 16
    )  # upstream: generations (choices) in flight at once; the queue holds the rest
    connect_timeout_s: float = ranged(
        5.0, 0.001, 3600
    )  # upstream: TCP connect (and write) timeout; a failed connect is 503
    read_timeout_s: float = ranged(600.0, 0.001, 86400)  # upstream: longest silence between two stream events; then 504
    retry_after_s: int = ranged(
        2, 0, 3600
    )  # upstream: Retry-After sent with 503s (and 429s when the upstream names none)
    spare_connections: int = ranged(1, 0, 64)  # upstream: connections opened ahead of need (0: connect on demand)


@dataclass
class DeltafinConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    placement: PlacementConfig = field(default_factory=PlacementConfig)
    compat: CompatConfig = field(default_factory=CompatConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    # more models served by this process beside the main one: served name -> the overrides that compose its own
    # config, as on the command line (docs/models.md); a request's `model` chooses among them
    models: dict[str, list[str]] = field(default_factory=dict)
