"""examples/grpc_discovery_trio.py runs as written and prints what its docstring says."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "grpc_discovery_trio.py"


def test_the_trio_example_runs() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines() == [
        "balanced: {'s0': 3, 's1': 3, 's2': 3}",
        "after s2 left: ['s0', 's1']",
        "first serving: True",
    ]
