"""Project-level promises: cheap `import poise`, curated public surfaces."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

PACKAGES = [
    "poise",
    "nadisc",
    "nadisc_etcd",
    "nadisc_consul",
    "nadisc_nacos",
    "nadisc_kubernetes",
]


def test_import_poise_loads_only_stdlib_and_anyio() -> None:
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "import poise\n"
        "new = {m.split('.')[0] for m in set(sys.modules) - before}\n"
        "stdlib = set(sys.stdlib_module_names)\n"
        "print(sorted(n for n in new if n not in stdlib and not n.startswith('_')))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True
    ).stdout.strip()
    third_party = set(eval(out))  # a printed list of names
    assert third_party <= {"anyio", "sniffio", "idna", "typing_extensions", "poise"}, third_party
    assert "httpx" not in third_party and "pydantic" not in third_party


@pytest.mark.parametrize("name", PACKAGES)
def test_all_is_sorted_and_complete(name: str) -> None:
    module = importlib.import_module(name)
    exported = list(getattr(module, "__all__", []))
    assert exported == sorted(exported), f"{name}.__all__ is not sorted"
    public = {
        attr
        for attr, value in vars(module).items()
        if not attr.startswith("_") and not isinstance(value, type(sys)) and attr != "annotations"
    }
    assert public == set(exported), f"{name}: exported names differ: {public ^ set(exported)}"
    for attr in exported:
        assert hasattr(module, attr), f"{name}.{attr} listed in __all__ but missing"
