"""gRPC calls of the discovery channels: counts by status code and latency, per connection.

Contract: :func:`grpc_call_metrics` reads every open
:class:`~nadisc.grpc.DiscoveryChannel` of an owner (synchronously, on the
owner's loop) and returns one :class:`GrpcCallMetrics` per (connection,
service). :class:`GrpcCallsCollector` exports them to Prometheus as
``nadisc_discovery_grpc_calls_total{connection,service,code}`` (every one of
the 17 ``grpc.StatusCode`` names, zeros included: a closed label set) and
``nadisc_discovery_grpc_call_duration_seconds{connection,service}`` (whole
calls as the caller saw them: picks, probes and transparent retries
included; the buckets of the HTTP routes). ``nadisc.grpc`` is imported only
when something is read, so the owner never imports it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from .._route import CALL_LATENCY_BUCKETS

if TYPE_CHECKING:
    from .._owner import DiscoveryOwner

__all__ = ["GrpcCallMetrics", "GrpcCallsCollector", "grpc_call_metrics", "register_grpc_metrics"]

_CALLS = "nadisc_discovery_grpc_calls_total"
_DURATION = "nadisc_discovery_grpc_call_duration_seconds"


@dataclass(frozen=True, slots=True)
class GrpcCallMetrics:
    """The calls of one discovery channel's (connection, service)."""

    connection: str
    service: str
    #: Status code name -> calls that ended with it (every code present).
    codes: Mapping[str, int]
    #: Calls per :data:`~nadisc.CALL_LATENCY_BUCKETS` bound, plus one over the last.
    latency: tuple[int, ...]
    latency_sum: float


def grpc_call_metrics(owner: DiscoveryOwner | None = None) -> tuple[GrpcCallMetrics, ...]:
    """The open discovery channels' call metrics (of ``owner``; None: of every owner)."""
    import sys

    module = sys.modules.get("nadisc.grpc._discovery")
    if module is None:  # no discovery channel was ever made
        return ()
    merged: dict[tuple[str, str], tuple[dict[str, int], list[int], float]] = {}
    for channel in module.open_channels():
        if owner is not None and channel._owner is not owner:
            continue
        stats = channel.stats
        key = (stats.connection, stats.service)
        codes, latency, total = merged.get(key) or ({}, [0] * len(stats.latency), 0.0)
        for code, count in stats.codes.items():
            codes[code.name] = codes.get(code.name, 0) + count
        latency = [a + b for a, b in zip(latency, stats.latency, strict=True)]
        merged[key] = (codes, latency, total + stats.latency_sum)
    return tuple(
        GrpcCallMetrics(connection, service, codes, tuple(latency), total)
        for (connection, service), (codes, latency, total) in sorted(merged.items())
    )


class GrpcCallsCollector(Collector):
    """Prometheus families of :func:`grpc_call_metrics` (read on every ``collect()``)."""

    def __init__(self, owner: DiscoveryOwner | None = None) -> None:
        self._owner = owner

    def describe(self) -> Iterable[Metric]:
        return _families(())

    def collect(self) -> Iterable[Metric]:
        return _families(grpc_call_metrics(self._owner))

    def __repr__(self) -> str:
        return "<GrpcCallsCollector>"


def _families(rows: tuple[GrpcCallMetrics, ...]) -> list[Metric]:
    labels = ["connection", "service"]
    calls = CounterMetricFamily(
        _CALLS,
        "gRPC calls through discovery channels, by final status code.",
        labels=[*labels, "code"],
    )
    duration = HistogramMetricFamily(
        _DURATION,
        "gRPC calls through discovery channels, whole calls (picks, probes, retries).",
        labels=labels,
    )
    for row in rows:
        for code, count in sorted(row.codes.items()):
            calls.add_metric([row.connection, row.service, code], float(count))
        buckets: list[tuple[str, float]] = []
        cumulative = 0
        for bound, count in zip((*CALL_LATENCY_BUCKETS, math.inf), row.latency, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == math.inf else repr(bound), float(cumulative)))
        duration.add_metric([row.connection, row.service], buckets, row.latency_sum)
    return [calls, duration]


def register_grpc_metrics(owner: DiscoveryOwner, registry: CollectorRegistry) -> GrpcCallsCollector:
    """Register the gRPC call families of ``owner``'s discovery channels in ``registry``."""
    collector = GrpcCallsCollector(owner)
    registry.register(collector)
    return collector
