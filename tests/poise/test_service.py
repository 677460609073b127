"""Service adapters: service_fn, ConcurrencyLimit reservations, close/release hooks."""

from __future__ import annotations

from collections.abc import Callable

import anyio
import pytest

from poise import (
    ConcurrencyLimit,
    InvalidInput,
    ReservingService,
    SelectionError,
    Service,
    ServiceFn,
    close_service,
    release_reservation,
    service_fn,
)


class Wakes:
    """A wake function that counts its calls."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> None:
        self.count += 1


async def _double(x: int) -> int:
    return 2 * x


class Gate:
    """An inner service whose calls block until the gate opens."""

    def __init__(self) -> None:
        self.open = anyio.Event()
        self.started = 0
        self.closed = 0

    def poll_ready(self, wake: Callable[[], None]) -> bool:
        return True

    async def call(self, request: int) -> int:
        self.started += 1
        await self.open.wait()
        return request

    def close(self) -> None:
        self.closed += 1


async def test_service_fn_is_always_ready_and_calls_through() -> None:
    svc = service_fn(_double)
    assert isinstance(svc, ServiceFn)
    assert isinstance(svc, Service)
    wake = Wakes()
    assert svc.poll_ready(wake) is True
    assert await svc.call(21) == 42
    assert wake.count == 0
    assert "_double" in repr(svc)


def test_service_fn_rejects_non_callables() -> None:
    with pytest.raises(InvalidInput):
        service_fn(42)  # type: ignore[arg-type]


@pytest.mark.parametrize("limit", [0, -1, 1.5, True, "2"])
def test_concurrency_limit_rejects_bad_limits(limit: object) -> None:
    with pytest.raises(InvalidInput, match="limit"):
        ConcurrencyLimit(service_fn(_double), limit)  # type: ignore[arg-type]


def test_poll_ready_reserves_a_permit_and_pends_when_none_is_free() -> None:
    svc = ConcurrencyLimit(service_fn(_double), 2)
    wake = Wakes()
    assert svc.poll_ready(wake) and svc.reserved == 1
    assert svc.poll_ready(wake) and svc.reserved == 2
    assert svc.available == 0
    assert svc.poll_ready(wake) is False
    assert svc.reserved == 2
    # Releasing a reservation frees a permit and calls the remembered wake once.
    svc.release_reservation()
    assert svc.reserved == 1 and svc.available == 1
    assert wake.count == 1
    svc.release_reservation()
    assert wake.count == 1  # nothing was waiting any more
    svc.release_reservation()
    assert svc.reserved == 0  # releasing with none held is a no-op


async def test_call_without_reservation_never_reaches_inner() -> None:
    inner = Gate()
    svc = ConcurrencyLimit(inner, 1)
    with pytest.raises(SelectionError, match="reservation"):
        await svc.call(1)
    assert inner.started == 0


async def test_call_consumes_the_reservation_and_frees_the_permit_at_the_end() -> None:
    inner = Gate()
    svc = ConcurrencyLimit(inner, 1)
    wake = Wakes()
    result: list[int] = []

    async def run() -> None:
        result.append(await svc.call(7))

    assert svc.poll_ready(wake)
    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        await anyio.wait_all_tasks_blocked()
        assert inner.started == 1
        assert svc.reserved == 0 and svc.in_use == 1
        assert svc.poll_ready(wake) is False
        inner.open.set()
    assert result == [7]
    assert svc.in_use == 0 and svc.available == 1
    assert wake.count == 1


async def test_permit_is_released_when_the_call_raises() -> None:
    async def boom(x: int) -> int:
        raise RuntimeError("boom")

    svc = ConcurrencyLimit(service_fn(boom), 1)
    wake = Wakes()
    assert svc.poll_ready(wake)
    with pytest.raises(RuntimeError):
        await svc.call(1)
    assert svc.in_use == 0 and svc.available == 1


async def test_permit_is_released_when_the_call_is_cancelled() -> None:
    inner = Gate()
    svc = ConcurrencyLimit(inner, 1)
    wake = Wakes()
    assert svc.poll_ready(wake)
    async with anyio.create_task_group() as tg:

        async def run() -> None:
            await svc.call(1)

        tg.start_soon(run)
        await anyio.wait_all_tasks_blocked()
        assert inner.started == 1
        assert svc.poll_ready(wake) is False
        tg.cancel_scope.cancel()
    assert svc.in_use == 0 and svc.reserved == 0 and svc.available == 1
    assert wake.count == 1


class Pending:
    """An inner service that is not ready until told, and counts reservations."""

    def __init__(self) -> None:
        self.ready = False
        self.fail = False
        self.released = 0

    def poll_ready(self, wake: Callable[[], None]) -> bool:
        if self.fail:
            raise OSError("down")
        return self.ready

    async def call(self, request: int) -> int:
        return request

    def release_reservation(self) -> None:
        self.released += 1


def test_inner_readiness_is_polled_and_a_pending_inner_gives_the_permit_back() -> None:
    inner = Pending()
    svc = ConcurrencyLimit(inner, 1)
    wake = Wakes()
    assert svc.poll_ready(wake) is False
    assert svc.reserved == 0 and svc.available == 1
    inner.fail = True
    with pytest.raises(OSError):
        svc.poll_ready(wake)
    assert svc.reserved == 0 and svc.available == 1
    inner.fail = False
    inner.ready = True
    assert svc.poll_ready(wake)
    svc.release_reservation()
    assert inner.released == 1  # the release reaches a reserving inner service


def test_close_service_calls_sync_close_if_present() -> None:
    inner = Gate()
    close_service(inner)
    assert inner.closed == 1
    close_service(service_fn(_double))  # no close(): nothing to do
    close_service(ConcurrencyLimit(inner, 1))
    assert inner.closed == 2


def test_close_service_refuses_an_async_close() -> None:
    class AsyncClose:
        async def close(self) -> None:
            raise AssertionError("never awaited")

    with pytest.raises(InvalidInput, match="async"):
        close_service(AsyncClose())


def test_release_reservation_helper_and_protocol() -> None:
    inner = Pending()
    release_reservation(inner)
    assert inner.released == 1
    release_reservation(service_fn(_double))  # no hook: no-op
    assert isinstance(ConcurrencyLimit(inner, 1), ReservingService)
    assert not isinstance(service_fn(_double), ReservingService)
    assert "limit=1" in repr(ConcurrencyLimit(inner, 1))
