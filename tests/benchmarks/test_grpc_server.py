"""The shared start-up of the gRPC test and benchmark servers (``benchmarks/_grpc_server.py``)."""

from __future__ import annotations

import sys

import pytest

from benchmarks._grpc_server import serving

SERVER = "import sys; print('PORTS 5 7', flush=True); sys.stdin.read()"


def test_the_printed_ports_are_yielded_and_the_server_stops_with_its_stdin() -> None:
    with serving([sys.executable, "-c", SERVER]) as ports:
        assert ports == [5, 7]


def test_a_server_that_does_not_start_says_why() -> None:
    failing = "import sys; sys.stderr.write('no port for you'); print('hello')"
    with (
        pytest.raises(RuntimeError, match="did not start: no port for you"),
        serving([sys.executable, "-c", failing]),
    ):
        pytest.fail("the block ran")
