"""The retry decision of one failed attempt: one synchronous function.

:func:`retry_step` is what the discovery transport's attempt loop (and so
``RestDiscoveryClient``, which calls through it) asks after an attempt
failed: retry transparently (nothing reached a server: any method, not
counted among ``max_attempts``), retry as one of the request's attempts, or
stop. Time is an argument (``now``); the retry budget is asked last and only
when every other condition allows a retry, so it is charged for retries
that go out and for nothing else. No I/O, no clock: the rules are tested
exhaustively in ``tests/nadisc/test_retry.py``.

The rules, in order:

``nothing_sent``
    (the connection failed before a byte was sent) with
    ``retry_on_connect_failure`` on, fewer transparent retries so far than
    listed instances, and an untried listed instance: ``TRANSPARENT``.
``status``
    (a 502, 503 or 504 answer) for a retryable request with
    ``retry_get_head_on_retryable_status`` on, attempts left and ``now``
    before the call's deadline: ``RETRY`` if the budget allows one.
``transport``
    (any other transport error) for a retryable request, when
    ``retry_get_head_on_transport_error`` is on or it is the attempt's own
    timeout (``timed_out`` and ``now >= cutoff``), with attempts left:
    ``RETRY`` if the budget allows one.

Everything else is ``STOP``.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Failure", "RetryRules", "Step", "retry_step"]


class Failure(enum.Enum):
    """What went wrong with an attempt."""

    NOTHING_SENT = "nothing_sent"
    TRANSPORT = "transport"
    STATUS = "status"


class Step(enum.Enum):
    """What the attempt loop does next."""

    TRANSPARENT = "transparent"
    RETRY = "retry"
    STOP = "stop"


@dataclass(frozen=True, slots=True)
class RetryRules:
    """The options the decision reads (from :class:`~nadisc.RestOptions`)."""

    max_attempts: int
    on_connect_failure: bool
    on_transport_error: bool
    on_retryable_status: bool


def retry_step(
    rules: RetryRules,
    failure: Failure,
    *,
    retryable: bool,
    attempts: int,
    transparent: int,
    listed: int,
    untried: bool,
    timed_out: bool,
    now: float,
    cutoff: float,
    deadline: float,
    withdraw: Callable[[float], bool],
) -> Step:
    """The next step after a failed attempt (see the module docstring).

    ``attempts`` counts every attempt so far including this one,
    ``transparent`` the transparent retries among them; ``withdraw(now)``
    charges the retry budget and says whether it allowed the retry.
    """
    if failure is Failure.NOTHING_SENT:
        if rules.on_connect_failure and transparent < listed and untried:
            return Step.TRANSPARENT
        failure = Failure.TRANSPORT  # then as any transport error
    if not retryable or attempts - transparent >= rules.max_attempts:
        return Step.STOP
    if failure is Failure.STATUS:
        allowed = rules.on_retryable_status and now < deadline
    else:
        allowed = rules.on_transport_error or (timed_out and now >= cutoff)
    if allowed and withdraw(now):
        return Step.RETRY
    return Step.STOP
