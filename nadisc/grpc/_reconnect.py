"""Reconnect attempts to an instance taken out because it could not be reached.

Contract: an instance of a discovery channel that the route's outlier
detector ejects while its subchannel has no connection up (refused, reset,
or the server's SETTINGS never came) was taken out because it could not be
reached, not for its answers. The channel then tries to connect to it again,
on gRPC's connection backoff (``doc/connection-backoff.md``: 1 s initial,
x1.6, +/-20 % jitter, capped at 120 s), and ends its ejection as soon as an
attempt succeeds (the server's SETTINGS in, and the health probe SERVING
when one is configured). An instance ejected for its answers keeps the
whole ejection.

The decisions are synchronous, with the time and the random draw passed in
(:class:`ConnectBackoff`, :class:`ReconnectSchedule`); the attempts run in
tasks of the discovery channel's task group, one per unreachable instance,
cancelled when its ejection ends and by the channel's close.

Per ejected identity::

    (ejected, unreachable) ──► WAITING ──due──► CONNECTING ──ok──► reinstated
                                  ▲                 │
                                  └──── failed ─────┘   (ejection ends by time: stop)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["ConnectBackoff", "ReconnectSchedule"]

#: gRPC's MIN_CONNECT_TIMEOUT: an attempt may take at least this long.
MIN_CONNECT_TIMEOUT = 20.0


@dataclass(frozen=True, slots=True)
class ConnectBackoff:
    """gRPC's connection backoff parameters (seconds). Frozen, validated."""

    initial: float = 1.0
    multiplier: float = 1.6
    jitter: float = 0.2
    maximum: float = 120.0

    def __post_init__(self) -> None:
        for name in ("initial", "multiplier", "jitter", "maximum"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"ConnectBackoff.{name} must be a number, not {value!r}")
            if not math.isfinite(value):
                raise ValueError(f"ConnectBackoff.{name} must be finite, not {value!r}")
        if self.initial <= 0 or self.maximum < self.initial:
            raise ValueError(
                f"ConnectBackoff needs 0 < initial <= maximum, got initial={self.initial!r} "
                f"maximum={self.maximum!r}"
            )
        if self.multiplier < 1.0:
            raise ValueError(f"ConnectBackoff.multiplier must be >= 1, not {self.multiplier!r}")
        if not 0.0 <= self.jitter < 1.0:
            raise ValueError(f"ConnectBackoff.jitter must be in [0, 1), not {self.jitter!r}")

    def backoff(self, failures: int) -> float:
        """The backoff after ``failures`` failed attempts, unjittered: initial x multiplier^n,
        capped at ``maximum``."""
        if failures <= 0:
            return self.initial
        # Past the cap the power no longer matters (and must not overflow).
        steps = min(failures, 1 + int(math.log(self.maximum / self.initial, self.multiplier)))
        return min(self.initial * self.multiplier**steps, self.maximum)

    def delay(self, failures: int, draw: float) -> float:
        """The jittered backoff; ``draw`` in [0, 1) (0.5: none)."""
        backoff = self.backoff(failures)
        return backoff * (1.0 + self.jitter * (2.0 * draw - 1.0))


class ReconnectSchedule:
    """When each unreachable identity is due its next connection attempt.

    Synchronous, time and draws passed in. ``start`` on an ejection of an
    unreachable instance (the first attempt one backoff later: the failures
    that ejected it were the first attempts); ``failed`` after an attempt
    that did not connect (the next one backoff after that attempt began, as
    gRPC counts it; at once when the attempt took longer); ``stop`` when it
    connected, its ejection ended, or it left the listing. O(1) each.
    """

    __slots__ = ("_backoff", "_state")

    def __init__(self, backoff: ConnectBackoff | None = None) -> None:
        self._backoff = ConnectBackoff() if backoff is None else backoff
        #: identity -> [failed attempts, due time]
        self._state: dict[str, list[float]] = {}

    @property
    def backoff(self) -> ConnectBackoff:
        return self._backoff

    def __contains__(self, identity: object) -> bool:
        return identity in self._state

    def __len__(self) -> int:
        return len(self._state)

    def identities(self) -> frozenset[str]:
        return frozenset(self._state)

    def start(self, identity: str, now: float, draw: float) -> float:
        """Begin (or begin again) the attempts to ``identity``; returns the first due time."""
        due = now + self._backoff.delay(0, draw)
        self._state[identity] = [0, due]
        return due

    def due(self, identity: str) -> float | None:
        state = self._state.get(identity)
        return None if state is None else state[1]

    def attempt_timeout(self, identity: str) -> float:
        """How long an attempt may take: max(the current backoff, MIN_CONNECT_TIMEOUT)."""
        state = self._state.get(identity)
        failures = 0 if state is None else int(state[0])
        return max(self._backoff.backoff(failures), MIN_CONNECT_TIMEOUT)

    def failed(self, identity: str, began: float, draw: float) -> float | None:
        """An attempt begun at ``began`` did not connect; the next due time (None: stopped)."""
        state = self._state.get(identity)
        if state is None:
            return None
        state[0] += 1
        state[1] = began + self._backoff.delay(int(state[0]), draw)
        return state[1]

    def stop(self, identity: str) -> bool:
        """No more attempts to ``identity`` (False: none were scheduled)."""
        return self._state.pop(identity, None) is not None

    def __repr__(self) -> str:
        return f"<ReconnectSchedule pending={len(self._state)}>"
