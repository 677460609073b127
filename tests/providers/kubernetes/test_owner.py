"""Kubernetes discovery through the owner: entry point, watch, drain, UID, relist, tokens, RBAC.

In-process cases inject the provider the entry point would build, wired to
the fake through ``fake.transport()``, and run under trio's MockClock (the
drain case calls real loopback backends, so it runs on the real clock).
The entry-point case loads the provider by name and talks to the fake
served over TLS by hypercorn.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest
import trio
import trio.testing
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nadisc_kubernetes import KubernetesProvider, KubernetesSettings, build_snapshot, factory
from nadisc_kubernetes._wire import decode_service, decode_slice

from nadisc import (
    ConfigError,
    ConnectionContext,
    DiscoveryConfig,
    DiscoveryTransport,
    EvidenceUnavailable,
    Observation,
    Provider,
    open_discovery,
    validate_provider_block,
)
from tests.fakes.kubernetes import KubernetesFake, run_kubernetes_fake, slice_object
from tests.nadisc.owner_support import all_tasks
from tests.support_http import HttpBackend, serve_backends

from .conftest import TOKEN, endpoint, owned_slice, write_kubeconfig

pytestmark = pytest.mark.trio_only

SLICES = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"


def config(
    kubeconfig: Path,
    *,
    connection: Mapping[str, Any] | None = None,
    limits: Mapping[str, Any] | None = None,
    **block: Any,
) -> DiscoveryConfig:
    kubernetes: dict[str, Any] = {
        "credentials": "kubeconfig",
        "kubeconfig": str(kubeconfig),
        "initial_backoff": 1,
        "max_backoff": 4,
        "services": {"orders": {"name": "orders", "port": "http"}},
    }
    kubernetes.update(block)
    primary: dict[str, Any] = {
        "provider": "kubernetes",
        "request_timeout_ms": 2000,
        "poll_interval_ms": 5000,
        "snapshot": {"max_age_ms": 30_000, "stale_if_error_ms": 10_000},
        "retry": {"initial_backoff_ms": 1000, "max_backoff_ms": 4000},
        "kubernetes": kubernetes,
    }
    primary.update(connection or {})
    document: dict[str, Any] = {
        "enabled": True,
        "connections": {"primary": primary},
        "shutdown_timeout_ms": 5000,
    }
    if limits is not None:
        document["limits"] = dict(limits)
    return DiscoveryConfig.model_validate(document)


def in_process(cfg: DiscoveryConfig, fake: KubernetesFake) -> dict[str, Provider]:
    """The provider the entry point would build, wired to the in-process fake."""
    connection = cfg.connections["primary"]
    settings = validate_provider_block("primary", connection, KubernetesSettings)
    context = ConnectionContext(
        name="primary",
        request_timeout=connection.request_timeout_ms / 1000,
        max_instances_per_service=cfg.limits.max_instances_per_service,
        max_response_bytes=cfg.limits.max_snapshot_bytes,
    )
    return {
        "primary": factory.create_with(context, settings, transport=fake.transport(), environ={})
    }


def provider_of(providers: dict[str, Provider]) -> KubernetesProvider:
    provider = providers["primary"]
    assert isinstance(provider, KubernetesProvider)
    return provider


async def wait_until(
    observation: Observation, predicate: Callable[[], bool], limit: float = 120
) -> None:
    with anyio.fail_after(limit):
        while not predicate():
            await observation.changed(anyio.current_time() + limit)


def identities(observation: Observation) -> tuple[str, ...]:
    try:
        return observation.snapshot().identities()
    except EvidenceUnavailable:
        return ()


def refusal(observation: Observation) -> str | None:
    try:
        observation.snapshot()
    except EvidenceUnavailable as exc:
        return exc.reason
    return None


def seeded(**options: Any) -> KubernetesFake:
    fake = KubernetesFake(tokens={TOKEN: "alice"}, **options)
    fake.create_service("orders")
    return fake


def lists(fake: KubernetesFake) -> int:
    return sum(1 for r in fake.requests if r.path == SLICES and not r.query.get("watch"))


# -- the entry point, over TLS on loopback ---------------------------------------------------------


async def test_the_kubernetes_entry_point_watches_with_two_streams(
    tmp_path: Path, self_signed_cert: tuple[str, str]
) -> None:
    before = all_tasks()
    async with run_kubernetes_fake(tokens={TOKEN: "alice"}, tls=self_signed_cert) as fake:
        fake.create_service("orders")
        owned_slice(fake, "orders-a", 1, 2)
        kubeconfig = write_kubeconfig(tmp_path / "config", fake.url, ca_file=self_signed_cert[0])
        cfg = config(kubeconfig)
        async with open_discovery(cfg) as owner:
            observation = await owner.client().observe("orders", trio.current_time() + 5)
            snapshot = observation.snapshot()
            assert snapshot.identities() == ("pod-1", "pod-2")
            assert snapshot.evidence.value == "orchestrator_ready"
            assert snapshot.instances[0].metadata["zone"] == "zone-a"
            with anyio.fail_after(10):
                await fake.wait_for(lambda: fake.open_watches == 2)
            owned_slice(fake, "orders-a", 1, 2, 3)
            await wait_until(observation, lambda: len(identities(observation)) == 3, limit=10)
            stats = owner.observer().snapshot()
            assert stats is not None
        report = owner.close_report
        assert report is not None and report.tasks_left == 0 and not report.provider_errors
        assert fake.open_watches == 0
    assert all_tasks() == before


def test_a_bad_kubernetes_block_is_refused_with_its_path(tmp_path: Path) -> None:
    cfg = config(tmp_path / "config", services={"orders": {"name": "orders", "port": "HTTP"}})
    with pytest.raises(ConfigError) as caught:
        validate_provider_block("primary", cfg.connections["primary"], KubernetesSettings)
    assert "discovery.connections.primary.kubernetes.services" in str(caught.value)
    assert factory.settings_model is KubernetesSettings
    assert factory.name == "kubernetes"


# -- in process, under MockClock ---------------------------------------------------------------


async def test_slices_scaled_up_and_down_show_within_one_watch_event(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    owned_slice(fake, "orders-a", 1)
    cfg = config(write_kubeconfig(tmp_path / "config", fake.url))
    async with open_discovery(cfg, providers=in_process(cfg, fake)) as owner:
        observation = await owner.client().observe("orders", trio.current_time() + 5)
        assert identities(observation) == ("pod-1",)
        await fake.wait_for(lambda: fake.open_watches == 2)
        listed = lists(fake)
        for pods, slices in (
            ((1, 2, 3), {"orders-a": (1, 2), "orders-b": (3,)}),
            ((1,), {"orders-a": (1,)}),
        ):
            start = trio.current_time()
            for name, members in slices.items():
                owned_slice(fake, name, *members)
            for gone in {"orders-b"} - set(slices):
                fake.delete_slice(gone)
            expected = tuple(f"pod-{n}" for n in pods)
            await wait_until(observation, lambda: identities(observation) == expected)  # noqa: B023
            assert trio.current_time() - start < 0.5
        assert lists(fake) == listed  # every change came on the watch, none by listing


async def test_a_terminating_endpoint_drains_and_its_call_in_flight_completes(
    tmp_path: Path,
) -> None:
    async with serve_backends(HttpBackend("old", latency=0.5), HttpBackend("new")) as (old, new):
        fake = seeded()

        def ep(n: int, backend: HttpBackend, **conditions: Any) -> dict[str, Any]:
            return {**endpoint(n, **conditions), "addresses": [backend.host]}

        def port(backend: HttpBackend) -> list[dict[str, Any]]:
            return [{"name": "http", "port": backend.port, "protocol": "TCP"}]

        owned_slice(fake, "orders-old", endpoints=[ep(1, old)], ports=port(old))
        cfg = config(write_kubeconfig(tmp_path / "config", fake.url))
        async with open_discovery(cfg, providers=in_process(cfg, fake)) as owner:
            observation = await owner.client().observe("orders", anyio.current_time() + 5)
            transport = DiscoveryTransport(owner)
            async with httpx.AsyncClient(mounts={"nadisc://": transport}) as http:
                answers: list[str] = []

                async def long_call() -> None:
                    answers.append((await http.get("nadisc://primary/orders/long")).text)

                async with anyio.create_task_group() as tg:
                    tg.start_soon(long_call)
                    with anyio.fail_after(5):
                        while old.active == 0:  # noqa: ASYNC110 - the backend has no event
                            await anyio.sleep(0.01)
                    # The Pod starts terminating; a new one is ready in another slice.
                    owned_slice(
                        fake, "orders-old",
                        endpoints=[ep(1, old, ready=False, serving=True, terminating=True)],
                        ports=port(old),
                    )  # fmt: skip
                    owned_slice(fake, "orders-new", endpoints=[ep(2, new)], ports=port(new))
                    await wait_until(
                        observation,
                        lambda: (
                            [(i.identity, i.draining) for i in observation.snapshot().instances]
                            == [("pod-1", True), ("pod-2", False)]
                        ),
                        limit=5,
                    )
                    for _ in range(6):
                        assert (await http.get("nadisc://primary/orders/short")).text == "new"
                    assert old.active == 1  # still in flight on the draining Pod
                assert answers == ["old"]
                route = transport.route("primary", "orders")
                assert route is not None
                assert route.statistics().sent == {"pod-1": 1, "pod-2": 6}
                assert old.served == 1 and new.served == 6
                # Not serving any more: withdrawn.
                owned_slice(
                    fake, "orders-old",
                    endpoints=[ep(1, old, ready=False, serving=False, terminating=True)],
                    ports=port(old),
                )  # fmt: skip
                await wait_until(
                    observation, lambda: identities(observation) == ("pod-2",), limit=5
                )


async def test_a_recreated_service_ignores_the_old_uids_slices(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    owned_slice(fake, "orders-a", 1, 2)
    cfg = config(write_kubeconfig(tmp_path / "config", fake.url))
    async with open_discovery(cfg, providers=in_process(cfg, fake)) as owner:
        observation = await owner.client().observe("orders", trio.current_time() + 5)
        assert identities(observation) == ("pod-1", "pod-2")
        await fake.wait_for(lambda: fake.open_watches == 2)
        old_uid = fake.service_uid("orders")
        fake.delete_service("orders")
        await wait_until(observation, lambda: refusal(observation) == "empty")
        fake.create_service("orders")  # a new UID; the garbage collector has not run yet
        assert fake.service_uid("orders") != old_uid
        await trio.sleep(1)
        assert refusal(observation) == "empty"  # the old slices are not evidence
        (metrics,) = [s for c in owner.observer().snapshot().connections for s in c.services]
        assert dict(metrics.invalid_records).keys() == {"endpointslice/orders-a"}
        owned_slice(fake, "orders-b", 3)  # the controller writes the new Service's slice
        await wait_until(observation, lambda: identities(observation) == ("pod-3",))
        fake.delete_slice("orders-a")  # then the old one is collected
        await trio.sleep(1)
        assert identities(observation) == ("pod-3",)


async def test_a_rotated_token_file_is_used_by_the_next_request(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    owned_slice(fake, "orders-a", 1)
    (tmp_path / "token-1").write_text("token-1")
    (tmp_path / "token-2").write_text("token-2")
    link = tmp_path / "token"
    link.symlink_to(tmp_path / "token-1")
    fake.tokens = {"token-1": "alice"}
    kubeconfig = write_kubeconfig(tmp_path / "config", fake.url, token=None, token_file=str(link))
    cfg = config(kubeconfig)
    providers = in_process(cfg, fake)
    async with open_discovery(cfg, providers=providers) as owner:
        observation = await owner.client().observe("orders", trio.current_time() + 5)
        await fake.wait_for(lambda: fake.open_watches == 2)
        # The kubelet swaps the projected token: a new file behind the same path.
        swap = tmp_path / "token.swap"
        swap.symlink_to(tmp_path / "token-2")
        os.replace(swap, link)
        fake.tokens = {"token-1": "alice", "token-2": "alice"}
        seen = len(fake.requests)
        fake.end_watches()
        await fake.wait_for(lambda: fake.open_watches == 2 and len(fake.requests) >= seen + 2)
        assert {r.token for r in fake.requests[seen:]} == {"token-2"}
        fake.tokens = {"token-2": "alice"}  # the old token expires
        owned_slice(fake, "orders-a", 1, 2)
        await wait_until(observation, lambda: identities(observation) == ("pod-1", "pod-2"))
        await trio.sleep(12)  # confirmation queries too
        assert refusal(observation) is None and not observation.snapshot().degraded
        assert provider_of(providers).http.counters.unauthorized_retries == 0


async def test_rbac_revoked_is_a_revocation_within_two_requests(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    owned_slice(fake, "orders-a", 1)
    cfg = config(write_kubeconfig(tmp_path / "config", fake.url))
    async with open_discovery(cfg, providers=in_process(cfg, fake)) as owner:
        observation = await owner.client().observe("orders", trio.current_time() + 5)
        await fake.wait_for(lambda: fake.open_watches == 2)
        fake.deny("alice", "*", "endpointslices")
        seen = len(fake.requests)
        fake.end_watches()  # both streams re-watch: the slice watch is the next request denied
        await wait_until(observation, lambda: refusal(observation) == "revoked")
        after = fake.requests[seen:]
        denied = [r for r in after if r.status == 403]
        # The first request to EndpointSlices after the denial (the re-watch) was
        # refused; a 403 on a watch alone may be a role that lists but does not
        # watch, so the very next request lists, is refused too, and that answer
        # revoked the evidence: no backoff, no grace in between.
        slices = [r for r in after if r.path == SLICES]
        assert slices[:2] == denied == denied[:2]
        assert [bool(r.query.get("watch")) for r in denied] == [True, False]
        # No grace, and the Service stream (still allowed, re-opened) does not undo it.
        await trio.sleep(20)
        assert refusal(observation) == "revoked"
        fake.allow("alice")
        await wait_until(observation, lambda: identities(observation) == ("pod-1",))


async def test_each_watched_service_takes_two_streams_and_a_queued_one_keeps_polling(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    fake.create_service("payments")
    owned_slice(fake, "orders-a", 1)
    owned_slice(fake, "payments-a", 7, service="payments")
    cfg = config(
        write_kubeconfig(tmp_path / "config", fake.url),
        limits={"max_watch_streams": 3},
        services={"orders": {"port": "http"}, "payments": {"port": "http"}},
    )
    async with open_discovery(cfg, providers=in_process(cfg, fake)) as owner:
        orders = await owner.client().observe("orders", trio.current_time() + 5)
        payments = await owner.client().observe("payments", trio.current_time() + 5)
        await fake.wait_for(lambda: fake.open_watches == 2)
        await trio.sleep(1)
        assert fake.open_watches == 2  # 3 streams: room for one Service's two only
        watched = {r.query.get("fieldSelector") for r in fake.watch_requests("services")}
        assert watched == {"metadata.name=orders"}
        start = trio.current_time()
        owned_slice(fake, "payments-a", 7, 8, service="payments")
        await wait_until(payments, lambda: identities(payments) == ("pod-7", "pod-8"))
        # Seen by the queued service's polling (poll_interval_ms = 5000), not by a watch.
        assert 0 < trio.current_time() - start <= 5.5
        owned_slice(fake, "orders-a", 1, 2)
        await wait_until(orders, lambda: identities(orders) == ("pod-1", "pod-2"), limit=0.5)


# -- 410s and disconnects at random: the served set converges to the truth ---------------------

PODS = st.integers(1, 6)
STATE = st.sampled_from(["served", "draining", "withdrawn"])
OPERATION = st.one_of(
    st.tuples(st.just("put"), st.sampled_from("abc"), st.dictionaries(PODS, STATE, max_size=4)),
    st.tuples(st.just("delete"), st.sampled_from("abc")),
    st.tuples(st.just("expire")),
    st.tuples(st.just("compact")),
    st.tuples(st.just("break")),
    st.tuples(st.just("end")),
    st.tuples(st.just("recreate")),
    st.tuples(st.just("sleep"), st.floats(0, 3)),
)
CONDITIONS: dict[str, dict[str, Any]] = {
    "served": {"ready": True},
    "draining": {"ready": False, "serving": True, "terminating": True},
    "withdrawn": {"ready": False, "serving": False, "terminating": True},
}


def truth(fake: KubernetesFake) -> list[tuple[str, str, int, bool]]:
    services = [decode_service(json.dumps(o).encode()) for o in fake.objects["services"].values()]
    slices = [decode_slice(json.dumps(o).encode()) for o in fake.objects["endpointslices"].values()]
    listing = build_snapshot(
        "orders", services[0] if services else None, slices, port="http", max_instances=100
    )
    return [(i.identity, i.host, i.port, i.draining) for i in listing.instances]


def served(observation: Observation) -> list[tuple[str, str, int, bool]] | str:
    try:
        return [(i.identity, i.host, i.port, i.draining) for i in observation.snapshot().instances]
    except EvidenceUnavailable as exc:
        return exc.reason


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(st.lists(OPERATION, min_size=1, max_size=14))
def test_random_events_410s_and_disconnects_converge_to_the_fakes_state(
    tmp_path: Path, operations: list[tuple[Any, ...]]
) -> None:
    async def scenario() -> None:
        fake = seeded(window=8)
        owned_slice(fake, "orders-a", 1)
        # Confirmation queries only every 100 s: within the scenario (at most ~60 s)
        # everything after the first listing must come through the two watches.
        slow_polls = {
            "poll_interval_ms": 100_000,
            "snapshot": {"max_age_ms": 200_000, "stale_if_error_ms": 100_000},
        }
        cfg = config(write_kubeconfig(tmp_path / "config", fake.url), connection=slow_polls)
        providers = in_process(cfg, fake)
        async with open_discovery(cfg, providers=providers) as owner:
            observation = await owner.client().observe("orders", trio.current_time() + 5)
            started = trio.current_time()
            for operation in operations:
                kind = operation[0]
                if kind == "put":
                    _, name, pods = operation
                    endpoints = [
                        endpoint(n, **CONDITIONS[state]) for n, state in sorted(pods.items())
                    ]
                    fake.put_slice(
                        slice_object(
                            f"orders-{name}",
                            "orders",
                            endpoints,
                            owner_uid=fake.service_uid("orders"),
                        )
                    )
                elif kind == "delete":
                    if ("default", f"orders-{operation[1]}") in fake.objects["endpointslices"]:
                        fake.delete_slice(f"orders-{operation[1]}")
                elif kind == "expire":
                    fake.compact()
                    fake.expire_watches()
                elif kind == "compact":
                    fake.compact()
                elif kind == "break":
                    fake.break_watches()
                elif kind == "end":
                    fake.end_watches()
                elif kind == "recreate":
                    fake.delete_service("orders")
                    fake.create_service("orders")
                else:
                    await trio.sleep(operation[1])
            await trio.sleep(20)  # quiescence: longer than any backoff (4 s) and relist
            assert trio.current_time() - started < 100  # no confirmation query helped
            expected = truth(fake)
            assert served(observation) == (expected if expected else "empty"), (
                operations,
                provider_of(providers).statistics,
            )
            assert fake.open_watches == 2

    trio.run(scenario, clock=trio.testing.MockClock(autojump_threshold=0))
