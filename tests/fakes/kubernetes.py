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
* Compaction: the history keeps ``window`` events; :meth:`compact` drops all
  of it. :meth:`expire_watches` makes every open watch end with a 410
  ERROR event (what a watch whose cache position was compacted receives).
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
import uuid
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote

import anyio
import httpx
import trio
from hypercorn.config import Config
from hypercorn.trio import serve

__all__ = [
    "KubernetesFake",
    "open_kubernetes_fake",
    "run_kubernetes_fake",
    "slice_object",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
Kind = Literal["services", "endpointslices"]

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
MANAGED_BY_LABEL = "endpointslice.kubernetes.io/managed-by"
_KINDS: dict[Kind, tuple[str, str, str]] = {
    # resource: (kind, apiVersion, group for RBAC messages)
    "services": ("Service", "v1", ""),
    "endpointslices": ("EndpointSlice", "discovery.k8s.io/v1", "discovery.k8s.io"),
}
DEFAULT_WATCH_TIMEOUT = 1800.0


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


class ApiError(Exception):
    def __init__(
        self, code: int, reason: str, message: str, details: dict[str, Any] | None = None
    ) -> None:
        super().__init__(message)
        self.body = status_object(code, reason, message, details)
        self.code = code


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
    fields: dict[str, str]
    labels: dict[str, str]
    queue: deque[dict[str, Any] | str] = field(default_factory=deque)
    wake: anyio.Event = field(default_factory=anyio.Event)

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
    ) -> dict[str, Any]:
        """Create (or replace) a ClusterIP Service; returns the stored object."""
        key = (namespace, name)
        exists = key in self.objects["services"]
        meta: dict[str, Any] = {"name": name}
        if uid is not None:
            meta["uid"] = uid
        body = {
            "metadata": meta,
            "spec": {
                "type": "ClusterIP",
                "clusterIP": "10.96.0.10",
                "ports": ports
                if ports is not None
                else [{"name": "http", "port": 80, "targetPort": 8080, "protocol": "TCP"}],
            },
            "status": {"loadBalancer": {}},
        }
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
        """RBAC: ``user`` may no longer ``verb`` ``resource`` ("*": any)."""
        self.denied.setdefault(user, set()).add((verb, resource))

    def allow(self, user: str) -> None:
        self.denied.pop(user, None)

    # ------------------------------------------------------------------ serving
    def _authorize(
        self, token: str | None, verb: str, resource: Kind, namespace: str | None
    ) -> None:
        if self.tokens is None:
            user = "system:anonymous"
        else:
            found = self.tokens.get(token or "")
            if found is None:
                raise ApiError(401, "Unauthorized", "Unauthorized")
            user = found
        denied = self.denied.get(user, set())
        if {(verb, resource), ("*", resource), (verb, "*"), ("*", "*")} & denied:
            group = _KINDS[resource][2]
            scope = (
                f' in the namespace "{namespace}"'
                if namespace is not None
                else " at the cluster scope"
            )
            raise ApiError(
                403,
                "Forbidden",
                f'{resource}{"." + group if group else ""} is forbidden: User "{user}" cannot '
                f'{verb} resource "{resource}" in API group "{group}"{scope}',
                {"group": group, "kind": resource},
            )

    def _matches(
        self,
        obj: dict[str, Any],
        namespace: str | None,
        fields: dict[str, str],
        labels: dict[str, str],
    ) -> bool:
        meta = obj["metadata"]
        if namespace is not None and meta["namespace"] != namespace:
            return False
        for name, value in fields.items():
            actual = meta["name"] if name == "metadata.name" else meta["namespace"]
            if actual != value:
                return False
        own = meta.get("labels", {})
        return all(own.get(k) == v for k, v in labels.items())

    def _deliver(self, watch: _Watch, event: _Event) -> None:
        if event.kind != watch.kind:
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
    def _selectors(query: dict[str, str]) -> tuple[dict[str, str], dict[str, str]]:
        def parse(text: str, what: str) -> dict[str, str]:
            out: dict[str, str] = {}
            for part in filter(None, text.split(",")):
                key, sep, value = part.partition("==") if "==" in part else part.partition("=")
                if not sep or not key.strip():
                    raise ApiError(400, "BadRequest", f"unable to parse requirement: {part!r}")
                out[key.strip()] = value.strip()
            return out

        fields = parse(query.get("fieldSelector", ""), "field")
        for name in fields:
            if name not in ("metadata.name", "metadata.namespace"):
                raise ApiError(400, "BadRequest", f"field label not supported: {name}")
        return fields, parse(query.get("labelSelector", ""), "label")

    def _list(self, kind: Kind, namespace: str | None, query: dict[str, str]) -> dict[str, Any]:
        fields, labels = self._selectors(query)
        token = query.get("continue", "")
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
        else:
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
            version = {"groupVersion": "discovery.k8s.io/v1", "version": "v1"}
            return {
                "kind": "APIGroupList",
                "apiVersion": "v1",
                "groups": [
                    {"name": "discovery.k8s.io", "versions": [version], "preferredVersion": version}
                ],
            }

        def resource(name: str, kind: str, short: list[str] | None = None) -> dict[str, Any]:
            entry: dict[str, Any] = {
                "name": name,
                "singularName": kind.lower(),
                "namespaced": True,
                "kind": kind,
                "verbs": ["get", "list", "watch"],
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
        return None

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
        self, method: str, path: str, query: dict[str, str], token: str | None
    ) -> tuple[int, dict[str, Any] | AsyncIterator[bytes]]:
        """Serve one request: (status, JSON body or a streamed watch body)."""
        record = RequestRecord(method, path, query, token)
        self.requests.append(record)
        self._poke()
        try:
            for prefix, codes in self.fail_next.items():
                if path.startswith(prefix) and codes:
                    code = codes.pop(0)
                    raise ApiError(
                        code, "InternalError" if code >= 500 else "Unknown", f"injected {code}"
                    )
            if method != "GET":
                raise ApiError(405, "MethodNotAllowed", f"the server does not allow {method} here")
            document = self._discovery(path)
            if document is not None:
                record.status = 200
                return 200, document
            route = self._route(path)
            if route is None:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            kind, namespace, name = route
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
                    fields["metadata.name"] = name
                return self._open_watch(kind, namespace, fields, labels, query, record)
            record.status = 200
            return 200, self._list(kind, namespace, query)
        except ApiError as error:
            record.status = error.code
            return error.code, error.body
        finally:
            self._poke()

    def _open_watch(
        self,
        kind: Kind,
        namespace: str | None,
        fields: dict[str, str],
        labels: dict[str, str],
        query: dict[str, str],
        record: RequestRecord,
    ) -> tuple[int, dict[str, Any] | AsyncIterator[bytes]]:
        raw_version = query.get("resourceVersion", "")
        watch = _Watch(kind, namespace, fields, labels)
        if raw_version in ("", "0"):
            for obj in sorted(self.objects[kind].values(), key=lambda o: o["metadata"]["name"]):
                if self._matches(obj, namespace, fields, labels):
                    watch.push({"type": "ADDED", "object": obj})
        else:
            if not raw_version.isdigit():
                raise ApiError(400, "BadRequest", f"invalid resource version: {raw_version}")
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
        end_at = anyio.current_time() + timeout
        self._poke()
        try:
            while True:
                while watch.queue:
                    item = watch.queue.popleft()
                    if item == "end":
                        return
                    if item == "break":
                        raise _Broken("the connection broke")
                    if item == "bookmark":
                        if not bookmarks:
                            continue
                        item = {
                            "type": "BOOKMARK",
                            "object": {
                                "kind": kind_name,
                                "apiVersion": api_version,
                                "metadata": {"resourceVersion": str(self.version)},
                            },
                        }
                    assert isinstance(item, dict)
                    yield json.dumps(item).encode() + b"\n"
                now = anyio.current_time()
                if now >= end_at:
                    return
                until = end_at
                if bookmarks and self.bookmark_interval is not None:
                    until = min(until, now + self.bookmark_interval)
                wake = watch.wake
                with anyio.move_on_at(until):
                    await wake.wait()
                if (
                    not watch.queue
                    and bookmarks
                    and self.bookmark_interval is not None
                    and anyio.current_time() < end_at
                ):
                    watch.push("bookmark")
        finally:
            self._watches.discard(watch)
            self._poke()

    # ------------------------------------------------------------------ adapters
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """The ASGI app (for hypercorn)."""
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        if scope["type"] != "http":
            return
        while True:
            message = await receive()
            if message["type"] == "http.disconnect" or not message.get("more_body"):
                break
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        query = dict(
            parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        )
        status, body = await self.handle(
            scope["method"], unquote(scope["path"]), query, _bearer(headers)
        )
        content_type = [(b"content-type", b"application/json")]
        if isinstance(body, dict):
            data = json.dumps(body).encode()
            await send(
                {
                    "type": "http.response.start",
                    "status": status,
                    "headers": [*content_type, (b"content-length", str(len(data)).encode())],
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
            request.method, unquote(request.url.path), query, _bearer(headers)
        )
        if isinstance(body, dict):
            return httpx.Response(status, json=body, request=request)
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
