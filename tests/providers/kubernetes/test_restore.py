"""Storage restores, against a fake that answers as the API server's watch cache does.

A restore without ``--bump-revision`` makes versions go backwards. A client
that watches again from the later version it holds is accepted (200) and
hears nothing, bookmarks included, until the cluster passes that version
(staging/src/k8s.io/apiserver/pkg/storage/cacher/watch_cache.go
getAllEventsSinceLocked, cache_watcher.go process). What the provider can do
about it, and the one case it cannot see, are in docs/providers-kubernetes.md
(Storage restores). Under trio's MockClock through ``fake.transport()``.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import trio
import trio.testing

from nadisc import IncompleteSnapshot
from tests.fakes.kubernetes import KubernetesFake

from .conftest import TOKEN, owned_slice, watching

pytestmark = pytest.mark.trio_only

#: Versions the restored cluster writes elsewhere (a Service nobody watches).
UNRELATED = "billing"


def outgrow(fake: KubernetesFake, held: int) -> None:
    """Writes elsewhere until the cluster's version reaches ``held``."""
    while fake.version < held:
        fake.create_service(UNRELATED)


def restored_warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno == logging.WARNING and "storage was restored" in r.getMessage()
    ]


async def test_writes_below_the_held_version_come_with_the_relist_and_later_ones_after(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    async with watching(fake, tmp_path) as (_, sink):
        backup = fake.version
        await fake.wait_for(lambda: fake.open_watches == 2)
        for n in (2, 3, 4, 5):
            owned_slice(fake, f"orders-x{n}", n)  # only in the lost timeline
        await sink.wait_for(lambda: len(sink.identities) == 5)
        await trio.sleep(61)
        held = fake.version
        fake.restore(backup, watches="end")
        # The restored cluster writes while the watches are silent, still
        # below the version held: nothing is delivered, the relist finds it.
        owned_slice(fake, "orders-new", 9)
        assert fake.version < held
        with trio.fail_after(200):
            await sink.wait_for(lambda: sink.identities == ("pod-1", "pod-9"))
        # Then it passes the held version: those events apply to the right state.
        outgrow(fake, held)
        owned_slice(fake, "orders-newer", 8)
        with trio.fail_after(10):
            await sink.wait_for(lambda: sink.identities == ("pod-1", "pod-8", "pod-9"))
        lost = {"pod-2", "pod-3", "pod-4", "pod-5"}
        relisted = next(
            i for i, s in enumerate(sink.published) if s.identities() == ("pod-1", "pod-9")
        )
        assert all(not lost & set(s.identities()) for s in sink.published[relisted:])


async def test_a_restore_that_breaks_the_watches_is_relisted_at_once_even_when_outgrown(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # The API servers restart: the connections break. A failed stream lists
    # again before it watches again, so even a cluster that passed the held
    # version before the provider came back is seen as it is.
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    async with watching(fake, tmp_path, initial_backoff=1, max_backoff=2) as (_, sink):
        backup = fake.version
        await fake.wait_for(lambda: fake.open_watches == 2)
        for n in (2, 3, 4, 5):
            owned_slice(fake, f"orders-x{n}", n)
        await sink.wait_for(lambda: len(sink.identities) == 5)
        held = fake.version
        published = len(sink.published)
        restored_at = trio.current_time()
        fake.restore(backup)
        outgrow(fake, held + 1)
        owned_slice(fake, "orders-new", 9)  # a version above the held one
        with trio.fail_after(30):
            await sink.wait_for(lambda: sink.identities == ("pod-1", "pod-9"))
        assert trio.current_time() - restored_at <= 2  # one backoff delay
        assert sink.failures and all(isinstance(f, IncompleteSnapshot) for f in sink.failures)
        # The listing held before the restore was never published again.
        assert [s.identities() for s in sink.published[published:]] == [("pod-1", "pod-9")]
        await trio.sleep(100)
        assert sink.identities == ("pod-1", "pod-9")


async def test_before_any_bookmark_a_silent_watch_checks_the_version_and_relists(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # No bookmark has been seen (a server without a watch cache sends none),
    # so silence is no failure; the quiet reopen first asks for one item to
    # read the cluster's version, and a lower one means a restore.
    caplog.set_level(logging.INFO, "nadisc_kubernetes")
    fake = KubernetesFake(tokens={TOKEN: "alice"}, bookmark_interval=None)
    async with watching(fake, tmp_path) as (provider, sink):
        backup = fake.version
        await fake.wait_for(lambda: fake.open_watches == 2)
        owned_slice(fake, "orders-a", 1, 2)
        await sink.wait_for(lambda: sink.identities == ("pod-1", "pod-2"))
        published = len(sink.published)
        restored_at = trio.current_time()
        fake.restore(backup, watches="end")
        with trio.fail_after(300):
            await sink.wait_for(lambda: sink.identities == ("pod-1",))
        assert trio.current_time() - restored_at <= 82
        assert len(sink.published) == published + 1 and not sink.failures
        assert not provider.bookmarks_seen and provider.statistics.version_checks >= 1
        assert restored_warnings(caplog)


async def test_a_quiet_reopen_on_a_healthy_server_only_checks_the_version(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"}, bookmark_interval=None)
    async with watching(fake, tmp_path) as (provider, sink):
        await trio.sleep(200)
        stats = provider.statistics
        # Two streams, silent 80 s each, twice: a one-item list and a reopen each.
        assert stats.quiet_reopens == stats.version_checks == 4
        assert stats.relists == 0 and stats.lists == 2 and not sink.failures
        checks = [r for r in fake.requests if r.query.get("limit") == "1"]
        assert len(checks) == 4 and all(not r.query.get("watch") for r in checks)
        assert len(sink.published) == 1


async def test_the_recommended_restore_expires_the_watches_and_relists_at_once(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    # etcdutl snapshot restore --bump-revision N --mark-compacted: versions
    # jump ahead and everything older is compacted, so every watcher gets 410.
    caplog.set_level(logging.INFO, "nadisc_kubernetes")
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    async with watching(fake, tmp_path) as (provider, sink):
        backup = fake.version
        await fake.wait_for(lambda: fake.open_watches == 2)
        owned_slice(fake, "orders-a", 1, 2)
        await sink.wait_for(lambda: sink.identities == ("pod-1", "pod-2"))
        restored_at = trio.current_time()
        fake.restore(backup, bump=1_000_000)
        with trio.fail_after(30):
            await sink.wait_for(lambda: sink.identities == ("pod-1",))
        assert trio.current_time() - restored_at <= 1  # one backoff delay
        assert provider.statistics.relists == 2 and not sink.failures
        assert not restored_warnings(caplog)  # versions went up: nothing to notice
