"""Builds everything the routes serve from a config: engine, chat format, endpoint services."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from deltafin.config import DeltafinConfig
from deltafin.engine import EngineClient, EngineFront
from deltafin.prompt import build_chat_format
from deltafin.rules import build_pipeline
from deltafin.serving.chat import ChatService
from deltafin.serving.completions import CompletionService
from deltafin.serving.context import ServingContext, prompt_work_for
from deltafin.serving.prompt_work import PerThreadChatFormat
from deltafin.serving.parse import ParseService
from deltafin.serving.tokenize import TokenizeService


@dataclass
class Services:
    ctx: ServingContext
    chat: ChatService
    completions: CompletionService
    tokenize: TokenizeService
    parse: ParseService

    @classmethod
    def from_engine(cls, config: DeltafinConfig, engine: EngineFront) -> "Services":
        def chat_format_with(tokenizer: Any) -> Any:
            return build_chat_format(
                config.model.chat_format,
                tokenizer,
                content_format=config.model.content_format,
                default_kwargs=dict(config.model.chat_template_kwargs),
            )

        chat_format_with(engine.tokenizer)  # a format the checkpoint cannot serve fails here, at load
        prompt = prompt_work_for(config, engine.tokenizer)
        # Prompt work runs on two threads (deltafin.serving.prompt_work): each renders with its own tokenizer.
        chat_format = PerThreadChatFormat(chat_format_with, prompt.tokenizers)
        prompt.prepare(chat_format.prepare)
        rules = build_pipeline(config.compat.rules, config.model.family)
        ctx = ServingContext(config=config, engine=engine, chat_format=chat_format, rules=rules, prompt=prompt)
        chat = ChatService(ctx)
        return cls(
            ctx=ctx,
            chat=chat,
            completions=CompletionService(ctx),
            tokenize=TokenizeService(ctx, chat),
            parse=ParseService(chat),
        )

    @classmethod
    def load(cls, config: DeltafinConfig) -> "Services":
        return cls.from_engine(config, front_for(config, build_engine(config)))


def build_engine(config: DeltafinConfig) -> EngineClient:
    """The engine `engine._target_` names (conf/engine/*.yaml): a callable (config) -> EngineClient."""
    from hydra.utils import get_method

    return get_method(config.engine._target_)(config)


def build_local_engine(config: DeltafinConfig) -> EngineClient:
    """The built-in torch engine over model.path's weights."""
    from deltafin.engine.loader import load_model
    from deltafin.engine.local import LocalEngine
    from deltafin.grammar.compiled import constraint_factory, logits_width

    import torch

    # Only the engine's owner thread runs torch with several threads (LocalEngine._loop says why); loading here
    # with one keeps this thread from growing an OpenMP team of its own.
    threads = config.placement.num_threads or torch.get_num_threads()
    torch.set_num_threads(1)
    loaded = load_model(config.model, config.placement, max_batch=config.engine.max_batch)
    return LocalEngine(
        loaded,
        threads=threads,
        max_batch=config.engine.max_batch,
        constraint_factory=constraint_factory(loaded.tokenizer, logits_width(loaded.model), loaded.stop_token_ids),
        prefix_cache_min_tokens=config.server.prefix_cache.min_tokens if config.server.prefix_cache.enabled else None,
    )


def engine_name(config: DeltafinConfig) -> str:
    """The engine's short name for logs and metrics, known before it is built."""
    from hydra.utils import get_method

    return getattr(get_method(config.engine._target_), "engine_name", config.engine._target_)


build_local_engine.engine_name = "local"  # type: ignore[attr-defined]


def front_for(config: DeltafinConfig, engine: EngineClient) -> EngineFront:
    """Admission and memo, sized by the server config, in front of `engine`."""
    return EngineFront(
        engine,
        max_waiting=config.server.queue.max_waiting,
        timeout_s=config.server.queue.timeout_s,
        memo_entries=config.server.memo.entries,
    )
