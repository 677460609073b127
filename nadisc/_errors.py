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
    │   ├── LeaseLost           the registry no longer holds our registration
    │   └── RegistrationRejected  the registry refused a write definitively
    └── RegistrationError       a registration plan is invalid, or a startup-required
                                registration failed for good (``.registration``, ``.path``)

Errors from httpx, dnspython, json and pydantic are translated at the boundary
and chained as ``__cause__``. Messages never contain secrets.
"""

from __future__ import annotations

__all__ = [
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


class QualifierError(DiscoveryError, LookupError):
    """The requested connection (qualifier) cannot be selected."""


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
