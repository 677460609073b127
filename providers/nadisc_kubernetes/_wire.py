"""Kubernetes wire shapes (``v1`` Service, ``discovery.k8s.io/v1`` EndpointSlice), decoded.

Contract: every function here is synchronous and pure (no I/O, no clock).
Bodies are decoded with ``msgspec`` typed structs, which validate while
decoding (only the fields we read are materialised; unknown fields are
skipped). A body that is not of the expected shape raises
:class:`WireError`; the caller decides what that means (an incomplete
listing, an invalid record). A body nested deeper than the decoder's stack
raises :class:`~nadisc.IncompleteSnapshot` through the shared guard
(``nadisc._jsonguard``), as in every provider. Byte bounds are applied before decoding by the
HTTP shell; :func:`decode_event` refuses a line over its bound too.

Shapes::

    list{"metadata": {"resourceVersion", "continue"?}, "items": [object...]}
    event   {"type": ADDED|MODIFIED|DELETED|BOOKMARK|ERROR, "object": object|Status}
    Status  {"kind": "Status", "code": 410, "reason": "Expired", "message": ...}

Cost: one pass over the bytes per decode; objects are not copied afterwards.
The structs are ``gc=False`` (they hold no cycles), so a large list does not
hand the cyclic collector thousands of objects to trace.
"""

from __future__ import annotations

from typing import Literal, TypeVar, overload

import msgspec

from nadisc import IncompleteSnapshot
from nadisc._jsonguard import decode_guarded

T = TypeVar("T")

__all__ = [
    "Condition",
    "EndpointSlice",
    "Event",
    "ListPage",
    "ObjectMeta",
    "OwnerReference",
    "Service",
    "ServicePage",
    "SliceEndpoint",
    "SlicePage",
    "SlicePort",
    "Status",
    "WireError",
    "decode_event",
    "decode_page",
    "decode_service",
    "decode_slice",
    "decode_status",
]


class WireError(ValueError):
    """A body was not of the shape the Kubernetes API documents."""


class OwnerReference(msgspec.Struct, frozen=True, gc=False):
    kind: str = ""
    name: str = ""
    uid: str = ""
    apiVersion: str = ""
    controller: bool | None = None


class ObjectMeta(msgspec.Struct, frozen=True, gc=False):
    name: str = ""
    namespace: str = ""
    uid: str = ""
    resourceVersion: str = ""
    labels: dict[str, str] = {}
    ownerReferences: list[OwnerReference] = []
    deletionTimestamp: str | None = None


class ServicePort(msgspec.Struct, frozen=True, gc=False):
    port: int
    name: str = ""
    protocol: str = "TCP"


class ServiceSpec(msgspec.Struct, frozen=True, gc=False):
    ports: list[ServicePort] = []
    type: str = "ClusterIP"
    #: None or empty: a Service without a selector (its slices are written by
    #: hand or mirrored from an Endpoints object).
    selector: dict[str, str] | None = None
    externalName: str | None = None
    #: The Service's families, primary first (``IPv4``/``IPv6``).
    ipFamilies: list[str] = []


class Service(msgspec.Struct, frozen=True, gc=False):
    metadata: ObjectMeta
    spec: ServiceSpec = ServiceSpec()


class Condition(msgspec.Struct, frozen=True, gc=False):
    ready: bool | None = None
    serving: bool | None = None
    terminating: bool | None = None


class TargetRef(msgspec.Struct, frozen=True, gc=False):
    kind: str = ""
    namespace: str = ""
    name: str = ""
    uid: str = ""


class ForZone(msgspec.Struct, frozen=True, gc=False):
    name: str = ""


class Hints(msgspec.Struct, frozen=True, gc=False):
    forZones: list[ForZone] = []


class SliceEndpoint(msgspec.Struct, frozen=True, gc=False):
    addresses: list[str]
    conditions: Condition = Condition()
    hostname: str | None = None
    nodeName: str | None = None
    zone: str | None = None
    targetRef: TargetRef | None = None
    hints: Hints | None = None


class SlicePort(msgspec.Struct, frozen=True, gc=False):
    name: str | None = None
    port: int | None = None
    protocol: str | None = None
    appProtocol: str | None = None


class EndpointSlice(msgspec.Struct, frozen=True, gc=False):
    metadata: ObjectMeta
    addressType: str = "IPv4"
    endpoints: list[SliceEndpoint] | None = None
    ports: list[SlicePort] | None = None


class ListMeta(msgspec.Struct, frozen=True, gc=False):
    resourceVersion: str = ""
    # ``continue`` is a Python keyword: renamed on the wire.
    continue_: str = msgspec.field(default="", name="continue")


class ServicePage(msgspec.Struct, frozen=True, gc=False):
    """One page of a Service list: items, version and continue token."""

    metadata: ListMeta = ListMeta()
    items: list[Service] | None = None


class SlicePage(msgspec.Struct, frozen=True, gc=False):
    """One page of an EndpointSlice list."""

    metadata: ListMeta = ListMeta()
    items: list[EndpointSlice] | None = None


ListPage = ServicePage | SlicePage


class Status(msgspec.Struct, frozen=True, gc=False):
    """The API server's error object (``kind: Status``)."""

    code: int = 0
    reason: str = ""
    message: str = ""
    status: str = ""
    details: StatusDetails | None = None

    @property
    def too_large_version(self) -> bool:
        """The 504 the API server answers for a resourceVersion it has not
        reached (``storage.NewTooLargeResourceVersionError``: reason Timeout,
        cause ``ResourceVersionTooLarge``, "Too large resource version")."""
        if self.code != 504:
            return False
        causes = self.details.causes if self.details is not None else ()
        return any(c.reason == "ResourceVersionTooLarge" for c in causes) or (
            "too large resource version" in self.message.lower()
        )


class StatusCause(msgspec.Struct, frozen=True, gc=False):
    reason: str = ""
    message: str = ""


class StatusDetails(msgspec.Struct, frozen=True, gc=False):
    causes: list[StatusCause] = []
    retryAfterSeconds: int = 0


class _RawEvent(msgspec.Struct, frozen=True, gc=False):
    type: str
    object: msgspec.Raw


class _Versioned(msgspec.Struct, frozen=True, gc=False):
    metadata: ObjectMeta = ObjectMeta()


EventType = Literal["ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"]
_EVENT_TYPES = frozenset(("ADDED", "MODIFIED", "DELETED", "BOOKMARK", "ERROR"))


class Event(msgspec.Struct, frozen=True, gc=False):
    """One watch event. ``object`` is the decoded resource (None for a
    BOOKMARK or ERROR), ``status`` the Status of an ERROR event, and
    ``resource_version`` the object's (or the bookmark's) version."""

    type: str
    resource_version: str
    object: Service | EndpointSlice | None = None
    status: Status | None = None


_service_page_decoder = msgspec.json.Decoder(ServicePage)
_slice_page_decoder = msgspec.json.Decoder(SlicePage)
_event_decoder = msgspec.json.Decoder(_RawEvent)
_service_decoder = msgspec.json.Decoder(Service)
_slice_decoder = msgspec.json.Decoder(EndpointSlice)
_status_decoder = msgspec.json.Decoder(Status)
_versioned_decoder = msgspec.json.Decoder(_Versioned)

Kind = Literal["service", "slice"]


def _decode(decoder: msgspec.json.Decoder[T], body: bytes | memoryview, what: str) -> T:
    """``decoder.decode(body)``: a misshapen body is :class:`WireError`, one
    nested too deeply ``IncompleteSnapshot`` (the shared guard)."""
    try:
        return decode_guarded(decoder, body, what)  # type: ignore[arg-type]
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise WireError(f"{what}: {exc}") from None


@overload
def decode_page(kind: Literal["service"], body: bytes | memoryview) -> ServicePage: ...
@overload
def decode_page(kind: Literal["slice"], body: bytes | memoryview) -> SlicePage: ...
@overload
def decode_page(kind: Kind, body: bytes | memoryview) -> ServicePage | SlicePage: ...
def decode_page(kind: Kind, body: bytes | memoryview) -> ServicePage | SlicePage:
    """One list page of ``kind``, items decoded and validated in the same pass."""
    if kind == "service":
        return _decode(_service_page_decoder, body, "service list")
    return _decode(_slice_page_decoder, body, "slice list")


def decode_service(body: bytes | memoryview) -> Service:
    return _decode(_service_decoder, body, "Service")


def decode_slice(body: bytes | memoryview) -> EndpointSlice:
    return _decode(_slice_decoder, body, "EndpointSlice")


def decode_status(body: bytes | memoryview) -> Status | None:
    """The Status object of an error answer, or None when it is not one."""
    try:
        status = _decode(_status_decoder, body, "Status")
    except (WireError, IncompleteSnapshot):
        return None
    return status if status.code else None


def decode_object(kind: Kind, raw: bytes | memoryview) -> Service | EndpointSlice:
    return decode_service(raw) if kind == "service" else decode_slice(raw)


def decode_event(kind: Kind, line: bytes, *, limit: int) -> Event:
    """One newline-delimited watch event of a ``kind`` watch."""
    if len(line) > limit:
        raise WireError(f"a watch event of {len(line)} bytes exceeds the limit of {limit}")
    raw = _decode(_event_decoder, line, "watch event")
    if raw.type not in _EVENT_TYPES:
        raise WireError(f"watch event: unknown type {raw.type!r}")
    if raw.type == "ERROR":
        status = decode_status(raw.object)
        if status is None:
            raise WireError("watch event: an ERROR without a Status object")
        return Event("ERROR", "", status=status)
    if raw.type == "BOOKMARK":
        meta = _decode(_versioned_decoder, raw.object, "bookmark").metadata
        if not meta.resourceVersion:
            raise WireError("watch event: a BOOKMARK without a resourceVersion")
        return Event("BOOKMARK", meta.resourceVersion)
    obj = decode_object(kind, raw.object)
    return Event(raw.type, obj.metadata.resourceVersion, object=obj)
