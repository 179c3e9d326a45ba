"""The S3 tier's object bodies without copies of the payload: the body a PUT sends (the
record header and the pool's ``memoryview``, never joined) and the reading of a GET's body
straight into a slot.

A PUT's body is a file-like object whose ``read`` returns ``memoryview`` slices, which
urllib3 passes on to ``socket.sendall``: the pool's memory is sent as it is. A GET's body is
read with ``http.client.HTTPResponse.readinto`` when the response is the usual
urllib3-over-http.client one (no copy); otherwise with botocore's
``StreamingBody.readinto``, which urllib3 implements with a ``read`` into a temporary
``bytes`` (one copy). After a read, the connection goes back to the pool only if the body
was read whole. Lines are logged under the S3 tier's logger (``tierkv.tiers.s3``).
"""

from __future__ import annotations

import http.client
import io
import logging
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("tierkv.tiers.s3")


class RecordBody(io.RawIOBase):
    """A seekable, read-only stream over ``header || payload`` that never joins them.

    ``read`` returns ``memoryview`` slices (of the header bytes or of the payload view), so
    whoever sends it (urllib3 / http.client: ``sock.sendall(block)``) sends pool memory as
    it is. botocore only reads, seeks and asks for the length.
    """

    def __init__(self, header: bytes, payload: memoryview) -> None:
        super().__init__()
        self._parts = (memoryview(header), payload)
        self._size = len(header) + payload.nbytes
        self._pos = 0

    def __len__(self) -> int:
        return self._size - self._pos

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        self._pos = min(max(0, base + offset), self._size)
        return self._pos

    def read(self, size: int | None = -1) -> memoryview | bytes:
        if size is None or size < 0:
            # Whole remainder: only callers that want one object get a joined copy.
            rest = b"".join(bytes(p) for p in self._slices(self._size - self._pos))
            self._pos = self._size
            return rest
        for piece in self._slices(size):
            self._pos += piece.nbytes
            return piece  # at most one part per call; a short read is allowed
        return b""

    def readinto(self, buffer: Any) -> int:
        piece = self.read(len(buffer))
        n = len(piece)
        memoryview(buffer).cast("B")[:n] = piece
        return n

    def _slices(self, size: int) -> list[memoryview]:
        """Views of the next ``size`` bytes from the current position (not consumed)."""
        out, pos, left = [], self._pos, size
        start = 0
        for part in self._parts:
            end = start + part.nbytes
            if left > 0 and pos < end:
                take = min(end - pos, left)
                out.append(part[pos - start : pos - start + take])
                pos += take
                left -= take
            start = end
        return out


def http_response(body: Any) -> http.client.HTTPResponse | None:
    """The ``http.client`` response under a botocore ``StreamingBody``, when readable directly.

    botocore -> urllib3 ``HTTPResponse`` -> ``http.client.HTTPResponse``. Only a plain
    (not content-encoded) response that urllib3 has not read from yet qualifies.
    """
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if not isinstance(fp, http.client.HTTPResponse) or fp.isclosed():
        return None
    headers = getattr(raw, "headers", None)
    if headers is not None and headers.get("content-encoding", "identity") != "identity":
        return None
    if getattr(raw, "_fp_bytes_read", 0):
        return None
    return fp


def read_exact(read_into: Callable[[memoryview], int | None], dest: memoryview) -> int:
    """Fill ``dest`` from ``read_into``; returns how many bytes arrived (less at EOF)."""
    done = 0
    while done < dest.nbytes:
        n = read_into(dest[done:])
        if not n:
            break
        done += n
    return done


def body_reader(body: Any, deadline: float = 0.0) -> Callable[[memoryview], int | None]:
    """What fills a view from a botocore ``StreamingBody``: the ``http.client`` response's
    ``readinto`` when :func:`http_response` finds it, else the body's own. ``deadline``
    (``time.monotonic()``; 0: none): a read called past it raises TimeoutError, however
    slowly the bytes came; with the ``http.client`` response of a body of known length each
    read is one receive (bounded by ``read_timeout``), so the whole read ends by the
    deadline plus one ``read_timeout`` at most (``HTTPResponse.readinto`` receives until
    the view is full: a body trickling a byte at a time each within the timeout took one
    call (bytes x timeout) to fill a slot)."""
    fp = http_response(body)
    if not deadline:
        return body.readinto if fp is None else fp.readinto
    if fp is None:  # (urllib3's readinto fills the view whole: a piece at a time)
        read_into: Callable[[memoryview], int | None] = _in_pieces(body.readinto)
    else:
        read_into = _one_receive(fp)

    def read_by_deadline(view: memoryview) -> int | None:
        if time.monotonic() >= deadline:
            raise TimeoutError("the response body came slower than min_rate")
        return read_into(view)

    return read_by_deadline


FALLBACK_PIECE = 4096  # bytes per call of a body's own readinto, under a deadline


def _in_pieces(read_into: Callable[[memoryview], int | None]) -> Callable[[memoryview], int | None]:
    """``read_into`` given :data:`FALLBACK_PIECE` of a view at a time (it fills what it is
    given whole, however slowly the bytes come: the deadline is looked at between pieces)."""
    return lambda view: read_into(view[:FALLBACK_PIECE])


def _one_receive(fp: http.client.HTTPResponse) -> Callable[[memoryview], int | None]:
    """``fp.readinto`` with one receive per call (``readinto1``): of the body's length, or
    of the chunk being read (``HTTPResponse.readinto`` receives until the view is full,
    chunk after chunk)."""
    buffered = fp.fp
    if not hasattr(buffered, "readinto1"):
        return _in_pieces(fp.readinto)
    if fp.chunked:
        return _one_chunked_receive(fp)
    if fp.length is None:
        return _in_pieces(fp.readinto)

    def readinto(view: memoryview) -> int:
        length = fp.length
        if fp.fp is None or not length:
            return 0
        n: int = buffered.readinto1(view[:length])
        fp.length = length - n
        if not n or not fp.length:
            fp._close_conn()  # type: ignore[attr-defined]  # as HTTPResponse.readinto does
        return n

    return readinto


def _one_chunked_receive(fp: http.client.HTTPResponse) -> Callable[[memoryview], int | None]:
    """One receive per call of a chunked body, within the chunk being read (as
    ``HTTPResponse._readinto_chunked`` reads, a receive at a time)."""

    def readinto(view: memoryview) -> int:
        if fp.fp is None:
            return 0
        left = fp._get_chunk_left()  # type: ignore[attr-defined]  # (None: the body ended)
        if left is None:
            return 0
        n: int = fp.fp.readinto1(view[:left])
        fp.chunk_left = left - n
        return n

    return readinto


def finish(body: Any, complete: bool) -> None:
    """Hand the HTTP connection back for reuse after a complete read, else drop it."""
    raw = getattr(body, "_raw_stream", None)
    try:
        if complete and raw is not None and hasattr(raw, "release_conn"):
            fp = getattr(raw, "_fp", None)
            if fp is None or getattr(fp, "isclosed", lambda: False)():
                raw.release_conn()
                return
        body.close()
    except Exception as exc:  # cleanup must not turn a result into an error
        log.debug("s3 tier: closing a response failed: %s", exc)
