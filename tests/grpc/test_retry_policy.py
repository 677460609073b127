"""gRPC's retry policy and retry throttling: synchronous rules, checked with hypothesis."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from nadisc.grpc import RetryPolicy, RetryThrottle
from nadisc.grpc._retry import retry_delay, should_retry

codes = st.sampled_from([c for c in grpc.StatusCode if c is not grpc.StatusCode.OK])
policies = st.builds(
    RetryPolicy,
    max_attempts=st.integers(2, 9),
    initial_backoff=st.floats(0.001, 5),
    max_backoff=st.floats(0.001, 30),
    backoff_multiplier=st.floats(1, 10),
    retryable_status_codes=st.frozensets(codes, min_size=1),
)


@given(policies, st.integers(1, 10), codes)
def test_only_retryable_codes_within_max_attempts_go_again(
    policy: RetryPolicy, attempts: int, code: grpc.StatusCode
) -> None:
    expected = code in policy.retryable_status_codes and attempts < min(policy.max_attempts, 5)
    assert should_retry(policy, None, attempts, code, None) is expected


@given(policies, st.integers(1, 10), st.floats(0, 0.999999))
def test_the_backoff_is_random_below_the_capped_exponential(
    policy: RetryPolicy, attempts: int, random: float
) -> None:
    delay = retry_delay(policy, attempts, random)
    ceiling = min(
        policy.initial_backoff * policy.backoff_multiplier ** (attempts - 1), policy.max_backoff
    )
    assert 0 <= delay <= ceiling
    assert delay == pytest.approx(random * ceiling)


@given(policies, st.integers(-1000, 10_000))
def test_a_pushback_sets_the_delay_or_forbids_the_retry(policy: RetryPolicy, pushback: int) -> None:
    code = next(iter(policy.retryable_status_codes))
    if pushback < 0:
        assert not should_retry(policy, None, 1, code, pushback)
    else:
        assert should_retry(policy, None, 1, code, pushback)
        assert retry_delay(policy, 1, 0.5, pushback) == pushback / 1000


@given(
    st.integers(1, 1000),
    st.floats(0.001, 1),
    st.lists(st.booleans(), max_size=300),
)
def test_throttling_follows_the_token_count(
    max_tokens: int, ratio: float, outcomes: list[bool]
) -> None:
    throttle = RetryThrottle(max_tokens, ratio)
    tokens = float(max_tokens)
    step = int(ratio * 1000) / 1000 or 0.001
    for failed in outcomes:
        if failed:
            throttle.failure()
            tokens = max(0.0, tokens - 1)
        else:
            throttle.success()
            tokens = min(float(max_tokens), tokens + step)
        assert throttle.tokens == pytest.approx(tokens)
        assert throttle.allows() is (throttle.tokens > max_tokens / 2)
    policy = RetryPolicy()
    allowed = should_retry(policy, throttle, 1, grpc.StatusCode.UNAVAILABLE, None)
    assert allowed is throttle.allows()


def test_throttling_stops_retries_after_half_the_tokens() -> None:
    throttle = RetryThrottle(10, 0.5)
    for _ in range(4):
        throttle.failure()
    assert throttle.allows()  # 6 > 5
    throttle.failure()
    assert not throttle.allows()  # 5 is not above 5
    throttle.success()
    assert throttle.allows()  # 5.5


def test_service_config_form() -> None:
    policy = RetryPolicy.from_service_config(
        {
            "maxAttempts": 7,
            "initialBackoff": "0.2s",
            "maxBackoff": "2s",
            "backoffMultiplier": 3,
            "retryableStatusCodes": ["UNAVAILABLE", "resource_exhausted"],
        }
    )
    assert policy.max_attempts == 5  # gRPC's cap
    assert policy.initial_backoff == 0.2
    assert policy.retryable_status_codes == {
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    }


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"maxAttempts": 3}, "missing field 'retryableStatusCodes'"),
        (
            {
                "maxAttempts": 3,
                "initialBackoff": "fast",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
            "duration 'fast'",
        ),
        (
            {
                "maxAttempts": 3,
                "initialBackoff": "1s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["NOPE"],
            },
            "'NOPE' is not a gRPC status code",
        ),
        (
            {
                "maxAttempts": 1,
                "initialBackoff": "1s",
                "maxBackoff": "1s",
                "backoffMultiplier": 2,
                "retryableStatusCodes": ["UNAVAILABLE"],
            },
            "max_attempts must be >= 2",
        ),
    ],
)
def test_bad_service_config_is_a_typed_error(config: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RetryPolicy.from_service_config(config)


def test_bad_throttle_and_policy_values() -> None:
    with pytest.raises(ValueError, match="max_tokens"):
        RetryThrottle(0)
    with pytest.raises(ValueError, match="token_ratio"):
        RetryThrottle(10, 0)
    with pytest.raises(ValueError, match="may not contain OK"):
        RetryPolicy(retryable_status_codes=frozenset({grpc.StatusCode.OK}))
    with pytest.raises(ValueError, match="initial_backoff"):
        RetryPolicy(initial_backoff=float("nan"))
