"""NIXL, where it can be imported: one agent per node, one registered memory region (the
node's pool mapping), remote agents loaded from metadata, and one-sided READs that end by a
deadline of their own.

NIXL is optional (``scripts/install-nixl.sh``: the ``nixl-cu12`` wheel without its CUDA
dependencies, which a CPU-only node does not need). :func:`unavailable` says why it cannot be
used here, or returns "" when it can. A READ from a holder that stopped answering never ends
in NIXL (it has no timeout): :meth:`Agent.read` polls the transfer until the caller's
deadline, then reports ``TIMEOUT`` and hands the running transfer back. Releasing a NIXL
handle does not stop its transfer (a READ given up at its deadline was seen landing seconds
later, over UCX's TCP transport): the reader keeps the destination from reuse until the
transfer ends (:mod:`tierkv.cluster.late_reads`).
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

DONE, ERROR, TIMEOUT, REFUSED, PROC = "DONE", "ERR", "TIMEOUT", "REFUSED", "PROC"

_module: Any = None
_import_error = ""


def _load() -> Any:
    global _module, _import_error
    if _module is None and not _import_error:
        for name in ("nixl_cu12", "nixl"):
            try:
                _module = __import__(name)
                break
            except Exception as exc:  # ImportError, or a shared library that fails to load
                _import_error = _import_error or f"{name}: {type(exc).__name__}: {exc}"
        if _module is not None:
            _import_error = ""
            # NIXL's Python logs go to stdout at INFO, in a format of their own: through
            # this process's logging instead, warnings and up unless NIXL_LOG_LEVEL says.
            nixl_log = logging.getLogger("nixl")
            nixl_log.handlers.clear()
            nixl_log.propagate = True
            if not os.environ.get("NIXL_LOG_LEVEL"):
                nixl_log.setLevel(logging.WARNING)
    return _module


def unavailable() -> str:
    """Why NIXL cannot be used in this process ("" when it can)."""
    if os.environ.get("TIERKV_NO_NIXL"):
        return "TIERKV_NO_NIXL is set"
    if _load() is None:
        return f"nixl cannot be imported ({_import_error}); scripts/install-nixl.sh installs it"
    return ""


class NixlError(Exception):
    """NIXL refused an operation (bad metadata, an unknown region, a failed agent)."""


def address_of(view: memoryview) -> int:
    """The address of a contiguous buffer's first byte."""
    flat = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    return int(np.frombuffer(flat, dtype=np.uint8).ctypes.data)


def ucx_transports() -> str:
    """The UCX transports this process allows (``UCX_TLS``; "all" when not set)."""
    return os.environ.get("UCX_TLS", "all")


# The agent's progress thread waits up to this long (us) for UCX events between rounds.
# nixl_agent sets 0, where the thread spins: most of a core per agent even when idle.
PROGRESS_DELAY_US = 1000
_construct_lock = threading.Lock()


def _new_agent(nixl: Any, name: str, config: Any) -> Any:
    """``nixl.nixl_agent(name, config)`` with :data:`PROGRESS_DELAY_US` (the Python API
    offers no setting for it: its binding's constructor is wrapped meanwhile)."""
    bindings = sys.modules[nixl.nixl_agent.__module__]  # nixl_cu12._api
    native = bindings.nixlBind.nixlAgent

    def with_delay(agent_name: str, agent_config: Any) -> Any:
        agent_config.pthrDelay = PROGRESS_DELAY_US
        return native(agent_name, agent_config)

    with _construct_lock:
        bindings.nixlBind.nixlAgent = with_delay
        try:
            return nixl.nixl_agent(name, config)
        finally:
            bindings.nixlBind.nixlAgent = native


class Agent:
    """One NIXL agent with the UCX backend, thread-safe (NIXL's strict sync mode)."""

    def __init__(self, name: str) -> None:
        nixl = _load()
        if nixl is None:
            raise NixlError(unavailable())
        try:
            config = nixl.nixl_agent_config(
                backends=["UCX"], sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT
            )
            self._agent = _new_agent(nixl, name, config)
        except Exception as exc:
            raise NixlError(f"cannot start a NIXL agent: {exc}") from None
        if "UCX" not in self._agent.backends:
            raise NixlError("NIXL has no UCX backend here")
        self.name = name
        self._registered: Any = None
        self.base = 0
        self.size = 0
        self._lock = threading.Lock()  # the region's registration (no I/O under it)

    # -- the region ------------------------------------------------------------------------
    def register(self, region: memoryview) -> None:
        """Register ``region`` (the pool's whole mapping) for remote READs and as the
        destination of this node's READs."""
        base, size = address_of(region), region.nbytes
        try:
            descs = self._agent.register_memory([(base, size, 0, "")], "DRAM")
        except Exception as exc:
            raise NixlError(f"cannot register {size} bytes with NIXL: {exc}") from None
        with self._lock:
            self._registered, self.base, self.size = descs, base, size

    def close(self) -> None:
        """Unregister and drop the agent (its progress thread ends)."""
        self.unregister()
        self._agent = None

    def unregister(self) -> None:
        with self._lock:
            descs, self._registered = self._registered, None
            self.size = 0
        if descs is not None:
            try:
                self._agent.deregister_memory(descs)
            except Exception as exc:
                log.warning("NIXL: deregistering the pool failed: %s", exc)

    @property
    def registered(self) -> bool:
        return self._registered is not None

    def inside(self, addr: int, length: int) -> bool:
        return self.size > 0 and self.base <= addr and addr + length <= self.base + self.size

    def metadata(self) -> bytes:
        return bytes(self._agent.get_agent_metadata())

    # -- peers -----------------------------------------------------------------------------
    def add_remote(self, metadata: bytes) -> str:
        """Load a peer agent's metadata; returns its agent name."""
        try:
            name = self._agent.add_remote_agent(metadata)
        except Exception as exc:
            raise NixlError(f"the holder's NIXL metadata was refused: {exc}") from None
        return name.decode(errors="replace") if isinstance(name, bytes) else str(name)

    def remove_remote(self, name: str) -> None:
        try:
            self._agent.remove_remote_agent(name)
        except Exception as exc:
            log.debug("NIXL: removing remote agent %s: %s", name, exc)

    def notifications(self) -> list[bytes]:
        """The notification messages peers' transfers delivered since the last call."""
        got = self._agent.get_new_notifs()
        return [bytes(msg) for msgs in got.values() for msg in msgs]

    # -- transfers -------------------------------------------------------------------------
    def read(
        self,
        local: Sequence[tuple[int, int]],
        remote: Sequence[tuple[int, int]],
        agent: str,
        deadline: float,
        notify: bytes = b"",
    ) -> tuple[str, Any]:
        """READ each remote (address, length) of ``agent`` into the local one; returns
        (state, handle). The state is DONE, ERR, REFUSED (NIXL would not start it: nothing
        was transferred) or TIMEOUT (``deadline``, monotonic, passed). The handle is None,
        released, but for TIMEOUT: the transfer then still runs, and may still write into
        the local buffers, until :meth:`state` says it ended; the caller keeps those buffers
        from reuse until then, and :meth:`release` s the handle after (releasing it earlier
        does not stop the transfer). ``notify``: a message NIXL delivers to ``agent`` once
        the transfer is done (:meth:`notifications` there)."""
        mine = np.array([(a, n, 0) for a, n in local], dtype=np.uint64).reshape(-1, 3)
        theirs = np.array([(a, n, 0) for a, n in remote], dtype=np.uint64).reshape(-1, 3)
        try:
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs(mine, "DRAM"),
                self._agent.get_xfer_descs(theirs, "DRAM"),
                agent,
                notify,
            )
        except Exception as exc:
            log.debug("NIXL: a READ from %s could not start: %s", agent, exc)
            return REFUSED, None
        state = ERROR
        try:
            state = self._agent.transfer(handle)
            delay = 20e-6
            while state == PROC:
                if time.monotonic() >= deadline:
                    return TIMEOUT, handle
                time.sleep(delay)
                delay = min(delay * 2, 1e-3)
                state = self._agent.check_xfer_state(handle)
        except Exception as exc:
            log.debug("NIXL: a READ from %s failed: %s", agent, exc)
            state = ERROR
        self.release(handle)
        return (DONE if state == DONE else ERROR), None

    def state(self, handle: Any) -> str:
        """A transfer's state: PROC (running), DONE or ERR."""
        try:
            state = self._agent.check_xfer_state(handle)
        except Exception as exc:
            log.debug("NIXL: checking a READ failed: %s", exc)
            return ERROR
        return state if state in (PROC, DONE) else ERROR

    def release(self, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            log.warning("NIXL: a READ's handle could not be released: %s", exc)
