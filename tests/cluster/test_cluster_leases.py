"""The holder's lease table alone: grants, releases by the right peer only or by a READ's
completion notification, expiry by a deadline (a fake clock, with no reaper thread racing
the test's own expire calls; and the reaper thread with the real clock), a bound on live
leases, ids that cannot be guessed."""

from __future__ import annotations

import itertools
import threading

from tierkv.cluster.leases import LeaseTable
from tierkv.cluster.transport import Served


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def table(
    ttl: float = 5.0, clock: Clock | None = None, max_leases: int = 8
) -> tuple[LeaseTable, list[Served]]:
    released: list[Served] = []
    t = LeaseTable(released.append, ttl, max_leases, clock or Clock())
    return t, released


def test_a_lease_ends_once_and_only_for_its_peer() -> None:
    t, released = table()
    served = Served([None], [b""])
    lease = t.grant("reader-a", served, 1)
    assert lease is not None and t.live() == 1
    assert t.end(lease.id, "reader-b") == 0 and released == []  # another peer's: refused
    assert t.end(lease.id + 1, "reader-a") == 0  # unknown
    assert t.end(lease.id, "reader-a") == 1 and released == [served]
    assert t.end(lease.id, "reader-a") == 0 and released == [served]  # not twice
    assert t.stats() == {
        "live": 0,
        "granted": 1,
        "released": 1,
        "notified": 0,
        "expired": 0,
        "refused": 0,
    }


def test_leases_expire_in_deadline_order() -> None:
    clock = Clock()
    t, released = table(5.0, clock)
    first = Served([None], [b""])
    t.grant("r", first, 1)
    clock.now += 3
    second = Served([None], [b""])
    late = t.grant("r", second, 1)
    assert late is not None
    clock.now += 2.5  # the first passed its deadline, the second not
    assert t.expire() == 1 and released == [first]
    assert t.end(late.id, "r") == 1 and released == [first, second]
    t.close()


def test_the_reaper_drops_an_expired_lease_without_any_traffic() -> None:
    done = threading.Event()
    t = LeaseTable(lambda served: done.set(), 0.05).start()
    t.grant("r", Served([None], [b""]), 1)
    assert done.wait(20.0)  # a liveness bound
    assert t.stats()["expired"] == 1 and t.live() == 0
    t.close()


def test_live_leases_are_bounded_and_close_releases_them_all() -> None:
    t, released = table(max_leases=2)
    assert t.grant("r", Served([None], [b""]), 1) is not None
    assert t.grant("r", Served([None], [b""]), 1) is not None
    assert t.grant("r", Served([None], [b""]), 1) is None  # the caller releases it itself
    assert t.stats()["refused"] == 1
    t.close()
    assert len(released) == 2 and t.live() == 0
    assert t.grant("r", Served([None], [b""]), 1) is None  # closed


def test_a_completed_reads_notification_ends_its_lease_once() -> None:
    arrived: list[int] = []
    released: list[Served] = []
    t = LeaseTable(released.append, 5.0, clock=Clock(), notifications=lambda: arrived[:])
    first, second = Served([], [], []), Served([], [], [])
    a, b = t.grant("reader-a", first, 1), t.grant("reader-b", second, 3)
    assert a is not None and b is not None
    assert t.poll() == 0 and released == []  # nothing arrived yet
    arrived[:] = [b.id, b.id + 1 if b.id + 1 != a.id else b.id + 2]  # b's, and an unknown id
    assert t.poll() == 1 and released == [second]
    assert t.poll() == 0 and released == [second]  # the same notification again: nothing
    assert t.end(b.id, "reader-b") == 0  # ended already
    assert t.live() == 1 and t.stats()["notified"] == 1


def test_a_failing_poll_leaves_the_leases_to_their_deadlines() -> None:
    def broken() -> list[int]:
        raise RuntimeError("agent closed")

    clock = Clock()
    t = LeaseTable(lambda served: None, 5.0, clock=clock, notifications=broken)
    assert t.grant("r", Served([], [], []), 1) is not None
    assert t.poll() == 0 and t.live() == 1
    clock.now += 6
    assert t.expire() == 1


def test_lease_ids_are_random_not_a_sequence() -> None:
    """A lease id is what a completion notification names: a peer must not guess another's."""
    t, _ = table(max_leases=200)
    ids = [lease.id for lease in (t.grant("r", Served([], [], []), 1) for _ in range(100)) if lease]
    assert len(set(ids)) == 100 and all(0 < i < 1 << 63 for i in ids)
    gaps = {b - a for a, b in itertools.pairwise(ids)}
    assert len(gaps) > 90  # consecutive grants are not a fixed step apart
