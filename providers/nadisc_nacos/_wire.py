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

Costs: one msgspec pass over the body (O(bytes)), then one tight loop per
host that builds ``Instance`` objects from the values it has just checked
(without re-running the constructor's checks) while the cyclic garbage
collector is paused (the new objects hold no cycles); instances equal to the
previous listing's are reused. :func:`listing_digest` lets a poll whose
content did not change skip decoding entirely.

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

import dataclasses
import gc
import hashlib
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

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
    "listing_digest",
]

#: v1 beat ``code`` when the server holds no such instance (light beat).
INSTANCE_NOT_FOUND_V1 = 20404
#: v2/v3 envelope ``code`` "instance not found".
INSTANCE_NOT_FOUND_V3 = 21003


class WireInstance(msgspec.Struct, rename="camel", kw_only=True, gc=False):
    """One host of a listing (fields Nacos's ``Instance`` serializes)."""

    ip: str
    port: int
    instance_id: str | None = None
    weight: float = 1.0
    healthy: bool = True
    enabled: bool = True
    cluster_name: str = "DEFAULT"
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


_REF_TIME = re.compile(rb'"lastRefTime":\s*-?\d+')


def listing_digest(body: bytes) -> bytes:
    """A digest of a list answer's content: equal digests, equal listings.

    ``lastRefTime`` (the server's clock, new in every v1 answer) is left out;
    everything else counts, so any change of a host, its health or metadata,
    or the protect flag changes the digest. Lets an unchanged poll skip
    decoding altogether (about 0.1x ``json.loads``).
    """
    return hashlib.blake2b(_REF_TIME.sub(b"", body), digest_size=16).digest()


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
    # A listing creates thousands of objects at once; the cyclic collector
    # would scan them (and everything else) several times over while they
    # are built. They hold no cycles, so collection waits until they exist.
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        return _decode_list(body, api, service, group, max_instances, previous, what)
    finally:
        if paused:
            gc.enable()


def _decode_list(
    body: bytes,
    api: str,
    service: str,
    group: str,
    max_instances: int,
    previous: ProviderSnapshot | None,
    what: str,
) -> Listing:
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


_new = object.__new__
_set = object.__setattr__
#: The fields ``_trusted_instance`` sets; a change to ``Instance`` fails here, loudly.
_INSTANCE_FIELDS = ("identity", "host", "port", "weight", "metadata", "tags", "draining")
assert tuple(f.name for f in dataclasses.fields(Instance)) == _INSTANCE_FIELDS
#: The slot descriptors' setters, in ``_INSTANCE_FIELDS`` order: a third faster
#: than ``object.__setattr__`` (no name lookup), and like it they bypass the
#: frozen dataclass's ``__setattr__`` (the object is not yet shared).
_SLOT_SETTERS = tuple(vars(Instance)[name].__set__ for name in _INSTANCE_FIELDS)


def _trusted_instance(identity: str, host: WireInstance) -> Instance:
    """An ``Instance`` from values ``_snapshot`` already checked (identity and
    host non-empty, port in range, weight finite and > 0), without running
    the checks again: at thousands of hosts per poll the constructor's own
    validation costs as much as the decoding. The decoded metadata dict is
    ours alone, so it is wrapped read-only instead of copied."""
    instance = _new(Instance)
    _set(instance, "identity", identity)
    _set(instance, "host", host.ip)
    _set(instance, "port", host.port)
    _set(instance, "weight", float(host.weight))
    _set(instance, "metadata", MappingProxyType(host.metadata))
    _set(instance, "tags", ())
    _set(instance, "draining", False)
    return instance


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
    append = instances.append
    seen: set[str] = set()
    isfinite = math.isfinite
    new, proxy, cls = _new, MappingProxyType, Instance
    set_identity, set_host, set_port, set_weight, set_metadata, set_tags, set_draining = (
        _SLOT_SETTERS
    )
    for host in hosts:
        weight = host.weight
        if not (host.enabled and host.healthy) or weight == 0:
            continue  # not eligible: disabled, unhealthy, or weight 0
        ip, port = host.ip, host.port
        identity = host.instance_id or default_instance_id(
            ip, port, host.cluster_name, group, service
        )
        if identity in seen:
            invalid[identity] = "repeated instance id"
            continue
        if not ip or not (0 < port < 65536):
            invalid[identity] = f"unusable address {ip!r}:{port}"
            continue
        if not (weight > 0 and isfinite(weight)):
            invalid[identity] = f"weight {weight!r} is not a finite number >= 0"
            continue
        seen.add(identity)
        old = before.get(identity) if before else None
        if (
            old is not None
            and old.host == ip
            and old.port == port
            and old.weight == weight
            and old.metadata == host.metadata
        ):
            append(old)
        else:
            # ``_trusted_instance`` inlined: this loop runs once per host per poll.
            instance = new(cls)
            set_identity(instance, identity)
            set_host(instance, ip)
            set_port(instance, port)
            set_weight(instance, weight)  # msgspec hands floats for a float field
            set_metadata(instance, proxy(host.metadata))
            set_tags(instance, ())
            set_draining(instance, False)
            append(instance)
    if len(instances) > max_instances:
        raise CapacityRejected(
            f"service {service!r} lists more than max_instances_per_service={max_instances}"
        )
    kind = EvidenceKind.WEAK_HEALTH if protected else EvidenceKind.REGISTRY_HEALTH
    # Identities are unique by construction (``seen``): skip the re-check.
    snapshot = _new(ProviderSnapshot)
    _set(snapshot, "service", service)
    _set(snapshot, "instances", tuple(instances))
    _set(snapshot, "evidence", kind)
    _set(snapshot, "invalid", MappingProxyType(invalid))
    return snapshot


_SNAPSHOT_FIELDS = ("service", "instances", "evidence", "invalid")
assert tuple(f.name for f in dataclasses.fields(ProviderSnapshot) if f.init) == _SNAPSHOT_FIELDS


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
