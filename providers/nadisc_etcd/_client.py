"""A small client for etcd's v3 JSON gateway over httpx.

Every call is one ``POST /v3/...`` bounded twice: in time by
``min(deadline, now + request_timeout)`` (an anyio cancel scope, so a
stopped server cannot hold a caller), and in bytes by ``max_response_bytes``
(the body is read in chunks and refused once it passes the limit, before any
decoding). Watches are long POSTs whose newline-delimited results are parsed
incrementally with the same bound on every line.

Connections: unary calls take a turn under a fair limiter of
``max_request_connections`` before reaching a pool of as many connections
(a call still waiting at its deadline was never sent: ``IncompleteSnapshot``
even for a write); every watch opens a dedicated single-connection
transport of its own, outside that pool, closed with the watch.

Failures leave this module as nadisc's typed outcomes, with the httpx,
JSON or msgspec error chained as ``__cause__``:

====================================  =====================  ===================
what happened                          reads                  writes
====================================  =====================  ===================
no endpoint accepted a connection     IncompleteSnapshot     IncompleteSnapshot
transport error, timeout, truncation  IncompleteSnapshot     OutcomeUnknown
undecodable body                      IncompleteSnapshot     OutcomeUnknown
body over ``max_response_bytes``      CapacityRejected       CapacityRejected
permission denied / bad credentials   IdentityRevoked        IdentityRevoked
server "unavailable"/"timed out"      IncompleteSnapshot     OutcomeUnknown
lease not found                       IncompleteSnapshot     LeaseLost
any other server refusal              IncompleteSnapshot     RegistrationRejected
====================================  =====================  ===================

Authentication: with a username, the client authenticates once
(``/v3/auth/authenticate``) and sends the token as ``Authorization: <token>``
(no ``Bearer``). When the server says the token is invalid or was minted
before an auth-store change, the token is refreshed once (one refresh shared
by concurrent callers) and the call repeated; a second refusal is reported.
Messages name the endpoint, the path and the server's own message, never
the token or the password.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

import anyio
import httpx
import msgspec

from nadisc import (
    CapacityRejected,
    IdentityRevoked,
    IncompleteSnapshot,
    LeaseLost,
    OutcomeUnknown,
    ProviderFailure,
    RegistrationRejected,
    redacted_excerpt,
    time_left,
    tls_context_for,
)

from ._settings import EtcdSettings
from ._wire import (
    AuthenticateResponse,
    DeleteRangeResponse,
    ErrorBody,
    GatewayStatus,
    LeaseGrantResponse,
    LeaseKeepAliveLine,
    LeaseTimeToLiveResponse,
    PutResponse,
    RangeResponse,
    StatusResponse,
    TxnResponse,
    WatchLine,
    WatchResponse,
    WireError,
    b64,
    decode,
)

__all__ = [
    "Batches",
    "ClientCore",
    "EtcdClient",
    "Kind",
    "LineBuffer",
    "ResponseTooLarge",
    "WatchMessageTooLarge",
    "WatchStream",
    "discard",
]

logger = logging.getLogger(__name__)

Kind = Literal["read", "write"]
_M = TypeVar("_M", bound=msgspec.Struct)


class ResponseTooLarge(CapacityRejected):
    """An answer this process refused unread because it is larger than
    ``max_response_bytes`` (the owner's ``limits.max_snapshot_bytes``): the
    local limit, not a refusal by the server (etcd's own
    ``RESOURCE_EXHAUSTED``, such as "too many requests", is a plain
    ``CapacityRejected``). A range that meets it asks again in smaller pages."""


class WatchMessageTooLarge(ResponseTooLarge):
    """A watch message over ``max_response_bytes``, refused unread. A stream
    resumed after it would send it again, so the watch ranges afresh from
    a stream opened from now instead."""


def _transport_failure(kind: Kind, message: str) -> ProviderFailure:
    return IncompleteSnapshot(message) if kind == "read" else OutcomeUnknown(message)


def _server_failure(kind: Kind, where: str, status: GatewayStatus) -> ProviderFailure:
    text = f"{where}: {status}"
    if status.permission_denied or status.credentials_missing or status.token_expired:
        return IdentityRevoked(text)
    if status.http_status == 413 or status.code == 8:
        return CapacityRejected(text)
    if kind == "read":
        return IncompleteSnapshot(text)
    if status.lease_not_found:
        return LeaseLost(text)
    if status.outcome_unknown:
        return OutcomeUnknown(text)
    return RegistrationRejected(text)


async def discard(response: httpx.Response, chunks: AsyncIterator[bytes]) -> None:
    """Abandon a body that is being read: close the connection, then let the
    body iterator run into the closed connection so every generator in
    httpx/httpcore's chain finishes now (an abandoned, suspended one would be
    finalized later by the garbage collector, which trio reports as a
    resource leak). Shielded and bounded."""
    with anyio.CancelScope(shield=True) as scope:
        scope.deadline = anyio.current_time() + 1.0
        await response.aclose()
        try:
            while True:
                await chunks.__anext__()
        except Exception:  # the connection was closed on purpose
            pass


class LineBuffer:
    """Splits a byte stream into newline-delimited lines, each at most ``limit`` bytes.

    ``feed`` raises ``WatchMessageTooLarge`` (a ``CapacityRejected``) as soon
    as a line (complete or not) exceeds the limit, so memory stays O(limit).
    """

    __slots__ = ("_buffer", "_limit")

    def __init__(self, limit: int) -> None:
        self._buffer = bytearray()
        self._limit = limit

    def feed(self, chunk: bytes) -> list[bytes]:
        self._buffer += chunk
        lines: list[bytes] = []
        start = 0
        while True:
            end = self._buffer.find(b"\n", start)
            if end < 0:
                break
            if end - start > self._limit:
                raise WatchMessageTooLarge(
                    f"a watch message exceeded max_response_bytes={self._limit}"
                )
            line = bytes(self._buffer[start:end]).strip()
            if line:
                lines.append(line)
            start = end + 1
        del self._buffer[:start]
        if len(self._buffer) > self._limit:
            raise WatchMessageTooLarge(f"a watch message exceeded max_response_bytes={self._limit}")
        return lines


class _Chunk:
    """Yields one byte string once. A plain iterator object, not an async
    generator: a send that dies half-way (the server went away while the
    body was being written) leaves no unfinished generator behind for the
    garbage collector to complain about."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data

    def __aiter__(self) -> _Chunk:
        return self

    async def __anext__(self) -> bytes:
        data, self._data = self._data, None
        if data is None:
            raise StopAsyncIteration
        return data


class _Body(httpx.AsyncByteStream):
    """A request body of known bytes, iterated by :class:`_Chunk`."""

    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data = data

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _Chunk(self._data)


@dataclass(slots=True)
class _Counters:
    requests: int = 0
    failures: int = 0
    authentications: int = 0
    #: Dedicated watch connections open right now (outside the request pool).
    watch_connections: int = 0
    #: gRPC wire: channels opened for one unary call each, or for the pages
    #: of one range (none while the provider's served channel takes the calls).
    call_channels: int = 0


class Batches(Protocol):
    """What the provider reads from an established watch, on either wire."""

    #: The server's revision when the watch was created (its ``created``
    #: answer's header): a watch opened without a start revision delivers
    #: every event newer than it. 0 when the first answer was not ``created``.
    created_revision: int

    async def next_batch(self) -> list[WatchResponse]:
        """The next messages; always a checkpoint (a reader of the stream
        gives the loop a turn between batches through it, even while the
        server has more to say at once)."""
        ...


class _Opened(Batches, Protocol):
    """A watch stream as it is opened: its first message can be put back."""

    created_revision: int

    def _push_back(self, messages: list[WatchResponse]) -> None: ...


_S = TypeVar("_S", bound=_Opened)
_R = TypeVar("_R")


class WatchStream:
    """One established watch: ``created`` was received. Use within ``EtcdClient.watch``."""

    def __init__(self, where: str, chunks: AsyncIterator[bytes], limit: int) -> None:
        self._where = where
        self._chunks = chunks
        self._lines = LineBuffer(limit)
        self._pending: list[WatchResponse] = []
        self.created_revision = 0

    async def next_batch(self) -> list[WatchResponse]:
        """Every message available now (at least one); waits for the next chunk
        when none is buffered. Raises ``IncompleteSnapshot`` when the stream ends
        or breaks, ``WatchMessageTooLarge`` (a ``CapacityRejected``) for an
        oversized message."""
        while not self._pending:
            try:
                chunk = await self._chunks.__anext__()
            except StopAsyncIteration:
                raise IncompleteSnapshot(f"{self._where}: the watch stream ended") from None
            except httpx.HTTPError as exc:
                raise IncompleteSnapshot(f"{self._where}: the watch stream broke: {exc}") from exc
            self._pending = [self._decode(line) for line in self._lines.feed(chunk)]
        # The chunks of one network read come without a turn of the loop.
        await anyio.lowlevel.checkpoint()
        batch, self._pending = self._pending, []
        return batch

    def _decode(self, line: bytes) -> WatchResponse:
        try:
            message = decode(WatchLine, line)
        except WireError as exc:
            raise IncompleteSnapshot(f"{self._where}: undecodable watch message") from exc
        if message.error is not None:
            raise _server_failure("read", self._where, message.error.status())
        if message.result is None:
            raise IncompleteSnapshot(f"{self._where}: watch message without a result")
        return message.result

    def _push_back(self, messages: list[WatchResponse]) -> None:
        self._pending = messages + self._pending


class ClientCore:
    """What both wires share: endpoints, deadlines, the request limiter, the
    auth token (one refresh shared by concurrent callers) and the counters."""

    def __init__(
        self, settings: EtcdSettings, *, request_timeout: float, max_response_bytes: int
    ) -> None:
        self._endpoints = settings.endpoints
        self._current = 0
        self._username = settings.username
        self._password = settings.password
        self._request_timeout = request_timeout
        self._max_bytes = max_response_bytes
        self._requests = anyio.CapacityLimiter(settings.max_request_connections)
        self._token: str | None = None
        self._auth_lock = anyio.Lock()
        self._closed = False
        self.counters = _Counters()

    @property
    def endpoint(self) -> str:
        """The endpoint currently used (the last one that accepted a connection)."""
        return self._endpoints[self._current]

    @property
    def request_pool(self) -> tuple[int, int]:
        """(unary requests in flight, ``max_request_connections``)."""
        return self._requests.borrowed_tokens, int(self._requests.total_tokens)

    @asynccontextmanager
    async def _established(
        self,
        open_watch: Callable[[AsyncExitStack, _R, float], Awaitable[tuple[_S, WatchResponse]]],
        request: _R,
        until: float,
    ) -> AsyncIterator[_S]:
        """A watch opened with ``open_watch`` (either wire's) once ``created``
        arrived: a token refused as expired is refreshed once and the watch
        opened again; any other refusal of the create is the read's failure.
        A compacted start revision, or a first message that is not
        ``created``, goes back to the stream as its first batch."""
        for attempt in (0, 1):
            async with AsyncExitStack() as stack:
                token = self._token
                stream, first = await open_watch(stack, request, until)
                if first.canceled and first.compact_revision == 0:
                    status = GatewayStatus.from_cancel_reason(first.cancel_reason)
                    if attempt == 0 and status.token_expired and self._username is not None:
                        await self._refresh_token(token, until, "read")
                        continue
                    raise _server_failure("read", f"{self.endpoint}/v3/watch", status)
                if first.canceled or not first.created:
                    stream._push_back([first])
                else:
                    stream.created_revision = first.header.revision
                yield stream
                return
        raise AssertionError("unreachable")  # pragma: no cover

    def _bound(self, deadline: float) -> float:
        """One request's deadline: ``deadline``, at most the request timeout away."""
        left = time_left(deadline)  # refuses a passed, NaN or non-number deadline
        return deadline - max(0.0, left - self._request_timeout)

    def _secrets(self) -> tuple[str, ...]:
        """What an error message must never be quoted with (it may echo the request)."""
        secrets = [self._token or ""]
        if self._password is not None:
            secrets.append(self._password.get_secret_value())
        return tuple(s for s in secrets if s)

    async def _ensure_token(self, until: float, kind: Kind) -> None:
        if self._username is not None and self._token is None:
            await self._refresh_token(None, until, kind)

    async def _refresh_token(self, stale: str | None, until: float, kind: Kind) -> None:
        async with self._auth_lock:
            if self._token != stale:
                return  # another caller already refreshed it
            self._token = await self._authenticate(until, kind)

    async def _authenticate(self, until: float, kind: Kind) -> str:
        """A fresh token for the configured user (each wire has its own call)."""
        raise NotImplementedError


class EtcdClient(ClientCore):
    """The v3 gateway calls nadisc_etcd needs; one instance per connection.

    Not a general etcd client: only range, put, delete, a compare-lease
    delete, leases, watch, status and authenticate.
    """

    def __init__(
        self,
        settings: EtcdSettings,
        *,
        request_timeout: float,
        max_response_bytes: int,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(
            settings, request_timeout=request_timeout, max_response_bytes=max_response_bytes
        )
        connect = settings.connect_timeout_ms / 1000
        self._unary_timeout = httpx.Timeout(request_timeout, connect=connect)
        self._stream_timeout = httpx.Timeout(request_timeout, connect=connect, read=None)
        pool = settings.max_request_connections
        # Unary requests share a small pool, and never more requests than it
        # has connections reach it: httpcore hands connections to queued
        # requests by scanning every request against every connection, so a
        # crowd of waiters (or of long watches) in one pool costs the event
        # loop O(requests x connections) per event. The fair limiter in front
        # keeps the pool's own queue empty (``self._requests``).
        # Loading a CA bundle is synchronous and slow (it holds the event
        # loop): https endpoints use the process's shared default context,
        # plain-http ones a context that trusts nothing and loads nothing.
        self._tls = tls_context_for(settings.endpoints)
        self._http = httpx.AsyncClient(
            transport=transport,
            verify=self._tls,
            timeout=self._unary_timeout,
            limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool),
            trust_env=False,
        )
        # Watches get a dedicated connection each, outside that pool (the
        # gateway cannot multiplex watches over HTTP/1.1). An injected
        # transport (tests) serves watches as well; otherwise each watch
        # opens its own single-connection transport, sharing one TLS context.
        self._injected = transport

    # ------------------------------------------------------------- transport

    @asynccontextmanager
    async def _stream(
        self,
        where: str,
        content: bytes,
        headers: dict[str, str],
        *,
        timeouts: httpx.Timeout | None = None,
        client: httpx.AsyncClient | None = None,
    ) -> AsyncIterator[httpx.Response]:
        """``POST`` with a streamed response (what ``httpx.AsyncClient.stream``
        does), sending the body through :class:`_Body`."""
        http = client if client is not None else self._http
        request = http.build_request(
            "POST",
            where,
            content=content,
            headers=headers,
            timeout=timeouts if timeouts is not None else httpx.USE_CLIENT_DEFAULT,
        )
        request.stream = _Body(content)
        response = await http.send(request, stream=True)
        try:
            yield response
        finally:
            await response.aclose()

    async def _post(
        self, path: str, body: object, *, kind: Kind, until: float, auth: bool = True
    ) -> tuple[int, bytes]:
        """POST once to the first endpoint that accepts a connection; bounded body."""
        if self._closed:
            raise IncompleteSnapshot(f"{path}: not sent, the etcd client is closed")
        content = json.dumps(body, separators=(",", ":")).encode("utf-8")
        headers = {"Content-Type": "application/json"}
        if auth and self._token is not None:
            headers["Authorization"] = self._token
        self.counters.requests += 1
        last_error: Exception | None = None
        sent = False
        with anyio.CancelScope(deadline=until) as scope:
            async with self._requests:
                sent = True
                for step in range(len(self._endpoints)):
                    index = (self._current + step) % len(self._endpoints)
                    where = f"{self._endpoints[index]}{path}"
                    try:
                        async with self._stream(where, content, headers) as response:
                            self._current = index
                            data = await self._read_bounded(response, where)
                            return response.status_code, data
                    except httpx.ConnectError as exc:
                        last_error = exc
                        continue
                    except httpx.HTTPError as exc:
                        self.counters.failures += 1
                        raise _transport_failure(
                            kind, f"{where}: {type(exc).__name__}: {exc}"
                        ) from exc
        self.counters.failures += 1
        if scope.cancelled_caught and not sent:
            # Still waiting for a turn: nothing left this process.
            raise IncompleteSnapshot(
                f"{path}: not sent, no request slot came free before the deadline "
                f"(max_request_connections={self._requests.total_tokens:g})"
            )
        if scope.cancelled_caught:
            raise _transport_failure(
                kind, f"{self.endpoint}{path}: no complete answer before the deadline"
            ) from last_error
        # Nothing was sent, so even a write is known not to have applied.
        raise IncompleteSnapshot(
            f"{path}: not sent, no endpoint accepted a connection: {last_error}"
        ) from last_error

    async def _read_bounded(self, response: httpx.Response, where: str) -> bytes:
        declared = response.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self._max_bytes:
            raise ResponseTooLarge(
                f"{where}: response of {declared} bytes exceeds max_response_bytes="
                f"{self._max_bytes}"
            )
        data = bytearray()
        chunks = response.aiter_raw()
        async for chunk in chunks:
            data += chunk
            if len(data) > self._max_bytes:
                await discard(response, chunks)
                raise ResponseTooLarge(
                    f"{where}: response exceeds max_response_bytes={self._max_bytes}"
                )
        return bytes(data)

    async def _call(
        self,
        path: str,
        body: object,
        model: type[_M],
        *,
        kind: Kind,
        deadline: float,
        parse: Callable[[bytes], _M] | None = None,
    ) -> _M:
        until = self._bound(deadline)
        for attempt in (0, 1):
            await self._ensure_token(until, kind)
            token = self._token
            status, data = await self._post(path, body, kind=kind, until=until)
            where = f"{self.endpoint}{path}"
            if status == 200:
                try:
                    return parse(data) if parse is not None else decode(model, data)
                except (WireError, ValueError) as exc:
                    raise _transport_failure(kind, f"{where}: undecodable response") from exc
            failure = self._status_of(status, data, self._secrets())
            if attempt == 0 and failure.token_expired and self._username is not None:
                await self._refresh_token(token, until, kind)
                continue
            raise _server_failure(kind, where, failure)
        raise AssertionError("unreachable")  # pragma: no cover

    @staticmethod
    def _status_of(status: int, data: bytes, secrets: tuple[str, ...] = ()) -> GatewayStatus:
        try:
            parsed = decode(ErrorBody, data).status(status)
        except WireError:
            return GatewayStatus.of(0, f"HTTP {status}: {redacted_excerpt(data, secrets)}", status)
        # The server's own message: still filtered (a proxy may have written it).
        return GatewayStatus.of(parsed.code, redacted_excerpt(parsed.message, secrets), status)

    # ------------------------------------------------------------------ auth

    async def _authenticate(self, until: float, kind: Kind) -> str:
        assert self._username is not None and self._password is not None
        body = {"name": self._username, "password": self._password.get_secret_value()}
        self.counters.authentications += 1
        status, data = await self._post(
            "/v3/auth/authenticate", body, kind=kind, until=until, auth=False
        )
        where = f"{self.endpoint}/v3/auth/authenticate"
        if status != 200:
            refusal = self._status_of(status, data, self._secrets())
            raise _server_failure(kind, f"{where}: authentication refused", refusal)
        try:
            return decode(AuthenticateResponse, data).token
        except WireError as exc:
            raise _transport_failure(kind, f"{where}: undecodable response") from exc

    # ------------------------------------------------------------------- kv

    @asynccontextmanager
    async def pinned(self) -> AsyncIterator[None]:
        """Nothing here: the HTTP pool keeps its connections by itself (see
        ``EtcdGrpcClient.pinned``)."""
        yield

    async def range(
        self,
        key: bytes,
        range_end: bytes | None,
        *,
        deadline: float,
        keys_only: bool = False,
        count_only: bool = False,
        limit: int = 0,
        revision: int = 0,
        newest_first: bool = False,
    ) -> RangeResponse:
        """One range. ``newest_first`` sorts by ``mod_revision``, newest first
        (with ``limit=1``: the newest change under the range)."""
        body: dict[str, object] = {"key": b64(key)}
        if revision:
            body["revision"] = str(revision)
        if range_end is not None:
            body["range_end"] = b64(range_end)
        if keys_only:
            body["keys_only"] = True
        if count_only:
            body["count_only"] = True
        if limit:
            body["limit"] = str(limit)
        if newest_first:
            body["sort_order"] = "DESCEND"
            body["sort_target"] = "MOD"
        return await self._call("/v3/kv/range", body, RangeResponse, kind="read", deadline=deadline)

    async def put(self, key: bytes, value: bytes, *, lease: int, deadline: float) -> PutResponse:
        body = {"key": b64(key), "value": b64(value), "lease": str(lease)}
        return await self._call("/v3/kv/put", body, PutResponse, kind="write", deadline=deadline)

    async def delete_range(
        self, key: bytes, range_end: bytes | None = None, *, deadline: float
    ) -> DeleteRangeResponse:
        body = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        return await self._call(
            "/v3/kv/deleterange", body, DeleteRangeResponse, kind="write", deadline=deadline
        )

    async def delete_if_lease(self, key: bytes, lease: int, *, deadline: float) -> bool:
        """Delete ``key`` only while it is attached to ``lease`` (one transaction)."""
        body = {
            "compare": [
                {"key": b64(key), "target": "LEASE", "result": "EQUAL", "lease": str(lease)}
            ],
            "success": [{"request_delete_range": {"key": b64(key)}}],
        }
        answer = await self._call("/v3/kv/txn", body, TxnResponse, kind="write", deadline=deadline)
        return answer.succeeded

    # --------------------------------------------------------------- leases

    async def lease_grant(self, ttl: int, *, deadline: float) -> LeaseGrantResponse:
        return await self._call(
            "/v3/lease/grant",
            {"TTL": str(ttl)},
            LeaseGrantResponse,
            kind="write",
            deadline=deadline,
        )

    async def lease_keepalive(self, lease: int, *, deadline: float) -> int:
        """One keepalive round trip: the remaining TTL (0: the lease is gone)."""

        def first_line(data: bytes) -> LeaseKeepAliveLine:
            for line in data.splitlines():
                if line.strip():
                    return decode(LeaseKeepAliveLine, line)
            raise ValueError("empty keepalive stream")

        answer = await self._call(
            "/v3/lease/keepalive",
            {"ID": str(lease)},
            LeaseKeepAliveLine,
            kind="write",
            deadline=deadline,
            parse=first_line,
        )
        if answer.error is not None:
            raise _server_failure(
                "write", f"{self.endpoint}/v3/lease/keepalive", answer.error.status()
            )
        return answer.result.TTL if answer.result is not None else 0

    async def lease_revoke(self, lease: int, *, deadline: float) -> bool:
        """Revoke ``lease``; False if it was already gone."""
        try:
            await self._call(
                "/v3/lease/revoke",
                {"ID": str(lease)},
                PutResponse,
                kind="write",
                deadline=deadline,
            )
        except LeaseLost:
            return False
        return True

    async def lease_time_to_live(self, lease: int, *, deadline: float) -> LeaseTimeToLiveResponse:
        return await self._call(
            "/v3/lease/timetolive",
            {"ID": str(lease)},
            LeaseTimeToLiveResponse,
            kind="read",
            deadline=deadline,
        )

    # ----------------------------------------------------------------- misc

    async def status(self, *, deadline: float) -> StatusResponse:
        return await self._call(
            "/v3/maintenance/status", {}, StatusResponse, kind="read", deadline=deadline
        )

    async def compact(self, revision: int, *, deadline: float) -> None:
        await self._call(
            "/v3/kv/compaction",
            {"revision": str(revision)},
            PutResponse,
            kind="write",
            deadline=deadline,
        )

    # ---------------------------------------------------------------- watch

    @asynccontextmanager
    async def watch(
        self,
        key: bytes,
        range_end: bytes,
        *,
        start_revision: int,
        open_deadline: float,
        progress_notify: bool = True,
    ) -> AsyncIterator[WatchStream]:
        """Open a watch from ``start_revision``; yields once ``created`` arrived.
        ``start_revision=0`` watches from now: every event newer than the
        stream's ``created_revision``.

        Opening is bounded by ``open_deadline`` and ``request_timeout``; reading
        afterwards is not (the caller decides when a silent stream is dead).
        A compacted start revision is *not* an error here: the stream is
        yielded and its first batch carries the ``canceled`` message with
        ``compact_revision``.
        """
        create: dict[str, object] = {"key": b64(key), "range_end": b64(range_end)}
        if start_revision:
            create["start_revision"] = str(start_revision)
        if progress_notify:
            create["progress_notify"] = True
        content = json.dumps({"create_request": create}).encode("utf-8")
        async with self._established(
            self._open_watch, content, self._bound(open_deadline)
        ) as stream:
            yield stream

    async def _open_watch(
        self, stack: AsyncExitStack, content: bytes, until: float
    ) -> tuple[WatchStream, WatchResponse]:
        if self._closed:
            raise IncompleteSnapshot("/v3/watch: the etcd client is closed")
        self.counters.requests += 1
        with anyio.CancelScope(deadline=until) as scope:
            await self._ensure_token(until, "read")
            headers = {"Content-Type": "application/json"}
            if self._token is not None:
                headers["Authorization"] = self._token
            last_error: Exception | None = None
            for step in range(len(self._endpoints)):
                index = (self._current + step) % len(self._endpoints)
                where = f"{self._endpoints[index]}/v3/watch"
                try:
                    response = await stack.enter_async_context(
                        self._stream(
                            where,
                            content,
                            headers,
                            timeouts=self._stream_timeout,
                            client=await self._watch_client(stack),
                        )
                    )
                except httpx.ConnectError as exc:
                    last_error = exc
                    continue
                except httpx.HTTPError as exc:
                    self.counters.failures += 1
                    raise IncompleteSnapshot(f"{where}: {type(exc).__name__}: {exc}") from exc
                self._current = index
                if response.status_code != 200:
                    data = await self._read_bounded(response, where)
                    refusal = self._status_of(response.status_code, data)
                    raise _server_failure("read", where, refusal)
                chunks = response.aiter_raw()
                stack.push_async_callback(discard, response, chunks)
                stream = WatchStream(where, chunks, self._max_bytes)
                batch = await stream.next_batch()
                stream._push_back(batch[1:])
                return stream, batch[0]
        self.counters.failures += 1
        if scope.cancelled_caught:
            raise IncompleteSnapshot(
                f"{self.endpoint}/v3/watch: the watch was not established before the deadline"
            )
        raise IncompleteSnapshot(
            f"/v3/watch: no endpoint accepted a connection: {last_error}"
        ) from last_error

    async def _watch_client(self, stack: AsyncExitStack) -> httpx.AsyncClient:
        """A single-connection client for one watch, closed with ``stack``
        (the request pool when a transport was injected)."""
        if self._injected is not None:
            return self._http
        transport = httpx.AsyncHTTPTransport(
            verify=self._tls,
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=0),
        )
        client = httpx.AsyncClient(
            transport=transport, timeout=self._stream_timeout, trust_env=False
        )
        self.counters.watch_connections += 1
        stack.push_async_callback(self._close_quietly, client)
        return client

    async def _close_quietly(self, client: httpx.AsyncClient) -> None:
        self.counters.watch_connections -= 1
        with anyio.move_on_after(1.0, shield=True):
            await client.aclose()

    # ---------------------------------------------------------------- close

    async def aclose(self) -> None:
        """Close the connection pool. Idempotent; bounded even when cancelled."""
        if self._closed:
            return
        self._closed = True
        with anyio.move_on_after(2.0, shield=True):
            await self._http.aclose()
