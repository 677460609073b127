"""Exceptions raised by nadisc.

::

    DiscoveryError
    ├── ConfigError             invalid config; ``.path`` names the field
    ├── ProviderNotFound        unknown provider name (says what to install)
    ├── QualifierError          no such connection / no ``primary`` / zero connections
    ├── UnknownService          service alias not bound on that connection
    ├── DeadlineExceeded        the caller's own deadline passed (also for NaN/past deadlines)
    ├── LifecycleError          wrong phase (publish before freeze, use after close...)
    ├── PrepareError            a startup-required connection could not come up (also
    │                           one a startup-required registration publishes on)
    ├── EvidenceUnavailable     the observation has no evidence usable now
    │                           (``.reason``: stale, revoked, empty, invalid, closed, capacity,
    │                           weak: a strict read of weaker evidence)
    ├── CapacityExceeded        a configured limit refused the work (``.limit``)
    ├── ProviderFailure         typed outcome of one provider operation
    │   ├── IncompleteSnapshot  transport/paging/decoding incomplete: grace may apply
    │   ├── InvalidSnapshot     confirmed invalid candidates: no grace
    │   ├── IdentityRevoked     authentication/permission revoked: no grace
    │   ├── CapacityRejected    the response exceeded a byte/instance limit
    │   ├── OutcomeUnknown      a write whose remote effect cannot be known
    │   │   └── RenewalOutcomeUnknown  (in nadisc._provider) a lost renewal that
    │   │                           cannot create a record (a TTL pass, a light beat)
    │   ├── LeaseLost           the registry no longer holds our registration
    │   └── RegistrationRejected  the registry refused a write definitively
    ├── RegistrationError       a registration plan is invalid, or a startup-required
    │                           registration failed for good (``.registration``, ``.path``)
    └── CallError               a call through discovery failed; also an ``httpx.RequestError``
        ├── CallQualifierError      (QualifierError)       httpx.RequestError
        ├── CallUnknownService      (UnknownService)       httpx.RequestError
        ├── CallLifecycleError      (LifecycleError)       httpx.RequestError
        ├── CallCapacityExceeded    (CapacityExceeded)     httpx.RequestError
        ├── CallEvidenceUnavailable (EvidenceUnavailable)  httpx.TransportError
        └── CallTimeout             (DeadlineExceeded)     httpx.TimeoutException
                                    ``.limit``/``.seconds``: which limit ran out

The ``Call*`` classes are what a request sent through the discovery transport
(and the REST client) raises in place of the nadisc error in parentheses: an
instance is both that nadisc error and the httpx error, so ``except
httpx.HTTPError`` and ``except nadisc.UnknownService`` both catch it, and the
original error is its ``__cause__``. :func:`for_call` makes one from any
nadisc error.

Errors from httpx, dnspython, json and pydantic are translated at the boundary
and chained as ``__cause__``. Messages never contain secrets.
"""

from __future__ import annotations

import httpx

__all__ = [
    "CallCapacityExceeded",
    "CallError",
    "CallEvidenceUnavailable",
    "CallLifecycleError",
    "CallQualifierError",
    "CallTimeout",
    "CallUnknownService",
    "CapacityExceeded",
    "CapacityRejected",
    "ConfigError",
    "DeadlineExceeded",
    "DiscoveryError",
    "EvidenceUnavailable",
    "IdentityRevoked",
    "IncompleteSnapshot",
    "InvalidSnapshot",
    "LeaseLost",
    "LifecycleError",
    "OutcomeUnknown",
    "PrepareError",
    "ProviderFailure",
    "ProviderNotFound",
    "QualifierError",
    "RegistrationError",
    "RegistrationRejected",
    "UnknownService",
    "for_call",
    "relative_deadline_hint",
]


class DiscoveryError(Exception):
    """Root of every exception nadisc raises on purpose."""


class ConfigError(DiscoveryError, ValueError):
    """The configuration is invalid. ``path`` is dotted, e.g.
    ``discovery.connections.business.provider``.

    ``problems`` lists every ``(path, message)`` found in the document (the
    first one is ``path``/``detail``), so a host can show them all at once.
    """

    def __init__(
        self, path: str, message: str, *, problems: tuple[tuple[str, str], ...] = ()
    ) -> None:
        if not problems:
            problems = ((path, message),)
        text = f"{path}: {message}"
        if len(problems) > 1:
            text += "".join(f"; also {p}: {m}" for p, m in problems[1:])
        super().__init__(text)
        self.path = path
        self.detail = message
        self.problems = problems


class ProviderNotFound(ConfigError):
    """No provider is installed under the requested name."""


class QualifierError(DiscoveryError, KeyError):
    """The requested connection (qualifier) cannot be selected.

    A :class:`KeyError` (and so a :class:`LookupError`), so mappings of
    connections such as :class:`~nadisc.RestClients` keep the mapping
    protocol: ``name in clients`` is False and ``clients.get(name)`` is None
    for a name that is not configured. Its message is the plain text
    (KeyError would quote it).
    """

    __str__ = BaseException.__str__


class UnknownService(DiscoveryError, LookupError):
    """The service alias is not bound on the selected connection."""


class DeadlineExceeded(DiscoveryError, TimeoutError):
    """The caller's deadline passed (or was already past, or was not a number)."""


class LifecycleError(DiscoveryError, RuntimeError):
    """The owner is in the wrong phase for this operation."""


class PrepareError(DiscoveryError):
    """A startup-required connection failed to prepare. ``connection`` names it."""

    def __init__(self, connection: str, message: str) -> None:
        super().__init__(f"connection {connection!r}: {message}")
        self.connection = connection


class EvidenceUnavailable(DiscoveryError):
    """The observation holds no evidence that may be used now."""

    def __init__(self, message: str, *, reason: str) -> None:
        super().__init__(message)
        self.reason = reason


class CapacityExceeded(DiscoveryError):
    """A configured limit refused the work. ``limit`` is the config key."""

    def __init__(self, limit: str, message: str) -> None:
        super().__init__(f"{limit}: {message}")
        self.limit = limit


class ProviderFailure(DiscoveryError):
    """A typed outcome of one provider operation."""


class IncompleteSnapshot(ProviderFailure):
    """The listing could not be completed (transport, timeout, paging, decoding)."""


class InvalidSnapshot(ProviderFailure):
    """The registry answered with candidates confirmed to be invalid."""


class IdentityRevoked(ProviderFailure):
    """The connection's identity or permission was revoked or trimmed."""


class CapacityRejected(ProviderFailure):
    """The response exceeded a configured byte or instance limit."""


class OutcomeUnknown(ProviderFailure):
    """A write timed out or lost its answer: it may still take effect remotely."""


class LeaseLost(ProviderFailure):
    """The registry no longer holds the registration (lease expired, 20404...)."""


class RegistrationRejected(ProviderFailure):
    """The registry definitively refused a registration write."""


class RegistrationError(DiscoveryError, ValueError):
    """A registration plan is invalid. Names the registration and config path."""

    def __init__(self, registration: str, message: str, *, path: str | None = None) -> None:
        where = f"registration {registration!r}"
        if path:
            where += f" ({path})"
        super().__init__(f"{where}: {message}")
        self.registration = registration
        self.path = path


# -- calls through discovery (httpx-facing) ------------------------------------------------


class CallError(DiscoveryError, httpx.RequestError):
    """A request through discovery failed: a nadisc error that is also an ``httpx.RequestError``.

    httpx attaches the request (``.request``) as the error leaves the client.
    Subclasses add the specific nadisc type, so a handler written for either
    library catches it.
    """

    # httpx.RequestError.__init__ is not part of this chain: the attribute
    # its ``request`` property reads starts unset, as httpx's own errors do.
    _request: httpx.Request | None = None

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)


class CallQualifierError(CallError, QualifierError):
    """:class:`QualifierError` of a call (also an ``httpx.RequestError``)."""


class CallUnknownService(CallError, UnknownService):
    """:class:`UnknownService` of a call (also an ``httpx.RequestError``)."""


class CallLifecycleError(CallError, LifecycleError):
    """:class:`LifecycleError` of a call (also an ``httpx.RequestError``)."""


class CallCapacityExceeded(CallError, CapacityExceeded):
    """:class:`CapacityExceeded` of a call (also an ``httpx.RequestError``)."""

    def __init__(self, limit: str, message: str) -> None:
        CallError.__init__(self, f"{limit}: {message}")
        self.limit = limit


class CallEvidenceUnavailable(CallError, EvidenceUnavailable, httpx.TransportError):
    """:class:`EvidenceUnavailable` of a call (also an ``httpx.TransportError``).

    Nothing was sent: no instance may be used now (``reason``).
    """

    def __init__(self, message: str, *, reason: str) -> None:
        CallError.__init__(self, message)
        self.reason = reason


class CallTimeout(CallError, DeadlineExceeded, httpx.TimeoutException):
    """The budget of a call ran out (also an ``httpx.TimeoutException``).

    ``limit`` names the limit that ran out: ``"rest.request_timeout"`` (the
    connection's REST budget), ``"httpx timeout"`` (the client's or the
    request's httpx timeout), ``"nadisc.deadline"`` (the request extension);
    ``None`` for a deadline refused before the call started. ``seconds`` is
    that limit's value: the budget in seconds (for ``nadisc.deadline``, the
    seconds it left when the call started).
    """

    def __init__(
        self, message: str, *, limit: str | None = None, seconds: float | None = None
    ) -> None:
        CallError.__init__(self, message)
        self.limit = limit
        self.seconds = seconds


_CALL_TYPES: tuple[tuple[type[DiscoveryError], type[CallError]], ...] = (
    (QualifierError, CallQualifierError),
    (UnknownService, CallUnknownService),
    (LifecycleError, CallLifecycleError),
    (CapacityExceeded, CallCapacityExceeded),
    (EvidenceUnavailable, CallEvidenceUnavailable),
    (DeadlineExceeded, CallTimeout),
)


def for_call(error: DiscoveryError) -> CallError:
    """The httpx-facing form of ``error`` (see the table in the module docstring).

    A :class:`CallError` is returned as is. Otherwise a new error of the
    matching ``Call*`` class (plain :class:`CallError` for any other nadisc
    error) with the same message and attributes; raise it ``from error``.
    """
    if isinstance(error, CallError):
        return error
    cls: type[CallError] = CallError
    for base, call_cls in _CALL_TYPES:
        if isinstance(error, base):
            cls = call_cls
            break
    made = cls.__new__(cls)
    Exception.__init__(made, *error.args)
    made.__dict__.update(error.__dict__)
    if cls is CallTimeout:
        made.__dict__.setdefault("limit", None)
        made.__dict__.setdefault("seconds", None)
    return made


#: A deadline this far in the past was most likely meant as a duration.
RELATIVE_HINT_AFTER = 60.0


def relative_deadline_hint(deadline: float, now: float) -> str:
    """A hint for a deadline that looks like a duration (``""`` when it does not).

    Deadlines in nadisc are absolute event-loop times; one that passed more
    than a minute ago (``observe(service, 2)``) was most likely meant as
    ``anyio.current_time() + 2``.
    """
    if now - deadline <= RELATIVE_HINT_AFTER:
        return ""
    shown = f"{deadline:g}"
    return (
        f" (deadlines are absolute: anyio.current_time() + {shown}, not {shown}, "
        f"for {shown} s from now)"
    )
