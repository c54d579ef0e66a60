"""Litestar wiring: routes, the error handler, readiness, auth, and the outer request-context layer."""

from deltafin.app.factory import build_app

__all__ = ["build_app"]
