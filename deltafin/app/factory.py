"""`build_app(config)`: the ASGI app. The server listens at once; the model loads on a thread meanwhile."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import structlog
from litestar import Litestar, Response, get
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig

from deltafin import __version__
from deltafin.app.auth import ApiKeyGate
from deltafin.app.body import publish_body_schemas
from deltafin.app.connections import BodyDeadline
from deltafin.app.errors import handle_exception
from deltafin.app.generation import GENERATION_ROUTES, GenerationEndpoints, document_generation_routes
from deltafin.app.request_context import RequestContext
from deltafin.app.routes import BODY_TYPES, ROUTES
from deltafin.app.served import ServedModel, ServedModels
from deltafin.app.services import Services, engine_name, start_fork_server
from deltafin.app.shutdown import Drain, DrainGate
from deltafin.config import DeltafinConfig
from deltafin.metrics import Metrics
from deltafin.serving.responses import open_store

log = structlog.get_logger("deltafin.app")


def _provide_models(state: State) -> ServedModels:
    return state.models


def _engine_states(models: ServedModels) -> list[tuple[str, float, float]]:
    """(model, requests waiting, 1.0 while generating) of each loaded model, for the gauges."""
    return [
        (
            services.ctx.model_name,
            float(services.ctx.engine.admission.waiting),
            float(services.ctx.engine.admission.busy),
        )
        for services in models.loaded()
    ]


def _expert_pools(models: ServedModels) -> list[tuple[str, Any]]:
    """(model, its pool's counters) of each loaded model that has an expert pool."""
    pools = [(services.ctx.model_name, services.ctx.engine.expert_stats()) for services in models.loaded()]
    return [(model, stats) for model, stats in pools if stats is not None]


def _prefix_caches(models: ServedModels) -> list[tuple[str, Any]]:
    """(model, its prefix cache's counters by tier) of each loaded model whose engine has one."""
    caches = [(services.ctx.model_name, services.ctx.engine.prefix_cache_stats()) for services in models.loaded()]
    return [(model, stats) for model, stats in caches if stats is not None]


@get(
    "/health",
    summary="200 when every served model is loaded (and its upstream answers), else 503",
    include_in_schema=True,
)
async def health(state: State) -> Response:
    models: ServedModels = state.models
    statuses = {model.name: model.status for model in models}
    down: dict[str, Any] = {}  # the first loaded model whose upstream does not answer
    for model in models:
        if model.services is None:
            continue
        engine = model.services.ctx.engine
        upstream = await engine.readiness()  # an upstream engine: is it there and ready? (answers from its state)
        if not upstream.ready:
            statuses[model.name] = "upstream_unavailable"
            down = down or {"model": model, "engine": engine.name, "error": upstream.detail}
    if down:
        body = {"status": "upstream_unavailable", "engine": down["engine"], "error": down["error"]}
        return Response(
            {**body, **_named(models, statuses, down["model"])}, status_code=503, headers={"Retry-After": "5"}
        )
    failed = next((model for model in models if model.error), None)
    if failed is not None:
        return Response(
            {"status": "failed", "error": failed.error, **_named(models, statuses, failed)}, status_code=503
        )
    loading = next((model for model in models if model.services is None), None)
    if loading is not None:
        return Response({"status": "loading", "error": None, **_named(models, statuses, loading)}, status_code=503)
    main = models.main.services
    assert main is not None
    return Response(
        {"status": "ok", "model": models.main.name, "engine": main.ctx.engine.name, **_named(models, statuses, None)}
    )


def first_line(exc: BaseException) -> str:
    """The first line of an error's message that says something, else the error's type."""
    return next((line.strip() for line in str(exc).splitlines() if line.strip()), type(exc).__name__)


def _named(models: ServedModels, statuses: dict[str, str], which: ServedModel | None) -> dict[str, Any]:
    """With several models: which one the status is about, and each model's own status."""
    if not models.several:
        return {}
    return {**({"failing_model": which.name} if which is not None else {}), "models": statuses}


@get("/metrics", summary="Prometheus metrics", media_type="text/plain; version=0.0.4")
async def metrics(state: State) -> bytes:
    return state.metrics.render()


def _freeze_loaded_heap() -> None:
    """Move everything loaded so far (torch, transformers, the tokenizers, the model: 340,000-440,000 objects
    that live as long as the process) out of the cyclic collector's reach. Left in, every full collection
    walked them all: ~185 ms (gateway) to ~235 ms (local engine) with the event loop stopped, three times in a
    couple of hundred gateway requests: a latency spike for every stream in flight (bench/gc_pause.py). Done
    once, when loading ends (the one pause falls before the server says it is ready)."""
    gc.collect()
    gc.freeze()


def build_app(
    config: DeltafinConfig,
    services: Services | Sequence[Services] | None = None,
    *,
    models: Sequence[DeltafinConfig] = (),
    tracer: Any = None,
) -> Any:
    """The ASGI app for `config`'s model and the other `models` (deltafin.config.models), loaded in the
    background one after another, the main one first. With `services` given (tests: one, or one per model, the
    main one first) it is ready at once. `tracer`: a deltafin.app.tracing.RequestTracer (tests); None builds one
    when `server.tracing.otlp_endpoint` is set (only then is OpenTelemetry imported)."""
    if tracer is None and config.server.tracing.otlp_endpoint is not None:
        from deltafin.app.tracing import RequestTracer

        tracer = RequestTracer(config.server.tracing, frozenset(GENERATION_ROUTES))
    loaded = [services] if isinstance(services, Services) else list(services or ())
    served = ServedModels([config, *models] if not loaded else [each.ctx.config for each in loaded])
    app_metrics = Metrics()
    drain = Drain(config.server.shutdown_grace_s)
    app_metrics.watch_engines(lambda: _engine_states(served))
    app_metrics.watch_expert_pools(lambda: _expert_pools(served))
    app_metrics.watch_prefix_caches(lambda: _prefix_caches(served))

    @asynccontextmanager
    async def load_in_background(app: Litestar) -> AsyncIterator[None]:
        if loaded:
            for model, each in zip(served, loaded):
                model.services = each
            try:
                yield
            finally:
                if tracer is not None:
                    tracer.flush()
            return
        store = open_store(
            config.server.responses, api_keys=len(config.server.api_keys)
        )  # one store, whichever model answered (GET needs no model)
        task = asyncio.create_task(_load_all(served, store, app_metrics))
        try:
            yield
        finally:
            task.cancel()
            for services_loaded in served.loaded():
                # Stop the engine before the interpreter exits: a torch call still running on the engine's
                # own thread at exit aborts the process (SIGABRT instead of exit 0).
                await services_loaded.ctx.engine.aclose()
                if services_loaded.ctx.grammars is not None:
                    services_loaded.ctx.grammars.close()  # its worker processes
            store.close()
            if tracer is not None:
                tracer.shutdown()  # the spans still batched leave now

    generation = GenerationEndpoints(services=served.require, drain=drain, max_body_bytes=config.server.max_body_bytes)
    litestar_app = Litestar(
        route_handlers=[*ROUTES, *generation.route_handlers(), health, metrics],
        dependencies={"models": Provide(_provide_models, sync_to_thread=False)},
        exception_handlers={Exception: handle_exception},
        lifespan=[load_in_background],
        state=State({"models": served, "config": config, "metrics": app_metrics, "drain": drain}),
        request_max_body_size=config.server.max_body_bytes,
        openapi_config=OpenAPIConfig(title="Deltafin", version=__version__, path="/schema"),
        debug=False,
        logging_config=None,  # Litestar's default would give the root logger its own plain-text format
    )
    publish_body_schemas(litestar_app, BODY_TYPES)
    document_generation_routes(litestar_app)
    # Outermost first: request id + log line + metrics; refuse new work while draining; the API key,
    # checked before routing so a request without one never has its body read; the body's deadline; Litestar.
    inner: Any = BodyDeadline(litestar_app, config.server.connections.body_timeout_s)
    inner = ApiKeyGate(inner, config.server.api_keys, config.server.open_routes)
    app = RequestContext(DrainGate(inner, drain), app_metrics, engine=engine_name(config), tracer=tracer)
    app.drain = drain  # the server starts draining it on SIGTERM/SIGINT (deltafin.app.server)
    return app


async def _load_all(served: ServedModels, store: Any, app_metrics: Metrics) -> None:
    """Load each model in turn (one model's failure is its own: the others still load and serve), then say
    ready. The grammar workers' fork server starts once, beside the first load."""
    start_fork_server()
    for model in served:
        try:
            services = await asyncio.to_thread(Services.load, model.config, store)
            services.ctx.work.prepare_loop_thread()  # on this loop's thread, where small prompts render
            model.services = services
            services.ctx.engine.observe(app_metrics)  # upstream latency and errors
        except Exception as exc:  # shown by /health and 503s; the process stays up to say so
            model.error = first_line(exc)
            log.error("model_load_failed", model=model.name, error=model.error)
    _freeze_loaded_heap()
    if served.loaded():
        loaded = [model.name for model in served if model.services is not None]
        log.info("ready", model=served.main.name, **({"models": loaded} if served.several else {}))
