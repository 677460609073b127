"""The registration operation bound on any anyio backend (asyncio too).

Real (short) sleeps instead of trio's MockClock: 40 registrations against a
registry that answers in 2 ms, four registry calls at a time.
"""

from __future__ import annotations

import anyio

from nadisc import (
    CloseOutcome,
    ConnectionSpec,
    LimitsConfig,
    OwnerBuilder,
    OwnerRegistrations,
    RegistrationState,
)

from .test_registration_scheduling import POLICY, CongestedRegistry, specs


async def test_the_bound_holds_on_this_backend() -> None:
    registry = CongestedRegistry(0.002, congestion=False)

    builder = (
        OwnerBuilder(limits=LimitsConfig(max_parallel_operations=4), shutdown_timeout=30)
        .connection(ConnectionSpec("primary", registry, POLICY, services={"orders": "orders"}))
        .registrations(OwnerRegistrations())
    )
    async with builder.open() as owner:
        await owner.prepare(anyio.current_time() + 5)
        owner.freeze_registrations(specs(40))
        await owner.publish(anyio.current_time() + 20)
        assert {s.state for s in owner.registrations().values()} == {RegistrationState.ACTIVE}
    assert 1 < registry.max_in_flight <= 4
    report = owner.close_report
    assert report is not None
    assert {getattr(e, "outcome", None) for e in report.registrations} == {
        CloseOutcome.DEREGISTERED
    }
    assert registry.keys == {}
