"""429 Too Many Requests and Retry-After: the next request waits what the server asked.

API Priority and Fairness rejects a request with 429, a plain-text body and
``Retry-After`` (staging/src/k8s.io/apiserver/pkg/server/filters/
priority-and-fairness.go); the watch cache, while its storage
(re)initializes, with a ``TooManyRequests`` Status carrying
``details.retryAfterSeconds`` and the same header. client-go waits that long
before it asks again (staging/src/k8s.io/client-go/rest/request.go
checkWait: 429 or any 5xx with a ``Retry-After`` in seconds). Under trio's
MockClock: every gap below is virtual time.
"""

from __future__ import annotations

import itertools
import json
from collections import deque
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from nadisc_kubernetes import KubernetesProvider, KubernetesSettings, resolve_access

from nadisc import IncompleteSnapshot
from tests.fakes.kubernetes import KubernetesFake, status_object

from .conftest import TOKEN, RecordingSink, context, owned_slice, write_kubeconfig

pytestmark = pytest.mark.trio_only

SLICES = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"


class Timed(httpx.AsyncBaseTransport):
    """The fake's transport, noting when each request on the slices was sent;
    queued answers for the slices are given first (a proxy's, say)."""

    def __init__(self, fake: KubernetesFake) -> None:
        self.inner = fake.transport()
        self.sent: list[tuple[float, bool, int]] = []
        self.canned: deque[httpx.Response] = deque()
        self._moved = trio.Event()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path != SLICES:
            return await self.inner.handle_async_request(request)
        watch = bool(request.url.params.get("watch"))
        if self.canned:
            answer = self.canned.popleft()
            self._note(watch, answer.status_code)
            return httpx.Response(
                answer.status_code,
                headers=answer.headers,
                content=answer.content,
                request=request,
            )
        response = await self.inner.handle_async_request(request)
        self._note(watch, response.status_code)
        return response

    def _note(self, watch: bool, status: int) -> None:
        self.sent.append((trio.current_time(), watch, status))
        moved, self._moved = self._moved, trio.Event()
        moved.set()

    async def until(self, count: int) -> None:
        """Wait until ``count`` requests on the slices were sent."""
        while len(self.sent) < count:
            await self._moved.wait()

    def gaps(self) -> list[float]:
        """Seconds between consecutive requests on the slices."""
        times = [t for t, _, _ in self.sent]
        return [b - a for a, b in itertools.pairwise(times)]

    def gap_after(self, status: int, nth: int = 0) -> float:
        """Seconds from the ``nth`` answer with ``status`` to the next request."""
        indexes = [i for i, (_, _, code) in enumerate(self.sent) if code == status]
        at = indexes[nth]
        return self.sent[at + 1][0] - self.sent[at][0]


def provider_on(
    fake: KubernetesFake, tmp_path: Path, transport: httpx.AsyncBaseTransport, **settings: Any
) -> KubernetesProvider:
    kubeconfig = write_kubeconfig(tmp_path / "kubeconfig", fake.url)
    parsed = KubernetesSettings.model_validate(
        {
            "credentials": "kubeconfig",
            "kubeconfig": str(kubeconfig),
            "services": {"orders": {"name": "orders", "port": "http"}},
            **settings,
        }
    )
    return KubernetesProvider(
        context(), parsed, access=resolve_access(parsed, {}), transport=transport
    )


def seeded() -> KubernetesFake:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    fake.create_service("orders")
    owned_slice(fake, "orders-a", 1)
    return fake


async def watch(provider: KubernetesProvider, sink: RecordingSink) -> None:
    """``provider.watch`` without waiting for its start (a failure starts it)."""
    await provider.watch("orders", sink, task_status=trio.TASK_STATUS_IGNORED)


async def test_a_429_from_priority_and_fairness_on_the_watch_delays_the_next_request(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    timed = Timed(fake)
    provider = provider_on(fake, tmp_path, timed, initial_backoff=0.2, max_backoff=30)
    sink = RecordingSink()
    async with trio.open_nursery() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        await fake.wait_for(lambda: fake.open_watches == 2)
        fake.throttle(SLICES, retry_after=5)
        fake.end_watches()  # the server's timeout: the re-watch is throttled
        with trio.fail_after(60):
            await timed.until(4)  # list, watch, the throttled watch, the next one
        assert [code for _, _, code in timed.sent[:3]] == [200, 200, 429]
        assert timed.gap_after(429) == pytest.approx(5)  # not the 0.1-0.2 s backoff
        (failure,) = sink.failures
        assert isinstance(failure, IncompleteSnapshot)
        assert "HTTP 429" in str(failure) and "Too many requests" in str(failure)
        nursery.cancel_scope.cancel()


async def test_a_429_status_on_the_list_delays_the_next_list(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    fake.throttle(SLICES, retry_after=7, form="status")  # the watch cache starting up
    timed = Timed(fake)
    provider = provider_on(fake, tmp_path, timed, initial_backoff=0.2)
    sink = RecordingSink()
    async with trio.open_nursery() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        with trio.fail_after(60):
            await sink.wait_for(lambda: sink.identities == ("pod-1",))
        assert timed.sent[0][2] == 429 and not timed.sent[1][1]  # a list again
        assert timed.gap_after(429) == pytest.approx(7)
        assert "HTTP 429 TooManyRequests: storage is (re)initializing" in str(sink.failures[0])
        nursery.cancel_scope.cancel()


async def test_the_servers_delay_is_capped_at_max_backoff_then_the_backoff_resumes(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    fake.throttle(SLICES, retry_after=600)
    timed = Timed(fake)
    provider = provider_on(fake, tmp_path, timed, initial_backoff=0.2, max_backoff=4)
    sink = RecordingSink()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch, provider, sink)
        with trio.fail_after(60):
            await timed.until(1)
        fake.fail_next[SLICES] = [503]  # the answer after the wait: no Retry-After
        with trio.fail_after(60):
            await sink.wait_for(lambda: sink.identities == ("pod-1",))
        codes = [code for _, _, code in timed.sent[:3]]
        assert codes == [429, 503, 200]
        assert timed.gap_after(429) == pytest.approx(4)  # max_backoff, not 600 s
        # The usual backoff again: its second step, 0.2-0.4 s.
        assert 0.2 <= timed.gap_after(503) <= 0.4
        nursery.cancel_scope.cancel()


def answer(status: int, body: bytes, **headers: str) -> httpx.Response:
    return httpx.Response(status, headers=headers, content=body)


async def test_retry_after_in_the_status_alone_or_on_a_5xx_is_honoured_too(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    timed = Timed(fake)
    too_many = status_object(429, "TooManyRequests", "slow down", {"retryAfterSeconds": 3})
    timed.canned.extend(
        [
            # A proxy dropped the header: the Status still says how long.
            answer(429, json.dumps(too_many).encode(), **{"content-type": "application/json"}),
            # A 5xx with the header (client-go waits for those as well).
            answer(503, b"upstream busy", **{"retry-after": "2"}),
            # An HTTP date is not a number of seconds (client-go ignores it too).
            answer(503, b"busy", **{"retry-after": "Wed, 21 Oct 2015 07:28:00 GMT"}),
        ]
    )
    provider = provider_on(fake, tmp_path, timed, initial_backoff=0.2, max_backoff=30)
    sink = RecordingSink()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(watch, provider, sink)
        with trio.fail_after(60):
            await sink.wait_for(lambda: sink.identities == ("pod-1",))
        gaps = timed.gaps()
        assert gaps[0] == pytest.approx(3)
        assert gaps[1] == pytest.approx(2)
        assert gaps[2] <= 0.8  # the backoff's third step (0.4-0.8 s), nothing more
        assert len(sink.failures) == 3
        nursery.cancel_scope.cancel()


async def test_a_watch_that_broke_after_a_while_starts_the_backoff_over(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # Each watch stays open two minutes and then breaks: the relist after each
    # break waits the backoff's first step (0.5-1 s), never a doubled one. A
    # stream broken now and then is not a server failing at once.
    fake = seeded()
    timed = Timed(fake)
    provider = provider_on(fake, tmp_path, timed, initial_backoff=1, max_backoff=30)
    sink = RecordingSink()
    delays = []
    async with trio.open_nursery() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        for _ in range(6):
            await fake.wait_for(lambda: fake.open_watches == 2)
            await trio.sleep(120)
            sent = len(timed.sent)
            broke = trio.current_time()
            fake.break_watches()
            with trio.fail_after(60):
                await timed.until(sent + 1)
            assert not timed.sent[sent][1]  # a list again, not a watch
            delays.append(timed.sent[sent][0] - broke)
        nursery.cancel_scope.cancel()
    assert all(0.5 <= delay <= 1 for delay in delays), delays
    assert len(sink.failures) == 12  # both streams broke each time


async def test_aclose_ends_a_streams_wait_at_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = seeded()
    fake.throttle(SLICES, retry_after=600)
    timed = Timed(fake)
    provider = provider_on(fake, tmp_path, timed, initial_backoff=0.2, max_backoff=30)
    sink = RecordingSink()
    ended: list[Exception] = []
    done = trio.Event()

    async def watching() -> None:
        try:
            await watch(provider, sink)
        except Exception as exc:
            ended.append(exc)
        finally:
            done.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(watching)
        with trio.fail_after(60):
            await timed.until(1)  # the 429: the stream now waits 30 s
        closed_at = trio.current_time()
        await provider.aclose()
        with trio.fail_after(60):
            await done.wait()
    # Virtual time: the stream's wait ended with the close, not after its 30 s.
    assert trio.current_time() - closed_at < 1
    assert isinstance(ended[0], IncompleteSnapshot) and "closed" in str(ended[0])
    assert len(timed.sent) == 1
