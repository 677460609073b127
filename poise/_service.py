"""Service adapters: plain async callables, and a concurrency limit that reserves.

A :class:`~poise.Service` has a synchronous readiness check that may *reserve*
capacity and an async ``call``. Two adapters cover the common cases:

* :func:`service_fn` turns ``async def f(request)`` into an always-ready
  service (``poll_ready`` is ``True`` and reserves nothing).
* :class:`ConcurrencyLimit` wraps a service and allows at most ``limit`` calls
  at once. Its ``poll_ready`` takes a permit and holds it as a *reservation*;
  the next ``call`` consumes the reservation and frees the permit when the
  call ends, whether it returned, raised or was cancelled::

      free ──poll_ready() -> True──► reserved ──call()──► in use ──end──► free
        ▲                               │
        └──── release_reservation() ────┘

  When no permit is free, ``poll_ready`` returns ``False`` and remembers the
  ``wake`` function; every remembered wake is called once when a permit
  frees up.

Two optional hooks complete the service protocol. Both are synchronous and
looked up with ``getattr``, so a service that has no use for them simply does
not define them:

``release_reservation()``
    Give back one reservation taken by ``poll_ready`` that will not be
    followed by a ``call``. The balance calls it when it invalidates a ready
    endpoint (mutable access, eligibility turned off, removal, replacement).
    A service that reserves capacity must provide it, or an invalidated
    reservation leaks until the service is closed.
``close()``
    Release what the service owns. :func:`close_service` calls it if present.

Cost: every method is O(1) except waking, which is O(remembered wakes).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Coroutine
from typing import Generic, Protocol, TypeVar, runtime_checkable

from ._errors import InvalidInput, SelectionError
from ._protocols import Service

__all__ = [
    "ConcurrencyLimit",
    "ReservingService",
    "ServiceFn",
    "close_service",
    "release_reservation",
    "service_fn",
]

Req = TypeVar("Req")
Resp = TypeVar("Resp")


@runtime_checkable
class ReservingService(Protocol):
    """The optional hook of a service whose ``poll_ready`` reserves capacity."""

    def release_reservation(self) -> None: ...


class ServiceFn(Generic[Req, Resp]):
    """An always-ready service around an async callable. Reserves nothing."""

    __slots__ = ("_fn", "call")

    call: Callable[[Req], Coroutine[object, object, Resp]]
    """The wrapped callable itself: a call through the adapter adds no frame.

    Set once, here; a balance reads it when the endpoint joins or gets this
    service, not on every call.
    """

    def __init__(self, fn: Callable[[Req], Coroutine[object, object, Resp]]) -> None:
        if not callable(fn):
            raise InvalidInput(f"service_fn needs an async callable, got {type(fn).__name__}")
        self._fn = fn
        self.call = fn

    def poll_ready(self, wake: Callable[[], None]) -> bool:
        return True

    def __repr__(self) -> str:
        name = getattr(self._fn, "__qualname__", None) or type(self._fn).__name__
        return f"<ServiceFn {name}>"


def service_fn(fn: Callable[[Req], Coroutine[object, object, Resp]]) -> ServiceFn[Req, Resp]:
    """Adapt ``async def fn(request) -> response`` as an always-ready service."""
    return ServiceFn(fn)


class ConcurrencyLimit(Generic[Req, Resp]):
    """At most ``limit`` calls of ``inner`` at once; readiness reserves a permit.

    Each ``poll_ready`` that returns ``True`` holds one reservation, and each
    ``call`` consumes one. Calling without a reservation raises
    :class:`~poise.SelectionError` and never reaches ``inner``. The inner
    service's own readiness is polled after a permit is taken; if it is not
    ready, the permit goes back and the result is ``False``.
    """

    __slots__ = ("_in_use", "_inner", "_limit", "_reserved", "_wakers")

    def __init__(self, inner: Service[Req, Resp], limit: int) -> None:
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidInput(f"ConcurrencyLimit limit must be an integer >= 1, got {limit!r}")
        self._inner = inner
        self._limit = limit
        self._reserved = 0
        self._in_use = 0
        self._wakers: dict[Callable[[], None], None] = {}

    @property
    def inner(self) -> Service[Req, Resp]:
        return self._inner

    @property
    def limit(self) -> int:
        return self._limit

    @property
    def reserved(self) -> int:
        """Reservations taken by ``poll_ready`` and not yet consumed or released."""
        return self._reserved

    @property
    def in_use(self) -> int:
        """Calls running now."""
        return self._in_use

    @property
    def available(self) -> int:
        """Permits neither reserved nor in use."""
        return self._limit - self._reserved - self._in_use

    def poll_ready(self, wake: Callable[[], None]) -> bool:
        if self._reserved + self._in_use >= self._limit:
            self._wakers[wake] = None
            return False
        # Hold the permit while asking the inner service, so a wake it calls
        # synchronously cannot hand the same permit to someone else.
        self._reserved += 1
        try:
            ready = self._inner.poll_ready(wake)
        except BaseException:
            self._reserved -= 1
            raise
        if not ready:
            self._reserved -= 1
        return ready

    def release_reservation(self) -> None:
        """Give back one unused reservation (no-op if none is held)."""
        if self._reserved > 0:
            self._reserved -= 1
            release_reservation(self._inner)
            self._permit_freed()

    async def call(self, request: Req) -> Resp:
        if self._reserved <= 0:
            raise SelectionError(
                "ConcurrencyLimit.call() without a reservation: poll_ready() must return True first"
            )
        self._reserved -= 1
        self._in_use += 1
        try:
            return await self._inner.call(request)
        finally:
            self._in_use -= 1
            self._permit_freed()

    def close(self) -> None:
        """Close the inner service (if it can be closed) and forget waiting wakes."""
        self._wakers.clear()
        close_service(self._inner)

    def _permit_freed(self) -> None:
        if self._wakers:
            wakers, self._wakers = self._wakers, {}
            for wake in wakers:
                wake()

    def __repr__(self) -> str:
        return (
            f"<ConcurrencyLimit limit={self._limit} in_use={self._in_use} "
            f"reserved={self._reserved} waiting={len(self._wakers)}>"
        )


def release_reservation(service: object) -> None:
    """Call ``service.release_reservation()`` if the service has that hook."""
    release = getattr(service, "release_reservation", None)
    if release is not None:
        release()


def close_service(service: object) -> None:
    """Call the service's synchronous ``close()`` if it has one.

    An ``async`` close cannot be run from here; it raises
    :class:`~poise.InvalidInput` rather than leaving a coroutine un-awaited.
    """
    close = getattr(service, "close", None)
    if close is None:
        return
    if not callable(close):
        raise InvalidInput(f"{type(service).__name__}.close is not callable")
    result = close()
    if inspect.isawaitable(result):
        if inspect.iscoroutine(result):
            result.close()
        raise InvalidInput(
            f"{type(service).__name__}.close() is async; close_service() needs a synchronous close"
        )
