"""Nacos registration through the owner when the server misbehaves on the wire.

A server restarted empty (the beat answers 20404 / 21003: the lease is
lost), one 5xx or a hang on the re-registration, lost light beats, rate
limiting. The rules under test:

* Nacos keeps one instance per ip:port:cluster and a register replaces it,
  so a re-registration whose answer was lost is repeated with the same
  record (``idempotent_register``); an unknown first write is deleted by
  ip:port:cluster at close (``deregister_without_handle``);
* a lost light beat cannot create an instance (20404 / 21003 on a missing
  one): no residual risk; a lost register can: residual risk;
* 429 is a refusal that did not apply.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import trio
import trio.testing
from nadisc_nacos import NacosProvider, NacosSettings, factory

from nadisc import (
    CloseOutcome,
    DiscoveryConfig,
    DiscoveryOwner,
    Eligibility,
    IncompleteSnapshot,
    OutcomeUnknown,
    RegistrationRecord,
    RegistrationState,
    open_discovery,
    validate_provider_block,
)
from nadisc._provider import RenewalOutcomeUnknown
from tests.fakes.nacos import NacosFake
from tests.providers.fault_transport import Action, FaultTransport, Once, primary_context

# Tests taking ``autojump_clock`` run on trio only (tests/conftest.py marks
# them); the provider-level ones run on both loops.

WEB = ("10.0.0.5", 18080)
API = pytest.mark.parametrize("api", ["v1", "v3"])


def config(api: str, **registration: Any) -> DiscoveryConfig:
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {
                "primary": {
                    "provider": "nacos",
                    "request_timeout_ms": 1000,
                    "monitor_interval_ms": 1000,
                    "observation_grace_ms": 5000,
                    "deregister_timeout_ms": 1000,
                    "poll_interval_ms": 1000,
                    "retry": {"initial_backoff_ms": 200, "max_backoff_ms": 2000},
                    "nacos": {
                        "server_addr": "http://nacos.fake:8848/nacos",
                        "namespace": "public",
                        "group": "BIZ",
                        "api": api,
                        "beat_interval": 1,
                        "services": {"self": {"name": "order-api"}},
                    },
                }
            },
            "registrations": {
                "web": {
                    "service_name": "self",
                    "listener_ref": "web",
                    "ip": WEB[0],
                    "port": WEB[1],
                    **registration,
                }
            },
            "shutdown_timeout_ms": 5000,
        }
    )


def provider_for(cfg: DiscoveryConfig, transport: FaultTransport) -> NacosProvider:
    connection = cfg.connections["primary"]
    settings = validate_provider_block("primary", connection, NacosSettings)
    return factory.create_with(primary_context(cfg), settings, transport=transport)


def register_fault(api: str, action: Any) -> Once:
    """The next registration write (not a v3 heartbeat, which is a POST too)."""
    return Once("POST", f"/{api}/", action, skip_query="heartBeat")


def beat_fault(api: str, action: Any) -> Once:
    if api == "v1":
        return Once("PUT", "/v1/ns/instance/beat", action)
    return Once("POST", "/v3/client/ns/instance", action, with_query="heartBeat")


def held(fake: NacosFake) -> bool:
    return fake.find("order-api", *WEB, namespace="public", group="BIZ") is not None


def status(owner: DiscoveryOwner) -> Any:
    return owner.registrations()["web"]


async def until_state(owner: DiscoveryOwner, state: RegistrationState, limit: float = 60) -> None:
    with trio.fail_after(limit):
        # A state also changes with time alone (evidence lapses): poll.
        while status(owner).state is not state:  # noqa: ASYNC110
            await trio.sleep(0.05)


@asynccontextmanager
async def owner_over(
    transport: FaultTransport, api: str, **registration: Any
) -> AsyncIterator[DiscoveryOwner]:
    cfg = config(api, **registration)
    async with open_discovery(
        cfg,
        providers={"primary": provider_for(cfg, transport)},
        listeners={"web": WEB},
        eligibility={"web": Eligibility.always()},
        publish_deadline=trio.current_time() + 10,
    ) as owner:
        yield owner


def outcome(owner: DiscoveryOwner) -> Any:
    report = owner.close_report
    assert report is not None
    (entry,) = report.registrations
    return entry


@API
@pytest.mark.parametrize("action", [503, "hang", "apply_then_hang"])
async def test_reregistration_after_an_empty_restart_survives_one_lost_answer(
    autojump_clock: trio.testing.MockClock, api: str, action: Any
) -> None:
    transport = FaultTransport(NacosFake())
    async with owner_over(transport, api) as owner:
        restarted = NacosFake()
        transport.once(register_fault(api, action))
        since = transport.mark()
        transport.restart(restarted)  # the next beat: "instance not found"
        await until_state(owner, RegistrationState.OUTCOME_UNKNOWN)
        await until_state(owner, RegistrationState.ACTIVE)
        assert held(restarted)
        registers = [
            t
            for t, method, path in transport.log[since:]
            if method == "POST" and path.endswith("/ns/instance")
        ]
        assert len(registers) >= 2  # beats (v3) are POSTs too: at least lost + repeat
        assert status(owner).residual_risk and status(owner).last_error is None
    assert not held(restarted)
    assert outcome(owner).outcome is CloseOutcome.RESIDUAL


@API
@pytest.mark.parametrize("action", [503, "hang"])
async def test_a_lost_light_beat_leaves_no_residual_risk(
    autojump_clock: trio.testing.MockClock, api: str, action: Action
) -> None:
    # A hang too: the provider's own timeout answers it before the
    # lifecycle's backstop would take it for any lost write.
    fake = NacosFake()
    transport = FaultTransport(fake)
    async with owner_over(transport, api) as owner:
        transport.once(beat_fault(api, action))
        await until_state(owner, RegistrationState.OUTCOME_UNKNOWN)
        assert status(owner).last_error == "RenewalOutcomeUnknown"
        await until_state(owner, RegistrationState.ACTIVE)
        assert not status(owner).residual_risk
    entry = outcome(owner)
    assert entry.outcome is CloseOutcome.DEREGISTERED and not entry.possibly_remaining
    assert not held(fake)


@API
async def test_rate_limited_writes_did_not_apply(
    autojump_clock: trio.testing.MockClock, api: str
) -> None:
    fake = NacosFake()
    transport = FaultTransport(fake)
    transport.once(register_fault(api, 429))
    async with owner_over(transport, api) as owner:  # retried, not blocked
        transport.once(beat_fault(api, 429))
        await trio.sleep(3)
        assert status(owner).state is RegistrationState.ACTIVE
        assert not status(owner).residual_risk
    assert outcome(owner).outcome is CloseOutcome.DEREGISTERED


@API
async def test_unknown_first_write_is_deleted_at_close(
    autojump_clock: trio.testing.MockClock, api: str
) -> None:
    fake = NacosFake()
    transport = FaultTransport(fake)
    transport.once(register_fault(api, "apply_then_hang"))
    async with owner_over(transport, api, startup_required=False) as owner:
        await until_state(owner, RegistrationState.OUTCOME_UNKNOWN)
        await trio.sleep(10)
        assert held(fake)
        # Never written again (and no beat for a registration without a handle).
        assert len([1 for _, method, _ in transport.log if method in ("POST", "PUT")]) == 1
    assert any(method == "DELETE" for _, method, _ in transport.log)
    assert not held(fake)
    entry = outcome(owner)
    assert entry.outcome is CloseOutcome.RESIDUAL and entry.possibly_remaining


@API
@pytest.mark.parametrize("removal", ["acknowledged", "refused"])
async def test_a_rejected_repeat_of_a_lost_reregistration_is_deleted_at_close(
    autojump_clock: trio.testing.MockClock, api: str, removal: str
) -> None:
    # The lost re-registration landed; its repeat is refused (400). The
    # refusal says nothing about the lost write, so the instance is still
    # deleted by ip:port:cluster at close.
    transport = FaultTransport(NacosFake())
    restarted = NacosFake()
    async with owner_over(transport, api) as owner:
        transport.once(register_fault(api, "apply_then_hang"), register_fault(api, 400))
        transport.restart(restarted)  # the next beat: "instance not found"
        await until_state(owner, RegistrationState.FAILED)
        assert held(restarted) and status(owner).residual_risk
        if removal == "refused":
            transport.once(Once("DELETE", f"/{api}/", "refuse"))
        since = transport.mark()
    assert any(method == "DELETE" for _, method, _ in transport.log[since:])
    entry = outcome(owner)
    assert entry.possibly_remaining
    if removal == "acknowledged":
        assert not held(restarted)
        assert entry.outcome is CloseOutcome.RESIDUAL
    else:
        assert held(restarted)
        assert entry.outcome is CloseOutcome.UNREACHABLE
        assert entry.state is RegistrationState.OUTCOME_UNKNOWN


@API
async def test_a_lease_lost_after_a_lost_write_is_deleted_at_close(
    autojump_clock: trio.testing.MockClock, api: str
) -> None:
    # A re-registration's answer is lost (its repeat is acknowledged); the
    # server restarts empty again and refuses connections, so the next
    # re-registration never applies and no handle is held. The lost write
    # arrives after the server said the instance was gone: the close still
    # deletes it by ip:port:cluster.
    transport = FaultTransport(NacosFake())
    again = NacosFake()
    async with owner_over(transport, api) as owner:
        transport.once(register_fault(api, "deliver_later"))
        transport.restart(NacosFake())  # the next beat: "instance not found"
        await until_state(owner, RegistrationState.OUTCOME_UNKNOWN)
        await until_state(owner, RegistrationState.ACTIVE)
        assert status(owner).residual_risk
        transport.once(*[register_fault(api, "refuse")] * 100)
        refused = len(transport.faults)
        transport.restart(again)
        with trio.fail_after(60):
            while refused - len(transport.faults) < 2:  # noqa: ASYNC110
                await trio.sleep(0.05)
        assert not held(again)
        await transport.deliver_delayed()  # the lost write arrives, late
        assert held(again)
        since = transport.mark()
    assert any(method == "DELETE" for _, method, _ in transport.log[since:])
    assert not held(again)
    entry = outcome(owner)
    assert entry.outcome is CloseOutcome.RESIDUAL and entry.possibly_remaining


def record() -> RegistrationRecord:
    return RegistrationRecord(
        registration="web", service="order-api", instance_id="i", host=WEB[0], port=WEB[1]
    )


@API
async def test_lost_writes_say_whether_they_could_create_the_instance(api: str) -> None:
    transport = FaultTransport(NacosFake())
    provider = provider_for(config(api), transport)
    await provider.prepare(anyio.current_time() + 5)
    assert provider.capabilities.idempotent_register
    assert provider.capabilities.deregister_without_handle
    transport.once(register_fault(api, 503))
    with pytest.raises(OutcomeUnknown) as lost:
        await provider.register(record(), anyio.current_time() + 5)
    assert not isinstance(lost.value, RenewalOutcomeUnknown)
    registered = await provider.register(record(), anyio.current_time() + 5)
    transport.once(beat_fault(api, 503))
    with pytest.raises(RenewalOutcomeUnknown):
        await provider.renew(registered, anyio.current_time() + 5)
    transport.once(beat_fault(api, "hang"))
    with pytest.raises(RenewalOutcomeUnknown):
        await provider.renew(registered, anyio.current_time() + 0.5)
    transport.once(beat_fault(api, 429))
    with pytest.raises(IncompleteSnapshot) as limited:
        await provider.renew(registered, anyio.current_time() + 5)
    assert not isinstance(limited.value, OutcomeUnknown)
    await provider.aclose()
