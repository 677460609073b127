"""The Consul provider: health-filtered listings, blocking-query watches, registration.

``query`` reads ``/v1/health/service/<name>?passing`` once. ``watch`` runs the
blocking-query loop (see :mod:`nadisc_consul._blocking` for the rules)::

    cursor.request_index() --GET ?index=&wait=--> answer
        CHANGED   -> decode -> sink.publish(complete snapshot)
        UNCHANGED -> sink.refresh()          (registry confirmed: still current)
        RESET     -> forget index, non-blocking read next
        failure   -> sink.fail(typed), backoff, then a non-blocking read
    every request first takes a token from the rate-limit bucket

A health read that Consul trimmed for lack of ``service:read`` (200 with
``X-Consul-Results-Filtered-By-ACLs: true``, which real Consul answers to a
valid token instead of a 403) raises :class:`AclFiltered`, an
``IdentityRevoked``: the permission was trimmed, the listing is not an
explicit empty one. (A read of a service with no instances at all carries no
such header in Consul, so it stays an explicit empty listing.)

An instance is healthy only when every check of its entry passes, the node's
``serfHealth`` included (the server filters with ``?passing`` and we check
again). Identity is ``Service.ID`` (or ``<node>/<Service.ID>`` with
``identity_scope: node``); a repeated ID is left out and counted in
``ProviderSnapshot.invalid``. Large answers are decoded cooperatively, one
array element at a time with a checkpoint every few milliseconds, so the
event loop never stalls on one big ``json.loads``.

Registration is an idempotent upsert (``PUT /v1/agent/service/register``).
The owner's registration lifecycle calls ``renew`` every ``monitor_interval``;
``renew`` passes the TTL check (if there is one) every time and re-applies
the registration when ``reregister_interval`` passed since the last write,
or at once after ``check`` found the service missing (Consul reaped it after
``DeregisterCriticalServiceAfter``)::

    renew:  due = never written here | now - last write >= reregister_interval
                  | the last check answered 404
            due -> PUT register (the same payload)      } one writer: the
            TTL check -> PUT check/pass (404: LeaseLost) } lifecycle's table

Because register is an upsert by service ID and deregister names the ID
alone, the provider declares ``idempotent_register`` (a re-registration
whose answer was lost is repeated with the same payload) and
``deregister_without_handle`` (a registration whose outcome is unknown is
still removed at close). What a failed write means::

    connection refused / connect timeout, 429     IncompleteSnapshot: not applied
    PUT register: answer lost, 5xx                 OutcomeUnknown (may create)
    PUT check/pass: answer lost, 5xx               RenewalOutcomeUnknown (cannot
                                                   create: 404 on a missing check)
    deregister: 404 or 500 "Unknown service ..."   absent: acknowledged
"""

from __future__ import annotations

import logging
import random
from collections.abc import Sequence
from importlib import metadata as importlib_metadata
from typing import TYPE_CHECKING
from urllib.parse import quote

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
    ObservationSink,
    OutcomeUnknown,
    ProviderFailure,
    ProviderSnapshot,
    Registered,
    RegistrationError,
    RegistrationRecord,
    RegistrationRejected,
    time_left,
)
from nadisc._provider import RenewalOutcomeUnknown

from ._blocking import Backoff, BlockingCursor, IndexOutcome, TokenBucket, read_timeout
from ._http import AclFiltered, ConsulHttp, ConsulResponse
from ._registration import HealthEndpoint, RegistrationContributor, build_registration
from ._settings import ConsulSettings, ServiceBinding
from ._wire import (
    decode_health_service,
    decode_health_service_cooperatively,
    format_duration,
    parse_index,
)

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

    from ._catalog import ConsulCatalog

__all__ = ["COOPERATIVE_BYTES", "ConsulProvider", "ConsulProviderFactory", "factory"]

logger = logging.getLogger(__name__)

#: Bodies larger than this are decoded cooperatively (yielding every few ms).
COOPERATIVE_BYTES = 64 * 1024

# ``PUT /v1/agent/service/register`` is an upsert keyed by the service ID
# (the agent's ``AddService`` replaces a service of the same ID), and
# ``/v1/agent/service/deregister/<id>`` names the service by that ID alone:
# a lost (re-)registration can be repeated with the same payload without
# creating a second instance, and an unknown one can be removed at close.
_CAPABILITIES = Capabilities(
    evidence=EvidenceKind.REGISTRY_HEALTH,
    registration=True,
    watch_streams=1,
    idempotent_renewal=True,
    idempotent_register=True,
    deregister_without_handle=True,
)
_DISCOVERY_ONLY = Capabilities(
    evidence=EvidenceKind.REGISTRY_HEALTH,
    registration=False,
    watch_streams=1,
    idempotent_renewal=True,
    idempotent_register=True,
    deregister_without_handle=True,
)


def _version() -> str:
    try:
        return importlib_metadata.version("poise-nadisc")
    except importlib_metadata.PackageNotFoundError:  # pragma: no cover - source checkout
        return "0"


class ConsulProvider:
    """One Consul agent serving one named connection. See the module docstring."""

    def __init__(
        self,
        context: ConnectionContext,
        settings: ConsulSettings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        random_source: random.Random | None = None,
    ) -> None:
        self._context = context
        self._settings = settings
        self._http = ConsulHttp(
            settings, max_response_bytes=context.max_response_bytes, transport=transport
        )
        self._random = random_source or random.Random()
        self._contributors: list[RegistrationContributor] = []
        self._host_endpoint: HealthEndpoint | None = None
        self._payloads: dict[str, dict[str, object]] = {}
        #: instance id -> event-loop time of the last acknowledged write.
        self._applied: dict[str, float] = {}
        #: instance ids a check found missing: re-applied at the next renewal.
        self._missing: set[str] = set()
        self._closed = False
        self._version = _version()
        #: The connection's one catalog (see ``catalog_for``).
        self.catalog: ConsulCatalog | None = None

    def __repr__(self) -> str:
        return (
            f"<ConsulProvider connection={self._context.name!r}"
            f" agent={self._settings.url.host}:{self._settings.url.port}"
            f" registrations={len(self._payloads)}{' closed' if self._closed else ''}>"
        )

    # -- plumbing shared with the catalog -----------------------------------
    @property
    def capabilities(self) -> Capabilities:
        """Registry-health evidence, one watch stream per service, idempotent
        renewal (register is an upsert); registration unless ``enabled: false``."""
        return _CAPABILITIES if self._settings.enabled else _DISCOVERY_ONLY

    @property
    def settings(self) -> ConsulSettings:
        return self._settings

    @property
    def context(self) -> ConnectionContext:
        return self._context

    @property
    def http(self) -> ConsulHttp:
        return self._http

    def bindings(self) -> dict[str, str]:
        """Service aliases of this connection: alias -> remote Consul name."""
        return {alias: binding.name for alias, binding in self._settings.services.items()}

    def read_params(self, *, index: int | None = None, wait: float | None = None) -> dict[str, str]:
        """Query parameters every read carries (dc, consistency, blocking)."""
        params: dict[str, str] = {}
        if self._settings.datacenter is not None:
            params["dc"] = self._settings.datacenter
        if self._settings.consistency != "default":
            params[self._settings.consistency] = ""
        if index is not None:
            params["index"] = str(index)
            params["wait"] = format_duration(wait if wait is not None else self._settings.wait)
        return params

    def new_bucket(self) -> TokenBucket:
        return TokenBucket(self._settings.watch_rate, self._settings.watch_burst)

    def new_backoff(self) -> Backoff:
        return Backoff(self._settings.initial_backoff, self._settings.max_backoff)

    def unit_random(self) -> float:
        return self._random.random()

    def add_contributor(self, contributor: RegistrationContributor) -> None:
        """Advertise ``contributor``'s tags/meta on later registrations."""
        self._contributors.append(contributor)

    def set_host_health_endpoint(self, endpoint: HealthEndpoint | None) -> None:
        """The host's health endpoint: the check source after explicit paths."""
        self._host_endpoint = endpoint

    # -- discovery -----------------------------------------------------------
    async def prepare(self, deadline: float) -> None:
        """Reach the agent once: a non-blocking ``GET /v1/catalog/services``
        proves reachability and that the token is known (403 otherwise)."""
        budget = time_left(deadline)
        await self._http.get(
            "/v1/catalog/services", self.read_params(), budget=budget, what="prepare"
        )

    async def query(self, service: str, deadline: float) -> ProviderSnapshot:
        snapshot, _ = await self._read_service(service, None, budget=time_left(deadline))
        return snapshot

    async def _fetch_service(
        self,
        service: str,
        index: int | None,
        *,
        budget: float,
        wait: float | None = None,
        binding: ServiceBinding | None = None,
        http: ConsulHttp | None = None,
    ) -> tuple[ConsulResponse, int]:
        binding = binding if binding is not None else self._settings.binding(service)
        params = self.read_params(index=index, wait=wait)
        params["passing"] = ""
        if binding.tag is not None:
            params["tag"] = binding.tag
        what = f"GET /v1/health/service/{binding.name}"
        response = await (http or self._http).get(
            f"/v1/health/service/{quote(binding.name, safe='')}", params, budget=budget, what=what
        )
        if response.filtered_by_acls:
            raise AclFiltered(
                f"{what}: results filtered by ACLs (the token lacks service:read "
                f"on {binding.name!r})"
            )
        return response, parse_index(response.headers.get("x-consul-index"), what=what)

    async def decode(
        self,
        service: str,
        body: bytes,
        *,
        binding: ServiceBinding | None = None,
        previous: ProviderSnapshot | None = None,
    ) -> ProviderSnapshot:
        """Decode a health answer for ``service``; large ones cooperatively.

        ``previous``, the last snapshot published for the same service, lets
        unchanged instances be reused rather than rebuilt: the result is the
        same, but a watch loop over thousands of instances stops creating
        thousands of long-lived objects per update (and the garbage
        collector passes they would set off, which stall the event loop).
        """
        binding = binding if binding is not None else self._settings.binding(service)
        max_instances = self._context.max_instances_per_service
        scope = self._settings.identity_scope
        if len(body) > COOPERATIVE_BYTES:
            snapshot = await decode_health_service_cooperatively(
                body,
                service=binding.name,
                max_instances=max_instances,
                tag=binding.tag,
                identity_scope=scope,
                previous=previous,
            )
        else:
            snapshot = decode_health_service(
                body,
                service=binding.name,
                max_instances=max_instances,
                tag=binding.tag,
                identity_scope=scope,
                previous=previous,
            )
        if snapshot.service != service:
            snapshot = ProviderSnapshot(
                service, snapshot.instances, snapshot.evidence, snapshot.invalid
            )
        return snapshot

    async def _read_service(
        self, service: str, index: int | None, *, budget: float, wait: float | None = None
    ) -> tuple[ProviderSnapshot, int]:
        response, new_index = await self._fetch_service(service, index, budget=budget, wait=wait)
        return await self.decode(service, response.body), new_index

    async def read_health(self, name: str, *, budget: float) -> tuple[ProviderSnapshot, int]:
        """One non-blocking passing-only read of the remote service ``name``
        (no alias lookup, no tag filter): the catalog's per-service read."""
        binding = ServiceBinding(name=name)
        response, new_index = await self._fetch_service(name, None, budget=budget, binding=binding)
        return await self.decode(name, response.body, binding=binding), new_index

    async def watch(
        self, service: str, sink: ObservationSink, *, task_status: TaskStatus[None]
    ) -> None:
        """The blocking-query loop (module docstring), on a channel of its own
        outside the request pool. Returns only when cancelled."""
        async with self._http.channel() as http:
            await self._watch_loop(service, sink, task_status, http)

    async def _watch_loop(
        self,
        service: str,
        sink: ObservationSink,
        task_status: TaskStatus[None],
        http: ConsulHttp,
    ) -> None:
        cursor = BlockingCursor()
        bucket = self.new_bucket()
        backoff = self.new_backoff()
        wait = self._settings.wait
        started = False
        last: ProviderSnapshot | None = None
        while True:
            delay = bucket.reserve(anyio.current_time())
            if delay > 0:
                await anyio.sleep(delay)
            index = cursor.request_index()
            budget = (
                read_timeout(wait, self._context.request_timeout)
                if index is not None
                else self._context.request_timeout
            )
            try:
                response, new_index = await self._fetch_service(
                    service, index, budget=budget, wait=wait, http=http
                )
                outcome = cursor.observe(new_index)
                if outcome is IndexOutcome.CHANGED:
                    snapshot = await self.decode(service, response.body, previous=last)
            except ProviderFailure as failure:
                cursor_note = f" (index {cursor.index})" if cursor.index else ""
                logger.info("consul watch of %r failed%s: %s", service, cursor_note, failure)
                # After a failure the next read is a fresh, non-blocking one: it
                # re-establishes complete evidence at once instead of blocking on
                # an index whose listing we never delivered.
                cursor.reset()
                sink.fail(failure)
                if not started:
                    started = True
                    task_status.started()
                await anyio.sleep(backoff.next_delay(self._random.random()))
                continue
            backoff.succeeded()
            if outcome is IndexOutcome.CHANGED:
                sink.publish(snapshot)
                last = snapshot
            elif outcome is IndexOutcome.UNCHANGED:
                sink.refresh()
            else:
                logger.info("consul index of %r went backwards; reading afresh", service)
            if not started:
                started = True
                task_status.started()

    # -- registration --------------------------------------------------------
    def registration_payload(self, record: RegistrationRecord) -> tuple[dict[str, object], str]:
        """The agent payload and the handle for ``record`` (validates; no I/O)."""
        payload, check_id, kind = build_registration(
            record,
            self._settings,
            contributions=[c.contribute() for c in self._contributors],
            host_endpoint=self._host_endpoint,
            version=self._version,
        )
        handle = f"{kind}:{check_id}" if check_id is not None and kind is not None else "none:"
        return payload, handle

    async def register(self, record: RegistrationRecord, deadline: float) -> Registered:
        """Write the registration (``PUT /v1/agent/service/register``).

        A record this connection cannot advertise (registration disabled,
        loopback without ``allow_loopback``, meta Consul refuses...) raises
        :class:`~nadisc.RegistrationRejected` *before* anything is sent,
        chained to the :class:`~nadisc.RegistrationError` naming the field:
        nothing was written, so the lifecycle records a definite refusal,
        never an unknown outcome.
        """
        try:
            if not self._settings.enabled:
                raise RegistrationError(
                    record.registration,
                    "registration is disabled on this connection (enabled: false)",
                    path="consul.enabled",
                )
            payload, handle = self.registration_payload(record)
        except RegistrationError as exc:
            logger.warning("consul: registration refused before any write: %s", exc)
            raise RegistrationRejected(f"refused before any write: {exc}") from exc
        budget = time_left(deadline)
        await self._put_registration(record, payload, budget, "register")
        registered = Registered(record, handle)
        if handle.startswith("ttl:"):
            try:
                await self._pass_ttl(registered, time_left(deadline))
            except (IncompleteSnapshot, OutcomeUnknown, DeadlineExceeded) as exc:
                # The registration itself was acknowledged: its first TTL
                # pass is repeated by the next renewal (until then the check
                # is critical, and the lifecycle waits for a HEALTHY one).
                logger.info(
                    "consul: %r registered; its first TTL pass did not complete (%s)",
                    record.instance_id,
                    type(exc).__name__,
                )
        return registered

    async def _put_registration(
        self, record: RegistrationRecord, payload: dict[str, object], budget: float, verb: str
    ) -> None:
        await self._http.put(
            "/v1/agent/service/register",
            payload,
            budget=budget,
            what=f"{verb} {record.instance_id!r}",
        )
        self._payloads[record.instance_id] = payload
        self._applied[record.instance_id] = anyio.current_time()
        self._missing.discard(record.instance_id)

    def reapply_due(self, registered: Registered, now: float) -> bool:
        """Whether :meth:`renew` at ``now`` re-applies the registration."""
        instance_id = registered.record.instance_id
        applied = self._applied.get(instance_id)
        return (
            applied is None
            or instance_id in self._missing
            or now - applied >= self._settings.reregister_interval
        )

    async def reapply(self, registered: Registered, deadline: float) -> Registered:
        """Re-apply the registration now (idempotent upsert), then pass a TTL check."""
        record = registered.record
        payload = self._payloads.get(record.instance_id)
        if payload is None:
            payload, _ = self.registration_payload(record)
        await self._put_registration(record, payload, time_left(deadline), "re-register")
        if registered.handle.startswith("ttl:"):
            await self._pass_ttl(registered, time_left(deadline))
        return registered

    async def renew(self, registered: Registered, deadline: float) -> Registered:
        """The lifecycle's renewal: re-apply when due (see the module
        docstring), and pass a TTL check on every call."""
        if self.reapply_due(registered, anyio.current_time()):
            return await self.reapply(registered, deadline)
        if registered.handle.startswith("ttl:"):
            await self._pass_ttl(registered, time_left(deadline))
        else:
            time_left(deadline)
            await anyio.lowlevel.checkpoint()
        return registered

    async def _pass_ttl(self, registered: Registered, budget: float) -> None:
        # A TTL pass only updates a check the agent holds (404 / "Unknown
        # check ID" otherwise): even if a lost one lands late, it cannot
        # re-create a removed service, so its lost answer leaves no residual
        # risk (RenewalOutcomeUnknown).
        check_id = registered.handle.partition(":")[2]
        what = f"pass TTL check {check_id!r}"
        response = await self._http.put(
            f"/v1/agent/check/pass/{quote(check_id, safe='')}",
            None,
            budget=budget,
            what=what,
            allow=(404, 500),
            unknown=RenewalOutcomeUnknown,
        )
        if response.status == 404 or (response.status == 500 and _check_is_gone(response.text())):
            raise LeaseLost(f"{what}: the agent no longer holds the check ({response.text()})")
        if response.status != 200:
            raise RenewalOutcomeUnknown(f"{what}: Consul answered HTTP {response.status}")

    async def check(self, registered: Registered, deadline: float) -> HealthStatus:
        """``GET /v1/agent/health/service/id/<id>``: 200 passing, 429 warning,
        503 critical, 404 unknown; maintenance mode reads as DISABLED."""
        instance_id = registered.record.instance_id
        what = f"health of {instance_id!r}"
        response = await self._http.get_any(
            f"/v1/agent/health/service/id/{quote(instance_id, safe='')}",
            None,
            budget=time_left(deadline),
            what=what,
        )
        if response.status == 404:
            self._missing.add(instance_id)
            return HealthStatus.MISSING
        if response.status not in (200, 429, 503):
            raise IncompleteSnapshot(f"{what}: Consul answered HTTP {response.status}")
        if response.status == 503 and b"_service_maintenance" in response.body:
            return HealthStatus.DISABLED
        return HealthStatus.HEALTHY if response.status == 200 else HealthStatus.UNHEALTHY

    async def deregister(self, registered: Registered, deadline: float) -> None:
        instance_id = registered.record.instance_id
        what = f"deregister {instance_id!r}"
        response = await self._http.put(
            f"/v1/agent/service/deregister/{quote(instance_id, safe='')}",
            None,
            budget=time_left(deadline),
            what=what,
            allow=(404, 500),
        )
        if response.status in (404, 500) and not _service_is_unknown(response.body):
            # Not the agent's answer for an absent ID (a proxy, a wrong path,
            # server trouble): whether the service is still there is not known.
            raise OutcomeUnknown(
                f"{what}: Consul answered HTTP {response.status}: {response.text()}; "
                "the removal may or may not have applied"
            )
        # 200, or the agent no longer holds the ID (reaped after
        # DeregisterCriticalServiceAfter, or removed by someone else): absent
        # is what deregistration wants.
        self._payloads.pop(instance_id, None)
        self._applied.pop(instance_id, None)
        self._missing.discard(instance_id)

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._http.aclose()


#: How a Consul agent says a TTL check it was asked to pass is not there (any
#: more): ``Unknown check ID "…"`` (404 on current agents, 500 on older ones)
#: and ``CheckID "…" does not have associated TTL`` (the ID names no TTL check).
_CHECK_GONE = ("unknown check", "does not have associated ttl")


#: How a Consul agent refuses to deregister an ID it does not hold (Consul's
#: agent/acl.go, ``vetServiceUpdate`` / ``vetServiceUpdateWithAuthorizer``,
#: and agent/local/state.go, ``removeServiceLocked``). Current agents answer
#: 404 ``Unknown service ID "<id>". Ensure that the service ID is passed, not
#: the service name.`` (an ``HTTPError`` with ``StatusNotFound``); the local
#: state's removal returns the same text as a plain error, which the HTTP
#: layer answers with 500. Older agents (ACLs enabled) returned
#: ``fmt.Errorf("Unknown service %q", serviceID)``, a 500 with
#: ``Unknown service "<id>"`` (``ServiceID.String()`` is the bare ID).
_SERVICE_UNKNOWN = (b"unknown service id", b'unknown service "')


def _service_is_unknown(body: bytes) -> bool:
    """Whether ``body`` is the agent's answer for an ID it does not hold."""
    return body[:512].lstrip().lower().startswith(_SERVICE_UNKNOWN)


def _check_is_gone(text: str) -> bool:
    lowered = text.lower()
    return any(marker in lowered for marker in _CHECK_GONE)


class ConsulProviderFactory:
    """The ``consul`` entry point: validates settings and builds providers."""

    @property
    def name(self) -> str:
        return "consul"

    @property
    def settings_model(self) -> type[BaseModel]:
        return ConsulSettings

    def create(self, context: ConnectionContext, settings: BaseModel) -> ConsulProvider:
        if not isinstance(settings, ConsulSettings):
            settings = ConsulSettings.model_validate(settings.model_dump())
        return ConsulProvider(context, settings)

    def create_with(
        self,
        context: ConnectionContext,
        settings: ConsulSettings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        contributors: Sequence[RegistrationContributor] = (),
    ) -> ConsulProvider:
        """Like :meth:`create`, with an injected transport (tests) and contributors."""
        provider = ConsulProvider(context, settings, transport=transport)
        for contributor in contributors:
            provider.add_contributor(contributor)
        return provider


factory = ConsulProviderFactory()
