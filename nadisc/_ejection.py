"""Passive outlier ejection of a calling route, independent of the transport.

A route (the HTTP transport's, or any other caller built on a
:class:`poise.DiscoveryBalance`) keeps an instance whose attempts keep
failing out of its balance for a while, with a :class:`poise.OutlierDetector`
as the decision core (synchronous, time passed in). This module holds what
every caller shares:

* :class:`EjectionOptions`: the validated rules (the ``rest.outlier`` block,
  in seconds), and :meth:`EjectionOptions.detector` to make one detector
  per route;
* :class:`EjectionLog`: the route's record of ejections and returns (the
  detector's observer), which the statistics and the observer read.

What counts is decided where the attempts end: a completed attempt is
evidence (a connection failure, a timeout, including an attempt timeout, and
a failure status complete it as failed; a response that is not a failure
completes it as a success); a declined pick (nothing sent) and a call its
caller cancelled are no evidence. A caller other than HTTP decides its own
failure statuses and feeds them the same way (``Held.complete(failed=...)``,
or by raising from its service).

* :class:`RouteDetector`: the detector of a route, which a caller may ask
  to end one ejection early (:meth:`RouteDetector.reinstate`): the gRPC
  discovery channel does so for an instance taken out because it could not
  be reached, once a connection to it succeeds again.

Defaults (on, as failure accrual is in Linkerd and Finagle): five failed
attempts in a row eject an instance for 10 s, the k-th ejection in a row
lasts k x 10 s up to 300 s, and at most half of the listed instances are out
at once, rounded down (one of two or three, none of one). When nothing
usable would be left, the ejections are lifted.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from poise import InvalidInput, OutlierDetector, OutlierEvent

from ._config import OutlierConfig
from ._errors import ConfigError

__all__ = ["EjectionLog", "EjectionOptions", "RouteDetector"]


@dataclass(frozen=True, slots=True)
class EjectionOptions:
    """The ejection rules of one connection's callers. Frozen, validated.

    ``consecutive_failures`` and ``failure_rate`` (a fraction, 0-1) may each
    be ``None`` (rule off), not both. Times are in seconds. Bad values raise
    :class:`~nadisc.ConfigError` naming ``rest.outlier``.
    """

    consecutive_failures: int | None = 5
    failure_rate: float | None = None
    window: float = 10.0
    minimum_calls: int = 10
    base_ejection_time: float = 10.0
    max_ejection_time: float = 300.0
    max_ejection_percent: float = 50.0

    def __post_init__(self) -> None:
        try:
            self.detector()
        except InvalidInput as exc:
            raise ConfigError("rest.outlier", str(exc)) from None

    def detector(self, observer: EjectionLog | None = None) -> RouteDetector:
        """A new detector with these rules (one per route), reporting to ``observer``."""
        return RouteDetector(
            consecutive_failures=self.consecutive_failures,
            failure_rate=self.failure_rate,
            window=self.window,
            minimum_calls=self.minimum_calls,
            base_ejection_time=self.base_ejection_time,
            max_ejection_time=self.max_ejection_time,
            max_ejection_percent=self.max_ejection_percent,
            observer=observer,
        )

    @classmethod
    def from_config(cls, config: OutlierConfig) -> EjectionOptions | None:
        """The rules of a ``rest.outlier`` block (``None`` when it is switched off)."""
        if not config.enabled:
            return None
        return cls(
            consecutive_failures=config.consecutive_failures or None,
            failure_rate=(config.failure_rate_percent / 100.0) or None,
            window=config.window_ms / 1000.0,
            minimum_calls=config.minimum_calls,
            base_ejection_time=config.base_ejection_ms / 1000.0,
            max_ejection_time=config.max_ejection_ms / 1000.0,
            max_ejection_percent=float(config.max_ejection_percent),
        )


@dataclass(slots=True)
class EjectionLog:
    """A route's ejection record: called by its detector for every event.

    ``ejections`` counts ejections since the route opened, ``returns`` the
    ends of ejections; ``last`` is the latest event per instance identity.
    ``listener``, when set, is called with every event after it is counted
    (synchronously, in the detector's call; it must not raise).
    O(1) per event.
    """

    ejections: int = 0
    returns: int = 0
    last: dict[str, OutlierEvent] = field(default_factory=dict)
    listener: Callable[[OutlierEvent], None] | None = None

    def __call__(self, event: OutlierEvent) -> None:
        if event.ejected:
            self.ejections += 1
        else:
            self.returns += 1
        self.last[str(event.key)] = event
        if self.listener is not None:
            self.listener(event)


#: The reason of a return :meth:`RouteDetector.reinstate` asked for.
RECONNECTED = "reconnected"


class RouteDetector(OutlierDetector):
    """An :class:`~poise.OutlierDetector` one of whose ejections may end early.

    :meth:`reinstate` (the detector's own, with the reason
    ``"reconnected"``) marks an ejected key; the balance's next scan (every
    pick scans) ends its ejection. The key then starts over as a new
    member: clean counters, and its next ejection lasts the base time
    again, as gRPC resets a subchannel's backoff once a connection
    succeeds; the other ejections keep their duration. No cost per pick:
    the early return is one more entry in the detector's expiry heap.
    """

    __slots__ = ()

    def reinstate(self, key: Hashable, now: float, reason: str = RECONNECTED) -> bool:
        """End the ejection of ``key`` at the next scan from ``now`` (False: not ejected)."""
        return super().reinstate(key, now, reason)

    def __repr__(self) -> str:
        return super().__repr__().replace("<OutlierDetector", "<RouteDetector", 1)
