"""The error of a process that cannot serve its endpoint (an RPC socket, an HTTP port)
because another live process serves it: start-up stops with a clear message."""

from __future__ import annotations


class EndpointInUseError(RuntimeError):
    """Another live process already serves this endpoint (an RPC socket, an HTTP port)."""
