"""DiscoveryTransport against real loopback HTTP servers (no mocked transport)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import httpx
import pytest

from nadisc import (
    DeadlineExceeded,
    DiscoveryOwner,
    DiscoveryTransport,
    EvidenceUnavailable,
    IdentityRevoked,
    IncompleteSnapshot,
    Instance,
    InstanceSchemeMismatch,
    NotDiscoveryUrl,
    ObservationSnapshot,
    QualifierError,
    RestConfig,
    RestOptions,
    SnapshotConfig,
    UnknownService,
    declared_scheme,
)
from nadisc._route import Attempt, InstanceService, Route
from nadisc.testing import MemoryProvider
from tests.nadisc.owner_support import memory_owner, policy
from tests.support_http import HttpBackend, count_connections, serve_backends

SERVICE = "orders"


def provider(*instances: Instance) -> MemoryProvider:
    memory = MemoryProvider(services={SERVICE: SERVICE}, watch=True)
    memory.set(SERVICE, instances)
    return memory


@asynccontextmanager
async def discovery(
    memory: MemoryProvider, **rest: Any
) -> AsyncIterator[tuple[DiscoveryOwner, DiscoveryTransport, httpx.AsyncClient]]:
    async with memory_owner(
        {"primary": memory}, policies={"primary": policy(rest=RestConfig(**rest))}
    ) as owner:
        transport = DiscoveryTransport(owner)
        async with httpx.AsyncClient(mounts={"nadisc://": transport}) as http:
            yield owner, transport, http


def closed_port_instance(identity: str) -> Instance:
    """An instance on a loopback port nothing listens on (connection refused)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return Instance(identity, "127.0.0.1", port)


async def test_round_robin_rewrites_url_and_host_per_instance() -> None:
    async with serve_backends(HttpBackend("a"), HttpBackend("b")) as (a, b):
        memory = provider(a.instance(), b.instance())
        async with discovery(memory) as (_, transport, http):
            bodies = []
            for _ in range(6):
                response = await http.get("nadisc://primary/orders/v1/items?limit=5")
                assert response.status_code == 200
                assert str(response.request.url) == "nadisc://primary/orders/v1/items?limit=5"
                assert response.extensions["nadisc.instance"].identity == response.text
                bodies.append(response.text)
            assert sorted(bodies) == ["a", "a", "a", "b", "b", "b"]
            assert bodies[0] != bodies[1]
            assert {(r.method, r.path) for r in a.requests} == {("GET", "/v1/items")}
            assert {r.host for r in b.requests} == {f"{b.host}:{b.port}"}
            route = transport.route("primary", SERVICE)
            assert route is not None
            stats = route.statistics()
            assert stats.sent == {"a": 3, "b": 3}
            assert stats.in_flight == {"a": 0, "b": 0}


async def test_other_schemes_and_malformed_urls_never_reach_discovery() -> None:
    async with serve_backends(HttpBackend("a")) as (a,):
        memory = provider(a.instance())
        async with discovery(memory) as (_, transport, _http):
            for url in (
                a.url + "/orders/x",
                "nadisc://primary/",
                "nadisc://primary:80/orders/x",
            ):
                with pytest.raises(NotDiscoveryUrl):
                    await transport.handle_async_request(httpx.Request("GET", url))
            assert sum(memory.query_counts.values()) == 0
            assert a.served == 0
            with pytest.raises(QualifierError):
                await transport.handle_async_request(
                    httpx.Request("GET", "nadisc://elsewhere/orders/x")
                )
            with pytest.raises(UnknownService):
                await transport.handle_async_request(
                    httpx.Request("GET", "nadisc://primary/payments/x")
                )
            assert sum(memory.query_counts.values()) == 0


async def test_drain_during_load_loses_no_request_and_drained_gets_nothing() -> None:
    backends = [HttpBackend(name, latency=0.002) for name in ("a", "b", "c")]
    async with serve_backends(*backends) as (a, b, c):
        memory = provider(a.instance(), b.instance(), c.instance())
        async with discovery(memory) as (_, transport, http):
            statuses: list[int] = []
            total = 300
            issued = 0
            sent_to_b_at_drain: int | None = None

            async def worker() -> None:
                nonlocal issued, sent_to_b_at_drain
                while issued < total:
                    issued += 1
                    if issued == total // 3:
                        memory.set(SERVICE, [a.instance(), c.instance()])
                        route = transport.route("primary", SERVICE)
                        assert route is not None
                        sent_to_b_at_drain = route.statistics().sent.get("b", 0)
                    response = await http.get("nadisc://primary/orders/work")
                    statuses.append(response.status_code)

            async with anyio.create_task_group() as tg:
                for _ in range(16):
                    tg.start_soon(worker)
            assert statuses == [200] * total
            route = transport.route("primary", SERVICE)
            assert route is not None
            stats = route.statistics()
            assert sent_to_b_at_drain is not None and sent_to_b_at_drain > 0
            # Nothing was handed to b after the drain, and b saw exactly what was sent.
            assert stats.sent["b"] == sent_to_b_at_drain == b.served
            assert set(stats.in_flight) == {"a", "c"}
            assert a.served + b.served + c.served == total


async def test_revoked_and_emptied_listings_send_nothing() -> None:
    async with serve_backends(HttpBackend("a")) as (a,):
        memory = provider(a.instance())
        async with discovery(memory) as (_, _transport, http):
            assert (await http.get("nadisc://primary/orders/x")).status_code == 200
            memory.watch_fail(SERVICE, IdentityRevoked("token revoked"))
            with pytest.raises(EvidenceUnavailable) as info:
                await http.get("nadisc://primary/orders/x")
            assert info.value.reason == "revoked"
            memory.set(SERVICE, [a.instance()])
            assert (await http.get("nadisc://primary/orders/x")).status_code == 200
            memory.set_empty(SERVICE)
            with pytest.raises(EvidenceUnavailable) as info:
                await http.get("nadisc://primary/orders/x")
            assert info.value.reason == "empty"
            assert a.served == 2


async def test_instance_revoked_between_selection_and_send_is_never_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async with serve_backends(HttpBackend("a"), HttpBackend("b")) as (a, b):
        memory = provider(a.instance(), b.instance())
        async with discovery(memory) as (_, transport, http):
            assert (await http.get("nadisc://primary/orders/x")).text == "a"
            route = transport.route("primary", SERVICE)
            assert route is not None
            # Let the balance keep its old pool up to the moment of sending, as if
            # the revocation landed between selection and hand-over.
            selected: list[str] = []
            real_admit = InstanceService.admit

            def stale_snapshot(self: Route) -> ObservationSnapshot:
                return self.observation.snapshot()

            def spy(self: InstanceService, attempt: Attempt, now: float | None = None) -> Instance:
                selected.append(self.key)
                return real_admit(self, attempt, now)

            monkeypatch.setattr(Route, "snapshot", stale_snapshot)
            monkeypatch.setattr(InstanceService, "admit", spy)
            memory.set(SERVICE, [a.instance()])
            response = await http.get("nadisc://primary/orders/x")
            assert selected == ["b", "a"]  # b was picked, declined, and never sent to
            assert response.text == "a"
            assert b.served == 0
            assert route.statistics().sent == {"a": 2}
            # The declined pick's guard was cancelled: nothing is left in flight.
            assert route.streaming.balance.statistics().in_flight == 0


async def test_unchanged_instance_keeps_its_endpoint_and_a_changed_one_is_rebuilt() -> None:
    async with serve_backends(HttpBackend("a"), HttpBackend("b")) as (a, b):
        memory = provider(a.instance(), b.instance())
        async with discovery(memory, lb_strategy="weighted") as (_, transport, http):
            await http.get("nadisc://primary/orders/x")
            route = transport.route("primary", SERVICE)
            assert route is not None
            balance = route.streaming.discovery
            before_a, before_b = balance.endpoint("a"), balance.endpoint("b")
            memory.set(SERVICE, [a.instance(), b.instance(weight=3.0)])
            await http.get("nadisc://primary/orders/x")
            assert balance.endpoint("a") is before_a
            assert balance.endpoint("b") is not before_b
            assert balance.endpoint("b").weight == 3.0


async def test_get_is_retried_on_another_instance_for_retryable_status() -> None:
    async with serve_backends(HttpBackend("bad", status=503), HttpBackend("good")) as (bad, good):
        memory = provider(bad.instance(), good.instance())
        async with discovery(memory, max_attempts=2, retry_get_head_on_retryable_status=True) as (
            _,
            transport,
            http,
        ):
            for _ in range(4):
                response = await http.get("nadisc://primary/orders/x")
                assert response.status_code == 200 and response.text == "good"
            # Without the switch, or for POST, the 503 is the answer.
            response = await http.post("nadisc://primary/orders/x", content=b"order")
            posts = [r for r in bad.requests + good.requests if r.method == "POST"]
            assert len(posts) == 1
            assert response.status_code in (200, 503)
            route = transport.route("primary", SERVICE)
            assert route is not None
            assert route.statistics().in_flight == {"bad": 0, "good": 0}


async def test_post_is_not_retried_after_a_connect_failure_when_switched_off() -> None:
    # retry_on_connect_failure: false restores the strict rule (only GET/HEAD
    # ever move on); with the default, test_transport_faults covers the retry.
    async with serve_backends(HttpBackend("good")) as (good,):
        dead = closed_port_instance("dead")
        memory = provider(dead, good.instance())
        async with discovery(
            memory,
            max_attempts=4,
            retry_get_head_on_transport_error=True,
            retry_get_head_on_retryable_status=True,
            retry_on_connect_failure=False,
            outlier={"enabled": False},
        ) as (_, transport, http):
            with pytest.raises(httpx.ConnectError, match="instance 'dead' "):
                await http.post("nadisc://primary/orders/x", content=b"once")
            assert good.served == 0
            # The same failure on GET moves on to the other instance.
            for _ in range(2):
                response = await http.get("nadisc://primary/orders/x")
                assert response.status_code == 200
            route = transport.route("primary", SERVICE)
            assert route is not None
            assert route.statistics().sent == {"dead": 2, "good": 2}


async def test_attempts_never_exceed_max_attempts() -> None:
    backends = tuple(HttpBackend(f"s{i}", status=503) for i in range(5))
    async with serve_backends(*backends) as served:
        memory = provider(*(b.instance() for b in served))
        async with discovery(memory, max_attempts=3, retry_get_head_on_retryable_status=True) as (
            _,
            _transport,
            http,
        ):
            response = await http.get("nadisc://primary/orders/x")
            assert response.status_code == 503
            hits = [b.served for b in served]
            assert sum(hits) == 3 and max(hits) == 1  # three different instances


async def test_retries_share_one_budget() -> None:
    slow = (HttpBackend("s1", latency=60.0), HttpBackend("s2", latency=60.0))
    async with serve_backends(*slow) as (s1, s2):
        memory = provider(s1.instance(), s2.instance())
        async with discovery(
            memory,
            request_timeout_ms=600,
            connect_timeout_ms=100,
            max_attempts=16,
            retry_get_head_on_transport_error=True,
        ) as (_, transport, http):
            started = anyio.current_time()
            with pytest.raises(DeadlineExceeded):
                await http.get("nadisc://primary/orders/x")
            elapsed = anyio.current_time() - started
            # At least the 0.6 s budget (its timer cannot fire early); measured
            # 0.60-0.65 s and bounded at 11x, below one unbudgeted attempt (60 s)
            # or 16 attempts of 0.6 s each (9.6 s).
            assert 0.6 <= elapsed < 7.0
            route = transport.route("primary", SERVICE)
            assert route is not None
            assert sum(route.statistics().sent.values()) <= 16
            assert route.statistics().in_flight == {"s1": 0, "s2": 0}


async def test_cancelled_caller_releases_the_load_guard() -> None:
    async with serve_backends(HttpBackend("slow", latency=5.0)) as (slow,):
        memory = provider(slow.instance())
        async with discovery(memory) as (_, transport, http):
            route_seen: list[int] = []

            async def watch() -> None:
                await anyio.sleep(0.2)  # the request is at the backend by now
                assert slow.active == 1
                route = transport.route("primary", SERVICE)
                assert route is not None
                route_seen.append(route.statistics().in_flight["slow"])

            with anyio.move_on_after(0.3) as scope:
                async with anyio.create_task_group() as tg:
                    tg.start_soon(watch)
                    await http.get("nadisc://primary/orders/x")
            assert scope.cancelled_caught
            assert route_seen == [1]
            route = transport.route("primary", SERVICE)
            assert route is not None
            assert route.statistics().in_flight == {"slow": 0}
            assert route.streaming.balance.statistics().in_flight == 0


async def test_open_response_body_keeps_load_counted_until_closed() -> None:
    async with serve_backends(HttpBackend("s", chunks=3, chunk_delay=0.01)) as (s,):
        memory = provider(s.instance())
        async with discovery(memory, lb_strategy="p2c_peak_ewma") as (_, transport, http):
            request = http.build_request("GET", "nadisc://primary/orders/stream")
            response = await http.send(request, stream=True)
            route = transport.route("primary", SERVICE)
            assert route is not None
            assert route.statistics().in_flight == {"s": 1}
            await anyio.sleep(0.05)  # the body is still open: the load stays counted
            assert route.statistics().in_flight == {"s": 1}
            await response.aclose()
            assert route.statistics().in_flight == {"s": 0}
            # A body read to the end also ends the guard.
            async with http.stream("GET", "nadisc://primary/orders/stream") as streamed:
                assert await streamed.aread() == b"ssss"
            assert route.statistics().in_flight == {"s": 0}


async def test_options_override_applies_to_every_connection() -> None:
    async with serve_backends(HttpBackend("a")) as (a,):
        memory = provider(a.instance())
        async with memory_owner({"primary": memory}) as owner:
            options = RestOptions(request_timeout=2.0, connect_timeout=0.5)
            async with DiscoveryTransport(owner, options=options, qualifiers=["primary"]) as t:
                assert t.options_for("primary") is options
                response = await t.handle_async_request(
                    httpx.Request("GET", "nadisc://primary/orders/x")
                )
                await response.aread()
                await response.aclose()
                assert response.status_code == 200
            with pytest.raises(Exception, match="closed"):
                await t.handle_async_request(httpx.Request("GET", "nadisc://primary/orders/x"))
            # A name the owner does not know is refused when the transport is made.
            with pytest.raises(QualifierError, match="unknown connection 'nope'"):
                DiscoveryTransport(owner, qualifiers=["primary", "nope"])
            with pytest.raises(TypeError, match="connection names"):
                DiscoveryTransport(owner, qualifiers=[None])  # type: ignore[list-item]


async def test_head_is_retried_too_and_the_instance_scheme_is_used() -> None:
    async with serve_backends(HttpBackend("bad", status=502), HttpBackend("good")) as (bad, good):
        memory = provider(bad.instance(), good.instance())
        async with discovery(memory, max_attempts=2, retry_get_head_on_retryable_status=True) as (
            _,
            _transport,
            http,
        ):
            for _ in range(2):
                assert (await http.head("nadisc://primary/orders/x")).status_code == 200
            # Round robin offers "bad" first both times; each retry moves to "good".
            assert [r.method for r in bad.requests] == ["HEAD", "HEAD"]
            assert [r.method for r in good.requests] == ["HEAD", "HEAD"]
        # https towards a plain-http instance: the TLS handshake fails, nothing is served.
        async with discovery(memory, instance_scheme="https") as (_, _transport, http):
            with pytest.raises(httpx.ConnectError):
                await http.get("nadisc://primary/orders/x")
        assert bad.served + good.served == 4


def _count_service_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count every pick handed to an instance service (declined ones included)."""
    calls = [0]
    real = InstanceService.admit

    def counting(self: InstanceService, attempt: Attempt, now: float | None = None) -> Instance:
        calls[0] += 1
        return real(self, attempt, now)

    monkeypatch.setattr(InstanceService, "admit", counting)
    return calls


async def test_retries_on_a_single_dead_instance_stop_at_max_attempts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Every listed instance was already tried: the retry goes to a tried one
    # instead of declining picks until the budget runs out.
    calls = _count_service_calls(monkeypatch)
    memory = provider(closed_port_instance("dead"))
    async with discovery(
        memory,
        request_timeout_ms=3000,
        connect_timeout_ms=500,
        max_attempts=3,
        retry_get_head_on_transport_error=True,
    ) as (_, transport, http):
        started = anyio.current_time()
        with pytest.raises(httpx.ConnectError):
            await http.get("nadisc://primary/orders/x")
        # Three refused connects (measured about 50 ms in all), not the 3 s
        # request timeout: a bound 30x above what it measures.
        assert anyio.current_time() - started < 1.5
        route = transport.route("primary", SERVICE)
        assert route is not None
        assert route.statistics().sent == {"dead": 3}
        assert calls[0] == 3


async def test_retryable_status_from_the_only_instance_is_returned_after_max_attempts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls = _count_service_calls(monkeypatch)
    async with serve_backends(HttpBackend("bad", status=503)) as (bad,):
        memory = provider(bad.instance())
        async with discovery(
            memory,
            request_timeout_ms=2000,
            connect_timeout_ms=500,
            max_attempts=2,
            retry_get_head_on_retryable_status=True,
        ) as (_, _transport, http):
            started = anyio.current_time()
            response = await http.get("nadisc://primary/orders/x")
            assert response.status_code == 503 and response.text == "bad"
            # Two quick 503s (measured about 40 ms), not the 2 s budget: a
            # bound 25x above what it measures.
            assert anyio.current_time() - started < 1.0
            assert bad.served == 2 and calls[0] == 2


async def test_transport_error_retries_stop_at_max_attempts_on_distinct_instances() -> None:
    memory = provider(*(closed_port_instance(f"d{i}") for i in range(5)))
    async with discovery(
        memory,
        max_attempts=3,
        retry_get_head_on_transport_error=True,
        retry_on_connect_failure=False,
        outlier={"enabled": False},
    ) as (_, transport, http):
        with pytest.raises(httpx.ConnectError):
            await http.get("nadisc://primary/orders/x")
        route = transport.route("primary", SERVICE)
        assert route is not None
        sent = route.statistics().sent
        assert sum(sent.values()) == 3 and max(sent.values()) == 1


async def test_connect_failures_try_every_instance_before_counting_an_attempt() -> None:
    # Transparent retries (the default) visit each listed instance once and
    # are not among max_attempts: the last refusal is attempt 1 of 3, and
    # the two retries max_attempts allows go to tried instances.
    memory = provider(*(closed_port_instance(f"d{i}") for i in range(5)))
    async with discovery(
        memory, max_attempts=3, retry_get_head_on_transport_error=True, outlier={"enabled": False}
    ) as (_, transport, http):
        with pytest.raises(httpx.ConnectError, match=r"instance 'd\d' \(127\.0\.0\.1:\d+\)"):
            await http.get("nadisc://primary/orders/x")
        route = transport.route("primary", SERVICE)
        assert route is not None
        sent = route.statistics().sent
        assert sorted(sent) == [f"d{i}" for i in range(5)]
        assert sum(sent.values()) == 5 + 2


async def test_retry_goes_to_another_instance_even_when_the_policy_prefers_the_bad_one() -> None:
    async with serve_backends(
        HttpBackend("bad", status=503, weight=5.0), HttpBackend("good", weight=1.0)
    ) as (bad, good):
        memory = provider(bad.instance(), good.instance())
        async with discovery(
            memory, lb_strategy="weighted", max_attempts=2, retry_get_head_on_retryable_status=True
        ) as (_, _transport, http):
            for _ in range(10):
                assert (await http.get("nadisc://primary/orders/x")).text == "good"
            assert bad.served <= 10 and good.served == 10


async def test_retries_are_off_by_default() -> None:
    async with serve_backends(HttpBackend("bad", status=503), HttpBackend("good")) as (bad, good):
        memory = provider(bad.instance(), closed_port_instance("dead"), good.instance())
        # (The transparent retry of a refused connection is on by default and
        # is not one of these retries: switched off here.)
        async with discovery(memory, max_attempts=3, retry_on_connect_failure=False) as (
            _,
            transport,
            http,
        ):
            assert (await http.get("nadisc://primary/orders/x")).status_code == 503
            with pytest.raises(httpx.ConnectError):
                await http.get("nadisc://primary/orders/x")
            route = transport.route("primary", SERVICE)
            assert route is not None
            assert route.statistics().sent == {"bad": 1, "dead": 1}
            assert bad.served == 1 and good.served == 0


async def test_plain_url_whose_host_is_a_connection_name_is_refused() -> None:
    async with serve_backends(HttpBackend("a")) as (a,):
        memory = provider(a.instance())
        async with discovery(memory) as (_, transport, _http):
            for url in ("http://primary/orders/x", "https://primary/orders/x"):
                with pytest.raises(NotDiscoveryUrl):
                    await transport.handle_async_request(httpx.Request("GET", url))
            assert sum(memory.query_counts.values()) == 0 and a.served == 0


class _RecordingHeld:
    """Stands in for ``poise.Held``: records how the guard ended."""

    def __init__(self) -> None:
        self.ended: list[str] = []

    def cancel(self) -> None:
        self.ended.append("cancelled")

    def complete(self, *, failed: bool = False) -> None:
        self.ended.append("failed" if failed else "completed")


class _FailingCloseStream(httpx.AsyncByteStream):
    """A body whose iterator raises when it is closed early."""

    def __init__(self) -> None:
        self.closed = False

    async def _chunks(self) -> AsyncIterator[bytes]:
        try:
            yield b"one"
            yield b"two"
        finally:
            raise RuntimeError("closing the iterator failed")

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks()

    async def aclose(self) -> None:
        self.closed = True


async def test_guarded_body_closes_its_stream_and_ends_the_guard_when_closing_raises() -> None:
    from nadisc._transport import _GuardedStream

    inner = _FailingCloseStream()
    held = _RecordingHeld()
    stream = _GuardedStream(inner, held, failed=False)  # type: ignore[arg-type]
    chunks = stream.__aiter__()
    assert await chunks.__anext__() == b"one"
    with pytest.raises(RuntimeError, match="closing the iterator failed"):
        await stream.aclose()
    assert inner.closed and held.ended == ["cancelled"]
    await stream.aclose()  # idempotent: nothing ends twice
    assert held.ended == ["cancelled"]


@pytest.mark.parametrize(
    ("metadata", "declared"),
    [
        ({}, None),
        ({"scheme": "https"}, "https"),
        ({"scheme": " HTTP "}, "http"),
        ({"secure": "true"}, "https"),
        ({"secure": "False"}, "http"),
        ({"secure": "maybe"}, "secure=maybe"),
        ({"scheme": "grpc", "secure": "true"}, "grpc"),  # "scheme" wins
    ],
)
def test_declared_scheme_reads_the_instance_metadata(
    metadata: dict[str, str], declared: str | None
) -> None:
    assert declared_scheme(Instance("i", "127.0.0.1", 1, metadata=metadata)) == declared


@pytest.mark.parametrize(
    ("metadata", "configured"),
    [
        ({"scheme": "https"}, "http"),
        ({"secure": "true"}, "http"),
        ({"scheme": "grpc"}, "http"),
        ({"scheme": "http"}, "https"),
        ({"secure": "false"}, "https"),
    ],
)
async def test_an_instance_declaring_another_scheme_is_refused_before_any_connection(
    metadata: dict[str, str], configured: str
) -> None:
    async with count_connections() as listener:
        memory = provider(listener.instance("odd", metadata=metadata))
        async with discovery(
            memory,
            instance_scheme=configured,
            max_attempts=3,
            retry_get_head_on_transport_error=True,
        ) as (_, transport, http):
            for _ in range(2):
                with pytest.raises(InstanceSchemeMismatch) as caught:
                    await http.get("nadisc://primary/orders/x")
                assert caught.value.identity == "odd"
                assert caught.value.configured == configured
                assert "rest.instance_scheme" in str(caught.value)
            route = transport.route("primary", SERVICE)
            assert route is not None
            assert route.statistics().sent == {}
            assert route.statistics().in_flight == {"odd": 0}
        assert listener.accepted == 0


async def test_an_instance_declaring_the_configured_scheme_is_called() -> None:
    async with serve_backends(HttpBackend("a"), HttpBackend("b")) as (a, b):
        memory = provider(
            a.instance(metadata={"scheme": "HTTP"}), b.instance(metadata={"secure": "false"})
        )
        async with discovery(memory) as (_, _transport, http):
            bodies = sorted([(await http.get("nadisc://primary/orders/x")).text for _ in range(2)])
            assert bodies == ["a", "b"]


async def test_a_listing_that_expires_is_refused_at_that_instant(
    autojump_clock: object,
) -> None:
    # The transport's evidence check is cached between events; the cache
    # must end exactly when the listing's max age (here also its grace after
    # failed refreshes) runs out.
    memory = MemoryProvider(services={SERVICE: SERVICE})
    memory.set(SERVICE, [Instance("a", "127.0.0.1", 8000)])
    config = policy(snapshot=SnapshotConfig(max_age_ms=15_000, stale_if_error_ms=15_000))
    async with memory_owner({"primary": memory}, policies={"primary": config}) as owner:
        pool = httpx.MockTransport(lambda request: httpx.Response(200))
        transport = DiscoveryTransport(owner, transport=pool)
        async with httpx.AsyncClient(mounts={"nadisc://": transport}) as http:
            url = "nadisc://primary/orders/x"
            assert (await http.get(url)).status_code == 200
            route = transport.route("primary", SERVICE)
            assert route is not None
            confirmed = route.observation.snapshot().confirmed_at
            memory.fail(SERVICE, IncompleteSnapshot("the registry is down"))
            await anyio.sleep_until(confirmed + 14.999)
            assert (await http.get(url)).status_code == 200  # failed refreshes, in grace
            assert route.observation.snapshot().degraded
            await anyio.sleep_until(confirmed + 15.0)
            with pytest.raises(EvidenceUnavailable) as info:
                await http.get(url)
            assert info.value.reason == "stale"
            assert route.statistics().sent == {"a": 2}
            # A complete listing again (the next query, after the current
            # jittered backoff of at most max_backoff_ms = 30 s): served again.
            memory.fail(SERVICE, None)
            await anyio.sleep(31.0)
            assert route.observation.snapshot().confirmed_at > confirmed
            assert (await http.get(url)).status_code == 200
