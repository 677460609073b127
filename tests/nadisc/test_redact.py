"""A quoted answer never carries a connection's secret, in any spelling an echo
of the request would give it (``nadisc._redact``)."""

from __future__ import annotations

import html
import json
from collections.abc import Callable
from urllib.parse import quote, quote_plus

import anyio
import anyio.abc
import pytest

from nadisc import DiscoveryConfig, open_discovery, redacted_excerpt

SECRETS = [
    'pa"ss;hunter2',  # a quote: JSON escapes it, and a bare value stops at it
    "jürgen-sekrit",  # non-ASCII: JSON may write \u00fc
    "svc@sekrit.example",  # percent-encoded in a form: svc%40sekrit.example
    "a/b&c<d> e+f'g",  # every escaping differs
]

ECHOES: dict[str, Callable[[str], str]] = {
    "as is": lambda s: s,
    "JSON, ASCII": lambda s: json.dumps(s)[1:-1],
    "JSON, UTF-8": lambda s: json.dumps(s, ensure_ascii=False)[1:-1],
    "JSON, slash escaped": lambda s: json.dumps(s)[1:-1].replace("/", "\\/"),
    "form": quote_plus,
    "percent, upper hex": lambda s: quote(s, safe=""),
    "percent, lower hex": lambda s: quote(s, safe="").replace("%4", "%4").lower(),
    "path": quote,
    "HTML": html.escape,
}


def _tail(secret: str) -> str:
    # The part of a secret that must not survive (past any leading escape).
    return secret[-6:]


@pytest.mark.parametrize("secret", SECRETS)
@pytest.mark.parametrize("echo", list(ECHOES))
def test_each_spelling_of_a_secret_is_masked(secret: str, echo: str) -> None:
    spelled = ECHOES[echo](secret)
    body = f'HTTP 500: you sent {{"user": {json.dumps("x")}, "note": "{spelled}"}} and ?q={spelled}'
    shown = redacted_excerpt(body, [secret])
    assert spelled not in shown
    assert "***" in shown
    # Nothing readable of the secret is left, in whichever spelling.
    for form in {ECHOES[e](secret) for e in ECHOES}:
        assert form not in shown


@pytest.mark.parametrize("secret", SECRETS)
def test_the_json_echo_of_a_login_keeps_nothing_of_the_password(secret: str) -> None:
    body = json.dumps({"name": "ops", "password": secret})
    shown = redacted_excerpt(f"error: {body}", [secret])
    assert _tail(secret) not in shown
    assert '"password": "***"' in shown


def test_a_quoted_value_after_a_credential_word_is_cut_to_its_closing_quote() -> None:
    # Not a secret of the connection's: only the credential word finds it.
    shown = redacted_excerpt(r'denied: {"password": "pa\"ss;hunter2", "user": "ops"}')
    assert "hunter2" not in shown
    assert shown == 'denied: {"password": "***", "user": "ops"}'
    assert redacted_excerpt("token='ab\\'cd ef'") == "token='***'"
    # Not closed: masked to the end.
    assert "tail" not in redacted_excerpt('token: "abc tail')


def test_a_credential_word_after_another_is_not_taken_for_the_value() -> None:
    # "bearer token" is prose: the token after it is what is masked.
    assert (
        redacted_excerpt("invalid bearer token Bearer abc.def") == "invalid bearer token Bearer ***"
    )
    assert redacted_excerpt("bearer token abc123") == "bearer token ***"
    # With a separator, a word-like value is still a value.
    assert redacted_excerpt("password=token") == "password=***"


def test_verdicts_and_plain_text_are_left_alone() -> None:
    assert redacted_excerpt("password required", ["hunter2"]) == "password required"
    assert redacted_excerpt("plain answer", ["hunter2"]) == "plain answer"


async def _echo_server(
    listener: anyio.abc.Listener[anyio.abc.SocketStream], answered: list[bytes]
) -> None:  # pragma: no cover - served in the background
    async def answer(stream: anyio.abc.SocketStream) -> None:
        async with stream:
            request = b""
            while b"\r\n\r\n" not in request:
                request += await stream.receive()
            head, _, body = request.partition(b"\r\n\r\n")
            length = 0
            for line in head.split(b"\r\n")[1:]:
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            while len(body) < length:
                body += await stream.receive()
            answered.append(body)
            echo = b"you sent " + body + b" with " + head
            await stream.send(
                b"HTTP/1.1 500 Internal Server Error\r\nContent-Type: text/plain\r\n"
                b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (len(echo), echo)
            )

    await listener.serve(answer)


async def test_a_registry_echoing_the_login_shows_no_credential() -> None:
    """etcd's login (a JSON body) meets a server that quotes the request back:
    the connection's prepare failure names the refusal, and neither the
    password (with a quote in it) nor the non-ASCII user name survives."""
    password, user = 'pa"ss;hunter2', "jürgen-sekrit"
    answered: list[bytes] = []
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    config = DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {
                "primary": {
                    "provider": "etcd",
                    "startup_required": False,
                    "request_timeout_ms": 2000,
                    "etcd": {
                        "endpoints": [f"http://127.0.0.1:{port}"],
                        "username": user,
                        "password": password,
                        "services": {"a": {"name": "a"}},
                    },
                }
            },
        }
    )
    async with listener, anyio.create_task_group() as servers:
        servers.start_soon(_echo_server, listener, answered)
        async with open_discovery(config) as owner:
            [connection] = owner.observer().snapshot().connections
        servers.cancel_scope.cancel()
    # The login reached the server with the escaped password in it.
    assert any(b"hunter2" in body for body in answered)
    reason = connection.prepare_error
    assert reason is not None and "500" in reason
    # The echoed body is within the excerpt (the check below means something).
    assert '"password":"***"' in reason, reason
    assert "hunter2" not in reason
    assert "sekrit" not in reason
