"""gRPC calls through discovery: one subchannel per instance, picked per call by poise.

Contract: ``async with discovery_channel(owner, "primary", "orders") as channel:``
gives a channel that generated ``*_pb2_grpc`` stubs accept unchanged (the
four multicallables of :class:`~nadisc.grpc.Channel`). Underneath:

- the shared observation of (connection, service) feeds a route of
  :mod:`nadisc._route` (the connection's balancing policy, outlier ejection,
  zones and subset, the route statistics);
- each call is one pick; the picked instance's subchannel (a
  :class:`~nadisc.grpc.Channel` to its address, opened on its first call)
  takes it. The pick and the hand-over run with no await in between, under
  the observation's currency check: an instance that left the listing, or
  whose evidence is unusable, gets no new call from that moment;
- an instance that left the listing keeps its subchannel for the calls in
  flight for at most ``drain`` seconds; then the subchannel closes and what
  is still running ends as ``UNAVAILABLE``;
- a call the server never saw (REFUSED_STREAM, a stream above a GOAWAY's
  last id, a connection that failed before any byte) goes to another
  instance inside the call's deadline; any other failure is the caller's
  (and, with a :class:`RetryPolicy` for a method marked idempotent, retried
  under gRPC's retry throttling);
- ``first_serving=True`` on a call first asks ``grpc.health.v1`` Check of up
  to 16 candidates at once (see :mod:`nadisc.grpc._first_serving`).

The protocol of an instance comes from exactly one source: the metadata our
registrations of a ``grpc`` listener publish (:mod:`nadisc._grpc_protocol`),
or an explicit :class:`DiscoveryProtocol` for registries without metadata
(DNS, Kubernetes). Both: :class:`GrpcProtocolConflict`; neither:
:class:`GrpcProtocolMissing`.
"""

from __future__ import annotations

import contextlib
import math
import random
import ssl
from collections.abc import AsyncIterable, AsyncIterator, Callable, Generator, Iterable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, cast

import anyio
import anyio.abc
import grpc
import grpc.aio

from poise import CallDeclined, Held, InvalidInput, PoiseError, SelectionError

from .._balancing import RouteBalancing
from .._errors import DiscoveryError, EvidenceUnavailable, LifecycleError
from .._grpc_protocol import GRPC_AUTHORITY_KEY, GRPC_TLS_KEY, GRPC_TLS_MODES
from .._observation import run_clock
from .._retry import Failure, RetryRules, Step, retry_step
from .._route import CALL_FAILURE_KINDS, Attempt, InstanceService, RestOptions, Route
from .._tls import grpc_tls_context
from ._channel import Channel
from ._errors import RpcError
from ._first_serving import first_serving_pick
from ._outcome import Outcome
from ._retry import RetryPolicy, RetryThrottle, retry_delay, should_retry
from ._wire import MetadataLike

if TYPE_CHECKING:
    from .._instance import Instance
    from .._observation import Observation
    from .._owner import DiscoveryOwner

__all__ = [
    "DiscoveryChannel",
    "DiscoveryProtocol",
    "GrpcProtocolConflict",
    "GrpcProtocolError",
    "GrpcProtocolMissing",
    "discovery_channel",
]

#: Statuses that say the instance, not the request, failed: they feed the ejector.
_INSTANCE_FAILURES = frozenset(
    {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }
)


class GrpcProtocolError(DiscoveryError, ValueError):
    """The gRPC protocol of a service's instances is not known, malformed or given twice.

    ``service`` names the (connection, service) it is about.
    """

    def __init__(self, service: str, message: str) -> None:
        super().__init__(f"{service}: {message}")
        self.service = service


class GrpcProtocolConflict(GrpcProtocolError):
    """Instances publish gRPC protocol metadata and a ``DiscoveryProtocol`` was given too."""


class GrpcProtocolMissing(GrpcProtocolError):
    """Instances carry no gRPC protocol metadata and no ``DiscoveryProtocol`` was given."""


@dataclass(frozen=True, slots=True)
class DiscoveryProtocol:
    """How to dial instances whose registry has no metadata (DNS, Kubernetes).

    The port is the instance's. ``authority`` is the ``:authority`` of every
    call (default ``host:port`` of the instance); ``tls`` dials with TLS
    (``ssl_context``, default the library's verifying context).
    """

    authority: str | None = None
    tls: bool = False
    ssl_context: ssl.SSLContext | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.tls, bool):
            raise TypeError(f"DiscoveryProtocol.tls must be a bool, not {type(self.tls).__name__}")
        if self.authority is not None and (not self.authority or "/" in self.authority):
            raise ValueError(f"DiscoveryProtocol.authority {self.authority!r} is not host[:port]")
        if self.ssl_context is not None and not self.tls:
            raise ValueError("DiscoveryProtocol: ssl_context given with tls=False")

    def __repr__(self) -> str:
        return f"DiscoveryProtocol(authority={self.authority!r}, tls={self.tls})"


@dataclass(frozen=True, slots=True)
class _Dial:
    target: str
    authority: str | None
    ssl_context: ssl.SSLContext | None


def dial_for(
    instance: Instance, protocol: DiscoveryProtocol | None, where: str, tls_context: ssl.SSLContext
) -> _Dial:
    """How to reach ``instance`` over gRPC, from its metadata or ``protocol`` (never both)."""
    meta = instance.metadata
    mode = meta.get(GRPC_TLS_KEY)
    host = f"[{instance.host}]" if ":" in instance.host else instance.host
    target = f"{host}:{instance.port}"
    if mode is not None:
        if protocol is not None:
            raise GrpcProtocolConflict(
                where,
                f"instance {instance.identity!r} publishes gRPC protocol metadata "
                f"({GRPC_TLS_KEY}={mode}) and a DiscoveryProtocol was given too; "
                "drop the DiscoveryProtocol for a registry with gRPC metadata",
            )
        if mode not in GRPC_TLS_MODES:
            raise GrpcProtocolError(
                where,
                f"instance {instance.identity!r} has {GRPC_TLS_KEY}={mode!r}; "
                f"expected one of {sorted(GRPC_TLS_MODES)}",
            )
        return _Dial(target, meta.get(GRPC_AUTHORITY_KEY), tls_context if mode == "tls" else None)
    if protocol is None:
        raise GrpcProtocolMissing(
            where,
            f"instance {instance.identity!r} carries no gRPC protocol metadata "
            f"({GRPC_TLS_KEY}); set protocol=DiscoveryProtocol(authority=..., tls=...) "
            "for this service",
        )
    context = None
    if protocol.tls:
        context = protocol.ssl_context or tls_context
    return _Dial(target, protocol.authority, context)


class _Subchannel:
    """The channel of one instance generation, run by a task of the discovery channel."""

    __slots__ = ("active", "callables", "channel", "dial", "idle", "instance", "opened", "stop")

    def __init__(self, instance: Instance, dial: _Dial) -> None:
        self.instance = instance
        self.dial = dial
        self.channel: Channel | None = None
        self.active = 0
        self.idle = anyio.Event()
        self.opened = anyio.Event()
        self.stop = anyio.Event()
        #: (kind, method) -> the channel's multicallable (one per method, made once).
        self.callables: dict[tuple[str, str], Any] = {}

    def enter(self) -> None:
        self.active += 1

    def leave(self) -> None:
        self.active -= 1
        if self.active == 0 and self.stop.is_set():
            self.idle.set()

    def multicallable(self, mc: _DiscoveryMultiCallable) -> Any:
        found = self.callables.get(mc._key)
        if found is None:
            channel = self.channel
            assert channel is not None
            factory = getattr(channel, mc._kind)
            found = self.callables[mc._key] = factory(mc._method, mc._serializer, mc._deserializer)
        return found


class DiscoveryChannel:
    """A gRPC channel for one (connection, service) of a prepared owner; see the module docstring.

    Made by :func:`discovery_channel`; enter it with ``async with``.
    """

    def __init__(
        self,
        owner: DiscoveryOwner,
        qualifier: str | None,
        service: str,
        *,
        protocol: DiscoveryProtocol | None = None,
        drain: float = 5.0,
        retry_policy: RetryPolicy | None = None,
        retry_throttle: RetryThrottle | None = None,
        probe_budget: float = 1.0,
        health_service: str = "",
        channel_options: dict[str, Any] | None = None,
    ) -> None:
        if protocol is not None and not isinstance(protocol, DiscoveryProtocol):
            raise TypeError(f"protocol must be a DiscoveryProtocol, not {type(protocol).__name__}")
        if not (isinstance(drain, int | float) and math.isfinite(drain) and drain >= 0):
            raise ValueError(f"drain must be finite seconds >= 0, not {drain!r}")
        if retry_policy is not None and not isinstance(retry_policy, RetryPolicy):
            raise TypeError(
                f"retry_policy must be a RetryPolicy, not {type(retry_policy).__name__}"
            )
        self._owner = owner
        self._handle = owner.client(qualifier)
        self.qualifier = self._handle.qualifier
        self.service = service
        self._protocol = protocol
        self._drain = float(drain)
        self.retry_policy = retry_policy
        self.retry_throttle = (
            retry_throttle
            if retry_throttle is not None
            else (RetryThrottle() if retry_policy is not None else None)
        )
        if not (isinstance(probe_budget, int | float) and 0 < probe_budget < math.inf):
            raise ValueError(f"probe_budget must be finite seconds > 0, not {probe_budget!r}")
        #: The first-serving probe's budget for a call without a deadline.
        self.probe_budget = float(probe_budget)
        #: The service name the first-serving probe asks ``grpc.health.v1`` about.
        self.health_service = health_service
        self._channel_options = dict(channel_options or {})
        if "transparent_retries" in self._channel_options:
            raise TypeError(
                "transparent_retries is the discovery channel's decision, not a subchannel option"
            )
        self._route: Route | None = None
        self._subs: dict[str, _Subchannel] = {}
        self._tg: anyio.abc.TaskGroup | None = None
        self._clock: Callable[[], float] = anyio.current_time
        self._tls_context: ssl.SSLContext | None = None
        self._closed = False
        self._where = f"connection {self.qualifier!r} service {service!r}"
        #: The rotating start of the first-serving probe.
        self.probe_start = 0
        #: The owner's call counts of this connection (they outlive the channel).
        self.stats = owner.grpc_call_counts(self.qualifier)

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("open" if self._tg is not None else "new")
        return (
            f"<DiscoveryChannel {self.qualifier}/{self.service} "
            f"subchannels={len(self._subs)} {state}>"
        )

    @property
    def route(self) -> Route:
        route = self._route
        if route is None:
            raise LifecycleError(f"{self._where}: the discovery channel is not open")
        return route

    def subchannel_count(self) -> int:
        """How many subchannels are open now (draining ones included)."""
        return len(self._subs)

    # -- lifetime -------------------------------------------------------------------

    async def __aenter__(self) -> Self:
        if self._tg is not None or self._closed:
            raise LifecycleError(f"{self._where}: a discovery channel can be entered once")
        self._clock = run_clock()
        observation = await self._handle.observe(self.service)
        policy = self._owner.connection_policy(self.qualifier)
        route = Route(observation, RestOptions.from_config(policy.rest), self._clock)
        route.balancing = RouteBalancing(policy.balancing)
        self._route = route
        tg = anyio.create_task_group()
        await tg.__aenter__()
        self._tg = tg
        # A handle of its own: waiting for changes here never takes a change
        # from a caller waiting on ``route.observation``.
        follow = await self._handle.observe(self.service)
        tg.start_soon(self._follow, route, follow)
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
        await tg.__aexit__(None, None, None)
        return None

    async def close(self, grace: float | None = None) -> None:
        """Stop taking calls, close every subchannel (at most ``grace`` s each, default 1)."""
        if self._closed:
            return
        self._closed = True
        route = self._route
        if route is not None:
            route.close()
        subs = list(self._subs.values())
        self._subs.clear()
        for sub in subs:
            sub.stop.set()
            sub.idle.set()
            sub.opened.set()  # a call waiting for one still opening: closed
        tg = self._tg
        if tg is not None:
            with (
                anyio.CancelScope(shield=True),
                anyio.move_on_after(1.0 if grace is None else grace),
            ):
                for sub in subs:
                    if sub.channel is not None:
                        await sub.channel.close(0.5)
            tg.cancel_scope.cancel()

    # -- revocation -----------------------------------------------------------------

    async def _follow(self, route: Route, observation: Observation) -> None:
        """Mirror every listing change; drain the subchannels of departed instances."""
        while not self._closed:
            self._reconcile(route)
            try:
                await observation.changed()
            except EvidenceUnavailable:
                # The observation closed (the owner is shutting down): no
                # instance takes a new call; the subchannels drain.
                for identity, sub in list(self._subs.items()):
                    self._retire(identity, sub)
                return

    def _reconcile(self, route: Route) -> None:
        try:
            route.snapshot()
            usable = True
        except EvidenceUnavailable:
            usable = False
        for identity, sub in list(self._subs.items()):
            current = route.current(identity) if usable else None
            if current is None or current != sub.instance:
                self._retire(identity, sub)

    def _retire(self, identity: str, sub: _Subchannel) -> None:
        if self._subs.get(identity) is sub:
            del self._subs[identity]
        if not sub.stop.is_set():
            sub.stop.set()
            if sub.active == 0:
                sub.idle.set()

    async def _run_sub(self, sub: _Subchannel, channel: Channel) -> None:
        async with channel:
            sub.channel = channel
            sub.opened.set()
            await sub.stop.wait()
            # No new call reaches it; the calls in flight get the drain budget.
            with anyio.move_on_after(self._drain):
                await sub.idle.wait()
            # What is still running ends as UNAVAILABLE ("the channel was closed").
            await channel.close(min(self._drain, 1.0))

    async def subchannel(self, instance: Instance) -> _Subchannel:
        """The live subchannel of ``instance`` (opened on its first call).

        The subchannel runs in a task of the discovery channel, not of the
        caller: a caller cancelled while it opens leaves it opening for the
        next call, never half-open in the table.
        """
        identity = instance.identity
        sub = self._subs.get(identity)
        if sub is not None and (sub.instance is instance or sub.instance == instance):
            if sub.channel is None:
                await sub.opened.wait()  # another call is opening it right now
                if sub.channel is None:
                    raise RpcError(
                        grpc.StatusCode.UNAVAILABLE, f"{self._where}: the channel is closed"
                    )
            return sub
        if sub is not None:
            self._retire(identity, sub)
        tg = self._tg
        if tg is None or self._closed:
            raise RpcError(grpc.StatusCode.UNAVAILABLE, f"{self._where}: the channel is closed")
        if self._tls_context is None:
            self._tls_context = grpc_tls_context()
        dial = dial_for(instance, self._protocol, self._where, self._tls_context)
        channel = Channel(
            dial.target,
            ssl_context=dial.ssl_context,
            authority=dial.authority,
            # Never the same host again on its own: the discovery channel
            # moves an unprocessed call to another instance first.
            transparent_retries=0,
            **self._channel_options,
        )
        sub = self._subs[identity] = _Subchannel(instance, dial)
        tg.start_soon(self._run_sub, sub, channel)
        return await self.subchannel(instance)

    # -- the pick --------------------------------------------------------------------

    async def apply_listing(self, deadline: float) -> None:
        """Let the balance apply the mirrored listing (before a call that does not pick)."""
        route = self.route
        if not route.reconciled:
            # An empty or ended listing: the probe finds no candidate and says so.
            with anyio.move_on_at(deadline), contextlib.suppress(SelectionError):
                await route.streaming.ready()

    def hold(self, instance: Instance) -> Held[None]:
        """A load guard on ``instance``'s endpoint for a call sent to it directly.

        Synchronous. Raises ``RpcError(UNAVAILABLE)``, marked unprocessed,
        when the instance is no longer the current one of its identity.
        """
        route = self.route
        identity = instance.identity
        if route.current(identity) is instance:
            try:
                held = route.streaming.balance.hold(identity)
            except InvalidInput:
                pass
            else:
                route.count_sent(identity)
                return held
        error = RpcError(
            grpc.StatusCode.UNAVAILABLE,
            f"{self._where}: instance {identity!r} left the listing after the probe",
            where="discovery",
        )
        error.unprocessed = True
        raise error

    def pick_now(self, attempt: Attempt) -> Held[Any] | None:
        """The fast path of :meth:`pick`, synchronous: the held endpoint ``attempt``
        was admitted to (``attempt.instance`` set), or None for the full path.

        Taken when the balance already applied the mirrored listing and an
        endpoint is ready; the instance's currency check still guards the
        hand-over, with no await between it and the send.
        """
        route = self._route
        if route is None or self._closed or not route.reconciled:
            return None
        balance = route.streaming.balance
        try:
            if not balance.ready_nowait():
                return None
            held = balance.pick_held(attempt)
        except PoiseError:
            return None
        try:
            cast("InstanceService", held.response.service).admit(attempt)
        except CallDeclined:
            held.cancel()  # nothing was sent
            return None
        return held

    async def pick(self, attempt: Attempt, deadline: float) -> Held[Any]:
        """The endpoint poise picks, admitted under the currency check, with its
        load guard open (``attempt.instance`` is the instance to send to).

        Raises ``RpcError(UNAVAILABLE)`` when the evidence is unusable and
        ``RpcError(DEADLINE_EXCEEDED)`` when no instance becomes ready before
        ``deadline``.
        """
        route = self.route
        streaming = route.streaming
        balance = streaming.balance
        while True:
            if self._closed:
                raise RpcError(grpc.StatusCode.UNAVAILABLE, f"{self._where}: the channel is closed")
            if self._clock() >= deadline:
                raise RpcError(
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                    f"{self._where}: no instance was picked before the deadline",
                )
            try:
                route.snapshot()
            except EvidenceUnavailable as exc:
                raise RpcError(
                    grpc.StatusCode.UNAVAILABLE, f"{self._where}: {exc}", where="discovery"
                ) from exc
            try:
                if not (route.reconciled and balance.ready_nowait()):
                    with anyio.move_on_at(deadline):
                        await streaming.ready()
                    if self._clock() >= deadline:
                        continue
                held = balance.pick_held(attempt)
            except SelectionError:
                continue
            try:
                cast("InstanceService", held.response.service).admit(attempt)
            except CallDeclined as exc:
                held.cancel()  # nothing was sent
                cause = exc.__cause__
                if isinstance(cause, EvidenceUnavailable):
                    raise RpcError(
                        grpc.StatusCode.UNAVAILABLE, f"{self._where}: {cause}", where="discovery"
                    ) from cause
                continue
            return held

    def live_subchannel(self, instance: Instance) -> _Subchannel | None:
        """The open subchannel of exactly ``instance``, synchronously (None: see
        :meth:`subchannel`)."""
        sub = self._subs.get(instance.identity)
        if sub is None or sub.instance is not instance or sub.channel is None:
            return None
        return sub

    # -- multicallables (grpc.aio.Channel's shape) ------------------------------------

    def unary_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> DiscoveryUnaryUnary:
        return DiscoveryUnaryUnary(
            self, "unary_unary", method, request_serializer, response_deserializer
        )

    def stream_unary(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> DiscoveryStreamUnary:
        return DiscoveryStreamUnary(
            self, "stream_unary", method, request_serializer, response_deserializer
        )

    def unary_stream(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> DiscoveryUnaryStream:
        return DiscoveryUnaryStream(
            self, "unary_stream", method, request_serializer, response_deserializer
        )

    def stream_stream(
        self,
        method: str,
        request_serializer: Callable[[Any], bytes] | None = None,
        response_deserializer: Callable[[bytes], Any] | None = None,
        _registered_method: bool | None = False,
    ) -> DiscoveryStreamStream:
        return DiscoveryStreamStream(
            self, "stream_stream", method, request_serializer, response_deserializer
        )


class _DiscoveryMultiCallable:
    def __init__(
        self,
        channel: DiscoveryChannel,
        kind: str,
        method: str,
        serializer: Callable[[Any], bytes] | None,
        deserializer: Callable[[bytes], Any] | None,
    ) -> None:
        if not method.startswith("/"):
            raise ValueError(f"gRPC method {method!r} must be a path such as /pkg.Service/Method")
        self._channel = channel
        self._kind = kind
        self._method = method
        self._serializer = serializer
        self._deserializer = deserializer
        self._key = (kind, method)

    def _deadline(self, timeout: float | None) -> float:
        if timeout is not None and not timeout >= 0:
            raise ValueError(f"{self._method}: timeout must be >= 0 seconds, not {timeout!r}")
        # The call's own deadline; the caller's cancel scope bounds it anyway
        # (and each subchannel call sends the earlier of the two as grpc-timeout).
        return math.inf if timeout is None else self._channel._clock() + timeout


class DiscoveryUnaryUnary(_DiscoveryMultiCallable):
    """The unary-unary multicallable of a :class:`DiscoveryChannel`."""

    def __call__(
        self,
        request: Any,
        *,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
        idempotent: bool = False,
        first_serving: bool = False,
    ) -> DiscoveryUnaryCall:
        if credentials is not None:
            raise ValueError(f"{self._method}: per-call credentials are not supported")
        deadline = self._deadline(timeout)
        return DiscoveryUnaryCall(
            self, deadline, (request,), metadata, compression, idempotent, first_serving
        )


class DiscoveryStreamUnary(_DiscoveryMultiCallable):
    """The stream-unary multicallable: one pick per call; never re-sent once started."""

    def __call__(
        self,
        request_iterator: Iterable[Any] | AsyncIterable[Any] | None = None,
        *,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> DiscoveryUnaryCall:
        if request_iterator is None:
            raise ValueError(
                f"{self._method}: a discovery channel needs the request iterator "
                "(write()/done_writing() are not offered)"
            )
        deadline = self._deadline(timeout)
        return DiscoveryUnaryCall(
            self, deadline, (request_iterator,), metadata, compression, False, False
        )


class DiscoveryUnaryCall:
    """A unary-response call through discovery, shaped as ``grpc.aio``'s.

    Sent when first awaited (a call never awaited sends nothing). Awaiting
    it again, or from several tasks at once, gives the same response or
    raises the same error; ``code()``, ``details()`` and the metadata
    accessors wait for the outcome (starting the call if nobody awaited it)
    and describe the attempt that ended it. ``cancel()`` ends it as
    CANCELLED: before it was sent, nothing is sent; in flight, the attempt
    is reset and no other is made.
    """

    __slots__ = ("_args", "_cancelled", "_inner", "_outcome")

    def __init__(self, *args: Any) -> None:
        self._args = args
        self._outcome: Outcome[Any] = Outcome()
        #: The subchannel call of the attempt in flight, then of the last one.
        self._inner: Any = None
        self._cancelled = False

    def __await__(self) -> Generator[Any, None, Any]:
        return self._result().__await__()

    async def _result(self) -> Any:
        return await self._outcome.get(self._send, _abandoned)

    async def _send(self) -> Any:
        return await unary_call(*self._args, handle=self)

    async def _settle(self) -> RpcError | None:
        try:
            await self._result()
        except RpcError as exc:
            return exc
        return None

    async def code(self) -> grpc.StatusCode:
        error = await self._settle()
        return grpc.StatusCode.OK if error is None else error.code()

    async def details(self) -> str:
        error = await self._settle()
        return "" if error is None else error.details() or ""

    async def initial_metadata(self) -> grpc.aio.Metadata:
        return await self._metadata("initial_metadata")

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        return await self._metadata("trailing_metadata")

    async def _metadata(self, which: str) -> grpc.aio.Metadata:
        """The last attempt's metadata (``which`` accessor), else the error's."""
        error = await self._settle()
        source: Any = self._inner
        if source is not None:
            result: grpc.aio.Metadata = await getattr(source, which)()
            return result
        found = getattr(error, which)() if error is not None else None
        return found or grpc.aio.Metadata()

    def cancel(self) -> bool:
        """End the call as CANCELLED; False when it had already ended."""
        outcome = self._outcome
        if outcome.value is not None or self._cancelled:
            return False
        self._cancelled = True
        if not outcome.busy:
            # Never sent: nothing will be.
            outcome.value = RpcError(grpc.StatusCode.CANCELLED, "cancelled by the caller")
        elif self._inner is not None:
            self._inner.cancel()
        return True

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._outcome.value is not None


def _abandoned() -> RpcError:
    return RpcError(grpc.StatusCode.CANCELLED, "the task awaiting the call was cancelled")


async def unary_call(
    mc: _DiscoveryMultiCallable,
    deadline: float,
    args: tuple[Any, ...],
    metadata: MetadataLike | None,
    compression: grpc.Compression | None,
    idempotent: bool,
    first_serving: bool,
    *,
    handle: DiscoveryUnaryCall | None = None,
) -> Any:
    """Pick, send, and on a failure the server never saw, pick another instance.

    ``handle`` (the caller's call object) gets each attempt's subchannel call
    (for its metadata, and for ``cancel()``); once it was cancelled, nothing
    more is sent.

    One coroutine from the caller to the subchannel's call: every resumption
    of the call passes through as few frames as a plain channel's does.
    """
    channel = mc._channel
    clock = channel._clock
    start = clock()
    code = 0  # OK
    try:
        # The instances this call was sent to (made at its first failure).
        tried: set[str] | None = None
        transparent = 0
        attempts = 0
        policy = channel.retry_policy if idempotent else None
        throttle = channel.retry_throttle
        while True:
            if first_serving:
                await channel.apply_listing(deadline)
                instance = await first_serving_pick(channel, deadline)
                # The probe's winner is sent to directly, under a load guard
                # of its own endpoint (as a picked call is).
                held: Held[Any] = channel.hold(instance)
            else:
                attempt = Attempt(avoid=frozenset(tried), skips=len(tried)) if tried else Attempt()
                found = channel.pick_now(attempt)
                held = found if found is not None else await channel.pick(attempt, deadline)
                instance = attempt.instance  # type: ignore[assignment]
            try:
                sub = channel.live_subchannel(instance)
                if sub is None:
                    sub = await channel.subchannel(instance)
                call = sub.callables.get(mc._key) or sub.multicallable(mc)
                if handle is not None and handle._cancelled:
                    # Cancelled while the instance was picked or its
                    # subchannel opened: nothing is sent, nothing is blamed
                    # (the guard ends here; the handler's complete is a no-op).
                    held.cancel()
                    raise RpcError(grpc.StatusCode.CANCELLED, "cancelled by the caller")
                sub.active += 1
                try:
                    inner = call(
                        *args,
                        timeout=None if deadline == math.inf else max(deadline - clock(), 0.0),
                        metadata=metadata,
                        compression=compression,
                    )
                    if handle is not None:
                        handle._inner = inner
                    outcome: Any = await inner
                except RpcError as exc:
                    outcome = exc
                finally:
                    sub.leave()
            except Exception:
                held.complete(failed=True)
                raise
            except BaseException:
                held.cancel()
                raise
            attempts += 1
            if not isinstance(outcome, RpcError):
                held.complete()
                if throttle is not None:
                    throttle.success()
                return outcome
            error = outcome
            if handle is not None and handle._cancelled:
                held.cancel()  # the caller's doing: no evidence about the instance
                raise error
            held.complete(failed=error.code() in _INSTANCE_FAILURES)
            channel.route.count_failure(_FAILURE_STATUS, held.key)
            if tried is None:
                tried = set()
            tried.add(str(held.key))
            now = clock()
            if getattr(error, "unprocessed", False) and now < deadline:
                # The server never saw it: the transport's rule decides (any
                # method, not an attempt of the retry policy, at most one per
                # listed instance), to an instance this round has not tried.
                listed = channel.route.identities()
                untried = any(identity not in tried for identity in listed)
                if not untried and listed:
                    tried.clear()  # every one was tried: a new round, anywhere
                    untried = True
                step = retry_step(
                    _TRANSPARENT_ONLY,
                    Failure.NOTHING_SENT,
                    retryable=False,
                    attempts=attempts,
                    transparent=transparent,
                    listed=len(listed),
                    untried=untried,
                    timed_out=False,
                    now=now,
                    cutoff=deadline,
                    deadline=deadline,
                    withdraw=_no_budget,
                )
                if step is Step.TRANSPARENT:
                    transparent += 1
                    attempts -= 1
                    continue
            if policy is not None:
                pushback = _pushback(error)
                if throttle is not None and (
                    error.code() in policy.retryable_status_codes or pushback is not None
                ):
                    throttle.failure()
                if should_retry(policy, throttle, attempts, error.code(), pushback):
                    delay = retry_delay(policy, attempts, random.random(), pushback)
                    if now + delay < deadline:
                        await anyio.sleep(delay)
                        continue
            raise error
    except RpcError as exc:
        code = exc.code().value[0]
        raise
    except BaseException:
        code = _CANCELLED
        raise
    finally:
        channel.stats.observe(code, clock() - start)


_FAILURE_STATUS = CALL_FAILURE_KINDS.index("status")
#: The transparent half of :func:`nadisc._retry.retry_step`: gRPC's own retry
#: policy (above) takes the place of the transport's attempts and statuses.
_TRANSPARENT_ONLY = RetryRules(
    max_attempts=1, on_connect_failure=True, on_transport_error=False, on_retryable_status=False
)


def _no_budget(now: float) -> bool:
    return False


_CANCELLED: int = grpc.StatusCode.CANCELLED.value[0]


def _pushback(error: RpcError) -> int | None:
    """``grpc-retry-pushback-ms`` of the trailers: None absent, -1 for "do not retry"."""
    for key, value in error.trailing_metadata() or ():
        if key == "grpc-retry-pushback-ms":
            try:
                return int(value)
            except (TypeError, ValueError):
                return -1
    return None


class DiscoveryUnaryStream(_DiscoveryMultiCallable):
    """The unary-stream multicallable: one pick, the stream stays on that instance."""

    def __call__(
        self,
        request: Any,
        *,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> DiscoveryStreamCall:
        if credentials is not None:
            raise ValueError(f"{self._method}: per-call credentials are not supported")
        return DiscoveryStreamCall(self, self._deadline(timeout), (request,), metadata, compression)


class DiscoveryStreamStream(_DiscoveryMultiCallable):
    """The stream-stream multicallable (one pick; never re-sent)."""

    def __call__(
        self,
        request_iterator: Iterable[Any] | AsyncIterable[Any] | None = None,
        *,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> DiscoveryStreamCall:
        if request_iterator is None:
            raise ValueError(
                f"{self._method}: a discovery channel needs the request iterator "
                "(write()/done_writing() are not offered)"
            )
        return DiscoveryStreamCall(
            self, self._deadline(timeout), (request_iterator,), metadata, compression
        )


class DiscoveryStreamCall:
    """A streaming-response call through discovery: ``async for``, ``read()``, ``cancel()``.

    The pick happens on the first read; the instance's load guard stays open
    until the stream ends, so a draining subchannel waits for it.
    """

    def __init__(
        self,
        mc: _DiscoveryMultiCallable,
        deadline: float,
        args: tuple[Any, ...],
        metadata: MetadataLike | None,
        compression: grpc.Compression | None,
    ) -> None:
        self._mc = mc
        self._deadline = deadline
        self._args = args
        self._metadata = metadata
        self._compression = compression
        self._call: Any = None
        self._held: Any = None
        self._sub: _Subchannel | None = None
        self._start = 0.0
        self._ended = False
        #: Set when the task that opens the call is done (another task using
        #: the call at the same time waits for it instead of picking again).
        self._opening: anyio.Event | None = None
        self._open_error: BaseException | None = None

    async def _open(self) -> Any:
        if self._call is not None:
            return self._call
        if self._opening is not None:
            await self._opening.wait()
            if self._call is None:
                error = self._open_error
                if isinstance(error, RpcError):
                    raise error
                raise RpcError(grpc.StatusCode.CANCELLED, "the task opening the call was cancelled")
            return self._call
        self._opening = anyio.Event()
        try:
            return await self._open_once()
        finally:
            self._opening.set()

    async def _open_once(self) -> Any:
        mc = self._mc
        channel = mc._channel
        clock = channel._clock
        self._start = clock()
        try:
            attempt = Attempt()
            held = channel.pick_now(attempt)
            if held is None:
                held = await channel.pick(attempt, self._deadline)
            self._held = held
            instance: Instance = attempt.instance  # type: ignore[assignment]
            sub = channel.live_subchannel(instance)
            if sub is None:
                sub = await channel.subchannel(instance)
            sub.enter()
            self._sub = sub
            deadline = self._deadline
            self._call = sub.multicallable(mc)(
                *self._args,
                timeout=None if deadline == math.inf else max(deadline - clock(), 0.0),
                metadata=self._metadata,
                compression=self._compression,
            )
        except BaseException as exc:
            self._open_error = exc
            self._end(exc)
            raise
        return self._call

    def _end(self, error: BaseException | None) -> None:
        if self._ended:
            return
        self._ended = True
        channel = self._mc._channel
        if isinstance(error, RpcError):
            code = error.code().value[0]
        elif error is None:
            code = 0  # OK
        else:
            code = _CANCELLED
        channel.stats.observe(code, channel._clock() - self._start)
        held = self._held
        if held is not None:
            if isinstance(error, RpcError) and error.code() in _INSTANCE_FAILURES:
                held.complete(failed=True)
            elif error is None or isinstance(error, RpcError):
                held.complete()
            else:
                held.cancel()
        sub = self._sub
        if sub is not None:
            self._sub = None
            sub.leave()

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        response = await self.read()
        if response is grpc.aio.EOF:
            raise StopAsyncIteration
        return response

    async def read(self) -> Any:
        call = await self._open()
        try:
            response = await call.read()
        except BaseException as exc:
            self._end(exc)
            raise
        if response is grpc.aio.EOF:
            self._end(None)
        return response

    async def initial_metadata(self) -> grpc.aio.Metadata:
        call = await self._open()
        result: grpc.aio.Metadata = await call.initial_metadata()
        return result

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        call = await self._open()
        result: grpc.aio.Metadata = await call.trailing_metadata()
        return result

    async def code(self) -> grpc.StatusCode:
        call = await self._open()
        result: grpc.StatusCode = await call.code()
        return result

    def cancel(self) -> bool:
        call = self._call
        cancelled = bool(call.cancel()) if call is not None else False
        self._end(RpcError(grpc.StatusCode.CANCELLED, "cancelled by the caller"))
        return cancelled

    def done(self) -> bool:
        return self._ended

    def __del__(self) -> None:
        if not self._ended and self._held is not None:
            self._held.cancel()


def discovery_channel(
    owner: DiscoveryOwner,
    qualifier: str | None,
    service: str,
    *,
    protocol: DiscoveryProtocol | None = None,
    drain: float = 5.0,
    retry_policy: RetryPolicy | None = None,
    retry_throttle: RetryThrottle | None = None,
    probe_budget: float = 1.0,
    health_service: str = "",
    **channel_options: Any,
) -> DiscoveryChannel:
    """A gRPC channel for ``service`` on connection ``qualifier``; use with ``async with``.

    ``protocol`` names how to dial instances without gRPC metadata (DNS,
    Kubernetes); ``drain`` bounds how long the calls of a departed instance
    may go on; ``retry_policy`` applies to calls made with ``idempotent=True``;
    the other keywords go to each subchannel's :class:`~nadisc.grpc.Channel`.
    """
    return DiscoveryChannel(
        owner,
        qualifier,
        service,
        protocol=protocol,
        drain=drain,
        retry_policy=retry_policy,
        retry_throttle=retry_throttle,
        probe_budget=probe_budget,
        health_service=health_service,
        channel_options=channel_options,
    )
