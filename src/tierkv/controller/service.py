"""The controller's state and request handlers: registered servers, their liveness, their
reports applied to the index (:mod:`tierkv.controller.index`), and lookups.

- Register: a server names itself (``MemberInfo``: id, data address, boot token) and its
  namespaces. A new boot token of a known instance (it restarted between two heartbeats)
  drops the old boot's entries at once; the same boot again (a server re-syncing after a
  refused report or heartbeat) keeps them for lookups until its sync's last part replaces
  them, and only starts it over (no sequence, no parts). Refused while no instance slot is
  free (:class:`~tierkv.controller.holders.NoFreeSlot`: the sync could not be applied).
- Heartbeat: refreshes the server's last-seen time; the reply carries the controller's boot
  token and whether it knows this boot of the server *at the sequence number the heartbeat
  carries* (if not: register and full sync at once). A server sends its reports, syncs and
  heartbeats from one thread, each after the previous one's answer, so a heartbeat's
  sequence is exactly the last one the controller applied; any difference means the
  controller's entries for it are not what the server holds (e.g. a late duplicate Register
  started a sync over), and only a full sync repairs that. A registration not yet followed
  by its full sync has no sequence (:data:`UNSYNCED`), so it never matches.
- Report: admits and evicts with a sequence number; applied only in order and after the
  registration's full sync (a gap, an unknown boot, or no sync yet is refused and the
  server re-syncs). Reports come from one sender thread
  per server and each waits for its answer, so order on the wire is order of events.
- SyncBatch: a full sync in parts; parts are collected aside and the last one swaps the
  instance's table in (one bulk build). Lookups see the previous table meanwhile; reports
  that follow the sync apply on top (the server sends them after its last part).
- A server not heard from for ``dead_after`` seconds is deregistered (its entries dropped
  in bulk) by the reaper thread; a clean shutdown deregisters at once; an operator can
  remove one (the dashboard's remove, :meth:`ControllerService.remove`): a server still
  alive learns it from its next heartbeat, registers again and re-syncs.
- Registrations, restarts, syncs and deregistrations are kept as recent activity (the last
  :data:`ACTIVITY` events) for the dashboard.
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from tierkv.cluster import controller_messages as cm
from tierkv.cluster import found_columns, router_lookup
from tierkv.cluster import messages as m
from tierkv.controller.holders import NoFreeSlot
from tierkv.controller.index import ControllerIndex
from tierkv.controller.keytable import TIERS
from tierkv.keys import KEY_SIZE
from tierkv.logs import FailureLog

log = logging.getLogger(__name__)

MAX_SYNC_BYTES = 8 * 2**30  # the syncs' parts collected at most, all servers together
# What a part costs at least against max_sync_bytes, whatever it holds (a server sends parts
# of 65,536 keys, 2 MiB): parts of a few keys each cannot pile up by the million.
MIN_PART_BYTES = 64 * 2**10
ACTIVITY = 50  # recent events kept for the dashboard
UNSYNCED = -1  # the sequence of a registration whose full sync has not ended
# Tier codes a report or sync may carry: Where's (0 pool, 1 disk). The index has room for
# more (keytable.TIERS) but nothing reads them: the dashboard and POST /lookup would count
# keys no server can serve.
WHERE_CODES = len(m.Where)


LATENCY_BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 5e-3, 1e-2, 5e-2, 0.1, 0.5, 1.0)


class LookupLatency:
    """How long lookups took, as a histogram's bucket counts and sum: a fixed size however
    many lookups come and whether or not anything scrapes it. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = [0] * (len(LATENCY_BUCKETS) + 1)  # the last one: +Inf
        self._sum = 0.0

    def observe(self, seconds: float) -> None:
        i = bisect_left(LATENCY_BUCKETS, seconds)
        with self._lock:
            self._counts[i] += 1
            self._sum += seconds

    def snapshot(self) -> tuple[list[int], float]:
        """(count per bucket, not cumulative; the sum of the seconds)."""
        with self._lock:
            return list(self._counts), self._sum


@dataclass
class Instance:
    member: m.MemberInfo
    namespaces: list[cm.NamespaceInfo]
    registered_at: float
    last_seen: float
    seq: int = UNSYNCED  # last report or sync applied
    sync_parts: list[tuple[bytes, bytes]] = field(default_factory=list)
    sync_bytes: int = 0  # what the parts cost against max_sync_bytes (not their keys)
    sync_reserved: int = 0  # the room its sync took (its whole size, when told)
    # When its sync was first deferred for want of room (None: not deferred) since it last
    # synced: its entries are kept through its registrations meanwhile, for dead_after.
    deferred_since: float | None = None
    sync_keys: int = 0  # keys in the parts collected
    syncs: int = 0
    reports: int = 0


class ControllerService:
    """Everything the controller knows; handlers run on the control server's thread."""

    def __init__(
        self,
        dead_after: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
        max_sync_bytes: int = MAX_SYNC_BYTES,
    ) -> None:
        """``max_sync_bytes``: what the full syncs in progress may hold together (each
        collects its parts until its last one, then replaces its server's entries at once):
        a part past it is refused and its server syncs again later, from the start."""
        self.boot = time.time_ns()
        self.dead_after = dead_after
        self.max_sync_bytes = max_sync_bytes
        self._reserved = 0  # the room all syncs in progress took together
        # Syncs deferred for want of room: a WARNING once a minute at most (servers retry
        # each second), one line when syncs are applied again.
        self._deferrals = FailureLog("controller: full syncs", log)
        self.clock = clock
        self.index = ControllerIndex()
        self._instances: dict[str, Instance] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.counts: dict[str, int] = {
            "registrations": 0,
            "registrations_refused": 0,
            "restarts_noticed": 0,
            "heartbeats": 0,
            "heartbeats_out_of_sequence": 0,
            "admits": 0,
            "evicts": 0,
            "reports": 0,
            "reports_refused": 0,
            "syncs": 0,
            "sync_parts": 0,
            "syncs_deferred": 0,  # refused for want of room: other servers' syncs held it
            "lookups": 0,
            "lookup_keys": 0,
            "router_lookups": 0,
            "deregistered_dead": 0,
            "deregistered_clean": 0,
            "deregistered_operator": 0,
        }
        self.lookup_seconds = LookupLatency()
        # The control port's counters (served, refused, replayed, malformed): set by the app.
        self.control_stats: Callable[[], dict[str, int]] = dict
        # Every namespace a server named, kept while some instance holds keys of it: a
        # lookup by model still finds the chunks of an engine that left.
        self._known_namespaces: dict[bytes, cm.NamespaceInfo] = {}
        self.activity: deque[dict[str, object]] = deque(maxlen=ACTIVITY)

    # -- lifecycle -------------------------------------------------------------------------
    def handlers(self) -> dict[type, Callable[[Any], Any]]:
        return {
            cm.Register: self.on_register,
            cm.Namespaces: self.on_namespaces,
            cm.Heartbeat: self.on_heartbeat,
            cm.Report: self.on_report,
            cm.SyncBatch: self.on_sync,
            cm.Deregister: self.on_deregister,
            m.Resolve: self.on_resolve,
            m.GetStatus: lambda req: m.NodeStatus(req.rid, self.stats()),
        }

    def start(self, interval: float) -> None:
        """Start the reaper (checks liveness every ``interval`` seconds)."""
        self._thread = threading.Thread(
            target=self._reap_loop, args=(interval,), name="tierkv-ctl-reaper", daemon=True
        )
        self._thread.start()

    def alive(self) -> bool:
        """Whether the reaper runs (for health checks)."""
        return self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        self.index.close()

    def _reap_loop(self, interval: float) -> None:
        while not self._stop.wait(interval):
            self.reap()

    def reap(self) -> list[str]:
        """Deregister servers silent for longer than ``dead_after``."""
        now = self.clock()
        # The keys go with the registration, under the same lock: a server that registers
        # again (and syncs) in between must not have its fresh entries dropped after.
        with self._lock:
            dead = [i for i, s in self._instances.items() if now - s.last_seen > self.dead_after]
            held = {instance: self._drop(instance) for instance in dead}
        for instance, n in held.items():
            self.counts["deregistered_dead"] += 1
            self._event("deregistered", instance, f"silent for {self.dead_after:g} s, {n} keys")
            log.warning(
                "server %s silent for %.0f s: deregistered (%d keys)", instance, self.dead_after, n
            )
        return dead

    def remove(self, instance: str) -> int | None:
        """An operator's removal: forget ``instance`` and its keys (None: not registered)."""
        with self._lock:
            if instance not in self._instances:
                return None
            n = self._drop(instance)
        self.counts["deregistered_operator"] += 1
        self._event("removed", instance, f"by an operator, {n} keys")
        log.warning("server %s removed by an operator (%d keys)", instance, n)
        return n

    def _drop(self, instance: str) -> int:
        """Forget a registered instance and its keys (lock held by the caller); returns
        how many keys it held."""
        self._reserve(self._instances.pop(instance), 0)
        return self.index.drop(instance)

    def _event(self, event: str, instance: str, detail: str = "") -> None:
        self.activity.append(
            {"time": time.time(), "event": event, "instance": instance, "detail": detail}
        )

    # -- handlers --------------------------------------------------------------------------
    def _current(self, instance: str, boot: int) -> Instance | None:
        """The registered state of this boot of ``instance`` (lock held by the caller)."""
        state = self._instances.get(instance)
        if state is None or state.member.incarnation != boot:
            return None
        state.last_seen = self.clock()
        return state

    def on_register(self, req: cm.Register) -> cm.Registered | m.Refused:
        member = req.member
        if not member.node_id:
            return m.Refused(req.rid, "register: empty instance id")
        if why := _namespaces_problem(req.namespaces):
            return m.Refused(req.rid, f"register: {why}")
        now = self.clock()
        with self._lock:
            old = self._instances.get(member.node_id)
            restarted = old is not None and old.member.incarnation != member.incarnation
            if restarted:  # the old boot's keys are gone with it (refused or not)
                self._drop(member.node_id)
            waiting = _deferred_since(old, now, self.dead_after) if not restarted else None
            if old is not None and not restarted and old.seq == UNSYNCED and waiting is None:
                # Registered again before the sync that followed its last registration
                # ended (refused, failed): the entries kept for that sync are dropped now,
                # or a server whose syncs keep failing would be named for chunks it evicted
                # for as long as it stayed alive. (A sync deferred for want of room keeps
                # them, for dead_after at most: it starts once room is free.)
                self.index.drop(member.node_id)
            if not self.index.free_slots():  # its sync could not be applied
                refused = True
            else:
                refused = False
                # The same boot keeps its entries for lookups until its full sync (which
                # follows) replaces them; the fresh state has no sequence, so reports and
                # heartbeats are refused or unknown until then.
                if old is not None and not restarted:
                    self._reserve(old, 0)  # (its sync, if any, is over)
                fresh = Instance(member, list(req.namespaces), now, now, deferred_since=waiting)
                self._instances[member.node_id] = fresh
                self._remember(req.namespaces)
        if refused:
            self.counts["registrations_refused"] += 1
            log.warning(
                "server %s refused: no free instance slot (%d servers registered)",
                member.node_id,
                len(self._instances),
            )
            return m.Refused(req.rid, "register: no free instance slot, try again later")
        if restarted:
            self.counts["restarts_noticed"] += 1
            log.info("server %s restarted: its previous entries dropped", member.node_id)
        self.counts["registrations"] += 1
        self._event("registered", member.node_id, "restarted" if restarted else member.data)
        log.info("server %s registered (data %s)", member.node_id, member.data)
        return cm.Registered(req.rid, self.boot)

    def on_namespaces(self, req: cm.Namespaces) -> m.Done | m.Refused:
        if why := _namespaces_problem(req.namespaces):
            return m.Refused(req.rid, f"namespaces: {why}")
        with self._lock:
            state = self._current(req.instance, req.boot)
            if state is None:
                return m.Refused(req.rid, "namespaces: unknown boot of this server")
            state.namespaces = list(req.namespaces)
            self._remember(req.namespaces)
        return m.Done(req.rid, len(req.namespaces))

    def on_heartbeat(self, req: cm.Heartbeat) -> cm.HeartbeatReply:
        self.counts["heartbeats"] += 1
        with self._lock:
            state = self._current(req.instance, req.boot)
            if state is None:
                return cm.HeartbeatReply(req.rid, self.boot, False)
            have, syncing = state.seq, bool(state.sync_parts)
        known = have == req.seq and not syncing
        if not known:
            # Not a loop: the server's next heartbeat follows its full sync, which sets
            # state.seq to the very sequence that heartbeat carries (module docstring).
            self.counts["heartbeats_out_of_sequence"] += 1
            log.info(
                "server %s is at sequence %d, the controller at %d%s: asked to re-sync",
                req.instance,
                req.seq,
                have,
                " (its full sync left unfinished)" if syncing else "",
            )
        return cm.HeartbeatReply(req.rid, self.boot, known)

    def on_report(self, req: cm.Report) -> cm.Ack:
        n_keys = len(req.keys) // KEY_SIZE
        if len(req.keys) % KEY_SIZE or len(req.evicts) % KEY_SIZE or len(req.tiers) != n_keys:
            self.counts["reports_refused"] += 1
            return cm.Ack(req.rid, self.boot, False, "keys, tiers and evicts do not match")
        tiers = np.frombuffer(req.tiers, dtype=np.int8)
        if n_keys and (int(tiers.min()) < 0 or int(tiers.max()) >= WHERE_CODES):
            self.counts["reports_refused"] += 1
            return cm.Ack(req.rid, self.boot, False, _TIER_RANGE)
        with self._lock:
            state = self._current(req.instance, req.boot)
            # Reports apply on top of a full sync: none before the registration's has ended
            # (its previous entries may be kept for lookups meanwhile, but they are stale).
            if (
                state is None
                or state.seq == UNSYNCED
                or state.sync_parts
                or req.seq != state.seq + 1
            ):
                self.counts["reports_refused"] += 1
                return cm.Ack(req.rid, self.boot, False, "unknown boot or out of sequence")
            # Applied under the controller's lock: reports of one server apply in order.
            if n_keys:
                try:
                    self.index.add(req.instance, req.keys, tiers)
                except NoFreeSlot as e:  # nothing applied; the server registers again
                    self.counts["reports_refused"] += 1
                    return cm.Ack(req.rid, self.boot, False, str(e))
            if req.evicts:
                self.index.remove(req.instance, req.evicts)
            state.seq = req.seq
            state.reports += 1
        self.counts["reports"] += 1
        self.counts["admits"] += n_keys
        self.counts["evicts"] += len(req.evicts) // KEY_SIZE
        return cm.Ack(req.rid, self.boot, True)

    def on_sync(self, req: cm.SyncBatch) -> cm.Ack:
        n_keys = len(req.keys) // KEY_SIZE
        why = ""
        if len(req.keys) % KEY_SIZE or len(req.tiers) != n_keys:
            why = "bad sync batch: keys and tiers do not match"
        elif n_keys:
            tiers = np.frombuffer(req.tiers, dtype=np.int8)
            if int(tiers.min()) < 0 or int(tiers.max()) >= WHERE_CODES:
                why = f"bad sync batch: {_TIER_RANGE}"
        elif not req.last:  # only a sync's last part may be empty (a server that holds nothing)
            why = "bad sync batch: an empty part before the last"
        if why:
            self.counts["reports_refused"] += 1
            return cm.Ack(req.rid, self.boot, False, why)
        cost = max(len(req.keys) + len(req.tiers), MIN_PART_BYTES)
        with self._lock:
            state = self._current(req.instance, req.boot)
            if state is None or req.part != len(state.sync_parts) or req.seq < state.seq:
                self.counts["reports_refused"] += 1
                if state is not None:
                    self._forget(state)
                return cm.Ack(req.rid, self.boot, False, "unknown boot or sync part out of order")
            if why := self._room_for(state, req, cost):
                return cm.Ack(req.rid, self.boot, False, why)
            state.sync_parts.append((req.keys, req.tiers))
            state.sync_bytes += cost
            state.sync_keys += n_keys
            self.counts["sync_parts"] += 1
            if not req.last:
                return cm.Ack(req.rid, self.boot, True)
            parts = state.sync_parts
            self._forget(state)
            keys = b"".join(k for k, _ in parts)
            tiers_all = np.frombuffer(b"".join(t for _, t in parts), dtype=np.int8)
            try:
                self.index.replace(req.instance, keys, tiers_all)
            except NoFreeSlot as e:  # nothing applied; its next Register drops the kept entries
                self.counts["reports_refused"] += 1
                return cm.Ack(req.rid, self.boot, False, str(e))
            state.seq = req.seq
            state.syncs += 1
            state.deferred_since = None
        self._deferrals.ok()
        self.counts["syncs"] += 1
        self._event("synced", req.instance, f"{len(keys) // KEY_SIZE} keys")
        log.info("server %s full sync applied: %d keys", req.instance, len(keys) // KEY_SIZE)
        return cm.Ack(req.rid, self.boot, True)

    def _room_for(self, state: Instance, req: cm.SyncBatch, cost: int) -> str:
        """Take room for a sync part (lock held): "" when taken, else why not (the sync's
        parts are dropped). A sync that tells its size takes room for all of it at part 0,
        or is deferred then, before anything was sent for nothing: a sync once started
        always ends (one part refused for want of room used to drop its sync whole, however
        far along). One that does not tell takes room part by part."""
        if req.part == 0:
            # Its whole size, its parts of 65,536 keys at least MIN_PART_BYTES each.
            told = req.total_keys >= 0
            size = req.total_keys * (KEY_SIZE + 1) if told else cost
            need = min(size + MIN_PART_BYTES, self.max_sync_bytes) if told else cost
            refusal = self._no_room(state, need, size)
            if refusal:
                return refusal
            self._reserve(state, need)
        if state.sync_bytes + cost > state.sync_reserved:
            if req.total_keys >= 0:  # (its room was all it said, or max_sync_bytes)
                lied = state.sync_bytes + cost > req.total_keys * (KEY_SIZE + 1) + MIN_PART_BYTES
                self.counts["reports_refused"] += 1
                self._forget(state)
                if lied:
                    return "the sync's parts hold more than its total_keys said"
                return "sync larger than max_sync_bytes"
            if refusal := self._no_room(state, state.sync_bytes + cost):
                return refusal
            self._reserve(state, state.sync_bytes + cost)
        return ""

    def _reserve(self, state: Instance, n: int) -> None:
        """Set the room ``state``'s sync holds (lock held), in the running total."""
        self._reserved += n - state.sync_reserved
        state.sync_reserved = n

    def _forget(self, state: Instance) -> None:
        """Drop the sync parts collected and the room they had (lock held)."""
        _forget_parts(state)
        self._reserve(state, 0)

    def _no_room(self, state: Instance, need: int, size: int | None = None) -> str:
        """Why ``state``'s sync cannot take ``need`` bytes of room ("" if it can; lock
        held); ``size``: what its parts cost at least (``need``, unless told)."""
        if (need if size is None else size) > self.max_sync_bytes:
            self.counts["reports_refused"] += 1
            self._forget(state)
            return "sync larger than max_sync_bytes"
        others = self._reserved - state.sync_reserved
        if others + need <= self.max_sync_bytes:
            return ""
        # Other servers' syncs hold the room: this one tries again later (its server
        # registers again after a pause, keeping the entries it had), when theirs are in.
        self.counts["syncs_deferred"] += 1
        self._forget(state)
        if state.deferred_since is None:
            state.deferred_since = self.clock()
        self._deferrals.failed(
            f"server {state.member.node_id}'s sync",
            f"deferred: other syncs hold {others} of max_sync_bytes ({self.max_sync_bytes}); "
            "it syncs again later",
        )
        return "other servers' syncs hold the room"

    def on_deregister(self, req: cm.Deregister) -> m.Done:
        with self._lock:
            if self._current(req.instance, req.boot) is None:
                return m.Done(req.rid, 0)
            n = self._drop(req.instance)
        self.counts["deregistered_clean"] += 1
        self._event("deregistered", req.instance, f"shut down, {n} keys")
        return m.Done(req.rid, n)

    def on_resolve(self, req: m.Resolve) -> cm.Located | m.Refused:
        if any(len(k) != KEY_SIZE for k in req.keys):
            return m.Refused(req.rid, f"resolve: keys must be {KEY_SIZE} bytes")
        t = time.perf_counter()
        found = self.index.lookup(req.keys) if req.keys else {}
        with self._lock:
            members = {i: s.member for i, s in self._instances.items()}
        holders: list[m.MemberInfo] = []
        parts = []
        for instance, tiers in found.items():
            member = members.get(instance)
            if member is None:
                continue
            pos = np.flatnonzero(tiers >= 0)
            parts.append((len(holders), pos, tiers[pos]))
            holders.append(member)
        self.counts["lookups"] += 1
        self.counts["lookup_keys"] += len(req.keys)
        self.lookup_seconds.observe(time.perf_counter() - t)
        return cm.Located(req.rid, holders, *found_columns.of_arrays(parts))

    def _remember(self, namespaces: list[cm.NamespaceInfo]) -> None:
        """Note namespaces a server named (caller holds the lock); those no instance names
        any more and none holds keys of are forgotten here, so the memory stays within
        what the index holds."""
        for ns in namespaces:
            self._known_namespaces[ns.digest] = ns
        if len(self._known_namespaces) > 2 * cm.MAX_NAMESPACES:
            self._known_namespaces = self._still_known(self.index.held_namespaces())

    def _still_known(self, held: set[bytes]) -> dict[bytes, cm.NamespaceInfo]:
        """The remembered namespaces some instance names or holds keys of (lock held)."""
        named = {ns.digest for s in self._instances.values() for ns in s.namespaces}
        return {d: ns for d, ns in self._known_namespaces.items() if d in held or d in named}

    def router_lookup(self, body: bytes) -> dict[str, object]:
        """``POST /lookup`` (:mod:`tierkv.cluster.router_lookup`) from the index: the
        namespaces registered servers name, and those of engines gone whose keys some
        instance still holds."""
        held = self.index.held_namespaces()
        with self._lock:
            members = {i: s.member for i, s in self._instances.items()}
            namespaces = [ns for s in self._instances.values() for ns in s.namespaces]
            self._known_namespaces = self._still_known(held)
            named = {ns.digest for ns in namespaces}
            namespaces += [
                ns for d, ns in self._known_namespaces.items() if d in held and d not in named
            ]

        def address(instance: str) -> str | None:
            member = members.get(instance)
            return member.data if member is not None else None

        t = time.perf_counter()
        reply = router_lookup.answer(body, namespaces, self.index.lookup, address)
        self.counts["router_lookups"] += 1
        self.lookup_seconds.observe(time.perf_counter() - t)
        return reply

    # -- figures ---------------------------------------------------------------------------
    def instances(self) -> list[dict[str, object]]:
        now = self.clock()
        with self._lock:
            states = list(self._instances.values())
        rows: list[dict[str, object]] = []
        for s in states:
            node = s.member.node_id
            rows.append(
                {
                    "instance": node,
                    "data": s.member.data,
                    "boot": s.member.incarnation,
                    "namespaces": [_describe(ns) for ns in s.namespaces],
                    "keys_by_namespace": self.index.namespaces(node),
                    "keys": self.index.size(node),
                    "keys_by_tier": dict(
                        zip(("pool", "disk"), self.index.by_tier(node), strict=False)
                    ),
                    "last_heartbeat_s": round(now - s.last_seen, 3),
                    "seq": s.seq,
                    # Registered and its full sync not applied yet (parts coming, or the
                    # first yet to come): its entries are not current.
                    "syncing": s.seq == UNSYNCED or bool(s.sync_parts),
                    "sync_keys_received": s.sync_keys,
                    "syncs": s.syncs,
                }
            )
        return sorted(rows, key=lambda r: str(r["instance"]))

    def stats(self) -> dict[str, object]:
        rows = self.instances()
        return {
            "boot": self.boot,
            "instances": rows,
            "namespaces": namespace_totals(rows),
            "total_keys": self.index.total(),
            "index_bytes": self.index.nbytes(),
            "index_merges": self.index.merges,
            "index_merge_seconds": round(self.index.merge_seconds, 3),
            "activity": list(self.activity),
            "control": self.control_stats(),
            **self.counts,
        }


_TIER_RANGE = f"a tier out of range (tiers are 0 to {WHERE_CODES - 1}: pool, disk)"


def _deferred_since(old: Instance | None, now: float, limit: float) -> float | None:
    """When ``old``'s sync was first deferred, if its entries are still kept for it: for
    ``limit`` seconds from then (None: they are not)."""
    if old is None or old.deferred_since is None or now - old.deferred_since >= limit:
        return None
    return old.deferred_since


def _forget_parts(state: Instance) -> None:
    """Drop the sync parts collected (lock held by the caller)."""
    state.sync_parts, state.sync_bytes, state.sync_keys = [], 0, 0


def namespace_totals(rows: list[dict[str, Any]]) -> list[dict[str, object]]:
    """Per namespace (of any instance's rows): its model, the keys held per tier across
    instances, and how many instances hold or serve it."""
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        for ns in row["namespaces"]:
            entry = out.setdefault(ns["namespace"], _blank(ns["namespace"]))
            entry["model"] = ns["model"]
        for digest, counts in row["keys_by_namespace"].items():
            entry = out.setdefault(digest, _blank(digest))
            entry["keys_by_tier"] = [
                a + b for a, b in zip(entry["keys_by_tier"], counts, strict=True)
            ]
            entry["keys"] += sum(counts)
            entry["instances"] += 1
    return sorted(out.values(), key=lambda e: (-e["keys"], e["namespace"]))


def _blank(digest: str) -> dict[str, Any]:
    return {
        "namespace": digest,
        "model": "",
        "keys": 0,
        "keys_by_tier": [0] * TIERS,
        "instances": 0,
    }


def _namespaces_problem(namespaces: list[cm.NamespaceInfo]) -> str:
    if len(namespaces) > cm.MAX_NAMESPACES:
        return f"more than {cm.MAX_NAMESPACES} namespaces"
    return next((why for ns in namespaces if (why := ns.problem())), "")


def _describe(ns: cm.NamespaceInfo) -> dict[str, object]:
    return {
        "namespace": ns.digest.hex(),
        "model": ns.model,
        "chunk_tokens": ns.chunk_tokens,
        "world_size": ns.world_size,
        "rank": ns.rank,
    }
