"""Reading a server's delay, and how long the next request waits: pure rules."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nadisc_kubernetes._http import Gone, RetryLater, failure_for, retry_after, status_failure
from nadisc_kubernetes._pacing import retry_wait
from nadisc_kubernetes._wire import decode_status

from nadisc import IdentityRevoked, IncompleteSnapshot
from tests.fakes.kubernetes import status_object

WHAT = "list slices of default/orders"


def status_body(code: int, reason: str, seconds: int | None = None) -> bytes:
    details = {"retryAfterSeconds": seconds} if seconds is not None else None
    return json.dumps(status_object(code, reason, "slow down", details)).encode()


@pytest.mark.parametrize(
    ("header", "seconds", "expected"),
    [
        ("5", None, 5.0),
        (" 12 ", None, 12.0),
        ("0", None, 0.0),
        ("5", 9, 5.0),  # the header wins, as in client-go
        (None, 9, 9.0),  # a proxy dropped the header: the Status still says
        ("Wed, 21 Oct 2015 07:28:00 GMT", None, None),  # a date is not seconds
        ("Wed, 21 Oct 2015 07:28:00 GMT", 4, 4.0),
        ("-1", None, None),
        ("1.5", None, None),
        ("٣", None, None),  # a non-ASCII digit
        (None, 0, None),
        (None, None, None),
    ],
)
def test_the_delay_is_whole_seconds_from_the_header_else_the_status(
    header: str | None, seconds: int | None, expected: float | None
) -> None:
    body = status_body(429, "TooManyRequests", seconds)
    assert retry_after(header, decode_status(body)) == expected


def test_only_429_and_5xx_with_a_delay_are_retry_later() -> None:
    throttled = failure_for(429, b"Too many requests, please try again later.\n", WHAT, (), "5")
    assert isinstance(throttled, RetryLater) and throttled.retry_after == 5
    assert str(throttled) == f"{WHAT}: HTTP 429 Too many requests, please try again later."
    unavailable = failure_for(503, status_body(503, "ServiceUnavailable", 2), WHAT)
    assert isinstance(unavailable, RetryLater) and unavailable.retry_after == 2
    plain = failure_for(429, status_body(429, "TooManyRequests"), WHAT)
    assert type(plain) is IncompleteSnapshot  # no delay given: the usual backoff
    assert isinstance(failure_for(403, b"", WHAT, (), "5"), IdentityRevoked)
    assert isinstance(failure_for(410, b"", WHAT, (), "5"), Gone)
    assert type(failure_for(400, b"", WHAT, (), "5")) is IncompleteSnapshot


def test_an_error_event_asking_for_a_delay_is_retry_later() -> None:
    status = decode_status(status_body(429, "TooManyRequests", 3))
    assert status is not None
    failure = status_failure(status, WHAT)
    assert isinstance(failure, RetryLater) and failure.retry_after == 3


@given(
    backoff=st.floats(0, 3600),
    server=st.one_of(st.none(), st.floats(0, 10**6)),
    cap=st.floats(0.001, 3600),
)
def test_the_wait_is_the_backoff_or_the_servers_delay_up_to_the_cap(
    backoff: float, server: float | None, cap: float
) -> None:
    wait = retry_wait(backoff, server, cap)
    assert wait >= backoff
    if server is None:
        assert wait == backoff
    else:
        assert wait >= min(server, cap)
        assert wait <= max(backoff, cap)
