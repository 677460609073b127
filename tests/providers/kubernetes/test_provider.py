"""The Kubernetes provider against the API-server fake: lists, watches, failures, credentials.

In-process cases run under trio's MockClock through ``fake.transport()``;
the TLS and kubectl cases serve the fake on a loopback port with hypercorn.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import trio
import trio.testing
from nadisc_kubernetes import KubernetesProvider, KubernetesSettings, resolve_access
from nadisc_kubernetes._http import Gone

from nadisc import (
    CapacityRejected,
    DeadlineExceeded,
    IdentityRevoked,
    IncompleteSnapshot,
    InvalidSnapshot,
    default_tls_context,
)
from tests.fakes.kubernetes import KubernetesFake, run_kubernetes_fake

from .conftest import (
    IN_CI,
    TOKEN,
    RecordingSink,
    context,
    endpoint,
    in_process,
    owned_slice,
    write_kubeconfig,
)

pytestmark = pytest.mark.trio_only

SLICES = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"


def seeded(**options: Any) -> KubernetesFake:
    fake = KubernetesFake(tokens={TOKEN: "alice"}, **options)
    fake.create_service("orders")
    return fake


class Hooked(httpx.AsyncBaseTransport):
    """Calls ``before(request)`` before handing each request to ``inner``."""

    def __init__(
        self, inner: httpx.AsyncBaseTransport, before: Callable[[httpx.Request], None]
    ) -> None:
        self.inner, self.before = inner, before

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.before(request)
        return await self.inner.handle_async_request(request)


def deadline(seconds: float = 5) -> float:
    return trio.current_time() + seconds


async def test_query_assembles_every_page(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    for n in range(1, 8):
        owned_slice(fake, f"orders-{n}", n)
    provider = in_process(fake, tmp_path, page_size=2)
    snapshot = await provider.query("orders", deadline())
    assert snapshot.identities() == tuple(f"pod-{n}" for n in range(1, 8))
    pages = [r for r in fake.requests if r.path == SLICES]
    assert [r.query.get("limit") for r in pages] == ["2"] * 4
    assert [bool(r.query.get("continue")) for r in pages] == [False, True, True, True]
    assert pages[0].query["labelSelector"] == "kubernetes.io/service-name=orders"
    assert {r.token for r in fake.requests} == {TOKEN}
    await provider.aclose()
    await provider.aclose()


async def test_an_expired_continue_token_restarts_the_list_once_then_is_incomplete(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    for n in range(1, 6):
        owned_slice(fake, f"orders-{n}", n)
    expire = {"times": 1}

    def compact_after_first_page(request: httpx.Request) -> None:
        if request.url.path == SLICES and "continue" in request.url.params and expire["times"] > 0:
            expire["times"] -= 1
            fake.compact()

    provider = in_process(fake, tmp_path, page_size=2)
    provider._http._client._transport = Hooked(fake.transport(), compact_after_first_page)
    snapshot = await provider.query("orders", deadline())
    assert len(snapshot.instances) == 5  # complete, after one restart
    assert provider.statistics.lists == 3  # services, slices (expired), slices again
    expire["times"] = 2
    with pytest.raises(IncompleteSnapshot, match="expired twice"):
        await provider.query("orders", deadline())
    expire["times"] = 0
    fake.requests.clear()
    provider._settings = provider._settings.model_copy(update={"max_pages": 2})
    with pytest.raises(IncompleteSnapshot, match="max_pages=2"):
        await provider.query("orders", deadline())


async def test_missing_service_is_explicit_empty_and_slices_are_not_read(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    provider = in_process(fake, tmp_path)
    snapshot = await provider.query("orders", deadline())
    assert snapshot.instances == () and not snapshot.invalid
    assert not any(r.path == SLICES for r in fake.requests)


async def test_failures_are_typed_and_never_carry_the_token(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    owned_slice(fake, "orders-a", 1)
    provider = in_process(fake, tmp_path)
    fake.deny("alice", "list", "endpointslices")
    with pytest.raises(IdentityRevoked, match="Forbidden") as revoked:
        await provider.query("orders", deadline())
    assert TOKEN not in str(revoked.value)
    with pytest.raises(IdentityRevoked):
        await provider.prepare(deadline())
    fake.allow("alice")
    fake.fail_next[SLICES] = [503]
    with pytest.raises(IncompleteSnapshot, match="HTTP 503"):
        await provider.query("orders", deadline())
    small = in_process(fake, tmp_path, ctx=context(max_response_bytes=200))
    with pytest.raises(CapacityRejected, match="max_response_bytes=200"):
        await small.query("orders", deadline())
    wrong = in_process(fake, tmp_path, token="not-a-token")
    with pytest.raises(IdentityRevoked, match="401"):
        await wrong.query("orders", deadline())


async def test_a_401_rereads_the_token_file_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    owned_slice(fake, "orders-a", 1)
    token_file = tmp_path / "token"
    token_file.write_text("token-A")
    config = write_kubeconfig(tmp_path / "config", fake.url, token=None, token_file=str(token_file))
    settings = KubernetesSettings.model_validate(
        {
            "credentials": "kubeconfig",
            "kubeconfig": str(config),
            "services": {"orders": {"port": "http"}},
        }
    )
    fake.tokens = {"token-A": "alice"}
    provider = KubernetesProvider(
        context(), settings, access=resolve_access(settings, {}), transport=fake.transport()
    )
    await provider.query("orders", deadline())
    # Rewritten in place with the same size and times: a stat cannot see it, the 401 does.
    stat = token_file.stat()
    token_file.write_text("token-B")
    os.utime(token_file, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    fake.tokens = {"token-B": "alice"}
    fake.requests.clear()
    assert len((await provider.query("orders", deadline())).instances) == 1
    assert [r.token for r in fake.requests][:2] == ["token-A", "token-B"]
    assert provider.http.counters.unauthorized_retries == 1
    fake.tokens = {}
    with pytest.raises(IdentityRevoked, match="401"):
        await provider.query("orders", deadline())


async def run_watch(
    provider: KubernetesProvider, sink: RecordingSink, nursery: trio.Nursery
) -> None:
    await nursery.start(provider.watch, "orders", sink)


async def test_watch_follows_events_and_publishes_only_changes(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    owned_slice(fake, "orders-a", 1)
    provider = in_process(fake, tmp_path)
    sink = RecordingSink()
    async with trio.open_nursery() as nursery:
        await run_watch(provider, sink, nursery)
        assert sink.identities == ("pod-1",)
        await fake.wait_for(lambda: fake.open_watches == 2)
        owned_slice(fake, "orders-b", 2)
        await sink.wait_for(lambda: sink.identities == ("pod-1", "pod-2"))
        published = len(sink.published)
        # A MODIFIED event that does not change the listing (a new label) commits nothing.
        owned_slice(fake, "orders-b", 2, labels={"team": "shop"})
        await trio.sleep(1)
        assert len(sink.published) == published
        # Watches carry the list's version, bookmarks and the server timeout.
        watches = fake.watch_requests("endpointslices")
        assert watches[0].query["allowWatchBookmarks"] == "true"
        assert watches[0].query["timeoutSeconds"] == "290"
        nursery.cancel_scope.cancel()
    assert fake.open_watches == 0 and not sink.failures


async def test_410_as_error_event_or_status_relists_once_without_a_duplicate_commit(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    owned_slice(fake, "orders-a", 1)
    provider = in_process(fake, tmp_path)
    sink = RecordingSink()
    async with trio.open_nursery() as nursery:
        await run_watch(provider, sink, nursery)
        await fake.wait_for(lambda: fake.open_watches == 2)
        published = len(sink.published)
        fake.compact()
        fake.expire_watches()  # ERROR events with code 410
        with trio.fail_after(100):
            await fake.wait_for(lambda: fake.open_watches == 2 and provider.statistics.relists >= 2)
        assert provider.statistics.relists == 2
        await trio.sleep(1)
        assert len(sink.published) == published  # nothing changed: nothing committed
        owned_slice(fake, "orders-a", 1, 2)  # a change made while it was relisting is not lost
        await sink.wait_for(lambda: sink.identities == ("pod-1", "pod-2"))
        # The HTTP-status form: re-watching from a compacted version answers 410.
        fake.gone_as_status = True
        fake.create_service("other")  # unseen by both watches: their versions fall behind
        fake.compact()
        fake.end_watches()
        with trio.fail_after(100):
            await fake.wait_for(lambda: provider.statistics.relists >= 4 and fake.open_watches == 2)
        assert provider.statistics.relists == 4
        assert [r.status for r in fake.watch_requests("endpointslices")][-2:] == [410, 200]
        nursery.cancel_scope.cancel()
    assert not sink.failures


async def test_server_timeouts_resume_from_the_last_version_and_bookmarks_confirm(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded(bookmark_interval=20.0)
    owned_slice(fake, "orders-a", 1)
    provider = in_process(fake, tmp_path, watch_timeout=30)
    sink = RecordingSink()
    async with trio.open_nursery() as nursery:
        await run_watch(provider, sink, nursery)
        await trio.sleep(100)
        watches = fake.watch_requests("endpointslices")
        assert len(watches) >= 3 and provider.statistics.server_timeouts >= 4
        assert provider.statistics.lists == 2  # resumed, never relisted
        assert {w.query["resourceVersion"] for w in watches[1:]} <= {
            str(v) for v in range(1, fake.version + 1)
        }
        assert sink.refreshes >= 2 and provider.statistics.bookmarks >= 2
        assert len(sink.published) == 1 and not sink.failures
        nursery.cancel_scope.cancel()


async def test_a_broken_stream_fails_then_lists_again_before_it_watches_again(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    owned_slice(fake, "orders-a", 1)
    provider = in_process(fake, tmp_path, initial_backoff=1, max_backoff=2)
    sink = RecordingSink()
    async with trio.open_nursery() as nursery:
        await run_watch(provider, sink, nursery)
        await fake.wait_for(lambda: fake.open_watches == 2)
        fake.break_watches()
        owned_slice(fake, "orders-b", 2)  # written while the streams are down
        await sink.wait_for(lambda: sink.identities == ("pod-1", "pod-2"))
        assert sink.failures and all(isinstance(f, IncompleteSnapshot) for f in sink.failures)
        # Only a list confirms a stream that failed: reopening the watch from
        # the version held would also be accepted by a server whose storage
        # went back in time, and stay silent.
        assert provider.statistics.lists == 4 and provider.statistics.relists == 2
        fake.deny("alice")
        fake.end_watches()  # the re-watch is the next request: denied
        await sink.wait_for(lambda: any(isinstance(f, IdentityRevoked) for f in sink.failures))
        nursery.cancel_scope.cancel()


async def test_a_confirmation_query_never_reverts_what_the_watch_published(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    owned_slice(fake, "orders-a", 1)
    provider = in_process(fake, tmp_path)
    sink = RecordingSink()

    async with trio.open_nursery() as nursery:
        await run_watch(provider, sink, nursery)
        await fake.wait_for(lambda: fake.open_watches == 2)
        view = provider._views["orders"]
        mark = view.changes
        # The list answers first with the old state, then the watch applies a newer one.
        inner = provider._http._client._transport

        class ListThenChange(httpx.AsyncBaseTransport):
            async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
                response = await inner.handle_async_request(request)
                if request.url.path == SLICES and "watch" not in request.url.params:
                    owned_slice(fake, "orders-a", 1, 2)
                    await sink.wait_for(lambda: view.changes > mark)
                return response

        provider._http._client._transport = ListThenChange()
        answer = await provider.query("orders", deadline())
        assert answer.identities() == ("pod-1", "pod-2") == sink.identities
        nursery.cancel_scope.cancel()


# -- over loopback: TLS and kubectl agreeing with the provider -------------------------------------


async def test_tls_with_the_kubeconfig_ca_and_refused_without_it(
    tmp_path: Path, self_signed_cert: tuple[str, str]
) -> None:
    cert, _ = self_signed_cert
    async with run_kubernetes_fake(tokens={TOKEN: "alice"}, tls=self_signed_cert) as fake:
        fake.create_service("orders")
        owned_slice(fake, "orders-a", 1, 2)
        good = write_kubeconfig(tmp_path / "good", fake.url, ca_file=cert)
        settings = KubernetesSettings.model_validate(
            {
                "credentials": "kubeconfig",
                "kubeconfig": str(good),
                "services": {"orders": {"port": "http"}},
            }
        )
        provider = KubernetesProvider(context(), settings)
        assert (await provider.query("orders", trio.current_time() + 5)).identities() == (
            "pod-1",
            "pod-2",
        )
        await provider.aclose()
        bad = write_kubeconfig(tmp_path / "bad", fake.url)
        untrusted = KubernetesProvider(
            context(), settings.model_copy(update={"kubeconfig": str(bad)})
        )
        with pytest.raises(IncompleteSnapshot, match=r"(?i)certificate|ssl|transport"):
            await untrusted.query("orders", trio.current_time() + 5)
        await untrusted.aclose()
    # The kubeconfig's CA is the only one trusted (as kubectl does); without
    # one, the process's shared default store; plain http loads no bundle.
    with_ca = resolve_access(settings, {})
    assert with_ca.ssl_context().cert_store_stats()["x509_ca"] == 1
    without = resolve_access(settings.model_copy(update={"kubeconfig": str(bad)}), {})
    assert without.ssl_context() is default_tls_context()
    plain = write_kubeconfig(tmp_path / "plain", "http://127.0.0.1:1")
    assert (
        resolve_access(settings.model_copy(update={"kubeconfig": str(plain)}), {})
        .ssl_context()
        .cert_store_stats()["x509_ca"]
        == 0
    )


async def test_kubectl_and_the_provider_see_the_same_endpoints(
    tmp_path: Path, self_signed_cert: tuple[str, str]
) -> None:
    import shutil

    kubectl = shutil.which("kubectl")
    if kubectl is None:
        if IN_CI:
            pytest.fail("kubectl is not installed (make servers installs kubernetes-client)")
        pytest.skip("kubectl is not installed (never skipped under CI=true)")
    cert, _ = self_signed_cert
    async with run_kubernetes_fake(tokens={TOKEN: "alice"}, tls=self_signed_cert) as fake:
        fake.create_service("orders")
        owned_slice(
            fake,
            "orders-a",
            endpoints=[endpoint(1), endpoint(2, ready=False, serving=True, terminating=True)],
        )
        owned_slice(fake, "orders-b", endpoints=[endpoint(3), endpoint(4, ready=False)])
        config = write_kubeconfig(tmp_path / "config", fake.url, ca_file=cert)
        env = {"PATH": os.environ.get("PATH", ""), "HOME": str(tmp_path), "KUBECONFIG": str(config)}
        with anyio.fail_after(30):
            done = await anyio.run_process(
                [kubectl, "get", "endpointslices", "-l", "kubernetes.io/service-name=orders",
                 "-o", "json", "--cache-dir", str(tmp_path / "cache")],
                env=env,
            )  # fmt: skip
        listed = json.loads(done.stdout)
        seen_by_kubectl: dict[str, str] = {}
        for item in listed["items"]:
            for ep in item["endpoints"]:
                c = ep.get("conditions", {})
                if c.get("ready", True) and not c.get("terminating", False):
                    seen_by_kubectl[ep["targetRef"]["uid"]] = "served"
                elif c.get("terminating") and c.get("serving"):
                    seen_by_kubectl[ep["targetRef"]["uid"]] = "draining"
        settings = KubernetesSettings.model_validate(
            {
                "credentials": "kubeconfig",
                "kubeconfig": str(config),
                "services": {"orders": {"port": "http"}},
            }
        )
        provider = KubernetesProvider(context(), settings)
        snapshot = await provider.query("orders", trio.current_time() + 5)
        await provider.aclose()
        assert {
            i.identity: "draining" if i.draining else "served" for i in snapshot.instances
        } == seen_by_kubectl
        assert seen_by_kubectl == {"pod-1": "served", "pod-2": "draining", "pod-3": "served"}


async def test_a_service_without_the_port_is_invalid_until_it_gets_one(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    fake.create_service("orders", ports=[{"name": "grpc", "port": 9090}])
    owned_slice(fake, "orders-a", 1)
    provider = in_process(fake, tmp_path)
    with pytest.raises(InvalidSnapshot, match="no port 'http'"):
        await provider.query("orders", deadline())
    sink = RecordingSink()
    async with trio.open_nursery() as nursery:
        await run_watch(provider, sink, nursery)
        assert isinstance(sink.failures[-1], InvalidSnapshot) and not sink.published
        await fake.wait_for(lambda: fake.open_watches == 2)
        failures = len(sink.failures)
        owned_slice(fake, "orders-b", 2)  # a slice event: still invalid
        await sink.wait_for(lambda: len(sink.failures) > failures)
        fake.create_service("orders")  # the same UID, now with the "http" port
        with trio.fail_after(1):  # on that event, not at the next re-watch
            await sink.wait_for(lambda: sink.identities == ("pod-1", "pod-2"))
        nursery.cancel_scope.cancel()


async def test_watches_that_end_at_once_are_not_reopened_in_a_hot_loop(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    owned_slice(fake, "orders-a", 1)
    inner = fake.transport()
    watches = 0

    class EmptyWatches(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            nonlocal watches
            if "watch" in request.url.params:
                watches += 1
                return httpx.Response(200, stream=httpx.ByteStream(b""), request=request)
            return await inner.handle_async_request(request)

    provider = in_process(fake, tmp_path, initial_backoff=1, max_backoff=4)
    provider._http._client._transport = EmptyWatches()
    sink = RecordingSink()
    async with trio.open_nursery() as nursery:
        await run_watch(provider, sink, nursery)
        await trio.sleep(20)
        nursery.cancel_scope.cancel()
    assert 4 <= watches <= 30  # two streams, backing off up to 4 s each
    assert sink.identities == ("pod-1",) and not sink.failures


class StallAfterFirstPage:
    """Wraps the provider's GET: once, after the first page of a ``kind`` list
    (one asked without a continue token) has come back, it waits out that
    request's budget (the time that was left to the read's deadline), outside
    the request, so the read's next request finds the deadline past."""

    def __init__(self, provider: KubernetesProvider, kind: str) -> None:
        self.inner = provider._http.get
        self.kind = kind
        self.times = 1
        self.stalled = 0

    async def __call__(self, path: str, params: dict[str, str], **kwargs: Any) -> Any:
        body = await self.inner(path, params, **kwargs)
        if self.times and path.endswith(self.kind) and "continue" not in params:
            self.times -= 1
            self.stalled += 1
            await trio.sleep(kwargs["budget"] + 0.01)
        return body


def stalled_between_pages(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kind: str = "endpointslices"
) -> tuple[KubernetesProvider, StallAfterFirstPage]:
    """Five slices read in pages of two, the first page of ``kind`` stalled."""
    fake = seeded()
    for n in range(1, 6):
        owned_slice(fake, f"orders-{n}", n)
    provider = in_process(fake, tmp_path, page_size=2)
    stall = StallAfterFirstPage(provider, kind)
    monkeypatch.setattr(provider._http, "get", stall)
    return provider, stall


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        # Between two pages of the slices.
        ("endpointslices", "list slices of default/orders did not finish by its deadline"),
        # Between the query's two lists: the Service's, then its slices'.
        ("services", "query of 'orders' did not finish by its deadline"),
    ],
)
async def test_a_list_whose_deadline_passes_between_pages_is_incomplete(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    match: str,
) -> None:
    provider, stall = stalled_between_pages(tmp_path, monkeypatch, kind)
    with pytest.raises(IncompleteSnapshot, match=match):
        await provider.query("orders", deadline())
    assert stall.stalled == 1
    # A deadline already past when the read starts is the caller's.
    with pytest.raises(DeadlineExceeded):
        await provider.query("orders", trio.current_time() - 1)
    snapshot = await provider.query("orders", deadline())
    assert len(snapshot.instances) == 5


async def test_a_watch_whose_list_runs_out_of_time_reports_it_and_lists_again(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Before, the deadline passing between two pages of the watch's own
    # list raised DeadlineExceeded out of the watch and ended it.
    provider, stall = stalled_between_pages(tmp_path, monkeypatch)
    sink = RecordingSink()
    async with trio.open_nursery() as nursery:
        await run_watch(provider, sink, nursery)
        await sink.wait_for(lambda: len(sink.identities) == 5)
        nursery.cancel_scope.cancel()
    assert stall.stalled == 1
    [failure] = sink.failures
    assert isinstance(failure, IncompleteSnapshot)
    assert "did not finish by its deadline" in str(failure)


async def test_a_list_restarted_after_an_expired_token_past_its_deadline_is_incomplete(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The continue token expires (410), and the list's restart from its first
    # page finds the deadline past: still a timeout of the list.
    fake = seeded()
    for n in range(1, 6):
        owned_slice(fake, f"orders-{n}", n)

    def compact_on_continue(request: httpx.Request) -> None:
        if request.url.path == SLICES and "continue" in request.url.params:
            fake.compact()

    provider = in_process(fake, tmp_path, page_size=2)
    provider._http._client._transport = Hooked(fake.transport(), compact_on_continue)
    inner = provider._http.get
    expired = []

    async def late_after_gone(path: str, params: dict[str, str], **kwargs: Any) -> Any:
        try:
            return await inner(path, params, **kwargs)
        except Gone:
            expired.append(path)
            await trio.sleep(kwargs["budget"] + 0.01)
            raise

    monkeypatch.setattr(provider._http, "get", late_after_gone)
    with pytest.raises(IncompleteSnapshot, match="list slices of default/orders did not finish"):
        await provider.query("orders", deadline())
    assert expired == [SLICES]
