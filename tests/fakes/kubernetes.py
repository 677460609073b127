"""A protocol-faithful Kubernetes API server fake: Services and EndpointSlices.

It answers as the API server's documentation ("API Concepts": efficient
detection of changes, watch bookmarks, retrieving large results in chunks,
resource versions; "Status" errors) describes, for the two resources
discovery reads:

* ``v1`` Services and ``discovery.k8s.io/v1`` EndpointSlices, namespaced and
  across namespaces; ``get`` of one object (404 ``NotFound`` Status);
  ``fieldSelector`` (``metadata.name``, ``metadata.namespace``) and
  equality ``labelSelector``.
* One global, increasing ``resourceVersion`` (a string; clients must treat
  it as opaque). Every write stamps the object with a new version and is
  kept in an event history for watches.
* Lists answer ``{"kind": "...List", "metadata": {"resourceVersion",
  "continue"?, "remainingItemCount"?}, "items": [...]}``; ``limit`` splits a
  list into chunks served from one consistent snapshot; a ``continue`` token
  whose snapshot was compacted is ``410 Expired`` (HTTP status, Status body).
* Watches (``watch=1``/``true``) stream newline-delimited
  ``{"type", "object"}`` events from ``resourceVersion``: "" or "0" starts
  with synthetic ADDED events of the current state; a version older than the
  compaction point answers 200 and one ``ERROR`` event with a 410 ``Expired``
  Status (or a plain HTTP 410 with ``gone_as_status``); ``allowWatchBookmarks``
  adds BOOKMARK events (only ``metadata.resourceVersion`` set) every
  ``bookmark_interval`` and on :meth:`KubernetesFake.bookmark`;
  ``timeoutSeconds`` ends the stream cleanly (the server's own timeout).
  An object modified out of a watch's selector is sent as DELETED, into it as
  ADDED.
* A watch from a version the store has not reached is accepted (200) and
  stays silent, bookmarks included, until the store passes that version;
  only then do events (those of a higher version) flow. Only a list from
  such a version, or a watch with ``sendInitialEvents``, waits 3 s and
  answers 504 "Too large resource version" (with ``Retry-After: 1``).
* Compaction: the history keeps ``window`` events; :meth:`compact` drops all
  of it. :meth:`expire_watches` makes every open watch end with a 410
  ERROR event (what a watch whose cache position was compacted receives).
  :meth:`restore` goes back to a backup, with or without the
  ``--bump-revision``/``--mark-compacted`` treatment.
* 429: :meth:`throttle` answers as priority and fairness does (plain text
  and ``Retry-After``) or with a ``TooManyRequests`` Status carrying
  ``retryAfterSeconds`` (and the same header); ``fail_next`` injects any
  status, with the reason the API server gives it.
* Authentication with bearer tokens (``tokens``: token -> user; 401
  ``Unauthorized`` Status for a missing or unknown token when tokens are
  configured) and RBAC per user and (verb, resource) (403 ``Forbidden``
  Status, worded as the API server words it).
* Discovery for kubectl: ``/version``, ``/api``, ``/apis``, ``/api/v1``,
  ``/apis/discovery.k8s.io/v1`` (legacy discovery documents; no aggregated
  discovery, no OpenAPI: kubectl falls back as it does with older servers).

State changes are synchronous methods, so tests drive them under trio's
``MockClock``. ``fake.transport()`` serves it in-process (an httpx transport
that streams watch bodies without sockets or tasks); ``run_kubernetes_fake``
serves it on a loopback port with hypercorn, optionally over TLS.
"""

from __future__ import annotations

import base64
import copy
import itertools
import json
import random
import re
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote

import anyio
import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

from ._asgi import Receive, Scope, Send, read_request

__all__ = [
    "KubernetesFake",
    "PlainAnswer",
    "open_kubernetes_fake",
    "run_kubernetes_fake",
    "slice_object",
]

Kind = Literal["services", "endpointslices"]

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
_KINDS: dict[Kind, tuple[str, str, str]] = {
    # resource: (kind, apiVersion, group for RBAC messages)
    "services": ("Service", "v1", ""),
    "endpointslices": ("EndpointSlice", "discovery.k8s.io/v1", "discovery.k8s.io"),
}
DEFAULT_WATCH_TIMEOUT = 1800.0


def _details(kind: Kind, name: str) -> dict[str, str]:
    """A Status's ``details`` naming one object: ``group`` is left out for the
    core group, as ``StatusDetails.Group`` is ``omitempty``
    (staging/src/k8s.io/apimachinery/pkg/apis/meta/v1/types.go)."""
    group = _KINDS[kind][2]
    return {"name": name, "group": group, "kind": kind} if group else {"name": name, "kind": kind}


#: What the fake's resources allow (the API server's verbs for both kinds).
_VERBS = ("create", "delete", "deletecollection", "get", "list", "patch", "update", "watch")
_WRITE_VERBS = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


def status_object(
    code: int, reason: str, message: str, details: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The API server's ``Status`` error object."""
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details is not None:
        body["details"] = details
    return body


def _qualified(kind: Kind) -> str:
    """``services`` or ``endpointslices.discovery.k8s.io`` (how messages name a resource)."""
    group = _KINDS[kind][2]
    return f"{kind}.{group}" if group else kind


class ApiError(Exception):
    def __init__(
        self, code: int, reason: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.body: dict[str, Any] | PlainAnswer = status_object(code, reason, message, details)
        self.code = code


@dataclass(frozen=True)
class PlainAnswer:
    """An answer written with Go's ``http.Error`` instead of a ``Status``
    object: a text body, ``text/plain`` (what the request filters in front of
    the API machinery send, e.g. priority and fairness)."""

    text: str
    headers: dict[str, str] = field(default_factory=dict)


#: The reason a ``Status`` carries for a status code (staging/src/k8s.io/
#: apimachinery/pkg/api/errors/errors.go NewGenericServerResponse: another
#: 4xx is ``Unknown``, another 5xx ``InternalError``), and 410 as
#: NewResourceExpired words the API server's 410s.
_REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


def answer_headers(body: dict[str, Any] | PlainAnswer) -> dict[str, str]:
    """The headers an error answer carries besides its content type.

    A ``Status`` whose ``details.retryAfterSeconds`` is positive also sets
    ``Retry-After`` to that many seconds (staging/src/k8s.io/apiserver/pkg/
    endpoints/handlers/responsewriters/writers.go ErrorNegotiated)."""
    if isinstance(body, PlainAnswer):
        return dict(body.headers)
    details = body.get("details") if body.get("kind") == "Status" else None
    seconds = details.get("retryAfterSeconds", 0) if isinstance(details, dict) else 0
    if isinstance(seconds, int) and seconds > 0:
        return {"Retry-After": str(seconds)}
    return {}


class _Broken(Exception):
    """Raised inside a watch body to break the connection."""


@dataclass
class _Event:
    version: int
    kind: Kind
    type: str
    obj: dict[str, Any]
    old: dict[str, Any] | None


@dataclass(eq=False)
class _Watch:
    kind: Kind
    namespace: str | None
    fields: list[FieldRequirement]
    labels: list[Requirement]
    queue: deque[dict[str, Any] | str] = field(default_factory=deque)
    wake: anyio.Event = field(default_factory=anyio.Event)
    #: Only events and bookmarks of a higher version reach this watch (set for
    #: a watch from a version the store had not reached when it opened).
    after: int = 0

    def push(self, item: dict[str, Any] | str) -> None:
        self.queue.append(item)
        wake, self.wake = self.wake, anyio.Event()
        wake.set()


@dataclass
class RequestRecord:
    method: str
    path: str
    query: dict[str, str]
    token: str | None
    status: int = 0


# ---------------------------------------------------------------------- selectors
#: One requirement of a label selector: (key, operator, values). Grammar and
#: meaning as staging/src/k8s.io/apimachinery/pkg/labels/selector.go parses
#: them: ``k``, ``!k``, ``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``,
#: ``k notin (a,b)``, ``k>n``, ``k<n``. ``!=`` and ``notin`` also match
#: objects without the label.
Requirement = tuple[str, str, tuple[str, ...]]


def _split_requirements(text: str) -> list[str]:
    parts: list[str] = []
    depth = 0
    current = ""
    for char in text:
        if char == "(":
            depth += 1
        elif char == ")":
            depth -= 1
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    if depth != 0:
        raise ApiError(
            400, "BadRequest", f"unable to parse requirement: unbalanced parentheses in {text!r}"
        )
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def parse_label_selector(text: str) -> list[Requirement]:
    out: list[Requirement] = []
    for part in _split_requirements(text):
        set_based = re.fullmatch(r"([^\s!=<>(),]+)\s+(in|notin)\s*\(([^()]*)\)", part)
        if set_based:
            values = tuple(v.strip() for v in set_based.group(3).split(",") if v.strip())
            out.append((set_based.group(1), set_based.group(2), values))
            continue
        if part.startswith("!"):
            key = part[1:].strip()
            if not key or re.search(r"[\s=!<>()]", key):
                raise ApiError(400, "BadRequest", f"unable to parse requirement: {part!r}")
            out.append((key, "!", ()))
            continue
        compared = re.fullmatch(r"([^\s!=<>(),]+)\s*(==|!=|=|>|<)\s*([^\s!=<>(),]*)", part)
        if compared:
            key, op, value = compared.groups()
            if op in (">", "<") and not value.lstrip("-").isdigit():
                raise ApiError(400, "BadRequest", f"unable to parse requirement: {part!r}")
            out.append((key, "=" if op == "==" else op, (value,)))
            continue
        if re.fullmatch(r"[^\s!=<>(),]+", part):
            out.append((part, "exists", ()))
            continue
        raise ApiError(400, "BadRequest", f"unable to parse requirement: {part!r}")
    return out


def labels_match(labels: dict[str, str], requirements: list[Requirement]) -> bool:
    for key, op, values in requirements:
        present = key in labels
        value = labels.get(key)
        if op == "exists" and not present:
            return False
        if op == "!" and present:
            return False
        if op in ("=", "in") and value not in values:
            return False
        if op in ("!=", "notin") and present and value in values:
            return False
        if op in (">", "<"):
            if value is None or not value.lstrip("-").isdigit():
                return False
            if (int(value) > int(values[0])) != (op == ">"):
                return False
    return True


#: Field selectors: ``=``, ``==``, ``!=`` on the fields each resource
#: supports (metadata.name and metadata.namespace for both resources here;
#: pkg/registry/core/service/strategy.go and discovery's strategy).
FieldRequirement = tuple[str, str, str]


def parse_field_selector(text: str) -> list[FieldRequirement]:
    out: list[FieldRequirement] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        matched = re.fullmatch(r"([^=!\s]+)\s*(==|!=|=)\s*(.*)", part)
        if not matched:
            raise ApiError(400, "BadRequest", f"invalid selector: {part!r}; can't understand it")
        key, op, value = matched.groups()
        if key not in ("metadata.name", "metadata.namespace"):
            raise ApiError(400, "BadRequest", f"field label not supported: {key}")
        out.append((key, "!=" if op == "!=" else "=", value))
    return out


# ---------------------------------------------------------------------- patches
#: Lists merged by a key in a strategic merge patch, per the Go types'
#: ``patchMergeKey`` tags (staging/src/k8s.io/api/core/v1/types.go:
#: ServiceSpec.Ports by "port"; ObjectMeta.OwnerReferences by "uid"); every
#: other list of these two kinds is replaced whole (EndpointSlice endpoints
#: and ports are ``+listType=atomic`` in staging/src/k8s.io/api/discovery/v1/types.go).
_MERGE_KEYS: dict[str, str] = {"ports": "port", "ownerReferences": "uid"}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (``application/merge-patch+json``)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any, path: tuple[str, ...] = ()) -> Any:
    """A strategic merge patch as community/contributors/devel/sig-api-machinery/
    strategic-merge-patch.md describes it, for the fields of Services and
    EndpointSlices: maps merge (null deletes), keyed lists merge by their key
    (``$patch: delete`` removes an element, ``$setElementOrder/<list>``
    orders them), other lists are replaced; ``$retainKeys`` is honoured."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result = copy.deepcopy(target) if isinstance(target, dict) else {}
    orders = {k.split("/", 1)[1]: v for k, v in patch.items() if k.startswith("$setElementOrder/")}
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
            continue
        merge_key = _MERGE_KEYS.get(key)
        if merge_key is not None and isinstance(value, list):
            current = [dict(item) for item in result.get(key) or [] if isinstance(item, dict)]
            for item in value:
                if not isinstance(item, dict) or merge_key not in item:
                    raise ApiError(
                        400, "BadRequest", f"map: {key} missing the merge key {merge_key}"
                    )
                found = next((c for c in current if c.get(merge_key) == item[merge_key]), None)
                if item.get("$patch") == "delete":
                    if found is not None:
                        current.remove(found)
                elif found is not None:
                    current[current.index(found)] = strategic_merge_patch(found, item, (*path, key))
                else:
                    current.append({k: v for k, v in item.items() if k != "$patch"})
            order = orders.get(key)
            if isinstance(order, list):
                rank = {
                    json.dumps(o.get(merge_key)): n
                    for n, o in enumerate(order)
                    if isinstance(o, dict)
                }
                current.sort(key=lambda c: rank.get(json.dumps(c.get(merge_key)), len(rank)))
            result[key] = current
        elif isinstance(value, dict):
            result[key] = strategic_merge_patch(result.get(key), value, (*path, key))
        else:
            result[key] = copy.deepcopy(value)
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def json_patch(target: Any, operations: Any) -> Any:
    """RFC 6902 JSON patch (``application/json-patch+json``): add, remove,
    replace, test, move, copy."""
    if not isinstance(operations, list):
        raise ApiError(400, "BadRequest", "json patch must be a list of operations")
    document = copy.deepcopy(target)

    def walk(pointer: str) -> tuple[Any, str]:
        if not pointer.startswith("/"):
            raise ApiError(422, "Invalid", f"invalid json pointer {pointer!r}")
        tokens = [t.replace("~1", "/").replace("~0", "~") for t in pointer[1:].split("/")]
        node = document
        for token in tokens[:-1]:
            node = node[int(token)] if isinstance(node, list) else node[token]
        return node, tokens[-1]

    for op in operations:
        try:
            kind = op["op"]
            parent, last = walk(op["path"])
            if kind == "test":
                actual = parent[int(last)] if isinstance(parent, list) else parent[last]
                if actual != op["value"]:
                    raise ApiError(422, "Invalid", f"the test at {op['path']} failed")
            elif kind == "remove":
                del parent[int(last) if isinstance(parent, list) else last]
            elif kind in ("add", "replace", "copy", "move"):
                if kind in ("copy", "move"):
                    source_parent, source_last = walk(op["from"])
                    index = int(source_last) if isinstance(source_parent, list) else source_last
                    value = copy.deepcopy(source_parent[index])
                    if kind == "move":
                        del source_parent[index]
                else:
                    value = copy.deepcopy(op["value"])
                if isinstance(parent, list):
                    position = len(parent) if last == "-" else int(last)
                    if kind == "replace":
                        parent[position] = value
                    else:
                        parent.insert(position, value)
                else:
                    if kind == "replace" and last not in parent:
                        raise ApiError(422, "Invalid", f"replace: {op['path']} does not exist")
                    parent[last] = value
            else:
                raise ApiError(400, "BadRequest", f"unknown json patch op {kind!r}")
        except (KeyError, IndexError, ValueError, TypeError):
            raise ApiError(422, "Invalid", f"the json patch could not be applied: {op!r}") from None
    return document


# ---------------------------------------------------------------------- schema
#: The fields of the two kinds that strict field validation knows (from
#: staging/src/k8s.io/api/core/v1/types.go and .../discovery/v1/types.go);
#: ``fieldValidation=Strict`` refuses any other (the apiserver's strict
#: decoding, "strict decoding error: unknown field").
_META_FIELDS = {
    "name", "generateName", "namespace", "uid", "resourceVersion", "generation",
    "creationTimestamp", "deletionTimestamp", "deletionGracePeriodSeconds", "labels",
    "annotations", "ownerReferences", "finalizers", "managedFields", "selfLink",
}  # fmt: skip
_SCHEMA: dict[str, dict[str, Any]] = {
    "services": {
        "apiVersion": None, "kind": None, "metadata": _META_FIELDS,
        "spec": {
            "ports", "selector", "clusterIP", "clusterIPs", "type", "externalIPs",
            "sessionAffinity", "loadBalancerIP", "loadBalancerSourceRanges", "externalName",
            "externalTrafficPolicy", "healthCheckNodePort", "publishNotReadyAddresses",
            "sessionAffinityConfig", "ipFamilies", "ipFamilyPolicy",
            "allocateLoadBalancerNodePorts",
            "loadBalancerClass", "internalTrafficPolicy", "trafficDistribution",
        },
        "status": None,
    },
    "endpointslices": {
        "apiVersion": None, "kind": None, "metadata": _META_FIELDS,
        "addressType": None, "endpoints": None, "ports": None,
    },
}  # fmt: skip


def unknown_fields(kind: Kind, obj: dict[str, Any]) -> list[str]:
    schema = _SCHEMA[kind]
    unknown: list[str] = []
    for key, value in obj.items():
        if key not in schema:
            unknown.append(key)
        elif isinstance(schema[key], set) and isinstance(value, dict):
            unknown.extend(f"{key}.{inner}" for inner in value if inner not in schema[key])
    return unknown


_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def validate(kind: Kind, obj: dict[str, Any], old: dict[str, Any] | None) -> list[tuple[str, str]]:
    """(field, problem) pairs, as pkg/apis/core/validation/validation.go
    (ValidateService) and pkg/apis/discovery/validation/validation.go
    (ValidateEndpointSlice) would report the ones checked here."""
    problems: list[tuple[str, str]] = []
    name = obj["metadata"].get("name", "")
    if kind == "services":
        if not _LABEL_NAME.match(name) or len(name) > 63:
            problems.append(
                (
                    "metadata.name",
                    f'Invalid value: "{name}": a DNS-1035 label must consist of lower case '
                    "alphanumeric characters or '-'",
                )
            )
        spec = obj.get("spec") or {}
        ports = spec.get("ports") or []
        if spec.get("type", "ClusterIP") != "ExternalName" and not ports:
            problems.append(("spec.ports", "Required value"))
        for index, port in enumerate(ports):
            if not isinstance(port.get("port"), int) or not 0 < port["port"] < 65536:
                problems.append(
                    (
                        f"spec.ports[{index}].port",
                        "Invalid value: must be between 1 and 65535, inclusive",
                    )
                )
            if len(ports) > 1 and not port.get("name"):
                problems.append((f"spec.ports[{index}].name", "Required value"))
        if spec.get("type") == "ExternalName" and not spec.get("externalName"):
            problems.append(("spec.externalName", "Required value"))
    else:
        if not _NAME.match(name) or len(name) > 253:
            problems.append(
                ("metadata.name", f'Invalid value: "{name}": a lowercase RFC 1123 subdomain')
            )
        address_type = obj.get("addressType")
        if address_type not in ("IPv4", "IPv6", "FQDN"):
            problems.append(
                (
                    "addressType",
                    "Required value"
                    if address_type is None
                    else f'Unsupported value: "{address_type}"',
                )
            )
        if old is not None and old.get("addressType") != address_type:
            problems.append(("addressType", "Invalid value: field is immutable"))
        for index, endpoint in enumerate(obj.get("endpoints") or []):
            addresses = endpoint.get("addresses") if isinstance(endpoint, dict) else None
            if not addresses or len(addresses) > 100:
                problems.append(
                    (
                        f"endpoints[{index}].addresses",
                        "Required value: must contain at least 1 address",
                    )
                )
    return problems


def defaulted_service(obj: dict[str, Any], allocate: Callable[[], str]) -> dict[str, Any]:
    """Defaults of a new Service (pkg/apis/core/v1/defaults.go SetDefaults_Service:
    type ClusterIP, sessionAffinity None, protocol TCP, targetPort = port; the
    registry allocates clusterIP and sets ipFamilies/ipFamilyPolicy,
    pkg/registry/core/service/storage/alloc.go)."""
    spec = obj.setdefault("spec", {})
    spec.setdefault("type", "ClusterIP")
    spec.setdefault("sessionAffinity", "None")
    for port in spec.get("ports") or []:
        port.setdefault("protocol", "TCP")
        port.setdefault("targetPort", port.get("port"))
    if spec["type"] != "ExternalName":
        if spec.get("clusterIP") in (None, ""):
            spec["clusterIP"] = allocate()
        spec.setdefault("clusterIPs", [spec["clusterIP"]])
        spec.setdefault("ipFamilies", ["IPv4"])
        spec.setdefault("ipFamilyPolicy", "SingleStack")
    obj.setdefault("status", {"loadBalancer": {}})
    return obj


def mirrored_slice_object(
    endpoints_name: str,
    endpoints_uid: str,
    slice_name: str,
    addresses: list[dict[str, Any]],
    *,
    ports: list[dict[str, Any]] | None = None,
    address_type: str = "IPv4",
) -> dict[str, Any]:
    """A slice as the EndpointSlice mirroring controller writes it for a
    selectorless Service's Endpoints object (pkg/controller/
    endpointslicemirroring/utils.go newEndpointSlice): a controller owner
    reference to ``v1 Endpoints/<name>``, the service-name label and
    ``managed-by: endpointslicemirroring-controller.k8s.io``."""
    return {
        "metadata": {
            "name": slice_name,
            "labels": {
                SERVICE_NAME_LABEL: endpoints_name,
                MANAGED_BY_LABEL: "endpointslicemirroring-controller.k8s.io",
            },
            "ownerReferences": [
                {
                    "apiVersion": "v1",
                    "kind": "Endpoints",
                    "name": endpoints_name,
                    "uid": endpoints_uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],
        },
        "addressType": address_type,
        "endpoints": addresses,
        "ports": ports
        if ports is not None
        else [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }


def slice_object(
    name: str,
    service: str,
    endpoints: list[dict[str, Any]],
    *,
    ports: list[dict[str, Any]] | None = None,
    owner_uid: str | None = None,
    address_type: str = "IPv4",
    labels: dict[str, str] | None = None,
) -> dict[str, Any]:
    """An EndpointSlice body as the EndpointSlice controller writes it."""
    metadata: dict[str, Any] = {
        "name": name,
        "labels": {
            SERVICE_NAME_LABEL: service,
            MANAGED_BY_LABEL: "endpointslice-controller.k8s.io",
            **(labels or {}),
        },
    }
    if owner_uid is not None:
        metadata["ownerReferences"] = [
            {
                "apiVersion": "v1",
                "kind": "Service",
                "name": service,
                "uid": owner_uid,
                "controller": True,
                "blockOwnerDeletion": True,
            }
        ]
    return {
        "metadata": metadata,
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": ports
        if ports is not None
        else [{"name": "http", "port": 8080, "protocol": "TCP"}],
    }


class KubernetesFake:
    """The fake API server: state, control methods, an ASGI app and an httpx transport."""

    def __init__(
        self,
        *,
        tokens: dict[str, str] | None = None,
        window: int = 1000,
        bookmark_interval: float | None = 60.0,
        gone_as_status: bool = False,
        seed: int = 0,
    ) -> None:
        self.url = "http://kubernetes.fake"
        self.tokens = tokens
        self.window = window
        self.bookmark_interval = bookmark_interval
        self.gone_as_status = gone_as_status
        self._uids = (uuid.UUID(int=(seed << 64) + n) for n in itertools.count(1))
        self.version = 1
        #: Versions at or below this one are compacted away.
        self.compacted = 0
        self.objects: dict[Kind, dict[tuple[str, str], dict[str, Any]]] = {
            "services": {},
            "endpointslices": {},
        }
        self.history: deque[_Event] = deque()
        self._snapshots: dict[int, dict[Kind, dict[tuple[str, str], dict[str, Any]]]] = {}
        self._watches: set[_Watch] = set()
        #: user -> denied (verb, resource) pairs; "*" denies every verb.
        self.denied: dict[str, set[tuple[str, str]]] = {}
        self.requests: list[RequestRecord] = []
        self._activity = anyio.Event()
        #: Answer the next requests whose path starts with the key with this status.
        self.fail_next: dict[str, list[int]] = {}
        #: Path prefix -> the 429 answers (see :meth:`throttle`) still to give.
        self.throttled: dict[str, list[ApiError]] = {}
        self._random = random.Random(seed)
        self._next_ip = 10

    # ------------------------------------------------------------------ state
    def _poke(self) -> None:
        activity, self._activity = self._activity, anyio.Event()
        activity.set()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds (re-checked after each request or change)."""
        while not predicate():
            await self._activity.wait()

    def _write(
        self, kind: Kind, event_type: str, key: tuple[str, str], obj: dict[str, Any] | None
    ) -> dict[str, Any]:
        self.version += 1
        store = self.objects[kind]
        old = store.get(key)
        if event_type == "DELETED":
            assert old is not None
            new = copy.deepcopy(old)
            new["metadata"]["resourceVersion"] = str(self.version)
            del store[key]
        else:
            assert obj is not None
            new = copy.deepcopy(obj)
            meta = new.setdefault("metadata", {})
            meta["namespace"], meta["name"] = key
            meta["resourceVersion"] = str(self.version)
            meta.setdefault("uid", old["metadata"]["uid"] if old else str(next(self._uids)))
            meta.setdefault("creationTimestamp", "2026-01-01T00:00:00Z")
            meta.setdefault("generation", 1)
            kind_name, api_version, _ = _KINDS[kind]
            new["kind"], new["apiVersion"] = kind_name, api_version
            store[key] = new
        event = _Event(self.version, kind, event_type, new, old)
        self.history.append(event)
        while len(self.history) > self.window:
            dropped = self.history.popleft()
            self.compacted = dropped.version
        self._forget_snapshots()
        for watch in list(self._watches):
            self._deliver(watch, event)
        self._poke()
        return new

    def _forget_snapshots(self) -> None:
        for version in [v for v in self._snapshots if v <= self.compacted]:
            del self._snapshots[version]

    def create_service(
        self,
        name: str,
        *,
        namespace: str = "default",
        ports: list[dict[str, Any]] | None = None,
        uid: str | None = None,
        selector: dict[str, str] | Literal["default"] | None = "default",
        ip_families: list[str] | None = None,
        spec: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """Create (or replace) a ClusterIP Service; returns the stored object.

        ``selector`` defaults to ``{"app": <name>}``; ``None`` makes a Service
        without a selector (its slices are mirrored or hand-written)."""
        key = (namespace, name)
        exists = key in self.objects["services"]
        meta: dict[str, Any] = {"name": name}
        if uid is not None:
            meta["uid"] = uid
        body_spec: dict[str, Any] = {
            "type": "ClusterIP",
            "clusterIP": "10.96.0.10",
            "ports": ports
            if ports is not None
            else [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
            "ipFamilies": ip_families or ["IPv4"],
            "ipFamilyPolicy": "SingleStack"
            if len(ip_families or ["IPv4"]) == 1
            else "RequireDualStack",
        }
        if selector == "default":
            body_spec["selector"] = {"app": name}
        elif selector is not None:
            body_spec["selector"] = dict(selector)
        body_spec.update(spec or {})
        body = {"metadata": meta, "spec": body_spec, "status": {"loadBalancer": {}}}
        if exists and uid is None:
            body["metadata"]["uid"] = self.objects["services"][key]["metadata"]["uid"]
        return self._write("services", "MODIFIED" if exists else "ADDED", key, body)

    def delete_service(self, name: str, *, namespace: str = "default") -> None:
        self._write("services", "DELETED", (namespace, name), None)

    def service_uid(self, name: str, *, namespace: str = "default") -> str:
        return str(self.objects["services"][(namespace, name)]["metadata"]["uid"])

    def put_slice(self, body: dict[str, Any], *, namespace: str = "default") -> dict[str, Any]:
        """Create or replace an EndpointSlice (``slice_object`` builds one)."""
        key = (namespace, body["metadata"]["name"])
        exists = key in self.objects["endpointslices"]
        return self._write("endpointslices", "MODIFIED" if exists else "ADDED", key, body)

    def delete_slice(self, name: str, *, namespace: str = "default") -> None:
        self._write("endpointslices", "DELETED", (namespace, name), None)

    def compact(self) -> None:
        """Compact the history up to now: older versions and continue tokens are gone."""
        self.compacted = self.version
        self.history.clear()
        self._forget_snapshots()

    def restore(
        self,
        version: int,
        *,
        bump: int | None = None,
        watches: Literal["break", "end"] = "break",
    ) -> None:
        """A storage restore from a backup taken at ``version``: the objects go
        back to what they were then.

        Without ``bump`` (``etcdutl snapshot restore`` without
        ``--bump-revision``) the global version goes back to ``version`` too.
        Every open watch breaks (the API servers restart), or with
        ``watches="end"`` ends cleanly (what a running API server's watch cache
        does to its watchers when its own etcd watch fails: cacher.go
        startCaching, terminateAllWatchers). A client that watches again
        from the later version it holds is answered 200 and hears nothing
        until the store passes that version (see ``_open_watch``); only a list
        from such a version, or a watch with ``sendInitialEvents``, is a 504
        "Too large resource version".

        With ``bump`` (``--bump-revision <bump> --mark-compacted``, what the
        etcd and Kubernetes docs ask for), the version jumps to ``version +
        bump`` and everything up to it counts as compacted: every open watch
        receives a 410 ``Expired`` ERROR event and ends, and a watch, list or
        continue token from an older version is 410 too, so clients list again.
        """
        if bump is not None and bump <= 0:
            raise ValueError("bump must be a positive number of revisions")
        state = self.state_at(version)
        self.objects = {kind: dict(items) for kind, items in state.items()}
        self._snapshots.clear()
        if bump is not None:
            self.version = version + bump
            self.compacted = self.version
            self.history.clear()
            self.expire_watches()
        else:
            self.version = version
            self.history = deque(e for e in self.history if e.version <= version)
            if watches == "end":
                self.end_watches()
            else:
                self.break_watches()
        self._poke()

    def freeze_watches(self) -> None:
        """Every open watch goes silent for good: connection open, nothing sent,
        not even bookmarks (a dead peer behind a proxy that keeps the socket)."""
        for watch in list(self._watches):
            watch.push("freeze")

    def expire_watches(self) -> None:
        """Every open watch receives a 410 ``Expired`` ERROR event and ends."""
        for watch in list(self._watches):
            watch.push(
                {
                    "type": "ERROR",
                    "object": status_object(
                        410,
                        "Expired",
                        f"too old resource version: {self.compacted} ({self.version})",
                    ),
                }
            )
            watch.push("end")

    def end_watches(self) -> None:
        """Every open watch ends cleanly (as at its server-side timeout)."""
        for watch in list(self._watches):
            watch.push("end")

    def break_watches(self) -> None:
        """Every open watch's connection breaks mid-stream."""
        for watch in list(self._watches):
            watch.push("break")

    def bookmark(self) -> None:
        """Send a BOOKMARK at the current version to every watch that allows them."""
        for watch in list(self._watches):
            watch.push("bookmark")

    @property
    def open_watches(self) -> int:
        return len(self._watches)

    def deny(self, user: str, verb: str = "*", resource: str = "*") -> None:
        """RBAC: ``user`` may no longer ``verb`` ``resource`` ("*": any).

        Verbs are the API server's request verbs: a collection read is
        ``list``, the same read with ``watch=1`` is ``watch``
        (staging/src/k8s.io/apiserver/pkg/endpoints/request/requestinfo.go), so
        ``deny(user, "watch", "endpointslices")`` is a role that lists slices but
        may not watch them: the list answers 200, the watch 403 before any
        stream (the authorization filter runs before the handler)."""
        self.denied.setdefault(user, set()).add((verb, resource))

    def allow(self, user: str) -> None:
        self.denied.pop(user, None)

    def throttle(
        self,
        prefix: str,
        *,
        retry_after: int = 1,
        times: int = 1,
        form: Literal["priority", "status"] = "priority",
        message: str = "storage is (re)initializing",
    ) -> None:
        """Answer the next ``times`` requests whose path starts with ``prefix``
        with 429, asking the client to come back in ``retry_after`` seconds.

        ``form="priority"`` is API Priority and Fairness rejecting a request
        (staging/src/k8s.io/apiserver/pkg/server/filters/priority-and-fairness.go:
        ``setResponseHeaders`` names the flow schema and priority level,
        ``tooManyRequests`` sets ``Retry-After`` and writes a plain-text body
        with ``http.Error``, no ``Status`` object). ``form="status"`` is
        ``errors.NewTooManyRequests(message, retry_after)``: a ``Status`` with
        reason ``TooManyRequests`` and ``details.retryAfterSeconds``, and the
        same ``Retry-After`` header (``ErrorNegotiated``); the watch cache
        answers that way while its storage (re)initializes (cacher.go,
        "storage is (re)initializing", one second)."""
        answers = self.throttled.setdefault(prefix, [])
        for _ in range(times):
            error = ApiError(429, "TooManyRequests", message, {"retryAfterSeconds": retry_after})
            if form == "priority":
                error.body = PlainAnswer(
                    "Too many requests, please try again later.\n",
                    {
                        "Retry-After": str(retry_after),
                        "X-Kubernetes-PF-FlowSchema-UID": "fake-flowschema-uid",
                        "X-Kubernetes-PF-PriorityLevel-UID": "fake-prioritylevel-uid",
                    },
                )
            answers.append(error)

    # ------------------------------------------------------------------ serving
    def _user(self, token: str | None) -> str:
        if self.tokens is None:
            return "system:anonymous"
        found = self.tokens.get(token or "")
        if found is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        return found

    def _allowed(self, user: str, verb: str, resource: str) -> bool:
        denied = self.denied.get(user, set())
        return not ({(verb, resource), ("*", resource), (verb, "*"), ("*", "*")} & denied)

    def _authorize(
        self, token: str | None, verb: str, resource: Kind, namespace: str | None
    ) -> None:
        user = self._user(token)
        if not self._allowed(user, verb, resource):
            group = _KINDS[resource][2]
            scope = (
                f' in the namespace "{namespace}"'
                if namespace is not None
                else " at the cluster scope"
            )
            # staging/src/k8s.io/apiserver/pkg/endpoints/handlers/responsewriters/
            # errors.go Forbidden/forbiddenMessage, wrapped by apierrors.NewForbidden:
            # the verb is the request's ("watch" for ?watch=1, so a role may allow
            # list and refuse watch), and details carry the group only when set
            # (StatusDetails.Group is omitempty; a core resource has none).
            details = {"group": group, "kind": resource} if group else {"kind": resource}
            raise ApiError(
                403,
                "Forbidden",
                f'{resource}{"." + group if group else ""} is forbidden: User "{user}" cannot '
                f'{verb} resource "{resource}" in API group "{group}"{scope}',
                details,
            )

    def _matches(
        self,
        obj: dict[str, Any],
        namespace: str | None,
        fields: list[FieldRequirement],
        labels: list[Requirement],
    ) -> bool:
        meta = obj["metadata"]
        if namespace is not None and meta["namespace"] != namespace:
            return False
        for name, op, value in fields:
            actual = meta["name"] if name == "metadata.name" else meta["namespace"]
            if (actual == value) != (op == "="):
                return False
        return labels_match(meta.get("labels") or {}, labels)

    def _deliver(self, watch: _Watch, event: _Event) -> None:
        if event.kind != watch.kind or event.version <= watch.after:
            return
        now = self._matches(event.obj, watch.namespace, watch.fields, watch.labels)
        before = event.old is not None and self._matches(
            event.old, watch.namespace, watch.fields, watch.labels
        )
        if event.type == "DELETED":
            if before:
                watch.push({"type": "DELETED", "object": event.obj})
        elif now and before:
            watch.push({"type": "MODIFIED", "object": event.obj})
        elif now:
            watch.push({"type": "ADDED", "object": event.obj})
        elif before:
            watch.push({"type": "DELETED", "object": event.obj})

    @staticmethod
    def _selectors(query: dict[str, str]) -> tuple[list[FieldRequirement], list[Requirement]]:
        return (
            parse_field_selector(query.get("fieldSelector", "")),
            parse_label_selector(query.get("labelSelector", "")),
        )

    def state_at(self, version: int) -> dict[Kind, dict[tuple[str, str], dict[str, Any]]]:
        """The stored objects as they were at ``version`` (undoing the history
        after it); 410 Expired when the history no longer reaches back."""
        if version < self.compacted:
            raise ApiError(
                410, "Expired", f"too old resource version: {version} ({self.compacted})"
            )
        state = {k: dict(v) for k, v in self.objects.items()}
        for event in reversed(self.history):
            if event.version <= version:
                break
            key = (event.obj["metadata"]["namespace"], event.obj["metadata"]["name"])
            if event.old is None:
                state[event.kind].pop(key, None)
            else:
                state[event.kind][key] = event.old
        return state

    def _too_large(self, version: int) -> ApiError:
        # staging/src/k8s.io/apiserver/pkg/storage/errors.go
        # NewTooLargeResourceVersionError: a 504 Timeout Status whose cause is
        # ResourceVersionTooLarge, retry after one second.
        return ApiError(
            504,
            "Timeout",
            f"Too large resource version: {version}, current: {self.version}",
            {
                "causes": [
                    {"reason": "ResourceVersionTooLarge", "message": "Too large resource version"}
                ],
                "retryAfterSeconds": 1,
            },
        )

    async def _fresh_enough(self, version: int) -> None:
        """Wait up to 3 s for the store to reach ``version`` (the watch cache's
        blockTimeout in staging/src/k8s.io/apiserver/pkg/storage/cacher/
        watch_cache.go waitUntilFreshAndBlock), else 504 Too large. Lists from
        a version and watches with ``sendInitialEvents`` wait so; a plain
        watch does not (see ``_open_watch``)."""
        with anyio.move_on_after(3.0):
            await self.wait_for(lambda: self.version >= version)
        if self.version < version:
            raise self._too_large(version)

    async def _list(
        self, kind: Kind, namespace: str | None, query: dict[str, str]
    ) -> dict[str, Any]:
        fields, labels = self._selectors(query)
        token = query.get("continue", "")
        raw_version = query.get("resourceVersion")
        match = query.get("resourceVersionMatch", "")
        # Semantics of resourceVersion / resourceVersionMatch on a list: the
        # "Resource versions" page of the API concepts docs
        # (content/en/docs/reference/using-api/api-concepts.md) and
        # staging/src/k8s.io/apimachinery/pkg/apis/meta/internalversion/validation.
        if match and raw_version in (None, ""):
            raise ApiError(
                400,
                "BadRequest",
                "resourceVersionMatch is forbidden unless resourceVersion is provided",
            )
        if match not in ("", "Exact", "NotOlderThan"):
            raise ApiError(400, "BadRequest", f"resourceVersionMatch: unsupported value {match!r}")
        if token and raw_version not in (None, "", "0"):
            raise ApiError(
                400, "BadRequest", "specifying resource version is not allowed when using continue"
            )
        if raw_version not in (None, "") and not raw_version.isdigit():
            raise ApiError(400, "BadRequest", f"invalid resource version: {raw_version}")
        if match == "Exact" and raw_version == "0":
            raise ApiError(
                400,
                "BadRequest",
                'resourceVersionMatch "Exact" is forbidden for resourceVersion "0"',
            )
        if token:
            try:
                decoded = json.loads(base64.urlsafe_b64decode(token.encode()))
                version, start = int(decoded["rv"]), str(decoded["start"])
            except (ValueError, KeyError, TypeError):
                raise ApiError(400, "BadRequest", "continue key is not valid") from None
            snapshot = self._snapshots.get(version)
            if snapshot is None:
                raise ApiError(
                    410,
                    "Expired",
                    "The provided continue parameter is too old to display a consistent list "
                    "result. You can start a new list without the continue parameter.",
                )
        elif match == "Exact":
            assert raw_version is not None
            wanted = int(raw_version)
            if wanted > self.version:
                await self._fresh_enough(wanted)
            version, start = wanted, ""
            snapshot = self.state_at(wanted)
        else:
            if raw_version not in (None, "", "0"):
                # NotOlderThan (explicit or implied): at least that version.
                await self._fresh_enough(int(raw_version))
            version, start = self.version, ""
            snapshot = {k: dict(v) for k, v in self.objects.items()}
        items = sorted(
            (
                obj
                for key, obj in snapshot[kind].items()
                if self._matches(obj, namespace, fields, labels) and f"{key[0]}/{key[1]}" > start
            ),
            key=lambda o: (o["metadata"]["namespace"], o["metadata"]["name"]),
        )
        metadata: dict[str, Any] = {"resourceVersion": str(version)}
        limit = query.get("limit", "")
        if limit.isdigit() and 0 < int(limit) < len(items):
            page = items[: int(limit)]
            last = page[-1]["metadata"]
            self._snapshots[version] = snapshot
            metadata["continue"] = base64.urlsafe_b64encode(
                json.dumps({"rv": version, "start": f"{last['namespace']}/{last['name']}"}).encode()
            ).decode()
            metadata["remainingItemCount"] = len(items) - len(page)
            items = page
        kind_name, api_version, _ = _KINDS[kind]
        return {
            "kind": f"{kind_name}List",
            "apiVersion": api_version,
            "metadata": metadata,
            "items": items,
        }

    # ------------------------------------------------------------------ writes
    def _allocate_ip(self) -> str:
        self._next_ip += 1
        return f"10.96.{self._next_ip // 250}.{self._next_ip % 250 + 1}"

    def _generated(self, prefix: str, kind: Kind, namespace: str) -> str:
        # staging/src/k8s.io/apiserver/pkg/storage/names/generate.go: the prefix
        # plus five random characters from "bcdfghjklmnpqrstvwxz2456789".
        alphabet = "bcdfghjklmnpqrstvwxz2456789"
        while True:
            name = prefix + "".join(self._random.choice(alphabet) for _ in range(5))
            if (namespace, name) not in self.objects[kind]:
                return name

    def _decode_body(self, body: bytes, content_type: str) -> Any:
        if "yaml" in content_type:
            import yaml

            try:
                return yaml.safe_load(body)
            except yaml.YAMLError:
                raise ApiError(400, "BadRequest", "the body is not valid YAML") from None
        try:
            return json.loads(body or b"null")
        except ValueError:
            raise ApiError(400, "BadRequest", "the body is not valid JSON") from None

    def _admit(
        self,
        kind: Kind,
        key: tuple[str, str],
        obj: Any,
        old: dict[str, Any] | None,
        query: dict[str, str],
    ) -> dict[str, Any]:
        """Check a new state of one object (kind, namespace, strict fields, validation)."""
        kind_name, api_version, _ = _KINDS[kind]
        if not isinstance(obj, dict):
            raise ApiError(400, "BadRequest", "the object is not a JSON object")
        if (
            obj.get("kind", kind_name) != kind_name
            or obj.get("apiVersion", api_version) != api_version
        ):
            raise ApiError(
                400,
                "BadRequest",
                f"the API version in the data ({obj.get('apiVersion')}) does not match the "
                f"expected API version ({api_version})",
            )
        meta = obj.setdefault("metadata", {})
        if meta.get("namespace") not in (None, key[0]):
            raise ApiError(
                400,
                "BadRequest",
                "the namespace of the provided object does not match the namespace sent on "
                "the request",
            )
        if query.get("fieldValidation", "") == "Strict":
            unknown = unknown_fields(kind, obj)
            if unknown:
                raise ApiError(
                    400,
                    "BadRequest",
                    "strict decoding error: "
                    + ", ".join(f'unknown field "{name}"' for name in unknown),
                )
        meta["name"], meta["namespace"] = key[1], key[0]
        if kind == "services":
            # Defaults apply on every write; an update keeps the allocated clusterIP.
            spec = obj.setdefault("spec", {})
            if old is not None and not spec.get("clusterIP"):
                for field_name in ("clusterIP", "clusterIPs", "ipFamilies", "ipFamilyPolicy"):
                    if field_name in old.get("spec", {}):
                        spec[field_name] = copy.deepcopy(old["spec"][field_name])
            defaulted_service(obj, self._allocate_ip)
        problems = validate(kind, obj, old)
        if problems:
            name = key[1]
            raise ApiError(
                422,
                "Invalid",
                f'{kind_name} "{name}" is invalid: '
                + ", ".join(f"{path}: {text}" for path, text in problems),
                {
                    "name": name,
                    "kind": kind_name,
                    "causes": [
                        {"reason": "FieldValueInvalid", "message": text, "field": path}
                        for path, text in problems
                    ],
                },
            )
        return obj

    def _conflict(self, kind: Kind, name: str, detail: str) -> ApiError:
        # staging/src/k8s.io/apiserver/pkg/registry/generic/registry/store.go:
        # a stale resourceVersion is errors.NewConflict(..., OptimisticLockErrorMsg).
        return ApiError(
            409,
            "Conflict",
            f'Operation cannot be fulfilled on {_qualified(kind)} "{name}": {detail}',
            _details(kind, name),
        )

    def _commit(
        self,
        kind: Kind,
        event_type: str,
        key: tuple[str, str],
        obj: dict[str, Any] | None,
        query: dict[str, str],
    ) -> dict[str, Any]:
        if query.get("dryRun") == "All":
            preview = copy.deepcopy(obj if obj is not None else self.objects[kind][key])
            return preview
        return self._write(kind, event_type, key, obj)

    def _api_write(
        self,
        method: str,
        kind: Kind,
        namespace: str,
        name: str | None,
        query: dict[str, str],
        body: bytes,
        content_type: str,
    ) -> tuple[int, dict[str, Any]]:
        store = self.objects[kind]
        if method == "POST":
            if name is not None:
                raise ApiError(405, "MethodNotAllowed", "POST is not allowed on a named object")
            obj = self._decode_body(body, content_type)
            meta = obj.get("metadata") if isinstance(obj, dict) else None
            if not isinstance(meta, dict):
                raise ApiError(400, "BadRequest", "the object has no metadata")
            new_name = meta.get("name") or ""
            if not new_name and meta.get("generateName"):
                new_name = self._generated(str(meta["generateName"]), kind, namespace)
            if not new_name:
                raise ApiError(
                    422,
                    "Invalid",
                    f'{_KINDS[kind][0]} "" is invalid: metadata.name: Required value: '
                    "name or generateName is required",
                )
            key = (namespace, new_name)
            if key in store:
                raise ApiError(
                    409,
                    "AlreadyExists",
                    f'{_qualified(kind)} "{new_name}" already exists',
                    _details(kind, new_name),
                )
            if meta.get("resourceVersion"):
                # staging/src/k8s.io/apiserver/pkg/storage/errors.go ErrResourceVersionSetOnCreate
                raise ApiError(
                    500,
                    "InternalError",
                    "resourceVersion should not be set on objects to be created",
                )
            for dropped in ("uid", "creationTimestamp", "generation"):
                meta.pop(dropped, None)
            admitted = self._admit(kind, key, obj, None, query)
            return 201, self._commit(kind, "ADDED", key, admitted, query)
        if name is None:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on a collection")
        key = (namespace, name)
        old = store.get(key)
        if old is None:
            raise ApiError(
                404, "NotFound", f'{kind} "{name}" not found', {"name": name, "kind": kind}
            )
        if method == "DELETE":
            options = self._decode_body(body, content_type) if body else None
            preconditions = (options or {}).get("preconditions") or {}
            wanted_rv = preconditions.get("resourceVersion")
            if wanted_rv is not None and wanted_rv != old["metadata"]["resourceVersion"]:
                raise self._conflict(
                    kind,
                    name,
                    "Precondition failed: ResourceVersion in precondition: "
                    f"{wanted_rv}, ResourceVersion in object meta: "
                    f"{old['metadata']['resourceVersion']}",
                )
            wanted_uid = preconditions.get("uid")
            if wanted_uid is not None and wanted_uid != old["metadata"]["uid"]:
                raise self._conflict(
                    kind,
                    name,
                    f"Precondition failed: UID in precondition: {wanted_uid}, UID in object meta: "
                    f"{old['metadata']['uid']}",
                )
            if query.get("dryRun") != "All":
                self._write(kind, "DELETED", key, None)
            return 200, {
                "kind": "Status",
                "apiVersion": "v1",
                "metadata": {},
                "status": "Success",
                "details": {**_details(kind, name), "uid": old["metadata"]["uid"]},
            }
        if method == "PUT":
            obj = self._decode_body(body, content_type)
            if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
                raise ApiError(400, "BadRequest", "the object has no metadata")
            if obj["metadata"].get("name") != name:
                raise ApiError(
                    400,
                    "BadRequest",
                    f"the name of the object ({obj['metadata'].get('name')}) does not match the "
                    f"name on the URL ({name})",
                )
            sent_rv = obj["metadata"].get("resourceVersion")
        elif method == "PATCH":
            patch = self._decode_body(body, content_type)
            current = copy.deepcopy(old)
            if content_type.startswith("application/merge-patch+json"):
                obj = merge_patch(current, patch)
            elif content_type.startswith("application/strategic-merge-patch+json"):
                obj = strategic_merge_patch(current, patch)
            elif content_type.startswith("application/json-patch+json"):
                obj = json_patch(current, patch)
            else:
                raise ApiError(
                    415,
                    "UnsupportedMediaType",
                    f"the body of the request was in an unknown format - accepted media types "
                    f"include: application/json-patch+json, application/merge-patch+json, "
                    f"application/strategic-merge-patch+json (got {content_type or 'none'})",
                )
            # A patch that carries metadata.resourceVersion is a precondition on it.
            sent = (
                patch.get("metadata", {}).get("resourceVersion")
                if isinstance(patch, dict)
                else None
            )
            sent_rv = sent
            if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
                raise ApiError(422, "Invalid", "the patched object has no metadata")
        else:
            raise ApiError(405, "MethodNotAllowed", f"the server does not allow {method} here")
        if sent_rv not in (None, "") and sent_rv != old["metadata"]["resourceVersion"]:
            raise self._conflict(
                kind,
                name,
                "the object has been modified; please apply your changes to the latest version "
                "and try again",
            )
        meta = obj["metadata"]
        meta["uid"] = old["metadata"]["uid"]
        meta["creationTimestamp"] = old["metadata"].get("creationTimestamp")
        meta.pop("resourceVersion", None)

        def content(o: dict[str, Any]) -> dict[str, Any]:
            skipped = ("metadata", "status", "kind", "apiVersion")
            return {k: v for k, v in o.items() if k not in skipped}

        spec_changed = content(obj) != content(old)
        meta["generation"] = old["metadata"].get("generation", 1) + (1 if spec_changed else 0)
        admitted = self._admit(kind, key, obj, old, query)
        return 200, self._commit(kind, "MODIFIED", key, admitted, query)

    def _access_review(self, token: str | None, body: bytes) -> dict[str, Any]:
        """SelfSubjectAccessReview (staging/src/k8s.io/api/authorization/v1/types.go):
        answers with the RBAC rules ``deny`` set (what ``kubectl auth can-i`` asks)."""
        user = self._user(token)
        review = self._decode_body(body, "application/json")
        if not isinstance(review, dict):
            raise ApiError(400, "BadRequest", "the review is not a JSON object")
        attributes = (review.get("spec") or {}).get("resourceAttributes") or {}
        verb = str(attributes.get("verb", ""))
        resource = str(attributes.get("resource", ""))
        allowed = resource in _KINDS and self._allowed(user, verb, resource)
        if verb not in _VERBS and verb != "*":
            allowed = False
        # The RBAC authorizer gives no reason when it denies
        # (plugin/pkg/auth/authorizer/rbac/rbac.go): kubectl prints a bare "no".
        review["status"] = {"allowed": allowed}
        review.setdefault("metadata", {})["creationTimestamp"] = None
        return review

    # ------------------------------------------------------------------ discovery
    def _discovery(self, path: str) -> dict[str, Any] | None:
        if path == "/version":
            return {
                "major": "1",
                "minor": "30",
                "gitVersion": "v1.30.0-fake",
                "gitCommit": "0" * 40,
                "gitTreeState": "clean",
                "buildDate": "2026-01-01T00:00:00Z",
                "goVersion": "go1.22.0",
                "compiler": "gc",
                "platform": "linux/amd64",
            }
        if path == "/api":
            return {
                "kind": "APIVersions",
                "versions": ["v1"],
                "serverAddressByClientCIDRs": [
                    {"clientCIDR": "0.0.0.0/0", "serverAddress": "127.0.0.1:6443"}
                ],
            }
        if path == "/apis":
            groups = []
            for group in ("discovery.k8s.io", "authorization.k8s.io"):
                version = {"groupVersion": f"{group}/v1", "version": "v1"}
                groups.append({"name": group, "versions": [version], "preferredVersion": version})
            return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}

        def resource(name: str, kind: str, short: list[str] | None = None) -> dict[str, Any]:
            entry: dict[str, Any] = {
                "name": name,
                "singularName": kind.lower(),
                "namespaced": True,
                "kind": kind,
                "verbs": list(_VERBS),
            }
            if short:
                entry["shortNames"] = short
            return entry

        if path == "/api/v1":
            return {
                "kind": "APIResourceList",
                "groupVersion": "v1",
                "resources": [resource("services", "Service", ["svc"])],
            }
        if path == "/apis/discovery.k8s.io/v1":
            return {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": "discovery.k8s.io/v1",
                "resources": [resource("endpointslices", "EndpointSlice")],
            }
        if path == "/apis/authorization.k8s.io/v1":
            return {
                "kind": "APIResourceList",
                "apiVersion": "v1",
                "groupVersion": "authorization.k8s.io/v1",
                "resources": [
                    {
                        "name": "selfsubjectaccessreviews",
                        "singularName": "selfsubjectaccessreview",
                        "namespaced": False,
                        "kind": "SelfSubjectAccessReview",
                        "verbs": ["create"],
                    }
                ],
            }
        return self._openapi(path)

    def _openapi(self, path: str) -> dict[str, Any] | None:
        """Enough OpenAPI v3 for kubectl: the index (``/openapi/v3``) and, per
        group version, the operations with their ``x-kubernetes-group-version-kind``
        and the ``fieldValidation`` parameter. kubectl's --validate (strict by
        default) looks for that parameter to hand validation to the server
        (staging/src/k8s.io/kubectl/pkg/cmd/util/helpers.go GetValidationDirective;
        staging/src/k8s.io/cli-runtime/pkg/resource/query_param_verifier_v3.go)."""
        documents = {
            "api/v1": ("", "v1", "Service", "/api/v1", "services"),
            "apis/discovery.k8s.io/v1": (
                "discovery.k8s.io",
                "v1",
                "EndpointSlice",
                "/apis/discovery.k8s.io/v1",
                "endpointslices",
            ),
        }
        if path == "/openapi/v3":
            return {
                "paths": {
                    name: {"serverRelativeURL": f"/openapi/v3/{name}?hash=fake{n}"}
                    for n, name in enumerate(documents)
                }
            }
        name = path.removeprefix("/openapi/v3/")
        if name not in documents:
            return None
        group, version, kind, prefix, plural = documents[name]
        gvk = {"group": group, "version": version, "kind": kind}
        parameters = [
            {"name": n, "in": "query", "schema": {"type": "string"}}
            for n in ("dryRun", "fieldManager", "fieldValidation")
        ]
        operation = {
            "parameters": parameters,
            "responses": {"200": {"description": "OK"}},
            "x-kubernetes-group-version-kind": gvk,
        }
        item_ops = {
            verb: dict(operation, operationId=f"{verb}{kind}")
            for verb in ("get", "put", "patch", "delete")
        }
        collection_ops = {
            verb: dict(operation, operationId=f"{verb}{kind}s") for verb in ("get", "post")
        }
        return {
            "openapi": "3.0.0",
            "info": {"title": "Kubernetes", "version": "v1.30.0-fake"},
            "paths": {
                f"{prefix}/namespaces/{{namespace}}/{plural}": collection_ops,
                f"{prefix}/namespaces/{{namespace}}/{plural}/{{name}}": item_ops,
            },
            "components": {"schemas": {}},
        }

    @staticmethod
    def _route(path: str) -> tuple[Kind, str | None, str | None] | None:
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            rest = parts[2:]
        elif parts[:3] == ["apis", "discovery.k8s.io", "v1"]:
            rest = parts[3:]
        else:
            return None
        namespace = None
        if len(rest) >= 2 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
        if not rest or rest[0] not in _KINDS:
            return None
        kind: Kind = rest[0]
        if (kind == "services") != (parts[0] == "api"):
            return None
        if len(rest) == 1:
            return kind, namespace, None
        if len(rest) == 2 and namespace is not None:
            return kind, namespace, rest[1]
        return None

    async def handle(
        self,
        method: str,
        path: str,
        query: dict[str, str],
        token: str | None,
        body: bytes = b"",
        content_type: str = "",
    ) -> tuple[int, dict[str, Any] | PlainAnswer | AsyncIterator[bytes]]:
        """Serve one request: (status, JSON body, a plain-text answer or a
        streamed watch body). Error answers carry the headers
        :func:`answer_headers` gives."""
        record = RequestRecord(method, path, query, token)
        self.requests.append(record)
        self._poke()
        try:
            for prefix, codes in self.fail_next.items():
                if path.startswith(prefix) and codes:
                    code = codes.pop(0)
                    raise ApiError(
                        code,
                        _REASONS.get(code, "InternalError" if code >= 500 else "Unknown"),
                        f"injected {code}",
                        # errors.NewTooManyRequests: a 429 always says when to come back.
                        {"retryAfterSeconds": 1} if code == 429 else None,
                    )
            for prefix, answers in self.throttled.items():
                if path.startswith(prefix) and answers:
                    # Priority and fairness runs after authentication (the
                    # handler chain of staging/src/k8s.io/apiserver/pkg/server/
                    # config.go DefaultBuildHandlerChain): a bad token is a 401 first.
                    self._user(token)
                    raise answers.pop(0)
            if method == "GET":
                document = self._discovery(path)
                if document is not None:
                    record.status = 200
                    return 200, document
            if path == "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews":
                if method != "POST":
                    raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed here")
                record.status = 201
                return 201, self._access_review(token, body)
            route = self._route(path)
            if route is None:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            kind, namespace, name = route
            if method != "GET":
                verb = _WRITE_VERBS.get(method)
                if verb is None:
                    raise ApiError(
                        405, "MethodNotAllowed", f"the server does not allow {method} here"
                    )
                if namespace is None:
                    raise ApiError(405, "MethodNotAllowed", f"{method} needs a namespace")
                self._authorize(token, verb, kind, namespace)
                status, answer = self._api_write(
                    method, kind, namespace, name, query, body, content_type
                )
                record.status = status
                return status, answer
            watching = query.get("watch", "").lower() in ("1", "true")
            verb = "watch" if watching else "get" if name is not None else "list"
            self._authorize(token, verb, kind, namespace)
            if name is not None and not watching:
                obj = self.objects[kind].get((namespace or "", name))
                if obj is None:
                    raise ApiError(
                        404, "NotFound", f'{kind} "{name}" not found', {"name": name, "kind": kind}
                    )
                record.status = 200
                return 200, obj
            if watching:
                fields, labels = self._selectors(query)
                if name is not None:
                    fields.append(("metadata.name", "=", name))
                return await self._open_watch(kind, namespace, fields, labels, query, record)
            answer = await self._list(kind, namespace, query)
            record.status = 200
            return 200, answer
        except ApiError as error:
            record.status = error.code
            return error.code, error.body
        finally:
            self._poke()

    async def _open_watch(
        self,
        kind: Kind,
        namespace: str | None,
        fields: list[FieldRequirement],
        labels: list[Requirement],
        query: dict[str, str],
        record: RequestRecord,
    ) -> tuple[int, dict[str, Any] | PlainAnswer | AsyncIterator[bytes]]:
        raw_version = query.get("resourceVersion", "")
        initial = query.get("sendInitialEvents", "").lower()
        bookmarks = query.get("allowWatchBookmarks", "").lower() == "true"
        if initial == "true" and (
            query.get("resourceVersionMatch") != "NotOlderThan" or not bookmarks
        ):
            # staging/src/k8s.io/apimachinery/pkg/apis/meta/internalversion/validation/
            # validation.go: sendInitialEvents needs resourceVersionMatch=NotOlderThan
            # and allowWatchBookmarks.
            raise ApiError(
                422,
                "Invalid",
                "sendInitialEvents: Forbidden: sendInitialEvents is forbidden for watch unless "
                "resourceVersionMatch is set to NotOlderThan and allowWatchBookmarks is true",
            )
        if raw_version not in ("", "0") and not raw_version.isdigit():
            raise ApiError(400, "BadRequest", f"invalid resource version: {raw_version}")
        watch = _Watch(kind, namespace, fields, labels)
        if raw_version not in ("", "0") and int(raw_version) > self.version:
            if initial == "true":
                # staging/src/k8s.io/apiserver/pkg/storage/cacher/cacher.go
                # waitUntilWatchCacheFreshAndForceAllEvents: only a watch that
                # asks for the initial events waits for the cache to reach its
                # version (3 s), then fails with 504 "Too large resource version".
                await self._fresh_enough(int(raw_version))
            else:
                # Any other watch from a version the store has not reached is
                # accepted: watch_cache.go getAllEventsSinceLocked finds no event
                # newer than it (an empty interval, not an error), and
                # cache_watcher.go processInterval/process deliver only events
                # (bookmarks included) of a higher version than the watch's. The
                # watch stays silent until the store passes that version.
                watch.after = int(raw_version)
        synthetic = initial == "true" or (raw_version in ("", "0") and initial != "false")
        if synthetic:
            # "Get State and Start at Most Recent" / sendInitialEvents: the current
            # state as ADDED events; with sendInitialEvents, then a bookmark
            # annotated k8s.io/initial-events-end (API concepts: streaming lists).
            for obj in sorted(self.objects[kind].values(), key=lambda o: o["metadata"]["name"]):
                if self._matches(obj, namespace, fields, labels):
                    watch.push({"type": "ADDED", "object": obj})
            if initial == "true":
                watch.push("initial-events-end")
        elif raw_version not in ("", "0"):
            start = int(raw_version)
            if start < self.compacted:
                message = f"too old resource version: {start} ({self.compacted})"
                if self.gone_as_status:
                    raise ApiError(410, "Gone", message)
                record.status = 200
                watch.push({"type": "ERROR", "object": status_object(410, "Expired", message)})
                watch.push("end")
                return 200, self._stream(watch, query, register=False)
            for event in self.history:
                if event.version > start:
                    self._deliver(watch, event)
        record.status = 200
        # Registered now, so nothing written before the body is first read is missed.
        self._watches.add(watch)
        return 200, self._stream(watch, query, register=True)

    async def _stream(
        self, watch: _Watch, query: dict[str, str], *, register: bool
    ) -> AsyncIterator[bytes]:
        timeout = DEFAULT_WATCH_TIMEOUT
        if query.get("timeoutSeconds", "").isdigit():
            timeout = float(query["timeoutSeconds"])
        bookmarks = query.get("allowWatchBookmarks", "").lower() == "true"
        kind_name, api_version, _ = _KINDS[watch.kind]
        opened = anyio.current_time()
        end_at = opened + timeout

        def next_bookmark(now: float) -> float:
            # The watch cache sends a bookmark to every watch that allows them
            # about once a minute, and one 2 s before the watch's deadline
            # (staging/src/k8s.io/apiserver/pkg/storage/cacher/cache_watcher.go
            # nextBookmarkTime; bookmarkFrequency in cacher.go), whether or not
            # other events flowed meanwhile.
            assert self.bookmark_interval is not None
            return min(now + self.bookmark_interval, max(now, end_at - 2.0))

        due = next_bookmark(opened) if bookmarks and self.bookmark_interval is not None else None
        self._poke()
        try:
            while True:
                while watch.queue:
                    item = watch.queue.popleft()
                    if item == "end":
                        return
                    if item == "break":
                        raise _Broken("the connection broke")
                    if item == "freeze":
                        await anyio.sleep_forever()
                    if item in ("bookmark", "initial-events-end"):
                        # A bookmark carries the store's version. The fake's one
                        # counter moves only with its own writes, while a cluster's
                        # revision moves with every write to any resource: it sends
                        # its bookmarks to watches at or below its version, as such
                        # a cluster would, and none to a watch from a version it
                        # has not reached yet (cache_watcher.go process).
                        if not bookmarks or self.version <= watch.after:
                            continue
                        meta: dict[str, Any] = {"resourceVersion": str(self.version)}
                        if item == "initial-events-end":
                            meta["annotations"] = {"k8s.io/initial-events-end": "true"}
                        item = {
                            "type": "BOOKMARK",
                            "object": {
                                "kind": kind_name,
                                "apiVersion": api_version,
                                "metadata": meta,
                            },
                        }
                    assert isinstance(item, dict)
                    yield json.dumps(item).encode() + b"\n"
                now = anyio.current_time()
                if now >= end_at:
                    return
                if due is not None and now >= due:
                    watch.push("bookmark")
                    due = next_bookmark(now) if due < end_at - 2.0 else end_at + 1.0
                    continue
                until = end_at if due is None else min(end_at, due)
                wake = watch.wake
                with anyio.move_on_at(until):
                    await wake.wait()
        finally:
            self._watches.discard(watch)
            self._poke()

    # ------------------------------------------------------------------ adapters
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app (for hypercorn)."""
        request = await read_request(scope, receive, send)
        if request is None:
            return
        received, headers = request.body, request.headers
        query = dict(
            parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        )
        status, body = await self.handle(
            scope["method"],
            unquote(scope["path"]),
            query,
            _bearer(headers),
            bytes(received),
            headers.get("content-type", ""),
        )
        content_type = [(b"content-type", b"application/json")]
        if isinstance(body, dict | PlainAnswer):
            if isinstance(body, PlainAnswer):
                data = body.text.encode()
                content_type = [
                    (b"content-type", b"text/plain; charset=utf-8"),
                    (b"x-content-type-options", b"nosniff"),
                ]
            else:
                data = json.dumps(body).encode()
            extra = [(k.lower().encode(), v.encode()) for k, v in answer_headers(body).items()]
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [
                        *content_type,
                        *extra,
                        (b"content-length", str(len(data)).encode()),
                    ],
                }
            )
            await send({"type": "http.response.body", "body": data})
            return
        await send({"type": "http.response.start", "status": status, "headers": content_type})
        async with anyio.create_task_group() as group:

            async def until_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                group.cancel_scope.cancel()

            group.start_soon(until_disconnect)
            try:
                async for chunk in body:
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except _Broken:
                raise
            finally:
                await body.aclose()  # type: ignore[attr-defined]
            await send({"type": "http.response.body", "body": b""})
            group.cancel_scope.cancel()

    def transport(self) -> httpx.AsyncBaseTransport:
        """An in-process httpx transport (no sockets, no tasks): MockClock friendly.
        Watch bodies stream; a broken watch raises ``httpx.ReadError``."""
        return _FakeTransport(self)

    def watch_requests(self, kind: Kind) -> list[RequestRecord]:
        return [r for r in self.requests if r.path.endswith(kind) and r.query.get("watch")]


def _bearer(headers: dict[str, str]) -> str | None:
    authorization = headers.get("authorization", "")
    if authorization.lower().startswith("bearer "):
        return authorization[7:].strip()
    return None


class _StreamBody(httpx.AsyncByteStream):
    """A watch body for httpx: a plain iterator object (no generator of its own
    to be left unfinished when the client stops reading)."""

    def __init__(self, body: AsyncIterator[bytes]) -> None:
        self._body = body

    def __aiter__(self) -> _StreamBody:
        return self

    async def __anext__(self) -> bytes:
        try:
            return await self._body.__anext__()
        except _Broken as exc:
            raise httpx.ReadError(str(exc)) from exc

    async def aclose(self) -> None:
        await self._body.aclose()  # type: ignore[attr-defined]


class _FakeTransport(httpx.AsyncBaseTransport):
    def __init__(self, fake: KubernetesFake) -> None:
        self._fake = fake

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        query = dict(parse_qsl(request.url.query.decode("latin-1"), keep_blank_values=True))
        headers = {k.lower(): v for k, v in request.headers.items()}
        await anyio.lowlevel.checkpoint()
        status, body = await self._fake.handle(
            request.method,
            unquote(request.url.path),
            query,
            _bearer(headers),
            await request.aread(),
            headers.get("content-type", ""),
        )
        if isinstance(body, PlainAnswer):
            # Go's http.Error: text/plain, nosniff, the text as written.
            headers = {
                "content-type": "text/plain; charset=utf-8",
                "x-content-type-options": "nosniff",
                **answer_headers(body),
            }
            return httpx.Response(
                status, headers=headers, content=body.text.encode(), request=request
            )
        if isinstance(body, dict):
            return httpx.Response(status, json=body, headers=answer_headers(body), request=request)
        return httpx.Response(
            status,
            headers={"content-type": "application/json"},
            stream=_StreamBody(body),
            request=request,
        )


@asynccontextmanager
async def open_kubernetes_fake(**options: Any) -> AsyncIterator[KubernetesFake]:
    """The fake without sockets (use ``fake.transport()``)."""
    yield KubernetesFake(**options)


@asynccontextmanager
async def run_kubernetes_fake(
    *, tls: tuple[str, str] | None = None, **options: Any
) -> AsyncIterator[KubernetesFake]:
    """The fake served by hypercorn on ``127.0.0.1:<ephemeral>`` (``fake.url``);
    ``tls=(certfile, keyfile)`` serves HTTPS."""
    fake = KubernetesFake(**options)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    if tls is not None:
        config.certfile, config.keyfile = tls
    config.accesslog = None
    config.errorlog = None
    config.loglevel = "CRITICAL"
    config.graceful_timeout = 0.1
    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(
            lambda task_status: serve(
                fake,  # type: ignore[arg-type]
                config,
                shutdown_trigger=shutdown.wait,
                task_status=task_status,
            )
        )
        fake.url = binds[0].replace("http://", "https://", 1) if tls is not None else binds[0]
        try:
            yield fake
        finally:
            fake.end_watches()
            shutdown.set()
            nursery.cancel_scope.cancel()
