"""A protocol-faithful Consul agent fake, served on loopback by hypercorn on trio.

It behaves like a single Consul agent (one server, one datacenter) as its
HTTP API documentation describes, odd parts included:

* ``/v1/agent/service/register`` upserts a service with ``Check``/``Checks``
  (HTTP + Interval, TCP, TTL, DeregisterCriticalServiceAfter clamped to the
  one-minute minimum, CheckID, Status); ``/v1/agent/service/deregister/<id>``
  is a no-op when absent; TTL checks move through
  ``/v1/agent/check/{pass,warn,fail,update}/<check id>`` and expire to
  critical; HTTP and TCP checks are really performed on their interval, and
  with ``FailuresBeforeCritical: N`` a failed probe turns the check critical
  only as the N-th failure in a row (until then its status and output stay
  as they were; a passing or warning probe resets the count); a
  reaper (every ``reap_interval``, 30 s like Consul) removes services critical
  for longer than DeregisterCriticalServiceAfter.
* Each node carries a ``serfHealth`` check; ``?passing`` drops an entry when
  any of its checks, the node's included, is not passing.
* Reads answer with the documented shapes (``[]``, never ``null``), the
  ``X-Consul-Index``/``KnownLeader``/``LastContact`` headers, and block on
  ``index`` + ``wait`` (default 5 min, cap 10 min, jitter up to wait/16),
  returning early when that endpoint's index moves. A bad ``wait`` or
  ``index`` is a 400 with a plain-text body.
* ACLs (off until :meth:`ConsulFake.enable_acl`): tokens from
  ``X-Consul-Token`` or ``Authorization: Bearer``. As in Consul, reads are
  *filtered*, not denied: ``/v1/health/service``, ``/v1/health/checks``,
  ``/v1/health/state`` and ``/v1/catalog/services`` leave out what the token
  may not read and, when they left something out, answer 200 with the header
  ``X-Consul-Results-Filtered-By-ACLs: true``. An unknown (or deleted)
  token is a 403 ``ACL not found`` on every endpoint; a write without
  ``service:write`` is a 403 ``Permission denied: ...`` (plain text).

Fault injection (:meth:`ConsulFake.inject`): status codes, dropped
connections, truncated bodies (Content-Length larger than what is sent, then
the connection closes), slow bodies, hanging answers, arbitrary bodies,
missing/non-numeric/zero index headers; plus :meth:`ConsulFake.reset_index`
(the index goes backwards, as after a snapshot restore) and token revocation.

State changes are synchronous methods that take the time as an argument, so
the tests pin them under trio's ``MockClock`` without sockets; the same
object is the ASGI app (``open_consul_fake`` runs it in-process through
``httpx.ASGITransport``, ``run_consul_fake`` serves it on a real port).
"""

from __future__ import annotations

import json
import random
import re
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import parse_qsl, unquote

import anyio
import httpx
from hypercorn.config import Config

from tests.support_http import serve_app, stop_serving

from ._asgi import Receive, Scope, Send, read_request

__all__ = [
    "ConsulFake",
    "FakeError",
    "Fault",
    "open_consul_fake",
    "parse_go_duration",
    "run_consul_fake",
]


DEFAULT_WAIT = 300.0
MAX_WAIT = 600.0
STATUSES = ("passing", "warning", "critical")
_META_KEY = re.compile(r"^[A-Za-z0-9_-]+$")
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")
_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_go_duration(text: str) -> float:
    """Go's ``time.ParseDuration`` (seconds); ValueError when Go would refuse."""
    if text == "0":
        return 0.0
    position, total = 0, 0.0
    if not text:
        raise ValueError("empty")
    while position < len(text):
        match = _DURATION.match(text, position)
        if match is None:
            raise ValueError(text)
        total += float(match.group(1)) * _UNITS[match.group(2)]
        position = match.end()
    return total


class FakeError(Exception):
    """An HTTP error answer: status and plain-text body."""

    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status
        self.text = text


class _AbortConnection(Exception):
    """Raised inside the app to make the server close the connection."""


@dataclass
class Fault:
    """One injected misbehaviour, applied to the next matching request(s).

    kind:
      ``status``     answer ``status`` with ``body`` (plain text)
      ``drop``       headers promise a body, the connection closes before it
      ``truncate``   Content-Length larger than what is sent, then close
      ``slow``       the real answer in 8 pieces, each followed by ``delay`` (so an
                     empty body still ends 8 * ``delay`` after its headers)
      ``hang``       never answer
      ``body``       answer 200 with ``body`` (and ``index`` if given)
      ``no_index``   the real answer without X-Consul-Index
      ``index``      the real answer with X-Consul-Index set to ``index``
    """

    kind: Literal["status", "drop", "truncate", "slow", "hang", "body", "no_index", "index"]
    status: int = 500
    body: bytes = b""
    delay: float = 0.0
    index: str | None = None


@dataclass
class _Node:
    name: str
    address: str
    node_id: str
    create_index: int
    modify_index: int
    # Agent ``node_meta``: Consul's structs.Node.Meta (agent/structs/structs.go),
    # returned under Node.Meta by /v1/health/service and /v1/catalog/nodes.
    meta: dict[str, str] = field(default_factory=dict)


@dataclass
class _Service:
    node: str
    id: str
    name: str
    tags: list[str]
    address: str
    port: int
    meta: dict[str, str]
    weights: dict[str, int]
    tagged_addresses: dict[str, Any]
    definition: dict[str, Any]
    create_index: int
    modify_index: int


@dataclass
class _Check:
    node: str
    check_id: str
    name: str
    service_id: str
    service_name: str
    kind: str  # "serf", "http", "tcp", "ttl", "script"
    status: str
    output: str
    definition: dict[str, Any]
    create_index: int
    modify_index: int
    interval: float | None = None
    ttl: float | None = None
    target: str | None = None
    timeout: float = 10.0
    deregister_after: float | None = None
    critical_since: float | None = None
    ttl_expires: float | None = None
    next_run: float | None = None
    running: bool = False
    failures_before_critical: int = 0
    failures: int = 0


@dataclass
class _Token:
    accessor: str
    read: tuple[str, ...]
    write: tuple[str, ...]


@dataclass
class _Injected:
    prefix: str
    fault: Fault
    remaining: int


@dataclass
class RequestRecord:
    method: str
    path: str
    query: dict[str, str]
    token: str | None
    outcome: str = "open"  # "open", "answered", "disconnected", "aborted"


class ConsulFake:
    """The fake agent: state, control methods and the ASGI app (``__call__``)."""

    def __init__(
        self,
        *,
        node: str = "fake-node-1",
        address: str = "127.0.0.1",
        datacenter: str = "dc1",
        reap_interval: float = 30.0,
        min_deregister_after: float = 60.0,
        seed: int = 0,
        perform_checks: bool = True,
        consul_service: bool = True,
    ) -> None:
        self.datacenter = datacenter
        self.agent_node = node
        self.reap_interval = reap_interval
        self.min_deregister_after = min_deregister_after
        self.perform_checks = perform_checks
        self.url = "http://consul.fake"
        self._random = random.Random(seed)
        self.index = 1
        self.nodes: dict[str, _Node] = {}
        self.services: dict[tuple[str, str], _Service] = {}
        self.checks: dict[tuple[str, str], _Check] = {}
        self._service_tombstones: dict[str, int] = {}
        self._services_index = 1
        self._checks_index = 1
        self._next_reap: float | None = None
        self._changed = anyio.Event()
        self._activity = anyio.Event()
        self._faults: list[_Injected] = []
        self.acl_enabled = False
        self._tokens: dict[str, _Token] = {}
        self.requests: list[RequestRecord] = []
        self.add_node(node, address)
        if consul_service:
            # A server agent lists itself as the "consul" service (port 8300).
            self.register({"Name": "consul", "ID": "consul", "Port": 8300}, now=0.0)

    # ------------------------------------------------------------------ state
    def _bump(self) -> int:
        self.index += 1
        return self.index

    def _notify(self) -> None:
        event, self._changed = self._changed, anyio.Event()
        event.set()
        self._poke()

    def _poke(self) -> None:
        event, self._activity = self._activity, anyio.Event()
        event.set()

    async def wait_for(self, predicate: Callable[[], bool]) -> None:
        """Wait until ``predicate()`` holds, re-checking after every state
        change and every request outcome (bound it with a timeout)."""
        while not predicate():
            await self._activity.wait()

    def add_node(self, name: str, address: str, meta: Mapping[str, str] | None = None) -> None:
        """Add a node with a passing ``serfHealth`` check and the agent's ``node_meta``."""
        node_meta = dict(meta or {})
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in node_meta.items()):
            raise TypeError("node meta must map strings to strings")
        index = self._bump()
        self.nodes[name] = _Node(
            name,
            address,
            str(uuid.UUID(int=self._random.getrandbits(128))),
            index,
            index,
            node_meta,
        )
        self.checks[(name, "serfHealth")] = _Check(
            node=name,
            check_id="serfHealth",
            name="Serf Health Status",
            service_id="",
            service_name="",
            kind="serf",
            status="passing",
            output="Agent alive and reachable",
            definition={},
            create_index=index,
            modify_index=index,
        )
        self._checks_index = index
        self._notify()

    def set_node_health(self, status: str, *, node: str | None = None, now: float = 0.0) -> None:
        """Set a node's ``serfHealth`` status (``critical``: the agent is gone)."""
        self._set_status(
            self.checks[(node or self.agent_node, "serfHealth")],
            status,
            "Agent not live or unreachable"
            if status == "critical"
            else "Agent alive and reachable",
            now,
        )

    def register(self, payload: Any, *, now: float, node: str | None = None) -> None:
        """``PUT /v1/agent/service/register`` semantics (FakeError 400 on bad input)."""
        node_name = node or self.agent_node
        if node_name not in self.nodes:
            raise FakeError(400, f"Unknown node {node_name!r}")
        if not isinstance(payload, dict):
            raise FakeError(400, "Request decode failed: expected an object")
        name = payload.get("Name")
        if not isinstance(name, str) or not name:
            raise FakeError(400, "Missing service name")
        service_id = payload.get("ID") or name
        if not isinstance(service_id, str):
            raise FakeError(400, "Request decode failed: ID")
        tags = payload.get("Tags") or []
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise FakeError(400, "Request decode failed: Tags")
        address = payload.get("Address") or ""
        port = payload.get("Port", 0)
        if not isinstance(address, str) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise FakeError(400, "Request decode failed: Address/Port")
        meta = payload.get("Meta") or {}
        if not isinstance(meta, dict):
            raise FakeError(400, "Request decode failed: Meta")
        if len(meta) > 64:
            raise FakeError(
                400,
                "Invalid Service Meta: Node metadata cannot contain more than 64 key/value pairs",
            )
        for key, value in meta.items():
            if not _META_KEY.match(key) or len(key) > 128:
                raise FakeError(
                    400, f"Invalid Service Meta: Key contains invalid characters: {key!r}"
                )
            if key.startswith("consul-"):
                raise FakeError(
                    400, f"Invalid Service Meta: Key prefix 'consul-' is reserved: {key!r}"
                )
            if not isinstance(value, str) or len(value) > 512:
                raise FakeError(400, f"Invalid Service Meta: Value is too long for key {key!r}")
        weights = payload.get("Weights") or {"Passing": 1, "Warning": 1}
        if not isinstance(weights, dict):
            raise FakeError(400, "Request decode failed: Weights")
        passing = weights.get("Passing", 1)
        warning = weights.get("Warning", 1)
        if not isinstance(passing, int) or passing < 1:
            raise FakeError(400, "Invalid Weights: Passing must be greater than 0")
        raw_checks: list[Any] = []
        if payload.get("Check"):
            raw_checks.append(payload["Check"])
        if payload.get("Checks"):
            if not isinstance(payload["Checks"], list):
                raise FakeError(400, "Request decode failed: Checks")
            raw_checks.extend(payload["Checks"])
        parsed = [
            self._parse_check(raw, service_id, name, node_name, position, len(raw_checks))
            for position, raw in enumerate(raw_checks, start=1)
        ]
        definition = {
            "Name": name,
            "Tags": tags,
            "Address": address,
            "Port": port,
            "Meta": meta,
            "Weights": {"Passing": passing, "Warning": warning},
        }
        key = (node_name, service_id)
        existing = self.services.get(key)
        changed = existing is None or existing.definition != definition
        if changed:
            index = self._bump()
            if existing is not None and existing.name != name:
                self._service_tombstones[existing.name.lower()] = index
            tagged: dict[str, Any] = {}
            if address:
                tagged = {
                    "lan_ipv4": {"Address": address, "Port": port},
                    "wan_ipv4": {"Address": address, "Port": port},
                }
            self.services[key] = _Service(
                node=node_name,
                id=service_id,
                name=name,
                tags=list(tags),
                address=address,
                port=port,
                meta=dict(meta),
                weights={"Passing": passing, "Warning": warning},
                tagged_addresses=tagged,
                definition=definition,
                create_index=existing.create_index if existing else index,
                modify_index=index,
            )
            self._services_index = index
        # Checks: keep the status of an unchanged definition, replace the rest,
        # and drop the service's checks the new definition no longer has.
        wanted = {c["check_id"]: c for c in parsed}
        for check_key, check in list(self.checks.items()):
            if (
                check.node == node_name
                and check.service_id == service_id
                and check.check_id not in wanted
            ):
                del self.checks[check_key]
                self._checks_index = self._bump()
        for check_id, spec in wanted.items():
            current = self.checks.get((node_name, check_id))
            if current is not None and current.definition == spec["definition"]:
                continue
            index = self._bump()
            check = _Check(
                node=node_name,
                check_id=check_id,
                name=spec["name"],
                service_id=service_id,
                service_name=name,
                kind=spec["kind"],
                status=spec["status"],
                output="",
                definition=spec["definition"],
                create_index=index,
                modify_index=index,
                interval=spec["interval"],
                ttl=spec["ttl"],
                target=spec["target"],
                timeout=spec["timeout"],
                deregister_after=spec["deregister_after"],
                failures_before_critical=spec["failures_before_critical"],
            )
            if check.status == "critical":
                check.critical_since = now
            if check.kind == "ttl" and check.ttl is not None:
                check.ttl_expires = now + check.ttl
            if check.kind in ("http", "tcp"):
                check.next_run = now
            self.checks[(node_name, check_id)] = check
            self._checks_index = index
        self._notify()

    def _parse_check(
        self, raw: Any, service_id: str, service_name: str, node: str, position: int, count: int
    ) -> dict[str, Any]:
        if not isinstance(raw, dict):
            raise FakeError(400, "Request decode failed: Check")
        check_id = (
            raw.get("CheckID")
            or raw.get("ID")
            or (f"service:{service_id}" if count == 1 else f"service:{service_id}:{position}")
        )
        status = raw.get("Status") or "critical"
        if status not in STATUSES:
            raise FakeError(
                400, f"Status for checks must 'passing', 'warning', 'critical', got {status!r}"
            )

        def duration(field_name: str) -> float | None:
            value = raw.get(field_name)
            if value in (None, ""):
                return None
            try:
                return parse_go_duration(str(value))
            except ValueError:
                raise FakeError(
                    400, f"Request decode failed: time: invalid duration {value!r}"
                ) from None

        interval = duration("Interval")
        ttl = duration("TTL")
        timeout = duration("Timeout") or 10.0
        deregister_after = duration("DeregisterCriticalServiceAfter")
        if deregister_after is not None:
            deregister_after = max(deregister_after, self.min_deregister_after)
        if raw.get("HTTP"):
            kind, target = "http", str(raw["HTTP"])
        elif raw.get("TCP"):
            kind, target = "tcp", str(raw["TCP"])
        elif ttl is not None:
            kind, target = "ttl", None
        else:
            raise FakeError(400, "Check is not valid: one of HTTP, TCP or TTL is required")
        if kind in ("http", "tcp") and (interval is None or interval <= 0):
            raise FakeError(400, f"Check is not valid: {kind.upper()} checks require an Interval")
        threshold = raw.get("FailuresBeforeCritical", 0)
        if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 0:
            raise FakeError(400, "Request decode failed: FailuresBeforeCritical")
        definition = {k: raw.get(k) for k in sorted(raw) if k != "Status"}
        return {
            "check_id": check_id,
            "name": raw.get("Name") or f"Service '{service_name}' check",
            "kind": kind,
            "status": status,
            "interval": interval,
            "ttl": ttl,
            "target": target,
            "timeout": timeout,
            "deregister_after": deregister_after,
            "failures_before_critical": threshold,
            "definition": definition,
        }

    def deregister(self, service_id: str, *, node: str | None = None) -> bool:
        """Remove a service and its checks; False (and no change) when absent."""
        key = (node or self.agent_node, service_id)
        service = self.services.pop(key, None)
        if service is None:
            return False
        index = self._bump()
        self._services_index = index
        self._service_tombstones[service.name.lower()] = index
        for check_key, check in list(self.checks.items()):
            if check.node == key[0] and check.service_id == service_id:
                del self.checks[check_key]
                self._checks_index = index
        self._notify()
        return True

    def set_maintenance(self, service_id: str, enable: bool, reason: str = "") -> None:
        """Maintenance mode: a critical ``_service_maintenance:<id>`` check."""
        key = (self.agent_node, f"_service_maintenance:{service_id}")
        if enable and key not in self.checks:
            index = self._bump()
            self.checks[key] = _Check(
                node=self.agent_node,
                check_id=key[1],
                name="Service Maintenance Mode",
                service_id=service_id,
                service_name=self.services[(self.agent_node, service_id)].name,
                kind="maintenance",
                status="critical",
                output=reason or "Maintenance mode is enabled for this service",
                definition={},
                create_index=index,
                modify_index=index,
            )
            self._checks_index = index
            self._notify()
        elif not enable and self.checks.pop(key, None) is not None:
            self._checks_index = self._bump()
            self._notify()

    def _set_status(self, check: _Check, status: str, output: str, now: float) -> None:
        if status not in STATUSES:
            raise FakeError(400, f"Invalid status {status!r}")
        if status == "critical" and check.status != "critical":
            check.critical_since = now
        elif status != "critical":
            check.critical_since = None
        if check.status != status or check.output != output:
            check.status = status
            check.output = output
            check.modify_index = self._bump()
            self._checks_index = check.modify_index
            self._notify()

    def set_check(
        self,
        check_id: str,
        status: str,
        output: str = "",
        *,
        now: float = 0.0,
        node: str | None = None,
    ) -> None:
        """Force a check's status (as if its probe had reported ``status``)."""
        check = self.checks.get((node or self.agent_node, check_id))
        if check is None:
            raise KeyError(check_id)
        self._set_status(check, status, output, now)

    def probe_result(
        self,
        check_id: str,
        status: str,
        output: str = "",
        *,
        now: float = 0.0,
        node: str | None = None,
    ) -> None:
        """Apply one HTTP/TCP probe's result, as the agent's check runner does.

        ``passing`` and ``warning`` reset the failure count and take effect at
        once; ``critical`` takes effect only as the ``FailuresBeforeCritical``-th
        failure in a row (0 and 1: the first), and until then the check keeps
        its status and output.
        """
        check = self.checks.get((node or self.agent_node, check_id))
        if check is None:
            raise KeyError(check_id)
        self._probed(check, status, output, now)

    def _probed(self, check: _Check, status: str, output: str, now: float) -> None:
        if status != "critical":
            check.failures = 0
        else:
            check.failures += 1
            if check.failures < check.failures_before_critical:
                return
        self._set_status(check, status, output, now)

    def update_ttl(self, check_id: str, status: str, output: str, *, now: float) -> None:
        check = self.checks.get((self.agent_node, check_id))
        if check is None:
            raise FakeError(
                404,
                f'Unknown check ID "{check_id}". Ensure that the check ID is passed, '
                "not the check name.",
            )
        if check.kind != "ttl":
            raise FakeError(500, f'CheckID "{check_id}" does not have associated TTL')
        assert check.ttl is not None
        check.ttl_expires = now + check.ttl
        self._set_status(check, status, output, now)

    def tick(self, now: float) -> list[_Check]:
        """Advance time: expire TTLs, reap, and return the probes due now."""
        for check in list(self.checks.values()):
            if check.kind == "ttl" and check.ttl_expires is not None and now >= check.ttl_expires:
                check.ttl_expires = None
                self._set_status(check, "critical", "TTL expired", now)
        if self._next_reap is None:
            self._next_reap = now + self.reap_interval
        if now >= self._next_reap:
            self._next_reap = now + self.reap_interval
            self.reap(now)
        due: list[_Check] = []
        for check in self.checks.values():
            if (
                check.kind in ("http", "tcp")
                and not check.running
                and check.next_run is not None
                and now >= check.next_run
            ):
                assert check.interval is not None
                check.next_run = now + check.interval
                check.running = True
                due.append(check)
        return due

    def reap(self, now: float) -> list[str]:
        """Deregister services critical for longer than DeregisterCriticalServiceAfter."""
        reaped: list[str] = []
        for check in list(self.checks.values()):
            if (
                check.service_id
                and check.deregister_after is not None
                and check.status == "critical"
                and check.critical_since is not None
                and now - check.critical_since >= check.deregister_after
                and self.deregister(check.service_id, node=check.node)
            ):
                reaped.append(check.service_id)
        return reaped

    def reset_index(self, to: int = 1) -> None:
        """The raft index goes backwards (snapshot restore / new cluster)."""
        self.index = to
        items: list[_Service | _Check | _Node] = [
            *self.services.values(),
            *self.checks.values(),
            *self.nodes.values(),
        ]
        for item in items:
            item.create_index = min(item.create_index, to)
            item.modify_index = min(item.modify_index, to)
        self._service_tombstones = {k: min(v, to) for k, v in self._service_tombstones.items()}
        self._services_index = min(self._services_index, to)
        self._checks_index = min(self._checks_index, to)
        self._notify()

    # ---------------------------------------------------------------- ACLs
    def enable_acl(self) -> None:
        """Default-deny ACLs: only tokens added with :meth:`add_token` work."""
        self.acl_enabled = True
        self._notify()

    def add_token(
        self, secret: str, *, read: tuple[str, ...] = ("",), write: tuple[str, ...] = ("",)
    ) -> None:
        """A token with ``service:read``/``service:write`` on these name prefixes
        (``""`` = every service). Node reads are always allowed."""
        self._tokens[secret] = _Token(
            str(uuid.UUID(int=self._random.getrandbits(128))), read, write
        )

    def set_token_rules(
        self, secret: str, *, read: tuple[str, ...], write: tuple[str, ...] = ()
    ) -> None:
        """Change what an existing token may read/write (its policy was edited);
        blocked reads re-run at once and see the new rules."""
        token = self._tokens[secret]
        self._tokens[secret] = _Token(token.accessor, read, write)
        self._notify()

    def revoke_token(self, secret: str) -> None:
        self._tokens.pop(secret, None)
        self._notify()

    def _token(self, secret: str | None) -> _Token | None:
        """The caller's token; FakeError 403 "ACL not found" for an unknown one."""
        if not self.acl_enabled:
            return None
        if secret is None or secret == "":
            return _Token("00000000-0000-0000-0000-000000000002", (), ())  # anonymous
        token = self._tokens.get(secret)
        if token is None:
            raise FakeError(403, "ACL not found")
        return token

    def _can(self, token: _Token | None, access: str, service: str) -> bool:
        if token is None:
            return True
        prefixes = token.read + token.write if access == "read" else token.write
        return any(service.startswith(p) for p in prefixes)

    def _require(self, token: _Token | None, access: str, service: str) -> None:
        if not self._can(token, access, service):
            raise FakeError(
                403,
                f"Permission denied: token with AccessorID '{token.accessor if token else ''}' "
                f"lacks permission 'service:{access}' on \"{service}\"",
            )

    # ---------------------------------------------------------------- faults
    def inject(self, prefix: str, fault: Fault, *, times: int = 1) -> None:
        """Apply ``fault`` to the next ``times`` requests whose path starts with ``prefix``."""
        self._faults.append(_Injected(prefix, fault, times))

    def clear_faults(self) -> None:
        """Drop every injected fault not used up yet (the registry heals)."""
        self._faults.clear()

    def _take_fault(self, path: str) -> Fault | None:
        for injected in self._faults:
            if path.startswith(injected.prefix) and injected.remaining > 0:
                injected.remaining -= 1
                if injected.remaining == 0:
                    self._faults.remove(injected)
                return injected.fault
        return None

    # ------------------------------------------------------------- rendering
    def _node_json(self, node: _Node) -> dict[str, Any]:
        return {
            "ID": node.node_id,
            "Node": node.name,
            "Address": node.address,
            "Datacenter": self.datacenter,
            "TaggedAddresses": {
                "lan": node.address,
                "lan_ipv4": node.address,
                "wan": node.address,
                "wan_ipv4": node.address,
            },
            # The agent adds its network segment to every node's meta.
            "Meta": {"consul-network-segment": "", **node.meta},
            "CreateIndex": node.create_index,
            "ModifyIndex": node.modify_index,
        }

    def _service_json(self, service: _Service) -> dict[str, Any]:
        return {
            "ID": service.id,
            "Service": service.name,
            "Tags": list(service.tags),
            "Address": service.address,
            "TaggedAddresses": dict(service.tagged_addresses),
            "Meta": dict(service.meta),
            "Port": service.port,
            "Weights": dict(service.weights),
            "EnableTagOverride": False,
            "Proxy": {"Mode": "", "MeshGateway": {}, "Expose": {}},
            "Connect": {},
            "PeerName": "",
            "CreateIndex": service.create_index,
            "ModifyIndex": service.modify_index,
        }

    def _check_json(self, check: _Check) -> dict[str, Any]:
        service = self.services.get((check.node, check.service_id))
        return {
            "Node": check.node,
            "CheckID": check.check_id,
            "Name": check.name,
            "Status": check.status,
            "Notes": "",
            "Output": check.output,
            "ServiceID": check.service_id,
            "ServiceName": check.service_name,
            "ServiceTags": list(service.tags) if service else [],
            "Type": "" if check.kind == "serf" else check.kind,
            "Interval": "" if check.interval is None else f"{check.interval:g}s",
            "Timeout": "",
            "ExposedPort": 0,
            "Definition": {},
            "CreateIndex": check.create_index,
            "ModifyIndex": check.modify_index,
        }

    def _entry_checks(self, service: _Service) -> list[_Check]:
        node_checks = [
            c for c in self.checks.values() if c.node == service.node and not c.service_id
        ]
        own = [
            c for c in self.checks.values() if c.node == service.node and c.service_id == service.id
        ]
        return sorted(node_checks, key=lambda c: c.check_id) + sorted(own, key=lambda c: c.check_id)

    def health_service(
        self,
        name: str,
        *,
        passing: bool = False,
        tags: tuple[str, ...] = (),
        token: _Token | None = None,
    ) -> tuple[int, list[dict[str, Any]], bool]:
        """``GET /v1/health/service/<name>``: (index, entries, filtered-by-ACL).

        Without ``service:read`` on ``name`` every entry is left out; the
        flag is set only when something was left out (as Consul does)."""
        readable = self._can(token, "read", name)
        filtered = False
        lowered = name.lower()
        members = sorted(
            (s for s in self.services.values() if s.name.lower() == lowered),
            key=lambda s: (s.node, s.id),
        )
        index = max(self._service_tombstones.get(lowered, 0), 0)
        entries = []
        for service in members:
            checks = self._entry_checks(service)
            index = max(index, service.modify_index, *(c.modify_index for c in checks))
            if passing and any(c.status != "passing" for c in checks):
                continue
            if any(t not in service.tags for t in tags):
                continue
            if not readable:
                filtered = True
                continue
            entries.append(
                {
                    "Node": self._node_json(self.nodes[service.node]),
                    "Service": self._service_json(service),
                    "Checks": [self._check_json(c) for c in checks],
                }
            )
        if not members and index == 0:
            index = self._services_index
        return max(index, 1), entries, filtered

    def catalog_services(
        self, token: _Token | None = None
    ) -> tuple[int, dict[str, list[str]], bool]:
        """``GET /v1/catalog/services``: (index, {name: tags}, filtered-by-ACL)."""
        names: dict[str, list[str]] = {}
        filtered = False
        for service in sorted(self.services.values(), key=lambda s: s.name):
            if not self._can(token, "read", service.name):
                filtered = True
                continue
            tags = names.setdefault(service.name, [])
            for tag in service.tags:
                if tag not in tags:
                    tags.append(tag)
        return max(self._services_index, 1), names, filtered

    def health_state(
        self, state: str, token: _Token | None = None
    ) -> tuple[int, list[dict[str, Any]], bool]:
        """``GET /v1/health/state/<state>``: (index, checks, filtered-by-ACL)."""
        if state not in ("any", *STATUSES):
            raise FakeError(400, f"Unsupported state: {state}")
        matching = [
            c
            for c in sorted(self.checks.values(), key=lambda c: (c.node, c.check_id))
            if state == "any" or c.status == state
        ]
        checks = [
            self._check_json(c)
            for c in matching
            if not c.service_name or self._can(token, "read", c.service_name)
        ]
        return max(self._checks_index, 1), checks, len(checks) < len(matching)

    def health_checks(
        self, name: str, token: _Token | None = None
    ) -> tuple[int, list[dict[str, Any]], bool]:
        """``GET /v1/health/checks/<name>``: (index, checks, filtered-by-ACL)."""
        matching = [c for c in self.checks.values() if c.service_name.lower() == name.lower()]
        readable = self._can(token, "read", name)
        checks = [self._check_json(c) for c in matching] if readable else []
        index = max(self._checks_index, self._service_tombstones.get(name.lower(), 0), 1)
        return index, checks, len(checks) < len(matching)

    # ------------------------------------------------------------------ ASGI
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        request = await read_request(scope, receive, send)
        if request is None:
            return
        body, headers = request.body, request.headers
        secret = headers.get("x-consul-token")
        authorization = headers.get("authorization", "")
        if secret is None and authorization.lower().startswith("bearer "):
            secret = authorization[7:].strip()
        query = dict(
            parse_qsl(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
        )
        tags = tuple(
            v
            for k, v in parse_qsl(
                scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True
            )
            if k == "tag"
        )
        path = unquote(scope["path"])
        record = RequestRecord(scope["method"], path, query, secret)
        self.requests.append(record)
        self._poke()
        fault = self._take_fault(path)
        try:
            if fault is not None and fault.kind == "hang":
                await self._until_disconnect(receive)
                record.outcome = "disconnected"
                return
            if fault is not None and fault.kind == "status":
                await self._send(
                    send, fault.status, fault.body, {"Content-Type": "text/plain"}, None
                )
                record.outcome = "answered"
                return
            if fault is not None and fault.kind == "body":
                extra = {"X-Consul-Index": fault.index or str(self.index)}
                await self._send(
                    send, 200, fault.body, {"Content-Type": "application/json", **extra}, None
                )
                record.outcome = "answered"
                return
            try:
                status, payload, extra = await self._dispatch(
                    scope["method"], path, query, tags, body, secret, receive
                )
            except FakeError as error:
                await self._send(
                    send,
                    error.status,
                    error.text.encode(),
                    {"Content-Type": "text/plain; charset=utf-8"},
                    fault,
                )
                record.outcome = "answered"
                return
            if status == -1:
                record.outcome = "disconnected"
                return
            if fault is not None and fault.kind == "no_index":
                extra.pop("X-Consul-Index", None)
            if fault is not None and fault.kind == "index":
                extra["X-Consul-Index"] = fault.index or "0"
            data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
            content_type = "text/plain" if isinstance(payload, bytes) else "application/json"
            await self._send(send, status, data, {"Content-Type": content_type, **extra}, fault)
            record.outcome = "answered"
        except _AbortConnection:
            record.outcome = "aborted"
            raise
        finally:
            if record.outcome == "open":
                record.outcome = "cancelled"
            self._poke()

    async def _until_disconnect(self, receive: Receive) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    async def _send(
        self, send: Send, status: int, body: bytes, headers: dict[str, str], fault: Fault | None
    ) -> None:
        declared = len(body)
        if fault is not None and fault.kind in ("truncate", "drop"):
            declared = len(body) + max(16, len(body))
        raw_headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
        raw_headers.append((b"content-length", str(declared).encode()))
        await send({"type": "http.response.start", "status": status, "headers": raw_headers})
        if fault is not None and fault.kind == "drop":
            raise _AbortConnection("dropped")
        if fault is not None and fault.kind == "truncate":
            await send(
                {"type": "http.response.body", "body": body[: len(body) // 2], "more_body": True}
            )
            raise _AbortConnection("truncated")
        if fault is not None and fault.kind == "slow":
            # Exactly 8 pieces, each followed by ``delay``: the end of the
            # answer comes 8 * delay after its headers whatever the body's
            # size, an empty body (a register call's answer) included.
            step = -(-len(body) // 8)
            for piece in range(8):
                chunk = body[piece * step : (piece + 1) * step]
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
                await anyio.sleep(fault.delay)
            await send({"type": "http.response.body", "body": b""})
            return
        await send({"type": "http.response.body", "body": body})

    def _headers(self, index: int, query: dict[str, str], filtered: bool = False) -> dict[str, str]:
        headers = {
            "X-Consul-Index": str(index),
            "X-Consul-KnownLeader": "true",
            "X-Consul-LastContact": "0",
            "X-Consul-Effective-Consistency": (
                "stale" if "stale" in query else "consistent" if "consistent" in query else "leader"
            ),
        }
        if filtered:
            headers["X-Consul-Results-Filtered-By-ACLs"] = "true"
        return headers

    async def _dispatch(
        self,
        method: str,
        path: str,
        query: dict[str, str],
        tags: tuple[str, ...],
        body: bytes,
        secret: str | None,
        receive: Receive,
    ) -> tuple[int, Any, dict[str, str]]:
        now = anyio.current_time()
        token = self._token(secret)
        blocking_reads: dict[str, Callable[[], tuple[int, Any, bool]]] = {}
        if method == "GET":
            if "stale" in query and "consistent" in query:
                raise FakeError(
                    400, "Cannot specify ?stale with ?consistent, conflicting semantics."
                )
            if query.get("dc") not in (None, "", self.datacenter):
                raise FakeError(500, "No path to datacenter")
            if path.startswith("/v1/health/service/"):
                name = path.removeprefix("/v1/health/service/")

                def read_health() -> tuple[int, Any, bool]:
                    return self.health_service(
                        name,
                        passing="passing" in query and query["passing"] != "false",
                        tags=tags,
                        token=self._token(secret),
                    )

                blocking_reads[path] = read_health
            elif path == "/v1/catalog/services":

                def read_services() -> tuple[int, Any, bool]:
                    return self.catalog_services(self._token(secret))

                blocking_reads[path] = read_services
            elif path.startswith("/v1/health/state/"):
                state = path.removeprefix("/v1/health/state/")

                def read_state() -> tuple[int, Any, bool]:
                    return self.health_state(state, self._token(secret))

                blocking_reads[path] = read_state
            elif path.startswith("/v1/health/checks/"):
                name = path.removeprefix("/v1/health/checks/")

                def read_checks() -> tuple[int, Any, bool]:
                    return self.health_checks(name, self._token(secret))

                blocking_reads[path] = read_checks
            if path in blocking_reads:
                return await self._blocking(blocking_reads[path], query, receive)
            if path.startswith("/v1/agent/health/service/id/"):
                return self._agent_health(path.removeprefix("/v1/agent/health/service/id/"), token)
            if path == "/v1/agent/services":
                services = {
                    s.id: self._service_json(s)
                    for s in self.services.values()
                    if s.node == self.agent_node and self._can(token, "read", s.name)
                }
                return 200, services, {}
            if path == "/v1/agent/checks":
                checks = {
                    c.check_id: self._check_json(c)
                    for c in self.checks.values()
                    if c.node == self.agent_node and c.service_id
                }
                return 200, checks, {}
            if path == "/v1/status/leader":
                return 200, "127.0.0.1:8300", {}
        if method == "PUT":
            if path == "/v1/agent/service/register":
                try:
                    payload = json.loads(body or b"null")
                except ValueError:
                    raise FakeError(400, "Request decode failed: invalid JSON") from None
                wanted = payload.get("Name") if isinstance(payload, dict) else None
                self._require(token, "write", wanted if isinstance(wanted, str) else "")
                self.register(payload, now=now)
                return 200, b"", {}
            if path.startswith("/v1/agent/service/maintenance/"):
                service_id = path.removeprefix("/v1/agent/service/maintenance/")
                existing = self.services.get((self.agent_node, service_id))
                if existing is None:
                    raise FakeError(404, f'Unknown service ID "{service_id}"')
                self._require(token, "write", existing.name)
                if query.get("enable") not in ("true", "false"):
                    raise FakeError(400, "Missing value for enable")
                self.set_maintenance(service_id, query["enable"] == "true", query.get("reason", ""))
                return 200, b"", {}
            if path.startswith("/v1/agent/service/deregister/"):
                service_id = path.removeprefix("/v1/agent/service/deregister/")
                existing = self.services.get((self.agent_node, service_id))
                if existing is None:
                    # What the agent answers for an ID it does not hold (for
                    # instance after DeregisterCriticalServiceAfter reaped it).
                    raise FakeError(
                        404,
                        f'Unknown service ID "{service_id}". Ensure that the service ID '
                        "is passed, not the service name.",
                    )
                self._require(token, "write", existing.name)
                self.deregister(service_id)
                return 200, b"", {}
            for verb, status in (("pass", "passing"), ("warn", "warning"), ("fail", "critical")):
                prefix = f"/v1/agent/check/{verb}/"
                if path.startswith(prefix):
                    return self._ttl(
                        path.removeprefix(prefix), status, query.get("note", ""), token, now
                    )
            if path.startswith("/v1/agent/check/update/"):
                try:
                    update = json.loads(body or b"{}")
                except ValueError:
                    raise FakeError(400, "Request decode failed: invalid JSON") from None
                new_status = update.get("Status") if isinstance(update, dict) else None
                if not isinstance(new_status, str) or new_status not in STATUSES:
                    raise FakeError(400, f"Invalid check status: {new_status!r}")
                return self._ttl(
                    path.removeprefix("/v1/agent/check/update/"),
                    new_status,
                    str(update.get("Output", "")),
                    token,
                    now,
                )
        if method not in ("GET", "PUT"):
            raise FakeError(405, f"method {method} not allowed")
        raise FakeError(404, "404 page not found")

    def _ttl(
        self, check_id: str, status: str, output: str, token: _Token | None, now: float
    ) -> tuple[int, Any, dict[str, str]]:
        check = self.checks.get((self.agent_node, check_id))
        if check is not None:
            self._require(token, "write", check.service_name)
        self.update_ttl(check_id, status, output, now=now)
        return 200, b"", {}

    def _agent_health(
        self, service_id: str, token: _Token | None
    ) -> tuple[int, Any, dict[str, str]]:
        service = self.services.get((self.agent_node, service_id))
        if service is None:
            raise FakeError(404, f"ServiceId {service_id} not found")
        self._require(token, "read", service.name)
        checks = self._entry_checks(service)
        own = [c for c in checks if c.service_id]
        statuses = {c.status for c in own}
        aggregated = (
            "critical"
            if "critical" in statuses
            else "warning"
            if "warning" in statuses
            else "passing"
        )
        status = {"passing": 200, "warning": 429, "critical": 503}[aggregated]
        return (
            status,
            {
                "AggregatedStatus": aggregated,
                "Service": self._service_json(service),
                "Checks": [self._check_json(c) for c in own],
            },
            {},
        )

    async def _blocking(
        self, read: Callable[[], tuple[int, Any, bool]], query: dict[str, str], receive: Receive
    ) -> tuple[int, Any, dict[str, str]]:
        min_index: int | None = None
        if "index" in query:
            raw = query["index"]
            if not raw.isdigit():
                raise FakeError(
                    400, f"Invalid index: strconv.ParseUint: parsing {raw!r}: invalid syntax"
                )
            min_index = int(raw)
        wait = DEFAULT_WAIT
        if "wait" in query:
            try:
                wait = parse_go_duration(query["wait"])
            except ValueError:
                raise FakeError(400, "Invalid wait time") from None
        wait = min(wait, MAX_WAIT)
        index, payload, filtered = read()
        if not min_index:
            return 200, payload, self._headers(index, query, filtered)
        deadline = anyio.current_time() + wait + self._random.uniform(0, wait / 16)
        disconnected = False
        while index <= min_index and anyio.current_time() < deadline:
            changed = self._changed
            async with anyio.create_task_group() as group:

                async def watch_disconnect() -> None:
                    nonlocal disconnected
                    await self._until_disconnect(receive)
                    disconnected = True
                    group.cancel_scope.cancel()

                group.start_soon(watch_disconnect)
                with anyio.move_on_at(deadline):
                    await changed.wait()
                group.cancel_scope.cancel()
            if disconnected:
                return -1, None, {}
            index, payload, filtered = read()
        return 200, payload, self._headers(index, query, filtered)

    # -------------------------------------------------------------- probes
    async def run_background(
        self,
        *,
        tick: float = 0.05,
        task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """TTL expiry, reaping and real HTTP/TCP probes, until cancelled."""
        async with httpx.AsyncClient(trust_env=False) as client, anyio.create_task_group() as group:
            task_status.started()
            while True:
                for check in self.tick(anyio.current_time()):
                    if self.perform_checks:
                        group.start_soon(self._probe, client, check)
                    else:
                        check.running = False
                await anyio.sleep(tick)

    async def _probe(self, client: httpx.AsyncClient, check: _Check) -> None:
        try:
            assert check.target is not None
            if check.kind == "http":
                try:
                    response = await client.get(check.target, timeout=check.timeout)
                except httpx.HTTPError as exc:
                    status, output = "critical", f"Get {check.target}: {type(exc).__name__}"
                else:
                    code = response.status_code
                    status = (
                        "passing" if 200 <= code < 300 else "warning" if code == 429 else "critical"
                    )
                    output = f"HTTP GET {check.target}: {code} Output: {response.text[:128]}"
            else:
                host, _, port = check.target.rpartition(":")
                try:
                    with anyio.fail_after(check.timeout):
                        stream = await anyio.connect_tcp(host.strip("[]"), int(port))
                    await stream.aclose()
                    status, output = "passing", f"TCP connect {check.target}: Success"
                except (OSError, TimeoutError) as exc:
                    status, output = "critical", f"dial tcp {check.target}: {exc}"
            if self.checks.get((check.node, check.check_id)) is check:
                self._probed(check, status, output, anyio.current_time())
        finally:
            check.running = False

    # ------------------------------------------------------------- helpers
    def transport(self) -> httpx.AsyncBaseTransport:
        """An in-process transport (no sockets): works under trio's MockClock."""
        return httpx.ASGITransport(app=self, raise_app_exceptions=False)

    def open_requests(self, path: str) -> int:
        return sum(1 for r in self.requests if r.path == path and r.outcome == "open")

    def outcomes(self, path: str) -> list[str]:
        return [r.outcome for r in self.requests if r.path == path]


@asynccontextmanager
async def open_consul_fake(**options: Any) -> AsyncIterator[ConsulFake]:
    """The fake without sockets (use ``fake.transport()``), with its background
    task (TTL expiry, reaper; probes only if ``perform_checks``)."""
    options.setdefault("perform_checks", False)
    fake = ConsulFake(**options)
    async with anyio.create_task_group() as group:
        await group.start(fake.run_background)
        try:
            yield fake
        finally:
            group.cancel_scope.cancel()


@asynccontextmanager
async def run_consul_fake(
    *, tls: tuple[str, str] | None = None, **options: Any
) -> AsyncIterator[ConsulFake]:
    """The fake served by hypercorn on ``127.0.0.1:<ephemeral>``; ``fake.url``
    is its base URL. ``tls=(certfile, keyfile)`` serves HTTPS with that PEM
    certificate and key (``fake.url`` is then ``https://...``)."""
    fake = ConsulFake(**options)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    if tls is not None:
        config.certfile, config.keyfile = tls
    config.accesslog = None
    config.errorlog = None
    config.loglevel = "CRITICAL"
    config.graceful_timeout = 0.1
    shutdown = anyio.Event()
    async with anyio.create_task_group() as nursery:
        binds = await nursery.start(serve_app, fake, config, shutdown)
        fake.url = binds[0].replace("http://", "https://", 1) if tls is not None else binds[0]
        await nursery.start(fake.run_background)
        try:
            yield fake
        finally:
            stop_serving(shutdown, nursery.cancel_scope)
