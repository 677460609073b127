"""Deadline rules for provider authors.

Every provider call takes an absolute ``deadline`` on the event loop's
clock. Two rules come up in every provider that talks to a registry, and
are stated once here so that all providers answer them alike:

* :func:`time_left`: the budget of one request. A deadline that is not a
  number, is NaN or has already passed is the caller's mistake,
  :class:`~nadisc.DeadlineExceeded`, with the same message the owner gives
  (and the same hint when the value looks like a duration).
* :func:`multi_request_read`: a read made of several requests (pages of a
  range or a list, a list started again, a query's two lists) under one
  deadline. When the deadline passes *between* two requests the read
  timed out, :class:`~nadisc.IncompleteSnapshot` (a retryable failure, the
  same as a deadline that passes during a request), so a watch that reads
  under its provider's own deadline reports it and reads again instead of
  ending. A deadline already past when the read starts stays the caller's
  ``DeadlineExceeded``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import anyio

from ._errors import DeadlineExceeded, IncompleteSnapshot
from ._observation import check_deadline

__all__ = ["multi_request_read", "time_left"]


def time_left(deadline: float) -> float:
    """Seconds left before ``deadline`` (event-loop clock), always > 0.

    Raises :class:`~nadisc.DeadlineExceeded` when ``deadline`` is not a
    number, is NaN, or has already passed.
    """
    now = anyio.current_time()
    check_deadline(deadline, now)
    return deadline - now


@contextmanager
def multi_request_read(deadline: float, what: str) -> Iterator[None]:
    """Wrap a read of several requests under one ``deadline``.

    A :class:`~nadisc.DeadlineExceeded` raised inside becomes
    :class:`~nadisc.IncompleteSnapshot` ("``what`` did not finish by its
    deadline") when the deadline had not passed as the read began; one
    already past (or not a number) then is re-raised as it is. ``what``
    names the read in that message (a provider, a service, a page).
    """
    try:
        in_time = deadline > anyio.current_time()
    except TypeError:
        in_time = False
    try:
        yield
    except DeadlineExceeded as exc:
        if not in_time:
            raise
        raise IncompleteSnapshot(f"{what} did not finish by its deadline ({exc})") from exc
