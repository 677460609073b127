"""Decoding Consul answers: shapes, classification of defects, limits."""

from __future__ import annotations

import json
import random
from typing import Any

import anyio
import anyio.lowlevel
import msgspec
import pytest
import trio
from hypothesis import given, settings
from hypothesis import strategies as st
from nadisc_consul import decode_health_service
from nadisc_consul._wire import (
    HealthDecoder,
    _Entry,
    decode_catalog_services,
    decode_health_service_cooperatively,
    decode_health_state,
    decode_health_state_cooperatively,
    format_duration,
    iter_json_array,
    parse_duration,
    parse_index,
    split_json_array,
)

from nadisc import (
    CapacityRejected,
    DiscoveryError,
    EvidenceKind,
    IncompleteSnapshot,
    Instance,
    InvalidSnapshot,
    ProviderSnapshot,
)


def entry(
    service_id: str = "web-1",
    *,
    node: str = "node-1",
    node_address: str = "10.0.0.1",
    address: str | None = "10.0.0.9",
    port: Any = 8080,
    name: str = "web",
    tags: Any = ("a",),
    meta: Any = None,
    weights: Any = None,
    statuses: tuple[str, ...] = ("passing", "passing"),
    node_meta: Any = None,
) -> dict[str, Any]:
    service: dict[str, Any] = {
        "ID": service_id,
        "Service": name,
        "Tags": list(tags) if isinstance(tags, tuple) else tags,
        "Address": address,
        "TaggedAddresses": {},
        "Meta": {"zone": "a"} if meta is None else meta,
        "Port": port,
        "Weights": {"Passing": 1, "Warning": 1} if weights is None else weights,
    }
    checks = [
        {
            "Node": node,
            "CheckID": f"c{i}",
            "Name": "n",
            "Status": s,
            "ServiceID": "",
            "ServiceName": "",
        }
        for i, s in enumerate(statuses)
    ]
    return {
        "Node": {
            "ID": "x",
            "Node": node,
            "Address": node_address,
            "Datacenter": "dc1",
            "TaggedAddresses": {},
            "Meta": {} if node_meta is None else node_meta,
        },
        "Service": service,
        "Checks": checks,
    }


def decode(entries: Any, **kwargs: Any):
    options: dict[str, Any] = {"service": "web", "max_instances": 4096}
    options.update(kwargs)
    return decode_health_service(json.dumps(entries).encode(), **options)


def test_healthy_entries_become_instances_with_weights_tags_meta() -> None:
    snapshot = decode(
        [entry(weights={"Passing": 7, "Warning": 1}, tags=("x", "y"), meta={"k": "v"})]
    )
    (instance,) = snapshot.instances
    assert snapshot.evidence is EvidenceKind.REGISTRY_HEALTH
    assert (instance.identity, instance.host, instance.port) == ("web-1", "10.0.0.9", 8080)
    assert instance.weight == 7.0
    assert instance.tags == ("x", "y")
    assert dict(instance.metadata) == {"k": "v"}
    assert dict(snapshot.invalid) == {}


def test_empty_service_address_falls_back_to_node_address() -> None:
    (instance,) = decode([entry(address="")]).instances
    assert instance.host == "10.0.0.1"


def _zones(snapshot: ProviderSnapshot) -> dict[str, str | None]:
    return {i.identity: i.metadata.get("zone") for i in snapshot.instances}


def test_the_zone_comes_from_node_meta_when_the_service_has_none() -> None:
    segment = {"consul-network-segment": ""}
    entries = [
        entry("w1", node="n1", meta={}, node_meta={**segment, "zone": "east"}),
        entry("w2", node="n2", meta={"k": "v"}, node_meta={**segment, "zone": "west"}),
        entry("w3", node="n3", meta={"zone": "own"}, node_meta={**segment, "zone": "west"}),
        entry("w4", node="n4", meta={}, node_meta=segment),
        entry("w5", node="n5", meta={}, node_meta={"zone": 7}),  # not Consul's shape: ignored
        entry("w6", node="n6", meta={}, node_meta={"rack": "zone"}),
    ]
    expected = {"w1": "east", "w2": "west", "w3": "own", "w4": None, "w5": None, "w6": None}
    body = json.dumps(entries).encode()
    options: dict[str, Any] = {"service": "web", "max_instances": 16}
    # The column path, the entry-by-entry path (an invalid entry forces it)
    # and the permissive reference agree.
    assert _zones(decode_health_service(body, **options)) == expected
    invalid = entry("bad", node="n9", port=0)
    mixed = json.dumps([*entries, invalid]).encode()
    assert _zones(decode_health_service(mixed, **options)) == expected
    assert _zones(reference(body, **options)) == expected
    (w2,) = (i for i in decode(entries).instances if i.identity == "w2")
    assert dict(w2.metadata) == {"k": "v", "zone": "west"}
    # Instances of nodes sharing one node meta share one metadata mapping.
    same = [entry(f"s{n}", node=f"m{n}", meta={}, node_meta={"zone": "z"}) for n in range(3)]
    first, *rest = decode(same).instances
    assert all(i.metadata is first.metadata for i in rest)


def test_null_tags_meta_and_missing_weights_are_empty_defaults() -> None:
    raw = entry()
    raw["Service"]["Tags"] = None
    raw["Service"]["Meta"] = None
    del raw["Service"]["Weights"]
    (instance,) = decode([raw]).instances
    assert instance.tags == () and dict(instance.metadata) == {} and instance.weight == 1.0


def test_any_non_passing_check_including_the_node_makes_an_entry_unhealthy() -> None:
    snapshot = decode(
        [
            entry("a", statuses=("critical", "passing")),  # serfHealth critical
            entry("b", statuses=("passing", "warning")),
            entry("c"),
        ]
    )
    assert snapshot.identities() == ("c",)
    assert dict(snapshot.invalid) == {}  # unhealthy is not invalid


def test_invalid_candidates_are_left_out_and_counted() -> None:
    snapshot = decode(
        [
            entry("ok"),
            entry("port", port=70000),
            entry("zero", port=0),
            entry("text-port", port="80"),
            entry("noaddr", address="", node_address=""),
            entry("weight", weights={"Passing": 0, "Warning": 1}),
            entry("tags", tags=[1]),
            entry("meta", meta={"k": 1}),
            entry("other", name="db"),
        ]
    )
    assert snapshot.identities() == ("ok",)
    assert set(snapshot.invalid) == {
        "node-1/port",
        "node-1/zero",
        "node-1/text-port",
        "node-1/noaddr",
        "node-1/weight",
        "node-1/tags",
        "node-1/meta",
        "node-1/other",
    }
    assert "out of range" in snapshot.invalid["node-1/port"]


def test_duplicate_service_ids_keep_the_first_and_count_the_rest() -> None:
    snapshot = decode([entry("web", node="n1"), entry("web", node="n2")])
    assert snapshot.identities() == ("web",)
    assert "duplicate service ID" in snapshot.invalid["n2/web"]
    by_node = decode([entry("web", node="n1"), entry("web", node="n2")], identity_scope="node")
    assert by_node.identities() == ("n1/web", "n2/web")
    assert dict(by_node.invalid) == {}


def test_only_invalid_candidates_is_an_invalid_snapshot() -> None:
    with pytest.raises(InvalidSnapshot, match="all 2 entries are invalid"):
        decode([entry("a", port=0), entry("b", port=-1)])


def test_empty_array_is_an_explicit_empty_listing() -> None:
    snapshot = decode([])
    assert snapshot.instances == () and dict(snapshot.invalid) == {}


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"null",
        b'{"Node": {}}',
        b"[1]",
        b'[{"Node": {"Node": "n"}}]',
        b'[{"Node": {"Node": "n"}, "Service": {"ID": "", "Port": 1}, "Checks": []}]',
        b'[{"Node": {"Node": "n"}, "Service": {"ID": "a"}, "Checks": {}}]',
        b'[{"Node": {"Node": "n"}, "Service": {"ID": "a"}, "Checks": [{"Status": 1}]}]',
        b"[" + b"{" * 3,
    ],
)
def test_wrong_shapes_are_incomplete(body: bytes) -> None:
    with pytest.raises(IncompleteSnapshot):
        decode_health_service(body, service="web", max_instances=10)


def test_more_entries_than_allowed_is_capacity() -> None:
    with pytest.raises(CapacityRejected, match="max_instances_per_service=2"):
        decode([entry("a"), entry("b"), entry("c")], max_instances=2)


def test_tag_filter_is_checked_again_client_side() -> None:
    snapshot = decode([entry("a", tags=("grpc",)), entry("b", tags=("http",))], tag="grpc")
    assert snapshot.identities() == ("a",)
    assert "requested tag" in snapshot.invalid["node-1/b"]


def test_service_names_compare_case_insensitively() -> None:
    assert decode([entry(name="Web")]).identities() == ("web-1",)


def test_index_header_parsing() -> None:
    assert parse_index("42", what="q") == 42
    assert parse_index(" 0 ", what="q") == 0
    for bad in (None, "", "-1", "abc", "1.5", str(2**64)):
        with pytest.raises(IncompleteSnapshot):
            parse_index(bad, what="q")


def test_durations_round_trip_in_go_syntax() -> None:
    assert format_duration(30) == "30s"
    assert format_duration(0.25) == "250ms"
    assert parse_duration("1m30s") == 90
    assert parse_duration(format_duration(12.5)) == 12.5
    with pytest.raises(ValueError):
        parse_duration("30")


def test_catalog_services_and_health_state_shapes() -> None:
    assert decode_catalog_services(b'{"a": ["x"], "b": null}') == {"a": ("x",), "b": ()}
    assert decode_health_state(b'[{"Status": "passing"}]') == 1
    for bad in (b"[]", b'{"a": "x"}', b"nope"):
        with pytest.raises(IncompleteSnapshot):
            decode_catalog_services(bad)
    for bad in (b"{}", b"[1]", b"nope"):
        with pytest.raises(IncompleteSnapshot):
            decode_health_state(bad)


async def test_cooperative_decoding_matches_and_yields() -> None:

    body = json.dumps([entry(f"web-{i}", meta={"k": str(i % 3)}) for i in range(600)]).encode()
    expected = decode_health_service(body, service="web", max_instances=1000)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await anyio.lowlevel.checkpoint()
            ticks += 1

    async with anyio.create_task_group() as nursery:
        nursery.start_soon(ticker)
        got = await decode_health_service_cooperatively(
            body, service="web", max_instances=1000, slice_seconds=0.0
        )
        nursery.cancel_scope.cancel()
    assert got == expected
    assert ticks >= 5  # the loop ran other tasks while decoding
    # equal meta values are shared, not copied per instance
    assert got.instances[0].metadata is got.instances[3].metadata


def test_whitespace_and_trailing_data_in_arrays() -> None:
    spaced = (
        b" [\n "
        + json.dumps(entry()).encode()
        + b" ,\n"
        + json.dumps(entry("b")).encode()
        + b"\n] \n"
    )
    assert decode_health_service(spaced, service="web", max_instances=5).identities() == (
        "web-1",
        "b",
    )
    assert decode_health_service(b" [ ] ", service="web", max_instances=5).instances == ()
    for bad in (b"[] x", b"[1 2]", b"[", b"", b"\xff[]"):
        with pytest.raises(IncompleteSnapshot):
            decode_health_service(bad, service="web", max_instances=5)


async def test_health_state_cooperative_validation() -> None:
    checks = [{"Status": "passing", "CheckID": f"c{i}"} for i in range(300)]
    assert await decode_health_state_cooperatively(json.dumps(checks).encode(), 0.0) == 300
    with pytest.raises(IncompleteSnapshot, match="entry 1"):
        await decode_health_state_cooperatively(b'[{"Status": "passing"}, {"x": 1}]')


# -- the typed decoder against the permissive reference ------------------------
#
# HealthDecoder.add is the permissive path: plain ``json`` values, one
# explicit type test per field. The typed msgspec path must reach exactly its
# outcome (same snapshot, or same error type and message) for any entry.


def reference(body: bytes, **options: Any) -> ProviderSnapshot:
    decoder = HealthDecoder(**options)
    data = json.loads(body)
    if type(data) is not list:
        raise IncompleteSnapshot("not an array")
    decoder.check_count(len(data))
    for item in data:
        decoder.add(item)
    return decoder.finish()


def outcome(run: Any) -> tuple[str, object]:
    try:
        snapshot = run()
    except DiscoveryError as exc:
        return type(exc).__name__, str(exc)
    return "snapshot", (snapshot.instances, dict(snapshot.invalid))


_ODD: list[Any] = [None, "", "x", 0, -1, 1.5, True, [], {}, 2**70, "10.0.0.1"]
_MISSING = object()


def odd_entry(chance: random.Random) -> Any:
    """An entry mostly well-formed, any field possibly odd or absent.

    Fields whose defect spoils the whole listing are odd rarely, the others
    often, so every outcome (instances, invalid entries, incomplete and
    invalid listings) turns up. Drawn from a seeded ``random.Random``
    because hypothesis's own draws lean towards the boundaries, which here
    would make almost every listing unreadable.
    """

    def field(values: list[Any], odd: float = 0.05) -> Any:
        roll = chance.random()
        if roll < odd:
            return chance.choice(_ODD)
        if roll < 2 * odd:
            return _MISSING
        return chance.choice(values)

    def structural(values: list[Any]) -> Any:
        return field(values, odd=0.005)

    if chance.random() < 0.005:
        return chance.choice(_ODD)  # not even an object
    service = {
        "ID": structural(["a", "b", "c"]),
        "Service": field(["web", "web", "web", "WEB", "db"]),
        "Address": field(["", "10.0.0.9", "10.0.0.9", "10.0.0.9", "0.0.0.0", "::"]),
        "Port": field([8080, 8080, 8080, 1, 65535, 0, 65536, -5]),
        "Weights": field([{"Passing": field([1, 3, 3, 3, 0, 2**64])}]),
        "Tags": field([[], ["grpc"], ["http"], ["grpc", "http"]]),
        "Meta": field([{}, {"k": "v"}, {"k": "v", "z": "v"}]),
        "Unused": field(_ODD),
    }
    node = {
        "Node": structural(["n1", "n2"]),
        "Address": field(["", "10.0.0.1", "10.0.0.1"]),
    }
    checks = [
        structural([{"Status": structural(["passing", "passing", "critical"])}])
        for _ in range(chance.randrange(4))
    ]
    raw = {
        "Node": structural([node]),
        "Service": structural([service]),
        "Checks": structural([checks]),
    }
    return _without_missing(raw)


def _without_missing(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_missing(v) for k, v in value.items() if v is not _MISSING}
    if isinstance(value, list):
        return [_without_missing(v) for v in value if v is not _MISSING]
    return value


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    count=st.integers(0, 6),
    tag=st.sampled_from([None, "grpc"]),
    scope=st.sampled_from(["service", "node"]),
)
def test_typed_decoding_matches_the_permissive_reference(
    seed: int, count: int, tag: str | None, scope: Any
) -> None:
    chance = random.Random(seed)
    body = json.dumps([odd_entry(chance) for _ in range(count)]).encode()
    options: dict[str, Any] = {
        "service": "web",
        "max_instances": 5,
        "tag": tag,
        "identity_scope": scope,
    }
    expected = outcome(lambda: reference(body, **options))
    assert outcome(lambda: decode_health_service(body, **options)) == expected
    cooperative = outcome(lambda: trio.run(_cooperatively, body, options))
    assert cooperative == expected
    # an earlier listing to reuse instances from changes nothing in the result
    earlier = json.dumps([odd_entry(chance) for _ in range(count)]).encode()
    try:
        previous = decode_health_service(earlier, **options)
    except DiscoveryError:
        return
    with_previous = {**options, "previous": previous}
    assert outcome(lambda: decode_health_service(body, **with_previous)) == expected
    assert outcome(lambda: trio.run(_cooperatively, body, with_previous)) == expected
    assert outcome(lambda: reference(body, **with_previous)) == expected


async def _cooperatively(body: bytes, options: dict[str, Any]) -> ProviderSnapshot:
    return await decode_health_service_cooperatively(body, **options, slice_seconds=0.0)


# -- bad input: typed outcomes, chained causes, short messages ----------------

SECRET = "s3cr3t-token-value"


@pytest.mark.parametrize(
    ("body", "cause"),
    [
        (b"not json", msgspec.DecodeError),
        (b'{"token": "' + SECRET.encode() + b'"}', msgspec.ValidationError),
        (b'[{"Node": "' + SECRET.encode(), msgspec.DecodeError),
        (b'[{"Node": {"Node": "n", "Meta": "' + SECRET.encode() + b'"}} x', msgspec.DecodeError),
        (b"[NaN]", msgspec.DecodeError),
    ],
)
def test_malformed_bodies_are_incomplete_with_the_cause_chained(
    body: bytes, cause: type[Exception]
) -> None:
    for decode_now in (
        lambda: decode_health_service(body, service="web", max_instances=10),
        lambda: trio.run(_cooperatively, body, {"service": "web", "max_instances": 10}),
    ):
        with pytest.raises(IncompleteSnapshot) as caught:
            decode_now()
        assert isinstance(caught.value.__cause__, cause)
        assert SECRET not in str(caught.value)
        assert len(str(caught.value)) < 200


def test_invalid_utf8_anywhere_is_incomplete_even_in_a_field_we_skip() -> None:
    raw = entry()
    raw["Node"]["Meta"] = {"k": "\u00e9"}
    body = json.dumps([raw], ensure_ascii=False).encode()
    assert decode_health_service(body, service="web", max_instances=5).identities() == ("web-1",)
    broken = body.replace("\u00e9".encode(), b"\xff")
    with pytest.raises(IncompleteSnapshot, match="not UTF-8") as caught:
        decode_health_service(broken, service="web", max_instances=5)
    # the codec's error holds the whole body (its Output fields may carry
    # credentials): nothing of it is chained
    assert caught.value.__cause__ is None and caught.value.__suppress_context__
    with pytest.raises(IncompleteSnapshot, match="not UTF-8"):
        split_json_array(broken, "q")


def test_capacity_is_checked_before_any_entry_is_built() -> None:
    body = b"[1, 2, 3]"  # three entries, none of them an object
    with pytest.raises(CapacityRejected, match="3 entries exceed"):
        decode_health_service(body, service="web", max_instances=2)
    with pytest.raises(CapacityRejected, match="3 entries exceed"):
        trio.run(_cooperatively, body, {"service": "web", "max_instances": 2})
    # within the limit, the first bad entry is named
    with pytest.raises(IncompleteSnapshot, match="entry 0 is not an object"):
        decode_health_service(body, service="web", max_instances=3)


def test_numbers_out_of_every_range_are_invalid_entries_not_crashes() -> None:
    valid = json.dumps(entry("ok")).encode()
    huge_port = json.dumps(entry("port")).encode().replace(b'"Port": 8080', b'"Port": 1e400')
    huge_weight = json.dumps(entry("w", weights={"Passing": 10**400})).encode()
    big_int_port = json.dumps(entry("big", port=2**64)).encode()
    body = b"[" + b",".join([valid, huge_port, huge_weight, big_int_port]) + b"]"
    snapshot = decode_health_service(body, service="web", max_instances=5)
    assert snapshot.identities() == ("ok",)
    assert set(snapshot.invalid) == {"node-1/port", "node-1/w", "node-1/big"}
    assert "out of range" in snapshot.invalid["node-1/port"]
    assert "positive integer" in snapshot.invalid["node-1/w"]


def test_only_the_needed_fields_are_read_unknown_ones_are_ignored() -> None:
    raw = entry()
    raw["Service"]["Proxy"] = {"Mode": "", "Expose": {"Paths": [1, {"x": None}]}}
    raw["Node"]["TaggedAddresses"] = {"lan": 5}
    raw["Extra"] = [None, 1.5, "x"]
    (instance,) = decode([raw]).instances
    assert (instance.identity, instance.port) == ("web-1", 8080)


def test_split_and_iterate_arrays() -> None:
    raws = split_json_array(b' [1, {"a": [2]} , "x"] ', "q")
    assert [bytes(r) for r in raws] == [b"1", b'{"a": [2]}', b'"x"']
    assert list(iter_json_array('[1, {"a": [2]}]', "q")) == [1, {"a": [2]}]
    with pytest.raises(IncompleteSnapshot, match="expected a JSON array"):
        split_json_array(b'{"a": 1}', "q")
    with pytest.raises(IncompleteSnapshot, match="not JSON"):
        split_json_array(b"[1,", "q")


def test_add_raw_accepts_one_entry_as_json_text() -> None:
    decoder = HealthDecoder("web", max_instances=3)
    decoder.add_raw(json.dumps(entry("a")).encode())
    decoder.add_raw(json.dumps(entry("b", port="80")).encode())  # the permissive path
    with pytest.raises(IncompleteSnapshot, match="entry 2 is not JSON"):
        decoder.add_raw(b"{")
    snapshot = decoder.finish()
    assert snapshot.identities() == ("a",)
    assert "out of range" in snapshot.invalid["node-1/b"]


async def test_cooperative_decoding_checkpoints_in_bounded_slices() -> None:
    body = json.dumps([entry(f"web-{i}") for i in range(640)]).encode()
    steps = 0

    async def ticker() -> None:
        nonlocal steps
        while True:
            await anyio.lowlevel.checkpoint()
            steps += 1

    async with anyio.create_task_group() as nursery:
        nursery.start_soon(ticker)
        await anyio.lowlevel.checkpoint()
        before = steps
        snapshot = await decode_health_service_cooperatively(
            body, service="web", max_instances=1000, slice_seconds=0.0
        )
        nursery.cancel_scope.cancel()
    assert len(snapshot.instances) == 640
    # with a zero slice it yields after every 32 entries
    assert steps - before >= 640 // 32 - 1


def test_health_state_typed_and_fallback_agree() -> None:
    checks: list[dict[str, object]] = [
        {"Status": "passing", "Node": "n", "CheckID": f"c{i}"} for i in range(5)
    ]
    assert decode_health_state(json.dumps(checks).encode()) == 5
    checks[3] = {"Status": 7}
    with pytest.raises(IncompleteSnapshot, match="entry 3 is not a check object") as caught:
        decode_health_state(json.dumps(checks).encode())
    assert isinstance(caught.value.__cause__, msgspec.ValidationError)
    with pytest.raises(IncompleteSnapshot, match="not JSON"):
        decode_health_state(b"[{]")


def documented_entry(service_id: str) -> dict[str, Any]:
    """An entry shaped like the HTTP API documentation's example answer."""
    return {
        "Node": {
            "ID": "40e4a748-2192-161a-0510-9bf59fe950b5",
            "Node": "agent-one",
            "Address": "10.1.10.12",
            "Datacenter": "dc1",
            "TaggedAddresses": {"lan": "10.1.10.12", "wan": "10.1.10.12"},
            "Meta": {"instance_type": "t2.medium"},
            "CreateIndex": 3,
            "ModifyIndex": 7,
        },
        "Service": {
            "ID": service_id,
            "Service": "redis",
            "Tags": ["primary"],
            "Address": "",
            "TaggedAddresses": {"lan": {"Address": "10.1.10.12", "Port": 8000}},
            "Meta": {"redis_version": "4.0"},
            "Port": 8000,
            "Weights": {"Passing": 10, "Warning": 1},
            "EnableTagOverride": False,
            "Proxy": {"Mode": "", "MeshGateway": {}, "Expose": {}},
            "Connect": {},
            "Namespace": "default",
        },
        "Checks": [
            {
                "Node": "agent-one",
                "CheckID": "serfHealth",
                "Name": "Serf Health Status",
                "Status": "passing",
                "Notes": "",
                "Output": "Agent alive and reachable",
                "ServiceID": "",
                "ServiceName": "",
                "ServiceTags": [],
                "Type": "",
                "Definition": {},
                "CreateIndex": 3,
                "ModifyIndex": 3,
            },
            {
                "Node": "agent-one",
                "CheckID": f"service:{service_id}",
                "Name": "Service 'redis' check",
                "Status": "passing",
                "Notes": "",
                "Output": "",
                "ServiceID": service_id,
                "ServiceName": "redis",
                "ServiceTags": ["primary"],
                "Type": "ttl",
                "CreateIndex": 4,
                "ModifyIndex": 4,
            },
        ],
    }


def test_documented_entries_take_the_typed_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """Well-formed answers never fall back to the slow, permissive path."""
    sparse = documented_entry("redis-3")
    sparse["Service"].update(Tags=None, Meta=None, Weights=None)
    del sparse["Checks"]
    body = json.dumps([documented_entry("redis-1"), documented_entry("redis-2"), sparse]).encode()
    expected = decode_health_service(body, service="redis", max_instances=5)

    def refuse(self: HealthDecoder, entry: object) -> None:
        raise AssertionError("the permissive path was used")

    monkeypatch.setattr(HealthDecoder, "add", refuse)
    snapshot = decode_health_service(body, service="redis", max_instances=5)
    options = {"service": "redis", "max_instances": 5}
    assert trio.run(_cooperatively, body, options) == snapshot == expected
    first, _, third = snapshot.instances
    assert (first.host, first.port, first.weight, first.tags) == (
        "10.1.10.12",
        8000,
        10.0,
        ("primary",),
    )
    assert dict(first.metadata) == {"redis_version": "4.0"}
    assert (third.tags, dict(third.metadata), third.weight) == ((), {}, 1.0)
    assert first.metadata is snapshot.instances[1].metadata


def test_unchanged_instances_are_reused_from_the_previous_snapshot() -> None:
    entries = [entry(f"web-{i}", meta={"k": "v"}, tags=("grpc",)) for i in range(8)]
    first = decode(entries)
    entries[2]["Service"]["Port"] = 9090  # changed instances ...
    entries[3]["Service"]["Address"] = "10.0.0.3"
    entries[4]["Service"]["Meta"] = {"k": "w"}
    entries[5]["Service"]["Tags"] = ["grpc", "http"]
    entries[6]["Service"]["Weights"] = {"Passing": 5, "Warning": 1}
    entries[7]["Checks"][0]["Status"] = "critical"  # ... and one gone
    body = json.dumps(entries).encode()
    fresh = decode_health_service(body, service="web", max_instances=9)
    for again in (
        decode_health_service(body, service="web", max_instances=9, previous=first),
        trio.run(_cooperatively, body, {"service": "web", "max_instances": 9, "previous": first}),
    ):
        assert again == fresh
        assert again.instances[0] is first.instances[0]
        assert again.instances[1] is first.instances[1]
        assert all(again.instances[i] is not first.instances[i] for i in range(2, 7))
        assert again.identities() == first.identities()[:7]
    # a previous snapshot built elsewhere (other mapping objects) is reused by value
    made = ProviderSnapshot(
        "web",
        (Instance("web-0", "10.0.0.9", 8080, 1.0, {"k": "v"}, ("grpc",)),),
        EvidenceKind.REGISTRY_HEALTH,
    )
    again = decode_health_service(body, service="web", max_instances=9, previous=made)
    assert again == fresh and again.instances[0] is made.instances[0]
    # the permissive path reuses too
    entries[1]["Service"]["Unused"] = 1
    entries[0]["Node"]["Address"] = 7  # odd, but the service address wins
    odd = decode(entries, previous=first)
    assert odd.instances[0] is first.instances[0]


@pytest.mark.parametrize(
    "odd",
    [
        b"1" + b"0" * 5000,  # more digits than Python converts
        b"[" * 5000 + b"]" * 5000,  # nested past the decoder's depth
    ],
)
def test_pathological_values_are_incomplete_not_crashes(odd: bytes) -> None:
    good = json.dumps(entry("a")).encode()
    body = b"[" + good + b"," + good.replace(b'"Port": 8080', b'"Port": ' + odd) + b"]"
    options = {"service": "web", "max_instances": 5}
    for decode_now in (
        lambda: decode_health_service(body, service="web", max_instances=5),
        lambda: trio.run(_cooperatively, body, options),
    ):
        with pytest.raises(IncompleteSnapshot) as caught:
            decode_now()
        # json's error would hold the entry (.doc): it is not chained
        assert caught.value.__cause__ is None or isinstance(caught.value.__cause__, RecursionError)
        assert len(str(caught.value)) < 200
    deep = b"[" * 100_000 + b"]" * 100_000
    with pytest.raises(IncompleteSnapshot, match="nested too deeply"):
        decode_health_service(deep, service="web", max_instances=5)
    with pytest.raises(IncompleteSnapshot):
        decode_health_state(deep)
    with pytest.raises(IncompleteSnapshot):
        decode_catalog_services(b'{"a": ' + deep + b"}")
    with pytest.raises(IncompleteSnapshot):
        list(iter_json_array("[1, " + odd.decode() + "]", "q"))


def well_formed_entry(chance: random.Random, n: int) -> dict[str, Any]:
    """A valid entry of service ``web``: what the column pass must take."""
    service: dict[str, Any] = {
        "ID": f"web-{n}",
        "Service": "web",
        "Address": chance.choice(["10.0.0.9", f"10.0.1.{n % 250 + 1}", ""]),
        "Port": chance.choice([1, 8080, 65535]),
        "Weights": {"Passing": chance.choice([1, 3, 2**40]), "Warning": 1},
        "Tags": chance.choice([None, [], ["grpc"], ["grpc", "http"]]),
        "Meta": chance.choice([None, {}, {"k": "v"}, {"k": "v", "zone": "a"}]),
    }
    checks = [
        {"Status": chance.choice(["passing", "passing", "passing", "critical", "warning"])}
        for _ in range(chance.randrange(3))
    ]
    return {
        "Node": {"Node": f"n{n % 3}", "Address": f"10.9.0.{n % 3 + 1}"},
        "Service": service,
        "Checks": chance.choice([checks, checks, None]),
    }


@settings(max_examples=200, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    count=st.integers(1, 12),
    tag=st.sampled_from([None, "grpc"]),
    scope=st.sampled_from(["service", "node"]),
)
def test_the_column_pass_matches_the_entry_by_entry_path(
    seed: int, count: int, tag: str | None, scope: Any
) -> None:
    """A listing of valid entries (healthy or not, with or without their own
    address, tags and meta) decoded column by column gives exactly the
    entry-by-entry result, byte count included; given a previous listing,
    its unchanged instances are the very same objects."""
    chance = random.Random(seed)
    body = json.dumps([well_formed_entry(chance, n) for n in range(count)]).encode()
    options: dict[str, Any] = {
        "service": "web",
        "max_instances": 20,
        "tag": tag,
        "identity_scope": scope,
    }
    expected = outcome(lambda: reference(body, **options))
    entries = msgspec.json.decode(body, type=list[_Entry])
    columns = HealthDecoder(**options).columns(entries)
    if columns is None:
        # only a tag some entry lacks sends a valid listing the slow way
        assert tag is not None
        return
    assert ("snapshot", (columns.instances, dict(columns.invalid))) == expected
    assert columns.approximate_bytes() == reference(body, **options).approximate_bytes()
    again = HealthDecoder(**options, previous=columns).columns(entries)
    assert again is not None
    assert all(a is b for a, b in zip(again.instances, columns.instances, strict=True))
