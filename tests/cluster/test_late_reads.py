"""READs given up at their deadline (:mod:`tierkv.cluster.late_reads`), with a stand-in for
NIXL's transfers whose state the test sets, and a real index as the fence (the real NIXL
READs that land late: tests/cluster/test_cluster_nixl_processes.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tierkv.allocator import Allocator
from tierkv.cluster.late_reads import LateReads
from tierkv.cluster.nixl_agent import DONE, ERROR, PROC
from tierkv.index import ObjectIndex

BLOCK = 4096
BASE = 1 << 40  # the pool mapping's address
WRITER = 7


class Transfers:
    """NIXL's side: each handle's state, and every release (each must come once)."""

    def __init__(self) -> None:
        self.states: dict[int, str] = {}
        self.released: list[int] = []
        self.lock = threading.Lock()

    def state(self, handle: Any) -> str:
        with self.lock:
            assert handle not in self.released, "polled after its release"
            return self.states[handle]

    def release(self, handle: Any) -> None:
        with self.lock:
            assert handle not in self.released, "released twice"
            self.released.append(handle)


def wait_for(what: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def reserved(index: ObjectIndex, n: int) -> tuple[int, list[int]]:
    """A prefetcher's reservation of ``n`` slots: (lease id, their addresses)."""
    keys = [f"key-{i}".encode() for i in range(n)]
    res = index.reserve_write(keys, BLOCK, WRITER)
    return res.lease_id, [BASE + off for _, off, _ in res.slots]


def give_up(
    index: ObjectIndex, transfers: Transfers, late: LateReads, handle: int, n: int
) -> tuple[int, list[int]]:
    """A READ into ``n`` reserved slots, given up while it runs: (lease id, addresses)."""
    lease, addresses = reserved(index, n)
    transfers.states[handle] = PROC
    late.given_up(handle, addresses, "holder-a")
    return lease, addresses


@pytest.fixture
def parts() -> Iterator[tuple[ObjectIndex, Transfers, LateReads]]:
    index = ObjectIndex(Allocator(16 * BLOCK, BLOCK))
    transfers = Transfers()
    late = LateReads(transfers, BASE, index, grace=0.2, poll=0.002)
    yield index, transfers, late
    late.close()
    index.check()


def test_a_given_up_read_keeps_its_slots_until_it_ends(
    parts: tuple[ObjectIndex, Transfers, LateReads],
) -> None:
    index, transfers, late = parts
    lease, addresses = give_up(index, transfers, late, 1, 3)
    assert late.pending() and all(late.holds(a) for a in addresses)
    index.abort(lease, WRITER)  # the miss: the prefetcher gives the slots back
    assert index.stats().fenced_free == 3 and index.used == 3 * BLOCK
    time.sleep(0.05)  # polled meanwhile, still running
    assert late.pending() and transfers.released == []
    transfers.states[1] = DONE
    wait_for(lambda: not late.pending())
    assert transfers.released == [1] and index.used == 0
    stats = late.stats()
    assert (stats["given_up"], stats["landed"], stats["slots_given_back"]) == (1, 1, 3)
    assert not any(late.holds(a) for a in addresses)


def test_a_read_that_failed_keeps_its_slots_for_the_grace(
    parts: tuple[ObjectIndex, Transfers, LateReads],
) -> None:
    index, transfers, late = parts
    lease, addresses = reserved(index, 2)
    late.failed(addresses, "holder-a")  # its handle released already
    index.abort(lease, WRITER)
    assert index.stats().fenced_free == 2
    wait_for(lambda: not late.pending())
    assert index.used == 0 and late.stats()["failed"] == 1
    # A given-up READ that ends in error: its slots stay the grace more.
    patient = LateReads(transfers, BASE, index, grace=60.0, poll=0.002)
    lease, addresses = give_up(index, transfers, patient, 2, 1)
    index.abort(lease, WRITER)
    transfers.states[2] = ERROR
    wait_for(lambda: transfers.released == [2])
    assert patient.pending() and patient.holds(addresses[0])
    assert index.stats().fenced_free == 1
    patient.close()


def test_a_holders_agent_is_unloaded_once_its_reads_ended(
    parts: tuple[ObjectIndex, Transfers, LateReads],
) -> None:
    index, transfers, late = parts
    give_up(index, transfers, late, 1, 1)
    unloaded: list[str] = []
    late.unload_when_done("holder-b", lambda: unloaded.append("b"))  # nothing pending: now
    late.unload_when_done("holder-a", lambda: unloaded.append("a"))
    assert unloaded == ["b"]
    transfers.states[1] = DONE
    wait_for(lambda: unloaded == ["b", "a"])
    # Loaded again before its READs ended: the waiting unload is dropped.
    give_up(index, transfers, late, 2, 1)
    late.unload_when_done("holder-a", lambda: unloaded.append("a again"))
    late.keep_loaded("holder-a")
    transfers.states[2] = DONE
    wait_for(lambda: not late.pending())
    assert unloaded == ["b", "a"]


def test_close_releases_every_pending_handle_once(
    parts: tuple[ObjectIndex, Transfers, LateReads],
) -> None:
    index, transfers, late = parts
    give_up(index, transfers, late, 1, 1)
    transfers.states[1] = DONE  # may end while closing: released once either way
    late.close()
    assert transfers.released == [1]
    transfers.states[3] = PROC
    late.given_up(3, [], "holder-a")  # after close: released at once
    assert transfers.released == [1, 3]


def test_a_slot_the_pool_took_back_already_is_not_fenced(
    parts: tuple[ObjectIndex, Transfers, LateReads],
) -> None:
    """A READ that outlived its reservation (it expired): nothing to fence, the address is
    still refused to fetches until the READ ends."""
    index, transfers, late = parts
    transfers.states[1] = PROC
    late.given_up(1, [BASE + 3 * BLOCK], "holder-a")
    assert late.holds(BASE + 3 * BLOCK) and index.stats().fenced_free == 0
    transfers.states[1] = DONE
    wait_for(lambda: not late.pending())
    assert late.stats()["slots_given_back"] == 0
