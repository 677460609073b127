"""One watch over the common prefix feeding many observed services (real etcd).

At reduced size (the benchmark watches 1,000 services): 200 services on one
stream, each observation seeing only its own keys; a compaction that makes
every service range again; the stream's host leaving and another member
taking over without a re-range; ``max_watch_streams`` counting the one
stream. Run on trio and on asyncio.
"""

from __future__ import annotations

import contextvars
import gc
import random
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio
import nadisc_etcd._provider as provider_module
import pytest
from nadisc_etcd import EtcdProvider, EtcdSettings

from nadisc import (
    ConnectionContext,
    DiscoveryOwner,
    Observation,
    ObservationSnapshot,
    ProviderSnapshot,
    open_discovery,
)
from tests.nadisc.owner_support import all_tasks

from .conftest import EtcdServer, RawEtcd, both_wires
from .owner_helpers import (
    Look,
    etcd_block,
    etcd_config,
    ids,
    look,
    soon,
    unique_prefix,
    wait_for,
)

pytestmark = [pytest.mark.real_server]

RawFactory = Callable[[EtcdServer], RawEtcd]


def names(count: int) -> list[str]:
    return [f"s{n:03d}" for n in range(count)]


def setup(url: str, prefix: str, count: int, **policy: Any) -> tuple[Any, EtcdProvider]:
    bound = {name: {"name": name} for name in names(count)}
    etcd: dict[str, Any] = {"services": bound, "probe_interval_ms": 1000}
    etcd.update(policy.pop("etcd", {}))
    config = etcd_config(
        url,
        prefix,
        etcd=etcd,
        limits={"max_watch_streams": 4},
        request_timeout_ms=1900,
        poll_interval_ms=20_000,
        snapshot={"max_age_ms": 30_000, "stale_if_error_ms": 10_000},
        **policy,
    )
    context = ConnectionContext(
        name="primary",
        request_timeout=1.9,
        max_instances_per_service=4096,
        max_response_bytes=4 * 1024 * 1024,
    )
    settings = EtcdSettings.model_validate(etcd_block(url, prefix, **etcd))
    return config, EtcdProvider(context, settings)


async def until(predicate: Callable[[], bool], within: float) -> None:
    with anyio.fail_after(within):
        while not predicate():  # noqa: ASYNC110 - polls the provider's counters
            await anyio.sleep(0.02)


def streams_held(owner: DiscoveryOwner) -> int:
    return owner.observer().snapshot().capacity.watch_streams


def _lists(identity: str, answer: Look) -> bool:
    return identity in (ids(answer) or ())


def _settled_on(expected: set[str], answer: Look) -> bool:
    return (
        isinstance(answer, ObservationSnapshot) and not answer.degraded and ids(answer) == expected
    )


async def observe_all(owner: DiscoveryOwner, count: int) -> dict[str, Observation]:
    client = owner.client()
    return {name: await client.observe(name, soon(10)) for name in names(count)}


# JSON wire only: the gRPC wire opens a connection per unary call, and 200
# ranges at once on a loaded machine can outlast the 1.5 s request timeout
# (a retried range then breaks the exact counts below). The gRPC wire's
# shared stream is covered by the compaction test below and test_grpc_wire.py.
async def test_200_services_share_one_stream_and_each_sees_only_its_own_keys(
    etcd_server: EtcdServer, raw: RawEtcd
) -> None:
    count = 200
    prefix = unique_prefix()
    for name in names(count):
        await raw.put_record(f"{prefix}/{name}/i0", "10.0.0.1:80")
    config, provider = setup(etcd_server.url, prefix, count)
    before = all_tasks()
    async with open_discovery(
        config, providers={"primary": provider}, prepare_deadline=soon(10)
    ) as owner:
        observations = await observe_all(owner, count)
        await until(lambda: provider.statistics().watch_streams_opened == 1, 10)
        # One socket for 200 watched services, and the owner counts exactly it
        # (max_watch_streams is 4 here: per-service watches would not fit).
        assert provider.statistics().watch_connections == 1
        assert streams_held(owner) == 1
        expected = {name: {"i0"} for name in names(count)}
        rng = random.Random(18)
        targets = rng.sample(names(count), 25)
        for n, name in enumerate(targets):
            await raw.put_record(f"{prefix}/{name}/p{n}", f"10.0.1.{n + 1}:80")
            expected[name].add(f"p{n}")
        # Keys under the prefix that no observation covers, and a key that
        # only shares a service name's leading characters.
        await raw.put_record(f"{prefix}/unbound/x", "10.0.2.1:80")
        await raw.put_record(f"{prefix}/{targets[0]}x/y", "10.0.2.2:80")
        await raw.put_record(f"{prefix}0/{targets[0]}/z", "10.0.2.3:80")
        for n, name in enumerate(targets):
            await wait_for(observations[name], partial(_lists, f"p{n}"), 5.0)
        # A last write to one service, then every observation: only its own keys.
        await raw.delete(f"{prefix}/{targets[1]}/i0")
        expected[targets[1]].discard("i0")
        await wait_for(observations[targets[1]], lambda a: "i0" not in (ids(a) or {"i0"}), 5.0)
        seen = {name: ids(look(observation)) for name, observation in observations.items()}
        assert seen == expected
        stats = provider.statistics()
        # Every service ranged once; one stream carried every change.
        listings = stats.watch_ranges + stats.watch_listings_taken
        assert (listings, stats.watch_streams_opened) == (count, 1), stats
        assert stats.watch_failures == 0, stats
    assert provider.statistics().watch_connections == 0
    assert all_tasks() == before


@both_wires
async def test_a_compacted_shared_stream_ranges_every_service_again(
    own_etcd: EtcdServer, raw_factory: RawFactory
) -> None:
    raw = raw_factory(own_etcd)
    count = 20
    prefix = unique_prefix()
    for name in names(count):
        await raw.put_record(f"{prefix}/{name}/a", "10.0.0.1:80")
    config, provider = setup(
        own_etcd.url,
        prefix,
        count,
        etcd={"retry_initial_backoff_ms": 6000, "retry_max_backoff_ms": 6000},
    )
    before = all_tasks()
    async with open_discovery(
        config, providers={"primary": provider}, prepare_deadline=soon(10)
    ) as owner:
        observations = await observe_all(owner, count)
        await until(lambda: provider.statistics().watch_streams_opened == 1, 10)
        # Every member is on the stream before the server stops. observe()
        # returns with a first listing, which need not be the member's own
        # range on the stream yet: a member still ranging when the server
        # stops fails on its own deadline, out of step with the others, and
        # may range again after the compaction (no resync to count).
        fanout = provider._fanout
        assert fanout is not None
        await until(lambda: len(fanout.live()) == count, 10)
        first = observations["s000"]
        own_etcd.pause()  # the probe times out, the stream is abandoned
        try:
            await wait_for(first, lambda a: isinstance(a, ObservationSnapshot) and a.degraded)
            # The broken stream told every member at once, and each backs
            # off (3-6 s with jitter): the writes and the compaction below
            # take about 50 ms (10x that on a loaded machine still fits)
            # before the stream is reopened.
            await until(lambda: provider.statistics().watch_failures >= count, 5)
            assert provider.statistics().watch_failures == count
        finally:
            own_etcd.resume()
        # While the members back off: change two services, compact the history.
        await raw.put_record(f"{prefix}/s001/b", "10.0.0.2:80")
        await raw.delete(f"{prefix}/s002/a")
        await raw.put_record(f"{prefix}/s002/c", "10.0.0.3:80")
        await raw.compact(await raw.revision())
        expected = {name: {"a"} for name in names(count)}
        expected["s001"] = {"a", "b"}
        expected["s002"] = {"c"}
        # Bounded generously: each member backs off 3-6 s, and a range that
        # fails on the just-resumed server waits once more; on a loaded
        # machine (both CI passes and mypy on two cores) that took over 15 s.
        for name, observation in observations.items():
            await wait_for(observation, partial(_settled_on, expected[name]), 45.0)
        stats = provider.statistics()
        # Every member was told once to range again (a range that failed on
        # the just-resumed server is retried), and the stream started afresh.
        assert stats.compaction_resyncs == count, stats
        assert stats.watch_ranges + stats.watch_listings_taken >= 2 * count, stats
        # The stream is live again for everybody.
        await raw.put_record(f"{prefix}/s019/d", "10.0.0.4:80")
        await wait_for(observations["s019"], lambda a: ids(a) == {"a", "d"}, 5.0)
        assert streams_held(owner) == 1
    assert all_tasks() == before


async def test_the_host_leaving_hands_the_stream_over_without_a_re_range(
    etcd_server: EtcdServer, raw: RawEtcd
) -> None:
    count = 20
    prefix = unique_prefix()
    for name in names(count):
        await raw.put_record(f"{prefix}/{name}/a", "10.0.0.1:80")
    config, provider = setup(etcd_server.url, prefix, count, idle_timeout_ms=300)
    before = all_tasks()
    async with open_discovery(
        config, providers={"primary": provider}, prepare_deadline=soon(10)
    ) as owner:
        observations = await observe_all(owner, count)
        await until(lambda: provider.statistics().watch_streams_opened == 1, 10)
        fanout = provider._fanout
        assert fanout is not None and fanout.host is not None
        host = fanout.host.state.service
        # The host's observation stops: its slot is reclaimed, its watch ends
        # and the stream goes with it; another member opens it again from
        # the next revision.
        del observations[host]
        gc.collect()
        await until(lambda: len(fanout) == count - 1, 5)
        await until(lambda: provider.statistics().watch_streams_opened == 2, 5)
        assert fanout.host is not None and fanout.host.state.service != host
        target = next(iter(observations))
        await raw.put_record(f"{prefix}/{target}/b", "10.0.0.2:80")
        await raw.put_record(f"{prefix}/{host}/b", "10.0.0.2:80")
        await wait_for(observations[target], lambda a: ids(a) == {"a", "b"}, 5.0)
        stats = provider.statistics()
        # Resumed, never re-ranged (the first listing a range or the query's).
        assert stats.watch_ranges + stats.watch_listings_taken == count, stats
        assert stats.watch_failures == 0, stats
        assert streams_held(owner) == 1
        # Every observation stops: no stream left, none counted.
        observations.clear()
        gc.collect()
        await until(lambda: len(fanout) == 0, 5)
        await until(lambda: provider.statistics().watch_connections == 0, 5)
        # The ticket goes back when the last slot's task has ended, which
        # may come a turn after the connection closed.
        await until(lambda: streams_held(owner) == 0, 5)
    assert all_tasks() == before


#: Set while the test itself queries (the tasks of the owner and the watch
#: were started before, so they never see it).
asked: contextvars.ContextVar[bool] = contextvars.ContextVar("asked", default=False)


def serves_host(host: str, answer: Look) -> bool:
    return isinstance(answer, ObservationSnapshot) and any(i.host == host for i in answer.instances)


async def test_a_query_of_a_watched_service_stops_after_the_first_page(
    etcd_server: EtcdServer, raw: RawEtcd, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner's confirmation query of a service whose watch already
    stands at or past the range's revision returns the watch's listing: the
    first (short) page tells the revision, the rest is neither read nor
    decoded."""
    monkeypatch.setattr(provider_module, "RANGE_PAGE", 10)
    prefix = unique_prefix()
    (name,) = names(1)
    for n in range(45):
        await raw.put_record(f"{prefix}/{name}/i{n:03d}", f"10.0.1.{n + 1}:80")
    config, provider = setup(etcd_server.url, prefix, 1)
    async with open_discovery(
        config, providers={"primary": provider}, prepare_deadline=soon(10)
    ) as owner:
        observation = await owner.client().observe(name, soon(5))
        await wait_for(observation, lambda a: len(ids(a) or ()) == 45, 5.0)
        await until(lambda: name in provider._live, 5)
        pages: list[int] = []
        original = provider._client.range

        async def counting(*args: Any, **kwargs: Any) -> Any:
            answer = await original(*args, **kwargs)
            if asked.get():  # this test's query, not the owner's or the watch's
                pages.append(len(answer.kvs))
            return answer

        async def query(provider: EtcdProvider) -> ProviderSnapshot:
            token = asked.set(True)
            try:
                return await provider.query(name, soon(5))
            finally:
                asked.reset(token)

        monkeypatch.setattr(provider._client, "range", counting)
        # The watch knows it stands at the store's revision once it applied
        # the newest write; a write elsewhere in the shared server (another
        # test's lease expiring) can come in between: then the range is read
        # in full, which is right, and the attempt is made again.
        for attempt in range(5):
            pages.clear()
            await raw.put_record(f"{prefix}/{name}/i{attempt:03d}", f"10.0.2.{attempt + 1}:80")
            await wait_for(observation, partial(serves_host, f"10.0.2.{attempt + 1}"), 5.0)
            snapshot = await query(provider)
            assert len(snapshot.instances) == 45
            if pages == [10]:
                break
            # not settled: the rest is read in one page (it fits the budget)
            assert pages == [10, 35]
        assert pages == [10]
        # Without a watch, the whole range is read in one request.
        pages.clear()
        _, unwatched = setup(etcd_server.url, prefix, 1)
        original = unwatched._client.range
        monkeypatch.setattr(unwatched._client, "range", counting)
        try:
            assert len((await query(unwatched)).instances) == 45
        finally:
            await unwatched.aclose()
        assert pages == [45]
