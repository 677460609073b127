"""etcd's v3 gRPC API through ``nadisc.grpc.Channel`` (``wire: grpc``).

The same calls, answers and failure table as :class:`~._client.EtcdClient`
(the JSON gateway client): the provider cannot tell the wires apart except
by speed. Messages are the protobuf classes of :mod:`._proto`; answers are
turned into the same msgspec structs of :mod:`._wire` (a key-value keeps
its value as bytes in ``raw``, so nothing is base64-encoded twice).

Bounds, as on the JSON wire: every call runs under
``min(deadline, now + request_timeout)`` (an anyio cancel scope; the
channel sends the remaining time as ``grpc-timeout``), and every response
message is limited to ``max_response_bytes`` by the channel's receive limit
(refused from its 5-byte length prefix, before it is buffered). Unary calls
take a turn under the ``max_request_connections`` limiter.

Connections: a channel's connection is served by a task of the channel's
own task group, which must be entered and left by one task. Under an owner,
the provider's ``serve`` task (one task of the owner's, for the owner's
life) keeps one channel to the endpoint that was current when it started,
and every unary call to that endpoint (and every page of a range) is a
stream on it: one connection, reopened by the channel when it was lost.
When a call finds another endpoint current (a failover), the channel
follows it. Calls to another endpoint, calls before that channel is open,
and a provider used without an owner open a channel of their own
inside the calling task and close it when answered: one TCP connection and
HTTP/2 handshake per call, on loopback about a millisecond of CPU. The
pages of one complete range are the exception: without a served channel
they share one the range holds (:meth:`EtcdGrpcClient.pinned`). A watch
keeps one channel for its whole life (entered in the watch's own task), as
the JSON wire keeps a dedicated connection per watch.

Failures (``RpcError`` codes and etcd's messages, from etcd's
``api/v3rpc/rpctypes/error.go``, normalized by :class:`~._wire.GatewayStatus`
exactly as the gateway's error bodies are):

====================================  =====================  ===================
what happened                          reads                  writes
====================================  =====================  ===================
no endpoint accepted a connection     IncompleteSnapshot     IncompleteSnapshot
``UNAVAILABLE``/``DEADLINE_EXCEEDED``  IncompleteSnapshot     OutcomeUnknown
(connection lost, no leader, our or
the server's deadline), ``INTERNAL``
undecodable message                   IncompleteSnapshot     OutcomeUnknown
``RESOURCE_EXHAUSTED`` (message over  CapacityRejected       CapacityRejected
``max_response_bytes``)
``PERMISSION_DENIED``, auth failed,   IdentityRevoked        IdentityRevoked
user name empty
``NOT_FOUND`` "lease not found"       IncompleteSnapshot     LeaseLost
any other refusal                     IncompleteSnapshot     RegistrationRejected
====================================  =====================  ===================

Authentication: with a username, ``Auth.Authenticate`` once; the token
travels as the ``token`` metadata (etcd's ``rpctypes.TokenFieldNameGRPC``,
what etcd's own clients send). ``UNAUTHENTICATED`` ("invalid auth token")
or "revision of auth store is old" refresh it once, shared by concurrent
callers, and the call is repeated; a second refusal is reported.
"""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from contextvars import ContextVar
from itertools import repeat
from typing import Any, Literal
from urllib.parse import urlsplit

import anyio
import grpc
import httpx
from anyio.abc import TaskStatus

from nadisc import IncompleteSnapshot, LeaseLost, ProviderFailure, redacted_excerpt
from nadisc.grpc import Channel, RpcError

from ._client import (
    ClientCore,
    Kind,
    ResponseTooLarge,
    WatchMessageTooLarge,
    _server_failure,
    _transport_failure,
)
from ._proto import MESSAGES as _M
from ._proto import RANGE_COLUMNS
from ._settings import EtcdSettings
from ._wire import (
    DeleteRangeResponse,
    Event,
    GatewayStatus,
    KeyValue,
    LeaseGrantResponse,
    LeaseTimeToLiveResponse,
    PutResponse,
    RangeResponse,
    ResponseHeader,
    StatusResponse,
    TxnResponse,
    WatchResponse,
)

__all__ = ["EtcdGrpcClient", "GrpcWatchStream"]

_KV = "/etcdserverpb.KV/"
_LEASE = "/etcdserverpb.Lease/"
_DESCEND, _MOD = 2, 3  # RangeRequest.SortOrder.DESCEND, SortTarget.MOD
_LEASE_TARGET, _EQUAL = 4, 0  # Compare.CompareTarget.LEASE, CompareResult.EQUAL
_EVENT_TYPES: tuple[Literal["PUT"], Literal["DELETE"]] = (
    "PUT",
    "DELETE",
)  # mvccpb.Event.EventType by number


#: The channel the calls of a task, and of the tasks it starts, share while
#: :meth:`EtcdGrpcClient.pinned` holds it: (client, endpoint index, channel).
_PINNED: ContextVar[tuple[EtcdGrpcClient, int, Channel] | None] = ContextVar(
    "nadisc_etcd_pinned_channel", default=None
)


class _Refused(Exception):
    """A call ended with a gRPC status: classified by the caller."""

    def __init__(self, where: str, status: GatewayStatus, error: RpcError) -> None:
        super().__init__(where)
        self.where = where
        self.status = status
        self.error = error


def _header(message: Any) -> ResponseHeader:
    h = message.header
    return ResponseHeader(h.cluster_id, h.member_id, h.revision, h.raft_term)


def _kv(kv: Any) -> KeyValue:
    return KeyValue(kv.key, kv.create_revision, kv.mod_revision, kv.version, "", kv.lease, kv.value)


def _range_response(data: bytes) -> RangeResponse:
    """A ``RangeResponse``'s bytes as the wire struct, read column-wise
    (:data:`~._proto.RANGE_COLUMNS`: one list per field from the C parser,
    the key-values built in one ``map``, no Python step per key).

    The columns line up only when every key-value carries each field once.
    etcd always sends a key and the three revisions (all non-zero for a
    stored key); a value is left out only when empty (every one of a
    keys-only range) and a lease only when 0. A column of another length
    (some values empty or leases 0 but not all, or a key-value without a
    key or revision) is not in step: the message is then read again with
    the ``RangeResponse`` class, one key-value at a time."""
    answer = RANGE_COLUMNS.FromString(data)
    columns = answer.kvs
    keys = list(columns.key)
    count = len(keys)
    creates = list(columns.create_revision)
    mods = list(columns.mod_revision)
    versions = list(columns.version)
    values = list(columns.value)
    leases = list(columns.lease)
    if (
        len(creates) == len(mods) == len(versions) == count
        and len(values) in (0, count)
        and len(leases) in (0, count)
    ):
        kvs = tuple(
            map(
                KeyValue,
                keys,
                creates,
                mods,
                versions,
                repeat(""),
                leases or repeat(0),
                values or repeat(b""),
            )
        )
    else:
        full = _M["RangeResponse"].FromString(data)
        kvs = tuple([_kv(kv) for kv in full.kvs])
    return RangeResponse(_header(answer), kvs, answer.more, answer.count)


def _watch_response(message: Any) -> WatchResponse:
    return WatchResponse(
        header=_header(message),
        watch_id=message.watch_id,
        created=message.created,
        canceled=message.canceled,
        compact_revision=message.compact_revision,
        cancel_reason=message.cancel_reason,
        fragment=message.fragment,
        events=tuple(Event(_kv(e.kv), _EVENT_TYPES[e.type]) for e in message.events),
    )


def _target(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class GrpcWatchStream:
    """One established watch (``created`` was received); the same interface
    as the JSON wire's ``WatchStream``. Use within ``EtcdGrpcClient.watch``."""

    def __init__(
        self, where: str, call: Any, secrets: Callable[[], tuple[str, ...]], limit: int
    ) -> None:
        self._where = where
        self._call = call
        self._secrets = secrets
        self._limit = limit
        self._pending: list[WatchResponse] = []
        self.created_revision = 0

    async def next_batch(self) -> list[WatchResponse]:
        """The next message (pushed-back ones first). ``IncompleteSnapshot``
        when the stream ends or breaks, ``WatchMessageTooLarge`` (a
        ``CapacityRejected``) for a message over ``max_response_bytes``, a
        server refusal as the typed outcome. Always a checkpoint: the read
        waited, or the loop gets a turn before a message that was already
        here is taken."""
        call = self._call
        if self._pending or call.has_response():
            await anyio.lowlevel.checkpoint()
        if self._pending:
            batch, self._pending = self._pending, []
            return batch
        try:
            message = await call.read()
        except RpcError as exc:
            status = _status(exc, self._secrets(), self._limit)
            if _over_receive_limit(exc):
                raise WatchMessageTooLarge(f"{self._where}: {status}") from exc
            where = f"{self._where}: the watch stream broke"
            raise _server_failure("read", where, status) from exc
        if message is grpc.aio.EOF:
            raise IncompleteSnapshot(f"{self._where}: the watch stream ended")
        return [_watch_response(message)]

    def _push_back(self, messages: list[WatchResponse]) -> None:
        self._pending = messages + self._pending


def _over_receive_limit(error: RpcError) -> bool:
    """The channel refused a message over its receive limit
    (``max_response_bytes``), not the server."""
    return error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "receive limit" in (
        error.details() or ""
    )


def _status(error: RpcError, secrets: tuple[str, ...], limit: int) -> GatewayStatus:
    code = error.code()
    number = int(code.value[0]) if code is not None else 2
    text = redacted_excerpt(error.details() or "", secrets)
    if _over_receive_limit(error):
        text = f"a response exceeds max_response_bytes={limit}: {text}"
    return GatewayStatus.of(number, text)


def _method(
    channel: Channel, path: str, response: str | Callable[[bytes], Any], *, stream: bool = False
) -> Any:
    parse = _M[response].FromString if isinstance(response, str) else response
    if stream:
        return channel.stream_stream(path, _serialize, parse)
    return channel.unary_unary(path, _serialize, parse)


def _serialize(message: Any) -> bytes:
    data: bytes = message.SerializeToString()
    return data


class EtcdGrpcClient(ClientCore):
    """The etcd v3 gRPC calls nadisc_etcd needs; one instance per connection.

    The same surface, answers and failures as :class:`~._client.EtcdClient`.
    """

    def __init__(
        self,
        settings: EtcdSettings,
        *,
        request_timeout: float,
        max_response_bytes: int,
    ) -> None:
        super().__init__(
            settings, request_timeout=request_timeout, max_response_bytes=max_response_bytes
        )
        self._targets = tuple(_target(url) for url in settings.endpoints)
        #: The served channel (endpoint index, channel) while ``serve`` runs,
        #: and what tells it that another endpoint became the current one.
        self._shared: tuple[int, Channel] | None = None
        self._moved: anyio.Event | None = None
        self._connect = settings.connect_timeout_ms / 1000
        # A context of our own: the channel sets ALPN "h2" on it, which the
        # process's shared context (used by HTTP/1.1 pools) must not get.
        self._tls: ssl.SSLContext | None = (
            httpx.create_ssl_context()
            if any(url.startswith("https://") for url in settings.endpoints)
            else None
        )

    async def serve(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        """Keep one channel to the current endpoint for the unary calls, until
        cancelled (the owner's ``serve`` task); started once it takes calls."""
        started = False
        while not self._closed:
            index = self._current
            self._moved = moved = anyio.Event()
            async with self._channel(index) as channel:
                self._shared = (index, channel)
                if not started:
                    started = True
                    task_status.started()
                try:
                    # Until a call finds another endpoint current (a failover):
                    # then the channel follows it.
                    await moved.wait()
                finally:
                    self._shared = None
                    self._moved = None
        if not started:
            task_status.started()

    @asynccontextmanager
    async def pinned(self) -> AsyncIterator[None]:
        """The calls made in this block, by this task and the tasks it starts,
        share one channel to the current endpoint when no served channel
        exists (a provider without an owner): a range of several pages is
        one connection, not one per page. Entered and left by one task."""
        if self._shared is not None or self._closed or _PINNED.get() is not None:
            yield
            return
        index = self._current
        self.counters.call_channels += 1
        async with self._channel(index) as channel:
            token = _PINNED.set((self, index, channel))
            try:
                yield
            finally:
                _PINNED.reset(token)

    def _move_to(self, index: int) -> None:
        """Endpoint ``index`` answered: it is the current one from now on."""
        self._current = index
        shared, moved = self._shared, self._moved
        if shared is not None and shared[0] != index and moved is not None:
            moved.set()

    def _channel(self, index: int) -> Channel:
        return Channel(
            self._targets[index],
            ssl_context=self._tls,
            max_receive_message_length=self._max_bytes,
            max_send_message_length=self._max_bytes,
        )

    # ------------------------------------------------------------- transport

    def _metadata(self, auth: bool) -> tuple[tuple[str, str], ...] | None:
        if auth and self._token is not None:
            return (("token", self._token),)
        return None

    async def _opened(self, stack: AsyncExitStack, index: int) -> Channel | None:
        """A channel to endpoint ``index`` with its connection up, or None
        when the endpoint did not accept one within ``connect_timeout_ms``."""
        channel = await stack.enter_async_context(self._channel(index))
        return channel if await self._connected(channel) else None

    async def _connected(self, channel: Channel) -> bool:
        with anyio.move_on_after(self._connect):
            try:
                await channel.connection()
            except RpcError:
                return False
            return True
        return False

    async def _send(
        self,
        path: str,
        response: str | Callable[[bytes], Any],
        request: Any,
        *,
        kind: Kind,
        until: float,
        auth: bool = True,
        stream: bool = False,
    ) -> Any:
        """One call to the first endpoint that accepts a connection."""
        if self._closed:
            raise IncompleteSnapshot(f"{path}: not sent, the etcd client is closed")
        self.counters.requests += 1
        sent = False
        where = path
        with anyio.CancelScope(deadline=until) as scope:
            async with self._requests:
                sent = True
                for step in range(len(self._targets)):
                    index = (self._current + step) % len(self._targets)
                    where = f"{self._endpoints[index]}{path}"
                    async with AsyncExitStack() as stack:
                        shared = self._shared
                        if shared is None:
                            pin = _PINNED.get()
                            if pin is not None and pin[0] is self:
                                shared = pin[1], pin[2]
                        if shared is not None and shared[0] == index:
                            channel = shared[1] if await self._connected(shared[1]) else None
                        else:
                            self.counters.call_channels += 1
                            channel = await self._opened(stack, index)
                        if channel is None:
                            continue
                        self._move_to(index)
                        method = _method(channel, path, response, stream=stream)
                        metadata = self._metadata(auth)
                        try:
                            if not stream:
                                return await method(request, metadata=metadata)
                            call = method(metadata=metadata)
                            await call.write(request)
                            answer = await call.read()
                            call.cancel()
                            return answer
                        except RpcError as exc:
                            self.counters.failures += 1
                            raise _Refused(
                                where, _status(exc, self._secrets(), self._max_bytes), exc
                            ) from None
        self.counters.failures += 1
        if scope.cancelled_caught and not sent:
            raise IncompleteSnapshot(
                f"{path}: not sent, no request slot came free before the deadline "
                f"(max_request_connections={self._requests.total_tokens:g})"
            )
        if scope.cancelled_caught:
            raise _transport_failure(kind, f"{where}: no complete answer before the deadline")
        raise IncompleteSnapshot(f"{path}: not sent, no endpoint accepted a connection")

    async def _call(
        self,
        path: str,
        response: str | Callable[[bytes], Any],
        request: Any,
        *,
        kind: Kind,
        deadline: float,
        stream: bool = False,
    ) -> Any:
        until = self._bound(deadline)
        for attempt in (0, 1):
            await self._ensure_token(until, kind)
            token = self._token
            try:
                answer = await self._send(
                    path, response, request, kind=kind, until=until, stream=stream
                )
            except _Refused as refused:
                status = refused.status
                if attempt == 0 and status.token_expired and self._username is not None:
                    await self._refresh_token(token, until, kind)
                    continue
                raise _failure(kind, refused) from refused.error
            return answer
        raise AssertionError("unreachable")  # pragma: no cover

    async def _authenticate(self, until: float, kind: Kind) -> str:
        assert self._username is not None and self._password is not None
        request = _M["AuthenticateRequest"](
            name=self._username, password=self._password.get_secret_value()
        )
        self.counters.authentications += 1
        path = "/etcdserverpb.Auth/Authenticate"
        try:
            answer = await self._send(
                path, "AuthenticateResponse", request, kind=kind, until=until, auth=False
            )
        except _Refused as refused:
            refused.where += ": authentication refused"
            raise _failure(kind, refused) from refused.error
        if not answer.token:
            raise _transport_failure(kind, f"{self.endpoint}{path}: answered without a token")
        token: str = answer.token
        return token

    # ------------------------------------------------------------------- kv

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
        """One range (see ``EtcdClient.range``)."""
        request = _M["RangeRequest"](
            key=key,
            range_end=range_end or b"",
            limit=limit,
            revision=revision,
            keys_only=keys_only,
            count_only=count_only,
        )
        if newest_first:
            request.sort_order, request.sort_target = _DESCEND, _MOD
        answer: RangeResponse = await self._call(
            _KV + "Range", _range_response, request, kind="read", deadline=deadline
        )
        return answer

    async def put(self, key: bytes, value: bytes, *, lease: int, deadline: float) -> PutResponse:
        request = _M["PutRequest"](key=key, value=value, lease=lease)
        answer = await self._call(
            _KV + "Put", "PutResponse", request, kind="write", deadline=deadline
        )
        return PutResponse(_header(answer))

    async def delete_range(
        self, key: bytes, range_end: bytes | None = None, *, deadline: float
    ) -> DeleteRangeResponse:
        request = _M["DeleteRangeRequest"](key=key, range_end=range_end or b"")
        answer = await self._call(
            _KV + "DeleteRange", "DeleteRangeResponse", request, kind="write", deadline=deadline
        )
        return DeleteRangeResponse(_header(answer), answer.deleted)

    async def delete_if_lease(self, key: bytes, lease: int, *, deadline: float) -> bool:
        """Delete ``key`` only while it is attached to ``lease`` (one transaction)."""
        request = _M["TxnRequest"](
            compare=[_M["Compare"](key=key, target=_LEASE_TARGET, result=_EQUAL, lease=lease)],
            success=[_M["RequestOp"](request_delete_range=_M["DeleteRangeRequest"](key=key))],
        )
        answer = await self._call(
            _KV + "Txn", "TxnResponse", request, kind="write", deadline=deadline
        )
        return TxnResponse(_header(answer), answer.succeeded).succeeded

    # --------------------------------------------------------------- leases

    async def lease_grant(self, ttl: int, *, deadline: float) -> LeaseGrantResponse:
        answer = await self._call(
            _LEASE + "LeaseGrant",
            "LeaseGrantResponse",
            _M["LeaseGrantRequest"](TTL=ttl),
            kind="write",
            deadline=deadline,
        )
        return LeaseGrantResponse(_header(answer), answer.ID, answer.TTL, answer.error)

    async def lease_keepalive(self, lease: int, *, deadline: float) -> int:
        """One keepalive exchange on a ``LeaseKeepAlive`` stream: the
        remaining TTL (0: the lease is gone)."""
        answer = await self._call(
            _LEASE + "LeaseKeepAlive",
            "LeaseKeepAliveResponse",
            _M["LeaseKeepAliveRequest"](ID=lease),
            kind="write",
            deadline=deadline,
            stream=True,
        )
        if answer is grpc.aio.EOF:  # the stream ended without an answer
            raise _transport_failure(
                "write", f"{self.endpoint}{_LEASE}LeaseKeepAlive: no keepalive answer"
            )
        ttl: int = answer.TTL
        return ttl

    async def lease_revoke(self, lease: int, *, deadline: float) -> bool:
        """Revoke ``lease``; False if it was already gone."""
        try:
            await self._call(
                _LEASE + "LeaseRevoke",
                "LeaseRevokeResponse",
                _M["LeaseRevokeRequest"](ID=lease),
                kind="write",
                deadline=deadline,
            )
        except LeaseLost:
            return False
        return True

    async def lease_time_to_live(self, lease: int, *, deadline: float) -> LeaseTimeToLiveResponse:
        answer = await self._call(
            _LEASE + "LeaseTimeToLive",
            "LeaseTimeToLiveResponse",
            _M["LeaseTimeToLiveRequest"](ID=lease),
            kind="read",
            deadline=deadline,
        )
        return LeaseTimeToLiveResponse(_header(answer), answer.ID, answer.TTL, answer.grantedTTL)

    # ----------------------------------------------------------------- misc

    async def status(self, *, deadline: float) -> StatusResponse:
        answer = await self._call(
            "/etcdserverpb.Maintenance/Status",
            "StatusResponse",
            _M["StatusRequest"](),
            kind="read",
            deadline=deadline,
        )
        return StatusResponse(_header(answer), answer.version)

    async def compact(self, revision: int, *, deadline: float) -> None:
        await self._call(
            _KV + "Compact",
            "CompactionResponse",
            _M["CompactionRequest"](revision=revision),
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
    ) -> AsyncIterator[GrpcWatchStream]:
        """Open a ``Watch`` stream from ``start_revision``; yields once
        ``created`` arrived (see ``EtcdClient.watch``: the same create request
        as the gateway path, and a compacted start revision is the first
        batch's ``canceled`` message, not an error)."""
        create = _M["WatchCreateRequest"](
            key=key,
            range_end=range_end,
            start_revision=start_revision,
            progress_notify=progress_notify,
        )
        request = _M["WatchRequest"](create_request=create)
        async with self._established(
            self._open_watch, request, self._bound(open_deadline)
        ) as stream:
            yield stream

    async def _open_watch(
        self, stack: AsyncExitStack, request: Any, until: float
    ) -> tuple[GrpcWatchStream, WatchResponse]:
        path = "/etcdserverpb.Watch/Watch"
        if self._closed:
            raise IncompleteSnapshot(f"{path}: the etcd client is closed")
        self.counters.requests += 1
        with anyio.move_on_at(until) as scope:
            await self._ensure_token(until, "read")
        if scope.cancelled_caught:
            raise IncompleteSnapshot(f"{path}: not authenticated before the deadline")
        for step in range(len(self._targets)):
            index = (self._current + step) % len(self._targets)
            where = f"{self._endpoints[index]}{path}"
            # The channel's task group is entered here, outside any cancel
            # scope of this call: it outlives the call, in the watch's stack.
            attempt = AsyncExitStack()
            async with attempt:
                channel = await attempt.enter_async_context(self._channel(index))
                with anyio.CancelScope(deadline=until) as scope:
                    opened = await self._start_watch(channel, where, request, attempt)
                if scope.cancelled_caught:
                    self.counters.failures += 1
                    raise IncompleteSnapshot(
                        f"{where}: the watch was not established before the deadline"
                    )
                if opened is None:
                    continue
                self._move_to(index)
                self.counters.watch_connections += 1
                attempt.callback(self._watch_closed)
                stack.push_async_callback(attempt.pop_all().aclose)
                return opened
        self.counters.failures += 1
        raise IncompleteSnapshot(f"{path}: no endpoint accepted a connection")

    async def _start_watch(
        self, channel: Channel, where: str, request: Any, stack: AsyncExitStack
    ) -> tuple[GrpcWatchStream, WatchResponse] | None:
        """Send the create request and read the first answer (None: the
        endpoint did not accept a connection)."""
        if not await self._connected(channel):
            return None
        watch = _method(channel, "/etcdserverpb.Watch/Watch", "WatchResponse", stream=True)
        try:
            # A call made under the open deadline would send it as
            # grpc-timeout, and the server would end the watch then:
            # shielded, the stream has no deadline (it lives as long as the
            # watch). A new stream's first small message fits the initial
            # flow-control window, so the write only queues frames for the
            # connection's writer.
            with anyio.CancelScope(shield=True):
                call = watch(metadata=self._metadata(True))
                stack.callback(call.cancel)
                await call.write(request)
        except RpcError as exc:
            self.counters.failures += 1
            raise _failure("read", _Refused(where, _status(exc, (), self._max_bytes), exc)) from exc
        stream = GrpcWatchStream(where, call, self._secrets, self._max_bytes)
        return stream, (await stream.next_batch())[0]

    def _watch_closed(self) -> None:
        self.counters.watch_connections -= 1

    # ---------------------------------------------------------------- close

    async def aclose(self) -> None:
        """Refuse new calls (each call's channel closes with the call). Idempotent."""
        self._closed = True


def _failure(kind: Kind, refused: _Refused) -> ProviderFailure:
    status = refused.status
    if status.code in (1, 2, 13):  # CANCELLED, UNKNOWN, INTERNAL: the call broke
        return _transport_failure(kind, f"{refused.where}: {status}")
    if _over_receive_limit(refused.error):
        return ResponseTooLarge(f"{refused.where}: {status}")
    return _server_failure(kind, refused.where, status)
