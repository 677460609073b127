"""The trusted builder for providers that validate in bulk: equal to the constructor."""

from __future__ import annotations

import dataclasses
from types import MappingProxyType

import pytest

from nadisc import Instance
from nadisc._instance import _InstanceShell, _trusted_instances


def test_the_shell_has_the_layout_of_instance() -> None:
    names = {f.name for f in dataclasses.fields(Instance)}
    assert set(Instance.__slots__) == names == set(_InstanceShell.__slots__)


def test_built_instances_equal_constructed_ones_in_every_field() -> None:
    view = MappingProxyType({"zone": "a"})
    built = _trusted_instances([("i1", "10.0.0.1", 80, 2.0, view), ("i2", "::1", 81, 1.0, view)])
    expected = [
        Instance("i1", "10.0.0.1", 80, weight=2.0, metadata={"zone": "a"}),
        Instance("i2", "::1", 81, metadata={"zone": "a"}),
    ]
    assert built == expected
    for one, other in zip(built, expected, strict=True):
        assert type(one) is Instance
        # every field is set (an unset slot would raise here) and equal
        fields = [f.name for f in dataclasses.fields(Instance)]
        assert [getattr(one, n) for n in fields] == [getattr(other, n) for n in fields]
        assert hash(one) == hash(other) and repr(one) == repr(other)
        assert one.approximate_bytes() == other.approximate_bytes()
    assert built[1].address == "[::1]:81"
    with pytest.raises(dataclasses.FrozenInstanceError):
        built[0].port = 1  # type: ignore[misc]
