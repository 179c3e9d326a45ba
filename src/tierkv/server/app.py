"""Entry point of `tierkv server`: logging, the server (:mod:`tierkv.server.wiring`), signals.

SIGTERM and SIGINT stop the RPC loop; in-flight blocking requests finish and are answered,
requests still queued are refused with SHUTTING_DOWN, then every part stops in the reverse
order of its start (HTTP, RPC, tiering, cluster node, tiers, eviction) and the pool segment
is unlinked.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

from tierkv.config import ServerConfig
from tierkv.gc_pauses import freeze_startup
from tierkv.logs import setup_logging
from tierkv.server.wiring import Server
from tierkv.thread_names import name_os_threads

log = logging.getLogger(__name__)


def run(cfg: ServerConfig) -> int:
    """Serve until SIGTERM/SIGINT. A part that fails to start raises (everything started
    before it is stopped first)."""
    setup_logging(cfg.log_level, cfg.log_format)
    name_os_threads("tierkv-server")  # before any thread starts
    server = Server(cfg)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        server.stop(timeout=0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if cfg.http_port:  # imported when HTTP starts; now, so that freezing covers it too
        import tierkv.server.http
        import tierkv.web.serving  # noqa: F401
    freeze_startup()  # the imports: never scanned by a collection again
    server.serve()
    return 0
