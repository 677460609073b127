"""The Kubernetes fake on versions it has not reached, restores and 429s.

Pinned to the API server's sources (the fake cites them): a plain watch from
a version the watch cache has not reached is accepted and stays silent
(staging/src/k8s.io/apiserver/pkg/storage/cacher/cacher.go Watch,
watch_cache.go getAllEventsSinceLocked, cache_watcher.go process); only a
list from such a version, or a watch with ``sendInitialEvents``, waits 3 s
and answers 504. A restore with ``--bump-revision --mark-compacted`` expires
every watch. A 429 comes as priority and fairness writes it (plain text,
``Retry-After``) or as a ``TooManyRequests`` Status with
``retryAfterSeconds`` and the same header.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
import trio
import trio.testing

from tests.fakes.kubernetes import KubernetesFake, run_kubernetes_fake, slice_object
from tests.providers.kubernetes.conftest import TOKEN, endpoint

from .test_kubernetes_fake import SLICES, client, events_of, seeded, watching


def bump(fake: KubernetesFake) -> None:
    """One write that is not a slice (it moves the version only)."""
    fake.create_service("unrelated")


@pytest.mark.trio_only
async def test_a_watch_from_a_version_not_reached_is_accepted_and_silent_until_passed(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = seeded(bookmark_interval=10.0)
    held = fake.version + 3
    async with client(fake) as http:
        params = {
            "watch": "1",
            "resourceVersion": str(held),
            "allowWatchBookmarks": "true",
            "timeoutSeconds": "200",
        }
        began = trio.current_time()
        async with watching(http, params) as (response, lines):
            # No 3 s wait and no 504: the watch is accepted at once.
            assert response.status_code == 200 and trio.current_time() == began
            seen: list[dict[str, Any]] = []

            async def read() -> None:
                async for line in lines:
                    if line:
                        seen.append(json.loads(line))

            async with trio.open_nursery() as nursery:
                nursery.start_soon(read)
                # Writes up to the version asked for are not delivered, and no
                # bookmark comes while the store is below it (one every 10 s).
                fake.put_slice(slice_object("orders-7", "orders", [endpoint(7)], owner_uid="x"))
                bump(fake)
                await trio.sleep(30)
                bump(fake)
                assert fake.version == held
                await trio.sleep(30)
                assert seen == []
                # Past it, events flow again (only the later ones), then bookmarks.
                fake.put_slice(slice_object("orders-8", "orders", [endpoint(8)], owner_uid="x"))
                await trio.sleep(11)
                nursery.cancel_scope.cancel()
            assert seen[0]["type"] == "ADDED" and len(seen) >= 2
            assert seen[0]["object"]["metadata"]["name"] == "orders-8"
            assert seen[0]["object"]["metadata"]["resourceVersion"] == str(held + 1)
            assert {e["type"] for e in seen[1:]} == {"BOOKMARK"}
            assert {e["object"]["metadata"]["resourceVersion"] for e in seen[1:]} == {str(held + 1)}


@pytest.mark.trio_only
async def test_a_list_or_an_initial_events_watch_from_a_version_not_reached_is_a_504(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = seeded()
    future = str(fake.version + 10)
    async with client(fake) as http:
        began = trio.current_time()
        listed = await http.get(SLICES, params={"resourceVersion": future})
        assert listed.status_code == 504 and trio.current_time() - began == pytest.approx(3)
        # storage/errors.go retryAfterSeconds 1, and responsewriters sets the header.
        assert listed.json()["details"]["retryAfterSeconds"] == 1
        assert listed.headers["retry-after"] == "1"
        initial = await http.get(
            SLICES,
            params={
                "watch": "1",
                "resourceVersion": future,
                "resourceVersionMatch": "NotOlderThan",
                "sendInitialEvents": "true",
                "allowWatchBookmarks": "true",
            },
        )
        assert initial.status_code == 504
        assert initial.json()["details"]["causes"][0]["reason"] == "ResourceVersionTooLarge"


@pytest.mark.trio_only
async def test_a_restore_without_bump_ends_or_breaks_watches_and_goes_back(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = seeded()
    backup = fake.version
    fake.delete_slice("orders-5")
    held = fake.version
    async with client(fake) as http:
        params = {"watch": "1", "resourceVersion": str(held), "timeoutSeconds": "100"}
        async with watching(http, params) as (_, lines):
            began = trio.current_time()
            fake.restore(backup, watches="end")
            assert [line async for line in lines if line] == []  # a clean end
            assert trio.current_time() == began
        listed = (await http.get(SLICES)).json()
        assert listed["metadata"]["resourceVersion"] == str(backup)  # versions went back
        assert len(listed["items"]) == 5  # orders-5 is back
        async with http.stream("GET", SLICES, params=params) as response:
            fake.restore(backup)  # the default: the connection breaks
            with pytest.raises(httpx.ReadError):
                async for _ in response.aiter_lines():
                    pass


@pytest.mark.trio_only
async def test_a_restore_with_bump_expires_open_watches_and_older_versions(
    autojump_clock: trio.testing.MockClock,
) -> None:
    fake = seeded()
    backup = fake.version
    fake.delete_slice("orders-5")
    held = fake.version
    async with client(fake) as http:
        params = {"watch": "1", "resourceVersion": str(held)}
        async with watching(http, params) as (_, lines):
            fake.restore(backup, bump=1000)
            (error,) = await events_of(lines, 1)
            assert error["type"] == "ERROR"
            assert error["object"]["code"] == 410 and error["object"]["reason"] == "Expired"
            assert [line async for line in lines if line] == []
        assert fake.version == backup + 1000
        # Watching again from the version held: 410, so the client lists again.
        async with http.stream("GET", SLICES, params=params) as response:
            events = [json.loads(line) async for line in response.aiter_lines() if line]
            assert [e["object"]["code"] for e in events] == [410]
        listed = (await http.get(SLICES)).json()
        assert listed["metadata"]["resourceVersion"] == str(backup + 1000)  # higher than held
        assert len(listed["items"]) == 5
    with pytest.raises(ValueError, match="positive"):
        fake.restore(backup, bump=0)


async def test_a_429_comes_as_priority_and_fairness_or_as_a_status() -> None:
    fake = seeded()
    async with client(fake) as http:
        fake.throttle(SLICES, retry_after=5, times=2)
        for params in ({}, {"watch": "1"}):
            throttled = await http.get(SLICES, params=params)
            assert throttled.status_code == 429
            # Go's http.Error: plain text, no Status object.
            assert throttled.headers["content-type"] == "text/plain; charset=utf-8"
            assert throttled.text == "Too many requests, please try again later.\n"
            assert throttled.headers["retry-after"] == "5"
            assert throttled.headers["x-kubernetes-pf-prioritylevel-uid"]
        assert (await http.get(SLICES)).status_code == 200  # only the next two
        fake.throttle(SLICES, retry_after=7, form="status")
        status = await http.get(SLICES)
        body = status.json()
        assert (status.status_code, body["kind"], body["reason"]) == (
            429,
            "Status",
            "TooManyRequests",
        )
        assert body["details"]["retryAfterSeconds"] == 7 and status.headers["retry-after"] == "7"
        assert body["message"] == "storage is (re)initializing"
        # fail_next: the reason the API server gives the code, and a 429 says when.
        fake.fail_next[SLICES] = [429, 503]
        injected = await http.get(SLICES)
        assert injected.json()["reason"] == "TooManyRequests"
        assert injected.headers["retry-after"] == "1"
        unavailable = await http.get(SLICES)
        assert unavailable.json()["reason"] == "ServiceUnavailable"
        assert "retry-after" not in unavailable.headers
    async with client(fake, token="not-a-token") as http:
        fake.throttle(SLICES)
        assert (await http.get(SLICES)).status_code == 401  # authentication comes first


@pytest.mark.trio_only
async def test_the_served_fake_sends_the_same_429_headers() -> None:
    async with run_kubernetes_fake(tokens={TOKEN: "alice"}) as fake:
        fake.create_service("orders")
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with httpx.AsyncClient(base_url=fake.url, headers=headers) as http:
            fake.throttle(SLICES, retry_after=3)
            plain = await http.get(SLICES)
            assert plain.status_code == 429 and plain.headers["retry-after"] == "3"
            assert plain.headers["content-type"].startswith("text/plain")
            assert plain.text == "Too many requests, please try again later.\n"
            fake.throttle(SLICES, retry_after=4, form="status")
            status = await http.get(SLICES)
            assert status.headers["retry-after"] == "4"
            assert status.json()["details"]["retryAfterSeconds"] == 4
