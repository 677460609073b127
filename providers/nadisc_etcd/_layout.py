"""Key layout and record codec, compatible with gRPC's etcd naming resolver.

::

    key    <prefix>/<service>/<instance-id>          (prefix "services" by default)
    value  {"Op": 0, "Addr": "host:port", "Metadata": {...}}

This is the format etcd's ``naming/endpoints`` manager writes and its gRPC
resolver reads (the resolver target is ``<prefix>/<service>``), so Go
services registered with ``endpoints.Manager.AddEndpoint`` are discovered
here, and registrations written here are resolved by ``etcd:///`` targets.

``Metadata`` mapping (it is free-form in gRPC):

* ``weight``: a finite number > 0 (or its decimal text) -> ``Instance.weight``;
* ``tags``: a list of strings -> ``Instance.tags``;
* every other member -> ``Instance.metadata``: strings as they are, other
  JSON values as compact JSON text;
* ``Metadata`` absent or ``null`` -> no metadata; any other non-object value
  (gRPC allows a bare string) is kept under the metadata key
  ``"Metadata"`` (a string as it is, anything else as compact JSON text).

A record is a *confirmed invalid candidate* (listed in
``ProviderSnapshot.invalid`` with the reason, never served) when its value is
not base64, longer than ``max_record_bytes``, not UTF-8, not JSON, not an
object, has ``Op`` other than the integer 0 (Add), lacks ``Addr``, has an
``Addr`` that is not a string or has no port in 1-65535 (gRPC allows a bare
host, we cannot dial one), or carries a ``weight``/``tags`` of the wrong
shape. A reason names a field's JSON type (``got the string "0"``, never a
bare ``got 0``), quotes at most :data:`SHOWN_CHARS` characters of a scalar,
names a list or an object by its type only, and says where JSON is
malformed, never what is around it: a value may hold secrets.

Decoding is pure and synchronous; it costs O(len(value)). A range's
records are decoded column-wise by :func:`decode_records`: each value by
a typed msgspec decoder called from C (no Python per field), the
addresses checked as one text and split in one pass (one by one only
when one is of a rarer shape, such as a bracketed IPv6 host), the hosts
checked as one set, the instances built in one ``map``; a page holding a
record that is invalid, or of a rare shape, is decoded record by record
instead, with the same outcome.
"""

from __future__ import annotations

import binascii
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from operator import attrgetter
from types import MappingProxyType
from typing import Annotated, Any, Literal, cast

import msgspec

from nadisc import Instance, RegistrationRecord
from nadisc._instance import _EMPTY, _trusted_instances, trusted_instance, valid_hosts

__all__ = [
    "RESERVED_METADATA",
    "Layout",
    "RecordError",
    "check_record",
    "decode_record",
    "decode_record_bytes",
    "decode_records",
    "decode_records_b64",
    "encode_record",
    "instance_id_after",
    "instance_ids_after",
]


class RecordError(ValueError):
    """A record value is not a valid instance record (the message says why)."""


@dataclass(frozen=True, slots=True)
class Layout:
    """Where a service's records live under one prefix."""

    prefix: str

    def service_prefix(self, service: str) -> bytes:
        """``<prefix>/<service>/`` as bytes: every instance key starts with it."""
        head = f"{self.prefix}/{service}/" if self.prefix else f"{service}/"
        return head.encode("utf-8")

    def watch_prefix(self) -> bytes:
        """``<prefix>/`` as bytes: every service's keys start with it."""
        return f"{self.prefix}/".encode() if self.prefix else b""

    def instance_key(self, service: str, instance_id: str) -> bytes:
        return self.service_prefix(service) + instance_id.encode("utf-8")

    def instance_id(self, service: str, key: bytes) -> str | None:
        """The instance id part of ``key``, or None if ``key`` is outside the service."""
        return instance_id_after(self.service_prefix(service), key)


def instance_id_after(head: bytes, key: bytes) -> str | None:
    """The UTF-8 text of ``key`` after the service prefix ``head``, or None
    if ``key`` does not extend ``head`` or its rest is not UTF-8."""
    if not key.startswith(head) or len(key) == len(head):
        return None
    try:
        return key[len(head) :].decode("utf-8")
    except UnicodeDecodeError:
        return None


def instance_ids_after(head: bytes, keys: Sequence[bytes]) -> list[str] | None:
    """:func:`instance_id_after` of every key at once, or None when any key
    has none, or holds a newline (the caller then looks at each key by
    itself).

    In C, without a step per key: the keys are joined by newlines and
    decoded as one text (a newline byte never occurs inside a multi-byte
    UTF-8 character, so the text decodes exactly when every key does),
    then split at every newline followed by the head: that makes one piece
    per key only when each newline is followed by the head, that is when
    every key starts with it."""
    if not keys:
        return []
    joined = b"\n".join(keys)
    if b"\n" in head or joined.count(b"\n") != len(keys) - 1:
        return None
    try:
        text = joined.decode("utf-8")
    except UnicodeDecodeError:
        return None
    pieces = ("\n" + text).split("\n" + head.decode("utf-8", "surrogateescape"))
    if len(pieces) != len(keys) + 1 or pieces[0]:
        return None
    del pieces[0]
    # An empty piece is a key equal to the head: it names no instance.
    return pieces if all(pieces) else None


#: Record values are decoded untyped (Metadata is open-ended), then checked.
_JSON = msgspec.json.Decoder()


class _Record(msgspec.Struct, frozen=True, gc=False):
    """The record shape :func:`decode_records` takes, checked by msgspec in
    C: ``Op`` exactly the integer 0 (or absent), ``Addr`` a non-empty
    string, ``Metadata`` an object or null (or absent). Anything else
    (including what :func:`decode_record_bytes` would accept, such as a
    bare ``Metadata`` string) fails here and is decoded record by record."""

    Addr: Annotated[str, msgspec.Meta(min_length=1)]
    Op: Literal[0] = 0
    Metadata: dict[str, Any] | None = None


_RECORDS = msgspec.json.Decoder(_Record)
_addr_of = attrgetter("Addr")
_metadata_of = attrgetter("Metadata")
_a2b = partial(binascii.a2b_base64, strict_mode=True)
#: At most this many characters of a scalar field are quoted in a reason.
SHOWN_CHARS = 40
#: What :func:`_tags` finds when every item of a list is a string.
_ALL_STRINGS = object()
#: Empty metadata (the one view every instance without metadata shares).
_NO_METADATA = cast("MappingProxyType[str, str]", _EMPTY)


def _split_addr(addr: str) -> tuple[str, int]:
    host, sep, port_text = addr.rpartition(":")
    if not sep or not host:
        raise RecordError(f"Addr {_quoted(addr)} is not host:port")
    if host[0] == "[" and host[-1] == "]":
        host = host[1:-1]
        if not host:
            raise RecordError(f"Addr {_quoted(addr)} has an empty host")
    elif ":" in host:
        raise RecordError(f"Addr {_quoted(addr)}: an IPv6 host must be bracketed")
    # ASCII digits only: str.isdigit() also admits digits int() refuses ("²").
    if len(port_text) > 5 or not port_text.isdigit() or not port_text.isascii():
        raise RecordError(f"Addr {_quoted(addr)}: port must be 1-65535")
    port = int(port_text)
    if not 0 < port < 65536:
        raise RecordError(f"Addr {_quoted(addr)}: port must be 1-65535")
    return host, port


def _cut(text: str) -> str:
    """``text`` cut to :data:`SHOWN_CHARS` characters (``...`` marks a cut)."""
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "..."


def _quoted(text: str) -> str:
    """``text`` as a JSON string, cut to :data:`SHOWN_CHARS` characters."""
    quoted = json.dumps(text[:SHOWN_CHARS], ensure_ascii=False)
    return quoted if len(text) <= SHOWN_CHARS else quoted[:-1] + '..."'


def _shown(value: object) -> str:
    """What a record field holds, for a reason: its JSON type, and for a
    scalar its text cut to :data:`SHOWN_CHARS` characters, so the string
    ``"0"`` never reads like the integer ``0``. A list or an object is
    named by its type only: it may hold anything, secrets included."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "the boolean true" if value else "the boolean false"
    if isinstance(value, int):
        return f"the integer {_cut(str(value))}"
    if isinstance(value, float):
        return f"the number {_cut(repr(value))}"
    if isinstance(value, str):
        return f"the string {_quoted(value)}"
    if isinstance(value, list):
        return "a list"
    return "an object"


def _weight(value: object) -> float:
    try:
        if isinstance(value, bool) or not isinstance(value, int | float | str):
            raise ValueError
        weight = float(value)
    except OverflowError:  # an integer beyond the float range
        weight = math.inf
    except ValueError:
        raise RecordError(
            f"Metadata.weight must be a number or its decimal text, got {_shown(value)}"
        ) from None
    if not (math.isfinite(weight) and weight > 0):
        raise RecordError(f"Metadata.weight must be finite and > 0, got {_shown(value)}")
    return weight


def _text(value: object) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def _tags(value: object) -> tuple[str, ...]:
    if isinstance(value, list):
        odd = next((item for item in value if not isinstance(item, str)), _ALL_STRINGS)
        if odd is _ALL_STRINGS:
            return tuple(value)
        got = f"a list holding {_shown(odd)}"
    else:
        got = _shown(value)
    raise RecordError(f"Metadata.tags must be a list of strings, got {got}")


def _extras(extra: dict[str, Any]) -> tuple[float, tuple[str, ...], dict[str, str]]:
    """The weight, tags and metadata of a record's ``Metadata`` object."""
    weight = 1.0
    tags: tuple[str, ...] = ()
    metadata: dict[str, str] = {}
    for name, item in extra.items():
        if name == "weight":
            weight = _weight(item)
        elif name == "tags":
            tags = _tags(item)
        else:
            metadata[name] = _text(item)
    return weight, tags, metadata


_BYTE_AT = re.compile(r"\(byte (\d+)\)")


def _unreadable(raw: bytes, error: Exception) -> str:
    """Why ``raw`` did not decode as JSON: not UTF-8 (and where), or not
    JSON (and where, when the decoder says). Only positions, never text
    around them: a value may hold secrets."""
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"value is not UTF-8 (invalid byte at offset {exc.start})"
    if isinstance(error, RecursionError):
        return "value is not valid JSON (nested too deeply)"
    if isinstance(error, msgspec.ValidationError):
        # The untyped decoder validates nothing but number ranges (1e400).
        return "value is not valid JSON (a number is out of range)"
    text = str(error)
    at = _BYTE_AT.search(text)
    if at is not None:
        return f"value is not valid JSON (malformed at byte {at.group(1)})"
    if "truncated" in text:
        return "value is not valid JSON (it ends early)"
    return "value is not valid JSON"


def decode_record(identity: str, value_b64: str, *, max_record_bytes: int) -> Instance:
    """Decode one record value into an :class:`Instance` (``RecordError`` if invalid)."""
    # base64 grows 4/3: refuse an oversized value before decoding it.
    if len(value_b64) > (max_record_bytes // 3 + 1) * 4:
        raise RecordError(f"value is larger than max_record_bytes={max_record_bytes}")
    try:
        # The strict C decoder, without b64decode's Python wrapper.
        raw = binascii.a2b_base64(value_b64, strict_mode=True)
    except (binascii.Error, ValueError):
        raise RecordError("value is not valid base64") from None
    return decode_record_bytes(identity, raw, max_record_bytes=max_record_bytes)


def decode_record_bytes(identity: str, raw: bytes, *, max_record_bytes: int) -> Instance:
    """:func:`decode_record` of a value already in bytes (the gRPC wire's)."""
    if len(raw) > max_record_bytes:
        raise RecordError(f"value is larger than max_record_bytes={max_record_bytes}")
    if not raw:
        raise RecordError("value is empty")
    try:
        # msgspec checks UTF-8 and parses in one C pass (no str copy first).
        document = _JSON.decode(raw)
    except (msgspec.DecodeError, RecursionError) as exc:
        raise RecordError(_unreadable(raw, exc)) from None
    if not isinstance(document, dict):
        raise RecordError("value is not a JSON object")
    op = document.get("Op", 0)
    if isinstance(op, bool) or not isinstance(op, int) or op != 0:
        raise RecordError(f"Op must be the integer 0 (Add), got {_shown(op)}")
    if "Addr" not in document:
        raise RecordError("Addr is missing")
    addr = document["Addr"]
    if not isinstance(addr, str):
        raise RecordError(f"Addr must be a string, got {_shown(addr)}")
    if not addr:
        raise RecordError("Addr is empty")
    host, port = _split_addr(addr)
    weight = 1.0
    tags: tuple[str, ...] = ()
    metadata: dict[str, str] = {}
    extra = document.get("Metadata")
    if isinstance(extra, dict):
        weight, tags, metadata = _extras(extra)
    elif extra is not None:
        metadata["Metadata"] = _text(extra)
    if not identity:
        raise RecordError("instance identity must not be empty")
    try:
        # Every field but the host was checked above (the port by
        # _split_addr, the weight by _weight): the constructor's own checks
        # would repeat them. The host is checked, by the same rule.
        return trusted_instance(identity, host, port, weight, metadata, tags)
    except ValueError as exc:
        raise RecordError(str(exc)) from None


_ADDR_LINES = re.compile(r"(?:[^\[:\n][^:\n]*+:[0-9]{1,5}+\n)*+[^\[:\n][^:\n]*+:[0-9]{1,5}+")
"""Addresses joined by newlines, each ``host:port`` of the plain shape:
a host with no colon or newline that does not start with ``[``, and a port
of one to five ASCII digits. Possessive throughout (nothing to take back:
a host stops at the colon, a port at the newline), so a text that fails
is given up at once, not tried again line by line."""


def _split_addrs(addrs: list[str]) -> tuple[list[str], list[int]] | None:
    """The hosts and ports of ``addrs`` (non-empty) in a few passes in C,
    when every one is of the plain shape (see :data:`_ADDR_LINES`) with a
    port in 1-65535: what :func:`_split_addr` makes of each. None otherwise
    (a bracketed IPv6 host, a port out of range, anything else): the
    caller then splits them one by one.

    The addresses are joined by newlines and matched as one text; a newline
    inside an address makes a line more than there are addresses (then the
    pieces do not add up). Each line holding exactly one colon, turning the
    newlines into colons and splitting there gives host, port, host, port.
    Ports repeat (a fleet listens on a few), so each distinct one is read
    once."""
    text = "\n".join(addrs)
    if _ADDR_LINES.fullmatch(text) is None:
        return None
    parts = text.replace("\n", ":").split(":")
    if len(parts) != 2 * len(addrs):
        return None
    texts = parts[1::2]
    distinct = list(set(texts))
    numbers = dict(zip(distinct, map(int, distinct), strict=True))
    if min(numbers.values()) < 1 or max(numbers.values()) > 65535:
        return None
    return parts[0::2], list(map(numbers.__getitem__, texts))


def _split_each(addrs: list[str]) -> tuple[list[str], list[int]]:
    """The hosts and ports of ``addrs``, one address at a time (each what
    :func:`_split_addr` makes of it; ``RecordError`` as it raises); both
    lists empty when a plain port is out of range."""
    hosts: list[str] = []
    ports: list[int] = []
    for addr in addrs:
        host, _, text = addr.rpartition(":")
        if (
            host
            and host[0] != "["
            and ":" not in host
            and len(text) <= 5
            and text.isdigit()
            and text.isascii()
        ):
            port = int(text)
            if not 0 < port < 65536:
                return [], []
        else:  # a bracketed IPv6 host, or not host:port at all
            host, port = _split_addr(addr)
        hosts.append(host)
        ports.append(port)
    return hosts, ports


def decode_records(
    identities: Sequence[str], raws: Sequence[bytes], *, max_record_bytes: int
) -> list[Instance] | None:
    """``decode_record_bytes(identities[i], raws[i])`` of every record at
    once, or None when any of them is invalid (or of a shape this path does
    not take): the caller then decodes each by itself, which says which
    record is bad and why. Equal results, at a fraction of the cost: the
    values are decoded by a typed msgspec decoder called from C, the
    addresses split in a few passes over their joined text
    (:func:`_split_addrs`), the hosts checked as one set and the
    instances built in one ``map``; only records with ``Metadata`` take a
    Python step of their own."""
    if not raws:
        return []
    if len(identities) != len(raws) or max(map(len, raws)) > max_record_bytes:
        return None
    if not all(identities):
        return None
    try:
        # Each value by itself (no joined document whose split could
        # shift): one C call per value, no Python frame.
        records = list(map(_RECORDS.decode, raws))
    except (msgspec.DecodeError, RecursionError):
        return None
    addrs = list(map(_addr_of, records))
    split = _split_addrs(addrs)
    try:
        if split is not None:
            hosts, ports = split
        else:
            hosts, ports = _split_each(addrs)
            if not ports:
                return None
        if not valid_hosts(hosts):
            return None
        if not any(map(_metadata_of, records)):
            return _trusted_instances(identities, hosts, ports, repeat(1.0), repeat(_NO_METADATA))
        extras = list(map(_metadata_of, records))
        weights: list[float] = []
        views: list[MappingProxyType[str, str]] = []
        tagged: list[tuple[int, tuple[str, ...]]] = []
        for at, extra in enumerate(extras):
            if not extra:
                weights.append(1.0)
                views.append(_NO_METADATA)
                continue
            weight, tags, metadata = _extras(extra)
            weights.append(weight)
            views.append(MappingProxyType(metadata) if metadata else _NO_METADATA)
            if tags:
                tagged.append((at, tags))
    except RecordError:
        return None
    instances = _trusted_instances(identities, hosts, ports, weights, views)
    for at, tags in tagged:
        instances[at] = trusted_instance(
            identities[at], hosts[at], ports[at], weights[at], views[at], tags
        )
    return instances


def decode_records_b64(
    identities: Sequence[str], values_b64: Sequence[str], *, max_record_bytes: int
) -> list[Instance] | None:
    """:func:`decode_records` of values in base64 text (the JSON wire's)."""
    if values_b64 and max(map(len, values_b64)) > (max_record_bytes // 3 + 1) * 4:
        return None
    try:
        raws = list(map(_a2b, values_b64))
    except (binascii.Error, ValueError):
        return None
    return decode_records(identities, raws, max_record_bytes=max_record_bytes)


#: Metadata names the codec owns (they come from the record's own fields).
RESERVED_METADATA = frozenset({"weight", "tags"})


def encode_record(record: RegistrationRecord) -> bytes:
    """The value we write for ``record`` (deterministic: equal records, equal bytes)."""
    host = f"[{record.host}]" if ":" in record.host else record.host
    metadata: dict[str, object] = dict(sorted(record.metadata.items()))
    metadata["weight"] = record.weight
    if record.tags:
        metadata["tags"] = list(record.tags)
    document = {"Op": 0, "Addr": f"{host}:{record.port}", "Metadata": metadata}
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def check_record(record: RegistrationRecord) -> list[str]:
    """Problems that make ``record`` unwritable (empty list: fine)."""
    problems: list[str] = []
    clash = RESERVED_METADATA.intersection(record.metadata)
    if clash:
        problems.append(f"metadata keys {sorted(clash)} are reserved for weight/tags")
    if not record.instance_id or "/" in record.instance_id:
        problems.append("instance_id must be non-empty and contain no '/'")
    if not record.service or record.service.startswith("/") or record.service.endswith("/"):
        problems.append("service must be non-empty and not start or end with '/'")
    if not record.host or record.host in ("0.0.0.0", "::"):
        problems.append(f"host {record.host!r} is not a reachable address")
    if not (0 < record.port < 65536):
        problems.append(f"port {record.port} out of range 1-65535")
    if not (math.isfinite(record.weight) and record.weight > 0):
        problems.append("weight must be finite and > 0")
    return problems
