"""Route.sync: mirroring observation listings into a poise Directory (sans-IO)."""

from __future__ import annotations

from types import SimpleNamespace
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
from nadisc._evidence import Evidence, EvidencePolicy, FailureKind, Refusal
from nadisc._instance import ProviderSnapshot
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


class _EvidenceObservation(_StubObservation):
    """An observation over a real evidence record, read the way the slot reads it."""

    def __init__(self, evidence: Evidence) -> None:
        self._slot = SimpleNamespace(evidence=evidence)
        self.reads = 0

    def _usable_at(self, now: float, strict: bool) -> ObservationSnapshot:
        self.reads += 1
        evidence = self._slot.evidence
        view = evidence.view(now, strict=strict)
        if isinstance(view, Refusal):
            raise EvidenceUnavailable(view.message, reason=view.reason.value)
        return ObservationSnapshot(
            connection="primary",
            service="orders",
            instances=view.instances,
            evidence=view.evidence,
            revision=view.generation,
            confirmed_at=view.confirmed_at,
            degraded=view.degraded,
        )


def _listing(*identities: str) -> ProviderSnapshot:
    return ProviderSnapshot(
        "orders",
        tuple(Instance(i, "127.0.0.1", 8000) for i in identities),
        EvidenceKind.REGISTRY_HEALTH,
    )


def _routed(
    max_age: float, grace: float, start: float, options: RestOptions | None = None
) -> tuple[Evidence, _EvidenceObservation, list[float], Route]:
    """Evidence with that policy, an observation of it, a settable clock
    (``clock[0]``, from ``start``) and a route over them."""
    evidence = Evidence(EvidencePolicy(max_age=max_age, stale_if_error=grace))
    observation = _EvidenceObservation(evidence)
    clock = [start]
    route = Route(cast(Observation, observation), options or RestOptions(), lambda: clock[0])
    return evidence, observation, clock, route


def _checked(route: Route) -> str | None:
    """The reason the route's evidence check refuses now (None: it passes)."""
    try:
        route.check_usable()
    except EvidenceUnavailable as exc:
        return exc.reason
    return None


@pytest.mark.both_loops
def test_the_cached_evidence_check_ends_exactly_when_the_listing_expires() -> None:
    evidence, observation, clock, route = _routed(10.0, 4.0, 0.0)
    evidence.on_success(_listing("a", "b"), 0.0)
    assert _checked(route) is None
    assert route.identities() == ("a", "b")  # the first check mirrors the listing
    reads = observation.reads
    clock[0] = 9.999
    assert _checked(route) is None
    assert observation.reads == reads  # answered from the cache
    clock[0] = 10.0  # max age: refused at the very instant, by time alone
    assert _checked(route) == "stale"
    # A refresh confirms the listing: the next check asks again and passes.
    evidence.on_refresh(10.0)
    assert _checked(route) is None
    clock[0] = 19.999
    assert _checked(route) is None
    # A failed refresh moves the end to the grace after the last confirmation.
    evidence.on_failure(FailureKind.INCOMPLETE, 12.0)
    clock[0] = 13.0
    assert _checked(route) is None
    clock[0] = 13.999
    assert _checked(route) is None
    clock[0] = 14.0
    assert _checked(route) == "stale"


@pytest.mark.both_loops
def test_the_cached_evidence_check_follows_every_event_at_once() -> None:
    evidence, _, _, route = _routed(10.0, 0.0, 1.0)
    evidence.on_success(_listing("a"), 0.0)
    assert _checked(route) is None
    # Revoked with no time passing: the very next check refuses.
    evidence.on_failure(FailureKind.REVOKED, 1.0)
    assert _checked(route) == "revoked"
    # A new listing: usable again, and mirrored before the check returns.
    evidence.on_success(_listing("b", "c"), 1.0)
    assert _checked(route) is None
    assert route.identities() == ("b", "c")
    assert route.current("a") is None
    # Emptied, then closed: each refuses at once.
    evidence.on_success(_listing(), 1.0)
    assert _checked(route) == "empty"
    evidence.on_success(_listing("b"), 1.0)
    assert _checked(route) is None
    evidence.close()
    assert _checked(route) == "closed"


@pytest.mark.both_loops
def test_a_strict_route_refuses_the_grace_of_a_failed_refresh_at_once() -> None:
    evidence, observation, clock, strict = _routed(
        10.0, 5.0, 1.0, RestOptions(strict_evidence=True)
    )
    relaxed = Route(cast(Observation, observation), RestOptions(), lambda: clock[0])
    evidence.on_success(_listing("a"), 0.0)
    assert _checked(strict) is None and _checked(relaxed) is None
    evidence.on_failure(FailureKind.INCOMPLETE, 1.0)
    assert _checked(strict) == "incomplete"
    assert _checked(relaxed) is None


def test_evidence_version_moves_with_every_event_and_usable_until_is_the_limit() -> None:
    evidence = Evidence(EvidencePolicy(max_age=10.0, stale_if_error=4.0))
    assert evidence.usable_until(0.0) is None  # nothing listed yet
    versions = [evidence.version]
    evidence.on_success(_listing("a"), 0.0)
    versions.append(evidence.version)
    assert evidence.usable_until(0.0) == 10.0
    evidence.on_success(_listing("a"), 2.0)  # the same listing: no view change...
    versions.append(evidence.version)  # ...but a new confirmation
    assert evidence.usable_until(2.0) == 12.0
    evidence.on_refresh(3.0)
    versions.append(evidence.version)
    assert evidence.usable_until(3.0) == 13.0
    evidence.on_failure(FailureKind.INCOMPLETE, 4.0)
    versions.append(evidence.version)
    assert evidence.usable_until(4.0) == 7.0  # grace after the last confirmation
    assert evidence.usable_until(4.0, strict=True) is None
    assert evidence.usable_until(7.0) is None
    evidence.on_withheld(frozenset({"a"}), 5.0)
    versions.append(evidence.version)
    evidence.close()
    versions.append(evidence.version)
    assert versions == sorted(set(versions))  # every event moved it
    assert evidence.usable_until(5.0) is None
