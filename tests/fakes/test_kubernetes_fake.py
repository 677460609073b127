"""The Kubernetes API-server fake, pinned to the documented behaviour and to real kubectl.

The documented facts come from the Kubernetes "API Concepts" page (watch
from a resourceVersion, 410 Gone after compaction, bookmarks, chunked lists
with limit/continue and 410 on an expired continue token) and from the
``Status`` object the API server returns for errors (401 Unauthorized, 403
Forbidden, 404 NotFound). The kubectl tests point Debian's / the image's
``kubectl`` at the fake served over TLS (kubectl sends bearer tokens over
https only) with a generated kubeconfig and a fresh cache directory, so its
API discovery requests reach the fake too.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import trio
import trio.testing

from tests.fakes.kubernetes import KubernetesFake, run_kubernetes_fake, slice_object
from tests.providers.kubernetes.conftest import TOKEN, endpoint, write_kubeconfig
from tests.providers.kubernetes.conftest import self_signed_cert as self_signed_cert  # fixture

SLICES = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
SERVICES = "/api/v1/namespaces/default/services"
IN_CI = os.environ.get("CI", "").lower() == "true"


def client(fake: KubernetesFake, token: str | None = TOKEN) -> httpx.AsyncClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(transport=fake.transport(), base_url=fake.url, headers=headers)


def seeded(**options: Any) -> KubernetesFake:
    fake = KubernetesFake(tokens={TOKEN: "alice"}, **options)
    uid = fake.create_service("orders")["metadata"]["uid"]
    for n in range(1, 6):
        fake.put_slice(slice_object(f"orders-{n}", "orders", [endpoint(n)], owner_uid=uid))
    return fake


class Lines:
    """The lines of a watch body, read from ``aiter_raw`` (one generator level,
    closed explicitly by :func:`watching`)."""

    def __init__(self, response: httpx.Response) -> None:
        self.raw = response.aiter_raw()
        self._buffer = b""

    def __aiter__(self) -> Lines:
        return self

    async def __anext__(self) -> str:
        while b"\n" not in self._buffer:
            self._buffer += await self.raw.__anext__()
        line, _, self._buffer = self._buffer.partition(b"\n")
        return line.decode()


@asynccontextmanager
async def watching(
    http: httpx.AsyncClient, params: dict[str, str], path: str = SLICES
) -> AsyncIterator[tuple[httpx.Response, Lines]]:
    """An open watch and its lines (closed on exit, read or not)."""
    async with http.stream("GET", path, params=params) as response:
        lines = Lines(response)
        try:
            yield response, lines
        finally:
            # Close, then run the body into the closed stream so that every
            # generator of httpx's chain finishes (none left to the collector).
            await response.aclose()
            with contextlib.suppress(Exception):
                while True:
                    await lines.raw.__anext__()


async def events_of(lines: Lines, count: int) -> list[dict[str, Any]]:
    """The next ``count`` events of a watch body (``response.aiter_lines()``)."""
    events: list[dict[str, Any]] = []
    while len(events) < count:
        line = await lines.__anext__()
        if line:
            events.append(json.loads(line))
    return events


async def test_objects_carry_versions_uids_and_lists_their_version() -> None:
    fake = seeded()
    async with client(fake) as http:
        listed = (await http.get(SLICES)).json()
        assert (
            listed["kind"] == "EndpointSliceList" and listed["apiVersion"] == "discovery.k8s.io/v1"
        )
        assert listed["metadata"]["resourceVersion"] == str(fake.version)
        assert [i["metadata"]["name"] for i in listed["items"]] == [
            f"orders-{n}" for n in range(1, 6)
        ]
        versions = [int(i["metadata"]["resourceVersion"]) for i in listed["items"]]
        assert versions == sorted(set(versions))  # each write has its own version
        one = (await http.get(f"{SERVICES}/orders")).json()
        assert one["kind"] == "Service" and one["metadata"]["uid"] == fake.service_uid("orders")
        selected = await http.get(SERVICES, params={"fieldSelector": "metadata.name=nope"})
        assert selected.json()["items"] == []
        labelled = await http.get(
            SLICES, params={"labelSelector": "kubernetes.io/service-name=other"}
        )
        assert labelled.json()["items"] == []


async def test_errors_are_status_objects_as_the_api_server_sends_them() -> None:
    fake = seeded()
    async with client(fake) as http:
        missing = await http.get(f"{SERVICES}/payments")
        assert missing.status_code == 404
        assert missing.json() == {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": 'services "payments" not found', "reason": "NotFound",
            "details": {"name": "payments", "kind": "services"}, "code": 404,
        }  # fmt: skip
    async with client(fake, token="wrong") as http:
        denied = await http.get(SLICES)
        assert denied.status_code == 401 and denied.json()["reason"] == "Unauthorized"
    fake.deny("alice", "list", "endpointslices")
    async with client(fake) as http:
        forbidden = await http.get(SLICES)
        assert forbidden.status_code == 403
        body = forbidden.json()
        assert body["reason"] == "Forbidden" and body["code"] == 403
        assert body["message"] == (
            'endpointslices.discovery.k8s.io is forbidden: User "alice" cannot list resource '
            '"endpointslices" in API group "discovery.k8s.io" in the namespace "default"'
        )
        assert (await http.get(SERVICES)).status_code == 200  # only that verb on that resource


async def test_a_role_may_list_but_not_watch_as_the_api_server_words_it() -> None:
    # The watch is refused before any stream, with the verb "watch" in the
    # message (responsewriters/errors.go forbiddenMessage) and the group in the
    # details only for a named group (the body client-go logs, e.g.
    # kubernetes-sigs/prometheus-adapter#274: "details":{"kind":"pods"}).
    fake = seeded()
    fake.deny("alice", "watch", "endpointslices")
    fake.deny("alice", "watch", "services")
    async with client(fake) as http:
        listed = await http.get(SLICES)
        assert listed.status_code == 200 and len(listed.json()["items"]) == 5
        watched = await http.get(SLICES, params={"watch": "1", "resourceVersion": "1"})
        assert watched.status_code == 403
        assert watched.json() == {
            "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
            "message": 'endpointslices.discovery.k8s.io is forbidden: User "alice" cannot '
            'watch resource "endpointslices" in API group "discovery.k8s.io" in the '
            'namespace "default"',
            "reason": "Forbidden",
            "details": {"group": "discovery.k8s.io", "kind": "endpointslices"},
            "code": 403,
        }  # fmt: skip
        core = await http.get(SERVICES, params={"watch": "true"})
        assert core.status_code == 403
        assert core.json()["details"] == {"kind": "services"}
        assert core.json()["message"] == (
            'services is forbidden: User "alice" cannot watch resource "services" in API '
            'group "" in the namespace "default"'
        )
        assert (await http.get(SERVICES)).status_code == 200
    assert fake.open_watches == 0
    assert [r.status for r in fake.watch_requests("endpointslices")] == [403]


async def test_chunked_lists_are_one_consistent_snapshot_and_expire_with_compaction() -> None:
    fake = seeded()
    async with client(fake) as http:
        first = (await http.get(SLICES, params={"limit": "2"})).json()
        assert len(first["items"]) == 2 and first["metadata"]["remainingItemCount"] == 3
        token = first["metadata"]["continue"]
        fake.delete_slice("orders-5")  # written between chunks: not seen by this list
        second = (await http.get(SLICES, params={"limit": "2", "continue": token})).json()
        third = (
            await http.get(
                SLICES, params={"limit": "2", "continue": second["metadata"]["continue"]}
            )
        ).json()
        names = [i["metadata"]["name"] for page in (first, second, third) for i in page["items"]]
        assert names == [f"orders-{n}" for n in range(1, 6)]
        assert "continue" not in third["metadata"]
        assert {p["metadata"]["resourceVersion"] for p in (first, second, third)} == {
            first["metadata"]["resourceVersion"]
        }
        again = (await http.get(SLICES, params={"limit": "2"})).json()
        fake.compact()
        expired = await http.get(
            SLICES, params={"limit": "2", "continue": again["metadata"]["continue"]}
        )
        assert expired.status_code == 410 and expired.json()["reason"] == "Expired"


@pytest.mark.trio_only
async def test_a_watch_replays_from_its_version_then_follows_and_ends_at_its_timeout(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = seeded()
    async with client(fake) as http:
        start = fake.version
        fake.put_slice(
            slice_object("orders-1", "orders", [endpoint(1, ready=False)], owner_uid="x")
        )
        params = {"watch": "1", "resourceVersion": str(start), "timeoutSeconds": "5"}
        async with watching(http, params) as (response, lines):
            assert response.status_code == 200
            fake.delete_slice("orders-2")
            fake.put_slice(slice_object("orders-9", "orders", [endpoint(9)], owner_uid="x"))
            events = await events_of(lines, 3)
            assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
                ("MODIFIED", "orders-1"),
                ("DELETED", "orders-2"),
                ("ADDED", "orders-9"),
            ]
            assert events[2]["object"]["metadata"]["resourceVersion"] == str(fake.version)
            began = trio.current_time()
            rest = [line async for line in lines if line]
            assert rest == [] and trio.current_time() - began == pytest.approx(5, abs=0.1)
        # "" / "0": the current state first, as synthetic ADDED events.
        async with watching(http, {"watch": "true", "resourceVersion": "0"}) as (_, lines):
            added = await events_of(lines, 5)
            assert {e["type"] for e in added} == {"ADDED"} and len(added) == 5


async def test_an_out_of_selector_change_is_a_deletion_for_that_watch() -> None:
    fake = seeded()
    async with client(fake) as http:
        params = {"watch": "1", "resourceVersion": str(fake.version), "labelSelector": "app=web"}
        async with watching(http, params) as (_, lines):
            labelled = slice_object("orders-1", "orders", [], owner_uid="x", labels={"app": "web"})
            fake.put_slice(labelled)
            fake.put_slice(slice_object("orders-1", "orders", [], owner_uid="x"))
            events = await events_of(lines, 2)
            assert [e["type"] for e in events] == ["ADDED", "DELETED"]


@pytest.mark.trio_only
async def test_bookmarks_carry_only_a_version_and_come_only_when_allowed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = seeded(bookmark_interval=10.0)
    async with client(fake) as http:
        params = {"watch": "1", "resourceVersion": str(fake.version), "allowWatchBookmarks": "true"}
        async with watching(http, params) as (_, lines):
            began = trio.current_time()
            (event,) = await events_of(lines, 1)
            assert trio.current_time() - began == pytest.approx(10, abs=0.1)
            assert event == {
                "type": "BOOKMARK",
                "object": {
                    "kind": "EndpointSlice",
                    "apiVersion": "discovery.k8s.io/v1",
                    "metadata": {"resourceVersion": str(fake.version)},
                },
            }
        params.pop("allowWatchBookmarks")
        params["timeoutSeconds"] = "30"
        async with http.stream("GET", SLICES, params=params) as response:
            fake.bookmark()
            assert [line async for line in response.aiter_lines() if line] == []


async def test_a_compacted_version_is_a_410_error_event_or_status() -> None:
    fake = seeded(window=3)
    assert fake.compacted > 1
    async with client(fake) as http:
        params = {"watch": "1", "resourceVersion": "1"}
        async with http.stream("GET", SLICES, params=params) as response:
            assert response.status_code == 200
            events = [json.loads(line) async for line in response.aiter_lines() if line]
            assert len(events) == 1 and events[0]["type"] == "ERROR"
            status = events[0]["object"]
            assert status["kind"] == "Status" and status["code"] == 410
            assert status["reason"] == "Expired" and "too old resource version" in status["message"]
        # An open watch whose position was compacted gets the same ERROR, then ends.
        async with http.stream(
            "GET", SLICES, params={"watch": "1", "resourceVersion": str(fake.version)}
        ) as r:
            fake.expire_watches()
            events = [json.loads(line) async for line in r.aiter_lines() if line]
            assert [e["object"]["code"] for e in events] == [410]
    fake.gone_as_status = True
    async with client(fake) as http:
        gone = await http.get(SLICES, params={"watch": "1", "resourceVersion": "1"})
        assert gone.status_code == 410 and gone.json()["code"] == 410


async def test_a_broken_watch_is_a_read_error_in_process() -> None:
    fake = seeded()
    async with client(fake) as http:
        async with http.stream(
            "GET", SLICES, params={"watch": "1", "resourceVersion": str(fake.version)}
        ) as r:
            assert fake.open_watches == 1
            fake.break_watches()
            with pytest.raises(httpx.ReadError):
                async for _ in r.aiter_lines():
                    pass
        assert fake.open_watches == 0


async def test_discovery_documents_name_the_two_resources() -> None:
    fake = seeded()
    async with client(fake) as http:
        assert (await http.get("/api")).json()["versions"] == ["v1"]
        groups = (await http.get("/apis")).json()["groups"]
        assert [g["name"] for g in groups] == ["discovery.k8s.io", "authorization.k8s.io"]
        core = (await http.get("/api/v1")).json()
        assert [r["name"] for r in core["resources"]] == ["services"]
        discovery = (await http.get("/apis/discovery.k8s.io/v1")).json()
        assert discovery["resources"][0]["kind"] == "EndpointSlice"
        assert set(discovery["resources"][0]["verbs"]) >= {"list", "watch"}


# -- real kubectl against the fake (over TLS, on loopback) ----------------------------------------

KUBECTL = shutil.which("kubectl")


def need_kubectl() -> str:
    if KUBECTL is None:
        if IN_CI:
            pytest.fail("kubectl is not installed (make servers installs kubernetes-client)")
        pytest.skip("kubectl is not installed (never skipped under CI=true)")
    return KUBECTL


async def kubectl(home: Path, kubeconfig: Path, *args: str) -> str:
    binary = need_kubectl()
    env = {"PATH": os.environ.get("PATH", ""), "HOME": str(home), "KUBECONFIG": str(kubeconfig)}
    with anyio.fail_after(30):
        done = await anyio.run_process(
            [binary, *args, "--cache-dir", str(home / "cache")], env=env, check=False
        )
    assert done.returncode == 0, done.stderr.decode()[-2000:]
    return done.stdout.decode()


@pytest.mark.trio_only
async def test_kubectl_lists_slices_and_services_from_the_fake(
    tmp_path: Path, self_signed_cert: tuple[str, str]
) -> None:
    need_kubectl()
    async with run_kubernetes_fake(tokens={TOKEN: "alice"}, tls=self_signed_cert) as fake:
        uid = fake.create_service("orders")["metadata"]["uid"]
        fake.put_slice(
            slice_object("orders-a", "orders", [endpoint(1), endpoint(2)], owner_uid=uid)
        )
        fake.put_slice(slice_object("orders-b", "orders", [endpoint(3)], owner_uid=uid))
        config = write_kubeconfig(tmp_path / "config", fake.url, ca_file=self_signed_cert[0])
        names = await kubectl(tmp_path, config, "get", "endpointslices", "-o", "name")
        assert names.split() == [
            "endpointslice.discovery.k8s.io/orders-a",
            "endpointslice.discovery.k8s.io/orders-b",
        ]
        table = await kubectl(tmp_path, config, "get", "endpointslices")
        assert table.split()[:2] == ["NAME", "AGE"] and "orders-a" in table and "orders-b" in table
        services = json.loads(await kubectl(tmp_path, config, "get", "services", "-o", "json"))
        assert [s["metadata"]["uid"] for s in services["items"]] == [uid]
        assert services["items"][0]["spec"]["ports"][0]["name"] == "http"
        # kubectl discovered the API through the fake, with alice's token.
        paths = {r.path for r in fake.requests}
        assert {"/api", "/apis", "/api/v1", "/apis/discovery.k8s.io/v1"} <= paths
        assert {r.token for r in fake.requests} == {TOKEN}
        # RBAC denials reach kubectl as the API server's Status message.
        fake.deny("alice", "list", "endpointslices")
        binary = need_kubectl()
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "KUBECONFIG": str(config)}
        refused = await anyio.run_process(
            [binary, "get", "endpointslices", "--cache-dir", str(tmp_path / "cache")],
            env=env,
            check=False,
        )
        assert refused.returncode != 0
        assert b'cannot list resource "endpointslices"' in refused.stderr


@pytest.mark.trio_only
async def test_kubectl_lists_then_fails_to_watch_under_a_list_only_role(
    tmp_path: Path, self_signed_cert: tuple[str, str]
) -> None:
    binary = need_kubectl()
    async with run_kubernetes_fake(tokens={TOKEN: "alice"}, tls=self_signed_cert) as fake:
        uid = fake.create_service("orders")["metadata"]["uid"]
        fake.put_slice(slice_object("orders-a", "orders", [endpoint(1)], owner_uid=uid))
        config = write_kubeconfig(tmp_path / "config", fake.url, ca_file=self_signed_cert[0])
        fake.deny("alice", "watch", "endpointslices")
        assert (await kubectl(tmp_path, config, "auth", "can-i", "list", "endpointslices")) == (
            "yes\n"
        )
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "KUBECONFIG": str(config)}
        cache = ["--cache-dir", str(tmp_path / "cache")]
        with anyio.fail_after(30):
            can_watch = await anyio.run_process(
                [binary, "auth", "can-i", "watch", "endpointslices", *cache], env=env, check=False
            )
            watched = await anyio.run_process(
                [binary, "get", "endpointslices", "--watch", "-o", "name", *cache],
                env=env,
                check=False,
            )
        assert (can_watch.returncode, can_watch.stdout) == (1, b"no\n")
        # kubectl prints the list, then the watch's 403 as client-go reports a
        # refused watch (kubernetes/kubernetes#78227: "Forbidden: unknown (get ...)").
        assert watched.returncode != 0
        assert watched.stdout.split() == [b"endpointslice.discovery.k8s.io/orders-a"]
        assert b"(Forbidden)" in watched.stderr
        slices = [r for r in fake.requests if r.path == SLICES]
        assert [(bool(r.query.get("watch")), r.status) for r in slices] == [
            (False, 200),
            (True, 403),
        ]


@pytest.mark.trio_only
async def test_kubectl_watch_sees_the_changes_in_order(
    tmp_path: Path, self_signed_cert: tuple[str, str]
) -> None:
    binary = need_kubectl()
    async with run_kubernetes_fake(tokens={TOKEN: "alice"}, tls=self_signed_cert) as fake:
        uid = fake.create_service("orders")["metadata"]["uid"]
        fake.put_slice(slice_object("orders-a", "orders", [endpoint(1)], owner_uid=uid))
        config = write_kubeconfig(tmp_path / "config", fake.url, ca_file=self_signed_cert[0])
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "KUBECONFIG": str(config)}
        command = [
            binary, "get", "endpointslices", "--watch", "-o", "name",
            "--cache-dir", str(tmp_path / "cache"),
        ]  # fmt: skip
        output = tmp_path / "watch.out"
        with output.open("wb") as sink, anyio.fail_after(30):
            async with await anyio.open_process(command, env=env, stdout=sink) as process:
                await fake.wait_for(lambda: fake.open_watches == 1)
                fake.put_slice(slice_object("orders-b", "orders", [endpoint(2)], owner_uid=uid))
                fake.delete_slice("orders-a")
                while output.read_text().count("\n") < 3:  # noqa: ASYNC110 - a file
                    await trio.sleep(0.05)
                process.terminate()
        assert output.read_text().split() == [
            "endpointslice.discovery.k8s.io/orders-a",  # the list
            "endpointslice.discovery.k8s.io/orders-b",  # ADDED
            "endpointslice.discovery.k8s.io/orders-a",  # DELETED
        ]
        watches = fake.watch_requests("endpointslices")
        assert watches and watches[0].query["resourceVersion"] == str(fake.version - 2)


# -- writes, selectors, versions (each pinned to the API server's source) -----------------------


def service_body(name: str = "payments", **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name},
        "spec": {"ports": [{"name": "http", "port": 80}], **spec},
    }


async def test_create_defaults_and_refuses_a_duplicate_as_already_exists() -> None:
    fake = seeded()
    async with client(fake) as http:
        created = await http.post(SERVICES, json=service_body())
        assert created.status_code == 201
        spec = created.json()["spec"]
        # pkg/apis/core/v1/defaults.go SetDefaults_Service; the registry allocates the IP.
        assert spec["type"] == "ClusterIP" and spec["sessionAffinity"] == "None"
        assert spec["ports"][0]["protocol"] == "TCP" and spec["ports"][0]["targetPort"] == 80
        assert spec["clusterIP"].startswith("10.96.") and spec["ipFamilies"] == ["IPv4"]
        again = await http.post(SERVICES, json=service_body())
        assert again.status_code == 409 and again.json()["reason"] == "AlreadyExists"
        assert again.json()["message"] == 'services "payments" already exists'
        # StatusDetails.Group is omitempty: the core group is left out.
        assert again.json()["details"] == {"name": "payments", "kind": "services"}
        # generateName: the prefix and five characters of the name generator's alphabet.
        generated = await http.post(
            SLICES,
            json={
                "apiVersion": "discovery.k8s.io/v1",
                "kind": "EndpointSlice",
                "metadata": {"generateName": "orders-"},
                "addressType": "IPv4",
                "endpoints": [{"addresses": ["10.0.0.9"]}],
            },
        )
        name = generated.json()["metadata"]["name"]
        assert generated.status_code == 201 and len(name) == len("orders-") + 5
        assert set(name[len("orders-") :]) <= set("bcdfghjklmnpqrstvwxz2456789")
        invalid = await http.post(SERVICES, json={**service_body("x"), "spec": {}})
        assert invalid.status_code == 422 and "spec.ports: Required value" in invalid.text
        strict = await http.post(
            SERVICES,
            params={"fieldValidation": "Strict"},
            json=service_body("y", bogus=1),
        )
        assert strict.status_code == 400
        assert 'strict decoding error: unknown field "spec.bogus"' in strict.json()["message"]


async def test_updates_and_deletes_honour_resource_version_preconditions() -> None:
    fake = seeded()
    async with client(fake) as http:
        current = (await http.get(f"{SERVICES}/orders")).json()
        stale = json.loads(json.dumps(current))
        stale["metadata"]["resourceVersion"] = "1"
        conflict = await http.put(f"{SERVICES}/orders", json=stale)
        # store.go GuaranteedUpdate: errors.NewConflict with OptimisticLockErrorMsg.
        assert conflict.status_code == 409 and conflict.json()["reason"] == "Conflict"
        assert "the object has been modified" in conflict.json()["message"]
        assert conflict.json()["details"] == {"name": "orders", "kind": "services"}
        current["metadata"]["labels"] = {"tier": "web"}
        updated = await http.put(f"{SERVICES}/orders", json=current)
        assert updated.status_code == 200
        version = updated.json()["metadata"]["resourceVersion"]
        merged = await http.patch(
            f"{SERVICES}/orders",
            content=json.dumps({"metadata": {"labels": {"tier": None, "team": "a"}}}),
            headers={"content-type": "application/merge-patch+json"},
        )
        assert merged.json()["metadata"]["labels"] == {"team": "a"}
        strategic = await http.patch(
            f"{SERVICES}/orders",
            content=json.dumps(
                {
                    "$setElementOrder/ports": [{"port": 9000}, {"port": 80}],
                    "spec": {"ports": [{"name": "admin", "port": 9000}]},
                }
            ),
            headers={"content-type": "application/strategic-merge-patch+json"},
        )
        assert [p["port"] for p in strategic.json()["spec"]["ports"]] == [80, 9000]
        stale_patch = await http.patch(
            f"{SERVICES}/orders",
            content=json.dumps({"metadata": {"resourceVersion": version}}),
            headers={"content-type": "application/merge-patch+json"},
        )
        assert stale_patch.status_code == 409
        refused = await http.request(
            "DELETE",
            f"{SERVICES}/orders",
            json={"kind": "DeleteOptions", "preconditions": {"resourceVersion": "2"}},
        )
        assert refused.status_code == 409 and "Precondition failed" in refused.text
        deleted = await http.delete(f"{SERVICES}/orders")
        assert deleted.status_code == 200 and deleted.json()["status"] == "Success"
        assert (await http.delete(f"{SERVICES}/orders")).status_code == 404
        unsupported = await http.patch(
            f"{SLICES}/orders-1", content=b"{}", headers={"content-type": "text/plain"}
        )
        assert unsupported.status_code == 415
        immutable = await http.patch(
            f"{SLICES}/orders-1",
            content=json.dumps({"addressType": "IPv6"}),
            headers={"content-type": "application/merge-patch+json"},
        )
        assert immutable.status_code == 422 and "field is immutable" in immutable.text


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("tier in (web, api)", ["orders-1", "orders-2"]),
        ("tier notin (web)", ["orders-2", "orders-3", "orders-4", "orders-5"]),
        ("tier!=web", ["orders-2", "orders-3", "orders-4", "orders-5"]),
        ("tier", ["orders-1", "orders-2"]),
        ("!tier", ["orders-3", "orders-4", "orders-5"]),
        ("kubernetes.io/service-name=orders,tier==api", ["orders-2"]),
    ],
)
async def test_set_based_and_inequality_label_selectors(selector: str, expected: list[str]) -> None:
    fake = seeded()
    for name, tier in (("orders-1", "web"), ("orders-2", "api")):
        body = fake.objects["endpointslices"][("default", name)]
        body["metadata"]["labels"]["tier"] = tier
        fake.put_slice(body)
    async with client(fake) as http:
        listed = await http.get(SLICES, params={"labelSelector": selector})
        assert [i["metadata"]["name"] for i in listed.json()["items"]] == expected
        excluded = await http.get(SERVICES, params={"fieldSelector": "metadata.name!=orders"})
        assert excluded.json()["items"] == []
        bad = await http.get(SLICES, params={"labelSelector": "tier in (web"})
        assert bad.status_code == 400


@pytest.mark.trio_only
async def test_list_resource_versions_exact_not_older_than_and_too_large(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = seeded()
    before = fake.version
    fake.delete_slice("orders-5")
    async with client(fake) as http:
        exact = await http.get(
            SLICES, params={"resourceVersion": str(before), "resourceVersionMatch": "Exact"}
        )
        assert exact.json()["metadata"]["resourceVersion"] == str(before)
        assert len(exact.json()["items"]) == 5  # the state at that version
        newer = await http.get(SLICES, params={"resourceVersion": str(before)})
        assert len(newer.json()["items"]) == 4  # NotOlderThan: the current state
        forbidden = await http.get(SLICES, params={"resourceVersionMatch": "Exact"})
        assert forbidden.status_code == 400
        began = trio.current_time()
        future = await http.get(SLICES, params={"resourceVersion": str(fake.version + 10)})
        # storage/errors.go NewTooLargeResourceVersionError after the 3 s blockTimeout.
        assert future.status_code == 504 and trio.current_time() - began == pytest.approx(3)
        body = future.json()
        assert body["reason"] == "Timeout"
        assert body["details"]["causes"][0]["reason"] == "ResourceVersionTooLarge"
        # A plain watch from that version is accepted instead: see
        # test_kubernetes_fake_versions.py.
        fake.compact()
        expired = await http.get(
            SLICES, params={"resourceVersion": str(before), "resourceVersionMatch": "Exact"}
        )
        assert expired.status_code == 410


@pytest.mark.trio_only
async def test_send_initial_events_ends_with_an_annotated_bookmark(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = seeded(bookmark_interval=None)
    async with client(fake) as http:
        refused = await http.get(SLICES, params={"watch": "1", "sendInitialEvents": "true"})
        assert refused.status_code == 422
        params = {
            "watch": "1",
            "sendInitialEvents": "true",
            "resourceVersionMatch": "NotOlderThan",
            "allowWatchBookmarks": "true",
        }
        async with watching(http, params) as (_, lines):
            events = await events_of(lines, 6)
        assert [e["type"] for e in events] == ["ADDED"] * 5 + ["BOOKMARK"]
        annotations = events[-1]["object"]["metadata"]["annotations"]
        assert annotations == {"k8s.io/initial-events-end": "true"}


@pytest.mark.trio_only
async def test_bookmarks_come_every_minute_even_while_events_flow(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = seeded()  # 60 s, as the watch cache
    async with client(fake) as http:
        params = {
            "watch": "1",
            "resourceVersion": str(fake.version),
            "allowWatchBookmarks": "true",
            "timeoutSeconds": "200",
        }
        async with watching(http, params) as (_, lines):
            seen: list[tuple[float, str]] = []
            began = trio.current_time()

            async def writer() -> None:
                for n in range(38):
                    await trio.sleep(5)
                    owned = fake.objects["endpointslices"][("default", "orders-1")]
                    owned["metadata"]["labels"]["n"] = str(n)
                    fake.put_slice(owned)

            async with trio.open_nursery() as nursery:
                nursery.start_soon(writer)
                with contextlib.suppress(StopAsyncIteration):
                    async for line in lines:
                        if line:
                            seen.append((trio.current_time() - began, json.loads(line)["type"]))
                nursery.cancel_scope.cancel()
        marks = [round(t) for t, kind in seen if kind == "BOOKMARK"]
        # One a minute whatever else flows, and one 2 s before the deadline.
        assert marks == [60, 120, 180, 198]
        assert sum(1 for _, kind in seen if kind == "MODIFIED") == 38


@pytest.mark.trio_only
async def test_kubectl_writes_reach_the_provider(
    tmp_path: Path, self_signed_cert: tuple[str, str]
) -> None:
    """kubectl apply / create / label / delete / auth can-i against the fake,
    with strict validation (no --validate=false), and the provider's watch
    seeing each change."""
    from nadisc_kubernetes import KubernetesProvider, KubernetesSettings, resolve_access

    from tests.providers.kubernetes.conftest import RecordingSink, context

    need_kubectl()
    manifest = tmp_path / "orders.yaml"

    def write_manifest(*addresses: str, extra_port: bool = False) -> None:
        ports = [{"name": "http", "port": 80}] + (
            [{"name": "admin", "port": 9000}] if extra_port else []
        )
        service = {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": {"name": "orders"},
            "spec": {"ports": ports},
        }
        mirrored = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "orders-manual",
                "labels": {"kubernetes.io/service-name": "orders"},
            },
            "addressType": "IPv4",
            "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
            "endpoints": [{"addresses": [a], "conditions": {"ready": True}} for a in addresses],
        }
        import yaml

        manifest.write_text(yaml.safe_dump_all([service, mirrored]))

    async with run_kubernetes_fake(tokens={TOKEN: "alice"}, tls=self_signed_cert) as fake:
        config = write_kubeconfig(tmp_path / "config", fake.url, ca_file=self_signed_cert[0])
        settings = KubernetesSettings.model_validate(
            {
                "credentials": "kubeconfig",
                "kubeconfig": str(config),
                "services": {"orders": {"port": "http"}},
                "trust_unowned_slices": True,  # kubectl writes hand-made slices
            }
        )
        provider = KubernetesProvider(context(), settings, access=resolve_access(settings, {}))
        sink = RecordingSink()
        try:
            async with trio.open_nursery() as nursery:
                await nursery.start(provider.watch, "orders", sink)
                assert sink.identities == ()
                write_manifest("10.9.0.1")
                assert "created" in await kubectl(tmp_path, config, "apply", "-f", str(manifest))
                with trio.fail_after(20):
                    await sink.wait_for(lambda: sink.identities == ("IPv4/10.9.0.1:8080",))
                write_manifest("10.9.0.1", "10.9.0.2", extra_port=True)
                assert "configured" in await kubectl(tmp_path, config, "apply", "-f", str(manifest))
                with trio.fail_after(20):
                    await sink.wait_for(lambda: len(sink.identities) == 2)
                # A label that moves the slice off the Service: the provider drops it.
                await kubectl(
                    tmp_path, config, "label", "--overwrite", "endpointslice", "orders-manual",
                    "kubernetes.io/service-name=elsewhere",
                )  # fmt: skip
                with trio.fail_after(20):
                    await sink.wait_for(lambda: sink.identities == ())
                await kubectl(tmp_path, config, "delete", "endpointslice", "orders-manual")
                write_manifest("10.9.0.3")
                binary = need_kubectl()
                env = {
                    "PATH": os.environ.get("PATH", ""),
                    "HOME": str(tmp_path),
                    "KUBECONFIG": str(config),
                }
                again = await anyio.run_process(
                    [binary, "create", "-f", str(manifest), "--cache-dir", str(tmp_path / "cache")],
                    env=env,
                    check=False,
                )
                # The Service exists (409 AlreadyExists); the slice is created.
                assert again.returncode != 0 and b"AlreadyExists" in again.stderr
                with trio.fail_after(20):
                    await sink.wait_for(lambda: sink.identities == ("IPv4/10.9.0.3:8080",))
                assert (
                    await kubectl(tmp_path, config, "auth", "can-i", "watch", "endpointslices")
                ).strip() == "yes"
                fake.deny("alice", "delete", "endpointslices")
                denied = await anyio.run_process(
                    [
                        binary,
                        "auth",
                        "can-i",
                        "delete",
                        "endpointslices",
                        "--cache-dir",
                        str(tmp_path / "cache"),
                    ],
                    env=env,
                    check=False,
                )
                assert denied.returncode == 1 and denied.stdout.strip() == b"no"
                await kubectl(tmp_path, config, "delete", "service", "orders")
                with trio.fail_after(20):
                    await sink.wait_for(lambda: sink.identities == () and len(sink.published) >= 5)
                nursery.cancel_scope.cancel()
        finally:
            await provider.aclose()
        validated = [
            r for r in fake.requests if r.method in ("POST", "PATCH") and "fieldManager" in r.query
        ]
        assert validated and all(
            r.query.get("fieldValidation") == "Strict"
            for r in validated
            if r.query["fieldManager"] != "kubectl-label"
        )
        assert any(r.path == "/openapi/v3" for r in fake.requests)
