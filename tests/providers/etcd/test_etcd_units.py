"""Unit tests of the etcd provider's pure parts and its error translation.

No server: wire decoding, the record codec, the sans-IO watch state, the
settings model, and the client against an in-process httpx transport.
"""

from __future__ import annotations

import base64
import importlib.metadata
import inspect
import itertools
import json
import random
from collections.abc import Callable

import anyio
import httpx
import pydantic
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from nadisc_etcd import (
    EtcdClient,
    EtcdProvider,
    EtcdSettings,
    Layout,
    RecordError,
    decode_record,
    encode_record,
    factory,
)
from nadisc_etcd._client import LineBuffer, _Body
from nadisc_etcd._leases import LeasePool
from nadisc_etcd._provider import page_size, record_bytes
from nadisc_etcd._state import Backoff, ProbeVerdict, ServiceState
from nadisc_etcd._wire import (
    Event,
    GatewayStatus,
    KeyValue,
    RangeResponse,
    ResponseHeader,
    WatchLine,
    WatchResponse,
    WireError,
    decode,
    prefix_range_end,
)

from nadisc import (
    CapacityRejected,
    ConfigError,
    DiscoveryConfig,
    EvidenceKind,
    IdentityRevoked,
    IncompleteSnapshot,
    LeaseLost,
    OutcomeUnknown,
    Provider,
    ProviderFactory,
    RegistrationRecord,
    RegistrationRejected,
    binding_names,
    validate_provider_block,
)

from .conftest import make_context


def settings_of(**values: object) -> EtcdSettings:
    return EtcdSettings.model_validate(values)


def b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def value(document: object) -> str:
    return b64(json.dumps(document))


# ---------------------------------------------------------------------- wire


def test_omitted_zero_values_decode_as_zero() -> None:
    answer = decode(RangeResponse, b'{"header":{"revision":"7"}}')
    assert (answer.header.revision, answer.kvs, answer.more, answer.count) == (7, (), False, 0)
    line = decode(
        WatchLine,
        b'{"result":{"header":{"revision":"9"},"events":[{"kv":{"key":"YQ==",'
        b'"mod_revision":"9"}},{"type":"DELETE","kv":{"key":"Yg=="}}]}}',
    )
    assert line.result is not None
    put, delete = line.result.events
    assert (put.type, put.kv.key, put.kv.value, put.kv.lease) == ("PUT", b"a", "", 0)
    assert (delete.type, delete.kv.key, delete.kv.mod_revision) == ("DELETE", b"b", 0)
    assert not line.result.is_progress
    progress = decode(WatchResponse, b'{"header":{"revision":"12"}}')
    assert progress.is_progress


def test_a_key_that_is_not_base64_makes_the_body_unreadable() -> None:
    with pytest.raises(WireError, match="base64"):
        decode(KeyValue, b'{"key":"!!!"}')


def test_prefix_range_end() -> None:
    assert prefix_range_end(b"services/orders/") == b"services/orders0"
    assert prefix_range_end(b"a\xff") == b"b"
    assert prefix_range_end(b"\xff\xff") == b"\x00"


def test_cancel_reasons_and_error_bodies_are_classified() -> None:
    denied = GatewayStatus.from_cancel_reason(
        "rpc error: code = PermissionDenied desc = etcdserver: permission denied"
    )
    assert denied.permission_denied and denied.code == 7
    stale = GatewayStatus.from_cancel_reason(
        "rpc error: code = Unauthenticated desc = etcdserver: invalid auth token"
    )
    assert stale.token_expired
    missing = GatewayStatus.from_cancel_reason(
        "rpc error: code = InvalidArgument desc = etcdserver: user name is empty"
    )
    assert missing.credentials_missing and not missing.permission_denied
    assert GatewayStatus.of(5, "etcdserver: requested lease not found").lease_not_found
    assert GatewayStatus.of(14, "etcdserver: request timed out").outcome_unknown


def test_line_buffer_splits_and_bounds_lines() -> None:
    lines = LineBuffer(10)
    assert lines.feed(b'{"a"') == []
    assert lines.feed(b':1}\n\n{"b":2}\n{"c"') == [b'{"a":1}', b'{"b":2}']
    assert lines.feed(b":3}\n") == [b'{"c":3}']
    with pytest.raises(CapacityRejected):
        lines.feed(b"x" * 11)  # an unfinished line already over the limit
    with pytest.raises(CapacityRejected):
        LineBuffer(10).feed(b"y" * 11 + b"\n")


# -------------------------------------------------------------- record codec


def test_layout_names_instances_under_the_service_only() -> None:
    layout = Layout("services")
    assert layout.instance_key("orders", "i-1") == b"services/orders/i-1"
    assert layout.instance_id("orders", b"services/orders/i-1") == "i-1"
    assert layout.instance_id("orders", b"services/orders/") is None
    assert layout.instance_id("orders", b"services/orders-x/i") is None
    # Nested keys belong to every enclosing prefix, as with gRPC's etcd resolver.
    assert layout.instance_id("orders", b"services/orders/eu/i-1") == "eu/i-1"
    assert layout.instance_id("orders/eu", b"services/orders/eu/i-1") == "i-1"
    assert layout.instance_id("orders", b"services/orders/\xff") is None
    assert Layout("").service_prefix("foo/bar") == b"foo/bar/"


def test_decode_accepts_what_grpc_writers_write() -> None:
    plain = decode_record("e1", value({"Addr": "1.2.3.4:50051"}), max_record_bytes=1024)
    assert (plain.host, plain.port, plain.weight, dict(plain.metadata)) == (
        "1.2.3.4",
        50051,
        1.0,
        {},
    )
    rich = decode_record(
        "e2",
        value(
            {
                "Op": 0,
                "Addr": "[fe80::1]:80",
                "Metadata": {"weight": "2.5", "tags": ["a"], "n": 3, "s": "t"},
            }
        ),
        max_record_bytes=1024,
    )
    assert (rich.host, rich.port, rich.weight, rich.tags) == ("fe80::1", 80, 2.5, ("a",))
    assert dict(rich.metadata) == {"n": "3", "s": "t"}


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        ("%%%", "base64"),
        (b64(""), "empty"),
        (b64("{nope"), "JSON"),
        (b64("\xff"), "JSON"),
        # Strict JSON only: no NaN/Infinity tokens, no number beyond a float.
        (b64('{"Addr": "h:1", "Metadata": {"x": NaN}}'), "JSON"),
        (b64('{"Addr": "h:1", "Metadata": {"weight": 1e400}}'), "JSON"),
        (value([1]), "object"),
        (value({"Op": 1, "Addr": "a:1"}), "Op"),
        (value({"Op": True, "Addr": "a:1"}), "Op"),
        (value({"Addr": 5}), "Addr"),
        (value({"Addr": "host"}), "host:port"),
        (value({"Addr": "host:0"}), "port"),
        (value({"Addr": "host:99999"}), "port"),
        # Digits str.isdigit() admits and int() refuses (not a ValueError escaping).
        (value({"Addr": "host:\u00b2"}), "port"),
        (value({"Addr": "host:\u0661"}), "port"),
        (value({"Addr": "[]:80"}), "empty host"),
        (value({"Addr": ":80"}), "host:port"),
        (value({"Addr": "::1:80"}), "bracketed"),
        (value({"Addr": "h:1", "Metadata": {"weight": 0}}), "weight"),
        (value({"Addr": "h:1", "Metadata": {"weight": True}}), "weight"),
        (value({"Addr": "h:1", "Metadata": {"weight": "NaN"}}), "weight"),
        (value({"Addr": "h:1", "Metadata": {"tags": "x"}}), "tags"),
        (value({"Addr": "h:1", "Metadata": {"x": "y" * 300}}), "max_record_bytes"),
    ],
)
def test_malformed_records_say_why(raw: str, reason: str) -> None:
    with pytest.raises(RecordError, match=reason):
        decode_record("id", raw, max_record_bytes=256)


hosts = st.one_of(
    # DNS names (labels neither start nor end with "-"; the last is not all digits).
    st.from_regex(
        r"[a-z]([a-z0-9-]{0,18}[a-z0-9])?(\.[a-z]([a-z0-9-]{0,8}[a-z0-9])?){0,3}", fullmatch=True
    ),
    st.ip_addresses().map(str),
)


@given(
    host=hosts,
    port=st.integers(1, 65535),
    weight=st.floats(min_value=0.001, max_value=1e6),
    tags=st.lists(st.text(max_size=5), max_size=3).map(tuple),
    metadata=st.dictionaries(
        st.text(min_size=1, max_size=5).filter(lambda k: k not in ("weight", "tags")),
        st.text(max_size=8),
        max_size=3,
    ),
)
def test_encode_then_decode_round_trips(
    host: str, port: int, weight: float, tags: tuple[str, ...], metadata: dict[str, str]
) -> None:
    mine = RegistrationRecord(
        registration="r",
        service="s",
        instance_id="i",
        host=host,
        port=port,
        weight=weight,
        tags=tags,
        metadata=metadata,
    )
    encoded = encode_record(mine)
    assert encoded == encode_record(mine)  # deterministic: check() compares bytes
    back = decode_record("i", b64(encoded), max_record_bytes=65536)
    assert (back.host, back.port, back.weight, back.tags) == (host, port, weight, tags)
    assert dict(back.metadata) == metadata


# ---------------------------------------------------------- sans-IO watch state


def kv(key: str, mod: int, addr: str | None = "10.0.0.1:80") -> KeyValue:
    raw = value({"Op": 0, "Addr": addr}) if addr else b64("junk")
    return KeyValue(key=key.encode(), mod_revision=mod, value=raw)


def events(revision: int, *items: tuple[str, KeyValue]) -> WatchResponse:
    return WatchResponse(
        header=ResponseHeader(revision=revision),
        events=tuple(Event(type=kind, kv=item) for kind, item in items),  # type: ignore[arg-type]
    )


def new_state(max_instances: int = 100) -> ServiceState:
    return ServiceState("orders", Layout("p"), max_record_bytes=1024, max_instances=max_instances)


def test_events_of_one_transaction_all_apply_and_replays_are_ignored() -> None:
    state = new_state()
    state.reset([kv("p/orders/a", 3)], 5)
    txn = events(6, ("PUT", kv("p/orders/b", 6)), ("PUT", kv("p/orders/c", 6)))
    assert state.apply(txn)
    assert state.snapshot().identities() == ("a", "b", "c")
    assert state.revision == 6
    # A resumed stream may repeat what we applied: nothing changes.
    assert not state.apply(events(6, ("DELETE", kv("p/orders/b", 6))))
    assert not state.apply(events(7, ("DELETE", kv("p/orders/zz", 7))))
    assert state.revision == 7
    assert state.apply(events(8, ("PUT", kv("p/orders/a", 8, None))))
    snapshot = state.snapshot()
    assert snapshot.identities() == ("b", "c")
    assert set(snapshot.invalid) == {"p/orders/a"}
    assert snapshot.evidence is EvidenceKind.LEASE


def test_probe_verdicts_confirm_lag_and_stall() -> None:
    state = new_state()
    state.reset([kv("p/orders/a", 3)], 5)
    assert state.judge_probe(9, [kv("p/orders/a", 3)]) is ProbeVerdict.CONFIRMED
    newer = [kv("p/orders/a", 3), kv("p/orders/b", 8)]
    assert state.judge_probe(9, newer) is ProbeVerdict.LAGGING
    # Events up to 8 arrived: the next probe sees the same listing.
    state.apply(events(8, ("PUT", kv("p/orders/b", 8))))
    assert state.judge_probe(10, newer) is ProbeVerdict.CONFIRMED
    # A probe sees a change the stream never delivers, twice: stalled.
    newest = [*newer, kv("p/orders/c", 11)]
    assert state.judge_probe(12, newest) is ProbeVerdict.LAGGING
    assert state.judge_probe(13, newest) is ProbeVerdict.STALLED
    # A deletion the stream has not delivered is a lag too.
    fresh = new_state()
    fresh.reset([kv("p/orders/a", 3)], 5)
    assert fresh.judge_probe(6, []) is ProbeVerdict.LAGGING
    fresh.apply(events(6, ("DELETE", kv("p/orders/a", 6))))
    assert fresh.judge_probe(7, []) is ProbeVerdict.CONFIRMED


def test_a_progress_notification_advances_the_resume_point() -> None:
    state = new_state()
    state.reset([], 5)
    state.progress(40)
    state.progress(30)
    assert state.revision == 40


def test_too_many_valid_instances_is_capacity_rejected_invalid_ones_do_not_count() -> None:
    state = new_state(max_instances=1)
    state.reset([kv("p/orders/a", 2), kv("p/orders/b", 3, None)], 3)
    assert state.snapshot().identities() == ("a",)
    state.apply(events(4, ("PUT", kv("p/orders/c", 4))))
    with pytest.raises(CapacityRejected, match="max_instances_per_service=1"):
        state.snapshot()


@given(seed=st.integers(0, 2**32), steps=st.integers(1, 40))
def test_backoff_stays_between_half_the_cap_and_the_cap(seed: int, steps: int) -> None:
    backoff = Backoff(0.5, 8.0, random.Random(seed))
    cap = 0.5
    for _ in range(steps):
        delay = backoff.next_delay()
        assert cap / 2 <= delay <= cap
        cap = min(8.0, cap * 2)
    backoff.reset()
    assert backoff.next_delay() <= 0.5


# ------------------------------------------------------------------ settings


def test_settings_hide_the_password_and_reject_bad_input() -> None:
    settings = settings_of(endpoints=["http://127.0.0.1:2379/"], username="u", password="hunter2")
    assert settings.endpoints == ("http://127.0.0.1:2379",)
    assert "hunter2" not in repr(settings) and "hunter2" not in settings.model_dump_json()
    assert "'u'" not in repr(settings)
    with pytest.raises(pydantic.ValidationError, match="together"):
        settings_of(endpoints=["http://x:1"], username="u")
    with pytest.raises(pydantic.ValidationError, match="http"):
        settings_of(endpoints=["ftp://x:1"])
    with pytest.raises(pydantic.ValidationError, match="credentials"):
        settings_of(endpoints=["http://u:p@x:1"])
    with pytest.raises(pydantic.ValidationError, match="duplicate"):
        settings_of(endpoints=["http://x:1", "http://x:1/"])
    with pytest.raises(pydantic.ValidationError, match="extra"):
        EtcdSettings.model_validate({"endpoints": ["http://x:1"], "namespace": "n"})
    with pytest.raises(pydantic.ValidationError, match="'/'"):
        settings_of(endpoints=["http://x:1"], prefix="/services")
    with pytest.raises(pydantic.ValidationError, match="retry_max_backoff_ms"):
        settings_of(endpoints=["http://x:1"], retry_initial_backoff_ms=10, retry_max_backoff_ms=5)
    bound = EtcdSettings.model_validate(
        {
            "endpoints": ("http://x:1",),
            "services": {"orders": {"name": "order-worker"}, "self": {}},
        }
    )
    assert bound.remote_name("orders") == "order-worker"
    assert bound.remote_name("self") == "self"  # name defaults to the alias


@pytest.mark.parametrize(
    "endpoint",
    [
        "ftp://root:hunter2@etcd:2379",
        "http://root:hunter2@etcd:2379",
        "http://:hunter2@etcd:2379",
        "http://etcd:2379/hunter2",
        "http://etcd:2379/?token=hunter2",
        "hunter2",
    ],
)
def test_a_rejected_endpoint_is_never_echoed(endpoint: str) -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        settings_of(endpoints=["http://ok:1", endpoint])
    assert "endpoints[1]" in str(info.value)
    assert "hunter2" not in str(info.value) and "hunter2" not in repr(info.value)


def test_a_rejected_password_or_field_is_never_echoed() -> None:
    with pytest.raises(pydantic.ValidationError) as info:
        EtcdSettings.model_validate(
            {"endpoints": ["http://x:1"], "password": ["hunter2"], "ttl_seconds": "hunter2"}
        )
    assert "hunter2" not in str(info.value)
    settings = settings_of(endpoints=["http://x:1"], username="u", password="hunter2")
    assert "hunter2" not in str(settings) and "hunter2" not in repr(settings)


def test_the_config_documents_provider_block_validates() -> None:
    config = DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {
                "primary": {
                    "provider": "etcd",
                    "etcd": {
                        "endpoints": ["http://10.0.0.10:2379"],
                        "username": "svc-orders",
                        "password": "pw",
                        "services": {"self": {"name": "order-api"}, "orders": {}},
                    },
                }
            },
        }
    )
    connection = config.connections["primary"]
    settings = validate_provider_block("primary", connection, EtcdSettings)
    assert isinstance(settings, EtcdSettings)
    assert settings.password is not None and settings.password.get_secret_value() == "pw"
    assert {a: settings.remote_name(a) for a in settings.services} == binding_names(connection)
    bad = DiscoveryConfig.model_validate(
        {
            "enabled": True,
            "connections": {"primary": {"provider": "etcd", "etcd": {"endpoints": ["ftp://x"]}}},
        }
    )
    with pytest.raises(ConfigError) as caught:
        validate_provider_block("primary", bad.connections["primary"], EtcdSettings)
    assert caught.value.path == "discovery.connections.primary.etcd.endpoints"


class Other(pydantic.BaseModel):
    endpoints: list[str] = []


def test_the_entry_point_names_the_factory() -> None:
    [entry] = importlib.metadata.entry_points(group="nadisc.providers", name="etcd")
    assert entry.load() is factory
    assert factory.name == "etcd" and factory.settings_model is EtcdSettings
    provider = factory.create(make_context(), settings_of(endpoints=["http://x:1"]))
    caps = provider.capabilities
    assert (caps.evidence, caps.registration, caps.watch_streams, caps.idempotent_renewal) == (
        EvidenceKind.LEASE,
        True,
        1,
        True,
    )
    # Keepalives are due within a third of the lease TTL (15 s by default).
    assert caps.renew_within == 5.0
    short = factory.create(make_context(), settings_of(endpoints=["http://x:1"], ttl_seconds=3))
    assert short.capabilities.renew_within == 1.0
    # Both satisfy nadisc's protocols (checked by mypy).
    as_factory: ProviderFactory = factory
    as_provider: Provider = provider
    assert as_factory.name == "etcd" and as_provider.capabilities == caps
    with pytest.raises(ConfigError, match=r"connections\.test\.etcd"):
        factory.create(make_context(), Other())


# ------------------------------------------------- client error translation

Handler = Callable[[httpx.Request], httpx.Response]


def client_with(handler: Handler, **settings: object) -> EtcdClient:
    values: dict[str, object] = {"endpoints": ["http://a:1"]}
    values.update(settings)
    return EtcdClient(
        EtcdSettings.model_validate(values),
        request_timeout=1.0,
        max_response_bytes=4096,
        transport=httpx.MockTransport(handler),
    )


class Body(httpx.AsyncByteStream):
    """A response body delivered in one chunk, streamed (not pre-read)."""

    def __init__(self, data: bytes) -> None:
        self._data: bytes | None = data

    def __aiter__(self) -> Body:
        return self

    async def __anext__(self) -> bytes:
        if self._data is None:
            raise StopAsyncIteration
        data, self._data = self._data, None
        return data


def reply(status: int, payload: object = None, *, raw: bytes | None = None) -> httpx.Response:
    data = raw if raw is not None else json.dumps(payload).encode()
    return httpx.Response(status, stream=Body(data))


def error(status: int, code: int, message: str) -> httpx.Response:
    return reply(status, {"error": message, "message": message, "code": code})


def soon() -> float:
    return anyio.current_time() + 5


async def test_server_errors_become_typed_outcomes() -> None:
    answers = {
        "/v3/kv/range": error(403, 7, "etcdserver: permission denied"),
        "/v3/kv/put": error(503, 14, "etcdserver: request timed out"),
        "/v3/kv/deleterange": error(400, 3, "etcdserver: key is not provided"),
        "/v3/lease/revoke": error(404, 5, "etcdserver: requested lease not found"),
        "/v3/lease/grant": error(404, 5, "etcdserver: requested lease not found"),
    }
    client = client_with(lambda request: answers[request.url.path])
    with pytest.raises(IdentityRevoked, match="permission denied"):
        await client.range(b"k", None, deadline=soon())
    with pytest.raises(OutcomeUnknown, match="timed out"):
        await client.put(b"k", b"v", lease=0, deadline=soon())
    with pytest.raises(RegistrationRejected, match="key is not provided"):
        await client.delete_range(b"k", deadline=soon())
    with pytest.raises(LeaseLost):
        await client.lease_grant(5, deadline=soon())
    assert await client.lease_revoke(7, deadline=soon()) is False
    await client.aclose()


async def test_undecodable_and_oversized_bodies() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v3/kv/range":
            return reply(200, raw=b'{"kvs":[{"key":"%%"}]}')
        if request.url.path == "/v3/kv/put":
            return reply(200, raw=b"not json")
        return reply(200, raw=b"x" * 5000)

    client = client_with(handler)
    with pytest.raises(IncompleteSnapshot, match="undecodable") as caught:
        await client.range(b"k", None, deadline=soon())
    assert isinstance(caught.value.__cause__, WireError)
    with pytest.raises(OutcomeUnknown, match="undecodable"):
        await client.put(b"k", b"v", lease=0, deadline=soon())
    with pytest.raises(CapacityRejected, match="max_response_bytes=4096"):
        await client.status(deadline=soon())
    await client.aclose()


async def test_transport_errors_on_reads_and_writes() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        raise httpx.ReadError("connection reset", request=request)

    client = client_with(handler)
    with pytest.raises(IncompleteSnapshot, match="ReadError") as caught:
        await client.range(b"k", None, deadline=soon())
    assert isinstance(caught.value.__cause__, httpx.ReadError)
    with pytest.raises(OutcomeUnknown, match="ReadError"):
        await client.lease_keepalive(5, deadline=soon())
    await client.aclose()


async def test_a_refused_connection_fails_over_to_the_next_endpoint() -> None:
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.host)
        if request.url.host == "a":
            raise httpx.ConnectError("refused", request=request)
        return reply(200, {"header": {"revision": "3"}})

    client = client_with(handler, endpoints=["http://a:1", "http://b:1"])
    answer = await client.range(b"k", None, deadline=soon())
    assert answer.header.revision == 3
    await client.range(b"k", None, deadline=soon())
    assert seen == ["a", "b", "b"]  # the working endpoint is remembered
    assert client.endpoint == "http://b:1"
    await client.aclose()


async def test_the_token_is_sent_bare_and_refreshed_once() -> None:
    tokens = iter(["tok.1", "tok.2", "tok.3"])
    sent: list[str | None] = []
    valid = {"tok.2"}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v3/auth/authenticate":
            body = json.loads(request.content)
            assert body == {"name": "app", "password": "pw"}
            assert "authorization" not in request.headers
            return reply(200, {"token": next(tokens)})
        sent.append(request.headers.get("authorization"))
        if request.headers.get("authorization") in valid:
            return reply(200, {})
        return error(401, 16, "etcdserver: invalid auth token")

    client = client_with(handler, username="app", password="pw")
    await client.range(b"k", None, deadline=soon())
    assert sent == ["tok.1", "tok.2"]  # no "Bearer"; one refresh
    valid.clear()
    with pytest.raises(IdentityRevoked, match="invalid auth token") as caught:
        await client.range(b"k", None, deadline=soon())
    assert "pw" not in str(caught.value)
    assert sent[2:] == ["tok.2", "tok.3"]  # refreshed once more, then reported
    assert client.counters.authentications == 3
    await client.aclose()


async def test_a_keepalive_without_ttl_means_the_lease_is_gone() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        lease = json.loads(request.content)["ID"]
        ttl = ',"TTL":"4"' if lease == "1" else ""
        return reply(200, raw=f'{{"result":{{"ID":"{lease}"{ttl}}}}}\n'.encode())

    client = client_with(handler)
    assert await client.lease_keepalive(1, deadline=soon()) == 4
    assert await client.lease_keepalive(2, deadline=soon()) == 0
    await client.aclose()


async def test_provider_watch_reports_a_permission_cancel_as_revoked(
    autojump_clock: object,
) -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v3/kv/range":
            return reply(200, {"header": {"revision": "4"}})
        reason = "rpc error: code = PermissionDenied desc = etcdserver: permission denied"
        line = {"result": {"created": True, "canceled": True, "cancel_reason": reason}}
        return reply(200, raw=json.dumps(line).encode() + b"\n")

    settings = settings_of(endpoints=["http://a:1"], retry_initial_backoff_ms=10)
    provider = EtcdProvider(make_context(), settings, transport=httpx.MockTransport(handler))
    failures: list[Exception] = []
    failed = anyio.Event()

    class Sink:
        def publish(self, snapshot: object) -> None:
            pass

        def fail(self, failure: Exception) -> None:
            failures.append(failure)
            failed.set()

        def refresh(self) -> None:
            pass

    with anyio.fail_after(5):
        async with anyio.create_task_group() as nursery:
            await nursery.start(provider.watch, "orders", Sink())
            await failed.wait()
            nursery.cancel_scope.cancel()
    assert isinstance(failures[0], IdentityRevoked)
    await provider.aclose()


def registration_transport(put_fails: bool, revoke_fails: bool) -> httpx.MockTransport:
    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v3/lease/grant":
            return reply(200, {"ID": "77", "TTL": "10"})
        if (path == "/v3/kv/put" and put_fails) or (path == "/v3/lease/revoke" and revoke_fails):
            raise httpx.ReadError("connection reset", request=request)
        return reply(200, {"header": {"revision": "5"}})

    return httpx.MockTransport(handler)


def a_record() -> RegistrationRecord:
    return RegistrationRecord(
        registration="web", service="orders", instance_id="i-1", host="10.0.0.1", port=80
    )


async def test_a_lost_put_answer_is_resolved_by_revoking_its_lease() -> None:
    settings = settings_of(endpoints=["http://a:1"])
    provider = EtcdProvider(
        make_context(),
        settings,
        transport=registration_transport(put_fails=False, revoke_fails=False),
    )
    registered = await provider.register(a_record(), soon())
    assert registered.handle == "77"
    await provider.aclose()

    resolved = EtcdProvider(
        make_context(),
        settings,
        transport=registration_transport(put_fails=True, revoke_fails=False),
    )
    with pytest.raises(IncompleteSnapshot, match="cannot take effect") as caught:
        await resolved.register(a_record(), soon())
    assert isinstance(caught.value.__cause__, OutcomeUnknown)
    await resolved.aclose()

    unknown = EtcdProvider(
        make_context(),
        settings,
        transport=registration_transport(put_fails=True, revoke_fails=True),
    )
    with pytest.raises(OutcomeUnknown):
        await unknown.register(a_record(), soon())
    await unknown.aclose()


# ------------------------------------------- resume: no event lost, none twice


@st.composite
def histories(draw: st.DrawFn) -> tuple[list[tuple[int, str, str | None]], int, list[int]]:
    """A key history (revision, key, addr-or-None for delete), the revision of
    the first range, and the revisions at which the stream broke."""
    keys = [f"p/orders/k{n}" for n in range(4)]
    steps = draw(
        st.lists(
            st.tuples(
                st.sampled_from(keys),
                st.one_of(st.none(), st.integers(1, 9).map(lambda p: f"10.0.0.{p}:80")),
                st.booleans(),  # shares the next revision (one transaction)
            ),
            min_size=1,
            max_size=25,
        )
    )
    history: list[tuple[int, str, str | None]] = []
    revision = 1
    for key, addr, same_txn in steps:
        if not (same_txn and history and history[-1][1] != key):
            revision += 1
        history.append((revision, key, addr))
    start = draw(st.integers(1, revision))
    breaks = draw(st.lists(st.integers(start, revision), max_size=4).map(sorted))
    return history, start, breaks


def state_at(history: list[tuple[int, str, str | None]], revision: int) -> dict[str, int]:
    live: dict[str, int] = {}
    for rev, key, addr in history:
        if rev > revision:
            break
        if addr is None:
            live.pop(key, None)
        else:
            live[key] = rev
    return live


@given(histories())
def test_resumed_streams_lose_no_event_and_apply_none_twice(
    case: tuple[list[tuple[int, str, str | None]], int, list[int]],
) -> None:
    history, start, breaks = case
    final = history[-1][0]
    state = new_state()
    state.reset([kv(key, rev) for key, rev in state_at(history, start).items()], start)

    def responses(after: int) -> list[WatchResponse]:
        # What a watch from ``after + 1`` delivers: one response per revision.
        by_revision: dict[int, list[tuple[str, KeyValue]]] = {}
        for rev, key, addr in history:
            if rev > after:
                kind = "DELETE" if addr is None else "PUT"
                by_revision.setdefault(rev, []).append((kind, kv(key, rev)))
        return [events(rev, *items) for rev, items in sorted(by_revision.items())]

    # The stream breaks at each point; the server may also repeat a response
    # the client had applied just before the break (the answer raced the break).
    for point in breaks:
        for response in responses(state.revision):
            if response.header.revision > point:
                break
            state.apply(response)
        for response in responses(max(start, state.revision - 1)):
            state.apply(response)  # replays at or below revision are ignored
            break
    for response in responses(state.revision):
        state.apply(response)

    assert state.revision == max(final, start)
    expected = sorted(key.rsplit("/", 1)[1] for key in state_at(history, final))
    assert list(state.snapshot().identities()) == expected
    assert (
        state.judge_probe(final, [kv(key, rev) for key, rev in state_at(history, final).items()])
        is ProbeVerdict.CONFIRMED
    )


def test_the_provider_runs_on_asyncio_too() -> None:
    records = {"p/orders/a": value({"Op": 0, "Addr": "10.0.0.1:80"})}

    def handler(request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/v3/kv/range":
            kvs = [{"key": b64(k), "value": v, "mod_revision": "2"} for k, v in records.items()]
            return reply(200, {"header": {"revision": "3"}, "kvs": kvs})
        if path == "/v3/lease/grant":
            return reply(200, {"ID": "9", "TTL": "15"})
        if path == "/v3/lease/keepalive":
            return reply(200, raw=b'{"result":{"ID":"9","TTL":"15"}}\n')
        return reply(200, {"header": {"revision": "4"}})

    async def scenario() -> tuple[tuple[str, ...], str]:
        provider = EtcdProvider(
            make_context(),
            settings_of(endpoints=["http://a:1"], prefix="p"),
            transport=httpx.MockTransport(handler),
        )
        snapshot = await provider.query("orders", anyio.current_time() + 5)
        registered = await provider.register(a_record(), anyio.current_time() + 5)
        await provider.renew(registered, anyio.current_time() + 5)
        await provider.aclose()
        return snapshot.identities(), registered.handle

    assert anyio.run(scenario, backend="asyncio") == (("a",), "9")


async def test_request_bodies_are_sent_without_an_async_generator() -> None:
    # A send cut off half-way (the server died) must leave nothing for the
    # garbage collector to finalize: the body is a plain iterator object.
    body = _Body(b'{"key":"YQ=="}')
    chunks = body.__aiter__()
    assert not inspect.isasyncgen(chunks)
    assert [chunk async for chunk in chunks] == [b'{"key":"YQ=="}']
    assert [chunk async for chunk in body] == [b'{"key":"YQ=="}']  # fresh each time


# ------------------------------------------------------------- range pages


def test_page_size_follows_the_byte_limit_and_the_instance_limit() -> None:
    # the whole listing in one page when it fits the page budget
    assert page_size(64 * 2**20, 300, 4096) == 4097
    # a smaller response limit: half of it at the estimated record size
    assert page_size(64 * 1024, 256, 4096) == 128
    # never below one record, whatever the records weigh
    assert page_size(4096, 1_000_000, 4096) == 1
    # the estimate of a page of records: base64 key and value text + framing
    page = (kv("p/orders/i1", 3), kv("p/orders/i2", 4))
    size = len(page[0].value) + (len(page[0].key) * 4 + 2) // 3 + 120
    assert record_bytes(page) == size


class RangeServer:
    """The gateway's ``/v3/kv/range`` over a fixed key set, as etcd answers it
    (api/etcdserverpb/rpc.proto RangeRequest: ``limit``, ``revision``,
    ``range_end``, ``count_only``; RangeResponse ``more`` and ``count`` of
    the whole range)."""

    def __init__(self, records: dict[bytes, str]) -> None:
        self.records = dict(sorted(records.items()))
        self.limits: list[int] = []
        self.revisions: list[int] = []

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        start = base64.b64decode(body["key"])
        end = base64.b64decode(body["range_end"])
        limit = int(body.get("limit", 0))
        self.limits.append(limit)
        self.revisions.append(int(body.get("revision", 0)))
        keys = [k for k in self.records if start <= k < end]
        page = [] if body.get("count_only") else keys[:limit] if limit else keys
        kvs = [{"key": b64(k), "value": self.records[k], "mod_revision": "9"} for k in page]
        payload = {
            "header": {"revision": "9"},
            "kvs": kvs,
            "more": len(page) < len(keys),
            "count": str(len(keys)),
        }
        return reply(200, payload)


def range_provider(server: RangeServer, max_response_bytes: int) -> EtcdProvider:
    return EtcdProvider(
        make_context(max_response_bytes=max_response_bytes),
        settings_of(endpoints=["http://a:1"], prefix="p", max_record_bytes=8192),
        transport=httpx.MockTransport(server.handle),
    )


def addr_value(n: int, pad: int = 0) -> str:
    return value(
        {"Op": 0, "Addr": f"10.1.{n // 250}.{n % 250 + 1}:80", "Metadata": {"p": "x" * pad}}
    )


async def test_a_listing_that_fits_is_one_request() -> None:
    server = RangeServer({f"p/orders/i{n:04d}".encode(): addr_value(n) for n in range(300)})
    provider = range_provider(server, 4 * 2**20)
    snapshot = await provider.query("orders", soon())
    assert len(snapshot.instances) == 300
    assert len(server.limits) == 1
    await provider.aclose()


async def test_pages_follow_the_byte_limit_at_one_revision() -> None:
    server = RangeServer({f"p/orders/i{n:04d}".encode(): addr_value(n) for n in range(300)})
    provider = range_provider(server, 64 * 1024)
    snapshot = await provider.query("orders", soon())
    assert len(snapshot.instances) == 300
    # first page at the default estimate (1 KiB a record), the next ones at
    # the measured size: far fewer than 300 / 32 requests
    assert server.limits[0] == 32
    assert all(limit > 32 for limit in server.limits[1:])
    assert 2 <= len(server.limits) <= 4
    # every later page read at the first page's revision
    assert server.revisions == [0] + [9] * (len(server.limits) - 1)
    await provider.aclose()


async def test_records_larger_than_estimated_are_asked_again_in_smaller_pages() -> None:
    server = RangeServer(
        {f"p/orders/i{n:04d}".encode(): addr_value(n, pad=3000) for n in range(40)}
    )
    provider = range_provider(server, 64 * 1024)
    snapshot = await provider.query("orders", soon())
    assert len(snapshot.instances) == 40
    # 32 records of ~4 KiB exceed the 64 KiB limit: refused, then smaller pages
    assert server.limits[0] == 32
    assert server.limits[1] < 32
    await provider.aclose()


# ------------------------------------------------------------- shared leases


def test_a_lease_is_shared_until_full_and_revoked_with_its_last_key() -> None:
    pool = LeasePool(renew_within=5.0, group=3)
    assert pool.joinable() is None
    lease = pool.granted(11, now=0.0)
    for key in (b"a", b"b", b"c"):
        assert pool.joinable() is lease
        assert pool.attach(lease, key) is None
    assert pool.joinable() is None  # full: the next registration grants one
    other = pool.granted(12, now=1.0)
    # a key put again on another lease leaves the first one
    assert pool.attach(other, b"a") is None
    assert lease.keys == {b"b", b"c"}
    assert not pool.detach(11, b"b")
    assert pool.detach(11, b"c")  # the last key: revoke it
    assert pool.get(11) is None and len(pool) == 1


def test_a_lost_lease_takes_every_key_and_is_never_joined() -> None:
    pool = LeasePool(renew_within=5.0)
    lease = pool.granted(7, now=0.0)
    pool.attach(lease, b"a")
    pool.attach(lease, b"b")
    pool.lost(7)
    assert pool.is_lost(7) and pool.alive(7, 0.0) == -1
    assert pool.joinable() is None
    fresh = pool.granted(8, now=1.0)
    # the owner registers each again on the new lease; the lost one empties
    assert pool.attach(fresh, b"a") is None
    assert pool.attach(fresh, b"b") is None
    assert pool.get(7) is None and fresh.keys == {b"a", b"b"}


@settings(max_examples=200, deadline=None)
@given(
    periods=st.lists(st.floats(min_value=0.05, max_value=1.0), min_size=1, max_size=12),
    offsets=st.lists(st.floats(min_value=0.0, max_value=1.0), min_size=12, max_size=12),
    took=st.floats(min_value=0.0, max_value=0.2),
)
def test_shared_keepalives_stay_within_the_renewal_window(
    periods: list[float], offsets: list[float], took: float
) -> None:
    """Registrations on one lease renew at their own periods (each at most
    ``renew_within``, 1.0 here); the keepalives actually sent (the grant
    counts as one) are never further apart than ``renew_within + fresh``
    (1.25: a third of the TTL plus a quarter of that, so one keepalive may
    be lost before the lease lapses at 3.0)."""
    pool = LeasePool(renew_within=1.0)
    pool.granted(1, now=0.0)
    calls = sorted(
        (offset * period + n * period, i)
        for i, (period, offset) in enumerate(zip(periods, offsets, strict=False))
        for n in range(int(20 / period) + 1)
    )
    sent = [0.0]
    for at, _ in calls:
        if at > 20:
            break
        if pool.keepalive_due(1, at):
            sent.append(at)
            pool.kept(1, at, ttl=3)
    gaps = [b - a for a, b in itertools.pairwise(sent)]
    assert max(gaps, default=0.0) <= 1.0 + pool.fresh + 1e-9
    # and far fewer than one per call when many registrations share it
    assert len(sent) <= 20 / pool.fresh + 2


@pytest.mark.parametrize("outcome", ["cancelled", "answered", "lost"])
async def test_a_shared_request_whose_sender_stopped_waiting_is_no_answer(outcome: str) -> None:
    """Callers that join an in-flight keepalive get its answer, or its failure;
    when its sender is cancelled (its deadline passed while the server hung)
    they get a transient failure, never the default "TTL 0", which reads as
    the lease gone and re-registers on a lease the server still holds."""

    def handler(request: httpx.Request) -> httpx.Response:
        raise AssertionError("no request is sent here")

    provider = EtcdProvider(
        make_context(),
        settings_of(endpoints=["http://a:1"]),
        transport=httpx.MockTransport(handler),
    )
    flights: dict[object, object] = {}
    release = anyio.Event()
    later = anyio.current_time() + 3600

    async def call() -> int:
        await release.wait()
        if outcome == "lost":
            raise LeaseLost("lease 7 expired or was revoked")
        return 30

    got: dict[str, object] = {}

    async def caller(name: str) -> None:
        try:
            got[name] = await provider._single_flight(flights, 7, name, later, call)  # type: ignore[arg-type]
        except Exception as exc:
            got[name] = exc

    sender = anyio.CancelScope()

    async def leader() -> None:
        with sender:
            await caller("leader")

    async with anyio.create_task_group() as group:
        group.start_soon(leader)
        await anyio.wait_all_tasks_blocked()
        group.start_soon(caller, "joiner")
        await anyio.wait_all_tasks_blocked()
        if outcome == "cancelled":
            sender.cancel()
        else:
            release.set()
    joiner = got["joiner"]
    if outcome == "cancelled":
        assert "leader" not in got
        assert isinstance(joiner, IncompleteSnapshot), joiner
        assert "ended without an answer" in str(joiner)
    elif outcome == "answered":
        assert got == {"leader": 30, "joiner": 30}
    else:
        assert isinstance(got["leader"], LeaseLost) and isinstance(joiner, LeaseLost)
    assert not flights
