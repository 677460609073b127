"""A unary-response call's outcome, got once and shared by every task awaiting it.

``grpc.aio`` lets one task await a call while others await its status or
metadata. The first of them gets the outcome (sends the call, reads its
answer); tasks that ask meanwhile wait for that one; later ones get it at
once. When the task getting it is cancelled, so is the call: the others
get the error ``abandoned()`` makes.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Generic, TypeVar

import anyio

from ._errors import RpcError

__all__ = ["Outcome"]

T = TypeVar("T")


class Outcome(Generic[T]):
    """The response (in a 1-tuple) or the error of one call, once it ended."""

    __slots__ = ("_settled", "busy", "value")

    def __init__(self) -> None:
        self.value: tuple[T] | RpcError | None = None
        #: A task is getting the outcome now.
        self.busy = False
        #: Made by the first task that waits for another's (most calls have one task).
        self._settled: anyio.Event | None = None

    async def get(
        self, produce: Callable[[], Awaitable[T]], abandoned: Callable[[], RpcError]
    ) -> T:
        """The response, or raise the error; ``produce()`` runs at most once at a time."""
        value = self.value
        if value is None and self.busy:
            if self._settled is None:
                self._settled = anyio.Event()
            await self._settled.wait()
            value = self.value
            if value is None:  # the task getting it was cancelled: so was the call
                value = self.value = abandoned()
        elif value is None:
            self.busy = True
            try:
                value = self.value = (await produce(),)
            except RpcError as exc:
                value = self.value = exc
            finally:
                self.busy = False
                if self._settled is not None:
                    self._settled.set()
        if isinstance(value, RpcError):
            raise value
        return value[0]
