"""Headless Chromium driven over the DevTools protocol with trio-websocket (not a test module).

``async with open_chromium(tmp_path) as browser`` starts Debian's ``chromium``
headless with a fresh profile and ``--remote-debugging-port=0``, reads the
chosen port from ``DevToolsActivePort`` in the profile, and connects to the
browser's DevTools WebSocket. ``await browser.open_page(url)`` creates a tab
and returns a :class:`Page` whose ``evaluate`` / ``screenshot`` send CDP
commands on that tab's session. No browser-driver package is needed.

Under ``CI=true`` a missing ``chromium`` fails (``require_chromium``).
"""

# Polling here waits on other processes or on a server's side effects,
# which no single event covers.
# ruff: noqa: ASYNC109, ASYNC220, ASYNC240

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import struct
import subprocess
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
from trio_websocket import WebSocketConnection, open_websocket_url

IN_CI = os.environ.get("CI", "").lower() == "true"
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
    "--remote-debugging-port=0",
]


def require_chromium() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        message = "chromium is not installed (make servers installs Debian's chromium)"
        if IN_CI:
            pytest.fail(message + "; CI=true requires it")
        pytest.skip(message + " (never skipped under CI=true)")
    return found


class Browser:
    def __init__(self, socket: WebSocketConnection, nursery: trio.Nursery) -> None:
        self._socket = socket
        self._ids = itertools.count(1)
        self._pending: dict[int, trio.MemorySendChannel[dict[str, Any]]] = {}
        nursery.start_soon(self._read)

    async def _read(self) -> None:
        while True:
            message = json.loads(await self._socket.get_message())
            channel = self._pending.pop(message.get("id", -1), None)
            if channel is not None:
                await channel.send(message)

    async def send(
        self, method: str, params: dict[str, Any] | None = None, session: str | None = None
    ) -> dict[str, Any]:
        ident = next(self._ids)
        send, receive = trio.open_memory_channel[dict[str, Any]](1)
        self._pending[ident] = send
        payload: dict[str, Any] = {"id": ident, "method": method, "params": params or {}}
        if session is not None:
            payload["sessionId"] = session
        await self._socket.send_message(json.dumps(payload))
        answer = await receive.receive()
        if "error" in answer:
            raise RuntimeError(f"{method}: {answer['error']}")
        return dict(answer.get("result", {}))

    async def open_page(self, url: str, *, width: int = 1280, height: int = 800) -> Page:
        target = await self.send("Target.createTarget", {"url": "about:blank"})
        attached = await self.send(
            "Target.attachToTarget", {"targetId": target["targetId"], "flatten": True}
        )
        page = Page(self, attached["sessionId"])
        await page.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": height, "deviceScaleFactor": 1, "mobile": False},
        )
        await page.send("Page.enable")
        await page.send("Page.navigate", {"url": url})
        return page


class Page:
    def __init__(self, browser: Browser, session: str) -> None:
        self.browser = browser
        self.session = session

    async def send(self, method: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return await self.browser.send(method, params, self.session)

    async def evaluate(self, expression: str, *, await_promise: bool = False) -> Any:
        result = await self.send(
            "Runtime.evaluate",
            {"expression": expression, "returnByValue": True, "awaitPromise": await_promise},
        )
        if "exceptionDetails" in result:
            raise RuntimeError(f"page script failed: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def wait_for(self, expression: str, timeout: float = 10.0) -> Any:
        with trio.fail_after(timeout):
            while True:
                value = await self.evaluate(expression)
                if value:
                    return value
                await trio.sleep(0.02)

    async def screenshot(self, path: Path) -> bytes:
        result = await self.send("Page.captureScreenshot", {"format": "png"})
        data = base64.b64decode(result["data"])
        path.write_bytes(data)
        return data


def png_size(data: bytes) -> tuple[int, int]:
    """(width, height) from a PNG's IHDR; raises ValueError if it is not a PNG."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR":
        raise ValueError("not a PNG")
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


@asynccontextmanager
async def open_chromium(profile: Path, *, flags: tuple[str, ...] = ()) -> AsyncIterator[Browser]:
    binary = require_chromium()
    profile.mkdir(parents=True, exist_ok=True)
    process = subprocess.Popen(
        [binary, *FLAGS, *flags, f"--user-data-dir={profile}", "about:blank"],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        marker = profile / "DevToolsActivePort"
        with trio.fail_after(30):
            while not (marker.exists() and len(marker.read_text().splitlines()) >= 2):
                if process.poll() is not None:
                    raise RuntimeError(f"chromium exited with {process.returncode}")
                await trio.sleep(0.05)
        port, path = marker.read_text().splitlines()[:2]
        url = f"ws://127.0.0.1:{port.strip()}{path.strip()}"
        async with (
            trio.open_nursery() as nursery,
            open_websocket_url(url, max_message_size=64 * 1024 * 1024) as socket,
        ):
            yield Browser(socket, nursery)
            nursery.cancel_scope.cancel()
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
