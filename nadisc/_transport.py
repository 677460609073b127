"""An httpx transport that calls services through discovery.

Mount it on its own scheme, so that a plain URL can never reach discovery::

    transport = DiscoveryTransport(owner)
    async with httpx.AsyncClient(mounts={"nadisc://": transport}) as http:
        response = await http.get("nadisc://primary/orders/v1/orders?limit=5")

``nadisc://<qualifier>/<service-alias>/<path>`` names the connection and the
service alias explicitly; the transport picks an instance of that alias on
that connection (the connection's ``rest`` options decide the strategy) and
sends ``<instance_scheme>://<host>:<port>/<path>?<query>`` through ONE shared
connection pool. Any other scheme is refused with :class:`NotDiscoveryUrl`
before discovery is consulted. URL hosts are case-folded, so a connection
whose name is not a lowercase host label is addressed through the request
extension ``"nadisc.qualifier"`` (what :class:`~nadisc.RestDiscoveryClient`
does); unknown names raise :class:`~nadisc.QualifierError`, unknown aliases
:class:`~nadisc.UnknownService`.

One call, all attempts::

    budget = the smallest of rest.request_timeout, the request's httpx timeout
             (extensions["timeout"]: its largest phase, none if a phase is None)
             and the "nadisc.deadline" extension (absolute event-loop time);
             the caller's cancel scope, when it ends first, cancels the call
    loop:  fast path (listing already applied, an endpoint ready): no yield,
             no cancel scope, straight to the hand-over below
           otherwise: evidence usable now?   no -> EvidenceUnavailable
                      reconcile and wait for a ready endpoint (bounded)
           pick; re-check currency; hand to the pool   (revoked -> declined,
             pick again; instance declares another scheme ->
             InstanceSchemeMismatch, nothing sent)
           transport error  ─┐  GET/HEAD, switched on, attempts and budget left:
           502/503/504      ─┘  retry on another instance where there is one
    budget spent -> CallTimeout naming the limit (chained from the last error)

How the budget bounds the pool: httpx's own pool reads the timeout
extension once per operation, so the transport hands it a mapping whose
every value is capped by what is left of the budget (no cancel scope of
ours); a response whose headers arrive after the budget is refused. A pool
not known to honour the extension (``nadisc_enforces_timeouts``) gets the
budget as one cancel scope around the call.

Errors: every nadisc error is re-raised at the boundary as its ``Call*``
form (see :mod:`nadisc._errors`), which is also an ``httpx.RequestError``;
errors of the pool pass through unchanged.

Cost on the fast path: the URL parse is cached per path; one evidence check
(cached until the evidence records an event or its usable-until instant
passes, see ``Route.check_usable``), one readiness scan, one policy pick, a
request rebuilt by copying the caller's normalised header list, and a
guarded body.

Only ``GET`` and ``HEAD`` are ever retried; a request whose body is a stream
that cannot be replayed is not retried either. Each attempt's connect timeout
is ``min(connect_timeout, budget left)``. The budget covers everything up to
the response headers; reading the body of a streamed response is the
caller's business (``RestDiscoveryClient.request`` reads it inside the budget).

Load guards: each attempt is a ``Balance.pick_held``; the returned
``poise.Held`` keeps the endpoint's load guard open until the response body
is closed (streamed responses too). An instance that was selected but left
the evidence before the hand-over declines the call (``poise.CallDeclined``:
guard cancelled, nothing sent, another pick is made). Body read to the end -> the call completes
(as failed for a 5xx status, so a load-aware policy counts it against the
instance); closed before the end, or cancelled -> the guard is cancelled
(no latency observation); reading raised -> completes as failed. A response
that is never closed keeps its instance's load counted: close it.

Failure counts: each failed attempt adds one to its route's counter of its
:class:`~nadisc.CallFailureKind` (transport error, timeout, 5xx status when
the headers arrive, other) and a call that reached no instance adds one
``no_endpoint``; an int increment on the failure path, nothing on success.
"""

from __future__ import annotations

import logging
import math
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import TYPE_CHECKING, Any, cast
from urllib.parse import unquote

import anyio
import httpx
import sniffio

from poise import CallDeclined, Held, SelectionError

from ._balancing import RouteBalancing
from ._errors import (
    CallError,
    CallTimeout,
    DeadlineExceeded,
    DiscoveryError,
    EvidenceUnavailable,
    LifecycleError,
    QualifierError,
    UnknownService,
    for_call,
    relative_deadline_hint,
)
from ._instance import Instance
from ._observation import loop_clock, run_clock
from ._retry import Failure, RetryRules, Step, retry_step
from ._route import (
    NO_ENDPOINT,
    OTHER,
    STATUS,
    TIMEOUT,
    Attempt,
    InstanceSchemeMismatch,
    InstanceService,
    RestOptions,
    Route,
    call_outcome,
    failure_kind,
)
from ._tls import default_tls_context

if TYPE_CHECKING:
    from poise import StreamingDiscoveryBalance

if TYPE_CHECKING:
    from ._connection import DiscoveryHandle
    from ._owner import DiscoveryOwner

__all__ = [
    "BUDGET_EXTENSION",
    "DEADLINE_EXTENSION",
    "DEADLINE_LIMIT",
    "HTTPX_LIMIT",
    "INSTANCE_EXTENSION",
    "QUALIFIER_EXTENSION",
    "REST_LIMIT",
    "SCHEME",
    "Budget",
    "DiscoveryTransport",
    "NotDiscoveryUrl",
    "call_budget",
    "check_service",
    "connection_of",
    "enforces_timeouts",
    "url_host",
]

logger = logging.getLogger(__name__)

#: The URL scheme the transport serves.
SCHEME = "nadisc"
#: Request extension: the exact connection name (overrides the case-folded URL host).
QUALIFIER_EXTENSION = "nadisc.qualifier"
#: Request extension: absolute deadline (event-loop clock) for the whole call.
DEADLINE_EXTENSION = "nadisc.deadline"
#: Request extension set by the REST client: its :class:`Budget`, kept armed
#: through the body read (the client reads the body within it).
BUDGET_EXTENSION = "nadisc.budget"
#: Response extension: the :class:`~nadisc.Instance` that answered.
INSTANCE_EXTENSION = "nadisc.instance"
#: Request extension: True marks a request idempotent (hedged like GET/HEAD when hedging is on).
IDEMPOTENT_EXTENSION = "nadisc.idempotent"

RETRYABLE_STATUS = frozenset({502, 503, 504})
_RETRYABLE_METHODS = frozenset({"GET", "HEAD"})
_SHUTDOWN_GRACE = 5.0
_URL_CACHE = 1024
_NOTHING: frozenset[str] = frozenset()
# The attempt loop's "tried" set while nothing was tried (never added to:
# the loop makes its own set at the first failure).
_NONE_TRIED: set[str] = set()
# The CALL_OUTCOMES index of a response with a 5xx status.
_STATUS_OUTCOME = STATUS + 1
_now = anyio.current_time


class NotDiscoveryUrl(CallError, httpx.UnsupportedProtocol, ValueError):
    """A URL that is not a well-formed ``nadisc://<qualifier>/<service>/...`` URL.

    Raised before discovery is consulted; a plain ``http(s)://`` URL given to
    the discovery transport is always this error, never a lookup. Also an
    ``httpx.UnsupportedProtocol`` (what httpx raises for a scheme it has no
    transport for).
    """


def connection_of(owner: DiscoveryOwner, qualifier: str | None) -> DiscoveryHandle:
    """The owner's handle on connection ``qualifier`` (``None``: the default, ``primary``).

    Raises :class:`~nadisc.QualifierError` (unknown name, no default, zero
    connections) and :class:`~nadisc.LifecycleError` (owner not prepared or
    closing).
    """
    return owner.client(qualifier)


def check_service(handle: DiscoveryHandle, service: str) -> None:
    """Raise :class:`~nadisc.UnknownService` unless ``service`` is bound on ``handle``."""
    if not isinstance(service, str) or service not in handle.services():
        raise UnknownService(f"service {service!r} is not bound on connection {handle.qualifier!r}")


def url_host(qualifier: str) -> str:
    """What stands for connection ``qualifier`` in the host of a ``nadisc://`` URL.

    The name itself when it is a lowercase host label; otherwise the neutral
    ``qualified`` (the exact name then travels in the ``"nadisc.qualifier"``
    request extension).
    """
    if qualifier and all(c.islower() or c.isdigit() or c in "-_" for c in qualifier):
        return qualifier
    return "qualified"


#: ``CallTimeout.limit`` of the connection's REST budget.
REST_LIMIT = "rest.request_timeout"
#: ``CallTimeout.limit`` of the client's or the request's httpx timeout.
HTTPX_LIMIT = "httpx timeout"
#: ``CallTimeout.limit`` of the ``nadisc.deadline`` request extension.
DEADLINE_LIMIT = DEADLINE_EXTENSION
_LIMIT_NAMES = {
    REST_LIMIT: "REST budget (rest.request_timeout)",
    HTTPX_LIMIT: "httpx timeout (client or request)",
    DEADLINE_LIMIT: "nadisc.deadline extension",
}
_PHASES = ("connect", "read", "write", "pool")


class Budget:
    """The budget of one call: the smallest of its limits, and which one that is.

    ``deadline`` is absolute (event-loop clock); ``limit`` is one of
    :data:`REST_LIMIT`, :data:`HTTPX_LIMIT`, :data:`DEADLINE_LIMIT`;
    ``seconds`` the limit's value (for the extension: what it left at the
    start). The caller's cancel scope is not one of them: when it ends
    first it cancels the call, as it cancels anything else.
    """

    __slots__ = ("deadline", "limit", "seconds", "start")

    def __init__(self, deadline: float, limit: str, seconds: float, start: float) -> None:
        self.deadline = deadline
        self.limit = limit
        self.seconds = seconds
        self.start = start

    def describe(self) -> str:
        what = _LIMIT_NAMES[self.limit]
        if self.limit == DEADLINE_LIMIT:
            return f"the {what} (absolute {self.deadline:g}, {self.seconds:.3g} s after the start)"
        return f"the {what} of {self.seconds:g} s"

    def exceeded(self, route: Route, attempts: int) -> CallTimeout:
        after = f" after {attempts} attempt(s)" if attempts else ""
        return CallTimeout(
            f"connection {route.connection!r} service {route.service!r}: "
            f"{self.describe()} ran out{after}",
            limit=self.limit,
            seconds=self.seconds,
        )

    def exceeded_before_listing(self, qualifier: str, service: str) -> CallTimeout:
        return CallTimeout(
            f"connection {qualifier!r} service {service!r}: {self.describe()} ran out "
            "before the first listing",
            limit=self.limit,
            seconds=self.seconds,
        )

    def __repr__(self) -> str:
        return f"<Budget {self.limit} deadline={self.deadline:g}>"


def _httpx_total(phases: object) -> float | None:
    # httpx's timeout as one budget: the largest of its phase values, or
    # none when a phase is unbounded (httpx.Timeout(None, connect=2)).
    if not isinstance(phases, dict):
        return None
    get = phases.get
    connect, read, write, pool = get("connect"), get("read"), get("write"), get("pool")
    if connect is None or read is None or write is None or pool is None:
        return None
    return float(max(connect, read, write, pool, 0.0))


def call_budget(request: httpx.Request, options: RestOptions, start: float) -> Budget:
    """The budget of ``request`` starting at ``start``: see :class:`Budget`.

    The smallest of ``options.request_timeout``, the request's httpx
    timeout (``request.extensions["timeout"]``, set by httpx from the
    client's or the request's ``timeout``; its largest phase value, none
    when a phase is unbounded) and the ``"nadisc.deadline"`` extension. On a
    tie the REST budget is named. Raises :class:`~nadisc.CallTimeout` for a
    deadline extension that is not a number, or already passed (with a hint
    when it looks like a duration).
    """
    seconds = options.request_timeout
    budget = Budget(start + seconds, REST_LIMIT, seconds, start)
    extensions = request.extensions
    total = _httpx_total(extensions.get("timeout"))
    if total is not None and start + total < budget.deadline:
        budget.deadline = start + total
        budget.limit = HTTPX_LIMIT
        budget.seconds = total
    deadline = extensions.get(DEADLINE_EXTENSION)
    if deadline is not None:
        if (
            isinstance(deadline, bool)
            or not isinstance(deadline, int | float)
            or math.isnan(deadline)
        ):
            raise CallTimeout(
                f"the {DEADLINE_EXTENSION} extension must be an absolute event-loop time, "
                f"not {deadline!r}"
            )
        if deadline < budget.deadline:
            budget.deadline = deadline
            budget.limit = DEADLINE_LIMIT
            budget.seconds = deadline - start
    if budget.deadline <= start:
        hint = relative_deadline_hint(budget.deadline, start)
        raise CallTimeout(
            f"{budget.describe()} was spent before the call started{hint}",
            limit=budget.limit,
            seconds=budget.seconds,
        )
    return budget


class _Timeouts(dict[str, float | None]):
    """The pool's per-operation timeouts, each capped by what is left of the budget.

    httpx pools read ``request.extensions["timeout"]`` once per operation
    (acquiring a connection, connecting, each write and read); while the
    call is armed every read returns ``min(phase value, time left)``, so the
    budget bounds the whole exchange without a cancel scope of ours. Once
    the headers are in (:meth:`release`), the phase values alone apply, as
    for plain httpx: reading the body is the caller's business.
    """

    __slots__ = ("clock", "deadline")

    def __init__(
        self,
        request: httpx.Request,
        options: RestOptions,
        deadline: float,
        clock: Callable[[], float],
    ) -> None:
        phases = request.extensions.get("timeout")
        if isinstance(phases, dict):
            super().__init__(phases)
        else:
            super().__init__(connect=None, read=None, write=None, pool=None)
        connect = dict.get(self, "connect")
        limit = options.connect_timeout
        if connect is None or connect > limit:
            self["connect"] = limit
        self.deadline = deadline
        self.clock = clock

    def release(self) -> None:
        self.deadline = math.inf

    def get(self, key: str, default: float | None = None) -> float | None:  # type: ignore[override]
        value = dict.get(self, key, default)
        deadline = self.deadline
        if deadline == math.inf:
            return value
        left = deadline - self.clock()
        if left < 0.0:
            left = 0.0
        return left if value is None or value > left else value

    def __getitem__(self, key: str) -> float | None:
        if key not in self:
            raise KeyError(key)
        return self.get(key)


def enforces_timeouts(pool: httpx.AsyncBaseTransport) -> bool:
    """True for a pool known to honour ``request.extensions["timeout"]`` (httpx's own).

    Other pools (``httpx.MockTransport``, custom transports) get the budget
    as a cancel scope around the call instead.
    """
    known = getattr(pool, "nadisc_enforces_timeouts", None)
    if isinstance(known, bool):
        return known
    return isinstance(pool, httpx.AsyncHTTPTransport)


async def _ready(
    streaming: StreamingDiscoveryBalance[Attempt, httpx.Response],
    route: Route,
    budget: Budget,
    own: bool,
    attempts: int,
) -> None:
    # Reconcile and wait for a ready endpoint, within the budget.
    if not own:
        await streaming.ready()  # the caller's scope ends first
        return
    with anyio.move_on_at(budget.deadline):
        await streaming.ready()
        return
    if not attempts:
        route.count_failure(NO_ENDPOINT)
    raise budget.exceeded(route, attempts)


def _header_list_ok() -> bool:
    # The rebuild below fills httpx's header list directly (three-tuples of
    # raw key, lowercased key, value); check the layout once.
    try:
        probe = httpx.Headers([(b"X-Probe", b"1")])
        return probe._list == [(b"X-Probe", b"x-probe", b"1")] and hasattr(probe, "_encoding")
    except Exception:  # pragma: no cover - another httpx layout
        return False


_FAST_HEADERS = _header_list_ok()
# httpx.URL keeps its parsed, hashable form here (checked once): the target
# cache keys on it instead of reading the URL's properties per request.
_URL_REFERENCE = isinstance(getattr(httpx.URL("nadisc://q/s/"), "_uri_reference", None), tuple)


def _rebuild(
    request: httpx.Request,
    url: httpx.URL,
    host: bytes,
    extensions: dict[str, object],
) -> httpx.Request:
    """The caller's request for an instance: its URL, its ``Host``, the same body."""
    if not _FAST_HEADERS:  # pragma: no cover - another httpx layout
        return httpx.Request(
            request.method,
            url,
            headers=_with_host(request.headers.raw, host),
            stream=_body(request.stream),
            extensions=extensions,
        )
    # Copy the already-normalised header list instead of normalising it
    # again: a new Request costs a quarter of what the constructor costs.
    headers = httpx.Headers.__new__(httpx.Headers)
    headers._list = [(b"Host", b"host", host)] + [
        item for item in request.headers._list if item[1] != b"host"
    ]
    headers._encoding = request.headers._encoding
    made = httpx.Request.__new__(httpx.Request)
    made.method = request.method
    made.url = url
    made.headers = headers
    made.stream = _body(request.stream)
    made.extensions = extensions
    content = getattr(request, "_content", None)
    if content is not None:
        made._content = content
    return made


def _body(stream: httpx.SyncByteStream | httpx.AsyncByteStream) -> httpx.AsyncByteStream:
    """The body to send to one instance.

    httpx's ``ByteStream.__aiter__`` is an async generator. An attempt whose
    connection breaks while sending (an instance killed mid-request) leaves
    that generator unfinished, and trio warns when the garbage collector
    finds it, at an arbitrary later point in the caller's program. The same
    bytes behind an iterator that is not a generator have nothing to finalize.
    """
    if type(stream) is httpx.ByteStream:
        data = stream._stream
        # Most requests have no body: one shared, stateless empty body.
        return _Bytes(data) if data else _NO_BODY
    return stream  # type: ignore[return-value]


class _Bytes(httpx.ByteStream):
    """An ``httpx.ByteStream`` whose async iteration is a plain iterator."""

    def __aiter__(self) -> AsyncIterator[bytes]:
        return _OneChunk(self._stream)


#: The body of every request without one (each iteration starts afresh).
_NO_BODY = _Bytes(b"")


class _OneChunk:
    __slots__ = ("_data",)

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data

    def __aiter__(self) -> _OneChunk:
        return self

    async def __anext__(self) -> bytes:
        data = self._data
        if data is None:
            raise StopAsyncIteration
        self._data = None
        return data


class _GuardedStream(httpx.AsyncByteStream):
    """A response body that ends the call's :class:`~poise.Held` guard exactly once.

    Iterating it is a plain ``__anext__`` delegation (no async generator of
    its own). The guard ends when the body is closed: completed when it was
    read to the end (as failed for a 5xx status), completed as failed when
    reading raised, cancelled when it was closed early or the reader was
    cancelled.
    """

    __slots__ = (
        "_closed",
        "_data",
        "_done",
        "_failed",
        "_held",
        "_inner",
        "_iterator",
        "_memory",
        "_route",
    )

    def __init__(
        self,
        inner: httpx.AsyncByteStream,
        held: Held[Any],
        failed: bool,
        route: Route | None = None,
    ) -> None:
        self._inner = inner
        self._held = held
        self._failed = failed
        self._route = route
        self._done = False
        self._closed = False
        self._iterator: AsyncIterator[bytes] | None = None
        # A body already in memory (httpx.ByteStream, what MockTransport and
        # in-memory pools hand back) is handed out here as its one chunk,
        # with no iterator of its own; ``_data`` is None once it was.
        self._memory = type(inner) is httpx.ByteStream
        self._data: bytes | None = inner._stream if self._memory else None  # type: ignore[attr-defined]

    def __aiter__(self) -> AsyncIterator[bytes]:
        # One iteration per body: iterating again continues where it stopped.
        if self._iterator is None and not self._memory:
            self._iterator = _iterate(self._inner)
        return self

    async def __anext__(self) -> bytes:
        if self._memory:
            data = self._data
            if data is None:
                self._done = True
                raise StopAsyncIteration
            self._data = None
            return data
        iterator = self._iterator
        if iterator is None:
            iterator = self._iterator = _iterate(self._inner)
        try:
            return await iterator.__anext__()
        except StopAsyncIteration:
            self._done = True
            raise
        except Exception as exc:
            route = self._route
            if route is not None and isinstance(exc, httpx.TransportError):
                _name_instance(exc, route, self._held.key)
            if route is not None and not self._failed:  # a 5xx was counted at its headers
                route.count_failure(failure_kind(exc), self._held.key)
            self._failed = True
            self._done = True
            raise

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        held = self._held
        try:
            try:
                iterator = self._iterator
                if not self._done and iterator is not None:
                    close = getattr(iterator, "aclose", None)
                    if close is not None:
                        await close()
            finally:
                # The connection goes back to (or leaves) the pool even when
                # closing the iterator raised. A body in memory has nothing
                # to give back (httpx.ByteStream.aclose does nothing).
                inner = self._inner
                if type(inner) is not httpx.ByteStream:
                    await inner.aclose()
        finally:
            # Synchronous: ends the guard even inside a cancelled scope.
            if not self._done:
                held.cancel()
            else:
                held.complete(failed=self._failed)


def _iterate(stream: httpx.AsyncByteStream) -> AsyncIterator[bytes]:
    # A body already in memory (httpx.ByteStream, what MockTransport and
    # in-memory pools hand back) is read without starting its async generator.
    if type(stream) is httpx.ByteStream:
        return _OneChunk(stream._stream)
    return stream.__aiter__()


def _replayable(request: httpx.Request) -> bool:
    return isinstance(request.stream, httpx.ByteStream)


class _Target:
    __slots__ = ("qualifier", "raw_path", "route", "service")

    def __init__(self, qualifier: str, service: str, raw_path: bytes) -> None:
        self.qualifier = qualifier
        self.service = service
        self.raw_path = raw_path
        #: The route of (qualifier, service), once the transport has one.
        self.route: Route | None = None


def _target(request: httpx.Request) -> _Target:
    url = request.url
    if url.scheme != SCHEME:
        raise NotDiscoveryUrl(
            f"the discovery transport serves {SCHEME}:// URLs only, not {url.scheme}:// "
            "(plain URLs go through a plain client)"
        )
    host = url.host
    qualifier = request.extensions.get(QUALIFIER_EXTENSION)
    if qualifier is None:
        if not host:
            raise NotDiscoveryUrl(
                f"{SCHEME}:// URL without a qualifier: {SCHEME}://<qualifier>/..."
            )
        qualifier = host
    elif not isinstance(qualifier, str) or (host and host != url_host(qualifier)):
        raise NotDiscoveryUrl(
            f"the request names connection {qualifier!r} in its extension but {host!r} in its URL"
        )
    if url.port is not None or url.userinfo:
        raise NotDiscoveryUrl(f"a {SCHEME}:// URL carries no port or user info")
    raw = url.raw_path  # path + query, still percent-encoded
    path, sep, query = raw.partition(b"?")
    segments = path.split(b"/", 2)
    if len(segments) < 2 or not segments[1]:
        raise NotDiscoveryUrl(
            f"{SCHEME}:// URL without a service alias: {SCHEME}://<qualifier>/<service>/<path>"
        )
    service = unquote(segments[1].decode("ascii"))
    rest = b"/" + (segments[2] if len(segments) > 2 else b"")
    return _Target(qualifier, service, rest + sep + query)


class DiscoveryTransport(httpx.AsyncBaseTransport):
    """An ``httpx.AsyncBaseTransport`` for ``nadisc://`` URLs; see the module docstring.

    ``owner`` is a prepared :class:`~nadisc.DiscoveryOwner`. ``options``
    applies one :class:`~nadisc.RestOptions` to every connection; by default
    each connection's own ``rest`` block applies. ``qualifiers`` restricts
    the connections this transport may call (others raise
    :class:`~nadisc.QualifierError`). ``transport`` is the pool every
    instance shares (default: an ``httpx.AsyncHTTPTransport`` with
    ``limits``); it is closed by :meth:`aclose` only when created here.

    Routes (one per connection and service) are created on first use and
    hold their observation until :meth:`aclose`.
    """

    def __init__(
        self,
        owner: DiscoveryOwner,
        *,
        options: RestOptions | None = None,
        qualifiers: Iterable[str] | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        limits: httpx.Limits | None = None,
        verify: bool = True,
    ) -> None:
        if options is not None and not isinstance(options, RestOptions):
            raise TypeError(f"options must be RestOptions, got {type(options).__name__}")
        self._owner = owner
        self._options = options
        self._qualifiers = None if qualifiers is None else frozenset(qualifiers)
        for name in self._qualifiers or ():
            # An unknown name is refused now (QualifierError), not at the first call.
            if not isinstance(name, str):
                raise TypeError(f"qualifiers are connection names, not {type(name).__name__}")
            owner.connection_policy(name)
        self._owns_pool = transport is None
        self._pool: httpx.AsyncBaseTransport = (
            transport
            if transport is not None
            else httpx.AsyncHTTPTransport(
                limits=limits if limits is not None else httpx.Limits(),
                verify=default_tls_context() if verify else False,
            )
        )
        self._routes: dict[tuple[str, str], Route] = {}
        self._opening: dict[tuple[str, str], anyio.Event] = {}
        self._urls: dict[tuple[str, str, int, bytes], tuple[httpx.URL, bytes]] = {}
        self._pool_enforces = enforces_timeouts(self._pool)
        # httpx's mock pool is called as it calls itself, so that a handler
        # answering synchronously (which cannot wait) needs no cancel scope.
        self._mock = self._pool if type(self._pool) is httpx.MockTransport else None
        self._targets: dict[tuple[str | None, object], _Target] = {}
        # The running loop's clock, deadline and cancel scope: resolved on the
        # first request (a transport serves one loop).
        self._loop: _Loop | None = None
        self._closed = False

    # -- views ---------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        return self._closed

    def route(self, qualifier: str, service: str) -> Route | None:
        """The route of (connection, service), if one was used (closed ones too)."""
        return self._routes.get((qualifier, service))

    def routes(self) -> tuple[Route, ...]:
        return tuple(self._routes.values())

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"<DiscoveryTransport routes={len(self._routes)} {state}>"

    # -- routes --------------------------------------------------------------------------

    def options_for(self, qualifier: str | None) -> RestOptions:
        """The options calls on ``qualifier`` use (validates the qualifier)."""
        handle = self._connection(qualifier)
        if self._options is not None:
            return self._options
        return RestOptions.from_config(self._owner.connection_policy(handle.qualifier).rest)

    def _connection(self, qualifier: str | None) -> DiscoveryHandle:
        handle = connection_of(self._owner, qualifier)
        if self._qualifiers is not None and handle.qualifier not in self._qualifiers:
            raise QualifierError(
                f"connection {handle.qualifier!r} is not served by this transport "
                f"(serves: {', '.join(sorted(self._qualifiers))})"
            )
        return handle

    async def _route(self, qualifier: str, service: str, budget: Budget) -> Route:
        key = (qualifier, service)
        deadline = budget.deadline
        while True:
            route = self._routes.get(key)
            if route is not None:
                return route
            opening = self._opening.get(key)
            if opening is None:
                break
            with anyio.move_on_at(deadline):
                await opening.wait()
            if _now() >= deadline:
                raise budget.exceeded_before_listing(qualifier, service)
        handle = self._connection(qualifier)
        check_service(handle, service)  # UnknownService before anything starts
        options = self._options or RestOptions.from_config(
            self._owner.connection_policy(handle.qualifier).rest
        )
        balancing = RouteBalancing(self._owner.connection_policy(handle.qualifier).balancing)
        event = self._opening[key] = anyio.Event()
        try:
            try:
                observation = await handle.observe(service, deadline)
            except DeadlineExceeded as exc:
                raise budget.exceeded_before_listing(qualifier, service) from exc
            if self._closed:
                raise LifecycleError("the discovery transport is closed")
            loop = self._loop
            clock = loop.now if loop is not None else loop_clock()[0]
            route = self._routes[key] = Route(observation, options, clock)
            route.balancing = balancing
        finally:
            del self._opening[key]
            event.set()
        return route

    # -- the transport -------------------------------------------------------------------

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            if self._closed:
                raise LifecycleError("the discovery transport is closed")
            loop = self._loop
            if loop is None:
                loop = self._loop = _Loop()
            now = loop.now
            target = self._target(request)
            start = now()
            route = target.route
            if route is None:
                route = self._routes.get((target.qualifier, target.service))
            options = route.options if route is not None else self.options_for(target.qualifier)
            budget = request.extensions.get(BUDGET_EXTENSION)
            if not isinstance(budget, Budget):
                budget = call_budget(request, options, start)
            deadline = budget.deadline
            # The start reading stands for the first "budget left?" check of a
            # plain call when nothing was awaited since it was taken.
            first: float | None = start
            if route is None:
                first = None
                route = await self._route(target.qualifier, target.service, budget)
            target.route = route
            balancing = route.balancing
            plain = balancing.hedging is None and balancing.budget is None
            # Whether the budget ends before the caller's own cancel scope
            # (when the caller's ends first, it cancels this call, trio's rule,
            # and no bound of ours is needed). Asked up front only where the
            # answer is needed up front; otherwise the attempt loop asks on
            # the rare paths that need it (None: not asked yet).
            own: bool | None = None
            if not plain:
                own = deadline < loop.effective_deadline()
            elif not self._pool_enforces:
                # A pool that may ignore the timeout extension gets the budget
                # as one scope around the call whichever deadline is earlier:
                # reading the caller's effective deadline walks its scopes and
                # costs about what the scope does; a caller's scope that ends
                # first still cancels the call through ours. An
                # httpx.MockTransport is bounded per send instead, only where
                # its handler can wait (_answer_inline).
                own = True
            # A plain call observes its own latency on success, with the clock
            # reading it takes after the response (a balanced call's is observed
            # below).
            response: httpx.Response | None = None
            try:
                if own and not self._pool_enforces and not (plain and self._mock is not None):
                    # A pool that may ignore the timeout extension: one scope,
                    # entered before the call runs so that every scope the call
                    # opens (the pool's, the wait for an endpoint) nests inside
                    # it. Entered only once the call suspends, it would cross
                    # them (see docs/calling.md, "Benchmark").
                    with loop.scope(deadline=deadline):
                        if plain:
                            response = await self._call(
                                route, request, target, budget, own, None, start, first
                            )
                        else:
                            response = await self._balanced(
                                route, request, target, budget, own is True
                            )
                    if response is None:
                        route.count_failure(TIMEOUT)
                        raise budget.exceeded(route, 0)
                elif plain:
                    return await self._call(route, request, target, budget, own, None, start, first)
                else:
                    response = await self._balanced(route, request, target, budget, own is True)
            except Exception as exc:
                route.observe_call(call_outcome(exc), now() - start)
                raise
            if not plain:
                route.observe_call(
                    0 if response.status_code < 500 else _STATUS_OUTCOME, now() - start
                )
            return response
        except CallError:
            # A failure that waited for nothing still yields once, so a
            # caller's retry loop cannot starve the tasks that would mend it
            # (the mirror publishing a listing, a shutdown). Error path only.
            await anyio.lowlevel.cancel_shielded_checkpoint()
            raise
        except DiscoveryError as exc:
            await anyio.lowlevel.cancel_shielded_checkpoint()
            raise for_call(exc) from exc

    def _balanced(
        self, route: Route, request: httpx.Request, target: _Target, budget: Budget, own: bool
    ) -> Awaitable[httpx.Response]:
        # The route's retry budget and hedging around the attempt loop
        # (nadisc._balancing); a route with neither calls _call directly.
        marked = request.extensions.get(IDEMPOTENT_EXTENSION) is True
        idempotent = _replayable(request) and (request.method in _RETRYABLE_METHODS or marked)
        balancing = route.balancing
        if balancing.hedging is None or not idempotent:
            return balancing.call(
                lambda n: self._call(route, request, target, budget, own, None, None, None),
                idempotent=False,
                clock=route.clock,
            )
        # The instances this call's attempts were sent to, shared by its
        # hedges: a hedge avoids them while another instance is eligible.
        sent: set[str] = set()
        return balancing.call(
            lambda n: self._call(route, request, target, budget, own, sent, None, None),
            idempotent=True,
            clock=route.clock,
        )

    def _run_loop(self) -> _Loop:
        # The running loop's clock, effective deadline and scope, resolved
        # once (for the REST client; the request path spells it out).
        loop = self._loop
        if loop is None:
            loop = self._loop = _Loop()
        return loop

    def _own(self, deadline: float, own: bool | None) -> bool:
        # ``own`` as handle_async_request would have computed it (see there).
        if own is None:
            loop = self._loop
            assert loop is not None
            return deadline < loop.effective_deadline()
        return own

    async def _call(
        self,
        route: Route,
        request: httpx.Request,
        target: _Target,
        budget: Budget,
        own: bool | None,
        sent: set[str] | None,
        start: float | None,
        at: float | None,
    ) -> httpx.Response:
        # ``start``: the call's start when this attempt loop is the whole call
        # (no hedging, no retry budget), which then observes the call's
        # latency on success; ``at``: a clock reading taken with nothing
        # awaited since, which stands for the first check of the budget.
        # Every wait is bounded by the budget: the pool by the timeouts handed
        # to it (or the caller's scope), the rare waits for discovery by a
        # scope of their own. Nothing here yields unless it must wait.
        options = route.options
        deadline = budget.deadline
        # Built on the failure paths only (nothing per successful call).
        errors: list[Exception] | None = None
        attempts = 0
        # Attempts whose connection failed before anything was sent, retried
        # transparently: not among max_attempts, at most one per listed instance.
        transparent = 0
        per_attempt = options.attempt_timeout
        cutoff = math.inf
        # A hedge (``sent`` shared with the call's other attempts) starts out
        # avoiding the instances they were sent to.
        tried: set[str] = _NONE_TRIED if sent is None else sent
        streaming = route.streaming
        balance = streaming.balance
        pool = self._pool
        mock = self._mock
        now = route.clock
        # The pool's timeouts, capped by the budget (httpx's mock pool reads
        # none: its handler gets the caller's extensions, as with plain httpx).
        timeouts: _Timeouts | None = None
        extensions = request.extensions
        if mock is None:
            timeouts = _Timeouts(request, options, deadline, now)
            extensions = dict(extensions)
            extensions["timeout"] = timeouts
        # What every attempt's request is built from (no closure per call).
        scheme = options.instance_scheme
        raw_path = target.raw_path
        url = self._url

        # Fast path, taken while the balance already applied the mirrored
        # listing: no separate evidence view, no reconcile step and no wait
        # when an endpoint is ready; the currency check in the service
        # still guards the send, and a declined pick falls back to the full
        # path.
        fast = route.reconciled
        # How many more picks of an already tried instance this call may
        # decline. Carried across declined picks (not renewed per pick), and
        # zero once every listed instance was tried: then a retry goes to a
        # tried instance instead of declining picks until the budget ends.
        skip_budget = 0 if not tried else _skip_budget(route, tried, len(balance))
        while True:
            if at is None:
                at = now()
            if at >= deadline:
                if not attempts:
                    route.count_failure(NO_ENDPOINT)
                raise budget.exceeded(route, attempts) from (errors[-1] if errors else None)
            if not fast:
                try:
                    route.snapshot()  # EvidenceUnavailable: no request, no retry
                except EvidenceUnavailable:
                    if not attempts:
                        route.count_failure(NO_ENDPOINT)
                    raise
            # The reading stands for the pick's and the currency check's
            # while nothing is awaited before them; the next check reads again.
            picked_at: float | None = at
            at = None
            attempt = Attempt(
                avoid=frozenset(tried) if skip_budget else _NOTHING,
                skips=skip_budget,
                sent=sent,
            )
            if per_attempt is not None:
                # The attempt's own end: the pool's timeouts read it (a pool
                # that may ignore them gets it as a scope around the send).
                picked_at = now()
                cutoff = picked_at + per_attempt
                if timeouts is not None:
                    timeouts.deadline = cutoff if cutoff < deadline else deadline
                if not self._pool_enforces:
                    attempt.cutoff = cutoff
            try:
                if not (fast and balance.ready_nowait(picked_at)):
                    own = self._own(deadline, own)
                    await _ready(streaming, route, budget, own, attempts)
                    picked_at = None
                held = balance.pick_held(attempt, picked_at)
            except SelectionError:
                # The pool changed between reconciling and selection: pick again
                # (the evidence view above says when nothing is left).
                fast = False
                continue
            # The instance service's checks (skip, scheme, evidence, currency),
            # the request built for the instance and the hand-over to the pool,
            # with no await in between; the pick's load guard stays open in
            # ``held`` until the response body is closed.
            declined: CallDeclined | None = None
            cause: Exception | None = None
            try:
                instance = cast("InstanceService", held.response.service).admit(attempt, picked_at)
            except CallDeclined as exc:
                held.cancel()  # nothing was sent
                declined = exc
            else:
                made, host = url(scheme, instance, raw_path)
                outgoing = _rebuild(request, made, host, extensions)
                try:
                    if mock is not None:
                        response = await _answer_inline(
                            mock, outgoing, deadline if attempt.cutoff is None else cutoff
                        )
                    elif attempt.cutoff is None:
                        response = await pool.handle_async_request(outgoing)
                    else:
                        response = await _within(
                            pool.handle_async_request(outgoing), outgoing, attempt.cutoff
                        )
                except Exception as exc:
                    held.complete(failed=True)
                    cause = exc
                except BaseException:
                    held.cancel()
                    raise
            # Errors are raised outside the except blocks so each keeps its own chain.
            if declined is not None:
                reason = declined.__cause__
                if isinstance(reason, EvidenceUnavailable | InstanceSchemeMismatch):
                    if not attempts:
                        route.count_failure(NO_ENDPOINT)
                    raise reason
                # Skipped, or withdrawn since it was selected: nothing was sent.
                skip_budget = attempt.skips if _untried_listed(route, tried) else 0
                fast = False
                continue
            if cause is not None:
                attempts += 1
                key = held.key
                route.count_failure(failure_kind(cause), key)
                if tried is _NONE_TRIED:
                    tried = set()
                tried.add(instance.identity)
                skip_budget = _skip_budget(route, tried, len(balance))
                if not isinstance(cause, httpx.TransportError):
                    raise cause
                _name_instance(cause, route, key, instance)
                at = now()
                if isinstance(cause, httpx.TimeoutException) and at >= deadline:
                    # The pool's timeout was the budget's end, not a phase limit.
                    raise budget.exceeded(route, attempts) from cause
                if errors is None:
                    errors = []
                errors.append(cause)
                nothing_sent = isinstance(cause, _NOTHING_SENT)
                step = retry_step(
                    _rules(options),
                    Failure.NOTHING_SENT if nothing_sent else Failure.TRANSPORT,
                    retryable=_retryable(request),
                    attempts=attempts,
                    transparent=transparent,
                    listed=len(route.identities()) if nothing_sent else 0,
                    untried=nothing_sent and _untried_listed(route, tried),
                    timed_out=isinstance(cause, httpx.TimeoutException),
                    now=at,
                    cutoff=cutoff,
                    deadline=deadline,
                    withdraw=route.balancing.may_retry,
                )
                if step is Step.TRANSPARENT:
                    # No byte reached a server: safe for any method, and not
                    # one of the request's attempts.
                    transparent += 1
                    logger.debug(
                        "%s/%s: %s before anything was sent; retrying elsewhere",
                        route.connection,
                        route.service,
                        type(cause).__name__,
                    )
                    fast = False
                    continue
                if step is Step.RETRY:
                    logger.debug(
                        "%s/%s: attempt %d failed with %s; retrying",
                        route.connection,
                        route.service,
                        attempts,
                        type(cause).__name__,
                    )
                    fast = False
                    continue
                raise cause
            attempts += 1
            status = response.status_code
            if (
                status in RETRYABLE_STATUS
                and retry_step(
                    _rules(options),
                    Failure.STATUS,
                    retryable=_retryable(request),
                    attempts=attempts,
                    transparent=transparent,
                    listed=0,
                    untried=False,
                    timed_out=False,
                    now=now(),
                    cutoff=cutoff,
                    deadline=deadline,
                    withdraw=route.balancing.may_retry,
                )
                is Step.RETRY
            ):
                if tried is _NONE_TRIED:
                    tried = set()
                tried.add(instance.identity)
                skip_budget = _skip_budget(route, tried, len(balance))
                route.count_failure(STATUS, instance.identity)
                try:
                    await _close(response, None if mock is None else deadline)
                finally:
                    held.complete(failed=True)
                fast = False
                continue
            at = now()
            if at > deadline and self._own(deadline, own):
                # A pool bounds each wait by what was left when it began; a
                # response that trickled in past the budget is not returned.
                route.count_failure(TIMEOUT, instance.identity)
                try:
                    await _close(response, None if mock is None else deadline)
                finally:
                    held.complete(failed=True)
                raise budget.exceeded(route, attempts)
            if timeouts is not None:
                # The headers are in: reading the body is the caller's business,
                # bounded per operation by the httpx timeout as with plain
                # httpx; the REST client reads it within the call's budget (the
                # attempt timeout covers the way to the headers only).
                rest = extensions.get(BUDGET_EXTENSION) is budget
                timeouts.deadline = deadline if rest else math.inf
            if status >= 500:
                route.count_failure(STATUS, instance.identity)
            response = _wrap(response, held, instance, route)
            if start is not None:
                route.observe_call(0 if status < 500 else _STATUS_OUTCOME, at - start)
            return response

    def _target(self, request: httpx.Request) -> _Target:
        # Parsing the service and path out of a nadisc:// URL, once per
        # distinct (qualifier, URL): services use few distinct paths. The key
        # is the whole parsed URL (scheme, user info, host, port, path,
        # query), so a hit was validated when it was stored.
        qualifier = request.extensions.get(QUALIFIER_EXTENSION)
        if qualifier is not None and type(qualifier) is not str:
            return _target(request)  # refused there: not a connection name
        url = request.url
        key = (qualifier, url._uri_reference if _URL_REFERENCE else str(url))
        targets = self._targets
        target = targets.get(key)
        if target is None:
            target = _target(request)
            if len(targets) >= _URL_CACHE:
                targets.clear()
            targets[key] = target
        return target

    def _url(self, scheme: str, instance: Instance, raw_path: bytes) -> tuple[httpx.URL, bytes]:
        # Parsing a URL is the largest cost of rewriting a request; services
        # use few distinct paths, so a small bounded cache pays off. The
        # instance's Host header value is kept with it.
        key = (scheme, instance.host, instance.port, raw_path)
        urls = self._urls
        made = urls.get(key)
        if made is None:
            if len(urls) >= _URL_CACHE:
                urls.clear()
            made = urls[key] = (
                httpx.URL(scheme=scheme, host=instance.host, port=instance.port, raw_path=raw_path),
                instance.address.encode("ascii"),
            )
        return made

    # -- closing -------------------------------------------------------------------------

    async def aclose(self) -> None:
        """Close every route (their endpoints retire as calls end), close an owned pool.

        Idempotent; later requests raise :class:`~nadisc.LifecycleError`.
        The closed routes stay readable (:meth:`route`, :meth:`routes`):
        closing the httpx client that mounted the transport closes it, and
        the caller keeps its final statistics.
        """
        if self._closed:
            return
        self._closed = True
        routes = list(self._routes.values())
        for route in routes:
            route.close()
        if self._owns_pool:
            with anyio.CancelScope(shield=True), anyio.move_on_after(_SHUTDOWN_GRACE):
                await self._pool.aclose()

    async def __aenter__(self) -> DiscoveryTransport:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc_value: BaseException | None = None,
        traceback: TracebackType | None = None,
    ) -> None:
        await self.aclose()


#: Transport errors raised before any byte of the request was written.
_NOTHING_SENT = (httpx.ConnectError, httpx.ConnectTimeout)


def _rules(options: RestOptions) -> RetryRules:
    return RetryRules(
        max_attempts=options.max_attempts,
        on_connect_failure=options.retry_on_connect_failure,
        on_transport_error=options.retry_get_head_on_transport_error,
        on_retryable_status=options.retry_get_head_on_retryable_status,
    )


class _Loop:
    """The running loop's clock, effective deadline and cancel scope, resolved once.

    The same values as anyio's ``current_time``, ``current_effective_deadline``
    and ``CancelScope``, without anyio's per-call backend lookup; on trio the
    clock is the run's own clock object (one call per read instead of three).
    """

    __slots__ = ("effective_deadline", "now", "scope")

    def __init__(self) -> None:
        self.scope: Callable[..., AbstractContextManager[object]]
        self.now: Callable[[], float] = run_clock()
        self.effective_deadline: Callable[[], float]
        if sniffio.current_async_library() == "trio":
            import trio

            self.effective_deadline = trio.current_effective_deadline
            self.scope = trio.CancelScope
        else:
            self.effective_deadline = anyio.current_effective_deadline
            # The running backend's own class (a subclass of anyio.CancelScope):
            # built directly, it skips anyio's backend lookup per scope.
            self.scope = type(anyio.CancelScope())


async def _within(
    answer: Awaitable[httpx.Response], request: httpx.Request, at: float
) -> httpx.Response:
    # A send that may wait, bounded by ``at`` (the attempt timeout or the
    # call's budget) for a pool that may ignore the timeout extension.
    with anyio.move_on_at(at):
        return await answer
    raise httpx.ReadTimeout(
        "no response within the attempt timeout or the call's budget", request=request
    )


async def _answer_inline(
    pool: httpx.MockTransport, request: httpx.Request, at: float
) -> httpx.Response:
    # What httpx.MockTransport.handle_async_request does, bounded only where
    # it can wait: a body not yet in memory, an async handler's answer (a
    # synchronous handler cannot wait, and costs no cancel scope).
    if not hasattr(request, "_content"):
        return await _within(pool.handle_async_request(request), request, at)
    answer = pool.handler(request)
    if isinstance(answer, httpx.Response):
        return answer
    return await _within(answer, request, at)


async def _close(response: httpx.Response, bound: float | None) -> None:
    # A refused response closed before the call goes on; ``bound`` where
    # nothing else bounds the close (the mock pool's calls have no scope
    # around the whole call: a handler's streamed body may wait to close).
    if bound is None:
        await response.aclose()
        return
    with anyio.move_on_at(bound):
        await response.aclose()


def _retryable(request: httpx.Request) -> bool:
    # GET and HEAD with a body that can be sent again.
    return request.method in _RETRYABLE_METHODS and _replayable(request)


def _name_instance(
    error: Exception, route: Route, key: object, instance: Instance | None = None
) -> None:
    """Put the instance into ``error``'s message (httpx leaves some empty). Idempotent."""
    where = f"instance {str(key)!r}"
    if instance is not None:
        where += f" ({instance.address})"
    where += f" of {route.connection}/{route.service}"
    text = str(error)
    if text.startswith(where):
        return
    error.args = (f"{where}: {text or type(error).__name__}", *error.args[1:])


def _untried_listed(route: Route, tried: set[str]) -> bool:
    return any(identity not in tried for identity in route.identities())


def _skip_budget(route: Route, tried: set[str], size: int) -> int:
    # Declines allowed for tried instances: none when every listed instance
    # was tried; otherwise a bound, so a policy that keeps preferring a tried
    # instance ends up retrying it rather than spinning.
    return 4 * size + 16 if _untried_listed(route, tried) else 0


def _with_host(raw: list[tuple[bytes, bytes]], host: bytes) -> httpx.Headers:
    # The caller's headers with the instance's Host, built from the raw list
    # in one pass (no lookup by name).
    headers = [(b"Host", host)]
    headers.extend(item for item in raw if item[0].lower() != b"host")
    return httpx.Headers(headers)


def _wrap(
    response: httpx.Response, held: Held[Any], instance: Instance, route: Route
) -> httpx.Response:
    response.extensions[INSTANCE_EXTENSION] = instance
    failed = response.status_code >= 500
    if response.is_closed:
        # A pool that hands back a body already in memory: the call is over.
        held.complete(failed=failed)
        return response
    stream = response.stream
    if not isinstance(stream, httpx.AsyncByteStream):
        held.complete(failed=True)
        if not failed:
            route.count_failure(OTHER, instance.identity)
        raise TypeError(f"the pool returned a {type(stream).__name__} body, not an async one")
    # The pool's response is ours until returned: swap its body for the
    # guarded one rather than building a second response.
    response.stream = _GuardedStream(stream, held, failed, route)
    return response
