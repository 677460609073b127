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

import base64
import json
from typing import Any

import httpx
import pytest
import trio

from tests.fakes.nacos import (
    DEFAULT_EPOCH,
    LOGIN_FAILED,
    FakeError,
    Fault,
    NacosFake,
    open_nacos_fake,
    run_nacos_fake,
    to_boolean,
)

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
        # no token and no credentials: AbstractAuthenticationManager's USER_NOT_FOUND_MESSAGE
        assert none.status_code == 403 and none.json()["message"] == LOGIN_FAILED
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
        await trio.sleep(101)  # NacosSignatureAlgorithm.verify: valid while exp >= now (s)
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


# -- fidelity points each pinned to the alibaba/nacos source ---------------------------------


@pytest.mark.parametrize(
    ("text", "value"),
    [
        *[("true", True), ("TRUE", True), ("Yes", True), ("on", True), ("t", True)],
        *[("false", False), ("no", False), ("nope", False), ("1", False), ("true ", False)],
    ],
)
def test_booleans_read_as_convert_utils_reads_them(text: str, value: bool) -> None:
    """``common/.../utils/ConvertUtils.java``: ``toBoolean`` is true only for
    ``TRUE_SET`` (y, yes, on, true, t; case-insensitive), unknown words false."""
    assert to_boolean(text, default=True) is value
    assert to_boolean("", default=True) is True and to_boolean(None, default=False) is False


async def test_registration_booleans_unknown_words_are_false(autojump_clock: object) -> None:
    # ``HttpRequestInstanceBuilder.setAttributesToBuilder`` reads healthy,
    # ephemeral and enabled with ConvertUtils.toBoolean.
    fake = NacosFake()
    async with client(fake) as http:
        await register(http, healthy="TRUE", enabled="nope", ephemeral="Off")
    instance = fake.find(SERVICE, "10.10.10.10", 8888)
    assert instance is not None
    assert (instance.healthy, instance.enabled, instance.ephemeral) == (True, False, False)


async def test_one_instance_per_address_per_service(autojump_clock: object) -> None:
    """``naming/.../core/v2/client/impl/IpPortBasedClient.java``: one client per
    ``ip:port`` publishes one instance per service, so the same address in
    another cluster replaces the first."""
    fake = NacosFake()
    async with client(fake) as http:
        await register(http, clusterName="c1")
        await register(http, clusterName="c2")
        listing = (await http.get("/v1/ns/instance/list", params={"serviceName": SERVICE})).json()
        assert [h["clusterName"] for h in listing["hosts"]] == ["c2"]
        await http.delete(
            "/v1/ns/instance",
            params={"serviceName": SERVICE, "ip": "10.10.10.10", "port": "8888"},
        )
        assert fake.find(SERVICE, "10.10.10.10", 8888) is None  # whatever its cluster


async def test_a_service_holds_one_kind_of_instance(autojump_clock: object) -> None:
    """``EphemeralClientOperationServiceImpl.registerInstance`` (and the
    persistent twin): 400 "Current service ... is persistent service, can't
    register ephemeral instance."; v1 answers the text
    (``ResponseExceptionHandler``), v3 a Result envelope
    (``NacosApiExceptionHandler``)."""
    fake = NacosFake()
    async with client(fake) as http:
        await register(http, ephemeral="false")
        mixed = await http.post(
            "/v1/ns/instance", params={"serviceName": SERVICE, "ip": "10.0.0.2", "port": "1"}
        )
        assert mixed.status_code == 400
        assert mixed.text == (
            "Current service DEFAULT_GROUP@@nacos.test.1 is persistent service, "
            "can't register ephemeral instance."
        )
        v3 = await http.post(
            "/v3/client/ns/instance", params={"serviceName": SERVICE, "ip": "10.0.0.2", "port": "1"}
        )
        assert v3.status_code == 400 and v3.json()["code"] == 30000
        assert "persistent service" in v3.json()["data"]
    with pytest.raises(FakeError):
        fake.register(SERVICE, "10.0.0.3", 1, now=0)  # the sync API keeps the rule too


async def test_cluster_names_are_checked(autojump_clock: object) -> None:
    """``api/.../naming/utils/NamingUtils.java`` ``checkInstanceIsLegal``:
    ``CLUSTER_NAME_PATTERN_STRING = "^[0-9a-zA-Z-]+$"``."""
    async with client(NacosFake()) as http:
        bad = await register(http, clusterName="eu_west.1")
        assert bad.status_code == 400 and "0-9a-zA-Z-" in bad.text
        assert (await register(http, clusterName="eu-west-1")).status_code == 200


async def test_v3_parameter_errors_are_enveloped(autojump_clock: object) -> None:
    # ``NacosApiExceptionHandler``: a v3 error is {code, message, data}, never bare text.
    async with client(NacosFake()) as http:
        missing = await http.get("/v3/client/ns/instance/list", params={})
        assert missing.status_code == 400
        body = missing.json()
        assert body["code"] == 10000 and "serviceName" in body["data"]


async def test_last_ref_time_is_epoch_milliseconds(autojump_clock: object) -> None:
    # ``ServiceInfo.lastRefTime`` is ``System.currentTimeMillis()``.
    async with client(NacosFake()) as http:
        await trio.sleep(7)
        listing = (await http.get("/v1/ns/instance/list", params={"serviceName": SERVICE})).json()
    assert listing["lastRefTime"] == int((DEFAULT_EPOCH + trio.current_time()) * 1000)


async def test_v1_admin_paths_are_gone_on_3x_defaults(autojump_clock: object) -> None:
    """``InstanceController``: detail ``GET``, ``PUT`` and ``PATCH`` carry
    ``@Compatibility(apiType = ADMIN_API)``; ``ApiCompatibilityConfig``
    defaults ``nacos.core.api.compatibility.admin.enabled`` to false, and
    ``ApiCompatibilityFilter`` answers 410 with a Result of code 40000. The
    open paths (list, register, deregister, beat) stay served."""
    fake = NacosFake()
    async with client(fake) as http:
        assert (await register(http)).status_code == 200
        where = {"serviceName": SERVICE, "ip": "10.10.10.10", "port": "8888"}
        for method in ("GET", "PUT", "PATCH"):
            gone = await http.request(method, "/v1/ns/instance", params=where)
            assert gone.status_code == 410, method
            result = json.loads(gone.json()["message"])
            assert result["code"] == 40000
            assert "nacos.core.api.compatibility.admin.enabled=true" in result["message"]
        beat = await http.put("/v1/ns/instance/beat", params=where)
        assert beat.status_code == 200
    assert NacosFake(v3=False).v1_admin and not NacosFake().v1_admin


async def test_v1_update_and_patch(autojump_clock: object) -> None:
    """``InstanceController.update`` (``PUT``: the request's weight, enabled and
    metadata replace the instance's) and ``patch`` (only what is given)."""
    fake = NacosFake(v3=False)
    async with client(fake) as http:
        await register(http, metadata='{"a":"1"}', weight="3")
        where = {"serviceName": SERVICE, "ip": "10.10.10.10", "port": "8888"}
        patched = await http.patch("/v1/ns/instance", params={**where, "weight": "5"})
        assert patched.status_code == 200 and patched.text == "ok"
        instance = fake.find(SERVICE, "10.10.10.10", 8888)
        assert instance is not None
        assert (instance.weight, instance.metadata, instance.enabled) == (5.0, {"a": "1"}, True)
        put = await http.put("/v1/ns/instance", params={**where, "enabled": "false"})
        assert put.status_code == 200
        assert (instance.weight, instance.metadata, instance.enabled) == (1.0, {}, False)
        nobody = await http.put("/v1/ns/instance", params={**where, "ip": "10.9.9.9"})
        assert nobody.status_code == 400


async def test_per_request_credentials_and_jwt_tokens(autojump_clock: object) -> None:
    """``AbstractAuthenticationManager.authenticate(request)``: without a token
    the request's username/password are checked. ``NacosSignatureAlgorithm
    .verify``: a token of another key is "Invalid signature", a token that is
    not three parts "token invalid!", an unknown header "unsupported signature
    algorithm". Tokens are stateless JWTs: another server (or a restarted one)
    with the same key accepts them."""
    fake = NacosFake(users={"nacos": "secret"})
    params = {"serviceName": "s"}
    async with client(fake) as http:
        own = await http.get(
            "/v1/ns/instance/list", params={**params, "username": "nacos", "password": "secret"}
        )
        assert own.status_code == 200
        wrong = await http.get(
            "/v1/ns/instance/list", params={**params, "username": "nacos", "password": "x"}
        )
        assert wrong.status_code == 403 and wrong.json()["message"] == LOGIN_FAILED
        token = (
            await http.post("/v1/auth/login", data={"username": "nacos", "password": "secret"})
        ).json()["accessToken"]
    _, payload, _ = token.split(".")
    assert (
        json.loads(base64.urlsafe_b64decode(payload + "==="))["exp"]
        == int(DEFAULT_EPOCH + trio.current_time()) + 18000
    )
    restarted = NacosFake(users={"nacos": "secret"})
    assert restarted.identity(token, trio.current_time()) is None
    other = NacosFake(users={"nacos": "secret"}, token_key=b"a-different-key-of-thirty-two-bytes")
    assert other.identity(token, trio.current_time()) == "Invalid signature"
    restarted.rotate_key(b"rotated-key-of-at-least-thirty-two-b")
    assert restarted.identity(token, trio.current_time()) == "Invalid signature"
    assert fake.identity("a.b", 0) == "token invalid!"
    assert fake.identity(f"eyJhbGciOiJub25lIn0.{payload}.x", 0) == "unsupported signature algorithm"
    fake.denied.add("nacos")
    assert fake.identity(token, 0) == "authorization failed!"
    del fake.users["nacos"]
    assert fake.identity(token, 0) == "authorization failed!"  # a deleted user has no roles


async def test_preserved_heartbeat_metadata(autojump_clock: object) -> None:
    """``UnhealthyInstanceChecker`` / ``ExpiredInstanceChecker`` read the
    instance's ``preserved.heart.beat.timeout`` / ``preserved.ip.delete.timeout``;
    ``InstanceOperatorClientImpl.getHeartBeatInterval`` answers its
    ``preserved.heart.beat.interval`` as the beat's ``clientBeatInterval``;
    ``checkInstanceIsLegal`` refuses an interval above either timeout."""
    rules = {
        "preserved.heart.beat.interval": "1000",
        "preserved.heart.beat.timeout": "3000",
        "preserved.ip.delete.timeout": "6000",
    }
    async with open_nacos_fake() as fake, client(fake) as http:
        await register(http, metadata=json.dumps(rules))
        where = {"serviceName": SERVICE, "ip": "10.10.10.10", "port": "8888"}
        beat = (await http.put("/v1/ns/instance/beat", params=where)).json()
        assert beat["clientBeatInterval"] == 1000
        await trio.sleep(3.6)
        instance = fake.find(SERVICE, "10.10.10.10", 8888)
        assert instance is not None and not instance.healthy
        await trio.sleep(3)
        assert fake.find(SERVICE, "10.10.10.10", 8888) is None
        backwards = await register(
            http, metadata=json.dumps({**rules, "preserved.heart.beat.timeout": "500"})
        )
        assert backwards.status_code == 400 and "heart beat interval" in backwards.text
