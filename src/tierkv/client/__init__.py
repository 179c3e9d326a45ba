"""What engines import: the client of a tierkv server (:class:`Client`: registration,
lookup, one-copy store and retrieve, futures), the errors it raises and the results it
returns.

Modules: :mod:`.api` (the client), :mod:`.channel` (requests and replies on one connection),
:mod:`.pool_mapping` (the server's pool as mapped), :mod:`.copies` (one copy per chunk),
:mod:`.errors`, :mod:`.results`, :mod:`.endpoints` (where a server listens by default).
"""

from tierkv.client.api import DEFAULT_TIMEOUT, Client, Gather, Scatter, Tokens, wait_for_server
from tierkv.client.channel import DEFAULT_REPLY_SPIN
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
    "ServerError",
    "ServerUnavailableError",
    "StoreResult",
    "TierKVError",
    "Tokens",
    "UnauthorizedError",
    "default_endpoint",
    "wait_for_server",
]
