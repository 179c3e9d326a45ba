"""A bare RPC socket for bad-input tests: sends any bytes, decodes whatever the server answers."""

from __future__ import annotations

from typing import Any

import msgspec
import zmq

from tierkv import protocol as p


class Raw:
    """A bare DEALER socket: sends any bytes and decodes whatever the server answers."""

    def __init__(self, endpoint: str) -> None:
        self.sock: zmq.Socket[Any] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def send(self, msg: Any) -> None:
        self.sock.send(msg if isinstance(msg, bytes) else msgspec.msgpack.encode(msg))

    def recv(self, timeout: float = 5.0) -> Any:
        if not self.sock.poll(int(timeout * 1000)):
            raise TimeoutError("no reply")
        return p.reply_decoder.decode(self.sock.recv())

    def call(self, msg: Any, timeout: float = 5.0) -> Any:
        self.send(msg)
        return self.recv(timeout)

    def close(self) -> None:
        self.sock.close(linger=0)
