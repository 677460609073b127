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
              (fast path: hosts' checks as constraints, ids unique, metadata shared)
              anything refused -> careful path: the same decode without constraints,
                             then per-host decode: bad hosts -> invalid, rest kept
                             (the outer shape itself bad -> IncompleteSnapshot)
         --eligibility----> enabled and healthy and weight > 0 -> Instance
         --protect mark---> reachProtectionThreshold -> EvidenceKind.WEAK_HEALTH

Costs: a listing with nothing wrong in it takes the fast path: one msgspec
pass over the body (O(bytes)) whose typed structs carry the per-host checks
as constraints (id, address, port range, weight >= 0: checked in C), then a
few column-wide passes that run in C (``zip``, ``map``, ``set``,
``list.count``): the hosts' fields turned into columns (one ``astuple``
each and one transposition), metadata texts cut out with one join and one
split, each distinct text decoded once (in one pass) and its read-only view
shared, eligibility and ids checked over whole columns, ``Instance``
objects built in one ``map`` without re-running the constructor's checks,
the snapshot's byte size summed from the columns; the cyclic garbage
collector is paused meanwhile (the new objects hold no cycles). About
0.40-0.44x the CPU time of ``json.loads`` of the same body (0.44x in
instructions). Anything the fast path does not accept sends the body to
the careful path (host-by-host decode, each bad host named in
``invalid``): the same result, about 0.9x. Given the previous listing,
unchanged instances (and metadata views) are reused: about 0.5x.
:func:`listing_digest` lets a poll whose content did not change skip
decoding entirely (about 0.1x).

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

import gc
import hashlib
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import chain, compress
from operator import attrgetter, eq, getitem
from types import MappingProxyType
from typing import Annotated, Any, cast

import msgspec

from nadisc import (
    CapacityRejected,
    EvidenceKind,
    IncompleteSnapshot,
    Instance,
    ProviderSnapshot,
)
from nadisc._instance import _trusted_instances
from nadisc._jsonguard import decode_guarded, depth_guard
from nadisc._redact import redacted_excerpt

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
    # Required and not null: Nacos writes ``hosts`` in every ServiceInfo
    # (an empty array for an empty service), so an object without it (``{}``,
    # ``{"hosts": null}``, a Spring error body answered with 200) is not a
    # listing at all, never "no instances".
    hosts: list[WireInstance]
    name: str | None = None
    cache_millis: int = 0
    checksum: str = ""
    reach_protection_threshold: bool = False


class _LooseServiceInfo(msgspec.Struct, rename="camel", kw_only=True):
    hosts: list[msgspec.Raw]
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
_REF_TIME_KEY = b'"lastRefTime"'


def listing_digest(body: bytes) -> bytes:
    """A digest of a list answer's content: equal digests, equal listings.

    ``lastRefTime`` (the server's clock, new in every v1 answer) is left out;
    everything else counts, so any change of a host, its health or metadata,
    or the protect flag changes the digest. Lets an unchanged poll skip
    decoding altogether (about 0.1x ``json.loads``).

    The same digest as SHA-1 of ``_REF_TIME.sub(b"", body)``, without the
    copy or the regex scan of every quote: the key is found with
    ``bytes.find`` and the pieces between its matches are hashed in place.
    SHA-1 tells changes apart here (it is not a security check: the server
    writes the body either way), and it is the fastest ``hashlib`` offers
    where the CPU hashes it.
    """
    digest = hashlib.sha1(usedforsecurity=False)
    view = memoryview(body)
    start = 0
    at = body.find(_REF_TIME_KEY)
    while at >= 0:
        found = _REF_TIME.match(body, at)
        if found is None:
            at = body.find(_REF_TIME_KEY, at + 1)
            continue
        digest.update(view[start:at])
        start = found.end()
        at = body.find(_REF_TIME_KEY, start)
    digest.update(view[start:])
    return digest.digest()


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
        with depth_guard(what):
            listing = _fast_list(body, api, service, group, max_instances, previous, what)
            if listing is None:
                listing = _careful_list(body, api, service, group, max_instances, previous, what)
        return listing
    finally:
        if paused:
            gc.enable()


# -- the fast path: a listing with nothing wrong in it --------------------------------------
#
# The typed decode checks every host's fields in C (``_FastHost``'s
# constraints are exactly the checks ``_careful_snapshot`` makes in Python);
# identities are checked for repeats with one set; metadata
# objects are decoded once per distinct JSON text and shared. Anything the
# fast path does not accept (a malformed or hostile host, a repeated id,
# non-string metadata) sends the whole body to the careful path, which names
# each bad host: the outcome is the same, only slower.


class _FastHost(msgspec.Struct, rename="camel", kw_only=True, gc=False):
    # In the order Nacos writes them (msgspec looks for the next key at the
    # next field first). ``instanceId`` is required and not empty: a host
    # without one needs the default id, which needs the cluster name, and
    # goes the careful way (Nacos fills ``instanceId`` in every list answer).
    instance_id: Annotated[str, msgspec.Meta(min_length=1)]
    ip: Annotated[str, msgspec.Meta(min_length=1)]
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]
    # msgspec never yields inf/nan from JSON (out of range is refused), so
    # ``ge=0`` leaves exactly "finite and >= 0"; 0 means not eligible.
    weight: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    healthy: bool = True
    enabled: bool = True
    # No ``clusterName``: only the default id needs it (one string less per host).
    #: The metadata's JSON text: one decode per distinct text.
    metadata: msgspec.Raw = msgspec.Raw(b"{}")


class _FastServiceInfo(msgspec.Struct, rename="camel", kw_only=True):
    hosts: list[_FastHost]
    cache_millis: int = 0
    checksum: str = ""
    reach_protection_threshold: bool = False


class _FastEnvelope(msgspec.Struct, kw_only=True):
    code: int
    message: str | None = None
    data: list[_FastHost] | _FastServiceInfo | None = None


_fast_v1 = msgspec.json.Decoder(_FastServiceInfo)
_fast_v3 = msgspec.json.Decoder(_FastEnvelope)


def _unwrap(
    body: bytes,
    api: str,
    what: str,
    v1: msgspec.json.Decoder[Any],
    v3: msgspec.json.Decoder[Any],
    info_type: type,
) -> tuple[list[Any], int, str, bool]:
    """(hosts, cacheMillis, checksum, protection mark) of a list answer, by
    the given decoders: the fast path's or the careful path's. A v3 answer's
    ``data`` is a service info or a bare host list. Raises what msgspec
    raises, and the v3 envelope's error code."""
    if api == "v1":
        info = v1.decode(body)
        return info.hosts, info.cache_millis, info.checksum, info.reach_protection_threshold
    envelope = v3.decode(body)
    _check_code(envelope.code, envelope.message, what)
    data = _listed(envelope.data, what)
    if isinstance(data, info_type):
        return data.hosts, data.cache_millis, data.checksum, data.reach_protection_threshold  # type: ignore[attr-defined]
    return data, 0, "", False


def _listed(data: Any, what: str) -> Any:
    """A v3 ``data`` of a successful answer: a null one says nothing (Nacos
    answers ``[]`` for a service without instances), so it is no listing."""
    if data is None:
        raise IncompleteSnapshot(f"{what}: the answer's data is null (no instance list)")
    return data


_all_metadata = msgspec.json.Decoder(list[dict[str, str]])

_astuple = msgspec.structs.astuple
#: ``_fast_list`` unpacks each host's fields in this order.
_FAST_FIELDS = ("instance_id", "ip", "port", "weight", "healthy", "enabled", "metadata")

#: Metadata views are shared while hosts repeat each other's metadata: up to
#: this many distinct texts, or while they are at most half the hosts;
#: beyond that every host gets its own (one decode pass either way).
_SHARED_UP_TO = 64
#: Up to this many distinct texts, the byte size counts each one's hosts
#: with ``list.count``; beyond, by one pass of lookups.
_COUNT_EACH_UP_TO = 8


def _fast_list(
    body: bytes,
    api: str,
    service: str,
    group: str,
    max_instances: int,
    previous: ProviderSnapshot | None,
    what: str,
) -> Listing | None:
    """The listing, or None when the careful path must decide (and name
    what is wrong). Column by column rather than host by host: each step is
    one pass the interpreter runs in C (``zip``, ``map``, ``set``,
    ``list.count``); no Python code runs per host unless some host is not
    eligible (then one comprehension step picks the eligible ones)."""
    try:
        hosts, cache_millis, checksum, protected = _unwrap(
            body, api, what, _fast_v1, _fast_v3, _FastServiceInfo
        )
    except msgspec.ValidationError:
        return None  # some host (or the shape) is wrong: the careful path says which
    except msgspec.DecodeError as exc:
        raise IncompleteSnapshot(f"{what}: the answer is not valid JSON ({exc})") from None
    # The hosts' fields as columns: one ``astuple`` per host and one
    # transposition, both in C (an ``attrgetter`` pass per field costs twice
    # as much: each access goes through the generic attribute lookup).
    columns: list[Sequence[Any]] = list(zip(*map(_astuple, hosts), strict=True))
    identities, ips, ports, weights, healthy, enabled, raws = columns or [()] * len(_FAST_FIELDS)
    # Every host's metadata is checked, eligible or not, as the careful path
    # does. Hosts of one service mostly repeat a handful of metadata
    # objects: then each distinct JSON text is decoded once (all of them in
    # one pass) and its read-only view shared. Hashable copies of the texts
    # come from one join and one split (a JSON text holds no raw NUL byte).
    texts: Sequence[bytes] = b"\0".join(raws).split(b"\0") if raws else []
    if len(texts) != len(raws):  # never (msgspec refuses a raw NUL): be sure
        return None
    distinct = list(set(texts))
    shared = len(distinct) <= _SHARED_UP_TO or 2 * len(distinct) <= len(texts)
    try:
        values = _all_metadata.decode(b"[" + b",".join(distinct if shared else texts) + b"]")
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None
    # Weights are >= 0 (the decode checked): ``all`` finds a 0.0 by its
    # truth value, cheaper than comparing each one with 0.0.
    if not (all(enabled) and all(healthy) and all(weights)):
        # Some host is not eligible (disabled, unhealthy, or weight 0): the
        # columns keep the eligible ones.
        keep = [e and h and w != 0 for e, h, w in zip(enabled, healthy, weights, strict=True)]
        ips, ports, identities, weights, texts = (
            list(compress(column, keep)) for column in (ips, ports, identities, weights, texts)
        )
        if not shared:
            values = list(compress(values, keep))
    if shared:
        by_text = {t: MappingProxyType(v) for t, v in zip(distinct, values, strict=True)}
    count = len(identities)
    if len(set(identities)) != count:
        return None  # a repeated id: the careful path keeps the first, names the rest
    if count > max_instances:
        raise CapacityRejected(
            f"service {service!r} lists more than max_instances_per_service={max_instances}"
        )
    matched: list[Instance | None] = []
    if previous is not None:
        # The previous instance of each identity (None: there is none).
        olds = previous.instances
        matched = list(map(dict(zip(map(_identity_of, olds), olds, strict=True)).get, identities))
        if shared:
            _reuse_views(by_text, texts, matched)
    views = map(by_text.__getitem__, texts) if shared else map(MappingProxyType, values)
    # Every field was checked: the constructor's checks are skipped.
    instances = _trusted_instances(identities, ips, ports, weights, views)
    if matched:
        # Unchanged instances stay the very same objects: the pair's
        # ``True`` index picks the old one where it equals the new one.
        same = list(map(eq, matched, instances))
        if all(same):
            instances = cast("list[Instance]", matched)
        elif any(same):
            instances = list(map(_pick, zip(instances, matched, strict=True), same))
    # ``ProviderSnapshot.approximate_bytes``, summed column by column.
    size = 64 * (count + 1) + sum(map(len, identities)) + sum(map(len, ips))
    if shared:
        # Each distinct text's size times its hosts. The hosts are counted by
        # their texts, not their views: comparing two different views compares
        # their dicts, and bytes compare in one ``memcmp``. A few distinct
        # texts are counted one ``list.count`` pass each (the last one's share
        # is what is left); more of them in one pass of dict lookups (the
        # texts' hashes are cached since the ``set`` above).
        sized = {
            text: sum(map(len, view)) + sum(map(len, view.values()))
            for text, view in by_text.items()
        }
        if 0 < len(sized) <= _COUNT_EACH_UP_TO:
            *counted, (_, last) = sized.items()
            rest = len(texts)
            for text, each in counted:
                times = texts.count(text)
                rest -= times
                size += times * each
            size += rest * last
        else:
            size += sum(map(sized.__getitem__, texts))
    else:
        size += sum(map(len, chain.from_iterable(values)))
        size += sum(map(len, chain.from_iterable(map(dict.values, values))))
    kind = EvidenceKind.WEAK_HEALTH if protected else EvidenceKind.REGISTRY_HEALTH
    # Identities are unique (checked above) and the size is known: no re-check.
    snapshot = ProviderSnapshot._checked(service, tuple(instances), kind, _NO_INVALID, size)
    return Listing(snapshot, max(0.0, cache_millis / 1000.0), checksum)


_NO_INVALID: Mapping[str, str] = MappingProxyType({})

_identity_of = attrgetter("identity")
#: ``(new, old)[same]``: the old instance where it is equal to the new one.
_pick = cast("Callable[[tuple[Instance, Instance | None], bool], Instance]", getitem)


def _reuse_views(
    by_text: dict[bytes, MappingProxyType[str, str]],
    texts: Sequence[bytes],
    matched: list[Instance | None],
) -> None:
    """Give each distinct text the view its first host's previous instance
    holds, where that view has equal content: the instances then compare
    equal by identity, and a listing that did not change keeps its metadata
    objects. ``texts`` and ``matched`` are the eligible hosts'."""
    # Each text's first host, in one pass (read backwards, the first
    # occurrence is written last); a text only ineligible hosts carry has none.
    first = dict(zip(reversed(texts), range(len(texts) - 1, -1, -1), strict=True))
    for text, view in by_text.items():
        at = first.get(text)
        old = None if at is None else matched[at]
        if old is not None and old.metadata is not view and old.metadata == view:
            by_text[text] = old.metadata  # type: ignore[assignment]


# -- the careful path: some host is malformed or hostile -------------------------------------


def _careful_list(
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
        hosts, cache_millis, checksum, protected = _unwrap(body, api, what, _v1, _v3, _ServiceInfo)
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
    snapshot = _careful_snapshot(service, group, hosts, invalid, protected, max_instances, previous)
    return Listing(snapshot, max(0.0, cache_millis / 1000.0), checksum)


def _check_code(code: int, message: str | None, what: str) -> None:
    if code != 0:
        said = redacted_excerpt(message) if message else "no message"
        raise IncompleteSnapshot(f"{what}: Nacos answered code {code} ({said})")


def _loose(body: bytes, api: str, what: str) -> tuple[list[msgspec.Raw], int, str, bool]:
    try:
        if api == "v1":
            info = _v1_loose.decode(body)
            return (
                info.hosts,
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
    data = _listed(envelope.data, what)
    if isinstance(data, _LooseServiceInfo):
        return data.hosts, data.cache_millis, data.checksum, data.reach_protection_threshold
    return data, 0, "", False


def _careful_snapshot(
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
        if not (weight > 0 and math.isfinite(weight)):
            invalid[identity] = f"weight {weight!r} is not a finite number >= 0"
            continue
        seen.add(identity)
        old = before.get(identity)
        if (
            old is not None
            and old.host == ip
            and old.port == port
            and old.weight == weight
            and old.metadata == host.metadata
        ):
            instances.append(old)
        else:
            # The decoded metadata dict is ours alone: wrapped, not copied.
            (instance,) = _trusted_instances(
                (identity,), (ip,), (port,), (weight,), (MappingProxyType(host.metadata),)
            )
            instances.append(instance)
    if len(instances) > max_instances:
        raise CapacityRejected(
            f"service {service!r} lists more than max_instances_per_service={max_instances}"
        )
    kind = EvidenceKind.WEAK_HEALTH if protected else EvidenceKind.REGISTRY_HEALTH
    # Identities are unique by construction (``seen``); the size is measured on first use.
    return ProviderSnapshot._checked(service, tuple(instances), kind, MappingProxyType(invalid), -1)


def decode_login(body: bytes, *, max_bytes: int) -> LoginAnswer:
    """A login answer; anything else is ``IncompleteSnapshot`` (never echoing the body,
    which would carry the token)."""
    _bounded(body, max_bytes, "login")
    try:
        answer = decode_guarded(_login, body, "login")
    except (msgspec.ValidationError, msgspec.DecodeError):
        raise IncompleteSnapshot("login: the answer carries no accessToken") from None
    if not answer.access_token or not (math.isfinite(answer.token_ttl) and answer.token_ttl > 0):
        raise IncompleteSnapshot("login: the answer carries no usable accessToken/tokenTtl")
    return answer


def decode_beat(body: bytes, *, max_bytes: int) -> BeatAnswer:
    _bounded(body, max_bytes, "beat")
    try:
        return decode_guarded(_beat, body, "beat")
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise IncompleteSnapshot(f"beat: unexpected answer ({exc})") from None


def decode_envelope(body: bytes, *, max_bytes: int, what: str) -> tuple[int, str, bytes | None]:
    """A v2/v3 ``{code, message, data}`` envelope: (code, message, raw data)."""
    _bounded(body, max_bytes, what)
    try:
        envelope = decode_guarded(_any, body, what)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise IncompleteSnapshot(f"{what}: not a Nacos result envelope ({exc})") from None
    data = bytes(envelope.data)
    return envelope.code, envelope.message or "", None if data == b"null" else data
