"""A protocol-faithful Nacos server fake, in-process (ASGI) or served by hypercorn.

It answers like a Nacos naming server as its open-API documentation and its
source (``InstanceController``, ``InstanceOpenApiController``,
``ServiceUtil.selectInstancesWithHealthyProtection``, the auth filter and
``NacosSignatureAlgorithm``) describe, odd parts included:

* v1 (``/v1/ns/instance``, ``/instance/list``, ``/instance/beat``,
  ``/v1/auth/login``) and v3 (``/v3/client/ns/instance``, ``/instance/list``,
  ``/v3/auth/user/login``). Nacos 3.x sorts the v1 paths in two kinds
  (``@Compatibility`` in ``naming/.../controllers/InstanceController.java``,
  enforced by ``core/.../compatibility/ApiCompatibilityFilter.java``): the
  open API (list, register, deregister, beat: ``v1``, on by default,
  ``nacos.core.api.compatibility.client.enabled``) and the admin API (detail
  ``GET``, update ``PUT``, ``PATCH``: ``v1_admin``, *off* by default on 3.x,
  ``...admin.enabled=false``, on for 1.x/2.x servers, i.e. ``v3=False``).
  A kind that is off answers 410 with the ``Result`` JSON (code 40000) as the
  Spring error's message; ``v1_off_status=404`` models an old server.
* Namespaces, groups (``GROUP@@name`` or ``groupName``) and clusters. v1
  register answers text ``ok``; v3 answers ``{"code":0,"message":"success",
  "data":"ok"}``. Instance ids follow the ``simple`` generator
  ``ip#port#cluster#group@@service``. A service holds one instance per
  ``ip:port`` (``IpPortBasedClient``: one client per address publishes one
  instance per service; registering it in another cluster replaces it), and
  one kind: a service of ephemeral instances refuses a persistent one and
  the reverse (``EphemeralClientOperationServiceImpl`` /
  ``PersistentClientOperationServiceImpl``: 400 "Current service ... is
  persistent service, can't register ephemeral instance."), until it is
  empty. Cluster names are ``^[0-9a-zA-Z-]+$`` (``NamingUtils
  .checkInstanceIsLegal``). Booleans are read as ``ConvertUtils.toBoolean``
  reads them: ``true``/``t``/``yes``/``y``/``on`` in any case are true,
  anything else false. Errors: v1 answers the exception's text
  (``naming/.../exception/ResponseExceptionHandler.java``), v3 a ``Result``
  envelope (``core/.../exception/NacosApiExceptionHandler.java``).
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
  every request and background tick), or after the instance metadata's
  ``preserved.heart.beat.timeout`` / ``preserved.ip.delete.timeout`` (ms,
  ``UnhealthyInstanceChecker`` / ``ExpiredInstanceChecker``); the beat
  answer's ``clientBeatInterval`` is its ``preserved.heart.beat.interval``
  (``InstanceOperatorClientImpl.getHeartBeatInterval``). ``lastRefTime`` is
  epoch milliseconds (``epoch`` + the loop clock). Persistent instances have no beat and
  stay until deleted; their health is set by :meth:`set_healthy` (the
  server's own TCP/HTTP probe).
* Auth (``users=``): login with ``username``/``password`` form fields →
  ``{"accessToken","tokenTtl","globalAdmin","username"}``. Tokens are JWTs
  signed with HMAC-SHA256 under ``token_key`` (``NacosJwtParser`` /
  ``NacosSignatureAlgorithm``), stateless: they survive a restart (a new
  fake with the same key), and :meth:`NacosFake.rotate_key` makes every
  issued token fail with ``Invalid signature``. A token comes from the
  ``Authorization: Bearer`` header, the ``accessToken`` header or parameter;
  without one the request's own ``username``/``password`` parameters are
  checked (``AbstractAuthenticationManager.authenticate(request)``). 403
  texts as the source words them: not three dot-separated parts ``token
  invalid!``, an unknown header ``unsupported signature algorithm``, another
  key ``Invalid signature``, past ``exp`` ``token expired!``, no token and no
  matching credentials "User not found! Please check user exist or password
  is right!", a deleted or denied user ``authorization failed!`` (Spring's
  JSON error body with that ``message``). A refused login is a 403. Changing
  a password does not invalidate issued tokens: only expiry does.

Fault injection (:meth:`NacosFake.inject`): status answers, dropped
connections, truncated bodies, hangs, arbitrary bodies. State changes are
synchronous methods taking the time, so tests pin them under trio's
``MockClock``; ``transport()`` runs the app in-process, ``run_nacos_fake``
serves it on a loopback port.
"""

from __future__ import annotations

import base64
import hmac
import json
import re
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

__all__ = ["FakeError", "Fault", "NacosFake", "open_nacos_fake", "run_nacos_fake"]


HEART_BEAT_TIMEOUT = 15.0
IP_DELETE_TIMEOUT = 30.0
CLIENT_BEAT_INTERVAL_MS = 5000
#: ``AbstractAuthenticationManager.USER_NOT_FOUND_MESSAGE``.
LOGIN_FAILED = "User not found! Please check user exist or password is right!"
#: ``PreservedMetadataKeys``: the instance's own heartbeat rules (ms).
PRESERVED_INTERVAL = "preserved.heart.beat.interval"
PRESERVED_TIMEOUT = "preserved.heart.beat.timeout"
PRESERVED_DELETE = "preserved.ip.delete.timeout"
#: ``Constants.CLUSTER_NAME_PATTERN_STRING``.
CLUSTER_NAME = re.compile(r"^[0-9a-zA-Z-]+$")
#: ``ConvertUtils.TRUE_SET`` (compared lower-cased; everything else is false).
TRUE_WORDS = frozenset({"y", "yes", "on", "true", "t"})
#: 2026-01-01T00:00:00Z: the fake's wall clock is ``epoch`` + the loop clock,
#: so MockClock tests stay deterministic while the wire carries epoch times.
DEFAULT_EPOCH = 1_767_225_600.0
#: ``ApiCompatibilityFilter``'s refusal texts (``MESSAGE_REPLACED_API``).
_DEPRECATED = (
    "Current API will be deprecated, please use API(s) `{alternative}` instead, "
    "or set `nacos.core.api.compatibility.{kind}.enabled=true` in application.properties."
)


def to_boolean(value: str | None, default: bool) -> bool:
    """``ConvertUtils.toBoolean(WebUtils.optional(request, name, default))``:
    a missing or blank value is the default; otherwise only a TRUE_SET word
    (any case) is true."""
    if value is None or not value.strip():
        return default
    return value.lower() in TRUE_WORDS


def _b64(data: bytes) -> str:
    # ``Base64.getUrlEncoder().withoutPadding()`` as NacosSignatureAlgorithm uses.
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


_JWT_HEADER = _b64(json.dumps({"alg": "HS256", "typ": "JWT"}, separators=(",", ":")).encode())


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

    def rule(self, key: str, default_ms: float) -> float:
        """A preserved heartbeat rule in seconds (``ConvertUtils.toLong`` of the
        metadata value; a missing or unparsable one is the default)."""
        text = self.metadata.get(key, "")
        return int(text) / 1000 if text.strip().isdigit() else default_ms / 1000


@dataclass
class _Service:
    namespace: str
    group: str
    name: str
    #: None: the service has no metadata record (no protection), as for a
    #: service created by an instance registration.
    protect_threshold: float | None = None
    #: One instance per ``ip:port`` (the cluster is the instance's attribute).
    instances: dict[tuple[str, int], FakeInstance] = field(default_factory=dict)

    @property
    def grouped(self) -> str:
        return f"{self.group}@@{self.name}"


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
        v1_admin: bool | None = None,
        v1_off_status: int = 410,
        users: dict[str, str] | None = None,
        token_ttl: int = 18000,
        token_key: bytes = b"nadisc-fake-nacos-token-secret-key-0123456789",
        epoch: float = DEFAULT_EPOCH,
        cache_millis: int = 10000,
        url: str = "http://nacos.fake:8848",
    ) -> None:
        self.context_path = context_path.rstrip("/")
        self.v1 = v1
        self.v3 = v3
        #: The v1 admin paths: off by default where the v3 API exists (3.x).
        self.v1_admin = (not v3) if v1_admin is None else v1_admin
        self.v1_off_status = v1_off_status
        self.auth = users is not None
        self.users: dict[str, str] = dict(users or {})
        self.denied: set[str] = set()
        self.token_ttl = token_ttl
        self.token_key = token_key
        self.epoch = epoch
        self.cache_millis = cache_millis
        self.services: dict[tuple[str, str, str], _Service] = {}
        self.requests: list[RequestRecord] = []
        self.logins = 0
        self._faults: list[tuple[str, Fault, int]] = []
        self.origin = url
        self._changed = anyio.Event()

    @property
    def url(self) -> str:
        """The base URL with the context path (what ``server_addr`` takes)."""
        return self.origin + self.context_path

    def wall(self, now: float) -> float:
        """The server's wall clock (epoch seconds) at loop time ``now``."""
        return self.epoch + now

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
        """Register (or replace) the instance at ``ip:port``; refused (400,
        ``FakeError``) as the server refuses it: a bad cluster name, heartbeat
        rules out of order, or the other kind than the service holds."""
        instance = FakeInstance(
            ip, port, cluster, weight, healthy, enabled, ephemeral, dict(metadata or {}), now
        )
        if not CLUSTER_NAME.match(cluster):
            raise FakeError(
                400,
                "Instance 'clusterName' should be characters with only 0-9a-zA-Z-. "
                f"(current: {cluster})",
                text=True,
            )
        interval = instance.rule(PRESERVED_INTERVAL, CLIENT_BEAT_INTERVAL_MS)
        if (
            instance.rule(PRESERVED_TIMEOUT, HEART_BEAT_TIMEOUT * 1000) < interval
            or instance.rule(PRESERVED_DELETE, IP_DELETE_TIMEOUT * 1000) < interval
        ):
            raise FakeError(
                400,
                "Instance 'heart beat interval' must less than 'heart beat timeout' "
                "and 'ip delete timeout'.",
                text=True,
            )
        service = self.service(namespace, group, name)
        held = {i.ephemeral for i in service.instances.values() if (i.ip, i.port) != (ip, port)}
        if held and ephemeral not in held:
            kind, other = ("persistent", "ephemeral") if ephemeral else ("ephemeral", "persistent")
            raise FakeError(
                400,
                f"Current service {service.grouped} is {kind} service, "
                f"can't register {other} instance.",
                text=True,
            )
        service.instances[(ip, port)] = instance
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
        """Remove the instance at ``ip:port`` (whatever its cluster, as the
        server's client removes its published instance of the service)."""
        service = self.services.get((namespace, group, name))
        removed = None if service is None else service.instances.pop((ip, port), None)
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
        cluster: str | None = None,
    ) -> FakeInstance | None:
        """The instance at ``ip:port`` (with ``cluster``: only in that cluster)."""
        service = self.services.get((namespace, group, name))
        instance = None if service is None else service.instances.get((ip, port))
        if instance is not None and cluster is not None and instance.cluster != cluster:
            return None
        return instance

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
        instance = self.find(name, ip, port, namespace=namespace, group=group)
        if instance is None or not instance.ephemeral:
            return False
        instance.last_beat = now
        if not instance.healthy:
            instance.healthy = True
            self._poke()
        return True

    def tick(self, now: float) -> None:
        """The heartbeat checkers: unhealthy after the instance's heartbeat
        timeout (15 s), deleted after its delete timeout (30 s)."""
        for service in self.services.values():
            for key, instance in list(service.instances.items()):
                if not instance.ephemeral:
                    continue
                silent = now - instance.last_beat
                if silent > instance.rule(PRESERVED_DELETE, IP_DELETE_TIMEOUT * 1000):
                    del service.instances[key]
                    self._poke()
                elif (
                    silent > instance.rule(PRESERVED_TIMEOUT, HEART_BEAT_TIMEOUT * 1000)
                    and instance.healthy
                ):
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
    def issue_token(self, username: str, now: float) -> str:
        """A JWT as ``NacosJwtParser.jwtBuilder()`` compacts it: ``sub`` and an
        ``exp`` in epoch seconds, HMAC-SHA256 under the current key."""
        exp = int(self.wall(now)) + self.token_ttl
        payload = _b64(json.dumps({"sub": username, "exp": exp}, separators=(",", ":")).encode())
        signed = f"{_JWT_HEADER}.{payload}".encode("ascii")
        return f"{_JWT_HEADER}.{payload}.{_b64(hmac.digest(self.token_key, signed, 'sha256'))}"

    def rotate_key(self, key: bytes) -> None:
        """A new ``nacos.core.auth.plugin.nacos.token.secret.key``: every token
        issued so far fails with ``Invalid signature``."""
        self.token_key = key

    def login(self, username: str | None, password: str | None, now: float) -> dict[str, Any]:
        self.logins += 1
        if not username or not password or self.users.get(username) != password:
            raise FakeError(403, LOGIN_FAILED, text=True)
        return {
            "accessToken": self.issue_token(username, now),
            "tokenTtl": self.token_ttl,
            "globalAdmin": False,
            "username": username,
        }

    def _verify(self, token: str, now: float) -> str:
        """``NacosSignatureAlgorithm.verify``: the user, or AccessException's text."""
        parts = token.split(".")
        if len(parts) != 3:
            raise FakeError(403, "token invalid!")
        header, payload, signature = parts
        if header != _JWT_HEADER:
            raise FakeError(403, "unsupported signature algorithm")
        expected = _b64(hmac.digest(self.token_key, f"{header}.{payload}".encode(), "sha256"))
        if not hmac.compare_digest(expected, signature):
            raise FakeError(403, "Invalid signature")
        claims = json.loads(_unb64(payload))
        if int(claims["exp"]) >= int(self.wall(now)):
            return str(claims["sub"])
        raise FakeError(403, "token expired!")

    def identity(
        self, token: str | None, now: float, query: dict[str, str] | None = None
    ) -> str | None:
        """The auth filter: None when allowed, else the 403 message. Without a
        token, the request's ``username``/``password`` parameters are tried."""
        if not self.auth:
            return None
        query = query or {}
        if token:
            try:
                user = self._verify(token, now)
            except FakeError as refused:
                return str(refused.body)
        else:
            user = query.get("username", "")
            password = query.get("password", "")
            if not user or not password or self.users.get(user) != password:
                return LOGIN_FAILED
        # ``authorize``: a deleted user has no roles left, a denied one no permission.
        if user not in self.users or user in self.denied:
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
            "instanceHeartBeatInterval": int(
                instance.rule(PRESERVED_INTERVAL, CLIENT_BEAT_INTERVAL_MS) * 1000
            ),
            "instanceHeartBeatTimeOut": int(
                instance.rule(PRESERVED_TIMEOUT, HEART_BEAT_TIMEOUT * 1000) * 1000
            ),
            "ipDeleteTimeout": int(
                instance.rule(PRESERVED_DELETE, IP_DELETE_TIMEOUT * 1000) * 1000
            ),
            "instanceIdGenerator": "simple",
        }

    # -------------------------------------------------------------------- ASGI
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = await read_request(scope, receive, send)
        if request is None:
            return
        body, headers = request.body, request.headers
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

    def _gone(self, path: str, kind: str, alternative: str) -> FakeError:
        """``ApiCompatibilityFilter.responseReject``: ``sendError(410, Result JSON)``."""
        result = {
            "code": 40000,
            "message": _DEPRECATED.format(
                alternative=f"{alternative} {self.context_path}", kind=kind
            ),
            "data": None,
        }
        return self._spring_error(410, path, json.dumps(result))

    #: v1 routes by the ``@Compatibility`` kind ``InstanceController`` gives them.
    _V1_OPEN = {
        ("POST", "/v1/ns/instance"): "POST /v3/client/ns/instance",
        ("DELETE", "/v1/ns/instance"): "DELETE /v3/client/ns/instance",
        ("GET", "/v1/ns/instance/list"): "GET /v3/client/ns/instance/list",
        ("PUT", "/v1/ns/instance/beat"): "POST /v3/client/ns/instance?heartBeat=true",
    }
    _V1_ADMIN = {
        ("GET", "/v1/ns/instance"): "GET /v3/admin/ns/instance",
        ("PUT", "/v1/ns/instance"): "PUT /v3/admin/ns/instance",
        ("PATCH", "/v1/ns/instance"): "PUT /v3/admin/ns/instance/partial",
    }

    def _dispatch(
        self, method: str, path: str, query: dict[str, str], token: str | None, now: float
    ) -> tuple[int, Any]:
        if not path.startswith(self.context_path + "/"):
            raise self._spring_error(404, path, "")
        route = path[len(self.context_path) :]
        generation = route.split("/")[1] if route.count("/") >= 1 else ""
        if generation == "v1" and (method, route) in self._V1_ADMIN and not self.v1_admin:
            if self.v3:
                raise self._gone(path, "admin", self._V1_ADMIN[(method, route)])
            raise self._spring_error(self.v1_off_status, path, "api is not supported")
        if generation == "v1" and not self.v1:
            if self.v1_off_status == 410 and (method, route) in self._V1_OPEN:
                raise self._gone(path, "client", self._V1_OPEN[(method, route)])
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
        denied = self.identity(token, now, query)
        if denied is not None:
            raise self._spring_error(403, path, denied)
        if generation != "v3":
            return handler(method, query, now)
        try:
            return handler(method, query, now)
        except FakeError as error:
            if not error.text:
                raise
            # ``NacosApiExceptionHandler``: every v3 error is a Result envelope.
            code = 10000 if "required" in str(error.body) else 20002
            if "service" in str(error.body) and "can't register" in str(error.body):
                code = 30000
            raise FakeError(
                error.status, {"code": code, "message": "parameter error", "data": error.body}
            ) from None

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
        # ``clusterName``, else ``cluster``, else DEFAULT (HttpRequestInstanceBuilder.setCluster).
        return ip, port, query.get("clusterName") or query.get("cluster") or "DEFAULT"

    @staticmethod
    def _weight_and_metadata(query: dict[str, str]) -> tuple[float, dict[str, str]]:
        try:
            weight = float(query.get("weight") or 1.0)
            metadata = json.loads(query["metadata"]) if query.get("metadata") else {}
        except ValueError:
            raise FakeError(400, "instance format invalid", text=True) from None
        if not (0 <= weight <= 10000) or not isinstance(metadata, dict):
            raise FakeError(400, "weight or metadata invalid", text=True)
        return weight, {str(k): str(v) for k, v in metadata.items()}

    @staticmethod
    def _enabled(query: dict[str, str]) -> bool:
        # ``setEnabled``: ``enabled``, else the older ``enable``, else true.
        enabled = query.get("enabled", "")
        if not enabled.strip():
            return to_boolean(query.get("enable"), True)
        return to_boolean(enabled, True)

    def _write_instance(self, method: str, query: dict[str, str], now: float) -> None:
        namespace, group, name = self._names(query)
        ip, port, cluster = self._address(query)
        if method == "DELETE":
            self.deregister(name, ip, port, namespace=namespace, group=group, cluster=cluster)
            return
        weight, metadata = self._weight_and_metadata(query)
        self.register(
            name,
            ip,
            port,
            now=now,
            namespace=namespace,
            group=group,
            cluster=cluster,
            weight=weight,
            healthy=to_boolean(query.get("healthy"), True),
            enabled=self._enabled(query),
            ephemeral=to_boolean(query.get("ephemeral"), True),
            metadata=metadata,
        )

    def _update_instance(self, method: str, query: dict[str, str]) -> None:
        """v1 ``PUT`` (``update``: the request's weight, enabled and metadata
        replace the instance's, defaults for what is missing) and ``PATCH``
        (only the parameters given). Either needs the instance."""
        namespace, group, name = self._names(query)
        ip, port, cluster = self._address(query)
        if (namespace, group, name) not in self.services:
            raise FakeError(
                400, f"service not found, namespace: {namespace}, service: {name}", text=True
            )
        instance = self.find(name, ip, port, namespace=namespace, group=group)
        if instance is None:
            raise FakeError(400, "no matched ip found!", text=True)
        if method == "PUT":
            if not CLUSTER_NAME.match(cluster):
                raise FakeError(400, "Instance 'clusterName' is invalid", text=True)
            instance.weight, instance.metadata = self._weight_and_metadata(query)
            instance.enabled = self._enabled(query)
        else:
            weight, metadata = self._weight_and_metadata(query)
            if query.get("weight"):
                instance.weight = weight
            if query.get("metadata"):
                instance.metadata = metadata
            if query.get("enabled", "").strip() or query.get("enable", "").strip():
                instance.enabled = self._enabled(query)
        self._poke()

    def _v1_instance(self, method: str, query: dict[str, str], now: float) -> tuple[int, Any]:
        if method in ("POST", "DELETE"):
            self._write_instance(method, query, now)
            return 200, "ok"
        if method in ("PUT", "PATCH"):
            self._update_instance(method, query)
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
        healthy_only = to_boolean(query.get("healthyOnly"), False)
        service, hosts, protected, grouped, group = self._listing(query, healthy_only, "clusters")
        return 200, {
            "name": grouped,
            "groupName": group,
            "clusters": query.get("clusters", ""),
            "cacheMillis": self.cache_millis,
            "hosts": [self._instance_json(service, h) for h in hosts] if service else [],
            # ``ServiceInfo.lastRefTime``: ``System.currentTimeMillis()``.
            "lastRefTime": int(self.wall(now) * 1000),
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
            if self.find(name, ip, port, namespace=namespace, group=group) is None:
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
        # ``getHeartBeatInterval``: the instance's preserved interval, else the default.
        instance = self.find(name, ip, port, namespace=namespace, group=group)
        interval = CLIENT_BEAT_INTERVAL_MS
        if instance is not None:
            interval = int(instance.rule(PRESERVED_INTERVAL, CLIENT_BEAT_INTERVAL_MS) * 1000)
        return 200, {
            "clientBeatInterval": interval,
            "code": 10200 if found else 20404,
            "lightBeatEnabled": True,
        }

    def _v3_instance(self, method: str, query: dict[str, str], now: float) -> tuple[int, Any]:
        if method == "POST" and to_boolean(query.get("heartBeat"), False):
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
