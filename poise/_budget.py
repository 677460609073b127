"""A retry budget: a token bucket shared by the retries and hedges of one route.

Retries that every caller makes on every failure multiply the load on a
fleet that is already failing: with ``max_attempts`` 4 and every backend
down, each request costs four attempts. A budget bounds the extra attempts
to a share of the traffic, as Finagle's ``RetryBudget`` and gRPC's retry
throttling do::

    every request (first attempt)   balance += percent             (deposit)
    every second, continuously      balance += min_per_second      (refill)
    balance never exceeds            capacity
    a retry or a hedge               allowed iff balance >= 1, then balance -= 1

Over any run of ``T`` seconds with ``R`` requests the extra attempts are
therefore at most ``percent x R + min_per_second x T`` (the balance starts
at zero), whatever fails: with 20% and 10/s at 1000 requests/s that is
1.21 attempts per request at most. The minimum keeps a route with little
traffic able to retry at all.

Pure and synchronous: time is an argument (any monotonic clock in
seconds); a time earlier than the last one seen is treated as no time
passing. Counters (``deposits``, ``withdrawals``, ``refusals``) are for
metrics: a refusal is a retry or a hedge the budget did not allow.
"""

from __future__ import annotations

import math

from ._errors import InvalidInput

__all__ = ["RetryBudget"]


def _finite(name: str, value: object, *, low: float, high: float = math.inf) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidInput(f"RetryBudget: {name} must be a number, got {value!r}")
    number = float(value)
    if not (low <= number < high) or math.isnan(number):
        raise InvalidInput(f"RetryBudget: {name} must be in [{low:g}, {high:g}), got {value!r}")
    return number


class RetryBudget:
    """Token bucket of one route's retries and hedges (see the module docstring).

    ``percent`` is the share of requests that may be retried (0.2 = 20%),
    ``min_per_second`` the retries allowed per second whatever the traffic,
    ``capacity`` the most tokens kept (default: ten seconds of the minimum,
    at least 10), which bounds a burst after a quiet spell.
    """

    __slots__ = (
        "_balance",
        "_capacity",
        "_last",
        "_min_per_second",
        "_percent",
        "deposits",
        "refusals",
        "withdrawals",
    )

    def __init__(
        self,
        percent: float = 0.2,
        min_per_second: float = 10.0,
        *,
        capacity: float | None = None,
    ) -> None:
        self._percent = _finite("percent", percent, low=0.0, high=1000.0)
        self._min_per_second = _finite("min_per_second", min_per_second, low=0.0)
        if capacity is None:
            capacity = max(10.0, 10.0 * self._min_per_second)
        self._capacity = _finite("capacity", capacity, low=1.0)
        self._balance = 0.0
        self._last: float | None = None
        #: Requests that deposited (first attempts).
        self.deposits = 0
        #: Retries and hedges the budget allowed.
        self.withdrawals = 0
        #: Retries and hedges the budget refused (exhausted).
        self.refusals = 0

    @property
    def percent(self) -> float:
        return self._percent

    @property
    def min_per_second(self) -> float:
        return self._min_per_second

    @property
    def capacity(self) -> float:
        return self._capacity

    def _advance(self, now: float) -> None:
        if not math.isfinite(now):
            raise InvalidInput(f"RetryBudget: time must be finite, got {now!r}")
        last = self._last
        if last is None or now <= last:
            if last is None:
                self._last = now
            return
        self._balance = min(self._capacity, self._balance + (now - last) * self._min_per_second)
        self._last = now

    def balance(self, now: float) -> float:
        """The tokens available at ``now`` (one token = one retry or hedge)."""
        self._advance(now)
        return self._balance

    def deposit(self, now: float) -> None:
        """Count one request (its first attempt) at ``now``."""
        self._advance(now)
        self.deposits += 1
        self._balance = min(self._capacity, self._balance + self._percent)

    def try_withdraw(self, now: float) -> bool:
        """Take one token for a retry or a hedge at ``now``; False (counted) when exhausted."""
        self._advance(now)
        if self._balance >= 1.0:
            self._balance -= 1.0
            self.withdrawals += 1
            return True
        self.refusals += 1
        return False

    def __repr__(self) -> str:
        return (
            f"<RetryBudget {self._percent:g} + {self._min_per_second:g}/s "
            f"balance={self._balance:.2f} refused={self.refusals}>"
        )
