"""The evidence rules, one by one, on the synchronous core."""

from __future__ import annotations

import math

import pytest

from nadisc import (
    CapacityRejected,
    EvidenceKind,
    IdentityRevoked,
    IncompleteSnapshot,
    Instance,
    InvalidSnapshot,
    ProviderFailure,
    ProviderSnapshot,
)
from nadisc._evidence import (
    Backoff,
    Evidence,
    EvidencePolicy,
    FailureKind,
    Reason,
    Refusal,
    Usable,
)
from nadisc._observation import failure_kind


def snap(*ids: str, evidence: EvidenceKind = EvidenceKind.REGISTRY_HEALTH) -> ProviderSnapshot:
    return ProviderSnapshot(
        "svc", tuple(Instance(i, f"10.0.0.{n + 1}", 80) for n, i in enumerate(ids)), evidence
    )


def served(view: Usable | Refusal) -> set[str]:
    assert isinstance(view, Usable), view
    return {i.identity for i in view.instances}


def reason(view: Usable | Refusal) -> Reason:
    assert isinstance(view, Refusal), view
    return view.reason


def make(max_age: float = 10.0, stale_if_error: float = 4.0) -> Evidence:
    return Evidence(EvidencePolicy(max_age=max_age, stale_if_error=stale_if_error))


def test_pending_until_first_outcome() -> None:
    ev = make()
    assert not ev.has_outcome
    assert reason(ev.view(0.0)) is Reason.PENDING
    assert ev.expiry(0.0) == math.inf


def test_complete_listing_is_usable_until_max_age() -> None:
    ev = make()
    assert ev.on_success(snap("a", "b"), 100.0)
    assert served(ev.view(100.0)) == {"a", "b"}
    assert served(ev.view(109.999, strict=True)) == {"a", "b"}
    assert reason(ev.view(110.0)) is Reason.STALE
    assert ev.expiry(100.0) == 110.0


def test_complete_empty_list_revokes_old_candidates_at_once() -> None:
    ev = make()
    ev.on_success(snap("a", "b"), 0.0)
    assert ev.on_success(snap(), 1.0)
    assert reason(ev.view(1.0)) is Reason.EMPTY
    assert reason(ev.view(1.0, strict=False)) is Reason.EMPTY


def test_failure_tightens_to_last_success_plus_grace_and_never_extends() -> None:
    ev = make(max_age=10.0, stale_if_error=4.0)
    ev.on_success(snap("a"), 0.0)
    assert ev.on_failure(FailureKind.INCOMPLETE, 1.0)
    view = ev.view(1.0)
    assert served(view) == {"a"} and isinstance(view, Usable) and view.degraded
    # repeated failures later on do not move the window
    assert not ev.on_failure(FailureKind.INCOMPLETE, 3.0)
    assert not ev.on_failure(FailureKind.INCOMPLETE, 3.9)
    assert served(ev.view(3.99)) == {"a"}
    assert reason(ev.view(4.0)) is Reason.STALE
    assert ev.expiry(1.0) == 4.0


def test_strict_reads_refuse_after_a_failure_immediately() -> None:
    ev = make()
    ev.on_success(snap("a"), 0.0)
    ev.on_failure(FailureKind.INCOMPLETE, 0.5)
    assert reason(ev.view(0.5, strict=True)) is Reason.INCOMPLETE
    ev.on_success(snap("a"), 0.6)
    assert served(ev.view(0.6, strict=True)) == {"a"}


def test_grace_is_capped_by_max_age() -> None:
    # the config forbids stale_if_error > max_age; the core still takes the min
    ev = Evidence(EvidencePolicy(max_age=5.0, stale_if_error=50.0))
    ev.on_success(snap("a"), 0.0)
    ev.on_failure(FailureKind.INCOMPLETE, 1.0)
    assert reason(ev.view(5.0)) is Reason.STALE


def test_zero_grace_refuses_right_after_a_failure() -> None:
    ev = make(stale_if_error=0.0)
    ev.on_success(snap("a"), 0.0)
    ev.on_failure(FailureKind.INCOMPLETE, 2.0)
    assert reason(ev.view(2.0)) is Reason.STALE


def test_capacity_rejection_has_grace_then_reports_capacity() -> None:
    ev = make()
    ev.on_success(snap("a"), 0.0)
    ev.on_failure(FailureKind.CAPACITY, 1.0)
    assert served(ev.view(2.0)) == {"a"}
    assert reason(ev.view(2.0, strict=True)) is Reason.CAPACITY
    assert reason(ev.view(4.0)) is Reason.CAPACITY


@pytest.mark.parametrize(
    ("kind", "expected"),
    [(FailureKind.REVOKED, Reason.REVOKED), (FailureKind.INVALID, Reason.INVALID)],
)
def test_revocation_and_invalid_have_no_grace(kind: FailureKind, expected: Reason) -> None:
    ev = make(stale_if_error=10.0)
    ev.on_success(snap("a"), 0.0)
    assert ev.on_failure(kind, 0.1)
    assert reason(ev.view(0.1)) is expected
    # an incomplete refresh afterwards does not bring the old set back
    ev.on_failure(FailureKind.INCOMPLETE, 0.2)
    assert reason(ev.view(0.2)) is expected
    assert ev.expiry(0.2) == math.inf
    # only a complete listing does
    ev.on_success(snap("b"), 1.0)
    assert served(ev.view(1.0)) == {"b"}


def test_close_is_final() -> None:
    ev = make()
    ev.on_success(snap("a"), 0.0)
    assert ev.close()
    assert not ev.close()
    assert reason(ev.view(0.0)) is Reason.CLOSED
    assert not ev.on_success(snap("a"), 1.0)
    assert reason(ev.view(1.0)) is Reason.CLOSED


def test_withheld_new_set_never_serves_removed_candidates() -> None:
    ev = make()
    ev.on_success(snap("a", "b", "c"), 0.0)
    assert ev.on_withheld(frozenset({"a", "d"}), 1.0)
    view = ev.view(1.0)
    assert served(view) == {"a"}
    assert reason(ev.view(1.0, strict=True)) is Reason.CAPACITY
    # a later withheld set narrows further; nothing removed comes back
    ev.on_withheld(frozenset({"b", "c", "d"}), 2.0)
    assert reason(ev.view(2.0)) is Reason.CAPACITY
    # a published complete listing resets the restriction
    ev.on_success(snap("b", "c"), 3.0)
    assert served(ev.view(3.0, strict=True)) == {"b", "c"}


def test_withheld_keeps_grace_anchored_at_last_complete_success() -> None:
    ev = make(stale_if_error=4.0)
    ev.on_success(snap("a", "b"), 0.0)
    ev.on_withheld(frozenset({"a"}), 3.0)
    assert served(ev.view(3.5)) == {"a"}
    assert reason(ev.view(4.0)) is Reason.CAPACITY


def test_refresh_confirms_only_a_healthy_record() -> None:
    ev = make(max_age=10.0, stale_if_error=4.0)
    ev.on_success(snap("a"), 0.0)
    assert not ev.on_refresh(8.0)
    assert served(ev.view(12.0)) == {"a"}
    ev.on_failure(FailureKind.INCOMPLETE, 13.0)
    ev.on_refresh(14.0)  # cannot heal a failure
    assert reason(ev.view(12.0 + 4.0)) is Reason.STALE


def test_static_facts_do_not_age() -> None:
    ev = make()
    ev.on_success(snap("a", evidence=EvidenceKind.STATIC_FACT), 0.0)
    assert served(ev.view(1e9, strict=True)) == {"a"}
    assert ev.expiry(0.0) == math.inf
    assert ev.state_key(0.0) == ev.state_key(1e9)


def test_identical_listing_does_not_change_generation() -> None:
    ev = make()
    ev.on_success(snap("a"), 0.0)
    generation = ev.generation
    assert not ev.on_success(snap("a"), 1.0)
    assert ev.generation == generation
    assert ev.on_success(snap("a", "b"), 2.0)
    assert ev.generation == generation + 1


def test_state_key_moves_at_expiry() -> None:
    ev = make(max_age=10.0, stale_if_error=4.0)
    ev.on_success(snap("a"), 0.0)
    ev.on_failure(FailureKind.INCOMPLETE, 1.0)
    before = ev.state_key(3.9)
    assert ev.state_key(1.0) == before
    assert ev.state_key(4.0) != before
    assert ev.expiry(4.0) == math.inf  # refused until an event: no later expiry
    ev2 = make(max_age=10.0, stale_if_error=4.0)
    ev2.on_success(snap("a"), 0.0)
    assert ev2.expiry(0.0) == 10.0
    assert ev2.expiry(10.0) == math.inf


@pytest.mark.parametrize(
    ("failure", "kind"),
    [
        (IncompleteSnapshot("page 3 missing"), FailureKind.INCOMPLETE),
        (InvalidSnapshot("bad"), FailureKind.INVALID),
        (IdentityRevoked("403"), FailureKind.REVOKED),
        (CapacityRejected("too big"), FailureKind.CAPACITY),
        (ProviderFailure("something else"), FailureKind.INCOMPLETE),
        (ValueError("decoder crashed"), FailureKind.INCOMPLETE),
    ],
)
def test_failure_kinds(failure: BaseException, kind: FailureKind) -> None:
    # paging, decoding and transport trouble is never mistaken for revocation
    assert failure_kind(failure) is kind


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        EvidencePolicy(max_age=0.0)
    with pytest.raises(ValueError):
        EvidencePolicy(max_age=math.nan)
    with pytest.raises(ValueError):
        EvidencePolicy(max_age=1.0, stale_if_error=-1.0)


class _Top:
    """An rng that always picks the top of the range (and records the range)."""

    def __init__(self) -> None:
        self.ranges: list[tuple[float, float]] = []

    def uniform(self, a: float, b: float) -> float:
        self.ranges.append((a, b))
        return b


def test_backoff_doubles_with_jitter_between_half_and_cap() -> None:
    rng = _Top()
    backoff = Backoff(1.0, 8.0, rng=rng)  # type: ignore[arg-type]
    delays = [backoff.next_delay() for _ in range(6)]
    assert delays == [1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert rng.ranges[:4] == [(0.5, 1.0), (1.0, 2.0), (2.0, 4.0), (4.0, 8.0)]
    backoff.reset()
    assert backoff.next_delay() == 1.0


def test_backoff_real_jitter_stays_in_range() -> None:
    backoff = Backoff(0.5, 30.0)
    for _ in range(200):
        cap = backoff.cap()
        delay = backoff.next_delay()
        assert cap / 2 <= delay <= cap <= 30.0
    assert backoff.cap() == 30.0


def test_backoff_rejects_bad_bounds() -> None:
    with pytest.raises(ValueError):
        Backoff(0.0, 1.0)
    with pytest.raises(ValueError):
        Backoff(2.0, 1.0)


def test_a_listing_matches_only_what_lists_the_same_instances() -> None:
    ev = make()
    assert not ev.matches(snap("a"))  # nothing listed yet
    listed = snap("a", "b", "c")
    ev.on_success(listed, 0.0)
    same = ProviderSnapshot("svc", listed.instances, EvidenceKind.REGISTRY_HEALTH)
    assert ev.matches(same)
    # One more at the end (the rest the very same objects), one fewer, one
    # replaced at the end, and the same instances as weaker evidence.
    grown = ProviderSnapshot(
        "svc", (*listed.instances, Instance("d", "10.0.0.9", 80)), EvidenceKind.REGISTRY_HEALTH
    )
    assert not ev.matches(grown)
    assert not ev.matches(ProviderSnapshot("svc", listed.instances[:2], listed.evidence))
    replaced = (*listed.instances[:2], Instance("c", "10.0.0.3", 81))
    assert not ev.matches(ProviderSnapshot("svc", replaced, listed.evidence))
    assert not ev.matches(ProviderSnapshot("svc", listed.instances, EvidenceKind.WEAK_HEALTH))
    # What matches() said is passed on: the view only changes for a new listing.
    assert not ev.on_success(same, 1.0, matched=True)
    generation = ev.generation
    assert ev.on_success(grown, 2.0, matched=False)
    assert ev.generation == generation + 1


@pytest.mark.parametrize(
    ("steps", "at", "strict", "expected", "message"),
    [
        ([], 0.0, False, Reason.PENDING, "no listing has been obtained yet"),
        (["incomplete"], 0.0, False, Reason.INCOMPLETE, "no complete listing has been obtained"),
        (["capacity"], 0.0, False, Reason.CAPACITY, "a capacity limit refused the first listing"),
        (["listed", "close"], 0.0, False, Reason.CLOSED, "the observation is closed"),
        (["listed", "revoked"], 0.0, False, Reason.REVOKED, "the connection's identity"),
        (["listed", "invalid"], 0.0, False, Reason.INVALID, "the registry's answer was confirmed"),
        (["listed"], 10.0, False, Reason.STALE, "the last complete listing is 10.000s old"),
        (["listed", "incomplete"], 4.0, False, Reason.STALE, "the last refresh failed and the gr"),
        (["listed", "capacity"], 4.0, False, Reason.CAPACITY, "the last refresh failed and the gr"),
        (["listed", "incomplete"], 1.0, True, Reason.INCOMPLETE, "the last refresh failed and"),
        (["listed", "withheld"], 1.0, True, Reason.CAPACITY, "the last refresh failed and the rea"),
        (["listed", "withheld"], 1.0, False, Reason.CAPACITY, "a newer complete listing removed"),
        (["empty"], 1.0, False, Reason.EMPTY, "the registry lists no instances"),
        (["weak"], 1.0, True, Reason.WEAK, "the listing is weaker evidence (weak_health) and"),
    ],
)
def test_every_refusal_says_why_in_words_of_its_own_reason(
    steps: list[str], at: float, strict: bool, expected: Reason, message: str
) -> None:
    ev = make(max_age=10.0, stale_if_error=4.0)
    for step in steps:
        if step == "listed":
            ev.on_success(snap("a"), 0.0)
        elif step == "empty":
            ev.on_success(snap(), 0.0)
        elif step == "weak":
            ev.on_success(snap("a", evidence=EvidenceKind.WEAK_HEALTH), 0.0)
        elif step == "withheld":
            ev.on_withheld(frozenset({"z"}), 0.0)
        elif step == "close":
            ev.close()
        else:
            ev.on_failure(FailureKind(step), 0.0)
    refusal = ev.refusal(at, strict=strict)
    assert refusal is not None
    assert refusal.reason is expected
    assert refusal.message.startswith(message), refusal.message
    # The reason alone (what the state key and the time limits read) is the same.
    assert ev.usable_until(at, strict=strict) is None
    if not strict:
        assert ev.state_key(at) == (ev.generation, expected)
