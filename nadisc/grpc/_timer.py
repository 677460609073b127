"""A one-shot timer with microsecond resolution that an event loop can wait on.

Both loops end their own timers on whole milliseconds (``epoll_wait`` takes
its timeout in milliseconds), which is far too coarse for a reader that waits
tens of microseconds for the rest of a burst (see ``receive_coalescing`` in
:mod:`nadisc.grpc._connection`). Linux's ``timerfd`` is a file descriptor
that becomes readable when its time is up, so trio's ``wait_readable`` and
asyncio's ``add_reader`` wait on it like on a socket.

Python 3.13 has ``os.timerfd_create``; before it, ``timerfd_create`` and
``timerfd_settime`` are called from the C library through ``ctypes``. Where
neither exists (macOS, Windows, a C library without them) or the kernel
refuses one (out of file descriptors), :func:`read_timer` gives ``None`` and
the reader waits on its socket as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

__all__ = ["ReadTimer", "one_cpu", "read_timer"]

_CLOCK_MONOTONIC = getattr(time, "CLOCK_MONOTONIC", 1)
# TFD_NONBLOCK and TFD_CLOEXEC have the values of O_NONBLOCK and O_CLOEXEC.
_FLAGS = getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


class _TimeSpec(ctypes.Structure):
    _fields_ = (("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long))


class _ITimerSpec(ctypes.Structure):
    _fields_ = (("it_interval", _TimeSpec), ("it_value", _TimeSpec))


_Arm = Callable[[int, int], None]


def _libc_calls() -> tuple[Callable[[], int], Callable[[], _Arm]] | None:
    """(create, a new arm) on the C library's timerfd, or ``None`` where it has none.

    Each timer gets an ``arm`` of its own (its own ``itimerspec``), so loops
    in several threads never share one.
    """
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        create_fd: Any = libc.timerfd_create
        settime: Any = libc.timerfd_settime
    except (OSError, AttributeError):
        return None
    create_fd.argtypes = (ctypes.c_int, ctypes.c_int)
    create_fd.restype = ctypes.c_int
    settime.argtypes = (
        ctypes.c_int,
        ctypes.c_int,
        ctypes.POINTER(_ITimerSpec),
        ctypes.c_void_p,
    )
    settime.restype = ctypes.c_int

    def create() -> int:
        fd = int(create_fd(_CLOCK_MONOTONIC, _FLAGS))
        if fd < 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno))
        return fd

    def new_arm() -> _Arm:
        spec = _ITimerSpec()
        spec_ref = ctypes.byref(spec)
        value = spec.it_value

        def arm(fd: int, ns: int) -> None:
            value.tv_sec, value.tv_nsec = divmod(ns, 1_000_000_000)
            if settime(fd, 0, spec_ref, None) < 0:
                errno = ctypes.get_errno()
                raise OSError(errno, os.strerror(errno))

        return arm

    return create, new_arm


def _os_calls() -> tuple[Callable[[], int], Callable[[], _Arm]] | None:
    """(create, a new arm) on ``os.timerfd_*`` (Python 3.13 and later, Linux)."""
    create_fd: Any = getattr(os, "timerfd_create", None)
    settime_ns: Any = getattr(os, "timerfd_settime_ns", None)
    if create_fd is None or settime_ns is None:
        return None
    flags = getattr(os, "TFD_NONBLOCK", 0) | getattr(os, "TFD_CLOEXEC", 0)

    def create() -> int:
        return int(create_fd(_CLOCK_MONOTONIC, flags=flags))

    def arm(fd: int, ns: int) -> None:
        settime_ns(fd, initial=ns)

    return create, lambda: arm


@functools.cache
def _calls() -> tuple[Callable[[], int], Callable[[], _Arm]] | None:
    """The platform's timerfd calls, looked up once, when a first timer is wanted
    (not at import: a process that never coalesces never loads the C library)."""
    return _os_calls() or _libc_calls()


class ReadTimer:
    """One timerfd: :meth:`arm` it, wait until :attr:`fd` is readable, :meth:`clear` it."""

    __slots__ = ("_arm", "fd")

    def __init__(self, fd: int, arm: _Arm) -> None:
        #: The descriptor; ``-1`` once closed.
        self.fd = fd
        self._arm = arm

    def arm(self, seconds: float) -> None:
        """Readable ``seconds`` from now (> 0). Arming again replaces the previous
        time and takes an expiry not yet read: the descriptor is not readable
        until the new time (the kernel's ``timerfd_settime``)."""
        self._arm(self.fd, max(1, round(seconds * 1e9)))

    def clear(self) -> None:
        """Take the expiry, so the descriptor is not readable until the next one."""
        with contextlib.suppress(BlockingIOError):
            os.read(self.fd, 8)

    def close(self) -> None:
        """Close the descriptor (safe to call twice)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


def read_timer() -> ReadTimer | None:
    """A new :class:`ReadTimer`, or ``None`` where the platform has none."""
    calls = _calls()
    if calls is None:
        return None
    create, new_arm = calls
    try:
        fd = create()
    except OSError:
        return None
    return ReadTimer(fd, new_arm())


def one_cpu() -> bool:
    """Whether this process may run on one CPU only (its affinity), where a
    sender on the same host shares that CPU with the reader."""
    affinity: Any = getattr(os, "sched_getaffinity", None)
    if affinity is None:
        return False
    try:
        return len(affinity(0)) <= 1
    except OSError:
        return False
