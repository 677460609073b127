"""The client channel and its four multicallables, shaped like ``grpc.aio.Channel``'s.

Contract: ``async with Channel("host:port") as channel:`` owns one HTTP/2
connection at a time (a new one after a GOAWAY or a failure; the old one
finishes its streams) and every task it starts. ``FooStub(channel)`` from
``grpcio-tools`` works unchanged: ``channel.unary_unary(path,
request_serializer=..., response_deserializer=..., _registered_method=...)``
and the three others return multicallables whose calls take ``timeout=``,
``metadata=``, ``compression=`` (``wait_for_ready`` and ``credentials=None``
are accepted and ignored).

- Unary-response calls are awaitable; streaming-response calls are async
  iterables with ``read()`` (``grpc.aio.EOF`` at the end). Stream-request
  calls take an iterable or async iterable of requests, or none and then
  ``write()`` / ``done_writing()``.
- Deadlines: the earlier of ``timeout=`` (counted from the call) and the
  caller's cancel-scope deadline goes out as ``grpc-timeout``. The call's own
  expiry is ``RpcError(DEADLINE_EXCEEDED)``; the enclosing scope's expiry or
  any other cancellation of the caller is the caller's own cancellation. In
  both cases the stream is reset (RST_STREAM(CANCEL)) at once and its
  buffers dropped; a request-sending task is cancelled with it.
- A call abandoned without being read to its end keeps its stream until
  ``call.cancel()``, until it is garbage collected, or until the channel
  closes.
- Unary-request calls the server never processed (GOAWAY above their stream
  id, REFUSED_STREAM) are retried on a new connection, up to
  ``transparent_retries`` (2) times; a discovery channel's subchannels use 0.
- A connection attempt (TCP connect, TLS handshake, the server's first
  SETTINGS) takes at most ``connect_timeout`` (20 s, grpc's own); past it
  the calls waiting on it fail with UNAVAILABLE and it is dropped.
- ``receive_coalescing`` (80 us; ``None`` turns it off): while a response
  stream comes densely after the last request, and the socket is empty,
  the reader waits this long for more before its next read, so a fast
  stream comes several messages per read (see
  ``nadisc.grpc._connection``). Plaintext only, on Linux.
- The target, every option and every call argument are checked up front: a
  ``TypeError`` or ``ValueError`` naming what was wrong.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import math
import os
import re
import socket
import ssl
from collections.abc import AsyncIterable, Callable, Generator, Iterable
from types import TracebackType
from typing import Any, Generic, Self, TypeVar

import anyio
import anyio.abc
import grpc
import grpc.aio
import hpack
from anyio.streams.tls import TLSAttribute

from ._connection import Connection, Stream, Unprocessed
from ._errors import RpcError, code_from_http_status, code_from_int
from ._outcome import Outcome
from ._wire import (
    DEFAULT_MAX_MESSAGE_LENGTH,
    DEFAULT_MAX_METADATA_SIZE,
    MetadataLike,
    decode_grpc_message,
    decode_metadata,
    encode_message,
    encode_metadata,
    encode_timeout,
    gunzip_bounded,
    gzip_bytes,
)

__all__ = [
    "Channel",
    "StreamStreamMultiCallable",
    "StreamUnaryMultiCallable",
    "UnaryStreamMultiCallable",
    "UnaryUnaryMultiCallable",
]

Req = TypeVar("Req")
Resp = TypeVar("Resp")
_Handle = TypeVar("_Handle", bound="_CallHandle[Any, Any]")

_USER_AGENT = b"nadisc-grpc/0.1"
_RETRIES = 2
#: grpc's own bound on a connection attempt (its minimum connect timeout): TCP
#: connect, TLS handshake and the server's first SETTINGS frame.
DEFAULT_CONNECT_TIMEOUT = 20.0
#: How long a reader in the middle of a response stream waits for more before
#: its next read; :data:`MAX_RECEIVE_COALESCING` at most.
DEFAULT_RECEIVE_COALESCING = 80e-6
MAX_RECEIVE_COALESCING = 1e-3
#: No message is waiting (a deserializer may return ``None`` itself).
_NOTHING = object()


def _identity(value: Any) -> Any:
    return value


#: ``grpc-timeout`` as an HPACK literal without indexing (a new name, no Huffman);
#: the value's length byte and the value follow (at most 9 bytes, under 127).
_TIMEOUT_LITERAL = b"\x00\x0cgrpc-timeout"


def _fixed_block(headers: list[tuple[bytes, bytes]]) -> bytes:
    """``headers`` HPACK-encoded as never-indexed fields: static-table references only.

    The block adds nothing to the server's dynamic table and refers to no
    entry of it, so it is valid at any point of any connection and can be
    reused for every call.
    """
    return hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(k, v) for k, v in headers])


@functools.lru_cache(maxsize=512)
def _fixed_blocks(scheme: bytes, method: str, authority: str) -> tuple[bytes, bytes]:
    """The fixed request headers of a call of ``method``, without and with
    ``grpc-encoding: gzip``, each a :func:`_fixed_block`. Cached: encoding
    them (Huffman coding in Python) costs over 100 us, and code that makes
    a multicallable per call (as ``grpc.aio`` allows) would pay it each time.
    """
    base = [
        (b":method", b"POST"),
        (b":scheme", scheme),
        (b":path", method.encode("ascii")),
        (b":authority", authority.encode("ascii")),
        (b"te", b"trailers"),
        (b"content-type", b"application/grpc"),
        (b"user-agent", _USER_AGENT),
        (b"grpc-accept-encoding", b"identity,gzip"),
    ]
    return _fixed_block(base), _fixed_block([*base, (b"grpc-encoding", b"gzip")])


_TARGET_FORMS = (
    "host:port, [ipv6 address]:port, dns:host:port, dns:///host:port, "
    "ipv4:address:port or ipv6:[address]:port"
)
#: A DNS name or an IPv4 literal: letters, digits, ``-``, ``_`` and dots.
_HOST_NAME = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_.-]*[A-Za-z0-9_.])?\Z")
#: What an ``authority`` may hold (RFC 3986: unreserved, percent-encoded, sub-delims, ``:@[]``).
_AUTHORITY = re.compile(r"[A-Za-z0-9._~%!$&'()*+,;=:@\[\]-]+\Z")


def _bad_target(target: str, why: str) -> ValueError:
    return ValueError(f"gRPC target {target!r} {why} (accepted forms: {_TARGET_FORMS})")


def _split_target(target: str) -> tuple[str, int]:
    """``(host, port)`` of a target in one of :data:`_TARGET_FORMS`; ``ValueError`` else."""
    if not isinstance(target, str):
        raise TypeError(
            f"gRPC target must be a str such as 'host:port', not {type(target).__name__}"
        )
    rest = target
    family = ""
    if rest.startswith("dns:"):
        rest = rest[4:]
        if rest.startswith("//"):
            server, slash, rest = rest[2:].partition("/")
            if not slash:
                raise _bad_target(target, "has no host after dns://")
            if server:
                raise _bad_target(
                    target,
                    f"names a DNS server ({server!r}), which this channel does not support "
                    "(it uses the system resolver: write dns:///host:port)",
                )
    elif rest.startswith(("ipv4:", "ipv6:")):
        family, rest = rest[:4], rest[5:]
    if rest.startswith("["):
        end = rest.find("]")
        if end < 0 or rest[end + 1 : end + 2] != ":":
            raise _bad_target(target, "is not [address]:port")
        name, port = rest[1:end], rest[end + 2 :]
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            raise _bad_target(target, "has no valid IPv6 address in brackets") from None
        if family == "ipv4":
            raise _bad_target(target, "is not an IPv4 address")
    else:
        name, sep, port = rest.rpartition(":")
        if not sep or not name:
            raise _bad_target(target, "is not host:port")
        if ":" in name:
            try:
                ipaddress.IPv6Address(name)
            except ValueError:
                scheme = name.partition(":")[0]
                raise _bad_target(
                    target, f"has a scheme this channel does not take ({scheme}:)"
                ) from None
            raise _bad_target(target, "has an IPv6 address without brackets (write [address]:port)")
        if family == "ipv6":
            raise _bad_target(target, "needs its IPv6 address in brackets")
        if family == "ipv4":
            try:
                ipaddress.IPv4Address(name)
            except ValueError:
                raise _bad_target(target, "has no valid IPv4 address") from None
        elif not (name.isascii() and _HOST_NAME.match(name)):
            raise _bad_target(target, f"has no valid host name ({name!r})")
    if not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise _bad_target(target, "has no valid port")
    return name, int(port)


def _tls_server_name(authority: str) -> str:
    """The host part of an ``authority`` (its port and IPv6 brackets left out)."""
    if authority.startswith("["):
        return authority[1 : authority.find("]")] if "]" in authority else authority
    host, sep, port = authority.rpartition(":")
    return host if sep and port.isdigit() else authority


def _positive_int(owner: str, name: str, value: object) -> int:
    if type(value) is not int:
        raise TypeError(f"{owner}: {name} must be an int, not {type(value).__name__}")
    if value <= 0:
        raise ValueError(f"{owner}: {name} must be positive, not {value}")
    return value


def _seconds(owner: str, name: str, value: object, *, optional: bool = False) -> float | None:
    """Finite seconds > 0 (or ``None`` when ``optional``); names the option otherwise."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        allowed = "a number of seconds or None" if optional else "a number of seconds"
        raise TypeError(f"{owner}: {name} must be {allowed}, not {type(value).__name__}")
    if not 0 < value < math.inf:
        raise ValueError(f"{owner}: {name} must be finite seconds > 0, not {value!r}")
    return float(value)


def _compression(owner: str, value: object) -> grpc.Compression | None:
    """``None``, ``NoCompression`` or ``Gzip``; any other algorithm is refused."""
    if value is None:
        return None
    if not isinstance(value, grpc.Compression):
        raise TypeError(
            f"{owner}: compression must be a grpc.Compression or None, not {type(value).__name__}"
        )
    if value not in (grpc.Compression.NoCompression, grpc.Compression.Gzip):
        raise ValueError(
            f"{owner}: compression {value.name} is not supported "
            "(grpc.Compression.Gzip, grpc.Compression.NoCompression or None)"
        )
    return value


def _os_reason(exc: OSError) -> str:
    """What the OS said (``Connection refused``), from ``exc`` or, when anyio
    gathered several attempts under one ``OSError``, from the attempts."""
    reasons: list[str] = []
    seen: list[BaseException] = [exc]
    while seen:
        error = seen.pop(0)
        if isinstance(error, BaseExceptionGroup):
            seen.extend(error.exceptions)
            continue
        reason = None
        if isinstance(error, OSError):
            # The errno's own words ("Connection refused"): asyncio's and trio's
            # strerror wrap them in text of their own, or replace them.
            if error.errno and error.errno > 0 and not isinstance(error, socket.gaierror):
                reason = os.strerror(error.errno)
            else:
                reason = error.strerror
        if reason:
            if reason not in reasons:
                reasons.append(reason)
        elif error.__cause__ is not None and error is exc:
            seen.append(error.__cause__)
    if reasons:
        return "; ".join(reasons)
    return str(exc) or type(exc).__name__


class Channel:
    """A gRPC client channel to one address; see the module docstring."""

    def __init__(
        self,
        target: str,
        *,
        ssl_context: ssl.SSLContext | None = None,
        authority: str | None = None,
        max_send_message_length: int = DEFAULT_MAX_MESSAGE_LENGTH,
        max_receive_message_length: int = DEFAULT_MAX_MESSAGE_LENGTH,
        max_metadata_size: int = DEFAULT_MAX_METADATA_SIZE,
        compression: grpc.Compression | None = None,
        stream_window: int = 1024 * 1024,
        connection_window: int = 8 * 1024 * 1024,
        keepalive_time: float | None = None,
        keepalive_timeout: float = 20.0,
        keepalive_without_calls: bool = False,
        transparent_retries: int = _RETRIES,
        connect_timeout: float | None = DEFAULT_CONNECT_TIMEOUT,
        receive_coalescing: float | None = DEFAULT_RECEIVE_COALESCING,
    ) -> None:
        self._host, self._port = _split_target(target)
        self.target = target
        owner = f"Channel({target!r})"
        self.max_send = _positive_int(owner, "max_send_message_length", max_send_message_length)
        self.max_receive = _positive_int(
            owner, "max_receive_message_length", max_receive_message_length
        )
        self.max_metadata = _positive_int(owner, "max_metadata_size", max_metadata_size)
        for name, window in (
            ("stream_window", stream_window),
            ("connection_window", connection_window),
        ):
            if type(window) is not int:
                raise TypeError(f"{owner}: {name} must be an int, not {type(window).__name__}")
            if not 65535 <= window < 2**31:
                raise ValueError(f"{owner}: {name} must be in [65535, 2**31), not {window}")
        self.keepalive_time = _seconds(owner, "keepalive_time", keepalive_time, optional=True)
        ping_timeout = _seconds(owner, "keepalive_timeout", keepalive_timeout)
        assert ping_timeout is not None
        if type(keepalive_without_calls) is not bool:
            raise TypeError(
                f"{owner}: keepalive_without_calls must be a bool, "
                f"not {type(keepalive_without_calls).__name__}"
            )
        coalescing = _seconds(owner, "receive_coalescing", receive_coalescing, optional=True)
        if coalescing is not None and coalescing > MAX_RECEIVE_COALESCING:
            raise ValueError(
                f"{owner}: receive_coalescing must be at most {MAX_RECEIVE_COALESCING} s "
                f"(it delays reads in the middle of a stream), not {receive_coalescing!r}"
            )
        #: Seconds a reader in the middle of a response stream waits for more.
        self.receive_coalescing = coalescing
        #: TCP connect, TLS handshake and the server's first SETTINGS, at most this long.
        self.connect_timeout = _seconds(owner, "connect_timeout", connect_timeout, optional=True)
        if type(transparent_retries) is not int:
            raise TypeError(
                f"{owner}: transparent_retries must be an int >= 0, "
                f"not {type(transparent_retries).__name__}"
            )
        if transparent_retries < 0:
            raise ValueError(f"{owner}: transparent_retries must be an int >= 0")
        #: Same-host re-sends of a unary call the server never processed (0 under discovery).
        self.transparent_retries = transparent_retries
        self.compression = _compression(owner, compression)
        if ssl_context is not None and not isinstance(ssl_context, ssl.SSLContext):
            raise TypeError(
                f"{owner}: ssl_context must be an ssl.SSLContext or None, "
                f"not {type(ssl_context).__name__}"
            )
        if authority is not None:
            if not isinstance(authority, str):
                raise TypeError(
                    f"{owner}: authority must be a str or None, not {type(authority).__name__}"
                )
            if not (authority.isascii() and _AUTHORITY.match(authority)):
                raise ValueError(
                    f"{owner}: authority {authority!r} is not an ASCII host[:port] "
                    "(no spaces, control characters or non-ASCII letters)"
                )
        self._ssl = ssl_context
        if ssl_context is not None:
            # This changes the caller's context (Python sets ALPN per context
            # only): documented; nadisc.grpc_tls_context() is one for gRPC alone.
            ssl_context.set_alpn_protocols(["h2"])
        host = f"[{self._host}]" if ":" in self._host else self._host
        self.authority = authority or f"{host}:{self._port}"
        self._scheme = b"https" if ssl_context is not None else b"http"
        self._stream_window = stream_window
        self._connection_window = connection_window
        self._keepalive_timeout = ping_timeout
        self._keepalive_without_calls = keepalive_without_calls
        self._conn: Connection | None = None
        self._lock = anyio.Lock()
        self._tg: anyio.abc.TaskGroup | None = None
        self._closed = False

    def __repr__(self) -> str:
        return f"Channel({self.target!r}, tls={self._ssl is not None})"

    # -- lifetime ------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._tg is not None or self._closed:
            raise RuntimeError(f"{self!r} can be entered once")
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> bool | None:
        await self.close()
        tg, self._tg = self._tg, None
        if tg is None:
            return None
        if exc is None or isinstance(exc, anyio.get_cancelled_exc_class()):
            return await tg.__aexit__(exc_type, exc, tb)
        # The body's own error goes on as it is, not wrapped in an ExceptionGroup
        # by the channel's task group (whose tasks only ever end quietly).
        await tg.__aexit__(None, None, None)
        return None

    async def close(self, grace: float | None = None) -> None:
        """Close the connections (GOAWAY, then at most ``grace`` s, default 1, to send it)."""
        if self._closed:
            return
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()
        tg = self._tg
        if tg is not None:
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(1.0 if grace is None else grace),
            ):
                if conn is not None:
                    await conn.done.wait()
            tg.cancel_scope.cancel()

    # -- connections ---------------------------------------------------------

    @property
    def connecting(self) -> bool:
        """A connection is being made, or is made and the server's first
        SETTINGS are not in yet: a call now would wait for it."""
        conn = self._conn
        if conn is not None and conn.usable:
            return not conn.greeted
        return self._lock.locked()

    @property
    def connected(self) -> bool:
        """A connection is up and the server's first SETTINGS came (a call would not wait)."""
        conn = self._conn
        return conn is not None and conn.usable and conn.greeted

    async def connection(self) -> Connection:
        """The current connection, opened (under the caller's deadline) when there is none."""
        conn = self._conn
        if conn is not None and conn.usable:
            return conn
        async with self._lock:
            conn = self._conn
            if conn is not None and conn.usable:
                return conn
            if self._closed or self._tg is None:
                raise RpcError(
                    grpc.StatusCode.UNAVAILABLE,
                    "the channel is not open (use `async with Channel(...)`)",
                    where=self.target,
                )
            if conn is not None and conn.too_many_pings and self.keepalive_time is not None:
                # grpc's client keepalive rule: the server said too_many_pings, so double.
                self.keepalive_time *= 2
            conn = await self._connect()
            self._conn = conn
            self._tg.start_soon(conn.run)
            return conn

    def _timed_out(self, what: str) -> str:
        return (
            f"the connection attempt to {self.target} timed out {what} "
            f"after {self.connect_timeout} s (connect_timeout)"
        )

    async def _connect(self) -> Connection:
        timeout = self.connect_timeout
        deadline = math.inf if timeout is None else anyio.current_time() + timeout
        stream: anyio.abc.ByteStream | None = None
        try:
            with anyio.move_on_at(deadline):
                if self._ssl is None:
                    stream = await anyio.connect_tcp(self._host, self._port)
                else:
                    stream = await anyio.connect_tcp(
                        self._host,
                        self._port,
                        ssl_context=self._ssl,
                        tls_hostname=_tls_server_name(self.authority),
                        tls_standard_compatible=False,
                    )
        except ssl.SSLError as exc:
            raise RpcError(
                grpc.StatusCode.UNAVAILABLE,
                f"TLS handshake with {self.target} failed: {exc.reason or type(exc).__name__}",
                where=self.target,
            ) from None
        except OSError as exc:
            error = RpcError(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot connect to {self.target}: {_os_reason(exc)}",
                where=self.target,
            )
            error.unprocessed = True  # no byte reached the server
            raise error from None
        if stream is None:
            what = (
                "in the TCP connect" if self._ssl is None else "in the TCP connect or TLS handshake"
            )
            error = RpcError(grpc.StatusCode.UNAVAILABLE, self._timed_out(what), where=self.target)
            error.unprocessed = True  # no request byte reached the server
            raise error
        if self._ssl is not None:
            alpn = stream.extra(TLSAttribute.alpn_protocol, None)
            if alpn != "h2":
                await anyio.aclose_forcefully(stream)
                raise RpcError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"{self.target} did not negotiate HTTP/2 over TLS (ALPN gave {alpn!r})",
                    where=self.target,
                )
        return Connection(
            stream,
            name=self.target,
            authority=self.authority.encode("ascii"),
            max_receive=self.max_receive,
            max_metadata_size=self.max_metadata,
            stream_window=self._stream_window,
            connection_window=self._connection_window,
            keepalive_time=self.keepalive_time,
            keepalive_timeout=self._keepalive_timeout,
            keepalive_without_calls=self._keepalive_without_calls,
            receive_coalescing=self.receive_coalescing,
            settings_deadline=deadline,
            settings_timeout=self._timed_out("before the server's SETTINGS frame arrived"),
        )

    def start_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._tg is None:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, "the channel is closed", where=self.target)
        self._tg.start_soon(fn, *args)

    # -- multicallables (grpc.aio.Channel's shape) ----------------------------

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> UnaryUnaryMultiCallable[Any, Any]:
        return UnaryUnaryMultiCallable(self, method, request_serializer, response_deserializer)

    def unary_stream(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> UnaryStreamMultiCallable[Any, Any]:
        return UnaryStreamMultiCallable(self, method, request_serializer, response_deserializer)

    def stream_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> StreamUnaryMultiCallable[Any, Any]:
        return StreamUnaryMultiCallable(self, method, request_serializer, response_deserializer)

    def stream_stream(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> StreamStreamMultiCallable[Any, Any]:
        return StreamStreamMultiCallable(self, method, request_serializer, response_deserializer)


class _MultiCallable(Generic[Req, Resp]):
    def __init__(
        self,
        channel: Channel,
        method: str,
        serializer: Callable[[Req], bytes] | None,
        deserializer: Callable[[bytes], Resp] | None,
    ) -> None:
        if not isinstance(method, str):
            raise TypeError(f"gRPC method must be a str path, not {type(method).__name__}")
        if not method.startswith("/"):
            raise ValueError(f"gRPC method {method!r} must be a path such as /pkg.Service/Method")
        if not (method.isascii() and method.isprintable()):
            raise ValueError(f"gRPC method {method!r} must be printable ASCII")
        self._channel = channel
        self._method = method
        self._serializer: Callable[[Req], bytes] = serializer or _identity
        self._deserializer: Callable[[bytes], Resp] = deserializer or _identity
        #: The fixed request headers, HPACK-encoded (plain, gzip).
        self._fixed = _fixed_blocks(channel._scheme, method, channel.authority)

    def _start(
        self,
        kind: type[_Handle],
        timeout: float | None,
        metadata: MetadataLike | None,
        credentials: Any,
        compression: grpc.Compression | None,
        *,
        request: Any = _NOTHING,
        requests: Iterable[Req] | AsyncIterable[Req] | None = None,
    ) -> _Handle:
        """Set up a call of any kind: check the arguments, encode the metadata, frame a
        unary ``request`` now (a bad or oversized one raises here, nothing sent); the
        stream opens when the caller first awaits the call or reads from it.
        """
        if credentials is not None:
            raise ValueError(
                f"{self._method}: per-call credentials are not supported "
                "(give the Channel an ssl_context; send tokens as metadata)"
            )
        if timeout is not None:
            if isinstance(timeout, bool) or not isinstance(timeout, int | float):
                raise TypeError(
                    f"{self._method}: timeout must be a number of seconds or None, "
                    f"not {type(timeout).__name__}"
                )
            if not timeout >= 0:
                raise ValueError(f"{self._method}: timeout must be >= 0 seconds, not {timeout!r}")
        if requests is not None and not isinstance(requests, Iterable | AsyncIterable):
            raise TypeError(
                f"{self._method}: request_iterator must be an iterable or an async iterable "
                f"of requests (or None), not {type(requests).__name__}"
            )
        extra = encode_metadata(metadata, self._channel.max_metadata)
        if compression is None:
            compression = self._channel.compression
        else:
            compression = _compression(self._method, compression)
        call: _Call[Req, Resp] = _Call(self, timeout, extra, compression == grpc.Compression.Gzip)
        if request is not _NOTHING:
            return kind(call, call.frame(request), None, writable=False)
        return kind(call, None, requests, writable=requests is None)


class _Call(Generic[Req, Resp]):
    """The state every call kind shares: headers, deadline, one stream, the final status."""

    def __init__(
        self,
        owner: _MultiCallable[Req, Resp],
        timeout: float | None,
        metadata: list[tuple[bytes, bytes]],
        gzip: bool,
    ) -> None:
        self._owner = owner
        self._channel = owner._channel
        self.deadline = anyio.current_time() + timeout if timeout is not None else math.inf
        #: What ``grpc-timeout`` says: the earlier of :attr:`deadline` and the
        #: enclosing cancel scope's deadline, read when the call starts.
        self._header_deadline = self.deadline
        self._metadata = metadata
        self._gzip = gzip
        self.stream: Stream | None = None
        self._initial: grpc.aio.Metadata | None = None
        self._trailing: grpc.aio.Metadata | None = None
        self._code: grpc.StatusCode | None = None
        self._details: str = ""
        self._encoding: bytes | None = None
        self._sender_scope: anyio.CancelScope | None = None
        #: The scope of a wait for a connection or a stream slot (see _wait_open).
        self._open_scope: anyio.CancelScope | None = None
        self.started = False
        #: The stream is being opened (by the task that started the call).
        self.opening = False
        #: Set when the opening ends, for other tasks of the call that wait
        #: for it (made by the first of them: most calls have one task).
        self._opened: anyio.Event | None = None
        #: How many responses arrived compressed (the interop cases check it).
        self.compressed_received = 0

    def _fixed_headers(self) -> bytes:
        """The HPACK block of every header but the metadata (no dynamic-table use)."""
        block = self._owner._fixed[self._gzip]
        if self._header_deadline != math.inf:
            timeout = encode_timeout(self._header_deadline - anyio.current_time())
            block += _TIMEOUT_LITERAL + bytes((len(timeout),)) + timeout
        return block

    def frame(self, request: Req) -> bytes:
        try:
            payload = self._owner._serializer(request)
        except Exception as exc:
            raise RpcError(
                grpc.StatusCode.INTERNAL,
                f"{self._owner._method}: the request did not serialize ({type(exc).__name__})",
                where="send",
            ) from exc
        if not isinstance(payload, bytes | bytearray | memoryview):
            serializer = "request_serializer" if self._owner._serializer is not _identity else ""
            raise TypeError(
                f"{self._owner._method}: a request must serialize to bytes, not "
                f"{type(payload).__name__}"
                + (
                    f" (the {serializer} returned it)"
                    if serializer
                    else " (without a request_serializer the method takes bytes)"
                )
            )
        limit = self._channel.max_send
        if len(payload) > limit:
            raise RpcError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self._owner._method}: a {len(payload)}-byte request is over the "
                f"{limit}-byte send limit",
                where="send",
            )
        if self._gzip:
            return encode_message(gzip_bytes(payload), True)
        return encode_message(payload, False)

    async def open(self, first: bytes | None = None) -> Stream:
        """Open the stream; with ``first`` (a unary request), send it and await the headers.

        Unary requests the server never processed are retried on a new connection.
        """
        attempt = 0
        while True:
            conn = self._channel._conn
            if conn is None or not conn.open_now:
                try:
                    conn = await self._wait_open()
                except Unprocessed:
                    continue
            stream = conn.start_stream(self._fixed_headers(), self._metadata, body=first)
            self.stream = stream
            if first is None:
                return stream
            try:
                if not stream.local_ended:
                    await stream.send(first, end=True)
                await stream.wait_headers()
                return stream
            except RpcError as exc:
                if stream.unprocessed and attempt < self._channel.transparent_retries:
                    attempt += 1
                    stream.release()
                    self.stream = None
                    continue
                if stream.unprocessed:
                    exc.unprocessed = True  # a discovery channel may send it elsewhere
                self._finish_from_error()
                raise

    async def _wait_open(self) -> Connection:
        """A connection that takes a new stream now (connecting first when
        there is none); :meth:`abort` (a caller's ``cancel()``) while this
        waits ends the call with nothing sent."""
        scope = self._open_scope = anyio.CancelScope()
        try:
            with scope:
                conn = await self._channel.connection()
                await conn.wait_open()
        finally:
            self._open_scope = None
        if self._code is not None:  # aborted meanwhile: no stream, no request
            # A cancellation of the caller's own scope wins over the abort.
            await anyio.lowlevel.checkpoint_if_cancelled()
            raise self._error()
        return conn

    async def start(
        self, first: bytes | None, requests: Iterable[Req] | AsyncIterable[Req] | None
    ) -> None:
        """Open the stream with the unary request ``first``, or start sending ``requests``
        from a task of the channel (cancelled when the call ends).
        """
        self.started = True
        self.opening = True
        # The enclosing scope's deadline as it is now, in the task that starts
        # the call (its first await, read, write or metadata wait), not when the
        # call object was made.
        self._header_deadline = min(self.deadline, anyio.current_effective_deadline())
        try:
            await self.open(first)
        except RpcError as exc:
            if self._code is None:
                self._code = exc.code()
                self._details = exc.details() or ""
            raise
        finally:
            self.opening = False
            if self._opened is not None:
                self._opened.set()
        if requests is not None:
            scope = anyio.CancelScope(deadline=self.deadline)
            self._sender_scope = scope
            self._channel.start_soon(self.send_all, requests, scope)

    async def opened(self) -> None:
        """Wait until the task that started the call has opened its stream
        (another task using the call at the same time); the call's error if
        that failed or was cancelled."""
        if self.opening:
            if self._opened is None:
                self._opened = anyio.Event()
            await self._opened.wait()
        if self.stream is None or (self.done and self._code != grpc.StatusCode.OK):
            raise self._error()

    async def single(self) -> Resp:
        """The one response of a unary-response call (INTERNAL for none or for more)."""
        response = await self.read()
        if response is grpc.aio.EOF:
            self._code = grpc.StatusCode.INTERNAL
            self._details = "the server sent no response message"
            raise self._error()
        if await self.read() is not grpc.aio.EOF:
            self.abort(grpc.StatusCode.INTERNAL, "the server sent more than one response")
            raise self._error()
        return response

    def _finish_from_error(self) -> None:
        stream = self.stream
        if stream is not None and stream.error is not None and self._code is None:
            self._code = stream.error.code()
            self._details = stream.error.details() or ""

    async def read(self) -> Resp | Any:
        """The next response, or ``grpc.aio.EOF`` after the status arrived (raised unless OK)."""
        stream = self.stream
        assert stream is not None
        try:
            if self._initial is None:
                self._take_headers(await stream.wait_headers())
            item = await stream.next_message()
        except RpcError as exc:
            self._code = exc.code()
            self._details = exc.details() or ""
            raise self._error(exc) from None
        if item is None:
            self._finish()
            return grpc.aio.EOF
        return self._decode(item)

    def buffered(self) -> Resp | object:
        """The next response when it has already arrived, else ``_NOTHING`` (synchronous).

        A streaming reader takes what the reader task queued without a
        cancel scope or a task switch per message; the deadline still holds.
        """
        stream = self.stream
        if stream is None or self._initial is None:
            return _NOTHING
        if self.deadline != math.inf and self.deadline <= anyio.current_time():
            return _NOTHING
        item = stream.take()
        return _NOTHING if item is None else self._decode(item)

    def _decode(self, item: tuple[bool, bytes]) -> Resp:
        compressed, payload = item
        if compressed:
            self.compressed_received += 1
            if self._encoding != b"gzip":
                self.abort(grpc.StatusCode.INTERNAL, "a compressed message without grpc-encoding")
                raise self._error()
            try:
                payload = gunzip_bounded(payload, self._channel.max_receive)
            except RpcError as exc:
                self.abort(exc.code(), exc.details() or "")
                raise self._error() from None
        try:
            return self._owner._deserializer(payload)
        except Exception as exc:
            self.abort(
                grpc.StatusCode.INTERNAL,
                f"a response did not deserialize ({type(exc).__name__})",
            )
            raise self._error() from exc

    def _take_headers(self, headers: list[tuple[bytes, bytes]]) -> None:
        self._initial = decode_metadata(headers)
        for key, value in headers:
            if key == b"grpc-encoding":
                self._encoding = value

    def _finish(self) -> None:
        """Status from the trailers (or trailers-only headers, or the HTTP status)."""
        stream = self.stream
        assert stream is not None
        headers = stream.headers or []
        trailers = stream.trailers
        if trailers is None:
            self._code = grpc.StatusCode.INTERNAL
            self._details = "the server ended the stream without trailers"
        else:
            http = b""
            content_type = b""
            for key, value in headers:
                if key == b":status":
                    http = value
                elif key == b"content-type":
                    content_type = value
            status: bytes | None = None
            message = b""
            for key, value in trailers:
                if key == b"grpc-status":
                    status = value
                elif key == b"grpc-message":
                    message = value
            if status is not None and status.isdigit():
                self._code = code_from_int(int(status))
                self._details = decode_grpc_message(message)
            elif http != b"200":
                code = int(http) if http.isdigit() else 0
                self._code = code_from_http_status(code)
                self._details = f"the server answered HTTP {code} without grpc-status"
            elif not content_type.startswith(b"application/grpc"):
                self._code = grpc.StatusCode.UNKNOWN
                self._details = "the response is not application/grpc"
            else:
                self._code = grpc.StatusCode.UNKNOWN
                self._details = "the server's trailers have no valid grpc-status"
            self._trailing = decode_metadata(trailers)
        if self._initial is None:
            self._initial = grpc.aio.Metadata()
        self.release()
        if self._code != grpc.StatusCode.OK:
            raise self._error()

    def _error(self, cause: RpcError | None = None) -> RpcError:
        code = self._code or (cause.code() if cause else grpc.StatusCode.UNKNOWN)
        return RpcError(
            code,
            self._details,
            initial_metadata=self._initial,
            trailing_metadata=self._trailing,
            where=self._owner._method,
        )

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        """End the call locally with ``code`` (synchronous): reset the stream, stop the sender."""
        if self._code is None:
            self._code = code
            self._details = details
        if self._open_scope is not None:
            self._open_scope.cancel()  # still waiting to open: nothing is sent
        stream = self.stream
        if stream is not None:
            stream.fail(RpcError(code, details, where=self._owner._method), reset=True)
        self.release()

    def release(self) -> None:
        if self._sender_scope is not None:
            self._sender_scope.cancel()
        if self.stream is not None:
            self.stream.release()

    @property
    def done(self) -> bool:
        return self._code is not None

    async def send_all(
        self, requests: Iterable[Req] | AsyncIterable[Req], scope: anyio.CancelScope
    ) -> None:
        """Send every request, then END_STREAM; failures end the call, never raise."""
        stream = self.stream
        assert stream is not None
        with scope:
            try:
                if isinstance(requests, AsyncIterable):
                    async for request in requests:
                        await stream.send(self.frame(request), end=False)
                else:
                    for request in requests:
                        await stream.send(self.frame(request), end=False)
                await stream.send(b"", end=True)
            except RpcError as exc:
                if stream.error is None:
                    self.abort(exc.code(), exc.details() or "")
            except Exception as exc:
                self.abort(
                    grpc.StatusCode.CANCELLED,
                    f"the request iterator raised {type(exc).__name__}",
                )
        if scope.cancelled_caught and self.deadline <= anyio.current_time() and not self.done:
            self.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed")
        # The call consumed the iterator: close it (an async generator's
        # cleanup runs now, bounded, instead of at garbage collection).
        aclose = getattr(requests, "aclose", None)
        if aclose is not None:
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(1.0),
                contextlib.suppress(Exception),
            ):
                await aclose()


async def _caller_deadline() -> None:
    """Let the caller's own deadline cancel it (it has passed) before an error
    is raised in its place.

    The server's DEADLINE_EXCEEDED for the ``grpc-timeout`` sent from the
    caller's cancel scope can arrive in the same loop iteration as that
    scope's timer (asyncio runs I/O callbacks first): the caller then sees
    its own cancellation, as the deadline's owner, not an ``RpcError``. The
    wait is bounded (the scope's timer is due already) in case the scope's
    deadline was moved later meanwhile.
    """
    with anyio.move_on_after(0.05):
        await anyio.sleep_forever()


def _deadline_error(call: _Call[Any, Any]) -> RpcError:
    call.abort(grpc.StatusCode.DEADLINE_EXCEEDED, "the call's deadline passed")
    return call._error()


class _CallHandle(Generic[Req, Resp]):
    """What the caller holds: one :class:`_Call`, started on first use, under its deadline."""

    def __init__(
        self,
        call: _Call[Req, Resp],
        first: bytes | None,
        requests: Iterable[Req] | AsyncIterable[Req] | None,
        writable: bool,
    ) -> None:
        self._call = call
        self._first = first
        self._requests = requests
        #: A stream-request call made without an iterator: write() and done_writing().
        self._writable = writable

    @property
    def stream_unprocessed(self) -> bool:
        """Whether the server refused this call's stream unseen (REFUSED_STREAM,
        or above a GOAWAY's last stream id): for a discovery channel."""
        stream = self._call.stream
        return stream is not None and stream.unprocessed

    @property
    def server_answered(self) -> bool:
        """Whether the server's trailers (or a trailers-only answer) arrived."""
        stream = self._call.stream
        return stream is not None and stream.trailers is not None

    def __del__(self) -> None:
        call = self.__dict__.get("_call")
        if call is not None and not call.done and call.stream is not None:
            with contextlib.suppress(Exception):  # interpreter shutdown
                call.release()

    async def _guard(self, fn: Callable[[], Any]) -> Any:
        """Start the call if need be, then ``fn()``, both within the call's deadline.

        The deadline is DEADLINE_EXCEEDED; any other cancellation of the
        caller aborts the call (CANCELLED) and goes on; an ``RpcError``
        releases the stream.
        """
        call = self._call
        try:
            if call.deadline == math.inf:  # no deadline: no cancel scope to enter and leave
                if call.stream is None or call.opening:
                    await self._begin()
                return await fn()
            if call.deadline <= anyio.current_time():
                raise _deadline_error(call)
            with anyio.CancelScope(deadline=call.deadline):
                if call.stream is None or call.opening:
                    await self._begin()
                return await fn()
            raise _deadline_error(call)
        except RpcError as exc:
            call.release()
            if (
                exc.code() is grpc.StatusCode.DEADLINE_EXCEEDED
                and call._header_deadline < call.deadline
                and anyio.current_time() >= call._header_deadline
            ):
                await _caller_deadline()
            raise
        except BaseException:
            call.abort(grpc.StatusCode.CANCELLED, "the caller was cancelled")
            raise

    async def _begin(self) -> None:
        """Start the call (the first task to use it), or wait for the task
        that is starting it; the call's error if that failed."""
        call = self._call
        if not call.started:
            await call.start(self._first, self._requests)
        else:
            await call.opened()

    async def write(self, request: Req) -> None:
        """Send one request (stream-request calls made without a request iterator)."""
        if not self._writable:
            raise RuntimeError(
                "write() is for stream-request calls made without a request iterator"
            )
        frame = self._call.frame(request)

        async def send() -> None:
            assert self._call.stream is not None
            await self._call.stream.send(frame, end=False)

        await self._guard(send)

    async def done_writing(self) -> None:
        async def end() -> None:
            assert self._call.stream is not None
            await self._call.stream.send(b"", end=True)

        await self._guard(end)

    async def _settle(self) -> None:
        """Until the call has its status (a response read, or every response)."""
        raise NotImplementedError

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        await self._settle()
        return self._call._trailing or grpc.aio.Metadata()

    async def code(self) -> grpc.StatusCode:
        await self._settle()
        return self._call._code or grpc.StatusCode.UNKNOWN

    async def details(self) -> str:
        await self._settle()
        return self._call._details

    def cancel(self) -> bool:
        if self._call.done:
            return False
        self._call.abort(grpc.StatusCode.CANCELLED, "cancelled by the caller")
        return True

    def done(self) -> bool:
        return self._call.done


class _UnaryResponseCall(_CallHandle[Req, Resp]):
    """An awaitable unary-response call (``UnaryUnaryCall`` / ``StreamUnaryCall``).

    Awaiting it again gives the same response (or raises the same error);
    the metadata and status accessors wait for it.
    """

    #: Made on first use (see :class:`~._outcome.Outcome`).
    _outcome: Outcome[Resp] | None = None

    def _shared(self) -> Outcome[Resp]:
        outcome = self._outcome
        if outcome is None:
            outcome = self._outcome = Outcome()
        return outcome

    def __await__(self) -> Generator[Any, None, Resp]:
        return self._shared().get(self._single, self._call._error).__await__()

    async def _result(self) -> Resp:
        return await self._shared().get(self._single, self._call._error)

    async def _single(self) -> Resp:
        response: Resp = await self._guard(self._call.single)
        return response

    async def _settle(self) -> None:
        with contextlib.suppress(RpcError):
            await self._result()

    async def initial_metadata(self) -> grpc.aio.Metadata:
        await self._settle()
        return self._call._initial or grpc.aio.Metadata()

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        self._shared().value = self._call._error()
        return True


class _StreamResponseCall(_CallHandle[Req, Resp]):
    """A streaming-response call (``UnaryStreamCall`` / ``StreamStreamCall``)."""

    def __aiter__(self) -> Self:
        return self

    async def __anext__(self) -> Resp:
        call = self._call
        if call._code is not None:
            message = await self.read()  # EOF or the call's error
        else:
            message = self._taken()
            if message is not _NOTHING:
                return message  # type: ignore[return-value]
            message = await self._guard(call.read)
        if message is grpc.aio.EOF:
            raise StopAsyncIteration
        return message

    def has_response(self) -> bool:
        """Whether a response has already arrived: :meth:`read` then returns
        it without waiting, and without giving the event loop a turn (not in
        ``grpc.aio``; for a reader that yields between responses only when
        the read itself would not)."""
        stream = self._call.stream
        return stream is not None and stream.has_message

    def _taken(self) -> Resp | object:
        """A response that has already arrived (synchronous), else ``_NOTHING``."""
        call = self._call
        if not call.started:
            return _NOTHING
        try:
            return call.buffered()
        except RpcError:
            call.release()
            raise

    async def read(self) -> Resp | Any:
        """The next response, or ``grpc.aio.EOF``; raises ``RpcError`` unless the status is OK."""
        call = self._call
        if call.done and call._code == grpc.StatusCode.OK:
            return grpc.aio.EOF
        if call.done:
            raise call._error()
        message = self._taken()
        if message is not _NOTHING:
            return message
        return await self._guard(call.read)

    async def _headers(self) -> None:
        """Until the response headers arrived; the call's error if it ended first."""
        call = self._call

        async def headers() -> None:
            assert call.stream is not None
            if call._initial is None:
                call._take_headers(await call.stream.wait_headers())

        await self._guard(headers)

    async def initial_metadata(self) -> grpc.aio.Metadata:
        # As in grpc.aio: a call that ended without response headers has
        # empty initial metadata (its error is for the reader and code()).
        with contextlib.suppress(RpcError):
            await self._headers()
        return self._call._initial or grpc.aio.Metadata()

    async def wait_for_connection(self) -> None:
        """Until the server answered with response headers; raises the call's
        error if it ended first (as grpc.aio's does)."""
        await self._headers()

    async def _settle(self) -> None:
        try:
            while await self.read() is not grpc.aio.EOF:
                pass
        except RpcError:
            pass


class UnaryUnaryMultiCallable(_MultiCallable[Req, Resp]):
    def __call__(
        self,
        request: Req,
        *,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> _UnaryResponseCall[Req, Resp]:
        return self._start(
            _UnaryResponseCall, timeout, metadata, credentials, compression, request=request
        )


class StreamUnaryMultiCallable(_MultiCallable[Req, Resp]):
    def __call__(
        self,
        request_iterator: Iterable[Req] | AsyncIterable[Req] | None = None,
        *,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> _UnaryResponseCall[Req, Resp]:
        return self._start(
            _UnaryResponseCall,
            timeout,
            metadata,
            credentials,
            compression,
            requests=request_iterator,
        )


class UnaryStreamMultiCallable(_MultiCallable[Req, Resp]):
    def __call__(
        self,
        request: Req,
        *,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> _StreamResponseCall[Req, Resp]:
        return self._start(
            _StreamResponseCall, timeout, metadata, credentials, compression, request=request
        )


class StreamStreamMultiCallable(_MultiCallable[Req, Resp]):
    def __call__(
        self,
        request_iterator: Iterable[Req] | AsyncIterable[Req] | None = None,
        *,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> _StreamResponseCall[Req, Resp]:
        return self._start(
            _StreamResponseCall,
            timeout,
            metadata,
            credentials,
            compression,
            requests=request_iterator,
        )
