"""Bad input to the owner: typed errors, nothing half-built, nothing left running."""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Coroutine, Iterator
from typing import Any

import anyio
import pytest
from pydantic import BaseModel, ConfigDict

import nadisc._owner
from nadisc import (
    ConfigError,
    ConnectionContext,
    ConnectionSpec,
    DeadlineExceeded,
    DiscoveryConfig,
    ObservationSnapshot,
    OwnerBuilder,
    Provider,
)
from nadisc.testing import MemoryProvider

from .owner_support import all_tasks, inst, memory_owner


class _AnySettings(BaseModel):
    model_config = ConfigDict(extra="allow")


class CountingFactory:
    """A provider factory that counts what it creates; ``fail`` makes it raise."""

    name = "memory"
    settings_model = _AnySettings

    def __init__(self, *, fail: bool = False) -> None:
        self.fail = fail
        self.created: list[MemoryProvider] = []

    def create(self, context: ConnectionContext, settings: BaseModel) -> Provider:
        if self.fail:
            raise RuntimeError(f"cannot build the provider of {context.name!r}")
        provider = MemoryProvider(services={"orders": "orders"})
        provider.set("orders", [inst("a")])
        self.created.append(provider)
        return provider


@pytest.fixture
def factories(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, CountingFactory]]:
    """Connection name -> its factory (``from_config`` looks them up by path)."""
    table: dict[str, CountingFactory] = {}

    def load_factory(name: str, *, path: str = "provider") -> CountingFactory:
        connection = path.split(".")[2]
        return table.setdefault(connection, CountingFactory())

    monkeypatch.setattr(nadisc._owner, "load_factory", load_factory)
    yield table


def two_connections() -> DiscoveryConfig:
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {
                "primary": {"provider": "memory"},
                "second": {"provider": "memory"},
                "third": {"provider": "memory"},
            },
        }
    )


# ----------------------------------------------------------------- legacy default


async def test_an_unknown_legacy_default_creates_no_provider(
    factories: dict[str, CountingFactory],
) -> None:
    builder = OwnerBuilder.from_config(two_connections()).default_connection("nope")
    before = all_tasks()
    with pytest.raises(ConfigError) as info:
        async with builder.open():
            pytest.fail("the body must not run")
    assert info.value.path == "default_connection"
    assert "nope" in str(info.value)
    assert [len(f.created) for f in factories.values()] == [0, 0, 0]
    assert all_tasks() == before


async def test_an_unknown_legacy_default_closes_a_provider_handed_over() -> None:
    provider = MemoryProvider(services={"orders": "orders"})
    builder = OwnerBuilder().connection(ConnectionSpec("primary", provider))
    builder.default_connection("nope")
    with pytest.raises(ConfigError):
        async with builder.open():
            pytest.fail("the body must not run")
    assert provider.close_calls == 1
    assert provider.prepare_calls == 0


# ----------------------------------------------------------------- failed build


async def test_a_provider_failing_to_build_leaves_nothing_half_built(
    factories: dict[str, CountingFactory],
) -> None:
    factories["second"] = CountingFactory(fail=True)
    builder = OwnerBuilder.from_config(two_connections())
    before = all_tasks()
    with pytest.raises(RuntimeError, match="second"):
        async with builder.open():
            pytest.fail("the body must not run")
    (first,) = factories["primary"].created
    assert first.close_calls == 1 and first.prepare_calls == 0
    # no factory runs after the one that failed
    assert factories["third"].created == []
    assert all_tasks() == before


async def test_a_failed_build_closes_ready_made_providers_too(
    factories: dict[str, CountingFactory],
) -> None:
    factories["primary"] = CountingFactory(fail=True)
    ready = MemoryProvider(services={"orders": "orders"})
    builder = OwnerBuilder.from_config(two_connections(), providers={"third": ready})
    with pytest.raises(RuntimeError, match="primary"):
        async with builder.open():
            pytest.fail("the body must not run")
    assert ready.close_calls == 1
    assert factories["second"].created == []


# ----------------------------------------------------------------- shutdown deadlines


@pytest.mark.parametrize("bad", [math.nan, "soon", None, True])
async def test_every_shutdown_deadline_is_checked(autojump_clock: object, bad: object) -> None:
    provider = MemoryProvider(services={"orders": "orders"})
    provider.set("orders", [inst("a")])
    async with memory_owner({"primary": provider}) as owner:
        # before any deadline exists
        with pytest.raises(DeadlineExceeded):
            owner.begin_quiesce(bad)  # type: ignore[arg-type]
        with pytest.raises(DeadlineExceeded):
            owner.begin_close(anyio.current_time() - 1)  # the first one must lie ahead
        deadline = anyio.current_time() + 5
        quiesce = owner.begin_quiesce(deadline)
        # once a shared deadline exists, a malformed one is still refused
        with pytest.raises(DeadlineExceeded):
            owner.begin_quiesce(bad)  # type: ignore[arg-type]
        with pytest.raises(DeadlineExceeded):
            owner.begin_close(bad)  # type: ignore[arg-type]
        await quiesce.wait()
        await anyio.sleep(10)
        # a later, well-formed deadline that already passed is fine: the first
        # deadline is the shared one, and cleanup must still be startable
        report = await owner.begin_close(deadline).wait()
        assert report.tasks_left == 0
        with pytest.raises(DeadlineExceeded):
            owner.begin_close(bad)  # type: ignore[arg-type]


# ----------------------------------------------------------------- submit closures


class AsyncCallable:
    async def __call__(self, snapshot: ObservationSnapshot) -> str:
        return snapshot.identities()[0]


class SubAsyncCallable(AsyncCallable):
    pass


async def pick(snapshot: ObservationSnapshot) -> str:
    return snapshot.identities()[0]


async def pick_with(prefix: str, snapshot: ObservationSnapshot) -> str:
    return prefix + snapshot.identities()[0]


def pick_sync(prefix: str, snapshot: ObservationSnapshot) -> str:
    return prefix + snapshot.identities()[0]


@pytest.mark.parametrize(
    "closure",
    [pick, AsyncCallable(), SubAsyncCallable(), functools.partial(pick_with, ">")],
    ids=["async-def", "async-call", "inherited-async-call", "partial"],
)
async def test_an_async_closure_is_refused_before_the_check(
    autojump_clock: object, closure: object
) -> None:
    provider = MemoryProvider(services={"orders": "orders"})
    provider.set("orders", [inst("a")])
    async with memory_owner({"primary": provider}) as owner:
        orders = await owner.client().observe("orders", anyio.current_time() + 5)
        with pytest.raises(TypeError, match="synchronous"):
            orders.submit_if_current(closure)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="synchronous"):
            orders.submit_if_current_strict(closure)  # type: ignore[arg-type]


async def test_a_synchronous_closure_still_works(autojump_clock: object) -> None:
    provider = MemoryProvider(services={"orders": "orders"})
    provider.set("orders", [inst("a")])
    async with memory_owner({"primary": provider}) as owner:
        orders = await owner.client().observe("orders", anyio.current_time() + 5)
        assert orders.submit_if_current(lambda s: s.identities()) == ("a",)
        assert orders.submit_if_current_strict(functools.partial(pick_sync, ">")) == ">a"
        with pytest.raises(TypeError, match="callable"):
            orders.submit_if_current("not callable")  # type: ignore[arg-type]


async def test_a_closure_returning_a_coroutine_is_refused_and_the_coroutine_closed(
    autojump_clock: object,
) -> None:
    provider = MemoryProvider(services={"orders": "orders"})
    provider.set("orders", [inst("a")])
    started: list[str] = []

    async def send(identity: str) -> None:
        started.append(identity)

    async with memory_owner({"primary": provider}) as owner:
        orders = await owner.client().observe("orders", anyio.current_time() + 5)
        coroutines: list[Coroutine[Any, Any, None]] = []

        def later(s: ObservationSnapshot) -> Coroutine[Any, Any, None]:
            coroutines.append(send(s.identities()[0]))
            return coroutines[-1]

        with pytest.raises(TypeError, match="returned a coroutine"):
            _ = orders.submit_if_current(later)
        with pytest.raises(TypeError, match="returned a coroutine"):
            _ = orders.submit_if_current_strict(later)
        # Both were closed unrun: nothing was sent.
        assert [inspect.getcoroutinestate(c) for c in coroutines] == [inspect.CORO_CLOSED] * 2
    assert started == []
