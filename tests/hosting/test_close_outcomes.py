"""What the host says about how it ended, and a few of its messages.

* a deregistration that did not succeed makes the close not clean: the
  summary is a warning that names what may remain (it does not say
  "deregistered"), ``HostReport.clean`` is false, and the examples exit 1;
* a registration that becomes Active for the first time after the host
  started is logged as Active, not as Active *again*;
* with several listeners, a registration without ``listener_ref`` is
  refused naming that ambiguity (not a missing eligibility).
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

from nadisc import Eligibility, RegistrationError, RegistrationState
from nadisc.hosting import Bind, Host, open_host, serve
from nadisc.testing import Fault, MemoryProvider, MemoryRegistry
from tests.hosting.support import BACKENDS, RecordingApp, etcd_addresses, etcd_config, run_on
from tests.hosting.test_interrupted_startup import _Watched
from tests.hosting.test_subprocess import EXAMPLES, running
from tests.hosting.test_units import memory_config
from tests.providers.etcd.conftest import EtcdServer

EXAMPLE = EXAMPLES["asgi-asyncio"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_deregistration_is_not_a_clean_close(
    backend: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nadisc.hosting")
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        registry = MemoryRegistry()
        async with anyio.create_task_group() as tg:
            host: Host = await tg.start(
                lambda task_status: serve(
                    RecordingApp(),
                    memory_config(),
                    providers={"primary": MemoryProvider(registry=registry)},
                    handle_signals=False,
                    allow_loopback=True,
                    task_status=task_status,
                )
            )
            # Every removal goes unanswered: the record may well remain.
            for _ in range(20):
                registry.inject("deregister", Fault.drop())
            host.shutdown()
        seen["report"] = host.report

    run_on(backend, scenario)
    report = seen["report"]
    (entry,) = report.close_report.registrations
    assert entry.possibly_remaining
    assert report.clean is False
    assert report.possibly_remaining == ("web",)
    (line,) = [r for r in caplog.records if r.getMessage().startswith("host closed")]
    assert line.levelno == logging.WARNING
    assert "deregistered after" not in line.getMessage()
    assert "possibly remaining: web" in line.getMessage()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_clean_close_is_logged_at_info(backend: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nadisc.hosting")
    seen: dict[str, Any] = {}

    async def scenario() -> None:
        async with open_host(
            RecordingApp(),
            memory_config(),
            providers={"primary": MemoryProvider(registry=MemoryRegistry())},
            handle_signals=False,
            allow_loopback=True,
        ) as host:
            pass
        seen["report"] = host.report

    run_on(backend, scenario)
    report = seen["report"]
    assert report.clean is True and report.possibly_remaining == ()
    (line,) = [r for r in caplog.records if r.getMessage().startswith("host closed")]
    assert line.levelno == logging.INFO
    assert "deregistered after" in line.getMessage()


@pytest.mark.real_server
def test_the_example_exits_1_when_its_registry_hangs_at_shutdown(
    own_etcd: EtcdServer, tmp_path: Path
) -> None:
    # examples/plain_asgi_asyncio.py on an etcd that stops answering
    # (SIGSTOP) before the process gets SIGTERM: the removal cannot be
    # confirmed, so the close is not clean and the exit code says so.
    prefix = f"{tmp_path.name}/services"
    config = etcd_config(own_etcd.url, prefix)
    with running(EXAMPLE, config, tmp_path) as (process, listeners):
        assert anyio.run(etcd_addresses, own_etcd.url, prefix) == [listeners["web"]]
        own_etcd.pause()
        try:
            process.send_signal(signal.SIGTERM)
            code = process.wait(30)
        finally:
            own_etcd.resume()
        assert process.stderr is not None
        stderr = process.stderr.read().decode()
    assert code == 1, stderr
    assert "WARNING nadisc.hosting: host closed (SIGTERM)" in stderr
    assert "possibly remaining: web" in stderr


# ------------------------------------------------------------ small messages


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_late_first_registration_is_active_not_active_again(backend: str) -> None:
    eligible: list[bool] = [False]
    seen: dict[str, Any] = {}
    config = memory_config({"startup_required": False})

    async def scenario() -> None:
        with _Watched("is Active") as log:
            async with open_host(
                RecordingApp(),
                config,
                providers={"primary": MemoryProvider(registry=MemoryRegistry())},
                eligibility={"web": Eligibility.from_check(lambda: eligible[0], name="web")},
                handle_signals=False,
                allow_loopback=True,
            ) as host:
                assert host.owner.registrations()["web"].state is not RegistrationState.ACTIVE
                eligible[0] = True
                with anyio.fail_after(10):
                    await log.seen.wait()
            seen["log"] = list(log.messages)

    run_on(backend, scenario)
    active = [m for m in seen["log"] if "is Active" in m]
    assert active[0] == "registration 'web' is Active", active


def test_two_listeners_and_no_listener_ref_name_the_ambiguity() -> None:
    config = memory_config({"listener_ref": None})

    async def scenario() -> None:
        async with open_host(
            RecordingApp(),
            config,
            listeners={"web": Bind(), "other": Bind()},
            providers={"primary": MemoryProvider(registry=MemoryRegistry())},
            handle_signals=False,
            allow_loopback=True,
        ):
            raise AssertionError("must not start")

    with pytest.raises(RegistrationError) as caught:
        run_on("trio", scenario)
    assert caught.value.path == "discovery.registrations.web.listener_ref"
    message = str(caught.value)
    assert "'other'" in message and "'web'" in message
    assert "listener_ref" in message and "eligibility" not in message
