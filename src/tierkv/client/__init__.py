"""What engines import: the client of a tierkv server (:class:`Client`: registration,
lookup, one-copy store and retrieve, futures), the errors it raises and the results it
returns.

Modules: :mod:`.api` (the client's KV movement), :mod:`.connection` (its connection and
registration), :mod:`.channel` (requests and replies on one connection),
:mod:`.pool_mapping` (the server's pool as mapped), :mod:`.slots` (slots as zero-copy
views, and the copies between them and the engine), :mod:`.copies` (one copy of a chunk),
:mod:`.selectors` (tokens or hashes naming chunks), :mod:`.errors`, :mod:`.results`,
:mod:`.endpoints` (where a server listens by default), :mod:`.waiting` (until it answers).
"""

from tierkv.client.api import Client, Gather, Scatter
from tierkv.client.channel import DEFAULT_REPLY_SPIN
from tierkv.client.connection import DEFAULT_TIMEOUT, ServerConnection
from tierkv.client.endpoints import default_endpoint
from tierkv.client.errors import (
    LayoutError,
    LeaseExpiredError,
    NotRegisteredError,
    ServerError,
    ServerUnavailableError,
    TierKVError,
    UnauthorizedError,
)
from tierkv.client.results import PreparedStore, Registration, RetrieveResult, StoreResult
from tierkv.client.selectors import Tokens
from tierkv.client.waiting import wait_for_server

__all__ = [
    "DEFAULT_REPLY_SPIN",
    "DEFAULT_TIMEOUT",
    "Client",
    "Gather",
    "LayoutError",
    "LeaseExpiredError",
    "NotRegisteredError",
    "PreparedStore",
    "Registration",
    "RetrieveResult",
    "Scatter",
    "ServerConnection",
    "ServerError",
    "ServerUnavailableError",
    "StoreResult",
    "TierKVError",
    "Tokens",
    "UnauthorizedError",
    "default_endpoint",
    "wait_for_server",
]
