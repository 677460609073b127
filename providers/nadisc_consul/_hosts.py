"""Host classification shared by the settings validator and the payload builder.

Pure functions over strings. Addresses are compared by value through
:mod:`ipaddress`, so every spelling of an address counts: ``::``, ``::0``,
``[::0]`` and ``0:0:0:0:0:0:0:0`` are all the unspecified address, and an
IPv4-mapped IPv6 address is judged by its IPv4 part. The numeric shorthands
the C resolver's ``inet_aton`` accepts (``0``, ``127.1``, ``2130706433``,
``0x7f.1``, ``0177.0.0.1``) are judged by the address it reads them as.
"""

from __future__ import annotations

import ipaddress

from nadisc._instance import numeric_reading

__all__ = ["is_loopback_host", "is_unspecified_host", "numeric_host_reading"]

_WILDCARDS = frozenset({"", "*"})


def _unbracketed(host: str) -> str:
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    return text


def _inet_aton(text: str) -> ipaddress.IPv4Address | None:
    """The IPv4 address the C resolver's ``inet_aton`` reads ``text`` as
    (a trailing dot ignored, as URL parsers do), else None."""
    reading = numeric_reading(text)
    return ipaddress.IPv4Address(reading) if reading else None


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address (brackets and an IPv6 zone allowed; an
    ``inet_aton`` shorthand read as its address), else None."""
    text = _unbracketed(host)
    try:
        return ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        return _inet_aton(text)


def numeric_host_reading(host: str) -> str | None:
    """Why ``host`` is a number in disguise, or None when it is an IP address
    in its usual form or a real host name.

    A number in disguise is a name ``inet_aton`` accepts (``0``, ``127.1``,
    ``2130706433``, ``0x7f.1``, ``0177.0.0.1``; the answer then says which
    address it reads: ``"read as 127.0.0.1"``), or a name whose last label is
    all digits or ``0x...``, which URL parsers read as an IPv4 number
    (``"its last label is a number"``). Resolvers do not agree on these: the C
    resolver maps them to an address, other clients look them up as names.
    """
    text = _unbracketed(host)
    try:
        ipaddress.ip_address(text.partition("%")[0])
        return None
    except ValueError:
        pass
    reading = numeric_reading(text)
    if reading is None:
        return None
    return f"read as {reading}" if reading else "its last label is a number"


def is_unspecified_host(host: str) -> bool:
    """A wildcard bind in any spelling: ``0.0.0.0``, ``::``, ``[::0]``,
    ``0:0:0:0:0:0:0:0``, ``::ffff:0.0.0.0``, ``*``, empty."""
    if host.strip() in _WILDCARDS:
        return True
    address = _ip(host)
    if address is None:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_unspecified
    return address.is_unspecified


def is_loopback_host(host: str) -> bool:
    """``localhost`` (and ``*.localhost``) or a loopback address in any spelling."""
    name = host.strip().lower().rstrip(".")
    if name == "localhost" or name.endswith(".localhost"):
        return True
    address = _ip(host)
    if address is None:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped.is_loopback
    return address.is_loopback
