"""IncrementalListing against the plain ProviderSnapshot it must equal."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nadisc import EvidenceKind, IncrementalListing, Instance, ProviderSnapshot

KEYS = st.sampled_from([f"k{n:02d}" for n in range(12)])
IDENTITIES = st.sampled_from(["a", "b", "c", "d", "e", "f", "g", "h"])
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), KEYS, IDENTITIES, st.integers(1, 65535), st.text(max_size=5)),
        st.tuples(st.just("discard"), KEYS),
        st.tuples(st.just("clear")),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(OPS)
def test_every_change_keeps_order_identities_and_bytes_exact(ops: list[tuple[object, ...]]) -> None:
    listing: IncrementalListing[str] = IncrementalListing()
    model: dict[str, Instance] = {}
    for op in ops:
        if op[0] == "put":
            _, key, identity, port, meta = op
            instance = Instance(
                str(identity), "10.0.0.1", int(str(port)), metadata={"m": str(meta)}
            )
            listing.put(str(key), instance)
            model[str(key)] = instance
        elif op[0] == "discard":
            assert listing.discard(str(op[1])) == (model.pop(str(op[1]), None) is not None)
        else:
            listing.clear()
            model.clear()
        ordered = tuple(model[key] for key in sorted(model))
        assert len(listing) == len(model)
        identities = [i.identity for i in ordered]
        if len(set(identities)) != len(identities):
            with pytest.raises(ValueError, match="duplicate instance identity"):
                listing.snapshot("orders", EvidenceKind.LEASE)
            continue
        snapshot = listing.snapshot("orders", EvidenceKind.LEASE)
        plain = ProviderSnapshot("orders", ordered, EvidenceKind.LEASE)
        assert snapshot == plain
        assert snapshot.approximate_bytes() == plain.approximate_bytes()
        assert listing.approximate_bytes == plain.approximate_bytes()


def test_an_unchanged_listing_hands_out_the_same_snapshot() -> None:
    listing: IncrementalListing[bytes] = IncrementalListing()
    same = Instance("a", "10.0.0.1", 80)
    listing.put(b"p/a", same)
    first = listing.snapshot("orders", EvidenceKind.LEASE)
    listing.put(b"p/a", same)  # the very same object: no change
    assert listing.snapshot("orders", EvidenceKind.LEASE) is first
    listing.put(b"p/a", Instance("a", "10.0.0.1", 81))
    second = listing.snapshot("orders", EvidenceKind.LEASE)
    assert second is not first and second.instances[0].port == 81
    assert b"p/a" in listing and listing.get(b"p/a") is second.instances[0]
    assert listing.snapshot("orders", EvidenceKind.LEASE, {"p/x": "bad"}).invalid == {"p/x": "bad"}


def test_a_snapshot_does_no_per_instance_work(monkeypatch: pytest.MonkeyPatch) -> None:
    listing: IncrementalListing[bytes] = IncrementalListing()
    for n in range(2000):
        listing.put(f"p/{n:05d}".encode(), Instance(f"i{n}", "10.0.0.1", 80))
    calls = 0
    measure = Instance.approximate_bytes

    def counting(self: Instance) -> int:
        nonlocal calls
        calls += 1
        return measure(self)

    monkeypatch.setattr(Instance, "approximate_bytes", counting)
    for n in range(10):
        listing.put(f"p/{n:05d}".encode(), Instance(f"i{n}", "10.0.0.2", 81))
        listing.discard(f"p/{1000 + n:05d}".encode())
    snapshot = listing.snapshot("orders", EvidenceKind.LEASE)
    assert snapshot.approximate_bytes() == listing.approximate_bytes
    # Each change measures only the instances it adds or takes out (an
    # instance is immutable, so a replaced or removed one is measured again
    # instead of keeping a size per key); the snapshot's size is known.
    assert calls == 30


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(KEYS, IDENTITIES, st.integers(1, 65535), st.text(max_size=5)), max_size=20),
    st.booleans(),
)
def test_a_bulk_built_listing_equals_one_built_a_key_at_a_time(
    pairs: list[tuple[str, str, int, str]], ordered: bool
) -> None:
    """``from_sorted`` (a range's records, in key order) is the listing that
    ``put`` of each pair would build: instances, order, identity counts,
    bytes, duplicates, and later changes on top of it. Keys out of order or
    repeated (``ordered`` False keeps them as drawn) take the one-by-one path."""
    if ordered:
        pairs = sorted({pair[0]: pair for pair in pairs}.values())
    keys = [key for key, *_ in pairs]
    shared = {"zone": "a"}  # one mapping for many instances, measured once in bulk
    instances = [
        Instance(
            identity,
            "10.0.0.1" if port % 3 else "node-7.example",
            port,
            metadata={"m": meta} if meta else (shared if port % 5 == 0 else {}),
            tags=(meta, "t") if meta and port % 2 else (),
        )
        for _, identity, port, meta in pairs
    ]
    one_by_one: IncrementalListing[str] = IncrementalListing()
    for key, instance in zip(keys, instances, strict=True):
        one_by_one.put(key, instance)
    bulk = IncrementalListing.from_sorted(list(keys), list(instances))
    for change in ("none", "put", "discard"):
        if change == "put":
            for listing in (one_by_one, bulk):
                listing.put("k05", Instance("a", "10.0.0.2", 1))
        elif change == "discard" and keys:
            for listing in (one_by_one, bulk):
                listing.discard(keys[0])
        assert len(bulk) == len(one_by_one)
        assert bulk.approximate_bytes == one_by_one.approximate_bytes
        assert [bulk.get(k) for k in KEYS_ALL] == [one_by_one.get(k) for k in KEYS_ALL]
        try:
            expected = one_by_one.snapshot("orders", EvidenceKind.LEASE)
        except ValueError as exc:
            with pytest.raises(ValueError, match="duplicate instance identity"):
                bulk.snapshot("orders", EvidenceKind.LEASE)
            assert "duplicate" in str(exc)
            continue
        snapshot = bulk.snapshot("orders", EvidenceKind.LEASE)
        assert snapshot == expected
        assert snapshot.approximate_bytes() == expected.approximate_bytes()


KEYS_ALL = [f"k{n:02d}" for n in range(12)]


def test_a_bulk_build_needs_one_instance_per_key() -> None:
    with pytest.raises(ValueError, match="one instance per key"):
        IncrementalListing.from_sorted(["a"], [])
