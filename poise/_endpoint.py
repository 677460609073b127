"""One balanced member: identity, weight, eligibility, service and load tracker.

An :class:`Endpoint` owns three durable values, as in the dispatch contract:

* candidate metadata: ``key`` (stable identity, hashable), ``weight``
  (finite, > 0), ``eligible`` (administrative or health eligibility) and an
  opaque ``metadata`` value;
* the ``service`` that is polled for readiness and called;
* the load ``tracker`` (default :class:`~poise.InFlight`), the *only* source
  of the load a policy sees through :meth:`Endpoint.load`: the metric
  describes the service instance that actually receives the call.

Readiness is tracked per endpoint by the :class:`~poise.Balance` that holds
it::

    IDLE ──poll_ready() -> True──► READY ──selected by call()──► IDLE
      │  ▲                           │
      │  └── invalidated ────────────┘   (service replaced, endpoint_mut(),
      │                                   eligible = False, removal)
      └──poll_ready() raised──► FAILED ──balance.reset()──► IDLE

A READY endpoint holds a reservation in its service; whenever the balance
drops that state without a call, it returns the reservation through the
service's optional ``release_reservation()`` hook. An endpoint belongs to at
most one balance at a time; one that enters a balance always starts IDLE.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Hashable
from typing import TYPE_CHECKING, Generic, TypeVar

from ._errors import InvalidInput
from ._load import InFlight
from ._peak_ewma import row_of
from ._protocols import LoadTracker, Service
from ._service import ServiceFn

if TYPE_CHECKING:
    from ._balance import Balance

__all__ = ["Endpoint", "ReadinessState"]

Req = TypeVar("Req")
Resp = TypeVar("Resp")


class ReadinessState(enum.Enum):
    """Where an endpoint is in the readiness lifecycle."""

    IDLE = "idle"
    """Not known to be ready; polled by the next readiness scan if eligible."""
    READY = "ready"
    """``poll_ready`` returned True; a reservation is held until selected."""
    FAILED = "failed"
    """``poll_ready`` raised; quarantined until an explicit reset."""


IDLE = ReadinessState.IDLE
READY = ReadinessState.READY
FAILED = ReadinessState.FAILED


def check_service(service: object) -> None:
    """``InvalidInput`` unless ``service`` has callable ``poll_ready`` and ``call``."""
    missing = [
        name for name in ("poll_ready", "call") if not callable(getattr(service, name, None))
    ]
    if missing:
        raise InvalidInput(
            f"endpoint service must have poll_ready() and call(); a "
            f"{type(service).__name__} lacks {' and '.join(missing)}()"
        )


def check_weight(weight: object) -> float:
    """``weight`` as a float if it is a finite number > 0, else ``InvalidInput``."""
    if isinstance(weight, bool) or not isinstance(weight, int | float):
        raise InvalidInput(f"endpoint weight must be a number, got {type(weight).__name__}")
    value = float(weight)
    if not math.isfinite(value) or value <= 0.0:
        raise InvalidInput(f"endpoint weight must be finite and > 0, got {weight!r}")
    return value


def _steady(service: object) -> bool:
    """True when ``service``'s readiness is :class:`~poise.ServiceFn`'s own.

    Such a service is always ready and reserves nothing, so a call leaves it
    READY: a re-poll could only answer True again.
    """
    return getattr(type(service), "poll_ready", None) is ServiceFn.poll_ready and (
        "poll_ready" not in getattr(service, "__dict__", ())
    )


class Endpoint(Generic[Req, Resp]):
    """A balanced member. Satisfies the :class:`~poise.Weighted` protocol.

    ``weight``, ``eligible``, ``metadata`` and ``service`` may be changed in
    place while the endpoint is in a balance:

    * ``eligible = False`` takes effect at once: a READY endpoint gives its
      reservation back and becomes IDLE, and readiness scans skip it until it
      is eligible again (draining). Calls already dispatched are unaffected.
    * assigning ``service`` (anything with ``poll_ready`` and ``call``,
      else :class:`~poise.InvalidInput`) gives the old service's reservation back (a
      READY endpoint becomes IDLE); a FAILED endpoint stays FAILED until
      reset.
    """

    __slots__ = (
        "_call",
        "_ejected",
        "_eligible",
        "_error",
        "_index",
        "_key",
        "_listed",
        "_metadata",
        "_owner",
        "_parked",
        "_row",
        "_service",
        "_slot",
        "_state",
        "_steady",
        "_tracker",
        "_wake",
        "_wakes",
        "_weight",
        "load",
    )

    load: Callable[[float], float]
    """The tracker's ``load(now)``: what load-aware policies compare.

    Bound to the tracker once (the tracker never changes), so a policy's
    read costs one call.
    """

    def __init__(
        self,
        key: Hashable,
        service: Service[Req, Resp],
        *,
        weight: float = 1.0,
        eligible: bool = True,
        metadata: object = None,
        tracker: LoadTracker | None = None,
    ) -> None:
        try:
            hash(key)
        except TypeError as exc:
            raise InvalidInput(f"endpoint key must be hashable, got {type(key).__name__}") from exc
        check_service(service)
        self._key = key
        self._weight = check_weight(weight)
        self._eligible = bool(eligible)
        self._metadata = metadata
        self._service = service
        self._steady = _steady(service)
        # What Balance.dispatch awaits for a steady service (None: any other),
        # and the tracker's row it picks on (None: a tracker without one);
        # see poise._flat. _call sorts first among the slots, so it shares
        # the object's first cache line with the reference count.
        self._call = service.call if self._steady else None
        self._tracker: LoadTracker = InFlight() if tracker is None else tracker
        self._row = row_of(self._tracker)
        self.load = self._tracker.load
        self._state = IDLE
        self._error: Exception | None = None
        self._owner: Balance[Req, Resp] | None = None
        # Position in the owner's endpoint list and in its idle list.
        self._index = -1
        self._slot = -1
        self._listed = False
        # Kept by the owning balance: this endpoint's own wake function (made
        # when it joins a balance), how many times it fired, the sequence
        # number of its parking while it waits for one (-1: not parked), and
        # whether an outlier detector has ejected it.
        self._wake: Callable[[], None] | None = None
        self._wakes = 0
        self._parked = -1
        self._ejected = False

    def with_tracker(self, tracker: LoadTracker) -> Endpoint[Req, Resp]:
        """A new, detached, IDLE endpoint equal to this one but with ``tracker``."""
        return Endpoint(
            self._key,
            self._service,
            weight=self._weight,
            eligible=self._eligible,
            metadata=self._metadata,
            tracker=tracker,
        )

    # -- identity, weight, load (the Weighted protocol) --------------------

    @property
    def key(self) -> Hashable:
        return self._key

    @property
    def weight(self) -> float:
        return self._weight

    @weight.setter
    def weight(self, value: float) -> None:
        self._weight = check_weight(value)

    @property
    def tracker(self) -> LoadTracker:
        return self._tracker

    # -- eligibility, metadata, service -------------------------------------

    @property
    def eligible(self) -> bool:
        return self._eligible

    @eligible.setter
    def eligible(self, value: bool) -> None:
        value = bool(value)
        if value == self._eligible:
            return
        self._eligible = value
        owner = self._owner
        if owner is not None:
            owner._eligibility_changed(self)

    @property
    def metadata(self) -> object:
        return self._metadata

    @metadata.setter
    def metadata(self, value: object) -> None:
        self._metadata = value

    @property
    def service(self) -> Service[Req, Resp]:
        return self._service

    @service.setter
    def service(self, value: Service[Req, Resp]) -> None:
        check_service(value)
        owner = self._owner
        if owner is not None:
            owner._invalidate(self)
        self._service = value
        self._steady = _steady(value)
        self._call = value.call if self._steady else None
        if owner is not None:
            owner.wake()

    # -- readiness (maintained by the owning balance) ----------------------

    @property
    def state(self) -> ReadinessState:
        return self._state

    @property
    def error(self) -> Exception | None:
        """The readiness error that quarantined this endpoint (FAILED only)."""
        return self._error

    @property
    def ejected(self) -> bool:
        """True while the balance's outlier detector keeps this endpoint out."""
        return self._ejected

    @property
    def index(self) -> int | None:
        """Position in the owning balance now, or None when detached."""
        return self._index if self._owner is not None else None

    def __repr__(self) -> str:
        flags = ("" if self._eligible else " ineligible") + (" ejected" if self._ejected else "")
        return (
            f"<Endpoint key={self._key!r} weight={self._weight:g} state={self._state.value}{flags}>"
        )
