"""Settings of one Consul connection (the ``consul:`` block of a connection).

Frozen and strict: unknown keys are refused, and so is a value of another
type than its field's (``wait: '30'``, ``enabled: 'yes'``, ``watch_burst:
5.0``); a list setting takes a YAML list. Durations are seconds (floats; an
integer is a number too). The ACL token is a :class:`pydantic.SecretStr`: it
never appears in ``repr``, logs or error messages; only the HTTP header
carries it.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import (
    AnyHttpUrl,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from nadisc._config import PUBLISHED_SECRET, empty_port, secret_looking_keys, undialable

from ._hosts import is_loopback_host, is_unspecified_host, numeric_host_reading

__all__ = ["ConsulSettings", "ServiceBinding"]

_META_KEY = re.compile(r"^[A-Za-z0-9_-]{1,128}$")

#: Consul refuses DeregisterCriticalServiceAfter below one minute.
MIN_DEREGISTER_AFTER = 60.0


class ServiceBinding(BaseModel):
    """One service alias: the remote Consul service name (default: the alias)
    and an optional tag filter."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    #: Remote Consul service name (default: the alias).
    name: str = Field(min_length=1, max_length=512)
    #: Only entries carrying this tag.
    tag: str | None = Field(default=None, min_length=1)


class ConsulSettings(BaseModel):
    """Validated settings of a Consul connection.

    Discovery: ``url``, ``token``, ``ca_file``, ``datacenter``,
    ``consistency``, ``wait`` (blocking wait per request), ``services``.
    Registration (the write half): ``enabled``, ``advertised_host``,
    ``allow_loopback``, ``cluster_id``, ``tags``, ``meta``,
    ``reregister_interval``, ``health_check_path``, ``health_check_interval``,
    ``health_check_failures_before_critical``,
    ``deregister_critical_service_after``. Catalog: ``catalog_wait``.
    """

    #: ``hide_input_in_errors``: a rejected value (a url with a password in
    #: it, a token pasted in the wrong field) is never echoed by the error.
    #: ``strict``: no value is coerced into its field's type (a number in a
    #: string, a float for an integer, a word or a number for a boolean).
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, hide_input_in_errors=True)

    #: HTTP API address of the local Consul agent (no credentials in it).
    url: AnyHttpUrl = AnyHttpUrl("http://127.0.0.1:8500")
    #: ACL token, sent as `Authorization: Bearer` (never in a URL).
    token: SecretStr | None = Field(default=None, min_length=1)
    #: PEM bundle of the CA that signed the agent's certificate (https only).
    ca_file: str | None = None
    #: Datacenter to query (default: the agent's).
    datacenter: str | None = Field(default=None, min_length=1)
    #: Read consistency mode of discovery queries.
    consistency: Literal["default", "stale", "consistent"] = "default"
    #: Blocking wait sent as ``wait=``; Consul caps it at 10 minutes.
    wait: float = Field(default=30.0, gt=0, le=600)
    #: Instance identity: ``node`` (default) = ``<node>/<Service.ID>``, since
    #: a Service.ID is unique per agent only and defaults to the service name,
    #: so fleets repeat it on every node; ``service`` = Service.ID alone, for
    #: catalogs whose IDs are unique across nodes.
    identity_scope: Literal["service", "node"] = "node"
    #: Service aliases bound on this connection.
    services: dict[str, ServiceBinding] = Field(default_factory=dict)
    #: Re-issue rate limit of blocking loops (requests per second, burst).
    watch_rate: float = Field(default=2.0, gt=0, le=1000)
    #: Burst of the blocking-query rate limit.
    watch_burst: int = Field(default=5, ge=1, le=1000)
    #: Retry backoff after failures (seconds).
    initial_backoff: float = Field(default=1.0, gt=0, le=3600)
    #: Largest retry backoff after failures (seconds).
    max_backoff: float = Field(default=30.0, gt=0, le=3600)

    # -- registration (Fluens options) ---------------------------------
    #: Whether this connection may register instances.
    enabled: bool = True
    #: Advertise this host instead of the one the registration record carries.
    advertised_host: str | None = Field(default=None, min_length=1)
    #: Local development only: allow advertising loopback, and rewrite
    #: wildcard binds (0.0.0.0, ::, *) to ``localhost``.
    allow_loopback: bool = False
    #: Cluster id published in the instance's meta.
    cluster_id: str | None = Field(default=None, min_length=1, max_length=512)
    # The two tuples below are ``strict=False`` so the list a document holds
    # becomes the tuple; each item stays strict (text only).
    #: Tags added to every registered instance.
    tags: tuple[str, ...] = Field(default=(), strict=False)
    #: Meta keys that look secret (``db_password``) but are meant to be
    #: published: every observer of the registry reads them.
    publish_secret_looking_metadata: tuple[str, ...] = Field(default=(), strict=False)
    #: Meta added to every registered instance (readable by every observer; a
    #: secret-looking key is refused unless in publish_secret_looking_metadata).
    meta: dict[str, str] = Field(default_factory=dict)
    #: How often a registration is re-sent to the agent (seconds).
    reregister_interval: float = Field(default=30.0, gt=0, le=86400)
    #: HTTP path of the agent-run health check (default: a TTL check).
    health_check_path: str | None = None
    #: Interval of the health check (seconds).
    health_check_interval: float = Field(default=10.0, gt=0, le=86400)
    #: Consecutive failed HTTP/TCP probes before the agent marks the check
    #: critical (Consul's ``FailuresBeforeCritical``); until then the status
    #: stays what it was. 1 = critical on the first failure (Consul's own
    #: default). The default of 3 keeps one slow answer (a garbage-collection
    #: pause, CPU throttling, a loaded event loop) from taking the instance
    #: out of every caller's listing for a whole interval.
    health_check_failures_before_critical: int = Field(default=3, ge=1, le=100)
    #: Consul reaps an instance critical for this long (seconds, >= 60).
    deregister_critical_service_after: float = Field(
        default=MIN_DEREGISTER_AFTER, ge=MIN_DEREGISTER_AFTER, le=86400 * 7
    )
    #: Blocking wait of the catalog's two queries.
    catalog_wait: float = Field(default=300.0, gt=0, le=600)
    #: Parallel per-service reads during a catalog rebuild.
    catalog_parallelism: int = Field(default=8, ge=1, le=256)

    @field_validator("services", mode="before")
    @classmethod
    def _name_defaults_to_alias(cls, value: object) -> object:
        if isinstance(value, dict):
            return {
                alias: {"name": alias, **item}
                if isinstance(item, dict) and "name" not in item
                else item
                for alias, item in value.items()
            }
        return value

    @field_validator("services")
    @classmethod
    def _one_binding_per_remote_name(
        cls, value: dict[str, ServiceBinding]
    ) -> dict[str, ServiceBinding]:
        # The owner asks the provider for a service by its *remote* name, so
        # a remote name must lead back to one tag, and an alias must not be
        # another binding's remote name (it would be read as that one).
        first: dict[str, tuple[str, str | None]] = {}
        for alias, binding in value.items():
            seen = first.setdefault(binding.name, (alias, binding.tag))
            if seen[1] != binding.tag:
                raise ValueError(
                    f"aliases {seen[0]!r} and {alias!r} bind the same remote service "
                    "with different tags; services are observed by remote "
                    "name, so give each remote name one tag"
                )
        for alias, binding in value.items():
            owner = first.get(alias)
            if owner is not None and binding.name != alias:
                raise ValueError(
                    f"alias {alias!r} is also the remote name bound by alias {owner[0]!r}; "
                    "rename one of them"
                )
        return value

    @field_validator("url")
    @classmethod
    def _no_credentials_in_url(cls, value: AnyHttpUrl) -> AnyHttpUrl:
        if value.username is not None or value.password is not None:
            raise ValueError("credentials do not belong in url; use token")
        if value.query or value.fragment:
            # ?token=... would travel in every request line and log: refuse it
            raise ValueError("url must not carry a query or fragment (a token belongs in token)")
        return value

    @field_validator("url", mode="before")
    @classmethod
    def _port_is_given_when_a_colon_says_so(cls, value: object) -> object:
        # The URL parser reads ``http://consul:`` (``:${CONSUL_PORT}`` with an
        # empty variable, say) as the scheme's default port: refuse it instead.
        if isinstance(value, str) and empty_port(value):
            raise ValueError("':' after the host but no port (give 1-65535)")
        return value

    @field_validator("url")
    @classmethod
    def _port_is_dialable(cls, value: AnyHttpUrl) -> AnyHttpUrl:
        # The parser already refuses a port that is not a number or above
        # 65535; port 0 names no listening socket.
        problem = undialable(value.host, value.port)
        if problem is not None:
            raise ValueError(problem)
        return value

    @field_validator("advertised_host")
    @classmethod
    def _advertised_host_is_an_address_or_a_name(cls, value: str | None) -> str | None:
        if value is None:
            return None
        reading = numeric_host_reading(value)
        if reading is not None:
            raise ValueError(
                f"advertised_host is a numeric host name ({reading}) that resolvers and "
                "URL parsers take for an IPv4 number, not a name, and do not all read "
                "alike; write a dotted-quad address (a.b.c.d) or a real host name"
            )
        if is_unspecified_host(value):
            raise ValueError(
                "advertised_host must be a routable host, not an unspecified (wildcard) address"
            )
        return value

    @field_validator("health_check_path")
    @classmethod
    def _path_is_absolute(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise ValueError("health_check_path must start with '/'")
        return value

    @field_validator("meta")
    @classmethod
    def _meta_keys(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        allowed = info.data.get("publish_secret_looking_metadata") or ()
        for key in secret_looking_keys(value, allowed):
            raise ValueError(f"meta key {key!r} {PUBLISHED_SECRET}")
        for key, item in value.items():
            if not _META_KEY.match(key):
                raise ValueError(
                    f"meta key {key!r}: Consul allows only letters, digits, '-' and '_' "
                    "(no '.'), at most 128 characters"
                )
            if key.startswith("consul-"):
                raise ValueError(f"meta key {key!r}: the 'consul-' prefix is reserved")
            if len(item) > 512:
                raise ValueError(f"meta value of {key!r} exceeds 512 characters")
        if len(value) > 64:
            raise ValueError("Consul allows at most 64 meta pairs")
        return value

    @model_validator(mode="after")
    def _cross_fields(self) -> ConsulSettings:
        if self.url.scheme != "https" and self.ca_file is not None:
            raise ValueError("ca_file is only meaningful with an https url")
        if self.initial_backoff > self.max_backoff:
            raise ValueError("initial_backoff must not exceed max_backoff")
        # The wildcard and numeric spellings are refused by the field's own
        # validator (the error then names ``advertised_host``); loopback
        # depends on allow_loopback.
        if (
            self.advertised_host is not None
            and is_loopback_host(self.advertised_host)
            and not self.allow_loopback
        ):
            raise ValueError(
                "advertised_host is a loopback host, unreachable for other "
                "machines; set allow_loopback for local development"
            )
        return self

    def binding(self, service: str) -> ServiceBinding:
        """The binding for ``service``: the binding whose remote name it is
        (the owner asks by remote name; validation keeps that to one tag),
        else an alias key, else the name itself without a tag."""
        for binding in self.services.values():
            if binding.name == service:
                return binding
        bound = self.services.get(service)
        if bound is not None:
            return bound
        return ServiceBinding(name=service)

    @property
    def base_url(self) -> str:
        return str(self.url).rstrip("/")
