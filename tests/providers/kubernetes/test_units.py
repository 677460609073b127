"""Sans-IO parts of the Kubernetes provider: decoding, the evidence rules, settings, credentials."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path
from typing import Any

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from nadisc_kubernetes import (
    KubernetesSettings,
    ServiceView,
    TokenSource,
    build_snapshot,
    decode_event,
    decode_page,
    endpoint_state,
    resolve_access,
)
from nadisc_kubernetes._wire import (
    SliceEndpoint,
    WireError,
    decode_service,
    decode_slice,
    decode_status,
)
from pydantic import ValidationError

from nadisc import CapacityRejected, ConfigError, IncompleteSnapshot, InvalidSnapshot
from tests.fakes.kubernetes import KubernetesFake, slice_object

from .conftest import endpoint, write_kubeconfig

UID = "uid-1"


def service(ports: list[dict[str, Any]] | None = None, uid: str = UID) -> Any:
    body = {
        "metadata": {"name": "orders", "namespace": "default", "uid": uid, "resourceVersion": "5"},
        "spec": {"ports": ports if ports is not None else [{"name": "http", "port": 80}]},
    }
    return decode_service(json.dumps(body).encode())


def slice_(
    name: str, endpoints: list[dict[str, Any]], *, owner: str | None = UID, **kw: Any
) -> Any:
    return decode_slice(
        json.dumps(slice_object(name, "orders", endpoints, owner_uid=owner, **kw)).encode()
    )


def snapshot(svc: Any, *slices: Any, port: str | int | None = "http", limit: int = 100) -> Any:
    return build_snapshot("orders", svc, slices, port=port, max_instances=limit)


# -- conditions -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("ready", "serving", "terminating"), list(itertools.product((None, True, False), repeat=3))
)
def test_every_condition_combination_maps_as_documented(
    ready: bool | None, serving: bool | None, terminating: bool | None
) -> None:
    """nil ready = ready; nil terminating = not terminating; nil serving = ready."""
    conditions = {
        k: v
        for k, v in (("ready", ready), ("serving", serving), ("terminating", terminating))
        if v is not None
    }
    ep = msgspec.convert({"addresses": ["10.0.0.1"], "conditions": conditions}, SliceEndpoint)
    effective_ready = ready is not False
    if terminating:
        effective_serving = serving if serving is not None else effective_ready
        expected = "draining" if effective_serving else "withdrawn"
    else:
        expected = "served" if effective_ready else "withdrawn"
    assert endpoint_state(ep) == expected
    listed = snapshot(
        service(), slice_("s", [{"addresses": ["10.0.0.1"], "conditions": conditions}])
    )
    if expected == "withdrawn":
        assert listed.instances == ()
    else:
        (instance,) = listed.instances
        assert instance.draining is (expected == "draining")


def test_identity_is_the_target_not_the_ip_and_duplicates_merge() -> None:
    a = slice_("orders-a", [endpoint(1), endpoint(2, ready=False, serving=True, terminating=True)])
    # The same Pods again in a second slice (during a split): pod-2 served there, same IP reused
    # by another Pod.
    b = slice_("orders-b", [endpoint(2), {**endpoint(3), "addresses": ["10.0.0.1"]}])
    listed = snapshot(service(), a, b)
    assert listed.identities() == ("pod-1", "pod-2", "pod-3")
    by_id = {i.identity: i for i in listed.instances}
    assert not by_id["pod-2"].draining  # the served copy wins over the draining one
    assert by_id["pod-1"].host == by_id["pod-3"].host == "10.0.0.1"
    assert dict(by_id["pod-1"].metadata) == {
        "address_type": "IPv4", "zone": "zone-a", "node_name": "node-1",
    }  # fmt: skip
    hinted = slice_(
        "orders-h",
        [
            {
                **endpoint(4),
                "hints": {"forZones": [{"name": "zone-a"}, {"name": "zone-b"}]},
                "hostname": "w4",
            }
        ],
    )
    (h,) = snapshot(service(), hinted).instances
    assert h.metadata["hints.for_zones"] == "zone-a,zone-b" and h.metadata["hostname"] == "w4"
    bare = slice_("orders-x", [{"addresses": ["fd00::1"]}], address_type="IPv6")
    (x,) = snapshot(service(), bare).instances
    assert x.identity == "IPv6/[fd00::1]:8080" and x.address == "[fd00::1]:8080"


def test_an_identity_listed_twice_is_served_then_ipv4_then_from_the_first_slice() -> None:
    served, draining = endpoint(2), endpoint(2, ready=False, serving=True, terminating=True)
    moved = {**endpoint(2), "addresses": ["10.0.0.9"]}
    # Served over draining, whichever slice sorts first.
    for first, second in ((served, draining), (draining, served)):
        (pod,) = snapshot(service(), slice_("a", [first]), slice_("b", [second])).instances
        assert not pod.draining
    # Both served: the slice whose name sorts first, in whatever order given.
    for order in ((0, 1), (1, 0)):
        given_ = [slice_("a", [served]), slice_("b", [moved])]
        (pod,) = snapshot(service(), *(given_[i] for i in order)).instances
        assert pod.host == "10.0.0.2"
    # IPv4 over IPv6 when both families are served (no spec.ipFamilies).
    v6 = slice_("a", [{**endpoint(2), "addresses": ["fd00::2"]}], address_type="IPv6")
    (pod,) = snapshot(service(), v6, slice_("b", [served])).instances
    assert pod.host == "10.0.0.2"


def test_only_slices_owned_by_the_current_uid_are_evidence() -> None:
    stale = slice_("orders-old", [endpoint(1)], owner="uid-0")
    foreign = decode_slice(json.dumps({
        **slice_object("orders-foreign", "orders", [endpoint(2)]),
        "metadata": {"name": "orders-foreign", "labels": {"kubernetes.io/service-name": "orders"},
                     "ownerReferences": [{"kind": "Deployment", "name": "x", "uid": UID}]},
    }).encode())  # fmt: skip
    unlabelled = slice_("orders-u", [endpoint(4)])
    unlabelled = msgspec.structs.replace(
        unlabelled, metadata=msgspec.structs.replace(unlabelled.metadata, labels={})
    )
    good = slice_("orders-new", [endpoint(3)])
    listed = snapshot(service(), stale, foreign, unlabelled, good)
    assert listed.identities() == ("pod-3",)
    assert set(listed.invalid) == {
        "endpointslice/orders-old", "endpointslice/orders-foreign", "endpointslice/orders-u",
    }  # fmt: skip
    assert "uid-0" in listed.invalid["endpointslice/orders-old"]


def test_ports_resolve_by_service_port_name_or_number() -> None:
    ports = [{"name": "http", "port": 80}, {"name": "admin", "port": 9000}]
    s = slice_(
        "orders-a",
        [endpoint(1)],
        ports=[{"name": "http", "port": 8080}, {"name": "admin", "port": 9090}],
    )
    assert snapshot(service(ports), s, port="admin").instances[0].port == 9090
    assert snapshot(service(ports), s, port=80).instances[0].port == 8080
    with pytest.raises(InvalidSnapshot, match=r"no port 'grpc' \(its ports: http/TCP, admin/TCP\)"):
        snapshot(service(ports), s, port="grpc")
    with pytest.raises(InvalidSnapshot, match="has 2 ports"):
        snapshot(service(ports), s, port=None)
    single = service([{"port": 80}])  # an unnamed single port: slice port name ""
    unnamed = slice_("orders-b", [endpoint(2)], ports=[{"port": 8081}])
    assert snapshot(single, unnamed, port=None).instances[0].port == 8081
    missing = slice_("orders-c", [endpoint(3)], ports=[{"name": "other", "port": 1}])
    null = slice_("orders-d", [endpoint(4)], ports=[{"name": "http", "port": None}])
    listed = snapshot(service(), missing, null)
    assert listed.instances == ()
    assert listed.invalid["endpointslice/orders-c"] == "has no port named 'http'"
    assert "no usable number" in listed.invalid["endpointslice/orders-d"]


def test_missing_service_is_explicit_empty_and_capacity_is_refused() -> None:
    assert snapshot(None, slice_("orders-a", [endpoint(1)])).instances == ()
    assert snapshot(service()).instances == ()
    many = slice_("orders-a", [endpoint(n) for n in range(1, 6)])
    with pytest.raises(CapacityRejected, match="max_instances_per_service=4"):
        snapshot(service(), many, limit=4)


def test_too_deep_bodies_are_incomplete_through_the_shared_guard() -> None:
    deep = b"[" * 200_000 + b"]" * 200_000
    with pytest.raises(IncompleteSnapshot, match="slice list: the answer is nested too deeply"):
        decode_page("slice", b'{"kind":' + deep + b"}")  # even in a field never read
    with pytest.raises(WireError, match="Expected `object`, got `array`"):
        decode_page("slice", deep)  # the wrong type at the top is seen first: misshapen
    event = b'{"type":"ADDED","object":' + deep + b"}"
    with pytest.raises(IncompleteSnapshot, match="watch event: the answer is nested too deeply"):
        decode_event("slice", event, limit=len(event))
    bookmark = b'{"type":"BOOKMARK","object":{"metadata":' + deep + b"}}"
    with pytest.raises(IncompleteSnapshot, match="watch event: the answer is nested too deeply"):
        decode_event("slice", bookmark, limit=len(bookmark))
    assert decode_status(deep) is None  # an error body that is no Status: described as text


def test_decoding_refuses_wrong_shapes_and_oversized_events() -> None:
    with pytest.raises(WireError):
        decode_page("slice", b'{"items": [{"metadata": 5}]}')
    with pytest.raises(WireError):
        decode_page("service", b"not json")
    page = decode_page(
        "slice",
        json.dumps(
            {"metadata": {"resourceVersion": "7", "continue": "abc"}, "items": None}
        ).encode(),
    )
    assert page.metadata.continue_ == "abc" and page.items is None
    line = json.dumps(
        {"type": "ADDED", "object": slice_object("a", "orders", [endpoint(1)])}
    ).encode()
    assert decode_event("slice", line, limit=len(line)).type == "ADDED"
    with pytest.raises(WireError, match="exceeds the limit"):
        decode_event("slice", line, limit=len(line) - 1)
    with pytest.raises(WireError, match="unknown type"):
        decode_event("slice", b'{"type": "PATCHED", "object": {}}', limit=1000)
    with pytest.raises(WireError, match="without a Status"):
        decode_event("slice", b'{"type": "ERROR", "object": {}}', limit=1000)
    error = decode_event(
        "slice",
        b'{"type":"ERROR","object":{"kind":"Status","code":410,"reason":"Expired",'
        b'"message":"too old"}}',
        limit=1000,
    )
    assert error.status is not None and error.status.code == 410
    mark = decode_event(
        "slice", b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"9"}}}', limit=1000
    )
    assert mark.resource_version == "9" and mark.object is None


# -- the view, against the fake's own truth -------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.sampled_from("abc"), st.lists(st.integers(1, 6), max_size=3)), max_size=12
    )
)
def test_the_view_fed_by_events_equals_a_fresh_listing(writes: list[tuple[str, list[int]]]) -> None:
    """Applying the fake's events one by one gives the listing a fresh list gives."""
    fake = KubernetesFake()
    uid = fake.create_service("orders")["metadata"]["uid"]
    view = ServiceView("orders", "orders", port="http", max_instances=100)
    view.reset_service(
        [decode_service(json.dumps(o).encode()) for o in fake.objects["services"].values()],
        str(fake.version),
    )
    view.reset_slices([], str(fake.version))
    for name, pods in writes:
        key = ("default", f"orders-{name}")
        if not pods and key in fake.objects["endpointslices"]:
            fake.delete_slice(f"orders-{name}")
        else:
            fake.put_slice(
                slice_object(f"orders-{name}", "orders", [endpoint(n) for n in pods], owner_uid=uid)
            )
        event = fake.history[-1]
        line = json.dumps({"type": event.type, "object": event.obj}).encode()
        view.apply("slice", decode_event("slice", line, limit=1 << 20))
    fresh = build_snapshot(
        "orders",
        view.service,
        [decode_slice(json.dumps(o).encode()) for o in fake.objects["endpointslices"].values()],
        port="http",
        max_instances=100,
    )
    assert view.snapshot() == fresh
    assert view.version("slice") == str(fake.version)


# -- settings ------------------------------------------------------------------------------------


def test_settings_are_strict_and_name_the_field() -> None:
    parsed = KubernetesSettings.model_validate(
        {"services": {"orders": {"port": "http"}, "pay": {"name": "payments", "port": 8443}}}
    )
    assert parsed.binding("orders").name == "orders" and parsed.binding("payments").port == 8443
    for bad, where in (
        ({"services": {"o": {"name": "Orders"}}}, "services.o.name"),
        ({"services": {"o": {"port": "HTTP"}}}, "services.o.port"),
        ({"services": {"o": {"port": 70000}}}, "services.o.port"),
        ({"page_size": "10"}, "page_size"),
        ({"namespace": "Shop"}, "namespace"),
        ({"credentials": "exec"}, "credentials"),
        ({"tokne": "x"}, "tokne"),
        ({"services": {"a": {"name": "x", "port": 1}, "b": {"name": "x", "port": 2}}}, "services"),
        ({"initial_backoff": 10, "max_backoff": 5}, "initial_backoff"),
        ({"credentials": "in_cluster", "context": "x"}, "in_cluster"),
    ):
        with pytest.raises(ValidationError) as caught:
            KubernetesSettings.model_validate(bad)
        assert where in str(caught.value), (bad, str(caught.value))


# -- credentials ---------------------------------------------------------------------------------


def kube_settings(path: Path, **extra: Any) -> KubernetesSettings:
    return KubernetesSettings.model_validate(
        {"credentials": "kubeconfig", "kubeconfig": str(path), **extra}
    )


def test_kubeconfig_token_context_namespace_and_ca(tmp_path: Path) -> None:
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    config = write_kubeconfig(
        tmp_path / "config",
        "https://10.1.2.3:6443",
        token="s3cret",
        ca_file="ca.pem",
        namespace="shop",
    )
    access = resolve_access(kube_settings(config), {})
    assert access.server == "https://10.1.2.3:6443" and access.namespace == "shop"
    assert access.ca_file == str(ca)  # relative to the kubeconfig's folder
    assert access.tokens.current() == "s3cret"
    assert "s3cret" not in repr(access) and "s3cret" not in repr(access.tokens)
    assert resolve_access(kube_settings(config, namespace="other"), {}).namespace == "other"
    # $KUBECONFIG when no path is configured.
    auto = KubernetesSettings.model_validate({})
    assert resolve_access(auto, {"KUBECONFIG": str(config)}).server == "https://10.1.2.3:6443"


def test_exec_blocks_are_checked_and_other_plugins_refused(tmp_path: Path) -> None:
    exec_user = {
        "exec": {
            "apiVersion": "client.authentication.k8s.io/v1",
            "command": "gke-gcloud-auth-plugin",
        }
    }
    config = write_kubeconfig(tmp_path / "config", "https://k", token=None, user=exec_user)
    # client-go refuses a v1 exec block without interactiveMode; so does this.
    with pytest.raises(ConfigError, match="interactiveMode: is required") as caught:
        resolve_access(kube_settings(config), {})
    assert "users[alice].exec" in str(caught.value)
    config = write_kubeconfig(
        tmp_path / "config", "https://k", token=None, user={"auth-provider": {"name": "oidc"}}
    )
    with pytest.raises(ConfigError, match="auth-provider"):
        resolve_access(kube_settings(config), {})
    with pytest.raises(ConfigError, match="no context named 'nope'"):
        resolve_access(kube_settings(config, context="nope"), {})
    with pytest.raises(ConfigError, match="cannot read"):
        resolve_access(kube_settings(tmp_path / "missing"), {})
    half = write_kubeconfig(
        tmp_path / "config", "https://k", token=None, user={"client-certificate": "c.pem"}
    )
    with pytest.raises(ConfigError, match="needs its client-key"):
        resolve_access(kube_settings(half), {})


def test_in_cluster_reads_the_service_account_files(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("tok-1\n")
    (tmp_path / "namespace").write_text("shop")
    (tmp_path / "ca.crt").write_text("x")
    env = {"KUBERNETES_SERVICE_HOST": "fd00::1", "KUBERNETES_SERVICE_PORT_HTTPS": "443"}
    parsed = KubernetesSettings.model_validate({"in_cluster_root": str(tmp_path)})
    access = resolve_access(parsed, env)  # auto: the variables are set
    assert access.server == "https://[fd00::1]:443" and access.namespace == "shop"
    assert access.ca_file == str(tmp_path / "ca.crt") and access.tokens.current() == "tok-1"
    with pytest.raises(ConfigError, match="KUBERNETES_SERVICE_HOST"):
        resolve_access(KubernetesSettings.model_validate({"credentials": "in_cluster"}), {})
    # A port that is not one (other digits than ASCII, 0, over 65535) is refused too.
    for port in ("\u0664\u0664\u0663", "0", "65536"):
        with pytest.raises(ConfigError, match="a port in 1-65535"):
            resolve_access(parsed, {**env, "KUBERNETES_SERVICE_PORT_HTTPS": port})


def test_a_token_file_is_reread_when_it_changes_and_on_demand(tmp_path: Path) -> None:
    """Projected tokens rotate by swapping a symlink: re-read by path, never kept open."""
    (tmp_path / "v1").write_text("one")
    (tmp_path / "v2").write_text("two")
    link = tmp_path / "token"
    link.symlink_to(tmp_path / "v1")
    tokens = TokenSource(path=str(link))
    assert tokens.current() == "one" and tokens.current() == "one"
    assert tokens.reads == 1  # unchanged: not read again
    swap = tmp_path / "token.new"
    swap.symlink_to(tmp_path / "v2")
    os.replace(swap, link)
    assert tokens.current() == "two" and tokens.reads == 2
    assert tokens.reload() and tokens.reads == 3
    assert not TokenSource(token="fixed").reload()


def test_the_settings_have_a_json_schema() -> None:
    schema = KubernetesSettings.model_json_schema()
    assert schema["additionalProperties"] is False
    assert {"credentials", "namespace", "services", "watch_timeout"} <= set(schema["properties"])


def test_endpoints_with_the_same_topology_share_one_metadata_mapping() -> None:
    listed = snapshot(service(), slice_("s", [endpoint(1), endpoint(4), endpoint(2)]))
    by_id = {i.identity: i for i in listed.instances}
    assert by_id["pod-1"].metadata is by_id["pod-4"].metadata  # node-1, zone-a
    assert by_id["pod-2"].metadata is not by_id["pod-1"].metadata
    # Every part of the content is in the sharing key: a hint, a hostname, the
    # port's appProtocol, the address type (node-1 and zone-a throughout).
    hinted = {**endpoint(7), "hints": {"forZones": [{"name": "zone-b"}]}}
    empty_hint = {**endpoint(10), "hints": {}}
    named = {**endpoint(13), "hostname": "w13"}
    plain = slice_("t", [endpoint(1), hinted, empty_hint, named])
    h2c = [{"name": "http", "port": 8080, "protocol": "TCP", "appProtocol": "kubernetes.io/h2c"}]
    grpc = slice_("u", [endpoint(16), endpoint(19)], ports=h2c)
    v6 = slice_("v", [{**endpoint(22), "addresses": ["fd00::22"]}], address_type="IPv6")
    listed = snapshot(service(), plain, grpc, v6)
    by_id = {i.identity: i for i in listed.instances}
    topology = {"address_type": "IPv4", "zone": "zone-a", "node_name": "node-1"}
    assert dict(by_id["pod-1"].metadata) == topology
    assert by_id["pod-10"].metadata is by_id["pod-1"].metadata  # no zones in the hint
    assert dict(by_id["pod-7"].metadata) == {**topology, "hints.for_zones": "zone-b"}
    assert dict(by_id["pod-13"].metadata) == {**topology, "hostname": "w13"}
    assert by_id["pod-16"].metadata is by_id["pod-19"].metadata
    assert dict(by_id["pod-16"].metadata) == {**topology, "app_protocol": "kubernetes.io/h2c"}
    assert dict(by_id["pod-22"].metadata) == {**topology, "address_type": "IPv6"}
    distinct = {id(by_id[f"pod-{n}"].metadata) for n in (1, 7, 13, 16, 22)}
    assert len(distinct) == 5


@st.composite
def _endpoint_body(draw: Any, odd: bool) -> dict[str, Any]:
    """An endpoint in the common case (a served Pod with a UID, a valid
    address, no hints), or with ``odd`` one or more of the things the
    per-endpoint loop decides instead."""
    n = draw(st.integers(0, 12))
    conditions = st.fixed_dictionaries(
        {}, optional={"ready": st.just(True), "serving": st.booleans()}
    )
    body: dict[str, Any] = {
        "addresses": [draw(st.sampled_from(["10.0.0.1", "10.0.0.2", "fd00::3"]))],
        "conditions": draw(conditions),
        "targetRef": {"kind": "Pod", "name": f"orders-{n}", "uid": f"pod-{n}"},
    }
    for key, values in (
        # Few places, so that endpoints of one listing often share one.
        ("zone", [None, "", "zone-a"]),
        ("nodeName", [None, "node-1"]),
        ("hostname", [None, None, None, "", "w1"]),
    ):
        value = draw(st.sampled_from(values))
        if value is not None:
            body[key] = value
    if odd:
        change = draw(
            st.sampled_from(
                ["unready", "terminating", "no uid", "no ref", "hints", "empty hints",
                 "no address", "empty address", "bad address", "duplicate"]
            )
        )  # fmt: skip
        if change == "unready":
            body["conditions"] = {"ready": False}
        elif change == "terminating":
            body["conditions"] = {"terminating": True, "serving": draw(st.booleans())}
        elif change == "no uid":
            del body["targetRef"]["uid"]
        elif change == "no ref":
            del body["targetRef"]
        elif change == "hints":
            body["hints"] = {"forZones": [{"name": "zone-b"}]}
        elif change == "empty hints":
            body["hints"] = {}
        elif change == "no address":
            body["addresses"] = []
        elif change == "empty address":
            body["addresses"] = [""]
        elif change == "bad address":
            body["addresses"] = ["not a host!"]
        else:
            body["targetRef"]["uid"] = "pod-0"  # likely listed twice
    return body


@st.composite
def _slice_shape(draw: Any) -> tuple[list[dict[str, Any]], str, str | None]:
    plain = draw(st.lists(_endpoint_body(odd=False), max_size=8))
    for _ in range(draw(st.sampled_from([0, 0, 1, 2]))):
        plain.insert(draw(st.integers(0, len(plain))), draw(_endpoint_body(odd=True)))
    address_type = draw(st.sampled_from(["IPv4", "IPv4", "IPv6"]))
    return plain, address_type, draw(st.sampled_from([None, "kubernetes.io/h2c"]))


_slices = st.lists(_slice_shape(), max_size=4)


_PLACE = {"zone": "zone-a", "nodeName": "node-1"}
_POD = {"addresses": ["10.0.0.1"], "conditions": {"ready": True}, **_PLACE}
_HINTS = {"forZones": [{"name": "zone-b"}]}


@settings(max_examples=300, deadline=None)
@given(_slices, st.sampled_from(["primary", "ipv4", "ipv6"]))
# A slice whose only endpoint has hints, after one at the same place without.
@example(
    [
        ([{**_POD, "targetRef": {"uid": "pod-1"}}], "IPv4", None),
        ([{**_POD, "targetRef": {"uid": "pod-2"}, "hints": _HINTS}], "IPv4", None),
    ],
    "primary",
)  # fmt: skip
def test_the_column_pass_lists_what_the_per_endpoint_loop_lists(
    shapes: list[tuple[list[dict[str, Any]], str, str | None]], family: str
) -> None:
    """A slice whose every endpoint is the common case is listed in column
    passes; any other in one step per endpoint. Both give the same listing,
    invalid records and shared metadata mappings for any slices."""
    import nadisc_kubernetes._state as state

    slices = []
    for n, (endpoints, address_type, app) in enumerate(shapes):
        port = {"name": "http", "port": 8080, "protocol": "TCP"}
        if app is not None:
            port["appProtocol"] = app
        slices.append(slice_(f"s{n}", endpoints, ports=[port], address_type=address_type))
    svc = service()

    def listing() -> Any:
        try:
            return build_snapshot(
                "orders", svc, slices, port="http", max_instances=12, ip_family=family
            )
        except CapacityRejected as exc:
            return str(exc)

    columns = listing()
    loop_only = pytest.MonkeyPatch()
    loop_only.setattr(state, "_plain_members", lambda *args: None)
    try:
        stepwise = listing()
    finally:
        loop_only.undo()
    assert columns == stepwise
    if not isinstance(columns, str):
        assert columns.invalid == stepwise.invalid
        for a, b in zip(columns.instances, stepwise.instances, strict=True):
            assert a.draining is b.draining and dict(a.metadata) == dict(b.metadata)
        mappings = {id(i.metadata) for i in columns.instances}
        assert len(mappings) == len({id(i.metadata) for i in stepwise.instances})


async def test_watch_lines_are_split_across_chunks_and_bounded() -> None:
    from nadisc_kubernetes._http import LineReader

    class Chunks:
        def __init__(self, *chunks: bytes) -> None:
            self.chunks = list(chunks)

        def __aiter__(self) -> Chunks:
            return self

        async def __anext__(self) -> bytes:
            if not self.chunks:
                raise StopAsyncIteration
            return self.chunks.pop(0)

    reader = LineReader(Chunks(b'{"a":', b'1}\n{"b"', b":2}\n\n"), 16, "watch")
    assert [batch async for batch in reader] == [[], [b'{"a":1}'], [b'{"b":2}']]
    with pytest.raises(CapacityRejected, match="max_response_bytes=4"):
        [batch async for batch in LineReader(Chunks(b"123456\n"), 4, "watch")]
    with pytest.raises(CapacityRejected):  # no newline yet, but already too long
        [batch async for batch in LineReader(Chunks(b"123456"), 4, "watch")]
