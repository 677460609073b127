"""Outlier ejection of the calling routes: the rest.outlier block and its
options, the decisions with the defaults (sans-IO, time as an argument,
hypothesis), and a route under trio's MockClock where ejections grow."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nadisc import (
    ConfigError,
    DiscoveryTransport,
    EjectionOptions,
    Instance,
    OutlierConfig,
    RestConfig,
    RestOptions,
)
from nadisc._route import DEFAULT_EJECTION
from nadisc.testing import MemoryProvider
from tests.nadisc.owner_support import memory_owner, policy

SERVICE = "orders"


# ---------------------------------------------------------------- configuration


def test_the_defaults_are_on_and_documented() -> None:
    rest = RestConfig()
    assert rest.outlier.enabled and rest.retry_on_connect_failure
    assert rest.attempt_timeout_ms == 0
    options = RestOptions.from_config(rest)
    assert options.ejection == DEFAULT_EJECTION == EjectionOptions()
    assert options.attempt_timeout is None
    assert (
        EjectionOptions(
            consecutive_failures=5,
            failure_rate=None,
            window=10.0,
            minimum_calls=10,
            base_ejection_time=10.0,
            max_ejection_time=300.0,
            max_ejection_percent=50.0,
        )
        == DEFAULT_EJECTION
    )


@given(
    consecutive=st.integers(0, 50),
    rate=st.integers(0, 100),
    window=st.integers(1, 60_000),
    minimum=st.integers(1, 100),
    base=st.integers(1, 60_000),
    extra=st.integers(0, 60_000),
    percent=st.integers(0, 100),
)
def test_the_block_maps_onto_the_options(
    consecutive: int, rate: int, window: int, minimum: int, base: int, extra: int, percent: int
) -> None:
    block = {
        "consecutive_failures": consecutive,
        "failure_rate_percent": rate,
        "window_ms": window,
        "minimum_calls": minimum,
        "base_ejection_ms": base,
        "max_ejection_ms": base + extra,
        "max_ejection_percent": percent,
    }
    if not consecutive and not rate:
        with pytest.raises(ValueError, match="both rules are off"):
            OutlierConfig.model_validate(block)
        off = OutlierConfig.model_validate({**block, "enabled": False})
        assert EjectionOptions.from_config(off) is None
        return
    options = EjectionOptions.from_config(OutlierConfig.model_validate(block))
    assert options is not None
    assert options.consecutive_failures == (consecutive or None)
    assert options.failure_rate == (rate / 100 if rate else None)
    assert options.window == window / 1000
    assert options.base_ejection_time == base / 1000
    assert options.max_ejection_time == (base + extra) / 1000
    assert options.max_ejection_percent == percent


def test_bad_values_are_refused_naming_the_field() -> None:
    with pytest.raises(ValueError, match="base_ejection_ms"):
        OutlierConfig(base_ejection_ms=20_000, max_ejection_ms=10_000)
    with pytest.raises(ValueError, match="attempt_timeout_ms"):
        RestConfig(request_timeout_ms=3000, attempt_timeout_ms=4000)
    with pytest.raises(ConfigError, match=r"rest\.outlier"):
        EjectionOptions(consecutive_failures=None, failure_rate=None)
    with pytest.raises(ConfigError, match=r"rest\.outlier"):
        EjectionOptions(max_ejection_percent=150.0)
    with pytest.raises(ConfigError, match=r"rest\.attempt_timeout"):
        RestOptions(attempt_timeout=20.0)
    with pytest.raises(ConfigError, match=r"rest\.outlier"):
        RestOptions(ejection="on")  # type: ignore[arg-type]


# ---------------------------------------------------------------- decisions


@given(st.lists(st.floats(0.0, 400.0), min_size=1, max_size=12))
def test_with_the_defaults_each_ejection_in_a_row_lasts_longer(gaps: list[float]) -> None:
    # One instance of three fails five times each time it is back; `gaps`
    # is how long after its return it fails again. Time is an argument.
    detector = DEFAULT_EJECTION.detector()
    for key in ("a", "b", "c"):
        detector.add(key)
    now = 0.0
    k = 0
    returned: float | None = None
    for gap in gaps:
        now += gap
        detector.expire(now)
        for _ in range(4):
            assert detector.record("b", True, now) is None
        event = detector.record("b", True, now)
        assert event is not None and event.ejected
        if returned is not None and now - returned >= 300.0:
            k = 0  # in long enough to be forgiven
        k += 1
        assert event.ejections == k
        assert event.until == now + min(10.0 * k, 300.0)
        # Never two of three at once (50 %, rounded down).
        for _ in range(5):
            assert detector.record("a", True, now) is None
        assert detector.ejected == ("b",)
        now = event.until
        assert [e.key for e in detector.expire(now)] == ["b"]
        returned = now


# ---------------------------------------------------------------- a route


@asynccontextmanager
async def calling(**rest: Any) -> AsyncIterator[tuple[DiscoveryTransport, httpx.AsyncClient]]:
    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.port == 1:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, text="ok")

    memory = MemoryProvider(services={SERVICE: SERVICE}, watch=True)
    memory.set(SERVICE, [Instance("bad", "127.0.0.1", 1), Instance("good", "127.0.0.1", 2)])
    async with memory_owner(
        {"primary": memory}, policies={"primary": policy(rest=RestConfig(**rest))}
    ) as owner:
        transport = DiscoveryTransport(owner, transport=httpx.MockTransport(answer))
        async with httpx.AsyncClient(mounts={"nadisc://": transport}) as http:
            yield transport, http


async def test_a_route_ejects_a_failing_instance_for_longer_each_time(
    autojump_clock: object,
) -> None:
    async with calling() as (transport, http):
        ends = []
        route = None
        for _ in range(3):
            for _ in range(20):
                assert (await http.get("nadisc://primary/orders/x")).text == "ok"
            route = transport.route("primary", SERVICE)
            assert route is not None
            ejected = route.statistics().ejected
            assert list(ejected) == ["bad"]
            ends.append(ejected["bad"] - anyio.current_time())
            await anyio.sleep(ends[-1] + 0.001)  # until it is back
        assert route is not None
        stats = route.statistics()
        assert stats.ejections == 3 and stats.sent["bad"] == 15
        # 10 s, 20 s, 30 s (the ejection count multiplies the base).
        assert [round(end) for end in ends] == [10, 20, 30]
        assert route.ejection_log.returns == 2


async def test_a_route_with_ejection_off_keeps_calling_the_failing_instance(
    autojump_clock: object,
) -> None:
    async with calling(outlier={"enabled": False}, retry_on_connect_failure=False) as (
        transport,
        http,
    ):
        failed = 0
        for _ in range(20):
            try:
                await http.get("nadisc://primary/orders/x")
            except httpx.ConnectError:
                failed += 1
        route = transport.route("primary", SERVICE)
        assert route is not None
        assert failed == 10 and route.statistics().ejections == 0
