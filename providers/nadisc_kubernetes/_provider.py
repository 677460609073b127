"""The Kubernetes provider: Service + owned EndpointSlices, listed then watched.

Discovery only (no registration), evidence
:attr:`~nadisc.EvidenceKind.ORCHESTRATOR_READY`. ``watch`` holds **two**
streams per Service (``Capabilities.watch_streams = 2``), one for the
Service object and one for its EndpointSlices; both feed one
:class:`~nadisc_kubernetes._state.ServiceView`, which is published only
while both sides are in sync::

    per stream:  list (pages: limit/continue) ─► reset side ─► publish if changed
                   ▲                               │
                   │ 410 (HTTP or ERROR event),    ▼
                   │ 504 Too large resource version, a version lower than held
                   └── backoff, relist ◄── watch ?resourceVersion=<last>&allowWatchBookmarks
                                          │ ADDED/MODIFIED/DELETED: apply; publish if changed
                                          │ BOOKMARK: remember version; refresh() (<= 1/s)
                                          │ server timeout (stream ends): re-watch from <last>
                                          │   (after a backoff delay if it lasted < 1 s)
                                          │ 403 / 401 twice: fail(IdentityRevoked), backoff
                                          └ 5xx, broken stream, silence: fail(Incomplete),
                                            backoff, resume from <last> (no relist)

Every relist waits a backoff delay first (a server answering 410 right
after each list is not asked again in a hot loop); a watch that stayed
open a second resets the backoff. Silence: once the server has sent a
bookmark, ``bookmark_silence`` (80 s) without any line, from the watch's
start or its last line, is a dead stream; before the first bookmark the same
silence reopens the watch quietly from the version held (see ``_pacing``).

A publish happens only when the listing differs from the last one
published (a relist that finds nothing new commits nothing), or when a
failure was reported since. resourceVersions are only sent back, never
ordered, except that a decimal version lower than the one held (a restored
storage) forces a relist.

``query`` lists both (every page) and builds the same listing. While a
watch of the same Service is in sync and applied changes during the
query, the watch's listing is returned instead: it is at least as new as
the list, so a confirmation query never reverts what the watch already
published.

A list is assembled completely or reported incomplete: a continue token
that expired (410) restarts the list once; a second expiry, too many
pages or a bad page is an ``IncompleteSnapshot``, never a truncated
listing.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import httpx
from pydantic import BaseModel

from nadisc import (
    Capabilities,
    ConnectionContext,
    DeadlineExceeded,
    DiscoveryOnlyProvider,
    EvidenceKind,
    IncompleteSnapshot,
    ObservationSink,
    ProviderFailure,
    ProviderSnapshot,
)

from ._credentials import ClusterAccess, resolve_access
from ._http import Gone, KubeHttp, status_failure
from ._pacing import RefreshGate, silence_is_failure, silence_limit, went_backwards
from ._settings import KubernetesSettings
from ._state import SERVICE_NAME_LABEL, ServiceView
from ._wire import (
    EndpointSlice,
    Kind,
    Service,
    WireError,
    decode_event,
    decode_page,
)

if TYPE_CHECKING:
    from anyio.abc import TaskStatus

__all__ = ["KubernetesProvider", "KubernetesProviderFactory", "KubernetesStatistics", "factory"]

logger = logging.getLogger(__name__)

#: A watch the server ends sooner than this is re-opened after a backoff delay.
_SHORTEST_WATCH = 1.0
#: The least time a watch gets to open: the API server holds a watch from a
#: version it has not reached for up to 3 s (the watch cache's blockTimeout)
#: before it answers 504 "Too large resource version"; a shorter budget would
#: never see that answer and resume from the same version forever.
_WATCH_OPEN_FLOOR = 5.0

CAPABILITIES = Capabilities(
    evidence=EvidenceKind.ORCHESTRATOR_READY, registration=False, watch_streams=2
)


@dataclass(slots=True)
class KubernetesStatistics:
    """Counters of one provider since it was created."""

    lists: int = 0
    pages: int = 0
    watches_opened: int = 0
    #: Relists forced by a 410 (HTTP status or ERROR event), a 504 "Too large
    #: resource version" or a version going backwards.
    relists: int = 0
    #: Watches reopened because they stayed silent past the silence limit.
    silent_watches: int = 0
    #: Of those, the ones reopened without a failure: silent before this
    #: provider had seen any bookmark (a server that sends none looks the same).
    quiet_reopens: int = 0
    #: Bookmark confirmations passed to the sink (at most one a second).
    confirmations: int = 0
    #: Watches the server ended on its own (timeoutSeconds) and that resumed.
    server_timeouts: int = 0
    bookmarks: int = 0
    events: int = 0
    publishes: int = 0
    failures: int = 0


class _Backoff:
    def __init__(self, initial: float, cap: float, rng: random.Random) -> None:
        self._initial, self._cap, self._rng = initial, cap, rng
        self._next = initial

    def next_delay(self) -> float:
        delay = self._next
        self._next = min(self._cap, self._next * 2)
        return delay * (0.5 + 0.5 * self._rng.random())

    def reset(self) -> None:
        self._next = self._initial


class _Run:
    """Bookkeeping shared by the two streams of one ``watch`` call.

    A listing is published only while both sides are in sync and neither
    stream is failing: one stream coming back must not paper over the other
    one's failure (a 403 on the slices while the Service stream still works).
    """

    def __init__(
        self, view: ServiceView, sink: ObservationSink, task_status: TaskStatus[None]
    ) -> None:
        self.view = view
        self.sink = sink
        #: Streams whose last outcome was a failure.
        self.failing: set[str] = set()
        #: A failure was reported since the last publish.
        self.reported = False
        self.last: ProviderSnapshot | None = None
        self.gate = RefreshGate()
        self._task_status = task_status
        self._started = False

    def _start(self) -> None:
        if not self._started:
            self._started = True
            self._task_status.started()

    def settle(self, kind: str, stats: KubernetesStatistics, *, confirm: bool = False) -> None:
        """Stream ``kind`` is healthy: publish the view when both sides are in
        sync, no stream is failing, and it changed (or a failure was reported
        since); with ``confirm``, refresh otherwise."""
        self.failing.discard(kind)
        if self.failing or not self.view.synced:
            return
        try:
            snapshot = self.view.snapshot()
        except ProviderFailure as exc:
            # What the streams hold is invalid (a Service without the port) or
            # over capacity: reported, but no stream is failing; the next
            # change on either stream evaluates again.
            self.fail(None, exc, stats)
            return
        if self.reported or snapshot != self.last:
            self.reported = False
            self.last = snapshot
            stats.publishes += 1
            self.sink.publish(snapshot)
            self._start()
        elif confirm and self.gate.due(anyio.current_time()):
            stats.confirmations += 1
            self.sink.refresh()

    def fail(self, kind: str | None, failure: ProviderFailure, stats: KubernetesStatistics) -> None:
        if kind is not None:
            self.failing.add(kind)
        self.reported = True
        stats.failures += 1
        self.sink.fail(failure)
        self._start()


class KubernetesProvider(DiscoveryOnlyProvider):
    """One API server serving one named connection. See the module docstring."""

    provider_name = "kubernetes"

    def __init__(
        self,
        context: ConnectionContext,
        settings: KubernetesSettings,
        *,
        access: ClusterAccess | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        random_source: random.Random | None = None,
    ) -> None:
        self._context = context
        self._settings = settings
        self._access = access if access is not None else resolve_access(settings)
        self._http = KubeHttp(
            self._access, max_response_bytes=context.max_response_bytes, transport=transport
        )
        self._random = random_source or random.Random()
        self._views: dict[str, ServiceView] = {}
        #: The server has sent a bookmark on one of this provider's watches.
        self.bookmarks_seen = False
        self._closed = False
        self.statistics = KubernetesStatistics()

    def __repr__(self) -> str:
        return (
            f"<KubernetesProvider connection={self._context.name!r} "
            f"server={self._access.server!r} namespace={self._access.namespace!r}"
            f"{' closed' if self._closed else ''}>"
        )

    @property
    def capabilities(self) -> Capabilities:
        """Orchestrator readiness, two watch streams per Service, no registration."""
        return CAPABILITIES

    @property
    def settings(self) -> KubernetesSettings:
        return self._settings

    @property
    def access(self) -> ClusterAccess:
        return self._access

    @property
    def http(self) -> KubeHttp:
        return self._http

    @property
    def namespace(self) -> str:
        return self._access.namespace

    # -- paths ---------------------------------------------------------------------
    def _collection(self, kind: Kind) -> str:
        ns = self.namespace
        if kind == "service":
            return f"/api/v1/namespaces/{ns}/services"
        return f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"

    def _selector(self, kind: Kind, name: str) -> dict[str, str]:
        if kind == "service":
            return {"fieldSelector": f"metadata.name={name}"}
        return {"labelSelector": f"{SERVICE_NAME_LABEL}={name}"}

    def _view(self, service: str) -> ServiceView:
        binding = self._settings.binding(service)
        return ServiceView(
            service,
            binding.name,
            port=binding.port,
            max_instances=self._context.max_instances_per_service,
            protocol=binding.protocol,
            ip_family=self._settings.ip_family,
            trust_unowned=self._settings.trust_unowned_slices,
        )

    # -- discovery ------------------------------------------------------------------
    async def prepare(self, deadline: float) -> None:
        """Reach the API server and check that every bound Service may be
        listed, with its slices (403 -> ``IdentityRevoked`` naming it)."""
        for alias in sorted(self._settings.services):
            name = self._settings.services[alias].name
            for kind in ("service", "slice"):
                params = {**self._selector(kind, name), "limit": "1"}
                await self._http.get(
                    self._collection(kind),
                    params,
                    budget=_remaining(deadline),
                    what=f"prepare {alias!r}: list {kind}s of {name!r}",
                )

    async def list_all(
        self, kind: Kind, name: str, *, deadline: float
    ) -> tuple[list[Service] | list[EndpointSlice], str]:
        """Every item of ``kind`` for Service ``name`` (all pages) and the list's version."""
        what = f"list {kind}s of {self.namespace}/{name}"
        for attempt in (0, 1):
            try:
                return await self._pages(kind, name, deadline=deadline, what=what)
            except Gone:
                if attempt == 1:
                    raise IncompleteSnapshot(
                        f"{what}: the continue token expired twice; the list is incomplete"
                    ) from None
                logger.info("%s: continue token expired; listing again from the start", what)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _pages(
        self, kind: Kind, name: str, *, deadline: float, what: str
    ) -> tuple[list[Service] | list[EndpointSlice], str]:
        self.statistics.lists += 1
        items: list[Service] | list[EndpointSlice] = []
        token = ""
        version = ""
        for _page in range(self._settings.max_pages):
            params = {**self._selector(kind, name), "limit": str(self._settings.page_size)}
            if token:
                params["continue"] = token
            body = await self._http.get(
                self._collection(kind), params, budget=_remaining(deadline), what=what
            )
            self.statistics.pages += 1
            try:
                page = decode_page(kind, body)
            except WireError as exc:
                raise IncompleteSnapshot(f"{what}: {exc}") from None
            items.extend(page.items or ())  # type: ignore[arg-type]
            version = page.metadata.resourceVersion or version
            token = page.metadata.continue_
            if not token:
                if not version:
                    raise IncompleteSnapshot(f"{what}: the list carries no resourceVersion")
                return items, version
        raise IncompleteSnapshot(
            f"{what}: more than max_pages={self._settings.max_pages} pages; the list is incomplete"
        )

    async def query(self, service: str, deadline: float) -> ProviderSnapshot:
        """Both lists (every page), one complete listing (see the module docstring)."""
        self._check_open()
        live = self._views.get(service)
        mark = live.changes if live is not None else None
        view = self._view(service)
        services, service_version = await self.list_all("service", view.name, deadline=deadline)
        view.reset_service(services, service_version)  # type: ignore[arg-type]
        if view.service is not None:
            slices, slice_version = await self.list_all("slice", view.name, deadline=deadline)
            view.reset_slices(slices, slice_version)  # type: ignore[arg-type]
        else:
            view.reset_slices((), "")
        if live is not None and live.synced and live.changes != mark:
            return live.snapshot()
        return view.snapshot()

    async def watch(
        self, service: str, sink: ObservationSink, *, task_status: TaskStatus[None]
    ) -> None:
        """Keep ``sink`` current until cancelled (see the module docstring).

        ``task_status.started()`` is called after the first outcome reached
        the sink (a complete listing, or a failure)."""
        self._check_open()
        view = self._view(service)
        run = _Run(view, sink, task_status)
        self._views[service] = view
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._follow, "service", run)
                group.start_soon(self._follow, "slice", run)
        finally:
            if self._views.get(service) is view:
                del self._views[service]

    async def _follow(self, kind: Kind, run: _Run) -> None:
        view = run.view
        settings = self._settings
        stats = self.statistics
        backoff = _Backoff(settings.initial_backoff, settings.max_backoff, self._random)
        what = f"watch {kind}s of {self.namespace}/{view.name}"
        need_list = True
        while True:
            opened: float | None = None
            try:
                if need_list:
                    held = view.version(kind)
                    items, version = await self.list_all(
                        kind, view.name, deadline=anyio.current_time() + self._timeout
                    )
                    if held and went_backwards(held, version):
                        logger.warning(
                            "%s: the list's resourceVersion %s is lower than the %s held: "
                            "the server's storage was restored; its state replaces ours",
                            what,
                            version[:32],
                            held[:32],
                        )
                    if kind == "service":
                        view.reset_service(items, version)  # type: ignore[arg-type]
                    else:
                        view.reset_slices(items, version)  # type: ignore[arg-type]
                    need_list = False
                    run.settle(kind, stats)
                opened = anyio.current_time()
                if await self._stream(kind, run, what):
                    stats.server_timeouts += 1
                if anyio.current_time() - opened >= _SHORTEST_WATCH:
                    backoff.reset()
                    continue
                # Ended at once: a server that keeps doing so is not re-asked in a hot loop.
                await anyio.sleep(backoff.next_delay())
                continue
            except Gone as exc:
                stats.relists += 1
                logger.info("%s: %s; listing again", what, exc)
                view.unsync(kind)
                need_list = True
                if opened is not None and anyio.current_time() - opened >= _SHORTEST_WATCH:
                    backoff.reset()
                # Every relist waits: a server that answers 410 (or 504) right
                # after each list is not asked again in a hot loop.
                await anyio.sleep(backoff.next_delay())
                self._check_open()
                continue
            except ProviderFailure as exc:
                logger.info("%s failed: %s", what, exc)
                run.fail(kind, exc, stats)
            await anyio.sleep(backoff.next_delay())
            self._check_open()

    async def _stream(self, kind: Kind, run: _Run, what: str) -> bool:
        """One watch from the side's version until the server ends it (True)
        or, before any bookmark was seen, until it stays silent (False)."""
        view = run.view
        settings = self._settings
        stats = self.statistics
        params = {
            **self._selector(kind, view.name),
            "watch": "1",
            "allowWatchBookmarks": "true",
            "resourceVersion": view.version(kind),
            "timeoutSeconds": str(max(1, math.ceil(settings.watch_timeout))),
        }
        limit = self._context.max_response_bytes
        async with self._http.watch(
            self._collection(kind),
            params,
            open_budget=max(self._timeout, _WATCH_OPEN_FLOOR),
            idle_timeout=settings.watch_timeout + settings.watch_grace,
            what=what,
        ) as lines:
            stats.watches_opened += 1
            # Open again after a failure: the listing we hold is confirmed current.
            run.settle(kind, stats)
            quiet = silence_limit(
                watch_timeout=settings.watch_timeout,
                watch_grace=settings.watch_grace,
                bookmark_silence=settings.bookmark_silence,
            )
            while True:
                with anyio.move_on_after(quiet) as waiting:
                    try:
                        batch = await lines.__anext__()
                    except StopAsyncIteration:
                        return True
                if waiting.cancelled_caught:
                    stats.silent_watches += 1
                    if not silence_is_failure(bookmarks_seen=self.bookmarks_seen):
                        # No bookmark yet: a quiet but live server looks the same
                        # (see _pacing); reopen from the version held, no failure.
                        stats.quiet_reopens += 1
                        logger.debug(
                            "%s: silent for %gs before any bookmark; reopening", what, quiet
                        )
                        return False
                    raise IncompleteSnapshot(
                        f"{what}: the watch sent nothing for {quiet:g}s (the server sends a "
                        "bookmark about every minute); reopening it"
                    )
                changed = bookmark = False
                for line in batch:
                    try:
                        event = decode_event(kind, line, limit=limit)
                    except WireError as exc:
                        raise IncompleteSnapshot(f"{what}: {exc}") from None
                    if event.type == "ERROR":
                        assert event.status is not None
                        raise status_failure(event.status, what, self._http.secrets)
                    held = view.version(kind)
                    if held and went_backwards(held, event.resource_version):
                        raise Gone(
                            f"{what}: resourceVersion {event.resource_version[:32]} is lower "
                            f"than the {held[:32]} held (the server's storage was restored)"
                        )
                    if event.type == "BOOKMARK":
                        stats.bookmarks += 1
                        self.bookmarks_seen = True
                        bookmark = True
                    else:
                        stats.events += 1
                    changed = view.apply(kind, event) or changed
                if changed or bookmark:
                    run.settle(kind, stats, confirm=bookmark)

    @property
    def _timeout(self) -> float:
        return self._context.request_timeout

    def _check_open(self) -> None:
        if self._closed:
            raise IncompleteSnapshot(
                f"the kubernetes provider of connection {self._context.name!r} is closed"
            )

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._http.aclose()


def _remaining(deadline: float) -> float:
    if not isinstance(deadline, int | float) or math.isnan(deadline):
        raise DeadlineExceeded(f"deadline {deadline!r} is not a number")
    remaining = deadline - anyio.current_time()
    if remaining <= 0:
        raise DeadlineExceeded("the deadline has already passed")
    return remaining


class KubernetesProviderFactory:
    """The ``kubernetes`` entry point: validates settings and builds providers."""

    @property
    def name(self) -> str:
        return "kubernetes"

    @property
    def settings_model(self) -> type[BaseModel]:
        return KubernetesSettings

    def preflight(self, settings: BaseModel, environ: Mapping[str, str] | None = None) -> None:
        """Everything :meth:`create` checks, without the network (``nadisc
        check``): the kubeconfig or in-cluster files are read and the TLS
        material loaded; an exec plugin is validated, not run."""
        if not isinstance(settings, KubernetesSettings):
            settings = KubernetesSettings.model_validate(settings.model_dump())
        resolve_access(settings, environ).ssl_context()

    def create(self, context: ConnectionContext, settings: BaseModel) -> KubernetesProvider:
        if not isinstance(settings, KubernetesSettings):
            settings = KubernetesSettings.model_validate(settings.model_dump())
        return KubernetesProvider(context, settings)

    def create_with(
        self,
        context: ConnectionContext,
        settings: KubernetesSettings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        environ: dict[str, str] | None = None,
    ) -> KubernetesProvider:
        """Like :meth:`create`, with an injected transport and environment (tests)."""
        access = resolve_access(settings, environ)
        return KubernetesProvider(context, settings, access=access, transport=transport)


factory = KubernetesProviderFactory()
