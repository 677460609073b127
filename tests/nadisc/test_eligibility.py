"""Local eligibility: channels, checks, lapse, close and garbage collection."""

from __future__ import annotations

import gc

import pytest
import trio

import nadisc
from nadisc import Eligibility, EligibilityController, EligibilityError


def test_channel_update_lapse_and_close() -> None:
    controller, eligibility = Eligibility.channel()
    assert isinstance(controller, EligibilityController)
    assert not eligibility.is_eligible(0.0)  # nothing granted yet
    controller.update(True, 2.0, now=10.0)
    assert eligibility.is_eligible(10.0)
    assert eligibility.is_eligible(11.999)
    assert not eligibility.is_eligible(12.0)  # lapsed at once, no timer needed
    controller.update(True, 2.0, now=20.0)
    controller.update(False, 5.0, now=20.5)
    assert not eligibility.is_eligible(20.6)
    controller.update(True, 5.0, now=21.0)
    controller.close()
    assert controller.closed
    assert not eligibility.is_eligible(21.5)
    controller.close()  # idempotent
    with pytest.raises(EligibilityError, match="closed"):
        controller.update(True, 1.0, now=22.0)


@pytest.mark.parametrize("duration", [0.0, 0.0009, 30.001, -1.0, float("nan"), float("inf")])
def test_duration_bounds(duration: float) -> None:
    controller, _ = Eligibility.channel()
    with pytest.raises(EligibilityError, match="duration"):
        controller.update(True, duration, now=0.0)


def test_duration_bounds_inclusive_and_types() -> None:
    controller, eligibility = Eligibility.channel()
    controller.update(True, 0.001, now=0.0)
    assert eligibility.is_eligible(0.0005)
    controller.update(True, 30.0, now=0.0)
    assert eligibility.is_eligible(29.9)
    with pytest.raises(EligibilityError):
        controller.update(True, True, now=0.0)  # a bool is not a duration
    with pytest.raises(EligibilityError):
        controller.update("yes", 1.0, now=0.0)  # type: ignore[arg-type]
    assert isinstance(EligibilityError("x"), nadisc.DiscoveryError)


def test_update_outside_the_loop_needs_now() -> None:
    controller, _ = Eligibility.channel()
    with pytest.raises(EligibilityError, match="now="):
        controller.update(True, 1.0)


def test_second_controller_is_refused() -> None:
    _controller, eligibility = Eligibility.channel()
    with pytest.raises(EligibilityError, match="already has its controller"):
        eligibility.take_controller()
    with pytest.raises(EligibilityError):
        Eligibility.from_check(lambda: True).take_controller()


def test_dropping_the_controller_makes_it_ineligible() -> None:
    controller, eligibility = Eligibility.channel()
    controller.update(True, 30.0, now=0.0)
    assert eligibility.is_eligible(1.0)
    del controller
    gc.collect()
    assert not eligibility.is_eligible(1.0)


def test_from_check_and_always() -> None:
    state = {"up": True}
    eligibility = Eligibility.from_check(lambda: state["up"])
    assert eligibility.is_eligible(0.0)
    state["up"] = False
    assert not eligibility.is_eligible(0.0)

    def broken() -> bool:
        raise RuntimeError("boom")

    assert not Eligibility.from_check(broken).is_eligible(0.0)
    assert not Eligibility.from_check(lambda: 1).is_eligible(0.0)  # type: ignore[arg-type,return-value]
    assert Eligibility.always().is_eligible(123.0)
    with pytest.raises(EligibilityError):
        Eligibility.from_check(42)  # type: ignore[arg-type]
    with pytest.raises(EligibilityError):
        Eligibility()


async def test_update_uses_the_event_loop_clock(autojump_clock: trio.testing.MockClock) -> None:
    controller, eligibility = Eligibility.channel()
    controller.update(True, 1.0)
    assert eligibility.is_eligible(trio.current_time())
    await trio.sleep(1.0)
    assert not eligibility.is_eligible(trio.current_time())


async def test_changed_wakes_on_update_and_close(autojump_clock: trio.testing.MockClock) -> None:
    controller, eligibility = Eligibility.channel()
    seen: list[int] = []

    async def waiter() -> None:
        await eligibility.changed()
        seen.append(eligibility.revision)
        await eligibility.changed()
        seen.append(eligibility.revision)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.sleep(1)
        controller.update(True, 5.0)
        await trio.sleep(1)
        controller.close()
    assert seen == [1, 2]


def test_repr_shows_no_internals() -> None:
    controller, eligibility = Eligibility.channel()
    assert "closed=False" in repr(controller)
    assert "channel" in repr(eligibility)


def test_named_sources_are_named_in_errors_and_reprs() -> None:
    controller, eligibility = Eligibility.channel("web")
    assert (
        eligibility.name == "web" and "'web'" in repr(eligibility) and "'web'" in repr(controller)
    )
    with pytest.raises(EligibilityError, match=r"^eligibility 'web': duration 31") as info:
        controller.update(True, 31.0, now=0.0)
    assert info.value.source == "web" and info.value.detail.startswith("duration")
    with pytest.raises(EligibilityError, match="'web': this eligibility channel already"):
        eligibility.take_controller()
    controller.close()
    with pytest.raises(EligibilityError, match="'web': the eligibility controller is closed"):
        controller.update(True, 1.0, now=0.0)
    check = Eligibility.from_check(lambda: True, name="saga-recovery")
    with pytest.raises(EligibilityError, match="'saga-recovery': a check-based"):
        check.take_controller()
    with pytest.raises(EligibilityError, match="'grpc': from_check needs a callable"):
        Eligibility.from_check(3, name="grpc")  # type: ignore[arg-type]
    # Unnamed: the message is unchanged and carries no source.
    plain, _ = Eligibility.channel()
    with pytest.raises(EligibilityError, match=r"^duration") as unnamed:
        plain.update(True, 0.0, now=0.0)
    assert unnamed.value.source is None
    for bad in ("", "  ", 5):
        with pytest.raises(EligibilityError, match="non-empty string"):
            Eligibility.channel(bad)  # type: ignore[arg-type]
