"""An in-memory registry with fault injection, for tests of the registration lifecycle.

:class:`MemoryRegistry` has the registration half of the provider surface
(``register`` / ``renew`` / ``check`` / ``deregister`` with the same shapes
as :class:`~nadisc.Provider`) plus an ``idempotent_renewal`` flag, so a
provider can delegate to it. It starts no tasks: delayed effects are kept
as plain data with the time they land, and are applied whenever the
registry is next touched (any call, or :meth:`MemoryRegistry.settle`) — on
trio's ``MockClock`` that makes every fault deterministic.

Faults are scripted per operation and consumed in order::

    registry.inject("register", Fault.land_later(5.0))   # caller sees OutcomeUnknown,
                                                         # the write lands 5 s later
    registry.inject("renew", Fault.lose_ack())           # applied, answer lost
    registry.inject("check", Fault.fail(IncompleteSnapshot("flap")))
    registry.set_health("orders-10.0.0.5-8080", HealthStatus.UNHEALTHY)
    registry.expire("orders-10.0.0.5-8080")              # lease lost
    registry.revoke_identity()                           # every call: IdentityRevoked

A late write that lands after a deregistration re-creates the record (that
is what makes such writes dangerous); a late *renewal* only re-creates it
when ``idempotent_renewal`` is false.

Capability flags, mirrored by a provider built over the registry:

* ``idempotent_register``: the registry keys records by instance id and
  the handle is derived from it, so registering the same record again
  replaces it (an upsert, as in Consul or Nacos); without it every
  registration takes a new handle, like a new etcd lease;
* ``deregister_without_handle``: removals are addressed by instance id
  (they always are here; the flag says the provider may rely on it);
* ``renewal_creates=False``: a renewal only refreshes a record that exists
  (a TTL pass, a light beat), so its lost answers raise
  :class:`~nadisc._provider.RenewalOutcomeUnknown`, which leaves no
  residual risk. Only meaningful with ``idempotent_renewal``.
"""

from __future__ import annotations

import contextlib
import enum
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import anyio
import anyio.lowlevel

from ._errors import DeadlineExceeded, IdentityRevoked, LeaseLost, OutcomeUnknown, ProviderFailure
from ._provider import HealthStatus, Registered, RegistrationRecord, RenewalOutcomeUnknown

__all__ = ["Fault", "FaultKind", "MemoryRegistry", "Operation", "StoredRegistration"]

Operation = Literal["register", "renew", "check", "deregister"]
_OPERATIONS: tuple[Operation, ...] = ("register", "renew", "check", "deregister")


class FaultKind(enum.Enum):
    #: Apply the write, then raise OutcomeUnknown (the acknowledgement was lost).
    LOSE_ACK = "lose_ack"
    #: Raise OutcomeUnknown now; the write lands ``delay`` seconds later, or
    #: when :meth:`MemoryRegistry.land_held` is called if ``delay`` is None.
    LAND_LATER = "land_later"
    #: Raise OutcomeUnknown; the write never lands.
    DROP = "drop"
    #: Raise the given failure without applying anything.
    FAIL = "fail"
    #: Wait ``delay`` seconds before answering normally (the caller's deadline
    #: may pass first; the write then still lands when the delay ends).
    SLOW = "slow"


@dataclass(frozen=True, slots=True)
class Fault:
    kind: FaultKind
    delay: float | None = None
    failure: ProviderFailure | None = None

    @classmethod
    def lose_ack(cls) -> Fault:
        return cls(FaultKind.LOSE_ACK)

    @classmethod
    def land_later(cls, delay: float | None = None) -> Fault:
        return cls(FaultKind.LAND_LATER, delay=delay)

    @classmethod
    def drop(cls) -> Fault:
        return cls(FaultKind.DROP)

    @classmethod
    def fail(cls, failure: ProviderFailure) -> Fault:
        return cls(FaultKind.FAIL, failure=failure)

    @classmethod
    def slow(cls, delay: float) -> Fault:
        return cls(FaultKind.SLOW, delay=delay)


@dataclass(slots=True)
class StoredRegistration:
    """What the registry holds for one instance id."""

    record: RegistrationRecord
    handle: str
    health: HealthStatus = HealthStatus.HEALTHY
    #: Lease expiry (clock time) or None when the registry keeps it forever.
    expires_at: float | None = None
    renewals: int = 0


@dataclass(slots=True)
class _Held:
    """A write whose caller was told OutcomeUnknown, landing later."""

    operation: Operation
    apply: Callable[[], None]
    lands_at: float | None  # None: on land_held()


@dataclass(slots=True)
class _Log:
    operation: Operation
    instance_id: str
    outcome: str
    at: float


class MemoryRegistry:
    """A registry in memory. See the module docstring.

    ``idempotent_renewal``: repeating a renewal is harmless (a late renewal
    never re-creates a removed record). ``lease_ttl``: seconds a record lives
    without renewal (None: until removed). ``idempotent_register``,
    ``deregister_without_handle`` and ``renewal_creates``: see the module
    docstring.
    """

    def __init__(
        self,
        *,
        idempotent_renewal: bool = True,
        lease_ttl: float | None = None,
        idempotent_register: bool = False,
        deregister_without_handle: bool = False,
        renewal_creates: bool = True,
    ) -> None:
        self.idempotent_renewal = idempotent_renewal
        self.idempotent_register = idempotent_register
        self.deregister_without_handle = deregister_without_handle
        self.renewal_creates = renewal_creates
        self.lease_ttl = lease_ttl
        self.log: list[_Log] = []
        self._records: dict[str, StoredRegistration] = {}
        self._faults: dict[str, list[Fault]] = {}
        self._held: list[_Held] = []
        self._health_script: dict[str, list[HealthStatus]] = {}
        self._revoked = False
        self._handles = itertools.count(1)

    # ------------------------------------------------------------------ control

    def inject(self, operation: Operation, *faults: Fault) -> None:
        """Queue faults for the next calls of ``operation`` (one per call, in order)."""
        if operation not in _OPERATIONS:
            raise ValueError(f"unknown operation {operation!r}")
        self._faults.setdefault(operation, []).extend(faults)

    def pending_faults(self, operation: Operation) -> int:
        return len(self._faults.get(operation, ()))

    def set_health(self, instance_id: str, status: HealthStatus) -> None:
        """Set what checks report for a held instance (no effect if absent)."""
        stored = self._records.get(instance_id)
        if stored is not None:
            stored.health = status

    def script_health(self, instance_id: str, *statuses: HealthStatus) -> None:
        """Answer the next checks of ``instance_id`` with these statuses (flapping)."""
        self._health_script.setdefault(instance_id, []).extend(statuses)

    def expire(self, instance_id: str) -> None:
        """Drop the record as a lapsed lease would: renew -> LeaseLost, check -> MISSING."""
        self._records.pop(instance_id, None)

    def revoke_identity(self) -> None:
        """Every call raises IdentityRevoked until :meth:`restore_identity`."""
        self._revoked = True

    def restore_identity(self) -> None:
        self._revoked = False

    def land_held(self) -> int:
        """Apply every held write that waits for a trigger. Returns how many landed."""
        landed = [h for h in self._held if h.lands_at is None]
        self._held = [h for h in self._held if h.lands_at is not None]
        for held in landed:
            held.apply()
        return len(landed)

    def settle(self, now: float | None = None) -> None:
        """Apply held writes whose time has come and expire lapsed leases."""
        at = anyio.current_time() if now is None else now
        due = [h for h in self._held if h.lands_at is not None and h.lands_at <= at]
        if due:
            self._held = [h for h in self._held if h not in due]
            for held in due:
                held.apply()
        for instance_id, stored in list(self._records.items()):
            if stored.expires_at is not None and stored.expires_at <= at:
                del self._records[instance_id]

    # ---------------------------------------------------------------- inspection

    def held_writes(self) -> int:
        return len(self._held)

    def get(self, instance_id: str, *, now: float | None = None) -> StoredRegistration | None:
        self.settle(now)
        return self._records.get(instance_id)

    def instance_ids(self, *, now: float | None = None) -> tuple[str, ...]:
        self.settle(now)
        return tuple(sorted(self._records))

    def operations(self, operation: Operation | None = None) -> list[tuple[str, str]]:
        """(operation, outcome) pairs, in call order."""
        return [
            (entry.operation, entry.outcome)
            for entry in self.log
            if operation is None or entry.operation == operation
        ]

    # ------------------------------------------------------------------ surface

    async def register(self, record: RegistrationRecord, deadline: float) -> Registered:
        if self.idempotent_register:
            # Keyed by identity: the same record always gets the same handle.
            handle = f"id-{record.instance_id}"
        else:
            handle = f"lease-{next(self._handles)}"

        def write() -> None:
            self._records[record.instance_id] = StoredRegistration(
                record=record, handle=handle, expires_at=self._expiry()
            )

        await self._write("register", record.instance_id, deadline, write)
        return Registered(record=record, handle=handle)

    async def renew(self, registered: Registered, deadline: float) -> Registered:
        instance_id = registered.record.instance_id

        def write() -> None:
            stored = self._records.get(instance_id)
            if stored is None or stored.handle != registered.handle:
                if not self.idempotent_renewal:
                    # A non-idempotent renewal (a full heartbeat) re-creates.
                    self._records[instance_id] = StoredRegistration(
                        record=registered.record,
                        handle=registered.handle,
                        expires_at=self._expiry(),
                    )
                    return
                raise LeaseLost(f"{instance_id}: the registry no longer holds this lease")
            stored.renewals += 1
            stored.expires_at = self._expiry()

        await self._write("renew", instance_id, deadline, write)
        return registered

    async def check(self, registered: Registered, deadline: float) -> HealthStatus:
        instance_id = registered.record.instance_id
        await self._begin("check", instance_id, deadline)
        fault = self._next_fault("check")
        if fault is not None:
            if fault.kind is FaultKind.SLOW:
                await self._sleep(fault.delay or 0.0, deadline, "check", instance_id)
            elif fault.failure is not None:
                self._record("check", instance_id, type(fault.failure).__name__)
                raise fault.failure
            else:
                self._record("check", instance_id, "OutcomeUnknown")
                raise OutcomeUnknown("the health check's answer was lost")
        script = self._health_script.get(instance_id)
        stored = self._records.get(instance_id)
        if stored is None or stored.handle != registered.handle:
            status = HealthStatus.MISSING
        elif script:
            status = script.pop(0)
        else:
            status = stored.health
        self._record("check", instance_id, status.value)
        return status

    async def deregister(self, registered: Registered, deadline: float) -> None:
        instance_id = registered.record.instance_id

        def write() -> None:
            self._records.pop(instance_id, None)

        await self._write("deregister", instance_id, deadline, write)

    # ------------------------------------------------------------------ internals

    def _expiry(self) -> float | None:
        if self.lease_ttl is None:
            return None
        return anyio.current_time() + self.lease_ttl

    def _unknown(self, operation: Operation, message: str) -> OutcomeUnknown:
        if operation == "renew" and not self.renewal_creates:
            return RenewalOutcomeUnknown(message)
        return OutcomeUnknown(message)

    def _next_fault(self, operation: Operation) -> Fault | None:
        queue = self._faults.get(operation)
        return queue.pop(0) if queue else None

    def _record(self, operation: Operation, instance_id: str, outcome: str) -> None:
        self.log.append(_Log(operation, instance_id, outcome, anyio.current_time()))

    async def _begin(self, operation: Operation, instance_id: str, deadline: float) -> None:
        await anyio.lowlevel.checkpoint()
        self.settle()
        if anyio.current_time() >= deadline:
            self._record(operation, instance_id, "DeadlineExceeded")
            raise DeadlineExceeded(f"{operation}: the deadline had passed")
        if self._revoked:
            self._record(operation, instance_id, "IdentityRevoked")
            raise IdentityRevoked(f"{operation}: the connection's identity is revoked")

    async def _sleep(
        self, delay: float, deadline: float, operation: Operation, instance_id: str
    ) -> None:
        wake = anyio.current_time() + delay
        try:
            if wake > deadline:
                await anyio.sleep_until(deadline)
                self._record(operation, instance_id, "OutcomeUnknown")
                raise self._unknown(operation, f"{operation}: no answer before the deadline")
            await anyio.sleep_until(wake)
        except anyio.get_cancelled_exc_class():
            self._record(operation, instance_id, "cancelled")
            raise

    async def _write(
        self, operation: Operation, instance_id: str, deadline: float, write: Callable[[], None]
    ) -> None:
        await self._begin(operation, instance_id, deadline)
        fault = self._next_fault(operation)
        if fault is None:
            self._apply_now(operation, instance_id, write)
            return
        kind = fault.kind
        if kind is FaultKind.FAIL:
            assert fault.failure is not None
            self._record(operation, instance_id, type(fault.failure).__name__)
            raise fault.failure
        if kind is FaultKind.LOSE_ACK:
            self._apply_quietly(write)
            self._record(operation, instance_id, "OutcomeUnknown(applied)")
            raise self._unknown(operation, f"{operation}: the acknowledgement was lost")
        if kind is FaultKind.DROP:
            self._record(operation, instance_id, "OutcomeUnknown(dropped)")
            raise self._unknown(operation, f"{operation}: no answer")
        if kind is FaultKind.LAND_LATER:
            lands_at = None if fault.delay is None else anyio.current_time() + fault.delay
            self._held.append(_Held(operation, lambda: self._apply_quietly(write), lands_at))
            self._record(operation, instance_id, "OutcomeUnknown(held)")
            raise self._unknown(operation, f"{operation}: no answer yet")
        # SLOW: the write lands when the delay ends, whether or not the caller
        # is still waiting for the answer.
        assert fault.delay is not None
        lands_at = anyio.current_time() + fault.delay
        if lands_at > deadline:
            self._held.append(_Held(operation, lambda: self._apply_quietly(write), lands_at))
        await self._sleep(fault.delay, deadline, operation, instance_id)
        self._apply_now(operation, instance_id, write)

    def _apply_now(self, operation: Operation, instance_id: str, write: Callable[[], None]) -> None:
        try:
            write()
        except ProviderFailure as exc:
            self._record(operation, instance_id, type(exc).__name__)
            raise
        self._record(operation, instance_id, "ok")

    @staticmethod
    def _apply_quietly(write: Callable[[], None]) -> None:
        # A late write's failure (a renewal on a vanished lease) has nobody to
        # report to: it simply has no effect.
        with contextlib.suppress(ProviderFailure):
            write()

    def __repr__(self) -> str:
        return (
            f"<MemoryRegistry records={len(self._records)} held={len(self._held)} "
            f"revoked={self._revoked}>"
        )
