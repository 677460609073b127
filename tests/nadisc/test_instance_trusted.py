"""``Instance`` as a struct: the trusted builder equals the constructor, the
constructor's checks still run, and instances stay out of the cyclic GC."""

from __future__ import annotations

import gc
from collections.abc import Mapping
from types import MappingProxyType

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nadisc import Instance
from nadisc._instance import _EMPTY, _trusted_instances, trusted_instance

FIELDS = ("identity", "host", "port", "weight", "metadata", "tags", "draining")


def test_the_fields_are_the_documented_ones_in_order() -> None:
    assert Instance.__struct_fields__ == FIELDS


def test_built_instances_equal_constructed_ones_in_every_field() -> None:
    view = MappingProxyType({"zone": "a"})
    built = _trusted_instances(("i1", "i2"), ("10.0.0.1", "::1"), (80, 81), (2.0, 1.0), (view,) * 2)
    expected = [
        Instance("i1", "10.0.0.1", 80, weight=2.0, metadata={"zone": "a"}),
        Instance("i2", "::1", 81, metadata={"zone": "a"}),
    ]
    assert built == expected
    for one, other in zip(built, expected, strict=True):
        assert type(one) is Instance
        assert [getattr(one, n) for n in FIELDS] == [getattr(other, n) for n in FIELDS]
        assert one.draining is False  # the "checked" marker never stays behind
        assert hash(one) == hash(other) and repr(one) == repr(other)
        assert one.approximate_bytes() == other.approximate_bytes()
    assert built[1].address == "[::1]:81"
    with pytest.raises(AttributeError):
        built[0].port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"identity": "", "host": "h", "port": 1}, "identity must not be empty"),
        ({"identity": "i", "host": "", "port": 1}, "host must not be empty"),
        ({"identity": "i", "host": "h", "port": 0}, "port 0 out of range"),
        ({"identity": "i", "host": "h", "port": 65536}, "port 65536 out of range"),
        ({"identity": "i", "host": "h", "port": 1, "weight": 0.0}, "weight must be finite"),
        ({"identity": "i", "host": "h", "port": 1, "weight": float("inf")}, "weight must be"),
    ],
)
def test_the_public_constructor_still_checks_every_field(
    arguments: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Instance(**arguments)  # type: ignore[arg-type]


def test_instances_are_not_tracked_by_the_cyclic_collector() -> None:
    one = Instance("i", "h", 1, metadata={"zone": "a"}, tags=("t",))
    assert not gc.is_tracked(one)


def test_metadata_is_a_private_read_only_copy_and_empty_metadata_is_shared() -> None:
    source = {"zone": "a"}
    one = Instance("i", "h", 1, metadata=source)
    source["zone"] = "b"
    assert one.metadata == {"zone": "a"}
    with pytest.raises(TypeError):
        one.metadata["zone"] = "c"  # type: ignore[index]
    assert Instance("i", "h", 1, metadata={}).metadata is Instance("j", "h", 2).metadata


def test_hash_and_equality_follow_the_dataclass_rules_they_replace() -> None:
    base = Instance("i", "h", 1, metadata={"zone": "a"})
    other = Instance("i", "h", 1, metadata={"zone": "b"})
    assert base != other and hash(base) == hash(other)  # metadata: compared, not hashed
    assert len({base, Instance("i", "h", 1, metadata={"zone": "a"})}) == 1
    drained = msgspec.structs.replace(base, draining=True)
    assert drained.draining and drained != base and drained.metadata is base.metadata


# ------------------------------------------------------------ trusted_instance

#: Hosts valid and not: addresses, names, and text the constructor refuses.
HOSTS = st.one_of(
    st.sampled_from(["10.0.0.1", "::1", "fe80::1%eth0", "svc.local", "a_b-c", "-bad", "1.2.3"]),
    st.text(max_size=12),
)


@settings(max_examples=400, deadline=None)
@given(
    identity=st.text(min_size=1, max_size=8),
    host=HOSTS,
    port=st.integers(1, 65535),
    weight=st.floats(min_value=1e-9, max_value=1e9, allow_nan=False, allow_infinity=False),
    metadata=st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=3),
    view=st.booleans(),
    tags=st.lists(st.text(max_size=3), max_size=3).map(tuple),
    draining=st.booleans(),
)
def test_trusted_instance_equals_the_validating_constructor(
    identity: str,
    host: str,
    port: int,
    weight: float,
    metadata: dict[str, str],
    view: bool,
    tags: tuple[str, ...],
    draining: bool,
) -> None:
    """For every input the trusted builder's callers guarantee (identity
    non-empty, port in range, weight finite and positive), the same instance
    as ``Instance(...)`` in every field, or the same error for a bad host."""
    given_metadata: Mapping[str, str] = MappingProxyType(dict(metadata)) if view else metadata
    try:
        expected = Instance(identity, host, port, weight, given_metadata, tags, draining)
    except ValueError as exc:
        with pytest.raises(type(exc)) as caught:
            trusted_instance(identity, host, port, weight, given_metadata, tags, draining)
        assert str(caught.value) == str(exc)
        return
    built = trusted_instance(identity, host, port, weight, given_metadata, tags, draining)
    assert type(built) is Instance and built == expected
    assert [getattr(built, n) for n in FIELDS] == [getattr(expected, n) for n in FIELDS]
    assert type(built.metadata) is MappingProxyType
    assert (built.metadata is _EMPTY) == (expected.metadata is _EMPTY)
    assert hash(built) == hash(expected) and repr(built) == repr(expected)
    assert built.approximate_bytes() == expected.approximate_bytes()


def test_trusted_instance_keeps_no_reference_to_the_callers_dict() -> None:
    source = {"zone": "a"}
    built = trusted_instance("i", "10.0.0.1", 80, 1.0, source)
    source["zone"] = "b"
    assert built.metadata == {"zone": "a"}
    assert trusted_instance("i", "10.0.0.1", 80, 1.0, {}).metadata is _EMPTY
