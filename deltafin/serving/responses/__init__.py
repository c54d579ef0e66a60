"""The Responses API (/v1/responses) served through the chat path: see service.py."""

from deltafin.serving.responses.service import ResponsesService
from deltafin.serving.responses.store import open_store

__all__ = ["ResponsesService", "open_store"]
