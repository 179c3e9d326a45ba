"""The errors a client raises: the server unavailable, the server's error replies (one class
per code an engine handles differently), and a chunk that does not match its layout."""

from __future__ import annotations

from tierkv import protocol as p


class TierKVError(Exception):
    """Base of every error this client raises."""


class ServerUnavailableError(TierKVError):
    """The server did not answer in time (not running, overloaded, or restarting)."""


class ServerError(TierKVError):
    """The server answered with an error."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


class NotRegisteredError(ServerError):
    """The server does not know this client (it restarted?): call :meth:`Client.register`."""


class UnauthorizedError(ServerError):
    """The server refused this client's auth token (wrong or missing): registering again
    does not help; give the server's ``--auth-token`` (``auth_token=`` here, or
    ``TIERKV_AUTH_TOKEN``)."""

    def __init__(self, code: p.ErrorCode, message: str) -> None:
        super().__init__(
            code,
            f"{message} (the server has an --auth-token: pass the same token as "
            "auth_token= or TIERKV_AUTH_TOKEN)",
        )


class LeaseExpiredError(ServerError):
    """A lease or lookup session is gone (ended or expired)."""


class LayoutError(TierKVError, ValueError):
    """An array does not match the registered chunk layout."""


def raise_for(reply: p.Error) -> None:
    """Raise the error a server's error reply is, as the class its code names."""
    cls: type[ServerError] = ServerError
    if reply.code is p.ErrorCode.NOT_REGISTERED:
        cls = NotRegisteredError
    elif reply.code is p.ErrorCode.UNAUTHORIZED:
        cls = UnauthorizedError
    elif reply.code is p.ErrorCode.NOT_FOUND:
        cls = LeaseExpiredError
    raise cls(reply.code, reply.message)
