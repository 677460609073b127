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
    r"([\"']?\s*[:=]?\s*[\"']?)([^\s\"',;&}<]+)"
)


def redacted_excerpt(body: bytes | str, secrets: Iterable[str] = (), *, limit: int = 200) -> str:
    """A short, filtered excerpt of ``body`` that is safe to put in a message."""
    if isinstance(body, bytes):
        text = body[: limit * 4].decode("utf-8", "replace")
    else:
        text = body[: limit * 4]
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    text = _CREDENTIAL.sub(lambda m: f"{m.group(1)}{m.group(2)}***", text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
