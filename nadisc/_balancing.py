"""A route's zones, subset, hedges and retry budget: poise's decision parts, applied.

:class:`RouteBalancing` is built from a connection's ``balancing`` block
(:class:`~nadisc._config.BalancingConfig`) and held by its
:class:`~nadisc.Route`. It touches the calling pipeline at three points:

``select(instances)``
    where the route mirrors a listing into its directory (only when the
    listing changed): the deterministic subset (:func:`poise.subset`), then
    the zone preference (:func:`poise.zone_plan`, Kubernetes hints first).
    Instances left out are not mirrored, so the balance never sees them.
    Zone modes: ``local`` mirrors the caller's zone only; ``spill`` and
    ``all`` mirror every zone and let the route's policy balance the load
    across them (the balance has no per-request zone draw; a load-aware
    policy then evens out the load, which is what the spill is for, without
    the exact in-zone share of :meth:`poise.ZonePlan.pick`).

``call(make, idempotent)``
    around the attempt loop of one call: deposits the call in the retry
    budget and, for an idempotent call with hedging on, races hedges
    (:func:`poise.hedged_call`); a late loser's response is closed.

``may_retry()``
    at the retry decision: False (and counted) when the budget is spent.

Where an instance's zone comes from (:func:`instance_zone`): metadata
``zone`` (the Kubernetes provider's EndpointSlice ``zone``; an etcd
record's metadata; a Consul service's ``Meta``, else its node's ``Meta``
``zone``, which the Consul provider copies in; a Nacos instance's
metadata), else ``topology.kubernetes.io/zone``, else the Nacos cluster
when the identity is Nacos's default ``ip#port#cluster#group@@service``.
Kubernetes hints come from metadata ``hints.for_zones`` (comma-separated).

The caller's zone is ``balancing.zone``, else the environment variable
``NADISC_ZONE``; the subset's client identity is ``subset.client_index``,
else ``NADISC_CLIENT_INDEX``.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass

import anyio
import httpx

from poise import Hedging, RetryBudget, ZonePlan, hedged_call, hinted, subset, zone_plan

from ._config import BalancingConfig
from ._errors import ConfigError
from ._instance import Instance

__all__ = ["BalancingStatistics", "RouteBalancing", "instance_zone"]

ZONE_ENV = "NADISC_ZONE"
CLIENT_INDEX_ENV = "NADISC_CLIENT_INDEX"


def instance_zone(instance: Instance) -> str | None:
    """The zone of ``instance`` from its metadata (see the module docstring), or None."""
    metadata = instance.metadata
    zone = metadata.get("zone") or metadata.get("topology.kubernetes.io/zone")
    if zone:
        return zone
    parts = instance.identity.split("#")
    if len(parts) == 4 and "@@" in parts[3] and parts[2]:
        return parts[2]  # Nacos's default id: ip#port#cluster#group@@service
    return None


def _hints(instance: Instance) -> frozenset[str] | None:
    raw = instance.metadata.get("hints.for_zones")
    if raw is None:
        return None
    return frozenset(z for z in raw.split(",") if z)


def _env_int(environ: Mapping[str, str], name: str, low: int) -> int | None:
    raw = environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(name, f"must be an integer, got {raw[:40]!r}") from None
    if value < low:
        raise ConfigError(name, f"must be >= {low}, got {value}")
    return value


@dataclass(frozen=True, slots=True)
class BalancingStatistics:
    """What a route's balancing decided, for observers and metrics."""

    zone: str | None
    zone_mode: str | None
    local_share: float | None
    subset_size: int | None
    mirrored: int
    listed: int
    budget_refused: int
    hedges: int
    hedge_wins: int
    hedges_refused: int


class RouteBalancing:
    """One route's balancing decisions (see the module docstring)."""

    __slots__ = (
        "_identity",
        "_listed",
        "_min_size",
        "_mirrored",
        "_plan",
        "_size",
        "_zone",
        "budget",
        "hedging",
    )

    def __init__(
        self,
        config: BalancingConfig | None = None,
        environ: Mapping[str, str] | None = None,
        path: str = "balancing",
    ) -> None:
        config = BalancingConfig() if config is None else config
        env = os.environ if environ is None else environ
        zone = config.zone or env.get(ZONE_ENV) or None
        self._zone = zone if config.zone_aware else None
        self._min_size = config.zone_min_size
        self._plan: ZonePlan | None = None
        self._size: int | None = None
        self._identity: int | None = None
        if config.subset is not None:
            sub = config.subset
            index = sub.client_index
            if index is None:
                index = _env_int(env, CLIENT_INDEX_ENV, 0)
            if index is None:
                raise ConfigError(
                    f"{path}.subset", f"a subset needs client_index (or {CLIENT_INDEX_ENV})"
                )
            self._size = sub.size
            self._identity = index
        hedge = config.hedge
        self.hedging: Hedging | None = None
        if hedge is not None:
            self.hedging = (
                Hedging(delay=hedge.delay_ms / 1000.0, max_extra=hedge.max_extra_attempts)
                if hedge.delay_ms is not None
                else Hedging(
                    percentile=(hedge.percentile or 0.0) / 100.0,
                    max_extra=hedge.max_extra_attempts,
                )
            )
        budget = config.retry_budget
        self.budget: RetryBudget | None = (
            None if budget is None else RetryBudget(budget.percent / 100.0, budget.min_per_second)
        )
        self._listed = 0
        self._mirrored = 0

    @property
    def zone(self) -> str | None:
        return self._zone

    @property
    def plan(self) -> ZonePlan | None:
        """The zone plan of the last listing (None: no zone, or not computed yet)."""
        return self._plan

    # -- the listing ---------------------------------------------------------------------

    def select(self, instances: Sequence[Instance]) -> Sequence[Instance]:
        """The instances of a listing the route mirrors: subset, then zone preference."""
        self._listed = len(instances)
        chosen = instances
        if self._identity is not None and self._size is not None and chosen:
            by_identity = {i.identity: i for i in chosen}
            keep = subset(list(by_identity), self._identity, self._size)
            chosen = [by_identity[k] for k in keep]
        zone = self._zone
        if zone is not None and chosen:
            chosen = self._by_zone(zone, chosen)
        self._mirrored = len(chosen)
        return chosen

    def _by_zone(self, zone: str, instances: Sequence[Instance]) -> Sequence[Instance]:
        mask = hinted(zone, [_hints(i) for i in instances])
        if mask is not None:
            self._plan = ZonePlan(zone, "local", {zone: 1.0})
            return [i for i, keep in zip(instances, mask, strict=True) if keep]
        zones = [instance_zone(i) for i in instances]
        healthy: dict[str, int] = {}
        for instance, where in zip(instances, zones, strict=True):
            if where is not None:
                healthy.setdefault(where, 0)
                if not instance.draining:
                    healthy[where] += 1
        if not any(healthy.values()):
            self._plan = None
            return instances
        plan = self._plan = zone_plan(zone, healthy, min_size=self._min_size)
        if plan.mode != "local":
            return instances
        return [i for i, where in zip(instances, zones, strict=True) if where == zone]

    # -- the call ------------------------------------------------------------------------

    def may_retry(self, now: float) -> bool:
        """Whether one more retry may go out at ``now`` (charges the budget)."""
        budget = self.budget
        return budget is None or budget.try_withdraw(now)

    async def call(
        self,
        make: Callable[[int], Awaitable[httpx.Response]],
        *,
        idempotent: bool,
        clock: Callable[[], float] = anyio.current_time,
    ) -> httpx.Response:
        """Run one call's attempt loop ``make(n)``, hedged when idempotent and switched on."""
        budget = self.budget
        if budget is not None:
            budget.deposit(clock())
        hedging = self.hedging
        if hedging is None or not idempotent:
            return await make(0)
        return await hedged_call(
            make, hedging, idempotent=True, budget=budget, clock=clock, discard=_close
        )

    def statistics(self) -> BalancingStatistics:
        plan, hedging, budget = self._plan, self.hedging, self.budget
        return BalancingStatistics(
            zone=self._zone,
            zone_mode=None if plan is None else plan.mode,
            local_share=None if plan is None else plan.local_share,
            subset_size=self._size,
            mirrored=self._mirrored,
            listed=self._listed,
            budget_refused=0 if budget is None else budget.refusals,
            hedges=0 if hedging is None else hedging.hedges,
            hedge_wins=0 if hedging is None else hedging.wins,
            hedges_refused=0 if hedging is None else hedging.refused,
        )

    def __repr__(self) -> str:
        return f"<RouteBalancing zone={self._zone!r} subset={self._size!r}>"


async def _close(response: httpx.Response) -> None:
    await response.aclose()
