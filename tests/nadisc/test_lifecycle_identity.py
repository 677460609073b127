"""Identity revocation reaches registrations; the owner's readiness view.

An observation on connection X that sees ``IdentityRevoked`` cancels the
health evidence of every registration on X (a new identity epoch), leaves
connection Y alone, and wakes the host waiting in ``owner.identity_revoked``.
``owner.registrations()`` and the observer judge under the current epoch.
"""

from __future__ import annotations

import dataclasses

import pytest
import trio
import trio.testing

from nadisc import (
    DiscoveryConfig,
    DiscoveryOwner,
    Eligibility,
    HealthEvidence,
    IdentityRevoked,
    LifecycleError,
    ProviderSnapshot,
    QualifierError,
    RegistrationMetrics,
    RegistrationState,
    RegistrationStatus,
    open_discovery,
)
from nadisc.testing import MemoryProvider, MemoryRegistry

from .owner_support import inst, memory_owner
from .test_lifecycle_config import connection, discovery, registration

pytestmark = pytest.mark.trio_only

X_ADDRESS = ("10.0.0.5", 18080)
Y_ADDRESS = ("10.0.1.5", 19090)


class RevokingProvider(MemoryProvider):
    """When a query answers IdentityRevoked, the connection's identity is
    revoked for registry calls too, from that same instant (one credential
    serves both)."""

    def __init__(self, registry: MemoryRegistry) -> None:
        super().__init__(registry=registry)
        self.registry = registry

    async def query(self, service: str, deadline: float) -> ProviderSnapshot:
        try:
            return await super().query(service, deadline)
        except IdentityRevoked:
            self.registry.revoke_identity()
            raise


def two_connections() -> tuple[
    RevokingProvider, MemoryRegistry, RevokingProvider, MemoryRegistry, DiscoveryConfig
]:
    x_registry, y_registry = MemoryRegistry(), MemoryRegistry()
    x, y = RevokingProvider(x_registry), RevokingProvider(y_registry)
    for provider in (x, y):
        provider.set("order-worker", [inst("w1")])
    cfg = discovery(
        {"primary": connection(), "infra": connection()},
        {
            "business-http": registration(ip=X_ADDRESS[0], port=X_ADDRESS[1]),
            "infra-http": registration(
                qualifier="infra", listener_ref="admin", ip=Y_ADDRESS[0], port=Y_ADDRESS[1]
            ),
        },
    )
    return x, x_registry, y, y_registry, cfg


def statuses(owner: DiscoveryOwner) -> dict[str, RegistrationStatus]:
    return dict(owner.registrations())


async def test_a_revoked_observation_cancels_its_connections_registration_evidence(
    autojump_clock: trio.testing.MockClock,
) -> None:
    x, x_registry, y, y_registry, cfg = two_connections()
    always = Eligibility.always()
    async with open_discovery(
        cfg,
        providers={"primary": x, "infra": y},
        listeners={"web": X_ADDRESS, "admin": Y_ADDRESS},
        eligibility={"web": always, "admin": always},
    ) as owner:
        now = statuses(owner)
        assert {n: s.state for n, s in now.items()} == {
            "business-http": RegistrationState.ACTIVE,
            "infra-http": RegistrationState.ACTIVE,
        }
        assert {s.epoch for s in now.values()} == {0}
        orders = await owner.client("primary").observe("orders", trio.current_time() + 2)
        infra_orders = await owner.client("infra").observe("orders", trio.current_time() + 2)

        x.fail("order-worker", IdentityRevoked("the token was revoked"))
        epoch = 0
        with trio.fail_after(30):
            epoch = await owner.identity_revoked("primary")
        assert epoch == 1
        revoked_at = trio.current_time()

        # The very moment the host hears of it: X lost its evidence, Y did not.
        now = statuses(owner)
        x_status, y_status = now["business-http"], now["infra-http"]
        assert x_status.state is not RegistrationState.ACTIVE
        assert x_status.health is HealthEvidence.REVOKED
        assert x_status.epoch == 1 and x_status.healthy_until is None
        assert y_status.state is RegistrationState.ACTIVE and y_status.epoch == 0
        # The observation itself answers "revoked"; the other connection's does not.
        with pytest.raises(Exception, match="revoked"):
            orders.snapshot()
        assert [i.identity for i in infra_orders.snapshot().instances] == ["w1"]

        # Later checks run into the same revocation: no recovery, no new epoch.
        await trio.sleep(3)
        now = statuses(owner)
        assert now["business-http"].state is RegistrationState.DEGRADED
        assert now["business-http"].epoch == 1
        assert now["infra-http"].state is RegistrationState.ACTIVE
        assert ("check", "IdentityRevoked") in x_registry.operations("check")
        assert all(outcome == "healthy" for _, outcome in y_registry.operations("check"))

        snapshot = owner.observer().snapshot()
        assert snapshot.connection("primary").identity_revocations == 1
        assert snapshot.connection("infra").identity_revocations == 0
        x_metrics = snapshot.registration("business-http")
        assert x_metrics.state is RegistrationState.DEGRADED
        assert x_metrics.health is HealthEvidence.REVOKED and x_metrics.epoch == 1
        assert snapshot.registration("infra-http").state is RegistrationState.ACTIVE

        # Recovery: the identity is restored; a new HEALTHY check under the
        # new epoch makes it Active again.
        x_registry.restore_identity()
        x.fail("order-worker", None)
        await trio.sleep(2)
        recovered = owner.registrations()["business-http"]
        assert recovered.state is RegistrationState.ACTIVE and recovered.epoch == 1
        assert trio.current_time() > revoked_at
        # A later revocation is a new event (no gaps with after_epoch).
        async with trio.open_nursery() as nursery:
            seen: list[int] = []

            async def wait_next() -> None:
                seen.append(await owner.identity_revoked("primary", after_epoch=1))

            nursery.start_soon(wait_next)
            await trio.sleep(0.1)
            assert seen == []
            x.fail("order-worker", IdentityRevoked("revoked again"))
        assert seen == [2]


async def test_readiness_view_is_immutable_and_free_of_addresses(
    autojump_clock: trio.testing.MockClock,
) -> None:
    x, _, y, _, cfg = two_connections()
    controller, web = Eligibility.channel()
    controller.update(True, 30.0)
    async with open_discovery(
        cfg,
        providers={"primary": x, "infra": y},
        listeners={"web": X_ADDRESS, "admin": Y_ADDRESS},
        eligibility={"web": web, "admin": Eligibility.always()},
    ) as owner:
        view = owner.registrations()
        with pytest.raises(TypeError):
            view["business-http"] = view["infra-http"]  # type: ignore[index]
        with pytest.raises(dataclasses.FrozenInstanceError):
            view["business-http"].state = RegistrationState.FAILED  # type: ignore[misc]
        assert list(view) == ["business-http", "infra-http"]

        controller.close()  # the host withdraws local eligibility of "web"
        snapshot = owner.observer().snapshot()
        assert [m.name for m in snapshot.registration_states] == ["business-http", "infra-http"]
        business = snapshot.registration("business-http")
        assert business.state is RegistrationState.INELIGIBLE and not business.eligible
        assert business.qualifier == "primary" and business.readiness_critical is False
        assert all(isinstance(m, RegistrationMetrics) for m in snapshot.registration_states)
        # Names and closed sets only: no address, port or instance id anywhere.
        text = repr(snapshot.registration_states)
        for secret in (X_ADDRESS[0], str(X_ADDRESS[1]), Y_ADDRESS[0], "order-api-"):
            assert secret not in text
        for field in dataclasses.fields(RegistrationMetrics):
            assert field.name in {
                "name",
                "qualifier",
                "state",
                "write",
                "health",
                "eligible",
                "epoch",
                "residual_risk",
                "startup_required",
                "readiness_critical",
                # Counters, (time, closed state) pairs and a failure's class name.
                "renewals",
                "renewal_failures",
                "history",
                "last_error",
            }
        with pytest.raises(KeyError):
            snapshot.registration("nope")
        with pytest.raises(QualifierError):
            await owner.identity_revoked("nope")


async def test_without_registrations_the_view_is_empty(
    autojump_clock: trio.testing.MockClock,
) -> None:
    provider = MemoryProvider(services={"orders": "orders"})
    provider.set("orders", [inst("a")])
    async with memory_owner({"primary": provider}) as owner:
        assert dict(owner.registrations()) == {}
        assert owner.observer().snapshot().registration_states == ()
        with pytest.raises(LifecycleError, match="no registration component"):
            await owner.identity_revoked("primary")


async def test_the_owner_forwards_an_observed_revocation_to_the_registrations(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # The registry itself never answers IdentityRevoked here: the only way
    # the registrations can learn of it is through the observation.
    x, x_registry, y, _, cfg = two_connections()
    primary = MemoryProvider(registry=x_registry)
    primary.set("order-worker", [inst("w1")])
    always = Eligibility.always()
    async with open_discovery(
        cfg,
        providers={"primary": primary, "infra": y},
        listeners={"web": X_ADDRESS, "admin": Y_ADDRESS},
        eligibility={"web": always, "admin": always},
    ) as owner:
        await owner.client("primary").observe("orders", trio.current_time() + 2)
        before = owner.registrations()["business-http"]
        primary.fail("order-worker", IdentityRevoked("revoked"), times=1)
        with trio.fail_after(30):
            assert await owner.identity_revoked("primary") == 1
        revoked_at = trio.current_time()
        await trio.sleep(0.1)
        after = owner.registrations()["business-http"]
        # Re-checked at once under the new epoch: evidence from before the
        # revocation was not carried over.
        assert after.epoch == 1 and before.epoch == 0
        assert after.state is RegistrationState.ACTIVE
        assert after.healthy_until is not None and before.healthy_until is not None
        assert after.healthy_until >= revoked_at + 5.0 > before.healthy_until
        assert [e.at for e in x_registry.log if e.operation == "check"].count(revoked_at) >= 1
        assert all(e.outcome != "IdentityRevoked" for e in x_registry.log)
        assert owner.registrations()["infra-http"].epoch == 0
    assert x.query_counts == {}  # the RevokingProvider for X was not used
