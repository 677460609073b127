"""Smoke run of the first-listing benchmark (500 records, one round)."""

from __future__ import annotations

import pytest
from nadisc_etcd._layout import decode_records

from benchmarks import first_listing
from nadisc import _instance

pytestmark = pytest.mark.trio_only


def test_first_listing_smoke(capsys: pytest.CaptureFixture[str]) -> None:
    ratios = first_listing.main(["--smoke"])
    printed = capsys.readouterr().out
    assert "500 etcd records" in printed and "load average" in printed
    assert set(ratios) == {
        "first listing",
        "later listing",
        "floor",
        "json.loads",
        "valid_hosts, new hosts",
        "ipaddress per host",
    }
    assert ratios["floor"] == 1.0
    assert all(ratio > 0 for ratio in ratios.values())
    assert not _instance._VALID_HOSTS  # the benchmark leaves no hosts cached


def test_the_records_decode_to_their_hosts() -> None:
    identities, values, hosts = first_listing.records(300)
    assert len(set(hosts)) == 300
    decoded = decode_records(identities, values, max_record_bytes=4096)
    assert decoded is not None
    assert [(i.identity, i.host, i.port) for i in decoded] == [
        (identity, host, 80) for identity, host in zip(identities, hosts, strict=True)
    ]
    assert first_listing._floor(values) == [(host, 80) for host in hosts]
