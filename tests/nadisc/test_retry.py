"""retry_step: every combination of its inputs, against the rules stated one by one."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from nadisc._retry import Failure, RetryRules, Step, retry_step

_FLAGS = (False, True)


@dataclass(frozen=True)
class Case:
    failure: Failure
    rules: RetryRules
    retryable: bool
    attempts: int
    transparent: int
    listed: int
    untried: bool
    timed_out: bool
    now: float
    budget: bool


def _cases() -> list[Case]:
    cases = []
    flags = itertools.product(_FLAGS, repeat=3)
    for (
        connect,
        transport,
        status,
    ), failure, retryable, attempts, transparent in itertools.product(
        flags, list(Failure), _FLAGS, (1, 2, 3), (0, 1, 2)
    ):
        if transparent >= attempts:
            continue  # a transparent retry follows an attempt
        # now: before the cutoff (1.0), at it, at the deadline (2.0)
        for listed, untried, timed_out, now, budget in itertools.product(
            (0, 1, 3), _FLAGS, _FLAGS, (0.5, 1.0, 2.0), _FLAGS
        ):
            rules = RetryRules(3, connect, transport, status)
            cases.append(
                Case(
                    failure,
                    rules,
                    retryable,
                    attempts,
                    transparent,
                    listed,
                    untried,
                    timed_out,
                    now,
                    budget,
                )
            )
    return cases


def _decide(case: Case) -> tuple[Step, list[float]]:
    asked: list[float] = []

    def withdraw(now: float) -> bool:
        asked.append(now)
        return case.budget

    step = retry_step(
        case.rules,
        case.failure,
        retryable=case.retryable,
        attempts=case.attempts,
        transparent=case.transparent,
        listed=case.listed,
        untried=case.untried,
        timed_out=case.timed_out,
        now=case.now,
        cutoff=1.0,
        deadline=2.0,
        withdraw=withdraw,
    )
    return step, asked


CASES = _cases()


def test_every_combination_is_covered() -> None:
    # 8 option sets x 3 failures x 2 x 6 (attempts, transparent) pairs x 72
    assert len(CASES) == 8 * 3 * 2 * 6 * 72


def test_a_transparent_retry_needs_nothing_sent_the_option_and_an_instance_left() -> None:
    for case in CASES:
        step, asked = _decide(case)
        expected = (
            case.failure is Failure.NOTHING_SENT
            and case.rules.on_connect_failure
            and case.transparent < case.listed
            and case.untried
        )
        assert (step is Step.TRANSPARENT) == expected, case
        if step is Step.TRANSPARENT:
            assert asked == []  # not charged to the budget


def test_a_counted_retry_follows_each_rule() -> None:
    for case in CASES:
        step, asked = _decide(case)
        if step is Step.TRANSPARENT:
            continue
        rules = case.rules
        left = case.attempts - case.transparent < rules.max_attempts
        if case.failure is Failure.STATUS:
            wanted = rules.on_retryable_status and case.now < 2.0
        else:  # a connection that failed before sending, when not transparent, too
            wanted = rules.on_transport_error or (case.timed_out and case.now >= 1.0)
        allowed = case.retryable and left and wanted
        # The budget is asked exactly when everything else allows a retry, at `now`.
        assert asked == ([case.now] if allowed else []), case
        assert (step is Step.RETRY) == (allowed and case.budget), case


@pytest.mark.parametrize("failure", list(Failure))
def test_no_retry_once_the_attempts_are_spent(failure: Failure) -> None:
    rules = RetryRules(2, True, True, True)
    step = retry_step(
        rules,
        failure,
        retryable=True,
        attempts=2,
        transparent=0,
        listed=0,
        untried=False,
        timed_out=True,
        now=0.0,
        cutoff=0.0,
        deadline=1.0,
        withdraw=lambda now: True,
    )
    assert step is Step.STOP
