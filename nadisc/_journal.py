"""Renewal counts and state history of registrations, for the observer.

The registration runtime hands every state-machine event to
:meth:`RegistrationJournal.record` (synchronous, O(1) amortised: one
``derive_state`` and at most one append to a bounded ring). The observer
reads :meth:`RegistrationJournal.entry`. Nothing here decides anything:
it is bookkeeping for metrics and the console.

Counted as a renewal: an acknowledged renewal (``RenewAcked``). Counted as
a renewal failure: a renewal whose answer was lost (``RenewUnknown``),
refused (``RenewFailed``) or whose lease was gone (``RenewLeaseLost``).
The history keeps the last :data:`HISTORY` state changes as
``(event-loop time, state)``; a change caused only by the passage of time
(health evidence running out) is recorded at the next event.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from . import _registration_state as sm
from ._registration_state import RegistrationState

__all__ = ["HISTORY", "JournalEntry", "RegistrationJournal"]

#: State changes kept per registration.
HISTORY = 32

_RENEWED = (sm.RenewAcked,)
_RENEW_FAILED = (sm.RenewUnknown, sm.RenewFailed, sm.RenewLeaseLost)


@dataclass(slots=True)
class JournalEntry:
    """The mutable record of one registration (read through the observer)."""

    renewals: int = 0
    renewal_failures: int = 0
    history: deque[tuple[float, RegistrationState]] = field(
        default_factory=lambda: deque(maxlen=HISTORY)
    )


class RegistrationJournal:
    """Per registration name: renewal counters and the recent state changes."""

    __slots__ = ("_entries",)

    def __init__(self) -> None:
        self._entries: dict[str, JournalEntry] = {}

    def record(self, name: str, event: object, records: sm.RegistrationRecords, now: float) -> None:
        entry = self._entries.get(name)
        if entry is None:
            entry = self._entries[name] = JournalEntry()
        if isinstance(event, _RENEWED):
            entry.renewals += 1
        elif isinstance(event, _RENEW_FAILED):
            entry.renewal_failures += 1
        state = sm.derive_state(records, now)
        history = entry.history
        if not history or history[-1][1] is not state:
            history.append((now, state))

    def entry(self, name: str) -> JournalEntry | None:
        return self._entries.get(name)

    def __repr__(self) -> str:
        return f"<RegistrationJournal registrations={len(self._entries)}>"
