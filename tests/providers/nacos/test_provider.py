"""The Nacos provider against the fake: API probing, listings, auth, registration."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
import trio
from nadisc_nacos import NacosProvider, NacosSettings

from nadisc import (
    EvidenceKind,
    HealthStatus,
    IdentityRevoked,
    IncompleteSnapshot,
    LeaseLost,
    OutcomeUnknown,
    RegistrationRejected,
)
from tests.fakes.nacos import Fault, NacosFake, open_nacos_fake, run_nacos_fake

from .conftest import context, in_process, record

pytestmark = pytest.mark.trio_only


def soon(seconds: float = 10) -> float:
    return anyio.current_time() + seconds


@pytest.mark.parametrize(
    ("options", "api"),
    [
        ({}, "v3"),
        ({"v3": False}, "v1"),
        ({"v1": False}, "v3"),
        ({"v3": False, "users": {"u": "p"}}, "v1"),
    ],
)
async def test_auto_probes_the_api_once_at_prepare(
    autojump_clock: object, options: dict[str, object], api: str
) -> None:
    fake = NacosFake(**options)  # type: ignore[arg-type]
    creds: dict[str, Any] = {"username": "u", "password": "p"} if "users" in options else {}
    provider = in_process(fake, **creds)
    await provider.prepare(soon())
    assert provider.api == api
    fake.register("orders", "10.0.0.1", 80, now=trio.current_time())
    snapshot = await provider.query("orders", soon())
    assert snapshot.identities() == ("10.0.0.1#80#DEFAULT#DEFAULT_GROUP@@orders",)
    await provider.aclose()
    await provider.aclose()


async def test_a_server_with_neither_api_is_reported_clearly(autojump_clock: object) -> None:
    fake = NacosFake(context_path="/other")  # server_addr points at /nacos: 404 everywhere
    provider = in_process(fake)
    provider._http._bases = ("http://nacos.fake:8848/nacos",)  # what a wrong context path sends
    with pytest.raises(IncompleteSnapshot, match="offers neither the Nacos v3 client API"):
        await provider.prepare(soon())
    await provider.aclose()


async def test_listing_follows_groups_namespaces_and_health(autojump_clock: object) -> None:
    fake = NacosFake()
    now = trio.current_time()
    fake.register("ow", "10.0.0.1", 80, now=now, group="BUSINESS", ephemeral=False, weight=3)
    fake.register("ow", "10.0.0.2", 80, now=now, group="BUSINESS", ephemeral=False)
    fake.register("ow", "10.0.0.3", 80, now=now, group="OTHER", ephemeral=False)
    for api in ("v1", "v3"):
        provider = in_process(fake, api=api, group="BUSINESS", services={"orders": {"name": "ow"}})
        await provider.prepare(soon())
        snapshot = await provider.query("ow", soon())
        assert [(i.host, i.weight) for i in snapshot.instances] == [
            ("10.0.0.1", 3.0),
            ("10.0.0.2", 1.0),
        ]
        fake.set_healthy("ow", "10.0.0.2", 80, False, group="BUSINESS")
        assert (await provider.query("ow", soon())).identities() == (
            "10.0.0.1#80#DEFAULT#BUSINESS@@ow",
        )
        fake.set_healthy("ow", "10.0.0.2", 80, True, group="BUSINESS")
        same = await provider.query("ow", soon())
        assert await provider.query("ow", soon()) is same  # unchanged content: not decoded again
        empty = await provider.query("unknown", soon())
        assert empty.instances == () and empty.evidence is EvidenceKind.REGISTRY_HEALTH
        await provider.aclose()


async def test_protect_threshold_is_marked_on_v1(autojump_clock: object) -> None:
    fake = NacosFake()
    now = trio.current_time()
    for n in (1, 2):
        fake.register("s", f"10.0.0.{n}", 80, now=now, ephemeral=False)
    fake.set_protect_threshold("s", 0.5)
    fake.set_healthy("s", "10.0.0.2", 80, False)
    provider = in_process(fake, api="v1")
    await provider.prepare(soon())
    snapshot = await provider.query("s", soon())
    assert snapshot.evidence is EvidenceKind.WEAK_HEALTH and len(snapshot.instances) == 2
    await provider.aclose()


async def test_server_errors_and_bad_bodies_are_incomplete(autojump_clock: object) -> None:
    fake = NacosFake()
    provider = in_process(fake, api="v1")
    await provider.prepare(soon())
    fake.inject("/v1/ns/instance/list", Fault("status", 503, b"busy"))
    with pytest.raises(IncompleteSnapshot, match="HTTP 503"):
        await provider.query("s", soon())
    fake.inject("/v1/ns/instance/list", Fault("body", body=b'{"hosts": 5}'))
    with pytest.raises(IncompleteSnapshot):
        await provider.query("s", soon())
    fake.inject("/v1/ns/instance/list", Fault("hang"))
    with pytest.raises(IncompleteSnapshot, match="no complete answer"):
        await provider.query("s", soon(60))
    assert (await provider.query("s", soon())).instances == ()
    await provider.aclose()


async def test_truncated_body_and_failover_over_loopback() -> None:
    async with run_nacos_fake() as fake:
        dead = "http://127.0.0.1:9/nacos"  # discard port: connection refused
        settings = NacosSettings.model_validate({"server_addr": [dead, fake.url], "api": "v1"})
        provider = NacosProvider(context(), settings)
        await provider.prepare(soon())  # the dead first server is skipped
        assert provider.http.server.endswith(str(httpx.URL(fake.url).port))
        fake.inject("/v1/ns/instance/list", Fault("truncate"))
        with pytest.raises(IncompleteSnapshot):
            await provider.query("s", soon())
        assert (await provider.query("s", soon())).instances == ()
        await provider.aclose()


async def test_login_refresh_single_flight_and_one_relogin(autojump_clock: object) -> None:
    fake = NacosFake(users={"nacos": "pw"}, token_ttl=100)
    provider = in_process(fake, api="v1", username="nacos", password="pw")
    await provider.prepare(soon())
    assert fake.logins == 1
    await trio.sleep(49)
    await provider.query("s", soon())
    assert fake.logins == 1  # refreshed 50 s before a 100 s TTL ends (half the TTL at most)
    await trio.sleep(2)
    async with anyio.create_task_group() as group:
        for _ in range(20):
            group.start_soon(provider.query, "s", soon())
    assert fake.logins == 2  # twenty callers, one login
    # the server's token key rotates: "Invalid signature", one re-login, no failure
    fake.rotate_key(b"another-key-of-at-least-thirty-two-bytes")
    await provider.query("s", soon())
    assert fake.logins == 3
    # a permission denial is revocation, not a re-login
    fake.denied.add("nacos")
    with pytest.raises(IdentityRevoked, match="authorization failed"):
        await provider.query("s", soon())
    assert fake.logins == 3
    await provider.aclose()


async def test_password_change_revokes_at_the_next_login(autojump_clock: object) -> None:
    fake = NacosFake(users={"nacos": "pw"}, token_ttl=100)
    provider = in_process(fake, api="v3", username="nacos", password="pw")
    await provider.prepare(soon())
    fake.change_password("nacos", "changed")
    await provider.query("s", soon())  # the issued token still works
    await trio.sleep(100)
    with pytest.raises(IdentityRevoked) as revoked:
        await provider.query("s", soon())
    assert "refused" in str(revoked.value) and "changed" not in str(revoked.value)
    assert "pw" not in str(revoked.value)
    await provider.aclose()


@pytest.mark.parametrize(
    ("api", "server"),
    [("v1", {"v3": False}), ("v1", {}), ("v3", {})],
    ids=["v1-on-2.x", "v1-on-3.x-defaults", "v3"],
)
async def test_ephemeral_registration_beats_and_loss(
    autojump_clock: object, api: str, server: dict[str, bool]
) -> None:
    async with open_nacos_fake(**server) as fake:
        provider = in_process(fake, api=api, group="BUSINESS", metadata={"team": "a"})
        await provider.prepare(soon())
        assert provider.capabilities.renew_within == 5.0
        assert provider.capabilities.idempotent_renewal
        registered = await provider.register(record(metadata={"v": "1"}, weight=2), soon())
        assert registered.handle == "10.0.0.7#8080#DEFAULT#BUSINESS@@orders"
        instance = fake.find("orders", "10.0.0.7", 8080, group="BUSINESS")
        assert instance is not None and instance.ephemeral and instance.weight == 2
        assert instance.metadata == {"team": "a", "v": "1"}
        for _ in range(60):  # five minutes of beats
            await trio.sleep(5)
            await provider.renew(registered, soon())
        assert await provider.check(registered, soon()) is HealthStatus.HEALTHY
        if api == "v1":
            assert provider.server_beat_interval == 5.0
        await trio.sleep(20)
        assert await provider.check(registered, soon()) is HealthStatus.UNHEALTHY
        await trio.sleep(15)
        # deleted after 30 s silent; v3 has no detail read to tell missing from
        # disabled, nor has v1 on 3.x defaults (the detail read is admin API: 410)
        expected = HealthStatus.MISSING if fake.v1_admin else HealthStatus.DISABLED
        assert provider.detail_served is (fake.v1_admin if api == "v1" else None)
        assert await provider.check(registered, soon()) is expected
        with pytest.raises(LeaseLost):
            await provider.renew(registered, soon())
        again = await provider.register(registered.record, soon())
        await provider.deregister(again, soon())
        assert fake.find("orders", "10.0.0.7", 8080, group="BUSINESS") is None
        await provider.aclose()


@pytest.mark.parametrize("server", [{"v3": False}, {}], ids=["2.x", "3.x-defaults"])
async def test_persistent_registration_and_operator_disable(
    autojump_clock: object, server: dict[str, bool]
) -> None:
    async with open_nacos_fake(**server) as fake:
        provider = in_process(fake, api="v1", ephemeral=False)
        await provider.prepare(soon())
        registered = await provider.register(record(), soon())
        before = len(fake.requests)
        await trio.sleep(120)
        await provider.renew(registered, soon())
        assert len(fake.requests) == before  # no beat for persistent instances
        assert await provider.check(registered, soon()) is HealthStatus.HEALTHY
        fake.set_enabled("orders", "10.0.0.7", 8080, False)
        assert await provider.check(registered, soon()) is HealthStatus.DISABLED
        await provider.deregister(registered, soon())
        # Without the detail read (3.x defaults) not listed reads as disabled:
        # never a re-registration over an operator's disable.
        gone = HealthStatus.MISSING if fake.v1_admin else HealthStatus.DISABLED
        assert await provider.check(registered, soon()) is gone
        await provider.aclose()


async def test_lost_write_answer_is_outcome_unknown(autojump_clock: object) -> None:
    fake = NacosFake()
    provider = in_process(fake, api="v1")
    await provider.prepare(soon())
    fake.inject("/v1/ns/instance", Fault("hang"))
    with pytest.raises(OutcomeUnknown):
        await provider.register(record(), soon(5))
    fake.inject("/v1/ns/instance", Fault("status", 400, b"bad"))
    with pytest.raises(RegistrationRejected):
        await provider.register(record(), soon())
    with pytest.raises(RegistrationRejected, match="weights"):
        await provider.register(record(weight=20000), soon())
    await provider.aclose()


async def test_a_hanging_login_bounds_every_waiting_caller(autojump_clock: object) -> None:
    fake = NacosFake(users={"nacos": "pw"}, v3=False)
    provider = in_process(fake, api="v1", username="nacos", password="pw")
    fake.inject("/v1/auth/login", Fault("hang"))  # one login is in flight at a time
    failures: list[BaseException] = []

    async def caller() -> None:
        try:
            await provider.query("s", soon(3))
        except IncompleteSnapshot as exc:
            failures.append(exc)

    started = trio.current_time()
    async with anyio.create_task_group() as group:
        for _ in range(3):
            group.start_soon(caller)
    assert len(failures) == 3 and trio.current_time() - started <= 3.01
    await provider.prepare(soon())  # the server answers again: one login
    assert fake.logins == 1
    await provider.aclose()
