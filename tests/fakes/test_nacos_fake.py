"""Pins the Nacos fake to Nacos's documented answers and its server source.

Written from the open-API documentation's examples (the v1 instance list
example for ``DEFAULT_GROUP@@nacos.test.1``, the login example
``{"accessToken":...,"tokenTtl":18000,"globalAdmin":...}``, the beat answer
``{"clientBeatInterval":5000,"code":10200,"lightBeatEnabled":true}``, the
v2/v3 envelope ``{"code":0,"message":"success","data":...}`` with error code
21003 "instance not found") and, where the docs are silent, the server source
(protect threshold, enabled filtering, the 15 s / 30 s heartbeat timers,
auth-filter 403 texts). Independent of the provider, so the two cannot share
a misunderstanding. Time rules run in-process under trio's MockClock.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
import trio

from tests.fakes.nacos import Fault, NacosFake, open_nacos_fake, run_nacos_fake

pytestmark = pytest.mark.trio_only

SERVICE = "nacos.test.1"


def client(fake: NacosFake) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=fake.transport(), base_url=fake.url)


async def register(http: httpx.AsyncClient, **extra: str) -> httpx.Response:
    params = {"serviceName": SERVICE, "ip": "10.10.10.10", "port": "8888", **extra}
    return await http.post("/v1/ns/instance", params=params)


async def test_v1_register_and_list_have_the_documented_shapes(autojump_clock: object) -> None:
    fake = NacosFake()
    async with client(fake) as http:
        response = await register(http, ephemeral="false", metadata='{"site":"et2"}')
        assert response.status_code == 200 and response.text == "ok"
        listing = (await http.get("/v1/ns/instance/list", params={"serviceName": SERVICE})).json()
    # every field of the documented example answer
    assert set(listing) >= {
        "name",
        "groupName",
        "clusters",
        "cacheMillis",
        "hosts",
        "lastRefTime",
        "checksum",
        "allIPs",
        "reachProtectionThreshold",
        "valid",
    }
    assert listing["name"] == "DEFAULT_GROUP@@nacos.test.1"
    assert listing["cacheMillis"] == 10000 and listing["reachProtectionThreshold"] is False
    (host,) = listing["hosts"]
    assert host["instanceId"] == "10.10.10.10#8888#DEFAULT#DEFAULT_GROUP@@nacos.test.1"
    assert host["serviceName"] == "DEFAULT_GROUP@@nacos.test.1"
    assert (host["ip"], host["port"], host["clusterName"]) == ("10.10.10.10", 8888, "DEFAULT")
    assert host["ephemeral"] is False and host["metadata"] == {"site": "et2"}
    assert host["instanceHeartBeatInterval"] == 5000
    assert host["instanceIdGenerator"] == "simple"


async def test_unknown_service_lists_no_hosts(autojump_clock: object) -> None:
    async with client(NacosFake()) as http:
        listing = (await http.get("/v1/ns/instance/list", params={"serviceName": "nope"})).json()
    assert listing["hosts"] == []


async def test_namespaces_groups_and_clusters_are_separate(autojump_clock: object) -> None:
    fake = NacosFake()
    fake.register("svc", "10.0.0.1", 80, now=0, namespace="dev", group="A", cluster="c1")
    fake.register("svc", "10.0.0.2", 80, now=0, namespace="dev", group="A", cluster="c2")
    fake.register("svc", "10.0.0.3", 80, now=0, namespace="public", group="A")
    async with client(fake) as http:

        def ips(listing: dict[str, Any]) -> set[str]:
            return {h["ip"] for h in listing["hosts"]}

        base = {"serviceName": "A@@svc", "namespaceId": "dev"}
        everything = (await http.get("/v1/ns/instance/list", params=base)).json()
        assert ips(everything) == {"10.0.0.1", "10.0.0.2"}
        c1 = (await http.get("/v1/ns/instance/list", params={**base, "clusters": "c1"})).json()
        assert ips(c1) == {"10.0.0.1"}
        grouped = {"serviceName": "svc", "groupName": "A"}
        assert ips((await http.get("/v1/ns/instance/list", params=grouped)).json()) == {"10.0.0.3"}
        other = {"serviceName": "svc", "groupName": "B"}
        assert (await http.get("/v1/ns/instance/list", params=other)).json()["hosts"] == []


async def test_beats_and_the_15s_30s_timers(autojump_clock: object) -> None:
    async with open_nacos_fake() as fake, client(fake) as http:
        await register(http)
        beat = {"serviceName": SERVICE, "ip": "10.10.10.10", "port": "8888"}
        answer = (await http.put("/v1/ns/instance/beat", params=beat)).json()
        assert answer == {"clientBeatInterval": 5000, "code": 10200, "lightBeatEnabled": True}
        await trio.sleep(16)  # no beat for > 15 s: unhealthy
        instance = fake.find(SERVICE, "10.10.10.10", 8888)
        assert instance is not None and not instance.healthy
        await trio.sleep(0.5)
        answer = (await http.put("/v1/ns/instance/beat", params=beat)).json()
        assert answer["code"] == 10200
        assert fake.find(SERVICE, "10.10.10.10", 8888).healthy  # type: ignore[union-attr]
        await trio.sleep(31)  # no beat for > 30 s: deleted
        assert fake.find(SERVICE, "10.10.10.10", 8888) is None
        answer = (await http.put("/v1/ns/instance/beat", params=beat)).json()
        assert answer["code"] == 20404  # light beat of a missing instance
        full = {**beat, "beat": '{"ip":"10.10.10.10","port":8888,"serviceName":"x"}'}
        answer = (await http.put("/v1/ns/instance/beat", params=full)).json()
        assert answer["code"] == 10200  # a full beat re-registers
        assert fake.find(SERVICE, "10.10.10.10", 8888) is not None


async def test_persistent_instances_never_expire(autojump_clock: object) -> None:
    async with open_nacos_fake() as fake, client(fake) as http:
        await register(http, ephemeral="false")
        await trio.sleep(120)
        listing = (await http.get("/v1/ns/instance/list", params={"serviceName": SERVICE})).json()
        assert listing["hosts"][0]["healthy"] is True
        params = {"serviceName": SERVICE, "ip": "10.10.10.10", "port": "8888"}
        beat = (await http.put("/v1/ns/instance/beat", params=params)).json()
        assert beat["code"] == 20404  # persistent instances take no beats
        assert (await http.delete("/v1/ns/instance", params=params)).text == "ok"
        assert fake.find(SERVICE, "10.10.10.10", 8888) is None


async def test_disabled_left_out_and_protect_threshold(autojump_clock: object) -> None:
    fake = NacosFake()
    for n in range(1, 5):
        fake.register(SERVICE, f"10.0.0.{n}", 80, now=0, ephemeral=False)
    fake.set_enabled(SERVICE, "10.0.0.4", 80, False)
    fake.set_healthy(SERVICE, "10.0.0.3", 80, False)
    async with client(fake) as http:
        params = {"serviceName": SERVICE}
        listing = (await http.get("/v1/ns/instance/list", params=params)).json()
        assert {h["ip"] for h in listing["hosts"]} == {"10.0.0.1", "10.0.0.2", "10.0.0.3"}
        assert listing["reachProtectionThreshold"] is False  # no service metadata: no protection
        fake.set_protect_threshold(SERVICE, 0.7)  # 2 healthy / 3 listed = 0.67 <= 0.7
        listing = (await http.get("/v1/ns/instance/list", params=params)).json()
        assert listing["reachProtectionThreshold"] is True
        assert all(h["healthy"] for h in listing["hosts"]) and len(listing["hosts"]) == 3
        assert not fake.find(SERVICE, "10.0.0.3", 80).healthy  # type: ignore[union-attr]
        v3 = (await http.get("/v3/client/ns/instance/list", params=params)).json()
        assert v3["code"] == 0 and isinstance(v3["data"], list)  # the bare list: no flag
        assert all(h["healthy"] for h in v3["data"]) and len(v3["data"]) == 3
        fake.set_protect_threshold(SERVICE, 0.5)
        listing = (await http.get("/v1/ns/instance/list", params=params)).json()
        assert listing["reachProtectionThreshold"] is False
        assert [h["healthy"] for h in listing["hosts"]].count(False) == 1


async def test_v3_client_api_envelopes(autojump_clock: object) -> None:
    fake = NacosFake()
    async with client(fake) as http:
        params = {"serviceName": "svc", "groupName": "G", "ip": "10.0.0.1", "port": "80"}
        answer = (await http.post("/v3/client/ns/instance", params=params)).json()
        assert answer == {"code": 0, "message": "success", "data": "ok"}
        beat = (
            await http.post("/v3/client/ns/instance", params={**params, "heartBeat": "true"})
        ).json()
        assert beat["code"] == 0
        listing = (
            await http.get(
                "/v3/client/ns/instance/list", params={"serviceName": "svc", "groupName": "G"}
            )
        ).json()
        assert listing["data"][0]["instanceId"] == "10.0.0.1#80#DEFAULT#G@@svc"
        await http.delete("/v3/client/ns/instance", params=params)
        beat = (
            await http.post("/v3/client/ns/instance", params={**params, "heartBeat": "true"})
        ).json()
        assert beat == {"code": 21003, "message": "instance not found", "data": None}


async def test_api_generations_can_be_off(autojump_clock: object) -> None:
    async with client(NacosFake(v1=False)) as http:
        gone = await http.get("/v1/ns/instance/list", params={"serviceName": "s"})
        assert gone.status_code == 410 and gone.json()["error"] == "Gone"
    async with client(NacosFake(v3=False)) as http:
        missing = await http.get("/v3/client/ns/instance/list", params={"serviceName": "s"})
        assert missing.status_code == 404


async def test_login_tokens_and_the_filters_403_texts(autojump_clock: object) -> None:
    fake = NacosFake(users={"nacos": "secret"}, token_ttl=100)
    async with client(fake) as http:
        refused = await http.post("/v1/auth/login", data={"username": "nacos", "password": "x"})
        assert refused.status_code == 403
        login = (
            await http.post("/v1/auth/login", data={"username": "nacos", "password": "secret"})
        ).json()
        assert set(login) == {"accessToken", "tokenTtl", "globalAdmin", "username"}
        assert login["tokenTtl"] == 100
        token = login["accessToken"]
        params = {"serviceName": "s"}
        none = await http.get("/v1/ns/instance/list", params=params)
        assert none.status_code == 403 and none.json()["message"] == "user not found!"
        ok = await http.get("/v1/ns/instance/list", params={**params, "accessToken": token})
        assert ok.status_code == 200
        bearer = await http.get(
            "/v1/ns/instance/list", params=params, headers={"Authorization": f"Bearer {token}"}
        )
        assert bearer.status_code == 200
        bad = await http.get("/v1/ns/instance/list", params={**params, "accessToken": "forged"})
        assert bad.json()["message"] == "token invalid!"
        fake.change_password("nacos", "new")  # issued tokens stay valid until they expire
        assert (
            await http.get("/v1/ns/instance/list", params={**params, "accessToken": token})
        ).status_code == 200
        await trio.sleep(100)
        expired = await http.get("/v1/ns/instance/list", params={**params, "accessToken": token})
        assert expired.status_code == 403 and expired.json()["message"] == "token expired!"
        v3 = await http.post("/v3/auth/user/login", data={"username": "nacos", "password": "x"})
        assert v3.status_code == 403 and v3.json()["code"] == 10001


async def test_faults_over_loopback() -> None:
    async with run_nacos_fake() as fake, httpx.AsyncClient(base_url=fake.url) as http:
        fake.inject("/v1/ns/instance/list", Fault("truncate"))
        with pytest.raises(httpx.RemoteProtocolError):
            await http.get("/v1/ns/instance/list", params={"serviceName": "s"})
        fake.inject("/v1/ns/instance/list", Fault("status", 503, b"busy"))
        assert (
            await http.get("/v1/ns/instance/list", params={"serviceName": "s"})
        ).status_code == 503
        ok = await http.get("/v1/ns/instance/list", params={"serviceName": "s"})
        assert ok.status_code == 200 and ok.json()["hosts"] == []
