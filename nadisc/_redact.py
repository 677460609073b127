"""Quoting a registry's answer in an error or log line without its secrets.

Contract: :func:`redacted_excerpt` is the one way providers quote a response
body. It returns at most ``limit`` characters on one line, with the
connection's own secrets (passed in) replaced by ``***`` and the value after
any credential word (``Bearer``, ``token``, ``password``, ``Authorization``,
...) cut out, so a body that echoes the request (a reflecting proxy, a debug
page) cannot put a password or a token into a message.

Cost: one bounded decode and two passes over at most ``4 * limit`` bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

__all__ = ["redacted_excerpt"]

_CREDENTIAL = re.compile(
    r"(?i)(bearer|basic|token|secret|password|passwd|authorization|x-consul-token|api[-_]?key)"
    # The value, with an auth scheme in front of it taken along
    # (``Authorization: Bearer <token>`` masks the token, not the word).
    r"([\"']?\s*[:=]?\s*[\"']?)((?:(?:bearer|basic|digest)\s+)?[^\s\"',;&}<]+)"
)
#: Words that say what happened to a credential rather than being one: after
#: a credential word and a space only (no ``:``, ``=`` or quote), they stay,
#: so a registry's own verdict (``token expired!``, ``authorization
#: failed!``, ``Invalid signature``) remains readable.
_VERDICTS = frozenset(
    {
        "expired",
        "invalid",
        "failed",
        "refused",
        "denied",
        "required",
        "missing",
        "not",
        "is",
        "was",
        "has",
        "mismatch",
        "rejected",
        "unknown",
    }
)


def _mask(match: re.Match[str]) -> str:
    if not match.group(2).strip() and match.group(3).lower().rstrip("!.?") in _VERDICTS:
        return match.group(0)
    return f"{match.group(1)}{match.group(2)}***"


def redacted_excerpt(body: bytes | str, secrets: Iterable[str] = (), *, limit: int = 200) -> str:
    """A short, filtered excerpt of ``body`` that is safe to put in a message."""
    if isinstance(body, bytes):
        text = body[: limit * 4].decode("utf-8", "replace")
    else:
        text = body[: limit * 4]
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    text = _CREDENTIAL.sub(_mask, text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
