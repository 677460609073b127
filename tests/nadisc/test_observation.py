"""The observation shell: single flight, deadlines, evidence rules over time."""

from __future__ import annotations

import dataclasses
import gc
import math

import anyio
import pytest
from anyio.abc import TaskStatus
from hypothesis import given, settings
from hypothesis import strategies as st

from nadisc import (
    Capabilities,
    CapacityRejected,
    DeadlineExceeded,
    EvidenceKind,
    EvidenceUnavailable,
    IdentityRevoked,
    IncompleteSnapshot,
    InvalidSnapshot,
    Observation,
    ObservationSink,
    ProviderSnapshot,
)
from nadisc._observation import confirmation_window, next_confirmation, watch_current
from nadisc.testing import MemoryProvider

from .owner_support import inst, memory_owner, policy


def provider(**kwargs: object) -> MemoryProvider:
    p = MemoryProvider(services={"orders": "order-worker"}, **kwargs)  # type: ignore[arg-type]
    p.set("order-worker", [inst("a", 1), inst("b", 2)])
    return p


def reason_of(observation: Observation, *, strict: bool = False) -> str:
    with pytest.raises(EvidenceUnavailable) as info:
        observation.snapshot(strict=strict)
    return info.value.reason


async def test_concurrent_observers_share_one_query(autojump_clock: object) -> None:
    p = provider()
    p.set_latency(1.0)
    async with memory_owner({"primary": p}) as owner:
        handle = owner.client()
        results: list[Observation] = []

        async def one() -> None:
            results.append(await handle.observe("orders", anyio.current_time() + 5))

        async with anyio.create_task_group() as tg:
            for _ in range(50):
                tg.start_soon(one)
        assert len(results) == 50
        assert p.query_counts["order-worker"] == 1
        revisions = {r.snapshot().revision for r in results}
        assert revisions == {1}
        assert owner.observer().snapshot().connection("primary").queries == 1


async def test_a_waiter_that_gives_up_does_not_cancel_the_others(autojump_clock: object) -> None:
    p = provider()
    p.set_latency(2.0)
    async with memory_owner({"primary": p}) as owner:
        handle = owner.client()
        outcome: dict[str, object] = {}

        async def impatient() -> None:
            try:
                await handle.observe("orders", anyio.current_time() + 0.5)
            except DeadlineExceeded as exc:
                outcome["impatient"] = exc

        async def patient() -> None:
            await anyio.sleep(0.1)
            obs = await handle.observe("orders", anyio.current_time() + 5)
            outcome["patient"] = obs.snapshot().identities()

        async with anyio.create_task_group() as tg:
            tg.start_soon(impatient)
            tg.start_soon(patient)
        assert isinstance(outcome["impatient"], DeadlineExceeded)
        assert outcome["patient"] == ("a", "b")
        assert p.query_counts["order-worker"] == 1


async def test_a_cancelled_first_caller_does_not_stop_the_query(autojump_clock: object) -> None:
    p = provider()
    p.set_latency(2.0)
    async with memory_owner({"primary": p}) as owner:
        handle = owner.client()
        with anyio.move_on_after(0.5):
            await handle.observe("orders", anyio.current_time() + 10)
        obs = await handle.observe("orders", anyio.current_time() + 10)
        assert obs.snapshot().identities() == ("a", "b")
        assert p.query_counts["order-worker"] == 1


@pytest.mark.parametrize("deadline_offset", [-1.0, 0.0, math.nan])
async def test_expired_deadline_touches_nothing(
    autojump_clock: object, deadline_offset: float
) -> None:
    p = provider()
    async with memory_owner({"primary": p}) as owner:
        handle = owner.client()
        with pytest.raises(DeadlineExceeded):
            await handle.observe("orders", anyio.current_time() + deadline_offset)
        assert p.query_counts["order-worker"] == 0
        assert owner.observer().snapshot().connection("primary").services == ()
        # with an existing slot: no access time recorded either
        obs = await handle.observe("orders", anyio.current_time() + 5)
        slot = owner._connections["primary"].slots["orders"]
        touched = slot.last_access
        await anyio.sleep(1)
        with pytest.raises(DeadlineExceeded):
            await handle.observe("orders", anyio.current_time() + deadline_offset)
        assert slot.last_access == touched
        assert p.query_counts["order-worker"] == 1
        del obs


async def test_deadline_is_checked_again_after_waiting(autojump_clock: object) -> None:
    p = provider()
    p.set_latency(1.0)
    async with memory_owner({"primary": p}) as owner:
        with pytest.raises(DeadlineExceeded):
            # the listing lands exactly at the deadline: too late
            await owner.client().observe("orders", anyio.current_time() + 1.0)


async def test_complete_empty_list_revokes_at_once(autojump_clock: object) -> None:
    p = provider()
    async with memory_owner(
        {"primary": p},
        policies={"primary": policy(snapshot={"max_age_ms": 15000, "stale_if_error_ms": 10000})},
    ) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        p.set_empty("order-worker")
        await anyio.sleep(5.5)  # one poll
        assert reason_of(obs) == "empty"
        p.set("order-worker", [inst("c", 3)])
        await anyio.sleep(5)
        assert obs.snapshot().identities() == ("c",)


async def test_failures_give_grace_from_last_success_only(autojump_clock: object) -> None:
    p = provider()
    pol = policy(snapshot={"max_age_ms": 15000, "stale_if_error_ms": 8000})
    async with memory_owner({"primary": p}, policies={"primary": pol}) as owner:
        start = anyio.current_time()
        obs = await owner.client().observe("orders", start + 5)
        success_at = obs.snapshot().confirmed_at
        p.fail("order-worker", IncompleteSnapshot("paging broke"))
        await anyio.sleep_until(success_at + 5.5)  # the poll at +5 failed
        snap = obs.snapshot()
        assert snap.degraded and snap.identities() == ("a", "b")
        assert reason_of(obs, strict=True) == "incomplete"
        # retries (with backoff) keep failing; none of them extends the grace
        await anyio.sleep_until(success_at + 7.99)
        assert p.query_counts["order-worker"] >= 3
        assert obs.snapshot().degraded
        await anyio.sleep_until(success_at + 8.0)
        assert reason_of(obs) == "stale"
        p.fail("order-worker", None)
        await anyio.sleep(40)
        assert obs.snapshot(strict=True).identities() == ("a", "b")


@pytest.mark.parametrize(
    ("failure", "reason"),
    [(IdentityRevoked("403"), "revoked"), (InvalidSnapshot("bad records"), "invalid")],
)
async def test_no_grace_for_revocation_and_invalid(
    autojump_clock: object, failure: Exception, reason: str
) -> None:
    p = provider()
    pol = policy(snapshot={"max_age_ms": 15000, "stale_if_error_ms": 15000})
    async with memory_owner({"primary": p}, policies={"primary": pol}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        p.fail("order-worker", failure)  # type: ignore[arg-type]
        await anyio.sleep(5.5)
        assert reason_of(obs) == reason
        assert reason_of(obs, strict=True) == reason


async def test_capacity_rejection_gets_grace(autojump_clock: object) -> None:
    p = provider()
    pol = policy(snapshot={"max_age_ms": 15000, "stale_if_error_ms": 8000})
    async with memory_owner({"primary": p}, policies={"primary": pol}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        p.fail("order-worker", CapacityRejected("body over 4 MiB"))
        await anyio.sleep(5.5)
        assert obs.snapshot().degraded
        assert reason_of(obs, strict=True) == "capacity"
        await anyio.sleep(3)
        assert reason_of(obs) == "capacity"


async def test_malformed_listing_is_incomplete_not_revocation(autojump_clock: object) -> None:
    p = provider()
    p.set_malformed("order-worker", {"not": "a listing"})
    async with memory_owner({"primary": p}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        assert reason_of(obs) == "incomplete"
        p.fail("order-worker", ValueError("decoder blew up"))  # type: ignore[arg-type]
        await anyio.sleep(2)
        assert reason_of(obs) == "incomplete"
        p.fail("order-worker", None)
        p.set("order-worker", [inst("a")])
        await anyio.sleep(30)
        assert obs.snapshot().identities() == ("a",)


async def test_slow_query_times_out_as_incomplete(autojump_clock: object) -> None:
    p = provider()
    p.set_latency(100.0)
    async with memory_owner({"primary": p}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 10)
        assert anyio.current_time() == pytest.approx(3.0)  # request_timeout_ms
        assert reason_of(obs) == "incomplete"


async def test_submit_if_current(autojump_clock: object) -> None:
    p = provider()
    pol = policy(snapshot={"max_age_ms": 15000, "stale_if_error_ms": 8000})
    async with memory_owner({"primary": p}, policies={"primary": pol}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        assert obs.submit_if_current(lambda s: s.instances[0].address) == "10.0.0.1:8080"
        assert obs.submit_if_current_strict(lambda s: len(s.instances)) == 2
        p.fail("order-worker", IncompleteSnapshot("timeout"))
        await anyio.sleep(5.5)
        assert obs.submit_if_current(lambda s: len(s.instances)) == 2
        calls: list[object] = []
        with pytest.raises(EvidenceUnavailable):
            obs.submit_if_current_strict(calls.append)
        assert calls == []
        await anyio.sleep(3)
        with pytest.raises(EvidenceUnavailable):
            obs.submit_if_current(calls.append)
        assert calls == []


async def test_changed_returns_on_a_real_change(autojump_clock: object) -> None:
    p = provider()
    async with memory_owner({"primary": p}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        start = anyio.current_time()
        p.set("order-worker", [inst("c", 3)])
        await obs.changed(anyio.current_time() + 60)
        assert anyio.current_time() - start == pytest.approx(5.0)  # the next poll
        assert obs.snapshot().identities() == ("c",)
        # an unchanged listing is not a change
        with pytest.raises(DeadlineExceeded):
            await obs.changed(anyio.current_time() + 12)


async def test_changed_returns_at_a_real_expiry(autojump_clock: object) -> None:
    p = provider()
    pol = policy(snapshot={"max_age_ms": 15000, "stale_if_error_ms": 8000})
    async with memory_owner({"primary": p}, policies={"primary": pol}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        success_at = obs.snapshot().confirmed_at
        p.fail("order-worker", IncompleteSnapshot("timeout"))
        await obs.changed(anyio.current_time() + 60)  # the failure itself
        assert obs.snapshot().degraded
        await obs.changed(anyio.current_time() + 60)  # the grace running out
        assert anyio.current_time() == pytest.approx(success_at + 8.0)
        assert reason_of(obs) == "stale"


async def test_a_snapshot_record_is_reused_until_an_event_or_its_time_limit(
    autojump_clock: object,
) -> None:
    """Looks between two events share one record, unchecked, until the
    listing's own time limit; an event, a strict look or the limit passing
    each goes through the full check again."""
    p = provider()
    pol = policy(snapshot={"max_age_ms": 15000, "stale_if_error_ms": 8000})
    async with memory_owner({"primary": p}, policies={"primary": pol}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        first = obs.snapshot()
        assert obs.snapshot() is first
        assert obs.snapshot(strict=True) is first  # checked, the same listing
        p.fail("order-worker", IncompleteSnapshot("timeout"))
        await obs.changed(anyio.current_time() + 60)  # the failure: an event
        degraded = obs.snapshot()
        assert degraded is not first and degraded.degraded
        assert reason_of(obs, strict=True) == "incomplete"  # strict: checked
        assert obs.snapshot() is degraded
        # Just before the grace ends the record still stands; at its end,
        # with nothing recorded in between, it is refused.
        end = degraded.confirmed_at + 8.0
        await anyio.sleep(end - anyio.current_time() - 0.001)
        assert obs.snapshot() is degraded
        await anyio.sleep(0.001)
        assert reason_of(obs) == "stale"


async def test_changed_rejects_past_and_nan_deadlines(autojump_clock: object) -> None:
    p = provider()
    async with memory_owner({"primary": p}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        p.set("order-worker", [inst("z")])
        await anyio.sleep(6)  # a change is pending
        for bad in (anyio.current_time() - 1, math.nan, anyio.current_time()):
            with pytest.raises(DeadlineExceeded):
                await obs.changed(bad)
        await obs.changed(anyio.current_time() + 1)  # still pending: returns


async def test_static_evidence_never_expires_by_waiting(autojump_clock: object) -> None:
    p = MemoryProvider(services={"orders": "orders"}, evidence=EvidenceKind.STATIC_FACT)
    p.set("orders", [inst("a")])
    async with memory_owner({"primary": p}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        with pytest.raises(DeadlineExceeded):
            await obs.changed(anyio.current_time() + 3600)
        assert obs.snapshot(strict=True).identities() == ("a",)
        assert p.query_counts["orders"] == 1  # a static fact is asked for once


async def test_close_is_seen_by_every_handle(autojump_clock: object) -> None:
    p = provider()
    async with memory_owner({"primary": p}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        waiter = owner.begin_close(anyio.current_time() + 5)
        assert reason_of(obs) == "closed"
        await obs.changed(anyio.current_time() + 5)
        with pytest.raises(EvidenceUnavailable) as info:
            await obs.changed(anyio.current_time() + 5)
        assert info.value.reason == "closed"
        await waiter.wait()


async def test_idle_observation_is_reclaimed(autojump_clock: object) -> None:
    p = provider()
    pol = policy(idle_timeout_ms=30000)
    async with memory_owner({"primary": p}, policies={"primary": pol}) as owner:
        connection = owner._connections["primary"]
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        # a live handle holds the slot beyond the idle timeout
        await anyio.sleep(100)
        assert "orders" in connection.slots
        dropped_at = anyio.current_time()
        del obs
        gc.collect()
        await anyio.sleep(29)
        assert "orders" in connection.slots
        await anyio.sleep(6 + 0.1)  # idle timeout + at most one check interval
        assert "orders" not in connection.slots
        queries = p.query_counts["order-worker"]
        await anyio.sleep(60)
        assert p.query_counts["order-worker"] == queries  # its task is gone
        assert owner.observer().snapshot().live_tasks == 0
        assert anyio.current_time() - dropped_at > 30
        # a new observe starts a fresh slot
        again = await owner.client().observe("orders", anyio.current_time() + 5)
        assert again.snapshot().identities() == ("a", "b")


async def test_recent_access_holds_an_unheld_slot(autojump_clock: object) -> None:
    p = provider()
    pol = policy(idle_timeout_ms=30000)
    async with memory_owner({"primary": p}, policies={"primary": pol}) as owner:
        connection = owner._connections["primary"]
        for _ in range(4):
            await owner.client().observe("orders", anyio.current_time() + 5)  # dropped at once
            gc.collect()
            await anyio.sleep(20)
            assert "orders" in connection.slots


async def test_backoff_spaces_out_failed_queries(autojump_clock: object) -> None:
    p = provider()
    pol = policy(retry={"initial_backoff_ms": 1000, "max_backoff_ms": 8000})
    async with memory_owner({"primary": p}, policies={"primary": pol}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        p.fail("order-worker", IncompleteSnapshot("down"))
        before = p.query_counts["order-worker"]
        await anyio.sleep(5.01)  # the first failing poll
        await anyio.sleep(60)
        failed = p.query_counts["order-worker"] - before
        # caps 1, 2, 4, 8, 8...: between 60/8 and 1 + 60/(0.5) queries, and far
        # fewer than an unbounded retry loop would make
        assert 8 <= failed <= 20
        assert reason_of(obs) == "stale"


async def test_watch_mode_sees_changes_without_polling(autojump_clock: object) -> None:
    p = provider(watch=True)
    async with memory_owner({"primary": p}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        await anyio.sleep(0.1)
        assert p.active_watches("order-worker") == 1
        start = anyio.current_time()
        p.set("order-worker", [inst("c", 3)])
        await obs.changed(anyio.current_time() + 1)
        assert anyio.current_time() == start
        assert obs.snapshot().identities() == ("c",)
        p.watch_fail("order-worker", IdentityRevoked("token revoked"))
        assert reason_of(obs) == "revoked"
        # the watch ends; the slot backs off and starts a new one
        p.end_watches("order-worker", IncompleteSnapshot("stream reset"))
        await anyio.sleep(3)
        assert p.watch_counts["order-worker"] == 2
        assert obs.snapshot().identities() == ("c",)
        assert owner.observer().snapshot().capacity.watch_streams == 1


# policy(): poll 5 s, request timeout 3 s, max age 15 s -> window 5 + min(5 / 4, (15 - 5 - 3) / 2)
WINDOW = 6.25


async def test_silent_watch_is_reread_once_per_confirmation_window(autojump_clock: object) -> None:
    p = provider(watch=True)
    async with memory_owner({"primary": p}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        await anyio.sleep(2 * WINDOW + 3.5)
        # initial + one re-read per window the watch stayed silent
        assert p.query_counts["order-worker"] == 3
        assert obs.snapshot(strict=True).identities() == ("a", "b")


async def test_confirming_watch_needs_no_reread(autojump_clock: object) -> None:
    p = provider(watch=True)
    async with memory_owner({"primary": p}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        slot = owner._connections["primary"].slots["orders"]
        for _ in range(10):  # 40 s of a watch confirming every 4 s
            await anyio.sleep(4)
            p.watch_refresh("order-worker")
        assert p.query_counts["order-worker"] == 1  # the initial listing only
        assert slot.skipped_queries >= 4
        assert obs.snapshot(strict=True).identities() == ("a", "b")
        # the watch stops confirming (last at 40 s): the slot re-reads one
        # window after that confirmation, not before
        await anyio.sleep(WINDOW - 0.1)
        assert p.query_counts["order-worker"] == 1
        await anyio.sleep(0.2)
        assert p.query_counts["order-worker"] == 2
        assert obs.snapshot(strict=True).identities() == ("a", "b")


async def test_watch_changes_count_as_confirmations(autojump_clock: object) -> None:
    p = provider(watch=True)
    async with memory_owner({"primary": p}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        for n in range(8):  # a change every 3 s: each a complete listing
            await anyio.sleep(3)
            p.set("order-worker", [inst(f"c{n}", n + 1)])
        assert p.query_counts["order-worker"] == 1
        assert obs.snapshot(strict=True).identities() == ("c7",)


async def test_failed_watch_is_reread_every_poll_interval(autojump_clock: object) -> None:
    p = provider(watch=True)
    pol = policy(snapshot={"max_age_ms": 15000, "stale_if_error_ms": 8000})
    async with memory_owner({"primary": p}, policies={"primary": pol}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        await anyio.sleep(1)
        p.watch_fail("order-worker", IncompleteSnapshot("stream stalled"))
        assert reason_of(obs, strict=True) == "incomplete"
        assert obs.snapshot().identities() == ("a", "b")  # within the grace
        # a re-read within one poll interval of the failure (between half
        # and all of it, fixed per service): a complete listing heals it
        await anyio.sleep(2.4)
        assert p.query_counts["order-worker"] == 1
        await anyio.sleep(2.7)
        assert p.query_counts["order-worker"] == 2
        assert obs.snapshot(strict=True).identities() == ("a", "b")


@settings(max_examples=300, deadline=None)
@given(
    gaps=st.lists(st.floats(min_value=0.01, max_value=30.0), max_size=40),
    failures=st.sets(st.integers(min_value=0, max_value=39)),
    poll=st.floats(min_value=0.1, max_value=20.0),
    timeout=st.floats(min_value=0.05, max_value=10.0),
    spare=st.floats(min_value=0.01, max_value=20.0),
    took=st.floats(min_value=0.0, max_value=1.0),
)
def test_watched_listing_never_ages_past_max_age(
    gaps: list[float],
    failures: set[int],
    poll: float,
    timeout: float,
    spare: float,
    took: float,
) -> None:
    """Whatever a watch confirms and when (``gaps`` between its outcomes;
    the ones in ``failures`` are reported failures), the slot's schedule
    re-reads a healthy listing before it is ``max_age`` old, provided the
    re-read answers within the request timeout (``took`` of it)."""
    max_age = poll + timeout + spare
    window = confirmation_window(poll, timeout, max_age)
    assert poll <= window < max_age - timeout
    events: list[tuple[float, bool]] = []
    at = 0.0
    for n, gap in enumerate(gaps):
        at += gap
        events.append((at, n not in failures))
    horizon = at + 3 * max_age
    confirmed: float | None = 0.0  # the initial listing
    queried = 0.0
    watch = iter(events)
    upcoming = next(watch, None)
    last_good = 0.0
    while True:
        wake = next_confirmation(queried, confirmed, poll, window)
        # watch outcomes before the slot looks again
        while upcoming is not None and upcoming[0] <= wake:
            when, healthy = upcoming
            if confirmed is not None:
                assert when - last_good < max_age
            if healthy:
                last_good = max(last_good, when)
                confirmed = last_good
            else:
                confirmed = None  # a failure: no healthy record
            upcoming = next(watch, None)
        if wake > horizon:
            break
        if confirmed is not None:
            assert wake - last_good < max_age
        if watch_current(wake, confirmed, window):
            continue
        queried = wake
        done = wake + took * timeout
        if confirmed is not None:
            assert done - last_good < max_age
        confirmed = last_good = done


async def test_queued_watch_keeps_polling_until_streams_free(autojump_clock: object) -> None:
    from nadisc import LimitsConfig

    p = MemoryProvider(services={"one": "one", "two": "two"}, watch=True)
    p.set("one", [inst("a")])
    p.set("two", [inst("b")])
    limits = LimitsConfig(max_watch_streams=1)
    pol = policy(idle_timeout_ms=10000)
    async with memory_owner({"primary": p}, limits=limits, policies={"primary": pol}) as owner:
        handle = owner.client()
        first = await handle.observe("one", anyio.current_time() + 5)
        second = await handle.observe("two", anyio.current_time() + 5)
        await anyio.sleep(10.5)
        assert p.active_watches("one") == 1
        assert p.watch_counts["two"] == 0
        assert p.query_counts["two"] == 3  # queued: periodic queries
        assert owner.observer().snapshot().capacity.watch_streams_queued == 1
        p.set("two", [inst("c")])
        await anyio.sleep(5)
        assert second.snapshot().identities() == ("c",)
        del first
        gc.collect()
        await anyio.sleep(30)  # "one" is reclaimed, its stream goes to "two"
        assert p.active_watches("two") == 1
        assert p.watch_counts["two"] == 1


async def test_invalid_records_are_counted(autojump_clock: object) -> None:
    p = MemoryProvider(services={"orders": "orders"})
    p.set("orders", [inst("a")], invalid={"rec-7": "port missing"})
    async with memory_owner({"primary": p}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        assert obs.snapshot().identities() == ("a",)
        connection = owner.observer().snapshot().connection("primary")
        assert connection.invalid_records == 1
        (service,) = connection.services
        assert service.invalid_records == (("rec-7", "port missing"),)
        # Listed again next to other changes, and through refreshes, the same
        # bad record is not counted again; a new one (or a new reason) is.
        for n in range(3):
            p.set("orders", [inst("a"), inst(f"x{n}")], invalid={"rec-7": "port missing"})
            await obs.changed(anyio.current_time() + 30)
        await anyio.sleep(60)
        assert owner.observer().snapshot().connection("primary").invalid_records == 1
        p.set("orders", [inst("a")], invalid={"rec-7": "port 0", "rec-8": "no address"})
        await obs.changed(anyio.current_time() + 30)
        assert owner.observer().snapshot().connection("primary").invalid_records == 3
        # A later listing without malformed records clears the per-service view.
        p.set("orders", [inst("a"), inst("b")])
        await obs.changed(anyio.current_time() + 30)
        (service,) = owner.observer().snapshot().connection("primary").services
        assert service.invalid_records == ()


async def test_snapshot_record_is_immutable(autojump_clock: object) -> None:
    p = provider()
    async with memory_owner({"primary": p}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        snap = obs.snapshot()
        with pytest.raises(AttributeError):
            snap.instances = ()  # type: ignore[misc]
        assert isinstance(p.listing("order-worker"), ProviderSnapshot)
        assert obs.connection == "primary" and obs.service == "orders"


async def test_a_broken_provider_ends_only_its_observation(autojump_clock: object) -> None:
    class Broken(MemoryProvider):
        def __init__(self) -> None:
            super().__init__(services={"orders": "orders"})

        async def query(self, service: str, deadline: float) -> ProviderSnapshot:
            raise RuntimeError("bug")

    healthy = provider()
    async with memory_owner({"primary": Broken(), "other": healthy}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        assert reason_of(obs) == "incomplete"  # the exception became a typed outcome
        other = await owner.client("other").observe("orders", anyio.current_time() + 5)
        await anyio.sleep(30)
        assert other.snapshot().identities() == ("a", "b")


async def test_a_defect_in_one_slot_does_not_stop_the_owner(
    autojump_clock: object, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from nadisc._observation import Slot

    original = Slot._poll_cycle

    async def defective(self: Slot, *args: object) -> str:
        if self.alias == "orders" and self.connection.name == "primary":
            raise RuntimeError("defect")
        return await original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(Slot, "_poll_cycle", defective)
    async with memory_owner({"primary": provider(), "other": provider()}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        assert reason_of(obs) == "closed"
        assert "the observation failed" in caplog.text
        other = await owner.client("other").observe("orders", anyio.current_time() + 5)
        await anyio.sleep(10)
        assert other.snapshot().identities() == ("a", "b")
        assert owner.observer().snapshot().live_tasks == 1


async def test_the_cursor_is_the_handles_so_each_waiting_task_needs_its_own(
    autojump_clock: object,
) -> None:
    # Documented rule: two tasks on one handle share its cursor (one wakes per
    # change); two handles of one service each see every change, at no query.
    p = provider()
    async with memory_owner({"primary": p}) as owner:
        client = owner.client()
        shared = await client.observe("orders", anyio.current_time() + 5)
        own = await client.observe("orders", anyio.current_time() + 5)
        assert p.query_counts["order-worker"] == 1
        woken: list[str] = []

        async def wait(name: str, handle: Observation) -> None:
            with anyio.move_on_after(30):
                await handle.changed()
                woken.append(name)

        async with anyio.create_task_group() as tg:
            tg.start_soon(wait, "shared-1", shared)
            tg.start_soon(wait, "shared-2", shared)
            tg.start_soon(wait, "own", own)
            await anyio.sleep(1)
            p.set("order-worker", [inst("c", 3)])
        # One of the two tasks on the shared handle saw the change; the other
        # waited out its 30 s, though polls went on (nothing else changed).
        assert sorted(woken) in (["own", "shared-1"], ["own", "shared-2"])
        assert p.query_counts["order-worker"] > 2


class QueryTakingProvider(MemoryProvider):
    """A watch provider declaring ``watch_takes_query``: it logs when each
    query and watch starts and ends, and its watch can be made to fail."""

    def __init__(self) -> None:
        # "orders" lists "a"; every query takes 0.5 s.
        super().__init__(services={"orders": "orders"}, watch=True, latency=0.5)
        self.set("orders", [inst("a")])
        self.log: list[str] = []
        self.watch_failure: IncompleteSnapshot | None = None

    @property
    def capabilities(self) -> Capabilities:
        return dataclasses.replace(super().capabilities, watch_takes_query=True)

    async def query(self, service: str, deadline: float) -> ProviderSnapshot:
        self.log.append("query")
        try:
            return await super().query(service, deadline)
        finally:
            self.log.append("query answered")

    async def watch(
        self, service: str, sink: ObservationSink, *, task_status: TaskStatus[None]
    ) -> None:
        self.log.append("watch")
        if self.watch_failure is not None:
            sink.fail(self.watch_failure)
            task_status.started()
            raise self.watch_failure
        await super().watch(service, sink, task_status=task_status)


async def test_a_watch_that_takes_the_query_opens_while_the_query_runs(
    autojump_clock: object,
) -> None:
    p = QueryTakingProvider()
    async with memory_owner({"primary": p}) as owner:
        observation = await owner.client().observe("orders", anyio.current_time() + 5)
        assert observation.snapshot().identities() == ("a",)
        # Both went out together: the watch opened (and listed the service)
        # while the query was still on its way.
        assert sorted(p.log) == ["query", "watch"]
        await anyio.sleep(1)
        assert p.log[2:] == ["query answered"]
        p.set("orders", [inst("a"), inst("b")])
        await observation.changed(anyio.current_time() + 1)
        assert observation.snapshot().identities() == ("a", "b")


async def test_a_watch_that_fails_at_once_does_not_cut_the_query_short(
    autojump_clock: object,
) -> None:
    p = QueryTakingProvider()
    p.watch_failure = IncompleteSnapshot("the watch stream was refused")
    pol = policy(snapshot={"max_age_ms": 15000, "stale_if_error_ms": 10000})
    async with memory_owner({"primary": p}, policies={"primary": pol}) as owner:
        observation = await owner.client().observe("orders", anyio.current_time() + 5)
        # The watch failed before the query answered, and ended its session:
        # the query was not cut short, its listing is what observe() saw
        # first, and the watch's failure was recorded after it (served as
        # degraded within stale_if_error).
        assert sorted(p.log[:2]) == ["query", "watch"] and p.log[2] == "query answered"
        snapshot = observation.snapshot()
        assert snapshot.identities() == ("a",) and snapshot.degraded
        status = owner.observer().snapshot().connection("primary")
        assert dict(status.failure_kinds)["incomplete"] >= 1
