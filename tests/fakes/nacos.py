"""A protocol-faithful Nacos server fake, in-process (ASGI) or served by hypercorn.

It answers like a Nacos naming server as its open-API documentation and its
source (``InstanceController``, ``InstanceOpenApiController``,
``ServiceUtil.selectInstancesWithHealthyProtection``, the auth filter and
``NacosSignatureAlgorithm``) describe, odd parts included:

* v1 (``/v1/ns/instance``, ``/instance/list``, ``/instance/beat``,
  ``/v1/auth/login``) and v3 (``/v3/client/ns/instance``, ``/instance/list``,
  ``/v3/auth/user/login``) each switchable off: an API generation that is off
  answers 410 (Nacos 3 with compatibility off) or 404 (older servers that
  never had it), as a Spring JSON error.
* Namespaces, groups (``GROUP@@name`` or ``groupName``) and clusters. v1
  register answers text ``ok``; v3 answers ``{"code":0,"message":"success",
  "data":"ok"}``. Instance ids follow the ``simple`` generator
  ``ip#port#cluster#group@@service``.
* Lists leave disabled instances out. With a service protect threshold set
  (:meth:`NacosFake.set_protect_threshold`; a service without metadata has
  none, as in the source), when ``healthy / listed <= threshold`` every
  listed instance is returned with ``healthy: true`` and, on v1,
  ``reachProtectionThreshold: true`` (v3 returns the bare list: no flag).
  ``healthyOnly=true`` follows the source's quirk (the share is computed
  against the healthy-only list).
* Ephemeral instances: light beats (``PUT /v1/ns/instance/beat`` →
  ``{"clientBeatInterval":5000,"code":10200,"lightBeatEnabled":true}``, code
  ``20404`` when missing; v3 ``POST ?heartBeat=true`` → code ``21003``); a
  full beat (``beat=`` JSON) re-registers a missing instance. An instance
  without beats turns unhealthy after 15 s and is deleted after 30 s
  (``Constants.DEFAULT_HEART_BEAT_TIMEOUT`` / ``DEFAULT_IP_DELETE_TIMEOUT``;
  the server's checker runs every 5 s, the fake applies the rule exactly at
  every request and background tick). Persistent instances have no beat and
  stay until deleted; their health is set by :meth:`set_healthy` (the
  server's own TCP/HTTP probe).
* Auth (``users=``): login with ``username``/``password`` form fields →
  ``{"accessToken","tokenTtl","globalAdmin","username"}``; tokens from the
  ``Authorization: Bearer`` header, the ``accessToken`` header or the query
  parameter; an expired token is a 403 ``token expired!``, an unknown one
  ``token invalid!``, no token or a deleted user ``user not found!``, a
  denied user ``authorization failed!`` (Spring's JSON error body with that
  ``message``). A refused login is a 403. As with Nacos's JWT tokens,
  changing a password does not invalidate issued tokens: only expiry does.

Fault injection (:meth:`NacosFake.inject`): status answers, dropped
connections, truncated bodies, hangs, arbitrary bodies. State changes are
synchronous methods taking the time, so tests pin them under trio's
``MockClock``; ``transport()`` runs the app in-process, ``run_nacos_fake``
serves it on a loopback port.
"""

from __future__ import annotations

import itertools
import json
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

__all__ = ["FakeError", "Fault", "NacosFake", "open_nacos_fake", "run_nacos_fake"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

HEART_BEAT_TIMEOUT = 15.0
IP_DELETE_TIMEOUT = 30.0
CLIENT_BEAT_INTERVAL_MS = 5000
LOGIN_FAILED = "User not found! Please check user exist or password is right!"


class FakeError(Exception):
    """An HTTP error answer: status, body, content type."""

    def __init__(self, status: int, body: Any, *, text: bool = False) -> None:
        super().__init__(str(body))
        self.status = status
        self.body = body
        self.text = text


class _Abort(Exception):
    pass


@dataclass
class Fault:
    """One injected misbehaviour: ``status`` (with ``body``), ``drop``,
    ``truncate``, ``hang`` or ``body`` (200 with ``body``)."""

    kind: Literal["status", "drop", "truncate", "hang", "body"]
    status: int = 500
    body: bytes = b"server error"
    #: Only requests whose ``serviceName`` ends with this (None: every request).
    service: str | None = None


@dataclass
class FakeInstance:
    ip: str
    port: int
    cluster: str
    weight: float = 1.0
    healthy: bool = True
    enabled: bool = True
    ephemeral: bool = True
    metadata: dict[str, str] = field(default_factory=dict)
    last_beat: float = 0.0


@dataclass
class _Service:
    namespace: str
    group: str
    name: str
    #: None: the service has no metadata record (no protection), as for a
    #: service created by an instance registration.
    protect_threshold: float | None = None
    instances: dict[tuple[str, int, str], FakeInstance] = field(default_factory=dict)


@dataclass
class RequestRecord:
    method: str
    path: str
    query: dict[str, str]
    token: str | None
    outcome: str = "open"


class NacosFake:
    """One Nacos server (standalone). See the module docstring."""

    def __init__(
        self,
        *,
        context_path: str = "/nacos",
        v1: bool = True,
        v3: bool = True,
        v1_off_status: int = 410,
        users: dict[str, str] | None = None,
        token_ttl: int = 18000,
        cache_millis: int = 10000,
        url: str = "http://nacos.fake:8848",
    ) -> None:
        self.context_path = context_path.rstrip("/")
        self.v1 = v1
        self.v3 = v3
        self.v1_off_status = v1_off_status
        self.auth = users is not None
        self.users: dict[str, str] = dict(users or {})
        self.denied: set[str] = set()
        self.token_ttl = token_ttl
        self.cache_millis = cache_millis
        self.tokens: dict[str, tuple[str, float]] = {}
        self.services: dict[tuple[str, str, str], _Service] = {}
        self.requests: list[RequestRecord] = []
        self.logins = 0
        self._faults: list[tuple[str, Fault, int]] = []
        self._counter = itertools.count(1)
        self.origin = url
        self._changed = anyio.Event()

    @property
    def url(self) -> str:
        """The base URL with the context path (what ``server_addr`` takes)."""
        return self.origin + self.context_path

    # ----------------------------------------------------------- state (sync)
    def service(self, namespace: str, group: str, name: str) -> _Service:
        key = (namespace, group, name)
        if key not in self.services:
            self.services[key] = _Service(namespace, group, name)
        return self.services[key]

    def register(
        self,
        name: str,
        ip: str,
        port: int,
        *,
        now: float,
        namespace: str = "public",
        group: str = "DEFAULT_GROUP",
        cluster: str = "DEFAULT",
        weight: float = 1.0,
        healthy: bool = True,
        enabled: bool = True,
        ephemeral: bool = True,
        metadata: dict[str, str] | None = None,
    ) -> FakeInstance:
        service = self.service(namespace, group, name)
        instance = FakeInstance(
            ip, port, cluster, weight, healthy, enabled, ephemeral, dict(metadata or {}), now
        )
        service.instances[(ip, port, cluster)] = instance
        self._poke()
        return instance

    def deregister(
        self,
        name: str,
        ip: str,
        port: int,
        *,
        namespace: str = "public",
        group: str = "DEFAULT_GROUP",
        cluster: str = "DEFAULT",
    ) -> bool:
        service = self.services.get((namespace, group, name))
        removed = None if service is None else service.instances.pop((ip, port, cluster), None)
        self._poke()
        return removed is not None

    def find(
        self,
        name: str,
        ip: str,
        port: int,
        *,
        namespace: str = "public",
        group: str = "DEFAULT_GROUP",
        cluster: str = "DEFAULT",
    ) -> FakeInstance | None:
        service = self.services.get((namespace, group, name))
        return None if service is None else service.instances.get((ip, port, cluster))

    def beat(
        self,
        name: str,
        ip: str,
        port: int,
        *,
        now: float,
        namespace: str = "public",
        group: str = "DEFAULT_GROUP",
        cluster: str = "DEFAULT",
    ) -> bool:
        """A light beat: False (code 20404 / 21003) when the instance is gone."""
        instance = self.find(name, ip, port, namespace=namespace, group=group, cluster=cluster)
        if instance is None or not instance.ephemeral:
            return False
        instance.last_beat = now
        if not instance.healthy:
            instance.healthy = True
            self._poke()
        return True

    def tick(self, now: float) -> None:
        """The heartbeat checkers: unhealthy after 15 s, deleted after 30 s."""
        for service in self.services.values():
            for key, instance in list(service.instances.items()):
                if not instance.ephemeral:
                    continue
                silent = now - instance.last_beat
                if silent > IP_DELETE_TIMEOUT:
                    del service.instances[key]
                    self._poke()
                elif silent > HEART_BEAT_TIMEOUT and instance.healthy:
                    instance.healthy = False
                    self._poke()

    def set_protect_threshold(
        self,
        name: str,
        threshold: float,
        *,
        namespace: str = "public",
        group: str = "DEFAULT_GROUP",
    ) -> None:
        self.service(namespace, group, name).protect_threshold = threshold

    def set_enabled(self, name: str, ip: str, port: int, enabled: bool, **where: Any) -> None:
        instance = self.find(name, ip, port, **where)
        assert instance is not None
        instance.enabled = enabled
        self._poke()

    def set_healthy(self, name: str, ip: str, port: int, healthy: bool, **where: Any) -> None:
        instance = self.find(name, ip, port, **where)
        assert instance is not None
        instance.healthy = healthy
        self._poke()

    def select(
        self, service: _Service | None, clusters: set[str], healthy_only: bool
    ) -> tuple[list[FakeInstance], bool]:
        """``ServiceUtil.selectInstancesWithHealthyProtection`` with enableOnly."""
        if service is None:
            return [], False
        hosts: list[FakeInstance] = []
        healthy_count = 0
        for instance in service.instances.values():
            if clusters and instance.cluster not in clusters:
                continue
            if not instance.enabled:
                continue
            if not healthy_only or instance.healthy:
                hosts.append(instance)
            if instance.healthy:
                healthy_count += 1
        threshold = service.protect_threshold
        if threshold is None or not hosts:
            return hosts, False
        if healthy_count / len(hosts) <= max(0.0, threshold):
            copies = [
                FakeInstance(**{**i.__dict__, "healthy": True, "metadata": dict(i.metadata)})
                for i in hosts
            ]
            return copies, True
        return hosts, False

    # ------------------------------------------------------------ auth (sync)
    def login(self, username: str | None, password: str | None, now: float) -> dict[str, Any]:
        self.logins += 1
        if username is None or self.users.get(username) != password or password is None:
            raise FakeError(403, LOGIN_FAILED, text=True)
        token = f"tok-{next(self._counter)}-{username}"
        self.tokens[token] = (username, now + self.token_ttl)
        return {
            "accessToken": token,
            "tokenTtl": self.token_ttl,
            "globalAdmin": False,
            "username": username,
        }

    def identity(self, token: str | None, now: float) -> str | None:
        """The auth filter: None when allowed, else the 403 message."""
        if not self.auth:
            return None
        if not token:
            return "user not found!"
        known = self.tokens.get(token)
        if known is None:
            return "token invalid!"
        user, expires = known
        if now >= expires:
            return "token expired!"
        if user not in self.users:
            return "user not found!"
        if user in self.denied:
            return "authorization failed!"
        return None

    def change_password(self, username: str, password: str) -> None:
        self.users[username] = password

    # ------------------------------------------------------------------ faults
    def inject(self, prefix: str, fault: Fault, *, times: int = 1) -> None:
        self._faults.append((self.context_path + prefix, fault, times))

    def _take_fault(self, path: str, query: dict[str, str]) -> Fault | None:
        for position, (prefix, fault, times) in enumerate(self._faults):
            if fault.service is not None and not query.get("serviceName", "").endswith(
                fault.service
            ):
                continue
            if path.startswith(prefix):
                if times <= 1:
                    del self._faults[position]
                else:
                    self._faults[position] = (prefix, fault, times - 1)
                return fault
        return None

    def _poke(self) -> None:
        changed, self._changed = self._changed, anyio.Event()
        changed.set()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        while not predicate():
            await self._changed.wait()

    # ------------------------------------------------------------------- JSON
    def _instance_json(self, service: _Service, instance: FakeInstance) -> dict[str, Any]:
        grouped = f"{service.group}@@{service.name}"
        return {
            "instanceId": f"{instance.ip}#{instance.port}#{instance.cluster}#{grouped}",
            "ip": instance.ip,
            "port": instance.port,
            "weight": instance.weight,
            "healthy": instance.healthy,
            "enabled": instance.enabled,
            "ephemeral": instance.ephemeral,
            "clusterName": instance.cluster,
            "serviceName": grouped,
            "metadata": instance.metadata,
            "instanceHeartBeatInterval": CLIENT_BEAT_INTERVAL_MS,
            "instanceHeartBeatTimeOut": int(HEART_BEAT_TIMEOUT * 1000),
            "ipDeleteTimeout": int(IP_DELETE_TIMEOUT * 1000),
            "instanceIdGenerator": "simple",
        }

    # -------------------------------------------------------------------- ASGI
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
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
        body = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        query = dict(parse_qsl(scope.get("query_string", b"").decode(), keep_blank_values=True))
        if headers.get("content-type", "").startswith("application/x-www-form-urlencoded"):
            query.update(parse_qsl(body.decode(), keep_blank_values=True))
        token = None
        authorization = headers.get("authorization", "")
        if authorization.startswith("Bearer "):
            token = authorization[7:]
        token = token or headers.get("accesstoken") or query.get("accessToken")
        path = unquote(scope["path"])
        record = RequestRecord(scope["method"], path, query, token)
        self.requests.append(record)
        now = anyio.current_time()
        self.tick(now)
        fault = self._take_fault(path, query)
        try:
            if fault is not None and fault.kind == "hang":
                while (await receive())["type"] != "http.disconnect":
                    pass
                record.outcome = "disconnected"
                return
            if fault is not None and fault.kind in ("status", "body"):
                status = fault.status if fault.kind == "status" else 200
                await self._send(send, status, fault.body, "application/json", None)
                record.outcome = "answered"
                return
            try:
                status, payload = self._dispatch(scope["method"], path, query, token, now)
                text = isinstance(payload, str)
            except FakeError as error:
                status, payload, text = error.status, error.body, error.text
            data = payload.encode() if text else json.dumps(payload).encode()
            content = "text/plain;charset=UTF-8" if text else "application/json"
            await self._send(send, status, data, content, fault)
            record.outcome = "answered"
        except _Abort:
            record.outcome = "aborted"
            raise
        finally:
            if record.outcome == "open":
                record.outcome = "cancelled"

    async def _send(
        self, send: Send, status: int, body: bytes, content: str, fault: Fault | None
    ) -> None:
        declared = len(body)
        if fault is not None and fault.kind in ("truncate", "drop"):
            declared = len(body) * 2 + 16
        headers = [(b"content-type", content.encode()), (b"content-length", str(declared).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        if fault is not None and fault.kind == "drop":
            raise _Abort("dropped")
        if fault is not None and fault.kind == "truncate":
            await send(
                {"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True}
            )
            raise _Abort("truncated")
        await send({"type": "http.response.body", "body": body})

    def _spring_error(self, status: int, path: str, message: str) -> FakeError:
        reason = {403: "Forbidden", 404: "Not Found", 410: "Gone", 400: "Bad Request"}
        return FakeError(
            status,
            {
                "timestamp": "2025-01-01T00:00:00.000+00:00",
                "status": status,
                "error": reason.get(status, "Error"),
                "message": message,
                "path": path,
            },
        )

    def _dispatch(
        self, method: str, path: str, query: dict[str, str], token: str | None, now: float
    ) -> tuple[int, Any]:
        if not path.startswith(self.context_path + "/"):
            raise self._spring_error(404, path, "")
        route = path[len(self.context_path) :]
        generation = route.split("/")[1] if route.count("/") >= 1 else ""
        if generation == "v1" and not self.v1:
            raise self._spring_error(self.v1_off_status, path, "api is not supported")
        if generation == "v3" and not self.v3:
            raise self._spring_error(404, path, "")
        if (method, route) in (("POST", "/v1/auth/login"), ("POST", "/v1/auth/users/login")):
            return 200, self.login(query.get("username"), query.get("password"), now)
        if (method, route) == ("POST", "/v3/auth/user/login"):
            try:
                return 200, self.login(query.get("username"), query.get("password"), now)
            except FakeError:
                raise FakeError(
                    403, {"code": 10001, "message": "access denied", "data": LOGIN_FAILED}
                ) from None
        handlers = {
            "/v1/ns/instance": self._v1_instance,
            "/v1/ns/instance/list": self._v1_list,
            "/v1/ns/instance/beat": self._v1_beat,
            "/v3/client/ns/instance": self._v3_instance,
            "/v3/client/ns/instance/list": self._v3_list,
        }
        handler = handlers.get(route)
        if handler is None:
            raise self._spring_error(404, path, "")
        denied = self.identity(token, now)
        if denied is not None:
            raise self._spring_error(403, path, denied)
        return handler(method, query, now)

    # -- parameter helpers
    @staticmethod
    def _required(query: dict[str, str], name: str) -> str:
        value = query.get(name)
        if not value:
            raise FakeError(400, f"Param '{name}' is required.", text=True)
        return value

    def _names(self, query: dict[str, str]) -> tuple[str, str, str]:
        namespace = query.get("namespaceId") or "public"
        raw = self._required(query, "serviceName")
        if "@@" in raw:
            group, _, name = raw.partition("@@")
        else:
            group, name = query.get("groupName") or "DEFAULT_GROUP", raw
        return namespace, group, name

    def _address(self, query: dict[str, str]) -> tuple[str, int, str]:
        ip = self._required(query, "ip")
        try:
            port = int(self._required(query, "port"))
        except ValueError:
            raise FakeError(400, "port is not a number", text=True) from None
        return ip, port, query.get("clusterName") or "DEFAULT"

    def _write_instance(self, method: str, query: dict[str, str], now: float) -> None:
        namespace, group, name = self._names(query)
        ip, port, cluster = self._address(query)
        if method == "DELETE":
            self.deregister(name, ip, port, namespace=namespace, group=group, cluster=cluster)
            return
        try:
            weight = float(query.get("weight") or 1.0)
            metadata = json.loads(query["metadata"]) if query.get("metadata") else {}
        except ValueError:
            raise FakeError(400, "instance format invalid", text=True) from None
        if not (0 <= weight <= 10000) or not isinstance(metadata, dict):
            raise FakeError(400, "weight or metadata invalid", text=True)
        self.register(
            name,
            ip,
            port,
            now=now,
            namespace=namespace,
            group=group,
            cluster=cluster,
            weight=weight,
            healthy=query.get("healthy", "true") != "false",
            enabled=query.get("enabled", query.get("enable", "true")) != "false",
            ephemeral=query.get("ephemeral", "true") != "false",
            metadata={str(k): str(v) for k, v in metadata.items()},
        )

    def _v1_instance(self, method: str, query: dict[str, str], now: float) -> tuple[int, Any]:
        if method in ("POST", "DELETE"):
            self._write_instance(method, query, now)
            return 200, "ok"
        if method == "GET":
            namespace, group, name = self._names(query)
            ip, port, cluster = self._address(query)
            instance = self.find(name, ip, port, namespace=namespace, group=group, cluster=cluster)
            if instance is None:
                raise FakeError(404, "no matched ip found!", text=True)
            service = self.services[(namespace, group, name)]
            full = self._instance_json(service, instance)
            return 200, {
                "service": f"{group}@@{name}",
                "ip": ip,
                "port": port,
                "clusterName": cluster,
                "weight": instance.weight,
                "healthy": instance.healthy,
                "instanceId": full["instanceId"],
                "metadata": instance.metadata,
            }
        raise FakeError(405, "method not allowed", text=True)

    def _listing(self, query: dict[str, str], healthy_only: bool, clusters_key: str) -> Any:
        namespace, group, name = self._names(query)
        clusters = {c for c in (query.get(clusters_key) or "").split(",") if c}
        service = self.services.get((namespace, group, name))
        hosts, protected = self.select(service, clusters, healthy_only)
        assert service is not None or not hosts
        return service, hosts, protected, f"{group}@@{name}", group

    def _v1_list(self, method: str, query: dict[str, str], now: float) -> tuple[int, Any]:
        healthy_only = query.get("healthyOnly", "false").lower() == "true"
        service, hosts, protected, grouped, group = self._listing(query, healthy_only, "clusters")
        return 200, {
            "name": grouped,
            "groupName": group,
            "clusters": query.get("clusters", ""),
            "cacheMillis": self.cache_millis,
            "hosts": [self._instance_json(service, h) for h in hosts] if service else [],
            "lastRefTime": int(now * 1000),
            "checksum": "",
            "allIPs": False,
            "reachProtectionThreshold": protected,
            "valid": True,
        }

    def _v1_beat(self, method: str, query: dict[str, str], now: float) -> tuple[int, Any]:
        if method != "PUT":
            raise FakeError(405, "method not allowed", text=True)
        namespace, group, name = self._names(query)
        full = query.get("beat")
        if full:
            info = json.loads(full)
            ip, port = str(info["ip"]), int(info["port"])
            cluster = str(info.get("cluster") or query.get("clusterName") or "DEFAULT")
            if self.find(name, ip, port, namespace=namespace, group=group, cluster=cluster) is None:
                self.register(
                    name,
                    ip,
                    port,
                    now=now,
                    namespace=namespace,
                    group=group,
                    cluster=cluster,
                    weight=float(info.get("weight", 1.0)),
                    metadata=info.get("metadata") or {},
                )
        else:
            ip, port, cluster = self._address(query)
        found = self.beat(
            name, ip, port, now=now, namespace=namespace, group=group, cluster=cluster
        )
        return 200, {
            "clientBeatInterval": CLIENT_BEAT_INTERVAL_MS,
            "code": 10200 if found else 20404,
            "lightBeatEnabled": True,
        }

    def _v3_instance(self, method: str, query: dict[str, str], now: float) -> tuple[int, Any]:
        if method == "POST" and query.get("heartBeat", "false") == "true":
            namespace, group, name = self._names(query)
            ip, port, cluster = self._address(query)
            if not self.beat(
                name, ip, port, now=now, namespace=namespace, group=group, cluster=cluster
            ):
                return 200, {"code": 21003, "message": "instance not found", "data": None}
            return 200, {"code": 0, "message": "success", "data": "ok"}
        if method in ("POST", "DELETE"):
            if "@@" in query.get("serviceName", ""):
                return 400, {"code": 21000, "message": "service name error", "data": None}
            self._write_instance(method, query, now)
            return 200, {"code": 0, "message": "success", "data": "ok"}
        raise FakeError(405, "method not allowed", text=True)

    def _v3_list(self, method: str, query: dict[str, str], now: float) -> tuple[int, Any]:
        service, hosts, _, _, _ = self._listing(query, False, "clusterName")
        data = [self._instance_json(service, h) for h in hosts] if service else []
        return 200, {"code": 0, "message": "success", "data": data}

    # ---------------------------------------------------------------- helpers
    def transport(self) -> httpx.AsyncBaseTransport:
        """An in-process transport (no sockets): works under trio's MockClock."""
        return httpx.ASGITransport(app=self, raise_app_exceptions=False)

    def count(self, route: str, method: str | None = None) -> int:
        path = self.context_path + route
        return sum(1 for r in self.requests if r.path == path and method in (None, r.method))

    async def run_background(
        self,
        *,
        tick: float = 0.5,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """The heartbeat checkers between requests, until cancelled."""
        task_status.started()
        while True:
            self.tick(anyio.current_time())
            await anyio.sleep(tick)


@asynccontextmanager
async def open_nacos_fake(**options: Any) -> AsyncIterator[NacosFake]:
    """The fake without sockets (``fake.transport()``), with its checker task."""
    fake = NacosFake(**options)
    async with anyio.create_task_group() as group:
        await group.start(fake.run_background)
        try:
            yield fake
        finally:
            group.cancel_scope.cancel()


@asynccontextmanager
async def run_nacos_fake(**options: Any) -> AsyncIterator[NacosFake]:
    """The fake served by hypercorn on ``127.0.0.1:<ephemeral>`` (trio only)."""
    fake = NacosFake(**options)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.errorlog = None
    config.loglevel = "CRITICAL"
    config.graceful_timeout = 0.1
    # Tomcat (Nacos's server) keeps idle connections for 60 s; hypercorn's 5 s
    # default would race every 5 s heartbeat on a kept-alive connection.
    config.keep_alive_timeout = 60
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
        fake.origin = binds[0]
        await nursery.start(fake.run_background)
        try:
            yield fake
        finally:
            shutdown.set()
            nursery.cancel_scope.cancel()
