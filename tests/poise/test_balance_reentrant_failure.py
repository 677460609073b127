"""A poll_ready that runs a scan of its own balance, then raises.

A service's poll_ready may call back into its balance (``ready_nowait()``
from inside it: a scan within a scan). That inner scan may poll the same
endpoint again and settle it (READY, or quarantined when that poll raised
too) before the outer poll_ready raises. The outer scan used to take the
endpoint out of the idle list at the slot it no longer held (an
``IndexError``, or another endpoint lost from the scan); it now
quarantines the endpoint where it went, once.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from poise import Balance, Endpoint, ReadinessState

from ._balance_support import Ctl, First
from .test_balance_first_scan import Clock, Ready, _check_lists


class RaisesAfter(Ctl):
    """Its next poll_ready runs ``inner`` (a scan of the balance, say),
    then raises "outer poll"; a poll_ready from inside that scan answers as
    the ``Ctl`` of that ``mode`` does (its "fail" raises "inner poll")."""

    def __init__(self, mode: str) -> None:
        super().__init__("inner poll", mode)
        self.error = OSError("inner poll")
        self.inner: Callable[[], object] | None = None

    def poll_ready(self, wake: Callable[[], None]) -> bool:
        inner, self.inner = self.inner, None
        if inner is None:
            return super().poll_ready(wake)
        self.polls += 1
        inner()
        raise OSError("outer poll")


def _balance_with(
    service: RaisesAfter,
) -> tuple[Balance[object, object], list[Endpoint[object, object]], list[tuple[object, str]]]:
    eps: list[Endpoint[object, object]] = [Endpoint(i, Ready()) for i in range(6)]
    eps[2] = Endpoint(2, service)
    seen: list[tuple[object, str]] = []
    balance: Balance[object, object] = Balance(
        First(),
        eps,
        clock=Clock(),
        readiness_observer=lambda index, key, error: seen.append((key, str(error))),
    )
    return balance, eps, seen


@pytest.mark.parametrize(
    ("mode", "reported"),
    [
        # The inner scan quarantined it (and reported it): not again.
        ("fail", "inner poll"),
        # The inner scan found it READY: the later raise wins, and the
        # inner poll's reservation is given back.
        ("ready", "outer poll"),
        # The inner scan parked it: quarantined and unparked.
        ("pending", "outer poll"),
    ],
)
def test_an_endpoint_the_inner_scan_settled_is_quarantined_once(mode: str, reported: str) -> None:
    service = RaisesAfter(mode)
    balance, eps, seen = _balance_with(service)
    service.inner = balance.ready_nowait
    assert balance.ready_nowait()
    assert service.polls == 2
    assert eps[2].state is ReadinessState.FAILED
    assert seen == [(2, reported)]
    assert service.reserved == 0
    assert balance._ready == [ep for ep in eps if ep.index != 2]
    assert balance._idle == [] and balance._parked_count == 0
    assert eps[2]._slot < 0 and eps[2]._parked < 0
    _check_lists(balance)
    # Reset, it is polled afresh like any quarantined endpoint.
    service.mode = "ready"
    balance.reset(2)
    assert balance.ready_nowait()
    assert balance._ready == eps and service.reserved == 1
    _check_lists(balance)


def test_an_endpoint_drained_during_its_own_poll_is_quarantined_and_no_other_lost() -> None:
    service = RaisesAfter("ready")
    balance, eps, seen = _balance_with(service)

    def drain() -> None:
        eps[2].eligible = False

    service.inner = drain
    assert balance.ready_nowait()
    assert service.polls == 1
    assert eps[2].state is ReadinessState.FAILED
    assert seen == [(2, "outer poll")]
    # Every other endpoint was scanned and listed, none dropped from the scan.
    assert balance._ready == [ep for ep in eps if ep.index != 2]
    assert balance._idle == [] and all(ep._slot < 0 for ep in eps)
    _check_lists(balance)
