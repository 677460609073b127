"""A gRPC server in a subprocess that prints its ports: started, read and stopped in one place.

Shared by the gRPC benchmarks and the gRPC tests (not a benchmark). The
server's first line on stdout is ``PORT <n>`` or ``PORTS <n> [<m> ...]``;
it runs until its stdin closes. ``with serving(argv) as ports:`` starts it,
waits at most ``timeout`` seconds for that line (a server that does not
start is a ``RuntimeError`` with the end of its stderr), and on exit closes
its stdin and waits for it, killing it after 10 s. ``serving_process`` is
the same and also yields the process, for :func:`cpu_seconds`.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

__all__ = ["cpu_seconds", "serving", "serving_process"]


@contextmanager
def serving(argv: Sequence[str], *, timeout: float = 30.0) -> Iterator[list[int]]:
    """Run ``argv`` until the block ends; yields the ports it printed."""
    with serving_process(argv, timeout=timeout) as (ports, _process):
        yield ports


def cpu_seconds(process: subprocess.Popen[str]) -> float:
    """User plus system CPU seconds ``process`` has used so far (Linux ``/proc``);
    NaN where that cannot be read."""
    try:
        with open(f"/proc/{process.pid}/stat", encoding="ascii") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return float("nan")
    # After the command: state is field 3, utime and stime are fields 14 and 15.
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextmanager
def serving_process(
    argv: Sequence[str], *, timeout: float = 30.0
) -> Iterator[tuple[list[int], subprocess.Popen[str]]]:
    """:func:`serving`, yielding ``(ports, process)``."""
    with tempfile.TemporaryFile() as errors:
        process = subprocess.Popen(
            list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True
        )
        stdin, stdout = process.stdin, process.stdout
        assert stdin is not None and stdout is not None
        try:
            line: list[str] = []
            reader = threading.Thread(target=lambda: line.append(stdout.readline()), daemon=True)
            reader.start()
            reader.join(timeout)
            words = line[0].split() if line else []
            if not words or words[0] not in ("PORT", "PORTS"):
                process.kill()
                process.wait(10)
                errors.seek(0)
                tail = errors.read().decode(errors="replace")[-2000:]
                raise RuntimeError(f"the gRPC server ({' '.join(argv)}) did not start: {tail}")
            yield [int(word) for word in words[1:]], process
        finally:
            stdin.close()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
            stdout.close()
