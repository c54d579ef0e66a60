"""One log format: structlog JSON lines on stdout, for Deltafin's own events and for every stdlib logger
(uvicorn's boot and error lines, transformers, warnings); the request id is bound once per request through
contextvars, so lines logged while serving a request carry it whatever logger wrote them."""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog

_SHARED: list[Any] = [
    structlog.contextvars.merge_contextvars,
    structlog.processors.add_log_level,
    structlog.processors.TimeStamper(fmt="iso", utc=True),
]


def configure_logging(level: str = "info", *, json: bool = True) -> None:
    numeric = getattr(logging, level.upper(), logging.INFO)
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[*_SHARED, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stdout),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[*_SHARED, structlog.stdlib.add_logger_name, structlog.stdlib.ExtraAdder()],
            processors=[
                structlog.stdlib.ProcessorFormatter.remove_processors_meta,
                structlog.processors.format_exc_info,
                renderer,
            ],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    # Libraries log at warning and above; uvicorn's own lines (boot, shutdown, errors) at the server's level.
    root.setLevel(max(numeric, logging.WARNING))
    for name in ("uvicorn", "uvicorn.error", "uvicorn.asgi"):
        uvicorn_logger = logging.getLogger(name)
        uvicorn_logger.handlers[:] = []
        uvicorn_logger.propagate = True
        uvicorn_logger.setLevel(numeric)
    logging.captureWarnings(True)
    _no_progress_bars()


def _no_progress_bars() -> None:
    """Progress bars (transformers' "Loading weights", GGUF conversion, huggingface_hub's downloads) are
    neither log lines nor JSON."""
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils import logging as transformers_logging

    disable_progress_bars()
    transformers_logging.disable_progress_bar()
