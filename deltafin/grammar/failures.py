"""A grammar failure that is the server's, not the constraint's (imports nothing heavy: serving catches it)."""

from __future__ import annotations


class WorkerLost(Exception):
    """The grammar worker died on the request (killed from outside, or xgrammar crashed) or could not start:
    the server's failure, worth a retry (a constraint that keeps killing workers is refused by the caller)."""
