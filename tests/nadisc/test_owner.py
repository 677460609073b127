"""The owner: lifecycle stages, shutdown, no task left behind, no copies."""

from __future__ import annotations

import copy
import math
import pickle
from collections.abc import Mapping, Sequence

import anyio
import pytest
from anyio.abc import TaskGroup

from nadisc import (
    CloseReport,
    ConnectionSpec,
    DeadlineExceeded,
    DiscoveryConfig,
    DiscoveryOwner,
    EvidenceKind,
    IdentityRevoked,
    Instance,
    LifecycleError,
    OwnerBuilder,
    Phase,
    PrepareError,
    open_discovery,
)
from nadisc._connection import Connection
from nadisc.providers._static import StaticProvider
from nadisc.testing import MemoryProvider

from .owner_support import all_tasks, inst, memory_owner, policy


def phase(owner: DiscoveryOwner) -> Phase:
    """The phase, read through a call (it changes under the type checker's feet)."""
    return owner.phase


def config(**connections: dict[str, object]) -> DiscoveryConfig:
    return DiscoveryConfig.model_validate(
        {"enabled": True, "connections": connections, "shutdown_timeout_ms": 5000}
    )


def memory(**services: str) -> MemoryProvider:
    p = MemoryProvider(services=services or {"orders": "orders"})
    for remote in (services or {"orders": "orders"}).values():
        p.set(remote, [inst("a")])
    return p


async def test_standalone_host_stages(autojump_clock: object) -> None:
    provider = StaticProvider.static_services({"orders": [Instance("o1", "127.0.0.1", 8080)]})
    builder = OwnerBuilder().connection(ConnectionSpec("business", provider))
    async with builder.open() as owner:
        assert phase(owner) is Phase.BUILT and not owner.prepared
        await owner.prepare(anyio.current_time() + 5)
        assert phase(owner) is Phase.PREPARED and owner.prepared
        owner.freeze_registrations([])
        assert phase(owner) is Phase.FROZEN
        await owner.publish(anyio.current_time() + 5)
        assert phase(owner) is Phase.PUBLISHED
        handle = owner.client("business")
        observation = await handle.observe("orders", anyio.current_time() + 2)
        snapshot = observation.snapshot(strict=True)
        assert len(snapshot.instances) == 1
        assert snapshot.evidence is EvidenceKind.STATIC_FACT
        deadline = anyio.current_time() + 5
        await owner.begin_quiesce(deadline).wait()
        assert phase(owner) is Phase.QUIESCING
        # discovery still works while quiescing
        assert observation.snapshot().identities() == ("o1",)
        report = await owner.begin_close(deadline).wait()
        assert phase(owner) is Phase.CLOSED
        assert isinstance(report, CloseReport)
        assert not report.deadline_elapsed and report.tasks_left == 0
    assert owner.close_report is report


async def test_open_discovery_prepares_and_closes(autojump_clock: object) -> None:
    cfg = config(primary={"provider": "memory"})
    p = memory()
    async with open_discovery(cfg, providers={"primary": p}) as owner:
        assert phase(owner) is Phase.PREPARED
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        assert obs.snapshot().identities() == ("a",)
    assert phase(owner) is Phase.CLOSED
    assert owner.close_report is not None and owner.close_report.tasks_left == 0
    assert p.close_calls == 1
    assert p.prepare_calls == 1


async def test_static_connection_from_config_via_entry_point(autojump_clock: object) -> None:
    cfg = config(
        primary={
            "provider": "static",
            "static": {"services": {"orders": [{"host": "10.1.0.1", "port": 80}]}},
        }
    )
    async with open_discovery(cfg) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        snap = obs.snapshot(strict=True)
        assert snap.identities() == ("10.1.0.1:80",)
        assert snap.evidence is EvidenceKind.STATIC_FACT


async def test_required_connection_failing_prepare_is_named(autojump_clock: object) -> None:
    good, bad = memory(), memory()
    bad.fail_prepare(IdentityRevoked("bad credentials"))
    cfg = config(primary={"provider": "memory"}, infra={"provider": "memory"})
    before = all_tasks()
    with pytest.raises(PrepareError) as info:
        async with open_discovery(cfg, providers={"primary": good, "infra": bad}):
            pytest.fail("the body must not run")
    assert info.value.connection == "infra"
    assert "infra" in str(info.value)
    assert good.close_calls == 1 and bad.close_calls == 1  # nothing half-built
    assert all_tasks() == before


async def test_optional_connection_may_fail_prepare(autojump_clock: object) -> None:
    good, bad = memory(), memory()
    bad.fail_prepare(IdentityRevoked("bad credentials"))
    cfg = config(
        primary={"provider": "memory"}, infra={"provider": "memory", "startup_required": False}
    )
    async with open_discovery(cfg, providers={"primary": good, "infra": bad}) as owner:
        assert owner.prepared
        view = owner.observer().snapshot()
        assert view.connection("infra").prepared is False
        assert view.connection("primary").prepared is True


async def test_prepare_times_out_as_prepare_error(autojump_clock: object) -> None:
    slow = memory()
    slow.set_prepare_latency(100.0)
    async with memory_owner({"primary": slow}, prepare=False) as owner:
        with pytest.raises(PrepareError):
            await owner.prepare(anyio.current_time() + 1)
        assert anyio.current_time() == pytest.approx(1.0)
        assert phase(owner) is Phase.BUILT


@pytest.mark.parametrize("offset", [-1.0, 0.0, math.nan])
async def test_bad_deadlines_are_refused(autojump_clock: object, offset: float) -> None:
    async with memory_owner({"primary": memory()}, prepare=False) as owner:
        with pytest.raises(DeadlineExceeded):
            await owner.prepare(anyio.current_time() + offset)
        assert phase(owner) is Phase.BUILT
        await owner.prepare(anyio.current_time() + 5)
        owner.freeze_registrations()
        with pytest.raises(DeadlineExceeded):
            await owner.publish(anyio.current_time() + offset)
        assert phase(owner) is Phase.FROZEN
        with pytest.raises(DeadlineExceeded):
            owner.begin_close(anyio.current_time() + offset)
        assert phase(owner) is Phase.FROZEN


async def test_wrong_phase_is_a_lifecycle_error(autojump_clock: object) -> None:
    async with memory_owner({"primary": memory()}, prepare=False) as owner:
        with pytest.raises(LifecycleError):
            owner.client()
        with pytest.raises(LifecycleError):
            owner.freeze_registrations()
        with pytest.raises(LifecycleError):
            await owner.publish(anyio.current_time() + 1)
        await owner.prepare(anyio.current_time() + 1)
        with pytest.raises(LifecycleError):
            await owner.prepare(anyio.current_time() + 1)
        with pytest.raises(LifecycleError):
            owner.freeze_registrations(["something"])  # no registration component
        assert phase(owner) is Phase.PREPARED
        handle = owner.client()
        await owner.begin_close(anyio.current_time() + 5).wait()
        with pytest.raises(LifecycleError):
            owner.client()
        with pytest.raises(LifecycleError):
            await handle.observe("orders", anyio.current_time() + 1)


async def test_shutdown_shares_the_first_deadline(autojump_clock: object) -> None:
    class SlowClose(MemoryProvider):
        async def aclose(self) -> None:
            await anyio.sleep(100)

    p = SlowClose(services={"orders": "orders"})
    quick = memory()
    async with memory_owner({"primary": p, "quick": quick}) as owner:
        start = anyio.current_time()
        quiesce = owner.begin_quiesce(start + 2)
        close = owner.begin_close(start + 50)  # the later deadline is ignored
        assert owner.begin_close(start + 99) is close
        assert owner.begin_quiesce(start + 99) is quiesce
        report = await close.wait()
        assert anyio.current_time() == pytest.approx(start + 2)
        assert report.deadline_elapsed
        assert report.provider_errors == ("primary",)  # "quick" closed in time
        assert quick.close_calls == 1
        assert report.tasks_left == 0


async def test_dropping_the_waitable_does_not_cancel_cleanup(autojump_clock: object) -> None:
    p = memory()
    async with memory_owner({"primary": p}) as owner:
        await owner.client().observe("orders", anyio.current_time() + 5)
        with anyio.move_on_after(0):
            await owner.begin_close(anyio.current_time() + 5).wait()
        del_waiter = owner.begin_close(anyio.current_time() + 5)
        del del_waiter
        await anyio.sleep(0.01)
        assert phase(owner) is Phase.CLOSED
    assert p.close_calls == 1
    assert owner.close_report is not None and not owner.close_report.deadline_elapsed


async def test_no_task_outlives_the_block(autojump_clock: object) -> None:
    p = memory(orders="orders", users="users")
    p.set("users", [inst("u")])
    watching = MemoryProvider(services={"orders": "orders"}, watch=True)
    watching.set("orders", [inst("w")])
    before = all_tasks()
    async with memory_owner({"primary": p, "watch": watching}) as owner:
        await owner.client().observe("orders", anyio.current_time() + 5)
        await owner.client().observe("users", anyio.current_time() + 5)
        await owner.client("watch").observe("orders", anyio.current_time() + 5)
        await anyio.sleep(12)
        assert owner.observer().snapshot().live_tasks == 4  # 3 slots + 1 watch
        assert len(all_tasks()) > len(before)
    assert all_tasks() == before
    assert owner.close_report is not None and owner.close_report.tasks_left == 0
    assert owner._runtime.live_tasks == 0


async def test_no_task_left_when_the_body_raises(autojump_clock: object) -> None:
    p = memory()
    before = all_tasks()
    with pytest.raises(ZeroDivisionError):
        async with memory_owner({"primary": p}) as owner:
            await owner.client().observe("orders", anyio.current_time() + 5)
            1 / 0  # noqa: B018
    assert all_tasks() == before
    assert owner.close_report is not None and owner.close_report.tasks_left == 0
    assert p.close_calls == 1


@pytest.mark.parametrize("where", ["prepare", "observe", "close", "body"])
async def test_outer_cancellation_leaves_nothing(autojump_clock: object, where: str) -> None:
    class SlowClose(MemoryProvider):
        async def aclose(self) -> None:
            await super().aclose()
            if where == "close":
                await anyio.sleep(3)

    p = SlowClose(services={"orders": "orders"})
    p.set("orders", [inst("a")])
    if where == "prepare":
        p.set_prepare_latency(10)
    if where == "observe":
        p.set_latency(10)
    before = all_tasks()
    start = anyio.current_time()
    owners: list[DiscoveryOwner] = []
    with anyio.move_on_after(1) as scope:
        async with memory_owner(
            {"primary": p},
            policies={
                "primary": policy(
                    request_timeout_ms=9000, poll_interval_ms=5000, snapshot={"max_age_ms": 15000}
                )
            },
        ) as owner:
            owners.append(owner)
            obs = await owner.client().observe("orders", anyio.current_time() + 30)
            assert obs.snapshot()
            if where == "close":
                owner.begin_close(anyio.current_time() + 5)
            await anyio.sleep(30)
    assert scope.cancelled_caught
    assert all_tasks() == before
    assert p.close_calls == 1
    if where == "close":
        assert anyio.current_time() - start == pytest.approx(3.0)  # bounded, not cut
    if owners:
        report = owners[0].close_report
        assert report is not None and report.tasks_left == 0


async def test_owner_cannot_be_copied_or_pickled(autojump_clock: object) -> None:
    async with memory_owner({"primary": memory()}) as owner:
        with pytest.raises(TypeError):
            copy.copy(owner)
        with pytest.raises(TypeError):
            copy.deepcopy(owner)
        with pytest.raises(TypeError):
            pickle.dumps(owner)


async def test_handles_have_no_close_rights(autojump_clock: object) -> None:
    async with memory_owner({"primary": memory()}) as owner:
        handle = owner.client()
        obs = await handle.observe("orders", anyio.current_time() + 5)
        observer = owner.observer()
        for thing in (handle, obs, observer):
            for name in ("close", "aclose", "begin_close", "begin_quiesce", "shutdown"):
                assert not hasattr(thing, name), (thing, name)
        assert not hasattr(observer, "_owner")


class RecordingRegistrations:
    """A stand-in registration component that records the owner's calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.task_group: TaskGroup | None = None

    def freeze(self, specs: Sequence[object], connections: Mapping[str, Connection]) -> None:
        self.calls.append(f"freeze:{len(specs)}:{','.join(sorted(connections))}")

    async def publish(self, task_group: TaskGroup, deadline: float) -> None:
        self.task_group = task_group
        self.calls.append("publish")

        async def renew_forever() -> None:
            await anyio.sleep_forever()

        task_group.start_soon(renew_forever)

    def begin_quiesce(self, deadline: float) -> None:
        self.calls.append("begin_quiesce")

    async def drain(self, deadline: float) -> None:
        await anyio.sleep(0.5)
        self.calls.append("drain")

    def report(self) -> Sequence[object]:
        return ("reg-a: deregistered",)


async def test_registration_component_seam(autojump_clock: object) -> None:
    registrations = RecordingRegistrations()
    before = all_tasks()
    builder = OwnerBuilder().connection(ConnectionSpec("primary", memory(), policy()))
    builder.registrations(registrations)
    async with builder.open() as owner:
        await owner.prepare(anyio.current_time() + 5)
        owner.freeze_registrations(["spec-1", "spec-2"])
        await owner.publish(anyio.current_time() + 5)
        assert registrations.calls == ["freeze:2:primary", "publish"]
        quiesce = owner.begin_quiesce(anyio.current_time() + 5)
        assert registrations.calls[-1] == "begin_quiesce"  # synchronous
        await quiesce.wait()
        assert registrations.calls[-1] == "drain"
        report = await owner.begin_close(anyio.current_time() + 5).wait()
    assert report.registrations == ("reg-a: deregistered",)
    assert report.tasks_left == 0
    assert all_tasks() == before


def test_the_owner_runs_on_asyncio_too() -> None:
    async def scenario() -> CloseReport | None:
        p = memory()
        p.set_latency(0.01)
        cfg = config(primary={"provider": "memory"})
        async with open_discovery(cfg, providers={"primary": p}) as owner:
            handle = owner.client()
            observations = []
            async with anyio.create_task_group() as tg:

                async def one() -> None:
                    observations.append(await handle.observe("orders", anyio.current_time() + 5))

                for _ in range(20):
                    tg.start_soon(one)
            assert p.query_counts["orders"] == 1
            assert observations[0].snapshot().identities() == ("a",)
            # nothing changes within 20 ms (the next poll is 5 s away)
            with pytest.raises(DeadlineExceeded):
                await observations[0].changed(anyio.current_time() + 0.02)
        return owner.close_report

    report = anyio.run(scenario, backend="asyncio")
    assert report is not None and report.tasks_left == 0 and not report.deadline_elapsed


async def test_identity_revocation_reaches_the_registration_component(
    autojump_clock: object,
) -> None:
    class Listening(RecordingRegistrations):
        def revoke_identity(self, qualifier: str) -> None:
            self.calls.append(f"revoked:{qualifier}")

    registrations = Listening()
    revoked, healthy = memory(), memory()
    builder = OwnerBuilder()
    builder.connection(ConnectionSpec("primary", revoked, policy()))
    builder.connection(ConnectionSpec("infra", healthy, policy()))
    builder.registrations(registrations)
    async with builder.open() as owner:
        await owner.prepare(anyio.current_time() + 5)
        kept = [
            await owner.client(name).observe("orders", anyio.current_time() + 5)
            for name in ("primary", "infra")
        ]
        revoked.fail("orders", IdentityRevoked("token revoked"))
        await anyio.sleep(12)  # two failing polls: one transition, one notice
        assert [c for c in registrations.calls if c.startswith("revoked")] == ["revoked:primary"]
        view = owner.observer().snapshot()
        assert view.connection("primary").identity_revocations == 1
        assert view.connection("infra").identity_revocations == 0
        assert kept[1].snapshot().identities() == ("a",)
