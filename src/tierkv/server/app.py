"""Process wiring for `tierkv server`: pool, service, RPC loop, signals, clean shutdown.

SIGTERM and SIGINT stop the RPC loop; in-flight blocking requests finish and are answered,
requests still queued are refused with SHUTTING_DOWN, then the eviction thread stops, the
sockets close and the pool segment is unlinked.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

from tierkv import __version__
from tierkv.config import ServerConfig
from tierkv.logs import setup_logging
from tierkv.pool import ShmPool, format_bytes
from tierkv.server.rpc import RpcServer, ensure_endpoint_free
from tierkv.server.service import CacheService

log = logging.getLogger(__name__)


class Server:
    """A running server: build with :meth:`open`, run with :meth:`serve`, or use as a context
    manager around :meth:`start_background` in tests and the demo."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        ensure_endpoint_free(cfg.rpc_endpoint)  # before touching the pool: see there
        self.pool = ShmPool.create(cfg.resolved_pool_name, cfg.pool_size, prefault=cfg.prefault)
        try:
            self.service = CacheService(cfg, self.pool)
            self.rpc = RpcServer(self.service, cfg.rpc_endpoint)
        except BaseException:
            self.pool.close()
            raise
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return self.cfg.rpc_endpoint

    def serve(self) -> None:
        """Serve on this thread until :meth:`stop`; then tear everything down."""
        self.service.start()
        log.info(
            "tierkv %s serving %s; pool %s of %s (chunk size %d tokens)",
            __version__,
            self.endpoint,
            self.pool.name,
            format_bytes(self.pool.size),
            self.cfg.chunk_size,
        )
        try:
            self.rpc.serve_forever()
        finally:
            self.service.stop()
            self.pool.close()
            log.info("tierkv server stopped; pool %s removed", self.pool.name)

    def start_background(self) -> Server:
        self._thread = threading.Thread(target=self.serve, name="tierkv-server", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float | None = 10.0) -> None:
        self.rpc.stop()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run(cfg: ServerConfig) -> int:
    """Entry point of `tierkv server`: serve until SIGTERM/SIGINT."""
    setup_logging(cfg.log_level, cfg.log_format)
    server = Server(cfg)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        server.rpc.stop()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.serve()
    return 0
