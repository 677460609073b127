"""Through a Balance: a shunned endpoint is probed again; timeouts are evidence; loops."""

from __future__ import annotations

import random

import anyio
import anyio.lowlevel
import pytest
import trio

from poise import Balance, Endpoint, PeakEwma, PowerOfTwoChoices, service_fn


@pytest.mark.trio_only
async def test_an_endpoint_that_had_a_slow_second_gets_traffic_again(
    autojump_clock: object,
) -> None:
    slow_until = [0.0]
    counts = [0, 0, 0]

    def make(index: int) -> Endpoint[int, int]:
        async def serve(request: int) -> int:
            counts[index] += 1
            if index == 0 and trio.current_time() < slow_until[0]:
                await trio.sleep(2.0)
            else:
                await trio.sleep(0.020)
            return index

        return Endpoint(index, service_fn(serve), tracker=PeakEwma())

    balance: Balance[int, int] = Balance(
        PowerOfTwoChoices(random.Random(3)), [make(i) for i in range(3)]
    )
    slow_until[0] = trio.current_time() + 0.1
    tracker = balance.endpoint(0).tracker
    assert isinstance(tracker, PeakEwma)
    # Sequential traffic, one request every 100 ms, for 120 virtual seconds.
    async with trio.open_nursery() as nursery:
        for n in range(1200):
            nursery.start_soon(balance.dispatch, n)
            await trio.sleep(0.1)
            if n == 300:
                assert tracker.rtt_estimate >= 2.0  # it did answer slowly once
                shunned = counts[0]
    # Shut out for about decay x ln(2 s / 20 ms) = 46 s, then back to its share.
    later = counts[0] - shunned
    assert later > 0.5 * (900 / 3), counts


@pytest.mark.trio_only
async def test_a_timed_out_call_raises_the_estimate(autojump_clock: object) -> None:
    async def hang(request: int) -> int:
        await trio.sleep_forever()
        raise AssertionError  # pragma: no cover

    tracker = PeakEwma()
    balance: Balance[int, int] = Balance(
        PowerOfTwoChoices(random.Random(1)), [Endpoint("h", service_fn(hang), tracker=tracker)]
    )
    with trio.move_on_after(1.0):
        await balance.dispatch(0)
    assert tracker.in_flight == 0
    assert tracker.rtt_estimate == pytest.approx(1.0)
    assert balance.statistics().in_flight == 0


def test_a_balance_used_on_trio_then_on_asyncio_falls_back_to_anyio() -> None:
    async def echo(request: int) -> int:
        await anyio.lowlevel.checkpoint()
        return request

    balance: Balance[int, int] = Balance(
        PowerOfTwoChoices(random.Random(1)),
        [Endpoint(i, service_fn(echo), tracker=PeakEwma()) for i in range(3)],
    )

    async def twice() -> list[int]:
        return [await balance.dispatch(1), (await balance.dispatch_held(2)).response]

    assert anyio.run(twice, backend="trio") == [1, 2]
    assert balance._checkpoint is trio.lowlevel.checkpoint
    assert balance._clock is trio.current_time
    assert anyio.run(twice, backend="asyncio") == [1, 2]
    assert balance._clock is anyio.current_time
    assert anyio.run(twice, backend="trio") == [1, 2]


def test_a_custom_clock_is_kept_on_trio() -> None:
    async def echo(request: int) -> int:
        return request

    def clock() -> float:
        return 5.0

    balance: Balance[int, int] = Balance(
        PowerOfTwoChoices(), [Endpoint(0, service_fn(echo))], clock=clock
    )
    assert anyio.run(balance.dispatch, 7, backend="trio") == 7
    assert balance._clock is clock
