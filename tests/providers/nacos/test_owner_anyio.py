"""The core Nacos flows through the owner on either event loop (trio by
default; the asyncio pass runs this module too): real time, short intervals,
in-process fakes."""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from nadisc_nacos import NacosProvider

from nadisc import EvidenceKind, RegistrationState, open_discovery
from tests.fakes.nacos import NacosFake, open_nacos_fake

from .owner_support import config, identities, open_owner, providers_for, refusal, until

FAST = {
    "poll_interval_ms": 200,
    "request_timeout_ms": 1000,
    "monitor_interval_ms": 200,
    "observation_grace_ms": 3000,
}
ID = "10.0.0.7#18080#DEFAULT#DEFAULT_GROUP@@order-worker"


def soon(seconds: float = 5) -> float:
    return anyio.current_time() + seconds


@pytest.mark.parametrize("api", ["v1", "v3"])
async def test_registration_is_seen_by_another_owner_and_removed_on_close(api: str) -> None:
    async with open_nacos_fake() as fake:
        reader_cfg = config(fake.url, policy=FAST, api=api)
        async with open_owner(reader_cfg, fake) as reader:
            observation = await reader.client().observe("orders", soon())
            writer_cfg = config(fake.url, policy=FAST, registration={}, api=api)
            async with open_owner(writer_cfg, fake) as writer:
                start = anyio.current_time()
                with anyio.fail_after(5):
                    while identities(observation) != (ID,):
                        await observation.changed(soon())
                # Measured 0.20 s (one 200 ms poll); the bound is 12x that.
                assert anyio.current_time() - start < 2.5
                await anyio.sleep(0.6)  # a few beats
                assert writer.registrations()["web"].state is RegistrationState.ACTIVE
                assert (
                    fake.count("/v1/ns/instance/beat")
                    + fake.count("/v3/client/ns/instance", "POST")
                    >= 3
                )
            await until(lambda: refusal(observation) == "empty", limit=5)


async def test_unhealthy_withdrawn_and_protect_threshold_marked() -> None:
    fake = NacosFake()
    for n in (1, 2):
        fake.register("order-worker", f"10.0.0.{n}", 80, now=0, ephemeral=False)
    cfg = config(fake.url, policy=FAST, api="v1")
    async with open_owner(cfg, fake) as owner:
        observation = await owner.client().observe("orders", soon())
        fake.set_healthy("order-worker", "10.0.0.2", 80, False)
        await until(lambda: len(identities(observation)) == 1, limit=5)
        fake.set_protect_threshold("order-worker", 0.5)
        await until(lambda: len(identities(observation)) == 2, limit=5)
        assert observation.snapshot().evidence is EvidenceKind.WEAK_HEALTH
        assert refusal(observation, strict=True) == "weak"


async def test_token_expiry_relogs_in_once_without_a_gap() -> None:
    fake = NacosFake(users={"svc": "pw"}, token_ttl=1)
    fake.register("order-worker", "10.0.0.1", 80, now=0, ephemeral=False)
    cfg = config(fake.url, policy=FAST, username="svc", password="pw", token_refresh_margin=0)
    async with open_owner(cfg, fake) as owner:
        start = anyio.current_time()
        observation = await owner.client().observe("orders", soon())
        gaps = 0
        for _ in range(15):
            await anyio.sleep(0.1)
            gaps += refusal(observation, strict=True) is not None
        elapsed = anyio.current_time() - start
        # one login per expired 1 s token, never a burst; no refused read in between
        assert 2 <= fake.logins <= 2 + int(elapsed)
        assert gaps == 0


@pytest.mark.parametrize("options", [{"v3": False}, {"v1": False}])
async def test_api_auto_on_single_generation_servers(options: dict[str, Any]) -> None:
    fake = NacosFake(**options)
    fake.register("order-worker", "10.0.0.1", 80, now=0, ephemeral=False)
    cfg = config(fake.url, policy=FAST)
    providers = providers_for(cfg, {"primary": fake})
    async with open_discovery(cfg, providers=providers) as owner:
        provider = providers["primary"]
        assert isinstance(provider, NacosProvider)
        assert provider.api == ("v1" if "v3" in options else "v3")
        observation = await owner.client().observe("orders", soon())
        assert identities(observation) == ("10.0.0.1#80#DEFAULT#DEFAULT_GROUP@@order-worker",)
