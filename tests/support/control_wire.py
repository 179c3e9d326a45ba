"""Control-port traffic as an attacker or a broken peer would send it: frames given byte for
byte (no signature, a wrong one, a captured one played again), and a relay on the path that
keeps a copy of every request it forwards."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from typing import Any

import msgspec

from tierkv import framing
from tierkv.cluster import control_wire as wire
from tierkv.cluster import messages as m
from tierkv.piecewise_io import recv_exact

TIMEOUT = 10.0


def _host_port(addr: str) -> tuple[str, int]:
    address = framing.parse_endpoint(f"tcp://{addr}")[1]
    assert isinstance(address, tuple)
    return address


def read_frame(sock: socket.socket, timeout: float = TIMEOUT) -> bytes:
    """The body of the next frame on a blocking socket (ConnectionError when it closes)."""
    sock.settimeout(timeout)
    head = _read_exact(sock, framing.HEADER.size)
    (size,) = framing.HEADER.unpack(head)
    return _read_exact(sock, size)


def _read_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray(n)
    recv_exact(sock, memoryview(data))
    return bytes(data)


class RawControl:
    """One connection to a control port that sends what it is given, as it is."""

    def __init__(self, addr: str, hello: bytes | None = None) -> None:
        self.sock = socket.create_connection(_host_port(addr), timeout=TIMEOUT)
        self.sock.sendall(wire.hello() if hello is None else hello)

    def send(self, frames: list[bytes]) -> None:
        """``[auth, payload]``, or ``[payload]`` alone (sent with an empty signature)."""
        auth, payload = (b"", frames[0]) if len(frames) == 1 else (frames[0], frames[1])
        self.sock.sendall(b"".join(wire.frame(auth, payload)))

    def reply(self) -> bytes:
        """The next reply's payload."""
        parts = wire.split(memoryview(read_frame(self.sock)))
        assert parts is not None, "a reply without a signature length"
        return bytes(parts[1])

    def call(
        self, frames: list[bytes], decoder: msgspec.msgpack.Decoder[Any] = m.reply_decoder
    ) -> Any:
        self.send(frames)
        return decoder.decode(self.reply())

    def closed_by_peer(self, timeout: float = TIMEOUT) -> bool:
        """Whether the server closes this connection within ``timeout`` (replies not read
        yet are read and dropped)."""
        deadline = time.monotonic() + timeout
        try:
            while (left := deadline - time.monotonic()) > 0:
                self.sock.settimeout(left)
                if not self.sock.recv(65536):
                    return True
        except ConnectionError:
            return True
        except TimeoutError:
            pass
        return False

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawControl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def raw_call(
    addr: str, frames: list[bytes], decoder: msgspec.msgpack.Decoder[Any] = m.reply_decoder
) -> Any:
    """One request sent as given on a connection of its own; its reply, decoded."""
    with RawControl(addr) as conn:
        return conn.call(frames, decoder)


class Tap:
    """A relay in front of a control port that keeps a copy of every request it forwards:
    what an attacker on the path would capture."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.captured: list[list[bytes]] = []  # [auth, payload] of each request
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.settimeout(0.05)
        self.addr = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        self._threads = [threading.Thread(target=self._accept, daemon=True)]
        self._threads[0].start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                front, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            back = socket.create_connection(_host_port(self.upstream), timeout=TIMEOUT)
            self._socks += [front, back]
            for target in (self._requests, self._replies):
                t = threading.Thread(target=target, args=(front, back), daemon=True)
                self._threads.append(t)
                t.start()

    def _requests(self, front: socket.socket, back: socket.socket) -> None:
        """Relay the hello, then each request frame (keeping a copy)."""
        with contextlib.suppress(OSError, ConnectionError):
            front.settimeout(None)
            back.sendall(_read_exact(front, wire.HELLO.size))
            while not self._stop.is_set():
                body = read_frame(front, timeout=3600)
                parts = wire.split(memoryview(body))
                if parts is not None:
                    self.captured.append([parts[0], bytes(parts[1])])
                back.sendall(framing.HEADER.pack(len(body)) + body)
        back.close()

    def _replies(self, front: socket.socket, back: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while not self._stop.is_set():
                if not select.select([back], [], [], 0.05)[0]:
                    continue
                data = back.recv(65536)
                if not data:
                    break
                front.sendall(data)
        front.close()

    def requests(self, decoder: msgspec.msgpack.Decoder[Any], kind: type) -> list[list[bytes]]:
        """The captured ``[auth, payload]`` of the requests of type ``kind``."""
        return [f for f in list(self.captured) if isinstance(decoder.decode(f[1]), kind)]

    def close(self) -> None:
        self._stop.set()
        self._listener.close()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(10)
