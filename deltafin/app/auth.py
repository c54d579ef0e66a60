"""The API-key gate: an ASGI layer that answers 401 before routing, so no body is read (or parsed) for a
request without a valid key. The key comes as `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key:
<key>` (Anthropic's), on any route. Routes in `server.open_routes` are served without one."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Sequence
from typing import Any

from deltafin.app.errors import send_error
from deltafin.app.request_context import ROUTE_KEY, STATS_KEY
from deltafin.errors import AuthenticationError
from deltafin.metrics import UNAUTHENTICATED

_BEARER = b"bearer "


def is_open(path: str, open_routes: Sequence[str]) -> bool:
    """`/schema` in open_routes opens /schema and everything under it; other entries open exactly that path."""
    return any(path == route or path.startswith(route.rstrip("/") + "/") for route in open_routes)


def owner_of(token: bytes) -> str:
    """Who a request with this (valid) key is, for what it stores (responses): a digest, never the key."""
    return hashlib.sha256(token).hexdigest()[:32]


def bearer_token(authorization: bytes) -> bytes:
    """The token of `Authorization: Bearer <token>` (b"" for any other header)."""
    if authorization[: len(_BEARER)].lower() != _BEARER:
        return b""
    return authorization[len(_BEARER) :].strip()


def token_matches(token: bytes, keys: Sequence[bytes]) -> bool:
    """Constant-time compare on bytes: a token with non-ASCII bytes is simply a wrong key. An empty or
    whitespace-only token never authenticates, whatever the configured keys are (a key list filled from an
    unset environment variable holds "", and must leave the server closed, not open)."""
    token = token.strip()
    if not token:
        return False
    matched = False
    for key in keys:  # no early exit: the time taken does not say which key came closest
        matched |= hmac.compare_digest(token, key)
    return matched


def key_matches(authorization: bytes, keys: Sequence[bytes]) -> bool:
    """Whether an `Authorization` header holds a configured key as a bearer token."""
    return token_matches(bearer_token(authorization), keys)


class ApiKeyGate:
    def __init__(self, app: Any, api_keys: Sequence[str], open_routes: Sequence[str]) -> None:
        self.app = app
        self.keys = [key.encode("utf-8") for key in api_keys]
        self.open_routes = list(open_routes)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not self.keys or is_open(scope.get("path", ""), self.open_routes):
            await self.app(scope, receive, send)
            return
        authorization = api_key = b""
        for name, value in scope.get("headers", ()):
            name = name.lower()
            if name == b"authorization":
                authorization = value
            elif name == b"x-api-key":
                api_key = value
        for token in (bearer_token(authorization), api_key):
            if token_matches(token, self.keys):
                stats = scope.get("state", {}).get(STATS_KEY)
                if stats is not None:
                    stats.owner = owner_of(token.strip())
                await self.app(scope, receive, send)
                return
        scope[ROUTE_KEY] = UNAUTHENTICATED
        error = AuthenticationError(
            "Incorrect or missing API key (send `Authorization: Bearer <key>` or `x-api-key: <key>`).",
            headers={"WWW-Authenticate": "Bearer"},
        )
        await send_error(send, error, scope)
