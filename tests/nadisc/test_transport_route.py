"""Route.sync: mirroring observation listings into a poise Directory (sans-IO)."""

from __future__ import annotations

from typing import Any, cast

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nadisc import (
    EvidenceKind,
    EvidenceUnavailable,
    Instance,
    Observation,
    ObservationSnapshot,
    RestOptions,
)
from nadisc._route import Attempt, InstanceService, Route
from poise import CallDeclined

IDENTITIES = ("a", "b", "c", "d", "e")


class _StubObservation:
    """What Route reads of an observation when it is only asked to sync."""

    connection = "primary"
    service = "orders"

    def submit_if_current(self, submit: Any) -> Any:
        raise AssertionError("not used by sync")

    submit_if_current_strict = submit_if_current


def _route() -> Route:
    return Route(cast(Observation, _StubObservation()), RestOptions())


def _snapshot(revision: int, instances: tuple[Instance, ...]) -> ObservationSnapshot:
    return ObservationSnapshot(
        connection="primary",
        service="orders",
        instances=instances,
        evidence=EvidenceKind.REGISTRY_HEALTH,
        revision=revision,
        confirmed_at=0.0,
        degraded=False,
    )


listing = st.lists(
    st.tuples(st.sampled_from(IDENTITIES), st.integers(1, 3), st.integers(8000, 8001)),
    max_size=5,
    unique_by=lambda item: item[0],
).map(
    lambda items: tuple(
        Instance(identity, "127.0.0.1", port, weight=float(weight))
        for identity, weight, port in items
    )
)


@settings(max_examples=60, deadline=None)
@given(st.lists(listing, min_size=1, max_size=8))
def test_sync_keeps_unchanged_allocations_and_rebuilds_changed_ones(
    listings: list[tuple[Instance, ...]],
) -> None:
    route = _route()
    directory = route._directory
    previous: dict[str, Instance] = {}
    allocations: dict[str, object] = {}
    for revision, instances in enumerate(listings, start=1):
        route.sync(_snapshot(revision, instances))
        snapshot = directory.snapshot()
        current = {i.identity: i for i in instances}
        assert set(snapshot.keys()) == set(current)
        for identity, instance in current.items():
            member = snapshot.get(identity)
            assert member is not None
            assert member.backend.weight == instance.weight
            assert route.current(identity) == instance
            if previous.get(identity) == instance:
                assert member.allocation is allocations[identity]  # retained
            else:
                assert member.allocation is not allocations.get(identity)  # new generation
            allocations[identity] = member.allocation
        for gone in set(previous) - set(current):
            assert route.current(gone) is None
        previous = current
        # The same revision again is a no-op, whatever it carries.
        before = directory.revision
        route.sync(_snapshot(revision, ()))
        assert directory.revision == before


def test_a_closed_route_stops_mirroring() -> None:
    route = _route()
    route.sync(_snapshot(1, (Instance("a", "127.0.0.1", 8000),)))
    route.close()
    route.close()
    route.sync(_snapshot(2, ()))
    assert route.revision == 1
    assert route.statistics().in_flight == {}


class _SubmitObservation(_StubObservation):
    """Runs ``submit`` against a snapshot the test controls (or refuses)."""

    def __init__(self) -> None:
        self.current: ObservationSnapshot | None = None

    def _usable_at(self, now: float, strict: bool) -> ObservationSnapshot:
        return self._usable(strict)

    def _usable(self, strict: bool) -> ObservationSnapshot:
        if self.current is None:
            raise EvidenceUnavailable("revoked for the test", reason="revoked")
        return self.current

    def submit_if_current(self, submit: Any) -> Any:
        return submit(self._usable(False))

    submit_if_current_strict = submit_if_current


async def test_an_instance_service_declines_what_it_must_not_send() -> None:
    observation = _SubmitObservation()
    route = Route(cast(Observation, observation), RestOptions())
    a = Instance("a", "127.0.0.1", 8000)
    observation.current = _snapshot(1, (a,))
    route.sync(observation.current)
    service = InstanceService(route, a)
    sent: list[str] = []

    async def send(instance: Instance) -> httpx.Response:
        sent.append(instance.identity)
        return httpx.Response(204)

    assert (await service.call(Attempt(send=send))).status_code == 204
    # Skipped because this call already tried it (and another endpoint exists).
    with pytest.raises(CallDeclined):
        await service.call(Attempt(send=send, avoid=frozenset({"a"}), skips=1))
    # Withdrawn after selection: the hand-over sees the newer listing.
    observation.current = _snapshot(2, ())
    with pytest.raises(CallDeclined) as declined:
        await service.call(Attempt(send=send))
    assert declined.value.__cause__ is None
    # Evidence unusable: declined, chained from the reason.
    observation.current = None
    with pytest.raises(CallDeclined) as declined:
        await service.call(Attempt(send=send))
    assert isinstance(declined.value.__cause__, EvidenceUnavailable)
    assert sent == ["a"]
    assert route.statistics().sent == {"a": 1}
