"""Config-driven registrations through ``open_discovery`` (the host flow).

Listeners are bound first; the owner resolves the plan, freezes it (every
check before any write), publishes it and hands the owner over only once
every startup-required registration is Active. A required registration
raises its connection's startup requirement.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import anyio
import pytest
import trio
import trio.testing

from nadisc import (
    CloseOutcome,
    DeadlineExceeded,
    DiscoveryConfig,
    DiscoveryOwner,
    Eligibility,
    IncompleteSnapshot,
    LifecycleError,
    OwnerBuilder,
    Phase,
    PrepareError,
    RegistrationCloseEntry,
    RegistrationError,
    RegistrationRejected,
    RegistrationSpec,
    RegistrationState,
    open_discovery,
)
from nadisc.testing import Fault, MemoryProvider, MemoryRegistry

from .owner_support import all_tasks, inst

pytestmark = pytest.mark.trio_only

#: The advertised address of the registration in these configs.
WEB = ("10.0.0.5", 18080)
INSTANCE = "order-api-10.0.0.5-18080"


def connection(**overrides: Any) -> dict[str, Any]:
    """A memory connection with short registration timing (budgets valid)."""
    base: dict[str, Any] = {
        "provider": "memory",
        "monitor_interval_ms": 1000,
        "observation_grace_ms": 5000,
        "request_timeout_ms": 500,
        "deregister_timeout_ms": 700,
        "retry": {"initial_backoff_ms": 200, "max_backoff_ms": 2000},
        "memory": {"services": {"self": {"name": "order-api"}, "orders": {"name": "order-worker"}}},
    }
    base.update(overrides)
    return base


def registration(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "service_name": "self",
        "listener_ref": "web",
        "ip": WEB[0],
        "port": WEB[1],
    }
    base.update(overrides)
    return base


def discovery(
    connections: Mapping[str, dict[str, Any]], registrations: Mapping[str, dict[str, Any]]
) -> DiscoveryConfig:
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": dict(connections),
            "registrations": dict(registrations),
            "shutdown_timeout_ms": 5000,
        }
    )


def memory_pair(*, idempotent: bool = True) -> tuple[MemoryProvider, MemoryRegistry]:
    registry = MemoryRegistry(idempotent_renewal=idempotent)
    provider = MemoryProvider(registry=registry)
    provider.set("order-worker", [inst("w1")])
    return provider, registry


def outcomes(owner: DiscoveryOwner) -> dict[str, CloseOutcome]:
    report = owner.close_report
    assert report is not None
    out: dict[str, CloseOutcome] = {}
    for entry in report.registrations:
        assert isinstance(entry, RegistrationCloseEntry)
        out[entry.name] = entry.outcome
    return out


def phase(owner: DiscoveryOwner) -> Phase:
    """The phase, read through a call (it changes under the type checker's feet)."""
    return owner.phase


def state(owner: DiscoveryOwner, name: str) -> RegistrationState:
    return owner.registrations()[name].state


# --------------------------------------------------------------------------- the host flow


async def test_registrations_are_confirmed_before_the_block_runs(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider, registry = memory_pair()
    cfg = discovery({"primary": connection()}, {"business-http": registration()})
    before = all_tasks()
    async with open_discovery(
        cfg,
        providers={"primary": provider},
        listeners={"web": WEB},
        eligibility={"web": Eligibility.always()},
    ) as owner:
        entered = trio.current_time()
        assert phase(owner) is Phase.PUBLISHED
        assert state(owner, "business-http") is RegistrationState.ACTIVE
        assert registry.instance_ids() == (INSTANCE,)
        # Written and confirmed healthy before the block got the owner.
        log = [(e.operation, e.outcome) for e in registry.log if e.at <= entered]
        assert log[:2] == [("register", "ok"), ("check", "healthy")]
        # Discovery works alongside.
        orders = await owner.client().observe("orders", trio.current_time() + 2)
        assert [i.identity for i in orders.snapshot().instances] == ["w1"]
        await trio.sleep(3)
        assert len(registry.operations("renew")) >= 2
    # Leaving the block deregistered it and reported the final state.
    assert registry.instance_ids() == ()
    assert outcomes(owner) == {"business-http": CloseOutcome.DEREGISTERED}
    assert owner.registrations()["business-http"].state is RegistrationState.DEREGISTERED
    assert all_tasks() == before


@pytest.mark.parametrize(
    ("fault", "outcome"),
    [
        (Fault.fail(RegistrationRejected("refused")), CloseOutcome.NOT_REGISTERED),
        (Fault.drop(), CloseOutcome.OUTCOME_UNKNOWN),
        (Fault.lose_ack(), CloseOutcome.OUTCOME_UNKNOWN),
    ],
)
async def test_a_failed_startup_registration_fails_the_entry(
    autojump_clock: trio.testing.MockClock, fault: Fault, outcome: CloseOutcome
) -> None:
    provider, registry = memory_pair()
    registry.inject("register", fault)
    cfg = discovery({"primary": connection()}, {"business-http": registration()})
    before = all_tasks()
    ran = False
    with pytest.raises(RegistrationError, match="business-http") as caught:
        async with open_discovery(
            cfg,
            providers={"primary": provider},
            listeners={"web": WEB},
            eligibility={"web": Eligibility.always()},
        ):
            ran = True
    assert not ran
    assert caught.value.registration == "business-http"
    # The close already happened: the exception says what was left behind.
    assert f"business-http={outcome.value}" in "\n".join(caught.value.__notes__)
    assert provider.close_calls == 1
    assert all_tasks() == before
    # Nothing was written again after the first (failed or unknown) write.
    assert len(registry.operations("register")) == 1


async def test_an_unconfirmed_registration_fails_at_the_publish_deadline(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider, registry = memory_pair()
    _controller, web = Eligibility.channel()  # never granted
    cfg = discovery({"primary": connection()}, {"business-http": registration()})
    start = trio.current_time()
    with pytest.raises(DeadlineExceeded, match="business-http") as caught:
        async with open_discovery(
            cfg, providers={"primary": provider}, listeners={"web": WEB}, eligibility={"web": web}
        ):
            pytest.fail("the block must not run")
    # The default publish deadline: the connection's observation grace (5 s).
    assert 5 <= trio.current_time() - start < 6
    assert registry.operations() == []  # ineligible: nothing was ever sent
    assert "business-http=not_registered" in "\n".join(caught.value.__notes__)
    assert provider.close_calls == 1


async def test_registrations_that_are_not_startup_required_do_not_hold_the_entry(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider, registry = memory_pair()
    registry.inject("register", Fault.drop())
    cfg = discovery(
        {"primary": connection()},
        {"business-http": registration(startup_required=False, readiness_critical=True)},
    )
    async with open_discovery(
        cfg,
        providers={"primary": provider},
        listeners={"web": WEB},
        eligibility={"web": Eligibility.always()},
    ) as owner:
        assert phase(owner) is Phase.PUBLISHED
        await trio.sleep(1)
        assert state(owner, "business-http") is RegistrationState.OUTCOME_UNKNOWN
    assert outcomes(owner) == {"business-http": CloseOutcome.OUTCOME_UNKNOWN}


async def test_explicit_publish_deadline_and_nan_deadlines(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider, _registry = memory_pair()
    _controller, web = Eligibility.channel()
    cfg = discovery({"primary": connection()}, {"business-http": registration()})
    start = trio.current_time()
    with pytest.raises(DeadlineExceeded, match="business-http"):
        async with open_discovery(
            cfg,
            providers={"primary": provider},
            listeners={"web": WEB},
            eligibility={"web": web},
            publish_deadline=start + 1.5,
        ):
            pass
    assert trio.current_time() - start == pytest.approx(1.5)
    other, _ = memory_pair()
    with pytest.raises(DeadlineExceeded, match="publish deadline"):
        async with open_discovery(
            cfg,
            providers={"primary": other},
            listeners={"web": WEB},
            eligibility={"web": web},
            publish_deadline=math.nan,
        ):
            pass
    assert other.prepare_calls == 0


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    ("listeners", "eligibility", "path"),
    [
        (None, None, "discovery.registrations.business-http.listener_ref"),
        ({"web": WEB}, None, "discovery.registrations.business-http.eligibility_ref"),
        ({"grpc": WEB}, {"grpc": "x"}, "discovery.registrations.business-http.listener_ref"),
        ({"web": WEB}, {"grpc": "x"}, "discovery.registrations.business-http.eligibility_ref"),
    ],
)
async def test_unresolvable_references_fail_before_anything_runs(
    listeners: dict[str, tuple[str, int]] | None,
    eligibility: dict[str, str] | None,
    path: str,
) -> None:
    provider, registry = memory_pair()
    sources = None if eligibility is None else {k: Eligibility.always() for k in eligibility}
    cfg = discovery({"primary": connection()}, {"business-http": registration()})
    with pytest.raises(RegistrationError) as caught:
        async with open_discovery(
            cfg, providers={"primary": provider}, listeners=listeners, eligibility=sources
        ):
            pass
    assert caught.value.path == path
    assert caught.value.registration == "business-http"
    assert path in str(caught.value)
    assert provider.prepare_calls == 0 and provider.close_calls == 0
    assert registry.operations() == []


async def test_no_eligibility_reference_at_all_names_the_path() -> None:
    provider, _ = memory_pair()
    cfg = discovery({"primary": connection()}, {"business-http": registration(listener_ref=None)})
    with pytest.raises(RegistrationError) as caught:
        async with open_discovery(cfg, providers={"primary": provider}):
            pass
    assert caught.value.path == "discovery.registrations.business-http.eligibility_ref"


async def test_a_plan_check_refuses_before_any_write(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The config accepts a host name; the frozen plan refuses a loopback one.
    provider, registry = memory_pair()
    cfg = discovery({"primary": connection()}, {"business-http": registration(ip="localhost")})
    with pytest.raises(RegistrationError, match="loopback") as caught:
        async with open_discovery(
            cfg,
            providers={"primary": provider},
            listeners={"web": WEB},
            eligibility={"web": Eligibility.always()},
        ):
            pass
    assert caught.value.path == "discovery.registrations.business-http.ip"
    assert registry.operations() == []
    assert provider.close_calls == 1


# --------------------------------------------------------------------------- stage API


async def test_builder_plan_with_explicit_stages(autojump_clock: trio.testing.MockClock) -> None:
    provider, registry = memory_pair()
    cfg = discovery({"primary": connection()}, {"business-http": registration()})
    builder = OwnerBuilder.from_config(
        cfg,
        providers={"primary": provider},
        listeners={"web": WEB},
        eligibility={"web": Eligibility.always()},
    )
    async with builder.open() as owner:
        await owner.prepare(trio.current_time() + 5)
        spec = RegistrationSpec(name="other", service_name="self", ip="10.0.0.6", port=1)
        with pytest.raises(LifecycleError, match="already has a registration plan"):
            owner.freeze_registrations([spec])
        assert phase(owner) is Phase.PREPARED  # nothing half-applied
        owner.freeze_registrations()
        assert phase(owner) is Phase.FROZEN
        assert state(owner, "business-http") is RegistrationState.PENDING
        assert registry.operations() == []  # frozen, nothing written
        await owner.publish(trio.current_time() + 5)
        assert state(owner, "business-http") is RegistrationState.ACTIVE
        deadline = trio.current_time() + 5
        await owner.begin_quiesce(deadline).wait()
        assert registry.instance_ids() == ()
        report = await owner.begin_close(deadline).wait()
    assert [e.outcome for e in report.registrations if isinstance(e, RegistrationCloseEntry)] == [
        CloseOutcome.DEREGISTERED
    ]


async def test_builder_registration_plan_for_hosts_without_config(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from nadisc import ConnectionConfig, ConnectionSpec

    provider, registry = memory_pair()
    policy = ConnectionConfig.model_validate(connection())
    spec = RegistrationSpec(
        name="web", service_name="self", listener_ref="web", eligibility_ref="web"
    )
    builder = (
        OwnerBuilder()
        .connection(ConnectionSpec("primary", provider, policy))
        .registration_plan(
            [spec], listeners={"web": WEB}, eligibility={"web": Eligibility.always()}
        )
    )
    async with builder.open() as owner:
        await owner.prepare(trio.current_time() + 5)
        owner.freeze_registrations()
        await owner.publish(trio.current_time() + 5)
        assert registry.instance_ids() == (INSTANCE,)
    assert outcomes(owner) == {"web": CloseOutcome.DEREGISTERED}
    with pytest.raises(RegistrationError, match="expected a RegistrationSpec"):
        OwnerBuilder().registration_plan(["web"])  # type: ignore[list-item]


# --------------------------------------------------------------------------- startup requirement


def optional_connection() -> dict[str, Any]:
    return connection(startup_required=False)


async def test_a_required_registration_raises_its_connections_requirement(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider, registry = memory_pair()
    provider.fail_prepare(IncompleteSnapshot("registry unreachable"))
    cfg = discovery({"primary": optional_connection()}, {"business-http": registration()})
    before = all_tasks()
    with pytest.raises(PrepareError, match=r"required because.*business-http") as caught:
        async with open_discovery(
            cfg,
            providers={"primary": provider},
            listeners={"web": WEB},
            eligibility={"web": Eligibility.always()},
        ):
            pass
    assert caught.value.connection == "primary"
    assert registry.operations() == []
    assert provider.close_calls == 1
    assert all_tasks() == before


async def test_an_optional_registration_leaves_an_optional_connection_optional(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider, _registry = memory_pair()
    provider.fail_prepare(IncompleteSnapshot("registry unreachable"))
    cfg = discovery(
        {"primary": optional_connection()},
        {"business-http": registration(startup_required=False)},
    )
    async with open_discovery(
        cfg,
        providers={"primary": provider},
        listeners={"web": WEB},
        eligibility={"web": Eligibility.always()},
    ) as owner:
        assert owner.prepared
        assert owner.observer().snapshot().connection("primary").prepared is False
        assert phase(owner) is Phase.PUBLISHED


async def test_an_optional_connection_without_registrations_stays_optional(
    autojump_clock: trio.testing.MockClock,
) -> None:
    failing, _ = memory_pair()
    failing.fail_prepare(IncompleteSnapshot("registry unreachable"))
    good, registry = memory_pair()
    cfg = discovery(
        {"primary": connection(), "infra": optional_connection()},
        {"business-http": registration()},
    )
    async with open_discovery(
        cfg,
        providers={"primary": good, "infra": failing},
        listeners={"web": WEB},
        eligibility={"web": Eligibility.always()},
    ) as owner:
        assert state(owner, "business-http") is RegistrationState.ACTIVE
        assert registry.instance_ids() == (INSTANCE,)


async def test_adding_a_registry_capable_connection_registers_nothing(
    autojump_clock: trio.testing.MockClock,
) -> None:
    primary, primary_registry = memory_pair()
    infra, infra_registry = memory_pair()
    assert infra.capabilities.registration  # it could register: it must not
    cfg = discovery(
        {"primary": connection(), "infra": connection()}, {"business-http": registration()}
    )
    async with open_discovery(
        cfg,
        providers={"primary": primary, "infra": infra},
        listeners={"web": WEB},
        eligibility={"web": Eligibility.always()},
    ) as owner:
        await trio.sleep(5)
        assert set(owner.registrations()) == {"business-http"}
        assert primary_registry.instance_ids() == (INSTANCE,)
    # Not one registry call on the added connection, through close.
    assert infra_registry.log == [] and infra_registry.instance_ids() == ()
    assert primary_registry.operations("register") == [("register", "ok")]
    # And a plan with no registrations at all writes nowhere.
    lone, lone_registry = memory_pair()
    other, other_registry = memory_pair()
    empty = discovery({"primary": connection(), "infra": connection()}, {})
    async with open_discovery(empty, providers={"primary": lone, "infra": other}) as owner:
        await trio.sleep(5)
        assert dict(owner.registrations()) == {}
    assert lone_registry.log == [] and other_registry.log == []


async def test_the_stage_api_refuses_a_required_registration_on_a_failed_connection(
    autojump_clock: trio.testing.MockClock,
) -> None:
    from nadisc import ConnectionConfig, ConnectionSpec, OwnerRegistrations

    provider, registry = memory_pair()
    provider.fail_prepare(IncompleteSnapshot("registry unreachable"))
    policy = ConnectionConfig.model_validate(optional_connection())
    builder = (
        OwnerBuilder()
        .connection(ConnectionSpec("primary", provider, policy))
        .registrations(OwnerRegistrations(eligibility={"web": Eligibility.always()}))
    )
    spec = RegistrationSpec(
        name="web", service_name="self", ip=WEB[0], port=WEB[1], eligibility_ref="web"
    )
    async with builder.open() as owner:
        await owner.prepare(anyio.current_time() + 5)  # optional: passes
        with pytest.raises(PrepareError, match="startup-required registration 'web'"):
            owner.freeze_registrations([spec])
        assert phase(owner) is Phase.PREPARED
        # The same registration, not startup-required, may go ahead.
        owner.freeze_registrations(
            [
                RegistrationSpec(
                    name="web",
                    service_name="self",
                    ip=WEB[0],
                    port=WEB[1],
                    eligibility_ref="web",
                    startup_required=False,
                )
            ]
        )
        await owner.publish(anyio.current_time() + 5)
        await trio.sleep(0.5)
        assert registry.instance_ids() == (INSTANCE,)
    assert outcomes(owner) == {"web": CloseOutcome.DEREGISTERED}


async def test_prepare_itself_fails_for_a_connection_a_plan_made_required(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider, _ = memory_pair()
    provider.fail_prepare(IncompleteSnapshot("registry unreachable"))
    cfg = discovery({"primary": optional_connection()}, {"business-http": registration()})
    builder = OwnerBuilder.from_config(
        cfg,
        providers={"primary": provider},
        listeners={"web": WEB},
        eligibility={"web": Eligibility.always()},
    )
    async with builder.open() as owner:
        with pytest.raises(PrepareError, match="required because") as caught:
            await owner.prepare(trio.current_time() + 5)
        assert caught.value.connection == "primary"
        assert "business-http" in str(caught.value)
        assert phase(owner) is Phase.BUILT and not owner.prepared


async def test_an_eligibility_of_the_wrong_type_names_the_path() -> None:
    provider, _ = memory_pair()
    cfg = discovery({"primary": connection()}, {"business-http": registration()})
    with pytest.raises(RegistrationError, match=r"must be an nadisc\.Eligibility") as caught:
        async with open_discovery(
            cfg,
            providers={"primary": provider},
            listeners={"web": WEB},
            eligibility={"web": True},  # type: ignore[dict-item]
        ):
            pass
    assert caught.value.path == "discovery.registrations.business-http.eligibility_ref"
    assert provider.prepare_calls == 0


async def test_cancelled_while_publishing_leaves_nothing_behind(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider, registry = memory_pair()
    registry.inject("register", Fault.slow(0.3))
    controller, web = Eligibility.channel()
    controller.update(True, 30.0)
    cfg = discovery({"primary": connection()}, {"business-http": registration()})
    before = all_tasks()
    with trio.move_on_after(0.1) as scope:
        async with open_discovery(
            cfg, providers={"primary": provider}, listeners={"web": WEB}, eligibility={"web": web}
        ):
            pytest.fail("the block must not run")
    assert scope.cancelled_caught
    # The write in flight finished (shielded, bounded) and was removed again.
    assert [op for op, _ in registry.operations()] == ["register", "deregister"]
    assert registry.instance_ids() == ()
    assert provider.close_calls == 1
    assert all_tasks() == before


def test_the_close_note_of_thousands_of_registrations_stays_short() -> None:
    """A failed start names the first registrations and counts the rest by outcome."""
    from types import SimpleNamespace

    from nadisc._owner import _close_note

    entries = [
        SimpleNamespace(name=f"r{n:05d}", outcome=SimpleNamespace(value=value))
        for n, value in enumerate(["deregistered"] * 9_000 + ["not_registered"] * 1_000)
    ]
    note = _close_note(entries)
    assert note.startswith("registrations at close: r00000=deregistered, r00001=deregistered")
    assert "r00019=deregistered and 9980 more" in note and "r00020" not in note
    assert note.endswith("all 10000: deregistered=9000, not_registered=1000")
    assert len(note) < 1_000
    few = _close_note(entries[:3])
    assert few == (
        "registrations at close: r00000=deregistered, r00001=deregistered, r00002=deregistered"
    )
