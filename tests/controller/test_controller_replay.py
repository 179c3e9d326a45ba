"""A live server's index in the controller survives replays and heals from late duplicates:

- a Register of the server captured on the wire (a relay between server and controller
  keeps a copy of every request) and played again is refused; the server's keys stay;
- a late duplicate Register (signed, never seen before: e.g. one that timed out and was
  retried, delivered after the retry) starts the server's sync over; the server's next
  heartbeat carries its sequence number, the controller's differs, and a full sync repairs
  the index at once, although the server stores nothing meanwhile;
- the controller's heartbeat answers, unit by unit (:class:`ControllerService`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest

from support.clusterkit import wait_for
from support.control_wire import Tap, raw_call
from support.controllers import ControllerProcess, ctl_call, start_server
from support.kvops import store, tokens_for
from support.servers import ServerProcess
from tierkv.cluster import controller_messages as cm
from tierkv.cluster import messages as m
from tierkv.controller import service as service_module
from tierkv.controller.service import LATENCY_BUCKETS, ControllerService
from tierkv.keys import KEY_SIZE

Factory = Callable[..., ServerProcess]
CHUNKS = 4


def keys_of(ctl: ControllerProcess, instance: str) -> int:
    return int(ctl.instances().get(instance, {}).get("keys", -1))


def syncs_applied(ctl: ControllerProcess) -> int:
    status = ctl.status()
    assert status is not None
    return int(status["syncs"])


@pytest.mark.processes
def test_a_replayed_register_of_a_live_server_is_refused(
    server_factory: Factory, controller: ControllerProcess
) -> None:
    tap = Tap(controller.addr)
    try:
        a = start_server(server_factory, tap.addr)
        wait_for(lambda: a.node_id in controller.instances())
        store(a, tokens_for(1, CHUNKS), CHUNKS)
        wait_for(lambda: keys_of(controller, a.node_id) == CHUNKS)
        (register, *_) = tap.requests(cm.request_decoder, cm.Register)
        before = controller.status()
        assert before is not None
        reply = raw_call(controller.addr, register, cm.reply_decoder)
        assert isinstance(reply, m.Refused) and "replayed" in reply.reason, reply
        after = controller.status()
        assert after is not None
        assert after["registrations"] == before["registrations"]
        assert keys_of(controller, a.node_id) == CHUNKS
        assert after["control"]["replayed"] == 1, after["control"]
    finally:
        tap.close()


@pytest.mark.processes
def test_a_late_duplicate_register_is_repaired_by_the_next_heartbeat(
    server_factory: Factory, controller: ControllerProcess
) -> None:
    a = start_server(server_factory, controller.addr)
    wait_for(lambda: a.node_id in controller.instances())
    keys = store(a, tokens_for(2, CHUNKS), CHUNKS)
    wait_for(lambda: keys_of(controller, a.node_id) == CHUNKS)
    located = ctl_call(controller.addr, m.Resolve(0, keys))
    assert isinstance(located, cm.Located)
    (me,) = located.holders
    syncs = syncs_applied(controller)
    # The same server's registration again, arriving late: its sequence is reset.
    assert isinstance(ctl_call(controller.addr, cm.Register(0, me, [])), cm.Registered)
    # The server stores nothing more: only its heartbeat can tell the difference.
    wait_for(lambda: syncs_applied(controller) > syncs)
    wait_for(lambda: keys_of(controller, a.node_id) == CHUNKS)
    assert controller.holders(keys) == [{a.node_id}] * CHUNKS
    status = controller.status()
    assert status is not None and status["heartbeats_out_of_sequence"] >= 1


def test_heartbeats_are_known_only_at_the_controllers_sequence() -> None:
    service = ControllerService()
    try:
        me = m.MemberInfo("s:1", "s:1", "s:2", 7)

        def beat(seq: int, boot: int = 7) -> bool:
            reply = service.on_heartbeat(cm.Heartbeat(0, "s:1", boot, seq))
            return reply.known

        def sync(seq: int, n: int, part: int = 0, last: bool = True) -> bool:
            keys = b"".join(bytes([i + 1]) * KEY_SIZE for i in range(n))
            ack = service.on_sync(cm.SyncBatch(0, "s:1", 7, seq, part, last, keys, bytes(n)))
            return ack.ok

        assert isinstance(service.on_register(cm.Register(0, me, [])), cm.Registered)
        assert not beat(0)  # registered, not synced yet: no sequence matches
        assert sync(5, 3) and beat(5) and not beat(4) and not beat(6) and not beat(5, boot=8)
        report = cm.Report(0, "s:1", 7, 6, bytes([9]) * KEY_SIZE, bytes(1), b"")
        assert service.on_report(report).ok and beat(6) and not beat(5)
        assert service.index.size("s:1") == 4
        # A duplicate registration of the same boot starts a sync over: out of sequence (its
        # entries are kept for lookups until the sync's last part replaces them).
        assert isinstance(service.on_register(cm.Register(0, me, [])), cm.Registered)
        assert service.index.size("s:1") == 4 and not beat(6)
        # A full sync left unfinished is not "known" either; a finished one is.
        assert sync(6, 2, part=0, last=False) and not beat(6)
        assert sync(6, 2, part=1, last=True) and beat(6)
        assert service.counts["heartbeats_out_of_sequence"] == 6
    finally:
        service.close()


def test_lookup_times_take_a_fixed_room_whether_or_not_anything_scrapes() -> None:
    """Every resolve and router lookup is timed into a histogram of fixed size (it used to
    be a list only a Prometheus scrape emptied: without a scraper, it grew for ever)."""
    service = ControllerService()
    try:
        for _ in range(5000):
            service.on_resolve(m.Resolve(0, [bytes(KEY_SIZE)]))
        counts, total = service.lookup_seconds.snapshot()
        assert sum(counts) == 5000 and total > 0
        assert len(counts) == len(LATENCY_BUCKETS) + 1
        service.on_resolve(m.Resolve(0, [bytes(KEY_SIZE)]))
        assert sum(service.lookup_seconds.snapshot()[0]) == 5001  # reading drains nothing
    finally:
        service.close()


def test_a_server_that_registers_again_while_it_is_reaped_keeps_its_new_entries() -> None:
    """The reaper deregisters a silent server; the server (alive after all) registers
    again and syncs at that moment: its fresh entries must survive the reaper's drop."""
    now = [0.0]
    service = ControllerService(clock=lambda: now[0])
    me = m.MemberInfo("s:1", "s:1", "s:2", 7)
    keys = b"".join(bytes([i + 1]) * KEY_SIZE for i in range(3))
    try:
        assert isinstance(service.on_register(cm.Register(0, me, [])), cm.Registered)
        assert service.on_sync(cm.SyncBatch(0, "s:1", 7, 1, 0, True, keys, bytes(3))).ok
        now[0] += service.dead_after + 1
        drop = service.index.drop
        synced = threading.Event()

        def again() -> None:  # the server's re-registration and full sync
            service.on_register(cm.Register(0, me, []))
            service.on_sync(cm.SyncBatch(0, "s:1", 7, 2, 0, True, keys, bytes(3)))
            synced.set()

        def slow_drop(instance: str) -> int:
            threading.Thread(target=again, daemon=True).start()
            synced.wait(0.5)  # long enough for it, were it not kept out until the reap ends
            return drop(instance)

        service.index.drop = slow_drop  # type: ignore[method-assign]
        assert service.reap() == ["s:1"]
        service.index.drop = drop  # type: ignore[method-assign]
        assert synced.wait(10)
        assert service.index.size("s:1") == 3
        assert service.on_heartbeat(cm.Heartbeat(0, "s:1", 7, 2)).known
    finally:
        service.close()


def test_a_sync_cannot_pile_up_empty_or_tiny_parts() -> None:
    """A sync's parts are collected until its last one; an authenticated but broken server
    sending parts that hold nothing (or next to nothing) for ever made the collection grow
    without bound. Only the last part may be empty, and every part costs at least
    MIN_PART_BYTES against the sync's limit."""
    service = ControllerService(max_sync_bytes=100 * service_module.MIN_PART_BYTES)
    me = m.MemberInfo("s:1", "s:1", "s:2", 7)
    try:
        assert isinstance(service.on_register(cm.Register(0, me, [])), cm.Registered)

        def part(seq: int, n: int, i: int, last: bool, first: int = 1) -> cm.Ack:
            keys = b"".join(bytes([first + j]) * KEY_SIZE for j in range(n))
            return service.on_sync(cm.SyncBatch(0, "s:1", 7, seq, i, last, keys, bytes(n)))

        assert not part(1, 0, 0, False).ok  # empty, not the last: refused
        assert part(1, 0, 0, True).ok  # a server that holds nothing
        acks = [part(2, 1, i, False).ok for i in range(101)]
        assert acks[:100] == [True] * 100 and not acks[100]  # one key a part: 100 at most
        assert service.on_heartbeat(cm.Heartbeat(0, "s:1", 7, 1)).known  # the last sync holds
        assert part(3, 2, 0, False).ok and part(3, 1, 1, True, first=9).ok  # a fresh sync
        assert service.index.size("s:1") == 3
    finally:
        service.close()
