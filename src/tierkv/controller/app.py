"""Entry point of `tierkv controller`: the control port (signed frames over TCP, the cluster's
:class:`~tierkv.cluster.control_server.ControlServer` serving the controller's messages), the
liveness reaper and HTTP; SIGTERM/SIGINT stop them in reverse order."""

from __future__ import annotations

import logging
import signal
import threading
from types import FrameType
from typing import TYPE_CHECKING

from tierkv.cluster import controller_messages as cm
from tierkv.cluster.control_server import ControlServer
from tierkv.controller.config import ControllerConfig
from tierkv.controller.service import ControllerService
from tierkv.gc_pauses import freeze_startup
from tierkv.logs import setup_logging
from tierkv.thread_names import name_os_threads

if TYPE_CHECKING:  # the HTTP stack (FastAPI, uvicorn: half a second) loads with HTTP on
    from tierkv.web.serving import HttpServer

log = logging.getLogger(__name__)


class Controller:
    """The controller process's parts: :meth:`start`, :meth:`close` (reverse order)."""

    def __init__(self, cfg: ControllerConfig) -> None:
        self.cfg = cfg
        self.service = ControllerService(cfg.dead_after, max_sync_bytes=cfg.max_sync_bytes)
        self.control = ControlServer(
            cfg.host,
            cfg.port,
            cfg.auth_token,
            self.service.handlers(),
            max_message_bytes=cfg.max_message_bytes,
            decoder=cm.request_decoder,
        )
        self.service.control_stats = self.control.stats
        self.http: HttpServer | None = None

    def start(self) -> Controller:
        """Bind the control endpoint (a port in use fails first), start the reaper and
        HTTP, then serve control last: once the control endpoint answers (what servers and
        start-up scripts wait for), HTTP serves too."""
        try:
            self.control.bind()
            self.service.start(min(self.cfg.heartbeat_interval, self.cfg.dead_after / 3))
            if self.cfg.http_port:
                from tierkv.controller.http import create_app
                from tierkv.web.serving import HttpServer

                self.http = HttpServer(
                    self.cfg, create_app(self.service, self._health, self.cfg.auth_token)
                )
                self.http.start()
            self.control.start()
        except BaseException:
            self.close()
            raise
        log.info("tierkv controller on %s:%d", self.cfg.host, self.control.port)
        return self

    def _health(self) -> dict[str, bool]:
        return {"control": self.control.alive(), "reaper": self.service.alive()}

    def close(self) -> None:
        self.control.close()
        if self.http is not None:
            self.http.stop()
            self.http = None
        self.service.close()


def run(cfg: ControllerConfig) -> int:
    """Serve until SIGTERM/SIGINT."""
    setup_logging(cfg.log_level, cfg.log_format)
    name_os_threads("tierkv-ctl")  # before any thread starts
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    if cfg.http_port:  # imported when HTTP starts; now, so that freezing covers it too
        import tierkv.controller.http
        import tierkv.web.serving  # noqa: F401
    freeze_startup()
    controller = Controller(cfg).start()
    try:
        stop.wait()
    finally:
        controller.close()
    return 0
