"""The Nacos provider: instance-list polling, ephemeral/persistent registration.

Contract: ``query`` reads one service's instance list (every instance, the
provider filters: only ``enabled`` and ``healthy`` instances with a weight
> 0 are served, with their weight); the owner polls it every
``poll_interval_ms`` (``refresh_delay`` answers the server's ``cacheMillis``
when larger; the owner caps provider pacing at the poll interval so the
evidence budget holds). An answer with ``reachProtectionThreshold: true``
(Nacos returned every instance as healthy because too few were) is handed
over as ``EvidenceKind.WEAK_HEALTH``: normal reads serve it, strict reads
refuse it. Listings equal to the previous one reuse its instances.

API generation (``api``)::

    prepare --login if credentials (v3 path, then v1 path on 404/405/410)-->
      auto: GET /v3/client/ns/instance/list  200 envelope -> v3
                  404/405/410/501 -> GET /v1/ns/instance/list  200 -> v1
                  neither -> IncompleteSnapshot "offers neither API" (named statuses)
      v1 / v3: that one generation, checked by the same read

Registration (``register``/``renew``/``check``/``deregister``)::

    register  POST instance (ip, port, cluster, weight, metadata, ephemeral)
              -> read it back (v1 detail, v3 list): the server's instanceId is the handle
    renew     ephemeral: a light beat (v1 PUT /instance/beat, v3 POST ?heartBeat=true)
                code 20404 / 21003 -> LeaseLost (the lifecycle re-registers)
              persistent: nothing to do (the record stays until deleted)
    check     listed: healthy -> HEALTHY, else UNHEALTHY
              not listed: v1 detail read exists -> DISABLED, else MISSING;
              v3 (no detail read in the client API) -> DISABLED (never
              re-register over an operator's disable; a reaped ephemeral
              instance comes back through the beat's 21003)
    deregister DELETE instance (by ip, port, cluster: no handle needed)

Nacos keeps one instance per ip:port:cluster of a service, and registering it
again replaces it (the server's ``IpPortBasedClient`` / 1.x ``addInstance``):
``idempotent_register`` holds, so a re-registration whose answer was lost is
repeated with the same record; ``deregister_without_handle`` holds, so a
registration whose outcome is unknown is still deleted at close. Failed
writes::

    no server took the request, 429        IncompleteSnapshot: not applied
    register: answer lost, 5xx             OutcomeUnknown (may create)
    light beat: answer lost, 5xx           RenewalOutcomeUnknown: a light beat
                                           (no ``beat`` JSON) is answered
                                           20404 / 21003 on a missing instance
                                           and cannot create one; a full beat
                                           (``beat`` JSON, Nacos 1.x) can, and
                                           would be OutcomeUnknown

Renewals are paced by ``Capabilities.renew_within`` = ``beat_interval``
(Nacos's ``clientBeatInterval`` default, 5 s) until the server answers a
beat: its ``clientBeatInterval`` then paces that registration's next beat
(``Registered.renew_within``), is kept in
:attr:`NacosProvider.server_beat_interval`, and a shorter one also paces
registrations planned later.
Repeating a light beat is harmless, so ``idempotent_renewal`` holds.
Costs: one HTTP request per poll, per beat; O(instances) decoding.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from typing import TYPE_CHECKING

import anyio
import anyio.lowlevel
import httpx
from pydantic import BaseModel

from nadisc import (
    Capabilities,
    ConnectionContext,
    DeadlineExceeded,
    EvidenceKind,
    HealthStatus,
    IncompleteSnapshot,
    LeaseLost,
    LifecycleError,
    ObservationSink,
    OutcomeUnknown,
    ProviderFailure,
    ProviderSnapshot,
    Registered,
    RegistrationRecord,
    RegistrationRejected,
    time_left,
)
from nadisc._jsonguard import loads_guarded
from nadisc._provider import RenewalOutcomeUnknown

from ._http import NOT_SERVED, NacosHttp, NacosResponse, NotDelivered
from ._settings import HEART_BEAT_INTERVAL, HEART_BEAT_TIMEOUT, NacosSettings, heartbeat_rules
from ._wire import (
    INSTANCE_NOT_FOUND_V1,
    INSTANCE_NOT_FOUND_V3,
    decode_beat,
    decode_envelope,
    decode_instance_list,
    default_instance_id,
    listing_digest,
)

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

__all__ = ["NacosProvider", "NacosProviderFactory", "factory"]

logger = logging.getLogger(__name__)

_PATHS = {
    "v1": {
        "list": "/v1/ns/instance/list",
        "instance": "/v1/ns/instance",
        "beat": "/v1/ns/instance/beat",
    },
    "v3": {
        "list": "/v3/client/ns/instance/list",
        "instance": "/v3/client/ns/instance",
        "beat": "/v3/client/ns/instance",
    },
}
#: The service name the API probe lists when no service is bound.
PROBE_SERVICE = "nadisc-api-probe"
#: HTTP 429: a rate limit refused the request before it was processed.
_RATE_LIMITED = 429


class NacosProvider:
    """One Nacos cluster serving one named connection. See the module docstring."""

    def __init__(
        self,
        context: ConnectionContext,
        settings: NacosSettings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._context = context
        self._settings = settings
        self._http = NacosHttp(
            settings, max_response_bytes=context.max_response_bytes, transport=transport
        )
        self._api: str | None = None if settings.api == "auto" else settings.api
        self._previous: dict[str, ProviderSnapshot] = {}
        self._cache_seconds: dict[str, float] = {}
        self._digests: dict[str, bytes] = {}
        # The connection's metadata may set the instances' heartbeat rules
        # (``preserved.heart.beat.interval``): the server then expects beats
        # that often, so renewals are paced by it from the start.
        rules = heartbeat_rules(settings.metadata)
        assert not isinstance(rules, str)  # the settings validated them
        self._renew_within = min(settings.beat_interval, rules[HEART_BEAT_INTERVAL] / 1000)
        #: The server's last ``clientBeatInterval`` answer (seconds), if any.
        self.server_beat_interval: float | None = None
        #: Whether the v1 instance detail read is served (None: not tried).
        #: Nacos 3.x makes it admin API, answered 410 by default.
        self.detail_served: bool | None = None
        self._closed = False

    def __repr__(self) -> str:
        return (
            f"<NacosProvider connection={self._context.name!r} server={self._http.server}"
            f" api={self._api or 'unprobed'}{' closed' if self._closed else ''}>"
        )

    @property
    def capabilities(self) -> Capabilities:
        """Renewals within the shortest beat interval known: ``beat_interval``,
        the connection metadata's ``preserved.heart.beat.interval``, or a
        shorter ``clientBeatInterval`` a beat answer or a registration's own
        metadata asked for (registrations frozen afterwards take it)."""
        return Capabilities(
            evidence=EvidenceKind.REGISTRY_HEALTH,
            registration=True,
            watch_streams=0,
            idempotent_renewal=True,
            renew_within=self._renew_within,
            idempotent_register=True,
            deregister_without_handle=True,
        )

    @property
    def settings(self) -> NacosSettings:
        return self._settings

    @property
    def api(self) -> str | None:
        """The API generation in use (None until ``prepare`` probed it)."""
        return self._api

    @property
    def http(self) -> NacosHttp:
        return self._http

    def bindings(self) -> dict[str, str]:
        """Service aliases of this connection: alias -> remote Nacos name."""
        return {alias: b.name for alias, b in self._settings.services.items()}

    def refresh_delay(self, service: str, poll_interval: float) -> float:
        """The server's ``cacheMillis`` when larger than the poll interval
        (the owner caps it at the poll interval)."""
        return max(poll_interval, self._cache_seconds.get(service, 0.0))

    # -- discovery -------------------------------------------------------------
    async def prepare(self, deadline: float) -> None:
        """Log in (with credentials) and settle the API generation."""
        budget = time_left(deadline)
        await self._http.token(budget)
        probe = next(iter(self._settings.services.values()), None)
        name = probe.name if probe is not None else PROBE_SERVICE
        if self._settings.api != "auto":
            await self._list(self._settings.api, name, deadline)
            return
        v3 = await self._http.call(
            "GET",
            _PATHS["v3"]["list"],
            self._list_params("v3", name),
            budget=time_left(deadline),
            what="probe of the v3 client API",
        )
        if v3.status == 200 and _is_envelope(v3.body, "probe of the v3 client API"):
            self._api = "v3"
            return
        v1 = await self._http.call(
            "GET",
            _PATHS["v1"]["list"],
            self._list_params("v1", name),
            budget=time_left(deadline),
            what="probe of the v1 open API",
        )
        if v1.status == 200 and b'"hosts"' in v1.body:
            self._api = "v1"
            return
        if v3.status not in NOT_SERVED and v3.status != 200:
            said = self._http.quote(v3)
            raise IncompleteSnapshot(
                f"probe of {self._http.server}: v3 answered HTTP {v3.status}: {said}"
            )
        raise IncompleteSnapshot(
            f"{self._http.server} offers neither the Nacos v3 client API "
            f"(HTTP {v3.status}) nor the v1 open API (HTTP {v1.status}): "
            "is server_addr the Nacos address with its context path (e.g. /nacos)?"
        )

    def _require_api(self) -> str:
        if self._api is None:
            raise LifecycleError(
                f"nacos connection {self._context.name!r}: prepare() has not settled the API"
            )
        return self._api

    def _list_params(self, api: str, service: str) -> dict[str, str]:
        s = self._settings
        params = {"namespaceId": s.namespace, "groupName": s.group}
        if api == "v1":
            params["serviceName"] = f"{s.group}@@{service}"
            params["healthyOnly"] = "false"
            if s.cluster_filter:
                params["clusters"] = s.cluster
        else:
            params["serviceName"] = service
            if s.cluster_filter:
                params["clusterName"] = s.cluster
        return params

    async def _list(self, api: str, service: str, deadline: float) -> NacosResponse:
        what = f"list {self._settings.group}@@{service}"
        response = await self._http.call(
            "GET",
            _PATHS[api]["list"],
            self._list_params(api, service),
            budget=time_left(deadline),
            what=what,
        )
        if response.status != 200:
            if api == "v3" and response.status in (400, 404):
                code, message, _ = _safe_envelope(response, self._http)
                if code == 21008:  # service not exist: Nacos's explicit "no such service"
                    return NacosResponse(200, b'{"code":0,"message":"success","data":[]}')
                raise IncompleteSnapshot(f"{what}: HTTP {response.status} code {code} {message}")
            raise IncompleteSnapshot(
                f"{what}: Nacos answered HTTP {response.status}: {self._http.quote(response)}"
            )
        return response

    async def query(self, service: str, deadline: float) -> ProviderSnapshot:
        api = self._require_api()
        remote = self._settings.remote_name(service)
        response = await self._list(api, remote, deadline)
        digest = listing_digest(response.body)
        previous = self._previous.get(service)
        if previous is not None and self._digests.get(service) == digest:
            return previous  # the same content as last time: nothing to decode
        listing = decode_instance_list(
            response.body,
            api=api,
            service=remote,
            group=self._settings.group,
            max_bytes=self._http.max_response_bytes,
            max_instances=self._context.max_instances_per_service,
            previous=previous,
        )
        snapshot = listing.snapshot
        if snapshot.service != service:
            snapshot = ProviderSnapshot(
                service, snapshot.instances, snapshot.evidence, snapshot.invalid
            )
        self._previous[service] = snapshot
        self._digests[service] = digest
        self._cache_seconds[service] = listing.cache_seconds
        return snapshot

    async def watch(
        self, service: str, sink: ObservationSink, *, task_status: TaskStatus[None]
    ) -> None:
        raise LifecycleError("the nacos provider polls; it holds no watch streams")

    # -- registration ------------------------------------------------------------
    def _instance_params(self, record: RegistrationRecord, api: str) -> dict[str, str]:
        s = self._settings
        params = {
            "namespaceId": s.namespace,
            "groupName": s.group,
            "serviceName": f"{s.group}@@{record.service}" if api == "v1" else record.service,
            "clusterName": s.cluster,
            "ip": record.host,
            "port": str(record.port),
            "ephemeral": "true" if self._ephemeral(record) else "false",
        }
        return params

    def _ephemeral(self, record: RegistrationRecord) -> bool:
        return record.ephemeral and self._settings.ephemeral

    async def register(self, record: RegistrationRecord, deadline: float) -> Registered:
        api = self._require_api()
        if not (math.isfinite(record.weight) and 0 < record.weight <= 10000):
            raise RegistrationRejected(
                f"registration {record.registration!r}: Nacos takes weights in (0, 10000]"
            )
        params = self._instance_params(record, api)
        metadata = {**self._settings.metadata, **record.metadata}
        rules = heartbeat_rules(metadata)
        if isinstance(rules, str):
            raise RegistrationRejected(f"registration {record.registration!r}: {rules}")
        if self._ephemeral(record) and rules[HEART_BEAT_TIMEOUT] / 1000 <= self._renew_within:
            logger.warning(
                "nacos connection %r: registration %r may go %.1fs between beats, its "
                "preserved.heart.beat.timeout is %.1fs: the server will mark it unhealthy "
                "between beats; set the interval in the connection's metadata",
                self._context.name,
                record.registration,
                self._renew_within,
                rules[HEART_BEAT_TIMEOUT] / 1000,
            )
        pace: float | None = None
        if self._ephemeral(record) and HEART_BEAT_INTERVAL in metadata:
            pace = rules[HEART_BEAT_INTERVAL] / 1000
            self._adopt(pace, record.registration)
        params.update(
            weight=repr(float(record.weight)),
            enabled="true",
            healthy="true",
            metadata=json.dumps(metadata, separators=(",", ":"), sort_keys=True),
        )
        what = f"register {record.registration!r}"
        response = await self._write("POST", _PATHS[api]["instance"], params, deadline, what)
        self._write_ok(response, api, what)
        handle = await self._assigned_id(record, api, deadline)
        return Registered(record, handle, renew_within=pace)

    async def _write(
        self,
        method: str,
        path: str,
        params: dict[str, str],
        deadline: float,
        what: str,
        *,
        unknown: type[OutcomeUnknown] = OutcomeUnknown,
    ) -> NacosResponse:
        """One write. A lost answer raises ``unknown``: ``OutcomeUnknown``, or
        ``RenewalOutcomeUnknown`` for a write that cannot create a record."""
        try:
            return await self._http.call(
                method, path, params, budget=time_left(deadline), what=what
            )
        except NotDelivered as exc:
            # No server took the request: it certainly did not apply.
            raise IncompleteSnapshot(f"{exc}; the write was not sent") from exc
        except IncompleteSnapshot as exc:
            raise unknown(f"{exc}; the write may or may not have applied") from exc

    def _write_ok(
        self,
        response: NacosResponse,
        api: str,
        what: str,
        *,
        unknown: type[OutcomeUnknown] = OutcomeUnknown,
    ) -> None:
        if response.status == 200:
            if api == "v1" and response.body.strip() == b"ok":
                return
            if api == "v3":
                code, message, _ = _safe_envelope(response, self._http)
                if code == 0:
                    return
                raise RegistrationRejected(f"{what}: Nacos answered code {code} ({message})")
            if api == "v1":
                raise unknown(f"{what}: unexpected answer {self._http.quote(response)!r}")
        if response.status == 400:
            said = self._http.quote(response)
            raise RegistrationRejected(f"{what}: rejected by Nacos (400): {said}")
        if response.status == _RATE_LIMITED:
            # Refused before it was processed (a rate limit): not applied.
            raise IncompleteSnapshot(
                f"{what}: refused as rate limited (429): {self._http.quote(response)}; "
                "the write was not applied"
            )
        raise unknown(
            f"{what}: Nacos answered HTTP {response.status}: {self._http.quote(response)}; "
            "the write may or may not have applied"
        )

    async def _find(
        self, record: RegistrationRecord, api: str, deadline: float
    ) -> tuple[dict[str, object] | None, bool]:
        """Our instance as the server lists it (every instance, unfiltered),
        and whether the answer was past the protect threshold."""
        s = self._settings
        response = await self._list(api, record.service, deadline)
        what = f"list {record.service!r}"
        document = loads_guarded(response.body, what)
        # The same shape rules as a query: no ``hosts`` array (v1), or a v3
        # answer whose code is not 0 or whose data is no list, is no listing
        # (never "our instance is gone").
        info: object = document
        if api == "v3":
            if not isinstance(document, dict) or document.get("code") != 0:
                raise IncompleteSnapshot(f"{what}: not a successful Nacos result envelope")
            info = document.get("data")
            if isinstance(info, list):
                info = {"hosts": info}
        if not isinstance(info, dict) or not isinstance(info.get("hosts"), list):
            raise IncompleteSnapshot(f"{what}: the answer carries no instance list")
        hosts = info["hosts"]
        protected = info.get("reachProtectionThreshold") is True
        for host in hosts:
            if (
                isinstance(host, dict)
                and host.get("ip") == record.host
                and host.get("port") == record.port
                and host.get("clusterName", "DEFAULT") == s.cluster
            ):
                return host, protected
        return None, protected

    async def _assigned_id(self, record: RegistrationRecord, api: str, deadline: float) -> str:
        """The id the server assigned: v1 reads the instance's detail (one
        instance, whatever the service's size); v3's client API has no detail
        read, so it finds the instance in the service's list."""
        s = self._settings
        fallback = default_instance_id(record.host, record.port, s.cluster, s.group, record.service)
        try:
            host = await self._detail(record, deadline) if api == "v1" else _UNSERVED
            if host is _UNSERVED:
                host, _ = await self._find(record, api, deadline)
        except (ProviderFailure, DeadlineExceeded):
            return fallback
        if host is not None and isinstance(host.get("instanceId"), str) and host["instanceId"]:
            return str(host["instanceId"])
        return fallback

    async def renew(self, registered: Registered, deadline: float) -> Registered:
        record = registered.record
        if not self._ephemeral(record):
            time_left(deadline)
            await anyio.lowlevel.checkpoint()
            return registered
        api = self._require_api()
        params = self._instance_params(record, api)
        what = f"beat {record.registration!r}"
        # A light beat (no ``beat`` JSON) only refreshes an instance the
        # server holds; a full beat re-registers a missing ephemeral one
        # (1.x ``InstanceController.beat``), so its lost answer could leave one.
        unknown = OutcomeUnknown if "beat" in params else RenewalOutcomeUnknown
        if api == "v1":
            response = await self._write(
                "PUT", _PATHS["v1"]["beat"], params, deadline, what, unknown=unknown
            )
            if response.status != 200:
                self._write_ok(response, api, what, unknown=unknown)
            answer = decode_beat(response.body, max_bytes=self._http.max_response_bytes)
            if answer.code == INSTANCE_NOT_FOUND_V1:
                raise LeaseLost(f"{what}: Nacos no longer holds the instance (code 20404)")
            seconds = answer.client_beat_interval / 1000.0 if answer.client_beat_interval else 0.0
            if math.isfinite(seconds) and seconds > 0:
                # The instance's ``preserved.heart.beat.interval`` (or the
                # server's default): the next beat of this registration
                # follows it, as the Java client's BeatReactor does, and
                # registrations planned later start at it if it is shorter.
                self.server_beat_interval = seconds
                self._adopt(seconds, record.registration)
                if registered.renew_within != seconds:
                    return dataclasses.replace(registered, renew_within=seconds)
            return registered
        params["heartBeat"] = "true"
        response = await self._write(
            "POST", _PATHS["v3"]["beat"], params, deadline, what, unknown=unknown
        )
        code, message, _ = _safe_envelope(response, self._http)
        if code == INSTANCE_NOT_FOUND_V3:
            logger.info("nacos: %s: %s", what, message)  # quoted safely by _safe_envelope
            raise LeaseLost(f"{what}: Nacos no longer holds the instance (code 21003)")
        if response.status == _RATE_LIMITED:
            self._write_ok(response, api, what, unknown=unknown)
        if response.status != 200 or code != 0:
            raise unknown(f"{what}: Nacos answered HTTP {response.status} code {code}")
        return registered

    def _adopt(self, seconds: float, registration: str) -> None:
        """Adopt a beat interval the server expects (``clientBeatInterval``,
        i.e. the instance's ``preserved.heart.beat.interval``): a shorter one
        than the current pace shortens ``capabilities.renew_within``."""
        if not (math.isfinite(seconds) and seconds > 0):
            return
        if seconds < self._renew_within:
            logger.warning(
                "nacos connection %r: registration %r is expected to beat every %.1fs, "
                "shorter than the %.1fs this connection's renewals were paced at; "
                "its next beat and registrations planned from now follow it",
                self._context.name,
                registration,
                seconds,
                self._renew_within,
            )
            self._renew_within = seconds

    async def check(self, registered: Registered, deadline: float) -> HealthStatus:
        api = self._require_api()
        record = registered.record
        host, protected = await self._find(record, api, deadline)
        if host is not None:
            healthy = host.get("healthy", True) is True
            if protected and api == "v1":
                # Past the protect threshold every listed host says healthy:
                # the detail read tells the truth where it is served.
                detail = await self._detail(record, deadline)
                if detail is not _UNSERVED:
                    healthy = detail is not None and detail.get("healthy") is True
            if host.get("enabled", True) is False:
                return HealthStatus.DISABLED
            return HealthStatus.HEALTHY if healthy else HealthStatus.UNHEALTHY
        if api == "v1":
            detail = await self._detail(record, deadline)
            if detail is None:
                return HealthStatus.MISSING
            # Held but not listed (disabled), or no detail read to tell (Nacos
            # 3.x admin API off): as on v3, never re-register over an
            # operator's disable; a reaped ephemeral instance comes back
            # through the beat's 20404.
            return HealthStatus.DISABLED
        return HealthStatus.DISABLED

    async def _detail(
        self, record: RegistrationRecord, deadline: float
    ) -> dict[str, object] | None:
        """v1 ``GET /v1/ns/instance``: the instance whatever its state, None
        when the server holds no such instance, or ``_UNSERVED`` when the
        server does not serve the read (Nacos 3.x: admin API, 410 unless
        ``nacos.core.api.compatibility.admin.enabled=true``; asked once)."""
        if self.detail_served is False:
            return _UNSERVED
        what = f"detail of {record.registration!r}"
        params = self._instance_params(record, "v1")
        response = await self._http.call(
            "GET", _PATHS["v1"]["instance"], params, budget=time_left(deadline), what=what
        )
        if response.status in NOT_SERVED and response.status != 404:
            if self.detail_served is None:
                logger.info(
                    "nacos connection %r: the v1 instance detail read is not served "
                    "(HTTP %d, Nacos 3.x admin API); checks use the listing alone",
                    self._context.name,
                    response.status,
                )
            self.detail_served = False
            return _UNSERVED
        if response.status == 200:
            self.detail_served = True
            document = loads_guarded(response.body, what)
            if not isinstance(document, dict) or "ip" not in document:
                raise IncompleteSnapshot(f"{what}: the answer is not an instance")
            return document
        if response.status in (400, 404, 500) and (
            b"no ips found" in response.body
            or b"no matched ip" in response.body
            or response.status == 404
        ):
            return None
        raise IncompleteSnapshot(f"detail of {record.registration!r}: HTTP {response.status}")

    async def deregister(self, registered: Registered, deadline: float) -> None:
        api = self._require_api()
        record = registered.record
        what = f"deregister {record.registration!r}"
        response = await self._write(
            "DELETE", _PATHS[api]["instance"], self._instance_params(record, api), deadline, what
        )
        self._write_ok(response, api, what)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._http.aclose()


#: ``_detail``'s answer when the server does not serve the detail read.
_UNSERVED: dict[str, object] = {}


def _is_envelope(body: bytes, what: str) -> bool:
    try:
        document = loads_guarded(body, what)
    except IncompleteSnapshot:
        return False
    return isinstance(document, dict) and "code" in document and "data" in document


def _safe_envelope(response: NacosResponse, http: NacosHttp) -> tuple[int, str, bytes | None]:
    """(code, message, data) of a v3 envelope; the message is quoted safely
    (a server may echo the request into it). Not an envelope: code -1."""
    try:
        code, message, data = decode_envelope(
            response.body, max_bytes=http.max_response_bytes, what="answer"
        )
    except ProviderFailure:
        return -1, http.quote(response), None
    return code, http.quote(message), data


class NacosProviderFactory:
    """The ``nacos`` entry point: validates settings and builds providers."""

    @property
    def name(self) -> str:
        return "nacos"

    @property
    def settings_model(self) -> type[BaseModel]:
        return NacosSettings

    def create(self, context: ConnectionContext, settings: BaseModel) -> NacosProvider:
        if not isinstance(settings, NacosSettings):
            settings = NacosSettings.model_validate(settings.model_dump())
        return NacosProvider(context, settings)

    def create_with(
        self,
        context: ConnectionContext,
        settings: NacosSettings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> NacosProvider:
        """Like :meth:`create`, with an injected transport (tests, in-process fakes)."""
        return NacosProvider(context, settings, transport=transport)


factory = NacosProviderFactory()
