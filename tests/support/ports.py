"""Free TCP ports for the servers a test starts, chosen outside the kernel's ephemeral range.

A port found by binding port 0 and closing the socket comes from the ephemeral range
(``net.ipv4.ip_local_port_range``), where any process's next ``bind(0)`` or outgoing
connection may take it before the server the test hands it to binds it: vLLM's engine, for
one, picks its own ports that way while it starts (torch.distributed's rendezvous, ZMQ), so
two engines started at once could each take a port meant for the other. Ports below that
range are given out only when something asks for that port by number; each port is handed
out once per test process, and checked free (bound on all addresses, then closed) first.
Where the ephemeral range leaves no room below it, ports come from ``bind(0)`` as before.
"""

from __future__ import annotations

import os
import socket
import threading

_FIRST = 20000  # the lowest port handed out (well above the well-known and registered ones)
_given: set[int] = set()
_lock = threading.Lock()
_next: int | None = None


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as fh:
            return int(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("", port))  # all addresses: what a server binding "*" needs
        except OSError:
            return False
    return True


def _os_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def free_ports(n: int, span: int = 1) -> list[int]:
    """``n`` ports, each with the ``span - 1`` ports after it free too (a server's control
    and data ports), none of them handed out before by this process."""
    global _next
    limit = _ephemeral_start() - span
    if limit - _FIRST < 1000:  # no room below the ephemeral range: the old way
        return [_os_port() for _ in range(n)]
    out: list[int] = []
    with _lock:
        if _next is None:  # processes running tests side by side start apart
            _next = _FIRST + (os.getpid() * 397) % (limit - _FIRST)
        tried = 0
        while len(out) < n:
            if tried > limit - _FIRST:
                raise RuntimeError(f"no {span} free consecutive ports below {limit + span}")
            port = _next
            _next = _FIRST if _next + span > limit else _next + span
            tried += span
            block = range(port, port + span)
            if any(p in _given for p in block) or not all(_bindable(p) for p in block):
                continue
            _given.update(block)
            out.append(port)
    return out


def free_port() -> int:
    """One port (see :func:`free_ports`)."""
    return free_ports(1)[0]
