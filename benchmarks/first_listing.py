"""The first listing of a large service: every host new to the process.

Providers check every instance's host (an IP address or a DNS name) and
keep the hosts they found valid in a bounded cache, so a listing that
repeats hosts already seen checks none of them again. The first listing of
a service (or the first after a restart) finds every host new. Measured on
N etcd records (``{"Op": 0, "Addr": "10.a.b.c:80"}``, each with its own
IPv4 host; 10,000, 500 with ``--smoke``), in interleaved rounds, medians:

``first listing``
    :func:`nadisc_etcd._layout.decode_records` of the N values with the host
    cache emptied before each repeat: decoded, validated, typed instances.
``later listing``
    The same with every host cached (what every listing after the first
    costs).
``floor``
    The least a decoder of these records does: a minimal msgspec struct of
    the two fields decoded per value, the address split at its last colon
    and the port turned into an int; no check, no instance.
``json.loads``
    ``json.loads`` of every value (what a thin client hands its users).

Two rows for the host check alone, on the same N new hosts (for
information): ``valid_hosts`` (one pass over the joined hosts) and the
check it replaced, ``ipaddress.IPv4Address`` per host.

Ratios are to the floor, per round. Run ``python -m benchmarks.first_listing
[--smoke] [--rounds R]``.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Literal

import msgspec
from nadisc_etcd._layout import decode_records

from nadisc import _instance

FULL = 10_000
SMOKE = 500


class _Minimal(msgspec.Struct, gc=False):
    Addr: str
    Op: Literal[0] = 0


_MINIMAL = msgspec.json.Decoder(_Minimal)


def records(count: int) -> tuple[list[str], list[bytes], list[str]]:
    """``count`` identities, their record values and their hosts."""
    hosts = [f"10.{n // 62500 % 250}.{n // 250 % 250}.{n % 250 + 1}" for n in range(count)]
    values = [json.dumps({"Op": 0, "Addr": f"{host}:80"}).encode() for host in hosts]
    return [f"i{n:06d}" for n in range(count)], values, hosts


def _floor(values: list[bytes]) -> list[tuple[str, int]]:
    out = []
    for record in map(_MINIMAL.decode, values):
        host, _, port = record.Addr.rpartition(":")
        out.append((host, int(port)))
    return out


def _ipaddress_each(hosts: list[str]) -> bool:
    for host in hosts:
        ipaddress.IPv4Address(host)
    return True


def measure(count: int, rounds: int) -> dict[str, list[float]]:
    identities, values, hosts = records(count)
    cache = _instance._VALID_HOSTS

    def first() -> object:
        cache.clear()
        return decode_records(identities, values, max_record_bytes=4096)

    def later() -> object:
        return decode_records(identities, values, max_record_bytes=4096)

    def check_new() -> object:
        cache.clear()
        return _instance.valid_hosts(hosts)

    rows: dict[str, Callable[[], object]] = {
        "first listing": first,
        "later listing": later,
        "floor": lambda: _floor(values),
        "json.loads": lambda: [json.loads(value) for value in values],
        "valid_hosts, new hosts": check_new,
        "ipaddress per host": lambda: _ipaddress_each(hosts),
    }
    assert first() is not None and later() is not None
    seconds: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, run in rows.items():
            best = float("inf")
            for _ in range(3):
                start = time.process_time()
                run()
                best = min(best, time.process_time() - start)
            seconds[name].append(best)
    cache.clear()
    return seconds


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--smoke", action="store_true", help=f"{SMOKE} records, one round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    count, rounds = (SMOKE, 1) if args.smoke else (FULL, args.rounds)
    seconds = measure(count, rounds)
    ratios = {
        name: statistics.median(
            mine / floor for mine, floor in zip(times, seconds["floor"], strict=True)
        )
        for name, times in seconds.items()
    }
    print(f"{count:,} etcd records, every host its own IPv4 address; {rounds} round(s)")
    print(f"{'row':<26} {'ms':>8} {'/ floor':>8}")
    for name, times in seconds.items():
        print(f"{name:<26} {statistics.median(times) * 1e3:>8.2f} {ratios[name]:>7.2f}x")
    load = " ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"medians over the rounds (process CPU, best of 3 per round); load average {load}")
    return ratios


if __name__ == "__main__":
    main()
