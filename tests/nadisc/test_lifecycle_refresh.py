"""Provider-paced polling: a provider's ``refresh_delay`` (DNS: the answer's
TTL) sets the wait between polls, capped at ``poll_interval_ms``."""

from __future__ import annotations

import inspect

import pytest
import trio
import trio.testing

from nadisc import IncompleteSnapshot
from nadisc.providers._dns import DnsProvider
from nadisc.testing import MemoryProvider

from .owner_support import inst, memory_owner, policy

pytestmark = pytest.mark.trio_only


class TtlProvider(MemoryProvider):
    """A memory provider whose answers carry a TTL, like DNS answers do."""

    def __init__(self, ttl: object) -> None:
        super().__init__(services={"orders": "orders-remote"})
        self.ttl = ttl
        self.asked: list[tuple[str, float]] = []
        self.set("orders-remote", [inst("a")])

    def refresh_delay(self, service: str, poll_interval: float) -> float:
        self.asked.append((service, poll_interval))
        if isinstance(self.ttl, BaseException):
            raise self.ttl
        return self.ttl  # type: ignore[return-value]


async def queries_within(
    provider: MemoryProvider, window: float, *, usable: bool = True, **fields: int
) -> int:
    """Observe ``orders`` and count the provider's queries over ``window`` s."""
    async with memory_owner({"primary": provider}, policies={"primary": policy(**fields)}) as owner:
        observation = await owner.client().observe("orders", trio.current_time() + 1)
        await trio.sleep(window)
        if usable:
            assert observation.snapshot().instances
        return provider.query_counts["orders-remote"]


async def test_the_ttl_paces_the_polls(autojump_clock: trio.testing.MockClock) -> None:
    # poll_interval 5 s; over 19.5 s: queries at 0, 2, 4, ... 18.
    short = TtlProvider(2.0)
    assert await queries_within(short, 19.5) == 10
    assert short.asked and set(short.asked) == {("orders-remote", 5.0)}
    # Without a refresh_delay the poll interval rules: 0, 5, 10, 15.
    plain = MemoryProvider(services={"orders": "orders-remote"})
    plain.set("orders-remote", [inst("a")])
    assert await queries_within(plain, 19.5) == 4


async def test_a_ttl_longer_than_the_poll_interval_is_capped(
    autojump_clock: trio.testing.MockClock,
) -> None:
    assert await queries_within(TtlProvider(3600.0), 19.5) == 4
    # The poll interval given to the provider is the connection's.
    provider = TtlProvider(3600.0)
    assert await queries_within(provider, 9.5, poll_interval_ms=2000) == 5
    assert set(provider.asked) == {("orders-remote", 2.0)}


async def test_a_changing_ttl_changes_the_pace(autojump_clock: trio.testing.MockClock) -> None:
    provider = TtlProvider(4.0)
    async with memory_owner({"primary": provider}) as owner:
        await owner.client().observe("orders", trio.current_time() + 1)
        await trio.sleep(11.5)  # 0, 4, 8
        assert provider.query_counts["orders-remote"] == 3
        provider.ttl = 0.5  # the next answer is due to expire sooner
        # The wait after the query at 8 was already 4 s: 12, then every
        # 0.5 s: 12.5 ... 15.5.
        await trio.sleep(4.25)
        assert provider.query_counts["orders-remote"] == 3 + 8


@pytest.mark.parametrize("answer", [float("nan"), float("inf"), 0.0, -1.0, "2", True])
async def test_nonsense_answers_fall_back_to_the_poll_interval(
    autojump_clock: trio.testing.MockClock, answer: object
) -> None:
    assert await queries_within(TtlProvider(answer), 19.5) == 4


async def test_a_raising_refresh_delay_falls_back_to_the_poll_interval(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    provider = TtlProvider(RuntimeError("broken"))
    assert await queries_within(provider, 19.5) == 4
    assert "refresh_delay raised RuntimeError" in caplog.text


async def test_failures_still_back_off_instead(autojump_clock: trio.testing.MockClock) -> None:
    provider = TtlProvider(0.5)
    provider.fail("orders-remote", IncompleteSnapshot("timeout"))
    # initial_backoff 1 s, max 2 s: the delays are drawn from [0.5, 1] then
    # [1, 2]; the 0.5 s TTL would have asked for about 20 queries.
    count = await queries_within(provider, 9.5, usable=False)
    assert provider.asked == []  # never consulted after a failure
    assert 4 <= count <= 9


def test_the_dns_provider_offers_the_same_shape() -> None:
    parameters = list(inspect.signature(DnsProvider.refresh_delay).parameters)
    assert parameters == ["self", "service", "poll_interval"]
