"""Consul registration through the owner when the agent misbehaves on the wire.

A restarted (empty) agent, one 5xx or a hang on the re-registration, refused
connections, rate limiting, lost TTL passes and old agents' answers to a
deregistration of a missing service. The rules under test:

* register is an upsert by service ID, so a re-registration whose answer
  was lost is repeated with the same payload (``idempotent_register``), and
  an unknown first write is removed by ID at close
  (``deregister_without_handle``);
* a write that never left (connection refused) or was refused as rate
  limited (429) did not apply: no residual risk;
* a lost TTL ``check/pass`` cannot create a service: no residual risk; a
  lost ``PUT register`` can: residual risk.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
import trio
import trio.testing
from nadisc_consul import ConsulProvider, ConsulSettings, factory

from nadisc import (
    CloseOutcome,
    DiscoveryConfig,
    DiscoveryOwner,
    Eligibility,
    HealthCheck,
    IncompleteSnapshot,
    OutcomeUnknown,
    OwnerBuilder,
    RegistrationRecord,
    RegistrationSpec,
    RegistrationState,
    validate_provider_block,
)
from nadisc._provider import RenewalOutcomeUnknown
from tests.fakes.consul import ConsulFake, Fault
from tests.providers.fault_transport import Action, FaultTransport, Once, primary_context

# Tests taking ``autojump_clock`` run on trio only (tests/conftest.py marks
# them); the provider-level ones run on both loops.

REGISTER = "/v1/agent/service/register"
PASS = "/v1/agent/check/pass/"
DEREGISTER = "/v1/agent/service/deregister/"
HEALTH = "/v1/agent/health/service/id/"
INSTANCE = "order-api-10.0.0.5-18080"


def config() -> DiscoveryConfig:
    return DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {
                "primary": {
                    "provider": "consul",
                    "request_timeout_ms": 1000,
                    "monitor_interval_ms": 1000,
                    "observation_grace_ms": 5000,
                    "deregister_timeout_ms": 1000,
                    "retry": {"initial_backoff_ms": 200, "max_backoff_ms": 2000},
                    "consul": {
                        "url": "http://consul.fake",
                        "identity_scope": "service",
                        "wait": 5,
                        "services": {"self": {"name": "order-api"}},
                    },
                }
            },
            "shutdown_timeout_ms": 5000,
        }
    )


def provider_for(cfg: DiscoveryConfig, transport: FaultTransport) -> ConsulProvider:
    connection = cfg.connections["primary"]
    settings = validate_provider_block("primary", connection, ConsulSettings)
    return factory.create_with(primary_context(cfg), settings, transport=transport)


def spec(**changes: Any) -> RegistrationSpec:
    values: dict[str, Any] = {
        "name": "web",
        "service_name": "self",
        "ip": "10.0.0.5",
        "port": 18080,
        "check": HealthCheck(kind="ttl", ttl=10.0),
        "eligibility": Eligibility.always(),
    }
    values.update(changes)
    return RegistrationSpec(**values)


def held(fake: ConsulFake) -> bool:
    return any(key[1] == INSTANCE for key in fake.services)


def status(owner: DiscoveryOwner) -> Any:
    return owner.registrations()["web"]


async def until_state(owner: DiscoveryOwner, state: RegistrationState, limit: float = 60) -> None:
    with trio.fail_after(limit):
        # A state also changes with time alone (evidence lapses): poll.
        while status(owner).state is not state:  # noqa: ASYNC110
            await trio.sleep(0.05)


@asynccontextmanager
async def owner_over(
    transport: FaultTransport, registration: RegistrationSpec | None = None
) -> AsyncIterator[DiscoveryOwner]:
    cfg = config()
    builder = OwnerBuilder.from_config(
        cfg, providers={"primary": provider_for(cfg, transport)}
    ).registration_plan([registration or spec()])
    async with builder.open() as owner:
        await owner.prepare(trio.current_time() + 5)
        owner.freeze_registrations()
        await owner.publish(trio.current_time() + 10)
        yield owner


def outcome(owner: DiscoveryOwner) -> Any:
    report = owner.close_report
    assert report is not None
    (entry,) = report.registrations
    return entry


# --------------------------------------------------------- lease loss, then a fault


@pytest.mark.parametrize("action", [500, "hang", "apply_then_hang"])
async def test_reregistration_after_an_empty_restart_survives_one_lost_answer(
    autojump_clock: trio.testing.MockClock, action: Any
) -> None:
    transport = FaultTransport(ConsulFake(perform_checks=False))
    async with owner_over(transport) as owner:
        restarted = ConsulFake(perform_checks=False)
        transport.once(Once("PUT", REGISTER, action))
        since = transport.mark()
        transport.restart(restarted)  # the TTL pass now answers 404: LeaseLost
        await until_state(owner, RegistrationState.OUTCOME_UNKNOWN)
        await until_state(owner, RegistrationState.ACTIVE)
        assert held(restarted)
        # One lost re-registration, then its repeat with the same payload.
        assert len(transport.requests("PUT", REGISTER, since)) == 2
        assert status(owner).residual_risk and status(owner).last_error is None
    assert not held(restarted)
    # The lost write may still land (it did, with apply_then_hang): RESIDUAL.
    assert outcome(owner).outcome is CloseOutcome.RESIDUAL


async def test_unknown_first_write_is_removed_by_id_at_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake(perform_checks=False)
    transport = FaultTransport(fake)
    transport.once(Once("PUT", REGISTER, "apply_then_hang"))
    async with owner_over(transport, spec(startup_required=False)) as owner:
        await until_state(owner, RegistrationState.OUTCOME_UNKNOWN)
        await trio.sleep(30)
        assert len(transport.requests("PUT", REGISTER)) == 1  # never written again
        assert held(fake)  # it did land
    assert transport.requests("PUT", DEREGISTER)
    assert not held(fake)
    entry = outcome(owner)
    assert entry.outcome is CloseOutcome.RESIDUAL and entry.possibly_remaining


async def test_unknown_first_write_whose_removal_is_refused_stays_unknown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake(perform_checks=False)
    transport = FaultTransport(fake)
    transport.once(Once("PUT", REGISTER, "apply_then_hang"), Once("PUT", DEREGISTER, "refuse"))
    async with owner_over(transport, spec(startup_required=False)) as owner:
        await until_state(owner, RegistrationState.OUTCOME_UNKNOWN)
    entry = outcome(owner)
    assert entry.state is RegistrationState.OUTCOME_UNKNOWN
    assert entry.outcome is CloseOutcome.UNREACHABLE and entry.possibly_remaining
    assert held(fake)


@pytest.mark.parametrize("removal", ["acknowledged", "refused"])
async def test_a_rejected_repeat_of_a_lost_reregistration_is_removed_by_id_at_close(
    autojump_clock: trio.testing.MockClock, removal: str
) -> None:
    # The lost re-registration landed; its repeat is refused (400). The
    # refusal says nothing about the lost write, so the service is still
    # deregistered by ID at close.
    transport = FaultTransport(ConsulFake(perform_checks=False))
    restarted = ConsulFake(perform_checks=False)
    async with owner_over(transport) as owner:
        transport.once(Once("PUT", REGISTER, "apply_then_hang"), Once("PUT", REGISTER, 400))
        transport.restart(restarted)  # the TTL pass now answers 404: LeaseLost
        await until_state(owner, RegistrationState.FAILED)
        assert held(restarted) and status(owner).residual_risk
        if removal == "refused":
            transport.once(Once("PUT", DEREGISTER, "refuse"))
        since = transport.mark()
    assert transport.requests("PUT", DEREGISTER, since)
    entry = outcome(owner)
    assert entry.possibly_remaining
    if removal == "acknowledged":
        assert not held(restarted)
        assert entry.outcome is CloseOutcome.RESIDUAL
    else:
        assert held(restarted)
        assert entry.outcome is CloseOutcome.UNREACHABLE
        assert entry.state is RegistrationState.OUTCOME_UNKNOWN


async def test_a_lease_lost_after_a_lost_write_is_removed_by_id_at_close(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # A re-registration's answer is lost (its repeat is acknowledged), the
    # agent restarts empty again and refuses connections, so the next
    # re-registration never applies and no handle is held. The lost write
    # may still arrive after the agent said the service was gone; here it
    # does, and the close must still remove the service by ID.
    transport = FaultTransport(ConsulFake(perform_checks=False))
    again = ConsulFake(perform_checks=False)
    async with owner_over(transport) as owner:
        transport.once(Once("PUT", REGISTER, "deliver_later"))
        transport.restart(ConsulFake(perform_checks=False))
        await until_state(owner, RegistrationState.OUTCOME_UNKNOWN)
        await until_state(owner, RegistrationState.ACTIVE)
        assert status(owner).residual_risk
        transport.once(*[Once("PUT", REGISTER, "refuse")] * 100)
        since = transport.mark()
        transport.restart(again)  # the TTL pass answers 404: LeaseLost
        with trio.fail_after(60):
            while len(transport.requests("PUT", REGISTER, since)) < 2:  # noqa: ASYNC110
                await trio.sleep(0.05)
        assert not held(again)
        await transport.deliver_delayed()  # the lost write arrives, late
        assert held(again)
        since = transport.mark()
    assert transport.requests("PUT", DEREGISTER, since)
    assert not held(again)
    entry = outcome(owner)
    assert entry.outcome is CloseOutcome.RESIDUAL and entry.possibly_remaining


# --------------------------------------------------------- writes that cannot land later


async def test_refused_connections_leave_no_residual_risk(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake(perform_checks=False)
    transport = FaultTransport(fake)
    async with owner_over(transport) as owner:
        transport.down = True
        await trio.sleep(4)
        # Nothing reached the agent: the renewals are failures, not unknowns.
        assert status(owner).write.value == "acked"
        assert not status(owner).residual_risk
        transport.down = False
        await until_state(owner, RegistrationState.ACTIVE)
    entry = outcome(owner)
    assert entry.outcome is CloseOutcome.DEREGISTERED and not entry.possibly_remaining


async def test_rate_limited_writes_did_not_apply(autojump_clock: trio.testing.MockClock) -> None:
    fake = ConsulFake(perform_checks=False)
    transport = FaultTransport(fake)
    limited = {"Retry-After": "1"}
    transport.once(Once("PUT", REGISTER, 429, headers=limited))
    async with owner_over(transport) as owner:
        # The first write was refused, not lost: it was retried, not blocked.
        assert len(transport.requests("PUT", REGISTER)) == 2
        transport.once(Once("PUT", PASS, 429, headers=limited))
        await trio.sleep(3)
        assert status(owner).state is RegistrationState.ACTIVE
        assert not status(owner).residual_risk
    assert outcome(owner).outcome is CloseOutcome.DEREGISTERED


@pytest.mark.parametrize("action", [503, "hang"])
async def test_a_lost_ttl_pass_leaves_no_residual_risk(
    autojump_clock: trio.testing.MockClock, action: Action
) -> None:
    # A hang too: the provider's own timeout answers it (RenewalOutcomeUnknown)
    # before the lifecycle's backstop would take it for any lost write.
    fake = ConsulFake(perform_checks=False)
    transport = FaultTransport(fake)
    async with owner_over(transport) as owner:
        transport.once(Once("PUT", PASS, action))
        await until_state(owner, RegistrationState.OUTCOME_UNKNOWN)
        assert status(owner).last_error == "RenewalOutcomeUnknown"
        await until_state(owner, RegistrationState.ACTIVE)
        assert not status(owner).residual_risk
    entry = outcome(owner)
    assert entry.outcome is CloseOutcome.DEREGISTERED and not entry.possibly_remaining


@pytest.mark.parametrize("action", [503, "hang"])
async def test_a_lost_first_ttl_pass_does_not_block_an_acknowledged_registration(
    autojump_clock: trio.testing.MockClock, action: Action
) -> None:
    fake = ConsulFake(perform_checks=False)
    transport = FaultTransport(fake)
    transport.once(Once("PUT", PASS, action))
    async with owner_over(transport) as owner:  # publish succeeds
        assert status(owner).state is RegistrationState.ACTIVE
        assert not status(owner).residual_risk
    assert outcome(owner).outcome is CloseOutcome.DEREGISTERED


# --------------------------------------------------------- last_error after recovery


async def test_last_error_is_cleared_once_active_again(
    autojump_clock: trio.testing.MockClock,
) -> None:
    transport = FaultTransport(ConsulFake(perform_checks=False))
    async with owner_over(transport, spec(check=None)) as owner:
        transport.once(Once("GET", HEALTH, 500))
        with trio.fail_after(10):
            while status(owner).last_error is None:  # noqa: ASYNC110 - polled as above
                await trio.sleep(0.05)
        assert status(owner).last_error == "IncompleteSnapshot"
        await trio.sleep(2)  # the next check answers
        assert status(owner).state is RegistrationState.ACTIVE
        assert status(owner).last_error is None
        (metrics,) = owner.observer().snapshot().registration_states
        assert metrics.last_error is None


# --------------------------------------------------------- the provider's classification


def record() -> RegistrationRecord:
    return RegistrationRecord(
        registration="web",
        service="web",
        instance_id="web-1",
        host="10.0.0.5",
        port=8080,
        check=HealthCheck(kind="ttl", ttl=30.0),
    )


def plain_provider(transport: FaultTransport) -> ConsulProvider:
    return provider_for(config(), transport)


async def test_writes_are_classified_by_what_they_can_still_do() -> None:
    fake = ConsulFake()
    transport = FaultTransport(fake)
    provider = plain_provider(transport)
    registered = await provider.register(record(), anyio.current_time() + 5)
    # Never sent / refused as rate limited: did not apply.
    transport.once(Once("PUT", REGISTER, "refuse"))
    with pytest.raises(IncompleteSnapshot) as refused:
        await provider.reapply(registered, anyio.current_time() + 5)
    assert not isinstance(refused.value, OutcomeUnknown)
    transport.once(Once("PUT", REGISTER, 429))
    with pytest.raises(IncompleteSnapshot, match="429"):
        await provider.reapply(registered, anyio.current_time() + 5)
    # A lost PUT register may create the service: plain OutcomeUnknown.
    transport.once(Once("PUT", REGISTER, 500))
    with pytest.raises(OutcomeUnknown) as lost:
        await provider.reapply(registered, anyio.current_time() + 5)
    assert not isinstance(lost.value, RenewalOutcomeUnknown)
    # A lost TTL pass cannot: RenewalOutcomeUnknown (over HTTP 5xx or a hang).
    transport.once(Once("PUT", PASS, 503))
    with pytest.raises(RenewalOutcomeUnknown):
        await provider.renew(registered, anyio.current_time() + 5)
    transport.once(Once("PUT", PASS, "hang"))
    with pytest.raises(RenewalOutcomeUnknown):
        await provider.renew(registered, anyio.current_time() + 0.5)
    await provider.aclose()


async def test_capabilities_declare_the_upsert_and_removal_by_id() -> None:
    provider = plain_provider(FaultTransport(ConsulFake()))
    capabilities = provider.capabilities
    assert capabilities.idempotent_register and capabilities.deregister_without_handle
    await provider.aclose()


@pytest.mark.parametrize(
    "body",
    [
        # Older agents with ACLs: fmt.Errorf("Unknown service %q"), hence HTTP 500
        # (agent/acl.go, vetServiceUpdate).
        b'Unknown service "web-1"',
        # Current wording: 404 from the ACL check, but a plain error (HTTP 500)
        # from the local state's removal (agent/local/state.go).
        b'Unknown service ID "web-1". Ensure that the service ID is passed, not the service name.',
    ],
    ids=["consul-1.8", "current-wording"],
)
async def test_old_agents_500_for_a_missing_service_is_absent(body: bytes) -> None:
    fake = ConsulFake()
    provider = plain_provider(FaultTransport(fake))
    registered = await provider.register(record(), anyio.current_time() + 5)
    fake.deregister("web-1")
    fake.inject(DEREGISTER, Fault("status", status=500, body=body))
    await provider.deregister(registered, anyio.current_time() + 5)  # absent: done
    await provider.aclose()


@pytest.mark.parametrize(
    ("status_code", "body"),
    [
        (500, b"rpc error making call: No cluster leader"),
        (500, b"Unknown check"),  # not the service's answer
        (404, b"404 page not found"),
    ],
    ids=["no-leader", "other-text", "not-the-agent"],
)
async def test_other_deregister_failures_stay_unknown(status_code: int, body: bytes) -> None:
    fake = ConsulFake()
    provider = plain_provider(FaultTransport(fake))
    registered = await provider.register(record(), anyio.current_time() + 5)
    fake.inject(DEREGISTER, Fault("status", status=status_code, body=body))
    with pytest.raises(OutcomeUnknown):
        await provider.deregister(registered, anyio.current_time() + 5)
    await provider.aclose()


async def test_the_blocked_warning_names_the_registration_and_no_secret(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    fake = ConsulFake(perform_checks=False)
    transport = FaultTransport(fake)
    transport.once(Once("PUT", REGISTER, 500))
    with caplog.at_level(logging.WARNING):
        async with owner_over(transport, spec(startup_required=False)) as owner:
            await until_state(owner, RegistrationState.OUTCOME_UNKNOWN)
            await trio.sleep(5)
    (warning,) = [r for r in caplog.records if "blocked" in r.getMessage()]
    assert "'web'" in warning.getMessage() and "injected" not in warning.getMessage()
