"""The etcd provider: discovery by range + watch, registration by lease.

Discovery (evidence :attr:`~nadisc.EvidenceKind.LEASE`: a record exists
because its registrant keeps a lease alive)::

    query(service)   one range of <prefix>/<service>/ (pages read at one revision,
                     each decoded while the next is served) -> complete ProviderSnapshot

    watch(service)   stream from now ─► range ─► publish ─► read (progress_notify)
                       ▲                    │ each received batch of events: publish once
                       │                    │ progress notify / matching probe: refresh()
                       │ compacted          │ stream broke, probe failed or stalled:
                       └── re-range ◄───────┤   fail(IncompleteSnapshot), backoff,
                                            └── resume from revision+1 (no loss, no repeat)

The first range (and one after a compaction) is taken inside a stream
opened from now, once it is created: etcd sends such a watch each change
as it commits, while a watch from a past revision waits for the server's
resync (every 100 ms). The range then stands at or past the stream's start.

That diagram is one service on a stream of its own (``watch: per_service``).
With ``watch: shared`` (the default) every watched service of the connection
is a member of one stream over ``<prefix>/`` (see :mod:`._fanout`): a member
joins, ranges (its events buffered meanwhile; the first member opens the
stream from now before its range) and is then fed its own service's
events; the stream is read in one member's task (the host) and reopened
from its newest delivered revision + 1 when it breaks or its host leaves;
a compaction makes every member range again. One probe per stream
(the newest change under the prefix, a keys-only range with limit 1) does
what the per-service probe below does for all members at once.

While the stream is up a probe (a keys-only range, every ``probe_interval_ms``)
checks that the server still answers within the request timeout, that our
permission still holds (etcd 3.4 keeps streaming to a watcher whose
permission was revoked) and that the stream is not stalled; when the probe
sees exactly our listing it confirms it with ``sink.refresh()``. After a
reported failure the next confirmation is a full ``publish`` instead, so the
observation leaves the failed state with a complete listing.

Malformed records are confirmed invalid candidates: they are never served
and are listed, with their key and reason, in ``ProviderSnapshot.invalid``;
the valid rest is still a complete listing (a bad record written by someone
else must not take every good instance down with it). A record too large
for any response under ``max_response_bytes`` is one of them too: the range
pages around it and names it by a keys-only read, and a watch message over
the limit makes the watch range again (``_range_into``, ``_oversized``). A
body that cannot be read completely is an ``IncompleteSnapshot``; a limit
that holds not even one key, or the server's own ``RESOURCE_EXHAUSTED``, a
``CapacityRejected``.

Registration::

    register    lease grant(ttl_seconds) + put <key> on the lease  -> handle = lease id
    renew       one keepalive round trip; TTL 0 / missing          -> LeaseLost
    check       lease time-to-live + range of the key              -> HEALTHY / MISSING
    deregister  delete the key if still on our lease, revoke the lease

Keepalives are due within a third of the TTL: the provider declares
``Capabilities.renew_within = ttl_seconds / 3`` and the owner renews at
``min(monitor_interval, renew_within)``, so two keepalives may be lost
before the lease lapses.

A write whose answer was lost is ``OutcomeUnknown``, except a registration
``put`` whose lease we then revoked successfully: a put on a revoked lease
can no longer land, so that registration is known not applied and reported
as a retryable ``IncompleteSnapshot`` (as is any write that was never sent).

The provider never starts tasks of its own; ``watch`` runs in the caller's
task group and holds one stream (on a dedicated connection, outside the
request pool) plus one probe task inside it; with the shared watch, the
host member's task holds the stream and its probe, the others wait for
what the stream tells them.

Costs: a watch batch of k events costs O(k log n) plus the decoding of
those k records, and its snapshot is one tuple copy (see :mod:`._state`);
the watch yields between batches. Per watched service and interval: one
probe range per ``probe_interval_ms``; one socket for the stream. Shared:
per connection one socket and one probe per interval; per event the routing
(one dictionary look-up per ``/`` in its key) plus its member's O(log n).
"""

from __future__ import annotations

import binascii
import importlib
import logging
import math
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

import anyio
import anyio.lowlevel
import httpx
from anyio.abc import TaskGroup, TaskStatus
from pydantic import BaseModel

from nadisc import (
    Capabilities,
    CapacityRejected,
    ConfigError,
    ConnectionContext,
    EvidenceKind,
    HealthStatus,
    IdentityRevoked,
    IncompleteSnapshot,
    LeaseLost,
    LifecycleError,
    ObservationSink,
    OutcomeUnknown,
    ProviderFailure,
    ProviderSnapshot,
    Registered,
    RegistrationError,
    RegistrationRecord,
    RegistrationRejected,
    multi_request_read,
    redacted_excerpt,
)

from ._client import Batches, EtcdClient, ResponseTooLarge, WatchMessageTooLarge
from ._fanout import Fanout, Member
from ._layout import Layout, check_record, encode_record
from ._leases import LeasePool
from ._settings import EtcdSettings
from ._state import Backoff, ProbeVerdict, Reset, ServiceState
from ._wire import GatewayStatus, KeyValue, RangeResponse, prefix_range_end

if TYPE_CHECKING:
    from ._grpc import EtcdGrpcClient

__all__ = ["EtcdProvider", "EtcdProviderFactory", "EtcdStatistics", "factory"]

logger = logging.getLogger(__name__)

#: A lease must be kept alive within this fraction of its TTL: two keepalives
#: may be lost (or answered late) before the lease lapses.
RENEW_FRACTION = 1 / 3
#: Keys of the first page of a query that a running watch may make
#: unnecessary (it tells the range's revision; the rest is then not read),
#: and the page of the keys-only probe.
RANGE_PAGE = 250
#: The body one page of a complete range aims at (never above half of
#: ``max_response_bytes``): msgspec decodes a page in one synchronous call,
#: about 1 ms of CPU per MiB here, so a page holds the loop a few ms.
PAGE_BYTES = 4 * 2**20
#: The wire size assumed for a record of a service never ranged before
#: (base64 value, base64 key, revisions and JSON framing).
RECORD_ESTIMATE = 1024
#: Bytes of JSON framing per record besides its key and value text.
RECORD_FRAMING = 120
#: The wires on which a listing that fits one page is still read in pages
#: (see ``_range_into``): on ``grpc`` etcd serves a page in about the time
#: we take to decode one, so the pages overlap; the JSON gateway's serving
#: costs etcd several times our decode (and the CPU of a 2-core machine),
#: and a listing split there measured no faster, for more CPU.
PIPELINE_WIRES = frozenset({"grpc"})
#: Keys of a page of a complete range on those wires (when the page budget
#: holds more; a listing up to this size is one request): the next page is
#: asked for before a page is decoded, so etcd serves and sends it
#: meanwhile. etcd serves a key in about the time we take to decode one (on
#: ``grpc``, plus about 1 ms per request), so pages of one size keep both
#: busy; measured on 10,000 records, two pages of 5,000 beat one page,
#: smaller pages, and pages growing from a smaller first one.
PIPELINE_PAGE = 5000


def page_size(max_response_bytes: int, record_bytes: int, max_instances: int) -> int:
    """Keys per page of a complete range: as many as fit the page budget
    (``PAGE_BYTES``, at most half of ``max_response_bytes``, so a page of
    records up to twice the estimate still fits the limit) at
    ``record_bytes`` each, and never more than the service may hold plus
    one (a listing that fits is then one request)."""
    budget = min(PAGE_BYTES, max_response_bytes // 2)
    return max(1, min(max_instances + 1, budget // max(record_bytes, RECORD_FRAMING)))


def record_bytes(kvs: Sequence[KeyValue]) -> int:
    """The mean wire size of a page's records, from at most 32 of them
    spread over the page (an estimate for the next page, not a limit)."""
    if not kvs:
        return RECORD_ESTIMATE
    step = max(1, len(kvs) // 32)
    sample = kvs[::step]
    total = sum(kv.value_size + (len(kv.key) * 4 + 2) // 3 for kv in sample)
    return total // len(sample) + RECORD_FRAMING


#: Services the shared watch publishes between two turns of the event loop.
PUBLISH_STEP = 64
#: Query listings kept for a watch to take over (the owner queries a
#: service, then starts its watch): at most this many services, and at most
#: ``max_instances_per_service`` records in all.
QUERIED_SERVICES = 64


#: Our registrations on one lease from which a check reads the whole
#: service once (shared by the checks arriving together) instead of its key.
SHARED_CHECK_MIN = 8


class _Flight:
    """One request that concurrent callers share (see ``_single_flight``)."""

    __slots__ = ("answered", "done", "failure", "result")

    def __init__(self) -> None:
        self.done = anyio.Event()
        #: Whether ``result`` is the server's answer (else the request failed,
        #: or its caller was cancelled before the answer: nothing is known).
        self.answered = False
        self.result = 0
        self.failure: ProviderFailure | None = None


def shares_watch(settings: EtcdSettings) -> bool:
    """True when the connection's watches ride on one stream over the prefix."""
    return settings.watch == "shared" and bool(settings.prefix)


def capabilities_for(settings: EtcdSettings) -> Capabilities:
    """What an etcd connection can do; renewals are due within a third of the TTL."""
    return Capabilities(
        evidence=EvidenceKind.LEASE,
        registration=True,
        watch_streams=1,
        shared_watch=shares_watch(settings),
        watch_takes_query=True,
        idempotent_renewal=True,
        renew_within=settings.ttl_seconds * RENEW_FRACTION,
    )


@dataclass(frozen=True, slots=True)
class EtcdStatistics:
    """Counters of one provider since it was created (an immutable record)."""

    requests: int
    request_failures: int
    authentications: int
    #: Complete ranges taken by watches (initial and after compaction).
    watch_ranges: int
    watch_streams_opened: int
    #: Attempts to resume from ``revision + 1`` after a failure (no re-range).
    watch_resumes: int
    #: Re-ranges forced by a compacted start revision.
    compaction_resyncs: int
    watch_failures: int
    publishes: int
    probes: int
    #: Watches holding a dedicated connection right now (never from the pool).
    watch_connections: int = 0
    #: Leases granted for registrations (shared: one per LEASE_GROUP keys).
    leases_granted: int = 0
    #: Keepalives sent (one per shared lease per renewal window).
    keepalives: int = 0
    #: Shared leases held right now.
    leases_held: int = 0
    #: Watches that started from their service's query listing, read at the
    #: revision their stream was created at, instead of a range.
    watch_listings_taken: int = 0
    #: Watch messages refused as over ``max_response_bytes`` (etcd would send
    #: one again on resume): each made the watch range again, from a stream
    #: opened from now (on the shared stream, every watched service).
    oversized_resyncs: int = 0


@dataclass(slots=True)
class _Counts:
    leases_granted: int = 0
    keepalives: int = 0
    watch_ranges: int = 0
    watch_streams_opened: int = 0
    watch_resumes: int = 0
    compaction_resyncs: int = 0
    watch_failures: int = 0
    publishes: int = 0
    probes: int = 0
    watch_listings_taken: int = 0
    oversized_resyncs: int = 0


class _InFlight:
    """The queries of one service in flight, and the event set when the last ends."""

    __slots__ = ("count", "done")

    def __init__(self) -> None:
        self.count = 0
        self.done = anyio.Event()


class _Run:
    """Mutable bookkeeping of one ``watch`` call."""

    __slots__ = ("backoff", "failed", "failure", "sink", "state", "unpublished")

    def __init__(self, state: ServiceState, sink: ObservationSink, backoff: Backoff) -> None:
        self.state = state
        self.sink = sink
        #: Reset by every complete listing the sink receives, not by a mere
        #: reconnect (a stream that opens and fails at once keeps backing off).
        self.backoff = backoff
        #: A failure was reported and no complete listing followed yet.
        self.failed = False
        #: Why the current stream must be abandoned (set by the reader or the probe).
        self.failure: ProviderFailure | None = None
        #: The listing changed and was not published yet (the shared stream
        #: publishes its changed members in steps; a confirmation publishes
        #: rather than refreshes an older listing).
        self.unpublished = False


class _Compacted(Exception):
    """The watch start revision was compacted away: take a fresh range."""


class _Oversized(_Compacted):
    """The shared stream refused a message over ``max_response_bytes``
    (:class:`~._client.WatchMessageTooLarge`): take a fresh range, as after
    a compaction."""


class _Page:
    """One page of a complete range, asked for in a child task of the range's
    task group while the page before it is decoded (see ``_range_into``)."""

    __slots__ = ("answer", "done", "error")

    def __init__(self) -> None:
        self.done = anyio.Event()
        self.answer: RangeResponse | None = None
        #: The request's failure, raised by :meth:`result` in the range's own
        #: task (so it is reported as a request of that task would be).
        self.error: Exception | None = None

    async def fetch(
        self,
        request: Callable[[], Awaitable[RangeResponse]],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        # Started at once: the request is under way (up to its first wait)
        # before the range's task decodes the page before it.
        task_status.started()
        try:
            self.answer = await request()
        except Exception as exc:
            self.error = exc
        finally:
            self.done.set()

    @property
    def failed(self) -> bool:
        """The request failed with what ends the range (a page refused as
        too large is asked again in smaller pages instead)."""
        return self.error is not None and not isinstance(self.error, ResponseTooLarge)

    async def result(self) -> RangeResponse:
        await self.done.wait()
        if self.error is not None:
            raise self.error
        assert self.answer is not None
        return self.answer


def client_for(
    context: ConnectionContext,
    settings: EtcdSettings,
    transport: httpx.AsyncBaseTransport | None = None,
) -> EtcdClient | EtcdGrpcClient:
    """The client of ``settings.wire``. ``ConfigError`` naming ``etcd.wire``
    when ``grpc`` is asked for without the ``grpc`` extra installed."""
    if settings.wire == "json":
        return EtcdClient(
            settings,
            request_timeout=context.request_timeout,
            max_response_bytes=context.max_response_bytes,
            transport=transport,
        )
    path = f"discovery.connections.{context.name}.etcd.wire"
    if transport is not None:
        raise ConfigError(path, "an HTTP transport can only be given with wire 'json'")
    try:
        for module in ("h2", "google.protobuf"):
            importlib.import_module(module)
        from ._grpc import EtcdGrpcClient
    except ImportError as exc:
        raise ConfigError(
            path,
            f"wire 'grpc' needs the grpc extra (pip install 'poise-nadisc[grpc]'): "
            f"{exc.name or 'a module'} is not installed",
        ) from None
    return EtcdGrpcClient(
        settings,
        request_timeout=context.request_timeout,
        max_response_bytes=context.max_response_bytes,
    )


class EtcdProvider:
    """One etcd connection. See the module docstring for what each call does."""

    def __init__(
        self,
        context: ConnectionContext,
        settings: EtcdSettings,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self._context = context
        self._settings = settings
        self._layout = Layout(settings.prefix)
        self._client = client_for(context, settings, transport)
        self._counts = _Counts()
        self._closed = False
        self._capabilities = capabilities_for(settings)
        #: The leases our registrations share (one TTL per connection).
        self._leases = LeasePool(self._capabilities.renew_within or settings.ttl_seconds / 3)
        self._grant_lock = anyio.Lock()
        self._keepalives: dict[int, _Flight] = {}
        self._ttl_reads: dict[int, _Flight] = {}
        self._range_reads: dict[str, _Flight] = {}
        #: One range per service, shared by checks: (when sent, its records by
        #: key, the last key read when the range was cut at the listing limit,
        #: else None).
        self._service_reads: dict[str, tuple[float, dict[bytes, KeyValue], bytes | None]] = {}
        #: key -> when our put of it was answered (checks trust only later reads).
        self._put_at: dict[bytes, float] = {}
        #: service -> the mean wire size of its records at its last range
        #: (sizes the next range's pages).
        self._record_bytes: dict[str, int] = {}
        #: service -> the state of a running watch of it: a query reuses the
        #: records that watch already decoded.
        self._live: dict[str, ServiceState] = {}
        #: service -> the listing its last query read (oldest first, bounded
        #: by QUERIED_RECORDS and QUERIED_SERVICES): a watch whose stream
        #: was created at that very revision takes it instead of ranging.
        self._queried: OrderedDict[str, ServiceState] = OrderedDict()
        self._queried_records = 0
        #: service -> set when its queries in flight have all answered (the
        #: owner starts a watch while the query before it runs).
        self._querying: dict[str, _InFlight] = {}
        #: The members of the shared watch over ``<prefix>/`` (None: one
        #: stream per watched service).
        self._fanout: Fanout[_Run] | None = (
            Fanout(self._layout.watch_prefix()) if shares_watch(settings) else None
        )

    def __repr__(self) -> str:
        return (
            f"<EtcdProvider connection={self._context.name!r} endpoint={self._client.endpoint!r} "
            f"prefix={self._settings.prefix!r} closed={self._closed}>"
        )

    @property
    def capabilities(self) -> Capabilities:
        """Lease evidence, one watch stream, idempotent keepalives, and
        ``renew_within = ttl_seconds / 3`` so the owner renews in time."""
        return self._capabilities

    @property
    def settings(self) -> EtcdSettings:
        return self._settings

    def statistics(self) -> EtcdStatistics:
        c, n = self._counts, self._client.counters
        return EtcdStatistics(
            requests=n.requests,
            request_failures=n.failures,
            authentications=n.authentications,
            watch_ranges=c.watch_ranges,
            watch_streams_opened=c.watch_streams_opened,
            watch_resumes=c.watch_resumes,
            compaction_resyncs=c.compaction_resyncs,
            watch_failures=c.watch_failures,
            publishes=c.publishes,
            leases_granted=c.leases_granted,
            keepalives=c.keepalives,
            leases_held=len(self._leases),
            probes=c.probes,
            watch_connections=n.watch_connections,
            watch_listings_taken=c.watch_listings_taken,
            oversized_resyncs=c.oversized_resyncs,
        )

    def _check_open(self) -> None:
        if self._closed:
            raise LifecycleError(f"etcd provider of connection {self._context.name!r} is closed")

    def _deadline(self) -> float:
        return anyio.current_time() + self._context.request_timeout

    # ------------------------------------------------------------ discovery

    async def prepare(self, deadline: float) -> None:
        """Reach the cluster, authenticate, and check read permission on every
        bound service (``IdentityRevoked`` names the service that is refused).

        With the shared watch, one count-only range of the whole prefix covers
        every service (the watch needs that permission anyway); only when it
        is refused are the services checked one by one, to name the refused one.
        """
        self._check_open()
        await self._client.status(deadline=deadline)
        if self._fanout is not None and self._settings.services:
            head = self._fanout.head
            try:
                await self._client.range(
                    head, prefix_range_end(head), count_only=True, deadline=deadline
                )
            except IdentityRevoked:
                pass
            else:
                return
        # One count-only range per bound service, all at once (the request
        # limiter paces them): a thousand bound services fit in one request
        # timeout. A refusal is reported for the first alias by name.
        refused: dict[str, IdentityRevoked] = {}
        failures: list[ProviderFailure] = []

        async def check(alias: str) -> None:
            head = self._layout.service_prefix(self._settings.remote_name(alias))
            try:
                await self._client.range(
                    head, prefix_range_end(head), count_only=True, deadline=deadline
                )
            except IdentityRevoked as exc:
                refused[alias] = exc
            except ProviderFailure as exc:
                failures.append(exc)

        async with anyio.create_task_group() as group:
            for alias in sorted(self._settings.services):
                group.start_soon(check, alias)
        if refused:
            alias = min(refused)
            remote = self._settings.remote_name(alias)
            cause = refused[alias]
            raise IdentityRevoked(f"service {alias!r} ({remote!r}): {cause}") from cause
        if failures:
            raise failures[0]

    def _new_state(self, service: str) -> ServiceState:
        return ServiceState(
            service,
            self._layout,
            max_record_bytes=self._settings.max_record_bytes,
            max_instances=self._context.max_instances_per_service,
        )

    async def _range_into(
        self,
        state: ServiceState,
        deadline: float,
        *,
        settled: Callable[[int], bool] | None = None,
    ) -> bool:
        """A complete range of the service, in pages all read at the revision
        of the first page (one consistent listing), each page decoded
        cooperatively (the loop gets a turn between pages and every few
        hundred records) while the next one is asked for, reusing what a
        live watch already decoded.

        Pipelined: once a page arrives, the next one (from its last key) is
        asked for in a child task of this call's task group, and the page is
        decoded meanwhile, so etcd serves and sends the next page while we
        decode this one. A page holds what the page budget allows
        (:func:`page_size`); on the wires of :data:`PIPELINE_WIRES` a
        listing that fits it is split too, in pages of :data:`PIPELINE_PAGE`
        keys (a listing up to that size is one request). A failure of either
        side cancels the other and is raised as the request's (or the
        decode's) own; a cancelled caller leaves no request behind. Without
        a served channel, the gRPC wire's pages share one the range holds.

        A page refused as over ``max_response_bytes`` (records far larger
        than estimated) is asked again in pages a quarter its size until
        its keys are read, at the same revision (pinned by a count-only
        range when the first page was refused). A record refused even alone
        can never be read: it is named by a keys-only read of that one key
        and listed invalid (:meth:`_unreadable`), and the range goes on
        past it. Only a limit that holds not even that is
        ``CapacityRejected``.

        ``settled(revision)``, asked once the range's revision is known:
        True stops there (the range is not needed: a live watch already
        stands at or past it) and the state is left as it was; returns
        whether the state was filled.

        A deadline that passes between two of the range's requests is a
        timeout of the range, ``IncompleteSnapshot`` (as one that passes
        during a request): only a deadline already past when the range
        starts is ``DeadlineExceeded``. A watch's range runs under the
        provider's own deadline, and a slow registry must be a failure the
        watch reports and retries, never an error that ends the watch."""
        failure: Exception | None = None
        filled = False
        with multi_request_read(deadline, f"etcd: the range of {state.service!r}"):
            # The pages share one channel (gRPC wire, no served channel).
            async with self._client.pinned(), anyio.create_task_group() as group:
                try:
                    filled = await self._read_pages(group, state, deadline, settled)
                except Exception as exc:
                    # Raised as it is, not in the group's exception group; the
                    # page in flight, if any, is cancelled with the group.
                    failure = exc
                    group.cancel_scope.cancel()
            if failure is not None:
                raise failure
        return filled

    async def _read_pages(
        self,
        group: TaskGroup,
        state: ServiceState,
        deadline: float,
        settled: Callable[[int], bool] | None,
    ) -> bool:
        """The body of :meth:`_range_into`; each next page is fetched in ``group``."""
        head = self._layout.service_prefix(state.service)
        end = prefix_range_end(head)
        #: Records too large to read in any response: key -> reason.
        unread: dict[bytes, str] = {}
        building = state.resetting(unread)
        count = 0
        start, revision = head, 0
        limit_bytes = self._context.max_response_bytes
        most = self._context.max_instances_per_service
        estimate = self._record_bytes.get(state.service, RECORD_ESTIMATE)
        # A query a running watch may answer reads a small first page (it
        # tells the revision); any other range starts with a full page.
        short = settled is not None and state.service in self._live
        # After a refused page: how many of its keys from ``start`` are not
        # read yet (0: none), and the page size until they are (a quarter
        # of the refused one). Pages never grow back into a refused one.
        window = cap = 0
        # Whether a listing that fits the page budget is split (PIPELINE_WIRES).
        split = self._settings.wire in PIPELINE_WIRES
        #: The page read and not decoded yet (decoded while the next is fetched).
        pending: Sequence[KeyValue] = ()
        while True:
            # ``full``: the page the limits allow; the pipeline may ask for less.
            if window:
                full = limit = min(cap, window)
            else:
                full = (
                    RANGE_PAGE if short and not revision else page_size(limit_bytes, estimate, most)
                )
                limit = min(full, PIPELINE_PAGE) if split else full
            page = _Page()
            await group.start(
                page.fetch,
                partial(
                    self._client.range,
                    start,
                    end,
                    limit=limit,
                    revision=revision,
                    deadline=deadline,
                ),
            )
            if pending:
                await self._decode_page(state, building, pending, page)
                pending = ()
            try:
                answer = await page.result()
            except ResponseTooLarge:
                if not revision:
                    revision = (
                        await self._client.range(start, end, count_only=True, deadline=deadline)
                    ).header.revision
                    if settled is not None and settled(revision):
                        return False
                if limit > 1:
                    window, cap = limit, max(1, limit // 4)
                    continue
                answer = await self._unreadable(start, end, revision, deadline)
                unread[answer.kvs[0].key] = (
                    "value too large to read: a response holding only this record is over "
                    f"max_response_bytes={limit_bytes} (limits.max_snapshot_bytes)"
                )
            else:
                if not revision:
                    revision = answer.header.revision
                    if settled is not None and settled(revision):
                        return False
                if answer.kvs:
                    estimate = record_bytes(answer.kvs)
                    self._record_bytes[state.service] = estimate
            if window:
                window = max(0, window - len(answer.kvs))
            count += len(answer.kvs)
            if not answer.more:
                await self._decode_page(state, building, answer.kvs, None)
                break
            if not answer.kvs:
                raise IncompleteSnapshot(f"service {state.service!r}: the range was truncated")
            # Whether a page of ``full`` keys would have left more (a page
            # cut short for the pipeline says ``more`` for a listing that
            # fits the budget's page): only then is a listing over the
            # limit refused before it is read.
            beyond = answer.more if limit == full else answer.count > full
            if beyond and (count > most or answer.count > most):
                # Far past the limit already: the listing would be refused anyway.
                raise CapacityRejected(
                    f"service {state.service!r}: more than "
                    f"max_instances_per_service={self._context.max_instances_per_service} records"
                )
            start = answer.kvs[-1].key + b"\x00"
            pending = answer.kvs
        building.finish(revision)
        return True

    async def _decode_page(
        self,
        state: ServiceState,
        building: Reset,
        kvs: Sequence[KeyValue],
        fetching: _Page | None,
    ) -> None:
        """Decode one page into ``building`` (reusing a live watch's records),
        giving the loop a turn every few hundred records and after the page;
        stops early once ``fetching`` (the next page's request) failed."""
        live = self._live.get(state.service)
        for _ in building.page_steps(kvs, live):
            if fetching is not None and fetching.failed:
                return
            await anyio.lowlevel.checkpoint()
        await anyio.lowlevel.checkpoint()

    async def _unreadable(
        self, start: bytes, end: bytes, revision: int, deadline: float
    ) -> RangeResponse:
        """The first key from ``start`` at ``revision``, read keys-only: the
        record a one-record page at that revision could not hold. (etcd
        reports no value sizes; its key, ``mod_revision`` and the rest of
        the range are what a keys-only read of one key tells.)"""
        answer = await self._client.range(
            start, end, keys_only=True, limit=1, revision=revision, deadline=deadline
        )
        if not answer.kvs:
            raise IncompleteSnapshot(
                f"{start.decode('utf-8', 'replace')!r}: a record refused as too large "
                f"is not in a keys-only range at revision {revision}"
            )
        return answer

    async def query(self, service: str, deadline: float) -> ProviderSnapshot:
        """One range of the service prefix as a complete listing.

        When a running watch of the service already stands at or past the
        range's revision, its listing is returned instead: a range answered
        before a watch event was applied must not put the older listing back.
        That is known from the first page: the rest is then not read.
        """
        self._check_open()

        def watched_past(revision: int) -> bool:
            live = self._live.get(service)
            return live is not None and self._watched_revision(live) >= revision

        state = self._new_state(service)
        flight = self._querying.get(service)
        if flight is None:
            flight = self._querying[service] = _InFlight()
        flight.count += 1
        try:
            # Asked at the first page, and again at the end (the watch may
            # have moved past the range while its later pages were read).
            if not await self._range_into(state, deadline, settled=watched_past) or watched_past(
                state.revision
            ):
                return self._live[service].snapshot()
            snapshot = state.snapshot()
            self._keep_queried(state)
            return snapshot
        finally:
            flight.count -= 1
            if not flight.count:
                del self._querying[service]
                flight.done.set()

    def _keep_queried(self, state: ServiceState) -> None:
        """Keep a query's listing for a watch of the service about to start."""
        old = self._queried.pop(state.service, None)
        if old is not None:
            self._queried_records -= len(old)
        self._queried[state.service] = state
        self._queried_records += len(state)
        most = self._context.max_instances_per_service
        while self._queried and (
            self._queried_records > most or len(self._queried) > QUERIED_SERVICES
        ):
            _, dropped = self._queried.popitem(last=False)
            self._queried_records -= len(dropped)

    async def _take_queried(self, state: ServiceState, created: int) -> bool:
        """Fill ``state`` with its service's last query listing when that was
        read at ``created``, the revision a stream from now was just created
        at: nothing changed in between, so it is what a range would read now
        (and the stream delivers everything after it). True if taken.

        A query of the service still in flight (the owner starts the watch
        while it runs) is waited for, within the request deadline: its
        listing is the one to take."""
        flight = self._querying.get(state.service)
        if flight is not None:
            with anyio.move_on_at(self._deadline()):
                await flight.done.wait()
        queried = self._queried.pop(state.service, None)
        if queried is None:
            return False
        self._queried_records -= len(queried)
        if queried.revision != created:
            return False
        state.adopt(queried)
        return True

    def _watched_revision(self, state: ServiceState) -> int:
        """The revision up to which a running watch has applied every event
        of ``state``'s service (-1 while it has no complete listing)."""
        if self._fanout is not None:
            return self._fanout.delivered(state)
        return state.revision if state.revision else -1

    async def watch(
        self,
        service: str,
        sink: ObservationSink,
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        """Keep ``sink`` current until cancelled (see the module docstring).

        ``task_status.started()`` is called once the first outcome reached the
        sink: the first complete listing, or the first failure when the server
        cannot be reached (the owner must not wait forever on an unreachable
        registry to create its observation slot). Raises ``LifecycleError`` if
        the provider is closed underneath it.
        """
        self._check_open()
        backoff = Backoff(
            self._settings.retry_initial_backoff_ms / 1000,
            self._settings.retry_max_backoff_ms / 1000,
        )
        run = _Run(self._new_state(service), sink, backoff)
        self._live.setdefault(service, run.state)
        try:
            if self._fanout is not None:
                await self._watch_shared(self._fanout, run, service, task_status)
            else:
                await self._watch(run, service, sink, task_status, backoff)
        finally:
            if self._live.get(service) is run.state:
                del self._live[service]

    async def _watch(
        self,
        run: _Run,
        service: str,
        sink: ObservationSink,
        task_status: TaskStatus[None],
        backoff: Backoff,
    ) -> None:
        started = False
        need_range = True

        async def take_range(created: int) -> None:
            nonlocal need_range, started
            if await self._take_queried(run.state, created):
                self._counts.watch_listings_taken += 1
            else:
                self._counts.watch_ranges += 1
                await self._range_into(run.state, self._deadline())
            need_range = False
            self._publish(run)
            if not started:
                started = True
                task_status.started()

        while True:
            try:
                # A range is taken inside a stream opened from now (see _follow).
                await self._follow(run, first=take_range if need_range else None)
            except _Compacted:
                self._counts.compaction_resyncs += 1
                need_range = True
                continue
            except ProviderFailure as exc:
                if isinstance(exc, WatchMessageTooLarge) and not need_range:
                    # The stream cannot go past that message: range afresh
                    # (a record too large is listed invalid there) inside a
                    # stream opened from now. Refused before the range was
                    # taken, it is reported below instead (the limit may
                    # not hold even the stream's own messages).
                    self._oversized(service, exc)
                    need_range = True
                    continue
                self._counts.watch_failures += 1
                logger.info(
                    "etcd watch of %r on connection %r failed: %s",
                    service,
                    self._context.name,
                    exc,
                )
                run.failed = True
                sink.fail(exc)
            if not started:
                started = True
                task_status.started()
            await anyio.sleep(backoff.next_delay())
            self._check_open()
            if not need_range:
                self._counts.watch_resumes += 1

    def _oversized(self, watched: str, failure: WatchMessageTooLarge) -> None:
        """A watch message over the response limit makes the watch (every
        service of a shared one) range again; counted and logged."""
        self._counts.oversized_resyncs += 1
        logger.warning(
            "etcd watch of %r on connection %r: a message over max_response_bytes=%d was "
            "refused (%s); ranging again",
            watched,
            self._context.name,
            self._context.max_response_bytes,
            failure,
        )

    def _publish(self, run: _Run) -> None:
        try:
            snapshot = run.state.snapshot()
        except ProviderFailure as exc:
            run.failed = True
            run.sink.fail(exc)
            return
        run.failed = False
        run.unpublished = False
        run.backoff.reset()
        self._counts.publishes += 1
        run.sink.publish(snapshot)

    def _confirm(self, run: _Run) -> None:
        if run.failed or run.unpublished:
            self._publish(run)
        else:
            run.backoff.reset()
            run.sink.refresh()

    async def _follow(
        self, run: _Run, *, first: Callable[[int], Awaitable[None]] | None = None
    ) -> None:
        """Follow one stream until it fails (raise) or is compacted (``_Compacted``).

        With ``first`` (the service's range), the stream is opened from now
        and ``first()`` runs once it is created, before the stream is read:
        the range is then at or past the stream's start, and the events it
        already holds are ignored when they arrive. (etcd sends a watch from
        now every change as it commits; a watch from a past revision waits
        for the server's resync, every 100 ms.) Without it, the stream
        resumes from ``revision + 1``."""
        head = self._layout.service_prefix(run.state.service)
        async with self._client.watch(
            head,
            prefix_range_end(head),
            start_revision=0 if first is not None else run.state.revision + 1,
            open_deadline=self._deadline(),
        ) as stream:
            self._counts.watch_streams_opened += 1
            if first is not None:
                if not stream.created_revision:
                    raise IncompleteSnapshot(
                        f"etcd watch of {run.state.service!r}: the stream did not say its revision"
                    )
                # A linearizable range sent after the stream was created
                # stands at or past its start: no event falls in between.
                await first(stream.created_revision)
            run.failure = None
            compacted = False
            async with anyio.create_task_group() as group:

                async def read() -> None:
                    nonlocal compacted
                    try:
                        await self._read(run, stream)
                    except _Compacted:
                        compacted = True
                    except ProviderFailure as exc:
                        run.failure = exc
                    group.cancel_scope.cancel()

                async def probe() -> None:
                    try:
                        await self._probe(run, head)
                    except ProviderFailure as exc:
                        run.failure = exc
                    group.cancel_scope.cancel()

                group.start_soon(read)
                group.start_soon(probe)
        if compacted:
            raise _Compacted
        if run.failure is not None:
            raise run.failure

    async def _read(self, run: _Run, stream: Batches) -> None:
        state = run.state
        while True:
            batch = await stream.next_batch()
            changed = progressed = False
            for message in batch:
                if message.canceled:
                    if message.compact_revision:
                        logger.info(
                            "etcd watch of %r: revision %d compacted (now %d), ranging again",
                            state.service,
                            state.revision + 1,
                            message.compact_revision,
                        )
                        raise _Compacted
                    status = GatewayStatus.from_cancel_reason(message.cancel_reason)
                    if status.permission_denied or status.credentials_missing:
                        raise IdentityRevoked(f"etcd watch of {state.service!r}: {status}")
                    raise IncompleteSnapshot(f"etcd watch of {state.service!r} canceled: {status}")
                if message.created:
                    continue
                if message.events:
                    changed |= state.apply(message)
                elif message.is_progress:
                    state.progress(message.header.revision)
                    progressed = True
            if changed:
                # Latest-only: everything this read delivered is applied
                # first, then published once.
                self._publish(run)
            elif progressed:
                self._confirm(run)
            # next_batch() gives the loop a turn between batches, even when
            # the socket always has more to read (a burst).

    async def _probe(self, run: _Run, head: bytes) -> None:
        interval = self._settings.probe_interval_ms / 1000
        # Right after a failure, confirm at once: the stream may have nothing to say.
        if not run.failed:
            await anyio.sleep(interval)
        while True:
            self._counts.probes += 1
            revision, kvs = await self._keys_of(head, self._deadline())
            # Compared in steps, the loop getting a turn in between: a
            # 10,000-key service is never judged in one go.
            steps = run.state.judge_probe_steps(revision, kvs)
            while True:
                try:
                    next(steps)
                except StopIteration as done:
                    verdict: ProbeVerdict = done.value
                    break
                await anyio.lowlevel.checkpoint()
            if verdict is ProbeVerdict.CONFIRMED:
                self._confirm(run)
            elif verdict is ProbeVerdict.STALLED:
                raise IncompleteSnapshot(
                    f"etcd watch of {run.state.service!r} stalled below revision {revision}"
                )
            await anyio.sleep(interval)

    async def _keys_of(self, head: bytes, deadline: float) -> tuple[int, list[KeyValue]]:
        """Keys and mod revisions under ``head``, in pages of :data:`RANGE_PAGE`
        all read at the first page's revision (each page one small decode).
        A deadline that passes between pages is ``IncompleteSnapshot``
        (see :meth:`_range_into`)."""
        end = prefix_range_end(head)
        kvs: list[KeyValue] = []
        start, revision = head, 0
        shown = head.decode("utf-8", "replace")
        with multi_request_read(deadline, f"etcd: the keys-only range of {shown!r}"):
            while True:
                answer = await self._client.range(
                    start,
                    end,
                    keys_only=True,
                    limit=RANGE_PAGE,
                    revision=revision,
                    deadline=deadline,
                )
                if not revision:
                    revision = answer.header.revision
                kvs.extend(answer.kvs)
                if not answer.more:
                    return revision, kvs
                if not answer.kvs:
                    raise IncompleteSnapshot(f"{shown!r}: the keys-only range was truncated")
                start = answer.kvs[-1].key + b"\x00"
                await anyio.lowlevel.checkpoint()

    # --------------------------------------------------------- shared watch

    async def _watch_shared(
        self, fanout: Fanout[_Run], run: _Run, service: str, task_status: TaskStatus[None]
    ) -> None:
        """:meth:`watch` as a member of the shared stream over the prefix."""
        member = fanout.join(run.state, run)
        started = False
        need_range = True

        async def take_range(created: int | None = None) -> None:
            """The member's range; ``created``: this member opened the stream
            from now, created at that revision (a query listing read at it
            is taken instead)."""
            nonlocal need_range, started
            if created is not None and await self._take_queried(run.state, created):
                self._counts.watch_listings_taken += 1
                accepted = fanout.accept(member, run.state.revision)
                assert accepted  # at the stream's own start
            else:
                self._counts.watch_ranges += 1
                while True:
                    await self._range_into(run.state, self._deadline())
                    if fanout.accept(member, run.state.revision):
                        break
                    if fanout.opening:
                        await self._opened(fanout, member)
            need_range = False
            self._publish(run)
            if not started:
                started = True
                task_status.started()

        try:
            while True:
                try:
                    if need_range:
                        fanout.begin_range(member)
                        if fanout.idle():
                            # Nothing to resume: the stream opens from now,
                            # then this member ranges (see Fanout.open_fresh).
                            await self._host(fanout, member, first=take_range)
                            if need_range:
                                raise self._taken_failure(member)
                        else:
                            await take_range()
                    await self._follow_shared(fanout, run, member)
                except _Compacted as exc:
                    if not isinstance(exc, _Oversized):
                        self._counts.compaction_resyncs += 1
                    need_range = True
                    continue
                except ProviderFailure as exc:
                    self._report(run, service, exc)
                if not started:
                    started = True
                    task_status.started()
                await anyio.sleep(run.backoff.next_delay())
                self._check_open()
                if not need_range:
                    self._counts.watch_resumes += 1
        finally:
            fanout.leave(member)

    async def _opened(self, fanout: Fanout[_Run], member: Member[_Run]) -> None:
        """Wait until the stream being opened from now was created (or its
        opening ended)."""
        woken = anyio.Event()
        member.woken = False
        member.waker = woken.set
        try:
            while fanout.opening and not member.woken:
                await woken.wait()
        finally:
            member.waker = None

    def _taken_failure(self, member: Member[_Run]) -> ProviderFailure:
        """Why a stream this member opened ended before its range was taken."""
        if member.compacted:
            member.compacted = False
            if member.oversized:
                member.oversized = False
                return CapacityRejected(
                    "the shared etcd watch refused a message over max_response_bytes="
                    f"{self._context.max_response_bytes} while it opened"
                )
            return IncompleteSnapshot("the shared etcd watch was compacted while it opened")
        failure, member.failure = member.failure, None
        if isinstance(failure, ProviderFailure):
            return failure
        return IncompleteSnapshot(f"the shared etcd watch failed: {failure}")

    def _report(self, run: _Run, service: str, failure: ProviderFailure) -> None:
        self._counts.watch_failures += 1
        logger.info(
            "etcd watch of %r on connection %r failed: %s", service, self._context.name, failure
        )
        run.failed = True
        run.sink.fail(failure)

    async def _follow_shared(self, fanout: Fanout[_Run], run: _Run, member: Member[_Run]) -> None:
        """Wait for what the stream tells this member; read the stream (and
        probe the server) while nobody else does. Raises the stream's failure
        or ``_Compacted``."""
        await self._serve_member(fanout, member)

    async def _serve_member(self, fanout: Fanout[_Run], member: Member[_Run]) -> None:
        """Wait for what the stream tells this member; read the stream while
        nobody else does. Raises the stream's failure or ``_Compacted``."""
        while True:
            member.woken = False
            if member.compacted:
                raise _Oversized if member.oversized else _Compacted
            failure = member.failure
            if failure is not None:
                member.failure = None
                if isinstance(failure, ProviderFailure):
                    raise failure
                raise IncompleteSnapshot(f"the shared etcd watch failed: {failure}")
            if fanout.host is None:
                await self._host(fanout, member)
                continue
            woken = anyio.Event()
            member.waker = woken.set
            try:
                if not member.woken:
                    await woken.wait()
            finally:
                member.waker = None

    async def _host(
        self,
        fanout: Fanout[_Run],
        member: Member[_Run],
        *,
        first: Callable[[int], Awaitable[None]] | None = None,
    ) -> None:
        """Read the shared stream in this member's task until it ends; the
        fan-out records how (every member is woken to look). With ``first``
        (the fan-out is idle), the stream is opened from now and ``first()``
        (the member's range) runs once it is created, before it is read:
        what arrives meanwhile waits on the stream, and events at or below
        a member's range revision are ignored when applied."""
        if first is None:
            start = fanout.take_host(member)
        else:
            fanout.open_fresh(member)
            start = 0
        head = fanout.head
        outcome: ProviderFailure | _Compacted | None = None
        try:
            async with self._client.watch(
                head,
                prefix_range_end(head),
                start_revision=start,
                open_deadline=self._deadline(),
            ) as stream:
                self._counts.watch_streams_opened += 1
                if first is not None:
                    if not stream.created_revision:
                        raise IncompleteSnapshot(
                            f"etcd shared watch of {head.decode('utf-8', 'replace')!r}: "
                            "the stream did not say its revision"
                        )
                    fanout.opened(stream.created_revision)
                    await first(stream.created_revision)
                async with anyio.create_task_group() as group:

                    async def pump() -> None:
                        nonlocal outcome
                        try:
                            await self._pump(fanout, stream)
                        except (ProviderFailure, _Compacted) as exc:
                            outcome = exc
                        group.cancel_scope.cancel()

                    async def probe() -> None:
                        nonlocal outcome
                        try:
                            await self._probe_shared(fanout)
                        except ProviderFailure as exc:
                            outcome = exc
                        group.cancel_scope.cancel()

                    group.start_soon(pump)
                    group.start_soon(probe)
        except ProviderFailure as exc:
            outcome = exc
        finally:
            fanout.release_host(member)
        if isinstance(outcome, _Compacted):
            fanout.compacted()
        elif isinstance(outcome, WatchMessageTooLarge):
            # etcd would send that message again on resume: every member
            # ranges again, the stream starts afresh from now.
            self._oversized(head.decode("utf-8", "replace"), outcome)
            fanout.compacted(oversized=True)
        elif outcome is not None:
            fanout.broke(outcome)

    async def _probe_shared(self, fanout: Fanout[_Run]) -> None:
        """The shared stream's probe: the newest change under the prefix (one
        keys-only range, limit 1), every ``probe_interval_ms``. It checks that
        the server answers in time, that read permission on the prefix holds
        and that the stream is not stalled; when the stream has delivered what
        it saw, every live member's listing is confirmed (a member that
        reported a failure publishes its complete listing instead)."""
        interval = self._settings.probe_interval_ms / 1000
        head = fanout.head
        prefix = head.decode("utf-8", "replace")
        # Reopened after a failure: confirm at once, the stream may have
        # nothing to say.
        if not any(member.run.failed for member in fanout.live()):
            await anyio.sleep(interval)
        while True:
            self._counts.probes += 1
            answer = await self._client.range(
                head,
                prefix_range_end(head),
                keys_only=True,
                limit=1,
                newest_first=True,
                deadline=self._deadline(),
            )
            newest = max((kv.mod_revision for kv in answer.kvs), default=0)
            verdict = fanout.judge_probe(newest)
            if verdict is ProbeVerdict.CONFIRMED:
                for count, member in enumerate(fanout.live(), 1):
                    if member.live:  # not left since
                        self._confirm(member.run)
                    if count % PUBLISH_STEP == 0:
                        await anyio.lowlevel.checkpoint()
            elif verdict is ProbeVerdict.STALLED:
                raise IncompleteSnapshot(
                    f"etcd shared watch of {prefix!r} stalled below revision {newest}"
                )
            await anyio.sleep(interval)

    async def _pump(self, fanout: Fanout[_Run], stream: Batches) -> None:
        prefix = fanout.head.decode("utf-8", "replace")
        # What a previous host applied but could not publish before it left.
        for count, member in enumerate(fanout.live(), 1):
            if member.live and member.run.unpublished:
                self._publish(member.run)
            if count % PUBLISH_STEP == 0:
                await anyio.lowlevel.checkpoint()
        while True:
            batch = await stream.next_batch()
            changed: dict[int, Member[_Run]] = {}
            progressed = 0
            for message in batch:
                if message.canceled:
                    if message.compact_revision:
                        logger.info(
                            "etcd shared watch of %r: revision %s compacted (now %d), "
                            "ranging every watched service again",
                            prefix,
                            fanout.opened_from,
                            message.compact_revision,
                        )
                        raise _Compacted
                    status = GatewayStatus.from_cancel_reason(message.cancel_reason)
                    if status.permission_denied or status.credentials_missing:
                        raise IdentityRevoked(
                            f"etcd shared watch of prefix {prefix!r}: {status} (the shared "
                            "watch needs read permission on the whole prefix; "
                            "watch: per_service needs it per service)"
                        )
                    raise IncompleteSnapshot(f"etcd shared watch of {prefix!r} canceled: {status}")
                if message.created:
                    continue
                if message.events:
                    for changed_member in fanout.dispatch(message):
                        changed_member.run.unpublished = True
                        changed[id(changed_member)] = changed_member
                elif message.is_progress:
                    progressed = max(progressed, message.header.revision)
            # Latest-only: everything this read delivered is applied first,
            # then each changed service is published once.
            for count, changed_member in enumerate(changed.values(), 1):
                if changed_member.live and changed_member.run.unpublished:
                    self._publish(changed_member.run)
                if count % PUBLISH_STEP == 0:
                    await anyio.lowlevel.checkpoint()
            if progressed:
                for count, confirmed in enumerate(fanout.progress(progressed), 1):
                    if id(confirmed) not in changed:
                        self._confirm(confirmed.run)
                    if count % PUBLISH_STEP == 0:
                        await anyio.lowlevel.checkpoint()
            # next_batch() gives the loop a turn between batches.

    # --------------------------------------------------------- registration

    def _lease_of(self, registered: Registered) -> int:
        try:
            lease = int(registered.handle)
        except ValueError:
            lease = 0
        if lease <= 0:
            raise RegistrationError(
                registered.record.registration,
                f"handle {registered.handle!r} is not an etcd lease id",
            )
        return lease

    async def register(self, record: RegistrationRecord, deadline: float) -> Registered:
        """Put the record on the connection's open shared lease (granting
        one of ``ttl_seconds`` when none has room)."""
        self._check_open()
        problems = check_record(record)
        if problems:
            raise RegistrationError(record.registration, "; ".join(problems))
        key = self._layout.instance_key(record.service, record.instance_id)
        async with self._grant_lock:
            lease = self._leases.joinable()
            if lease is None:
                lease = self._leases.granted(
                    await self._grant(record, deadline), anyio.current_time()
                )
            emptied = self._leases.attach(lease, key)
        if emptied is not None:
            await self._revoke_quietly(emptied)
        self._put_at.pop(key, None)
        try:
            await self._client.put(key, encode_record(record), lease=lease.id, deadline=deadline)
        except OutcomeUnknown as exc:
            # Known not applied only once the lease is gone (a put on a
            # revoked lease cannot land). The lease's other registrations
            # lose their keys with it; their next renew says LeaseLost and
            # the owner registers them again.
            if await self._revoke_quietly(lease.id):
                self._leases.lost(lease.id)
                self._leases.detach(lease.id, key)
                raise IncompleteSnapshot(
                    f"registration {record.registration!r}: not registered; the put's answer "
                    f"was lost, and its lease {lease.id} was revoked so it cannot take effect"
                ) from exc
            raise
        except ProviderFailure:
            if self._leases.detach(lease.id, key):
                await self._revoke_quietly(lease.id)
            raise
        self._put_at[key] = anyio.current_time()
        logger.info(
            "registered %r as %s on lease %d (connection %r)",
            record.registration,
            key.decode("utf-8", "replace"),
            lease.id,
            self._context.name,
        )
        return Registered(record=record, handle=str(lease.id))

    async def _grant(self, record: RegistrationRecord, deadline: float) -> int:
        grant = await self._client.lease_grant(self._settings.ttl_seconds, deadline=deadline)
        if grant.error:
            raise RegistrationRejected(
                f"registration {record.registration!r}: lease grant refused: "
                f"{redacted_excerpt(grant.error)}"
            )
        if grant.ID == 0:
            # A 200 without a lease ID is as undecodable as a garbage 200: a
            # lease may have been granted (it expires on its own), nothing is
            # known of it.
            raise OutcomeUnknown(
                f"registration {record.registration!r}: the lease grant was answered "
                "without a lease ID"
            )
        self._counts.leases_granted += 1
        return grant.ID

    async def _revoke_quietly(self, lease: int) -> bool:
        """Best-effort revoke, shielded and bounded; True if the lease is gone."""
        with anyio.move_on_after(self._context.request_timeout, shield=True):
            try:
                await self._client.lease_revoke(lease, deadline=self._deadline())
            except ProviderFailure:
                return False
            return True
        return False

    async def renew(self, registered: Registered, deadline: float) -> Registered:
        """Keep the registration's (shared) lease alive: one keepalive for
        every registration on it per ``fresh`` window (see :mod:`._leases`);
        ``LeaseLost`` when the server no longer holds the lease."""
        self._check_open()
        lease = self._lease_of(registered)
        name = registered.record.registration
        pool = self._leases
        if pool.is_lost(lease):
            raise LeaseLost(f"registration {name!r}: lease {lease} expired or was revoked")
        if not pool.keepalive_due(lease, anyio.current_time()):
            return registered
        ttl = await self._single_flight(
            self._keepalives, lease, name, deadline, partial(self._keepalive, lease, deadline)
        )
        if ttl <= 0:
            raise LeaseLost(f"registration {name!r}: lease {lease} expired or was revoked")
        return registered

    async def _keepalive(self, lease: int, deadline: float) -> int:
        started = anyio.current_time()
        self._counts.keepalives += 1
        ttl = await self._client.lease_keepalive(lease, deadline=deadline)
        if ttl <= 0:
            self._leases.lost(lease)
        else:
            self._leases.kept(lease, started, ttl)
        return ttl

    async def _lease_ttl(self, lease: int, deadline: float) -> int:
        alive = await self._client.lease_time_to_live(lease, deadline=deadline)
        self._leases.read_alive(lease, anyio.current_time(), alive.TTL)
        return alive.TTL

    async def _single_flight(
        self,
        flights: dict[Any, _Flight],
        key: Any,
        name: str,
        deadline: float,
        call: Callable[[], Awaitable[int]],
    ) -> int:
        """Run ``call`` once for every caller that asks for ``key`` while it
        is in flight: they all get its answer (or a failure of the same kind)."""
        flight = flights.get(key)
        if flight is None:
            flight = flights[key] = _Flight()
            try:
                flight.result = await call()
                flight.answered = True
            except ProviderFailure as exc:
                flight.failure = exc
                raise
            finally:
                del flights[key]
                flight.done.set()
            return flight.result
        with anyio.move_on_at(deadline):
            await flight.done.wait()
        if not flight.done.is_set():
            raise IncompleteSnapshot(
                f"registration {name!r}: not sent; the shared request it waited for did not "
                "answer before the deadline"
            )
        failure = flight.failure
        if failure is None:
            if flight.answered:
                return flight.result
            # The caller that sent it stopped waiting (its deadline, a
            # cancellation) before any answer: no answer is not "lease gone".
            raise IncompleteSnapshot(
                f"registration {name!r}: the shared request it waited for ended without an "
                "answer (its sender stopped waiting)"
            )
        for kind in (LeaseLost, OutcomeUnknown, IdentityRevoked):
            if isinstance(failure, kind):
                raise kind(f"registration {name!r}: {failure}") from failure
        raise IncompleteSnapshot(f"registration {name!r}: {failure}") from failure

    async def check(self, registered: Registered, deadline: float) -> HealthStatus:
        """HEALTHY while the lease lives and the key holds our value on it.

        The lease's time-to-live is read once per ``fresh_check`` for every
        registration on it; the key is read by itself, or, when many of our
        registrations share its service, in one range of the service that
        the checks arriving together share."""
        self._check_open()
        lease = self._lease_of(registered)
        name = registered.record.registration
        ttl = self._leases.alive(lease, anyio.current_time())
        if ttl is None:
            ttl = await self._single_flight(
                self._ttl_reads, lease, name, deadline, partial(self._lease_ttl, lease, deadline)
            )
        if ttl <= 0:
            return HealthStatus.MISSING
        record = registered.record
        key = self._layout.instance_key(record.service, record.instance_id)
        shared = self._leases.get(lease)
        candidates: tuple[KeyValue, ...] | None = None
        if shared is not None and len(shared.keys) >= SHARED_CHECK_MIN:
            sent, kvs, cut = await self._service_keys(record.service, name, deadline)
            # A range sent before our put answered may not show the key yet,
            # and a range cut at the listing limit does not show the keys
            # after its last: such a key is then read by itself.
            if sent > self._put_at.get(key, math.inf) and (cut is None or key <= cut):
                found = kvs.get(key)
                candidates = (found,) if found is not None else ()
        if candidates is None:
            candidates = (await self._client.range(key, None, deadline=deadline)).kvs
        for kv in candidates:
            if kv.key != key or kv.lease != lease:
                continue
            try:
                value = kv.value_bytes()
            except (binascii.Error, ValueError):
                return HealthStatus.MISSING
            if value == encode_record(record):
                return HealthStatus.HEALTHY
        return HealthStatus.MISSING

    async def _service_keys(
        self, service: str, name: str, deadline: float
    ) -> tuple[float, Mapping[bytes, KeyValue], bytes | None]:
        """(when it was sent, the records of ``service``, the last key read
        when the range was cut at ``max_instances_per_service + 1`` records,
        else None): one recent range (sent at most ``fresh_check`` ago) that
        every check of it shares."""
        now = anyio.current_time()
        cached = self._service_reads.get(service)
        if cached is not None and now - cached[0] < self._leases.fresh_check:
            return cached

        async def read() -> int:
            sent = anyio.current_time()
            head = self._layout.service_prefix(service)
            try:
                answer = await self._client.range(
                    head,
                    prefix_range_end(head),
                    limit=self._context.max_instances_per_service + 1,
                    deadline=deadline,
                )
            except ResponseTooLarge:
                # The service does not fit one response (a record too large
                # for any, or a listing over the limit): cut before every
                # key, so each check reads its own key by itself.
                self._service_reads[service] = (sent, {}, b"")
                return 0
            cut = (answer.kvs[-1].key if answer.kvs else b"") if answer.more else None
            self._service_reads[service] = (sent, {kv.key: kv for kv in answer.kvs}, cut)
            return len(answer.kvs)

        await self._single_flight(self._range_reads, service, name, deadline, read)
        return self._service_reads.get(service, (-math.inf, {}, None))

    async def deregister(self, registered: Registered, deadline: float) -> None:
        """Delete the key if it is still on our lease; the lease's last key
        also revokes the lease."""
        self._check_open()
        lease = self._lease_of(registered)
        record = registered.record
        key = self._layout.instance_key(record.service, record.instance_id)
        self._put_at.pop(key, None)
        await self._client.delete_if_lease(key, lease, deadline=deadline)
        if self._leases.detach(lease, key):
            await self._client.lease_revoke(lease, deadline=deadline)
        logger.info(
            "deregistered %r (lease %d, connection %r)",
            record.registration,
            lease,
            self._context.name,
        )

    async def serve(self) -> None:
        """The owner's task for this provider: on the gRPC wire, one channel
        kept open for the unary calls (see ``EtcdGrpcClient.serve``); on the
        JSON wire nothing (its HTTP pool keeps connections by itself)."""
        serve = getattr(self._client, "serve", None)
        if serve is not None and not self._closed:
            await serve()

    async def aclose(self) -> None:
        """Close the HTTP pool. Idempotent; later calls raise ``LifecycleError``."""
        if self._closed:
            return
        self._closed = True
        self._queried.clear()
        self._queried_records = 0
        await self._client.aclose()


class EtcdProviderFactory:
    """What the ``etcd`` entry point names: builds an :class:`EtcdProvider`."""

    @property
    def name(self) -> str:
        return "etcd"

    @property
    def settings_model(self) -> type[BaseModel]:
        return EtcdSettings

    def create(self, context: ConnectionContext, settings: BaseModel) -> EtcdProvider:
        if not isinstance(settings, EtcdSettings):
            raise ConfigError(
                f"discovery.connections.{context.name}.etcd",
                f"expected EtcdSettings, got {type(settings).__name__}",
            )
        return EtcdProvider(context, settings)

    def __repr__(self) -> str:
        return "<EtcdProviderFactory name='etcd'>"


#: The ``nadisc.providers`` entry point ``etcd = "nadisc_etcd:factory"``.
factory = EtcdProviderFactory()
