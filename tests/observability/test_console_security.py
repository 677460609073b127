"""No other page can read the console: the Host allow-list (DNS rebinding) and
the Origin check on ``/ws`` (cross-site WebSocket).

Raw clients (httpx with a chosen ``Host``, trio-websocket with a chosen
``Host`` and ``Origin``) against the console served by hypercorn on the
Consul fake; then real Chromium: a page on a second origin tries the
console's WebSocket and ``/state``, and a name mapped to loopback by the
browser's resolver (what DNS rebinding achieves) loads ``/state``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st
from trio_websocket import ConnectionRejected, wrap_client_stream

from nadisc.observability._asgi import RequestGuard, host_of
from tests.fakes.consul import run_consul_fake
from tests.observability.chromium import open_chromium, require_chromium
from tests.observability.support import consul_console, served

EVIL = "attacker.example"


async def handshake(base: str, host: str, origin: str | None) -> dict[str, Any] | int:
    """The first message of ``/ws`` sent with ``Host: host`` (and ``Origin``),
    or the HTTP status that refused the handshake."""
    address, port = base.removeprefix("http://").split(":")
    headers = [(b"origin", origin.encode())] if origin else []
    stream = await trio.open_tcp_stream(address, int(port))
    result: dict[str, Any] | int = 0
    try:
        async with trio.open_nursery() as nursery:
            socket = await wrap_client_stream(nursery, stream, host, "/ws", extra_headers=headers)
            result = json.loads(await socket.get_message())
            await socket.aclose()
            nursery.cancel_scope.cancel()
    except ConnectionRejected as exc:
        result = exc.status_code
    except BaseExceptionGroup as group:
        rejected, rest = group.split(ConnectionRejected)
        if rest is not None or rejected is None:
            raise
        first = rejected.exceptions[0]
        assert isinstance(first, ConnectionRejected)
        result = first.status_code
    finally:
        await stream.aclose()
    return result


@pytest.mark.trio_only
@pytest.mark.real_server
async def test_foreign_host_and_cross_origin_are_refused_by_raw_clients() -> None:
    async with (
        run_consul_fake() as fake,
        consul_console(
            fake.url,
            metrics=True,
            allowed_hosts=["console.internal"],
            allowed_origins=["https://ops.example"],
        ) as (_, app, base),
    ):
        port = base.rpartition(":")[2]
        async with httpx.AsyncClient(base_url=base) as client:
            for path in ("/", "/console.js", "/state", "/metrics"):
                # DNS rebinding: the browser sends the attacker's name as Host.
                for host in (f"{EVIL}:{port}", EVIL, "127.0.0.1.attacker.example", "", "a b"):
                    answer = await client.get(path, headers={"host": host})
                    assert answer.status_code == 403, (path, host)
                    assert "orders" not in answer.text and EVIL not in answer.text
                for host in (f"127.0.0.1:{port}", f"localhost:{port}", "console.internal"):
                    answer = await client.get(path, headers={"host": host})
                    assert answer.status_code == 200, (path, host)
        own = f"127.0.0.1:{port}"
        assert await handshake(base, EVIL, None) == 403
        assert await handshake(base, own, f"http://{EVIL}") == 403
        assert await handshake(base, own, f"http://localhost:{port}") == 403  # other origin
        assert await handshake(base, own, "null") == 403
        assert await handshake(base, own, f"https://127.0.0.1:{port}") == 403  # other scheme
        for origin in (None, f"http://{own}", "https://ops.example", "https://OPS.example:443"):
            message = await handshake(base, own, origin)
            assert isinstance(message, dict) and message["type"] == "full", origin
        assert app.refused == 5 * 4 + 5


def test_the_guard_refuses_bad_configuration() -> None:
    with pytest.raises(ValueError, match="allowed host 'a/b'"):
        RequestGuard(hosts=["a/b"])
    with pytest.raises(ValueError, match=r"allowed origin 'ops\.example'"):
        RequestGuard(origins=["ops.example"])


@given(st.text(max_size=40))
def test_host_of_never_accepts_what_could_smuggle_a_second_name(text: str) -> None:
    host = host_of(text)
    if host is not None:
        assert not any(c in host for c in " /\\@?#")
        assert host == host.lower()


def test_host_of_spellings() -> None:
    assert host_of("LocalHost.:8765") == "localhost"
    assert host_of("[::1]:80") == "::1"
    assert host_of("[::1]") == "::1"
    assert host_of("::1") is None  # a bare IPv6 Host is not valid HTTP
    assert host_of("a:b:c") is None
    assert host_of("x:") is None


OTHER_PAGE = b"<!doctype html><title>other</title><p>another site</p>"


async def other_site(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    await send(
        {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/html")]}
    )
    await send({"type": "http.response.body", "body": OTHER_PAGE})


TRY_WS = """
new Promise((done) => {
  const socket = new WebSocket(%s);
  socket.onmessage = (e) => { done("read " + e.data.length); socket.close(); };
  socket.onerror = () => done("refused");
  socket.onclose = () => done("refused");
})
"""
TRY_STATE = """
fetch(%s).then((r) => r.text()).then((t) => "read " + t.length, () => "refused")
"""


@pytest.mark.trio_only
@pytest.mark.real_server
async def test_a_page_on_another_origin_cannot_read_the_console(tmp_path: Path) -> None:
    require_chromium()
    async with (
        run_consul_fake() as fake,
        consul_console(fake.url) as (_, app, base),
        served(other_site) as other,
    ):
        port = base.rpartition(":")[2]
        flags = (f"--host-resolver-rules=MAP {EVIL} 127.0.0.1",)
        async with open_chromium(tmp_path / "profile", flags=flags) as browser:
            # A page of another origin (another port of the same machine).
            page = await browser.open_page(other + "/")
            await page.wait_for("document.title === 'other'")
            ws = json.dumps(base.replace("http", "ws") + "/ws")
            assert await page.evaluate(TRY_WS % ws, await_promise=True) == "refused"
            state = json.dumps(base + "/state")
            assert await page.evaluate(TRY_STATE % state, await_promise=True) == "refused"
            # DNS rebinding: the attacker's name resolves to the console.
            rebound = f"http://{EVIL}:{port}"
            page = await browser.open_page(rebound + "/state")
            await page.wait_for("document.readyState === 'complete'")
            text = await page.evaluate("document.body.innerText")
            assert "orders" not in text and "does not answer" in text
            # The console's own page still reads it (same origin).
            page = await browser.open_page(base + "/")
            await page.wait_for("document.body && document.body.dataset.fresh === 'yes'")
            assert await page.evaluate(TRY_WS % ws, await_promise=True) != "refused"
        assert app.refused >= 2
