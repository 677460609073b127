"""The calling pipeline of one (connection, service): observation → directory → balance.

::

    Observation (shared slot, evidence rules)
        │  snapshot() before every attempt; revision unchanged -> O(1), nothing to do
        ▼
    Route.sync()        identity -> Instance; upsert only when the value changed,
        │               remove what the listing dropped (a poise Directory)
        ▼  latest-only SnapshotStream
    StreamingDiscoveryBalance   reconciles on ready(): retained endpoints keep
        │                       their load and quarantine; a changed instance is a
        │                       new generation; removed ones finish their calls
        ▼
    InstanceService.admit(attempt), then the send
        │  the evidence check (Route.check_usable) and the currency check:
        │  the chosen instance must still be in the current evidence; the
        │  request is built after them and handed to the HTTP pool with no
        │  await in between. A
        │  revoked or replaced instance declines the call (poise.CallDeclined:
        │  guard cancelled, nothing sent) and the caller picks again.
        ▼
    one shared httpx transport (one connection pool for every instance)

No task is started: the directory is brought up to date lazily, from the
request path, whenever the observation's revision moved. The observation's
own refresh task (in the owner's task group) is the only background work.

:class:`RestOptions` holds the per-connection calling settings (the seed's
``rest`` block, in seconds).

Cost per attempt on a stable listing (:attr:`Route.reconciled`): one
readiness scan, one policy pick and one evidence check
(:meth:`Route.check_usable`: a clock read and two comparisons while the
evidence records no event and its usable-until instant has not passed);
after a change, one evidence view (``snapshot()``) and the reconcile step.
No allocation proportional to the listing.

Counting: every request handed to the pool adds one to its identity's
``sent`` count; failures (:data:`CALL_FAILURE_KINDS`) add one to an int of
:attr:`Route.failures` (and to the instance's count), on the failure paths
only: a call that succeeds pays one status comparison for them.
"""

from __future__ import annotations

import enum
import math
from bisect import bisect_left
from collections.abc import Awaitable, Callable, Hashable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeVar

import anyio
import httpx
from msgspec.structs import replace as _replace

from poise import (
    Backend,
    CallDeclined,
    Directory,
    DiscoveryBalance,
    GenerationTracker,
    InFlight,
    LoadTracker,
    PeakEwma,
    Policy,
    PowerOfTwoChoices,
    RoundRobin,
    ServiceFn,
    StreamingDiscoveryBalance,
    WeightedRoundRobin,
)

from ._balancing import RouteBalancing
from ._config import RestConfig
from ._ejection import EjectionLog, EjectionOptions
from ._errors import CallError, ConfigError, EvidenceUnavailable
from ._evidence import Evidence
from ._instance import Instance
from ._observation import Observation, ObservationSnapshot

__all__ = [
    "CALL_FAILURE_KINDS",
    "CALL_LATENCY_BUCKETS",
    "CALL_OUTCOMES",
    "LB_STRATEGIES",
    "SCHEME_METADATA",
    "SECURE_METADATA",
    "Attempt",
    "CallFailureKind",
    "InstanceSchemeMismatch",
    "InstanceService",
    "RestOptions",
    "Route",
    "RouteStatistics",
    "declared_scheme",
    "failure_kind",
]

LbStrategy = Literal["round_robin", "weighted", "p2c_peak_ewma"]
InstanceScheme = Literal["http", "https"]

#: The balancing strategies a connection's ``rest.lb_strategy`` may name.
LB_STRATEGIES: tuple[str, ...] = ("round_robin", "weighted", "p2c_peak_ewma")
_SCHEMES: tuple[str, ...] = ("http", "https")
MAX_ATTEMPTS = 16
T = TypeVar("T")

#: Instance metadata key: the scheme the instance serves (``http`` or ``https``).
SCHEME_METADATA = "scheme"
#: Instance metadata key read when ``scheme`` is absent: ``true`` (https) or ``false`` (http).
SECURE_METADATA = "secure"
_SECURE_VALUES = {"true": "https", "false": "http"}


class CallFailureKind(enum.Enum):
    """The closed set of failures a calling route counts (:attr:`RouteStatistics.failures`).

    ``TRANSPORT``, ``TIMEOUT``, ``STATUS`` and ``OTHER`` are attempts that were
    handed to the HTTP pool (each is also one of the route's ``sent``
    requests); ``NO_ENDPOINT`` is a call that reached no instance at all.
    A call its caller cancelled, and a pick declined before anything was
    sent (the call picks again), count as no failure.
    """

    #: The pool raised a transport error: connect refused, reset, protocol
    #: error; while sending, or while the body was read.
    TRANSPORT = "transport"
    #: A phase limit of the httpx timeout, or the call's budget, ran out while
    #: the attempt was with the pool; or its headers came after the budget.
    TIMEOUT = "timeout"
    #: The instance answered with a 5xx status (what the load guard counts as
    #: failed), counted when the headers arrive.
    STATUS = "status"
    #: The call ended before any instance was tried: evidence unusable, no
    #: ready endpoint within the budget, every instance declares another scheme.
    NO_ENDPOINT = "no_endpoint"
    #: The pool raised something that is not an httpx error.
    OTHER = "other"


#: The kinds' values, in declaration order (the order of ``Route.failures``).
CALL_FAILURE_KINDS: tuple[str, ...] = tuple(kind.value for kind in CallFailureKind)
# Indexes into Route.failures (a list: a failure path adds one to an int).
TRANSPORT, TIMEOUT, STATUS, NO_ENDPOINT, OTHER = range(len(CALL_FAILURE_KINDS))


#: Upper bounds (seconds) of the routed-call latency histogram, 1 ms to 30 s.
CALL_LATENCY_BUCKETS: tuple[float, ...] = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
)  # fmt: skip
#: Outcome of a whole call (all its attempts): ``ok`` (a response below 500)
#: or the :data:`CALL_FAILURE_KINDS` value that ended it.
CALL_OUTCOMES: tuple[str, ...] = ("ok", *CALL_FAILURE_KINDS)


def call_outcome(error: BaseException | None, status: int = 200) -> int:
    """The index into :data:`CALL_OUTCOMES` of a call that returned a
    response with ``status`` (``error`` None) or raised ``error``."""
    if error is None:
        return STATUS + 1 if status >= 500 else 0
    from ._errors import CallEvidenceUnavailable, CallTimeout

    if isinstance(error, CallTimeout):
        return TIMEOUT + 1
    if isinstance(error, CallEvidenceUnavailable | EvidenceUnavailable):
        return NO_ENDPOINT + 1
    return failure_kind(error) + 1


def failure_kind(error: BaseException) -> int:
    """The failure kind (an index into :data:`CALL_FAILURE_KINDS`) of an attempt's error."""
    if isinstance(error, httpx.TimeoutException):
        return TIMEOUT
    if isinstance(error, httpx.TransportError):
        return TRANSPORT
    return OTHER


class InstanceSchemeMismatch(CallError, ValueError):
    """An instance declares a scheme other than the connection's ``rest.instance_scheme``.

    Raised before anything is sent to the instance (also an
    ``httpx.RequestError``, like every failure of a call). ``declared`` is what its
    metadata says (normalised), ``configured`` the connection's scheme.
    """

    def __init__(self, identity: str, declared: str, configured: str) -> None:
        super().__init__(
            f"instance {identity!r} declares scheme {declared!r} in its metadata, but the "
            f"connection calls instances over {configured!r} (rest.instance_scheme)"
        )
        self.identity = identity
        self.declared = declared
        self.configured = configured


def declared_scheme(instance: Instance) -> str | None:
    """The scheme ``instance`` declares in its metadata, or None when it declares none.

    ``metadata["scheme"]`` wins (case-insensitive, surrounding blanks
    ignored); otherwise ``metadata["secure"]`` = ``true`` means ``https`` and
    ``false`` means ``http``. Any other value is returned as declared
    (``"secure=maybe"`` for an unreadable ``secure``), so that it never
    matches a configured scheme.
    """
    metadata = instance.metadata
    scheme = metadata.get(SCHEME_METADATA)
    if scheme is not None:
        return scheme.strip().lower()
    secure = metadata.get(SECURE_METADATA)
    if secure is not None:
        return _SECURE_VALUES.get(secure.strip().lower(), f"{SECURE_METADATA}={secure}")
    return None


def _seconds(path: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ConfigError(path, f"must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if not math.isfinite(seconds) or seconds <= 0:
        raise ConfigError(path, f"must be a finite number of seconds > 0, got {value!r}")
    return seconds


#: The default ejection rules (``rest.outlier`` defaults).
DEFAULT_EJECTION = EjectionOptions()


@dataclass(frozen=True, slots=True)
class RestOptions:
    """How calls through discovery are made on one connection. Frozen, validated.

    The defaults are the seed's ``rest`` defaults: a total budget of 10 s per
    call (all attempts, discovery wait and response headers included), 2 s to
    connect, round robin, plain ``http`` to instances, one attempt. Retries
    happen only for ``GET`` and ``HEAD``, only when switched on, and only
    within ``max_attempts`` (1-16) and the one budget. Two exceptions, both
    inside the budget: a connection that failed before anything was sent
    (connect refused or timed out) is retried on another instance for any
    method and is not one of the ``max_attempts``
    (``retry_on_connect_failure``, on by default; at most once per listed
    instance), and a GET/HEAD whose ``attempt_timeout`` ran out is retried
    while ``max_attempts`` allow.

    ``ejection`` (on by default, see :mod:`nadisc._ejection`) keeps an
    instance whose attempts keep failing out of the balance for a while.

    ``instance_scheme`` is used towards every instance; an instance whose
    metadata declares another scheme (``scheme``, or ``secure``; see
    :func:`declared_scheme`) fails the attempt with
    :class:`InstanceSchemeMismatch` before anything is sent.

    ``strict_evidence`` makes every attempt refuse evidence as soon as a
    refresh failed (the observation's strict read); by default the
    observation's own grace rules apply and nothing is added on top.

    Bad values raise :class:`~nadisc.ConfigError` naming the field
    (``rest.max_attempts``), before anything is sent.
    """

    request_timeout: float = 10.0
    connect_timeout: float = 2.0
    lb_strategy: LbStrategy = "round_robin"
    instance_scheme: InstanceScheme = "http"
    max_attempts: int = 1
    retry_get_head_on_transport_error: bool = False
    retry_get_head_on_retryable_status: bool = False
    strict_evidence: bool = False
    #: Budget of one attempt up to its response headers (None: the call's budget).
    attempt_timeout: float | None = None
    #: Retry, for any method, a connection that failed before anything was sent.
    retry_on_connect_failure: bool = True
    #: Passive outlier ejection rules (None: off).
    ejection: EjectionOptions | None = DEFAULT_EJECTION

    def __post_init__(self) -> None:
        request = _seconds("rest.request_timeout", self.request_timeout)
        connect = _seconds("rest.connect_timeout", self.connect_timeout)
        if connect >= request:
            raise ConfigError(
                "rest.connect_timeout",
                f"a budget of {request:g} s cannot fit a connect timeout of {connect:g} s",
            )
        if self.attempt_timeout is not None:
            attempt = _seconds("rest.attempt_timeout", self.attempt_timeout)
            if attempt > request:
                raise ConfigError(
                    "rest.attempt_timeout",
                    f"an attempt timeout of {attempt:g} s exceeds the budget of {request:g} s",
                )
            object.__setattr__(self, "attempt_timeout", attempt)
        if self.ejection is not None and not isinstance(self.ejection, EjectionOptions):
            kind = type(self.ejection).__name__
            raise ConfigError("rest.outlier", f"must be EjectionOptions or None, got {kind}")
        if self.lb_strategy not in LB_STRATEGIES:
            raise ConfigError(
                "rest.lb_strategy",
                f"unknown strategy {self.lb_strategy!r} (one of: {', '.join(LB_STRATEGIES)})",
            )
        if self.instance_scheme not in _SCHEMES:
            raise ConfigError(
                "rest.instance_scheme",
                f"unsupported instance scheme {self.instance_scheme!r} (http or https)",
            )
        attempts = self.max_attempts
        if isinstance(attempts, bool) or not isinstance(attempts, int):
            raise ConfigError("rest.max_attempts", f"must be an integer, got {attempts!r}")
        if not 1 <= attempts <= MAX_ATTEMPTS:
            raise ConfigError(
                "rest.max_attempts", f"must be between 1 and {MAX_ATTEMPTS}, got {attempts}"
            )
        for name in (
            "retry_get_head_on_transport_error",
            "retry_get_head_on_retryable_status",
            "strict_evidence",
            "retry_on_connect_failure",
        ):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"rest.{name}", "must be true or false")
        object.__setattr__(self, "request_timeout", request)
        object.__setattr__(self, "connect_timeout", connect)

    @classmethod
    def from_config(cls, config: RestConfig) -> RestOptions:
        """The options of a connection's ``rest`` block (milliseconds -> seconds)."""
        return cls(
            request_timeout=config.request_timeout_ms / 1000.0,
            connect_timeout=config.connect_timeout_ms / 1000.0,
            lb_strategy=config.lb_strategy,
            instance_scheme=config.instance_scheme,
            max_attempts=config.max_attempts,
            retry_get_head_on_transport_error=config.retry_get_head_on_transport_error,
            retry_get_head_on_retryable_status=config.retry_get_head_on_retryable_status,
            attempt_timeout=config.attempt_timeout_ms / 1000.0 or None,
            retry_on_connect_failure=config.retry_on_connect_failure,
            ejection=EjectionOptions.from_config(config.outlier),
        )


@dataclass(slots=True)
class Attempt:
    """One attempt of one request, as handed to the balance.

    Give either ``build`` and ``pool`` (the transport's form: the request
    for the chosen instance is built synchronously and handed to the pool)
    or ``send`` (any async sender, called with the chosen instance).
    """

    #: Starts the call to the chosen instance and returns its awaitable.
    send: Callable[[Instance], Awaitable[httpx.Response]] | None = None
    #: Builds the request for the chosen instance (synchronous, no I/O).
    build: Callable[[Instance], httpx.Request] | None = None
    #: The shared connection pool a built request is handed to.
    pool: httpx.AsyncBaseTransport | None = None
    #: Keys tried by earlier attempts: skipped while another endpoint exists.
    avoid: frozenset[Hashable] = frozenset()
    #: How many more avoided endpoints may be skipped before one is accepted.
    skips: int = 0
    #: Filled in by the service that took the attempt.
    instance: Instance | None = None
    #: The attempt's end (event-loop time) enforced as a scope around the send;
    #: past it the attempt fails with ``httpx.ReadTimeout`` (None: no scope).
    cutoff: float | None = None
    #: Keys this call has sent to, shared by a call's hedges (None: not recorded):
    #: the service adds its key before the send, so a hedge started while
    #: this attempt waits can avoid its instance.
    sent: set[str] | None = None


@dataclass(frozen=True, slots=True)
class RouteStatistics:
    """A point-in-time view of one route."""

    connection: str
    service: str
    #: The observation revision mirrored into the directory (-1: none yet).
    revision: int
    #: Identity -> calls of the live generation not yet finished (bodies included).
    in_flight: Mapping[str, int]
    #: Identity -> requests handed to the pool for that instance (all generations).
    sent: Mapping[str, int]
    #: Failure kind (every one of :data:`CALL_FAILURE_KINDS`) -> count since the route opened.
    failures: Mapping[str, int] = field(default_factory=dict)
    #: Identity -> failed attempts of that instance (kinds other than ``no_endpoint``).
    failed: Mapping[str, int] = field(default_factory=dict)
    #: Identity -> end of its ejection (event-loop time) for the instances ejected now.
    ejected: Mapping[str, float] = field(default_factory=dict)
    #: Ejections since the route opened (0 when ejection is off).
    ejections: int = 0
    #: Per :data:`CALL_OUTCOMES` value: (calls per :data:`CALL_LATENCY_BUCKETS`
    #: bound plus one over the last, sum of seconds). Whole calls, as the
    #: caller saw them (to the response headers, or the error).
    latency: Mapping[str, tuple[tuple[int, ...], float]] = field(default_factory=dict)


class InstanceService:
    """The lightweight service of one instance generation: always ready, no state.

    ``call(attempt)`` re-checks the instance against the current evidence
    and hands the request to the shared pool, with no await in between.
    """

    __slots__ = ("instance", "key", "mismatch", "route")

    def __init__(self, route: Route, instance: Instance) -> None:
        self.route = route
        self.instance = instance
        self.key = instance.identity
        # Decided once per generation (an instance value never changes).
        declared = declared_scheme(instance)
        configured = route.options.instance_scheme
        self.mismatch: InstanceSchemeMismatch | None = (
            None
            if declared is None or declared == configured
            else InstanceSchemeMismatch(instance.identity, declared, configured)
        )

    # Always ready and reserving nothing: poise's own always-ready readiness,
    # which lets the balance keep the endpoint READY across calls instead of
    # polling it again after each pick.
    poll_ready = ServiceFn.poll_ready

    def admit(self, attempt: Attempt, now: float | None = None) -> Instance:
        """The checks of :meth:`call` before anything is sent, synchronous: the
        instance ``attempt`` may go to now (counted as sent to it), or
        :class:`~poise.CallDeclined` as :meth:`call` raises it. For a caller
        that sends the attempt itself (the gRPC discovery channel). ``now``:
        a reading of the route's clock taken with nothing awaited since."""
        key = self.key
        if attempt.skips > 0 and key in attempt.avoid:
            attempt.skips -= 1
            raise CallDeclined(f"instance {key!r} was already tried by this call")
        mismatch = self.mismatch
        if mismatch is not None:
            raise CallDeclined(f"instance {key!r} does not speak the configured scheme") from (
                mismatch
            )
        route = self.route
        instance = self.instance
        # submit_if_current, spelled out: the evidence check, the currency
        # check and the hand-over to the pool run with no await in between
        # (and no closure to build and vet per call).
        try:
            route.check_usable(now)
        except EvidenceUnavailable as exc:
            raise CallDeclined(f"the evidence is unusable ({exc.reason})") from exc
        current = route._instances.get(key)
        if current is None or current.draining:
            raise CallDeclined(f"instance {key!r} left the evidence after it was selected")
        if current is not instance:
            raise CallDeclined(f"instance {key!r} changed after it was selected")
        attempt.instance = instance
        route.count_sent(key)
        sent = attempt.sent
        if sent is not None:
            sent.add(key)
        return instance

    async def call(self, attempt: Attempt) -> httpx.Response:
        """Send ``attempt`` to this instance, or decline it without sending anything.

        Raises :class:`~poise.CallDeclined` when the attempt skips an instance
        it already tried, when the instance left the current evidence since
        it was selected, and when the evidence is no longer usable (then
        chained from the :class:`~nadisc.EvidenceUnavailable`), and when the
        instance declares a scheme other than the connection's (then chained
        from the :class:`InstanceSchemeMismatch`). The balance cancels the
        load guard of a declined call: nothing reached the wire.
        """
        instance = self.admit(attempt)
        build = attempt.build
        if build is not None:
            pool = attempt.pool
            if pool is None:
                raise TypeError("an Attempt with build= needs pool=")
            request = build(instance)
            if attempt.cutoff is None:
                return await pool.handle_async_request(request)
            with anyio.move_on_at(attempt.cutoff):
                return await pool.handle_async_request(request)
            raise httpx.ReadTimeout("no response within the attempt timeout", request=request)
        send = attempt.send
        if send is None:
            raise TypeError("an Attempt needs send= or build= with pool=")
        if attempt.cutoff is None:
            return await send(instance)
        with anyio.move_on_at(attempt.cutoff):
            return await send(instance)
        raise httpx.ReadTimeout("no response within the attempt timeout")

    def __repr__(self) -> str:
        return f"<InstanceService {self.key!r} {self.instance.address}>"


def _policy(strategy: str) -> tuple[Policy[None], Callable[[], LoadTracker]]:
    if strategy == "weighted":
        return WeightedRoundRobin(), InFlight
    if strategy == "p2c_peak_ewma":
        return PowerOfTwoChoices(), PeakEwma
    return RoundRobin(), InFlight


class Route:
    """The pipeline of one (connection, service): see the module docstring.

    Created by the transport on first use; holds its :class:`Observation`
    (which keeps the shared slot alive) until :meth:`close`.
    """

    __slots__ = (
        "_checked",
        "_closed",
        "_directory",
        "_discovery",
        "_evidence",
        "_failed",
        "_instances",
        "_sent",
        "_streaming",
        "_strict",
        "_submit",
        "_synced",
        "_tracker",
        "_until",
        "balancing",
        "clock",
        "detector",
        "ejection_log",
        "failures",
        "latency",
        "latency_sum",
        "observation",
        "options",
    )

    def __init__(
        self,
        observation: Observation,
        options: RestOptions,
        clock: Callable[[], float] | None = None,
    ) -> None:
        self.observation = observation
        self.options = options
        #: The event loop's clock (the transport passes the loop's own, cheaper one).
        self.clock: Callable[[], float] = anyio.current_time if clock is None else clock
        self._strict = options.strict_evidence
        # The evidence check of the hand-over, cached (see check_usable): the
        # evidence's version when it last passed, and the instant from which
        # time alone refuses it.
        slot = getattr(observation, "_slot", None)
        self._evidence: Evidence | None = getattr(slot, "evidence", None)
        self._checked = -1
        self._until = -math.inf
        self._submit = (
            observation.submit_if_current_strict
            if options.strict_evidence
            else observation.submit_if_current
        )
        policy, self._tracker = _policy(options.lb_strategy)
        self._directory = Directory()
        self._instances: dict[str, Instance] = {}
        self._sent: dict[str, int] = {}
        #: Failures by kind, indexed as :data:`CALL_FAILURE_KINDS` (touched on failure paths only).
        self.failures = [0] * len(CALL_FAILURE_KINDS)
        #: Calls per outcome (:data:`CALL_OUTCOMES`) per latency bucket (the last: over 30 s).
        self.latency = [[0] * (len(CALL_LATENCY_BUCKETS) + 1) for _ in CALL_OUTCOMES]
        self.latency_sum = [0.0] * len(CALL_OUTCOMES)
        self._failed: dict[str, int] = {}
        self._synced = -1
        self._closed = False
        #: Zones, subset, hedges and retry budget (the transport sets the connection's).
        self.balancing = RouteBalancing()
        #: The route's ejection record and detector (None: ejection is off).
        self.ejection_log = EjectionLog()
        self.detector = (
            None if options.ejection is None else options.ejection.detector(self.ejection_log)
        )
        self._discovery: DiscoveryBalance[Attempt, httpx.Response] = DiscoveryBalance(
            policy, self._factory, clock=self.clock, outlier_detector=self.detector
        )
        self._streaming = StreamingDiscoveryBalance(self._directory.reader(), self._discovery)

    # -- views -----------------------------------------------------------------------

    @property
    def connection(self) -> str:
        return self.observation.connection

    @property
    def service(self) -> str:
        return self.observation.service

    @property
    def streaming(self) -> StreamingDiscoveryBalance[Attempt, httpx.Response]:
        return self._streaming

    @property
    def revision(self) -> int:
        return self._synced

    @property
    def reconciled(self) -> bool:
        """True when the balance already applied everything mirrored so far (O(1)).

        The request path then skips the reconcile step of the streaming
        balance and dispatches at once.
        """
        return self._directory.revision == self._discovery.revision

    def identities(self) -> tuple[str, ...]:
        """The identities the route mirrors now."""
        return tuple(self._instances)

    def current(self, identity: str) -> Instance | None:
        """The instance the route mirrors under ``identity`` now (None: gone)."""
        return self._instances.get(identity)

    def statistics(self) -> RouteStatistics:
        in_flight: dict[str, int] = {}
        for endpoint in self._discovery.endpoints:
            tracker = endpoint.tracker
            count = tracker.open_guards if isinstance(tracker, GenerationTracker) else 0
            in_flight[str(endpoint.key)] = count
        return RouteStatistics(
            connection=self.connection,
            service=self.service,
            revision=self._synced,
            in_flight=in_flight,
            sent=dict(self._sent),
            failures=dict(zip(CALL_FAILURE_KINDS, self.failures, strict=True)),
            failed=dict(self._failed),
            ejected=self.ejected(),
            ejections=self.ejection_log.ejections,
            latency={
                outcome: (tuple(self.latency[i]), self.latency_sum[i])
                for i, outcome in enumerate(CALL_OUTCOMES)
            },
        )

    def ejected(self) -> dict[str, float]:
        """Identity -> end of its ejection (event-loop time), for those ejected now."""
        detector = self.detector
        if detector is None:
            return {}
        ends = {}
        for key in detector.ejected:
            until = detector.ejected_until(key)
            if until is not None:
                ends[str(key)] = until
        return ends

    def observe_call(self, outcome: int, seconds: float) -> None:
        """Count one whole call's latency under ``outcome`` (index into :data:`CALL_OUTCOMES`)."""
        self.latency[outcome][bisect_left(CALL_LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum[outcome] += seconds

    def __repr__(self) -> str:
        return (
            f"<Route {self.connection}/{self.service} revision={self._synced} "
            f"instances={len(self._instances)}>"
        )

    # -- discovery -> directory ----------------------------------------------------------

    def snapshot(self) -> ObservationSnapshot:
        """The observation's usable listing now, mirrored into the directory.

        Raises :class:`~nadisc.EvidenceUnavailable` when nothing may be used,
        including a listing without instances (reason ``empty``) and one whose
        instances are all draining (reason ``draining``).
        """
        snapshot = self.observation.snapshot(strict=self.options.strict_evidence)
        self.sync(snapshot)
        if not snapshot.instances:
            raise EvidenceUnavailable(
                f"connection {self.connection!r} service {self.service!r}: "
                "the listing has no instances",
                reason="empty",
            )
        if all(instance.draining for instance in snapshot.instances):
            raise EvidenceUnavailable(
                f"connection {self.connection!r} service {self.service!r}: "
                "every listed instance is draining",
                reason="draining",
            )
        return snapshot

    def sync(self, snapshot: ObservationSnapshot) -> None:
        """Mirror ``snapshot`` into the directory. Synchronous; O(1) when unchanged.

        Key = ``Instance.identity``. An instance whose value is unchanged keeps
        its allocation (its endpoint keeps load and quarantine); a changed one
        is upserted (a new generation); a missing one is removed (calls in
        flight finish with their guards). A ``draining`` instance is marked
        draining in the directory: when only that flag changed, with the same
        allocation (its calls in flight go on), otherwise after its upsert.
        """
        if snapshot.revision == self._synced or self._closed:
            return
        directory = self._directory
        instances = self._instances
        seen: set[str] = set()
        for instance in self.balancing.select(snapshot.instances):
            identity = instance.identity
            seen.add(identity)
            known = instances.get(identity)
            if known is not None and known == instance:
                continue
            instances[identity] = instance
            if (
                instance.draining
                and known is not None
                and not known.draining
                and _replace(known, draining=True) == instance
            ):
                # Only the draining flag moved: keep the allocation (and the
                # load guards of the calls in flight), take no new calls.
                directory.drain(identity)
                continue
            directory.upsert(identity, Backend(f"{identity}", weight=instance.weight))
            if instance.draining:
                directory.drain(identity)
        for identity in [i for i in instances if i not in seen]:
            del instances[identity]
            directory.remove(identity)
        self._synced = snapshot.revision

    def usable(self) -> ObservationSnapshot:
        """The observation's usable listing now (strict when the options say so).

        Raises :class:`~nadisc.EvidenceUnavailable`. Synchronous: what
        :meth:`submit` checks, for a caller that hands over right after.
        """
        return self.observation._usable_at(self.clock(), self._strict)

    def check_usable(self, now: float | None = None) -> None:
        """Raise :class:`~nadisc.EvidenceUnavailable` unless the evidence may be
        used now, and bring the mirror up to date with it. Synchronous.

        What :meth:`usable` decides, cached: after a check passed, later ones
        cost a clock read and two comparisons until the evidence records an
        event (its version moves: a listing, a refresh, a failure, a
        revocation, the close) or the instant passes from which time alone
        refuses it (max age, or grace after a failure). Either one makes the
        next check ask the observation again. Nothing of the listing is kept.
        ``now``: a reading of :attr:`clock` taken with nothing awaited since.
        """
        if now is None:
            now = self.clock()
        evidence = self._evidence
        if evidence is not None and evidence.version == self._checked and now < self._until:
            return
        snapshot = self.observation._usable_at(now, self._strict)
        if snapshot.revision != self._synced:
            self.sync(snapshot)
        if evidence is not None:
            until = evidence.usable_until(now, strict=self._strict)
            self._checked = evidence.version
            self._until = -math.inf if until is None else until

    def submit(self, hand_over: Callable[[ObservationSnapshot], T]) -> T:
        """Run the synchronous ``hand_over`` under the observation's currency check."""
        return self._submit(hand_over)

    def count_sent(self, identity: str) -> None:
        self._sent[identity] = self._sent.get(identity, 0) + 1

    def uncount_sent(self, identity: str) -> None:
        """Take back :meth:`count_sent` for an admitted attempt that went
        elsewhere before anything was sent (in the same synchronous step, so
        no reader sees the count go down)."""
        self._sent[identity] -= 1

    def count_failure(self, kind: int, identity: object = None) -> None:
        """Count one failure of ``kind`` (an index into :data:`CALL_FAILURE_KINDS`).

        ``identity`` names the instance of a failed attempt (``None`` for a
        call that reached none). Called on failure paths only.
        """
        self.failures[kind] += 1
        if identity is not None:
            key = str(identity)
            self._failed[key] = self._failed.get(key, 0) + 1

    def _factory(self, key: Hashable, backend: Backend) -> tuple[InstanceService, LoadTracker]:
        instance = self._instances[str(key)]
        return InstanceService(self, instance), self._tracker()

    def close(self) -> None:
        """Stop mirroring; retire every endpoint once its calls end. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._directory.close()
        self._discovery.close()
