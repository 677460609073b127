"""Nacos wire formats, decoded sans-IO: bytes in, typed values or typed failures out.

Contract: every function here is synchronous, does no I/O, and refuses a body
over its byte budget *before* decoding it (``CapacityRejected``). Decoding
uses msgspec typed structs (validation while decoding, several times faster
than ``json.loads``); a body that is not the documented shape is
``IncompleteSnapshot`` (the answer cannot be trusted as a whole), while one
malformed *instance* inside a well-formed list is counted in
``ProviderSnapshot.invalid`` and the rest stands::

    body --(len > budget)--> CapacityRejected
         --typed decode---> ServiceInfo (v1) | Envelope{code, data} (v3)
              fails -------> per-host decode: bad hosts -> invalid, rest kept
                             (the outer shape itself bad -> IncompleteSnapshot)
         --eligibility----> enabled and healthy and weight > 0 -> Instance
         --protect mark---> reachProtectionThreshold -> EvidenceKind.WEAK_HEALTH

Costs: one msgspec pass over the body (O(bytes)); instances equal to the
previous listing's are reused, not rebuilt (no new long-lived objects per
unchanged poll).

Facts (Nacos source, ``InstanceController`` / ``InstanceOpenApiController``
and ``ServiceUtil.selectInstancesWithHealthyProtection``): v1 ``/v1/ns/instance/list``
answers a ServiceInfo object (``name`` ``GROUP@@svc``, ``cacheMillis``,
``checksum``, ``hosts``, ``reachProtectionThreshold``); disabled instances
are left out; when the healthy share is at or under the service's protect
threshold every instance is returned with ``healthy: true`` and the flag set.
v3 ``/v3/client/ns/instance/list`` answers ``{"code":0,"message":"success",
"data":[...instances]}`` (the list only: no flag, no cacheMillis); an object
``data`` with ``hosts`` is accepted too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import msgspec

from nadisc import (
    CapacityRejected,
    EvidenceKind,
    IncompleteSnapshot,
    Instance,
    ProviderSnapshot,
)

__all__ = [
    "INSTANCE_NOT_FOUND_V1",
    "INSTANCE_NOT_FOUND_V3",
    "BeatAnswer",
    "Listing",
    "LoginAnswer",
    "WireInstance",
    "decode_beat",
    "decode_envelope",
    "decode_instance_list",
    "decode_login",
    "default_instance_id",
]

#: v1 beat ``code`` when the server holds no such instance (light beat).
INSTANCE_NOT_FOUND_V1 = 20404
#: v2/v3 envelope ``code`` "instance not found".
INSTANCE_NOT_FOUND_V3 = 21003


class WireInstance(msgspec.Struct, rename="camel", kw_only=True):
    """One host of a listing (fields Nacos's ``Instance`` serializes)."""

    ip: str
    port: int
    instance_id: str | None = None
    weight: float = 1.0
    healthy: bool = True
    enabled: bool = True
    ephemeral: bool = True
    cluster_name: str = "DEFAULT"
    service_name: str | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)


class _ServiceInfo(msgspec.Struct, rename="camel", kw_only=True):
    hosts: list[WireInstance] | None = None
    name: str | None = None
    cache_millis: int = 0
    checksum: str = ""
    reach_protection_threshold: bool = False


class _LooseServiceInfo(msgspec.Struct, rename="camel", kw_only=True):
    hosts: list[msgspec.Raw] | None = None
    name: str | None = None
    cache_millis: int = 0
    checksum: str = ""
    reach_protection_threshold: bool = False


class _Envelope(msgspec.Struct, kw_only=True):
    code: int
    message: str | None = None
    data: list[WireInstance] | _ServiceInfo | None = None


class _LooseEnvelope(msgspec.Struct, kw_only=True):
    code: int
    message: str | None = None
    data: list[msgspec.Raw] | _LooseServiceInfo | None = None


class _AnyEnvelope(msgspec.Struct, kw_only=True):
    code: int
    message: str | None = None
    data: msgspec.Raw = msgspec.Raw(b"null")


class LoginAnswer(msgspec.Struct, rename="camel", kw_only=True):
    """``POST /v1/auth/login`` (and ``/v3/auth/user/login``)."""

    access_token: str
    #: Seconds; Nacos's default is 18000.
    token_ttl: float = 18000.0


class BeatAnswer(msgspec.Struct, rename="camel", kw_only=True):
    """``PUT /v1/ns/instance/beat``."""

    code: int = 10200
    #: Milliseconds until the next beat is due.
    client_beat_interval: int | None = None
    light_beat_enabled: bool = False


@dataclass(frozen=True, slots=True)
class Listing:
    """A decoded listing: the snapshot plus the server's pacing hints."""

    snapshot: ProviderSnapshot
    #: Seconds the server says the answer may be cached (0: not said).
    cache_seconds: float
    checksum: str


_host = msgspec.json.Decoder(WireInstance)
_v1 = msgspec.json.Decoder(_ServiceInfo)
_v1_loose = msgspec.json.Decoder(_LooseServiceInfo)
_v3 = msgspec.json.Decoder(_Envelope)
_v3_loose = msgspec.json.Decoder(_LooseEnvelope)
_any = msgspec.json.Decoder(_AnyEnvelope)
_login = msgspec.json.Decoder(LoginAnswer)
_beat = msgspec.json.Decoder(BeatAnswer)


def _bounded(body: bytes, max_bytes: int, what: str) -> None:
    if len(body) > max_bytes:
        raise CapacityRejected(f"{what}: {len(body)} bytes exceed the budget of {max_bytes}")


def default_instance_id(ip: str, port: int, cluster: str, group: str, service: str) -> str:
    """Nacos's ``simple`` instance id generator: ``ip#port#cluster#group@@service``."""
    return f"{ip}#{port}#{cluster}#{group}@@{service}"


def decode_instance_list(
    body: bytes,
    *,
    api: str,
    service: str,
    group: str,
    max_bytes: int,
    max_instances: int,
    previous: ProviderSnapshot | None = None,
) -> Listing:
    """Decode a v1 or v3 instance list answer for ``service`` (its remote name)."""
    what = f"instance list of {group}@@{service}"
    _bounded(body, max_bytes, what)
    hosts: list[WireInstance] = []
    invalid: dict[str, str] = {}
    cache_millis, checksum, protected = 0, "", False
    try:
        if api == "v1":
            info = _v1.decode(body)
            hosts = info.hosts or []
            cache_millis, checksum = info.cache_millis, info.checksum
            protected = info.reach_protection_threshold
        else:
            envelope = _v3.decode(body)
            _check_code(envelope.code, envelope.message, what)
            data = envelope.data
            if isinstance(data, _ServiceInfo):
                hosts = data.hosts or []
                cache_millis, checksum = data.cache_millis, data.checksum
                protected = data.reach_protection_threshold
            else:
                hosts = data or []
    except msgspec.ValidationError:
        # The shape may be right with some hosts wrong: decode host by host.
        raw_hosts, cache_millis, checksum, protected = _loose(body, api, what)
        hosts = []
        for position, raw in enumerate(raw_hosts):
            try:
                hosts.append(_host.decode(raw))
            except msgspec.ValidationError as exc:
                invalid[f"hosts[{position}]"] = f"malformed instance: {exc}"
    except msgspec.DecodeError as exc:
        raise IncompleteSnapshot(f"{what}: the answer is not valid JSON ({exc})") from None
    snapshot = _snapshot(service, group, hosts, invalid, protected, max_instances, previous)
    return Listing(snapshot, max(0.0, cache_millis / 1000.0), checksum)


def _check_code(code: int, message: str | None, what: str) -> None:
    if code != 0:
        raise IncompleteSnapshot(f"{what}: Nacos answered code {code} ({message or 'no message'})")


def _loose(body: bytes, api: str, what: str) -> tuple[list[msgspec.Raw], int, str, bool]:
    try:
        if api == "v1":
            info = _v1_loose.decode(body)
            return (
                info.hosts or [],
                info.cache_millis,
                info.checksum,
                info.reach_protection_threshold,
            )
        envelope = _v3_loose.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise IncompleteSnapshot(
            f"{what}: the answer is not a Nacos instance list ({exc})"
        ) from None
    _check_code(envelope.code, envelope.message, what)
    data = envelope.data
    if isinstance(data, _LooseServiceInfo):
        return data.hosts or [], data.cache_millis, data.checksum, data.reach_protection_threshold
    return data or [], 0, "", False


def _snapshot(
    service: str,
    group: str,
    hosts: list[WireInstance],
    invalid: dict[str, str],
    protected: bool,
    max_instances: int,
    previous: ProviderSnapshot | None,
) -> ProviderSnapshot:
    before: Mapping[str, Instance] = (
        {i.identity: i for i in previous.instances} if previous is not None else {}
    )
    instances: list[Instance] = []
    seen: set[str] = set()
    for host in hosts:
        if not (host.enabled and host.healthy) or host.weight == 0:
            continue  # not eligible: disabled, unhealthy, or weight 0
        identity = host.instance_id or default_instance_id(
            host.ip, host.port, host.cluster_name, group, service
        )
        if identity in seen:
            invalid[identity] = "repeated instance id"
            continue
        if not host.ip or not (0 < host.port < 65536):
            invalid[identity] = f"unusable address {host.ip!r}:{host.port}"
            continue
        if not (math.isfinite(host.weight) and host.weight > 0):
            invalid[identity] = f"weight {host.weight!r} is not a finite number >= 0"
            continue
        seen.add(identity)
        old = before.get(identity)
        if (
            old is not None
            and old.host == host.ip
            and old.port == host.port
            and old.weight == host.weight
            and old.metadata == host.metadata
        ):
            instances.append(old)
        else:
            instances.append(
                Instance(identity, host.ip, host.port, weight=host.weight, metadata=host.metadata)
            )
        if len(instances) > max_instances:
            raise CapacityRejected(
                f"service {service!r} lists more than max_instances_per_service={max_instances}"
            )
    kind = EvidenceKind.WEAK_HEALTH if protected else EvidenceKind.REGISTRY_HEALTH
    return ProviderSnapshot(service, tuple(instances), kind, invalid)


def decode_login(body: bytes, *, max_bytes: int) -> LoginAnswer:
    """A login answer; anything else is ``IncompleteSnapshot`` (never echoing the body,
    which would carry the token)."""
    _bounded(body, max_bytes, "login")
    try:
        answer = _login.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError):
        raise IncompleteSnapshot("login: the answer carries no accessToken") from None
    if not answer.access_token or not (math.isfinite(answer.token_ttl) and answer.token_ttl > 0):
        raise IncompleteSnapshot("login: the answer carries no usable accessToken/tokenTtl")
    return answer


def decode_beat(body: bytes, *, max_bytes: int) -> BeatAnswer:
    _bounded(body, max_bytes, "beat")
    try:
        return _beat.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise IncompleteSnapshot(f"beat: unexpected answer ({exc})") from None


def decode_envelope(body: bytes, *, max_bytes: int, what: str) -> tuple[int, str, bytes | None]:
    """A v2/v3 ``{code, message, data}`` envelope: (code, message, raw data)."""
    _bounded(body, max_bytes, what)
    try:
        envelope = _any.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise IncompleteSnapshot(f"{what}: not a Nacos result envelope ({exc})") from None
    data = bytes(envelope.data)
    return envelope.code, envelope.message or "", None if data == b"null" else data
