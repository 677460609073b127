"""Weaker evidence (``EvidenceKind.weak``): served normally, refused by strict
reads with reason ``weak``, shown by the observer; a normal listing heals it."""

from __future__ import annotations

import anyio
import pytest

from nadisc import EvidenceKind, EvidenceUnavailable, Instance
from nadisc._evidence import Evidence, EvidencePolicy, Reason, Refusal, Usable
from nadisc._instance import ProviderSnapshot
from nadisc.testing import MemoryProvider

from .owner_support import memory_owner


def test_only_weak_health_is_weak() -> None:
    assert [kind for kind in EvidenceKind if kind.weak] == [EvidenceKind.WEAK_HEALTH]


def test_core_refuses_weak_listings_to_strict_reads_only() -> None:
    evidence = Evidence(EvidencePolicy(max_age=15.0, stale_if_error=5.0))
    weak = ProviderSnapshot("s", (Instance("a", "10.0.0.1", 80),), EvidenceKind.WEAK_HEALTH)
    assert evidence.on_success(weak, 0.0)
    assert isinstance(evidence.view(1.0), Usable)
    strict = evidence.view(1.0, strict=True)
    assert isinstance(strict, Refusal) and strict.reason is Reason.WEAK
    # the same members with normal evidence are a change of view (generation moves)
    healthy = ProviderSnapshot("s", weak.instances, EvidenceKind.REGISTRY_HEALTH)
    generation = evidence.generation
    assert evidence.on_success(healthy, 2.0)
    assert evidence.generation == generation + 1
    assert isinstance(evidence.view(2.0, strict=True), Usable)


async def test_owner_serves_marks_and_strictly_refuses_weak_evidence(
    autojump_clock: object,
) -> None:
    p = MemoryProvider(services={"orders": "order-worker"})
    p.set("order-worker", [Instance("a", "10.0.0.1", 80)], evidence=EvidenceKind.WEAK_HEALTH)
    async with memory_owner({"primary": p}) as owner:
        obs = await owner.client().observe("orders", anyio.current_time() + 5)
        snap = obs.snapshot()
        assert snap.evidence is EvidenceKind.WEAK_HEALTH and snap.identities() == ("a",)
        with pytest.raises(EvidenceUnavailable) as refused:
            obs.snapshot(strict=True)
        assert refused.value.reason == "weak"
        with pytest.raises(EvidenceUnavailable):
            obs.submit_if_current_strict(lambda s: s)
        assert obs.submit_if_current(lambda s: s.identities()) == ("a",)
        service = owner.observer().snapshot().connection("primary").services[0]
        assert service.weak is True and service.evidence == "weak_health"
        assert service.unavailable_reason is None
        p.set("order-worker", [Instance("a", "10.0.0.1", 80)])
        await obs.changed(anyio.current_time() + 30)
        assert obs.snapshot(strict=True).evidence is EvidenceKind.REGISTRY_HEALTH
        service = owner.observer().snapshot().connection("primary").services[0]
        assert service.weak is False and service.evidence == "registry_health"
