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
  instance inside the call's deadline (a streaming one too, while no
  response was delivered, no ``write()`` went through and no request was
  taken from an iterator that cannot be replayed); any other failure is the
  caller's (and, with a :class:`RetryPolicy` for a method marked idempotent,
  retried under gRPC's retry throttling);
- an instance whose gRPC protocol metadata cannot be used (an invalid
  ``nadisc-grpc-tls`` or ``nadisc-grpc-authority``, a conflict) is left out
  of the balance when its listing is mirrored: never dialled, never blamed;
- the route statistics count a gRPC attempt as the HTTP transport counts a
  request (:func:`failure_of`): application statuses are successes;
- ``first_serving=True`` on a call first asks ``grpc.health.v1`` Check of up
  to 16 candidates at once (see :mod:`nadisc.grpc._first_serving`);
- an instance ejected while its subchannel had no connection up (it could
  not be reached) is dialled again on gRPC's connection backoff, by a task
  of the channel, and returns as soon as a connection succeeds (see
  :mod:`nadisc.grpc._reconnect`); one ejected for its answers keeps the
  whole ejection.

The protocol of an instance comes from exactly one source: the metadata our
registrations of a ``grpc`` listener publish (:mod:`nadisc._grpc_protocol`),
or an explicit :class:`DiscoveryProtocol` for registries without metadata
(DNS, Kubernetes). Both: :class:`GrpcProtocolConflict`; neither:
:class:`GrpcProtocolMissing`.
"""

from __future__ import annotations

import contextlib
import logging
import math
import random
import re
import ssl
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Generator,
    Iterable,
    Iterator,
    Sequence,
)
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self, cast

import anyio
import anyio.abc
import grpc
import grpc.aio

from poise import CallDeclined, Held, InvalidInput, OutlierEvent, PoiseError, SelectionError

from .._balancing import RouteBalancing
from .._ejection import RouteDetector
from .._errors import DiscoveryError, EvidenceUnavailable, LifecycleError
from .._grpc_protocol import GRPC_AUTHORITY_KEY, GRPC_TLS_KEY, GRPC_TLS_MODES
from .._observation import run_clock
from .._retry import Failure, RetryRules, Step, retry_step
from .._route import (
    NO_ENDPOINT,
    STATUS,
    TIMEOUT,
    TRANSPORT,
    Attempt,
    InstanceService,
    RestOptions,
    Route,
)
from .._tls import grpc_tls_context
from ._channel import Channel
from ._connection import Unprocessed
from ._errors import RpcError
from ._first_serving import first_serving_pick
from ._health import HealthClient, HealthStatus
from ._outcome import Outcome
from ._reconnect import ConnectBackoff, ReconnectSchedule
from ._retry import RetryPolicy, RetryThrottle, retry_delay, should_retry
from ._wire import MetadataLike

if TYPE_CHECKING:
    from .._instance import Instance
    from .._observation import Observation
    from .._owner import DiscoveryOwner

__all__ = [
    "DiscoveryChannel",
    "DiscoveryProtocol",
    "DiscoveryStreamCall",
    "DiscoveryStreamUnaryCall",
    "DiscoveryUnaryCall",
    "GrpcProtocolConflict",
    "GrpcProtocolError",
    "GrpcProtocolMissing",
    "discovery_channel",
]

logger = logging.getLogger(__name__)

#: Statuses that say the instance, not the request, failed: they feed the ejector
#: (and the route statistics count them; see :func:`failure_of`).
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


#: What a registry-supplied ``:authority`` may hold (RFC 3986: unreserved,
#: percent-encoded, sub-delims, ``:@[]``): printable ASCII, never a blank or a line break.
_AUTHORITY = re.compile(r"[A-Za-z0-9._~%!$&'()*+,;=:@\[\]-]+")


def _shown(value: str) -> str:
    """A registry value for an error message: its repr, cut to 60 characters."""
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


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
        authority = meta.get(GRPC_AUTHORITY_KEY)
        if authority is not None and not _AUTHORITY.fullmatch(authority):
            raise GrpcProtocolError(
                where,
                f"instance {instance.identity!r} has an invalid {GRPC_AUTHORITY_KEY} "
                f"({_shown(authority)}): expected host[:port] in printable ASCII "
                "(RFC 3986 characters, no spaces or line breaks)",
            )
        return _Dial(target, authority, tls_context if mode == "tls" else None)
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


class _EligibleBalancing(RouteBalancing):
    """The route's balancing, behind a filter: only instances that can be dialled are mirrored.

    An instance whose gRPC protocol metadata cannot be used (an invalid
    ``nadisc-grpc-tls`` or ``nadisc-grpc-authority``, metadata together with a
    ``DiscoveryProtocol``, neither) never enters the balance: it is never
    picked, so it is never blamed. ``channel.rejected`` keeps why, per identity.
    """

    __slots__ = ("_channel",)

    def __init__(self, channel: DiscoveryChannel, config: Any) -> None:
        super().__init__(config)
        self._channel = channel

    def select(self, instances: Sequence[Instance]) -> Sequence[Instance]:
        channel = self._channel
        channel.prune({instance.identity for instance in instances})
        eligible = [instance for instance in instances if channel.admit_listed(instance)]
        return super().select(eligible if len(eligible) != len(instances) else instances)


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
        reconnect_backoff: ConnectBackoff | None = None,
        reconnect_health: bool = False,
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
        for owned in ("transparent_retries", "ssl_context", "authority"):
            if owned in self._channel_options:
                raise TypeError(
                    f"{owned} is the discovery channel's decision (per instance), "
                    "not a subchannel option"
                )
        # Checked now, by the channel's own checks, rather than when the first
        # subchannel opens (inside a call, as an error of that call).
        Channel("127.0.0.1:1", transparent_retries=0, **self._channel_options)
        self._route: Route | None = None
        self._subs: dict[str, _Subchannel] = {}
        #: identity -> (the instance, how to dial it): decided once per listed value.
        self._dials: dict[str, tuple[Instance, _Dial]] = {}
        #: identity -> (the instance, why it cannot be dialled), for the current listing.
        self.rejected: dict[str, tuple[Instance, GrpcProtocolError]] = {}
        self._logged_general = False
        self._tg: anyio.abc.TaskGroup | None = None
        self._clock: Callable[[], float] = anyio.current_time
        self._tls_context: ssl.SSLContext | None = None
        self._closed = False
        self._where = f"connection {self.qualifier!r} service {service!r}"
        #: The rotating start of the first-serving probe.
        self.probe_start = 0
        #: The owner's call counts of this connection (they outlive the channel).
        self.stats = owner.grpc_call_counts(self.qualifier)
        if reconnect_backoff is not None and not isinstance(reconnect_backoff, ConnectBackoff):
            raise TypeError(
                "reconnect_backoff must be a ConnectBackoff, "
                f"not {type(reconnect_backoff).__name__}"
            )
        if not isinstance(reconnect_health, bool):
            raise TypeError(
                f"reconnect_health must be a bool, not {type(reconnect_health).__name__}"
            )
        #: When the unreachable instances are dialled again (see nadisc.grpc._reconnect).
        self._reconnects = ReconnectSchedule(reconnect_backoff)
        #: Whether a reconnected instance must also answer Check(health_service) SERVING.
        self.reconnect_health = reconnect_health
        #: identity -> the cancel scope of its reconnect task.
        self._reconnect_scopes: dict[str, anyio.CancelScope] = {}

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
        route.balancing = _EligibleBalancing(self, policy.balancing)
        if isinstance(route.detector, RouteDetector):
            route.ejection_log.listener = self._ejection_event
        self._route = route
        # Listed by the owner's observer while open (console, metrics, watch).
        self._owner._grpc_routes[route] = None
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
            self._owner._grpc_routes.pop(route, None)
        subs = list(self._subs.values())
        self._subs.clear()
        # The reconnect attempts end with the task group, at once.
        for identity, scope in list(self._reconnect_scopes.items()):
            scope.cancel()
            self._reconnects.stop(identity)
        self._reconnect_scopes.clear()
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
        dial = self.dial(instance)
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

    # -- reconnecting to an instance that could not be reached ---------------------------

    def reconnecting(self) -> frozenset[str]:
        """The identities ejected as unreachable whose reconnect attempts go on now."""
        return self._reconnects.identities()

    def _ejection_event(self, event: OutlierEvent) -> None:
        """The route's detector ejected or returned an instance (synchronous, never raises).

        An instance ejected while its subchannel has no connection up could
        not be reached: a task of the channel dials it again on the backoff.
        One whose connection is up answered badly: its ejection stands.
        """
        identity = str(event.key)
        scope = self._reconnect_scopes.pop(identity, None)
        if scope is not None:
            scope.cancel()
        self._reconnects.stop(identity)
        tg = self._tg
        route = self._route
        if not event.ejected or tg is None or route is None or self._closed:
            return
        instance = route.current(identity)
        if instance is None:
            return
        sub = self._subs.get(identity)
        if sub is not None and sub.channel is not None and sub.channel.connected:
            return
        self._reconnects.start(identity, self._clock(), random.random())
        scope = self._reconnect_scopes[identity] = anyio.CancelScope()
        tg.start_soon(self._reconnect, identity, instance, scope)

    async def _reconnect(self, identity: str, instance: Instance, scope: anyio.CancelScope) -> None:
        """Dial ``instance`` on the backoff until it connects (then end its ejection)."""
        schedule = self._reconnects
        with scope:
            while (due := schedule.due(identity)) is not None:
                await anyio.sleep_until(due)
                route = self._route
                if route is None or route.current(identity) is not instance:
                    break  # replaced or gone: its ejection ended with it
                began = self._clock()
                if await self._connects(instance, schedule.attempt_timeout(identity)):
                    schedule.stop(identity)
                    detector = route.detector
                    if isinstance(detector, RouteDetector):
                        # The balance's next scan (every pick scans) returns it.
                        detector.reinstate(identity, self._clock())
                    logger.info("gRPC discovery: instance %r reachable again", identity)
                    break
                schedule.failed(identity, began, random.random())
        if self._reconnect_scopes.get(identity) is scope:
            del self._reconnect_scopes[identity]
            schedule.stop(identity)

    async def _connects(self, instance: Instance, timeout: float) -> bool:  # noqa: ASYNC109
        """One attempt: the subchannel's connection up (SETTINGS in) and, when
        configured, Check(health_service) SERVING, within ``timeout``."""
        with anyio.move_on_after(timeout):
            try:
                sub = self.live_subchannel(instance)
                if sub is None:
                    sub = await self.subchannel(instance)
                channel = sub.channel
                if channel is None:
                    return False
                conn = await channel.connection()
                await conn.wait_open()
                if not self.reconnect_health:
                    return True
                status = await HealthClient(channel).check(self.health_service)
                return status is HealthStatus.SERVING
            except (RpcError, Unprocessed):
                return False
            except Exception:
                # Whatever else one dial raises (an OS error, a TLS failure)
                # is a failed attempt: it must not end the channel's tasks.
                logger.debug(
                    "gRPC discovery: reconnect attempt to %r failed",
                    instance.identity,
                    exc_info=True,
                )
                return False
        return False

    # -- eligibility -------------------------------------------------------------------

    def admit_listed(self, instance: Instance) -> bool:
        """Whether ``instance`` of a new listing can be dialled (synchronous).

        Called when a listing is mirrored into the route. Decided once per
        instance value; an instance that cannot be dialled is kept out of the
        balance (never picked, never blamed), its reason in :attr:`rejected`,
        and logged once.
        """
        identity = instance.identity
        known = self._dials.get(identity)
        if known is not None and (known[0] is instance or known[0] == instance):
            return True
        refused = self.rejected.get(identity)
        if refused is not None and (refused[0] is instance or refused[0] == instance):
            return False
        try:
            self.dial(instance)
        except GrpcProtocolError as exc:
            self._dials.pop(identity, None)
            self.rejected[identity] = (instance, exc)
            # A bad value is logged per instance; a missing or conflicting
            # protocol (the channel's configuration) once per channel.
            general = isinstance(exc, GrpcProtocolConflict | GrpcProtocolMissing)
            if not (general and self._logged_general):
                self._logged_general |= general
                logger.warning("gRPC discovery: instance left out of the balance: %s", exc)
            return False
        self.rejected.pop(identity, None)
        return True

    def dial(self, instance: Instance) -> _Dial:
        """How to dial ``instance`` (cached per value); ``GrpcProtocolError`` if it cannot be."""
        identity = instance.identity
        known = self._dials.get(identity)
        if known is not None and (known[0] is instance or known[0] == instance):
            return known[1]
        if self._tls_context is None:
            self._tls_context = grpc_tls_context()
        dial = dial_for(instance, self._protocol, self._where, self._tls_context)
        self._dials[identity] = (instance, dial)
        return dial

    def prune(self, identities: set[str]) -> None:
        """Forget the decisions about instances no longer listed."""
        for table in (self._dials, self.rejected):
            if len(table) > len(identities) or any(key not in identities for key in table):
                for key in [key for key in table if key not in identities]:
                    del table[key]

    def _no_eligible(self, route: Route) -> GrpcProtocolError | None:
        """Why no listed instance can be dialled (None: some can, or none is listed)."""
        if route.identities() or not self.rejected:
            return None
        _instance, error = next(iter(self.rejected.values()))
        # A fresh error per call (the same object raised by many calls would
        # chain their tracebacks), of the same type, with the same message.
        prefix = f"{error.service}: "
        message = str(error)
        return type(error)(error.service, message.removeprefix(prefix))

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
        # One clock reading for the scan, the pick and the currency check
        # (nothing is awaited between them).
        now = route.clock()
        try:
            if not balance.ready_nowait(now):
                return None
            held = balance.pick_held(attempt, now)
        except PoiseError:
            return None
        try:
            cast("InstanceService", held.response.service).admit(attempt, now)
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
            if self.rejected:
                ineligible = self._no_eligible(route)
                if ineligible is not None:
                    raise ineligible
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

    def settle(self, held: Held[Any], attempt: Attempt) -> tuple[Held[Any], Attempt]:
        """Prefer an instance whose connection is up to one still connecting.

        When the instance ``attempt`` was admitted to has a connection being
        made (a hung host that accepted TCP and never sent its SETTINGS stays
        so until ``connect_timeout``), another instance that can be picked at
        once takes the call, and the first pick's guard ends with no
        evidence; else the first pick stands. grpc's pickers likewise give
        calls only to READY subchannels. Synchronous.
        """
        instance = attempt.instance
        assert instance is not None
        sub = self._subs.get(instance.identity)
        if sub is None or sub.channel is None or not sub.channel.connecting:
            return held, attempt
        for _ in range(2):  # a random policy may land on the same one again
            other = Attempt(avoid=attempt.avoid | {str(held.key)}, skips=attempt.skips + 1)
            found = self.pick_now(other)
            if found is None:
                continue
            assert other.instance is not None
            sub = self._subs.get(other.instance.identity)
            if sub is not None and sub.channel is not None and sub.channel.connecting:
                found.cancel()  # connecting too: the first pick stands
                return held, attempt
            held.cancel()  # nothing was sent
            self.route.uncount_sent(instance.identity)
            return found, other
        return held, attempt

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
    """The stream-unary multicallable: one pick per call.

    With a request iterator the call is a :class:`DiscoveryUnaryCall`; without
    one, a :class:`DiscoveryStreamUnaryCall` (``write()``, ``done_writing()``,
    then ``await call``). Either is re-sent only while the server never saw
    it and no request it cannot replay was taken.
    """

    def __call__(
        self,
        request_iterator: Iterable[Any] | AsyncIterable[Any] | None = None,
        *,
        timeout: float | None = None,
        metadata: MetadataLike | None = None,
        credentials: Any = None,
        wait_for_ready: bool | None = None,
        compression: grpc.Compression | None = None,
    ) -> DiscoveryUnaryCall | DiscoveryStreamUnaryCall:
        if credentials is not None:
            raise ValueError(f"{self._method}: per-call credentials are not supported")
        deadline = self._deadline(timeout)
        if request_iterator is None:
            return DiscoveryStreamUnaryCall(
                self, deadline, metadata, compression, requests=None, writable=True
            )
        return DiscoveryUnaryCall(
            self, deadline, (_Requests(request_iterator),), metadata, compression, False, False
        )


class _Status:
    """``code()`` and ``details()`` as ``grpc.aio`` calls have them, from ``_settle``."""

    async def _settle(self) -> RpcError | None:
        raise NotImplementedError

    async def code(self) -> grpc.StatusCode:
        error = await self._settle()
        return grpc.StatusCode.OK if error is None else error.code()

    async def details(self) -> str:
        error = await self._settle()
        return "" if error is None else error.details() or ""


class DiscoveryUnaryCall(_Status):
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
    more is sent. A stream-request call's ``args`` hold a :class:`_Requests`
    (re-sent only while no request was taken from an iterator that cannot be
    replayed).

    One coroutine from the caller to the subchannel's call: every resumption
    of the call passes through as few frames as a plain channel's does.
    """
    channel = mc._channel
    clock = channel._clock
    start = clock()
    code = 0  # OK
    outcome_index = 0  # ok (an index into CALL_OUTCOMES)
    observed = True
    requests = args[0] if type(args[0]) is _Requests else None
    try:
        # The instances this call was sent to (made at its first failure).
        tried: set[str] | None = None
        transparent = 0
        attempts = 0
        policy = channel.retry_policy if idempotent else None
        throttle = channel.retry_throttle
        while True:
            try:
                if first_serving:
                    await channel.apply_listing(deadline)
                    instance = await first_serving_pick(channel, deadline)
                    # The probe's winner is sent to directly, under a load guard
                    # of its own endpoint (as a picked call is).
                    held: Held[Any] = channel.hold(instance)
                else:
                    attempt = (
                        Attempt(avoid=frozenset(tried), skips=len(tried)) if tried else Attempt()
                    )
                    found = channel.pick_now(attempt)
                    held = found if found is not None else await channel.pick(attempt, deadline)
                    held, attempt = channel.settle(held, attempt)
                    instance = attempt.instance  # type: ignore[assignment]
            except Exception:
                if not attempts and not transparent:
                    outcome_index = _NO_ENDPOINT_OUTCOME
                    channel.route.count_failure(NO_ENDPOINT)
                else:
                    outcome_index = _TIMEOUT_OUTCOME if clock() >= deadline else outcome_index
                raise
            inner: Any = None
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
                        *(args if requests is None else (requests.attempt(),)),
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
                # The caller's or the channel's (bad metadata, a closed
                # channel): no evidence about the instance.
                held.cancel()
                raise
            except BaseException:
                held.cancel()
                raise
            attempts += 1
            if not isinstance(outcome, RpcError):
                held.complete()
                outcome_index = 0
                if throttle is not None:
                    throttle.success()
                return outcome
            error = outcome
            if handle is not None and handle._cancelled:
                held.cancel()  # the caller's doing: no evidence about the instance
                observed = False
                raise error
            now = clock()
            kind = failure_of(error, inner, now, deadline)
            held.complete(failed=kind is not None)
            outcome_index = 0 if kind is None else kind + 1
            if kind is not None:
                channel.route.count_failure(kind, held.key)
            if tried is None:
                tried = set()
            tried.add(str(held.key))
            if (
                now < deadline
                and never_seen(inner, error)
                and (requests is None or requests.resendable())
                and may_resend(channel.route, tried, attempts, transparent, now, deadline)
            ):
                # The server never saw it: the transport's rule decides (any
                # method, not an attempt of the retry policy, at most one per
                # listed instance), to an instance this round has not tried.
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
    except Exception:
        code = _CANCELLED  # no status: not the server's (a protocol or caller error)
        raise
    except BaseException:
        code = _CANCELLED
        observed = False  # the caller's cancellation: no outcome of the route
        raise
    finally:
        seconds = clock() - start
        channel.stats.observe(code, seconds)
        route = channel._route
        if observed and route is not None and not (handle is not None and handle._cancelled):
            route.observe_call(outcome_index, seconds)


def may_resend(
    route: Route, tried: set[str], attempts: int, transparent: int, now: float, deadline: float
) -> bool:
    """Whether a call the server never saw goes to another instance now.

    The transport's rule (:func:`nadisc._retry.retry_step`): any method, not
    an attempt of the retry policy, at most one per listed instance, to an
    instance this round has not tried; once every listed one was tried,
    ``tried`` is cleared and a new round may go anywhere.
    """
    listed = route.identities()
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
    return step is Step.TRANSPARENT


def never_seen(inner: Any, error: RpcError) -> bool:
    """Whether the server never saw the subchannel call ``inner`` that ended with ``error``:
    the error says so, or its stream was refused or above a GOAWAY's last stream id."""
    return error.unprocessed or (inner is not None and inner.stream_unprocessed)


def failure_of(error: RpcError, inner: Any, now: float, deadline: float) -> int | None:
    """The route failure kind (an index into ``CALL_FAILURE_KINDS``) of an attempt that
    ended with ``error``, or None when the instance did its job.

    - ``timeout``: DEADLINE_EXCEEDED once the call's own deadline, or the
      caller's cancel scope's, passed (the subchannel's timer, or the server's
      answer to the ``grpc-timeout`` we sent);
    - ``status``: UNAVAILABLE, INTERNAL, UNKNOWN or RESOURCE_EXHAUSTED that the
      server sent as its status (trailers, a trailers-only answer, an HTTP
      status without ``grpc-status``), and DEADLINE_EXCEEDED it sent before
      our deadline (its own, like an HTTP 504);
    - ``transport``: those codes made by the client from what the connection
      or stream did (refused, reset, closed, GOAWAY, REFUSED_STREAM, a broken
      stream or protocol, no keepalive answer);
    - None: any other status (NOT_FOUND, INVALID_ARGUMENT, ... are the
      application's answers), and a request the client refused to send (it
      did not serialize, or was over the send limit).
    """
    code = error.code()
    answered = inner is not None and inner.server_answered
    if code is grpc.StatusCode.DEADLINE_EXCEEDED:
        # Our deadline is the earlier of the call's own and the caller's
        # cancel scope's (both went out as ``grpc-timeout``).
        ours = min(deadline, anyio.current_effective_deadline())
        return STATUS if answered and now < ours else TIMEOUT
    if code not in _INSTANCE_FAILURES or error.where == "send":
        return None
    if answered and not never_seen(inner, error):
        return STATUS
    return TRANSPORT


#: Indexes into ``CALL_OUTCOMES`` (``ok`` is 0, then the failure kinds).
_TIMEOUT_OUTCOME = TIMEOUT + 1
_NO_ENDPOINT_OUTCOME = NO_ENDPOINT + 1
#: The transparent half of :func:`nadisc._retry.retry_step`: gRPC's own retry
#: policy (above) takes the place of the transport's attempts and statuses.
_TRANSPARENT_ONLY = RetryRules(
    max_attempts=1, on_connect_failure=True, on_transport_error=False, on_retryable_status=False
)


class _Requests:
    """The request iterator of a stream-request call, handed to each attempt.

    A list or tuple is replayed whole to every attempt. Any other iterable
    is iterated once, through a view per attempt that notes when a request
    is first asked of it: from then on the call is never re-sent (those
    requests cannot be asked for again), except when the first ask found the
    iterator already ended (nothing was taken). The view of an abandoned
    attempt asks nothing more of the iterator (its sender task may still
    run for a moment), and an async iterator's ``aclose()`` is passed on only
    by the current attempt's view, once something was asked of it.
    """

    __slots__ = ("_async", "_iterator", "asked", "ended_empty", "epoch", "source")

    def __init__(self, source: Iterable[Any] | AsyncIterable[Any]) -> None:
        self.source = source
        self._async = isinstance(source, AsyncIterable)
        self._iterator: Any = None
        #: A request was asked of the caller's iterator (it may be gone).
        self.asked = False
        #: The first ask found the iterator ended: nothing was taken.
        self.ended_empty = False
        #: The number of the current attempt's view.
        self.epoch = 0

    def resendable(self) -> bool:
        """Whether another attempt gets every request this one would have had."""
        return isinstance(self.source, list | tuple) or not self.asked or self.ended_empty

    def attempt(self) -> Iterable[Any] | AsyncIterable[Any]:
        """What the next attempt iterates (the views of earlier ones stop asking)."""
        source = self.source
        if isinstance(source, list | tuple):
            return source
        self.epoch += 1
        if self._async:
            if self._iterator is None:
                self._iterator = cast("AsyncIterable[Any]", source).__aiter__()
            return _AsyncTaking(self, self.epoch)
        if self._iterator is None:
            self._iterator = iter(cast("Iterable[Any]", source))
        return self._taking(self.epoch)

    def _taking(self, epoch: int) -> Iterator[Any]:
        iterator = self._iterator
        first = True
        while self.epoch == epoch:
            self.asked = True
            try:
                item = next(iterator)
            except StopIteration:
                if first:
                    self.ended_empty = True
                return
            first = False
            yield item


class _AsyncTaking:
    """One attempt's view of a caller's async request iterator (see :class:`_Requests`)."""

    __slots__ = ("_epoch", "_first", "_requests")

    def __init__(self, requests: _Requests, epoch: int) -> None:
        self._requests = requests
        self._epoch = epoch
        self._first = True

    def __aiter__(self) -> _AsyncTaking:
        return self

    async def __anext__(self) -> Any:
        requests = self._requests
        if requests.epoch != self._epoch:
            raise StopAsyncIteration  # an abandoned attempt: leave it to the current one
        first, self._first = self._first, False
        requests.asked = True
        try:
            return await requests._iterator.__anext__()
        except StopAsyncIteration:
            if first:
                requests.ended_empty = True
            raise

    async def aclose(self) -> None:
        requests = self._requests
        if requests.epoch == self._epoch and requests.asked and not requests.ended_empty:
            aclose = getattr(requests._iterator, "aclose", None)
            if aclose is not None:
                await aclose()


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
        return DiscoveryStreamCall(
            self, self._deadline(timeout), metadata, compression, request=request
        )


class DiscoveryStreamStream(_DiscoveryMultiCallable):
    """The stream-stream multicallable (one pick; the stream stays on that instance).

    With a request iterator, or without one: then ``write()`` and
    ``done_writing()`` send the requests.
    """

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
        if credentials is not None:
            raise ValueError(f"{self._method}: per-call credentials are not supported")
        deadline = self._deadline(timeout)
        if request_iterator is None:
            return DiscoveryStreamCall(
                self, deadline, metadata, compression, requests=None, writable=True
            )
        return DiscoveryStreamCall(
            self, deadline, metadata, compression, requests=_Requests(request_iterator)
        )


_NO_REQUEST: Any = object()


class _BoundCall(_Status):
    """A call through discovery that is bound to one instance once it opened.

    The pick happens on first use (a read, a write, a metadata or status
    accessor, an await), by whichever task comes first; other tasks wait for
    it. The instance's load guard stays open until the call ends, so a
    draining subchannel waits for it. An attempt the server never saw (a
    refused connection, REFUSED_STREAM, a stream above a GOAWAY's last id)
    goes to another instance under the rule of unary calls
    (:func:`may_resend`, within the deadline), as long as no response was
    delivered, no ``write()`` or ``done_writing()`` went through, and no
    request was taken from an iterator that cannot be replayed.
    """

    def __init__(
        self,
        mc: _DiscoveryMultiCallable,
        deadline: float,
        metadata: MetadataLike | None,
        compression: grpc.Compression | None,
        *,
        request: Any = _NO_REQUEST,
        requests: _Requests | None = None,
        writable: bool = False,
    ) -> None:
        self._mc = mc
        self._deadline = deadline
        self._request = request
        self._requests = requests
        self._writable = writable
        self._metadata = metadata
        self._compression = compression
        #: The subchannel call of the attempt now (None: not opened, or moving on).
        self._call: Any = None
        self._held: Any = None
        self._sub: _Subchannel | None = None
        self._start = 0.0
        self._started = False
        self._ended = False
        self._cancelled = False
        #: Set while a task opens the call (another task waits for it).
        self._opening: anyio.Event | None = None
        self._open_error: BaseException | None = None
        #: Instances this call was sent to; transparent moves so far.
        self._tried: set[str] | None = None
        self._transparent = 0
        #: A response reached the caller / a write() or done_writing() went through.
        self._delivered = False
        self._wrote = False
        #: The route outcome (an index into ``CALL_OUTCOMES``) if the call ends before a status.
        self._outcome = 0

    # -- the attempt -----------------------------------------------------------------

    def _args(self) -> tuple[Any, ...]:
        if self._writable:
            return ()
        if self._requests is not None:
            return (self._requests.attempt(),)
        return (self._request,)

    def _failed(self) -> BaseException:
        error = self._open_error
        if isinstance(error, Exception):
            return error
        if error is None and self._cancelled:
            return RpcError(grpc.StatusCode.CANCELLED, "cancelled by the caller")
        return RpcError(grpc.StatusCode.CANCELLED, "the task opening the call was cancelled")

    async def _open(self) -> Any:
        while True:
            call = self._call
            if call is not None:
                return call
            if self._ended or self._open_error is not None:
                raise self._failed()
            opening = self._opening
            if opening is not None:
                await opening.wait()
                continue
            opening = self._opening = anyio.Event()
            try:
                return await self._open_once()
            finally:
                self._opening = None
                opening.set()

    async def _open_once(self) -> Any:
        mc = self._mc
        channel = mc._channel
        clock = channel._clock
        if not self._started:
            self._started = True
            self._start = clock()
        tried = self._tried
        attempt = Attempt(avoid=frozenset(tried), skips=len(tried)) if tried else Attempt()
        try:
            try:
                held = channel.pick_now(attempt)
                if held is None:
                    held = await channel.pick(attempt, self._deadline)
                held, attempt = channel.settle(held, attempt)
            except Exception:
                if tried is None:
                    self._outcome = _NO_ENDPOINT_OUTCOME
                    channel.route.count_failure(NO_ENDPOINT)
                elif clock() >= self._deadline:
                    self._outcome = _TIMEOUT_OUTCOME
                raise
            if self._ended:  # cancelled while it was picked: nothing was sent
                held.cancel()
                raise self._failed()
            self._held = held
            instance: Instance = attempt.instance  # type: ignore[assignment]
            sub = channel.live_subchannel(instance)
            if sub is None:
                sub = await channel.subchannel(instance)
            if self._ended:
                raise self._failed()
            sub.enter()
            self._sub = sub
            deadline = self._deadline
            self._call = sub.multicallable(mc)(
                *self._args(),
                timeout=None if deadline == math.inf else max(deadline - clock(), 0.0),
                metadata=self._metadata,
                compression=self._compression,
            )
        except BaseException as exc:
            if not self._ended:
                self._open_error = exc
                self._end(exc, None)
            raise
        return self._call

    async def _run(self, op: Callable[[Any], Awaitable[Any]]) -> Any:
        """``op(call)`` on the attempt now; an attempt the server never saw moves on."""
        while True:
            call = await self._open()
            try:
                return await op(call)
            except RpcError as exc:
                if not self._ended:
                    if self._call is not call or self._resend(call, exc):
                        continue  # on another instance (this task's or another's doing)
                    self._end(exc, call)
                raise
            except BaseException as exc:
                if self._call is call:
                    self._end(exc, call)
                raise

    def _resend(self, call: Any, error: RpcError) -> bool:
        """Whether the failed attempt ``call`` moves to another instance (synchronous).

        When it does, the instance is charged as a unary call charges it, and
        the next :meth:`_open` picks again, avoiding the instances tried.
        """
        if self._delivered or self._wrote or self._cancelled:
            return False
        requests = self._requests
        if requests is not None and not requests.resendable():
            return False
        if not never_seen(call, error):
            return False
        channel = self._mc._channel
        now = channel._clock()
        deadline = self._deadline
        if now >= deadline:
            return False
        held = self._held
        tried = self._tried
        if tried is None:
            tried = self._tried = set()
        tried.add(str(held.key))
        if not may_resend(channel.route, tried, 1, self._transparent, now, deadline):
            return False
        self._transparent += 1
        kind = failure_of(error, call, now, deadline)
        held.complete(failed=kind is not None)
        if kind is not None:
            channel.route.count_failure(kind, held.key)
            self._outcome = kind + 1
        self._held = None
        self._call = None
        sub = self._sub
        if sub is not None:
            self._sub = None
            sub.leave()
        return True

    def _end(self, error: BaseException | None, call: Any) -> None:
        if self._ended:
            return
        self._ended = True
        channel = self._mc._channel
        now = channel._clock()
        seconds = now - self._start if self._started else 0.0
        outcome = self._outcome
        observed = not self._cancelled
        if isinstance(error, RpcError):
            code = error.code().value[0]
        elif error is None:
            code = 0  # OK
        else:
            code = _CANCELLED
            observed = isinstance(error, Exception)  # a cancellation is the caller's
        channel.stats.observe(code, seconds)
        held = self._held
        if held is not None:
            if call is None or not observed:
                held.cancel()  # nothing was sent, or the caller's doing: no evidence
            elif isinstance(error, RpcError):
                kind = failure_of(error, call, now, self._deadline)
                held.complete(failed=kind is not None)
                outcome = 0 if kind is None else kind + 1
                if kind is not None:
                    channel.route.count_failure(kind, held.key)
            elif error is None:
                held.complete()
                outcome = 0
            else:
                held.cancel()
        route = channel._route
        if observed and route is not None:
            route.observe_call(outcome, seconds)
        sub = self._sub
        if sub is not None:
            self._sub = None
            sub.leave()

    # -- what grpc.aio calls have ----------------------------------------------------

    async def write(self, request: Any) -> None:
        """Send one request (a stream-request call made without a request iterator)."""
        if not self._writable:
            raise RuntimeError(
                "write() is for stream-request calls made without a request iterator"
            )

        async def write(call: Any) -> bool:
            await call.write(request)
            return self._written(call)

        while not await self._run(write):
            pass  # written to an attempt abandoned meanwhile (never seen): again

    async def done_writing(self) -> None:
        """End the requests (a stream-request call made without a request iterator)."""
        if not self._writable:
            raise RuntimeError(
                "done_writing() is for stream-request calls made without a request iterator"
            )

        async def done_writing(call: Any) -> bool:
            await call.done_writing()
            return self._written(call)

        while not await self._run(done_writing):
            pass

    def _written(self, call: Any) -> bool:
        """After a write to ``call`` went through: True when ``call`` is still the
        attempt (from now on the call is never moved), False when it was
        abandoned meanwhile (the server never saw it: write to the next one)."""
        if self._call is call or self._ended:
            self._wrote = True
            return True
        return False

    async def _finish(self) -> None:
        """Until the call has its status (raises its error)."""
        raise NotImplementedError

    async def _settle(self) -> RpcError | None:
        try:
            await self._finish()
        except RpcError as exc:
            return exc
        return None

    async def trailing_metadata(self) -> grpc.aio.Metadata:
        error = await self._settle()
        call = self._call
        if call is not None:
            result: grpc.aio.Metadata = await call.trailing_metadata()
            return result
        found = error.trailing_metadata() if error is not None else None
        return found or grpc.aio.Metadata()

    def cancel(self) -> bool:
        """End the call as CANCELLED; False when it had already ended."""
        if self._ended:
            return False
        self._cancelled = True
        call = self._call
        if call is not None:
            call.cancel()
        self._end(RpcError(grpc.StatusCode.CANCELLED, "cancelled by the caller"), call)
        return True

    def cancelled(self) -> bool:
        return self._cancelled

    def done(self) -> bool:
        return self._ended

    def __del__(self) -> None:
        if not self.__dict__.get("_ended", True) and self._held is not None:
            self._held.cancel()


class DiscoveryStreamCall(_BoundCall):
    """A streaming-response call through discovery (unary-stream, stream-stream).

    ``async for``, ``read()`` (``grpc.aio.EOF`` at the end), ``write()`` and
    ``done_writing()`` (stream-stream made without a request iterator),
    ``initial_metadata()``, ``trailing_metadata()``, ``code()``,
    ``details()``, ``wait_for_connection()``, ``cancel()``, ``done()``, as
    the plain channel's call. See :class:`_BoundCall` for the pick and when
    it moves to another instance.
    """

    def __aiter__(self) -> AsyncIterator[Any]:
        return self

    async def __anext__(self) -> Any:
        response = await self.read()
        if response is grpc.aio.EOF:
            raise StopAsyncIteration
        return response

    async def read(self) -> Any:
        call = self._call
        if call is not None and self._delivered:
            # Bound for good: straight to the subchannel's call.
            try:
                response = await call.read()
            except BaseException as exc:
                self._end(exc, call)
                raise
        else:
            response = await self._run(_read)
            call = self._call
        if response is grpc.aio.EOF:
            self._end(None, call)
        else:
            self._delivered = True
        return response

    async def _finish(self) -> None:
        while await self.read() is not grpc.aio.EOF:
            pass

    async def wait_for_connection(self) -> None:
        """Until the server answered with response headers (the call's error if it ended)."""
        await self._run(_connected)

    async def initial_metadata(self) -> grpc.aio.Metadata:
        # As grpc.aio: a call that ended without response headers has none
        # (its error is for the reader and code()).
        with contextlib.suppress(RpcError):
            await self._run(_connected)
        call = self._call
        if call is None:
            return grpc.aio.Metadata()
        result: grpc.aio.Metadata = await call.initial_metadata()
        return result


class DiscoveryStreamUnaryCall(_BoundCall):
    """A stream-unary call made without a request iterator: ``write()``,
    ``done_writing()``, then ``await call`` for the response (the same one
    every time). The metadata and status accessors wait for the outcome.
    See :class:`_BoundCall` for the pick and when it moves to another instance.
    """

    def __await__(self) -> Generator[Any, None, Any]:
        return self._response().__await__()

    async def _response(self) -> Any:
        response = await self._run(_awaited)
        self._end(None, self._call)
        return response

    async def _finish(self) -> None:
        await self._response()

    async def initial_metadata(self) -> grpc.aio.Metadata:
        await self._settle()
        call = self._call
        if call is None:
            return grpc.aio.Metadata()
        result: grpc.aio.Metadata = await call.initial_metadata()
        return result


def _read(call: Any) -> Awaitable[Any]:
    return cast("Awaitable[Any]", call.read())


def _connected(call: Any) -> Awaitable[Any]:
    return cast("Awaitable[Any]", call.wait_for_connection())


async def _awaited(call: Any) -> Any:
    return await call


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
    reconnect_backoff: ConnectBackoff | None = None,
    reconnect_health: bool = False,
    **channel_options: Any,
) -> DiscoveryChannel:
    """A gRPC channel for ``service`` on connection ``qualifier``; use with ``async with``.

    ``protocol`` names how to dial instances without gRPC metadata (DNS,
    Kubernetes); ``drain`` bounds how long the calls of a departed instance
    may go on; ``retry_policy`` applies to calls made with ``idempotent=True``;
    ``reconnect_backoff`` (default gRPC's: 1 s, x1.6, +/-20 %, 120 s) paces
    the reconnect attempts to an instance ejected because it could not be
    reached, and ``reconnect_health=True`` makes such an instance return only
    once ``grpc.health.v1`` Check of ``health_service`` answers SERVING;
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
        reconnect_backoff=reconnect_backoff,
        reconnect_health=reconnect_health,
    )
