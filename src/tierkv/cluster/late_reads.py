"""READs given up at their deadline, whose bytes may still land: their destination slots
stay fenced in the reader's pool until the transfer has ended.

A reader gives up a NIXL READ at its own deadline (a stopped or slow holder, a slow link)
and reports a miss at once, but NIXL cannot stop the transfer: releasing its handle does not
(over UCX's TCP transport a READ given up after 10 ms went on writing 44 of its 48 MiB into
the reader's slots). The prefetcher frees the slots of a miss, the pool hands them to other
chunks, and a late READ would overwrite those, committed and verified already, with the
holder's bytes of that moment (its lease may have expired, its slot reused). So a given-up
READ's slots are fenced (:meth:`tierkv.index.ObjectIndex.fence`: freed, they stay
allocated), the transfer is polled until it ends, and then the handle is released and the
fence lifted. A READ that NIXL reports failed (ERR) may have ended on its first failed
request with others still running: its slots stay fenced :attr:`LateReads.grace` seconds
more. A holder that never answers again keeps its READ's slots fenced for as long (a
warning names it each :data:`WARN_EVERY` seconds); that is a few MiB of pool, never a wrong
chunk.

While a slot is fenced the transport fetches nothing into it (:meth:`LateReads.holds`): a
retry from another holder would have its verified bytes overwritten by the late ones. A
holder's agent is unloaded only once its given-up READs have ended (a handle whose remote
agent is gone is not polled safely).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tierkv.cluster.nixl_agent import DONE, PROC

log = logging.getLogger(__name__)

POLL_SECONDS = 0.01  # how often a given-up READ is checked
WARN_EVERY = 60.0  # seconds between warnings about a READ that has not ended


class SlotFence(Protocol):
    """What keeps pool slots from reuse (:class:`tierkv.index.ObjectIndex`)."""

    def fence(self, offsets: Iterable[int]) -> None: ...

    def unfence(self, offsets: Iterable[int]) -> int: ...


class Transfers(Protocol):
    """What polls and releases a running READ (:class:`tierkv.cluster.nixl_agent.Agent`)."""

    def state(self, handle: Any) -> str: ...

    def release(self, handle: Any) -> None: ...


@dataclass
class _Late:
    handle: Any  # None once released (a failed READ waiting out the grace)
    addresses: list[int]
    holder: str  # the remote agent's name
    since: float
    until: float = float("inf")  # fenced until then, once the handle is released
    warned: float = 0.0
    fenced: bool = False  # the pool's index holds a fence on its slots


@dataclass
class LateFigures:
    given_up: int = 0  # READs given up at their deadline
    failed: int = 0  # READs NIXL reported failed
    landed: int = 0  # given-up READs that ended afterwards
    longest_s: float = 0.0  # the longest a given-up READ took to end
    slots_given_back: int = 0  # fenced slots given back to the pool once their READ ended


class LateReads:
    """The reader's given-up READs, polled by a thread of their own until they end."""

    def __init__(
        self,
        transfers: Transfers,
        base: int,
        fence: SlotFence | None,
        grace: float,
        poll: float = POLL_SECONDS,
    ) -> None:
        """``base``: the address of the pool's first byte (slot offsets are relative to
        it); ``fence``: the pool's index (None: nothing to fence, the addresses are only
        refused to fetches); ``grace``: how long a failed READ's slots stay fenced."""
        self.transfers = transfers
        self.base = base
        self.fence = fence
        self.grace = grace
        self.poll = poll
        self.figures = LateFigures()
        self._late: list[_Late] = []
        self._held: dict[int, int] = {}  # address -> how many pending READs write there
        self._removals: dict[str, Callable[[], None]] = {}  # holder agent -> unload it
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    # -- the reader's side -----------------------------------------------------------------
    def given_up(self, handle: Any, addresses: Sequence[int], holder: str) -> None:
        """A READ passed its deadline and still runs (``handle`` not released)."""
        self._hold(_Late(handle, list(addresses), holder, time.monotonic()), failed=False)

    def failed(self, addresses: Sequence[int], holder: str) -> None:
        """A READ ended in error (its handle released): fence its slots for the grace."""
        now = time.monotonic()
        self._hold(_Late(None, list(addresses), holder, now, now + self.grace), failed=True)

    def pending(self) -> bool:
        """Whether any given-up READ may still write somewhere (no lock: a hint)."""
        return bool(self._held)

    def holds(self, address: int) -> bool:
        """Whether a pending READ may still write at ``address`` (a slot's first byte)."""
        with self._cond:
            return address in self._held

    def unload_when_done(self, holder: str, unload: Callable[[], None]) -> None:
        """Unload a holder's agent now, or once its given-up READs have ended."""
        with self._cond:
            if any(late.holder == holder for late in self._late):
                self._removals[holder] = unload
                return
        unload()

    def keep_loaded(self, holder: str) -> None:
        """The holder's agent was loaded again: an unload still waiting is dropped."""
        with self._cond:
            self._removals.pop(holder, None)

    def stats(self) -> dict[str, object]:
        with self._cond:
            f = self.figures
            return {
                "pending": len(self._late),
                "fenced_slots": len(self._held),
                "given_up": f.given_up,
                "failed": f.failed,
                "landed": f.landed,
                "longest_s": round(f.longest_s, 3),
                "slots_given_back": f.slots_given_back,
            }

    def close(self) -> None:
        """Stop polling and release the handles (the pool is going away with the agent)."""
        with self._cond:
            self._closed = True
            late, self._late = self._late, []
            self._held.clear()
            self._cond.notify_all()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=5.0)
        for handle in [h for entry in late if (h := self._take_handle(entry)) is not None]:
            self.transfers.release(handle)

    # -- internals -------------------------------------------------------------------------
    def _hold(self, late: _Late, failed: bool) -> None:
        if self.fence is not None:
            try:
                self.fence.fence(a - self.base for a in late.addresses)
                late.fenced = True
            except ValueError as exc:  # a slot the pool took back already (an expired store)
                log.warning("the slots of a NIXL READ from %s not fenced: %s", late.holder, exc)
        with self._cond:
            if self._closed:
                closed = True
            else:
                closed = False
                self._late.append(late)
                for address in late.addresses:
                    self._held[address] = self._held.get(address, 0) + 1
                if failed:
                    self.figures.failed += 1
                else:
                    self.figures.given_up += 1
                if self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="tierkv-late-reads", daemon=True
                    )
                    self._thread.start()
                self._cond.notify_all()
        if closed:
            if late.handle is not None:
                self.transfers.release(late.handle)
            self._lift(late)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._late and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                pending = list(self._late)
            ended = [late for late in pending if self._ended(late)]
            if ended:
                self._end(ended)
            with self._cond:
                if self._closed:
                    return
                self._cond.wait(self.poll)

    def _ended(self, late: _Late) -> bool:
        """Whether a pending READ can write no more (polls a running one; no lock held)."""
        now = time.monotonic()
        if late.handle is not None:
            state = self.transfers.state(late.handle)
            if state == PROC:
                if now - max(late.since, late.warned) >= WARN_EVERY:
                    late.warned = now
                    log.warning(
                        "a NIXL READ from %s given up %.0f s ago has not ended: its %d "
                        "slots stay out of use",
                        late.holder,
                        now - late.since,
                        len(late.addresses),
                    )
                return False
            handle = self._take_handle(late)
            if handle is None:
                return False  # closed meanwhile: close() released it
            self.transfers.release(handle)
            late.until = now if state == DONE else now + self.grace
            with self._cond:
                f = self.figures
                f.landed += 1
                f.longest_s = max(f.longest_s, now - late.since)
            log.info(
                "a NIXL READ from %s given up %.2f s before ended (%s)",
                late.holder,
                now - late.since,
                state,
            )
        return now >= late.until

    def _take_handle(self, late: _Late) -> Any:
        """The READ's handle, taken once (whoever takes it releases it)."""
        with self._cond:
            handle, late.handle = late.handle, None
        return handle

    def _end(self, ended: list[_Late]) -> None:
        unloads: list[Callable[[], None]] = []
        with self._cond:
            gone = {id(late) for late in ended}
            self._late = [late for late in self._late if id(late) not in gone]
            for late in ended:
                for address in late.addresses:
                    left = self._held[address] - 1
                    if left:
                        self._held[address] = left
                    else:
                        del self._held[address]
            busy = {late.holder for late in self._late}
            for holder in [h for h in self._removals if h not in busy]:
                unloads.append(self._removals.pop(holder))
        for late in ended:
            self._lift(late)
        for unload in unloads:
            unload()

    def _lift(self, late: _Late) -> None:
        if self.fence is not None and late.fenced:
            given = self.fence.unfence(a - self.base for a in late.addresses)
            with self._cond:
                self.figures.slots_given_back += given


__all__ = ["LateFigures", "LateReads", "SlotFence", "Transfers"]
