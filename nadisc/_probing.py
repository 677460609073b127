"""First serving candidate: pick an instance by asking a health probe first.

For protocols with an explicit health answer (gRPC ``Check`` -> ``SERVING``)
a caller may want the request to go only to an instance that has just said
so. :class:`FirstServing` runs one selection per request (draining instances
are never candidates)::

    candidates (listing order) ── rotate by one per request ──► first 16
        │ probe them concurrently, within 75 % of the budget left
        ├─ first probe that answers True ──► chosen; every other probe cancelled
        └─ none did ──► NoServingCandidate (every probe's error aggregated)
    chosen ── observation.submit_if_current: still in the current evidence?
        ├─ yes ──► send(chosen) at once (no await in between), awaited once:
        │          never re-sent automatically
        └─ no  ──► CandidateWithdrawn (nothing was sent)

Only an explicit ``True`` counts as Serving; ``False`` is recorded as
:class:`NotServing`, an exception as itself, a probe that had not answered
when the probing budget ran out as :class:`~nadisc.DeadlineExceeded`.
Errors are aggregated as :class:`NoServingCandidate`, a nadisc error that
carries ``failures`` (candidate, error) in probing order and is raised *from*
an ``ExceptionGroup`` of the same errors, so tracebacks show all of them.

Probes run in a task group owned by the call (they never outlive it). The
rotation counter is the only state; one :class:`FirstServing` may be shared
by concurrent callers. Cost: one task per probed candidate (at most
``max_probes``), nothing else.
"""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import anyio

from ._errors import ConfigError, DeadlineExceeded, DiscoveryError, EvidenceUnavailable
from ._instance import Instance
from ._observation import Observation, ObservationSnapshot

__all__ = [
    "CandidateWithdrawn",
    "FirstServing",
    "NoServingCandidate",
    "NotServing",
    "ProbeFailure",
    "first_serving",
]

C = TypeVar("C")
T = TypeVar("T")

#: At most this many candidates are probed for one request.
MAX_PROBES = 16
#: Share of the remaining budget probing may spend.
PROBE_SHARE = 0.75


class NotServing(DiscoveryError):
    """A probe answered, and the answer was not Serving."""


class CandidateWithdrawn(EvidenceUnavailable):
    """The chosen candidate left the evidence between probing and sending."""

    def __init__(self, message: str) -> None:
        super().__init__(message, reason="withdrawn")


@dataclass(frozen=True, slots=True)
class ProbeFailure(Generic[C]):
    """One candidate that did not answer Serving, and why."""

    candidate: C
    error: Exception


class NoServingCandidate(DiscoveryError):
    """No probed candidate answered Serving in time.

    ``failures`` lists each probed candidate with its error; ``__cause__`` is
    an ``ExceptionGroup`` of those errors (absent when there was no candidate).
    """

    def __init__(self, message: str, failures: Sequence[ProbeFailure[object]]) -> None:
        super().__init__(message)
        self.failures: tuple[ProbeFailure[object], ...] = tuple(failures)


class FirstServing(Generic[C]):
    """Select the first candidate whose probe answers Serving (see the module docs).

    ``probe(candidate) -> bool`` is awaited per candidate; ``max_probes``
    (1-16) bounds how many candidates one request probes, concurrently;
    ``budget_share`` (0 < share <= 0.75) is the part of the remaining budget
    probing may spend. Invalid settings raise :class:`~nadisc.ConfigError`.
    """

    __slots__ = ("_max", "_next", "_probe", "_share")

    def __init__(
        self,
        probe: Callable[[C], Awaitable[bool]],
        *,
        max_probes: int = MAX_PROBES,
        budget_share: float = PROBE_SHARE,
    ) -> None:
        if not callable(probe):
            raise ConfigError("probe", "must be an async callable candidate -> bool")
        if isinstance(max_probes, bool) or not isinstance(max_probes, int):
            raise ConfigError("max_probes", f"must be an integer, got {max_probes!r}")
        if not 1 <= max_probes <= MAX_PROBES:
            raise ConfigError("max_probes", f"must be between 1 and {MAX_PROBES}")
        if (
            isinstance(budget_share, bool)
            or not isinstance(budget_share, int | float)
            or not math.isfinite(budget_share)
            or not 0 < budget_share <= PROBE_SHARE
        ):
            raise ConfigError("budget_share", f"must be > 0 and <= {PROBE_SHARE}")
        self._probe = probe
        self._max = max_probes
        self._share = float(budget_share)
        self._next = 0

    def __repr__(self) -> str:
        return f"<FirstServing max_probes={self._max} share={self._share:g}>"

    async def select(self, candidates: Sequence[C], deadline: float) -> C:
        """The first of (up to ``max_probes``) candidates to answer Serving.

        The starting candidate rotates by one on every call. Raises
        :class:`NoServingCandidate` when none did within the probing budget,
        :class:`~nadisc.DeadlineExceeded` when ``deadline`` already passed.
        """
        now = anyio.current_time()
        if math.isnan(deadline) or deadline <= now:
            raise DeadlineExceeded("the budget was spent before probing started")
        count = len(candidates)
        if count == 0:
            raise NoServingCandidate("there is no candidate to probe", [])
        start = self._next % count
        self._next = start + 1
        order = [candidates[(start + i) % count] for i in range(min(count, self._max))]
        probe_until = now + (deadline - now) * self._share
        outcomes: list[Exception | None] = [None] * len(order)
        chosen: list[C] = []

        async def run(index: int, candidate: C, scope: anyio.CancelScope) -> None:
            try:
                serving = await self._probe(candidate)
            except Exception as exc:
                outcomes[index] = exc
                return
            if serving is True:
                if not chosen:
                    chosen.append(candidate)
                    scope.cancel()
            else:
                outcomes[index] = NotServing(f"candidate answered {serving!r}, not Serving")

        with anyio.move_on_at(probe_until):
            async with anyio.create_task_group() as tg:
                for index, candidate in enumerate(order):
                    tg.start_soon(run, index, candidate, tg.cancel_scope)
        if chosen:
            return chosen[0]
        failures: list[ProbeFailure[object]] = []
        for candidate, outcome in zip(order, outcomes, strict=True):
            error = outcome or DeadlineExceeded(
                f"no answer within the probing budget ({self._share:.0%} of the time left)"
            )
            failures.append(ProbeFailure(candidate, error))
        raise NoServingCandidate(
            f"none of {len(order)} probed candidate(s) answered Serving",
            failures,
        ) from ExceptionGroup("probe failures", [f.error for f in failures])

    async def submit(
        self: FirstServing[Instance],
        observation: Observation,
        send: Callable[[Instance], Awaitable[T]],
        deadline: float,
        *,
        strict: bool = False,
    ) -> T:
        """Probe the observation's instances, then send to the chosen one once.

        ``send(instance)`` is called right after the chosen instance was
        found in the current evidence (``observation.submit_if_current``),
        with no await in between, and awaited exactly once: a request that
        was submitted is never re-sent. Raises
        :class:`~nadisc.EvidenceUnavailable` (nothing usable),
        :class:`NoServingCandidate`, and :class:`CandidateWithdrawn` when the
        chosen instance left the evidence while probing (nothing sent).
        """
        snapshot = observation.snapshot(strict=strict)
        # Draining instances finish what they have and take nothing new.
        candidates = [i for i in snapshot.instances if not i.draining]
        instance = await self.select(candidates, deadline)

        def check(current: ObservationSnapshot) -> Instance:
            if instance not in current.instances:
                raise CandidateWithdrawn(
                    f"instance {instance.identity!r} left the evidence of "
                    f"{observation.connection!r}/{observation.service!r} while probing"
                )
            return instance

        submit = observation.submit_if_current_strict if strict else observation.submit_if_current
        chosen = submit(check)
        # No await between the currency check and the start of the request.
        return await send(chosen)


async def first_serving(
    candidates: Sequence[C],
    probe: Callable[[C], Awaitable[bool]],
    deadline: float,
    *,
    max_probes: int = MAX_PROBES,
) -> C:
    """One-shot :meth:`FirstServing.select` (no rotation across calls)."""
    return await FirstServing(probe, max_probes=max_probes).select(candidates, deadline)
