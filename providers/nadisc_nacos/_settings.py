"""Settings of one Nacos connection (the ``nacos:`` block of a connection).

Frozen and strict: unknown keys are refused, and so is a value of another
type than its field's (``beat_interval: '5'``, ``ephemeral: 'yes'``,
``cluster_filter: 1``; an integer is a number of seconds too); credentials
never ride in a ``server_addr`` (``http://user:pass@host`` is refused: use
``username`` / ``password``), the password is a :class:`pydantic.SecretStr`
(never in a ``repr``, a log line or an error message; validation errors
never echo the input). ``server_addr`` takes one address or several (a list,
or a comma-separated string as Nacos clients accept it), each with the
context path, e.g. ``http://nacos-business:8848/nacos/``; a bare
``host:port`` means ``http://host:port/nacos``.
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

__all__ = ["NacosServiceBinding", "NacosSettings"]

#: Nacos refuses these characters in service and group names (``@@`` is its
#: own group separator).
_NAME = re.compile(r"^[^@#\s]+(?:@(?!@)[^@#\s]*)*$")
DEFAULT_CONTEXT_PATH = "/nacos"
#: Cluster names Nacos accepts (``Constants.CLUSTER_NAME_PATTERN_STRING``,
#: checked by ``NamingUtils.checkInstanceIsLegal`` on every registration):
#: letters, digits and '-' only.
_CLUSTER = re.compile(r"^[0-9a-zA-Z-]+$")
#: Instance metadata keys the server reads as the instance's heartbeat rules
#: (``PreservedMetadataKeys``), in milliseconds.
HEART_BEAT_INTERVAL = "preserved.heart.beat.interval"
HEART_BEAT_TIMEOUT = "preserved.heart.beat.timeout"
IP_DELETE_TIMEOUT = "preserved.ip.delete.timeout"
#: Nacos's defaults for them (``Constants.DEFAULT_HEART_BEAT_*``, ms).
HEART_BEAT_DEFAULTS = {
    HEART_BEAT_INTERVAL: 5000,
    HEART_BEAT_TIMEOUT: 15000,
    IP_DELETE_TIMEOUT: 30000,
}


def heartbeat_rules(metadata: dict[str, str]) -> dict[str, int] | str:
    """The heartbeat rules ``metadata`` sets (ms, defaults filled in), or why
    Nacos would refuse them: each a whole number of ms > 0, and the interval
    not above either timeout (``NamingUtils.checkInstanceIsLegal``)."""
    rules = dict(HEART_BEAT_DEFAULTS)
    for key in rules:
        text = metadata.get(key)
        if text is None:
            continue
        if not text.strip().isdigit() or int(text) <= 0:
            return f"metadata {key!r} must be a whole number of milliseconds > 0"
        rules[key] = int(text)
    interval = rules[HEART_BEAT_INTERVAL]
    if rules[HEART_BEAT_TIMEOUT] < interval or rules[IP_DELETE_TIMEOUT] < interval:
        return (
            f"metadata {HEART_BEAT_INTERVAL!r} must not exceed {HEART_BEAT_TIMEOUT!r} "
            f"and {IP_DELETE_TIMEOUT!r} (Nacos refuses such an instance)"
        )
    return rules


class NacosServiceBinding(BaseModel):
    """One service alias: the remote Nacos service name (default: the alias)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

    name: str = Field(
        min_length=1,
        max_length=512,
        description=(
            "the Nacos service name the alias stands for, without the group (the group "
            "is the connection's 'group'); defaults to the alias"
        ),
    )

    @field_validator("name")
    @classmethod
    def _valid_name(cls, value: str) -> str:
        if "@@" in value or not _NAME.match(value):
            raise ValueError(
                "a Nacos service name may not contain '@@', '#' or whitespace "
                "(give the group in the connection's 'group')"
            )
        return value


class NacosSettings(BaseModel):
    """Validated settings of a Nacos connection.

    Discovery: ``server_addr``, ``namespace``, ``group``, ``cluster``
    (registrations, and the cluster filter of listings when
    ``cluster_filter``), ``username`` / ``password``, ``ca_file``, ``api``,
    ``services``. Registration: ``ephemeral``, ``weight``, ``metadata``,
    ``beat_interval`` (used until the server says otherwise).
    """

    #: ``strict``: no value is coerced into its field's type (a number in a
    #: string, a word or a number for a boolean). ``server_addr``'s one-string
    #: and list spellings are turned into its tuple before that check.
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True, hide_input_in_errors=True)

    server_addr: tuple[AnyHttpUrl, ...] = Field(
        default=(AnyHttpUrl("http://127.0.0.1:8848/nacos"),),
        min_length=1,
        max_length=32,
        description=(
            "the Nacos servers, each with its context path (http://host:8848/nacos/); "
            "one URL, a list, or a comma-separated string; a bare host:port means "
            "http://host:port/nacos. On a transport failure the next server is tried, "
            "and later requests start at the one that answered. No credentials in a URL"
        ),
    )
    namespace: str = Field(
        default="public",
        min_length=1,
        max_length=128,
        description="namespace id of every listing and registration; public is Nacos's default",
    )
    group: str = Field(
        default="DEFAULT_GROUP",
        min_length=1,
        max_length=128,
        description=(
            "the group every service of this connection is listed and registered in "
            "(sent as groupName and as the <group>@@<service> prefix on v1)"
        ),
    )
    cluster: str = Field(
        default="DEFAULT",
        min_length=1,
        max_length=64,
        description=(
            "the cluster registrations are written to (clusterName) and checked in; "
            "with cluster_filter, also the only cluster listings include"
        ),
    )
    cluster_filter: bool = Field(
        default=False,
        description="list only instances of 'cluster' (default: instances of every cluster)",
    )
    username: str | None = Field(
        default=None,
        min_length=1,
        max_length=256,
        description=(
            "login user of Nacos auth, together with 'password' (both or neither); "
            "without them no login is made"
        ),
    )
    password: SecretStr | None = Field(
        default=None,
        description=(
            "login password, together with 'username'; sent only in the login form body "
            "and never shown in a repr, a log line or an error"
        ),
    )
    ca_file: str | None = Field(
        default=None,
        min_length=1,
        description=(
            "PEM bundle of the CA that signed the servers' certificates "
            "(only with an https server_addr)"
        ),
    )
    api: Literal["auto", "v1", "v3"] = Field(
        default="auto",
        description=(
            "which HTTP API to speak: auto probes once at prepare and prefers the v3 "
            "client API, falling back to v1"
        ),
    )
    services: dict[str, NacosServiceBinding] = Field(
        default_factory=dict,
        description="service aliases of this connection: alias -> {name: remote service name}",
    )
    ephemeral: bool = Field(
        default=True,
        description=(
            "register ephemeral instances (kept alive by heartbeats) or, when false, "
            "persistent ones (no heartbeat; removed only by deregistration)"
        ),
    )
    beat_interval: float = Field(
        default=5.0,
        gt=0,
        le=60,
        description=(
            "seconds between heartbeats of an ephemeral registration until the server "
            "answers with its clientBeatInterval; Nacos's default is 5 s"
        ),
    )
    token_refresh_margin: float = Field(
        default=60.0,
        ge=0,
        le=86400,
        description=(
            "log in again this many seconds before the token's tokenTtl ends (at most half the TTL)"
        ),
    )
    # ``strict=False``: a tuple is taken for the list too; each item stays text.
    publish_secret_looking_metadata: list[str] = Field(
        default_factory=list,
        strict=False,
        description=(
            "keys of metadata that look secret (db_password, api_key) but are meant to be "
            "published: every observer of the registry reads them"
        ),
    )
    metadata: dict[str, str] = Field(
        default_factory=dict,
        description=(
            "extra instance metadata on every registration of this connection "
            "(a registration's own metadata wins on a shared key); at most 64 pairs; "
            "a secret-looking key is refused unless listed in publish_secret_looking_metadata"
        ),
    )

    @field_validator("server_addr", mode="before")
    @classmethod
    def _addresses(cls, value: object) -> object:
        if isinstance(value, str):
            value = [part for part in (p.strip() for p in value.split(",")) if part]
        if isinstance(value, list | tuple):
            out: list[object] = []
            for item in value:
                if isinstance(item, str):
                    text = item.strip()
                    if "://" not in text:
                        text = "http://" + text
                    if empty_port(text):
                        raise ValueError("':' after the host but no port (give 1-65535)")
                    scheme, _, rest = text.partition("://")
                    if "/" not in rest:
                        text = f"{scheme}://{rest}{DEFAULT_CONTEXT_PATH}"
                    out.append(text)
                else:
                    out.append(item)
            return tuple(out)
        return value

    @field_validator("server_addr")
    @classmethod
    def _no_credentials(cls, value: tuple[AnyHttpUrl, ...]) -> tuple[AnyHttpUrl, ...]:
        for url in value:
            if url.username is not None or url.password is not None:
                raise ValueError("credentials do not belong in server_addr; use username/password")
            if url.query or url.fragment:
                raise ValueError("server_addr takes no query or fragment")
            problem = undialable(url.host, url.port)
            if problem is not None:
                raise ValueError(problem)
        return value

    @field_validator("group", "namespace")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if "@@" in value or not _NAME.match(value):
            raise ValueError("may not contain '@@', '#' or whitespace")
        return value

    @field_validator("cluster")
    @classmethod
    def _cluster_name(cls, value: str) -> str:
        if not _CLUSTER.match(value):
            raise ValueError(
                "Nacos takes cluster names of letters, digits and '-' only (0-9a-zA-Z-)"
            )
        return value

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
    def _aliases(cls, value: dict[str, NacosServiceBinding]) -> dict[str, NacosServiceBinding]:
        remote = {binding.name: alias for alias, binding in value.items()}
        for alias, binding in value.items():
            owner = remote.get(alias)
            if owner is not None and owner != alias and binding.name != alias:
                raise ValueError(
                    f"alias {alias!r} is also the remote name bound by alias {owner!r}; "
                    "rename one of them"
                )
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, value: dict[str, str], info: ValidationInfo) -> dict[str, str]:
        # Published with every registration: the rule of a registration's own
        # metadata (nadisc's RegistrationConfig) holds here too.
        allowed = info.data.get("publish_secret_looking_metadata") or ()
        for key in secret_looking_keys(value, allowed):
            raise ValueError(f"metadata key {key!r} {PUBLISHED_SECRET}")
        if len(value) > 64:
            raise ValueError("at most 64 metadata pairs")
        for key, item in value.items():
            if not key or len(key) > 128 or len(item) > 1024:
                raise ValueError(
                    "metadata keys must be 1-128 characters, values at most 1024 characters"
                )
        rules = heartbeat_rules(value)
        if isinstance(rules, str):
            raise ValueError(rules)
        return value

    @model_validator(mode="after")
    def _cross_fields(self) -> NacosSettings:
        if (self.username is None) != (self.password is None):
            raise ValueError("username and password go together: give both or neither")
        if self.ca_file is not None and not any(u.scheme == "https" for u in self.server_addr):
            raise ValueError("ca_file is only meaningful with an https server_addr")
        return self

    @property
    def base_urls(self) -> tuple[str, ...]:
        """Each server's base URL with its context path, without a trailing slash."""
        return tuple(str(url).rstrip("/") for url in self.server_addr)

    def remote_name(self, service: str) -> str:
        """The remote name of ``service`` (an alias or already a remote name)."""
        for binding in self.services.values():
            if binding.name == service:
                return service
        bound = self.services.get(service)
        return bound.name if bound is not None else service
