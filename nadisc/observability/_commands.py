"""``nadisc console`` and ``nadisc watch``: hosts around the console and the watch view.

Contract:

* ``nadisc console CONFIG [--bind HOST:PORT] [--interval S]`` opens an owner
  for CONFIG (its registrations left out: a viewer never registers the
  application), observes every bound service of every connection, and
  serves the console (page, ``/ws``, ``/state``, ``/metrics``) with
  hypercorn until SIGINT/SIGTERM. The bind defaults to ``127.0.0.1:8765``;
  a non-loopback bind needs a token. The token comes from the environment
  variable named by ``--token-env`` (default ``NADISC_CONSOLE_TOKEN``),
  never from the command line (``ps`` would show it). It answers only for
  loopback ``Host`` names, the bind address and ``--allow-host`` names, and
  accepts WebSockets only from its own page or an ``--allow-origin``. It
  prints ``console: http://HOST:PORT/`` once it serves.
* ``nadisc watch CONFIG SERVICE... [--json] [--updates N]`` opens an owner
  the same way, observes SERVICE (an alias on the default connection, or
  ``connection/alias``) and redraws a table on each change: revision,
  evidence kind, evidence age, instance count and the last error. On a
  terminal the table redraws in place; ``--json`` prints one JSON line per
  changed service instead.
* ``nadisc watch [CONFIG] SERVICE... --connect ws://HOST:PORT/ws`` follows
  a running console instead (trio-websocket), sending the token from the
  same environment variable as ``Authorization: Bearer``; a lost connection
  is retried with backoff (0.1 s doubling to 1 s), and the status line
  shows the data's age (``STALE`` past what the console's interval allows).
  A refusal (a wrong or missing token: close code 4401; the Host or Origin
  check: HTTP 403) is not retried: the watch says so and exits with 1.
  What it prints shows the URL without user-info, query or fragment.
  On a terminal the table is cut to its width and redrawn on resize.

Exit status: 0 (stopped by SIGINT/Ctrl-C, SIGTERM or after ``--updates``;
no traceback), 2 on a usage or config error, 1 when discovery failed or
the followed console refused the watch.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import math
import os
import shutil
import sys
import urllib.parse
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any, TextIO

import anyio

from .._config import DiscoveryConfig
from .._errors import ConfigError, DiscoveryError
from ._model import DEFAULT_INTERVAL, overview_part, service_part

if TYPE_CHECKING:
    from trio_websocket import WebSocketConnection

__all__ = ["ConsoleRefused", "add_commands", "format_table", "watch_remote"]

DEFAULT_BIND = "127.0.0.1:8765"
TOKEN_ENV = "NADISC_CONSOLE_TOKEN"
_CONFIG_SUFFIXES = (".yaml", ".yml", ".toml", ".json")

Loader = Callable[[str], DiscoveryConfig]


def add_commands(sub: Any) -> None:
    """Add ``console`` and ``watch`` to the ``nadisc`` parser's subcommands."""
    console = sub.add_parser("console", help="serve the live console for a config")
    console.add_argument("config")
    console.add_argument("--bind", default=DEFAULT_BIND, help=f"HOST:PORT (default {DEFAULT_BIND})")
    console.add_argument("--interval", type=float, default=DEFAULT_INTERVAL, help="seconds")
    console.add_argument("--token-env", default=TOKEN_ENV, help="variable holding the token")
    console.add_argument("--timeout", type=float, default=5.0, help="first-listing wait")
    console.add_argument(
        "--allow-host",
        action="append",
        default=[],
        metavar="NAME",
        help="a Host name to answer for besides loopback and the bind address (repeatable)",
    )
    console.add_argument(
        "--allow-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="a page origin (scheme://host[:port]) whose WebSocket is accepted (repeatable)",
    )
    console.set_defaults(run=_run_console)

    watch = sub.add_parser("watch", help="watch services live in the terminal")
    watch.add_argument("items", nargs="+", metavar="[CONFIG] SERVICE")
    watch.add_argument("--connect", help="follow a running console (ws://HOST:PORT/ws)")
    watch.add_argument("--json", action="store_true", help="one JSON line per change")
    watch.add_argument("--updates", type=int, default=0, help="stop after N updates")
    watch.add_argument("--token-env", default=TOKEN_ENV, help="variable holding the token")
    watch.add_argument("--timeout", type=float, default=5.0, help="first-listing wait")
    watch.set_defaults(run=_run_watch)


# ----------------------------------------------------------------------------- shared


def _viewer_config(config: DiscoveryConfig) -> DiscoveryConfig:
    return config.model_copy(update={"registrations": {}})


def _positive(name: str, value: float) -> float:
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(name, "must be a positive number of seconds")
    return value


def _bind(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    host = host.strip("[]")
    digits = port.isascii() and port.isdigit()
    if not sep or not host or not digits or not 0 <= int(port) < 65536:
        raise ConfigError("--bind", f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _token(environ: Mapping[str, str], name: str) -> str | None:
    return environ.get(name) or None


def _service_keys(config: DiscoveryConfig | None, names: Sequence[str]) -> list[str]:
    keys = []
    for name in names:
        if "/" in name:
            connection, _, alias = name.partition("/")
        else:
            connection, alias = (config.default_connection if config else None) or "primary", name
        if config is not None:
            block = config.connections.get(connection)
            if block is None:
                raise ConfigError(f"watch {name}", f"no connection named {connection!r}")
        keys.append(f"{connection}/{alias}")
    return keys


def _age(part: Mapping[str, Any], now: float) -> float | None:
    confirmed = part.get("confirmed_at")
    return None if confirmed is None else max(0.0, now - float(confirmed))


def _row(part: Mapping[str, Any], now: float) -> dict[str, Any]:
    age = _age(part, now)
    return {
        "connection": part["connection"],
        "service": part["service"],
        "revision": part["revision"],
        "evidence": part["evidence"],
        "age": None if age is None else round(age, 3),
        "max_age": part["max_age"],
        "instances": len(part["instances"]),
        "unavailable": part["unavailable"],
        "last_error": part["last_failure"],
        "failure_reason": part.get("failure_reason"),
    }


def _change_key(row: Mapping[str, Any]) -> tuple[object, ...]:
    return tuple(v for k, v in row.items() if k != "age")


#: A connection that failed to prepare: (connection name, redacted reason).
Failed = tuple[tuple[str, str], ...]


def failed_connections(connections: Iterable[Mapping[str, Any]]) -> Failed:
    """(name, reason) of every connection whose prepare failed, from the
    console overview's ``connections`` (the reason is already redacted)."""
    return tuple(
        (str(c["name"]), str(c["prepare_error"]))
        for c in connections
        if c.get("prepare_error") is not None
    )


def format_table(rows: Sequence[Mapping[str, Any]], failed: Failed = ()) -> str:
    """The watch table: one line per service, columns aligned; then one line
    per connection that failed to prepare, with its reason."""
    header = ("CONNECTION", "SERVICE", "REV", "EVIDENCE", "AGE", "INSTANCES", "LAST ERROR")
    lines: list[tuple[str, ...]] = [header]
    for r in rows:
        age = "-" if r["age"] is None else f"{r['age']:.1f}s/{r['max_age']:g}s"
        error = (r["unavailable"] and f"unavailable: {r['unavailable']}") or r["last_error"] or "-"
        if r["unavailable"] and r["last_error"]:
            error += f" ({r['last_error']})"
        if r.get("failure_reason"):
            error += f": {r['failure_reason']}"
        lines.append(
            (
                str(r["connection"]),
                str(r["service"]),
                str(r["revision"]),
                str(r["evidence"] or "-"),
                age,
                str(r["instances"]),
                str(error),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    table = [
        "  ".join(cell.ljust(widths[i]) for i, cell in enumerate(line)).rstrip() for line in lines
    ]
    table.extend(f"connection {name} failed to prepare: {reason}" for name, reason in failed)
    return "\n".join(table)


class _View:
    """Prints rows: a redrawn table on a terminal, lines otherwise, or JSON lines.

    On a terminal the table is cut to its width and redrawn when it is
    resized; ``status`` (the followed console's link and the data's age)
    is the first line. Elsewhere status changes go to ``err``.
    """

    def __init__(
        self, out: TextIO, *, as_json: bool, updates: int, err: TextIO | None = None
    ) -> None:
        self.out = out
        self.err = err
        self.json = as_json
        self.tty = bool(getattr(out, "isatty", lambda: False)())
        self.left = updates if updates > 0 else -1
        self._last: dict[str, tuple[object, ...]] = {}
        self._rows: Sequence[dict[str, Any]] | None = None
        self._failed: Failed = ()
        self._status: str | None = None
        self._said: str | None = None

    def show(
        self,
        rows: Sequence[dict[str, Any]],
        *,
        tick: bool = False,
        status: str | None = None,
        failed: Failed = (),
    ) -> bool:
        """Print what changed; return False once ``--updates`` were printed.
        ``failed``: the connections that failed to prepare, with their reasons."""
        changed = [r for r in rows if self._last.get(self._key(r)) != _change_key(r)]
        for r in rows:
            self._last[self._key(r)] = _change_key(r)
        newly_failed = [f for f in failed if f not in self._failed]
        self._rows = rows
        self._status = status
        self._failed = failed
        if not changed and not newly_failed and not (tick and self.tty and not self.json):
            return True
        if self.json:
            for name, reason in newly_failed:
                self.out.write(
                    json.dumps({"connection": name, "prepare_error": reason}, sort_keys=True) + "\n"
                )
            for r in changed:
                self.out.write(json.dumps(r, sort_keys=True) + "\n")
        elif self.tty:
            self._redraw()
        else:
            self.out.write(format_table(rows, failed) + "\n\n")
        self.out.flush()
        if (changed or newly_failed) and self.left > 0:
            self.left -= 1
            return self.left > 0
        return True

    def notice(self, text: str) -> None:
        """A change of the link (lost, reconnecting, back): the status line on
        a terminal, a line on ``err`` otherwise (once per distinct text)."""
        if self.tty and not self.json:
            self._status = text
            self._redraw()
        elif text != self._said and self.err is not None:
            self.err.write(f"nadisc: {text}\n")
            self.err.flush()
        self._said = text

    def resized(self) -> None:
        if self.tty and not self.json:
            self._redraw()

    def _redraw(self) -> None:
        try:
            width = os.get_terminal_size(self.out.fileno()).columns
        except (AttributeError, OSError, ValueError):
            width = 0
        if width <= 0:  # not a terminal, or one that never set its size
            width = shutil.get_terminal_size((120, 40)).columns
        text = format_table(self._rows or [], self._failed)
        if self._status:
            text = self._status + "\n" + text
        lines = [line[:width] for line in text.splitlines()]
        self.out.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n")
        self.out.flush()

    @staticmethod
    def _key(row: Mapping[str, Any]) -> str:
        return f"{row['connection']}/{row['service']}"


async def _until_signal(body: Callable[[], Awaitable[None]], view: _View) -> None:
    """Run ``body`` until it returns or SIGINT/SIGTERM arrives (then return
    quietly: Ctrl-C is the way to stop a watch); SIGWINCH redraws the table."""
    import signal

    import trio

    wanted = [signal.SIGINT, signal.SIGTERM]
    if hasattr(signal, "SIGWINCH"):
        wanted.append(signal.SIGWINCH)
    async with trio.open_nursery() as nursery:

        async def signals() -> None:
            with trio.open_signal_receiver(*wanted) as received:
                async for number in received:
                    if number == getattr(signal, "SIGWINCH", None):
                        view.resized()
                    else:
                        nursery.cancel_scope.cancel()
                        return

        nursery.start_soon(signals)
        await body()
        nursery.cancel_scope.cancel()


# ----------------------------------------------------------------------------- console


def _run_console(
    args: argparse.Namespace, load: Loader, environ: Mapping[str, str], out: TextIO, err: TextIO
) -> int:
    config = load(args.config)
    host, port = _bind(args.bind)
    interval = _positive("--interval", args.interval)
    timeout = _positive("--timeout", args.timeout)
    token = _token(environ, args.token_env)
    if not _loopback(host) and token is None:
        raise ConfigError(
            "--bind", f"a console on a non-loopback address needs a token (set {args.token_env})"
        )
    from ._asgi import RequestGuard

    try:
        RequestGuard(args.allow_host, args.allow_origin)
    except ValueError as exc:
        raise ConfigError("--allow-host/--allow-origin", str(exc)) from None
    import trio

    trio.run(
        _console_main,
        _viewer_config(config),
        host,
        port,
        interval,
        timeout,
        token,
        out,
        (tuple(args.allow_host), tuple(args.allow_origin)),
    )
    return 0


async def _observe_all(owner: Any, config: DiscoveryConfig, first_wait: float) -> list[object]:
    held: list[object] = []
    deadline = anyio.current_time() + first_wait
    for name in config.connections:
        handle = owner.client(name)
        for alias in handle.services():
            try:
                held.append(await handle.observe(alias, deadline))
            except DiscoveryError as exc:
                sys.stderr.write(f"nadisc: {name}/{alias}: {type(exc).__name__}\n")
    return held


async def _console_main(
    config: DiscoveryConfig,
    host: str,
    port: int,
    interval: float,
    first_wait: float,
    token: str | None,
    out: TextIO,
    allowed: tuple[tuple[str, ...], tuple[str, ...]] = ((), ()),
) -> None:
    import gc
    import signal

    import trio

    from .._owner import open_discovery
    from ._console import console_app
    from ._serve import serve

    async with open_discovery(config) as owner:
        held = await _observe_all(owner, config, first_wait)
        app = console_app(
            owner,
            token=token,
            interval=interval,
            metrics=True,
            allowed_hosts=allowed[0],
            allowed_origins=allowed[1],
        )
        async with trio.open_nursery() as nursery:
            urls = await nursery.start(serve, app, f"{host}:{port}")
            # Everything alive after start-up stays alive: the collector need
            # never walk it again (full collections of it paused the event
            # loop for up to 190 ms under churn; frozen, under 1 ms).
            gc.freeze()
            out.write(f"console: {urls[0]}/\n")
            out.flush()
            with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
                async for _ in signals:
                    break
            nursery.cancel_scope.cancel()
        del held


# ----------------------------------------------------------------------------- watch


def _run_watch(
    args: argparse.Namespace, load: Loader, environ: Mapping[str, str], out: TextIO, err: TextIO
) -> int:
    items: list[str] = list(args.items)
    config: DiscoveryConfig | None = None
    if args.connect is None or items[0].lower().endswith(_CONFIG_SUFFIXES):
        if args.connect is None and len(items) < 2:
            raise ConfigError("watch", "give the config file and at least one SERVICE")
        config = load(items.pop(0))
    if not items:
        raise ConfigError("watch", "give at least one SERVICE")
    if args.updates < 0:
        raise ConfigError("--updates", "must be >= 0")
    timeout = _positive("--timeout", args.timeout)
    view = _View(out, as_json=args.json, updates=args.updates, err=err)
    import trio

    refused: list[ConsoleRefused] = []
    if args.connect is not None:
        keys = items if config is None else _service_keys(config, items)
        token = _token(environ, args.token_env)
        url = _connect_url(args.connect)

        async def body() -> None:
            try:
                await watch_remote(url, keys, view, token)
            except ConsoleRefused as exc:
                refused.append(exc)

    else:
        assert config is not None
        keys = _service_keys(config, items)
        viewer = _viewer_config(config)

        async def body() -> None:
            await _watch_local(viewer, keys, view, timeout)

    try:
        trio.run(_until_signal, body, view)
    except KeyboardInterrupt:
        return 0
    except BaseExceptionGroup as group:
        rest = group.split(KeyboardInterrupt)[1]
        if rest is not None:
            raise
        return 0
    if refused:
        exc = refused[0]
        hint = f"; the token comes from ${args.token_env}" if exc.code in (401, 4401) else ""
        err.write(f"nadisc: {exc}{hint}; not retrying\n")
        err.flush()
        return 1
    return 0


async def _watch_local(
    config: DiscoveryConfig, keys: Sequence[str], view: _View, first_wait: float
) -> None:
    import trio

    from .._owner import open_discovery

    async with open_discovery(config) as owner:
        deadline = anyio.current_time() + first_wait
        observations = []
        observer = owner.observer()
        failed = failed_connections(overview_part(observer.snapshot())["connections"])
        for key in keys:
            connection, _, alias = key.partition("/")
            if any(name == connection for name, _reason in failed):
                continue  # shown with its reason under the table
            observations.append(await owner.client(connection).observe(alias, deadline))
        wanted = set(keys)
        dirty = trio.Event()

        async with trio.open_nursery() as nursery:

            async def follow(observation: Any) -> None:
                nonlocal dirty
                while True:
                    await observation.changed(anyio.current_time() + 3600)
                    dirty.set()

            for observation in observations:
                nursery.start_soon(follow, observation)
            while True:
                now = anyio.current_time()
                rows = [
                    _row(service_part(listing), now)
                    for listing in observer.listings(now)
                    if f"{listing.connection}/{listing.service}" in wanted
                ]
                if not view.show(rows, tick=not dirty.is_set(), failed=failed):
                    nursery.cancel_scope.cancel()
                    return
                dirty = trio.Event()
                with trio.move_on_after(1.0):
                    await dirty.wait()


#: Reconnect backoff of ``watch --connect``: first wait, cap (seconds).
RECONNECT_FIRST = 0.1
RECONNECT_MAX = 1.0
#: Seconds between redraws while no message arrives (the age keeps moving).
_REDRAW = 1.0
#: How a console refuses a client for good, by WebSocket close code (after
#: the handshake) and by HTTP status (instead of it; hypercorn answers a
#: close before the handshake with 403): retrying cannot help.
_REFUSED_CLOSE = {
    4401: "refused the token (close code 4401)",
    4403: "refused this client (close code 4403: its Host or Origin check)",
    4404: "has no feed at this path (close code 4404)",
}
_REFUSED_STATUS = {
    401: "refused the token (HTTP 401)",
    403: "refused the handshake (HTTP 403: its Host or Origin check, or no feed at this path)",
}


class ConsoleRefused(DiscoveryError):
    """The console :func:`watch_remote` follows refused it for good: a wrong
    or missing token (close code 4401, HTTP 401), its Host or Origin check,
    or a path that is no feed (HTTP 403, close codes 4403 and 4404).

    ``code`` is the close code or HTTP status; ``url`` the console's URL as
    shown (no user-info, query or fragment). The message carries no
    credential.
    """

    def __init__(self, url: str, code: int, why: str) -> None:
        super().__init__(f"the console at {url} {why}")
        self.url = url
        self.code = code


def _shown_url(url: str) -> str:
    """``url`` as ``watch --connect`` prints it: without user-info, query or
    fragment, any of which may carry a credential (``ws://ops:pw@host/ws``,
    ``?token=...``, ``#token=...``)."""
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError:
        return "(a URL that does not parse)"
    netloc = parts.netloc.rpartition("@")[2]
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def _connect_url(url: str) -> str:
    """``url`` when it is a ``ws://`` or ``wss://`` URL with a host and a valid
    port; else a ConfigError that shows it without credentials."""
    try:
        parts = urllib.parse.urlsplit(url)
        valid = parts.scheme in ("ws", "wss") and bool(parts.hostname)
        _ = parts.port  # raises ValueError when it is not a number in range
    except ValueError:
        valid = False
    if not valid:
        raise ConfigError(
            "--connect", f"expected ws://HOST[:PORT]/PATH or wss://..., got {_shown_url(url)!r}"
        )
    return url


def _refusal(exc: BaseException, url: str, token: str | None) -> ConsoleRefused | None:
    """The refusal ``exc`` says the console made, if it is one."""
    from trio_websocket import ConnectionClosed, ConnectionRejected

    if isinstance(exc, ConnectionClosed) and exc.reason is not None:
        code = exc.reason.code
        why = _REFUSED_CLOSE.get(code)
    elif isinstance(exc, ConnectionRejected):
        code = exc.status_code
        why = _REFUSED_STATUS.get(code)
    else:
        return None
    if why is None:
        return None
    if code in (401, 4401) and token is None:
        why = why.replace("refused the token", "needs a token")
    return ConsoleRefused(url, code, why)


def _lost_reason(exc: BaseException) -> str:
    """Why a connection was lost, in a few words (no URL, no credential)."""
    from trio_websocket import ConnectionClosed, ConnectionRejected

    if isinstance(exc, ConnectionClosed):
        return "closed" if exc.reason is None else f"closed with code {exc.reason.code}"
    if isinstance(exc, ConnectionRejected):
        return f"HTTP {exc.status_code}"
    for error in (exc, exc.__cause__):
        if isinstance(error, OSError) and error.strerror:
            return error.strerror
    return type(exc).__name__


#: Seconds to connect and to finish the opening (or closing) handshake
#: (trio-websocket's own default).
_HANDSHAKE_TIMEOUT = 60.0


@asynccontextmanager
async def _open_socket(
    url: str, headers: list[tuple[bytes, bytes]]
) -> AsyncIterator[WebSocketConnection]:
    """The WebSocket to the console at ``url`` (a ``ws://`` or ``wss://`` URL),
    raising what ``trio_websocket.open_websocket_url`` raises, unwrapped.

    The TCP stream is ours and closed on the way out: trio-websocket leaves
    its own to the garbage collector when the peer closes first or rejects
    the handshake (a refused token, a console going away). The ``Host``
    header brackets an IPv6 address. (The tests' seam: they put a console
    over memory streams here.)
    """
    import ssl

    import trio
    from trio_websocket import ConnectionTimeout, HandshakeError, wrap_client_stream

    parts = urllib.parse.urlsplit(url)
    secure = parts.scheme == "wss"
    host = parts.hostname or ""
    port = parts.port or (443 if secure else 80)
    resource = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    name = f"[{host}]" if ":" in host else host
    authority = name if port == (443 if secure else 80) else f"{name}:{port}"
    stream: trio.abc.Stream
    try:
        with trio.fail_after(_HANDSHAKE_TIMEOUT):
            if secure:
                context = ssl.create_default_context()
                stream = await trio.open_ssl_over_tcp_stream(
                    host, port, ssl_context=context, https_compatible=True
                )
            else:
                stream = await trio.open_tcp_stream(host, port)
    except trio.TooSlowError:
        raise ConnectionTimeout from None
    except OSError as exc:
        raise HandshakeError from exc
    try:
        async with trio.open_nursery() as nursery:
            with trio.move_on_after(_HANDSHAKE_TIMEOUT) as opening:
                socket = await wrap_client_stream(
                    nursery, stream, authority, resource, extra_headers=headers
                )
            if opening.cancelled_caught:
                raise ConnectionTimeout
            try:
                yield socket
            finally:
                with trio.move_on_after(_HANDSHAKE_TIMEOUT):
                    await socket.aclose()
                nursery.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        # One error (the handshake's rejection from trio-websocket's reader
        # task, or the caller's own): raised as itself, as trio-websocket does.
        errors = [e for e in group.exceptions if not isinstance(e, trio.Cancelled)]
        if len(errors) == 1:
            raise errors[0] from None
        raise
    finally:
        await stream.aclose()


async def watch_remote(url: str, keys: Sequence[str], view: Any, token: str | None) -> None:
    """Follow a console's ``/ws`` and show ``keys`` (``connection/service``,
    or a bare service name matching it on any connection) through ``view``.

    A lost or unreachable connection is retried with backoff (0.1 s
    doubling up to 1 s), and ``view.notice`` says so with the attempt
    count; the table keeps the last rows, marked with their growing age,
    until the console answers again. The link counts as back (``reconnected``)
    once the console delivered state over it, not at the handshake.

    Raises :class:`ConsoleRefused` when the console refuses the client for
    good (a wrong or missing token, its Host or Origin check): retrying
    would not help; ``ConfigError`` when ``url`` is not a ``ws://`` or
    ``wss://`` URL. Nothing it prints or raises carries the URL's
    user-info, query or fragment.
    """
    import trio
    from trio_websocket import ConnectionClosed, HandshakeError

    _connect_url(url)
    headers = [(b"authorization", f"Bearer {token}".encode())] if token else []
    services: dict[str, dict[str, Any]] = {}
    #: The overview's ``connections`` (the latest one received).
    connections: list[Mapping[str, Any]] = []
    wanted = set(keys)
    clock: dict[str, float] = {"now": 0.0, "sampled": 0.0, "at": 0.0, "stale_after": 3.0}
    notice = getattr(view, "notice", None)
    shown_as = _shown_url(url)

    def shown(key: str) -> bool:
        return key in wanted or key.partition("/")[2] in wanted

    def rows_and_status(link: str) -> tuple[list[dict[str, Any]], str]:
        elapsed = trio.current_time() - clock["at"] if clock["at"] else 0.0
        now = clock["now"] + elapsed
        age = max(0.0, now - clock["sampled"])
        stale = " STALE" if age > clock["stale_after"] else ""
        rows = [_row(part, now) for key, part in sorted(services.items()) if shown(key)]
        return rows, f"{link} · data {age:.1f}s old{stale} · {shown_as}"

    def draw(link: str, *, tick: bool = False) -> bool:
        rows, status = rows_and_status(link)
        failed = failed_connections(connections)
        return bool(view.show(rows, tick=tick, status=status, failed=failed))

    delay = RECONNECT_FIRST
    attempt = 0
    while True:
        try:
            async with _open_socket(url, headers) as socket:
                link = "connecting"
                while True:
                    with trio.move_on_after(_REDRAW):
                        text = await socket.get_message()
                        message = _fold(json.loads(text), services, clock, trio.current_time())
                        if message is not None:
                            if link != "live":
                                # Back only now: a console that accepts the
                                # handshake and then closes (a refused token)
                                # has not reconnected anything.
                                link = "live"
                                if attempt and notice is not None:
                                    notice(f"reconnected to {shown_as}")
                                delay = RECONNECT_FIRST
                                attempt = 0
                            if isinstance(message.get("overview"), Mapping):
                                connections[:] = message["overview"].get("connections", [])
                            tick = message.get("type") == "tick"
                            if not draw(link, tick=tick):
                                return
                        continue
                    draw(link, tick=True)
        except (OSError, HandshakeError, ConnectionClosed) as exc:
            refused = _refusal(exc, shown_as, token)
            if refused is not None:
                raise refused from exc
            attempt += 1
            if notice is not None:
                _rows, status = rows_and_status("disconnected")
                notice(
                    f"console connection lost ({_lost_reason(exc)}); reconnecting in "
                    f"{delay:.1f}s (attempt {attempt}) · data {status.split('data ', 1)[1]}"
                )
            await trio.sleep(delay)
            delay = min(RECONNECT_MAX, delay * 2)


def _fold(
    message: Mapping[str, Any],
    services: dict[str, dict[str, Any]],
    clock: dict[str, float],
    received: float,
) -> Mapping[str, Any] | None:
    """Fold one console message into ``services`` and ``clock``; the message
    (None for a message of another kind)."""
    kind = message.get("type")
    if kind not in ("full", "delta", "tick"):
        return None
    clock["now"] = float(message.get("now") or 0.0)
    clock["sampled"] = float(message.get("sampled") or clock["now"])
    clock["stale_after"] = float(message.get("stale_after") or 3.0)
    clock["at"] = received
    _merge(services, message)
    return message


def _merge(services: dict[str, dict[str, Any]], message: Mapping[str, Any]) -> None:
    """Fold a ``full`` or ``delta`` message's service parts into ``services``;
    each part gets its ``confirmed_at`` from the message's ``confirmed``
    times (or keeps the one it had)."""
    if message.get("type") == "full":
        services.clear()
    touched = set()
    for key, part in message.get("services", {}).items():
        old = services.get(key)
        part.setdefault("confirmed_at", old.get("confirmed_at") if old else None)
        part["_chunks"] = old.get("_chunks", {}) if old else {}
        services[key] = part
        touched.add(key)
    for mark, chunk in message.get("instances", {}).items():
        key, _, n = mark.rpartition("#")
        if key in services:
            services[key]["_chunks"][int(n)] = chunk
            touched.add(key)
    for key in touched:
        part = services[key]
        if "chunks" in part:
            pieces = part["_chunks"]
            part["instances"] = [i for n in range(part["chunks"]) for i in pieces.get(n, [])]
    for key, stamp in message.get("confirmed", {}).items():
        if key in services:
            services[key]["confirmed_at"] = stamp
    for key in message.get("removed", []):
        services.pop(key, None)
