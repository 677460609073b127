"""A plain ASGI app hosted on asyncio: bind, register, drain on SIGTERM.

    python examples/plain_asgi_asyncio.py CONFIG.yaml [--host 0.0.0.0] [--port 0]
        [--advertised-host 10.0.0.5] [--allow-loopback]

The config's registrations may leave ``ip``/``port`` out: the host fills in
the address the server really bound. Routes: ``/`` answers ``hello``,
``/slow/<ms>`` sends a first line at once and the rest after that many
milliseconds. On SIGTERM or SIGINT
the registration is removed first, then in-flight requests finish, then the
process exits with the close report logged.

Exit code: 0 when the shutdown was clean (``HostReport.clean``: every
registration removed, nothing abandoned, within the budget), 1 when it was
not (the close report, logged as a warning, says why: a registration may
remain in the registry, say) or when the startup failed.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

import anyio

import nadisc
from nadisc.hosting import Bind, Host, HostReport, serve


async def app(scope: Any, receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    path: str = scope["path"]
    headers = [(b"content-type", b"text/plain")]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    if path.startswith("/slow/"):
        # The first line goes out at once, the rest after the delay: a
        # caller sees the request is inside the app.
        await send({"type": "http.response.body", "body": b"started\n", "more_body": True})
        await asyncio.sleep(int(path.rsplit("/", 1)[1]) / 1000)
    await send({"type": "http.response.body", "body": b"hello\n"})


async def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--advertised-host")
    parser.add_argument("--allow-loopback", action="store_true")
    parser.add_argument("--drain-timeout-ms", type=int, default=10_000)
    args = parser.parse_args(argv)
    config = nadisc.load_config_file(args.config)
    web = Bind(args.host, args.port, advertised_host=args.advertised_host)

    async def run() -> HostReport | None:
        async with anyio.create_task_group() as tg:
            host: Host = await tg.start(
                lambda task_status: serve(
                    app,
                    config,
                    listeners={"web": web},
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
        return host.report

    report = await run()
    return 0 if report is not None and report.clean else 1


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    sys.exit(asyncio.run(main(sys.argv[1:])))
