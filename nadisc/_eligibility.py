"""Local eligibility: the host's own say on whether a registration may be advertised.

Eligibility is local and cheap to read: :meth:`Eligibility.is_eligible` is a
synchronous O(1) check of plain data at the time passed in. It never reads
an overall readiness that includes the registration's own result (that
would be a cycle: registration waits on readiness waits on registration).

Two sources:

* :meth:`Eligibility.channel` — a unique :class:`EligibilityController` the
  host keeps and refreshes with ``update(True, duration)``; ``duration`` is
  1 ms to 30 s. The grant lapses on its own, and closing the controller or
  dropping it (garbage collection, via a weakref finalizer) makes the
  channel ineligible at once and for good::

      controller, eligibility = Eligibility.channel()
      controller.update(True, 10.0)     # eligible for the next 10 s

* :meth:`Eligibility.from_check` — a synchronous callable evaluated on
  every read. It must not wait on the network or re-enter the owner, and it
  must include its own shutdown judgement. An exception or a non-bool
  answer counts as ineligible.

``Eligibility.always()`` is eligible until the registration quiesces; it is
meant for tests and hosts without a lifecycle of their own.

Errors. Misuse raises :class:`EligibilityError` at the call that misused it
(``update``, ``take_controller``, ``from_check``). Those calls happen on the
host's side of the seam, before or outside any registration plan, and one
source may feed several registrations, so the error cannot name a
registration or its config path; give the source a ``name`` (by convention
the ``eligibility_ref`` the config uses, e.g. ``"web"``) and the error names
it (``EligibilityError.source``). A registration that references a missing
or wrong eligibility fails when the plan is resolved or frozen, with a
:class:`~nadisc.RegistrationError` naming the registration and
``discovery.registrations.<name>.eligibility_ref``. Being ineligible is a
registration state, never an error.
"""

from __future__ import annotations

import logging
import math
import weakref
from collections.abc import Callable

import anyio

from ._errors import DiscoveryError

__all__ = ["Eligibility", "EligibilityController", "EligibilityError"]

logger = logging.getLogger(__name__)

MIN_DURATION = 0.001
MAX_DURATION = 30.0


class EligibilityError(DiscoveryError, ValueError):
    """Misuse of an eligibility channel (bad duration, second controller,
    update after close). ``source`` is the name given to the channel or
    check, if any (see the module docstring for why no registration is
    named)."""

    def __init__(self, message: str, *, source: str | None = None) -> None:
        super().__init__(f"eligibility {source!r}: {message}" if source else message)
        self.source = source
        self.detail = message


def _check_name(name: str | None) -> str | None:
    if name is not None and (not isinstance(name, str) or not name.strip()):
        raise EligibilityError(f"an eligibility name must be a non-empty string, got {name!r}")
    return name


class _ChannelState:
    """Shared by one controller and its eligibility; plain data plus a wake-up event."""

    __slots__ = (
        "__weakref__",
        "closed",
        "controller_taken",
        "eligible_until",
        "event",
        "name",
        "revision",
    )

    def __init__(self, name: str | None = None) -> None:
        self.name = name
        self.eligible_until: float | None = None
        self.closed = False
        self.controller_taken = False
        self.revision = 0
        self.event: anyio.Event | None = None

    def close(self) -> None:
        # Called from close() and from the GC finalizer: flag only, no event
        # set here, because a finalizer may run at an arbitrary point.
        self.closed = True
        self.eligible_until = None


def _close_state(state: _ChannelState) -> None:
    state.close()


class EligibilityController:
    """The unique writer of one eligibility channel. Not thread-safe; use it
    from the event loop that runs the registrations."""

    __slots__ = ("__weakref__", "_finalizer", "_state")

    def __init__(self, state: _ChannelState) -> None:
        self._state = state
        # Dropping the controller must make the channel ineligible at once.
        self._finalizer = weakref.finalize(self, _close_state, state)

    def update(self, eligible: bool, duration: float, *, now: float | None = None) -> None:
        """Grant (``eligible=True``) or withdraw eligibility for ``duration``
        seconds from ``now`` (default: the event loop's clock). ``duration``
        must be between 1 ms and 30 s."""
        state = self._state
        source = state.name
        if not isinstance(eligible, bool):
            raise EligibilityError("eligible must be a bool", source=source)
        if isinstance(duration, bool) or not isinstance(duration, int | float):
            raise EligibilityError("duration must be a number of seconds", source=source)
        if not (math.isfinite(duration) and MIN_DURATION <= duration <= MAX_DURATION):
            raise EligibilityError(
                f"duration {duration!r} s is outside {MIN_DURATION} s to {MAX_DURATION} s",
                source=source,
            )
        if state.closed:
            raise EligibilityError("the eligibility controller is closed", source=source)
        if now is None:
            try:
                at = anyio.current_time()
            except Exception as exc:  # no event loop running here
                raise EligibilityError(
                    "update() outside the event loop needs an explicit now=", source=source
                ) from exc
        else:
            at = now
        state.eligible_until = at + duration if eligible else None
        self._notify()

    def close(self) -> None:
        """Make the channel ineligible at once and for good. Idempotent."""
        if self._state.closed:
            return
        self._finalizer.detach()
        self._state.close()
        self._notify()

    @property
    def closed(self) -> bool:
        return self._state.closed

    def _notify(self) -> None:
        state = self._state
        state.revision += 1
        event, state.event = state.event, None
        if event is not None:
            event.set()

    def __repr__(self) -> str:
        named = f" name={self._state.name!r}" if self._state.name else ""
        return f"<EligibilityController{named} closed={self._state.closed}>"


class Eligibility:
    """Read side of local eligibility. See the module docstring."""

    __slots__ = ("_check", "_name", "_state")

    def __init__(
        self,
        *,
        _state: _ChannelState | None = None,
        _check: Callable[[], bool] | None = None,
        _name: str | None = None,
    ) -> None:
        if (_state is None) == (_check is None):
            raise EligibilityError(
                "use Eligibility.channel(), Eligibility.from_check() or Eligibility.always()"
            )
        self._state = _state
        self._check = _check
        self._name = _state.name if _state is not None else _name

    @classmethod
    def channel(cls, name: str | None = None) -> tuple[EligibilityController, Eligibility]:
        """A new channel: its unique controller and the eligibility it drives.
        ``name`` (optional) labels the channel in errors and reprs."""
        eligibility = cls(_state=_ChannelState(_check_name(name)))
        return eligibility.take_controller(), eligibility

    @classmethod
    def from_check(cls, check: Callable[[], bool], *, name: str | None = None) -> Eligibility:
        """Eligibility decided by a synchronous ``check()`` on every read.
        ``name`` (optional) labels it in errors and reprs."""
        label = _check_name(name)
        if not callable(check):
            raise EligibilityError("from_check needs a callable", source=label)
        return cls(_check=check, _name=label)

    @property
    def name(self) -> str | None:
        """The label given at creation, if any."""
        return self._name

    @classmethod
    def always(cls) -> Eligibility:
        """Always eligible (the registration still stops at quiesce)."""
        return cls(_check=_always)

    def take_controller(self) -> EligibilityController:
        """The channel's controller. A channel has exactly one: asking twice
        (or asking a check-based eligibility) raises :class:`EligibilityError`."""
        state = self._state
        if state is None:
            raise EligibilityError("a check-based eligibility has no controller", source=self._name)
        if state.controller_taken:
            raise EligibilityError(
                "this eligibility channel already has its controller", source=state.name
            )
        state.controller_taken = True
        return EligibilityController(state)

    def is_eligible(self, now: float) -> bool:
        """Whether the registration may be advertised at ``now``. O(1) for a
        channel; for a check, the cost of the check."""
        state = self._state
        if state is not None:
            until = state.eligible_until
            return not state.closed and until is not None and now < until
        assert self._check is not None
        try:
            answer = self._check()
        except Exception:
            logger.warning(
                "eligibility check %s raised; treating as ineligible",
                repr(self._name) if self._name else "(unnamed)",
                exc_info=True,
            )
            return False
        if answer is not True and answer is not False:
            logger.warning(
                "eligibility check %s returned a non-bool; treating as ineligible",
                repr(self._name) if self._name else "(unnamed)",
            )
            return False
        return answer

    @property
    def revision(self) -> int:
        """Counts explicit updates of a channel (0 for checks)."""
        return 0 if self._state is None else self._state.revision

    async def changed(self) -> None:
        """Wait for the next explicit update or close of a channel.

        A lapse is not an event (read :meth:`is_eligible` with the time), and
        a check-based eligibility never signals: callers poll it. Always a
        checkpoint.
        """
        state = self._state
        if state is None:
            await anyio.sleep_forever()
            return
        if state.event is None:
            state.event = anyio.Event()
        await state.event.wait()

    def __repr__(self) -> str:
        named = f" name={self._name!r}" if self._name else ""
        if self._state is None:
            return f"<Eligibility check{named}>"
        return (
            f"<Eligibility channel{named} closed={self._state.closed} "
            f"revision={self._state.revision}>"
        )


def _always() -> bool:
    return True
