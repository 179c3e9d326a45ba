"""The engine client's replies and registration across what engines do to it: replies to
requests it did not wait for that arrive after a later call's (a cluster server answers a
commit waiting for the directory after later requests), forked children, and retrieves that
name chunks the wrong way. Real servers."""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np
import pytest

from support.clusterkit import converged, start_node, wait_for
from support.servers import CHUNK_SHAPE, CHUNK_SIZE, ServerProcess, chunk_data, register
from tierkv import framing

pytestmark = pytest.mark.processes


def test_an_unconfirmed_commits_answer_read_with_a_later_reply_is_kept(
    server_factory: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cluster server answers a commit (which waits for the directory) after a later fast
    request of the same connection; both replies read at once: the commit's answer is taken
    in (before, it was dropped: settle() waited out its timeout, disconnected, and reported
    the commit as short though it committed every chunk)."""
    node = start_node(server_factory, [], seed_self=True)
    wait_for(lambda: converged([node]))
    client = node.client()
    register(client)
    send = framing.Connection.send

    def send_then_pause(self: framing.Connection, payload: Any, deadline: float) -> None:
        send(self, payload, deadline)
        time.sleep(0.2)  # the engine's thread descheduled: both replies are there to read

    try:
        for r in range(3):
            tokens = list(range(r * 10 * CHUNK_SIZE, (r * 10 + 2) * CHUNK_SIZE))
            prepared = client.prepare_store(tokens)
            data = [chunk_data(tokens, i) for i in range(2)]
            client.finish_store(prepared, data, confirm=False)
            monkeypatch.setattr(framing.Connection, "send", send_then_pause)
            client.ping()
            monkeypatch.setattr(framing.Connection, "send", send)
            assert client.settle(5.0) == 0
            assert client.commit_shortfalls() == {}
            assert client.lookup(tokens).hits == 2
    finally:
        client.close()


def test_a_forked_child_neither_reads_the_parents_replies_nor_unregisters_it(
    server: ServerProcess,
) -> None:
    """A child forked with the client (a worker pool, a subprocess started by fork) that
    settles or closes it: the parent's pending replies, registration and locks stay its own
    (before, the child's settle read them, and its close unregistered the parent)."""
    client = server.client()
    register(client)
    tokens = list(range(2 * CHUNK_SIZE))
    prepared = client.prepare_store(tokens)
    client.finish_store(prepared, [chunk_data(tokens, i) for i in range(2)], confirm=False)
    pid = os.fork()
    if pid == 0:  # the child: settles (nothing of its own) and closes
        try:
            code = 0 if client.settle(2.0) == 0 else 3
            client.close()
        except BaseException:
            code = 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    try:
        assert client.settle(5.0) == 0 and client.commit_shortfalls() == {}
        assert client.lookup(tokens, request_id="r").hits == 2
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(2)]
        assert client.retrieve(request_id="r", out=out).retrieved == [0, 1]
        assert all(np.array_equal(out[i], chunk_data(tokens, i)) for i in range(2))
    finally:
        client.close()


def test_a_retrieve_that_names_its_chunks_the_wrong_way_is_refused(server: ServerProcess) -> None:
    """``first_chunk`` with a lookup's request id (whose chunks start at 0), or ``out``
    with fewer arrays than the chunks: a ValueError, nothing copied, the locks released
    (before: chunks put in the wrong arrays, or an IndexError halfway)."""
    client = server.client()
    register(client)
    tokens = list(range(3 * CHUNK_SIZE))
    client.store(tokens, [chunk_data(tokens, i) for i in range(3)])
    try:
        assert client.lookup(tokens, request_id="a").hits == 3
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(3)]
        with pytest.raises(ValueError, match="first_chunk"):
            client.retrieve(request_id="a", first_chunk=1, out=out)
        assert not any(a.any() for a in out)
        assert client.retrieve(request_id="a", out=out).retrieved == [0, 1, 2]  # still there
        assert all(np.array_equal(out[i], chunk_data(tokens, i)) for i in range(3))
        assert client.lookup(tokens, request_id="b").hits == 3
        short = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(2)]
        with pytest.raises(ValueError, match="out holds 2"):
            client.retrieve(request_id="b", out=short)
        assert not any(a.any() for a in short)
        assert client.stats().read_locked == 0
    finally:
        client.close()
