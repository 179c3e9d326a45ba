"""The ring's directory (:class:`RingDirectory`, a :class:`~tierkv.cluster.directory.Directory`):
decentralised, every member hosts a shard of it (:class:`~tierkv.cluster.ring_shard.Shard`),
and the consistent-hash ring (:mod:`tierkv.cluster.ring`) names the ``replicas`` owners of
each key's entry.

Writes are asynchronous: ``publish`` and ``unpublish`` only queue; a publisher thread drains
the queue, groups the keys by owner and sends one batch per owner (all owners at once), so
a commit never waits for the network. Entries held by this node's own shard are applied
directly. Updates for an owner that is *suspect* (it timed out and has not answered since,
:class:`~tierkv.cluster.control.ControlClient`) are not sent: they wait, merged, until it
answers a probe again, so a silent owner costs one timeout, not one per store. Nothing else
is retried; a node's own entries are written by that node only (a PUBLISH or UNPUBLISH
naming it as holder is refused). A lost or wrong entry is repaired by the anti-entropy:
every ``repair_interval`` seconds each node compares, with each owner (its own shard
included), a summary of the entries that owner should list for it
(:mod:`tierkv.cluster.digest`: per bucket of keys, a count and an XOR of entry hashes; the
owner keeps its side up to date entry by entry), and where a bucket differs the owner lists
its entries of that node there, and the node re-publishes what is missing or wrong and
withdraws the rest (rounds are spaced further apart where they would take more than 1 % of a
core). Entries of holders that are no members are dropped after a few rounds.
A shard keeps every holder's entry of a key (none pushes another out: the repair would put
it back and push the next out, for ever).

Reads are batched (:mod:`tierkv.cluster.ring_resolve`): :meth:`RingDirectory.resolve` asks
each key of one owner (this node first when it is one; otherwise as few owners as cover the
keys, so a two-member ring with two replicas answers a prefix in one round trip), all owners
in one round trip; keys still unresolved (owner dead, entry not moved yet) are asked of
another replica, up to ``replicas`` rounds. Suspect owners are not asked at all: a key only
they know is a miss at once, never a wait. Holders that are not live members are dropped.

Membership changes rebalance: entries of departed or restarted holders are purged, entries
move to the owners that are new for them (and leave a node that no longer owns them), and
every node re-publishes what it holds to the owners that are new for those keys; so the
directory heals itself after joins, leaves and restarts.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

import numpy as np

from tierkv.cluster import digest, found_columns
from tierkv.cluster import messages as m
from tierkv.cluster.control import ControlClient
from tierkv.cluster.directory import WHERE_CODES, Directory, Location, PublishQueue, Where
from tierkv.cluster.membership import Membership
from tierkv.cluster.ring import Ring
from tierkv.cluster.ring_resolve import resolve_keys
from tierkv.cluster.ring_shard import Shard
from tierkv.keys import KEY_SIZE

log = logging.getLogger(__name__)

BATCH = 65536  # entries per message
MAX_LISTED = 16 * BATCH  # entries an owner lists in one answer to a digest
UNKNOWN_ROUNDS = 3  # repair rounds after which entries of a holder that is no member go
REPAIR_CPU_SHARE = 0.01  # the anti-entropy's rounds are spaced to use at most this of a core
_NOT_FROM_OUTSIDE = "a node writes its own directory entries itself, never on request"
DEFERRED_CHECK = 0.25  # seconds between checks whether a suspect owner answers again
# A membership change is applied once the view has been still for ``settle`` seconds, or at
# the latest this many settles after the first change not applied yet: members that keep
# changing (one restarting in a loop) never hold rebalancing off for good.
MAX_SETTLES = 5
# Updates kept for one owner at most (latest per key); beyond, they are dropped (the
# anti-entropy rounds and the re-publish repair what an owner lacks or lists wrong).
MAX_KEPT = 1 << 20

_T = TypeVar("_T")


def _valid(key: bytes, where: int) -> bool:
    """An entry the ring can place and a resolve can read back; a buggy member's others are
    dropped (one key of another length would fail every later rebalance)."""
    return len(key) == KEY_SIZE and where in WHERE_CODES


class RingDirectory(Directory):
    """The consistent-hash directory of one node."""

    def __init__(
        self,
        membership: Membership,
        client: ControlClient,
        held: Callable[[], list[tuple[bytes, Where]]],
        replicas: int = 2,
        vnodes: int = 160,
        settle: float = 0.1,
        republish_interval: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        repair_interval: float = 5.0,
        claimed: Callable[[], list[tuple[bytes, Where]]] | None = None,
    ) -> None:
        """``held``: what this node holds, verified (re-published after membership changes
        and every ``republish_interval``); ``claimed``: what it has published, as recorded
        (cheaper; what the owners' entries are compared with every ``repair_interval``
        seconds, 0: never; default: ``held``)."""
        self.membership = membership
        self.settle = settle
        self.republish_interval = republish_interval
        self.clock = clock
        self.client = client
        self.held = held
        self.claimed = claimed or held
        self.repair_interval = repair_interval
        self.replicas = replicas
        self.vnodes = vnodes
        self.me = membership.me
        self.shard = Shard()
        self._applied = membership.alive()  # the view the last rebalance moved entries for
        self._ring_cache: tuple[int, dict[str, m.MemberInfo], Ring] | None = None
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._queue = PublishQueue()
        self._taken = 0  # the last ticket of the batch being sent
        # Updates for suspect owners (publisher thread only): owner -> key -> Where or -1.
        self._deferred: dict[str, dict[bytes, int]] = {}
        self._deferred_check = 0.0
        self._view_changed = False  # a membership change not yet applied
        self._changed_at = 0.0  # the last change
        self._first_change = 0.0  # the first change not applied yet
        self._next_republish = clock() + republish_interval
        self._next_repair = clock() + repair_interval if repair_interval > 0 else math.inf
        self._unknown: dict[str, int] = {}  # holder not a member -> repair rounds it was not
        self._stop = False
        self._busy = False
        self._thread: threading.Thread | None = None
        self.counts: dict[str, int] = {
            "published": 0,
            "unpublished": 0,
            "publish_batches": 0,
            "publish_failures": 0,
            "publish_waits": 0,  # commits that waited for their publish (read-your-writes)
            "publish_wait_timeouts": 0,
            "publish_deferred": 0,  # updates held back for a suspect owner
            "publish_deferred_sent": 0,  # ... sent once it answered again
            "publish_deferred_dropped": 0,  # ... dropped: the owner left
            "publish_deferred_moved": 0,  # ... whose key the owner no longer owns (not sent)
            "resolves": 0,
            "resolved_keys": 0,
            "resolve_found": 0,
            "resolve_rpcs": 0,
            "resolve_skipped": 0,  # owners not asked: suspect
            "served_resolves": 0,
            "served_publish": 0,
            "handoff_sent": 0,
            "handoff_received": 0,
            "republished": 0,
            "purged": 0,
            "rebalances": 0,
            "repair_rounds": 0,  # anti-entropy: summaries compared with every owner
            "repair_differences": 0,  # owners (this node included) whose entries differed
            "repaired": 0,  # entries re-published or withdrawn by the anti-entropy
            "served_digests": 0,
            "unknown_purged": 0,  # entries of holders that are not members, dropped
        }
        membership.add_listener(self._membership_changed)

    def current(self) -> tuple[dict[str, m.MemberInfo], Ring]:
        """Live members and their ring, as membership sees them now (rebuilt on change)."""
        version, members = self.membership.view()
        cached = self._ring_cache
        if cached is None or cached[0] != version:
            cached = (version, members, Ring(members, self.vnodes, self.replicas))
            self._ring_cache = cached
        return cached[1], cached[2]

    @property
    def ring(self) -> Ring:
        return self.current()[1]

    # -- writes (queued) -------------------------------------------------------------------
    def publish(self, keys: Sequence[bytes], where: Where = Where.POOL) -> int:
        with self._cond:
            ticket = self._queue.add(keys, where)
            if keys:
                self._cond.notify()
            return ticket

    def wait_published(self, ticket: int, timeout: float) -> bool:
        with self._cond:
            done = self._cond.wait_for(lambda: self._queue.done(ticket) or self._stop, timeout)
            self.counts["publish_waits"] += 1
            if not done:
                self.counts["publish_wait_timeouts"] += 1
            return done

    def unpublish(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        with self._cond:
            self._queue.withdraw(keys)
            self._cond.notify()

    def _membership_changed(
        self, old: dict[str, m.MemberInfo], new: dict[str, m.MemberInfo]
    ) -> None:
        with self._cond:
            now = self.clock()
            if not self._view_changed:
                self._first_change = now
            self._view_changed = True
            self._changed_at = now
            self._cond.notify()

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until the queue is empty and nothing is being sent (tests, benchmarks)."""
        with self._cond:
            return self._cond.wait_for(
                lambda: not self._queue and not self._view_changed and not self._busy, timeout
            )

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tierkv-cluster-pub", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None

    def _run(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._queue.mark_sent(self._taken)
                self._cond.notify_all()
                rebalance = self._next_work()
                if self._stop:
                    return
                pending, self._taken = self._queue.take()
                self._busy = True
            try:
                if rebalance:
                    # Bursts of changes (a joiner learning the members one by one) are
                    # applied once, from the last applied view to the current one.
                    self._rebalance()
                if pending:
                    self._send_updates(pending)
                if self._deferred and self.clock() >= self._deferred_check:
                    self._send_deferred()
                if self.clock() >= self._next_republish:
                    self._next_republish = self.clock() + self.republish_interval
                    self._republish_all()
                if self.clock() >= self._next_repair:
                    self._next_repair = self.clock() + self.repair_interval
                    # At most REPAIR_CPU_SHARE of a core, however much this node holds.
                    spacing = self._repair() / REPAIR_CPU_SHARE
                    self._next_repair = max(self._next_repair, self.clock() + spacing)
            except Exception:
                log.exception("directory publisher failed")

    def _next_work(self) -> bool:
        """Wait (lock held) for queued updates, a settled membership change or the periodic
        re-publish; returns whether a membership change settled (and is taken)."""
        while not self._stop:
            now = self.clock()
            if self._view_changed and now >= self._settled_at():
                self._view_changed = False
                return True
            if self._queue or now >= min(self._next_republish, self._next_repair):
                return False
            if self._deferred and now >= self._deferred_check:
                return False
            wake = min(self._next_republish, self._next_repair)
            if self._deferred:
                wake = min(wake, self._deferred_check)
            if self._view_changed:
                wake = min(wake, self._settled_at())
            self._cond.wait(max(0.001, wake - now))
        return False

    def _settled_at(self) -> float:
        """When the pending membership change is applied (lock held)."""
        return min(self._changed_at + self.settle, self._first_change + MAX_SETTLES * self.settle)

    def _republish_all(self) -> None:
        """Anti-entropy: publish everything this node holds to every owner (repairs
        updates lost to timeouts or to racing membership views)."""
        held = self.held()
        if held:
            self._send_updates({key: int(where) for key, where in held})
            log.debug("re-published %d entries", len(held))

    def _send_updates(self, pending: dict[bytes, int]) -> None:
        n_pub = sum(1 for w in pending.values() if w >= 0)
        self.counts["published"] += n_pub
        self.counts["unpublished"] += len(pending) - n_pub
        pubs, unpubs = self._route(pending, self.current()[1])
        self._defer_suspect(pubs, unpubs)
        self._send_publishes(pubs, retry=True)
        me = self.me.node_id
        unpublish: dict[str, list[m.Struct]] = {
            o: [m.Unpublish(0, me, b) for b in _batches(k)] for o, k in unpubs.items()
        }
        self._send(unpublish, retry=True)

    def _defer_suspect(
        self, pubs: dict[str, list[tuple[bytes, int]]], unpubs: dict[str, list[bytes]]
    ) -> None:
        """Take the updates for suspect owners out of ``pubs`` and ``unpubs`` and keep them
        (merged, the latest per key) until the owner answers again. An owner that answers
        again but still has updates kept gets them now, with its new ones merged in (the
        latest per key): sent before the new ones, the kept (older) ones would undo them (a
        withdrawal kept while the owner was suspect removing a chunk stored again since),
        and kept until the next check, the new ones would reach the owner after the commit
        that waits for them returned."""
        members, ring = self.current()
        for owner in set(pubs) | set(unpubs):
            info = members.get(owner)
            if info is None:
                continue
            suspect = self.client.suspect(info.control)
            if owner not in self._deferred and not suspect:
                continue
            kept = len(self._deferred.get(owner, ()))
            entries, keys = pubs.pop(owner, []), unpubs.pop(owner, [])
            held = self._keep(owner, entries, keys)
            if suspect:
                self.counts["publish_deferred"] += len(entries) + len(keys)
                continue
            self._deferred.pop(owner, None)
            self.counts["publish_deferred_sent"] += kept
            pubs[owner], unpubs[owner] = self._still_owned(owner, held, ring)
            if not pubs[owner]:
                del pubs[owner]
            if not unpubs[owner]:
                del unpubs[owner]
        if self._deferred and not self._deferred_check:
            self._deferred_check = self.clock() + DEFERRED_CHECK

    def _send_deferred(self) -> None:
        """Send what waited for owners that answer again; drop what waited for owners that
        left (their successors got everything from the rebalance)."""
        self._deferred_check = self.clock() + DEFERRED_CHECK
        members, ring = self.current()
        pubs: dict[str, list[tuple[bytes, int]]] = {}
        unpubs: dict[str, list[bytes]] = {}
        for owner, held in list(self._deferred.items()):
            info = members.get(owner)
            if info is None:
                self.counts["publish_deferred_dropped"] += len(held)
            elif self.client.suspect(info.control):
                continue
            else:
                del self._deferred[owner]
                pubs[owner], unpubs[owner] = self._still_owned(owner, held, ring)
                self.counts["publish_deferred_sent"] += len(pubs[owner]) + len(unpubs[owner])
                continue
            del self._deferred[owner]
        if not self._deferred:
            self._deferred_check = 0.0
        if pubs or unpubs:
            self._send_publishes({o: e for o, e in pubs.items() if e}, retry=True)
            me = self.me.node_id
            self._send(
                {o: [m.Unpublish(0, me, b) for b in _batches(k)] for o, k in unpubs.items() if k},
                retry=True,
            )

    def _route(
        self, updates: dict[bytes, int], ring: Ring
    ) -> tuple[dict[str, list[tuple[bytes, int]]], dict[str, list[bytes]]]:
        """Apply this node's own share of ``updates`` (key -> Where, or -1 to withdraw) to
        its shard; return the rest by owner: (publishes, withdrawals)."""
        keys = list(updates)
        pubs: dict[str, list[tuple[bytes, int]]] = {}
        unpubs: dict[str, list[bytes]] = {}
        for key, owners in zip(keys, ring.owners_many(keys), strict=True):
            where = updates[key]
            for owner in owners:
                if where < 0:
                    unpubs.setdefault(owner, []).append(key)
                else:
                    pubs.setdefault(owner, []).append((key, where))
        me = self.me.node_id
        local_pub = pubs.pop(me, None)
        if local_pub:
            self.shard.put(me, self.me.incarnation, local_pub)
        local_unpub = unpubs.pop(me, None)
        if local_unpub:
            self.shard.remove(me, local_unpub)
        return pubs, unpubs

    def _send_publishes(
        self, pubs: dict[str, list[tuple[bytes, int]]], retry: bool = False
    ) -> None:
        me, inc = self.me.node_id, self.me.incarnation
        publish: dict[str, list[m.Struct]] = {
            o: [m.Publish(0, me, inc, b) for b in _batches(e)] for o, e in pubs.items()
        }
        self._send(publish, retry)

    def _send(self, per_owner: dict[str, list[m.Struct]], retry: bool = False) -> None:
        """Send each owner its messages, every owner at once, one message each per round.
        Suspect owners are skipped (publishes to them were deferred before). With ``retry``
        (this node's newest updates), a Publish or Unpublish an owner did not answer (a
        timeout) or was skipped for is kept for it like a suspect owner's (sent when it
        answers again, merged with later updates): dropped, it left the owner without the
        entry (or with a withdrawn one) until the next anti-entropy round, or for good
        without. One it refused is not kept: sent again, it would be refused again."""
        members, _ = self.current()
        rounds = max((len(v) for v in per_owner.values()), default=0)
        owner_at: dict[str, str] = {}
        for r in range(rounds):
            calls: dict[str, m.Struct] = {}
            for owner, msgs in per_owner.items():
                info = members.get(owner)
                if info is None or r >= len(msgs):
                    continue
                if self.client.suspect(info.control):
                    self.counts["publish_failures"] += 1
                    if retry:
                        self._keep_for(owner, msgs[r])
                    continue
                calls[info.control] = msgs[r]
                owner_at[info.control] = owner
            if not calls:
                continue
            self.counts["publish_batches"] += len(calls)
            replies = self.client.call_many(calls)
            failed = [a for a in calls if not isinstance(replies.get(a), m.Done)]
            if failed:
                self.counts["publish_failures"] += len(failed)
                log.debug("directory update not acknowledged by %s", failed)
                if retry:
                    for addr in failed:
                        if replies.get(addr) is None:  # no answer: not a refusal
                            self._keep_for(owner_at[addr], calls[addr])

    def _keep_for(self, owner: str, msg: m.Struct) -> None:
        """Keep an update an owner did not take (see :meth:`_send`)."""
        if isinstance(msg, m.Publish):
            self._keep(owner, msg.entries, [])
            self.counts["publish_deferred"] += len(msg.entries)
        elif isinstance(msg, m.Unpublish):
            self._keep(owner, [], msg.keys)
            self.counts["publish_deferred"] += len(msg.keys)
        if not self._deferred_check:
            self._deferred_check = self.clock() + DEFERRED_CHECK

    def _still_owned(
        self, owner: str, held: dict[bytes, int], ring: Ring
    ) -> tuple[list[tuple[bytes, int]], list[bytes]]:
        """The updates kept for ``owner`` of keys it still owns on ``ring``, to send it now:
        (publishes, withdrawals). Those of keys a ring change gave to other owners since are
        dropped: a publish sent to the old owner would leave an entry where no reader looks
        (a wrong one if the ring changed back), and the new owners get this node's entries
        from the re-publish that follows every ring change. A withdrawal is not passed on to
        them either: it may be older than a publish of the same key they got since (the
        chunk stored again), which it would undo; an entry the old owner handed them is
        removed by the anti-entropy repair."""
        keys = list(held)
        pubs: list[tuple[bytes, int]] = []
        unpubs: list[bytes] = []
        moved = 0
        for key, owners in zip(keys, ring.owners_many(keys), strict=True):
            where = held[key]
            if owner not in owners:
                moved += 1
            elif where >= 0:
                pubs.append((key, where))
            else:
                unpubs.append(key)
        self.counts["publish_deferred_moved"] += moved
        return pubs, unpubs

    def _keep(
        self, owner: str, entries: list[tuple[bytes, int]], keys: list[bytes]
    ) -> dict[bytes, int]:
        """Merge publishes and withdrawals into what is kept for ``owner`` (the latest per
        key); returns it. Past MAX_KEPT updates it is all dropped (repair brings back what
        the owner lacks)."""
        held = self._deferred.setdefault(owner, {})
        held.update(entries)
        held.update(dict.fromkeys(keys, -1))
        if len(held) > MAX_KEPT:
            self.counts["publish_deferred_dropped"] += len(held)
            del self._deferred[owner]
            log.warning(
                "directory owner %s did not take %d updates: dropped (repair restores them)",
                owner,
                len(held),
            )
        return held

    # -- anti-entropy ----------------------------------------------------------------------
    def _repair(self) -> float:
        """One anti-entropy round: compare, with every owner (this node included), the
        summary of the entries it should list for this node with its own; where a bucket
        differs, re-publish what it lacks or lists wrong and withdraw what this node does not
        hold. Entries of holders that are no members for ``UNKNOWN_ROUNDS`` rounds go.
        Returns the CPU seconds the comparison took (not the updates sent)."""
        cpu = time.thread_time()
        claims = self.claimed()
        with self._cond:
            if self._view_changed:
                return 0.0  # the rebalance comes first (and re-publishes everything)
            pending, self._taken = self._queue.take()
        if pending:  # claimed before the snapshot: reaches the owners before the comparison
            sending = time.thread_time()
            self._send_updates(pending)
            cpu += time.thread_time() - sending
        self.counts["repair_rounds"] += 1
        members, ring = self.current()
        self._purge_unknown(members)
        me, inc = self.me.node_id, self.me.incarnation
        held = dict(claims)  # each key once
        if not all(len(k) == KEY_SIZE for k in held):
            held = {k: w for k, w in held.items() if _valid(k, w)}
        keys = list(held)
        arcs = ring.arcs(keys) if len(ring) else np.zeros(len(keys), dtype=np.intp)
        expected = digest.Expected(keys, list(held.values()), inc, arcs, ring.arc_owners)
        calls: dict[str, m.Struct] = {}
        owner_at: dict[str, str] = {}
        for owner, info in members.items():
            summary = expected.summary(owner)
            if owner == me:
                buckets = digest.differing(summary, self.shard.summary(me))
                if buckets:
                    listed = self.shard.entries_of(me, buckets)
                    pubs, unpubs = expected.differences(me, buckets, listed)
                    self.shard.put(me, inc, pubs)
                    self.shard.remove(me, unpubs)
                    self._repaired(me, len(pubs) + len(unpubs))
            elif not self.client.suspect(info.control):  # a silent owner costs no wait
                calls[info.control] = m.Digest(0, me, *summary)
                owner_at[info.control] = owner
        fixes_pub: dict[str, list[tuple[bytes, int]]] = {}
        fixes_unpub: dict[str, list[m.Struct]] = {}
        for addr, reply in self.client.call_many(calls).items():
            if not isinstance(reply, m.DigestDiff) or not reply.buckets:
                continue
            owner = owner_at[addr]
            pubs, unpubs = expected.differences(owner, reply.buckets, reply.entries)
            fixes_pub[owner] = pubs
            fixes_unpub[owner] = [m.Unpublish(0, me, b) for b in _batches(unpubs)]
            self._repaired(owner, len(pubs) + len(unpubs))
        spent = time.thread_time() - cpu
        self._send_publishes(fixes_pub)
        self._send(fixes_unpub)
        return spent

    def _repaired(self, owner: str, n: int) -> None:
        if not n:
            return  # the buckets differed while entries changed: the next round tells
        self.counts["repair_differences"] += 1
        self.counts["repaired"] += n
        log.info("directory owner %s listed %d entries of this node wrong: repaired", owner, n)

    def _purge_unknown(self, members: Mapping[str, m.MemberInfo]) -> None:
        """Drop the entries of holders that have not been members for ``UNKNOWN_ROUNDS``
        rounds (a holder's publishes may come before its first heartbeat: not at once)."""
        absent = [h for h in self.shard.holders() if h not in members]
        self._unknown = {h: self._unknown.get(h, 0) + 1 for h in absent}
        gone = [h for h, rounds in self._unknown.items() if rounds >= UNKNOWN_ROUNDS]
        if gone:
            n = self.shard.drop_holders(gone)
            self.counts["unknown_purged"] += n
            for h in gone:
                del self._unknown[h]
            log.info(
                "directory: dropped %d entries of %d holders that are no members", n, len(gone)
            )

    # -- membership changes ----------------------------------------------------------------
    def _rebalance(self) -> None:
        old = self._applied
        new, new_ring = self.current()
        if old == new:
            return
        self.counts["rebalances"] += 1
        self._applied = dict(new)
        old_ring = Ring(old, self.vnodes, self.replicas)
        for nid in set(old) - set(new):
            self.client.forget(old[nid].control)
        # Entries of holders that left or restarted are stale (their pools are gone);
        # entries of holders this node has not heard of yet are kept.
        gone = {nid: info.incarnation for nid, info in old.items() if new.get(nid) != info}
        self.counts["purged"] += self.shard.purge(gone)
        me = self.me.node_id
        fresh = {nid for nid in new if nid not in old or old[nid] != new[nid]}

        def new_owners(key_owners_old: tuple[str, ...], key_owners: tuple[str, ...]) -> list[str]:
            return [o for o in key_owners if o != me and (o in fresh or o not in key_owners_old)]

        # 1. Entries this node's shard holds move to their new owners.
        handoff: dict[str, list[tuple[bytes, str, int, int]]] = {}
        items = self.shard.items()
        keys = [k for k, _ in items]
        dropped: list[bytes] = []
        for (key, entries), o_old, o_new in zip(
            items, old_ring.owners_many(keys), new_ring.owners_many(keys), strict=True
        ):
            for owner in new_owners(o_old, o_new):
                handoff.setdefault(owner, []).extend((key, *e) for e in entries)
            if me not in o_new:
                dropped.append(key)
        self.shard.drop(dropped)
        handed_off = sum(len(v) for v in handoff.values())
        self.counts["handoff_sent"] += handed_off
        self._send({o: [m.Handoff(0, b) for b in _batches(e)] for o, e in handoff.items()})

        # 2. What this node holds is re-published to every owner: publishes made while the
        # views of the members differed may have gone to owners that no longer are.
        pubs, _ = self._route({key: int(where) for key, where in self.held()}, new_ring)
        republished = sum(len(v) for v in pubs.values())
        self.counts["republished"] += republished
        self._defer_suspect(pubs, {})
        self._send_publishes(pubs)
        log.info(
            "directory rebalanced: %d entries kept, %d handed off, %d dropped, %d re-published",
            len(self.shard),
            handed_off,
            len(dropped),
            republished,
        )

    # -- reads -----------------------------------------------------------------------------
    def resolve(self, keys: Sequence[bytes]) -> list[list[Location]]:
        if not keys:
            return []
        members, ring = self.current()
        version, live = self.membership.view()
        out, rpcs, skipped = resolve_keys(
            keys, members, ring, self.client, self.me.node_id, self.shard.get, live
        )
        now, live = self.membership.view()
        if now != version:  # members left during the round trip: their entries go too
            out = [[loc for loc in locs if loc.holder in live] for locs in out]
        self.counts["resolves"] += 1
        self.counts["resolved_keys"] += len(keys)
        self.counts["resolve_rpcs"] += rpcs
        self.counts["resolve_skipped"] += skipped
        self.counts["resolve_found"] += sum(1 for locs in out if locs)
        return out

    # -- control handlers (on the control server thread) -----------------------------------
    def on_publish(self, req: m.Publish) -> m.Done | m.Refused:
        if req.holder == self.me.node_id:
            return m.Refused(req.rid, _NOT_FROM_OUTSIDE)
        self.counts["served_publish"] += 1
        entries = [(k, w) for k, w in req.entries if _valid(k, w)]
        return m.Done(req.rid, self.shard.put(req.holder, req.incarnation, entries))

    def on_unpublish(self, req: m.Unpublish) -> m.Done | m.Refused:
        if req.holder == self.me.node_id:
            return m.Refused(req.rid, _NOT_FROM_OUTSIDE)
        return m.Done(req.rid, self.shard.remove(req.holder, req.keys))

    def on_handoff(self, req: m.Handoff) -> m.Done:
        # This node's own entries are its own to write (see on_publish): never handed over.
        me = self.me.node_id
        n = self.shard.put_many([e for e in req.entries if _valid(e[0], e[3]) and e[1] != me])
        self.counts["handoff_received"] += n
        return m.Done(req.rid, n)

    def on_digest(self, req: m.Digest) -> m.DigestDiff | m.Refused:
        """A holder's summary of what this node should list for it: the buckets that differ
        and this node's entries of that holder in them (at most ``MAX_LISTED``; the next
        round lists the rest)."""
        if len(req.counts) != digest.BUCKETS or len(req.hashes) != digest.BUCKETS:
            return m.Refused(req.rid, f"a directory digest has {digest.BUCKETS} buckets")
        self.counts["served_digests"] += 1
        buckets = digest.differing((req.counts, req.hashes), self.shard.summary(req.holder))
        entries = self.shard.entries_of(req.holder, buckets) if buckets else []
        return m.DigestDiff(req.rid, buckets, entries[:MAX_LISTED])

    def on_resolve(self, req: m.Resolve) -> m.Resolved:
        self.counts["served_resolves"] += 1
        holders: dict[str, int] = {}
        positions: list[int] = []
        holder_of: list[int] = []
        tiers: list[int] = []
        index, at, tier = holders.setdefault, positions.append, tiers.append
        held = holder_of.append
        for pos, entries in enumerate(self.shard.get(req.keys)):
            for holder, _, where in entries:
                at(pos)
                held(index(holder, len(holders)))
                tier(where)
        columns = found_columns.of_lists(positions, holder_of, tiers)
        return m.Resolved(req.rid, list(holders), *columns)

    def stats(self) -> dict[str, object]:
        return {"entries": len(self.shard), "members": len(self.ring), **self.counts}


def _batches(items: list[_T]) -> list[list[_T]]:
    return [items[i : i + BATCH] for i in range(0, len(items), BATCH)]
