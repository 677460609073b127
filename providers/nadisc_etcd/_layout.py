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
not base64, longer than ``max_record_bytes``, not UTF-8 JSON, not an object,
has ``Op`` other than 0 (Add), lacks ``Addr``, has an ``Addr`` without a port
in 1-65535 (gRPC allows a bare host, we cannot dial one), or carries a
``weight``/``tags`` of the wrong shape.

Decoding is pure and synchronous; it costs O(len(value)).
"""

from __future__ import annotations

import binascii
import json
import math
from dataclasses import dataclass

import msgspec

from nadisc import Instance, RegistrationRecord
from nadisc._instance import trusted_instance

__all__ = [
    "RESERVED_METADATA",
    "Layout",
    "RecordError",
    "check_record",
    "decode_record",
    "decode_record_bytes",
    "encode_record",
    "instance_id_after",
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


#: Record values are decoded untyped (Metadata is open-ended), then checked.
_JSON = msgspec.json.Decoder()


def _split_addr(addr: str) -> tuple[str, int]:
    host, sep, port_text = addr.rpartition(":")
    if not sep or not host:
        raise RecordError(f"Addr {addr!r} is not host:port")
    if host[0] == "[" and host[-1] == "]":
        host = host[1:-1]
        if not host:
            raise RecordError(f"Addr {addr!r} has an empty host")
    elif ":" in host:
        raise RecordError(f"Addr {addr!r}: an IPv6 host must be bracketed")
    # ASCII digits only: str.isdigit() also admits digits int() refuses ("²").
    if len(port_text) > 5 or not port_text.isdigit() or not port_text.isascii():
        raise RecordError(f"Addr {addr!r}: port must be 1-65535")
    port = int(port_text)
    if not 0 < port < 65536:
        raise RecordError(f"Addr {addr!r}: port must be 1-65535")
    return host, port


def _weight(value: object) -> float:
    if isinstance(value, bool):
        raise RecordError("Metadata.weight must be a number")
    if isinstance(value, int | float):
        weight = float(value)
    elif isinstance(value, str):
        try:
            weight = float(value)
        except ValueError:
            raise RecordError(f"Metadata.weight {value[:40]!r} is not a number") from None
    else:
        raise RecordError("Metadata.weight must be a number")
    if not (math.isfinite(weight) and weight > 0):
        raise RecordError("Metadata.weight must be finite and > 0")
    return weight


def _text(value: object) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


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
    except (msgspec.DecodeError, RecursionError):
        raise RecordError("value is not UTF-8 JSON") from None
    if not isinstance(document, dict):
        raise RecordError("value is not a JSON object")
    op = document.get("Op", 0)
    if isinstance(op, bool) or not isinstance(op, int) or op != 0:
        raise RecordError(f"Op must be 0 (Add), got {_text(op)[:40]}")
    addr = document.get("Addr")
    if not isinstance(addr, str) or not addr:
        raise RecordError("Addr is missing or not a string")
    host, port = _split_addr(addr)
    weight = 1.0
    tags: tuple[str, ...] = ()
    metadata: dict[str, str] = {}
    extra = document.get("Metadata")
    if isinstance(extra, dict):
        for name, item in extra.items():
            if name == "weight":
                weight = _weight(item)
            elif name == "tags":
                if not isinstance(item, list) or not all(isinstance(t, str) for t in item):
                    raise RecordError("Metadata.tags must be a list of strings")
                tags = tuple(item)
            else:
                metadata[name] = _text(item)
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
