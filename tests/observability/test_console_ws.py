"""The console's WebSocket feed with trio-websocket, and ``nadisc watch --connect``.

Against the Consul fake on loopback: full state first, then deltas as the
registry changes; the bearer token (header or first message); the app
mounted under a path prefix; latest-only delivery to a client that does
not read; and ``watch --connect`` following the console.
"""

# Polling here waits on other processes or on a server's side effects,
# which no single event covers.
# ruff: noqa: ASYNC110

from __future__ import annotations

import io
import json
from typing import Any

import httpx
import pytest
import trio
from trio_websocket import ConnectionClosed, open_websocket_url, wrap_client_stream

from nadisc.observability import console_app, watch_remote
from nadisc.observability._commands import _View
from tests.fakes.consul import run_consul_fake
from tests.observability.support import (
    CONSUL_TOKEN,
    apply_message,
    consul_console,
    identities,
    orders_instance,
    served,
)

pytestmark = [pytest.mark.trio_only, pytest.mark.real_server]


async def until_seen(socket: Any, state: dict[str, Any], want: list[str]) -> None:
    with trio.fail_after(5):
        while identities(state) != want:
            apply_message(state, await socket.get_message())


async def test_full_state_then_deltas_follow_the_registry() -> None:
    async with run_consul_fake() as fake, consul_console(fake.url) as (_, app, base):
        async with open_websocket_url(base.replace("http", "ws") + "/ws") as socket:
            state: dict[str, Any] = {}
            first = apply_message(state, await socket.get_message())
            assert first["type"] == "full" and "primary/orders" in first["services"]
            assert identities(state) == []
            fake.register(orders_instance(1), now=trio.current_time())
            await until_seen(socket, state, ["orders-1"])
            fake.register(orders_instance(2), now=trio.current_time())
            await until_seen(socket, state, ["orders-1", "orders-2"])
            fake.deregister("orders-1")
            await until_seen(socket, state, ["orders-2"])
            part = state["services"]["primary/orders"]
            assert part["evidence"] == "registry_health" and part["max_age"] == 30.0
            assert state["overview"]["connections"][0]["name"] == "primary"
            assert app.clients == 1
        # /state answers the same shape, without secrets.
        async with httpx.AsyncClient() as client:
            text = (await client.get(base + "/state")).text
        assert json.loads(text)["type"] == "full"
        assert CONSUL_TOKEN not in text and "hunter2-meta" not in text


async def test_a_token_is_required_by_header_or_first_message() -> None:
    async with run_consul_fake() as fake, consul_console(fake.url, token="s3cr3t") as (_, _a, base):
        url = base.replace("http", "ws") + "/ws"
        # Header.
        async with open_websocket_url(
            url, extra_headers=[(b"authorization", b"Bearer s3cr3t")]
        ) as socket:
            assert json.loads(await socket.get_message())["type"] == "full"
        # First message (what the page does).
        async with open_websocket_url(url) as socket:
            await socket.send_message(json.dumps({"token": "s3cr3t"}))
            assert json.loads(await socket.get_message())["type"] == "full"
        # Wrong token: closed with 4401, nothing sent. (Our own TCP stream:
        # trio-websocket leaves its socket to the GC when the peer closes first.)
        host, port = base.removeprefix("http://").split(":")
        stream = await trio.open_tcp_stream(host, int(port))
        try:
            async with trio.open_nursery() as nursery:
                socket = await wrap_client_stream(nursery, stream, host, "/ws")
                await socket.send_message(json.dumps({"token": "nope"}))
                with pytest.raises(ConnectionClosed) as closed:
                    await socket.get_message()
                assert closed.value.reason is not None and closed.value.reason.code == 4401
                nursery.cancel_scope.cancel()
        finally:
            await stream.aclose()
        async with httpx.AsyncClient() as client:
            assert (await client.get(base + "/state")).status_code == 401
            ok = await client.get(base + "/state", headers={"authorization": "Bearer s3cr3t"})
            assert ok.status_code == 200 and "s3cr3t" not in ok.text
            # The page itself carries no data and needs no token.
            page = await client.get(base + "/")
            assert page.status_code == 200 and "console.js" in page.text


async def test_mounted_under_a_prefix() -> None:
    async with run_consul_fake() as fake, consul_console(fake.url) as (owner, _, _base):
        inner = console_app(owner, interval=0.05, metrics=False)

        async def mounted(scope: Any, receive: Any, send: Any) -> None:
            # What a host's admin listener does for a mount at /admin/console.
            if scope["type"] != "lifespan":
                assert scope["path"].startswith("/admin/console")
                scope = dict(scope, root_path="/admin/console")
            await inner(scope, receive, send)

        async with served(mounted) as base:
            async with httpx.AsyncClient() as client:
                bare = await client.get(base + "/admin/console")
                assert bare.status_code == 308
                assert bare.headers["location"] == "/admin/console/"
                page = await client.get(base + "/admin/console/")
                assert page.status_code == 200 and 'src="console.js"' in page.text
                script = await client.get(base + "/admin/console/console.js")
                assert script.status_code == 200 and "WebSocket" in script.text
            async with open_websocket_url(
                base.replace("http", "ws") + "/admin/console/ws"
            ) as socket:
                assert json.loads(await socket.get_message())["type"] == "full"


async def test_a_client_that_does_not_read_gets_the_newest_state_not_a_backlog() -> None:
    """The ASGI send of one client blocks (a peer that stopped reading): meanwhile
    7 registry changes happen; once it unblocks, the next message brings the
    newest state at once, and nothing was queued for it."""
    async with run_consul_fake() as fake, consul_console(fake.url, interval=0.02) as (_, app, base):
        sent: list[str] = []
        gate = trio.Event()
        incoming_send, incoming_receive = trio.open_memory_channel[dict[str, Any]](10)
        await incoming_send.send({"type": "websocket.connect"})

        async def receive() -> dict[str, Any]:
            return await incoming_receive.receive()

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "websocket.send":
                sent.append(message["text"])
                if len(sent) >= 2:
                    await gate.wait()  # the peer stopped reading

        url = base.replace("http", "ws") + "/ws"
        async with trio.open_nursery() as nursery, open_websocket_url(url) as fast:
            scope = {
                "type": "websocket",
                "path": "/ws",
                "headers": [(b"host", b"127.0.0.1")],
                "root_path": "",
            }
            nursery.start_soon(app, scope, receive, send)  # type: ignore[arg-type]
            fast_state: dict[str, Any] = {}
            apply_message(fast_state, await fast.get_message())
            fake.register(orders_instance(1), now=trio.current_time())
            await until_seen(fast, fast_state, ["orders-1"])
            with trio.fail_after(5):
                while len(sent) < 2:
                    await trio.sleep(0.01)
            # The slow client is now stuck in its second send.
            for n in range(2, 9):
                fake.register(orders_instance(n), now=trio.current_time())
                await until_seen(fast, fast_state, [f"orders-{i}" for i in range(1, n + 1)])
            assert len(sent) == 2  # nothing queued behind the blocked send
            samples_before = app.model.samples
            gate.set()
            with trio.fail_after(5):
                while len(sent) < 3:
                    await trio.sleep(0.01)
            slow_state: dict[str, Any] = {}
            for text in sent:
                apply_message(slow_state, text)
            # One message brought it from the state it had to the newest one.
            assert identities(slow_state) == [f"orders-{i}" for i in range(1, 9)]
            assert json.loads(sent[2])["type"] == "delta"
            assert app.model.samples >= samples_before
            await incoming_send.send({"type": "websocket.disconnect", "code": 1000})


async def test_watch_connect_follows_the_console() -> None:
    async with run_consul_fake() as fake, consul_console(fake.url) as (_, _app, base):
        out = io.StringIO()
        view = _View(out, as_json=True, updates=2)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(
                watch_remote, base.replace("http", "ws") + "/ws", ["orders"], view, None
            )
            with trio.fail_after(5):
                while not out.getvalue():
                    await trio.sleep(0.01)
            fake.register(orders_instance(1), now=trio.current_time())
        lines = [json.loads(line) for line in out.getvalue().splitlines()]
        assert [(x["service"], x["instances"]) for x in lines] == [("orders", 0), ("orders", 1)]
        assert lines[0]["unavailable"] == "empty"
        assert lines[1]["unavailable"] is None and lines[1]["evidence"] == "registry_health"
        assert lines[1]["revision"] > lines[0]["revision"]


async def test_state_is_fresh_with_no_client_connected() -> None:
    """The console samples the owner on its own schedule (its lifespan, run by
    hypercorn): with no WebSocket client and no request, samples are taken,
    and ``/state`` shows a registry change, read within one interval."""
    async with run_consul_fake() as fake, consul_console(fake.url, interval=0.05) as (o, app, base):
        with trio.fail_after(5):  # hypercorn runs the lifespan once it listens
            while not app.model.running:
                await trio.sleep(0.01)
        assert app.clients == 0
        fake.register(orders_instance(1), now=trio.current_time())
        with trio.fail_after(5):
            while not any(listing.instances for listing in o.observer().listings()):
                await trio.sleep(0.01)
        # Two samples after the observer had it, none asked for by a client.
        taken = app.model.samples
        with trio.fail_after(5):
            while app.model.samples < taken + 2:
                await trio.sleep(0.01)
        assert app.model.current.taken_at <= app.model.sampled_at
        seen: dict[str, Any] = {}
        apply_message(seen, app.model.current.delta({}, full=True) or "")
        assert identities(seen) == ["orders-1"]
        async with httpx.AsyncClient() as client:
            text = (await client.get(base + "/state")).text
        state = json.loads(text)
        folded: dict[str, Any] = {}
        apply_message(folded, text)
        assert identities(folded) == ["orders-1"]
        assert list(state["instances"]) == ["primary/orders#0"]  # the instances' one chunk
        # Read within one sampling interval of the answer (server clock).
        assert 0 <= state["now"] - state["sampled"] <= state["interval"]
        assert state["stale_after"] > state["interval"]


async def test_ticks_tell_a_client_how_old_its_data_is_and_acks_bound_the_frames() -> None:
    async with run_consul_fake() as fake, consul_console(fake.url, interval=0.05) as (_, app, base):
        url = base.replace("http", "ws") + "/ws?ack=1"
        async with open_websocket_url(url) as socket:
            state: dict[str, Any] = {}
            first = apply_message(state, await socket.get_message())
            assert first["type"] == "full" and first["versions"]["primary/orders"] >= 1
            # Nothing changes: within a heartbeat a tick arrives carrying the age.
            with trio.fail_after(10):
                tick = first
                while tick["type"] != "tick":
                    await socket.send_message(json.dumps({"ack": tick["seq"]}))
                    tick = apply_message(state, await socket.get_message())
            assert tick["now"] >= tick["sampled"]
            assert "services" not in tick
            # Without an ack, nothing more is sent, whatever changes.
            fake.register(orders_instance(1), now=trio.current_time())
            fake.register(orders_instance(2), now=trio.current_time())
            with trio.move_on_after(1.5) as waited:
                await socket.get_message()
            assert waited.cancelled_caught
            # The ack brings one delta with the newest state of the changed card only.
            await socket.send_message(json.dumps({"ack": tick["seq"]}))
            with trio.fail_after(5):
                delta = apply_message(state, await socket.get_message())
            assert delta["type"] == "delta" and list(delta["services"]) == ["primary/orders"]
            assert identities(state) == ["orders-1", "orders-2"]
            assert delta["versions"]["primary/orders"] > first["versions"]["primary/orders"]
            assert app.clients == 1
