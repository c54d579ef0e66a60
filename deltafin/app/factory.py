"""`build_app(config)`: the ASGI app. The server listens at once; the model loads on a thread meanwhile."""

from __future__ import annotations

import asyncio
import gc
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator

import structlog
from litestar import Litestar, Response, get
from litestar.datastructures import State
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig

from deltafin import __version__
from deltafin.app.errors import handle_exception
from deltafin.app.request_context import RequestContext
from deltafin.app.auth import ApiKeyGate
from deltafin.app.body import publish_body_schemas
from deltafin.app.connections import BodyDeadline
from deltafin.app.generation import GenerationEndpoints, document_generation_routes
from deltafin.app.routes import BODY_TYPES, ROUTES
from deltafin.app.services import Services, engine_name
from deltafin.app.shutdown import Drain, DrainGate
from deltafin.config import DeltafinConfig
from deltafin.errors import EngineUnavailableError
from deltafin.metrics import Metrics

log = structlog.get_logger("deltafin.app")


class Readiness:
    """Holds the services once loaded, or why loading failed."""

    def __init__(self) -> None:
        self.services: Services | None = None
        self.error: str | None = None

    def require(self) -> Services:
        """The services, or the 503 that says why there are none yet."""
        if self.services is None:
            if self.error:
                raise EngineUnavailableError(
                    f"Service unavailable: the model failed to load: {self.error}.", code="model_load_failed"
                )
            raise EngineUnavailableError("Service unavailable: the model is still loading.", headers={"Retry-After": "5"})
        return self.services


def _provide_services(state: State) -> Services:
    return state.readiness.require()


def _engine_state(readiness: Readiness) -> tuple[float, float]:
    """(requests waiting, 1.0 if generating) for the gauges; zeros while the model loads."""
    if readiness.services is None:
        return 0.0, 0.0
    admission = readiness.services.ctx.engine.admission
    return float(admission.waiting), float(admission.busy)


@get("/health", summary="200 when the model is loaded, 503 while loading", include_in_schema=True)
async def health(state: State) -> Response:
    readiness: Readiness = state.readiness
    if readiness.services is not None:
        engine = readiness.services.ctx.engine
        upstream = await engine.readiness()  # an upstream engine: is it there and ready?
        if not upstream.ready:
            return Response({"status": "upstream_unavailable", "engine": engine.name, "error": upstream.detail},
                            status_code=503, headers={"Retry-After": "5"})
        return Response({"status": "ok", "model": state.config.model.name, "engine": engine.name})
    status = "failed" if readiness.error else "loading"
    return Response({"status": status, "error": readiness.error}, status_code=503)


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


def build_app(config: DeltafinConfig, services: Services | None = None) -> Any:
    """The ASGI app. With `services` given (tests) it is ready at once; else it loads in the background."""
    readiness = Readiness()
    app_metrics = Metrics()
    drain = Drain(config.server.shutdown_grace_s)
    app_metrics.watch_engine(lambda: _engine_state(readiness)[0], lambda: _engine_state(readiness)[1])
    app_metrics.watch_expert_pool(lambda: readiness.services.ctx.engine.expert_stats() if readiness.services else None)

    @asynccontextmanager
    async def load_in_background(app: Litestar) -> AsyncIterator[None]:
        if services is not None:
            readiness.services = services
            yield
            return

        async def load() -> None:
            try:
                services_loaded = await asyncio.to_thread(Services.load, config)
                services_loaded.ctx.prompt.prepare_loop_thread()  # on this loop's thread, where small prompts render
                readiness.services = services_loaded
                readiness.services.ctx.engine.observe(app_metrics)  # upstream latency and errors
                _freeze_loaded_heap()
                log.info("ready", model=config.model.name)
            except Exception as exc:  # shown by /health and 503s; the process stays up to say so
                readiness.error = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                log.error("model_load_failed", error=readiness.error)

        task = asyncio.create_task(load())
        try:
            yield
        finally:
            task.cancel()
            if readiness.services is not None:
                # Stop the engine before the interpreter exits: a torch call still running on the engine's
                # own thread at exit aborts the process (SIGABRT instead of exit 0).
                await readiness.services.ctx.engine.aclose()
                if readiness.services.ctx.grammars is not None:
                    readiness.services.ctx.grammars.close()  # its worker processes

    generation = GenerationEndpoints(services=readiness.require, drain=drain, max_body_bytes=config.server.max_body_bytes)
    litestar_app = Litestar(
        route_handlers=[*ROUTES, *generation.route_handlers(), health, metrics],
        dependencies={"services": Provide(_provide_services, sync_to_thread=False)},
        exception_handlers={Exception: handle_exception},
        lifespan=[load_in_background],
        state=State({"readiness": readiness, "config": config, "metrics": app_metrics, "drain": drain}),
        request_max_body_size=config.server.max_body_bytes,
        openapi_config=OpenAPIConfig(title="Deltafin", version=__version__, path="/schema"),
        debug=False,
        logging_config=None,  # Litestar's default would give the root logger its own plain-text format
    )
    publish_body_schemas(litestar_app, BODY_TYPES)
    document_generation_routes(litestar_app)
    # Outermost first: request id + log line + metrics; refuse new work while draining; the API key,
    # checked before routing so a request without one never has its body read; the body's deadline; Litestar.
    inner = BodyDeadline(litestar_app, config.server.connections.body_timeout_s)
    inner = ApiKeyGate(inner, config.server.api_keys, config.server.open_routes)
    app = RequestContext(DrainGate(inner, drain), app_metrics, engine=engine_name(config))
    app.drain = drain  # the server starts draining it on SIGTERM/SIGINT (deltafin.app.server)
    return app
