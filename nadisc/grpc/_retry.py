"""gRPC's service-config retry policy and retry throttling, as synchronous decisions.

Contract (gRPC proposal A6): a call of a method marked idempotent that ends
with a status in ``retryable_status_codes`` is tried again, at most
``max_attempts`` attempts in all (2 to 5), after a randomised exponential
backoff: ``random() * min(initial_backoff * multiplier**(n-1), max_backoff)``
for the n-th retry, or exactly the server's ``grpc-retry-pushback-ms``; a
negative or malformed pushback means "do not retry". Throttling: a token
count starts at ``max_tokens``; each retryable failure takes one, each OK
adds ``token_ratio``; retries go out only while the count is above half of
``max_tokens``. Nothing here reads a clock or sleeps: time and randomness
are arguments, so every rule is tested with hypothesis.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import grpc

__all__ = ["RetryPolicy", "RetryThrottle", "retry_delay", "should_retry"]


def _positive(name: str, value: float) -> float:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"RetryPolicy.{name} must be finite seconds > 0, not {value!r}")
    return float(value)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """gRPC's ``retryPolicy`` of a method config (for calls made with ``idempotent=True``)."""

    max_attempts: int = 3
    initial_backoff: float = 0.1
    max_backoff: float = 1.0
    backoff_multiplier: float = 2.0
    retryable_status_codes: frozenset[grpc.StatusCode] = field(
        default_factory=lambda: frozenset({grpc.StatusCode.UNAVAILABLE})
    )

    def __post_init__(self) -> None:
        if not isinstance(self.max_attempts, int) or isinstance(self.max_attempts, bool):
            raise TypeError(f"RetryPolicy.max_attempts must be an int, not {self.max_attempts!r}")
        if self.max_attempts < 2:
            raise ValueError(f"RetryPolicy.max_attempts must be >= 2, not {self.max_attempts}")
        # gRPC caps maxAttempts at 5 (larger values are treated as 5).
        object.__setattr__(self, "max_attempts", min(self.max_attempts, 5))
        _positive("initial_backoff", self.initial_backoff)
        _positive("max_backoff", self.max_backoff)
        _positive("backoff_multiplier", self.backoff_multiplier)
        codes = frozenset(self.retryable_status_codes)
        if not codes:
            raise ValueError("RetryPolicy.retryable_status_codes must name at least one code")
        for code in codes:
            if not isinstance(code, grpc.StatusCode):
                raise TypeError(f"RetryPolicy.retryable_status_codes: {code!r} is not a StatusCode")
            if code is grpc.StatusCode.OK:
                raise ValueError("RetryPolicy.retryable_status_codes may not contain OK")
        object.__setattr__(self, "retryable_status_codes", codes)

    @classmethod
    def from_service_config(cls, config: dict[str, object]) -> RetryPolicy:
        """From a service config's ``retryPolicy`` object (``"0.1s"`` durations, code names)."""
        try:
            codes: Iterable[object] = config["retryableStatusCodes"]  # type: ignore[assignment]
            return cls(
                max_attempts=config["maxAttempts"],  # type: ignore[arg-type]
                initial_backoff=_duration(config["initialBackoff"]),
                max_backoff=_duration(config["maxBackoff"]),
                backoff_multiplier=config["backoffMultiplier"],  # type: ignore[arg-type]
                retryable_status_codes=frozenset(_code(name) for name in codes),
            )
        except KeyError as exc:
            raise ValueError(f"retryPolicy: missing field {exc.args[0]!r}") from None


def _duration(value: object) -> float:
    if not isinstance(value, str) or not value.endswith("s"):
        raise ValueError(f"retryPolicy: duration {value!r} is not like '0.1s'")
    try:
        return float(value[:-1])
    except ValueError:
        raise ValueError(f"retryPolicy: duration {value!r} is not like '0.1s'") from None


def _code(name: object) -> grpc.StatusCode:
    if isinstance(name, str):
        found = grpc.StatusCode.__members__.get(name.upper())
        if found is not None:
            return found
    raise ValueError(f"retryPolicy: {name!r} is not a gRPC status code name")


class RetryThrottle:
    """gRPC's retry throttling (``retryThrottling``: ``maxTokens``, ``tokenRatio``)."""

    __slots__ = ("max_tokens", "token_ratio", "tokens")

    def __init__(self, max_tokens: int = 10, token_ratio: float = 0.1) -> None:
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
            raise TypeError(f"RetryThrottle.max_tokens must be an int, not {max_tokens!r}")
        if not 0 < max_tokens <= 1000:
            raise ValueError(f"RetryThrottle.max_tokens must be in 1..1000, not {max_tokens}")
        if not (isinstance(token_ratio, int | float) and 0 < token_ratio <= max_tokens):
            raise ValueError(f"RetryThrottle.token_ratio must be > 0, not {token_ratio!r}")
        self.max_tokens = float(max_tokens)
        # gRPC keeps three decimal places of the ratio.
        self.token_ratio = math.floor(float(token_ratio) * 1000) / 1000 or 0.001
        self.tokens = float(max_tokens)

    def failure(self) -> None:
        """A call ended with a retryable status (or a pushback)."""
        self.tokens = max(0.0, self.tokens - 1)

    def success(self) -> None:
        self.tokens = min(self.max_tokens, self.tokens + self.token_ratio)

    def allows(self) -> bool:
        return self.tokens > self.max_tokens / 2

    def __repr__(self) -> str:
        return f"RetryThrottle(tokens={self.tokens:g}/{self.max_tokens:g})"


def should_retry(
    policy: RetryPolicy,
    throttle: RetryThrottle | None,
    attempts: int,
    code: grpc.StatusCode,
    pushback_ms: int | None,
) -> bool:
    """Whether a call that made ``attempts`` attempts, the last ending with ``code``, goes again."""
    if code not in policy.retryable_status_codes:
        return False
    if attempts >= policy.max_attempts:
        return False
    if pushback_ms is not None and pushback_ms < 0:
        return False
    return throttle is None or throttle.allows()


def retry_delay(
    policy: RetryPolicy, attempts: int, random: float, pushback_ms: int | None = None
) -> float:
    """Seconds before the retry after ``attempts`` attempts (``random`` in [0, 1))."""
    if pushback_ms is not None and pushback_ms >= 0:
        return pushback_ms / 1000
    ceiling = policy.initial_backoff * policy.backoff_multiplier ** max(attempts - 1, 0)
    return random * min(ceiling, policy.max_backoff)
