"""The registration lifecycle through the owner against a real etcd.

publish -> Active; keepalives paced by the lease (``renew_within``) keep a
short lease alive across several TTLs even with a slow monitor interval;
a crashed registrant (a separate process, SIGKILLed) disappears when its
lease expires; a lease revoked remotely is lost and registered again under
a new lease; quiesce revokes the lease (Deregistered); a stopped server
makes the close report say Unreachable, a lost first write OutcomeUnknown,
and a lost renewal followed by an acknowledged removal Residual. Every test
ends by checking that no task of the owner is left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import anyio
import pytest
from nadisc_etcd import EtcdProvider, EtcdSettings

from nadisc import (
    CloseOutcome,
    ConnectionContext,
    DiscoveryOwner,
    Eligibility,
    LeaseLost,
    Registered,
    RegistrationCloseEntry,
    RegistrationRecord,
    RegistrationState,
    RegistrationStatus,
    open_discovery,
)

from ...nadisc.owner_support import all_tasks
from .conftest import EtcdServer, RawEtcd, both_wires
from .owner_helpers import (
    WEB,
    etcd_config,
    ids,
    injected_provider,
    reason,
    soon,
    unique_prefix,
    wait_for,
    wait_status,
    web_registration,
)

pytestmark = pytest.mark.real_server

RawFactory = Callable[[EtcdServer], RawEtcd]
NAME = "business-http"
INSTANCE = f"order-api-{WEB[0]}-{WEB[1]}"


def entries(owner: DiscoveryOwner) -> dict[str, RegistrationCloseEntry]:
    report = owner.close_report
    assert report is not None
    out: dict[str, RegistrationCloseEntry] = {}
    for entry in report.registrations:
        assert isinstance(entry, RegistrationCloseEntry)
        out[entry.name] = entry
    return out


async def lease_of(raw: RawEtcd, key: str) -> int | None:
    kvs = await raw.get(key)
    return int(kvs[0].get("lease", 0)) if kvs else None


async def ttl_of(raw: RawEtcd, lease: int) -> int:
    answer = await raw.call("/v3/lease/timetolive", {"ID": str(lease)})
    return int(answer.get("TTL", -1))


def opened(config: Any, **kwargs: Any) -> Any:
    return open_discovery(
        config,
        listeners={"web": WEB},
        eligibility={"web": Eligibility.always()},
        prepare_deadline=soon(),
        **kwargs,
    )


@both_wires
async def test_keepalives_follow_a_short_lease_and_quiesce_revokes_it(
    etcd_server: EtcdServer, raw: RawEtcd
) -> None:
    prefix = unique_prefix()
    key = f"{prefix}/order-api/{INSTANCE}"
    # A 2 s lease with a 5 s monitor interval: without renew_within the lease
    # would lapse between two renewals while the owner reported it Active.
    config = etcd_config(
        etcd_server.url,
        prefix,
        etcd={"ttl_seconds": 2},
        monitor_interval_ms=5000,
        observation_grace_ms=6000,
        registrations={NAME: web_registration()},
    )
    before = all_tasks()
    async with opened(config) as owner:
        assert owner.registrations()[NAME].state is RegistrationState.ACTIVE
        lease = await lease_of(raw, key)
        assert lease
        # Discovery on the same connection sees the registration.
        own = await owner.client().observe("self", soon())
        assert ids(await wait_for(own, lambda a: ids(a) == {INSTANCE}, 2.0)) == {INSTANCE}

        until = anyio.current_time() + 7.0  # three and a half TTLs
        while anyio.current_time() < until:
            assert owner.registrations()[NAME].state is RegistrationState.ACTIVE
            assert await lease_of(raw, key) == lease  # never lost, never replaced
            assert await ttl_of(raw, lease) > 0
            await anyio.sleep(0.25)
        assert ids(own.snapshot(strict=True)) == {INSTANCE}
    (entry,) = entries(owner).values()
    assert (entry.outcome, entry.possibly_remaining) == (CloseOutcome.DEREGISTERED, False)
    assert await raw.get(key) == []
    assert await ttl_of(raw, lease) == -1  # revoked, not left to expire
    assert all_tasks() == before


CHILD = textwrap.dedent(
    """
    import sys

    import trio

    from nadisc import Eligibility, PrepareError, open_discovery
    from tests.providers.etcd.owner_helpers import WEB, etcd_config, web_registration

    async def main(url: str, prefix: str) -> None:
        config = etcd_config(
            url, prefix, etcd={"ttl_seconds": 2}, registrations={"web": web_registration()}
        )
        # A fresh interpreter on a loaded machine may not prepare within the
        # 0.5 s request timeout: start again, as a supervisor would.
        while True:
            try:
                async with open_discovery(
                    config, listeners={"web": WEB}, eligibility={"web": Eligibility.always()}
                ):
                    print("active", flush=True)
                    await trio.sleep_forever()
            except PrepareError:
                await trio.sleep(0.2)

    trio.run(main, sys.argv[1], sys.argv[2])
    """
)


async def test_a_crashed_registrant_disappears_when_its_lease_expires(
    etcd_server: EtcdServer, raw: RawEtcd
) -> None:
    prefix = unique_prefix()
    key = f"{prefix}/order-api/{INSTANCE}"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    child = await anyio.open_process(
        [sys.executable, "-c", CHILD, etcd_server.url, prefix],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        before = all_tasks()
        async with open_discovery(etcd_config(etcd_server.url, prefix)) as owner:
            # Another process's registration, seen by this owner's discovery.
            peer = await owner.client().observe("self", soon())
            # A child interpreter starting and registering: about 1.5 s here, so a
            # bound of 20x that for a loaded machine.
            await wait_for(peer, lambda a: ids(a) == {INSTANCE}, 30.0)
            lease = await lease_of(raw, key)
            assert lease
            # The registrant crashes: no deregistration, keepalives just stop.
            child.send_signal(signal.SIGKILL)
            with anyio.fail_after(5):
                await child.wait()
            # Order of events, not elapsed time: the dead process left its
            # record behind (nothing deregistered it), and the record then
            # went with its lease, which etcd expired (TTL -1), not revoked.
            assert await lease_of(raw, key) == lease
            # Measured about 2.2 s (the 2 s TTL); the bound is 10x that.
            gone = await wait_for(peer, lambda a: reason(a) == "empty", 22.0)
            assert reason(gone) == "empty"
            assert await lease_of(raw, key) is None
            assert await ttl_of(raw, lease) == -1
        assert all_tasks() == before
    finally:
        if child.returncode is None:
            child.kill()
            with anyio.move_on_after(5):
                await child.wait()


class RecordingProvider(EtcdProvider):
    """The real provider, noting registrations, lost leases and the owner's
    view of the registration at the moment each write starts."""

    def __init__(self, context: ConnectionContext, settings: EtcdSettings) -> None:
        super().__init__(context, settings)
        self.owner: DiscoveryOwner | None = None
        self.registered: list[tuple[str, RegistrationStatus | None]] = []
        self.lost: list[str] = []

    async def register(self, record: RegistrationRecord, deadline: float) -> Registered:
        seen = None if self.owner is None else self.owner.registrations()[NAME]
        result = await super().register(record, deadline)
        self.registered.append((result.handle, seen))
        return result

    async def renew(self, registered: Registered, deadline: float) -> Registered:
        try:
            return await super().renew(registered, deadline)
        except LeaseLost:
            self.lost.append(registered.handle)
            raise


def recording(url: str, prefix: str, **etcd: Any) -> RecordingProvider:
    return injected_provider(RecordingProvider, url, prefix, **etcd)


@both_wires
async def test_a_remotely_revoked_lease_is_lost_then_registered_again_under_a_new_lease(
    etcd_server: EtcdServer, raw: RawEtcd
) -> None:
    prefix = unique_prefix()
    key = f"{prefix}/order-api/{INSTANCE}"
    provider = recording(etcd_server.url, prefix)
    config = etcd_config(etcd_server.url, prefix, registrations={NAME: web_registration()})
    before = all_tasks()
    async with opened(config, providers={"primary": provider}) as owner:
        provider.owner = owner
        assert owner.registrations()[NAME].state is RegistrationState.ACTIVE
        first = await lease_of(raw, key)
        assert first and [h for h, _ in provider.registered] == [str(first)]

        await raw.revoke(first)  # an operator, or another client, revokes it
        with anyio.fail_after(4.0):
            while (second := await lease_of(raw, key)) in (None, first):  # noqa: ASYNC110
                await anyio.sleep(0.05)
        status = await wait_status(owner, NAME, lambda s: s.state is RegistrationState.ACTIVE, 3.0)
        # The keepalive answered "lease gone" (LeaseLost, a definitive answer),
        # and only then was the record written again, under a new lease.
        assert provider.lost == [str(first)]
        handles = [h for h, _ in provider.registered]
        assert handles == [str(first), str(second)]
        _, at_reregistration = provider.registered[1]
        assert at_reregistration is not None
        assert at_reregistration.state is not RegistrationState.ACTIVE
        assert at_reregistration.health.value != "healthy"
        assert at_reregistration.residual_risk is False
        assert status.residual_risk is False
        assert await ttl_of(raw, first) == -1 and await ttl_of(raw, int(second)) > 0
    (entry,) = entries(owner).values()
    assert entry.outcome is CloseOutcome.DEREGISTERED
    assert await raw.get(key) == []
    assert all_tasks() == before


async def test_a_deregistration_cut_off_by_a_stopped_server_is_reported_unreachable(
    own_etcd: EtcdServer, raw_factory: RawFactory
) -> None:
    raw = raw_factory(own_etcd)
    prefix = unique_prefix()
    key = f"{prefix}/order-api/{INSTANCE}"
    config = etcd_config(own_etcd.url, prefix, registrations={NAME: web_registration()})
    before = all_tasks()
    try:
        async with opened(config) as owner:
            assert owner.registrations()[NAME].state is RegistrationState.ACTIVE
            lease = await lease_of(raw, key)
            assert lease
            own_etcd.pause()  # leaving the block now: the removal cannot finish
        (entry,) = entries(owner).values()
        assert entry.outcome is CloseOutcome.UNREACHABLE
        assert entry.possibly_remaining and not entry.permanent
        report = owner.close_report
        assert report is not None and report.tasks_left == 0
    finally:
        own_etcd.resume()
    # The removal was sent and its answer lost: the stopped server may still
    # apply it when it resumes (it did here, or not), and the lease it could
    # not revoke expires on its own (no keepalive is sent any more).
    with anyio.fail_after(6.0):
        while await raw.get(key) or await ttl_of(raw, lease) != -1:  # noqa: ASYNC110
            await anyio.sleep(0.1)
    assert all_tasks() == before


@both_wires
async def test_a_first_write_lost_to_a_stopped_server_is_outcome_unknown(
    own_etcd: EtcdServer, raw_factory: RawFactory
) -> None:
    raw = raw_factory(own_etcd)
    prefix = unique_prefix()
    key = f"{prefix}/order-api/{INSTANCE}"
    config = etcd_config(
        own_etcd.url,
        prefix,
        startup_required=False,
        registrations={NAME: web_registration(startup_required=False)},
    )
    before = all_tasks()
    own_etcd.pause()  # the lease grant is sent, and its answer never comes
    try:
        async with opened(config) as owner:
            status = await wait_status(
                owner, NAME, lambda s: s.state is RegistrationState.OUTCOME_UNKNOWN, 3.0
            )
            assert status.residual_risk
            # Blocked for good: a blind second registration could duplicate one
            # the registry did store.
            await anyio.sleep(1.0)
            assert owner.registrations()[NAME].state is RegistrationState.OUTCOME_UNKNOWN
        (entry,) = entries(owner).values()
        assert (entry.outcome, entry.possibly_remaining) == (CloseOutcome.OUTCOME_UNKNOWN, True)
    finally:
        own_etcd.resume()
    assert await raw.get(key) == []  # the put was never sent
    assert all_tasks() == before


async def test_a_lost_renewal_then_an_acknowledged_removal_is_residual(
    own_etcd: EtcdServer, raw_factory: RawFactory
) -> None:
    raw = raw_factory(own_etcd)
    prefix = unique_prefix()
    key = f"{prefix}/order-api/{INSTANCE}"
    # 6 s lease, keepalive every second: a stop of a second or two does not
    # let it lapse.
    config = etcd_config(
        own_etcd.url, prefix, etcd={"ttl_seconds": 6}, registrations={NAME: web_registration()}
    )
    before = all_tasks()
    async with opened(config) as owner:
        assert owner.registrations()[NAME].state is RegistrationState.ACTIVE
        own_etcd.pause()
        try:
            # The next keepalive times out: its answer is lost, it may still land.
            unknown = await wait_status(owner, NAME, lambda s: s.residual_risk, 3.0)
            assert unknown.state is RegistrationState.OUTCOME_UNKNOWN
        finally:
            own_etcd.resume()
        # Keepalives are idempotent: the same lease is renewed again, and a
        # fresh HEALTHY check makes it Active.
        back = await wait_status(owner, NAME, lambda s: s.state is RegistrationState.ACTIVE, 4.0)
        assert back.residual_risk  # never cleared
        assert await raw.get(key)
    (entry,) = entries(owner).values()
    assert (entry.outcome, entry.possibly_remaining) == (CloseOutcome.RESIDUAL, True)
    assert await raw.get(key) == []
    assert all_tasks() == before
