"""The ``etcd`` provider block of a connection: a frozen, validated value object.

Every field has its default here and nowhere else. The model is strict: a
value of another type than its field's is refused, never converted
(``ttl_seconds: '15'``, ``ttl_seconds: 15.0``, ``connect_timeout_ms: true``);
a list setting takes a YAML list. The password is a
:class:`pydantic.SecretStr`: it never appears in ``repr``, logs or error
messages, and it is only unwrapped at the moment the provider authenticates.

::

    connections:
      primary:
        provider: etcd
        etcd:
          endpoints: ["http://127.0.0.1:2379"]
          prefix: services          # keys: services/<service>/<instance-id>
          username: app             # optional; both or neither
          password: ...
          ttl_seconds: 15           # lease TTL of our own registrations
          services:
            orders: {name: order-worker}
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from typing import Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from nadisc._config import undialable
from nadisc._instance import valid_host

__all__ = ["EtcdServiceBinding", "EtcdSettings"]


def _check_path_text(value: str, what: str) -> str:
    if value != value.strip():
        raise ValueError(f"{what} must not start or end with whitespace")
    if value.startswith("/") or value.endswith("/"):
        raise ValueError(f"{what} must not start or end with '/' (the layout adds separators)")
    if "//" in value:
        raise ValueError(f"{what} must not contain an empty path segment ('//')")
    return value


def _authority(netloc: str) -> tuple[str, str]:
    """``(problem, authority)`` of an endpoint URL's ``host[:port]`` (a URL
    with user-info was refused before). ``problem`` is empty when the host is
    an IP address or a host name and the port, when given, a decimal number
    in 1-65535; ``authority`` is then the host with the port as a plain
    number (``:02379`` becomes ``:2379``). Problems never quote the input."""
    if netloc.startswith("["):
        host, _, rest = netloc[1:].partition("]")
        if rest and not rest.startswith(":"):
            return "text after the ']' of the IPv6 address is not ':<port>'", ""
        try:
            ipaddress.IPv6Address(host.partition("%")[0])
        except ValueError:
            return "the host between '[' and ']' is not an IPv6 address", ""
        host, has_port, port = f"[{host}]", rest[:1], rest[1:]
    else:
        host, has_port, port = netloc.partition(":")
        if not host:
            return "the host is empty", ""
        if not valid_host(host):
            return "the host is not an IP address or a host name", ""
    unspecified = undialable(host, None)  # 0.0.0.0 or [::]: the URL names no server
    if unspecified is not None:
        return unspecified, ""
    if not has_port:
        return "", host
    if not port:
        return "':' after the host but no port (give 1-65535)", ""
    if not (port.isascii() and port.isdigit()):
        return "the port is not a number (give 1-65535)", ""
    if not 1 <= int(port) <= 65_535:
        return "the port is outside 1-65535", ""
    return "", f"{host}:{int(port)}"


class EtcdServiceBinding(BaseModel):
    """One service alias bound on this connection: its remote (registry) name.

    ``name`` defaults to the alias itself.
    """

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    #: Remote service name in the key layout (default: the alias).
    name: str | None = Field(default=None, min_length=1, max_length=512)

    @field_validator("name")
    @classmethod
    def _name_is_a_path(cls, value: str | None) -> str | None:
        return None if value is None else _check_path_text(value, "service name")


class EtcdSettings(BaseModel):
    """Settings of one etcd connection (see the module docstring for the layout).

    Validation errors never echo the rejected input (``hide_input_in_errors``)
    nor an endpoint URL: a URL may carry credentials.
    """

    #: ``strict``: no value is coerced into its field's type (a number in a
    #: string, a float or a boolean for an integer).
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, hide_input_in_errors=True)

    # ``strict=False``: the list a document holds becomes the tuple; each
    # item stays strict (text only).
    #: Client URLs of the cluster members (``http://`` or ``https://``). The
    #: provider talks to the first one that accepts a connection.
    endpoints: tuple[str, ...] = Field(min_length=1, max_length=32, strict=False)
    #: Key prefix; instance keys are ``<prefix>/<service>/<instance-id>``. An
    #: empty prefix makes the service name the whole gRPC resolver target.
    prefix: str = Field(default="services", max_length=512)
    #: Kept out of ``repr`` and messages too (nadisc treats it as secret-looking).
    username: str | None = Field(default=None, min_length=1, max_length=256, repr=False)
    #: Password of the etcd user (both username and password, or neither).
    password: SecretStr | None = None
    #: Lease TTL of registrations this process writes. The provider declares
    #: ``Capabilities.renew_within = ttl_seconds / 3``, so the owner sends a
    #: keepalive at least three times per TTL whatever ``monitor_interval_ms``
    #: says: two lost keepalives in a row do not drop the registration.
    ttl_seconds: int = Field(default=15, ge=1, le=86_400)
    #: Service aliases bound on this connection -> remote service names.
    services: Mapping[str, EtcdServiceBinding] = Field(default_factory=dict)
    #: TCP connect budget of one request (the whole request is bounded by the
    #: connection's ``request_timeout``).
    connect_timeout_ms: int = Field(default=1000, ge=1, le=60_000)
    #: How often a watch checks the server with a small keys-only read: it
    #: detects a stopped server, a stalled stream and revoked permissions
    #: (etcd 3.4 keeps streaming to a watcher whose permission was revoked).
    probe_interval_ms: int = Field(default=5000, ge=50, le=3_600_000)
    #: Reconnect backoff of a watch: exponential, jittered between half the
    #: current cap and the cap.
    retry_initial_backoff_ms: int = Field(default=1000, ge=1, le=3_600_000)
    #: Largest reconnect backoff of a watch.
    retry_max_backoff_ms: int = Field(default=30_000, ge=1, le=86_400_000)
    #: A record value longer than this is a confirmed invalid candidate.
    max_record_bytes: int = Field(default=65_536, ge=64, le=16 * 1024 * 1024)
    #: Unary requests (ranges, puts, leases, probes) in flight at once on
    #: this connection, over as many pooled HTTP connections; more wait
    #: their turn in arrival order. Watches never use this pool: each
    #: stream holds a dedicated connection of its own (bounded by the
    #: owner's ``max_watch_streams``).
    max_request_connections: int = Field(default=16, ge=1, le=1024)
    #: ``shared``: one watch stream over ``<prefix>/`` feeds every watched
    #: service of the connection (one socket however many services are
    #: observed; needs read permission on the whole prefix). ``per_service``:
    #: one stream per watched service (permissions per service suffice). An
    #: empty ``prefix`` always watches per service.
    watch: Literal["shared", "per_service"] = "shared"
    #: How the provider talks to etcd: ``json``, its v3 JSON gateway (HTTP/1.1,
    #: httpx); ``grpc``, its v3 gRPC API over ``nadisc.grpc`` (HTTP/2; needs
    #: the ``grpc`` extra). The same calls, answers and failures either way;
    #: gRPC reads large ranges many times faster.
    wire: Literal["json", "grpc"] = "json"

    @field_validator("endpoints")
    @classmethod
    def _endpoints_are_http_urls(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        cleaned: list[str] = []
        for index, url in enumerate(value):
            try:
                parts = urlsplit(url)
            except ValueError:  # a bad [IPv6] host, say; its message quotes the input
                raise ValueError(f"endpoints[{index}]: the host does not parse") from None
            if parts.scheme not in ("http", "https"):
                raise ValueError(f"endpoints[{index}]: not an http(s) URL with a host")
            if parts.username is not None or parts.password is not None:
                raise ValueError(
                    f"endpoints[{index}]: credentials belong in username/password, not the URL"
                )
            if not parts.hostname:
                raise ValueError(f"endpoints[{index}]: the host is empty")
            if parts.query or parts.fragment or parts.path not in ("", "/"):
                raise ValueError(f"endpoints[{index}]: must not carry a path, query or fragment")
            problem, authority = _authority(parts.netloc)
            if problem:
                raise ValueError(f"endpoints[{index}]: {problem}")
            cleaned.append(f"{parts.scheme}://{authority}")
        if len(set(cleaned)) != len(cleaned):
            raise ValueError("endpoints: duplicate URL")
        return tuple(cleaned)

    @field_validator("prefix")
    @classmethod
    def _prefix_is_a_path(cls, value: str) -> str:
        return _check_path_text(value, "prefix") if value else value

    @model_validator(mode="after")
    def _credentials_come_in_pairs(self) -> EtcdSettings:
        if (self.username is None) != (self.password is None):
            raise ValueError("username and password must be given together")
        if self.retry_max_backoff_ms < self.retry_initial_backoff_ms:
            raise ValueError("retry_max_backoff_ms must be >= retry_initial_backoff_ms")
        return self

    @field_validator("services")
    @classmethod
    def _aliases_are_path_safe(
        cls, value: Mapping[str, EtcdServiceBinding]
    ) -> Mapping[str, EtcdServiceBinding]:
        for alias, binding in value.items():
            if not alias:
                raise ValueError("service aliases must be non-empty")
            if binding.name is None:
                _check_path_text(alias, f"service alias {alias!r} (used as the remote name)")
        return value

    def remote_name(self, alias: str) -> str:
        """The registry name bound to ``alias`` (``KeyError`` if it is not bound)."""
        return self.services[alias].name or alias
