"""The Kubernetes provider: Service + owned EndpointSlices, listed then watched.

Discovery only (no registration), evidence
:attr:`~nadisc.EvidenceKind.ORCHESTRATOR_READY`. ``watch`` holds **two**
streams per Service (``Capabilities.watch_streams = 2``), one for the
Service object and one for its EndpointSlices; both feed one
:class:`~nadisc_kubernetes._state.ServiceView`, which is published only
while both sides are in sync::

    per stream:  list (pages: limit/continue) ─► reset side ─► publish if changed
                   ▲                                │
                   │ 410 (HTTP or ERROR event),     ▼
                   │ a version lower than held ◄─ watch ?resourceVersion=<last>
                   │                                │   &allowWatchBookmarks=true
                   │                                │ ADDED/MODIFIED/DELETED: apply, publish
                   │                                │ BOOKMARK: note version; refresh() (<= 1/s)
                   │                                │ server timeout: re-watch from <last>
                   │                                │   (after a backoff if it lasted < 1 s)
                   │                                │ silent, no bookmark seen yet: read the
                   │                                │   version (one item); not lower: re-watch
                   │                                │ 403 on opening: list at once; list 403:
                   │                                │   fail(IdentityRevoked); list allowed:
                   │                                │   poll (below)
                   │                                │ 403 later / 401 twice: fail(IdentityRevoked)
                   └─ backoff (or Retry-After) ◄────┴ 429, 5xx, broken, silent: fail(Incomplete)

Every relist waits a backoff delay first (a server answering 410 right
after each list is not asked again in a hot loop); a watch that stayed
open a second resets the backoff. After a 429 (or a 5xx) that says how long
to wait (``Retry-After``, or ``details.retryAfterSeconds``), the next request
waits at least that, up to ``max_backoff``.

A stream that failed lists again before it watches again: an open watch
proves nothing about the version held (an API server whose storage went back
in time accepts a watch from a version it has not reached and stays silent),
so only a list, or a line on the watch, confirms a listing. Silence: once
the server has sent a bookmark, ``bookmark_silence`` (80 s) without any
line, from the watch's start or its last line, is a dead stream (a failure,
then a relist); before the first bookmark the same silence reopens the watch
quietly, after a one-item list showed the server's version is not lower
than the one held (see ``_pacing``).

A publish happens only when the listing differs from the last one
published, or when a failure was reported since. A complete list that finds
nothing new (a relist after a 410, a poll) commits nothing but confirms the
listing (``refresh()``, like a bookmark, at most once a second): it was read
at the server's current version.

A role that may list but not watch (the watch answers 403 right after a
list succeeded): one WARNING per resource naming the missing permission,
the listing kept, and the stream *polls*: it lists every ``max_backoff``
(jittered to 50-100 %), confirming each time, and tries the watch after
each list; once a watch opens it follows changes again. While a stream
polls, only its own lists confirm (the other stream's bookmarks say
nothing about what it last listed). resourceVersions are only sent back, never
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
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING

import anyio
import httpx
from pydantic import BaseModel

from nadisc import (
    Capabilities,
    ConnectionContext,
    DiscoveryOnlyProvider,
    EvidenceKind,
    IncompleteSnapshot,
    ObservationSink,
    ProviderFailure,
    ProviderSnapshot,
    multi_request_read,
    time_left,
)

from ._credentials import ClusterAccess, resolve_access
from ._http import Forbidden, Gone, KubeHttp, RetryLater, status_failure
from ._pacing import RefreshGate, retry_wait, silence_is_failure, silence_limit, went_backwards
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
#: The least time a watch gets to open, whatever ``request_timeout``: a watch
#: answers with its headers only, and the API server may queue it before
#: that under priority and fairness (staging/src/k8s.io/apiserver/pkg/server/
#: filters/priority-and-fairness.go getRequestWaitContext).
_WATCH_OPEN_FLOOR = 5.0

#: Resource and API group of each kind, as RBAC rules name them.
_RESOURCES: dict[Kind, tuple[str, str]] = {
    "service": ("services", ""),
    "slice": ("endpointslices", "discovery.k8s.io"),
}

CAPABILITIES = Capabilities(
    evidence=EvidenceKind.ORCHESTRATOR_READY, registration=False, watch_streams=2
)


@dataclass(slots=True)
class KubernetesStatistics:
    """Counters of one provider since it was created."""

    lists: int = 0
    pages: int = 0
    watches_opened: int = 0
    #: Lists of a stream after its first: after a 410 (HTTP status or ERROR
    #: event), a 504 "Too large resource version", a version lower than the
    #: one held (on an event or a version check), or a failure of its watch
    #: (a broken stream, or one silent once bookmarks are known, included).
    relists: int = 0
    #: Watches that stayed silent past the silence limit.
    silent_watches: int = 0
    #: Of those, the ones reopened without a failure: silent before this
    #: provider had seen any bookmark (a server that sends none looks the same).
    quiet_reopens: int = 0
    #: One-item lists read for the server's version before a quiet reopen.
    version_checks: int = 0
    #: Bookmark confirmations passed to the sink (at most one a second).
    confirmations: int = 0
    #: Watches the server ended on its own (timeoutSeconds) and that resumed.
    server_timeouts: int = 0
    #: Watches refused with 403 Forbidden right after a list was allowed (the
    #: credentials may list but not watch; the stream then polls).
    watch_denials: int = 0
    #: Lists made in place of a watch the credentials may not open (every
    #: ``max_backoff``, jittered); not counted in ``relists``.
    polls: int = 0
    bookmarks: int = 0
    events: int = 0
    publishes: int = 0
    failures: int = 0


class _WatchDenied(Exception):
    """A watch was refused with 403 Forbidden when it was opened (before any
    line): the credentials may not watch; whether they may list, a list tells."""

    def __init__(self, failure: Forbidden) -> None:
        super().__init__(str(failure))
        self.failure = failure


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
        #: Streams that may list but not watch: they list again periodically,
        #: so what they hold is only as fresh as their last list.
        self.polling: set[str] = set()
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
        since); with ``confirm`` (a bookmark, or a complete list answered at
        the server's current version), refresh otherwise.

        While a stream polls (its watch is forbidden), only its own lists
        confirm: a bookmark of the other stream says nothing about what the
        polling side last listed."""
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
        elif (
            confirm
            and (not self.polling or kind in self.polling)
            and self.gate.due(anyio.current_time())
        ):
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
        #: Kinds whose watch the credentials were found not to allow (the
        #: WARNING is logged once per kind until a watch of it opens again).
        self._unwatchable: set[Kind] = set()
        self._closed = False
        #: Set by aclose(): ends the streams' waits between requests (made
        #: by the first wait; a provider may be built outside an event loop).
        self._closing: anyio.Event | None = None
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
                    budget=time_left(deadline),
                    what=f"prepare {alias!r}: list {kind}s of {name!r}",
                )

    async def list_all(
        self, kind: Kind, name: str, *, deadline: float
    ) -> tuple[list[Service] | list[EndpointSlice], str]:
        """Every item of ``kind`` for Service ``name`` (all pages) and the list's version."""
        what = f"list {kind}s of {self.namespace}/{name}"
        with multi_request_read(deadline, what):
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
                self._collection(kind), params, budget=time_left(deadline), what=what
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
        with multi_request_read(deadline, f"query of {service!r}"):
            services, version = await self.list_all("service", view.name, deadline=deadline)
            view.reset_service(services, version)  # type: ignore[arg-type]
            if view.service is not None:
                slices, version = await self.list_all("slice", view.name, deadline=deadline)
                view.reset_slices(slices, version)  # type: ignore[arg-type]
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
        except BaseExceptionGroup as stopped:
            # Closed underneath: the streams stop with the closed error, which
            # the caller gets as such, not wrapped in the streams' task group.
            if self._closed and stopped.split(IncompleteSnapshot)[1] is None:
                raise self._closed_error() from None
            raise
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
            asked: float | None = None
            listed = False
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
                    listed = True
                    if kind in run.polling:
                        stats.polls += 1
                        # A poll that went through is a completed cycle.
                        backoff.reset()
                    # A complete list (no resourceVersion sent: read at the
                    # server's current version) is news from the server even
                    # when nothing changed: it confirms the listing.
                    run.settle(kind, stats, confirm=True)
                opened = anyio.current_time()
                try:
                    ended = await self._stream(kind, run, what)
                except _WatchDenied as denied:
                    opened = None
                    # A 403 on a watch says nothing about the list: only a
                    # list tells a watch-only role from credentials that lost
                    # both. Until a watch is allowed, lists keep the side current.
                    need_list = True
                    if not listed:
                        logger.info("%s: %s; listing to see whether lists still are", what, denied)
                        continue
                    stats.watch_denials += 1
                    self._note_unwatchable(kind, run, denied.failure)
                    await self._pause(self._poll_interval())
                    self._check_open()
                    continue
                if ended:
                    stats.server_timeouts += 1
                else:
                    # Silent before any bookmark: no failure, but a server
                    # restored to an older version is silent too; its
                    # version tells (a lower one raises Gone: relist).
                    await self._check_version(kind, view, what)
                    stats.quiet_reopens += 1
                    logger.debug("%s: silent before any bookmark; reopening", what)
                if anyio.current_time() - opened >= _SHORTEST_WATCH:
                    backoff.reset()
                    continue
                # Ended at once: a server that keeps doing so is not re-asked in a hot loop.
                await self._pause(backoff.next_delay())
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
            except ProviderFailure as exc:
                # Closed underneath: that is the caller's doing, not the server's.
                self._check_open()
                logger.info("%s failed: %s", what, exc)
                run.fail(kind, exc, stats)
                if not need_list:
                    # Only a list confirms the stream again: a watch from the
                    # version held is accepted even by a server whose storage
                    # went back in time, which then stays silent.
                    stats.relists += 1
                    view.unsync(kind)
                    need_list = True
                if isinstance(exc, RetryLater):
                    asked = exc.retry_after
                if opened is not None and anyio.current_time() - opened >= _SHORTEST_WATCH:
                    # A watch that stayed open a while and then broke starts
                    # the backoff over (only failing at once keeps doubling).
                    backoff.reset()
            await self._pause(retry_wait(backoff.next_delay(), asked, settings.max_backoff))
            self._check_open()

    def _poll_interval(self) -> float:
        """Seconds between the lists of a stream that may not watch:
        ``max_backoff``, jittered to 50-100 % (so the streams of many
        Services do not list in step)."""
        return self._settings.max_backoff * (0.5 + 0.5 * self._random.random())

    def _note_unwatchable(self, kind: Kind, run: _Run, denied: ProviderFailure) -> None:
        """The list of ``kind`` was allowed and its watch refused: poll, and
        say so once (a WARNING naming the missing permission), not per cycle."""
        run.polling.add(kind)
        if kind in self._unwatchable:
            logger.debug("%s: the watch is still forbidden; listed instead", denied)
            return
        self._unwatchable.add(kind)
        resource, group = _RESOURCES[kind]
        logger.warning(
            "kubernetes connection %r: the credentials may list but not watch %s in "
            'namespace %r (missing RBAC permission: verb "watch" on resource "%s" in API '
            'group "%s" in namespace "%s"); the provider lists them again about every %gs '
            "(max_backoff) instead of following changes, and goes back to watching once "
            "the permission is granted. The server said: %s",
            self._context.name,
            resource,
            self.namespace,
            resource,
            group,
            self.namespace,
            self._settings.max_backoff,
            denied,
        )

    def _watch_allowed(self, kind: Kind, run: _Run, what: str) -> None:
        """A watch of ``kind`` opened: a stream that polled follows changes again."""
        if kind in run.polling:
            run.polling.discard(kind)
            logger.debug("%s: the watch is allowed again; following changes", what)
        if kind in self._unwatchable:
            self._unwatchable.discard(kind)
            logger.info(
                "kubernetes connection %r: watching %s in namespace %r is allowed again; "
                "following changes",
                self._context.name,
                _RESOURCES[kind][0],
                self.namespace,
            )

    async def _pause(self, seconds: float) -> None:
        """Sleep ``seconds`` between a stream's requests, or until aclose()."""
        closing = self._closing
        if closing is None:
            closing = self._closing = anyio.Event()
        with anyio.move_on_after(seconds):
            await closing.wait()

    async def _check_version(self, kind: Kind, view: ServiceView, what: str) -> None:
        """Read the server's current version with a one-item list; Gone when
        it is lower than the one held (a restored storage)."""
        self.statistics.version_checks += 1
        params = {**self._selector(kind, view.name), "limit": "1"}
        body = await self._http.get(
            self._collection(kind), params, budget=self._timeout, what=f"{what}: version check"
        )
        try:
            current = decode_page(kind, body).metadata.resourceVersion
        except WireError as exc:
            raise IncompleteSnapshot(f"{what}: version check: {exc}") from None
        held = view.version(kind)
        if held and went_backwards(held, current):
            raise Gone(
                f"{what}: the server's resourceVersion {current[:32]} is lower than the "
                f"{held[:32]} held (the server's storage was restored)"
            )

    async def _stream(self, kind: Kind, run: _Run, what: str) -> bool:
        """One watch from the side's version until the server ends it (True)
        or, before any bookmark was seen, until it stays silent (False).

        Opening it confirms nothing: the API server accepts a watch from a
        version it has not reached and then sends nothing."""
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
        async with AsyncExitStack() as stack:
            try:
                lines = await stack.enter_async_context(
                    self._http.watch(
                        self._collection(kind),
                        params,
                        open_budget=max(self._timeout, _WATCH_OPEN_FLOOR),
                        idle_timeout=settings.watch_timeout + settings.watch_grace,
                        what=what,
                    )
                )
            except Forbidden as exc:
                raise _WatchDenied(exc) from None
            stats.watches_opened += 1
            self._watch_allowed(kind, run, what)
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
                        # No bookmark yet: a quiet but live server looks the
                        # same (see _pacing); the caller checks the version.
                        return False
                    raise IncompleteSnapshot(
                        f"{what}: the watch sent nothing for {quiet:g}s (the server sends a "
                        "bookmark about every minute); listing again"
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

    def _closed_error(self) -> IncompleteSnapshot:
        return IncompleteSnapshot(
            f"the kubernetes provider of connection {self._context.name!r} is closed"
        )

    def _check_open(self) -> None:
        if self._closed:
            raise self._closed_error()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._closing is not None:
            self._closing.set()
        await self._http.aclose()


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
