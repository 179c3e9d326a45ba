"""Process wiring for `tierkv server`: pool, service, HTTP, RPC loop, signals, shutdown.

SIGTERM and SIGINT stop the RPC loop; in-flight blocking requests finish and are answered,
requests still queued are refused with SHUTTING_DOWN, then the HTTP server stops, the
eviction thread stops, the sockets close and the pool segment is unlinked.
"""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType

from tierkv import __version__
from tierkv.config import ServerConfig, is_loopback
from tierkv.logs import setup_logging
from tierkv.pool import ShmPool, format_bytes
from tierkv.server.collector import StatsCollector
from tierkv.server.health import Health
from tierkv.server.http import HttpServer, create_app
from tierkv.server.rpc import RpcServer, ensure_endpoint_free
from tierkv.server.service import CacheService
from tierkv.server.status import StatusReader

log = logging.getLogger(__name__)


class Server:
    """A running server: build with :meth:`open`, run with :meth:`serve`, or use as a context
    manager around :meth:`start_background` in tests and the demo."""

    def __init__(self, cfg: ServerConfig) -> None:
        self.cfg = cfg
        ensure_endpoint_free(cfg.rpc_endpoint)  # before touching the pool: see there
        self.pool = ShmPool.create(cfg.resolved_pool_name, cfg.pool_size, prefault=cfg.prefault)
        self.http: HttpServer | None = None
        try:
            self.service = CacheService(cfg, self.pool)
            reader = StatusReader(self.service)
            self.service.metrics.registry.register(StatsCollector(reader))
            if cfg.http_port:  # bound now: a port in use fails start-up, before the RPC socket
                health = Health(self, self.service.eviction)
                app = create_app(
                    self.service,
                    reader,
                    health.checks,
                    cfg.auth_token,
                    require_token=not is_loopback(cfg.http_host),
                )
                self.http = HttpServer(cfg, app)
            self.rpc = RpcServer(self.service, cfg.rpc_endpoint)
        except BaseException:
            if self.http is not None:
                self.http.close()
            self.pool.close()
            raise
        self._thread: threading.Thread | None = None

    @property
    def endpoint(self) -> str:
        return self.cfg.rpc_endpoint

    def alive(self, stall: float) -> bool:
        """Whether the RPC loop is serving (for the health check)."""
        return self.rpc.alive(stall)

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
            if self.http is not None:
                self.http.start()
            self.rpc.serve_forever()
        finally:
            if self.http is not None:
                self.http.stop()
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
