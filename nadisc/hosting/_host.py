"""The host: serve ASGI apps with hypercorn, register the real address, drain on SIGTERM.

::

    async with open_host(app, config, listeners={"web": Bind("0.0.0.0", 0,
                         advertised_host="10.0.0.5")}) as host:
        ...                       # every startup-required registration is Active
        await host.wait()         # until SIGTERM/SIGINT or host.shutdown()
    host.report                   # HostReport: timings and the owner's CloseReport

Lifecycle::

    BINDING ─► SERVING ─► PUBLISHING ─► RUNNING ─┬─ SIGTERM / SIGINT / host.shutdown()
    (bind all,   (hypercorn     (as open_discovery: ├─ the block ends or raises
     learn real   took the       resolve the plan    ├─ the surrounding scope is cancelled
     ports)       sockets;       with the bound      └─ SIGTERM / SIGINT while SERVING or
                  app lifespan   addresses, publish,    PUBLISHING: registers no further
                  started)       wait for Active)               │
                                                                ▼
                                                     QUIESCING: eligibility withdrawn,
                                                     owner.begin_quiesce (deregister)
                                                                │ acknowledged (or budget)
                                                                ▼
                                                     (still QUIESCING) deregister grace:
                                                     serve on while callers learn of
                                                     the removal (default by provider)
                                                                ▼
                                                     DRAINING: hypercorn stops accepting
                                                     (new requests on an accepted connection
                                                     get 503), in-flight requests finish
                                                     within drain_timeout
                                                                ▼
                                                     CLOSING: owner.begin_close -> CloseReport
                                                                ▼
                                                     CLOSED (report logged and kept)

*Ownership.* Every task (one hypercorn server per listener, the eligibility
renewal, the registration watch, the signal receiver) is a child of the
host's task group inside the ``async with``; nothing outlives it. The
shutdown sequence runs shielded from cancellation and bounded by its budget
(``shutdown_timeout_ms`` of the config for deregistration and close, plus
the deregistration grace and ``drain_timeout_ms`` for in-flight requests).

*gRPC listeners* (``Bind(grpc=GrpcServe(...))``, :mod:`nadisc.hosting._grpc`)
run a grpcio server instead of hypercorn, driven through the same steps:
their health turns NOT_SERVING as QUIESCING begins (before the
deregistration is sent), DRAINING calls ``server.stop`` with the drain
budget, and the listener's threads are joined before it reports stopped.
Only their registrations get the gRPC protocol metadata.

*Eligibility.* Unless the caller passes its own under the same name, each
listener gets an :meth:`~nadisc.Eligibility.channel` the host renews itself
(a 5 s grant renewed every second) while its server is serving and the host
is not shutting down: registrations wait for it and stop renewing when it
goes. A renewal that comes after the grant lapsed logs a warning.

*A signal during startup* (before the block is entered) lets the app's
lifespan startup finish, then registers no further: preparing and
publishing are cancelled, the block is entered already cancelled and the
shutdown below removes whatever was written (``HostReport.interrupted_startup``).

*Logs* (logger ``nadisc.hosting``): a warning when eligibility lapsed, when a
registration leaves Active, and when the shutdown ran past its budget; the
close report at info when it is clean (:attr:`HostReport.clean`: nothing
possibly left registered, nothing abandoned, within budget), else a warning.

*Costs.* One hypercorn server and one socket per listener, two small tasks
(eligibility renewal every second, registration poll every 0.5 s), O(1) per
request for the gate (and one comparison per mount on routed listeners).
"""

from __future__ import annotations

import enum
import gc
import logging
import math
import signal
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import anyio.abc
import anyio.lowlevel

from .._config import DiscoveryConfig
from .._eligibility import Eligibility, EligibilityController
from .._errors import DiscoveryError, RegistrationError
from .._grpc_protocol import GRPC_METADATA_PREFIX
from .._owner import CloseReport, _open_discovery
from .._probe import eligibility_probe_app
from .._registration import resolve_registrations
from .._registration_state import RegistrationState
from ._asgi import ASGIApp, Gate, PrefixRouter, Receive, Scope, Send, not_found
from ._grpc import GrpcListener, GrpcListenerReport
from ._listen import CUT_BACKSTOP, Bind, Listener, bind_socket, is_wildcard
from ._timing import EligibilityLease, ShutdownBudget, default_deregister_grace

if TYPE_CHECKING:
    from .._owner import DiscoveryOwner
    from .._provider import Provider

__all__ = ["Host", "HostPhase", "HostReport", "HostingError", "open_host", "serve"]

logger = logging.getLogger("nadisc.hosting")

#: The probe's path prefix (see :class:`~nadisc.EligibilityProbe`).
PROBE_PREFIX = "/discovery/eligible"
_GRANT = 5.0
_RENEW_EVERY = 1.0
_WATCH_EVERY = 0.5


class HostingError(DiscoveryError, ValueError):
    """A host setup is wrong (names the listener or parameter)."""

    def __init__(self, where: str, message: str) -> None:
        super().__init__(f"{where}: {message}")
        self.where = where
        self.detail = message


class HostPhase(enum.Enum):
    """The host's lifecycle phase (values are metric-safe labels)."""

    STARTING = "starting"
    RUNNING = "running"
    QUIESCING = "quiescing"
    DRAINING = "draining"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class HostReport:
    """What one shutdown did, in seconds on the event-loop clock."""

    #: What started it: ``"SIGTERM"``, ``"SIGINT"``, ``"shutdown()"``,
    #: ``"exit"`` (the block ended), ``"cancelled"``, ``"error"``.
    reason: str
    started_at: float
    #: When every registration's removal was settled (None if the host
    #: never got that far); new requests are refused from ``refusing_at``.
    deregistered_at: float | None
    quiesce_seconds: float
    drain_seconds: float
    close_seconds: float
    total_seconds: float
    budget_seconds: float
    #: The shutdown ended after its budget.
    over_budget: bool
    #: HTTP requests still running when the drain budget ran out (cancelled).
    abandoned_requests: int
    #: Requests answered 503 after the deregistration (callers that had not
    #: seen it yet; a retrying caller goes elsewhere).
    refused_requests: int
    close_report: CloseReport | None = None
    #: Per listener: HTTP requests its app handled.
    served: Mapping[str, int] = field(default_factory=dict)
    #: The deregistration grace served after ``deregistered_at`` (seconds).
    grace_seconds: float = 0.0
    #: When new requests began to be refused (``deregistered_at`` + the grace).
    refusing_at: float | None = None
    #: Per gRPC listener: its health, stop and drain steps and their times.
    grpc: Mapping[str, GrpcListenerReport] = field(default_factory=dict)
    #: The shutdown was requested before the startup completed: the block
    #: was entered already cancelled, and registrations not yet confirmed
    #: were never confirmed (see *Shutdown, in order* in docs/hosting.md).
    interrupted_startup: bool = False

    @property
    def possibly_remaining(self) -> tuple[str, ...]:
        """Registrations whose record may still be in the registry (a removal
        that failed, timed out or was never answered; a write whose outcome
        is unknown). Empty when every one was removed or never written."""
        close = self.close_report
        if close is None:
            return ()
        return tuple(
            str(getattr(entry, "name", "?"))
            for entry in close.registrations
            if getattr(entry, "possibly_remaining", False)
        )

    @property
    def clean(self) -> bool:
        """The shutdown did everything it should, within its budget: nothing
        may remain registered, the owner closed within its deadline without
        provider errors, no request or RPC was abandoned and no thread left.
        The close summary is logged at info when clean, as a warning
        otherwise; the examples exit 0 when clean and 1 otherwise."""
        close = self.close_report
        return (
            close is not None
            and not close.deadline_elapsed
            and not close.provider_errors
            and not self.possibly_remaining
            and not self.over_budget
            and self.abandoned_requests == 0
            and not any(g.abandoned or g.threads_left for g in self.grpc.values())
        )


class Host:
    """A running host (from :func:`open_host`). Holds no close rights of the owner:
    the host closes it at the end of the block."""

    def __init__(
        self, listeners: Mapping[str, Listener | GrpcListener], gates: Mapping[str, Gate]
    ) -> None:
        self._listeners = dict(listeners)
        self._gates = dict(gates)
        self._owner: DiscoveryOwner | None = None
        self._phase = HostPhase.STARTING
        self._reason: str | None = None
        self._requested = anyio.Event()
        self._closed = anyio.Event()
        self._draining = anyio.Event()
        self._body: anyio.CancelScope | None = None
        #: Around preparing and publishing (a shutdown requested then cuts it).
        self._startup: anyio.CancelScope | None = None
        #: The publish began: a registration may have been written.
        self._published = False
        #: A shutdown request cut the startup short.
        self._interrupted = False
        self._controllers: dict[str, EligibilityController] = {}
        self._report: HostReport | None = None
        self._advertised: dict[str, tuple[str, int]] = {}

    def __repr__(self) -> str:
        bound = ", ".join(f"{n}={h}:{p}" for n, (h, p) in self.bound.items())
        return f"<Host {self._phase.value} {bound}>"

    @property
    def phase(self) -> HostPhase:
        return self._phase

    @property
    def owner(self) -> DiscoveryOwner:
        """The discovery owner (observations, calls, registration views)."""
        if self._owner is None:
            raise RuntimeError("the host has not opened its owner yet")
        return self._owner

    @property
    def bound(self) -> Mapping[str, tuple[str, int]]:
        """Listener name -> the real bound (host, port)."""
        return {name: listener.bound for name, listener in self._listeners.items()}

    @property
    def advertised(self) -> Mapping[str, tuple[str, int]]:
        """Listener name -> the (host, port) registrations advertise by default
        (listeners bound to a wildcard without ``advertised_host`` are absent)."""
        return dict(self._advertised)

    def url(self, listener: str) -> str:
        """``http://host:port`` of a listener, dialable from this machine."""
        return f"http://{self.target(listener)}"

    def target(self, listener: str) -> str:
        """``host:port`` of a listener, dialable from this machine (a gRPC target)."""
        host, port = self._listeners[listener].bound
        if is_wildcard(host):
            host = "127.0.0.1" if ":" not in host else "::1"
        if ":" in host:
            host = f"[{host}]"
        return f"{host}:{port}"

    @property
    def report(self) -> HostReport | None:
        """The shutdown's report, once closed."""
        return self._report

    @property
    def shutting_down(self) -> bool:
        return self._requested.is_set()

    def in_flight(self, listener: str) -> int:
        """HTTP requests inside the app of ``listener`` now (RPCs on a gRPC listener)."""
        served = self._listeners.get(listener)
        if isinstance(served, GrpcListener):
            return served.in_flight
        gate = self._gates.get(listener)
        return gate.in_flight if gate is not None else 0

    @property
    def _grpc(self) -> dict[str, GrpcListener]:
        return {n: li for n, li in self._listeners.items() if isinstance(li, GrpcListener)}

    def shutdown(self, reason: str = "shutdown()") -> None:
        """Begin the graceful shutdown (idempotent): the block is cancelled and
        the host quiesces, drains and closes on its way out. Requested during
        the startup (a signal), it cuts the registration short: see
        :func:`open_host`."""
        if self._requested.is_set():
            return
        self._reason = reason
        self._requested.set()
        if self._body is not None:
            self._body.cancel()
        elif self._startup is not None:
            self._startup.cancel()

    # -- the owner's start (nadisc._owner.StartupHooks) --------------------------

    def startup_began(self, scope: anyio.CancelScope) -> None:
        """The owner prepares and publishes in ``scope``: a shutdown cancels it."""
        self._startup = scope
        if self._requested.is_set():
            scope.cancel()  # requested during the app's lifespan startup

    def startup_publishing(self) -> None:
        self._published = True

    def startup_ended(self, interrupted: bool) -> None:
        self._startup = None
        self._interrupted = interrupted

    async def wait(self) -> None:
        """Sleep until a shutdown is requested (a signal or :meth:`shutdown`)."""
        await self._requested.wait()
        await anyio.lowlevel.checkpoint()

    async def wait_closed(self) -> HostReport:
        """Wait until the host closed; its report (None only if it never ran)."""
        await self._closed.wait()
        assert self._report is not None or self._owner is None
        return self._report  # type: ignore[return-value]

    async def wait_draining(self) -> None:
        """Wait until the deregistration is settled and new requests are refused."""
        await self._draining.wait()

    # ---------------------------------------------------------------- tasks

    async def _renew(self, names: tuple[str, ...]) -> None:
        """Keep the host's own eligibilities granted while serving."""
        leases = {name: EligibilityLease(_GRANT, _RENEW_EVERY) for name in names}
        while not self._requested.is_set():
            now = anyio.current_time()
            for name in names:
                listener = self._listeners[name]
                controller = self._controllers[name]
                if listener.stopped.is_set() or controller.closed:
                    continue
                lapsed = leases[name].renew(now)
                if lapsed is not None:
                    logger.warning(
                        "eligibility of listener %r lapsed for %.3f s before it was renewed "
                        "(the event loop was blocked?): its registrations were ineligible",
                        name,
                        lapsed,
                    )
                controller.update(True, _GRANT, now=now)
            due = min(lease.next_renewal(now) for lease in leases.values())
            await anyio.sleep(max(0.0, due - anyio.current_time()))

    async def _watch_registrations(self, owner: DiscoveryOwner) -> None:
        """Warn when a registration leaves Active while the host is running."""
        previous = {n: s.state for n, s in owner.registrations().items()}
        been_active = {n for n, state in previous.items() if state is RegistrationState.ACTIVE}
        while True:
            await anyio.sleep(_WATCH_EVERY)
            current = {n: s.state for n, s in owner.registrations().items()}
            if self._phase is HostPhase.RUNNING:
                for name, state in current.items():
                    was = previous.get(name)
                    if was is RegistrationState.ACTIVE and state is not RegistrationState.ACTIVE:
                        logger.warning("registration %r left Active: now %s", name, state.name)
                    elif (
                        was is not None
                        and was is not RegistrationState.ACTIVE
                        and (state is RegistrationState.ACTIVE)
                    ):
                        again = " again" if name in been_active else ""
                        logger.info("registration %r is Active%s", name, again)
            been_active.update(n for n, st in current.items() if st is RegistrationState.ACTIVE)
            previous = current

    async def _signals(self, *, task_status: anyio.abc.TaskStatus[None]) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            task_status.started()
            async for signum in received:
                name = signal.Signals(signum).name
                if self._requested.is_set():
                    logger.warning("%s during shutdown: already shutting down", name)
                    continue
                if self._phase is HostPhase.STARTING:
                    logger.info(
                        "%s during startup: registering no further, then shutting down "
                        "(deregister what was written, drain, close)",
                        name,
                    )
                else:
                    logger.info("%s: shutting down (deregister, drain, close)", name)
                self.shutdown(name)

    # ------------------------------------------------------------- shutdown

    async def _shutdown(
        self, owner: DiscoveryOwner, *, quiesce: float, drain: float, grace: float = 0.0
    ) -> HostReport:
        started = anyio.current_time()
        budget = ShutdownBudget(started, quiesce, drain, grace)
        self._requested.set()
        reason = self._reason or "exit"
        # 1. Quiesce: withdraw eligibility, deregister, wait for the answers.
        self._phase = HostPhase.QUIESCING
        for controller in self._controllers.values():
            controller.close()
        # gRPC health says NOT_SERVING before the deregistration goes out, so
        # health-checking callers stop at once; the servers still serve.
        for served in self._grpc.values():
            served.not_serving()
        waiter = owner.begin_quiesce(budget.deadline)
        with anyio.move_on_at(budget.quiesce_until) as waited:
            await waiter.wait()
        if waited.cancelled_caught:
            logger.warning("deregistration did not finish within %.3f s; draining anyway", quiesce)
        deregistered = anyio.current_time()
        # 2. Grace: keep serving while callers learn of the removal (their
        #    watches and polls), so none is refused or cut off for not yet
        #    knowing; then stop accepting.
        #    Each response from now on ends its connection, so a caller that
        #    still sends here holds no kept-alive connection when the server
        #    stops (its next request opens one, refused cleanly after).
        for gate in self._gates.values():
            gate.end_connections()
        if grace > 0 and (self._published or not self._interrupted):
            # (A startup cut before the publish wrote nothing: no caller
            # has anything to learn.)
            await anyio.sleep_until(budget.refuse_at(deregistered))
        refusing = anyio.current_time()
        # 3. Stop accepting: refuse new requests, let hypercorn drain the rest.
        self._phase = HostPhase.DRAINING
        for gate in self._gates.values():
            gate.close()
        self._draining.set()
        for listener in self._listeners.values():
            listener.stop()  # gRPC: server.stop(the drain budget)
        # At the drain budget the gates cut what still runs (503 for what has
        # not answered yet, alike on both loops); hypercorn's own cut
        # (graceful_timeout, CUT_BACKSTOP later) catches what ignores that,
        # and the host kills a server only if it is still there after it.
        cancelled_before = sum(gate.cancelled for gate in self._gates.values())
        cut_at = budget.drain_until(refusing)
        with anyio.move_on_at(cut_at):
            for listener in self._listeners.values():
                await listener.stopped.wait()
        if not all(li.stopped.is_set() for li in self._listeners.values()):
            for gate in self._gates.values():
                gate.cut()
            with anyio.move_on_at(cut_at + CUT_BACKSTOP + 1.0):
                for listener in self._listeners.values():
                    await listener.stopped.wait()
        if not all(li.stopped.is_set() for li in self._listeners.values()):
            for listener in self._listeners.values():
                listener.kill()
            with anyio.move_on_after(1.0):
                for listener in self._listeners.values():
                    await listener.stopped.wait()
        abandoned = sum(gate.cancelled for gate in self._gates.values()) - cancelled_before
        abandoned += sum(gate.in_flight for gate in self._gates.values())
        if abandoned:
            logger.warning(
                "%d request(s) still running after the %.3f s drain budget: cancelled",
                abandoned,
                drain,
            )
        drained = anyio.current_time()
        # 4. Close the owner (what quiesce left, providers, tasks).
        self._phase = HostPhase.CLOSING
        close_report = await owner.begin_close(budget.deadline).wait()
        ended = anyio.current_time()
        over = budget.over(ended)
        if over > 0:
            logger.warning(
                "shutdown took %.3f s, %.3f s past its budget of %.3f s",
                ended - started,
                over,
                budget.deadline - started,
            )
        report = HostReport(
            reason=reason,
            started_at=started,
            deregistered_at=deregistered,
            quiesce_seconds=deregistered - started,
            drain_seconds=drained - refusing,
            close_seconds=ended - drained,
            total_seconds=ended - started,
            budget_seconds=budget.deadline - started,
            over_budget=over > 0,
            abandoned_requests=abandoned,
            refused_requests=sum(gate.refused for gate in self._gates.values()),
            close_report=close_report,
            served={name: gate.served for name, gate in self._gates.items()},
            grace_seconds=refusing - deregistered,
            refusing_at=refusing,
            grpc={name: served.report() for name, served in self._grpc.items()},
            interrupted_startup=self._interrupted,
        )
        _log_close(report)
        return report


def _log_close(report: HostReport) -> None:
    close = report.close_report
    entries = ", ".join(
        f"{getattr(e, 'name', '?')}={getattr(getattr(e, 'outcome', None), 'value', '?')}"
        for e in (close.registrations if close is not None else ())
    )
    remaining = report.possibly_remaining
    quiesced = report.quiesce_seconds
    if remaining:
        removal = f"removal not confirmed after {quiesced:.3f} s, possibly remaining: " + ", ".join(
            remaining
        )
    elif any(
        getattr(getattr(e, "outcome", None), "value", None) == "deregistered"
        for e in (close.registrations if close is not None else ())
    ):
        removal = f"deregistered after {quiesced:.3f} s"
    else:
        removal = f"nothing was registered, quiesced in {quiesced:.3f} s"
    startup = ", startup interrupted" if report.interrupted_startup else ""
    (logger.info if report.clean else logger.warning)(
        "host closed (%s%s) in %.3f s: %s, drained in %.3f s, registrations [%s], "
        "deadline_elapsed=%s, tasks_left=%s, provider_errors=%s",
        report.reason,
        startup,
        report.total_seconds,
        removal,
        report.drain_seconds,
        entries,
        close.deadline_elapsed if close is not None else None,
        close.tasks_left if close is not None else None,
        list(close.provider_errors) if close is not None else None,
    )
    for name, g in report.grpc.items():
        stop = (
            (g.stopped_at - g.stop_at)
            if g.stopped_at is not None and g.stop_at is not None
            else 0.0
        )
        (logger.info if not (g.abandoned or g.threads_left) else logger.warning)(
            "gRPC listener %r: %d RPCs served, %d in flight at stop, stopped in %.3f s "
            "(grace %.3f s), abandoned=%d, threads_left=%d",
            name,
            g.rpcs,
            g.in_flight_at_stop,
            stop,
            g.stop_grace_seconds,
            g.abandoned,
            g.threads_left,
        )


# ------------------------------------------------------------------ planning


def _check_ms(label: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise HostingError(label, f"must be a finite number of milliseconds, not {value!r}")
    if value < 0:
        raise HostingError(label, f"must not be negative, not {value!r}")
    return float(value) / 1000.0


def _registered_listeners(config: DiscoveryConfig, names: list[str]) -> set[str]:
    """The listeners registrations advertise (the 'chosen' listeners)."""
    chosen: set[str] = set()
    for entry in config.registrations.values():
        ref = entry.listener_ref
        if ref is None and len(names) == 1:
            ref = names[0]
        if ref is not None:
            chosen.add(ref)
    return chosen


def _plan_apps(
    app: ASGIApp | None,
    config: DiscoveryConfig,
    listeners: Mapping[str, Bind],
    mounts: Mapping[str, ASGIApp],
    probe_on: str | None,
    probe: ASGIApp,
) -> tuple[dict[str, ASGIApp], dict[str, Gate]]:
    """Which ASGI app each listener serves (gated public apps; routed admin ones)."""
    names = list(listeners)
    admins = [n for n, b in listeners.items() if b.admin]
    if len(admins) > 1:
        raise HostingError("listeners", f"at most one admin listener, got {sorted(admins)}")
    admin = admins[0] if admins else None
    if mounts and admin is None:
        raise HostingError(
            "mounts", "mounts are served on the admin listener: add Bind(..., admin=True)"
        )
    chosen = _registered_listeners(config, [n for n in names if not listeners[n].admin])
    probe_targets: set[str] = set()
    grpc = {n for n, b in listeners.items() if b.grpc is not None}
    if probe_on is not None:
        if probe_on not in listeners:
            raise HostingError("probe_on", f"no listener {probe_on!r} (have {sorted(names)})")
        if probe_on in grpc:
            raise HostingError(
                "probe_on",
                f"listener {probe_on!r} serves gRPC; the eligibility probe is HTTP "
                "(its health service is grpc.health.v1)",
            )
        if probe_on != admin and probe_on not in chosen:
            raise HostingError(
                "probe_on",
                f"listener {probe_on!r} is neither the admin listener nor advertised by a "
                "registration: the eligibility probe is never mounted on a public listener",
            )
        if not config.eligibility_probe:
            raise HostingError(
                "probe_on", "the probe is disabled: set discovery.eligibility_probe: true"
            )
        probe_targets.add(probe_on)
    elif config.eligibility_probe:
        probe_targets = (
            {admin}
            if admin is not None
            else {c for c in chosen if c in listeners and c not in grpc}
        )
    apps: dict[str, ASGIApp] = {}
    gates: dict[str, Gate] = {}
    for name, bind in listeners.items():
        if name in grpc:
            continue  # a grpcio server, no ASGI app
        unchanged = {PROBE_PREFIX: probe} if name in probe_targets else {}
        if bind.admin:
            apps[name] = PrefixRouter(mounts, not_found, unchanged=unchanged)
            continue
        served = bind.app if bind.app is not None else app
        if served is None:
            raise HostingError(f"listeners.{name}", "no app: pass app or Bind(app=...)")
        gate = Gate(served)
        gates[name] = gate
        apps[name] = PrefixRouter({}, gate, unchanged=unchanged) if unchanged else gate
    return apps, gates


def _with_grpc_metadata(config: DiscoveryConfig, listeners: Mapping[str, Bind]) -> DiscoveryConfig:
    """The config with the gRPC protocol metadata added to the registrations of
    gRPC listeners, and to no other (the prefix is the host's to write)."""
    names = list(listeners)
    changed = {}
    for name, entry in config.registrations.items():
        for key in entry.metadata:
            if key.startswith(GRPC_METADATA_PREFIX):
                raise HostingError(
                    f"registrations.{name}.metadata.{key}",
                    f"keys under {GRPC_METADATA_PREFIX!r} are written by the host for the "
                    "registrations of a gRPC listener (from its GrpcServe); remove it",
                )
        ref = entry.listener_ref
        if ref is None and len(names) == 1:
            ref = names[0]
        bind = listeners.get(ref) if ref is not None else None
        if bind is None or bind.grpc is None:
            continue
        metadata = {**entry.metadata, **bind.grpc.metadata()}
        changed[name] = entry.model_copy(update={"metadata": metadata})
    if not changed:
        return config
    return config.model_copy(update={"registrations": {**config.registrations, **changed}})


def _open_listener(
    name: str, bind: Bind, app: ASGIApp | None, drain: float
) -> Listener | GrpcListener:
    if bind.grpc is not None:
        return GrpcListener(name, bind, bind.grpc, drain_timeout=drain)
    assert app is not None
    return Listener(name, bind, bind_socket(name, bind), app, drain_timeout=drain)


def _unwrap(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one real error of a task-group failure (cancellations dropped)."""
    leaves: list[BaseException] = []

    def walk(error: BaseException) -> None:
        if isinstance(error, BaseExceptionGroup):
            for inner in error.exceptions:
                walk(inner)
        elif not isinstance(error, anyio.get_cancelled_exc_class()):
            leaves.append(error)

    walk(group)
    return leaves[0] if len(leaves) == 1 else group


def _check_listener_refs(config: DiscoveryConfig, listeners: Mapping[str, object]) -> None:
    """A registration that needs a listener (it names no eligibility of its
    own) but does not say which, on a host with several: refused naming the
    listeners (the plan's resolution would only find the eligibility missing)."""
    if len(listeners) < 2:
        return
    for name, entry in config.registrations.items():
        if entry.listener_ref is None and entry.eligibility_ref is None:
            raise RegistrationError(
                name,
                f"no listener_ref, and the host has {len(listeners)} listeners "
                f"{sorted(listeners)}: set listener_ref to the one this registration "
                "advertises (it is optional only with a single listener)",
                path=f"discovery.registrations.{name}.listener_ref",
            )


# ------------------------------------------------------------------- running


@asynccontextmanager
async def open_host(
    app: ASGIApp | None,
    config: DiscoveryConfig,
    *,
    listeners: Mapping[str, Bind] | None = None,
    mounts: Mapping[str, ASGIApp] | None = None,
    probe_on: str | None = None,
    eligibility: Mapping[str, Eligibility] | None = None,
    providers: Mapping[str, Provider] | None = None,
    drain_timeout_ms: float = 5000,
    deregister_grace_ms: float | None = None,
    handle_signals: bool = True,
    allow_loopback: bool = False,
    publish_deadline: float | None = None,
    freeze_heap: bool = False,
) -> AsyncIterator[Host]:
    """Bind, serve, register the real addresses; on the way out deregister,
    drain and close (see the module docstring for the order).

    ``listeners`` defaults to ``{"web": Bind()}`` (127.0.0.1, ephemeral
    port). Registrations without ``ip``/``port`` take the bound address of
    their listener (``advertised_host`` for a wildcard bind); an explicit
    ``port`` must match it (``RegistrationError`` naming both otherwise).
    ``mounts`` (``{"/metrics": app}``) are served on the admin listener.
    The eligibility probe (``discovery.eligibility_probe: true``) is mounted
    at ``/discovery/eligible/`` on the admin listener, else on the listeners
    registrations advertise; ``probe_on`` picks one of those explicitly.
    ``eligibility`` adds or replaces local eligibilities by name (the host's
    own, per listener, are renewed automatically). ``handle_signals=False``
    leaves SIGTERM/SIGINT alone.

    ``deregister_grace_ms``: after the deregistration is acknowledged the
    host keeps serving this long, so that callers' watches and polls see the
    removal before it refuses anything (default ``None``: by provider, see
    :func:`~nadisc.hosting.default_deregister_grace`; 0 refuses at once).

    ``freeze_heap=True``: once running, collect and ``gc.freeze()`` the
    heap (the imports, the app, the owner and its observations), so that
    the cyclic collector's full collections, which stall every task of the
    process, walk only what was created since; undone (``gc.unfreeze()``)
    when the last freezing host of the process closes. The collection
    itself holds the loop once, at startup (tens to hundreds of ms, by heap
    size). Process-wide: for a process that is one host.

    Entry returns once every startup-required registration is Active; a
    registration that fails for good raises ``RegistrationError`` naming it
    (after the servers stopped and the owner closed). A shutdown requested
    during the startup (SIGTERM/SIGINT) lets the app's lifespan startup
    finish but registers no further: entry then returns at once, the block
    runs already cancelled (``host.shutting_down`` is true, it ends at its
    first checkpoint) and the host removes what was written on its way out;
    ``host.report.interrupted_startup`` is true.
    """
    listeners = dict(listeners) if listeners is not None else {"web": Bind()}
    if not listeners:
        raise HostingError("listeners", "at least one listener is needed")
    for name, bind in listeners.items():
        if not isinstance(bind, Bind):
            raise HostingError(f"listeners.{name}", f"expected a Bind, got {type(bind).__name__}")
        try:
            bind.check(name)
        except ValueError as exc:
            raise HostingError(f"listeners.{name}", str(exc)) from None
    if not config.enabled:
        raise HostingError("config", "discovery is not enabled (enabled: true)")
    drain = _check_ms("drain_timeout_ms", drain_timeout_ms)
    grace = (
        default_deregister_grace(config)
        if deregister_grace_ms is None
        else _check_ms("deregister_grace_ms", deregister_grace_ms)
    )
    quiesce = config.shutdown_timeout_ms / 1000.0
    extra = dict(eligibility or {})
    probe_view: dict[str, ASGIApp] = {}

    async def probe(scope: Scope, receive: Receive, send: Send) -> None:
        # Bound lazily: the owner (and its probe) exists only after the bind.
        await probe_view.get("app", not_found)(scope, receive, send)

    apps, gates = _plan_apps(app, config, listeners, dict(mounts or {}), probe_on, probe)
    _check_listener_refs(config, listeners)
    config = _with_grpc_metadata(config, listeners)
    # 1. Bind everything (learn the real ports) before anything runs.
    opened: dict[str, Listener | GrpcListener] = {}
    try:
        for name, bind in listeners.items():
            opened[name] = _open_listener(name, bind, apps.get(name), drain)
    except BaseException:
        for listener in opened.values():
            listener.close()
        raise
    host = Host(opened, gates)
    own: dict[str, Eligibility] = {}
    for name, listener in opened.items():
        # A wildcard without advertised_host stays a wildcard here: a
        # registration on it without its own ip is refused, naming both.
        advertised = listener.bind.advertised_host or listener.bound[0]
        host._advertised[name] = (advertised, listener.bound[1])
        if name not in extra:
            controller, source = Eligibility.channel(name)
            host._controllers[name] = controller
            own[name] = source
    sources = {**own, **extra}
    frozen = False
    try:
        async with anyio.create_task_group() as tg:
            try:
                if handle_signals:
                    # From the start: a signal during startup ends it (the
                    # app's lifespan startup is let finish, the registration
                    # is cut short) and shuts down, instead of killing the
                    # process with whatever was registered left behind.
                    await tg.start(host._signals)
                # 2. Serve: hypercorn takes each socket once the app's lifespan
                #    started; a grpcio server starts (health SERVING).
                for listener in opened.values():
                    tg.start_soon(listener.run, name=f"nadisc.hosting:{listener.name}")
                for listener in opened.values():
                    await listener.serving.wait()
                if host._controllers:
                    tg.start_soon(host._renew, tuple(host._controllers))
                # 3. Register with the real addresses; wait for startup-required ones.
                # The probe answers from the plan's own eligibilities, so a
                # registry check that dials it during publish is answered.
                specs = resolve_registrations(
                    config, host._advertised, sources, allow_loopback=allow_loopback
                )
                probe_view["app"] = eligibility_probe_app(
                    {spec.name: spec.eligibility for spec in specs if spec.eligibility},
                    enabled=config.eligibility_probe,
                )
                async with _open_discovery(
                    config,
                    providers=providers,
                    listeners=dict(host._advertised),
                    eligibility=sources,
                    allow_loopback=allow_loopback,
                    publish_deadline=publish_deadline,
                    hooks=host,
                ) as owner:
                    host._owner = owner
                    if not host._interrupted:
                        tg.start_soon(host._watch_registrations, owner)
                        host._phase = HostPhase.RUNNING
                        logger.info(
                            "host running: %s",
                            ", ".join(f"{n}={h}:{p}" for n, (h, p) in host.bound.items()),
                        )
                        if freeze_heap:
                            _freeze_heap()
                            frozen = True
                    try:
                        with anyio.CancelScope() as body:
                            host._body = body
                            if host._requested.is_set():
                                body.cancel()
                            yield host
                    except BaseException as exc:
                        if host._reason is None:
                            cancelled = isinstance(exc, anyio.get_cancelled_exc_class())
                            host._reason = "cancelled" if cancelled else "error"
                        raise
                    finally:
                        host._body = None
                        with anyio.CancelScope(shield=True):
                            host._report = await host._shutdown(
                                owner, quiesce=quiesce, drain=drain, grace=grace
                            )
            finally:
                host._requested.set()
                with anyio.CancelScope(shield=True):
                    for listener in opened.values():
                        listener.stop()
                    with anyio.move_on_after(drain + 1.0):
                        for listener in opened.values():
                            await listener.stopped.wait()
                    for listener in opened.values():
                        listener.kill()
                # Everything left (renewal, watch, signals) ends here.
                tg.cancel_scope.cancel()
    except BaseExceptionGroup as group:
        error = _unwrap(group)
        if error is group:
            raise
        context = error.__context__
        try:
            raise error from error.__cause__
        finally:
            error.__context__ = context
    finally:
        if frozen:
            _thaw_heap()
        for listener in opened.values():
            listener.close()
        host._phase = HostPhase.CLOSED
        host._closed.set()


#: Hosts of this process running with ``freeze_heap=True``.
_freezing_hosts = 0


def _freeze_heap() -> None:
    global _freezing_hosts
    gc.collect()
    gc.freeze()
    _freezing_hosts += 1


def _thaw_heap() -> None:
    global _freezing_hosts
    _freezing_hosts -= 1
    if not _freezing_hosts:
        gc.unfreeze()


async def serve(
    app: ASGIApp | None,
    config: DiscoveryConfig,
    *,
    task_status: anyio.abc.TaskStatus[Host] = anyio.TASK_STATUS_IGNORED,
    **options: object,
) -> HostReport:
    """Run a host until SIGTERM/SIGINT (or ``host.shutdown()``); return its report.

    ``task_status.started(host)`` is called once every startup-required
    registration is Active, so ``host = await tg.start(serve, app, config)``
    returns a running host (``host.bound`` holds the real ports); or, when a
    signal came during the startup, once the startup was cut short: the
    host is then already shutting down (``host.shutting_down``) and ``serve``
    returns its report (``interrupted_startup`` true) like after any other
    shutdown. The options are those of :func:`open_host`.
    """
    async with open_host(app, config, **options) as host:  # type: ignore[arg-type]
        task_status.started(host)
        await host.wait()
    report = host.report
    assert report is not None
    return report
