"""The console model under trio's MockClock: versions, deltas, the sampling role."""

from __future__ import annotations

import json
from typing import Any

import pytest
import trio
import trio.lowlevel
import trio.testing

from nadisc import DiscoveryConfig, open_discovery
from nadisc.observability import ConsoleModel
from nadisc.observability._model import CHUNK
from nadisc.testing import MemoryProvider
from tests.nadisc.owner_support import inst
from tests.observability.support import apply_message, identities

pytestmark = pytest.mark.trio_only

# Quiet between changes: no poll lands inside a test (the overview would move).
CONFIG = DiscoveryConfig.model_validate(
    {
        "enabled": True,
        "connections": {
            "primary": {
                "provider": "host",
                "poll_interval_ms": 600_000,
                "snapshot": {"max_age_ms": 900_000},
            }
        },
    }
)


def provider() -> MemoryProvider:
    memory = MemoryProvider(services={"a": "svc-a", "b": "svc-b"}, watch=True, watch_streams=2)
    memory.set("svc-a", [inst("a1")])
    memory.set("svc-b", [inst("b1"), inst("b2")])
    return memory


async def test_versions_move_only_on_change_and_deltas_carry_only_what_changed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    memory = provider()
    async with open_discovery(CONFIG, providers={"primary": memory}) as owner:
        held = [await owner.client().observe(s, trio.current_time() + 5) for s in ("a", "b")]
        model = ConsoleModel(owner.observer(), interval=0.1)
        first = model.resample()
        assert model.resample().seq == first.seq  # nothing changed
        seen: dict[str, int] = {}
        full = json.loads(first.delta(seen, full=True) or "")
        assert set(full["services"]) == {"primary/a", "primary/b"}
        assert first.delta(seen) is None  # up to date

        memory.set("svc-a", [inst("a1"), inst("a2")])
        await trio.lowlevel.checkpoint()
        second = model.resample()
        assert second.seq == first.seq + 1
        state: dict[str, Any] = {}
        apply_message(state, first.delta({}, full=True) or "")
        delta = apply_message(state, second.delta(seen) or "")
        assert delta["type"] == "delta" and set(delta["services"]) == {"primary/a"}
        assert list(delta["instances"]) == ["primary/a#0"]
        assert identities(state, "primary/a") == ["a1", "a2"]

        # A client that skipped several samples gets one delta to the newest.
        lagging = dict(seen)
        for n in range(3, 7):
            memory.set("svc-a", [inst(f"a{i}") for i in range(1, n + 1)])
            memory.set("svc-b", [inst("b1")])
            await trio.lowlevel.checkpoint()
            model.resample()
        newest = model.current
        apply_message(state, newest.delta(lagging) or "")
        assert identities(state, "primary/a") == [f"a{i}" for i in range(1, 7)]
        assert identities(state, "primary/b") == ["b1"]
        assert newest.delta(lagging) is None
        del held


async def test_one_waiter_samples_and_cancelling_it_hands_the_role_over(
    autojump_clock: trio.testing.MockClock,
) -> None:
    memory = provider()
    async with open_discovery(CONFIG, providers={"primary": memory}) as owner:
        held = await owner.client().observe("a", trio.current_time() + 5)
        model = ConsoleModel(owner.observer(), interval=0.1)
        seq = model.current.seq
        results: list[int] = []
        first = trio.CancelScope()

        async def waiter(scope: trio.CancelScope | None) -> None:
            # Like a client: wait for newer samples, again and again.
            with scope or trio.CancelScope():
                last = seq
                while True:
                    last = (await model.wait_newer(last)).seq
                    if scope is None:
                        results.append(last)
                        if "a9" in model.current.chunks["primary/a#0"][1]:
                            return

        async with trio.open_nursery() as nursery:
            nursery.start_soon(waiter, first)  # takes the sampling role
            await trio.sleep(0.05)
            nursery.start_soon(waiter, None)
            await trio.sleep(1.0)
            before = model.samples
            await trio.sleep(1.0)
            # One sampler at a time, every 0.1 s: about 10 samples a second, not 20.
            assert 9 <= model.samples - before <= 11
            first.cancel()  # the sampler leaves; the other waiter takes over
            await trio.sleep(1.0)
            before = model.samples
            await trio.sleep(1.0)
            assert 9 <= model.samples - before <= 11
            memory.set("svc-a", [inst("a9")])
        assert results and "a9" in model.current.chunks["primary/a#0"][1]
        assert results == sorted(results)
        del held


async def test_one_instance_changing_in_a_large_service_sends_its_chunk_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    memory = provider()
    big = [inst(f"i{n:03d}") for n in range(3 * CHUNK + 7)]
    memory.set("svc-a", big)
    async with open_discovery(CONFIG, providers={"primary": memory}) as owner:
        held = await owner.client().observe("a", trio.current_time() + 5)
        model = ConsoleModel(owner.observer(), interval=0.1)
        seen: dict[str, int] = {}
        state: dict[str, Any] = {}
        full = model.resample().delta(seen, full=True) or ""
        apply_message(state, full)
        assert identities(state, "primary/a") == [i.identity for i in big]
        changed = list(big)
        changed[CHUNK + 3] = inst("replaced")
        memory.set("svc-a", changed)
        await trio.lowlevel.checkpoint()
        text = model.resample().delta(seen) or ""
        message = apply_message(state, text)
        # The service's header (its revision moved) and one chunk of 50: not 157 instances.
        assert list(message["instances"]) == ["primary/a#1"]
        assert len(text) * 2 < len(full)
        assert identities(state, "primary/a") == [i.identity for i in changed]
        del held


def test_a_non_observer_is_refused() -> None:
    with pytest.raises(TypeError):
        ConsoleModel(object(), interval=0.1)  # type: ignore[arg-type]
