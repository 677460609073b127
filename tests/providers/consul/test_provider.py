"""The provider's discovery half: query, the blocking-query watch, failure typing."""

from __future__ import annotations

import functools
import json
from importlib.metadata import entry_points

import anyio
import httpx
import pytest
import trio
import trio.testing
from nadisc_consul import ConsulProvider, ConsulSettings, factory
from nadisc_consul._provider import COOPERATIVE_BYTES

from nadisc import (
    CapacityRejected,
    DeadlineExceeded,
    EvidenceKind,
    IdentityRevoked,
    IncompleteSnapshot,
    RegistrationError,
    RegistrationRecord,
    RegistrationRejected,
    default_tls_context,
)
from tests.fakes.consul import ConsulFake, Fault, run_consul_fake
from tests.providers.consul.conftest import RecordingSink, context, in_process, over_loopback

WEB = {
    "Name": "web",
    "ID": "web-1",
    "Tags": ["primary"],
    "Address": "10.0.0.5",
    "Port": 8080,
    "Meta": {"zone": "a"},
    "Weights": {"Passing": 3, "Warning": 1},
    "Check": {"CheckID": "service:web-1", "TTL": "1h", "Status": "passing"},
}


def health_requests(fake: ConsulFake, name: str = "web") -> list[dict[str, str]]:
    return [r.query for r in fake.requests if r.path == f"/v1/health/service/{name}"]


async def test_query_lists_passing_instances_with_weights_tags_and_meta() -> None:
    fake = ConsulFake()
    fake.register(WEB, now=0.0)
    fake.register({**WEB, "ID": "web-2", "Check": {"TTL": "1h"}}, now=0.0)  # critical
    fake.register({**WEB, "ID": "web-3", "Address": "", "Tags": []}, now=0.0)
    provider = in_process(fake)
    snapshot = await provider.query("web", anyio.current_time() + 5)
    await provider.aclose()
    assert snapshot.evidence is EvidenceKind.REGISTRY_HEALTH
    assert snapshot.identities() == ("web-1", "web-3")
    first, third = snapshot.instances
    assert (first.host, first.port, first.weight, first.tags) == (
        "10.0.0.5",
        8080,
        3.0,
        ("primary",),
    )
    assert dict(first.metadata) == {"zone": "a"}
    assert third.host == "127.0.0.1"  # empty Service.Address -> Node.Address
    assert "passing" in health_requests(fake)[0]


async def test_node_meta_zone_reaches_instances_without_a_zone_of_their_own() -> None:
    # A node's agent node_meta comes back under Node.Meta of every entry on it.
    fake = ConsulFake()
    fake.add_node("edge-1", "10.0.1.1", meta={"zone": "eu-west-1b", "rack": "r7"})
    plain = {k: v for k, v in WEB.items() if k != "Meta"}
    fake.register({**plain, "ID": "web-e"}, now=0.0, node="edge-1")
    fake.register({**WEB, "ID": "web-z"}, now=0.0, node="edge-1")  # its own zone wins
    fake.register({**plain, "ID": "web-p"}, now=0.0)  # the agent's node: no zone
    provider = in_process(fake)
    snapshot = await provider.query("web", anyio.current_time() + 5)
    await provider.aclose()
    zones = {i.identity: dict(i.metadata) for i in snapshot.instances}
    assert zones == {"web-e": {"zone": "eu-west-1b"}, "web-z": {"zone": "a"}, "web-p": {}}


async def test_alias_binding_maps_name_and_tag() -> None:
    fake = ConsulFake()
    fake.register(WEB, now=0.0)
    fake.register({**WEB, "ID": "web-2", "Tags": ["canary"]}, now=0.0)
    provider = in_process(
        fake,
        services={"orders": {"name": "web", "tag": "primary"}},
        datacenter="dc1",
        consistency="stale",
    )
    snapshot = await provider.query("orders", anyio.current_time() + 5)
    by_remote_name = await provider.query("web", anyio.current_time() + 5)
    await provider.aclose()
    assert snapshot.service == "orders" and snapshot.identities() == ("web-1",)
    assert by_remote_name.identities() == ("web-1",)  # the one binding of that name
    sent = health_requests(fake)[0]
    assert sent["tag"] == "primary" and sent["dc"] == "dc1" and "stale" in sent


async def test_watch_publishes_on_change_and_refreshes_on_quiet_returns(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake()
    fake.register(WEB, now=0.0)
    provider = in_process(fake, wait=10.0)
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "web", sink)
        assert sink.events == ["publish"]
        await anyio.sleep(12)  # one blocking round trip times out: not a change
        assert sink.events == ["publish", "refresh"]
        fake.set_check("service:web-1", "critical")
        await anyio.sleep(0.5)
        assert sink.events[-1] == "publish" and sink.published[-1].instances == ()
        nursery.cancel_scope.cancel()
    await provider.aclose()
    sent = health_requests(fake)
    assert "index" not in sent[0]
    assert all(q["wait"] == "10s" and int(q["index"]) >= 1 for q in sent[1:])


async def test_watch_reuses_unchanged_instances_across_updates(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # Thousands of instances rebuilt per update would make long-lived garbage
    # and event-loop stalls; the loop hands the decoder its last snapshot.
    fake = ConsulFake()
    fake.register(WEB, now=0.0)
    provider = in_process(fake, wait=10.0)
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "web", sink)
        fake.register({**WEB, "ID": "web-2", "Address": "10.0.0.6"}, now=1.0)
        await sink.wait_for(lambda: len(sink.published) == 2)
        first, second = sink.published
        (kept,) = first.instances
        assert second.identities() == ("web-1", "web-2")
        assert second.instances[0] is kept
        nursery.cancel_scope.cancel()
    await provider.aclose()


async def test_index_going_backwards_triggers_a_fresh_non_blocking_read(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake()
    fake.register(WEB, now=0.0)
    provider = in_process(fake, wait=30.0)
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "web", sink)
        await anyio.sleep(1)
        fake.reset_index(to=1)  # snapshot restore: every index is lower now
        # The server keeps blocking (its index is not above ours) until `wait`.
        await anyio.sleep(30 * 17 / 16 + 1)
        nursery.cancel_scope.cancel()
    await provider.aclose()
    sent = health_requests(fake)
    # initial read, a blocking read that saw the lower index, a fresh read, then blocking on 1
    assert "index" not in sent[0] and "index" in sent[1]
    assert "index" not in sent[2]
    assert sent[3]["index"] == "1"
    assert sink.events[:2] == ["publish", "publish"]


async def test_zero_index_is_replaced_by_one(autojump_clock: trio.testing.MockClock) -> None:
    fake = ConsulFake()
    fake.register(WEB, now=0.0)
    fake.inject("/v1/health/service/web", Fault("index", index="0"))
    provider = in_process(fake, wait=5.0)
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "web", sink)
        await anyio.sleep(1)
        nursery.cancel_scope.cancel()
    await provider.aclose()
    assert health_requests(fake)[1]["index"] == "1"
    assert sink.events[0] == "publish"


async def test_reissue_is_rate_limited_by_the_token_bucket(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake()
    # A server that ignores `wait`: answers at once, index never moves.
    fake.inject("/v1/health/service/web", Fault("body", body=b"[]", index="5"), times=10_000)
    provider = in_process(fake, watch_rate=2.0, watch_burst=5)
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "web", sink)
        await anyio.sleep(10)
        nursery.cancel_scope.cancel()
    await provider.aclose()
    count = len(health_requests(fake))
    assert 20 <= count <= 5 + 2 * 10 + 1
    assert sink.events[0] == "publish" and set(sink.events[1:]) == {"refresh"}


@pytest.mark.parametrize(
    ("fault", "expected"),
    [
        (Fault("status", status=500, body=b"rpc error: No cluster leader"), IncompleteSnapshot),
        (Fault("status", status=429, body=b"rate limit exceeded"), IncompleteSnapshot),
        (Fault("status", status=403, body=b"Permission denied"), IdentityRevoked),
        (Fault("no_index"), IncompleteSnapshot),
        (Fault("index", index="ten"), IncompleteSnapshot),
        (Fault("body", body=b"<html>proxy error</html>"), IncompleteSnapshot),
        (Fault("body", body=b'{"not": "an array"}'), IncompleteSnapshot),
    ],
)
async def test_watch_failures_are_typed_and_the_watch_recovers(
    autojump_clock: trio.testing.MockClock, fault: Fault, expected: type[Exception]
) -> None:
    fake = ConsulFake()
    fake.register(WEB, now=0.0)
    fake.inject("/v1/health/service/web", fault)
    provider = in_process(fake, wait=5.0, initial_backoff=1.0, max_backoff=2.0)
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "web", sink)
        await anyio.sleep(3)
        nursery.cancel_scope.cancel()
    await provider.aclose()
    assert type(sink.failures[0]) is expected
    assert sink.events[0] == f"fail:{expected.__name__}"
    assert sink.events[1] == "publish"
    assert sink.published[0].identities() == ("web-1",)


async def test_blocking_read_timeout_is_above_wait_times_17_16(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake()
    fake.register(WEB, now=0.0)
    provider = in_process(fake, ctx=context(request_timeout=2.0), wait=16.0)
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(provider.watch, "web", sink)
        fake.inject("/v1/health/service/web", Fault("hang"))
        started = anyio.current_time()
        await anyio.sleep(0.01)
        fake.set_check("service:web-1", "warning")  # unblocks the first blocking read
        with anyio.fail_after(100):
            await sink.wait_for(lambda: bool(sink.failures))
        failed_after = anyio.current_time() - started
        nursery.cancel_scope.cancel()
    await provider.aclose()
    assert isinstance(sink.failures[0], IncompleteSnapshot)
    assert 16.0 * 17 / 16 < failed_after <= 16.0 * 17 / 16 + 2.0 + 1.0


async def test_oversized_bodies_are_capacity_rejections() -> None:
    fake = ConsulFake()
    for i in range(40):
        fake.register({**WEB, "ID": f"web-{i}"}, now=0.0)
    provider = in_process(fake, ctx=context(max_response_bytes=4096))
    with pytest.raises(CapacityRejected, match="max_response_bytes=4096"):
        await provider.query("web", anyio.current_time() + 5)
    few = in_process(fake, ctx=context(max_instances_per_service=10))
    with pytest.raises(CapacityRejected, match="max_instances_per_service=10"):
        await few.query("web", anyio.current_time() + 5)
    await provider.aclose()
    await few.aclose()


async def test_large_answers_decode_cooperatively_with_the_same_result() -> None:
    fake = ConsulFake()
    for i in range(120):
        fake.register({**WEB, "ID": f"web-{i:03}", "Meta": {"pad": "x" * 400}}, now=0.0)
    _, entries, _ = fake.health_service("web", passing=True)
    assert len(json.dumps(entries)) > COOPERATIVE_BYTES
    provider = in_process(fake)
    snapshot = await provider.query("web", anyio.current_time() + 5)
    await provider.aclose()
    assert len(snapshot.instances) == 120
    assert snapshot.identities() == tuple(f"web-{i:03}" for i in range(120))


async def test_deadlines_in_the_past_or_nan_are_refused() -> None:
    provider = in_process(ConsulFake())
    with pytest.raises(DeadlineExceeded):
        await provider.query("web", anyio.current_time() - 1)
    with pytest.raises(DeadlineExceeded):
        await provider.query("web", float("nan"))
    await provider.aclose()
    await provider.aclose()  # idempotent


async def test_the_token_is_sent_but_never_shown() -> None:
    fake = ConsulFake()
    fake.register(WEB, now=0.0)
    fake.enable_acl()
    fake.add_token("s3cr3t-token-value")
    good = in_process(fake, token="s3cr3t-token-value")
    assert (await good.query("web", anyio.current_time() + 5)).identities() == ("web-1",)
    assert fake.requests[-1].token == "s3cr3t-token-value"
    assert "s3cr3t" not in repr(good) and "s3cr3t" not in repr(good.settings)
    fake.revoke_token("s3cr3t-token-value")
    with pytest.raises(IdentityRevoked) as revoked:
        await good.query("web", anyio.current_time() + 5)
    assert "ACL not found" in str(revoked.value) and "s3cr3t" not in str(revoked.value)
    anonymous = in_process(fake)
    with pytest.raises(IdentityRevoked, match="filtered by ACLs"):
        await anonymous.query("web", anyio.current_time() + 5)
    await good.aclose()
    await anonymous.aclose()


async def test_acl_filtered_health_read_is_a_revocation_not_an_empty_listing() -> None:
    def filtered(request: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            content=b"[]",
            headers={
                "Content-Type": "application/json",
                "X-Consul-Index": "42",
                "X-Consul-KnownLeader": "true",
                "X-Consul-Results-Filtered-By-ACLs": "true",
            },
        )

    provider = ConsulProvider(context(), ConsulSettings(), transport=httpx.MockTransport(filtered))
    with pytest.raises(IdentityRevoked, match="filtered by ACLs"):
        await provider.query("web", anyio.current_time() + 5)
    await provider.aclose()


async def test_fake_acl_filtering_reaches_the_provider_as_revocation(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = ConsulFake()
    fake.register(WEB, now=0.0)
    fake.enable_acl()
    fake.add_token("db-reader", read=("db",), write=())
    fake.add_token("web-reader", read=("web",), write=())
    trimmed = in_process(fake, token="db-reader")
    with pytest.raises(IdentityRevoked, match="lacks service:read on 'web'"):
        await trimmed.query("web", anyio.current_time() + 5)
    # As in Consul, nothing is left out of a service with no instances: no
    # header, so that is an explicit empty listing.
    assert (await trimmed.query("nothing", anyio.current_time() + 5)).instances == ()
    allowed = in_process(fake, token="web-reader")
    assert (await allowed.query("web", anyio.current_time() + 5)).identities() == ("web-1",)
    sink = RecordingSink()
    async with anyio.create_task_group() as nursery:
        await nursery.start(functools.partial(allowed.watch, "web", sink))
        await sink.wait_for(lambda: len(sink.published) == 1)
        fake.set_token_rules("web-reader", read=("db",))
        await sink.wait_for(lambda: bool(sink.failures))
        nursery.cancel_scope.cancel()
    assert isinstance(sink.failures[0], IdentityRevoked)
    assert [s.identities() for s in sink.published] == [("web-1",)]  # never an empty publish
    await trimmed.aclose()
    await allowed.aclose()


async def test_prepare_checks_reachability_and_rights() -> None:
    fake = ConsulFake()
    provider = in_process(fake)
    await provider.prepare(anyio.current_time() + 5)
    fake.enable_acl()
    with pytest.raises(IdentityRevoked):
        # catalog/services filters rather than denying, but an unknown token is denied
        await in_process(fake, token="unknown").prepare(anyio.current_time() + 5)
    await provider.aclose()


# -- real sockets -------------------------------------------------------------------------


async def test_transport_faults_over_loopback_are_incomplete() -> None:
    async with run_consul_fake() as fake:
        fake.register(WEB, now=anyio.current_time())
        provider = over_loopback(fake, ctx=context(request_timeout=0.5))
        for fault in (Fault("truncate"), Fault("drop"), Fault("hang"), Fault("slow", delay=0.2)):
            fake.inject("/v1/health/service/web", fault)
            with pytest.raises(IncompleteSnapshot) as failure:
                await provider.query("web", anyio.current_time() + 0.5)
            assert failure.value.__cause__ is not None
        assert (await provider.query("web", anyio.current_time() + 5)).identities() == ("web-1",)
        await provider.aclose()


async def test_unreachable_agent_is_incomplete() -> None:
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    await listener.aclose()
    provider = ConsulProvider(context(), ConsulSettings(url=f"http://127.0.0.1:{port}"))  # type: ignore[arg-type]
    with pytest.raises(IncompleteSnapshot, match="transport failed"):
        await provider.query("web", anyio.current_time() + 2)
    await provider.aclose()


async def test_content_length_over_budget_is_refused_before_reading() -> None:
    async with run_consul_fake() as fake:
        body = json.dumps([{"pad": "x" * 5000}]).encode()
        fake.inject("/v1/health/service/web", Fault("body", body=body))
        provider = over_loopback(fake, ctx=context(max_response_bytes=1024))
        with pytest.raises(CapacityRejected, match="exceeds max_response_bytes=1024"):
            await provider.query("web", anyio.current_time() + 5)
        await provider.aclose()


async def test_factory_and_entry_point() -> None:
    (point,) = [p for p in entry_points(group="nadisc.providers") if p.name == "consul"]
    assert point.load() is factory
    assert factory.name == "consul"
    assert factory.settings_model is ConsulSettings
    provider = factory.create(context(), ConsulSettings())
    capabilities = provider.capabilities
    assert capabilities.evidence is EvidenceKind.REGISTRY_HEALTH
    assert capabilities.registration and capabilities.idempotent_renewal
    assert capabilities.watch_streams == 1
    await provider.aclose()


async def test_disabled_registration_is_declared_and_refused() -> None:
    fake = ConsulFake()
    provider = in_process(fake, enabled=False)
    assert not provider.capabilities.registration
    assert provider.capabilities.watch_streams == 1
    record = RegistrationRecord("web", "web", "web-9", "10.0.0.9", 80)
    with pytest.raises(RegistrationRejected, match="disabled") as info:
        await provider.register(record, anyio.current_time() + 5)
    assert isinstance(info.value.__cause__, RegistrationError)
    assert ("fake-node-1", "web-9") not in fake.services
    await provider.aclose()


async def test_tls_with_the_configured_ca_file_and_refused_without_it(
    self_signed_cert: tuple[str, str],
) -> None:
    cert, key = self_signed_cert
    async with run_consul_fake(tls=(cert, key)) as fake:
        assert fake.url.startswith("https://127.0.0.1:")
        fake.register(WEB, now=anyio.current_time())
        trusted = over_loopback(fake, ca_file=cert)
        snapshot = await trusted.query("web", anyio.current_time() + 5)
        assert snapshot.identities() == ("web-1",)
        await trusted.aclose()
        # The system trust store does not know this CA: the read is incomplete.
        untrusted = over_loopback(fake)
        with pytest.raises(IncompleteSnapshot, match=r"(?i)certificate|ssl|tls|transport"):
            await untrusted.query("web", anyio.current_time() + 5)
        await untrusted.aclose()


def _count_trust_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Record every CA-bundle load (file or system store) from now on."""
    import ssl

    loads: list[str] = []
    verify_locations = ssl.SSLContext.load_verify_locations
    default_certs = ssl.SSLContext.load_default_certs

    def counted_locations(self: ssl.SSLContext, *args: object, **kwargs: object) -> None:
        loads.append("load_verify_locations")
        verify_locations(self, *args, **kwargs)  # type: ignore[arg-type]

    def counted_defaults(self: ssl.SSLContext, *args: object, **kwargs: object) -> None:
        loads.append("load_default_certs")
        default_certs(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ssl.SSLContext, "load_verify_locations", counted_locations)
    monkeypatch.setattr(ssl.SSLContext, "load_default_certs", counted_defaults)
    return loads


async def test_a_plain_http_agent_loads_no_ca_bundle(
    monkeypatch: pytest.MonkeyPatch, self_signed_cert: tuple[str, str]
) -> None:
    # Loading a CA bundle is synchronous work that holds the event loop for
    # tens to hundreds of milliseconds; a host that starts in a process
    # already serving (and being health-probed) must not pay it for an
    # agent it talks to over plain http.
    loads = _count_trust_loads(monkeypatch)
    plain = factory.create(
        context(), ConsulSettings.model_validate({"url": "http://127.0.0.1:8500"})
    )
    async with plain.http.channel():
        pass
    await plain.aclose()
    assert loads == []
    # https still verifies: the configured bundle (or the default store) is
    # loaded once per connection and shared by its channels.
    cert, _ = self_signed_cert
    secure = factory.create(
        context(), ConsulSettings.model_validate({"url": "https://127.0.0.1:8501", "ca_file": cert})
    )
    async with secure.http.channel():
        pass
    await secure.aclose()
    assert loads == ["load_verify_locations"]
    # The default store is the process's one shared context: loaded by the
    # first pool that needs it (in this test or before it), never again.
    default_tls_context.cache_clear()
    for _ in range(2):
        defaults = factory.create(
            context(), ConsulSettings.model_validate({"url": "https://127.0.0.1:8501"})
        )
        await defaults.aclose()
    assert len(loads) == 2
