"""The owner's counts of gRPC calls made through discovery channels, per connection.

Contract: the owner keeps one :class:`GrpcCallCounts` per configured
connection that a discovery channel was opened on (created with the first
channel, kept until the owner is gone), so the counts outlive every channel
and exported counters never go backwards. A discovery channel adds each
finished call to its connection's counts: the final status code (the closed
set :data:`GRPC_STATUS_NAMES`, indexed by the code's number) and the whole
call's duration in the buckets of the HTTP routes
(:data:`~nadisc.CALL_LATENCY_BUCKETS`). No service name, address or other
free text is recorded. The observer reads them
(:attr:`~nadisc.ObserverSnapshot.grpc_calls`). This module does not import
``grpc``: the owner never needs it.
"""

from __future__ import annotations

from bisect import bisect_left

from ._route import CALL_LATENCY_BUCKETS

__all__ = ["GRPC_STATUS_NAMES", "GrpcCallCounts"]

#: Every gRPC status code name, at the index of its number (0 OK ... 16 UNAUTHENTICATED).
GRPC_STATUS_NAMES: tuple[str, ...] = (
    "OK",
    "CANCELLED",
    "UNKNOWN",
    "INVALID_ARGUMENT",
    "DEADLINE_EXCEEDED",
    "NOT_FOUND",
    "ALREADY_EXISTS",
    "PERMISSION_DENIED",
    "RESOURCE_EXHAUSTED",
    "FAILED_PRECONDITION",
    "ABORTED",
    "OUT_OF_RANGE",
    "UNIMPLEMENTED",
    "INTERNAL",
    "UNAVAILABLE",
    "DATA_LOSS",
    "UNAUTHENTICATED",
)


class GrpcCallCounts:
    """Calls of one connection by status code number, and their latency histogram."""

    __slots__ = ("codes", "latency", "latency_sum")

    def __init__(self) -> None:
        #: Calls per status code number (the index into :data:`GRPC_STATUS_NAMES`).
        self.codes = [0] * len(GRPC_STATUS_NAMES)
        #: Calls per ``CALL_LATENCY_BUCKETS`` bound, plus one over the last.
        self.latency = [0] * (len(CALL_LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0

    def observe(self, code: int, seconds: float) -> None:
        """One finished call: its status code number and its duration in seconds."""
        self.codes[code] += 1
        self.latency[bisect_left(CALL_LATENCY_BUCKETS, seconds)] += 1
        self.latency_sum += seconds

    def __repr__(self) -> str:
        return f"<GrpcCallCounts calls={sum(self.codes)}>"
