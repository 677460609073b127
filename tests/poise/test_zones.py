"""zone_plan (Envoy's zone-aware rule) and Kubernetes topology hints."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from poise import InvalidInput, hinted, zone_plan

ZONES = ("a", "b", "c", "d")
counts = st.fixed_dictionaries({z: st.integers(0, 40) for z in ZONES}).filter(
    lambda c: sum(c.values()) > 0
)


@given(counts, st.sampled_from(ZONES))
def test_shares_are_a_distribution_over_zones_with_instances(
    healthy: dict[str, int], local: str
) -> None:
    plan = zone_plan(local, healthy, min_size=0)
    assert sum(plan.shares.values()) == pytest.approx(1.0)
    assert all(share > 0 and healthy[z] > 0 for z, share in plan.shares.items())
    if healthy[local] == 0:
        assert plan.mode == "all"


@given(counts)
def test_when_every_zone_follows_the_rule_every_instance_gets_the_mean_load(
    healthy: dict[str, int],
) -> None:
    """Callers equal in each zone that has callers: the plans level the load exactly."""
    callers = [z for z in ZONES if healthy[z] > 0]
    share = dict.fromkeys(callers, 1.0)
    plans = {z: zone_plan(z, healthy, callers=share, min_size=0) for z in callers}
    total = sum(healthy.values())
    for zone in callers:
        load = sum(plans[c].weight(zone, healthy[zone]) for c in callers) / len(callers)
        assert load == pytest.approx(1.0 / total)


def test_equal_capacity_stays_in_zone() -> None:
    plan = zone_plan("a", {"a": 3, "b": 3, "c": 3})
    assert plan.mode == "local"
    assert plan.local_share == 1.0


def test_a_zone_that_lost_two_of_three_keeps_three_sevenths_and_spills_the_rest() -> None:
    plan = zone_plan("a", {"a": 1, "b": 3, "c": 3})
    assert plan.mode == "spill"
    assert plan.local_share == pytest.approx(3 / 7)  # (1/7) / (1/3)
    assert plan.shares["b"] == pytest.approx(plan.shares["c"])
    assert zone_plan("b", {"a": 1, "b": 3, "c": 3}).mode == "local"


def test_fallbacks_to_every_zone() -> None:
    assert zone_plan(None, {"a": 3, "b": 3}).mode == "all"
    assert zone_plan("a", {"a": 0, "b": 9}).mode == "all"
    small = zone_plan("a", {"a": 1, "b": 3})  # 4 < min_size 6
    assert small.mode == "all"
    assert small.shares == {"a": 0.25, "b": 0.75}


def test_pick_follows_the_shares() -> None:
    plan = zone_plan("a", {"a": 1, "b": 3, "c": 3})
    picks = [plan.pick(i / 7000) for i in range(7000)]
    assert picks.count("a") == pytest.approx(3000, abs=2)
    with pytest.raises(InvalidInput, match="u must be"):
        plan.pick(1.0)


def test_bad_input_is_named() -> None:
    with pytest.raises(InvalidInput, match="no healthy"):
        zone_plan("a", {"a": 0})
    with pytest.raises(InvalidInput, match="'b'"):
        zone_plan("a", {"a": 1, "b": -1})
    with pytest.raises(InvalidInput, match="callers share"):
        zone_plan("a", {"a": 1, "b": 9}, callers={"a": -1.0}, min_size=0)


def test_hints_keep_the_endpoints_hinted_for_the_zone() -> None:
    both = frozenset({"a", "b"})
    assert hinted("a", [frozenset({"a"}), frozenset({"b"}), both]) == [True, False, True]
    assert hinted("a", [frozenset({"a"}), None]) is None  # not all hinted: ignore
    assert hinted("c", [frozenset({"a"})]) is None  # none for the zone: ignore
    assert hinted(None, [frozenset({"a"})]) is None
