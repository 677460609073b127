"""Pins the Consul fake to Consul's documented behaviour.

Written from the HTTP API documentation (shapes of the documented example
answers, the ``passing`` filter, blocking-query rules, plain-text 403s,
critical-service reaping), independently of the provider, so the fake and
the provider cannot share one misunderstanding. Time-dependent rules run
in-process under trio's MockClock; transport faults use real sockets.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import anyio
import httpx
import pytest
import trio

from tests.fakes.consul import (
    ConsulFake,
    Fault,
    open_consul_fake,
    parse_go_duration,
    run_consul_fake,
)


@pytest.fixture
async def fake() -> AsyncIterator[ConsulFake]:
    yield ConsulFake(seed=1)


def client_for(fake: ConsulFake) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=fake.transport(), base_url=fake.url)


WEB = {
    "Name": "web",
    "ID": "web-1",
    "Tags": ["primary", "v1"],
    "Address": "10.1.10.12",
    "Port": 8000,
    "Meta": {"nadisc-version": "1"},
    "Weights": {"Passing": 10, "Warning": 1},
    "Check": {"CheckID": "service:web-1", "TTL": "15s", "Status": "passing"},
}


def test_go_durations() -> None:
    assert parse_go_duration("30s") == 30
    assert parse_go_duration("5m") == 300
    assert parse_go_duration("1m30s") == 90
    assert parse_go_duration("250ms") == pytest.approx(0.25)
    assert parse_go_duration("0") == 0
    for bad in ("", "30", "abc", "5 m", "-1s"):
        with pytest.raises(ValueError):
            parse_go_duration(bad)


async def test_health_service_has_the_documented_shape(fake: ConsulFake) -> None:
    fake.register(WEB, now=0.0)
    async with client_for(fake) as client:
        response = await client.get("/v1/health/service/web")
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert int(response.headers["x-consul-index"]) >= 1
    assert response.headers["x-consul-knownleader"] == "true"
    assert response.headers["x-consul-lastcontact"] == "0"
    entries = response.json()
    assert isinstance(entries, list) and len(entries) == 1
    entry = entries[0]
    assert set(entry) == {"Node", "Service", "Checks"}
    assert {"ID", "Node", "Address", "Datacenter", "TaggedAddresses", "Meta"} <= set(entry["Node"])
    assert entry["Node"]["Datacenter"] == "dc1"
    service = entry["Service"]
    assert {
        "ID",
        "Service",
        "Tags",
        "Address",
        "TaggedAddresses",
        "Meta",
        "Port",
        "Weights",
    } <= set(service)
    assert service["ID"] == "web-1" and service["Service"] == "web"
    assert service["Tags"] == ["primary", "v1"]
    assert service["Port"] == 8000
    assert service["Weights"] == {"Passing": 10, "Warning": 1}
    assert service["Meta"] == {"nadisc-version": "1"}
    check_ids = [c["CheckID"] for c in entry["Checks"]]
    assert check_ids == ["serfHealth", "service:web-1"]
    serf = entry["Checks"][0]
    assert serf["ServiceID"] == "" and serf["Name"] == "Serf Health Status"
    for check in entry["Checks"]:
        assert {"Node", "CheckID", "Name", "Status", "ServiceID", "ServiceName"} <= set(check)


async def test_unknown_service_is_an_empty_array_not_null(fake: ConsulFake) -> None:
    async with client_for(fake) as client:
        response = await client.get("/v1/health/service/nothing-here")
    assert response.status_code == 200
    assert response.content == b"[]"
    assert int(response.headers["x-consul-index"]) >= 1


async def test_passing_filter_counts_every_check_including_serf_health(fake: ConsulFake) -> None:
    fake.register(WEB, now=0.0)
    fake.register({**WEB, "ID": "web-2", "Check": {"TTL": "15s", "Status": "warning"}}, now=0.0)
    async with client_for(fake) as client:
        everything = (await client.get("/v1/health/service/web")).json()
        passing = (await client.get("/v1/health/service/web?passing")).json()
        assert len(everything) == 2
        assert [e["Service"]["ID"] for e in passing] == ["web-1"]
        fake.set_node_health("critical")
        assert (await client.get("/v1/health/service/web?passing")).json() == []
        assert len((await client.get("/v1/health/service/web")).json()) == 2


async def test_tag_filter_requires_every_tag(fake: ConsulFake) -> None:
    fake.register(WEB, now=0.0)
    fake.register({**WEB, "ID": "web-2", "Tags": ["v1"]}, now=0.0)
    async with client_for(fake) as client:
        one = (await client.get("/v1/health/service/web?tag=primary")).json()
        both = (await client.get("/v1/health/service/web?tag=v1")).json()
    assert [e["Service"]["ID"] for e in one] == ["web-1"]
    assert len(both) == 2


async def test_empty_service_address_is_empty_and_node_address_is_set(fake: ConsulFake) -> None:
    fake.register({"Name": "api", "Port": 9000}, now=0.0)
    async with client_for(fake) as client:
        (entry,) = (await client.get("/v1/health/service/api")).json()
    assert entry["Service"]["ID"] == "api"  # ID defaults to the name
    assert entry["Service"]["Address"] == ""
    assert entry["Node"]["Address"] == "127.0.0.1"


async def test_catalog_services_maps_names_to_tags(fake: ConsulFake) -> None:
    fake.register(WEB, now=0.0)
    fake.register({**WEB, "ID": "web-2", "Tags": ["v2"]}, now=0.0)
    async with client_for(fake) as client:
        response = await client.get("/v1/catalog/services")
    assert response.json() == {"consul": [], "web": ["primary", "v1", "v2"]}


async def test_health_state_filters_by_state(fake: ConsulFake) -> None:
    fake.register(WEB, now=0.0)
    fake.register({**WEB, "ID": "web-2", "Check": {"TTL": "15s"}}, now=0.0)  # starts critical
    async with client_for(fake) as client:
        any_state = (await client.get("/v1/health/state/any")).json()
        critical = (await client.get("/v1/health/state/critical")).json()
        passing = (await client.get("/v1/health/state/passing")).json()
        bad = await client.get("/v1/health/state/sideways")
    assert {c["CheckID"] for c in any_state} == {"serfHealth", "service:web-1", "service:web-2"}
    assert [c["CheckID"] for c in critical] == ["service:web-2"]
    assert {c["CheckID"] for c in passing} == {"serfHealth", "service:web-1"}
    assert bad.status_code == 400 and bad.headers["content-type"].startswith("text/plain")


async def test_register_validates_like_the_agent(fake: ConsulFake) -> None:
    async with client_for(fake) as client:
        missing = await client.put("/v1/agent/service/register", json={"Port": 1})
        dotted = await client.put(
            "/v1/agent/service/register", json={"Name": "x", "Meta": {"a.b": "1"}}
        )
        no_interval = await client.put(
            "/v1/agent/service/register", json={"Name": "x", "Check": {"HTTP": "http://h/"}}
        )
        zero_weight = await client.put(
            "/v1/agent/service/register", json={"Name": "x", "Weights": {"Passing": 0}}
        )
    assert missing.status_code == 400 and missing.text == "Missing service name"
    assert dotted.status_code == 400 and "Invalid Service Meta" in dotted.text
    assert no_interval.status_code == 400 and "Interval" in no_interval.text
    assert zero_weight.status_code == 400
    assert ("fake-node-1", "x") not in fake.services


async def test_deregister_of_an_absent_id_is_404_unknown_service_id(fake: ConsulFake) -> None:
    # Consul's agent endpoint: agent_endpoint.go AgentDeregisterService answers
    # an ID it does not hold with a NotFoundError, HTTP 404, this exact text.
    async with client_for(fake) as client:
        before = fake.index
        response = await client.put("/v1/agent/service/deregister/ghost")
    assert response.status_code == 404
    assert response.text == (
        'Unknown service ID "ghost". Ensure that the service ID is passed, not the service name.'
    )
    assert fake.index == before


async def test_reregistering_the_same_definition_keeps_index_and_check_status(
    fake: ConsulFake,
) -> None:
    fake.register(WEB, now=0.0)
    fake.set_check("service:web-1", "warning", now=1.0)
    before = fake.index
    fake.register(WEB, now=2.0)
    assert fake.index == before
    assert fake.checks[("fake-node-1", "service:web-1")].status == "warning"
    fake.register({**WEB, "Port": 8001}, now=3.0)
    assert fake.index > before


async def test_ttl_checks_pass_warn_fail_update_and_expire() -> None:
    fake = ConsulFake()
    fake.register({**WEB, "Check": {"CheckID": "c1", "TTL": "10s"}}, now=0.0)
    check = fake.checks[("fake-node-1", "c1")]
    assert check.status == "critical"  # a TTL check starts critical
    async with client_for(fake) as client:
        assert (await client.put("/v1/agent/check/pass/c1?note=ok")).status_code == 200
        assert check.status == "passing" and check.output == "ok"
        assert (await client.put("/v1/agent/check/warn/c1")).status_code == 200
        assert check.status == "warning"
        update = await client.put(
            "/v1/agent/check/update/c1", json={"Status": "passing", "Output": "fine"}
        )
        assert update.status_code == 200 and check.output == "fine"
        unknown = await client.put("/v1/agent/check/pass/nope")
        assert unknown.status_code == 404 and "Unknown check ID" in unknown.text
    refreshed = check.ttl_expires
    assert refreshed is not None
    fake.tick(refreshed - 0.1)
    assert check.status == "passing"
    fake.tick(refreshed)
    assert check.status == "critical" and check.output == "TTL expired"


async def test_reaper_removes_services_critical_past_deregister_after() -> None:
    fake = ConsulFake(reap_interval=30.0)
    fake.register(
        {**WEB, "Check": {"TTL": "10s", "DeregisterCriticalServiceAfter": "10s"}}, now=0.0
    )
    fake.register({**WEB, "ID": "web-2", "Check": {"TTL": "10s", "Status": "passing"}}, now=0.0)
    check = fake.checks[("fake-node-1", "service:web-1")]
    assert check.deregister_after == 60.0  # clamped to Consul's one-minute minimum
    fake.tick(0.0)  # arms the reaper (every 30 s)
    for now in (30.0, 59.0):
        fake.tick(now)
        assert ("fake-node-1", "web-1") in fake.services
    fake.tick(60.0)
    fake.tick(90.0)  # first reaper pass after 60 s of critical
    assert ("fake-node-1", "web-1") not in fake.services
    assert ("fake-node-1", "service:web-1") not in fake.checks
    assert ("fake-node-1", "web-2") in fake.services  # no DeregisterCriticalServiceAfter


async def test_reaper_spares_a_service_that_recovered() -> None:
    fake = ConsulFake(reap_interval=30.0)
    fake.register(
        {**WEB, "Check": {"TTL": "100s", "DeregisterCriticalServiceAfter": "1m"}}, now=0.0
    )
    fake.tick(0.0)
    fake.update_ttl("service:web-1", "passing", "", now=50.0)
    fake.tick(60.0)
    fake.tick(90.0)
    assert ("fake-node-1", "web-1") in fake.services


async def test_blocking_query_waits_for_wait_plus_jitter(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake()
    fake.register(WEB, now=0.0)
    async with client_for(fake) as client:
        first = await client.get("/v1/health/service/web")
        index = first.headers["x-consul-index"]
        start = anyio.current_time()
        second = await client.get(f"/v1/health/service/web?index={index}&wait=30s")
        elapsed = anyio.current_time() - start
    assert 30.0 <= elapsed <= 30.0 * 17 / 16
    assert second.headers["x-consul-index"] == index  # a return is not a change


async def test_blocking_query_default_and_maximum_wait(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake()
    async with client_for(fake) as client:
        index = (await client.get("/v1/catalog/services")).headers["x-consul-index"]
        start = anyio.current_time()
        await client.get(f"/v1/catalog/services?index={index}")
        default = anyio.current_time() - start
        start = anyio.current_time()
        await client.get(f"/v1/catalog/services?index={index}&wait=1h")
        capped = anyio.current_time() - start
    assert 300.0 <= default <= 300.0 * 17 / 16
    assert 600.0 <= capped <= 600.0 * 17 / 16


async def test_blocking_query_returns_early_on_its_own_change_only(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake()
    fake.register(WEB, now=0.0)
    fake.register({"Name": "other", "Port": 1}, now=0.0)
    async with client_for(fake) as client:
        index = int((await client.get("/v1/health/service/web")).headers["x-consul-index"])
        results: dict[str, float] = {}

        async def block() -> None:
            start = anyio.current_time()
            response = await client.get(f"/v1/health/service/web?index={index}&wait=60s")
            results["elapsed"] = anyio.current_time() - start
            results["index"] = int(response.headers["x-consul-index"])

        async with anyio.create_task_group() as nursery:
            nursery.start_soon(block)
            await anyio.sleep(5)
            fake.register({"Name": "other", "Port": 2}, now=5.0)  # another service
            await anyio.sleep(5)
            fake.set_check("service:web-1", "critical", now=10.0)  # ours
    assert results["elapsed"] == pytest.approx(10.0, abs=0.5)
    assert results["index"] > index


async def test_blocking_index_zero_does_not_block_and_bad_values_are_400(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake()
    async with client_for(fake) as client:
        start = anyio.current_time()
        await client.get("/v1/catalog/services?index=0&wait=30s")
        assert anyio.current_time() - start < 1.0
        bad_wait = await client.get("/v1/catalog/services?index=5&wait=soon")
        bad_index = await client.get("/v1/catalog/services?index=-3")
        both = await client.get("/v1/catalog/services?stale&consistent")
        other_dc = await client.get("/v1/catalog/services?dc=mars")
    assert bad_wait.status_code == 400 and bad_wait.text == "Invalid wait time"
    assert bad_wait.headers["content-type"].startswith("text/plain")
    assert bad_index.status_code == 400 and bad_index.text.startswith("Invalid index")
    assert both.status_code == 400
    assert other_dc.status_code == 500 and other_dc.text == "No path to datacenter"


async def test_index_reset_goes_backwards(autojump_clock: trio.testing.MockClock) -> None:
    fake = ConsulFake()
    fake.register(WEB, now=0.0)
    async with client_for(fake) as client:
        high = int((await client.get("/v1/health/service/web")).headers["x-consul-index"])
        fake.reset_index(to=1)
        low = int((await client.get("/v1/health/service/web")).headers["x-consul-index"])
    assert high > 1 and low == 1


async def test_acl_reads_filter_and_unknown_tokens_are_denied(fake: ConsulFake) -> None:
    """Consul's documented ACL shapes: a valid token without ``service:read``
    gets 200 with the unreadable results left out and
    ``X-Consul-Results-Filtered-By-ACLs: true``; an unknown or deleted token
    gets 403 ``ACL not found``; a write without ``service:write`` gets 403
    ``Permission denied`` (plain text)."""
    fake.register(WEB, now=0.0)
    db_check = {"CheckID": "service:db-1", "TTL": "15s", "Status": "passing"}
    fake.register({**WEB, "Name": "db", "ID": "db-1", "Check": db_check}, now=0.0)
    fake.enable_acl()
    fake.add_token("reader", read=("web",), write=())
    fake.add_token("other", read=("db",), write=())
    fake.add_token("writer")
    web = "/v1/health/service/web"

    async with client_for(fake) as client:

        async def get(path: str, token: str | None) -> httpx.Response:
            headers = {"X-Consul-Token": token} if token is not None else {}
            return await client.get(path, headers=headers)

        anonymous = await get(web, None)
        unknown = await get(web, "nope")
        allowed = await get(web, "reader")
        bearer = await client.get(web, headers={"Authorization": "Bearer reader"})
        trimmed = await get(web, "other")
        trimmed_checks = await get("/v1/health/checks/web", "other")
        trimmed_state = await get("/v1/health/state/any", "other")
        allowed_checks = await get("/v1/health/checks/web", "reader")
        no_write = await client.put(
            "/v1/agent/service/register", json=WEB, headers={"X-Consul-Token": "reader"}
        )
        listing = await get("/v1/catalog/services", "reader")
        full_listing = await get("/v1/catalog/services", "writer")
        fake.revoke_token("reader")
        revoked = await get(web, "reader")
        revoked_listing = await get("/v1/catalog/services", "reader")
    flag = "x-consul-results-filtered-by-acls"
    for filtered in (anonymous, trimmed, trimmed_checks):
        assert filtered.status_code == 200 and filtered.json() == []
        assert filtered.headers[flag] == "true"
    assert trimmed_state.status_code == 200 and trimmed_state.headers[flag] == "true"
    assert {c["ServiceName"] for c in trimmed_state.json()} == {"", "db"}
    assert unknown.status_code == 403 and unknown.text == "ACL not found"
    assert unknown.headers["content-type"].startswith("text/plain")
    for readable in (allowed, bearer):
        assert readable.status_code == 200 and flag not in readable.headers
        assert [e["Service"]["ID"] for e in readable.json()] == ["web-1"]
    assert allowed_checks.status_code == 200 and flag not in allowed_checks.headers
    assert no_write.status_code == 403 and no_write.text.startswith("Permission denied")
    assert listing.json() == {"web": ["primary", "v1"]}  # lists filter instead of denying
    assert listing.headers[flag] == "true"
    assert {"db", "web"} <= set(full_listing.json()) and flag not in full_listing.headers
    assert revoked.status_code == 403 and revoked.text == "ACL not found"
    assert revoked_listing.status_code == 403 and revoked_listing.text == "ACL not found"


async def test_agent_health_by_id_maps_status_codes(fake: ConsulFake) -> None:
    fake.register(WEB, now=0.0)
    async with client_for(fake) as client:
        ok = await client.get("/v1/agent/health/service/id/web-1")
        fake.set_check("service:web-1", "warning")
        warn = await client.get("/v1/agent/health/service/id/web-1")
        fake.set_check("service:web-1", "critical")
        crit = await client.get("/v1/agent/health/service/id/web-1")
        missing = await client.get("/v1/agent/health/service/id/ghost")
    assert (ok.status_code, warn.status_code, crit.status_code) == (200, 429, 503)
    assert ok.json()["AggregatedStatus"] == "passing"
    assert missing.status_code == 404


async def test_faults_status_body_and_headers(fake: ConsulFake) -> None:
    fake.inject("/v1/health/service/", Fault("status", status=503, body=b"rpc error"))
    fake.inject("/v1/catalog/services", Fault("no_index"))
    fake.inject("/v1/health/state/", Fault("index", index="0"))
    fake.inject("/v1/health/checks/", Fault("body", body=b"{not json"))
    async with client_for(fake) as client:
        failed = await client.get("/v1/health/service/web")
        healthy_again = await client.get("/v1/health/service/web")
        no_index = await client.get("/v1/catalog/services")
        zero = await client.get("/v1/health/state/any")
        garbage = await client.get("/v1/health/checks/web")
    assert failed.status_code == 503 and failed.text == "rpc error"
    assert healthy_again.status_code == 200  # one-shot
    assert "x-consul-index" not in no_index.headers
    assert zero.headers["x-consul-index"] == "0"
    assert garbage.content == b"{not json"


async def test_background_task_expires_ttls_under_mock_clock(
    autojump_clock: trio.testing.MockClock,
) -> None:
    async with open_consul_fake() as fake:
        fake.register(
            {**WEB, "Check": {"CheckID": "c", "TTL": "5s", "Status": "passing"}},
            now=anyio.current_time(),
        )
        await anyio.sleep(4)
        assert fake.checks[("fake-node-1", "c")].status == "passing"
        await anyio.sleep(2)
        assert fake.checks[("fake-node-1", "c")].status == "critical"


# -- real sockets (real clock, short waits) --------------------------------------------


async def test_served_on_loopback_with_transport_faults() -> None:
    async with run_consul_fake() as fake, httpx.AsyncClient(base_url=fake.url) as client:
        assert fake.url.startswith("http://127.0.0.1:")
        fake.register(WEB, now=anyio.current_time())
        fake.inject("/v1/health/service/", Fault("truncate"))
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get("/v1/health/service/web")
        fake.inject("/v1/health/service/", Fault("drop"))
        with pytest.raises(httpx.RemoteProtocolError):
            await client.get("/v1/health/service/web")
        fake.inject("/v1/health/service/", Fault("slow", delay=0.02))
        start = anyio.current_time()
        slow = await client.get("/v1/health/service/web")
        # A lower bound the fake's own sleeps guarantee (at least 7 of its 8
        # pieces, 20 ms each, precede the last byte): slowness cannot break it.
        assert anyio.current_time() - start >= 0.1
        assert len(slow.json()) == 1
        fake.inject("/v1/health/service/", Fault("hang"))
        with pytest.raises(httpx.ReadTimeout):
            await client.get("/v1/health/service/web", timeout=0.2)
        assert (await client.get("/v1/health/service/web")).status_code == 200


async def test_http_checks_are_really_performed() -> None:
    async with run_consul_fake() as fake, httpx.AsyncClient(base_url=fake.url) as client:
        good = {"HTTP": f"{fake.url}/v1/status/leader", "Interval": "100ms"}
        with anyio.fail_after(5):
            listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
            dead_port = listener.extra(anyio.abc.SocketAttribute.local_port)
            await listener.aclose()
        bad = {"HTTP": f"http://127.0.0.1:{dead_port}/health", "Interval": "100ms"}
        await client.put("/v1/agent/service/register", json={"Name": "a", "Check": good})
        await client.put("/v1/agent/service/register", json={"Name": "b", "Check": bad})
        check_a = fake.checks[("fake-node-1", "service:a")]
        check_b = fake.checks[("fake-node-1", "service:b")]
        with anyio.fail_after(5):
            await fake.wait_for(lambda: check_a.status == "passing" and bool(check_b.output))
        assert check_b.status == "critical"
        passing = (await client.get("/v1/health/service/a?passing")).json()
        assert [e["Service"]["ID"] for e in passing] == ["a"]


async def test_a_cancelled_blocking_query_is_seen_as_a_disconnect() -> None:
    async with run_consul_fake() as fake, httpx.AsyncClient(base_url=fake.url) as client:
        index = (await client.get("/v1/catalog/services")).headers["x-consul-index"]
        with anyio.move_on_after(0.2):
            await client.get(f"/v1/catalog/services?index={index}&wait=30s")
        with anyio.fail_after(5):
            await fake.wait_for(lambda: not fake.open_requests("/v1/catalog/services"))
        assert fake.outcomes("/v1/catalog/services") == ["answered", "disconnected"]


async def test_maintenance_mode_adds_a_critical_check(fake: ConsulFake) -> None:
    fake.register(WEB, now=0.0)
    async with client_for(fake) as client:
        missing = await client.put("/v1/agent/service/maintenance/web-1")
        on = await client.put("/v1/agent/service/maintenance/web-1?enable=true&reason=deploy")
        passing = (await client.get("/v1/health/service/web?passing")).json()
        health = await client.get("/v1/agent/health/service/id/web-1")
        off = await client.put("/v1/agent/service/maintenance/web-1?enable=false")
        back = (await client.get("/v1/health/service/web?passing")).json()
    assert missing.status_code == 400
    assert on.status_code == 200 and off.status_code == 200
    assert passing == [] and len(back) == 1
    assert health.status_code == 503
    assert "_service_maintenance:web-1" in {c["CheckID"] for c in health.json()["Checks"]}


async def test_failures_before_critical_holds_the_status_until_the_nth_failure_in_a_row(
    fake: ConsulFake,
) -> None:
    # Consul's check definition: "FailuresBeforeCritical - the number of
    # consecutive unsuccessful results required before check status
    # transitions to critical"; until the threshold "status will stay
    # identical as before" (HTTP, TCP, gRPC, Docker and Monitor checks).
    check_def = {
        "CheckID": "service:web-1",
        "HTTP": "http://10.1.10.12:8000/health",
        "Interval": "10s",
        "FailuresBeforeCritical": 3,
    }
    fake.register({**WEB, "Check": check_def}, now=0.0)
    check = fake.checks[("fake-node-1", "service:web-1")]
    assert check.status == "critical"  # a new HTTP check starts critical
    fake.probe_result("service:web-1", "passing", "HTTP GET: 200", now=1.0)
    assert check.status == "passing"  # success takes effect at once
    index = fake.index
    for now in (2.0, 3.0):
        fake.probe_result("service:web-1", "critical", "Get: ReadTimeout", now=now)
        assert (check.status, check.output) == ("passing", "HTTP GET: 200")
    assert fake.index == index  # nothing changed: a blocking query stays blocked
    fake.probe_result("service:web-1", "warning", "HTTP GET: 429", now=4.0)  # resets the run
    for now in (5.0, 6.0):
        fake.probe_result("service:web-1", "critical", "Get: ReadTimeout", now=now)
        assert check.status == "warning"
    fake.probe_result("service:web-1", "critical", "Get: connection refused", now=7.0)
    assert (check.status, check.output) == ("critical", "Get: connection refused")
    assert check.critical_since == 7.0 and fake.index > index
    # Without the field (or with 0 or 1) the first failure is critical.
    fake.register({**WEB, "ID": "web-2", "Check": {"HTTP": "http://x/h", "Interval": "1s"}}, now=0)
    fake.probe_result("service:web-2", "passing", now=1.0)
    fake.probe_result("service:web-2", "critical", now=2.0)
    assert fake.checks[("fake-node-1", "service:web-2")].status == "critical"
    for bad in (-1, "3", True):
        with pytest.raises(Exception, match="FailuresBeforeCritical"):
            fake.register({**WEB, "Check": {**check_def, "FailuresBeforeCritical": bad}}, now=0)
