"""A bare RPC connection for bad-input tests: sends any bytes, decodes whatever the server
answers."""

from __future__ import annotations

import time
from typing import Any

import msgspec

from tierkv import framing
from tierkv import protocol as p


class Raw:
    """One connection speaking the framing directly: sends any payload (or any raw bytes,
    framing included, with :meth:`send_bytes`) and decodes whatever the server answers."""

    def __init__(self, endpoint: str) -> None:
        self.conn = framing.Connection(framing.connect(endpoint, 5.0))
        self._frames: list[bytes] = []

    def send(self, msg: Any) -> None:
        payload = msg if isinstance(msg, bytes) else msgspec.msgpack.encode(msg)
        self.conn.send(payload, time.monotonic() + 5.0)

    def send_bytes(self, data: bytes) -> None:
        self.conn.sock.sendall(data)  # a few bytes: the socket buffer takes them at once

    def recv(self, timeout: float = 5.0) -> Any:
        if not self._frames:
            frames = self.conn.receive(time.monotonic() + timeout)
            self._frames = [bytes(f) for f in frames]
        return p.reply_decoder.decode(self._frames.pop(0))

    def call(self, msg: Any, timeout: float = 5.0) -> Any:
        self.send(msg)
        return self.recv(timeout)

    def close(self) -> None:
        self.conn.close()
