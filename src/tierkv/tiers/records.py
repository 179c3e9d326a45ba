"""The chunk record format every tier shares.

Every chunk a tier holds is preceded (or accompanied) by a fixed 64-byte header carrying a
magic, the format version, the payload length, the full 32-byte key and a 16-byte XXH3-128
checksum of the payload; a load that finds anything inconsistent reports ``CORRUPT`` and
never hands the bytes to an engine. A tier removes a record it found corrupt, so that a bad
copy is read once, not on every lookup.
"""

from __future__ import annotations

import logging
import struct
from dataclasses import dataclass

from tierkv.checksums import checksum
from tierkv.keys import KEY_SIZE
from tierkv.tiers.base import LoadStatus

MAGIC = b"TKV1"
HEADER = struct.Struct("<4sHHQ32s16s")  # magic, version, flags, length, key, checksum
HEADER_SIZE = HEADER.size
assert HEADER_SIZE == 64
FORMAT_VERSION = 2  # 1: blake3 checksums (records of version 1 read as corrupt)


def byte_view(view: memoryview | bytes | bytearray) -> memoryview:
    """``view`` as a flat unsigned-byte memoryview of the same memory (never a copy); pool
    slices already are. Other shapes and formats are cast, which raises TypeError for memory
    that is not C-contiguous."""
    mv = view if isinstance(view, memoryview) else memoryview(view)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def pack_header(key: bytes, data: memoryview | bytes, digest: bytes | None = None) -> bytes:
    """The record header of ``data``; ``digest``: its checksum, if already computed."""
    if len(key) != KEY_SIZE:
        raise ValueError(f"keys are {KEY_SIZE} bytes, got {len(key)}")
    digest = checksum(data) if digest is None else digest
    return HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(data), key, digest)


@dataclass(frozen=True, slots=True)
class Header:
    length: int
    key: bytes
    digest: bytes


def unpack_header(raw: bytes | memoryview) -> Header | None:
    """The header, or None if ``raw`` is not a valid header of this format."""
    if len(raw) != HEADER_SIZE:
        return None
    magic, version, _flags, length, key, digest = HEADER.unpack(raw)
    if magic != MAGIC or version != FORMAT_VERSION:
        return None
    return Header(length, key, digest)


def whole_record(header: Header | None, key: bytes, size: int) -> bool:
    """Whether ``size`` stored bytes under ``header`` are a whole record of ``key`` (the
    checksum is not checked). A load into a slot of another length finds such a record
    CORRUPT but must keep it: the chunk is intact, the caller asked for the wrong size."""
    return header is not None and header.key == key and HEADER_SIZE + header.length == size


def misfit(
    logger: logging.Logger,
    tier: str,
    header: Header | None,
    key: bytes,
    size: int | None,
    want: int,
) -> bool:
    """A stored value of ``size`` bytes (None: unknown), ``header`` its record header, was
    found for a slot of ``want`` payload bytes (the load is CORRUPT): whether to delete it
    (it is not a whole record of ``key``; logged at WARNING). A whole record is kept (logged
    at DEBUG): the chunk is intact, the caller asked for the wrong size."""
    if size is not None and whole_record(header, key, size):
        logger.debug(
            "%s tier: %s holds %d payload bytes, load asked for %d; kept",
            tier,
            key.hex()[:16],
            size - HEADER_SIZE,
            want,
        )
        return False
    logger.warning(
        "%s tier: %s is %s bytes, not a record of its key; deleting it", tier, key.hex()[:16], size
    )
    return True


def verify(
    header: Header | None, key: bytes, data: memoryview, digest: bytes | None = None
) -> LoadStatus:
    """Whether ``data`` is the intact payload of ``key`` under ``header``; ``digest``: the
    checksum of ``data``, if already computed."""
    if header is None or header.key != key or header.length != len(data):
        return LoadStatus.CORRUPT
    digest = checksum(data) if digest is None else digest
    return LoadStatus.OK if digest == header.digest else LoadStatus.CORRUPT
