"""The controller's state stays whole through running out of instance slots, re-syncs of a
live server, syncs that list a key twice, tier codes no server uses, and its sync figures
(:class:`ControllerService` and :class:`ControllerIndex`, unit by unit)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from tierkv.cluster import controller_messages as cm
from tierkv.cluster import messages as m
from tierkv.cluster.controller_directory import ControllerDirectory
from tierkv.controller import index as index_module
from tierkv.controller import service as service_module
from tierkv.controller.holders import SLOTS, NoFreeSlot
from tierkv.controller.index import ControllerIndex
from tierkv.controller.service import ControllerService
from tierkv.keys import KEY_SIZE

NS = b"N" * 16
ME = m.MemberInfo("s:1", "s:1", "s:2", 7)


def key(i: int) -> bytes:
    return NS + i.to_bytes(16, "little")


def take_every_slot(idx: ControllerIndex) -> None:
    """Leave no slot free (as 65,536 registered instances would)."""
    while idx.filter.free_slots:
        idx.filter.take_slot("filler")


@pytest.fixture
def service() -> Iterator[ControllerService]:
    s = ControllerService()
    yield s
    s.close()


def sync(
    s: ControllerService,
    seq: int,
    keys: list[bytes],
    tiers: bytes | None = None,
    part: int = 0,
    last: bool = True,
) -> cm.Ack:
    tiers = bytes(len(keys)) if tiers is None else tiers
    return s.on_sync(cm.SyncBatch(0, "s:1", 7, seq, part, last, b"".join(keys), tiers))


def holders(s: ControllerService, keys: list[bytes]) -> set[str]:
    located = s.on_resolve(m.Resolve(0, keys))
    assert isinstance(located, cm.Located)
    return {h.node_id for h in located.holders}


def test_an_index_out_of_slots_changes_nothing_and_never_retires_another_slot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A full report or a new instance's admit that finds no free slot raised after the
    holdings were stored with slot -1; dropping them then retired slot -1, i.e. the last
    slot, a live instance's: its keys were hidden from every lookup."""
    monkeypatch.setattr(index_module, "REBASE_MIN", 0)  # evictions re-extract at once
    idx = ControllerIndex()
    try:
        idx.add("a", [key(1), key(2), key(3)], 0)
        take_every_slot(idx)
        with pytest.raises(NoFreeSlot):
            idx.replace("a", [key(5)], 1)
        assert idx.lookup([key(1), key(2), key(5)])["a"].tolist() == [0, 0, -1]
        with pytest.raises(NoFreeSlot):
            idx.add("b", [key(4)], 0)
        assert idx.instances() == ["a"] and idx.lookup([key(4)]) == {}
        assert idx.drop("b") == 0
        assert idx.filter.owner[SLOTS - 1] == "filler"  # the last slot is still live
        # Evicting most keys re-extracts the rest under a new slot: only a clean-up, put off.
        assert idx.remove("a", [key(2), key(3)]) == 2
        assert idx.lookup([key(1), key(2)])["a"].tolist() == [0, -1]
    finally:
        idx.close()


def test_a_controller_out_of_slots_refuses_registrations_and_syncs_clearly(
    service: ControllerService,
) -> None:
    assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
    take_every_slot(service.index)
    ack = sync(service, 1, [key(1)])
    assert not ack.ok and "no free instance slot" in ack.reason
    assert service.counts["reports_refused"] == 1
    assert not service.on_heartbeat(cm.Heartbeat(0, "s:1", 7, 1)).known
    other = m.MemberInfo("s:2", "s:2", "s:3", 1)
    refused = service.on_register(cm.Register(0, other, []))
    assert isinstance(refused, m.Refused) and "no free instance slot" in refused.reason
    assert [r["instance"] for r in service.instances()] == ["s:1"]
    assert service.index.instances() == []
    assert service.index.filter.owner[SLOTS - 1] == "filler"


def test_a_re_registration_of_the_same_boot_keeps_its_entries_until_its_sync_ends(
    service: ControllerService,
) -> None:
    """A server re-syncing (after a refused report, an out-of-sequence heartbeat) registers
    again with the same boot: lookups keep using its previous table until the sync's last
    part swaps the new one in; meanwhile it has no sequence (reports refused, heartbeats
    unknown). A new boot drops the old entries at once."""
    assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
    assert sync(service, 1, [key(1), key(2)]).ok
    assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
    assert holders(service, [key(1)]) == {"s:1"} and service.index.size("s:1") == 2
    assert not service.on_heartbeat(cm.Heartbeat(0, "s:1", 7, 1)).known
    report = cm.Report(0, "s:1", 7, 0, key(9), bytes(1), b"")
    assert not service.on_report(report).ok  # no sequence until the sync ends
    assert sync(service, 1, [key(2)], part=0, last=False).ok
    assert holders(service, [key(1)]) == {"s:1"}  # still the previous table
    assert sync(service, 1, [key(3)], part=1, last=True).ok
    assert holders(service, [key(1)]) == set()
    assert holders(service, [key(2), key(3)]) == {"s:1"} and service.index.size("s:1") == 2
    assert service.on_heartbeat(cm.Heartbeat(0, "s:1", 7, 1)).known
    restarted = m.MemberInfo("s:1", "s:1", "s:2", 8)
    assert isinstance(service.on_register(cm.Register(0, restarted, [])), cm.Registered)
    assert holders(service, [key(2), key(3)]) == set() and service.index.size("s:1") == 0
    assert service.counts["restarts_noticed"] == 1


def test_a_sync_listing_a_key_twice_counts_it_once_with_the_tier_kept(
    service: ControllerService,
) -> None:
    """The per-namespace counts took a repeated key's first tier, the table kept another:
    an eviction then left a count of -1 that never cleared."""
    assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
    assert sync(service, 1, [key(1), key(1), key(2)], bytes([1, 0, 1])).ok
    (row,) = service.instances()
    tiers = list(row["keys_by_tier"].values())  # type: ignore[union-attr]
    assert row["keys_by_namespace"] == {NS.hex(): [*tiers, 0, 0]}
    assert sum(tiers) == 2
    evict = cm.Report(0, "s:1", 7, 2, b"", b"", key(1) + key(2))
    assert service.on_report(evict).ok
    (row,) = service.instances()
    assert row["keys"] == 0 and row["keys_by_namespace"] == {}
    assert service.stats()["namespaces"] == []


def test_tiers_no_server_uses_are_refused_with_a_clear_reason(
    service: ControllerService,
) -> None:
    """Where has 0 (pool) and 1 (disk); 2 and 3 fit the index's tier bits but nothing
    serves them, so reports and syncs carrying them are refused."""
    assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
    ack = sync(service, 1, [key(1)], bytes([2]))
    assert not ack.ok and "tier out of range" in ack.reason
    assert sync(service, 1, [key(1)], bytes([1])).ok
    ack = service.on_report(cm.Report(0, "s:1", 7, 2, key(2), bytes([3]), b""))
    assert not ack.ok and "tier out of range" in ack.reason
    assert service.counts["reports_refused"] == 2
    assert service.index.size("s:1") == 1 and holders(service, [key(2)]) == set()


def test_a_syncs_keys_received_are_counted_and_too_large_syncs_refused(
    service: ControllerService,
) -> None:
    """``sync_keys_received`` was the parts' cost (at least 64 KiB a part, 33 bytes a key)
    divided by 32; "sync too large" was not counted as a refusal."""
    service.max_sync_bytes = 2 * service_module.MIN_PART_BYTES
    assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
    assert sync(service, 1, [key(1), key(2), key(3)], part=0, last=False).ok
    assert service.instances()[0]["sync_keys_received"] == 3
    assert sync(service, 1, [key(4)], part=1, last=False).ok
    assert service.instances()[0]["sync_keys_received"] == 4
    ack = sync(service, 1, [key(5)], part=2, last=False)
    assert not ack.ok and ack.reason == "sync larger than max_sync_bytes"
    assert service.counts["reports_refused"] == 1
    assert service.instances()[0]["sync_keys_received"] == 0


def test_the_syncs_in_progress_are_bounded_together(
    service: ControllerService, caplog: pytest.LogCaptureFixture
) -> None:
    """Each sync's parts were bounded (8 GiB), not all of them together: servers restarting
    at once could each hold as much in the controller while they synced. A part past the
    bound of all syncs is refused (counted, deferred) and its sync dropped, freeing its
    room; the others go on and apply, and the deferred server syncs again."""
    service.max_sync_bytes = 4 * service_module.MIN_PART_BYTES
    others = [m.MemberInfo(f"s:{i}", f"s:{i}", f"s:{i + 1}", 7) for i in (3, 5)]
    for member in (ME, *others):
        assert isinstance(service.on_register(cm.Register(0, member, [])), cm.Registered)

    def part(instance: str, n: int, i: int, last: bool) -> cm.Ack:
        return service.on_sync(cm.SyncBatch(0, instance, 7, 1, i, last, key(n), bytes(1)))

    assert part("s:1", 1, 0, False).ok and part("s:3", 2, 0, False).ok
    assert part("s:3", 3, 1, False).ok and part("s:5", 4, 0, False).ok  # the bound: 4 parts
    deferred = part("s:5", 4, 1, False)
    assert not deferred.ok and "other servers" in deferred.reason
    assert part("s:5", 4, 0, False).ok and not part("s:5", 4, 1, False).ok  # again
    assert service.counts["syncs_deferred"] == 2
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "deferred" in warnings[0].getMessage()  # once a minute
    assert service.instances()[2]["sync_keys_received"] == 0  # its parts dropped
    assert part("s:1", 5, 1, True).ok  # applied: its room is free again
    assert service.index.size("s:1") == 2
    assert part("s:5", 4, 0, True).ok and service.index.size("s:5") == 1  # again, from 0
    assert part("s:3", 6, 2, True).ok and service.index.size("s:3") == 3


def test_a_re_registration_before_its_sync_ended_drops_the_kept_entries(
    service: ControllerService,
) -> None:
    """The entries kept for a same-boot re-sync were kept as long as its syncs failed (each
    Register refreshed the server's last sign of life): lookups named it for chunks it had
    evicted for as long as it lived. A second Register before the sync ended drops them."""
    assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
    assert sync(service, 1, [key(1), key(2)]).ok
    assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
    assert holders(service, [key(1)]) == {"s:1"}  # kept for the sync that follows
    assert not sync(service, 1, [key(2)], part=1).ok  # that sync fails (a part out of order)
    assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
    assert holders(service, [key(1), key(2)]) == set() and service.index.size("s:1") == 0
    assert sync(service, 1, [key(2)]).ok
    assert holders(service, [key(1)]) == set() and holders(service, [key(2)]) == {"s:1"}


def test_a_restart_refused_for_want_of_a_slot_drops_the_old_boots_entries(
    service: ControllerService,
) -> None:
    """A new boot refused at Register (no free instance slot) left the old boot's entries,
    whose chunks died with it, named in lookups; the refusal was counted nowhere."""
    assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
    assert sync(service, 1, [key(1)]).ok
    take_every_slot(service.index)
    restarted = m.MemberInfo("s:1", "s:1", "s:2", 8)
    refused = service.on_register(cm.Register(0, restarted, []))
    assert isinstance(refused, m.Refused) and "no free instance slot" in refused.reason
    assert holders(service, [key(1)]) == set() and service.instances() == []
    assert service.counts["registrations_refused"] == 1


def wire(
    directory: ControllerDirectory,
    service: ControllerService,
    before: Callable[[object], None] = lambda _msg: None,
) -> None:
    """The directory's calls answered by ``service``'s handlers (``before`` sees each
    message first), in the directory's thread."""
    handlers = service.handlers()

    def call(_addr: str, msg: object, timeout: float | None = None) -> object:
        before(msg)
        return handlers[type(msg)](msg)

    directory.client.call = call  # type: ignore[method-assign]


def test_a_failed_registration_is_tried_again_after_a_pause_not_at_once() -> None:
    """An exception while registering (listing what the node holds failed) left the retry
    time in the past: the directory sent Register in a tight loop (45,000 a second)."""
    service = ControllerService()
    failing = threading.Event()
    attempts: list[int] = []

    def held() -> list[tuple[bytes, m.Where]]:
        attempts.append(1)
        failing.set()
        raise RuntimeError("listing the disk tier failed")

    directory = ControllerDirectory("ctl:1", ME, "tok", 1.0, held, interval=10.0)
    wire(directory, service)
    try:
        directory.start()
        assert failing.wait(30)
        time.sleep(0.5)  # retried after min(1 s, interval): no second attempt yet
        assert len(attempts) == 1 and service.counts["registrations"] == 1
    finally:
        directory.close()
        service.close()


def test_a_server_waiting_for_its_sync_is_shown_syncing(service: ControllerService) -> None:
    """Registered again (same boot: a re-sync), a server whose first sync part had not come
    yet was shown as synced (the dashboard's "synced x1"; "x0" for a new one) while its
    entries were not current."""
    assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
    assert service.instances()[0]["syncing"]  # registered, nothing synced yet
    assert sync(service, 1, [key(1)]).ok
    assert not service.instances()[0]["syncing"]
    assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
    row = service.instances()[0]
    assert row["syncing"] and row["syncs"] == 0
    assert sync(service, 2, [key(1)], part=0, last=False).ok
    assert service.instances()[0]["syncing"]
    assert sync(service, 2, [key(2)], part=1, last=True).ok
    assert not service.instances()[0]["syncing"]


def test_a_server_whose_sync_is_deferred_registers_again_and_heartbeats_only_then() -> None:
    """A server whose sync was deferred (other servers' syncs held max_sync_bytes) sent its
    heartbeat all the same: the controller, with no sync of it to compare, counted it out of
    sequence and "asked it to re-sync", and the server logged that the controller did not
    know it ("restarted?"). It registers and syncs again after a pause, once there is room,
    and heartbeats once registered."""
    service = ControllerService(max_sync_bytes=2 * service_module.MIN_PART_BYTES)
    other = m.MemberInfo("s:3", "s:3", "s:4", 7)
    assert isinstance(service.on_register(cm.Register(0, other, [])), cm.Registered)
    assert service.on_sync(cm.SyncBatch(0, "s:3", 7, 1, 0, False, key(2), bytes(1))).ok
    sent: list[type] = []
    beat = threading.Event()

    def before(msg: object) -> None:
        sent.append(type(msg))
        if isinstance(msg, cm.Register) and sent.count(cm.Register) == 2:
            assert service.remove("s:3") == 0  # its sync's room is free
        if isinstance(msg, cm.Heartbeat):
            beat.set()

    directory = ControllerDirectory(
        "ctl:1", ME, "tok", 1.0, lambda: [(key(1), m.Where.POOL)], interval=10.0
    )
    wire(directory, service, before)
    try:
        directory.start()
        assert beat.wait(30)
        assert sent == [cm.Register, cm.SyncBatch, cm.Register, cm.SyncBatch, cm.Heartbeat]
        assert service.counts["syncs_deferred"] == 1
        assert service.counts["heartbeats_out_of_sequence"] == 0
        assert holders(service, [key(1)]) == {"s:1"}
        assert directory.failures.total_failures == 1
    finally:
        directory.close()
        service.close()


def test_a_sync_that_tells_its_size_is_deferred_at_its_start_or_ends(
    service: ControllerService,
) -> None:
    """One part refused for want of room dropped its sync whole, however far along (a sync
    95 parts into 99 lost to a newcomer's fifth part), and the deferred server's retry
    REGISTER dropped the entries it had kept for its re-sync, hiding a live server's
    chunks from every lookup. A sync that tells its size takes room for all of it at part
    0 or is deferred there; once started it ends; a deferred server keeps its entries."""
    n = service_module.MIN_PART_BYTES // (KEY_SIZE + 1) + 1  # keys of a part (past MIN)
    big = 3 * n  # a sync of three such parts
    service.max_sync_bytes = 5 * service_module.MIN_PART_BYTES
    other = m.MemberInfo("s:3", "s:3", "s:4", 7)

    def part(instance: str, seq: int, keys: list[bytes], i: int, last: bool, total: int) -> cm.Ack:
        return service.on_sync(
            cm.SyncBatch(0, instance, 7, seq, i, last, b"".join(keys), bytes(len(keys)), total)
        )

    def keys(first: int) -> list[bytes]:
        return [key(first + j) for j in range(n)]

    assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
    assert part("s:1", 1, [key(1)], 0, True, 1).ok  # synced: its entries are in
    assert isinstance(service.on_register(cm.Register(0, other, [])), cm.Registered)
    assert part("s:3", 1, keys(10_000), 0, False, big).ok  # room for all of it taken
    assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)  # re-sync
    deferred = part("s:1", 2, keys(20_000), 0, False, 2 * n)  # no room for another
    assert not deferred.ok and "other servers" in deferred.reason
    assert service.counts["syncs_deferred"] == 1
    assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)  # retries
    assert holders(service, [key(1)]) == {"s:1"}  # kept while deferred (were dropped)
    assert part("s:3", 1, keys(30_000), 1, False, big).ok  # the sync started ends
    assert part("s:3", 1, keys(40_000), 2, True, big).ok
    assert service.index.size("s:3") == big
    assert part("s:1", 2, keys(20_000), 0, False, 2 * n).ok  # room again
    assert part("s:1", 2, keys(50_000), 1, True, 2 * n).ok
    assert holders(service, [key(20_000), key(1)]) == {"s:1"} and service.index.size("s:1") == 2 * n
    # A sync whose parts hold more than it said is refused.
    assert isinstance(service.on_register(cm.Register(0, other, [])), cm.Registered)
    assert part("s:3", 2, [key(5)], 0, False, 1).ok
    liar = part("s:3", 2, keys(60_000), 1, True, 1)
    assert not liar.ok and "more than its total_keys" in liar.reason


def test_deferred_entries_are_kept_for_dead_after_and_room_is_given_back() -> None:
    """Kept across deferrals with no limit, a server deferred again and again (a peer whose
    syncs keep failing took the room at each of its first parts) stayed named for chunks it
    had evicted: they are kept for ``dead_after`` from its first deferral. The room a sync
    took goes back when its server registers again or is removed, and a sync whose parts
    cost exactly ``max_sync_bytes`` fits (its room was padded past the bound)."""
    now = [1000.0]
    service = ControllerService(dead_after=30.0, clock=lambda: now[0])
    n = service_module.MIN_PART_BYTES // (KEY_SIZE + 1) + 1
    service.max_sync_bytes = n * (KEY_SIZE + 1)  # one part's cost exactly
    other = m.MemberInfo("s:3", "s:3", "s:4", 7)

    def part(instance: str, seq: int, keys: list[bytes], last: bool, total: int) -> cm.Ack:
        return service.on_sync(
            cm.SyncBatch(0, instance, 7, seq, 0, last, b"".join(keys), bytes(len(keys)), total)
        )

    try:
        assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
        assert part("s:1", 1, [key(i) for i in range(n)], True, n).ok  # exactly the bound
        assert isinstance(service.on_register(cm.Register(0, other, [])), cm.Registered)
        assert part("s:3", 1, [key(10_000)], False, n).ok  # all the room
        for seconds in (0, 10, 29):
            now[0] = 1000.0 + seconds
            assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
            assert not part("s:1", 2, [key(1)], True, 1).ok  # deferred
            assert holders(service, [key(1)]) == {"s:1"}  # kept
        now[0] = 1031.0  # dead_after since its first deferral
        assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
        assert holders(service, [key(1)]) == set()  # no longer
        # s:3 registers again (its sync is over): its room is free.
        assert isinstance(service.on_register(cm.Register(0, other, [])), cm.Registered)
        assert part("s:1", 2, [key(1)], True, 1).ok
        assert part("s:3", 2, [key(10_000)], False, n).ok
        assert service.remove("s:3") is not None  # removed: its room is free
        assert isinstance(service.on_register(cm.Register(0, ME, [])), cm.Registered)
        assert part("s:1", 3, [key(2)], True, 1).ok
    finally:
        service.close()
