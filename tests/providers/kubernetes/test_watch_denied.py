"""A role that may list but not watch, and a relist that finds nothing new.

The cases without a clock fixture run on both loops and check the order of
events (with short backoff settings); the MockClock cases pin the timing.
"""

from __future__ import annotations

import logging
from pathlib import Path

import anyio
import pytest
import trio
import trio.testing

from nadisc import IdentityRevoked, open_discovery
from tests.fakes.kubernetes import KubernetesFake

from .conftest import TOKEN, owned_slice, watching, write_kubeconfig
from .test_owner import config, in_process, provider_of

LOGGER = "nadisc_kubernetes._provider"


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage() for r in caplog.records if r.name == LOGGER and r.levelno >= logging.WARNING
    ]


async def test_a_list_only_role_keeps_the_listing_and_polls(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger=LOGGER)
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    fake.deny("alice", "watch", "endpointslices")
    async with watching(fake, tmp_path, initial_backoff=0.01, max_backoff=0.02) as (
        provider,
        sink,
    ):
        stats = provider.statistics
        with anyio.fail_after(10):
            await fake.wait_for(lambda: stats.polls >= 3)
        # Listed, kept, confirmed by every poll; never a failure.
        assert sink.identities == ("pod-1",) and not sink.failures
        assert len(sink.published) == 1 and sink.refreshes >= 1
        assert stats.watch_denials >= 3 and fake.open_watches == 1  # the Service watch
        owned_slice(fake, "orders-b", 2)  # seen by the next poll
        with anyio.fail_after(10):
            await sink.wait_for(lambda: sink.identities == ("pod-1", "pod-2"))
        warned = warnings_of(caplog)
        assert len(warned) == 1, warned
        assert 'verb "watch" on resource "endpointslices"' in warned[0]
        assert 'in API group "discovery.k8s.io" in namespace "default"' in warned[0]
        assert TOKEN not in warned[0]
        # The role is fixed: the next cycle's watch opens and the polls stop.
        fake.allow("alice")
        with anyio.fail_after(10):
            await fake.wait_for(lambda: fake.open_watches == 2)
        polls = stats.polls
        owned_slice(fake, "orders-c", 3)  # now a watch event
        with anyio.fail_after(10):
            await sink.wait_for(lambda: sink.identities == ("pod-1", "pod-2", "pod-3"))
        assert stats.polls == polls and not sink.failures
        # A role that lost list as well is a revocation, as before.
        fake.deny("alice", "*", "endpointslices")
        fake.end_watches()
        with anyio.fail_after(10):
            await sink.wait_for(lambda: any(isinstance(f, IdentityRevoked) for f in sink.failures))
    assert len(warnings_of(caplog)) == 1


async def test_a_relist_after_410_with_nothing_new_confirms(tmp_path: Path) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"}, bookmark_interval=None)
    async with watching(fake, tmp_path, initial_backoff=0.01, max_backoff=0.02) as (
        provider,
        sink,
    ):
        with anyio.fail_after(10):
            await fake.wait_for(lambda: fake.open_watches == 2)
        published, refreshes = len(sink.published), sink.refreshes
        fake.compact()
        fake.expire_watches()
        with anyio.fail_after(10):
            await fake.wait_for(lambda: provider.statistics.relists >= 2 and fake.open_watches == 2)
        # No bookmarks here: only the relist could have confirmed.
        assert sink.refreshes > refreshes
        assert len(sink.published) == published and not sink.failures


async def test_list_only_role_through_the_owner_on_mock_time(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    fake.create_service("orders")
    owned_slice(fake, "orders-a", 1)
    fake.deny("alice", "watch", "endpointslices")
    cfg = config(write_kubeconfig(tmp_path / "config", fake.url), max_backoff=4)
    providers = in_process(cfg, fake)
    provider = provider_of(providers)
    async with open_discovery(cfg, providers=providers) as owner:
        observation = await owner.client().observe("orders", trio.current_time() + 5)
        revision = observation.snapshot().revision
        start = trio.current_time()
        await trio.sleep(120)
        # Never revoked, nothing republished, one WARNING; a poll at most
        # every max_backoff (4 s), at least every half of it.
        assert observation.snapshot().identities() == ("pod-1",)
        assert observation.snapshot().revision == revision
        assert 120 / 4 <= provider.statistics.polls <= 120 / 2 + 1
        assert len(warnings_of(caplog)) == 1
        confirmed = observation.snapshot().confirmed_at
        assert confirmed is not None and confirmed > start + 110
        owned_slice(fake, "orders-a", 1, 2)
        with trio.fail_after(4.5):  # the next poll, within max_backoff
            while observation.snapshot().identities() != ("pod-1", "pod-2"):
                await observation.changed(trio.current_time() + 5)


async def test_relist_after_410_renews_the_observation_on_mock_time(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"}, bookmark_interval=None)
    fake.create_service("orders")
    owned_slice(fake, "orders-a", 1)
    cfg = config(write_kubeconfig(tmp_path / "config", fake.url))
    providers = in_process(cfg, fake)
    provider = provider_of(providers)
    async with open_discovery(cfg, providers=providers) as owner:
        observation = await owner.client().observe("orders", trio.current_time() + 5)
        await fake.wait_for(lambda: fake.open_watches == 2)
        await trio.sleep(3)  # within the confirmation window: no re-read yet
        before = observation.snapshot()
        fake.compact()
        fake.expire_watches()
        await fake.wait_for(lambda: provider.statistics.relists >= 2 and fake.open_watches == 2)
        after = observation.snapshot()
        assert before.confirmed_at is not None and after.confirmed_at is not None
        assert after.confirmed_at > before.confirmed_at
        assert after.revision == before.revision and after.identities() == ("pod-1",)
