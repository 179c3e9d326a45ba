"""The error a request handler raises to answer with an error reply (the server carries on)."""

from __future__ import annotations

from tierkv import protocol as p


class RequestError(Exception):
    """Becomes an error reply with ``code``; the server carries on."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
