"""Engines first: a server's HTTP work for routers and operators (``POST /lookup``,
``GET /quota``) steps aside while an engine's request is in flight.

The RPC loop and the HTTP server share one process and so one GIL, and the GIL knows no
priorities: 50 routers sending lookups back to back keep uvicorn's event loop and its
worker threads running Python all the time, and an engine's LOOKUP, which takes the GIL
several times on its way (the loop's receive, a worker, the loop's send), waits behind
them each time. A short switch interval (:func:`tierkv.priority.sharing_the_gil`) bounds
each wait but not their number. So the RPC loop counts the engine requests it has taken
and not yet answered (:meth:`EngineFirst.started` / :meth:`EngineFirst.finished`, both on
the loop's thread: a plain int), and HTTP work calls :meth:`EngineFirst.wait_turn` at its
check points (before each request reaches the app, between the steps of a router lookup,
between tenants of a quota listing): while a request is in flight it waits, without the
GIL, until the last one is answered. The wait is bounded (:data:`MAX_WAIT` each time), so
engines that are never idle slow the routers down but never stop them; HTTP work that
is already between two check points runs on (for at most one switch interval at a time).

Only servers have engines: the controller's HTTP has no gate.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

MAX_WAIT = 0.01  # seconds a check point waits at most for the engines' requests


class EngineFirst:
    """The engine requests in flight in one server's RPC loop, and the wait for them."""

    def __init__(self, max_wait: float = MAX_WAIT) -> None:
        self.max_wait = max_wait
        self.in_flight = 0  # changed on the RPC loop's thread only
        self.waits = 0  # check points that found a request in flight (status, tests)
        self._idle = threading.Event()
        self._idle.set()

    def started(self) -> None:
        """The RPC loop took an engine's request."""
        self.in_flight += 1
        if self.in_flight == 1:
            self._idle.clear()

    def finished(self) -> None:
        """The RPC loop answered (or dropped) an engine's request."""
        self.in_flight -= 1
        if not self.in_flight:
            self._idle.set()

    def wait_turn(self) -> None:
        """A check point of HTTP work: wait (without the GIL) while an engine's request is
        in flight, at most :attr:`max_wait`. Costs an attribute read when none is."""
        if self.in_flight:
            self.waits += 1
            self._idle.wait(self.max_wait)


def no_gate() -> None:
    """The check point where there are no engines (the controller)."""


class EnginesFirstMiddleware:
    """Pure ASGI: each HTTP request waits its turn (``wait_turn``) before the app sees it.
    The wait blocks uvicorn's event loop on purpose: while an engine's request is in
    flight, no other HTTP Python runs on that thread either."""

    def __init__(self, app: ASGIApp, wait_turn: Callable[[], None]) -> None:
        self.app = app
        self.wait_turn = wait_turn

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.wait_turn()
        await self.app(scope, receive, send)
