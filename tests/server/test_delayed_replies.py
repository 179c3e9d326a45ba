"""Replies the RPC loop holds or delays: a commit's wait for the cluster directory stays
within what its client waits for; a held query that fails is answered.

In a cluster, COMMIT_STORE replies once the directory has the chunks (read-your-writes), at
most ``commit_publish_timeout``. A client whose reply timeout equals that wait (an engine's
link: 2 s each by default) gave up on a commit the server made, and counted the server
down; the client now asks for at most half its timeout. A real server and client, with a
publisher that records the wait it is given instead of a directory.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest

from support.servers import CHUNK_SIZE, chunk_data, in_process_config, register
from tierkv import protocol as p
from tierkv.client import Client, ServerError
from tierkv.server.wiring import Server


class RecordingPublisher:
    def __init__(self) -> None:
        self.waits: list[float] = []

    def publish_committed(self, keys: Sequence[bytes], lengths: Sequence[int]) -> int:
        return len(self.waits)

    def wait_published(self, ticket: int, timeout: float) -> bool:
        self.waits.append(timeout)
        return True


def test_a_commit_waits_for_the_directory_within_its_clients_timeout(tmp_path: Path) -> None:
    cfg = in_process_config(tmp_path)
    server = Server(cfg).start_background()
    try:
        publisher = RecordingPublisher()
        server.service.publish_commits(publisher, 5.0)
        tokens = list(range(CHUNK_SIZE * 5))
        with Client(server.endpoint, timeout=2.0) as client:
            register(client)
            assert client.store(tokens[:CHUNK_SIZE], [chunk_data(tokens, 0)]).stored == [0]
            client.timeout = 60.0  # longer than the server's own limit: that limit holds
            stored = client.store(tokens[: 2 * CHUNK_SIZE], [chunk_data(tokens, 1)], first_chunk=1)
            assert stored.stored == [1]
            # A client that does not say (an older one): the server's limit. (Nothing was
            # copied into the slot: this test reads no bytes back.)
            prepared = client.prepare_store(tokens[: 3 * CHUNK_SIZE], first_chunk=2)
            reply = client._channel.call(
                p.CommitStore(client._channel.rid(), client._token(), prepared.slots.lease)
            )
            assert isinstance(reply, p.Committed) and reply.committed == 1
            # Bad waits: a negative one is the server's limit, a huge one capped by it.
            for i, wait_ms in enumerate((-5, 10**15)):
                prepared = client.prepare_store(tokens[: CHUNK_SIZE * (4 + i)], first_chunk=3 + i)
                reply = client._channel.call(
                    p.CommitStore(
                        client._channel.rid(), client._token(), prepared.slots.lease, None, wait_ms
                    )
                )
                assert isinstance(reply, p.Committed) and reply.committed == 1
        assert publisher.waits == [1.0, 5.0, 5.0, 5.0, 5.0]
    finally:
        server.stop()


def test_a_held_query_that_fails_is_answered_and_the_loop_serves_on(tmp_path: Path) -> None:
    """QUERY_PREFETCH with a wait is held on the RPC loop's thread: an error there must
    become the query's answer, never end the loop (every client would lose the server)."""
    server = Server(in_process_config(tmp_path)).start_background()
    try:

        def broken(conn: object, req: object) -> object:
            raise RuntimeError("a defect in holding the query")

        server.rpc._held.hold = broken  # type: ignore[method-assign]
        with Client(server.endpoint) as client:
            register(client)
            with pytest.raises(ServerError, match="internal error holding the query"):
                client.query_prefetch("r", wait=0.05)
            assert client.stats().clients == 1  # the loop serves on
    finally:
        server.stop()
