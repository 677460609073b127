"""Typed decoding of the etcd v3 JSON gateway (etcd >= 3.4).

The gateway is gRPC transcoded to JSON, with three habits every model here
tolerates:

* bytes are base64 text (keys, values, range ends);
* 64-bit integers are JSON *strings* (``"revision": "42"``);
* zero values are omitted (``more: false``, a PUT event's ``type``, TTL 0,
  ``count`` of an empty range, a header revision in a cancel message).

Keys are decoded strictly (a key that is not base64 makes the whole body
unreadable, because the record cannot even be named); values are kept as the
raw base64 text, so one bad value only invalidates its own record.

Error bodies (``{"error", "message", "code"}``, ``code`` a gRPC status) and
watch cancel reasons (``"rpc error: code = PermissionDenied desc = ..."``)
are normalized into :class:`GatewayStatus`.
"""

from __future__ import annotations

import base64
import binascii
import enum
import re
from typing import Annotated, Any, Literal, TypeVar

import msgspec

__all__ = [
    "AuthenticateResponse",
    "DeleteRangeResponse",
    "ErrorBody",
    "Event",
    "GatewayStatus",
    "GrpcCode",
    "KeyValue",
    "LeaseGrantResponse",
    "LeaseKeepAliveLine",
    "LeaseTimeToLiveResponse",
    "PutResponse",
    "RangeResponse",
    "ResponseHeader",
    "StatusResponse",
    "TxnResponse",
    "WatchLine",
    "WatchResponse",
    "WireError",
    "b64",
    "convert",
    "decode",
    "prefix_range_end",
]

_S = TypeVar("_S", bound=msgspec.Struct)

#: What a body that does not match its struct raises (``ValidationError``
#: is a subclass: malformed JSON and a wrong shape alike).
WireError = msgspec.DecodeError


def b64(data: bytes) -> str:
    """Base64 text of ``data`` (how the gateway wants bytes)."""
    return base64.b64encode(data).decode("ascii")


def prefix_range_end(prefix: bytes) -> bytes:
    """The ``range_end`` that selects every key starting with ``prefix``.

    The last byte that is not 0xff is incremented and the rest dropped; a
    prefix of only 0xff bytes (or empty) selects to the end of the keyspace.
    """
    trimmed = bytearray(prefix)
    while trimmed and trimmed[-1] == 0xFF:
        trimmed.pop()
    if not trimmed:
        return b"\x00"
    trimmed[-1] += 1
    return bytes(trimmed)


class _Struct(msgspec.Struct, frozen=True):
    """A wire message: decoded and validated by msgspec in one pass over the
    whole body (no per-record Python). Unknown fields are ignored (newer
    servers add fields); what we need is typed. Bytes fields take the
    gateway's base64 text and are decoded strictly (a key that is not base64
    makes the body unreadable: the record cannot even be named)."""


class ResponseHeader(_Struct, frozen=True):
    cluster_id: int = 0
    member_id: int = 0
    revision: int = 0
    raft_term: int = 0


class KeyValue(_Struct, frozen=True, gc=False):
    """One record as read. Untracked by the cyclic collector (it holds only
    bytes, text and integers): a 10,000-key range adds no objects for the
    collector to count and walk."""

    key: bytes
    create_revision: int = 0
    mod_revision: int = 0
    version: int = 0
    #: Raw base64 text of the value (decoded per record, see module docstring).
    value: str = ""
    lease: int = 0
    #: The value's bytes when the gRPC wire read it (``value`` is then empty).
    #: Never read from JSON: no gateway field has this name.
    raw: bytes = msgspec.field(default=b"", name="~nadisc.raw")

    def value_bytes(self) -> bytes:
        """The value's bytes (``binascii.Error`` when base64 text is invalid)."""
        if self.raw:
            return self.raw
        return binascii.a2b_base64(self.value, strict_mode=True)

    @property
    def value_size(self) -> int:
        """The value's size on the wire (base64 text on the JSON wire)."""
        return len(self.raw) or len(self.value)


class RangeResponse(_Struct, frozen=True):
    header: ResponseHeader = msgspec.field(default_factory=ResponseHeader)
    kvs: tuple[KeyValue, ...] = ()
    more: bool = False
    count: int = 0


class PutResponse(_Struct, frozen=True):
    header: ResponseHeader = msgspec.field(default_factory=ResponseHeader)


class DeleteRangeResponse(_Struct, frozen=True):
    header: ResponseHeader = msgspec.field(default_factory=ResponseHeader)
    deleted: int = 0


class TxnResponse(_Struct, frozen=True):
    header: ResponseHeader = msgspec.field(default_factory=ResponseHeader)
    succeeded: bool = False


class LeaseGrantResponse(_Struct, frozen=True):
    header: ResponseHeader = msgspec.field(default_factory=ResponseHeader)
    ID: int = 0
    TTL: int = 0
    error: str = ""


class _LeaseKeepAlive(_Struct, frozen=True):
    header: ResponseHeader = msgspec.field(default_factory=ResponseHeader)
    ID: int = 0
    #: 0 (omitted) means the lease is gone.
    TTL: int = 0


class LeaseTimeToLiveResponse(_Struct, frozen=True):
    header: ResponseHeader = msgspec.field(default_factory=ResponseHeader)
    ID: int = 0
    #: -1 when the lease does not exist (expired or revoked).
    TTL: int = 0
    grantedTTL: int = 0


class AuthenticateResponse(_Struct, frozen=True):
    token: Annotated[str, msgspec.Meta(min_length=1)]
    header: ResponseHeader = msgspec.field(default_factory=ResponseHeader)


class StatusResponse(_Struct, frozen=True):
    header: ResponseHeader = msgspec.field(default_factory=ResponseHeader)
    version: str = ""


class Event(_Struct, frozen=True):
    kv: KeyValue
    type: Literal["PUT", "DELETE"] = "PUT"


class WatchResponse(_Struct, frozen=True):
    header: ResponseHeader = msgspec.field(default_factory=ResponseHeader)
    watch_id: int = 0
    created: bool = False
    canceled: bool = False
    compact_revision: int = 0
    cancel_reason: str = ""
    fragment: bool = False
    events: tuple[Event, ...] = ()

    @property
    def is_progress(self) -> bool:
        """A progress notification: the watcher has seen everything up to
        ``header.revision`` and nothing under the watched range changed."""
        return not (self.created or self.canceled or self.events or self.fragment)


class ErrorBody(_Struct, frozen=True):
    """An error answer (unary body, or the ``error`` member of a stream line)."""

    code: int = 0
    #: grpc-gateway stream errors use these names instead.
    grpc_code: int = 0
    error: str = ""
    message: str = ""

    def status(self, http_status: int = 0) -> GatewayStatus:
        text = self.message or self.error
        return GatewayStatus.of(self.code or self.grpc_code, text, http_status)


class LeaseKeepAliveLine(_Struct, frozen=True):
    result: _LeaseKeepAlive | None = None
    error: ErrorBody | None = None


class WatchLine(_Struct, frozen=True):
    """One newline-delimited message of a watch stream."""

    result: WatchResponse | None = None
    error: ErrorBody | None = None


# One decoder per struct, made once. ``strict=False``: the gateway writes
# 64-bit integers as JSON strings, which msgspec then reads as ints.
_DECODERS: dict[type[Any], msgspec.json.Decoder[Any]] = {}


def decode(struct: type[_S], data: bytes | str) -> _S:
    """``data`` (one JSON body or stream line) as ``struct``; ``WireError``
    when it is not JSON or does not have the struct's shape."""
    decoder = _DECODERS.get(struct)
    if decoder is None:
        decoder = _DECODERS[struct] = msgspec.json.Decoder(struct, strict=False)
    result: _S = decoder.decode(data)
    return result


def convert(struct: type[_S], value: object) -> _S:
    """Plain Python data (as ``json.loads`` returns it) as ``struct``: the
    same rules as :func:`decode`."""
    return msgspec.convert(value, struct, strict=False)


class GrpcCode(enum.IntEnum):
    """The gRPC status codes the gateway reports that change what we do."""

    OK = 0
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    OUT_OF_RANGE = 11
    UNAVAILABLE = 14
    UNAUTHENTICATED = 16


_CODE_NAMES = {
    "InvalidArgument": 3,
    "DeadlineExceeded": 4,
    "NotFound": 5,
    "PermissionDenied": 7,
    "ResourceExhausted": 8,
    "FailedPrecondition": 9,
    "OutOfRange": 11,
    "Unavailable": 14,
    "Unauthenticated": 16,
}
_CANCEL_REASON = re.compile(r"code = (\w+) desc = (.*)", re.DOTALL)


class GatewayStatus:
    """A normalized server-side error: gRPC code, message, HTTP status."""

    __slots__ = ("code", "http_status", "message")

    def __init__(self, code: int, message: str, http_status: int = 0) -> None:
        self.code = code
        self.message = message
        self.http_status = http_status

    @classmethod
    def of(cls, code: int, message: str, http_status: int = 0) -> GatewayStatus:
        return cls(code, message[:500], http_status)

    @classmethod
    def from_cancel_reason(cls, reason: str) -> GatewayStatus:
        match = _CANCEL_REASON.search(reason)
        if match is None:
            return cls.of(0, reason)
        return cls.of(_CODE_NAMES.get(match.group(1), 2), match.group(2))

    @property
    def token_expired(self) -> bool:
        """The token must be refreshed (expired, unknown, or minted before an
        auth-store change)."""
        if self.code == GrpcCode.UNAUTHENTICATED:
            return True
        return "auth store is old" in self.message or "invalid auth token" in self.message

    @property
    def credentials_missing(self) -> bool:
        return "user name is empty" in self.message

    @property
    def permission_denied(self) -> bool:
        if self.code == GrpcCode.PERMISSION_DENIED or self.http_status == 403:
            return True
        return "permission denied" in self.message or "authentication failed" in self.message

    @property
    def lease_not_found(self) -> bool:
        return self.code == GrpcCode.NOT_FOUND and "lease not found" in self.message

    @property
    def outcome_unknown(self) -> bool:
        """The server could not say whether a write was applied."""
        return self.code in (GrpcCode.UNAVAILABLE, GrpcCode.DEADLINE_EXCEEDED) or (
            self.http_status in (502, 503, 504)
        )

    def __repr__(self) -> str:
        return f"GatewayStatus(code={self.code}, message={self.message!r})"

    def __str__(self) -> str:
        return f"{self.message or 'error'} (gRPC code {self.code})"
