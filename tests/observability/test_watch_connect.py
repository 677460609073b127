"""``nadisc watch --connect``: a refusal ends the watch, lost links are
counted, and nothing it prints carries the URL's credentials.

Most tests follow a scripted console over memory streams (trio-websocket on
both ends, trio's virtual clock for the backoff): each connection runs the
next script. The rest check the same claims against the real console
served by hypercorn: a wrong token (close code 4401), a path that is no
feed (HTTP 403), and the command's exit status and message.
"""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, cast

import pytest
import trio
import trio.testing
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    wrap_client_stream,
    wrap_server_stream,
)

from nadisc import ConfigError
from nadisc._cli import main
from nadisc.observability import ConsoleRefused, _commands, _console, watch_remote
from tests.fakes.consul import run_consul_fake
from tests.observability.support import consul_console

ROOT = Path(__file__).resolve().parents[2]
SECRET_URL = "ws://ops:hunter2@console.test/ws?token=q-tok-77#token=f-tok-88"
SHOWN_URL = "ws://console.test/ws"
SECRETS = ("hunter2", "ops:", "q-tok-77", "f-tok-88", "token=")


def full_message(revision: int, *, now: float = 100.0) -> str:
    part = {
        "connection": "primary",
        "service": "orders",
        "revision": revision,
        "evidence": "registry_health",
        "max_age": 30.0,
        "instances": [],
        "unavailable": None,
        "last_failure": None,
        "confirmed_at": now,
    }
    return json.dumps(
        {
            "type": "full",
            "seq": revision,
            "now": now,
            "sampled": now,
            "interval": 0.1,
            "stale_after": 3.0,
            "services": {"primary/orders": part},
            "overview": {"connections": [{"name": "primary", "prepare_error": None}]},
        }
    )


#: One connection's script: ("reject", status) | ("send", text) | ("close", code) | ("hold",).
Step = tuple[Any, ...]


class ScriptedConsole:
    """Stands in for ``trio_websocket.open_websocket_url`` in ``watch_remote``:
    connection n runs ``scripts[n]`` on the server side of a memory stream.
    Like ``open_websocket_url`` it raises a rejection or a close unwrapped."""

    def __init__(self, scripts: Sequence[Sequence[Step]]) -> None:
        self.scripts = list(scripts)
        self.urls: list[str] = []
        self.authorization: list[bytes | None] = []
        self.opened_at: list[float] = []

    @asynccontextmanager
    async def open(
        self, url: str, headers: list[tuple[bytes, bytes]]
    ) -> AsyncIterator[WebSocketConnection]:
        self.urls.append(url)
        self.opened_at.append(trio.current_time())
        script = self.scripts.pop(0)
        client, server = trio.testing.memory_stream_pair()
        try:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._serve, nursery, server, script)
                # trio-websocket runs over any trio stream (its annotation
                # names only the TCP and TLS ones).
                socket = await wrap_client_stream(
                    nursery,
                    cast("trio.SocketStream", client),
                    "console.test",
                    "/ws",
                    extra_headers=headers,
                )
                try:
                    yield socket
                finally:
                    nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            errors = [e for e in group.exceptions if not isinstance(e, trio.Cancelled)]
            if len(errors) == 1 and len(group.exceptions) == 1:
                raise errors[0] from None
            raise

    async def _serve(self, nursery: trio.Nursery, stream: Any, script: Sequence[Step]) -> None:
        request = await wrap_server_stream(nursery, stream)
        self.authorization.append(dict(request.headers).get(b"authorization"))
        if script[0][0] == "reject":
            await request.reject(script[0][1])
            return
        socket = await request.accept()
        for step in script:
            if step[0] == "send":
                await socket.send_message(step[1])
            elif step[0] == "close":
                await socket.aclose(step[1])
                return
            else:
                await trio.sleep_forever()


class Recorder:
    """A view that records what ``watch_remote`` shows: ``show`` returns
    False after ``updates`` states (ticks do not count)."""

    def __init__(self, updates: int) -> None:
        self.left = updates
        self.lines: list[str] = []

    def show(self, rows: Any, *, tick: bool = False, status: Any = None, failed: Any = ()) -> bool:
        if tick:
            self.lines.append(f"tick {status}")
            return True
        self.lines.append(f"show rev={[r['revision'] for r in rows]} {status}")
        self.left -= 1
        return self.left > 0

    def notice(self, text: str) -> None:
        self.lines.append(f"notice {text}")

    def events(self) -> list[str]:
        return [line for line in self.lines if not line.startswith("tick")]


def scripted(monkeypatch: pytest.MonkeyPatch, *scripts: Sequence[Step]) -> ScriptedConsole:
    console = ScriptedConsole(scripts)
    monkeypatch.setattr(_commands, "_open_socket", console.open)
    return console


def assert_no_secret(text: str) -> None:
    for secret in SECRETS:
        assert secret not in text, (secret, text)


@pytest.mark.parametrize(
    ("token", "said"), [("wrong", "refused the token"), (None, "needs a token")]
)
async def test_a_4401_ends_the_watch_at_once(
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    token: str | None,
    said: str,
) -> None:
    console = scripted(monkeypatch, [("close", 4401)], [("send", full_message(1)), ("hold",)])
    view = Recorder(updates=1)
    with pytest.raises(ConsoleRefused) as refused:
        await watch_remote(SECRET_URL, ["orders"], view, token)
    assert refused.value.code == 4401
    assert str(refused.value) == f"the console at {SHOWN_URL} {said} (close code 4401)"
    assert refused.value.url == SHOWN_URL
    assert isinstance(refused.value.__cause__, ConnectionClosed)
    # Not retried: one connection, no "lost", no "reconnected", nothing shown.
    assert len(console.urls) == 1 and console.scripts
    assert view.events() == []
    assert console.authorization == [b"Bearer wrong" if token else None]
    assert_no_secret(str(refused.value))


@pytest.mark.parametrize(
    ("script", "code", "said"),
    [
        ([("reject", 401)], 401, "refused the token (HTTP 401)"),
        ([("reject", 403)], 403, "refused the handshake (HTTP 403"),
        ([("close", 4403)], 4403, "refused this client (close code 4403"),
        ([("close", 4404)], 4404, "has no feed at this path (close code 4404)"),
    ],
)
async def test_every_refusal_of_the_console_ends_the_watch(
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    script: list[Step],
    code: int,
    said: str,
) -> None:
    console = scripted(monkeypatch, script, [("send", full_message(1)), ("hold",)])
    with pytest.raises(ConsoleRefused) as refused:
        await watch_remote(SECRET_URL, ["orders"], Recorder(updates=1), "right")
    assert refused.value.code == code
    assert str(refused.value).startswith(f"the console at {SHOWN_URL} {said}")
    assert len(console.urls) == 1


async def test_lost_links_count_attempts_and_reconnected_waits_for_state(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    console = scripted(
        monkeypatch,
        [("send", full_message(1)), ("close", 1001)],  # the console went away
        [("close", 1011)],  # accepted, then closed before any state
        [("reject", 503)],  # a proxy with no console behind it
        [("send", full_message(2)), ("hold",)],
    )
    view = Recorder(updates=2)
    start = trio.current_time()
    await watch_remote(SECRET_URL, ["orders"], view, "right")
    notices = [line for line in view.events() if line.startswith("notice")]
    assert [line.split(" · ")[0] for line in view.events()] == [
        "show rev=[1] live",
        "notice console connection lost (closed with code 1001); reconnecting in 0.1s (attempt 1)",
        "notice console connection lost (closed with code 1011); reconnecting in 0.2s (attempt 2)",
        "notice console connection lost (HTTP 503); reconnecting in 0.4s (attempt 3)",
        f"notice reconnected to {SHOWN_URL}",
        "show rev=[2] live",
    ]
    # The backoff on the virtual clock: 0.1, 0.2, 0.4 s between the attempts.
    offsets = [round(at - start, 6) for at in console.opened_at]
    assert offsets == [0.0, 0.1, 0.3, 0.7]
    assert len(notices) == 4
    # Every connection went to the URL as given; what was shown hides its credentials.
    assert console.urls == [SECRET_URL] * 4
    for line in view.lines:
        assert_no_secret(line)
    assert all(line.endswith(f" · {SHOWN_URL}") for line in view.lines if "reconnected" not in line)


async def test_a_link_without_state_yet_is_not_called_live(
    autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Accepted, then silent (a console waiting for a token message): not "live".
    scripted(monkeypatch, [("hold",)])
    view = Recorder(updates=1)
    with trio.move_on_after(2.5):
        await watch_remote(SECRET_URL, ["orders"], view, None)
    assert view.lines == [f"tick connecting · data 0.0s old · {SHOWN_URL}"] * 2


@pytest.mark.trio_only  # trio listeners, nursery and events
async def test_an_unreachable_console_is_retried_without_showing_credentials() -> None:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    port = listener.socket.getsockname()[1]
    await listener.aclose()  # nothing listens there now: connection refused
    seen = trio.Event()

    class FirstNotice(Recorder):
        def notice(self, text: str) -> None:
            super().notice(text)
            seen.set()

    view = FirstNotice(updates=1)
    url = f"ws://ops:hunter2@127.0.0.1:{port}/ws?token=q-tok-77"
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch_remote, url, ["orders"], view, "right")
        with trio.fail_after(10):
            await seen.wait()
        nursery.cancel_scope.cancel()
    text = view.lines[0]
    assert text.startswith("notice console connection lost (") and "(attempt 1)" in text
    assert text.endswith(f" · ws://127.0.0.1:{port}/ws")
    assert_no_secret(text)


def test_a_connect_url_that_is_not_a_websocket_url_is_a_usage_error() -> None:
    for url in (
        "http://ops:hunter2@console.test/ws?token=q-tok-77",
        "ws://ops:hunter2@console.test:99999/ws?token=q-tok-77",
        "ws://ops:hunter2@/ws?token=q-tok-77",
    ):
        out, err = io.StringIO(), io.StringIO()
        assert main(["watch", "orders", "--connect", url], environ={}, out=out, err=err) == 2
        assert err.getvalue().startswith("nadisc: config error: --connect: expected ws://")
        assert_no_secret(err.getvalue())
        assert out.getvalue() == ""


async def test_watch_remote_refuses_a_url_that_is_not_a_websocket_url() -> None:
    with pytest.raises(ConfigError) as error:
        await watch_remote(
            "http://ops:hunter2@console.test/ws?token=q-tok-77", [], Recorder(1), None
        )
    assert "http://console.test/ws" in str(error.value)
    assert_no_secret(str(error.value))


# ----------------------------------------------------------------- the real console


@pytest.fixture
def quick_token_refusal(monkeypatch: pytest.MonkeyPatch) -> None:
    """The console closes a client whose header token is wrong once it sent
    no token message within ``AUTH_TIMEOUT``: no wait for that here."""
    monkeypatch.setattr(_console, "AUTH_TIMEOUT", 0.0)


@pytest.mark.trio_only
@pytest.mark.real_server
async def test_the_real_console_refusing_the_token_or_the_path_ends_the_watch(
    quick_token_refusal: None,
) -> None:
    async with run_consul_fake() as fake, consul_console(fake.url, token="right") as (_, app, base):
        authority = base.removeprefix("http://")
        url = f"ws://ops:hunter2@{authority}/ws?token=q-tok-77"
        view = Recorder(updates=1)
        with trio.fail_after(10), pytest.raises(ConsoleRefused) as refused:
            await watch_remote(url, ["orders"], view, "wrong")
        assert refused.value.code == 4401
        assert str(refused.value) == (
            f"the console at ws://{authority}/ws refused the token (close code 4401)"
        )
        assert view.events() == []
        # A path that is no feed: closed before the handshake, so HTTP 403.
        with trio.fail_after(10), pytest.raises(ConsoleRefused) as refused:
            await watch_remote(f"ws://{authority}/nope", ["orders"], view, "right")
        assert refused.value.code == 403
        # The right token still follows it.
        await watch_remote(url, ["orders"], view, "right")
        assert view.events()[0].startswith("show rev=")
        assert app.clients == 0


@pytest.mark.trio_only
@pytest.mark.real_server
async def test_the_command_exits_1_and_says_the_token_was_refused(
    quick_token_refusal: None,
) -> None:
    async with run_consul_fake() as fake, consul_console(fake.url, token="right") as (_, _a, base):
        url = base.replace("http://", "ws://ops:hunter2@") + "/ws?token=q-tok-77"
        env = dict(os.environ, NADISC_CONSOLE_TOKEN="wrong", PYTHONPATH=str(ROOT))
        with trio.fail_after(60):
            done = await trio.run_process(
                [sys.executable, "-m", "nadisc._cli", "watch", "orders", "--connect", url],
                env=env,
                capture_stdout=True,
                capture_stderr=True,
                check=False,
            )
    err = done.stderr.decode()
    assert done.returncode == 1, err
    shown = base.replace("http://", "ws://") + "/ws"
    assert err == (
        f"nadisc: the console at {shown} refused the token (close code 4401); "
        "the token comes from $NADISC_CONSOLE_TOKEN; not retrying\n"
    )
    assert done.stdout.decode() == ""
    assert "Traceback" not in err and "wrong" not in err
    assert_no_secret(err)
