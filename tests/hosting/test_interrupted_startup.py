"""A startup that does not go to plan: a shutdown requested while the host is
still starting, and an app whose lifespan startup raises.

* SIGTERM while the app's lifespan startup runs: the startup is let finish,
  nothing is registered, the app's lifespan shutdown runs and ``serve``
  returns its report (reason ``SIGTERM``) instead of waiting for the
  publish deadline and raising.
* SIGTERM while a registration waits to be confirmed: the publish is cut,
  what was written is removed again, and the host closes within its budget.
* an app that received ``lifespan.startup`` and then raised failed its
  startup: nothing is registered and the host raises, naming the app's
  exception (its message redacted); an app that raises *before* reading
  any lifespan message does not support lifespan and is served without it.

The signals are real (the host's receiver is installed before the
listeners start) and sent at a known point of the startup: from the app's
lifespan startup, or from the eligibility check a pending registration
consults. Every wait is on an event; nothing depends on elapsed time.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

import anyio
import httpx
import pytest
from hypercorn.utils import LifespanFailureError

from nadisc import CloseOutcome, Eligibility, RegistrationCloseEntry
from nadisc.hosting import Bind, Gate, Host, serve
from nadisc.hosting._host import HostReport
from nadisc.hosting._listen import Listener, bind_socket
from nadisc.testing import MemoryProvider, MemoryRegistry
from tests.hosting.support import BACKENDS, RecordingApp, run_on
from tests.hosting.test_units import memory_config


class _LogWatch(logging.Handler):
    """Sets an event when a record of ``nadisc.hosting`` contains ``text``."""

    def __init__(self, text: str) -> None:
        super().__init__(logging.INFO)
        self.text = text
        self.seen = anyio.Event()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.messages.append(message)
        if self.text in message:
            self.seen.set()


class _Watched:
    """A handler on the ``nadisc.hosting`` logger for the scope of a test."""

    def __init__(self, text: str) -> None:
        self.handler = _LogWatch(text)
        self.logger = logging.getLogger("nadisc.hosting")

    def __enter__(self) -> _LogWatch:
        self._level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self.handler)
        return self.handler

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self.handler)
        self.logger.setLevel(self._level)


def _terminate_self() -> None:
    os.kill(os.getpid(), signal.SIGTERM)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigterm_during_the_lifespan_startup_shuts_down_without_registering(
    backend: str,
) -> None:
    lifespan: list[str] = []
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        registry = MemoryRegistry()
        with _Watched("SIGTERM") as log:

            async def app(scope: Any, receive: Any, send: Any) -> None:
                if scope["type"] == "lifespan":
                    await receive()
                    lifespan.append("startup")
                    _terminate_self()
                    # The startup goes on until the host took the signal.
                    with anyio.fail_after(10):
                        await log.seen.wait()
                    await send({"type": "lifespan.startup.complete"})
                    await receive()
                    lifespan.append("shutdown")
                    await send({"type": "lifespan.shutdown.complete"})
                    return
                await RecordingApp()(scope, receive, send)

            async with anyio.create_task_group() as tg:
                # The examples' form: started() must come, or tg.start fails.
                host: Host = await tg.start(
                    lambda task_status: serve(
                        app,
                        memory_config(),
                        providers={"primary": MemoryProvider(registry=registry)},
                        allow_loopback=True,
                        task_status=task_status,
                    )
                )
                seen["shutting_down_at_start"] = host.shutting_down
            seen["report"] = host.report
            seen["log"] = list(log.messages)
            seen["operations"] = registry.operations()
            seen["left"] = registry.instance_ids()

    run_on(backend, scenario)
    report: HostReport = seen["report"]
    assert seen["shutting_down_at_start"] is True
    assert report.reason == "SIGTERM"
    assert report.interrupted_startup is True
    assert not report.over_budget and report.clean
    # Nothing was ever written to the registry.
    assert seen["operations"] == [] and seen["left"] == ()
    assert lifespan == ["startup", "shutdown"]
    assert any("SIGTERM during startup" in line for line in seen["log"])
    assert not any("host running" in line for line in seen["log"])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sigterm_while_a_registration_is_unconfirmed_cuts_the_publish(backend: str) -> None:
    asked: list[bool] = []
    seen: dict[str, Any] = {}

    def never_eligible() -> bool:
        # Consulted while the publish waits for the registration to become
        # Active: it never does, so only the shutdown can end the startup.
        if not asked:
            _terminate_self()
        asked.append(False)
        return False

    async def scenario() -> None:
        app = RecordingApp()
        registry = MemoryRegistry()
        async with anyio.create_task_group() as tg:
            host: Host = await tg.start(
                lambda task_status: serve(
                    app,
                    memory_config(),
                    providers={"primary": MemoryProvider(registry=registry)},
                    eligibility={"web": Eligibility.from_check(never_eligible, name="web")},
                    allow_loopback=True,
                    # Far away: only the shutdown may end this startup.
                    publish_deadline=anyio.current_time() + 30,
                    task_status=task_status,
                )
            )
            seen["shutting_down_at_start"] = host.shutting_down
        seen["report"] = host.report
        seen["lifespan"] = list(app.lifespan)
        seen["left"] = registry.instance_ids()

    run_on(backend, scenario)
    report: HostReport = seen["report"]
    assert asked, "the eligibility check was never consulted"
    assert seen["shutting_down_at_start"] is True
    assert report.reason == "SIGTERM" and report.interrupted_startup is True
    assert not report.over_budget
    # Whatever was written is gone, and the report says so.
    assert seen["left"] == ()
    assert report.close_report is not None
    (entry,) = report.close_report.registrations
    assert isinstance(entry, RegistrationCloseEntry)
    assert entry.outcome in (CloseOutcome.NOT_REGISTERED, CloseOutcome.DEREGISTERED)
    assert report.clean
    assert seen["lifespan"] == ["startup", "shutdown"]


# ------------------------------------------------- lifespan startup raising


async def _exchange(app: Any) -> list[dict[str, Any]]:
    """Drive ``Gate(app)``'s lifespan as a server does; what it sent back."""
    to_app = [{"type": "lifespan.startup"}, {"type": "lifespan.shutdown"}]
    answers: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return to_app.pop(0)

    async def send(message: Any) -> None:
        answers.append(dict(message))

    with anyio.fail_after(1):
        await Gate(app)({"type": "lifespan"}, receive, send)
    return answers


async def test_an_app_raising_after_the_startup_message_fails_its_startup() -> None:
    async def raises(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        raise RuntimeError("database unreachable: password=hunter2")

    (answer,) = await _exchange(raises)
    assert answer["type"] == "lifespan.startup.failed"
    assert answer["message"].startswith("RuntimeError: database unreachable")
    assert "hunter2" not in answer["message"]
    assert "raises" in answer["message"]  # where it was raised


async def test_an_app_raising_before_reading_the_lifespan_scope_has_no_lifespan() -> None:
    # The ASGI way of "no lifespan support": the server goes on without it,
    # so the exception is handed to the server unchanged.
    async def http_only(scope: Any, receive: Any, send: Any) -> None:
        assert scope["type"] == "http", "only HTTP here"

    with pytest.raises(AssertionError, match="only HTTP here"):
        await _exchange(http_only)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hosted_app_whose_startup_raises_is_neither_registered_nor_served(
    backend: str,
) -> None:
    caught: dict[str, Any] = {}

    async def app(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await receive()
            raise RuntimeError("database unreachable: token=s3cr3t")
        await RecordingApp()(scope, receive, send)

    async def scenario() -> None:
        registry = MemoryRegistry()
        try:
            async with anyio.create_task_group() as tg:
                await tg.start(
                    lambda task_status: serve(
                        app,
                        memory_config(),
                        providers={"primary": MemoryProvider(registry=registry)},
                        handle_signals=False,
                        allow_loopback=True,
                        task_status=task_status,
                    )
                )
                raise AssertionError("the host must not start")
        except BaseException as exc:  # the task group's wrapping, on either loop
            caught["error"] = exc
        caught["operations"] = registry.operations()

    run_on(backend, scenario)
    error = caught["error"]
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    assert isinstance(error, LifespanFailureError), repr(error)
    assert "RuntimeError: database unreachable" in str(error)
    assert "s3cr3t" not in str(error)
    assert caught["operations"] == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_hosted_app_without_lifespan_support_is_served_without_it(backend: str) -> None:
    async def http_only(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            raise ValueError(f"unsupported scope {scope['type']}")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"plain"})

    async def scenario() -> None:
        registry = MemoryRegistry()
        async with anyio.create_task_group() as tg, httpx.AsyncClient(trust_env=False) as http:
            host: Host = await tg.start(
                lambda task_status: serve(
                    http_only,
                    memory_config(),
                    providers={"primary": MemoryProvider(registry=registry)},
                    handle_signals=False,
                    allow_loopback=True,
                    task_status=task_status,
                )
            )
            assert (await http.get(host.url("web") + "/")).text == "plain"
            assert len(registry.instance_ids()) == 1
            host.shutdown()
        assert host.report is not None and host.report.reason == "shutdown()"

    run_on(backend, scenario)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_server_whose_app_failed_its_startup_never_reports_serving(backend: str) -> None:
    # hypercorn on trio goes on to take its sockets after a failed startup
    # (it stops a moment later): the host must not take that for "serving"
    # and start registering an app that never started.
    outcome: dict[str, Any] = {}

    async def fails(scope: Any, receive: Any, send: Any) -> None:
        await receive()
        raise RuntimeError("no database")

    async def scenario() -> None:
        bind = Bind()
        listener = Listener("web", bind, bind_socket("web", bind), Gate(fails), drain_timeout=1)

        async def run() -> None:
            try:
                await listener.run()
            except Exception as exc:
                outcome["error"] = exc

        async def first_of(event: anyio.Event, done: anyio.CancelScope) -> None:
            await event.wait()
            done.cancel()

        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            # Whichever comes first: the server stopping, or "serving".
            async with anyio.create_task_group() as first:
                first.start_soon(first_of, listener.stopped, first.cancel_scope)
                first.start_soon(first_of, listener.serving, first.cancel_scope)
            outcome["serving"] = listener.serving.is_set()
            listener.kill()  # (a server that reported serving would run on)

    run_on(backend, scenario)
    assert outcome["serving"] is False
    error = outcome.get("error")
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:
        error = error.exceptions[0]
    assert isinstance(error, LifespanFailureError), repr(error)
