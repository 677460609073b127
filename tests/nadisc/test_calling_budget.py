"""One budget per call: the smallest of every limit, and the error names which one ran out.

Under trio's MockClock the pool is an ``httpx.MockTransport`` whose handler
waits as long as the test says (a pool that ignores the timeout extension,
so the transport bounds it with a cancel scope); the last tests use a real
loopback server and httpx's own pool, where the budget travels in the
timeout extension instead.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest

from nadisc import (
    CallTimeout,
    DeadlineExceeded,
    DiscoveryOwner,
    DiscoveryTransport,
    Instance,
    RestConfig,
    RestDiscoveryClient,
    RestOptions,
)
from nadisc.testing import MemoryProvider
from tests.nadisc.owner_support import memory_owner, policy
from tests.support_http import HttpBackend, serve_backends

SERVICE = "orders"
URL = f"nadisc://primary/{SERVICE}/slow"


def provider(*instances: Instance) -> MemoryProvider:
    memory = MemoryProvider(services={SERVICE: SERVICE})
    memory.set(SERVICE, instances or (Instance("a", "10.0.0.1", 8080),))
    return memory


class SlowPool:
    """An in-memory pool answering after ``latency`` seconds of the event-loop clock."""

    def __init__(self, latency: float) -> None:
        self.latency = latency
        self.sent = 0

    async def answer(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        await anyio.sleep(self.latency)
        return httpx.Response(200, content=b"late")

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.answer)


@asynccontextmanager
async def calling(
    latency: float, *, client_timeout: Any = None, **rest: Any
) -> AsyncIterator[tuple[DiscoveryOwner, DiscoveryTransport, httpx.AsyncClient]]:
    async with memory_owner(
        {"primary": provider()}, policies={"primary": policy(rest=RestConfig(**rest))}
    ) as owner:
        transport = DiscoveryTransport(owner, transport=SlowPool(latency).transport())
        async with httpx.AsyncClient(
            mounts={"nadisc://": transport}, timeout=client_timeout
        ) as http:
            yield owner, transport, http


async def timed_out(call: Any) -> tuple[CallTimeout, float]:
    started = anyio.current_time()
    with pytest.raises(CallTimeout) as info:
        await call
    return info.value, round(anyio.current_time() - started, 6)


@pytest.mark.trio_only
async def test_the_client_timeout_is_the_budget_when_smallest(autojump_clock: object) -> None:
    async with calling(3.0, client_timeout=0.5) as (_, _t, http):
        error, elapsed = await timed_out(http.get(URL))
    assert (error.limit, error.seconds, elapsed) == ("httpx timeout", 0.5, 0.5)
    assert "httpx timeout (client or request) of 0.5 s ran out" in str(error)
    # Caught as httpx's timeout and as nadisc's.
    assert isinstance(error, httpx.TimeoutException) and isinstance(error, DeadlineExceeded)
    assert error.request.url == httpx.URL(URL)


@pytest.mark.trio_only
async def test_a_request_timeout_is_the_budget_when_smallest(autojump_clock: object) -> None:
    async with calling(3.0, client_timeout=5.0) as (_, _t, http):
        error, elapsed = await timed_out(http.get(URL, timeout=0.25))
    assert (error.limit, error.seconds, elapsed) == ("httpx timeout", 0.25, 0.25)


@pytest.mark.trio_only
async def test_the_deadline_extension_is_the_budget_when_smallest(autojump_clock: object) -> None:
    async with calling(3.0, client_timeout=5.0) as (_, _t, http):
        deadline = anyio.current_time() + 0.75
        error, elapsed = await timed_out(http.get(URL, extensions={"nadisc.deadline": deadline}))
    assert (error.limit, elapsed) == ("nadisc.deadline", 0.75)
    assert error.seconds == pytest.approx(0.75)
    assert "nadisc.deadline extension" in str(error)
    assert "budget of 10 s" not in str(error)


@pytest.mark.trio_only
async def test_the_rest_budget_is_the_budget_when_smallest(autojump_clock: object) -> None:
    async with calling(3.0, client_timeout=5.0, request_timeout_ms=400, connect_timeout_ms=100) as (
        _,
        _t,
        http,
    ):
        error, elapsed = await timed_out(http.get(URL))
    assert (error.limit, error.seconds, elapsed) == ("rest.request_timeout", 0.4, 0.4)
    assert "REST budget (rest.request_timeout) of 0.4 s ran out" in str(error)


@pytest.mark.trio_only
async def test_no_httpx_timeout_leaves_the_rest_budget(autojump_clock: object) -> None:
    async with calling(30.0, client_timeout=None) as (_, _t, http):
        error, elapsed = await timed_out(http.get(URL))
    assert (error.limit, elapsed) == ("rest.request_timeout", 10.0)


@pytest.mark.trio_only
async def test_an_unbounded_phase_means_no_httpx_budget(autojump_clock: object) -> None:
    # httpx.Timeout(None, connect=1): no read limit, so httpx sets no total.
    async with calling(3.0, client_timeout=httpx.Timeout(None, connect=1.0)) as (_, _t, http):
        response = await http.get(URL)
    assert response.status_code == 200


@pytest.mark.trio_only
async def test_the_callers_cancel_scope_cancels_and_names_nothing(autojump_clock: object) -> None:
    async with calling(3.0, client_timeout=5.0) as (_, transport, http):
        started = anyio.current_time()
        with anyio.move_on_after(0.2) as scope:
            await http.get(URL)
        assert scope.cancelled_caught
        assert anyio.current_time() - started == 0.2
        # fail_after raises its own TimeoutError, never one of ours.
        with pytest.raises(TimeoutError) as info:
            with anyio.fail_after(0.3):
                await http.get(URL)
        assert not isinstance(info.value, CallTimeout)
        route = transport.route("primary", SERVICE)
        assert route is not None
        assert route.statistics().in_flight == {"a": 0}


@pytest.mark.trio_only
async def test_a_later_scope_leaves_the_smaller_limit_named(autojump_clock: object) -> None:
    async with calling(3.0, client_timeout=0.5) as (_, _t, http):
        with anyio.move_on_after(2.0) as scope:
            error, elapsed = await timed_out(http.get(URL))
    assert not scope.cancelled_caught
    assert (error.limit, elapsed) == ("httpx timeout", 0.5)


@pytest.mark.trio_only
async def test_the_rest_client_follows_the_same_rule(autojump_clock: object) -> None:
    pool = SlowPool(3.0)
    options = RestOptions(request_timeout=2.0, connect_timeout=0.5)
    async with (
        memory_owner({"primary": provider()}) as owner,
        RestDiscoveryClient(owner, options=options, transport=pool.transport()) as rest,
    ):
        error, elapsed = await timed_out(
            rest.request("GET", service=SERVICE, path="/", timeout=0.5)
        )
        assert (error.limit, elapsed) == ("httpx timeout", 0.5)
        error, elapsed = await timed_out(rest.get("/", service=SERVICE, timeout=0.25))
        assert (error.limit, elapsed) == ("httpx timeout", 0.25)
        error, elapsed = await timed_out(rest.get("/", service=SERVICE))
        assert (error.limit, error.seconds, elapsed) == ("rest.request_timeout", 2.0, 2.0)
        deadline = anyio.current_time() + 0.1
        error, elapsed = await timed_out(
            rest.get("/", service=SERVICE, extensions={"nadisc.deadline": deadline})
        )
        assert (error.limit, elapsed) == ("nadisc.deadline", 0.1)
        with anyio.move_on_after(0.3) as scope:
            await rest.get("/", service=SERVICE)
        assert scope.cancelled_caught


@pytest.mark.trio_only
async def test_a_relative_deadline_gets_a_hint(autojump_clock: object) -> None:
    async with calling(0.0) as (owner, _t, http):
        await anyio.sleep(1000)  # the clock is far from zero, as real clocks are
        error, _ = await timed_out(http.get(URL, extensions={"nadisc.deadline": 2}))
        assert "deadlines are absolute: anyio.current_time() + 2" in str(error)
        with pytest.raises(DeadlineExceeded, match=r"anyio\.current_time\(\) \+ 2"):
            await owner.client().observe(SERVICE, 2)
        # A deadline that passed a moment ago is just late: no hint.
        with pytest.raises(DeadlineExceeded) as info:
            await owner.client().observe(SERVICE, anyio.current_time() - 1)
        assert "absolute" not in str(info.value)


@pytest.mark.trio_only
async def test_a_deadline_extension_that_is_no_number_is_refused(autojump_clock: object) -> None:
    async with calling(0.0) as (_, _t, http):
        with pytest.raises(CallTimeout, match="must be an absolute event-loop time"):
            await http.get(URL, extensions={"nadisc.deadline": "soon"})


# -- both event loops: a pool that ignores timeouts, no clock comparison -----------------


class StuckPool:
    """A MockTransport whose handler never answers (or raises ``error`` instead)."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.error = error
        self.sent = 0
        self.arrived = anyio.Event()

    async def answer(self, request: httpx.Request) -> httpx.Response:
        self.sent += 1
        self.arrived.set()
        if self.error is not None:
            raise self.error
        await anyio.sleep_forever()
        raise AssertionError("unreachable")


@asynccontextmanager
async def mocked(
    handler: Any, request_timeout_ms: int
) -> AsyncIterator[tuple[DiscoveryTransport, httpx.AsyncClient]]:
    rest = RestConfig(request_timeout_ms=request_timeout_ms, connect_timeout_ms=10)
    async with memory_owner(
        {"primary": provider()}, policies={"primary": policy(rest=rest)}
    ) as owner:
        transport = DiscoveryTransport(owner, transport=httpx.MockTransport(handler))
        async with httpx.AsyncClient(mounts={"nadisc://": transport}) as http:
            yield transport, http


def stuck(
    pool: StuckPool, request_timeout_ms: int
) -> AbstractAsyncContextManager[tuple[DiscoveryTransport, httpx.AsyncClient]]:
    return mocked(pool.answer, request_timeout_ms)


async def test_the_budget_ends_a_pool_that_never_answers_on_either_loop() -> None:
    # MockTransport ignores the timeout extension: the budget is the
    # transport's own cancel scope around the call. Unbounded, the call would
    # never return.
    pool = StuckPool()
    async with stuck(pool, 50) as (transport, http):
        with pytest.raises(CallTimeout) as info:
            await http.get(URL)
        assert info.value.limit == "rest.request_timeout" and info.value.seconds == 0.05
        assert pool.sent == 1
        route = transport.route("primary", SERVICE)
        assert route is not None
        statistics = route.statistics()
        assert statistics.in_flight == {"a": 0}
        assert statistics.failures["timeout"] == 1


async def test_the_callers_earlier_scope_cancels_through_the_bound_on_either_loop() -> None:
    pool = StuckPool()
    async with stuck(pool, 60_000) as (transport, http):

        async def end_when_sent(scope: anyio.CancelScope) -> None:
            await pool.arrived.wait()
            scope.deadline = anyio.current_time()  # the caller's deadline: now

        with anyio.CancelScope() as scope:
            async with anyio.create_task_group() as tg:
                tg.start_soon(end_when_sent, scope)
                await http.get(URL)
        assert scope.cancelled_caught and pool.sent == 1
        route = transport.route("primary", SERVICE)
        assert route is not None
        assert route.statistics().in_flight == {"a": 0}
        assert route.statistics().failures["timeout"] == 0


async def test_a_pools_own_timeout_error_is_not_the_budgets_end_on_either_loop() -> None:
    # A TimeoutError raised by the pool itself (the handler's own fail_after,
    # say) passes through as it is: the budget did not run out.
    error = TimeoutError("the handler's own")
    async with stuck(StuckPool(error), 60_000) as (transport, http):
        with pytest.raises(TimeoutError) as info:
            await http.get(URL)
        assert info.value is error and not isinstance(info.value, CallTimeout)
        route = transport.route("primary", SERVICE)
        assert route is not None
        assert route.statistics().failures["timeout"] == 0


async def test_concurrent_budgets_each_end_their_own_call_on_either_loop() -> None:
    # Each call's budget ends its own call only; a call with no deadline of
    # its own (the 60 s default budget) is not touched.
    release = anyio.Event()
    ended: dict[str, object] = {}

    async def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/slow":
            await release.wait()
            return httpx.Response(200, content=b"in time")
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async with memory_owner({"primary": provider()}) as owner:
        transport = DiscoveryTransport(owner, transport=httpx.MockTransport(answer))
        async with httpx.AsyncClient(mounts={"nadisc://": transport}) as http:

            async def call(name: str, path: str, seconds: float | None) -> None:
                extensions = {}
                if seconds is not None:
                    extensions["nadisc.deadline"] = anyio.current_time() + seconds
                try:
                    response = await http.get(
                        f"nadisc://primary/{SERVICE}{path}", extensions=extensions
                    )
                    ended[name] = response.status_code
                except CallTimeout as exc:
                    ended[name] = exc.limit
                if "later" in ended and "sooner" in ended:
                    release.set()

            async with anyio.create_task_group() as tg:
                tg.start_soon(call, "later", "/stuck", 0.1)
                tg.start_soon(call, "sooner", "/stuck", 0.05)
                tg.start_soon(call, "spared", "/slow", None)
    assert ended == {"later": "nadisc.deadline", "sooner": "nadisc.deadline", "spared": 200}


# The budget's scope around a pool that may ignore timeouts is entered before
# the pool runs, so that every scope the pool opens nests inside it. Entering
# it only once the pool suspends (to spare it on calls that never suspend)
# would put it inside scopes the pool opened before suspending: exiting those
# then corrupts the cancel scope stack on both loops. These calls go through a
# warmed route (the fast path, no wait of the transport's own), so the first
# thing that suspends is the pool, inside a scope of its own.


@asynccontextmanager
async def warmed(
    answer: Any, request_timeout_ms: int = 60_000
) -> AsyncIterator[tuple[DiscoveryTransport, httpx.AsyncClient]]:
    async def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/warm":
            return httpx.Response(200)
        response: httpx.Response = await answer(request)
        return response

    rest = RestConfig(request_timeout_ms=request_timeout_ms, connect_timeout_ms=10)
    async with memory_owner(
        {"primary": provider()}, policies={"primary": policy(rest=rest)}
    ) as owner:
        transport = DiscoveryTransport(owner, transport=httpx.MockTransport(handler))
        async with httpx.AsyncClient(mounts={"nadisc://": transport}) as http:
            warm = await http.get(f"nadisc://primary/{SERVICE}/warm")
            assert warm.status_code == 200
            yield transport, http


def assert_settled(transport: DiscoveryTransport, timeouts: int) -> None:
    """Nothing left in flight on the route; ``timeouts`` counted against "a"."""
    route = transport.route("primary", SERVICE)
    assert route is not None
    assert route.statistics().in_flight == {"a": 0}
    assert route.statistics().failures["timeout"] == timeouts


async def assert_the_budget_ends(answer: Any) -> None:
    """A call through a warmed route whose pool answers with ``answer`` ends
    at its 50 ms budget, counted as a timeout, nothing left in flight."""
    async with warmed(answer, request_timeout_ms=50) as (transport, http):
        with pytest.raises(CallTimeout) as info:
            await http.get(URL)
        assert info.value.limit == "rest.request_timeout"
        assert_settled(transport, 1)


async def test_the_budget_ends_a_pool_waiting_inside_its_own_scope_on_either_loop() -> None:
    async def answer(request: httpx.Request) -> httpx.Response:
        with anyio.move_on_after(3600):  # the pool's own, far longer bound
            await anyio.sleep_forever()
        raise AssertionError("unreachable")

    await assert_the_budget_ends(answer)


async def test_the_budget_ends_a_pool_waiting_on_its_own_task_group_on_either_loop() -> None:
    # The pool's child task is cancelled with it: its task group was opened
    # inside the budget's scope.
    child_cancelled = anyio.Event()

    async def child() -> None:
        try:
            await anyio.sleep_forever()
        finally:
            child_cancelled.set()

    async def answer(request: httpx.Request) -> httpx.Response:
        async with anyio.create_task_group() as tg:
            tg.start_soon(child)
            await anyio.sleep_forever()
        raise AssertionError("unreachable")

    await assert_the_budget_ends(answer)
    assert child_cancelled.is_set()


async def test_a_pools_shielded_wait_outlasts_the_budget_on_either_loop() -> None:
    # The budget ends while the pool waits in a shielded scope: the shield
    # holds (the budget's scope is outside it), and the call ends at the
    # pool's next wait outside the shield.
    release = anyio.Event()
    shielded: list[str] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        with anyio.CancelScope(shield=True):
            await release.wait()
            shielded.append("released")
        await anyio.sleep_forever()
        raise AssertionError("unreachable")

    async with warmed(answer) as (transport, http):
        deadline = anyio.current_time() + 0.1

        async def release_after_the_budget() -> None:
            await anyio.sleep_until(deadline + 0.05)
            release.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(release_after_the_budget)
            with pytest.raises(CallTimeout) as info:
                await http.get(URL, extensions={"nadisc.deadline": deadline})
        assert info.value.limit == "nadisc.deadline"
        assert shielded == ["released"]
        assert_settled(transport, 1)


# -- httpx's own pool, a real loopback server, the real clock ---------------------------


@pytest.mark.trio_only  # the loopback backend is hypercorn on trio
async def test_httpx_pool_carries_the_budget_in_its_timeouts() -> None:
    async with serve_backends(HttpBackend("slow", latency=30.0)) as (slow,):
        memory = provider(slow.instance())
        async with (
            memory_owner({"primary": memory}) as owner,
            DiscoveryTransport(owner) as transport,
            httpx.AsyncClient(mounts={"nadisc://": transport}, timeout=0.3) as http,
        ):
            error, elapsed = await timed_out(http.get(URL))
            assert error.limit == "httpx timeout" and error.seconds == 0.3
            # At least the 0.3 s timer (it cannot fire early); measured 0.30 s,
            # and a bound 13x that is still well below the backend's 30 s.
            assert 0.3 <= elapsed < 4.0
            assert isinstance(error.__cause__, httpx.ReadTimeout)
            error, elapsed = await timed_out(http.get(URL, timeout=0.2))
            assert error.limit == "httpx timeout" and error.seconds == 0.2
            route = transport.route("primary", SERVICE)
            assert route is not None
            assert route.statistics().in_flight == {"slow": 0}


@pytest.mark.trio_only  # the loopback backend is hypercorn on trio
async def test_rest_client_budget_covers_the_body_over_httpx_pool() -> None:
    backend = HttpBackend("s", chunks=6, chunk_delay=1.5)
    async with (
        serve_backends(backend) as (s,),
        memory_owner({"primary": provider(s.instance())}) as owner,
        RestDiscoveryClient(owner) as rest,
    ):
        error, elapsed = await timed_out(rest.get("/", service=SERVICE, timeout=0.3))
        # The whole body would take 9 s; cut at the 0.3 s budget (measured
        # 0.30 s, bounded at 13x that).
        assert error.limit == "httpx timeout" and 0.3 <= elapsed < 4.0


# httpx.MockTransport is called as it calls itself: a synchronous handler
# cannot wait, so it runs under no scope of the transport's; an async
# handler's answer, and a request body still to be read, wait inside the
# budget's scope, entered before they start.


async def test_a_synchronous_mock_handler_runs_under_no_scope_of_ours_on_either_loop() -> None:
    deadlines: list[float] = []

    def answer(request: httpx.Request) -> httpx.Response:
        deadlines.append(anyio.current_effective_deadline())
        return httpx.Response(200, content=b"at once")

    async with mocked(answer, 60_000) as (transport, http):
        first = await http.get(URL)  # opens the route
        second = await http.get(URL)  # the warmed route's fast path
        assert first.content == second.content == b"at once"
        assert deadlines == [math.inf, math.inf]
        assert_settled(transport, 0)


async def test_an_async_mock_handler_answers_inside_the_budget_on_either_loop() -> None:
    deadlines: list[float] = []

    async def answer(request: httpx.Request) -> httpx.Response:
        deadlines.append(anyio.current_effective_deadline())
        return httpx.Response(200, content=b"awaited")

    async with mocked(answer, 60_000) as (transport, http):
        response = await http.get(URL)
        assert response.content == b"awaited"
        (deadline,) = deadlines
        assert math.isfinite(deadline)  # a scope bounds the answer, where none did above
        assert_settled(transport, 0)


async def test_a_streamed_body_to_a_mock_pool_is_read_within_the_budget_on_either_loop() -> None:
    bodies: list[bytes] = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(request.content)
        return httpx.Response(201)

    async def chunks(stall: bool) -> AsyncIterator[bytes]:
        yield b"one,"
        if stall:
            await anyio.sleep_forever()
        yield b"two"

    async with mocked(answer, 60_000) as (transport, http):
        response = await http.post(URL, content=chunks(stall=False))
        assert response.status_code == 201 and bodies == [b"one,two"]
        deadline = {"nadisc.deadline": anyio.current_time() + 0.05}
        with pytest.raises(CallTimeout) as info:
            await http.post(URL, content=chunks(stall=True), extensions=deadline)
        assert info.value.limit == "nadisc.deadline"
        assert bodies == [b"one,two"]  # the stalled body never reached the handler
        assert_settled(transport, 1)


class _SlowToClose(httpx.AsyncByteStream):
    """A 503's body whose close never finishes."""

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield b"busy"

    async def aclose(self) -> None:
        await anyio.sleep_forever()


async def test_a_refused_mock_answer_that_never_closes_ends_at_the_budget_on_either_loop() -> None:
    # A retried 503 is closed before the next attempt; with the mock pool no
    # scope surrounds the call, so the close is bounded on its own.
    def answer(request: httpx.Request) -> httpx.Response:
        return httpx.Response(503, stream=_SlowToClose())

    rest = RestConfig(
        request_timeout_ms=60_000,
        connect_timeout_ms=10,
        max_attempts=2,
        retry_get_head_on_retryable_status=True,
    )
    async with memory_owner(
        {"primary": provider()}, policies={"primary": policy(rest=rest)}
    ) as owner:
        transport = DiscoveryTransport(owner, transport=httpx.MockTransport(answer))
        async with httpx.AsyncClient(mounts={"nadisc://": transport}) as http:
            deadline = {"nadisc.deadline": anyio.current_time() + 0.05}
            with anyio.fail_after(30), pytest.raises(CallTimeout) as info:
                await http.get(URL, extensions=deadline)
            assert info.value.limit == "nadisc.deadline"
            assert_settled(transport, 0)
