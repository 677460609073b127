"""Faults seen through the owner against a real etcd: a stopped server, a
killed and restarted one, compaction under a broken watch, and a revoked
permission. Each test has its own server (``own_etcd``) and ends by checking
that no task of the owner is left.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio
import pytest
from nadisc_etcd import EtcdProvider

from nadisc import (
    CloseOutcome,
    Eligibility,
    EvidenceUnavailable,
    ObservationSnapshot,
    RegistrationCloseEntry,
    RegistrationState,
    open_discovery,
)

from ...nadisc.owner_support import all_tasks
from .conftest import EtcdServer, RawEtcd, both_wires
from .owner_helpers import (
    WEB,
    etcd_config,
    ids,
    injected_provider,
    look,
    reason,
    soon,
    unique_prefix,
    wait_for,
    wait_status,
    web_registration,
)

pytestmark = pytest.mark.real_server

RawFactory = Callable[[EtcdServer], RawEtcd]


def injected(url: str, prefix: str, **etcd: Any) -> EtcdProvider:
    return injected_provider(EtcdProvider, url, prefix, **etcd)


async def test_a_stopped_server_degrades_within_the_grace_then_goes_stale_then_recovers(
    own_etcd: EtcdServer, raw_factory: RawFactory
) -> None:
    raw = raw_factory(own_etcd)
    prefix = unique_prefix()
    await raw.put_record(f"{prefix}/orders/a", "10.0.0.1:8080")
    # grace = min(max_age 4 s, stale_if_error 1.5 s) = 1.5 s after the last success.
    config = etcd_config(
        own_etcd.url,
        prefix,
        snapshot={"max_age_ms": 9000, "stale_if_error_ms": 6000},
    )
    # The silence is noticed about 0.5 s after the last success (the 500 ms
    # probe timeout); a grace of 10x that leaves the degraded phase room on
    # a loaded machine.
    grace = 6.0
    before = all_tasks()
    async with open_discovery(config, prepare_deadline=soon()) as owner:
        orders = await owner.client().observe("orders", soon())
        assert ids(orders.snapshot(strict=True)) == {"a"}

        own_etcd.pause()
        try:
            # The probe (every 300 ms, 500 ms timeout) notices the silence.
            failed = await wait_for(
                orders, lambda a: isinstance(a, ObservationSnapshot) and a.degraded, grace
            )
            assert isinstance(failed, ObservationSnapshot)
            noticed = anyio.current_time()
            confirmed = failed.confirmed_at
            # Right after the failure: normal reads are served from the grace
            # window, strict reads are refused at once.
            assert ids(failed) == {"a"}
            assert noticed - confirmed < grace  # measured 0.50 s: 12x below
            with pytest.raises(EvidenceUnavailable) as strict:
                orders.snapshot(strict=True)
            assert strict.value.reason == "incomplete"

            # Repeated failures do not extend the window: it ends exactly at
            # the last success + grace, and changed() wakes for it.
            while True:
                # Read the clock first: a degraded answer given after this
                # reading was given before the grace ended, so this holds on
                # any machine speed.
                before_look = anyio.current_time()
                if not isinstance(answer := look(orders), ObservationSnapshot):
                    break
                assert before_look < confirmed + grace
                assert answer.degraded and answer.confirmed_at == confirmed
                await orders.changed(soon(10.0))
            expired = anyio.current_time()
            assert reason(answer) == "stale"
            # changed() woke for the window's end itself: measured 2 ms past
            # it, bounded at 250 ms (125x); the next wake-up otherwise would be
            # the 10 s deadline of changed().
            assert confirmed + grace <= expired < confirmed + grace + 0.25
            metrics = owner.observer().snapshot().connection("primary")
            assert metrics.failures >= 1
            assert metrics.services[0].unavailable_reason == "stale"
            await anyio.sleep(0.5)  # stopped for longer than the grace
            assert reason(look(orders)) == "stale"
        finally:
            own_etcd.resume()

        # After SIGCONT the next complete listing restores the evidence.
        back = await wait_for(
            orders, lambda a: isinstance(a, ObservationSnapshot) and not a.degraded, 4.0
        )
        assert ids(back) == {"a"}
        assert ids(orders.snapshot(strict=True)) == {"a"}
        await raw.put_record(f"{prefix}/orders/b", "10.0.0.2:8080")
        assert ids(await wait_for(orders, lambda a: ids(a) == {"a", "b"}, 2.0)) == {"a", "b"}
    assert all_tasks() == before


async def stream_open(provider: EtcdProvider) -> None:
    """Wait until the watch behind the observation has its stream up."""
    with anyio.fail_after(3.0):
        while provider.statistics().watch_streams_opened < 1:  # noqa: ASYNC110 - a counter
            await anyio.sleep(0.01)


def quiet_polls(url: str, prefix: str) -> Any:
    """A config whose confirmation queries are far apart (20 s): within the
    test only the watch can carry changes, so a lost event would show."""
    return etcd_config(
        url,
        prefix,
        poll_interval_ms=20_000,
        snapshot={"max_age_ms": 30_000, "stale_if_error_ms": 10_000},
    )


@both_wires
async def test_a_killed_and_restarted_server_resumes_the_watch_without_losing_events(
    own_etcd: EtcdServer, raw_factory: RawFactory
) -> None:
    raw = raw_factory(own_etcd)
    prefix = unique_prefix()
    head = f"{prefix}/orders"
    await raw.put_record(f"{head}/a", "10.0.0.1:80")
    # A long reconnect backoff leaves a window after the restart in which we
    # write before the watch is back.
    provider = injected(
        own_etcd.url, prefix, retry_initial_backoff_ms=2500, retry_max_backoff_ms=2500
    )
    before = all_tasks()
    async with open_discovery(
        quiet_polls(own_etcd.url, prefix), providers={"primary": provider}, prepare_deadline=soon()
    ) as owner:
        orders = await owner.client().observe("orders", soon())
        assert ids(orders.snapshot(strict=True)) == {"a"}
        await stream_open(provider)

        own_etcd.kill()
        failed = await wait_for(
            orders, lambda a: isinstance(a, ObservationSnapshot) and a.degraded, 3.0
        )
        assert ids(failed) == {"a"}
        own_etcd.start()
        # Written while the watch is down: the resumed watch must deliver them.
        await raw.put_record(f"{head}/b", "10.0.0.2:80")
        await raw.delete(f"{head}/a")
        back = await wait_for(
            orders,
            lambda a: isinstance(a, ObservationSnapshot) and not a.degraded and ids(a) == {"b"},
            6.0,
        )
        assert ids(back) == {"b"}
        await raw.put_record(f"{head}/c", "10.0.0.3:80")
        assert ids(await wait_for(orders, lambda a: ids(a) == {"b", "c"}, 2.0)) == {"b", "c"}
        stats = provider.statistics()
        # Resumed from the last revision + 1, never re-ranged: every event
        # since the kill arrived through the watch.
        # One complete listing to start from (a range, or the query's).
        assert stats.watch_ranges + stats.watch_listings_taken == 1, stats
        assert stats.watch_resumes >= 1 and stats.watch_streams_opened >= 2
        assert own_etcd.starts == 2
    assert all_tasks() == before


async def test_a_server_killed_while_the_watch_starts_leaves_nothing_behind(
    own_etcd: EtcdServer, raw_factory: RawFactory
) -> None:
    # The kill lands while the watch's first requests are on the wire (a
    # request body half sent, a stream half open). Nothing may leak (an
    # unfinished body would surface as an unraisable warning, an error
    # here) and the observation recovers once the server is back.
    raw = raw_factory(own_etcd)
    prefix = unique_prefix()
    await raw.put_record(f"{prefix}/orders/a", "10.0.0.1:80")
    before = all_tasks()
    async with open_discovery(etcd_config(own_etcd.url, prefix), prepare_deadline=soon()) as owner:
        orders = await owner.client().observe("orders", soon())
        own_etcd.kill()
        await wait_for(orders, lambda a: isinstance(a, ObservationSnapshot) and a.degraded)
        own_etcd.start()
        await raw.put_record(f"{prefix}/orders/b", "10.0.0.2:80")
        back = await wait_for(
            orders,
            lambda a: (
                isinstance(a, ObservationSnapshot) and not a.degraded and ids(a) == {"a", "b"}
            ),
            6.0,
        )
        assert ids(back) == {"a", "b"}
    assert all_tasks() == before


@both_wires
async def test_compaction_below_the_watched_revision_forces_a_re_range(
    own_etcd: EtcdServer, raw_factory: RawFactory
) -> None:
    raw = raw_factory(own_etcd)
    prefix = unique_prefix()
    head = f"{prefix}/orders"
    await raw.put_record(f"{head}/a", "10.0.0.1:80")
    provider = injected(
        own_etcd.url, prefix, retry_initial_backoff_ms=2500, retry_max_backoff_ms=2500
    )
    before = all_tasks()
    async with open_discovery(
        quiet_polls(own_etcd.url, prefix), providers={"primary": provider}, prepare_deadline=soon()
    ) as owner:
        orders = await owner.client().observe("orders", soon())
        await stream_open(provider)
        own_etcd.pause()  # the probe times out, the stream is abandoned
        try:
            await wait_for(orders, lambda a: isinstance(a, ObservationSnapshot) and a.degraded)
        finally:
            own_etcd.resume()
        # While the watch backs off: change things and compact the history away.
        await raw.put_record(f"{head}/b", "10.0.0.2:80")
        await raw.delete(f"{head}/a")
        await raw.put_record(f"{head}/c", "10.0.0.3:80")
        await raw.put_record(f"{head}/c", "10.0.0.3:81")
        await raw.compact(await raw.revision())

        back = await wait_for(
            orders,
            lambda a: (
                isinstance(a, ObservationSnapshot) and not a.degraded and ids(a) == {"b", "c"}
            ),
            6.0,
        )
        assert isinstance(back, ObservationSnapshot)
        assert {i.identity: i.port for i in back.instances} == {"b": 80, "c": 81}
        await raw.put_record(f"{head}/d", "10.0.0.4:80")
        assert ids(await wait_for(orders, lambda a: ids(a) == {"b", "c", "d"}, 2.0)) == {
            "b",
            "c",
            "d",
        }
        stats = provider.statistics()
        listings = stats.watch_ranges + stats.watch_listings_taken
        assert (stats.compaction_resyncs, listings) == (1, 2), stats
    assert all_tasks() == before


@both_wires
async def test_a_revoked_permission_revokes_the_observation_and_the_registrations_evidence(
    own_etcd: EtcdServer, raw_factory: RawFactory
) -> None:
    raw = raw_factory(own_etcd)
    prefix = "secured/services"
    start, end = "secured/services/", "secured/services0"
    steps: list[tuple[str, dict[str, Any]]] = [
        ("/v3/auth/user/add", {"name": "root", "password": "root-pw"}),
        ("/v3/auth/role/add", {"name": "root"}),
        ("/v3/auth/user/grant", {"user": "root", "role": "root"}),
        ("/v3/auth/user/add", {"name": "app", "password": "s3cret-app-pw"}),
        ("/v3/auth/role/add", {"name": "svc"}),
        (
            "/v3/auth/role/grant",
            {
                "name": "svc",
                "perm": {"permType": "READWRITE", "key": raw.b64(start), "range_end": raw.b64(end)},
            },
        ),
        ("/v3/auth/user/grant", {"user": "app", "role": "svc"}),
        ("/v3/auth/enable", {}),
    ]
    for path, body in steps:
        await raw.call(path, body)
    await raw.authenticate("root", "root-pw")
    await raw.put_record(f"{prefix}/orders/w1", "10.0.0.7:8080")

    config = etcd_config(
        own_etcd.url,
        prefix,
        etcd={"username": "app", "password": "s3cret-app-pw"},
        registrations={"business-http": web_registration()},
        # Authenticating hashes the password on the server (bcrypt): under the
        # full suite's load that alone can take longer than the default 0.5 s.
        request_timeout_ms=1500,
    )
    assert "s3cret" not in repr(config)
    before = all_tasks()
    async with open_discovery(
        config,
        listeners={"web": WEB},
        eligibility={"web": Eligibility.always()},
        prepare_deadline=soon(),
    ) as owner:
        status = owner.registrations()["business-http"]
        assert status.state is RegistrationState.ACTIVE
        epoch = status.epoch
        orders = await owner.client().observe("orders", soon())
        assert ids(orders.snapshot(strict=True)) == {"w1"}

        await raw.call(
            "/v3/auth/role/revoke",
            {"role": "svc", "key": raw.b64(start), "range_end": raw.b64(end)},
        )
        # No grace: normal and strict reads are refused as soon as it is seen.
        with anyio.fail_after(3.0):
            new_epoch = await owner.identity_revoked("primary", after_epoch=epoch)
        assert new_epoch > epoch
        answer = await wait_for(orders, lambda a: reason(a) == "revoked", 2.0)
        assert reason(answer) == "revoked"
        with pytest.raises(EvidenceUnavailable) as strict:
            orders.snapshot(strict=True)
        assert strict.value.reason == "revoked"
        # The registration on that connection lost its health evidence.
        lost = await wait_status(
            owner, "business-http", lambda s: s.state is not RegistrationState.ACTIVE, 2.0
        )
        assert lost.state is RegistrationState.DEGRADED
        assert lost.health.value in ("revoked", "none", "missing")
        assert lost.epoch >= new_epoch
        assert owner.observer().snapshot().connection("primary").identity_revocations >= 1
        await anyio.sleep(0.5)
        assert owner.registrations()["business-http"].state is not RegistrationState.ACTIVE
    report = owner.close_report
    assert report is not None
    (entry,) = report.registrations
    # The removal needs the permission that was revoked: the record may remain
    # (until its lease expires), and the report says so.
    assert isinstance(entry, RegistrationCloseEntry)
    assert entry.outcome is not CloseOutcome.DEREGISTERED
    assert entry.possibly_remaining
    assert all_tasks() == before
