"""A registrant in a process of its own, for ``benchmarks.etcd_peer``.

Run as ``python -m benchmarks._etcd_writer URL COMMANDS REPLIES`` with two
inherited pipe descriptors. Each command line is ``key value`` (a key without
spaces, then the value to its end); the writer puts the value under the key through etcd's
JSON gateway (``http.client`` on one kept-alive connection, the same for
every side measured) and answers ``t0 t1``: ``time.perf_counter()`` just
before the put and once its answer was read. On Linux that clock is
``CLOCK_MONOTONIC``, one clock for every process of the machine, so the
benchmark compares those stamps with its own. It exits at the end of the
commands.
"""

from __future__ import annotations

import base64
import http.client
import json
import os
import sys
import time
from urllib.parse import urlsplit


def _b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


def serve(url: str, commands: int, replies: int) -> None:
    parts = urlsplit(url)
    # A put that hangs fails the writer (and so the benchmark) instead.
    connection = http.client.HTTPConnection(
        parts.hostname or "127.0.0.1", parts.port or 2379, timeout=10
    )
    pending = b""
    while True:
        while b"\n" not in pending:
            chunk = os.read(commands, 65536)
            if not chunk:
                connection.close()
                return
            pending += chunk
        line, pending = pending.split(b"\n", 1)
        key, value = line.decode().split(" ", 1)
        body = json.dumps({"key": _b64(key), "value": _b64(value)})
        began = time.perf_counter()
        connection.request("POST", "/v3/kv/put", body, {"Content-Type": "application/json"})
        answer = connection.getresponse()
        answer.read()
        done = time.perf_counter()
        if answer.status != 200:
            raise SystemExit(f"put {key!r} answered {answer.status}")
        os.write(replies, f"{began!r} {done!r}\n".encode())


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
