"""etcd: a record whose ``Addr`` host is not an IP address or DNS name is a
confirmed invalid record (the shared check in ``nadisc.Instance``)."""

from __future__ import annotations

import base64
import json

import pytest
from nadisc_etcd._layout import RecordError, decode_record


def value(document: object) -> str:
    return base64.b64encode(json.dumps(document).encode()).decode()


@pytest.mark.parametrize("addr", ["<img src=x onerror=alert(5)>:80", "a b:80", "999.1.1.1:80"])
def test_an_address_that_is_not_host_port_is_refused_naming_the_instance(addr: str) -> None:
    with pytest.raises(RecordError, match=r"instance 'e1': address host .* DNS name"):
        decode_record("e1", value({"Addr": addr}), max_record_bytes=1024)


def test_a_valid_dns_name_is_kept() -> None:
    got = decode_record("e1", value({"Addr": "orders-1.internal:8080"}), max_record_bytes=1024)
    assert got.address == "orders-1.internal:8080"
