"""Membership with no single point of failure: seeds, join, heartbeat, member TTL, rejoin.

Every node keeps the whole member list. Every ``interval`` seconds it sends a heartbeat to
every member it believes alive, to its configured seeds, to members it has only heard of
(gossip candidates) and to members that died recently; the heartbeat and its reply both
carry the sender's live members. A member is *alive* only on direct evidence (a heartbeat
from it, or its reply to ours) within the last ``ttl`` seconds; members learnt second-hand
are merely probed, so gossip can never resurrect a dead node.

Partitions can be one-way: a node that still hears a peer's heartbeats but whose own calls
to it go unanswered for ``ttl`` seconds cannot use it (its stores would wait on it, its
reads would time out), so it declares the peer *unreachable from here*: out of this node's
view, as if dead, while the peer may still count this node in. Its heartbeats alone do not
bring it back; an answer to one of ours does (it keeps being probed). Since every node holds the
list and any live member answers a joiner with it, the list survives the loss of any node,
the first seed included; a joiner needs one live seed.

A node that restarts comes back with the same id and a new ``incarnation``: its peers see
the change (its pool is empty, its entries must be re-published to it) and report it as a
change of membership. Dead members and seeds keep being probed, so a restarted seed is found
again even if its own seed list names nobody alive. A node that stops cleanly sends LEAVE.

A peer that refuses our heartbeats (another cluster token) is logged as one
:class:`~tierkv.logs.FailureLog` per peer: the first refusal at WARNING with its cause, then
a summary at most once a minute, one INFO line once it answers again.

Changes are reported by ``on_change(old, new)`` (maps of node id to member info) from the
membership thread, never under a lock, in the order they happened.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tierkv.cluster import messages as m
from tierkv.cluster.control import ControlClient
from tierkv.logs import FailureLog

log = logging.getLogger(__name__)

# Members heard of second-hand probed at once, at least (twice the members, if more).
MIN_CANDIDATES = 256
ChangeListener = Callable[[dict[str, m.MemberInfo], dict[str, m.MemberInfo]], None]


@dataclass(slots=True)
class _Member:
    info: m.MemberInfo
    last_seen: float  # the last direct evidence of life (its heartbeat, its answer)
    last_answer: float  # the last answer to a call of ours (from when it joined)


class Membership:
    """This node's view of the cluster. Thread-safe."""

    def __init__(
        self,
        me: m.MemberInfo,
        seeds: Iterable[str],
        client: ControlClient,
        interval: float = 1.0,
        ttl: float = 5.0,
        on_change: ChangeListener | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not (interval > 0 and ttl > interval):
            raise ValueError("need 0 < heartbeat interval < member ttl")
        self.me = me
        self.seeds = [s.strip() for s in seeds if s.strip()]
        self.client = client
        self.interval = interval
        self.ttl = ttl
        self.clock = clock
        self._listeners: list[ChangeListener] = [on_change] if on_change else []
        self._lock = threading.Lock()
        self._members: dict[str, _Member] = {}
        self._candidates: dict[str, float] = {}  # control address -> until when to probe
        self.candidates_turned_away = 0  # reported members not probed: too many were
        self._dead: dict[str, tuple[m.MemberInfo, float]] = {}  # node id -> (info, when)
        self._unreachable: set[str] = set()  # node ids heard from that do not answer us
        self._self_addrs: set[str] = {me.control}
        self._reported: dict[str, m.MemberInfo] = {me.node_id: me}
        self._view: dict[str, m.MemberInfo] | None = None
        self._version = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.heartbeats_sent = 0
        self.heartbeats_received = 0
        self.changes = 0
        self.refused_by_peers = 0
        self._refusing: dict[str, FailureLog] = {}  # by control address (heartbeat thread)
        self.left = 0  # members that said LEAVE
        self.self_claims = 0  # heartbeats naming this node's id with another address
        self.unreachable = 0  # times a member heard from was declared unreachable from here

    # -- queries ---------------------------------------------------------------------------
    def add_listener(self, listener: ChangeListener) -> None:
        self._listeners.append(listener)

    def alive(self) -> dict[str, m.MemberInfo]:
        """Live members by node id, this node included (a copy)."""
        return dict(self.view()[1])

    def view(self) -> tuple[int, dict[str, m.MemberInfo]]:
        """(version, live members including this node); the version changes whenever the
        set changes, and the mapping must not be modified."""
        with self._lock:
            if self._view is None:
                view = {nid: mem.info for nid, mem in self._members.items()}
                view[self.me.node_id] = self.me
                self._view = view
            return self._version, self._view

    def _changed_locked(self) -> None:
        self._view = None
        self._version += 1

    def get(self, node_id: str) -> m.MemberInfo | None:
        if node_id == self.me.node_id:
            return self.me
        with self._lock:
            mem = self._members.get(node_id)
            return mem.info if mem else None

    def describe(self) -> list[dict[str, object]]:
        """Members with their heartbeat age (for status pages)."""
        now = self.clock()

        def row(info: m.MemberInfo, seen: float, state: str) -> dict[str, object]:
            return {
                "node_id": info.node_id,
                "control": info.control,
                "data": info.data,
                "incarnation": info.incarnation,
                "last_seen_s": round(now - seen, 3),
                "state": state,
            }

        with self._lock:
            rows = [row(mem.info, mem.last_seen, "alive") for mem in self._members.values()]
            rows += [
                row(info, when, "unreachable" if nid in self._unreachable else "dead")
                for nid, (info, when) in self._dead.items()
            ]
        rows.append(row(self.me, now, "self"))
        return sorted(rows, key=lambda r: str(r["node_id"]))

    # -- control handlers (on the control server thread) -----------------------------------
    def on_heartbeat(self, req: m.Heartbeat) -> m.HeartbeatAck:
        self.heartbeats_received += 1
        self._saw(req.sender, answered=False)
        self._gossip(req.members)
        return m.HeartbeatAck(req.rid, self.me, self._live_infos())

    def on_leave(self, req: m.Leave) -> m.Done:
        info = req.sender
        with self._lock:
            mem = self._members.get(info.node_id)
            gone = mem is not None and mem.info.incarnation == info.incarnation
            if gone:
                del self._members[info.node_id]
                self._changed_locked()
                self._dead[info.node_id] = (info, self.clock())
            if mem is None or gone:
                self._unreachable.discard(info.node_id)
        if gone:
            self.left += 1
            log.info("cluster member %s left", info.node_id)
            self._wake.set()
        return m.Done(req.rid, int(gone))

    def on_get_members(self, req: m.GetMembers) -> m.MemberList:
        return m.MemberList(req.rid, [*self._live_infos(), self.me])

    # -- state changes ---------------------------------------------------------------------
    def _live_infos(self) -> list[m.MemberInfo]:
        with self._lock:
            return [mem.info for mem in self._members.values()]

    def _saw(self, info: m.MemberInfo, answered: bool = True) -> None:
        """Direct evidence that ``info`` is alive: its answer to our call (``answered``) or
        its own heartbeat (which does not bring back a member unreachable from here)."""
        if info.node_id == self.me.node_id:
            # Its own heartbeat looped back through a seed address (that address is learnt
            # from the reply, in tick), or another process claiming this node's id: never a
            # reason to stop calling the address it names, which may be a real peer's.
            if info.control != self.me.control:
                self.self_claims += 1
            return
        now = self.clock()
        with self._lock:
            mem = self._members.get(info.node_id)
            if mem is not None and info.incarnation < mem.info.incarnation:
                return  # a late message of a previous life
            if not answered and info.node_id in self._unreachable:
                self._candidates[info.control] = now + 3 * self.ttl  # keep probing it
                return
            if mem is None or mem.info != info:
                self._members[info.node_id] = _Member(info, now, now)
                self._changed_locked()
                changed = True
            else:
                mem.last_seen = now
                if answered:
                    mem.last_answer = now
                changed = False
            if answered and info.node_id in self._unreachable:
                self._unreachable.discard(info.node_id)
                log.info("cluster member %s answers this node again", info.node_id)
            self._dead.pop(info.node_id, None)
            self._candidates.pop(info.control, None)
        if changed:
            self._wake.set()

    def _gossip(self, infos: Iterable[m.MemberInfo]) -> None:
        """Members another node reports: probe the ones we do not know as alive, up to
        :data:`MIN_CANDIDATES` or twice the members at once (one heartbeat naming 20,000
        made-up members made every round call them all, past the members' TTL: live
        members were declared dead). Past it the ones known already are kept probing; the
        others wait for another report (those probed leave as they answer or expire)."""
        until = self.clock() + 3 * self.ttl
        with self._lock:
            room = max(MIN_CANDIDATES, 2 * len(self._members))
            candidates = self._candidates
            for info in infos:
                if info.node_id == self.me.node_id:
                    continue
                mem = self._members.get(info.node_id)
                if mem is None or mem.info.incarnation < info.incarnation:
                    if info.control in candidates or len(candidates) < room:
                        candidates[info.control] = until
                    else:
                        self.candidates_turned_away += 1

    def _expire(self) -> None:
        now = self.clock()
        with self._lock:
            for nid, mem in list(self._members.items()):
                silent = now - mem.last_seen > self.ttl
                if not silent and now - mem.last_answer <= self.ttl:
                    continue
                del self._members[nid]
                self._changed_locked()
                self._dead[nid] = (mem.info, now)
                if silent:
                    log.warning(
                        "cluster member %s missed heartbeats for %.1f s: declared dead",
                        nid,
                        now - mem.last_seen,
                    )
                    continue
                self._unreachable.add(nid)
                self.unreachable += 1
                log.warning(
                    "cluster member %s has not answered this node for %.1f s (though it "
                    "was heard from %.1f s ago): unreachable from here, out of this view",
                    nid,
                    now - mem.last_answer,
                    now - mem.last_seen,
                )
            horizon = max(60.0, 20 * self.ttl)
            for nid, (_, when) in list(self._dead.items()):
                if now - when > horizon:
                    del self._dead[nid]
            for addr, until in list(self._candidates.items()):
                if now > until:
                    del self._candidates[addr]

    def _report(self) -> None:
        new = self.alive()
        old = self._reported
        if {k: v.incarnation for k, v in new.items()} == {k: v.incarnation for k, v in old.items()}:
            return
        self._reported = new
        self.changes += 1
        joined = sorted(set(new) - set(old))
        left = sorted(set(old) - set(new))
        restarted = sorted(k for k in set(new) & set(old) if new[k] != old[k])
        log.info(
            "cluster membership: %d members (joined %s, left %s, restarted %s)",
            len(new),
            joined or "-",
            left or "-",
            restarted or "-",
        )
        for listener in self._listeners:
            try:
                listener(old, new)
            except Exception:
                log.exception("membership listener failed")

    # -- the heartbeat loop ----------------------------------------------------------------
    def targets(self) -> list[str]:
        with self._lock:
            addrs = [mem.info.control for mem in self._members.values()]
            addrs += list(self._candidates)
            addrs += [info.control for info, _ in self._dead.values()]
            addrs += self.seeds
            known = set()
            out: list[str] = []
            for addr in addrs:
                if addr not in known and addr not in self._self_addrs:
                    known.add(addr)
                    out.append(addr)
            return out

    def tick(self) -> None:
        """One round: heartbeat every target, merge what they say, expire the silent."""
        targets = self.targets()
        if targets:
            msg = m.Heartbeat(0, self.me, self._live_infos())
            self.heartbeats_sent += len(targets)
            replies = self.client.call_many(
                {addr: msg for addr in targets}, timeout=0.8 * self.interval, suspect=False
            )
            for addr in set(self._refusing) - set(targets):
                del self._refusing[addr]
            for addr, reply in replies.items():
                if isinstance(reply, m.HeartbeatAck):
                    if (refusing := self._refusing.pop(addr, None)) is not None:
                        refusing.ok()
                    if reply.sender.node_id == self.me.node_id:
                        self._self_addrs.add(addr)
                        continue
                    self._saw(reply.sender)
                    self._gossip(reply.members)
                elif isinstance(reply, m.Refused):
                    self.refused_by_peers += 1
                    refusing = self._refusing.get(addr)
                    if refusing is None:
                        refusing = self._refusing[addr] = FailureLog(f"cluster peer {addr}", log)
                    refusing.failed("heartbeat", f"refused: {reply.reason}")
        self._expire()
        self._report()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tierkv-cluster-hb", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = self.clock()
            try:
                self.tick()
            except Exception:
                log.exception("cluster heartbeat round failed")
            # Sleep out the interval, but report a change seen by a handler at once.
            while not self._stop.is_set():
                left = started + self.interval - self.clock()
                if left <= 0:
                    break
                if self._wake.wait(left):
                    self._wake.clear()
                    self._report()

    def close(self, leave: bool = True) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        if leave:
            self.leave()

    def leave(self) -> None:
        """Tell every live member that this node is going away (best effort)."""
        msg = m.Leave(0, self.me)
        self.client.call_many(
            {info.control: msg for info in self._live_infos()}, timeout=1.0, suspect=False
        )
