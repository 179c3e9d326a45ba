"""An engine's reader of its server's chunk feed, off the engine's own thread.

:class:`FeedPoller` runs a :class:`~tierkv.chunk_follower.ChunkFollower` over the engine's
:class:`~tierkv.integrations.link.ServerLink` on a daemon thread that reads the feed every
``interval`` seconds; the engine takes the changes (:meth:`FeedPoller.take`) without ever
waiting on the server: a slow or dead server delays the reads, never the engine's step.

A read that fails (the server is down or stalled: the link's fallback, logged by the link,
which then stays away for its retry interval) withdraws everything held: while the link is
down every lookup is a miss, so no chunk may be announced as loadable. The next read that
succeeds starts from a snapshot, which re-announces what the pool holds (a restarted
server's feed is another epoch: the old server's chunks stay withdrawn).

Nobody may take the changes for a long time (vLLM takes them at the end of each engine step:
an idle engine takes none). The poller reads only while fewer than
:attr:`FeedPoller.max_pending` changes wait (a read in progress stops there, or after one
snapshot's difference), so memory stays bounded; when they are taken it reads on, from a snapshot if
the feed dropped what it missed meanwhile (the follower resyncs), so the engine still
converges to what the pool holds.
"""

from __future__ import annotations

import logging
import threading

from tierkv import protocol as p
from tierkv.chunk_follower import Change, ChunkFollower
from tierkv.client import Client
from tierkv.integrations.link import ServerLink

log = logging.getLogger(__name__)

MAX_PENDING = 65536  # changes waiting to be taken before the poller stops reading


class FeedPoller:
    """The chunk feed of a link's client (its engine's namespaces), read on a thread."""

    def __init__(
        self,
        link: ServerLink,
        interval: float,
        name: str,
        limit: int = 4096,
        max_pending: int = MAX_PENDING,
    ) -> None:
        if interval <= 0:
            raise ValueError("interval must be positive")
        self.link = link
        self.interval = interval
        self.max_pending = max_pending
        self.skipped_reads = 0  # reads not made: max_pending changes were waiting
        self._client: Client | None = None  # the link's, during a read (poll thread only)
        self.follower = ChunkFollower(self._read_events, self._read_snapshot, limit)
        self.failed_reads = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> FeedPoller:
        self._thread.start()
        return self

    def _read_events(self, after: int, limit: int) -> p.ChunkEvents:
        assert self._client is not None
        return self._client.read_chunk_events(after, limit)

    def _read_snapshot(self) -> tuple[int, int, list[p.ChunkEvent]]:
        assert self._client is not None
        return self._client.read_chunk_snapshot()

    def poll(self) -> bool:
        """Read the feed until caught up (the polling thread; tests call it directly);
        False if the read failed, and everything held was withdrawn. No read while
        :attr:`max_pending` changes wait to be taken."""
        pending = self.follower.pending
        if pending >= self.max_pending:
            self.skipped_reads += 1
            return True

        def read(client: Client) -> bool:
            self._client = client
            try:
                self.follower.poll(room=self.max_pending - pending)
            finally:
                self._client = None
            return True

        if self.link.call("read of the chunk feed", read, False):
            return True
        self.failed_reads += 1
        self.follower.forget()
        return False

    def take(self) -> list[Change]:
        """The changes read since the last take, in order (any thread, never blocks on the
        server)."""
        return self.follower.take()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.poll()
            except Exception:  # never let the thread die: events stop, the engine runs on
                log.exception("tierkv: reading the chunk feed failed")
                self.follower.forget()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the thread (waiting at most ``timeout`` seconds for a read in progress)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout)
