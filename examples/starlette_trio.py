"""A Starlette app hosted on trio, with an admin listener for the probe.

    python examples/starlette_trio.py CONFIG.yaml [--host 0.0.0.0] [--port 0]
        [--advertised-host 10.0.0.5] [--admin-port 0] [--allow-loopback]

Needs ``pip install starlette``. The public listener ``web`` serves the
app; the ``admin`` listener (loopback) serves the eligibility probe at
``/discovery/eligible/<registration>`` when the config enables it, so the
probe never shows on the public port. Routes: ``/`` answers ``hello``,
``/slow/{ms}`` sends a first line at once and the rest after that many
milliseconds. SIGTERM/SIGINT:
deregister, drain, close; the close report is logged.

Exit code: 0 when the shutdown was clean (``HostReport.clean``: every
registration removed, nothing abandoned, within the budget), 1 when it was
not (the close report, logged as a warning, says why) or when the startup
failed.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import AsyncIterator

import trio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.routing import Route

import nadisc
from nadisc.hosting import Bind, Host, serve


async def hello(request: Request) -> PlainTextResponse:
    return PlainTextResponse("hello\n")


async def slow(request: Request) -> StreamingResponse:
    delay = int(request.path_params["ms"]) / 1000

    async def lines() -> AsyncIterator[bytes]:
        # The first line goes out at once: a caller sees the request is in.
        yield b"started\n"
        await trio.sleep(delay)
        yield b"hello\n"

    return StreamingResponse(lines(), media_type="text/plain")


app = Starlette(routes=[Route("/", hello), Route("/slow/{ms:int}", slow)])


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--advertised-host")
    parser.add_argument("--admin-port", type=int, default=0)
    parser.add_argument("--allow-loopback", action="store_true")
    parser.add_argument("--drain-timeout-ms", type=int, default=10_000)
    args = parser.parse_args(argv)
    config = nadisc.load_config_file(args.config)
    listeners = {
        "web": Bind(args.host, args.port, advertised_host=args.advertised_host),
        "admin": Bind("127.0.0.1", args.admin_port, admin=True),
    }
    async with trio.open_nursery() as nursery:
        host: Host = await nursery.start(
            lambda task_status: serve(
                app,
                config,
                listeners=listeners,
                allow_loopback=args.allow_loopback,
                drain_timeout_ms=args.drain_timeout_ms,
                task_status=task_status,
            )
        )
        if host.shutting_down:  # a signal came during the startup
            print("stopping before the startup completed", flush=True)
        else:
            bound = " ".join(f"{n}={h}:{p}" for n, (h, p) in host.bound.items())
            print("serving", bound, flush=True)
    return 0 if host.report is not None and host.report.clean else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(trio.run(main, sys.argv[1:]))
