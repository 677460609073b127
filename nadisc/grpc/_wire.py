"""Wire rules of gRPC over HTTP/2 that need no I/O: metadata, timeouts, framing.

Contract (grpc's ``doc/PROTOCOL-HTTP2.md``):

- Outbound metadata keys are lowercase ``[0-9a-z_.-]``; ``-bin`` keys carry
  ``bytes`` (sent as unpadded base64), every other key an ASCII string of
  printable characters. Keys starting with ``grpc-`` or ``:`` and the
  transport's own headers are reserved and refused with ``ValueError`` naming
  the key (never the value). The sum of ``len(key) + len(value) + 32`` over
  the pairs (HTTP/2's header-list size) is limited.
- ``grpc-timeout`` is at most 8 digits and a unit; the remaining time is
  rounded up so a server never sees a deadline earlier than the caller's.
- A message is a 1-byte compressed flag, a 4-byte big-endian length and the
  payload. :class:`Deframer` reads the prefix first and refuses a declared
  length over the limit before a byte of the body is kept.
"""

from __future__ import annotations

import base64
import binascii
import math
import re
import struct
import zlib
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from urllib.parse import unquote

import grpc
import grpc.aio

from ._errors import RpcError

__all__ = [
    "DEFAULT_MAX_MESSAGE_LENGTH",
    "DEFAULT_MAX_METADATA_SIZE",
    "Deframer",
    "MetadataLike",
    "decode_grpc_message",
    "decode_metadata",
    "encode_message",
    "encode_metadata",
    "encode_timeout",
    "gunzip_bounded",
]

#: The runtime's managed-body limit and gRPC's own default, both ways.
DEFAULT_MAX_MESSAGE_LENGTH = 4 * 1024 * 1024
#: gRPC's default soft limit on a header list (8 KiB), both ways.
DEFAULT_MAX_METADATA_SIZE = 8 * 1024

MetadataLike = grpc.aio.Metadata | Sequence[tuple[str, str | bytes]]

_KEY = re.compile(r"[0-9a-z_.\-]+\Z")
_RESERVED = frozenset(
    {
        "content-type",
        "te",
        "host",
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "upgrade",
        "user-agent",
    }
)
_TRANSPORT_INBOUND = frozenset(
    {"content-type", "grpc-status", "grpc-message", "grpc-encoding", "grpc-accept-encoding"}
)
_PRINTABLE = re.compile(r"[\x20-\x7e]*\Z")
_PREFIX = struct.Struct(">BI")


def encode_metadata(
    metadata: MetadataLike | None, limit: int = DEFAULT_MAX_METADATA_SIZE
) -> list[tuple[bytes, bytes]]:
    """Outbound metadata as HTTP/2 header pairs; ``ValueError`` names the bad key,
    ``TypeError`` says what ``metadata`` should have been."""
    if metadata is None:
        return []
    if isinstance(metadata, str | bytes | bytearray | Mapping) or not isinstance(
        metadata, Iterable
    ):
        raise TypeError(
            "gRPC metadata must be grpc.aio.Metadata or a sequence of (key, value) pairs, "
            f"not {type(metadata).__name__}"
        )
    if not metadata:
        return []
    pairs: Iterable[object] = (
        metadata if not isinstance(metadata, grpc.aio.Metadata) else list(metadata)
    )
    out: list[tuple[bytes, bytes]] = []
    size = 0
    for index, item in enumerate(pairs):
        if not isinstance(item, tuple | list) or len(item) != 2:
            # Named by position and, when it has one, its key (never a value).
            first = item[0] if isinstance(item, tuple | list) and item else None
            key_note = f" (key {first!r})" if isinstance(first, str) else ""
            raise ValueError(f"gRPC metadata item {index}{key_note} is not a (key, value) pair")
        key, value = item
        if not isinstance(key, str) or not _KEY.match(key):
            raise ValueError(f"gRPC metadata key {key!r} is not lowercase [0-9a-z_.-]")
        if key.startswith("grpc-") or key in _RESERVED:
            raise ValueError(f"gRPC metadata key {key!r} is reserved for the transport")
        if key.endswith("-bin"):
            if not isinstance(value, bytes | bytearray):
                raise ValueError(f"gRPC metadata key {key!r} ends in -bin: its value must be bytes")
            raw = base64.b64encode(bytes(value)).rstrip(b"=")
        else:
            if not isinstance(value, str) or not _PRINTABLE.match(value):
                raise ValueError(
                    f"gRPC metadata value of {key!r} must be printable ASCII text "
                    "(use a -bin key for binary values)"
                )
            raw = value.encode("ascii")
        encoded_key = key.encode("ascii")
        size += len(encoded_key) + len(raw) + 32
        if size > limit:
            raise ValueError(f"gRPC metadata is over its {limit}-byte limit (at key {key!r})")
        out.append((encoded_key, raw))
    return out


def decode_metadata(headers: Iterable[tuple[bytes, bytes]]) -> grpc.aio.Metadata:
    """Inbound headers as ``grpc.aio.Metadata``: pseudo and transport headers left out."""
    pairs: list[tuple[str, str | bytes]] = []
    for raw_key, raw_value in headers:
        key = raw_key.decode("ascii", "replace")
        if key.startswith(":") or key in _TRANSPORT_INBOUND:
            continue
        if key.endswith("-bin"):
            try:
                value: str | bytes = base64.b64decode(raw_value + b"=" * (-len(raw_value) % 4))
            except (binascii.Error, ValueError):
                value = bytes(raw_value)
        else:
            value = raw_value.decode("latin-1")
        pairs.append((key, value))
    return grpc.aio.Metadata(*pairs)


def decode_grpc_message(raw: bytes) -> str:
    """``grpc-message`` is percent-encoded UTF-8; bad sequences become U+FFFD."""
    return unquote(raw.decode("ascii", "replace"), encoding="utf-8", errors="replace")


_UNITS = (("n", 1e-9), ("u", 1e-6), ("m", 1e-3), ("S", 1.0), ("M", 60.0), ("H", 3600.0))


def encode_timeout(seconds: float) -> bytes:
    """``grpc-timeout`` for ``seconds`` left: the finest unit that fits 8 digits, rounded up."""
    seconds = max(seconds, 0.0)
    for unit, size in _UNITS:
        amount = math.ceil(seconds / size)
        if amount < 100_000_000:
            return f"{max(amount, 1)}{unit}".encode("ascii")
    return b"99999999H"


def encode_message(payload: bytes, compressed: bool) -> bytes:
    """The 5-byte prefix and the payload."""
    return _PREFIX.pack(1 if compressed else 0, len(payload)) + payload


def gzip_bytes(payload: bytes) -> bytes:
    compressor = zlib.compressobj(6, zlib.DEFLATED, 31)
    return compressor.compress(payload) + compressor.flush()


def gunzip_bounded(payload: bytes, limit: int) -> bytes:
    """Inflate a gzip message, refusing to produce more than ``limit`` bytes."""
    inflater = zlib.decompressobj(31)
    try:
        out = inflater.decompress(payload, limit + 1)
    except zlib.error as exc:
        raise RpcError(
            grpc.StatusCode.INTERNAL, f"a gzip message did not inflate: {exc}", where="receive"
        ) from None
    if len(out) > limit or inflater.unconsumed_tail:
        raise RpcError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"an inflated message is over the {limit}-byte receive limit",
            where="receive",
        )
    return out


class Deframer:
    """Splits DATA bytes into messages and says how much flow-control credit to return.

    Every received byte is credited back exactly once: the bytes of the
    message still arriving at once (so a message larger than the window
    completes; it is bounded by ``limit``), the bytes of a complete message
    when the reader takes it (so queued messages, bounded by the window, are
    what holds the sender back).
    """

    __slots__ = ("_credited", "_limit", "_raw", "messages")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._raw = bytearray()
        self._credited = 0
        #: Complete messages: (compressed flag, payload, credit owed when taken).
        self.messages: deque[tuple[bool, bytes, int]] = deque()

    def feed(self, data: bytes) -> int:
        """Take DATA bytes; returns the credit to return now. Raises RESOURCE_EXHAUSTED/INTERNAL.

        With no partial message held (the usual case: a server writes whole
        messages), the messages are read from ``data`` itself, each payload
        copied once; only the start of a message cut by the end of ``data``
        is kept.
        """
        raw = self._raw
        if raw:
            raw += data
            return self._split()
        size = len(data)
        pos = 0
        append = self.messages.append
        while size - pos >= 5:
            flag, length = _PREFIX.unpack_from(data, pos)
            if flag > 1 or length > self._limit:
                break  # _split says what is wrong
            end = pos + 5 + length
            if end > size:
                break
            append((flag == 1, data[pos + 5 : end], 5 + length))
            pos = end
        if pos == size:
            return 0
        raw += data[pos:] if pos else data
        return self._split()

    def _split(self) -> int:
        """Complete messages out of the held bytes; the credit owed for the rest now."""
        raw = self._raw
        while len(raw) >= 5:
            flag, length = _PREFIX.unpack_from(raw)
            if flag > 1:
                raise RpcError(
                    grpc.StatusCode.INTERNAL,
                    f"a message prefix has compressed flag {flag} (only 0 or 1 exist)",
                    where="receive",
                )
            if length > self._limit:
                raise RpcError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the server declared a {length}-byte message, over the "
                    f"{self._limit}-byte receive limit",
                    where="receive",
                )
            size = 5 + length
            if len(raw) < size:
                break
            owed = size - min(self._credited, size)
            self._credited = max(0, self._credited - size)
            self.messages.append((flag == 1, bytes(raw[5:size]), owed))
            del raw[:size]
        credit = len(raw) - self._credited
        self._credited = len(raw)
        return credit

    @property
    def partial(self) -> bool:
        """Whether bytes of an incomplete message are held (a stream ending here is malformed)."""
        return bool(self._raw)
