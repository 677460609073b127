"""Host classification shared by the settings validator and the payload builder.

Pure functions over strings. Addresses are compared by value through
:mod:`ipaddress`, so every spelling of an address counts: ``::``, ``::0``,
``[::0]`` and ``0:0:0:0:0:0:0:0`` are all the unspecified address, and an
IPv4-mapped IPv6 address is judged by its IPv4 part.
"""

from __future__ import annotations

import ipaddress

__all__ = ["is_loopback_host", "is_unspecified_host"]

_WILDCARDS = frozenset({"", "*"})


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """``host`` as an IP address (brackets and an IPv6 zone allowed), else None."""
    text = host.strip()
    if text.startswith("[") and text.endswith("]"):
        text = text[1:-1]
    try:
        return ipaddress.ip_address(text.partition("%")[0])
    except ValueError:
        return None


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
