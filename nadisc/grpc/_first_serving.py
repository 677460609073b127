"""The first-serving probe: ``grpc.health.v1`` Check on several candidates, first SERVING wins.

Contract: a call made with ``first_serving=True`` checks up to
:data:`PROBE_WIDTH` (16) listed candidates at once, starting at the channel's
rotating start (the next such call starts one further on), and gives the
probes at most :data:`PROBE_SHARE` (75%) of the call's remaining budget
(:attr:`DiscoveryChannel.probe_budget` when the call has no deadline). The
first candidate that answers SERVING takes the business call; the other
probes are cancelled at once. When none answers SERVING in time (each
NOT_SERVING, failing or hung), the call is refused with
:class:`NoServingInstance` at the cut-off, and nothing of the business call
was sent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import grpc

from .._errors import EvidenceUnavailable
from ._errors import RpcError
from ._health import HealthClient, HealthStatus

if TYPE_CHECKING:
    from .._instance import Instance
    from ._discovery import DiscoveryChannel

__all__ = ["PROBE_SHARE", "PROBE_WIDTH", "NoServingInstance", "candidates", "probe_cutoff"]

#: At most this many candidates are probed at once.
PROBE_WIDTH = 16
#: The share of the remaining budget the probes may use.
PROBE_SHARE = 0.75


class NoServingInstance(RpcError):
    """No candidate answered SERVING within the probe's share of the budget; nothing was sent."""

    def __init__(self, details: str) -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, details, where="first-serving probe")


def probe_cutoff(now: float, deadline: float, default_budget: float) -> float:
    """When the probes must have found a SERVING candidate (synchronous)."""
    budget = default_budget if deadline == math.inf else max(deadline - now, 0.0)
    return now + PROBE_SHARE * budget


def candidates(identities: Sequence[str], start: int) -> list[str]:
    """Up to :data:`PROBE_WIDTH` identities, from ``start`` on, wrapping around."""
    n = len(identities)
    if n == 0:
        return []
    first = start % n
    rotated = [*identities[first:], *identities[:first]]
    return rotated[:PROBE_WIDTH]


async def first_serving_pick(channel: DiscoveryChannel, deadline: float) -> Instance:
    """The instance that answered SERVING first; raises :class:`NoServingInstance`."""
    route = channel.route
    try:
        route.snapshot()
    except EvidenceUnavailable as exc:
        raise RpcError(grpc.StatusCode.UNAVAILABLE, str(exc), where="discovery") from exc
    ejected = route.ejected()
    listed = [
        identity
        for identity in route.identities()
        if identity not in ejected
        and (instance := route.current(identity)) is not None
        and not instance.draining
    ]
    start = channel.probe_start
    channel.probe_start = (start + 1) % max(len(listed), 1)
    chosen = candidates(listed, start)
    await anyio.lowlevel.checkpoint_if_cancelled()
    now = channel._clock()
    # The caller's cancel scope is part of the budget the probes get 75% of.
    deadline = min(deadline, anyio.current_effective_deadline())
    cutoff = probe_cutoff(now, deadline, channel.probe_budget)
    winner: list[Instance] = []
    health_service = channel.health_service

    async def probe(identity: str, scope: anyio.CancelScope) -> None:
        instance = route.current(identity)
        if instance is None:
            return
        try:
            sub = await channel.subchannel(instance)
            assert sub.channel is not None
            status = await HealthClient(sub.channel).check(
                health_service, timeout=max(cutoff - channel._clock(), 0.0)
            )
        except RpcError:
            return
        if status is HealthStatus.SERVING and not winner and route.current(identity) is instance:
            winner.append(instance)
            scope.cancel()

    with anyio.move_on_at(cutoff):
        async with anyio.create_task_group() as tg:
            for identity in chosen:
                tg.start_soon(probe, identity, tg.cancel_scope)
    if winner:
        return winner[0]
    raise NoServingInstance(
        f"connection {channel.qualifier!r} service {channel.service!r}: none of "
        f"{len(chosen)} candidate(s) answered SERVING within {PROBE_SHARE:.0%} of the budget"
    )
