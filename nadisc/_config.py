"""The ``discovery`` configuration: frozen, validated value objects.

Everything under ``discovery`` is decided once, before any network resource
exists, and stays frozen for the owner's whole life: a changed value means a
restart (:func:`restart_required`). Validation is all or nothing: a config
object either exists fully checked or not at all.

::

    DiscoveryConfig                      discovery:
    ├── limits: LimitsConfig               limits: {...}
    ├── connections: {name: ConnectionConfig}
    │   ├── snapshot: SnapshotConfig       snapshot: {max_age_ms, stale_if_error_ms}
    │   ├── retry: RetryConfig             retry: {initial_backoff_ms, max_backoff_ms}
    │   ├── rest: RestConfig               rest: {...}
    │   └── one provider block             static: / dns: / <provider>: {...}
    └── registrations: {name: RegistrationConfig}

What is checked here, without touching the network:

* unknown fields (everywhere) and a provider block that belongs to another
  provider than the connection's ``provider``;
* every duration is an integer number of milliseconds, ``> 0`` (``>= 0`` where
  0 means "off", e.g. ``stale_if_error_ms``) and at most one day;
* the budgets fit: ``stale_if_error_ms <= max_age_ms``,
  ``poll_interval_ms + request_timeout_ms < max_age_ms``,
  ``monitor_interval_ms + request_timeout_ms < observation_grace_ms``,
  ``initial_backoff_ms <= max_backoff_ms``, REST ``connect_timeout_ms <
  request_timeout_ms``;
* the capacity limits and their hard maxima;
* references: a registration's ``qualifier`` names a connection, its
  ``service_name`` is an alias bound on that connection, ``default_connection``
  names a connection.

What is *not* checked here: whether a provider named by ``provider`` is
installed and whether its block is valid for it (the owner does that through
the provider's ``settings_model``, see :func:`validate_provider_block`), and
placeholders such as ``${VAR}`` (never expanded: the host resolves them before
handing the config over).

Errors raised while validating are pydantic ``ValidationError`` when a model
is built directly; :func:`nadisc.load_config` and :func:`parse_config` turn
them into :class:`~nadisc.ConfigError` with the full dotted path
(``discovery.connections.business.provider``).
"""

from __future__ import annotations

import difflib
import ipaddress
import re
from collections.abc import Iterable, Mapping, Sequence
from types import UnionType
from typing import Annotated, Any, Literal, TypeVar, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    Strict,
    ValidationError,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from ._errors import ConfigError
from ._instance import Instance, canonical_host, numeric_reading, valid_host

__all__ = [
    "BUILTIN_PROVIDERS",
    "DEFAULT_QUALIFIER",
    "MAX_DURATION_MS",
    "ConnectionConfig",
    "DiscoveryConfig",
    "DnsConfig",
    "DnsServiceConfig",
    "LimitsConfig",
    "MaskedUrl",
    "ProviderBlock",
    "RegistrationConfig",
    "RestConfig",
    "RetryConfig",
    "SnapshotConfig",
    "StaticConfig",
    "StaticInstanceConfig",
    "binding_names",
    "block_secrets",
    "config_error",
    "default_qualifier",
    "is_secret_key",
    "parse_nameserver",
    "provider_block",
    "restart_required",
    "translate_validation_error",
    "validate_provider_block",
    "validation_problems",
]

#: The fixed name of the default connection. Never inferred from count or order.
DEFAULT_QUALIFIER = "primary"
#: Longest duration any ``*_ms`` setting accepts: one day.
MAX_DURATION_MS = 86_400_000
#: Providers whose block is validated here (the others validate their own).
BUILTIN_PROVIDERS = frozenset({"static", "dns"})

#: Error type used for our own checks; ``ctx["field"]`` is the dotted
#: sub-path below the location pydantic reports.
_ERROR_TYPE = "nadisc_config"

StrictInt = Annotated[int, Strict()]
StrictBool = Annotated[bool, Strict()]
StrictStr = Annotated[str, Strict()]
#: Milliseconds, > 0, at most one day.
DurationMs = Annotated[int, Strict(), Field(gt=0, le=MAX_DURATION_MS)]
#: Milliseconds, >= 0 (0 switches the behaviour off), at most one day.
OptionalDurationMs = Annotated[int, Strict(), Field(ge=0, le=MAX_DURATION_MS)]
Port = Annotated[int, Strict(), Field(ge=1, le=65535)]
#: A finite weight > 0 (an integer is accepted; a string is not).
Weight = Annotated[float, Strict(), Field(gt=0, allow_inf_nan=False)]


def _problem(field: str | None, message: str) -> PydanticCustomError:
    """A validation error for ``field`` (dotted, relative to the model)."""
    # The message travels in the context: a template would expand braces in names.
    return PydanticCustomError(_ERROR_TYPE, "{detail}", {"detail": message, "field": field or ""})


def _check_name(kind: str, name: str, where: str) -> None:
    """Names are non-empty, case-sensitive, without surrounding blanks or dots
    (a dot would make config paths ambiguous)."""
    if not name:
        raise _problem(where, f"{kind} names must not be empty")
    if name != name.strip() or any(ord(c) < 32 for c in name) or "." in name:
        raise _problem(
            where, f"{kind} name {name!r} has surrounding whitespace, control characters or '.'"
        )


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", hide_input_in_errors=True)


# --------------------------------------------------------------------------- secrets


#: A key is secret-looking when, in snake case, it is one of these words or
#: ends with ``_<word>``: ``api_key``, ``private_key``, ``access_key_id``,
#: ``client_secret``, ``auth_token``, ``Authorization``, ``X-Api-Key``,
#: ``clientSecret``, ... Everything under such a key is masked, nested blocks
#: and lists included.
_SECRET_WORDS = frozenset(
    {
        "username",
        "user",
        "password",
        "passwd",
        "pwd",
        "passphrase",
        "token",
        "secret",
        "key",
        "key_id",
        "apikey",
        "credential",
        "credentials",
        "auth",
        "authorization",
        "bearer",
        "cookie",
        "signature",
    }
)

_CAMEL_BOUNDARY = re.compile(r"(?<=[a-z0-9])(?=[A-Z])")
_SEPARATORS = re.compile(r"[^a-z0-9]+")


def _is_secret_key(key: str) -> bool:
    snake = _SEPARATORS.sub("_", _CAMEL_BOUNDARY.sub("_", key).lower()).strip("_")
    if snake in _SECRET_WORDS:
        return True
    parts = snake.split("_")
    # "_<word>" endings, including two-part words such as "key_id"
    return parts[-1] in _SECRET_WORDS or "_".join(parts[-2:]) in _SECRET_WORDS


#: ``scheme://user-info@rest``: the user-info part is masked wherever it appears.
_URL_USERINFO = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://)([^/?#@]*)@(.*)$", re.DOTALL)


class MaskedUrl(SecretStr):
    """A URL that carries user-info (``http://bob:hunter2@host``): shown as
    ``http://***@host``. The value is kept so the provider's settings model
    can refuse it with its own message (credentials belong in their fields)."""

    def _display(self) -> str:
        match = _URL_USERINFO.match(self.get_secret_value())
        if match is None:  # pragma: no cover - only built from matching text
            return "**********"
        return f"{match.group(1)}***@{match.group(3)}"


def _field_annotation(model: Any, key: str) -> tuple[bool, Any]:
    """``(known, annotation)`` of ``key`` below the shape ``model``.

    ``model`` is a settings model class, a mapping/sequence annotation, or
    ``None`` (unknown shape: every key is unknown)."""
    shape = _strip(model)
    if isinstance(shape, type) and issubclass(shape, BaseModel):
        info = shape.model_fields.get(key)
        if info is None:
            for candidate in shape.model_fields.values():
                if candidate.alias == key:
                    info = candidate
                    break
        if info is None:
            return False, None
        return True, info.annotation
    origin = get_origin(shape)
    if origin is not None and isinstance(origin, type) and issubclass(origin, Mapping):
        args = get_args(shape)
        return True, args[-1] if args else Any
    if shape is Any:
        return True, Any
    return False, None


def _is_secret_annotation(annotation: Any) -> bool:
    shape = _strip(annotation)
    return isinstance(shape, type) and issubclass(shape, SecretStr)


def _item_annotation(annotation: Any) -> Any:
    shape = _strip(annotation)
    if shape is Any:
        return Any
    origin = get_origin(shape)
    if origin in (list, tuple, set, frozenset) or (
        isinstance(origin, type) and issubclass(origin, Sequence)
    ):
        args = [a for a in get_args(shape) if a is not Ellipsis]
        return args[0] if args else Any
    return None


def _masked_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    return {k: "**********" if _is_secret_key(k) else v for k, v in metadata.items()}


#: Why a secret-looking metadata key is refused (registrations, and the
#: metadata a provider block adds to every registration).
PUBLISHED_SECRET = (
    "looks like a secret, and metadata is published to every observer of the registry; "
    "remove it, or list the key in publish_secret_looking_metadata if it is meant to be public"
)


def secret_looking_keys(metadata: Iterable[str], allowed: Iterable[str]) -> list[str]:
    """The keys of ``metadata`` that look secret and are not in ``allowed``."""
    published = set(allowed)
    return [key for key in metadata if _is_secret_key(key) and key not in published]


def empty_port(url: str) -> bool:
    """True when ``url``'s authority ends in ``:`` with no port after it
    (``http://consul:``, a ``:${PORT}`` whose variable was empty): URL parsers
    read that as the scheme's default port."""
    authority = url.partition("://")[2].partition("/")[0].partition("?")[0]
    return authority.partition("#")[0].rpartition("@")[2].endswith(":")


def undialable(host: str | None, port: int | None) -> str | None:
    """Why a server URL's parsed ``host`` and ``port`` name no server, or
    None: port 0, or the unspecified address (the URL parser has already
    turned a numeric shorthand such as ``0`` into ``0.0.0.0``)."""
    if port == 0:
        return "port 0 cannot be connected to (give 1-65535)"
    try:
        unspecified = host is not None and ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        unspecified = False
    if unspecified:
        return "the host is the unspecified address (0.0.0.0 or ::), which names no server"
    return None


def is_secret_key(key: str) -> bool:
    """Whether values under ``key`` are treated as secrets (see ``_SECRET_WORDS``)."""
    return _is_secret_key(key)


class ProviderBlock(dict[str, Any]):
    """The raw, read-only block of a provider that validates its own settings.

    What ``repr``/``str``/``model_dump`` show is decided at load:

    * values under secret-looking keys (``username``, ``password``, ``token``,
      ``secret``, ``key``, ``authorization``, ``bearer``, ``*_token``,
      ``*_key_id``, ``api_key``, ``client_secret``, camelCase and dashed
      spellings too, ...) and fields the provider's settings model types as
      :class:`pydantic.SecretStr` are held as ``SecretStr``;
    * values under keys the installed provider's settings model does not
      know (a misspelt ``passwrd:``), and every value of a block whose
      provider is not installed, are held as ``SecretStr`` too;
    * URLs with user-info anywhere are held as :class:`MaskedUrl`.

    :func:`validate_provider_block` hands the provider's model plain values
    again. Nested mappings are ProviderBlocks, lists are tuples.
    """

    __slots__ = ()

    @classmethod
    def freeze(
        cls, value: Mapping[str, Any], *, secret: bool = False, model: Any = Any
    ) -> ProviderBlock:
        """A read-only deep copy of ``value``.

        With ``secret`` every string in it is held as a secret (the block sits
        under a secret-looking or unknown key). ``model`` is the shape the
        block is read with: a settings model class (keys it does not know are
        masked), ``None`` (no model: every value is masked) or ``Any`` (only
        secret-looking keys are masked).
        """
        block = cls()
        for key, item in value.items():
            name = str(key)
            known, annotation = _field_annotation(model, name)
            hidden = (
                secret or _is_secret_key(name) or not known or _is_secret_annotation(annotation)
            )
            dict.__setitem__(block, name, _freeze_value(item, hidden, annotation))
        return block

    def thaw(self) -> dict[str, Any]:
        """A plain, mutable deep copy with secrets revealed (for a settings model)."""
        return {k: _thaw_value(v) for k, v in self.items()}

    def __repr__(self) -> str:
        inner = ", ".join(f"{k!r}: {_masked_repr(k, v)}" for k, v in self.items())
        return "{" + inner + "}"

    __str__ = __repr__

    def _readonly(self, *args: object, **kwargs: object) -> None:
        raise TypeError("provider blocks are read-only")

    __setitem__ = _readonly
    __delitem__ = _readonly
    clear = _readonly
    pop = _readonly
    popitem = _readonly  # type: ignore[assignment]
    setdefault = _readonly
    update = _readonly
    __ior__ = _readonly  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:
        return (_restore_block, (dict(self),))


def _freeze_value(value: Any, secret: bool, annotation: Any = Any) -> Any:
    if isinstance(value, Mapping):
        return ProviderBlock.freeze(value, secret=secret, model=annotation)
    if isinstance(value, list | tuple):
        item = _item_annotation(annotation)
        return tuple(_freeze_value(v, secret or item is None, item) for v in value)
    if isinstance(value, str):
        if _URL_USERINFO.match(value):
            return MaskedUrl(value)
        if secret:
            return SecretStr(value)
    return value


def _restore_block(items: dict[str, Any]) -> ProviderBlock:
    """Rebuild a block from already frozen values (copy and pickle support)."""
    block = ProviderBlock()
    for key, value in items.items():
        dict.__setitem__(block, key, value)
    return block


def _thaw_value(value: Any) -> Any:
    if isinstance(value, ProviderBlock):
        return value.thaw()
    if isinstance(value, tuple):
        return [_thaw_value(v) for v in value]
    if isinstance(value, SecretStr):
        return value.get_secret_value()
    return value


def _masked_repr(key: str, value: Any) -> str:
    if isinstance(value, ProviderBlock):
        return repr(value)
    if isinstance(value, tuple):
        return "[" + ", ".join(_masked_repr(key, v) for v in value) + "]"
    if isinstance(value, MaskedUrl):
        return repr(str(value))
    if _is_secret_key(key) or isinstance(value, SecretStr):
        return "'**********'"
    return repr(value)


# --------------------------------------------------------------------------- limits


class LimitsConfig(_Frozen):
    """Capacity limits of one owner (``discovery.limits``). All values >= 1."""

    #: Most connections one owner may configure.
    max_connections: StrictInt = Field(default=16, ge=1, le=256)
    #: Most registrations one owner may configure.
    max_registrations: StrictInt = Field(default=64, ge=1, le=65_536)
    #: Most services observed at once on one connection.
    max_service_watches_per_connection: StrictInt = Field(default=1024, ge=1, le=65_536)
    #: Registry operations in flight at once per connection.
    max_parallel_operations: StrictInt = Field(default=4, ge=1, le=1024)
    #: Watch streams open at once on one connection.
    max_watch_streams: StrictInt = Field(default=64, ge=1, le=4096)
    #: Largest instance list one service may report.
    max_instances_per_service: StrictInt = Field(default=4096, ge=1, le=1_048_576)
    #: Most instances held across all observations.
    max_total_instances: StrictInt = Field(default=65_536, ge=1, le=16_777_216)
    #: Largest registry answer read for one snapshot, in bytes.
    max_snapshot_bytes: StrictInt = Field(default=67_108_864, ge=1, le=4_294_967_296)
    #: Most concurrent calls through the transports of one owner.
    max_transport_tasks: StrictInt = Field(default=4096, ge=1, le=65_536)

    @model_validator(mode="after")
    def _products(self) -> LimitsConfig:
        product = self.max_connections * self.max_service_watches_per_connection
        if product > 65_536:
            raise _problem(
                "max_service_watches_per_connection",
                f"max_connections x max_service_watches_per_connection = {product} exceeds 65536",
            )
        if self.max_instances_per_service > self.max_total_instances:
            raise _problem(
                "max_instances_per_service",
                "max_instances_per_service must not exceed max_total_instances",
            )
        return self


# --------------------------------------------------------------------------- balancing

Share = Annotated[float, Strict(), Field(ge=0, le=1_000_000, allow_inf_nan=False)]
Percentile = Annotated[float, Strict(), Field(gt=0, lt=100, allow_inf_nan=False)]


class SubsetConfig(_Frozen):
    """Deterministic subsetting (``connections.<name>.balancing.subset``).

    The client identity is its index in the fleet (0, 1, 2, ...), or
    ``NADISC_CLIENT_INDEX``.
    """

    #: Backends each client uses.
    size: StrictInt = Field(ge=1, le=65536)
    #: This client's index in the fleet (default: NADISC_CLIENT_INDEX).
    client_index: StrictInt | None = Field(default=None, ge=0)


class HedgeConfig(_Frozen):
    """Hedged requests of idempotent calls (``connections.<name>.balancing.hedge``)."""

    #: A fixed hedge delay.
    delay_ms: DurationMs | None = None
    #: Or: the route's rolling latency percentile, e.g. 95.
    percentile: Percentile | None = None
    #: Hedges at most per request.
    max_extra_attempts: StrictInt = Field(default=1, ge=1, le=8)

    @model_validator(mode="after")
    def _one_rule(self) -> HedgeConfig:
        if (self.delay_ms is None) == (self.percentile is None):
            raise _problem(None, "give exactly one of delay_ms and percentile")
        return self


class RetryBudgetConfig(_Frozen):
    """The route's budget of retries and hedges (``...balancing.retry_budget``)."""

    #: Retries and hedges allowed, in percent of requests.
    percent: Share = 20.0
    #: Retries and hedges allowed per second whatever the traffic.
    min_per_second: Share = 10.0


class BalancingConfig(_Frozen):
    """Zones, subsets, hedges and the retry budget (``connections.<name>.balancing``)."""

    #: The caller's zone (default: NADISC_ZONE); none = zone-blind.
    zone: StrictStr | None = Field(default=None, min_length=1)
    #: Prefer the caller's zone (Envoy's rule); false = every zone alike.
    zone_aware: StrictBool = True
    #: Fewer healthy instances than this: every zone alike.
    zone_min_size: StrictInt = Field(default=6, ge=0)
    #: Deterministic subsetting; none = every instance.
    subset: SubsetConfig | None = None
    #: Hedged requests; none = no hedging.
    hedge: HedgeConfig | None = None
    #: Retry budget shared by retries and hedges; none = only max_attempts bounds retries.
    retry_budget: RetryBudgetConfig | None = None


# --------------------------------------------------------------------------- connection parts


class SnapshotConfig(_Frozen):
    """Evidence age rules (``connections.<name>.snapshot``)."""

    #: Oldest evidence an observation may serve.
    max_age_ms: DurationMs = 15_000
    #: Grace after a failed refresh (incomplete only); 0 = none. Capped by max_age_ms.
    stale_if_error_ms: OptionalDurationMs = 0

    @model_validator(mode="after")
    def _grace_fits(self) -> SnapshotConfig:
        if self.stale_if_error_ms > self.max_age_ms:
            raise _problem(
                "stale_if_error_ms",
                f"stale_if_error_ms ({self.stale_if_error_ms}) must not exceed "
                f"max_age_ms ({self.max_age_ms})",
            )
        return self


class RetryConfig(_Frozen):
    """Exponential backoff with jitter between half the current cap and the cap."""

    #: First backoff after a failure.
    initial_backoff_ms: DurationMs = 1000
    #: Largest backoff (the cap doubles up to it).
    max_backoff_ms: DurationMs = 30_000

    @model_validator(mode="after")
    def _ordered(self) -> RetryConfig:
        if self.initial_backoff_ms > self.max_backoff_ms:
            raise _problem(
                "initial_backoff_ms",
                f"initial_backoff_ms ({self.initial_backoff_ms}) must not exceed "
                f"max_backoff_ms ({self.max_backoff_ms})",
            )
        return self


class OutlierConfig(_Frozen):
    """Passive outlier ejection of the connection's callers (``rest.outlier``)."""

    #: Keep instances whose calls keep failing out of the balance for a while.
    enabled: StrictBool = True
    #: Failed attempts in a row that eject an instance; 0 = rule off.
    consecutive_failures: StrictInt = Field(default=5, ge=0, le=100_000)
    #: Percentage of failed attempts in a window that ejects an instance; 0 = rule off.
    failure_rate_percent: StrictInt = Field(default=0, ge=0, le=100)
    #: Window of the failure-rate rule.
    window_ms: DurationMs = 10_000
    #: Fewest attempts in a window before the failure-rate rule applies.
    minimum_calls: StrictInt = Field(default=10, ge=1, le=1_000_000)
    #: Length of a first ejection; the k-th ejection in a row lasts k times as long.
    base_ejection_ms: DurationMs = 10_000
    #: Longest ejection.
    max_ejection_ms: DurationMs = 300_000
    #: Most instances ejected at once, in percent of the listed ones (rounded down).
    max_ejection_percent: StrictInt = Field(default=50, ge=0, le=100)

    @model_validator(mode="after")
    def _rules(self) -> OutlierConfig:
        if self.enabled and not self.consecutive_failures and not self.failure_rate_percent:
            raise _problem(
                "consecutive_failures",
                "ejection is enabled but both rules are off (consecutive_failures and "
                "failure_rate_percent are 0); set one, or enabled: false",
            )
        if self.base_ejection_ms > self.max_ejection_ms:
            raise _problem(
                "base_ejection_ms",
                f"base_ejection_ms ({self.base_ejection_ms}) must not exceed "
                f"max_ejection_ms ({self.max_ejection_ms})",
            )
        return self


class RestConfig(_Frozen):
    """The connection's REST caller (``connections.<name>.rest``)."""

    #: Whole budget of one call, all attempts included.
    request_timeout_ms: DurationMs = 10_000
    #: TCP connect budget of one attempt.
    connect_timeout_ms: DurationMs = 2000
    #: How an instance is chosen for each call.
    lb_strategy: Literal["round_robin", "weighted", "p2c_peak_ewma"] = "round_robin"
    #: Scheme used to call instances.
    instance_scheme: Literal["http", "https"] = "http"
    #: Attempts share the one budget.
    max_attempts: StrictInt = Field(default=1, ge=1, le=16)
    #: Retry GET/HEAD on another instance after a transport error.
    retry_get_head_on_transport_error: StrictBool = False
    #: Retry GET/HEAD on another instance after 502/503/504.
    retry_get_head_on_retryable_status: StrictBool = False
    #: Budget of one attempt up to the response headers; 0 = none (one attempt may use it all).
    attempt_timeout_ms: OptionalDurationMs = 0
    #: Retry a connection that failed before anything was sent, any method, on another instance.
    retry_on_connect_failure: StrictBool = True
    #: Passive outlier ejection of failing instances.
    outlier: OutlierConfig = Field(default_factory=OutlierConfig)

    @model_validator(mode="after")
    def _budget(self) -> RestConfig:
        if self.connect_timeout_ms >= self.request_timeout_ms:
            raise _problem(
                "connect_timeout_ms",
                f"request_timeout_ms ({self.request_timeout_ms}) is a budget that cannot fit "
                f"a connect timeout of {self.connect_timeout_ms} ms",
            )
        if self.attempt_timeout_ms > self.request_timeout_ms:
            raise _problem(
                "attempt_timeout_ms",
                f"attempt_timeout_ms ({self.attempt_timeout_ms}) must not exceed "
                f"request_timeout_ms ({self.request_timeout_ms})",
            )
        return self


# --------------------------------------------------------------------------- static


class StaticInstanceConfig(_Frozen):
    """One configured instance. ``id`` defaults to ``host:port``."""

    #: Host name or IP address of the instance.
    host: StrictStr = Field(min_length=1)
    #: Port of the instance.
    port: Port
    #: Balancing weight (> 0).
    weight: Weight = 1.0
    #: Instance identity (default host:port).
    id: StrictStr | None = Field(default=None, min_length=1)
    #: Metadata of the instance.
    metadata: dict[StrictStr, StrictStr] = Field(default_factory=dict)
    #: Tags of the instance.
    tags: list[StrictStr] = Field(default_factory=list)

    @field_validator("host")
    @classmethod
    def _valid_host(cls, value: str) -> str:
        # The check every provider's instances pass (nadisc.InvalidInstanceAddress).
        if not valid_host(value):
            raise ValueError("is not an IP address or DNS name")
        return value

    @property
    def identity(self) -> str:
        if self.id is not None:
            return self.id
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    # Values under secret-looking metadata keys are shown masked, as in any
    # provider block ("Secrets" in docs/config.md): in repr and str, and in
    # JSON dumps. The model keeps them (the instance is built from them).
    @field_serializer("metadata", when_used="json")
    def _masked_metadata(self, metadata: dict[str, str]) -> dict[str, str]:
        return _masked_metadata(metadata)

    def __repr_args__(self) -> Iterable[tuple[str | None, Any]]:
        for name, value in super().__repr_args__():
            yield name, _masked_metadata(value) if name == "metadata" else value

    def to_instance(self) -> Instance:
        return Instance(
            identity=self.identity,
            host=self.host,
            port=self.port,
            weight=self.weight,
            metadata=dict(self.metadata),
            tags=tuple(self.tags),
        )


class StaticConfig(_Frozen):
    """``static.services``: the complete instance list of each alias."""

    #: Each alias's complete instance list.
    services: dict[StrictStr, list[StaticInstanceConfig]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _unique(self) -> StaticConfig:
        for alias, instances in self.services.items():
            _check_name("service alias", alias, "services")
            seen: set[str] = set()
            for index, item in enumerate(instances):
                if item.identity in seen:
                    raise _problem(
                        f"services.{alias}[{index}]",
                        "duplicate instance identity (an earlier instance of this alias has "
                        "the same id, or the same host:port)",
                    )
                seen.add(item.identity)
        return self

    def instances(self, alias: str) -> tuple[Instance, ...]:
        """The configured instances of ``alias`` (KeyError if unbound)."""
        return tuple(item.to_instance() for item in self.services[alias])


# --------------------------------------------------------------------------- dns

_LABEL = re.compile(r"^(?!-)[A-Za-z0-9_-]{1,63}(?<!-)$")


def _check_dns_name(name: str) -> str:
    text = name[:-1] if name.endswith(".") else name
    if not text or len(text) > 253 or not all(_LABEL.match(p) for p in text.split(".")):
        raise ValueError("not a valid DNS name")
    return name


class DnsServiceConfig(_Frozen):
    """One DNS-backed service alias.

    Address mode (default): ``{host, port}`` queries A and AAAA (see
    ``address_types``) and pairs every address with ``port``. SRV mode:
    ``{host: _svc._proto.name, srv: true}``; ports, priorities and weights come
    from the records, so ``port`` must be absent.
    """

    #: DNS name to query (an SRV name like _svc._tcp.example.org with srv: true).
    host: StrictStr
    #: Port paired with every address (address mode only; SRV records carry their own).
    port: Port | None = None
    #: Query SRV records instead of A/AAAA.
    srv: StrictBool = False
    #: Record types queried in address mode.
    address_types: tuple[Literal["A", "AAAA"], ...] = ("A", "AAAA")

    @field_validator("host")
    @classmethod
    def _host(cls, value: str) -> str:
        try:
            ipaddress.ip_address(value)
        except ValueError:
            return _check_dns_name(value)
        raise ValueError("an IP address is not a DNS name; use the static provider for it")

    @model_validator(mode="after")
    def _mode(self) -> DnsServiceConfig:
        if self.srv:
            if self.port is not None:
                raise _problem("port", "SRV records carry their own ports: remove port")
            labels = self.host.split(".")
            if len(labels) < 3 or not (labels[0].startswith("_") and labels[1].startswith("_")):
                raise _problem("host", "an SRV name looks like _service._proto.name")
        else:
            if self.port is None:
                raise _problem("port", "port is required unless srv: true")
            if not self.address_types:
                raise _problem("address_types", "at least one of A, AAAA is required")
            if len(set(self.address_types)) != len(self.address_types):
                raise _problem("address_types", "duplicate address type")
        return self


def _check_nameserver(value: str) -> str:
    host, port = parse_nameserver(value)
    del host, port
    return value


def parse_nameserver(value: str) -> tuple[str, int]:
    """``"1.2.3.4"``, ``"1.2.3.4:5353"``, ``"::1"`` or ``"[::1]:5353"`` -> (ip, port)."""
    text = value.strip()
    port = 53
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise ValueError("unbalanced '[' in nameserver")
        host, rest = text[1:close], text[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise ValueError("expected ':port' after ']'")
            port = _port(rest[1:])
    elif text.count(":") == 1:
        host, port_text = text.split(":")
        port = _port(port_text)
    else:
        host = text
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError("nameservers are IP addresses with an optional :port") from None
    return host, port


def _port(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or not (1 <= int(text) <= 65535):
        raise ValueError("nameserver port must be 1-65535")
    return int(text)


class DnsConfig(_Frozen):
    """The ``dns`` block of a connection with ``provider: dns``.

    DNS proves that an address exists, nothing about health. Answers are
    refreshed every ``poll_interval_ms`` or when their TTL runs out, whichever
    comes first, but never more often than ``min_refresh_ms``.
    """

    #: Service aliases resolved through DNS.
    services: dict[StrictStr, DnsServiceConfig] = Field(default_factory=dict)
    #: ``ip[:port]`` entries; ``None`` reads the system resolver configuration.
    nameservers: tuple[StrictStr, ...] | None = None
    #: Lower bound for a TTL-driven refresh (a TTL of 0 must not spin).
    min_refresh_ms: DurationMs = 1000
    #: Query over TCP instead of UDP.
    tcp: StrictBool = False

    @field_validator("nameservers")
    @classmethod
    def _nameservers(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        if value is None:
            return None
        if not value:
            raise ValueError("nameservers must not be empty (omit it to use the system's)")
        for item in value:
            _check_nameserver(item)
        return value

    @model_validator(mode="after")
    def _aliases(self) -> DnsConfig:
        for alias in self.services:
            _check_name("service alias", alias, "services")
        return self

    def nameserver_addresses(self) -> tuple[tuple[str, int], ...] | None:
        if self.nameservers is None:
            return None
        return tuple(parse_nameserver(n) for n in self.nameservers)


# --------------------------------------------------------------------------- connection

_PROVIDER_NAME = re.compile(r"^[a-z][a-z0-9_-]*$")


class ConnectionConfig(_Frozen):
    """One named connection (``discovery.connections.<name>``).

    Besides the fields below, a connection carries exactly one provider block
    under the key equal to ``provider``: ``static`` and ``dns`` are validated
    here; any other provider's block is kept raw (:class:`ProviderBlock`) and
    validated by that provider's ``settings_model``.
    """

    model_config = ConfigDict(
        frozen=True,
        extra="allow",
        hide_input_in_errors=True,
        json_schema_extra={
            "additionalProperties": {
                "type": "object",
                "description": "the block of a provider other than static/dns, under a key "
                "equal to `provider`",
            }
        },
    )

    #: Name of the provider: static, dns, or an installed `nadisc.providers` entry
    #: point (etcd, consul, ...).
    provider: StrictStr
    #: Whether opening the owner fails when this connection cannot prepare.
    startup_required: StrictBool = True
    #: One operation, queueing included.
    request_timeout_ms: DurationMs = 3000
    #: Refresh period of a polled observation (providers that cannot watch).
    poll_interval_ms: DurationMs = 5000
    #: Reclaim an observation nobody held for this long.
    idle_timeout_ms: DurationMs = 30_000
    #: Evidence age rules of observations on this connection.
    snapshot: SnapshotConfig = Field(default_factory=SnapshotConfig)
    #: Backoff between failed refreshes.
    retry: RetryConfig = Field(default_factory=RetryConfig)
    #: Registration health re-check period.
    monitor_interval_ms: DurationMs = 5000
    #: How long one healthy re-check keeps a registration eligible.
    observation_grace_ms: DurationMs = 15_000
    #: Upper bound for one registration's deregistration.
    deregister_timeout_ms: DurationMs = 3000
    #: Settings of the REST caller bound to this connection.
    rest: RestConfig = Field(default_factory=RestConfig)
    #: Zones, subsets, hedges and the retry budget of calls on this connection.
    balancing: BalancingConfig = Field(default_factory=BalancingConfig)
    #: The static provider's block (only with provider: static).
    static: StaticConfig | None = None
    #: The DNS provider's block (only with provider: dns).
    dns: DnsConfig | None = None

    @model_validator(mode="before")
    @classmethod
    def _provider_blocks(cls, data: Any) -> Any:
        if not isinstance(data, Mapping):
            return data
        provider = data.get("provider")
        known = cls.model_fields
        out: dict[str, Any] = {}
        for key, value in data.items():
            if key in known:
                out[key] = value
                continue
            if not isinstance(key, str):
                raise _problem(None, "field names must be strings")
            if isinstance(provider, str) and key == provider:
                if not isinstance(value, Mapping):
                    raise _problem(key, "the provider block must be a mapping")
                out[key] = ProviderBlock.freeze(value, model=_settings_model(provider))
                continue
            hint = _unknown_field(key, known)
            if hint == "unknown field" and isinstance(provider, str) and isinstance(value, Mapping):
                hint = (
                    "unknown field, or a wrong provider block: this connection's provider "
                    "is another one"
                )
            raise _problem(key, hint)
        return out

    @field_validator("provider")
    @classmethod
    def _provider_name(cls, value: str) -> str:
        if not _PROVIDER_NAME.match(value):
            raise ValueError("provider names are lowercase letters, digits, '-' and '_'")
        if value in cls.model_fields and value not in BUILTIN_PROVIDERS:
            raise ValueError(f"{value!r} is a connection setting, not a provider")
        return value

    @model_validator(mode="after")
    def _rules(self) -> ConnectionConfig:
        for builtin in sorted(BUILTIN_PROVIDERS):
            if getattr(self, builtin) is not None and self.provider != builtin:
                raise _problem(
                    builtin,
                    f"wrong provider block: {builtin!r} given, but this connection's "
                    "provider is another one",
                )
        if self.provider in BUILTIN_PROVIDERS and getattr(self, self.provider) is None:
            raise _problem(self.provider, f"provider {self.provider!r} needs its block")
        if self.poll_interval_ms + self.request_timeout_ms >= self.snapshot.max_age_ms:
            raise _problem(
                "snapshot.max_age_ms",
                f"poll_interval_ms + request_timeout_ms ({self.poll_interval_ms} + "
                f"{self.request_timeout_ms}) must be less than snapshot.max_age_ms "
                f"({self.snapshot.max_age_ms})",
            )
        if self.monitor_interval_ms + self.request_timeout_ms >= self.observation_grace_ms:
            raise _problem(
                "observation_grace_ms",
                f"monitor_interval_ms + request_timeout_ms ({self.monitor_interval_ms} + "
                f"{self.request_timeout_ms}) must be less than observation_grace_ms "
                f"({self.observation_grace_ms})",
            )
        if self.provider not in BUILTIN_PROVIDERS:
            _raw_bindings(self.provider, provider_block(self))
        return self


def _settings_model(provider: str) -> type[BaseModel] | None:
    from ._registry import installed_settings_model

    return installed_settings_model(provider) if _PROVIDER_NAME.match(provider) else None


def provider_block(config: ConnectionConfig) -> Mapping[str, Any]:
    """The connection's provider block as a read-only mapping.

    For ``static``/``dns`` this is the validated block dumped back to plain
    values; for any other provider the raw block (empty if the config has
    none, so a provider whose settings all have defaults still validates).
    """
    if config.provider in BUILTIN_PROVIDERS:
        block = getattr(config, config.provider)
        return ProviderBlock.freeze(block.model_dump(mode="python"))
    extra = config.model_extra or {}
    value = extra.get(config.provider)
    return value if isinstance(value, ProviderBlock) else ProviderBlock()


def block_secrets(block: Mapping[str, Any]) -> tuple[str, ...]:
    """Every secret value held in a provider block (``SecretStr`` values at any
    depth, and the user-info of masked URLs with its password part), longest
    first, for redacting a message about that connection."""
    found: set[str] = set()

    def walk(value: Any) -> None:
        if isinstance(value, Mapping):
            for item in value.values():
                walk(item)
        elif isinstance(value, tuple | list):
            for item in value:
                walk(item)
        elif isinstance(value, SecretStr):
            text = value.get_secret_value()
            found.add(text)
            match = _URL_USERINFO.match(text)
            if match is not None:
                found.add(match.group(2))
                found.add(match.group(2).partition(":")[2])

    walk(block)
    return tuple(sorted((s for s in found if s), key=len, reverse=True))


M = TypeVar("M", bound=BaseModel)


def validate_provider_block(connection: str, config: ConnectionConfig, model: type[M]) -> M:
    """Validate the connection's provider block with a provider's ``settings_model``.

    Errors become :class:`~nadisc.ConfigError` with the path
    ``discovery.connections.<connection>.<provider>.<field>``; input values
    never appear in the message.
    """
    if config.provider in BUILTIN_PROVIDERS:
        built = getattr(config, config.provider)
        if isinstance(built, model):
            return built
    block = provider_block(config)
    raw = block.thaw() if isinstance(block, ProviderBlock) else dict(block)
    try:
        return model.model_validate(raw)
    except ValidationError as exc:
        raise translate_validation_error(
            exc, prefix=f"discovery.connections.{connection}.{config.provider}", model=model
        ) from None


def _raw_bindings(provider: str, block: Mapping[str, Any]) -> dict[str, str]:
    services = block.get("services", {})
    if isinstance(services, ProviderBlock):
        services = services.thaw()
    if services is None:
        return {}
    if not isinstance(services, Mapping):
        raise _problem(f"{provider}.services", "services must map aliases to {name: ...}")
    out: dict[str, str] = {}
    for alias, entry in services.items():
        if not isinstance(alias, str) or not alias or alias != alias.strip():
            raise _problem(f"{provider}.services", "service aliases must be non-empty strings")
        if not isinstance(entry, Mapping):
            raise _problem(f"{provider}.services.{alias}", "expected a mapping like {name: ...}")
        name = entry.get("name", alias)
        if not isinstance(name, str) or not name:
            raise _problem(
                f"{provider}.services.{alias}.name", "the remote service name must be a string"
            )
        out[alias] = name
    return out


def binding_names(config: ConnectionConfig) -> Mapping[str, str]:
    """Service bindings of a connection: alias -> remote service name.

    ``static``/``dns``: every alias maps to itself. Other providers: the
    block's ``services: {alias: {name: remote}}`` (``name`` defaults to the alias).
    """
    if config.provider == "static" and config.static is not None:
        return {alias: alias for alias in config.static.services}
    if config.provider == "dns" and config.dns is not None:
        return {alias: alias for alias in config.dns.services}
    return _raw_bindings(config.provider, provider_block(config))


# --------------------------------------------------------------------------- registration

_UNSPECIFIED = {ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::")}
#: A value that is exactly one ``${NAME}`` / ``${NAME:-fallback}`` placeholder
#: (left as text unless the document is expanded: see nadisc._loading).
WHOLE_PLACEHOLDER = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}$")


class RegistrationConfig(_Frozen):
    """One registration target (``discovery.registrations.<name>``).

    ``qualifier`` names the connection (default ``primary``); ``connection_ref``
    is the legacy spelling and may not be combined with it. ``service_name``
    is an alias bound on that connection, not a free remote name.
    """

    #: Connection to register on (default `primary`).
    qualifier: StrictStr = DEFAULT_QUALIFIER
    #: Legacy alias of ``qualifier``; when given, ``qualifier`` holds the same value.
    connection_ref: StrictStr | None = None
    #: Service alias bound on that connection (not a free remote name).
    service_name: StrictStr = Field(min_length=1)
    #: Host listener whose readiness the registration follows.
    listener_ref: StrictStr | None = Field(default=None, min_length=1)
    #: Defaults to the listener's eligibility.
    eligibility_ref: StrictStr | None = Field(default=None, min_length=1)
    #: The advertised address; default: the bound listener's (its
    #: ``advertised_host`` when it is bound to a wildcard address).
    ip: StrictStr | None = None
    #: Must equal the listener's bound port when both are known (a mapped
    #: port is ``advertised_port``); default: the bound port.
    port: Port | None = None
    #: The port peers dial when it differs from the bound one (NAT, containers).
    advertised_port: Port | None = None
    #: Whether opening fails when this registration cannot be published.
    startup_required: StrictBool = True
    #: Whether losing this registration makes the host not ready.
    readiness_critical: StrictBool = False
    #: Balancing weight published with the instance (> 0).
    weight: Weight = 1.0
    #: Metadata published with the instance (every observer can read it: no secrets).
    metadata: dict[StrictStr, StrictStr] = Field(default_factory=dict)
    #: Tags published with the instance.
    tags: list[StrictStr] = Field(default_factory=list)
    #: Explicit instance id (default: derived from service, ip and port).
    instance_id: StrictStr | None = Field(default=None, min_length=1)
    #: Metadata keys that look secret (``db_password``, ``api_key``, ...) but
    #: are meant to be published: every observer of the registry reads them.
    publish_secret_looking_metadata: list[StrictStr] = Field(default_factory=list)

    @model_validator(mode="after")
    def _no_secrets_published(self) -> RegistrationConfig:
        for key in secret_looking_keys(self.metadata, self.publish_secret_looking_metadata):
            raise _problem(f"metadata.{key}", PUBLISHED_SECRET)
        return self

    @model_validator(mode="before")
    @classmethod
    def _legacy_ref(cls, data: Any) -> Any:
        if isinstance(data, Mapping) and data.get("connection_ref") is not None:
            if "qualifier" in data:
                raise _problem(
                    "connection_ref",
                    "give either qualifier or its legacy alias connection_ref, not both",
                )
            return {**data, "qualifier": data["connection_ref"]}
        return data

    @field_validator("ip")
    @classmethod
    def _ip(cls, value: str | None) -> str | None:
        if value is None:
            return None
        if not value or value != value.strip() or any(c.isspace() for c in value):
            raise ValueError("ip must be a non-empty address without whitespace")
        if WHOLE_PLACEHOLDER.match(value):
            return value  # not expanded (no environ given): judged when the plan is made
        if not valid_host(value):
            # Not a URL, host:port, user-info or bracketed address: the
            # registry publishes this text as the address others dial.
            raise ValueError(
                "ip must be an IP address or a DNS host name (no port, scheme, "
                "brackets or user-info)"
            )
        try:
            address = ipaddress.ip_address(value)
        except ValueError:
            if numeric_reading(value) is not None:
                raise ValueError(
                    "ip is a numeric host name, which resolvers read as an IPv4 number; "
                    "write a dotted-quad address or a real host name"
                ) from None
            return value  # a host name (resolved by the registry or the host)
        if address in _UNSPECIFIED or (
            isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped in _UNSPECIFIED
        ):
            raise ValueError(
                "ip is the unspecified address, not a reachable one; "
                "configure the address others reach"
            )
        return value

    @property
    def effective_eligibility_ref(self) -> str | None:
        """``eligibility_ref``, or the listener's when not given."""
        return self.eligibility_ref if self.eligibility_ref is not None else self.listener_ref

    @property
    def qualifier_field(self) -> str:
        """The config key that named the connection (for error paths)."""
        return "connection_ref" if self.connection_ref is not None else "qualifier"


# --------------------------------------------------------------------------- root


class DiscoveryConfig(_Frozen):
    """The whole ``discovery`` node. Frozen for the owner's life."""

    #: Master switch; false (the default) means discovery is off and nothing else may be set.
    enabled: StrictBool = False
    #: Serve /discovery/eligible/{registration} (restrict its network access).
    eligibility_probe: StrictBool = False
    #: Legacy: when set, the default for unqualified selection (wins over ``primary``).
    default_connection: StrictStr | None = None
    #: Named connections to registries (one of them is usually `primary`).
    connections: dict[StrictStr, ConnectionConfig] = Field(default_factory=dict)
    #: Instances of this process to publish, by registration name.
    registrations: dict[StrictStr, RegistrationConfig] = Field(default_factory=dict)
    #: Capacity limits of the owner.
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    #: First-shutdown budget shared by quiesce and close.
    shutdown_timeout_ms: DurationMs = 10_000

    @model_validator(mode="after")
    def _rules(self) -> DiscoveryConfig:
        if not self.enabled:
            for field, present in (
                ("connections", bool(self.connections)),
                ("registrations", bool(self.registrations)),
                ("default_connection", self.default_connection is not None),
                ("eligibility_probe", self.eligibility_probe),
            ):
                if present:
                    raise _problem(
                        field, f"discovery is disabled (enabled: false) but {field} is set"
                    )
            return self
        for name in self.connections:
            _check_name("connection", name, "connections")
        for name in self.registrations:
            _check_name("registration", name, "registrations")
        if len(self.connections) > self.limits.max_connections:
            raise _problem(
                "connections",
                f"{len(self.connections)} connections exceed limits.max_connections "
                f"({self.limits.max_connections})",
            )
        if len(self.registrations) > self.limits.max_registrations:
            raise _problem(
                "registrations",
                f"{len(self.registrations)} registrations exceed limits.max_registrations "
                f"({self.limits.max_registrations})",
            )
        if self.default_connection is not None and self.default_connection not in self.connections:
            raise _problem("default_connection", "names no configured connection")
        most = self.limits.max_instances_per_service
        for name, configured in self.connections.items():
            # A static listing over the limit could never be served.
            static = configured.static.services if configured.static else {}
            for alias, instances in static.items():
                if len(instances) > most:
                    raise _problem(
                        f"connections.{name}.static.services.{alias}",
                        f"{len(instances)} instances exceed limits.max_instances_per_service "
                        f"({most}): the listing would be withheld",
                    )
        # What the frozen plan checks again at open (nadisc._registration):
        # one instance id, and one address, per connection and remote service.
        by_identity: dict[tuple[str, str, str], str] = {}
        backend_keys: dict[tuple[str, str, str, int], str] = {}
        for name, registration in self.registrations.items():
            where = f"registrations.{name}"
            qualifier = registration.qualifier
            connection = self.connections.get(qualifier)
            if connection is None:
                raise _problem(
                    f"{where}.{registration.qualifier_field}", "names no configured connection"
                )
            if connection.provider in BUILTIN_PROVIDERS:
                raise _problem(
                    f"{where}.{registration.qualifier_field}",
                    "the connection it names uses a discovery-only provider (static or dns), "
                    "which cannot register",
                )
            bindings = binding_names(connection)
            remote = bindings.get(registration.service_name)
            if remote is None:
                raise _problem(
                    f"{where}.service_name",
                    "this service alias is not bound on the connection the registration "
                    "names (bind it under the provider block's services)",
                )
            if registration.instance_id is not None:
                identity = (qualifier, remote, registration.instance_id)
                if identity in by_identity:
                    raise _problem(
                        f"{where}.instance_id",
                        "registers the same instance id as registration "
                        f"{by_identity[identity]!r} (same connection and remote service)",
                    )
                by_identity[identity] = name
            if registration.ip is None or registration.port is None:
                continue  # taken from the bound listener; the frozen plan checks it
            key = (qualifier, remote, canonical_host(registration.ip), registration.port)
            if key in backend_keys:
                raise _problem(
                    where,
                    f"registers the same instance as registration {backend_keys[key]!r}",
                )
            backend_keys[key] = name
        return self

    def connection(self, qualifier: str) -> ConnectionConfig:
        """The named connection (KeyError if absent)."""
        return self.connections[qualifier]


def default_qualifier(config: DiscoveryConfig) -> str | None:
    """The connection an unqualified selection uses, or ``None`` (then it must fail).

    An explicit legacy ``default_connection`` wins; otherwise the fixed name
    ``primary`` if such a connection exists. Never inferred from count or order.
    """
    if config.default_connection is not None:
        return config.default_connection
    if DEFAULT_QUALIFIER in config.connections:
        return DEFAULT_QUALIFIER
    return None


def restart_required(old: DiscoveryConfig, new: DiscoveryConfig) -> bool:
    """Whether moving from ``old`` to ``new`` needs a restart.

    Everything under ``discovery`` is frozen for the owner's life, so any
    difference at all means a restart (the candidate config is refused and
    the running one kept).
    """
    return old != new


# --------------------------------------------------------------------------- errors


def _render_loc(loc: tuple[int | str, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part:
            out += ("." if out else "") + str(part)
    return out


def _strip(annotation: Any) -> Any:
    """``Annotated[X, ...]`` and ``X | None`` -> ``X``."""
    while True:
        origin = get_origin(annotation)
        if origin is Annotated:
            annotation = get_args(annotation)[0]
        elif origin in (Union, UnionType):
            rest = [a for a in get_args(annotation) if a is not type(None)]
            if len(rest) != 1:
                return annotation
            annotation = rest[0]
        else:
            return annotation


def _model_at(root: type[BaseModel], loc: Sequence[int | str]) -> type[BaseModel] | None:
    """The model class found at ``loc`` below ``root`` (through dicts and lists)."""
    current: Any = root
    for part in loc:
        current = _strip(current)
        if isinstance(current, type) and issubclass(current, BaseModel):
            info = current.model_fields.get(str(part))
            if info is None:
                return None
            current = info.annotation
        elif get_origin(current) in (dict, list, tuple):
            args = get_args(current)
            if not args:
                return None
            current = args[-1] if get_origin(current) is dict else args[0]
        else:
            return None
    current = _strip(current)
    return current if isinstance(current, type) and issubclass(current, BaseModel) else None


def _unknown_field(name: str, known: Iterable[str]) -> str:
    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.7)
    return f"unknown field (did you mean {close[0]!r}?)" if close else "unknown field"


def validation_problems(
    exc: ValidationError, *, prefix: str = "discovery", model: type[BaseModel] | None = None
) -> list[tuple[str, str]]:
    """Every problem of a pydantic error as ``(dotted path, message)``.

    Input values never appear (they may be secrets). With ``model`` (the
    class validated at ``prefix``) unknown fields get a spelling hint.
    """
    problems: list[tuple[str, str]] = []
    #: Per path, whether its problems so far are only "not this type" ones:
    #: a value that fits no member of a union gets one error per member, and
    #: a more specific one (a number out of range) says what is wrong.
    type_only: dict[str, bool] = {}
    for error in exc.errors(include_input=False, include_url=False, include_context=True):
        loc = list(_without_union_tags(model, error["loc"]))
        ctx = error.get("ctx") or {}
        field = ctx.get("field") if error["type"] == _ERROR_TYPE else None
        if field:
            loc.extend(str(field).split("."))
        message = str(error["msg"]).removeprefix("Value error, ")
        if len(loc) >= 2 and loc[-1] == "[key]":
            # A mapping key that is not valid (an integer connection name):
            # the path names the key as written.
            loc = [*loc[:-2], str(loc[-2])]
            message = f"the key: {message}"
        rendered = _render_loc(tuple(loc))
        joiner = "." if rendered and not rendered.startswith("[") else ""
        path = prefix + joiner + rendered
        if error["type"] == "extra_forbidden":
            message = "unknown field"
            found = _model_at(model, error["loc"][:-1]) if model is not None else None
            if found is not None:
                message = _unknown_field(str(error["loc"][-1]), found.model_fields)
        is_type = str(error["type"]).endswith("_type")
        if path in type_only and len(loc) < len(error["loc"]):
            # Another member's error at the same path (a union tag was dropped).
            if is_type and not type_only[path]:
                continue
            if not is_type and type_only[path]:
                problems = [p for p in problems if p[0] != path]
        type_only[path] = is_type and type_only.get(path, True)
        problems.append((path, message))
    return problems


def _without_union_tags(
    model: type[BaseModel] | None, loc: Sequence[int | str]
) -> Sequence[int | str]:
    """``loc`` without the member tags pydantic puts after a union-typed field
    (``port.str``, ``port.constrained-int``): they are not config keys. The
    shape is followed from ``model`` through models, mappings and lists; past
    a union (or without a model) the rest is kept as it is."""
    if model is None:
        return loc
    current: Any = model
    kept: list[int | str] = []
    for at, part in enumerate(loc):
        current = _strip(current)
        origin = get_origin(current)
        if origin in (Union, UnionType):
            return [*kept, *loc[at + 1 :]]  # ``part`` is the member's tag
        kept.append(part)
        if isinstance(current, type) and issubclass(current, BaseModel):
            info = current.model_fields.get(str(part))
            if info is None:
                return [*kept, *loc[at + 1 :]]
            current = info.annotation
        elif origin in (dict, list, tuple) and get_args(current):
            args = get_args(current)
            current = args[-1] if origin is dict else args[0]
        else:
            return [*kept, *loc[at + 1 :]]
    return kept


def config_error(problems: Sequence[tuple[str, str]], default: str = "discovery") -> ConfigError:
    """One :class:`ConfigError` carrying every problem (the first names ``path``)."""
    if not problems:
        return ConfigError(default, "invalid configuration")
    path, message = problems[0]
    return ConfigError(path, message, problems=tuple(problems))


def translate_validation_error(
    exc: ValidationError, *, prefix: str = "discovery", model: type[BaseModel] | None = None
) -> ConfigError:
    """One :class:`ConfigError` for a pydantic error, with full dotted paths.

    The first problem gives ``path``; every problem is in ``problems`` and
    in the message. Input values never appear (they may be secrets). With
    ``model`` (the class validated at ``prefix``) unknown fields get a
    spelling hint.
    """
    return config_error(validation_problems(exc, prefix=prefix, model=model), prefix)
