"""Reasoning text handed to a stateless client to send back: the Responses API's `encrypted_content` and the
Messages API's thinking `signature`. It is ENCODED, NOT ENCRYPTED (base64 of the text, which anyone holding it
can read): what it buys is that a client which keeps only the opaque value (Codex; Claude Code with
`display: "omitted"`) still gets the model's reasoning back into its history, which Kimi's and K3's prompts keep.
"""

from __future__ import annotations

import base64
import binascii

_ENCODED = "deltafin.reasoning.v1:"


def encode_reasoning(text: str) -> str:
    return _ENCODED + base64.b64encode(text.encode("utf-8")).decode("ascii")


def decode_reasoning(value: str) -> str | None:
    """The text `encode_reasoning` encoded; None for anything else (another provider's opaque state)."""
    if not value.startswith(_ENCODED):
        return None
    try:
        return base64.b64decode(value[len(_ENCODED) :], validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
