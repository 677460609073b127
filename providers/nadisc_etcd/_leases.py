"""Sans-IO bookkeeping of the leases a connection's registrations share.

Every registration of one etcd connection has the same TTL
(``ttl_seconds``), so they may share leases: a new registration joins the
open lease while it has room (:data:`LEASE_GROUP` keys) and a new lease is
granted only when none has. Each registration still has its own key, its own
state in the owner and its own deregistration; what they share is the
keepalive::

    register ──► join the open lease (or grant one) ──► put key on it
    renew    ──► keepalive due? (none sent within ``fresh`` seconds) ─► one
                 keepalive for every key on the lease; else nothing sent
    check    ──► the lease's time-to-live, read once per ``fresh_check``
    deregister ► delete the key; the lease's last key revokes the lease
    lost     ──► every key on it is gone: each renew says LeaseLost and the
                 owner registers each again (on a new shared lease)

The owner renews each registration at least every ``renew_within`` (a third
of the TTL). A keepalive is skipped while the lease's last one (or its
grant) *started* less than ``fresh = renew_within / 4`` ago. A renew call
that is skipped comes again within ``renew_within``, so the gap between two
keepalives of a lease stays within ``renew_within + fresh`` (1.25 x a
third of the TTL: one keepalive may be lost before the lease lapses).
No clock here: every method takes ``now``.
"""

from __future__ import annotations

import math

__all__ = ["LEASE_GROUP", "LeasePool", "SharedLease"]

#: Keys one lease carries at most: a lost lease takes this many
#: registrations down at once, and a revoke deletes them in one transaction.
LEASE_GROUP = 256


class SharedLease:
    """One granted lease and the keys of ours on it."""

    __slots__ = ("alive_at", "alive_ttl", "id", "joinable", "kept_at", "keys", "lost")

    def __init__(self, lease_id: int, now: float) -> None:
        self.id = lease_id
        self.keys: set[bytes] = set()
        #: When the last keepalive (or the grant) started.
        self.kept_at = now
        #: When the last time-to-live read answered, and what it said.
        self.alive_at = -math.inf
        self.alive_ttl = 0
        #: False once revoked, lost, emptied or full: no new key joins it.
        self.joinable = True
        #: The server no longer holds it.
        self.lost = False

    def __repr__(self) -> str:
        return f"<SharedLease {self.id} keys={len(self.keys)} lost={self.lost}>"


class LeasePool:
    """The shared leases of one connection (see the module docstring)."""

    def __init__(self, renew_within: float, *, group: int = LEASE_GROUP) -> None:
        if group < 1:
            raise ValueError("a lease group holds at least one key")
        self.group = group
        #: A keepalive started less than this long ago makes another unnecessary.
        self.fresh = renew_within / 4
        #: A time-to-live answer this young serves every check of the lease.
        self.fresh_check = min(1.0, renew_within / 4)
        self._leases: dict[int, SharedLease] = {}
        self._open: SharedLease | None = None
        #: key -> the lease it was last put on.
        self._key_lease: dict[bytes, int] = {}

    def __len__(self) -> int:
        return len(self._leases)

    def get(self, lease_id: int) -> SharedLease | None:
        return self._leases.get(lease_id)

    def joinable(self) -> SharedLease | None:
        """The lease a new registration joins, or None: grant one."""
        lease = self._open
        if lease is None or not lease.joinable or lease.lost or len(lease.keys) >= self.group:
            self._open = None
            return None
        return lease

    def granted(self, lease_id: int, now: float) -> SharedLease:
        """A lease was just granted: new registrations join it from now on."""
        lease = SharedLease(lease_id, now)
        self._leases[lease_id] = lease
        self._open = lease
        return lease

    def attach(self, lease: SharedLease, key: bytes) -> int | None:
        """``key`` is put on ``lease``. A key lives on one lease only (a put
        moves it): returns the lease it left when that one is now empty
        and still held (the caller revokes it), else None."""
        previous = self._key_lease.get(key)
        emptied: int | None = None
        if previous is not None and previous != lease.id:
            old = self._leases.get(previous)
            still_held = old is not None and not old.lost
            if self.detach(previous, key) and still_held:
                emptied = previous
        lease.keys.add(key)
        self._key_lease[key] = lease.id
        if len(lease.keys) >= self.group:
            lease.joinable = False
        return emptied

    def detach(self, lease_id: int, key: bytes) -> bool:
        """``key`` left the lease; True when it was the lease's last key (the
        caller revokes it: nothing joins it any more)."""
        if self._key_lease.get(key) == lease_id:
            del self._key_lease[key]
        lease = self._leases.get(lease_id)
        if lease is None:
            return True
        lease.keys.discard(key)
        if lease.keys:
            return False
        lease.joinable = False
        del self._leases[lease_id]
        if self._open is lease:
            self._open = None
        return True

    def keepalive_due(self, lease_id: int, now: float) -> bool:
        """True when a renew of a registration on ``lease_id`` must send a
        keepalive (none started within ``fresh``, or the lease is unknown)."""
        lease = self._leases.get(lease_id)
        return lease is None or now - lease.kept_at >= self.fresh

    def kept(self, lease_id: int, started_at: float, ttl: int) -> None:
        """A keepalive started at ``started_at`` answered ``ttl`` (> 0)."""
        lease = self._leases.get(lease_id)
        if lease is not None:
            lease.kept_at = max(lease.kept_at, started_at)
            lease.alive_at = max(lease.alive_at, started_at)
            lease.alive_ttl = ttl

    def alive(self, lease_id: int, now: float) -> int | None:
        """A time-to-live answer young enough to serve a check (None: read one)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return None
        if lease.lost:
            return -1
        if now - lease.alive_at < self.fresh_check:
            return lease.alive_ttl
        return None

    def read_alive(self, lease_id: int, answered_at: float, ttl: int) -> None:
        lease = self._leases.get(lease_id)
        if lease is not None:
            lease.alive_at = answered_at
            lease.alive_ttl = ttl
            if ttl <= 0:
                self.lost(lease_id)

    def lost(self, lease_id: int) -> None:
        """The server no longer holds ``lease_id``: every key on it is gone."""
        lease = self._leases.get(lease_id)
        if lease is not None:
            lease.lost = True
            lease.joinable = False
            lease.alive_ttl = -1
            if self._open is lease:
                self._open = None

    def is_lost(self, lease_id: int) -> bool:
        lease = self._leases.get(lease_id)
        return lease is not None and lease.lost

    def __repr__(self) -> str:
        return f"<LeasePool leases={len(self._leases)} group={self.group}>"
