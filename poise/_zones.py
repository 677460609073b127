"""Zone-aware routing: prefer the caller's zone while it has the capacity, spill the rest.

The rule is Envoy's zone-aware routing. Let ``u[z]`` be zone ``z``'s share
of the healthy upstream instances and ``c[z]`` its share of the callers
(the fleet calling this service). For a caller in zone ``L``::

    u[L] >= c[L]     every request stays in L                    (mode "local")
    u[L] <  c[L]     a request stays in L with probability u[L] / c[L];
                     the rest spills to the other zones in proportion to
                     their spare capacity max(0, u[z] - c[z])     (mode "spill")

so that, when every caller follows the rule, every instance receives the
same expected load. Zone awareness is off (mode "all": every zone in
proportion to its instances) when the caller has no zone, the local zone
has no healthy instance, or the upstream has fewer than ``min_size``
healthy instances (Envoy's ``min_cluster_size``, default 6), where
keeping traffic local would concentrate it on too few instances.

Callers' shares: when the fleet's distribution is not known, the callers
are taken to be spread equally over the zones the upstream spans (every
zone that has an instance, healthy or not, plus the caller's own). That is
the common deployment (the same service in every zone) and it is what
makes a zone that lost instances spill.

Kubernetes topology hints: :func:`hinted` keeps the instances whose
``hints.forZones`` name the caller's zone when every instance carries hints
(the EndpointSlice controller's contract: hints on all endpoints or none),
and leaves the set unchanged otherwise or when no instance is hinted for
the zone.

Pure: no clock, no randomness inside; :meth:`ZonePlan.pick` takes a
uniform number in [0, 1) from the caller's random source.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

from ._errors import InvalidInput

__all__ = ["ZonePlan", "hinted", "zone_plan"]

ZoneMode = Literal["local", "spill", "all"]


@dataclass(frozen=True, slots=True)
class ZonePlan:
    """Where one caller's requests go: ``shares[zone]`` = probability, summing to 1."""

    local: str | None
    mode: ZoneMode
    shares: Mapping[str, float]

    @property
    def local_share(self) -> float:
        """The share of requests that stay in the caller's zone."""
        return 0.0 if self.local is None else self.shares.get(self.local, 0.0)

    def pick(self, u: float) -> str:
        """The zone for one request, from ``u`` uniform in [0, 1)."""
        if not 0.0 <= u < 1.0:
            raise InvalidInput(f"ZonePlan.pick: u must be in [0, 1), got {u!r}")
        zones = [z for z in sorted(self.shares) if self.shares[z] > 0.0]
        if not zones:
            raise InvalidInput("ZonePlan.pick: the plan has no zone with a share")
        edges: list[float] = []
        total = 0.0
        for zone in zones:
            total += self.shares[zone]
            edges.append(total)
        index = bisect.bisect_right(edges, u * total)
        return zones[min(index, len(zones) - 1)]

    def weight(self, zone: str | None, count: int) -> float:
        """The share of this caller's traffic each of ``count`` instances in ``zone`` gets."""
        if zone is None or count <= 0:
            return 0.0
        return self.shares.get(zone, 0.0) / count


def _proportional(counts: Mapping[str, int]) -> dict[str, float]:
    total = sum(counts.values())
    return {z: n / total for z, n in counts.items() if n > 0}


def zone_plan(
    local: str | None,
    healthy: Mapping[str, int],
    *,
    callers: Mapping[str, float] | None = None,
    fleet: Iterable[str] = (),
    min_size: int = 6,
) -> ZonePlan:
    """The :class:`ZonePlan` of a caller in zone ``local`` (see the module docstring).

    ``healthy[zone]`` counts the healthy upstream instances per zone (zones
    with 0 may be listed). ``callers[zone]`` is the fleet's share of callers
    per zone (any positive scale; default: equal over the zones of
    ``healthy``, ``fleet`` and ``local``). Raises
    :class:`~poise.InvalidInput` on a negative count or share, or when no
    instance is healthy.
    """
    for zone, count in healthy.items():
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise InvalidInput(f"zone_plan: zone {zone!r} has count {count!r}; need an int >= 0")
    if isinstance(min_size, bool) or not isinstance(min_size, int) or min_size < 0:
        raise InvalidInput(f"zone_plan: min_size must be an integer >= 0, got {min_size!r}")
    total = sum(healthy.values())
    if total == 0:
        raise InvalidInput("zone_plan: no healthy instance in any zone")
    everywhere = _proportional(healthy)
    if local is None or healthy.get(local, 0) == 0 or total < min_size:
        return ZonePlan(local, "all", everywhere)
    if callers is None:
        zones = set(healthy) | set(fleet) | {local}
        callers = dict.fromkeys(zones, 1.0)
    weight = 0.0
    for zone, share in callers.items():
        if not (isinstance(share, (int, float)) and 0.0 <= share < math.inf):
            raise InvalidInput(f"zone_plan: callers share of {zone!r} is {share!r}; need >= 0")
        weight += share
    if weight <= 0.0 or callers.get(local, 0.0) <= 0.0:
        return ZonePlan(local, "local", {local: 1.0})
    upstream = {z: n / total for z, n in healthy.items()}
    caller = {z: s / weight for z, s in callers.items()}
    u_local, c_local = upstream[local], caller[local]
    if u_local >= c_local:
        return ZonePlan(local, "local", {local: 1.0})
    stay = u_local / c_local
    spare = {
        z: max(0.0, share - caller.get(z, 0.0))
        for z, share in upstream.items()
        if z != local and share > 0.0
    }
    room = sum(spare.values())
    if room <= 0.0:  # callers elsewhere use all of it: spread by instances
        spare = {z: share for z, share in upstream.items() if z != local and share > 0.0}
        room = sum(spare.values())
    shares = {local: stay}
    for zone, extra in spare.items():
        if extra > 0.0:
            shares[zone] = (1.0 - stay) * extra / room
    return ZonePlan(local, "spill", shares)


def hinted(zone: str | None, hints: Iterable[frozenset[str] | None]) -> list[bool] | None:
    """Which instances Kubernetes topology hints keep for a caller in ``zone``.

    ``hints`` gives each instance's ``forZones`` (None: no hints). Returns a
    mask (True = keep) when every instance is hinted and at least one names
    ``zone``; None (keep everything) otherwise.
    """
    if zone is None:
        return None
    listed = list(hints)
    if not listed or any(h is None for h in listed):
        return None
    mask = [zone in h for h in listed if h is not None]
    return mask if any(mask) else None
