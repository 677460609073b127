"""Nacos through the owner, against in-process fakes under trio's MockClock:
discovery, evidence, registration lifecycle, auth, API generations."""

from __future__ import annotations

import pytest
import trio
from nadisc_nacos import NacosProvider

from nadisc import (
    EvidenceKind,
    RegistrationState,
)
from tests.fakes.nacos import NacosFake, open_nacos_fake
from tests.nadisc.owner_support import all_tasks

from .owner_support import (
    LONG_LIVED,
    config,
    identities,
    open_owner,
    providers_for,
    refusal,
    until,
)

pytestmark = pytest.mark.trio_only

ID = "10.0.0.7#18080#DEFAULT#DEFAULT_GROUP@@order-worker"


def soon(seconds: float = 10) -> float:
    return trio.current_time() + seconds


async def test_register_is_visible_to_another_owner_within_one_poll(
    autojump_clock: object,
) -> None:
    before = all_tasks()
    async with open_nacos_fake() as fake:
        reader_cfg = config(fake.url)
        async with open_owner(reader_cfg, fake) as reader:
            observation = await reader.client().observe("orders", soon())
            assert identities(observation) == () and refusal(observation) == "empty"
            writer_cfg = config(fake.url, registration={})
            async with open_owner(writer_cfg, fake) as writer:
                registered_at = trio.current_time()
                assert writer.registrations()["web"].state is RegistrationState.ACTIVE
                while identities(observation) != (ID,):
                    await observation.changed(soon(10))
                assert trio.current_time() - registered_at <= 5.0  # one poll_interval_ms
                snap = observation.snapshot(strict=True)
                assert snap.evidence is EvidenceKind.REGISTRY_HEALTH
                # beats keep the ephemeral instance alive across 10 minutes
                await trio.sleep(600)
                assert identities(observation) == (ID,)
                assert writer.registrations()["web"].state is RegistrationState.ACTIVE
                assert fake.find("order-worker", "10.0.0.7", 18080).healthy  # type: ignore[union-attr]
            # quiesce deregistered: gone at the next poll, a complete empty list revokes at once
            assert fake.find("order-worker", "10.0.0.7", 18080) is None
            await until(lambda: refusal(observation) == "empty", limit=6)
    assert all_tasks() <= before


async def test_a_process_that_stops_beating_disappears_after_the_timers(
    autojump_clock: object,
) -> None:
    async with open_nacos_fake() as fake:
        fake.register("order-worker", "10.0.0.9", 80, now=trio.current_time())  # beats once
        # One service holds one kind (the server refuses a persistent instance in an
        # ephemeral service): the survivor is ephemeral with an hour-long timeout.
        fake.register("order-worker", "10.0.0.8", 80, now=trio.current_time(), metadata=LONG_LIVED)
        cfg = config(fake.url)
        async with open_owner(cfg, fake) as owner:
            observation = await owner.client().observe("orders", soon())
            assert len(identities(observation)) == 2
            await until(lambda: len(identities(observation)) == 1)  # unhealthy after 15 s
            assert 15 < trio.current_time() <= 15 + 5 + 1
            assert identities(observation) == ("10.0.0.8#80#DEFAULT#DEFAULT_GROUP@@order-worker",)
            await trio.sleep(20)
            assert fake.find("order-worker", "10.0.0.9", 80) is None  # deleted after 30 s


async def test_disabled_or_unhealthy_is_withdrawn_at_the_next_poll(autojump_clock: object) -> None:
    fake = NacosFake()
    for n in (1, 2, 3):
        fake.register("order-worker", f"10.0.0.{n}", 80, now=0, ephemeral=False)
    cfg = config(fake.url)
    async with open_owner(cfg, fake) as owner:
        observation = await owner.client().observe("orders", soon())
        assert len(identities(observation)) == 3
        fake.set_enabled("order-worker", "10.0.0.1", 80, False)
        fake.set_healthy("order-worker", "10.0.0.2", 80, False)
        changed_at = trio.current_time()
        await observation.changed(soon(10))
        assert trio.current_time() - changed_at <= 5.0
        assert identities(observation) == ("10.0.0.3#80#DEFAULT#DEFAULT_GROUP@@order-worker",)


async def test_protect_threshold_is_served_marked_and_refused_by_strict_callers(
    autojump_clock: object,
) -> None:
    fake = NacosFake()
    for n in (1, 2):
        fake.register("order-worker", f"10.0.0.{n}", 80, now=0, ephemeral=False)
    fake.set_protect_threshold("order-worker", 0.5)
    cfg = config(fake.url, api="v1")
    async with open_owner(cfg, fake) as owner:
        observation = await owner.client().observe("orders", soon())
        assert observation.snapshot(strict=True).evidence is EvidenceKind.REGISTRY_HEALTH
        fake.set_healthy("order-worker", "10.0.0.2", 80, False)  # 1/2 <= 0.5: everyone back
        await observation.changed(soon(10))
        snap = observation.snapshot()
        assert snap.evidence is EvidenceKind.WEAK_HEALTH and len(snap.instances) == 2
        assert refusal(observation, strict=True) == "weak"
        service = owner.observer().snapshot().connection("primary").services[0]
        assert service.weak and service.evidence == "weak_health"
        fake.set_healthy("order-worker", "10.0.0.2", 80, True)
        await observation.changed(soon(10))
        assert observation.snapshot(strict=True).evidence is EvidenceKind.REGISTRY_HEALTH


async def test_token_expiry_mid_watch_is_one_relogin_and_no_gap(autojump_clock: object) -> None:
    fake = NacosFake(users={"svc": "pw"}, token_ttl=60)
    fake.register("order-worker", "10.0.0.1", 80, now=0, ephemeral=False)
    cfg = config(fake.url, username="svc", password="pw", token_refresh_margin=0)
    async with open_owner(cfg, fake) as owner:
        observation = await owner.client().observe("orders", soon())
        assert fake.logins == 1
        gaps = 0
        for _ in range(int(100 / 0.5)):
            await trio.sleep(0.5)
            gaps += refusal(observation, strict=True) is not None
        assert fake.logins == 2  # the 60 s token expired once: one re-login
        assert gaps == 0


async def test_password_changed_on_the_server_is_revocation(autojump_clock: object) -> None:
    async with open_nacos_fake(users={"svc": "pw"}, token_ttl=60) as fake:
        fake.register("order-worker", "10.0.0.1", 80, now=0, metadata=LONG_LIVED)
        cfg = config(
            fake.url, registration={}, username="svc", password="pw", token_refresh_margin=0
        )
        async with open_owner(cfg, fake) as owner:
            observation = await owner.client().observe("orders", soon())
            assert len(identities(observation)) == 2
            epoch = owner.registrations()["web"].epoch
            fake.change_password("svc", "rotated")
            await until(lambda: refusal(observation) == "revoked", limit=120)
            assert trio.current_time() >= 60  # the issued token ran out first
            await owner.identity_revoked("primary", after_epoch=epoch - 1)
            status = owner.registrations()["web"]
            assert status.epoch > epoch
            assert status.state is not RegistrationState.ACTIVE
            assert "rotated" not in repr(status) and "pw" not in (status.last_error or "")


@pytest.mark.parametrize("options", [{"v3": False}, {"v1": False}])
async def test_v1_only_and_v3_only_servers_work_with_api_auto(
    autojump_clock: object, options: dict[str, bool]
) -> None:
    async with open_nacos_fake(**options) as fake:
        fake.register("order-worker", "10.0.0.1", 80, now=0, metadata=LONG_LIVED)
        cfg = config(fake.url, registration={})
        providers = providers_for(cfg, {"primary": fake})
        async with open_owner(cfg, fake, providers) as owner:
            provider = providers["primary"]
            assert isinstance(provider, NacosProvider)
            assert provider.api == ("v1" if "v3" in options else "v3")
            observation = await owner.client().observe("orders", soon())
            await until(lambda: len(identities(observation)) == 2)
            await trio.sleep(60)
            assert owner.registrations()["web"].state is RegistrationState.ACTIVE
            assert len(identities(observation)) == 2
        assert fake.find("order-worker", "10.0.0.7", 18080) is None


async def test_a_beat_answered_missing_re_registers_by_the_lifecycle(
    autojump_clock: object,
) -> None:
    async with open_nacos_fake() as fake:
        cfg = config(fake.url, registration={})
        async with open_owner(cfg, fake) as owner:
            registers = fake.count("/v3/client/ns/instance", "POST")
            # the server lost the instance (a restart, an operator's delete)
            assert fake.deregister("order-worker", "10.0.0.7", 18080)
            await until(lambda: fake.find("order-worker", "10.0.0.7", 18080) is not None)
            assert fake.count("/v3/client/ns/instance", "POST") > registers
            await until(lambda: owner.registrations()["web"].state is RegistrationState.ACTIVE)
            await trio.sleep(60)
            assert owner.registrations()["web"].state is RegistrationState.ACTIVE
            assert fake.find("order-worker", "10.0.0.7", 18080) is not None
