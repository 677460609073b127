"""An instance ejected because it could not be reached returns once it connects again.

The rules are synchronous and checked with the time and the draws given
(:class:`ConnectBackoff`, :class:`ReconnectSchedule`, the route detector's
early return inside a real poise balance); the reconnect task runs against
real grpcio servers: one stopped and started again on the same port, one
answering with failure statuses. Both loops; the assertions are on the order
of events and on counts, never on the clock.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from types import ModuleType
from typing import Any

import anyio
import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nadisc import ConnectionConfig, Instance
from nadisc._config import OutlierConfig, RestConfig
from nadisc._ejection import EjectionLog, EjectionOptions, RouteDetector
from nadisc.grpc import ConnectBackoff, DiscoveryChannel, RpcError, discovery_channel
from nadisc.grpc._reconnect import MIN_CONNECT_TIMEOUT, ReconnectSchedule
from nadisc.testing import MemoryProvider
from poise import Balance, Endpoint, EndpointError, RoundRobin, service_fn
from tests.grpc.discovery_support import Backend, backends, failing
from tests.nadisc.owner_support import memory_owner

#: Long enough that no ejection of these tests can end by time while they run.
EJECTION_MS = 600_000

# -- the schedule ------------------------------------------------------------------


def test_the_backoff_is_grpcs_connection_backoff() -> None:
    # doc/connection-backoff.md: INITIAL_BACKOFF 1 s, MULTIPLIER 1.6,
    # JITTER 0.2, MAX_BACKOFF 120 s.
    backoff = ConnectBackoff()
    expected = [1.0]
    while expected[-1] < 120.0:
        expected.append(min(expected[-1] * 1.6, 120.0))
    got = [backoff.backoff(n) for n in range(len(expected) + 3)]
    assert got[: len(expected)] == pytest.approx(expected)
    assert got[len(expected) :] == [120.0] * 3
    assert backoff.delay(0, 0.0) == pytest.approx(0.8)
    assert backoff.delay(0, 0.5) == pytest.approx(1.0)
    assert backoff.delay(3, 1.0) == pytest.approx(1.2 * 1.6**3)
    assert backoff.backoff(10**6) == 120.0


@pytest.mark.parametrize(
    ("fields", "error"),
    [
        ({"initial": 0.0}, ValueError),
        ({"initial": 5.0, "maximum": 1.0}, ValueError),
        ({"multiplier": 0.5}, ValueError),
        ({"jitter": 1.0}, ValueError),
        ({"initial": math.inf}, ValueError),
        ({"initial": "1"}, TypeError),
    ],
)
def test_bad_backoff_values_are_refused(fields: dict[str, Any], error: type[Exception]) -> None:
    with pytest.raises(error, match="ConnectBackoff"):
        ConnectBackoff(**fields)


@given(
    st.floats(0.0, 1e6),
    st.lists(st.tuples(st.floats(0.0, 300.0), st.floats(0.0, 0.999)), max_size=30),
    st.floats(0.0, 0.999),
)
def test_attempts_come_one_growing_jittered_backoff_after_the_last_began(
    ejected_at: float, attempts: list[tuple[float, float]], first_draw: float
) -> None:
    backoff = ConnectBackoff()
    schedule = ReconnectSchedule(backoff)
    due = schedule.start("b0", ejected_at, first_draw)
    assert due == pytest.approx(ejected_at + backoff.delay(0, first_draw))
    for failures, (took, draw) in enumerate(attempts, start=1):
        began = due + took / 10
        assert schedule.attempt_timeout("b0") == max(
            backoff.backoff(failures - 1), MIN_CONNECT_TIMEOUT
        )
        due = schedule.failed("b0", began, draw)  # type: ignore[assignment]
        low = backoff.backoff(failures) * (1 - backoff.jitter)
        high = backoff.backoff(failures) * (1 + backoff.jitter)
        assert low - 1e-9 <= due - began <= high + 1e-9
        assert schedule.due("b0") == due
    assert schedule.stop("b0")
    assert "b0" not in schedule and schedule.failed("b0", 0.0, 0.5) is None


# -- the early return, in a real balance -------------------------------------------------


def detector(log: EjectionLog) -> RouteDetector:
    return EjectionOptions(
        consecutive_failures=2, base_ejection_time=60.0, max_ejection_time=600.0
    ).detector(log)


async def test_a_reinstated_ejection_ends_at_the_next_scan_and_the_others_keep_theirs() -> None:
    now = [0.0]
    log = EjectionLog()
    found = detector(log)

    def endpoint(key: str) -> Endpoint[None, str]:
        async def serve(request: None) -> str:
            if key in "ab":
                raise ConnectionRefusedError(key)
            return key

        return Endpoint(key, service_fn(serve))

    balance = Balance(
        RoundRobin(),
        [endpoint(key) for key in "abcd"],
        outlier_detector=found,
        clock=lambda: now[0],
    )
    answers = []
    for _ in range(8):
        try:
            answers.append(await balance.dispatch(None))
        except EndpointError:
            answers.append("failed")
    assert answers == ["failed", "failed", "c", "d"] * 2
    assert set(found.ejected) == {"a", "b"}
    assert not found.reinstate("c", now[0])  # not ejected: nothing to end
    now[0] = 1.0
    assert found.reinstate("a", now[0])
    assert found.next_due() == 1.0
    # The next pick's scan returns "a" (its turn is the oldest), "b" stays out.
    with pytest.raises(EndpointError) as info:
        await balance.dispatch(None)
    assert info.value.key == "a"
    assert "a" not in found.ejected and found.is_ejected("b")
    assert log.last["a"].reason == "reconnected" and not log.last["a"].ejected
    assert (log.ejections, log.returns) == (2, 1)
    assert found.ejections("a") == 0  # it starts over
    assert found.ejected_until("b") == 60.0
    assert found.next_due() == 60.0
    assert repr(found).startswith("<RouteDetector")


# -- real servers -----------------------------------------------------------------------


@asynccontextmanager
async def opened(*instances: Instance, **options: Any) -> AsyncIterator[DiscoveryChannel]:
    memory = MemoryProvider(services={"orders": "orders"})
    memory.set("orders", instances)
    config = ConnectionConfig(
        provider="memory",
        rest=RestConfig(
            outlier=OutlierConfig(base_ejection_ms=EJECTION_MS, max_ejection_ms=EJECTION_MS)
        ),
    )
    async with (
        memory_owner({"primary": memory}, policies={"primary": config}) as owner,
        discovery_channel(owner, "primary", "orders", **options) as channel,
    ):
        yield channel


async def eject_unreachable(channel: DiscoveryChannel, stub: Any, pb: ModuleType) -> None:
    """Calls until b0 (stopped) is ejected; every call is answered by b1."""
    while "b0" not in channel.route.ejected():
        assert (await stub.UnaryCall(pb.SimpleRequest(), timeout=10)).username == "b1"


async def test_a_restarted_instance_gets_calls_again_before_its_ejection_ends(
    pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 2) as (b0, b1):
        async with opened(b0.instance(), b1.instance()) as channel:
            stub = pb_grpc.TestServiceStub(channel)
            await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
            await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
            port = b0.port
            b0.stop()
            with anyio.fail_after(30):
                await eject_unreachable(channel, stub, pb)
            assert channel.route.ejection_log.last["b0"].ejected
            restarted = Backend("b0", pb, pb_grpc, port=port)
            try:
                with anyio.fail_after(30):
                    while restarted.calls == 0:
                        await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
                        await anyio.sleep(0.05)
                back = channel.route.ejection_log.last["b0"]
                # Returned by the reconnect, not by the end of its ejection
                # (which lies EJECTION_MS after it began).
                assert not back.ejected and back.reason == "reconnected"
                assert "b0" not in channel.route.ejected()
                assert channel.reconnecting() == frozenset()
                # Both take turns again.
                before = (restarted.calls, b1.calls)
                for _ in range(4):
                    await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
                assert (restarted.calls - before[0], b1.calls - before[1]) == (2, 2)
            finally:
                restarted.stop()


async def test_an_instance_ejected_for_its_answers_keeps_its_ejection(
    pb: ModuleType, pb_grpc: ModuleType
) -> None:
    with backends(pb, pb_grpc, 2) as (b0, b1):
        async with opened(b0.instance(), b1.instance()) as channel:
            stub = pb_grpc.TestServiceStub(channel)
            with anyio.fail_after(30):
                while not channel.route.ejected():
                    with pytest.raises(RpcError) as info:
                        await stub.UnaryCall(failing(pb, grpc.StatusCode.UNAVAILABLE), timeout=10)
                    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            # Its connection is up: it answered, it was reachable.
            assert len(channel.route.ejected()) == 1
            assert channel.reconnecting() == frozenset()
            (ejected,) = channel.route.ejected()
            assert channel.route.ejection_log.last[ejected].ejected


async def test_close_ends_the_reconnect_attempts_at_once(
    pb: ModuleType, pb_grpc: ModuleType
) -> None:
    # A backoff far longer than the test: only the close can end the task.
    slow = ConnectBackoff(initial=3600.0, maximum=3600.0)
    with backends(pb, pb_grpc, 2) as (b0, b1):
        with anyio.fail_after(30):
            async with opened(b0.instance(), b1.instance(), reconnect_backoff=slow) as channel:
                stub = pb_grpc.TestServiceStub(channel)
                b0.stop()
                await eject_unreachable(channel, stub, pb)
                assert channel.reconnecting() == {"b0"}
        assert channel.reconnecting() == frozenset()
        assert b1.calls >= 1


async def test_with_the_health_probe_a_reconnected_instance_must_serve(
    pb: ModuleType, pb_grpc: ModuleType
) -> None:
    quick = ConnectBackoff(initial=0.05, maximum=0.2)
    with backends(pb, pb_grpc, 2) as (b0, b1):
        async with opened(
            b0.instance(), b1.instance(), reconnect_backoff=quick, reconnect_health=True
        ) as channel:
            stub = pb_grpc.TestServiceStub(channel)
            port = b0.port
            b0.stop()
            with anyio.fail_after(30):
                await eject_unreachable(channel, stub, pb)
            restarted = Backend("b0", pb, pb_grpc, port=port)
            restarted.health = "not serving"
            try:
                with anyio.fail_after(30):
                    # Connected, asked, refused: still out, still being asked.
                    while restarted.health_checks < 3:
                        reply = await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
                        assert reply.username == "b1"
                        await anyio.sleep(0.05)
                assert restarted.calls == 0
                assert "b0" in channel.route.ejected()
                assert channel.reconnecting() == {"b0"}
                restarted.health = "serving"
                with anyio.fail_after(30):
                    while restarted.calls == 0:
                        await stub.UnaryCall(pb.SimpleRequest(), timeout=10)
                        await anyio.sleep(0.05)
                assert channel.route.ejection_log.last["b0"].reason == "reconnected"
            finally:
                restarted.stop()
