"""Affinity context: what a policy is told about the request it routes.

A :class:`~poise.Balance` passes a *context* to ``policy.pick``. There are
three ways to produce it:

========================  ==============================================
``context=None``          unit context: the policy gets ``None``
                          (round robin, power of two choices, ...)
``context=UseRequest()``  the whole request is the affinity key
``RequestContext(fn)``    ``fn(request)`` reads one stable field of a
                          structured request, e.g. ``attrgetter("user_id")``
========================  ==============================================

A projection only *reads* the field: the policy receives the very object the
request holds, nothing is copied. Any object with a ``project(request)``
method fits the :class:`ContextProjection` protocol.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

from ._errors import InvalidInput

__all__ = ["ContextProjection", "RequestContext", "UseRequest"]

Req_contra = TypeVar("Req_contra", contravariant=True)
Ctx_co = TypeVar("Ctx_co", covariant=True)
Req = TypeVar("Req")
Ctx = TypeVar("Ctx")


class ContextProjection(Protocol[Req_contra, Ctx_co]):
    """Maps a request to the affinity context a policy sees."""

    def project(self, request: Req_contra) -> Ctx_co: ...


class UseRequest:
    """The whole request is the affinity context."""

    __slots__ = ()

    def project(self, request: Req) -> Req:
        return request

    def __repr__(self) -> str:
        return "UseRequest()"


class RequestContext(Generic[Req, Ctx]):
    """The context is ``fn(request)``: one field read from a structured request."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[Req], Ctx]) -> None:
        if not callable(fn):
            raise InvalidInput(f"RequestContext needs a callable, got {type(fn).__name__}")
        self._fn = fn

    @property
    def fn(self) -> Callable[[Req], Ctx]:
        return self._fn

    def project(self, request: Req) -> Ctx:
        return self._fn(request)

    def __repr__(self) -> str:
        return f"RequestContext({self._fn!r})"
