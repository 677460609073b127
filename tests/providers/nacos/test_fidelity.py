"""Real Nacos behaviour the old fake hid: each test here fails on the provider
before these fixes (key rotation, 3.x admin paths, misshapen bodies, beat
pacing, refused connections, cluster names)."""

from __future__ import annotations

import json
import socket
from typing import Any

import anyio
import httpx
import pytest
import trio
from nadisc_nacos import NacosProvider, NacosSettings
from pydantic import ValidationError

from nadisc import (
    HealthStatus,
    IncompleteSnapshot,
    OutcomeUnknown,
    RegistrationRejected,
    RegistrationState,
)
from tests.fakes.nacos import Fault, NacosFake, open_nacos_fake

from .conftest import context, in_process, record
from .owner_support import (
    LONG_LIVED,
    config,
    identities,
    open_owner,
    refusal,
    until,
)

pytestmark = pytest.mark.trio_only

ROTATED = b"the-operators-new-token-secret-key-0123456789"


def soon(seconds: float = 10) -> float:
    return anyio.current_time() + seconds


# -- 1. a rotated token key: "Invalid signature" is a re-login, never revocation -------------


async def test_a_rotated_token_key_re_logs_in_once_and_revokes_nothing(
    autojump_clock: object,
) -> None:
    async with open_nacos_fake(users={"svc": "pw"}) as fake:
        fake.register("order-worker", "10.0.0.1", 80, now=0, metadata=LONG_LIVED)
        cfg = config(fake.url, registration={}, username="svc", password="pw")
        async with open_owner(cfg, fake) as owner:
            observation = await owner.client().observe("orders", soon())
            await until(lambda: len(identities(observation)) == 2)
            assert fake.logins == 1
            fake.rotate_key(ROTATED)  # every issued token now fails: "Invalid signature"
            for _ in range(120):
                await trio.sleep(0.5)
                assert refusal(observation) is None
            assert fake.logins == 2  # one re-login for the whole connection
            stats = owner.observer().snapshot().connection("primary")
            assert stats.identity_revocations == 0
            assert owner.registrations()["web"].state is RegistrationState.ACTIVE
        # the registration could still deregister at close
        assert fake.find("order-worker", "10.0.0.7", 18080) is None


class Servers(httpx.AsyncBaseTransport):
    """Routes each request to the fake its host names (a cluster in one process)."""

    def __init__(self, fakes: dict[str, NacosFake]) -> None:
        self._routes = {host: fake.transport() for host, fake in fakes.items()}
        #: Hosts whose next connection is refused.
        self.refuse: set[str] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if host in self.refuse:
            self.refuse.discard(host)
            raise httpx.ConnectError("connection refused", request=request)
        return await self._routes[host].handle_async_request(request)


async def test_servers_with_different_keys_cost_one_re_login(autojump_clock: object) -> None:
    first = NacosFake(users={"svc": "pw"}, url="http://nacos-a:8848")
    second = NacosFake(users={"svc": "pw"}, url="http://nacos-b:8848", token_key=ROTATED)
    provider = NacosProvider(
        context(),
        NacosSettings.model_validate(
            {"server_addr": [first.url, second.url], "username": "svc", "password": "pw"}
        ),
        transport=(servers := Servers({"nacos-a": first, "nacos-b": second})),
    )
    await provider.prepare(soon())
    servers.refuse.add("nacos-a")  # the next server answers, with its own key
    snapshot = await provider.query("s", soon())
    assert snapshot.instances == ()
    assert (first.logins, second.logins) == (1, 1)
    await provider.query("s", soon())  # the new token is the second server's: no more logins
    assert (first.logins, second.logins) == (1, 1)
    await provider.aclose()


# -- 3. a misshapen success body is no listing: IncompleteSnapshot, nothing revoked ----------

SPRING_200 = {"timestamp": "2026-01-01T00:00:00.000+00:00", "status": 500, "error": "x"}


@pytest.mark.parametrize(
    ("api", "body"),
    [
        ("v1", {}),
        ("v1", {"hosts": None}),
        ("v1", SPRING_200),
        ("v3", {"code": 0, "message": "success", "data": None}),
        ("v3", {"code": 0, "message": "success", "data": {}}),
        ("v3", {"code": 0, "message": "success"}),
    ],
)
async def test_a_misshapen_listing_is_incomplete_not_empty(
    autojump_clock: object, api: str, body: dict[str, Any]
) -> None:
    fake = NacosFake(v3=api == "v3")
    fake.register("orders", "10.0.0.7", 8080, now=0, ephemeral=False)
    provider = in_process(fake, api=api, ephemeral=False)
    await provider.prepare(soon())
    registered = await provider.register(record(), soon())
    assert len((await provider.query("orders", soon())).instances) == 1
    raw = json.dumps(body).encode()
    fake.inject(
        f"/{api}/" if api == "v1" else "/v3/client/ns/instance/list", Fault("body", body=raw)
    )
    with pytest.raises(IncompleteSnapshot):
        await provider.query("orders", soon())
    # the registration check reads the same listing: never "disabled" or "missing"
    fake.inject(
        f"/{api}/" if api == "v1" else "/v3/client/ns/instance/list", Fault("body", body=raw)
    )
    with pytest.raises(IncompleteSnapshot):
        await provider.check(registered, soon())
    assert await provider.check(registered, soon()) is HealthStatus.HEALTHY
    await provider.aclose()


async def test_the_owner_keeps_serving_through_misshapen_answers(autojump_clock: object) -> None:
    fake = NacosFake()
    fake.register("order-worker", "10.0.0.1", 80, now=0, ephemeral=False)
    cfg = config(fake.url, api="v3")
    async with open_owner(cfg, fake) as owner:
        observation = await owner.client().observe("orders", soon())
        assert len(identities(observation)) == 1
        empty = b'{"code":0,"message":"success","data":null}'
        fake.inject("/v3/client/ns/instance/list", Fault("body", body=empty))
        refusals = set()
        for _ in range(30):  # a poll answered badly, then good ones
            await trio.sleep(0.5)
            refusals.add(refusal(observation))
            # never the complete empty listing that revokes every instance at once
            assert identities(observation) in (
                (),
                ("10.0.0.1#80#DEFAULT#DEFAULT_GROUP@@order-worker",),
            )
        # stale (no stale_if_error grace configured), never "empty"; served again after
        assert refusals <= {None, "stale"} and refusal(observation) is None
        assert fake.count("/v3/client/ns/instance/list") >= 3
        assert owner.observer().snapshot().connection("primary").identity_revocations == 0


# -- 2. api: v1 on Nacos 3.x defaults (the detail read is admin API, 410) --------------------


async def test_v1_on_3x_defaults_checks_without_the_admin_detail_read(
    autojump_clock: object,
) -> None:
    fake = NacosFake()  # 3.x defaults: v1 open API on, admin API off
    provider = in_process(fake, api="v1", ephemeral=False)
    await provider.prepare(soon())
    registered = await provider.register(record(), soon())
    assert registered.handle == "10.0.0.7#8080#DEFAULT#DEFAULT_GROUP@@orders"
    fake.register("orders", "10.0.0.8", 8080, now=0, ephemeral=False)
    fake.set_protect_threshold("orders", 0.6)
    fake.set_healthy("orders", "10.0.0.8", 8080, False)  # 1/2 <= 0.6: the protected answer
    assert await provider.check(registered, soon()) is HealthStatus.HEALTHY
    fake.set_enabled("orders", "10.0.0.7", 8080, False)  # an operator's disable
    assert await provider.check(registered, soon()) is HealthStatus.DISABLED
    assert provider.detail_served is False
    assert fake.count("/v1/ns/instance", "GET") == 1  # asked once, then not again
    await provider.deregister(registered, soon())
    await provider.aclose()


async def test_v1_on_3x_defaults_through_the_owner(autojump_clock: object) -> None:
    async with open_nacos_fake() as fake:
        cfg = config(fake.url, api="v1", registration={})
        async with open_owner(cfg, fake) as owner:
            observation = await owner.client().observe("orders", soon())
            await until(lambda: len(identities(observation)) == 1)
            await trio.sleep(120)
            status = owner.registrations()["web"]
            assert status.state is RegistrationState.ACTIVE and status.last_error is None
            fake.set_enabled("order-worker", "10.0.0.7", 18080, False)
            await until(lambda: owner.registrations()["web"].health.value == "disabled", limit=60)
        assert fake.find("order-worker", "10.0.0.7", 18080) is None


# -- 4. beats: the server's interval paces renewals; a refused connection is not unknown -----


async def test_heartbeat_rules_pace_renewals(
    autojump_clock: object, caplog: pytest.LogCaptureFixture
) -> None:
    async with open_nacos_fake(v3=False) as fake:
        rules = {"preserved.heart.beat.interval": "3000", "preserved.heart.beat.timeout": "9000"}
        provider = in_process(fake, api="v1", metadata=rules)
        assert provider.capabilities.renew_within == 3.0  # known before any registration
        await provider.prepare(soon())
        own = {"preserved.heart.beat.interval": "2000", "preserved.heart.beat.timeout": "6000"}
        registered = await provider.register(record(metadata=own), soon())
        assert provider.capabilities.renew_within == 2.0
        # an operator shortens it on the server: the beat answer says so and is adopted
        instance = fake.find("orders", "10.0.0.7", 8080)
        assert instance is not None
        instance.metadata["preserved.heart.beat.interval"] = "1000"
        await provider.renew(registered, soon())
        assert provider.server_beat_interval == 1.0
        assert provider.capabilities.renew_within == 1.0
        # a registration whose own timeout the current pace would overrun is named
        tight = {"preserved.heart.beat.interval": "500", "preserved.heart.beat.timeout": "900"}
        await provider.register(record(port=8081, metadata=tight), soon())
        assert "will mark it unhealthy between beats" in caplog.text
        await provider.aclose()
    backwards = {"preserved.heart.beat.interval": "20000"}  # above the 15 s default timeout
    with pytest.raises(ValidationError, match="must not exceed"):
        NacosSettings.model_validate({"metadata": backwards})
    provider = in_process(NacosFake(), api="v3")
    await provider.prepare(soon())
    with pytest.raises(RegistrationRejected, match="must not exceed"):
        await provider.register(record(metadata=backwards), soon())
    await provider.aclose()


def beats(fake: NacosFake) -> int:
    return sum(1 for r in fake.requests if r.path.endswith("/instance/beat"))


async def beats_during(fake: NacosFake, seconds: float) -> int:
    before = beats(fake)
    await trio.sleep(seconds)
    return beats(fake) - before


@pytest.mark.parametrize(
    ("monitor_ms", "server_ms", "expected"),
    [
        (5000, 1000, range(18, 22)),  # shorter than the 5 s pace: beats every second
        (30000, 10000, range(1, 4)),  # longer than the 5 s beat_interval: every 10 s
    ],
)
async def test_a_beat_interval_learned_mid_run_re_paces_the_running_registration(
    autojump_clock: object, monitor_ms: int, server_ms: int, expected: range
) -> None:
    async with open_nacos_fake(v3=False) as fake:
        cfg = config(
            fake.url,
            registration={},
            api="v1",
            policy={"monitor_interval_ms": monitor_ms, "observation_grace_ms": 60000},
        )
        async with open_owner(cfg, fake) as owner:
            await until(lambda: owner.registrations()["web"].state is RegistrationState.ACTIVE)
            assert await beats_during(fake, 20) in range(3, 6)  # the 5 s default pace
            instance = fake.find("order-worker", "10.0.0.7", 18080)
            assert instance is not None
            # An operator changes the instance's rule on the server: the next
            # beat answer's clientBeatInterval says so.
            instance.metadata["preserved.heart.beat.interval"] = str(server_ms)
            await trio.sleep(6)  # one beat at the old pace carries the news
            assert await beats_during(fake, 20) in expected
            assert owner.registrations()["web"].state is RegistrationState.ACTIVE


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def test_a_refused_connection_is_not_an_unknown_outcome() -> None:
    fake = NacosFake()
    provider = in_process(fake, api="v1")
    await provider.prepare(soon())
    registered = await provider.register(record(), soon())
    await provider.aclose()
    # The same registration against a server that refuses connections.
    refusing = NacosProvider(
        context(),
        NacosSettings.model_validate(
            {"server_addr": f"http://127.0.0.1:{closed_port()}/nacos", "api": "v1"}
        ),
    )
    for attempt in (
        lambda: refusing.renew(registered, soon()),
        lambda: refusing.register(record(), soon()),
        lambda: refusing.deregister(registered, soon()),
    ):
        with pytest.raises(IncompleteSnapshot) as caught:
            await attempt()
        assert not isinstance(caught.value, OutcomeUnknown)
        assert "not sent" in str(caught.value)
    await refusing.aclose()


@pytest.mark.parametrize("cluster", ["eu_west", "eu.west", "DEFAULT 2", "c#1"])
def test_cluster_names_nacos_refuses_fail_validation(cluster: str) -> None:
    with pytest.raises(ValidationError) as caught:
        NacosSettings.model_validate({"cluster": cluster})
    assert caught.value.errors()[0]["loc"] == ("cluster",)
    assert "0-9a-zA-Z-" in str(caught.value)
    assert NacosSettings.model_validate({"cluster": "eu-west-1"}).cluster == "eu-west-1"


@pytest.mark.parametrize("api", ["v1", "v3"])
async def test_a_deep_listing_in_a_registration_check_is_incomplete(
    autojump_clock: object, api: str
) -> None:
    fake = NacosFake(v3=api == "v3")
    provider = in_process(fake, api=api, ephemeral=False)
    await provider.prepare(soon())
    registered = await provider.register(record(), soon())
    nest = b"[" * 200_000 + b"]" * 200_000
    body = b'{"hosts":' + nest + b"}" if api == "v1" else b'{"code":0,"data":' + nest + b"}"
    path = "/v1/ns/instance/list" if api == "v1" else "/v3/client/ns/instance/list"
    fake.inject(path, Fault("body", body=body))
    with pytest.raises(IncompleteSnapshot, match="nested too deeply"):
        await provider.check(registered, soon())
    await provider.aclose()
