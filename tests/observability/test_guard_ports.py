"""The console's Host/Origin guard reads ports as ASCII digits only.

``str.isdigit`` also accepts digits that ``int`` refuses (``'²'``, which a
header decoded as latin-1 can carry), and ``int`` refuses more than 4,300
digits: such a ``Host`` or ``Origin`` is refused like any foreign one (403),
never an error (HTTP 500).
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from nadisc.observability._asgi import RequestGuard, _origin_parts, host_of
from tests.fakes.consul import run_consul_fake
from tests.observability.support import consul_console

#: Ports that ``str.isdigit`` accepts and the guard must not take as ports.
NOT_PORTS = ["\u00b2", "\u00b3", "\u00b9", "8\u00b2", "\u0668\u0660", "\uff18\uff10", "99999"]


def scope(host: str | None, origin: str | None) -> dict[str, Any]:
    headers = [] if host is None else [(b"host", host.encode("latin-1", "replace"))]
    if origin is not None:
        headers.append((b"origin", origin.encode("latin-1", "replace")))
    return {"type": "websocket", "headers": headers, "server": ("127.0.0.1", 8765)}


@pytest.mark.parametrize("port", NOT_PORTS)
def test_a_port_that_is_not_ascii_digits_makes_host_and_origin_malformed(port: str) -> None:
    assert "\u00b2".isdigit()  # what let the value reach int() before
    assert host_of(f"127.0.0.1:{port}") is None
    assert host_of(f"[::1]:{port}") is None
    assert _origin_parts(f"http://127.0.0.1:{port}") is None
    assert _origin_parts(f"https://[::1]:{port}") is None


def test_a_port_of_thousands_of_digits_is_refused_not_an_error() -> None:
    # int() refuses more than 4,300 digits; the guard never gets that far.
    assert host_of("127.0.0.1:" + "1" * 5000) is None
    assert _origin_parts("http://127.0.0.1:" + "1" * 5000) is None
    # Leading zeros are still one port (as before).
    assert _origin_parts("http://127.0.0.1:" + "0" * 5000 + "80") == ("http", "127.0.0.1", 80)
    assert host_of("127.0.0.1:08765") == "127.0.0.1"


def test_the_guard_refuses_a_non_ascii_port_in_host_or_origin() -> None:
    guard = RequestGuard()
    own = "127.0.0.1:8765"
    assert guard.host_ok(scope(own, None)) and guard.origin_ok(scope(own, f"http://{own}"))
    # The reproducer: Origin's port is '²' (raised ValueError, HTTP 500).
    assert guard.origin_ok(scope(own, "http://127.0.0.1:\u00b2")) is False
    # Host's port is '²': the Host is malformed, and so is the page's own origin.
    assert guard.host_ok(scope("127.0.0.1:\u00b2", None)) is False
    assert guard.origin_ok(scope("127.0.0.1:\u00b2", "http://127.0.0.1:\u00b2")) is False
    assert guard.origin_ok(scope("127.0.0.1:\u00b2", f"http://{own}")) is False
    assert guard.host_ok(scope("[::1]:\u00b2", None)) is False


def test_configured_hosts_and_origins_need_ascii_ports() -> None:
    with pytest.raises(ValueError, match="allowed origin"):
        RequestGuard(origins=["https://ops.example:\u0668\u0660"])  # Arabic-Indic "80"
    with pytest.raises(ValueError, match="allowed origin"):
        RequestGuard(origins=["https://ops.example:\u00b2"])
    with pytest.raises(ValueError, match="allowed host"):
        RequestGuard(hosts=["ops.example:\u00b2"])
    guard = RequestGuard(origins=["https://ops.example:8443"])
    assert guard.origin_ok(scope("127.0.0.1:8765", "https://ops.example:8443"))


_HEADER = st.one_of(
    st.none(),
    st.text(max_size=30),
    st.builds(
        lambda scheme, host, port: f"{scheme}{host}:{port}",
        st.sampled_from(["", "http://", "https://", "HTTP://"]),
        st.sampled_from(["127.0.0.1", "[::1]", "localhost", "ops.example", "[::1"]),
        st.text(alphabet="0123456789\u00b2\u00b3\u00b9\u0660\uff10:[] ", max_size=8),
    ),
)


@given(_HEADER, _HEADER)
def test_the_guard_answers_every_header_without_raising(
    host: str | None, origin: str | None
) -> None:
    guard = RequestGuard(hosts=["ops.example"], origins=["https://ops.example"])
    assert guard.host_ok(scope(host, origin)) in (True, False)
    assert guard.origin_ok(scope(host, origin)) in (True, False)
    if origin is not None:
        parts = _origin_parts(origin)
        assert parts is None or 0 <= parts[2] <= 65535


async def status_line(base: str, lines: list[str]) -> str:
    """The status line the console answers to a raw request (``lines``: the
    request's lines after the request line; latin-1, as a client may send)."""
    address, port = base.removeprefix("http://").split(":")
    stream = await trio.open_tcp_stream(address, int(port))
    try:
        await stream.send_all("\r\n".join([*lines, "", ""]).encode("latin-1"))
        data = b""
        with trio.fail_after(10):
            while b"\r\n" not in data:
                chunk = await stream.receive_some(4096)
                if not chunk:
                    break
                data += chunk
    finally:
        await stream.aclose()
    return data.split(b"\r\n", 1)[0].decode("latin-1")


def websocket_request(host: str, origin: str) -> list[str]:
    return [
        "GET /ws HTTP/1.1",
        f"Host: {host}",
        "Upgrade: websocket",
        "Connection: Upgrade",
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version: 13",
        f"Origin: {origin}",
    ]


@pytest.mark.trio_only
@pytest.mark.real_server
async def test_the_served_console_answers_403_not_500_for_a_non_ascii_port() -> None:
    async with run_consul_fake() as fake, consul_console(fake.url) as (_, app, base):
        own = base.removeprefix("http://")
        # The console's own page is let in (the raw client is a real one).
        assert " 101 " in await status_line(base, websocket_request(own, f"http://{own}"))
        for host, origin in (
            (own, "http://127.0.0.1:\u00b2"),  # the reproducer: was HTTP 500
            ("127.0.0.1:\u00b2", "http://127.0.0.1:\u00b2"),
            ("127.0.0.1:\u00b2", f"http://{own}"),
        ):
            line = await status_line(base, websocket_request(host, origin))
            assert line.startswith("HTTP/1.1 403"), (host, origin, line)
        for path in ("/", "/state"):
            line = await status_line(base, [f"GET {path} HTTP/1.1", "Host: 127.0.0.1:\u00b2"])
            assert line.startswith("HTTP/1.1 403"), (path, line)
        assert app.refused == 5


@pytest.mark.trio_only
async def test_a_wrong_header_token_is_refused_at_once(autojump_clock: object) -> None:
    """A client that sent a token in its header gets 4401 at once, not after
    the wait for a token message (which is for browsers, which cannot)."""
    from nadisc import DiscoveryConfig, open_discovery
    from nadisc.observability import console_app
    from nadisc.observability._console import AUTH_TIMEOUT

    closed_at: list[tuple[int, float]] = []
    incoming = [{"type": "websocket.connect"}]

    async def receive() -> dict[str, Any]:
        if incoming:
            return incoming.pop()
        await trio.sleep_forever()  # the client says nothing more
        raise AssertionError

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "websocket.close":
            closed_at.append((message["code"], trio.current_time()))

    async with open_discovery(DiscoveryConfig(enabled=True)) as owner:
        app = console_app(owner, token="right-token")
        for authorization in (b"Bearer wrong-token", b"Basic d3Jvbmc="):
            incoming[:] = [{"type": "websocket.connect"}]
            started = trio.current_time()
            ws = {
                "type": "websocket",
                "path": "/ws",
                "headers": [(b"host", b"127.0.0.1"), (b"authorization", authorization)],
                "root_path": "",
            }
            await app(ws, receive, send)  # type: ignore[arg-type]
            code, when = closed_at.pop()
            assert code == 4401 and when == started
        # Without a header the token message is still waited for.
        incoming[:] = [{"type": "websocket.connect"}]
        started = trio.current_time()
        ws["headers"] = [(b"host", b"127.0.0.1")]
        await app(ws, receive, send)  # type: ignore[arg-type]
        code, when = closed_at.pop()
        assert code == 4401 and when == started + AUTH_TIMEOUT
