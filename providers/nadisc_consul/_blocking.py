"""Blocking-query rules, sans-IO: the index cursor, the rate limit and the backoff.

A Consul blocking query is a plain GET that the server holds until the
endpoint's index passes the one we sent, or until ``wait`` (plus up to
``wait/16`` of jitter) elapses. A return therefore does not mean a change.
The rules a loop must follow are all here, with the time passed in::

        +-----------+  no index yet   GET (no index)            +---------+
        |  FRESH    | ------------------------------------->  | answer  |
        +-----------+                                         +----+----+
              ^                                                    |
              | index went backwards                               v
              | (reset: forget it, non-blocking read)     new > last: CHANGED (publish)
              +--------------------------------------     new == last: UNCHANGED
                                                           new <= 0: remember 1 (publish
                                                           once; never block on 0)

* :class:`BlockingCursor` decides what index to send next and what an
  answer's ``X-Consul-Index`` means.
* :class:`TokenBucket` rate-limits re-issuing, so a server that answers
  instantly (index reset loops, ``wait`` ignored) cannot turn the loop into a
  busy loop. It returns how long to wait; it never sleeps.
* :class:`Backoff` spaces retries after failures (exponential, jittered
  between half the current cap and the cap).
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

__all__ = ["Backoff", "BlockingCursor", "IndexOutcome", "TokenBucket", "read_timeout"]


class IndexOutcome(enum.Enum):
    #: First answer, or the index moved forward: publish the listing.
    CHANGED = "changed"
    #: Same index: the server timed out the wait; nothing changed.
    UNCHANGED = "unchanged"
    #: The index went backwards (snapshot restore, new cluster): discard the
    #: answer, forget the index and do a fresh non-blocking read.
    RESET = "reset"


class BlockingCursor:
    """The index state of one blocking query. O(1), no I/O, no clock."""

    __slots__ = ("_index", "resets")

    def __init__(self) -> None:
        self._index = 0
        self.resets = 0

    @property
    def index(self) -> int:
        """The last accepted index (0: none yet, the next read is non-blocking)."""
        return self._index

    def request_index(self) -> int | None:
        """The ``index`` parameter for the next request, or None for a
        non-blocking read. Never 0: blocking on 0 returns at once, a busy loop."""
        return None if self._index == 0 else max(self._index, 1)

    def observe(self, new_index: int) -> IndexOutcome:
        """Account for the ``X-Consul-Index`` of a successful answer."""
        previous = self._index
        if previous == 0:
            # A first read: whatever came back is the listing. An index of 0
            # (no writes yet, or a broken server) is remembered as 1.
            self._index = max(new_index, 1)
            return IndexOutcome.CHANGED
        if new_index <= 0:
            # Never block on 0; 1 means "anything newer than the beginning".
            # The answer is still a complete listing: publish it once.
            if previous == 1:
                return IndexOutcome.UNCHANGED
            self._index = 1
            return IndexOutcome.CHANGED
        if new_index < previous:
            self._index = 0
            self.resets += 1
            return IndexOutcome.RESET
        if new_index == previous:
            return IndexOutcome.UNCHANGED
        self._index = new_index
        return IndexOutcome.CHANGED

    def reset(self) -> None:
        """Forget the index (the next read is non-blocking)."""
        self._index = 0


@dataclass(slots=True)
class TokenBucket:
    """``rate`` tokens per second, at most ``burst`` banked. Sans-IO.

    :meth:`reserve` takes a token and returns how long the caller must wait
    before using it (0.0 if one was banked). Reservations queue behind each
    other, so the long-run rate never exceeds ``rate``.
    """

    rate: float
    burst: int
    _tokens: float = math.nan
    _stamp: float = math.nan

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate) and self.rate > 0):
            raise ValueError("rate must be finite and > 0")
        if self.burst < 1:
            raise ValueError("burst must be >= 1")

    def reserve(self, now: float) -> float:
        if math.isnan(self._stamp):
            self._tokens = float(self.burst)
            self._stamp = now
        elapsed = max(0.0, now - self._stamp)
        self._tokens = min(float(self.burst), self._tokens + elapsed * self.rate)
        self._stamp = max(self._stamp, now)
        self._tokens -= 1.0
        if self._tokens >= 0.0:
            return 0.0
        return -self._tokens / self.rate


@dataclass(slots=True)
class Backoff:
    """Exponential backoff: the n-th consecutive failure waits a jittered
    delay between half of ``min(max, initial * 2**n)`` and that cap."""

    initial: float = 1.0
    maximum: float = 30.0
    failures: int = 0

    def next_delay(self, unit_random: float) -> float:
        """The delay before the next retry; ``unit_random`` in [0, 1)."""
        cap = min(self.maximum, self.initial * (2.0 ** min(self.failures, 32)))
        self.failures += 1
        return cap / 2.0 + (cap / 2.0) * unit_random

    def succeeded(self) -> None:
        self.failures = 0


def read_timeout(wait: float, margin: float) -> float:
    """Read timeout for a blocking request: above the server's ``wait * 17/16``
    worst case (wait plus jitter), plus a margin for the answer itself."""
    return wait * 17.0 / 16.0 + margin
