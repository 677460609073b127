"""The Kubernetes provider on setups the old fake hid: selectorless Services,
dual-stack, dead watches, 410 storms, storage restores, bookmark floods.

Each case here failed on the provider before these fixes (the fake then
could not express them). Under trio's MockClock through ``fake.transport()``.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path
from typing import Any

import httpx
import pytest
import trio
import trio.testing
from hypothesis import given
from hypothesis import strategies as st
from nadisc_kubernetes._pacing import (
    RefreshGate,
    silence_is_failure,
    silence_limit,
    went_backwards,
)

from nadisc import IdentityRevoked, IncompleteSnapshot, InvalidSnapshot
from tests.fakes.kubernetes import KubernetesFake, mirrored_slice_object, slice_object

from .conftest import TOKEN, RecordingSink, endpoint, in_process, owned_slice, watching

pytestmark = pytest.mark.trio_only


def deadline(seconds: float = 5) -> float:
    return trio.current_time() + seconds


def hand_written(name: str, *addresses: str, port: int = 8080) -> dict[str, Any]:
    """A slice as the Kubernetes docs show one for a Service without a selector:
    only the service-name label, no owner, no targetRef."""
    body = slice_object(
        name,
        "orders",
        [{"addresses": [a], "conditions": {"ready": True}} for a in addresses],
        ports=[{"name": "http", "port": port, "protocol": "TCP"}],
    )
    del body["metadata"]["labels"]["endpointslice.kubernetes.io/managed-by"]
    return body


# -- selectorless Services ----------------------------------------------------------------------


async def test_mirrored_slices_of_a_selectorless_service_are_served_by_default(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    fake.create_service("orders", selector=None)
    fake.put_slice(
        mirrored_slice_object("orders", "endpoints-uid", "orders-abcde", [endpoint(1), endpoint(2)])
    )
    # Mirrored from another Endpoints object (a name that is not the Service's): not evidence.
    stray = mirrored_slice_object("billing", "uid-b", "orders-zzzzz", [endpoint(3)])
    stray["metadata"]["labels"]["kubernetes.io/service-name"] = "orders"
    fake.put_slice(stray)
    provider = in_process(fake, tmp_path)
    listed = await provider.query("orders", deadline())
    assert listed.identities() == ("pod-1", "pod-2")
    assert "Endpoints/billing" in listed.invalid["endpointslice/orders-zzzzz"]


async def test_hand_written_slices_need_the_opt_in_and_never_pass_without_it(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    fake.create_service("orders", selector=None)
    fake.put_slice(hand_written("orders-1", "10.1.0.1", "10.1.0.2"))
    plain = in_process(fake, tmp_path)
    refused = await plain.query("orders", deadline())
    assert refused.instances == ()
    assert "trust_unowned_slices" in refused.invalid["endpointslice/orders-1"]
    trusting = in_process(fake, tmp_path, trust_unowned_slices=True)
    listed = await trusting.query("orders", deadline())
    # No targetRef: identity is family/address:port.
    assert listed.identities() == ("IPv4/10.1.0.1:8080", "IPv4/10.1.0.2:8080")
    # With a selector the controller owns the slices: the opt-in does not apply.
    fake.create_service("orders", selector={"app": "orders"})
    assert (await trusting.query("orders", deadline())).instances == ()


async def test_endpoints_without_target_ref_on_two_ports_are_two_members(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    fake.create_service("orders", selector=None)
    fake.put_slice(hand_written("orders-a", "10.1.0.1", port=8080))
    fake.put_slice(hand_written("orders-b", "10.1.0.1", port=8081))
    listed = await in_process(fake, tmp_path, trust_unowned_slices=True).query("orders", deadline())
    assert sorted(i.port for i in listed.instances) == [8080, 8081]


# -- dual-stack --------------------------------------------------------------------------------


def dual_stack(fake: KubernetesFake, primary: str) -> None:
    families = ["IPv4", "IPv6"] if primary == "IPv4" else ["IPv6", "IPv4"]
    uid = fake.create_service("orders", ip_families=families)["metadata"]["uid"]
    v6 = [dict(endpoint(n), addresses=[f"fd00::{n}"]) for n in (1, 2)]
    # Names chosen so that the IPv6 slice sorts first (the old tie-break).
    fake.put_slice(slice_object("orders-a6", "orders", v6, owner_uid=uid, address_type="IPv6"))
    fake.put_slice(slice_object("orders-b4", "orders", [endpoint(1), endpoint(2)], owner_uid=uid))


@pytest.mark.parametrize(
    ("setting", "primary", "expected"),
    [
        ("ipv4", "IPv6", "10.0.0."),
        ("ipv6", "IPv4", "[fd00::"),
        ("primary", "IPv4", "10.0.0."),
        ("primary", "IPv6", "[fd00::"),
    ],
)
async def test_dual_stack_serves_one_family_deterministically(
    tmp_path: Path,
    autojump_clock: trio.testing.MockClock,
    setting: str,
    primary: str,
    expected: str,
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    dual_stack(fake, primary)
    provider = in_process(fake, tmp_path, ip_family=setting)
    for _ in range(3):
        listed = await provider.query("orders", deadline())
        assert listed.identities() == ("pod-1", "pod-2")
        assert all(i.address.startswith(expected) for i in listed.instances), listed.instances
        assert not listed.invalid


async def test_a_family_the_service_does_not_have_is_invalid_not_empty(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    fake.create_service("orders")  # single-stack IPv4
    owned_slice(fake, "orders-a", 1)
    with pytest.raises(InvalidSnapshot, match=r"no IPv6 addresses \(spec.ipFamilies: IPv4\)"):
        await in_process(fake, tmp_path, ip_family="ipv6").query("orders", deadline())


# -- ports, ExternalName -----------------------------------------------------------------------


async def test_a_numeric_port_picks_its_protocol(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    ports = [
        {"name": "dns", "port": 53, "protocol": "UDP"},
        {"name": "dns-tcp", "port": 53, "protocol": "TCP"},
    ]
    uid = fake.create_service("orders", ports=ports)["metadata"]["uid"]
    slice_ports = [
        {"name": "dns", "port": 5353, "protocol": "UDP"},
        {"name": "dns-tcp", "port": 5354, "protocol": "TCP"},
    ]
    fake.put_slice(
        slice_object("orders-a", "orders", [endpoint(1)], owner_uid=uid, ports=slice_ports)
    )
    tcp = in_process(fake, tmp_path, services={"orders": {"port": 53}})
    assert (await tcp.query("orders", deadline())).instances[0].port == 5354
    udp = in_process(fake, tmp_path, services={"orders": {"port": 53, "protocol": "UDP"}})
    assert (await udp.query("orders", deadline())).instances[0].port == 5353
    sctp = in_process(fake, tmp_path, services={"orders": {"port": 53, "protocol": "SCTP"}})
    with pytest.raises(InvalidSnapshot, match="no port 53/SCTP"):
        await sctp.query("orders", deadline())


async def test_an_external_name_service_is_named_as_such(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    fake.create_service(
        "orders",
        selector=None,
        ports=[],
        spec={"type": "ExternalName", "externalName": "db.example.com"},
    )
    with pytest.raises(InvalidSnapshot, match=r"ExternalName .*'db\.example\.com'.*dns connection"):
        await in_process(fake, tmp_path).query("orders", deadline())


# -- tokens --------------------------------------------------------------------------------------


async def test_a_token_file_that_vanishes_is_a_typed_failure_in_the_watch(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    from nadisc_kubernetes import KubernetesProvider, KubernetesSettings, resolve_access

    from .conftest import context, write_kubeconfig

    fake = KubernetesFake(tokens={"tok": "alice"})
    uid = fake.create_service("orders")["metadata"]["uid"]
    fake.put_slice(slice_object("orders-a", "orders", [endpoint(1)], owner_uid=uid))
    token = tmp_path / "token"
    token.write_text("tok")
    config = write_kubeconfig(tmp_path / "config", fake.url, token=None, token_file=str(token))
    settings = KubernetesSettings.model_validate(
        {"credentials": "kubeconfig", "kubeconfig": str(config), "services": {"orders": {}}}
    )
    provider = KubernetesProvider(
        context(), settings, access=resolve_access(settings, {}), transport=fake.transport()
    )
    sink = RecordingSink()
    async with trio.open_nursery() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        token.unlink()
        fake.end_watches()
        await sink.wait_for(lambda: any(isinstance(f, IdentityRevoked) for f in sink.failures))
        assert "token file" in str(sink.failures[-1])
        token.write_text("tok")
        await sink.wait_for(lambda: len(sink.published) >= 2)  # back once it is there again
        nursery.cancel_scope.cancel()


# -- watch liveness ----------------------------------------------------------------------------


async def test_a_frozen_watch_is_detected_within_90_seconds_with_the_defaults(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"})  # bookmarks every 60 s, as the server
    async with watching(fake, tmp_path) as (provider, sink):
        await trio.sleep(61)  # one bookmark: the server is known to send them
        assert provider.bookmarks_seen
        frozen_at = trio.current_time()
        fake.freeze_watches()
        await sink.wait_for(lambda: bool(sink.failures))
        assert trio.current_time() - frozen_at <= 90  # MockClock: virtual seconds
        assert isinstance(sink.failures[0], IncompleteSnapshot)
        assert "sent nothing for 80s" in str(sink.failures[0])
        # A stream that went dead lists again before it watches again (a
        # server whose storage went back in time answers a watch from the
        # version held with silence, and only a list shows it).
        assert provider.statistics.relists == 2 and provider.statistics.silent_watches == 2
        owned_slice(fake, "orders-a", 1, 2)  # changes flow again
        await sink.wait_for(lambda: sink.identities == ("pod-1", "pod-2"))


async def test_a_watch_frozen_at_its_start_is_replaced_within_80_seconds(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # Frozen before its first bookmark (the server's first comes about a minute
    # after the watch starts): the silence is counted from the start.
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    async with watching(fake, tmp_path) as (provider, sink):
        await fake.wait_for(lambda: fake.open_watches == 2)
        frozen_at = trio.current_time()
        fake.freeze_watches()
        owned_slice(fake, "orders-a", 1, 2)  # a change the frozen stream never delivers
        await sink.wait_for(lambda: sink.identities == ("pod-1", "pod-2"))
        assert trio.current_time() - frozen_at <= 81  # MockClock: virtual seconds
        # No bookmark seen yet, so a live server without one looks the same: the
        # watch is reopened from the version held, with no failure and no relist.
        assert not sink.failures and not provider.bookmarks_seen
        assert provider.statistics.quiet_reopens == 2 and provider.statistics.relists == 0


async def test_once_bookmarks_are_known_a_watch_frozen_at_its_start_fails_within_80_seconds(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    async with watching(fake, tmp_path) as (provider, sink):
        await trio.sleep(61)
        assert provider.bookmarks_seen
        fake.end_watches()  # the server's timeout: both watches reopen
        await fake.wait_for(
            lambda: (
                len(fake.watch_requests("endpointslices"))
                == len(fake.watch_requests("services"))
                == 2
            )
        )
        await fake.wait_for(lambda: fake.open_watches == 2)
        frozen_at = trio.current_time()
        fake.freeze_watches()  # before the new watches sent anything
        await sink.wait_for(lambda: bool(sink.failures))
        assert trio.current_time() - frozen_at <= 81  # MockClock: virtual seconds
        assert "sent nothing for 80s" in str(sink.failures[0])
        assert provider.statistics.quiet_reopens == 0


async def test_a_quiet_server_without_bookmarks_is_reopened_never_failed(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    # A server without a watch cache (or a cacher that processed no event yet)
    # sends no bookmark: silence then reopens quietly, it never fails.
    fake = KubernetesFake(tokens={TOKEN: "alice"}, bookmark_interval=None)
    async with watching(fake, tmp_path, watch_timeout=100, watch_grace=10) as (provider, sink):
        await trio.sleep(1000)
        assert not sink.failures and not provider.bookmarks_seen
        # Two streams, one reopen per 80 s each: about 12 each in 1000 s.
        assert 20 <= provider.statistics.quiet_reopens <= 26
        owned_slice(fake, "orders-a", 1, 3)
        await sink.wait_for(lambda: sink.identities == ("pod-1", "pod-3"))


async def test_a_bookmark_flood_confirms_at_most_once_a_second(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"}, bookmark_interval=None)
    async with watching(fake, tmp_path) as (provider, sink):
        await fake.wait_for(lambda: fake.open_watches == 2)
        started = trio.current_time()
        for _ in range(30):
            for _ in range(40):
                fake.bookmark()
            await trio.sleep(0.1)
        elapsed = trio.current_time() - started
        await trio.sleep(1)
        assert provider.statistics.bookmarks == 2 * 30 * 40
        # Two streams, one gate per watch call: at most one refresh per second.
        assert sink.refreshes <= elapsed + 2
        assert provider.statistics.confirmations == sink.refreshes


# -- relists -----------------------------------------------------------------------------------


class GoneAfterList(httpx.AsyncBaseTransport):
    """Answers every watch of the slices with HTTP 410 (the list itself works)."""

    def __init__(self, fake: KubernetesFake) -> None:
        self.inner = fake.transport()
        self.watches = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if "endpointslices" in request.url.path and request.url.params.get("watch"):
            self.watches += 1
            return httpx.Response(
                410,
                json={"kind": "Status", "code": 410, "reason": "Expired", "message": "too old"},
                request=request,
            )
        return await self.inner.handle_async_request(request)


async def test_a_410_storm_relists_only_as_fast_as_the_backoff(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    fake.create_service("orders")
    owned_slice(fake, "orders-a", 1)
    provider = in_process(fake, tmp_path, initial_backoff=1, max_backoff=8)
    storm = GoneAfterList(fake)
    provider._http._client._transport = storm
    sink = RecordingSink()
    async with trio.open_nursery() as nursery:
        await nursery.start(provider.watch, "orders", sink)
        await trio.sleep(60)
        # Delays 0.5-1, 1-2, 2-4, 4-8, then 4-8 each: at most 4 + 56/4 + 1 relists.
        assert 5 <= provider.statistics.relists <= 19, provider.statistics
        assert storm.watches == provider.statistics.relists
        nursery.cancel_scope.cancel()


async def test_a_storage_restore_is_noticed_and_relisted(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "nadisc_kubernetes")
    fake = KubernetesFake(tokens={TOKEN: "alice"})  # bookmarks every 60 s, as the server
    async with watching(fake, tmp_path) as (provider, sink):
        backup = fake.version
        await fake.wait_for(lambda: fake.open_watches == 2)
        owned_slice(fake, "orders-a", 1, 2)
        owned_slice(fake, "orders-b", 3)
        await sink.wait_for(lambda: sink.identities == ("pod-1", "pod-2", "pod-3"))
        await trio.sleep(61)  # one bookmark: the server is known to send them
        assert provider.bookmarks_seen
        published = len(sink.published)
        restored_at = trio.current_time()
        # Versions go back; the watch cache ends its watchers, the provider
        # watches again from the versions it holds: 200, then silence.
        fake.restore(backup, watches="end")
        with trio.fail_after(200):
            await sink.wait_for(lambda: sink.identities == ("pod-1",))
        # bookmark_silence (80 s), then a relist after the backoff (at most 1 s).
        assert trio.current_time() - restored_at <= 82
        # Nothing was published in between: the old listing was never confirmed.
        assert len(sink.published) == published + 1
        assert any("sent nothing for 80s" in str(f) for f in sink.failures)
        assert provider.statistics.relists == 2
        watches = fake.watch_requests("endpointslices")
        assert all(r.status == 200 for r in watches)  # never a 504 on a watch
        assert any("storage was restored" in r.getMessage() for r in caplog.records)
        # The streams follow the restored cluster from its own version now.
        owned_slice(fake, "orders-c", 4)
        await sink.wait_for(lambda: sink.identities == ("pod-1", "pod-4"))


async def test_an_event_older_than_the_held_version_forces_a_relist(
    tmp_path: Path, autojump_clock: trio.testing.MockClock
) -> None:
    fake = KubernetesFake(tokens={TOKEN: "alice"})
    async with watching(fake, tmp_path) as (provider, sink):
        await fake.wait_for(lambda: fake.open_watches == 2)
        for watch in list(fake._watches):
            if watch.kind == "endpointslices":
                stale = slice_object("orders-a", "orders", [], owner_uid="x")
                stale["metadata"].update(namespace="default", resourceVersion="1")
                watch.push({"type": "MODIFIED", "object": stale})
        await fake.wait_for(lambda: provider.statistics.relists >= 1)
        assert sink.identities == ("pod-1",)  # the stale event was never applied


# -- the pacing rules, exhaustively -------------------------------------------------------------


@given(
    timeout=st.floats(1, 3600),
    grace=st.floats(1, 600),
    silence=st.floats(1, 3600),
    seen=st.booleans(),
)
def test_the_silence_limit_never_exceeds_the_server_timeout_bound(
    timeout: float, grace: float, silence: float, seen: bool
) -> None:
    limit = silence_limit(watch_timeout=timeout, watch_grace=grace, bookmark_silence=silence)
    assert limit == min(silence, timeout + grace)
    # Silence is a failure only once the server has shown it sends bookmarks.
    assert silence_is_failure(bookmarks_seen=seen) is seen


@given(held=st.integers(0, 10**20), seen=st.integers(0, 10**20))
def test_only_a_lower_decimal_version_goes_backwards(held: int, seen: int) -> None:
    assert went_backwards(str(held), str(seen)) == (seen < held)
    assert not went_backwards(f"a{held}", str(seen))
    assert not went_backwards(str(held), "")
    assert not went_backwards(str(held), "٣")  # a non-ASCII digit is opaque


@given(st.lists(st.floats(0, 1000), min_size=1, max_size=200))
def test_the_refresh_gate_passes_at_most_one_per_interval(times: list[float]) -> None:
    gate = RefreshGate(1.0)
    passed = [t for t in sorted(times) if gate.due(t)]
    assert passed[0] == min(times)
    assert all(b - a >= 1.0 for a, b in itertools.pairwise(passed))
