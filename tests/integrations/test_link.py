"""The engine integrations' server link (circuit breaker around a registered client), against
a real server: needs no engine."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest

from support.servers import CHUNK_SIZE, ServerProcess, chunk_data, register
from tierkv import framing
from tierkv.client import Client, NotRegisteredError, ServerUnavailableError
from tierkv.integrations.link import ServerLink
from tierkv.integrations.vllm.settings import ConnectorSettings, SettingsError
from tierkv.protocol import ErrorCode


def test_a_wrong_auth_token_backs_off_instead_of_registering_again(
    server_factory: Callable[..., ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    srv = server_factory(extra=["--auth-token", "right"])
    settings = ConnectorSettings.from_extra_config(
        {"endpoint": srv.endpoint, "auth_token": "wrong", "retry_interval": 600}
    )

    def register_engine(client: Client) -> None:
        register(client)

    link = ServerLink(settings, register_engine, "worker rank 0", logging.getLogger("engine"))
    caplog.set_level(logging.DEBUG, logger="engine")
    try:
        for _ in range(5):
            assert link.call("lookup", lambda c: 1, 0) == 0  # a miss, never an exception
    finally:
        link.close()
    assert link.failures == 1  # one refused REGISTER, then plain misses: no retry loop
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "refused this engine's auth token" in warnings[0], warnings
    assert "TIERKV_AUTH_TOKEN" in warnings[0]
    with Client(srv.endpoint, auth_token="right") as admin:
        assert admin.stats().errors.get("unauthorized") == 1


def test_the_links_client_spins_for_replies_as_configured(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """``reply_spin_us`` reaches the client's connection (default 100 us, 0: sleep at once);
    a negative or non-numeric value is refused by name."""
    srv = server_factory()
    for extra, spin in (
        ({}, 100e-6),
        ({"reply_spin_us": "0"}, 0.0),
        ({"reply_spin_us": 250}, 250e-6),
    ):
        settings = ConnectorSettings.from_extra_config({"endpoint": srv.endpoint, **extra})
        link = ServerLink(settings, register, "worker rank 0", logging.getLogger("engine"))
        try:
            assert link.call("ping", lambda c: c.ping() or 1, 0) == 1
            client = link.client()
            assert client is not None and client._channel.conn is not None
            assert client.reply_spin == pytest.approx(spin)
            assert client._channel.conn.spin == pytest.approx(spin)
        finally:
            link.close()
    for bad in (-1, "soon"):
        with pytest.raises(SettingsError, match="reply_spin_us"):
            ConnectorSettings.from_extra_config({"endpoint": srv.endpoint, "reply_spin_us": bad})
    with pytest.raises(ValueError, match="reply_spin"):
        Client(srv.endpoint, reply_spin=-0.001)


def test_a_restarted_server_is_registered_with_again_and_the_call_retried(
    server_factory: Callable[..., ServerProcess], caplog: pytest.LogCaptureFixture
) -> None:
    """kill -9 and a restart at the same endpoint: the first call after it meets
    NotRegisteredError, registers again and retries once; the caller gets the call's real
    result, never an exception (a server that keeps refusing: the fallback)."""
    srv = server_factory()
    settings = ConnectorSettings.from_extra_config({"endpoint": srv.endpoint})
    registrations: list[int] = []

    def register_engine(client: Client) -> None:
        registrations.append(register(client).client)

    link = ServerLink(settings, register_engine, "worker rank 0", logging.getLogger("engine"))
    caplog.set_level(logging.INFO, logger="engine")
    tokens = list(range(2 * CHUNK_SIZE))
    chunks = [chunk_data(tokens, i) for i in range(2)]
    try:
        stored = link.call("store", lambda c: len(c.store(tokens, chunks).stored), -1)
        assert stored == 2 and len(registrations) == 1
        srv.kill()
        srv.start()
        for _ in range(3):  # the first meets the restart; none raises
            stored = link.call("store", lambda c: len(c.store(tokens, chunks).stored), -1)
            assert stored in (0, 2), stored
        assert len(registrations) == 2  # once again, not once per call
        assert link.failures == 0  # an answer, not an outage
        hits = link.call("lookup", lambda c: c.lookup(tokens, wait=True).hits, -1)
        assert hits == 2  # the chunks stored after the restart
    finally:
        link.close()
    assert any("registering again" in r.getMessage() for r in caplog.records)


def test_a_killed_server_costs_one_refused_connect_per_retry_interval(
    server_factory: Callable[..., ServerProcess],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """kill -9 leaves the socket file behind, where nothing accepts connections any more: the
    link's call tries once, gets the fallback and marks the server down (one WARNING saying
    why), instead of retrying the connect for its whole timeout on the engine's thread. A
    plain client still waits for a server that is (re)starting, as before."""
    srv = server_factory()
    settings = ConnectorSettings.from_extra_config(
        {"endpoint": srv.endpoint, "timeout": 30, "retry_interval": 0}
    )
    link = ServerLink(settings, register, "worker rank 0", logging.getLogger("engine"))
    attempts: list[str] = []
    real_connect = framing.connect

    def counted(endpoint: str, timeout: float) -> socket.socket:
        attempts.append(endpoint)
        return real_connect(endpoint, timeout)

    monkeypatch.setattr(framing, "connect", counted)
    caplog.set_level(logging.INFO, logger="engine")
    try:
        assert link.call("ping", lambda c: c.ping() or 1, 0) == 1
        srv.kill()
        assert os.path.exists(srv.endpoint[len("ipc://") :])  # the socket file stays
        attempts.clear()
        for _ in range(3):  # retry_interval 0: each call asks the server again
            assert link.call("ping", lambda c: c.ping() or 1, 0) == 0
        assert len(attempts) == 3  # one connect each, none retried for 30 s
        assert link.failures == 3
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "no tierkv server accepts connections" in warnings[0]
        # Back: the next call connects, registers again (the server forgot it) and answers.
        srv.start()
        assert link.call("ping", lambda c: c.ping() or 1, 0) == 1
        assert any("is back after" in r.getMessage() for r in caplog.records)
    finally:
        link.close()

    # A plain client (wait_for_server=True, the default) retries until its timeout, so that
    # it connects to a server that is starting.
    srv.kill()
    attempts.clear()
    with pytest.raises(ServerUnavailableError, match="no reply"):
        Client(srv.endpoint, timeout=0.3).ping()
    assert len(attempts) > 1


def test_a_server_that_keeps_refusing_the_client_gives_the_fallback(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """NotRegisteredError again right after registering again: the fallback, no loop."""
    srv = server_factory()
    settings = ConnectorSettings.from_extra_config({"endpoint": srv.endpoint})
    link = ServerLink(settings, register, "worker rank 0", logging.getLogger("engine"))
    calls: list[int] = []

    def refused(client: Client) -> int:
        calls.append(1)
        raise NotRegisteredError(ErrorCode.NOT_REGISTERED, "who are you?")

    try:
        assert link.call("lookup", refused, -1) == -1
        assert len(calls) == 2
    finally:
        link.close()


def test_threads_meeting_a_restart_at_once_register_again_only_once(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """Eight threads' calls all refused with NotRegisteredError at the same moment (the server
    restarted under them): one registration follows, not one per thread (a second
    registration would be a second client of the same rank), and every call answers."""
    srv = server_factory()
    settings = ConnectorSettings.from_extra_config({"endpoint": srv.endpoint})
    registrations: list[int] = []

    def register_engine(client: Client) -> None:
        registrations.append(register(client).client)

    link = ServerLink(settings, register_engine, "worker rank 0", logging.getLogger("engine"))
    tokens = list(range(2 * CHUNK_SIZE))
    chunks = [chunk_data(tokens, i) for i in range(2)]
    threads = 8
    together = threading.Barrier(threads)

    def store(client: Client) -> int:
        try:
            return len(client.store(tokens, chunks).stored)
        except NotRegisteredError:
            with contextlib.suppress(threading.BrokenBarrierError):
                together.wait(30)  # every thread refused before any registers again
            raise

    try:
        assert link.call("store", store, -1) == 2
        srv.kill()
        srv.start()
        with ThreadPoolExecutor(threads) as pool:
            answers = list(pool.map(lambda _: link.call("store", store, -1), range(threads)))
        assert all(a in (0, 2) for a in answers), answers
        assert len(registrations) == 2, registrations
        with Client(srv.endpoint) as admin:
            assert admin.stats().clients == 1
    finally:
        link.close()


def test_the_feed_poller_stops_reading_while_its_changes_wait_and_then_converges(
    server_factory: Callable[..., ServerProcess],
) -> None:
    """An engine that takes no changes (an idle vLLM engine steps, and takes, none) holds at
    most ``max_pending`` of them: the poller stops reading the feed; once they are taken it
    reads on (a resync when the feed dropped what it missed) and ends at the pool's truth."""
    from tierkv.integrations.feed_poller import FeedPoller

    srv = server_factory(extra=["--chunk-feed-events", "4"])
    settings = ConnectorSettings.from_extra_config({"endpoint": srv.endpoint})
    link = ServerLink(settings, register, "scheduler", logging.getLogger("engine"))
    poller = FeedPoller(link, 1.0, "test-feed", max_pending=3)  # polled by hand: no thread
    try:
        with srv.client(timeout=5.0) as engine:
            register(engine)

            def store(first: int, n: int) -> list[bytes]:
                tokens = list(range(first, first + n * CHUNK_SIZE))
                notes = [b"note %d" % (first + i) for i in range(n)]
                data = [chunk_data(tokens, i) for i in range(n)]
                assert engine.store(tokens, data, notes=notes).stored == list(range(n))
                return notes

            first = store(100, 2)
            assert poller.poll() and [c.note for c in poller.take()] == first
            second = store(5000, 3)
            assert poller.poll() and poller.follower.pending == 3
            store(9000, 3)  # the feed keeps 4 events: these are dropped once cleared below
            assert poller.poll() and poller.skipped_reads == 1  # 3 wait: no read
            assert poller.follower.pending == 3
            assert engine.clear() == 8
            taken = poller.take()
            assert [c.note for c in taken] == second and all(c.held for c in taken)
            assert poller.poll()  # behind what the feed dropped: a resync
            assert poller.follower.resyncs == 2  # the first read, and this one
            removals = poller.take()
            assert not any(c.held for c in removals)
            assert sorted(c.note for c in removals) == sorted(first + second)
            assert poller.follower.held == {} and poller.follower.pending == 0
    finally:
        poller.close()
        link.close()
