"""Quoting a registry's answer in an error or log line without its secrets.

Contract: :func:`redacted_excerpt` is the one way providers quote a response
body. It returns at most ``limit`` characters on one line, with the
connection's own secrets (passed in) replaced by ``***`` and the value after
any credential word (``Bearer``, ``token``, ``password``, ``Authorization``,
...) cut out, so a body that echoes the request (a reflecting proxy, a debug
page) cannot put a password or a token into a message.

A body that echoes the request carries a secret the way the request did:
JSON-escaped (a quote or a non-ASCII letter in a password), percent-encoded
(a form or a query string, either case of hex digits) or HTML-escaped (a
debug page). Each secret is masked in every one of those spellings, and a
quoted value after a credential word is masked up to its closing quote
(escaped quotes included), not to the first quote in it.

Cost: one bounded decode and two passes over at most ``4 * limit`` bytes.
"""

from __future__ import annotations

import html
import json
import re
from collections.abc import Iterable
from urllib.parse import quote, quote_plus

__all__ = ["redacted_excerpt"]

_WORDS = r"bearer|basic|token|secret|password|passwd|authorization|x-consul-token|api[-_]?key"
_CREDENTIAL = re.compile(
    rf"(?i)({_WORDS})"
    # The separator: a quote, ':' or '=' (group ``sep``), or bare spaces.
    r"((?P<sep>[\"']?\s*[:=]\s*|[\"']\s*)|\s*)"
    # The value, with an auth scheme in front of it taken along
    # (``Authorization: Bearer <token>`` masks the token, not the word).
    # After bare spaces another credential word is no value ("invalid
    # bearer token Bearer <t>"): the scan resumes at that word.
    rf"((?(sep)|(?!(?:{_WORDS})\b))"
    # A quoted value whole, escapes included (to the end of the text when
    # it is not closed), or a bare one.
    r"(?:\"(?:[^\"\\]|\\.)*\"?|'(?:[^'\\]|\\.)*'?|(?:(?:bearer|basic|digest)\s+)?[^\s\"',;&}<]+))"
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
    value = match.group(4)
    quote_mark = value[0]
    if quote_mark in "\"'":
        return f"{match.group(1)}{match.group(2)}{quote_mark}***{quote_mark}"
    if not match.group(2).strip() and value.lower().rstrip("!.?") in _VERDICTS:
        return match.group(0)
    return f"{match.group(1)}{match.group(2)}***"


def _percent_lower(match: re.Match[str]) -> str:
    return match.group(0).lower()


def _spellings(secret: str) -> set[str]:
    """``secret`` as a request may have carried it, and an echo may repeat it."""
    escaped = json.dumps(secret)[1:-1]
    percent = quote(secret, safe="")
    forms = {
        secret,
        escaped,
        json.dumps(secret, ensure_ascii=False)[1:-1],
        # JSON may escape "/" too.
        escaped.replace("/", "\\/"),
        percent,
        re.sub("%[0-9A-F]{2}", _percent_lower, percent),
        quote_plus(secret),
        quote(secret),
        html.escape(secret),
        html.escape(secret, quote=False),
    }
    forms.discard("")
    return forms


def _masked(text: str, secrets: Iterable[str]) -> str:
    forms: set[str] = set()
    for secret in secrets:
        if secret:
            forms |= _spellings(secret)
    # The longest first: a spelling that contains another is masked whole.
    for form in sorted(forms, key=len, reverse=True):
        text = text.replace(form, "***")
    return text


def redacted_excerpt(body: bytes | str, secrets: Iterable[str] = (), *, limit: int = 200) -> str:
    """A short, filtered excerpt of ``body`` that is safe to put in a message."""
    if isinstance(body, bytes):
        text = body[: limit * 4].decode("utf-8", "replace")
    else:
        text = body[: limit * 4]
    text = _masked(text, secrets)
    text = _CREDENTIAL.sub(_mask, text)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."
