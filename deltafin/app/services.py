"""Builds everything the routes serve from a config: engine, chat format, endpoint services."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any

from deltafin.config import DeltafinConfig
from deltafin.engine import EngineClient, EngineFront
from deltafin.prompt import build_chat_format
from deltafin.rules import build_pipeline
from deltafin.serving.chat import ChatService
from deltafin.serving.completions import CompletionService
from deltafin.serving.context import ServingContext, prompt_work_for
from deltafin.serving.messages import MessagesService
from deltafin.serving.parse import ParseService
from deltafin.serving.prompt_work import PerThreadChatFormat
from deltafin.serving.responses import ResponsesService, open_store
from deltafin.serving.responses.conversation import speaks_developer
from deltafin.serving.responses.store import ResponseStore
from deltafin.serving.sampling_defaults import checkpoint_folder, sampling_defaults_for
from deltafin.serving.tokenize import TokenizeService


@dataclass
class Services:
    ctx: ServingContext
    chat: ChatService
    completions: CompletionService
    tokenize: TokenizeService
    parse: ParseService
    responses: ResponsesService
    messages: MessagesService

    @classmethod
    def from_engine(cls, config: DeltafinConfig, engine: EngineFront, store: ResponseStore | None = None) -> Services:
        """`store`: where stored responses live, shared by every model of the process (else one of its own)."""

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
        ctx = ServingContext(
            config=config,
            engine=engine,
            chat_format=chat_format,
            rules=rules,
            prompt=prompt,
            grammars=grammars_for(config, engine),
            sampling_defaults=sampling_defaults_for(config.model, checkpoint_folder(config.model)),
        )
        chat = ChatService(ctx)
        return cls(
            ctx=ctx,
            chat=chat,
            completions=CompletionService(ctx),
            tokenize=TokenizeService(ctx, chat),
            parse=ParseService(chat),
            responses=ResponsesService(
                ctx,
                chat,
                store
                if store is not None
                else open_store(config.server.responses, api_keys=len(config.server.api_keys)),
                developer_role=speaks_developer(
                    config.model.chat_format, getattr(engine.tokenizer, "chat_template", None)
                ),
            ),
            messages=MessagesService(ctx, chat),
        )

    @classmethod
    def load(cls, config: DeltafinConfig, store: ResponseStore | None = None) -> Services:
        """The model's engine built and loaded (this blocks: seconds to minutes), and its services."""
        return cls.from_engine(config, front_for(config, build_engine(config)), store)


def start_fork_server() -> None:
    """Start the grammar workers' fork server on a thread: it imports xgrammar (seconds), meanwhile a model
    loads."""
    threading.Thread(target=_start_fork_server, name="deltafin-forkserver-start", daemon=True).start()


def build_engine(config: DeltafinConfig) -> EngineClient:
    """The engine `engine._target_` names (conf/engine/*.yaml): a callable (config) -> EngineClient."""
    from hydra.utils import get_method

    return get_method(config.engine._target_)(config)


def _start_fork_server() -> None:
    from deltafin.grammar.lanes import fork_server

    try:
        fork_server()
    except Exception:  # grammars_for starts it again and reports the failure there
        pass


def grammars_for(config: DeltafinConfig, engine: EngineFront) -> Any:
    """The constraint compiler in front of `engine` (deltafin.grammar.service.Grammars), its worker processes
    started and what xgrammar needs of the tokenizer built now, at load, not by the first constrained request;
    None for an engine that cannot constrain."""
    caps = engine.capabilities
    if not caps.grammar:
        return None
    from deltafin.grammar.compiled import tokenizer_info
    from deltafin.grammar.lanes import default_workers
    from deltafin.grammar.service import Grammars

    # An upstream compiles for itself: its workers only check (limits, and xgrammar's reading of the schema).
    info = tokenizer_info(engine.tokenizer, engine.vocab_size, engine.stop_token_ids) if caps.compiled_grammar else None
    grammar = config.server.grammar
    return Grammars(
        info,
        engine.vocab_size,
        workers=default_workers() if grammar.workers is None else grammar.workers,
        timeout_s=grammar.compile_timeout_s,
        retry_after_s=config.server.queue.timeout_s,
    )


def engine_name(config: DeltafinConfig) -> str:
    """The engine's short name for logs and metrics, known before it is built."""
    from hydra.utils import get_method

    return getattr(get_method(config.engine._target_), "engine_name", config.engine._target_)


def front_for(config: DeltafinConfig, engine: EngineClient) -> EngineFront:
    """Admission and memo, sized by the server config, in front of `engine`."""
    return EngineFront(
        engine,
        max_waiting=config.server.queue.max_waiting,
        timeout_s=config.server.queue.timeout_s,
        memo_entries=config.server.memo.entries,
        # an upstream (vLLM, SGLang) schedules its own prefills: this one is the local engine's
        long_prefill_tokens=config.engine.long_prefill_tokens if engine_name(config) == "local" else None,
        max_long_prefills=config.engine.max_long_prefills,
    )
