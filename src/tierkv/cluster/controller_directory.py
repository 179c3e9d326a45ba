"""The directory of controller mode: a `tierkv controller` knows which server holds which
key (:mod:`tierkv.controller`); this is a server's side of it.

One thread talks to the controller, so everything it sends is in the order it happened:

- (re)registration and a full sync (everything :attr:`held` returns, in parts of
  :data:`BATCH` keys), whenever the controller does not know this boot of the server (first
  start, the controller restarted, a report refused);
- reports: ``publish``/``unpublish`` only queue (a store never waits for the network,
  unless its commit waits for its ticket, :meth:`wait_published`); the thread sends what
  queued as one report with the next sequence number. Stores and local reads go on while a
  full sync is being sent; what they queue meanwhile follows the sync, in order;
- heartbeats every ``interval`` seconds while registered; the reply says whether the
  controller knows this boot of the server (its boot token tells a restarted controller).
  Unregistered, it sends none: its registration attempts stand for them.

Registrations that fail (the controller away, or refusing: another cluster token, no free
instance slot, a full sync deferred while other servers' syncs hold the room) are retried
every second (or every ``interval``, if shorter) and logged as one
:class:`~tierkv.logs.FailureLog`: the first at WARNING with its cause, a summary at most once
a minute, one INFO line when registered again.

``resolve`` is one round trip to the controller. The holders it names come with their data
addresses, which :meth:`get` hands to the peer tier (the membership's role in ring mode).
A controller that timed out is *suspect* until it answers again (the client probes it in
the background, :class:`~tierkv.cluster.control.ControlClient`): meanwhile ``resolve``
answers "not found" at once and commits do not wait for their reports, so a silent or
unreachable controller costs one timeout, not one per local miss.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from tierkv.cluster import controller_messages as cm
from tierkv.cluster import found_columns
from tierkv.cluster import messages as m
from tierkv.cluster.control import ControlClient
from tierkv.cluster.directory import Directory, Location, PublishQueue, Where
from tierkv.keys import KEY_SIZE
from tierkv.logs import FailureLog

log = logging.getLogger(__name__)

BATCH = 65536  # keys per report or sync part
# The largest message a server sends the controller: a report or sync part of BATCH keys
# (each 32 bytes, its tier a byte, or 32 bytes as an eviction), or a registration naming
# MAX_NAMESPACES namespaces (a model name of MAX_MODEL characters, up to 4 bytes each in
# UTF-8, a digest and a few integers), and the message around them. A controller accepting
# less could never take a full sync.
MAX_PART_BYTES = max(BATCH * 33, cm.MAX_NAMESPACES * (4 * cm.MAX_MODEL + 64)) + 2**20


class ControllerDirectory(Directory):
    def __init__(
        self,
        controller: str,
        me: m.MemberInfo,
        token: str,
        timeout: float,
        held: Callable[[], list[tuple[bytes, Where]]],
        namespaces: Callable[[], list[cm.NamespaceInfo]] = list,
        interval: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.controller = controller
        self.me = me
        self.client = ControlClient(token, timeout, decoder=cm.reply_decoder)
        self.held = held
        self.namespaces = namespaces
        self.interval = interval
        self.clock = clock
        self._members: dict[str, m.MemberInfo] = {me.node_id: me}
        self._cond = threading.Condition()
        self._queue = PublishQueue()
        self._stop = False
        self._registered = False
        self._namespaces_changed = False
        self._seq = 0
        self._controller_boot = 0
        self._thread: threading.Thread | None = None
        self.failures = FailureLog(f"controller {controller}", log)
        self.counts: dict[str, int] = {
            "registrations": 0,
            "syncs": 0,
            "reports": 0,
            "reports_failed": 0,
            "heartbeats": 0,
            "resolves": 0,
            "resolved_keys": 0,
            "resolve_found": 0,
            "resolve_failures": 0,
            "resolve_skipped": 0,  # resolves answered "none" at once: controller suspect
            "publish_waits_skipped": 0,  # commits that did not wait: controller suspect
            "published": 0,
            "unpublished": 0,
        }

    # -- the Directory interface -----------------------------------------------------------
    def publish(self, keys: Sequence[bytes], where: Where = Where.POOL) -> int:
        with self._cond:
            ticket = self._queue.add(keys, where)
            if keys:
                self._cond.notify()
            return ticket

    def unpublish(self, keys: Sequence[bytes]) -> None:
        if not keys:
            return
        with self._cond:
            self._queue.withdraw(keys)
            self._cond.notify()

    def wait_published(self, ticket: int, timeout: float) -> bool:
        """Wait until the report carrying ``ticket`` is acknowledged. While this server is
        not registered (controller away, a full sync under way) or the controller is
        suspect, nothing is waited for: the next full sync, or the reports right after it,
        carry the keys."""
        if self.client.suspect(self.controller):
            self.counts["publish_waits_skipped"] += 1
            return True
        with self._cond:
            return self._cond.wait_for(
                lambda: self._queue.done(ticket) or self._stop or not self._registered, timeout
            )

    def resolve(self, keys: Sequence[bytes]) -> list[list[Location]]:
        if not keys:
            return []
        self.counts["resolves"] += 1
        self.counts["resolved_keys"] += len(keys)
        out: list[list[Location]] = [[] for _ in keys]
        if self.client.suspect(self.controller):
            self.counts["resolve_skipped"] += 1
            return out  # misses at once, never a wait: the probe brings it back
        reply = self.client.call(self.controller, m.Resolve(0, list(keys)))
        if not isinstance(reply, cm.Located):
            self.counts["resolve_failures"] += 1
            return out  # a controller that cannot answer: misses, never wrong answers
        with self._cond:
            for info in reply.holders:
                self._members[info.node_id] = info
        rows = found_columns.groups(
            reply.positions, reply.holder_of, reply.tiers, len(keys), len(reply.holders)
        )
        for h, where, at in rows or ():
            if where in (Where.POOL, Where.DISK):
                loc = Location(reply.holders[h].node_id, Where(where))
                for pos in at.tolist():
                    out[pos].append(loc)
        self.counts["resolve_found"] += sum(1 for locs in out if locs)
        return out

    def namespaces_changed(self) -> None:
        """The engines' namespaces changed: the sender thread tells the controller."""
        with self._cond:
            self._namespaces_changed = True
            self._cond.notify()

    def get(self, node_id: str) -> m.MemberInfo | None:
        """A holder's member record (data address), as the controller last named it."""
        with self._cond:
            return self._members.get(node_id)

    # -- the sender thread -----------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="tierkv-ctl-dir", daemon=True)
        self._thread.start()

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        if self._registered and not self.client.suspect(self.controller):
            self.client.call(
                self.controller, cm.Deregister(0, self.me.node_id, self.me.incarnation)
            )
        self.client.close()

    def _run(self) -> None:
        next_beat = self.clock()
        retry_at = 0.0  # a failed registration is tried again after a pause
        while True:
            with self._cond:
                # Unregistered, only the next registration attempt is due (a heartbeat's
                # time left in the past by a failed one made this loop spin).
                wake = next_beat if self._registered else retry_at
                self._cond.wait_for(
                    functools.partial(self._has_work, wake), max(0.0, wake - self.clock())
                )
                if self._stop:
                    return
                pending, taken = self._queue.take()
                tell_namespaces, self._namespaces_changed = self._namespaces_changed, False
            try:
                if not self._registered:
                    self._register_and_sync()
                    retry_at = self.clock() + min(1.0, self.interval)
                else:
                    if tell_namespaces:
                        self._send_namespaces()
                    if pending:
                        self._report(pending)
                # Unregistered, the registration attempts stand for heartbeats: the
                # controller has no sync of this boot to compare a sequence with.
                if self._registered and self.clock() >= next_beat:
                    next_beat = self.clock() + self.interval
                    self._heartbeat()
            except Exception:
                log.exception("controller directory: sending failed")
                self._set_registered(False)
                retry_at = self.clock() + min(1.0, self.interval)  # not at once, in a loop
            with self._cond:
                self._queue.mark_sent(taken)
                self._cond.notify_all()

    def _has_work(self, wake: float) -> bool:
        return (
            self._stop
            or self.clock() >= wake
            or (self._registered and (bool(self._queue) or self._namespaces_changed))
        )

    def _register_and_sync(self) -> None:
        reply = self.client.call(self.controller, cm.Register(0, self.me, self.namespaces()))
        if not isinstance(reply, cm.Registered):
            self.failures.failed("registering this server", _why(reply))
            return
        self._controller_boot = reply.controller_boot
        self.counts["registrations"] += 1
        held = self.held()
        keys = b"".join(k for k, _ in held)
        tiers = bytes(int(w) for _, w in held)
        parts = max(1, -(-len(held) // BATCH))
        for part in range(parts):
            lo, hi = part * BATCH, (part + 1) * BATCH
            ack = self.client.call(
                self.controller,
                cm.SyncBatch(
                    0,
                    self.me.node_id,
                    self.me.incarnation,
                    self._seq,
                    part,
                    part == parts - 1,
                    keys[lo * KEY_SIZE : hi * KEY_SIZE],
                    tiers[lo:hi],
                    len(held),
                ),
            )
            if not (isinstance(ack, cm.Ack) and ack.ok):
                self.failures.failed(f"full sync part {part}", _why(ack))
                return
        self.failures.ok()
        self._set_registered(True)
        self.counts["syncs"] += 1
        log.info("registered with controller %s; full sync of %d keys", self.controller, len(held))

    def _send_namespaces(self) -> None:
        me = self.me
        reply = self.client.call(
            self.controller, cm.Namespaces(0, me.node_id, me.incarnation, self.namespaces())
        )
        if not isinstance(reply, m.Done):  # registering again sends them
            log.warning("controller did not take this server's namespaces: %r", reply)
            self._set_registered(False)

    def _report(self, pending: dict[bytes, int]) -> None:
        items = list(pending.items())
        for lo in range(0, len(items), BATCH):
            chunk = items[lo : lo + BATCH]
            admits = [(k, w) for k, w in chunk if w >= 0]
            evicts = [k for k, w in chunk if w < 0]
            self.counts["published"] += len(admits)
            self.counts["unpublished"] += len(evicts)
            tiers = np.fromiter((w for _, w in admits), dtype=np.int8, count=len(admits))
            ack = self.client.call(
                self.controller,
                cm.Report(
                    0,
                    self.me.node_id,
                    self.me.incarnation,
                    self._seq + 1,
                    b"".join(k for k, _ in admits),
                    tiers.tobytes(),
                    b"".join(evicts),
                ),
            )
            if not (isinstance(ack, cm.Ack) and ack.ok):
                # Not applied (controller restarted, a gap, a timeout): a full sync repairs
                # everything, these updates included.
                self.counts["reports_failed"] += 1
                self._set_registered(False)
                return
            self._seq += 1
            self.counts["reports"] += 1

    def _heartbeat(self) -> None:
        reply = self.client.call(
            self.controller, cm.Heartbeat(0, self.me.node_id, self.me.incarnation, self._seq)
        )
        self.counts["heartbeats"] += 1
        if isinstance(reply, cm.HeartbeatReply) and (
            not reply.known or reply.controller_boot != self._controller_boot
        ):
            log.info(
                "controller %s does not know this server (restarted?): re-registering",
                self.controller,
            )
            self._set_registered(False)

    def _set_registered(self, registered: bool) -> None:
        with self._cond:
            self._registered = registered
            self._cond.notify_all()

    def stats(self) -> dict[str, object]:
        return {
            "mode": "controller",
            "registration_failures": self.failures.total_failures,
            "controller": self.controller,
            "registered": self._registered,
            "seq": self._seq,
            "controller_suspect": self.client.suspect(self.controller),
            "calls": self.client.calls,
            "timeouts": self.client.timeouts,
            "suspected": self.client.suspected,
            "probes": self.client.probes,
            **self.counts,
        }


def _why(reply: object) -> str:
    """A failed call's cause, for the log."""
    if reply is None:
        return "no answer"
    if isinstance(reply, (m.Refused, cm.Ack)):
        return f"refused: {reply.reason}"
    return f"unexpected reply {type(reply).__name__}"
