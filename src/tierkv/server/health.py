"""Liveness of a server's moving parts, for GET /healthcheck (Kubernetes probes).

Healthy means: the RPC loop is running and went round recently (it wakes at least every
50 ms, so a loop that has not for ``stall`` seconds is stuck in a handler), and the eviction
thread, which also expires crashed engines' locks, is alive.
"""

from __future__ import annotations

from typing import Protocol

STALL_S = 5.0


class _Loop(Protocol):
    def alive(self, stall: float) -> bool: ...


class _Thread(Protocol):
    def alive(self) -> bool: ...


class Health:
    def __init__(self, rpc: _Loop, eviction: _Thread, stall: float = STALL_S) -> None:
        self.rpc = rpc
        self.eviction = eviction
        self.stall = stall

    def checks(self) -> dict[str, bool]:
        """Each part's state; healthy when all are true."""
        return {"rpc_loop": self.rpc.alive(self.stall), "eviction": self.eviction.alive()}
