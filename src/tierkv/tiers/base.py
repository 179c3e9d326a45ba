"""The tier interface, the chunk record format every tier shares, and the tier registry.

A tier keeps chunks the pool evicted and gives them back on prefetch. Every operation is a
batch, runs on a tier thread (never on the RPC loop), and moves bytes straight between the
pool and the medium: ``store`` gets read-only ``memoryview`` slices of pool slots, ``load``
gets writable slices of freshly reserved slots. Tiers never raise for a single bad chunk:
they report it per item (``LoadStatus``) and count it.

Record format: every chunk a tier holds is preceded (or accompanied) by a fixed 64-byte
header carrying a magic, the format version, the payload length, the full 32-byte key and a
16-byte XXH3-128 checksum of the payload; a load that finds anything inconsistent reports
``CORRUPT`` and never hands the bytes to an engine. A tier removes a record it found
corrupt, so that a bad copy is read once, not on every lookup.
"""

from __future__ import annotations

import enum
import logging
import struct
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tierkv.checksums import checksum
from tierkv.keys import KEY_SIZE
from tierkv.options import OptionError, as_kwargs, convert, signature_struct
from tierkv.tiers.outage import Outage

log = logging.getLogger(__name__)


class TierError(Exception):
    """A tier cannot be created or is unusable as configured."""


class LoadStatus(enum.IntEnum):
    OK = 0
    MISSING = 1  # not in this tier
    CORRUPT = 2  # present but failed verification (torn, truncated, bit rot, wrong key)
    ERROR = 3  # the medium failed (I/O error, connection lost, timeout)


@dataclass(frozen=True, slots=True)
class TierUsage:
    objects: int
    bytes_used: int
    capacity: int  # 0 = unbounded / unknown


# -- record header -----------------------------------------------------------------------
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


# -- interface ---------------------------------------------------------------------------
class Tier(ABC):
    """A store of chunks below the pool. Implementations must be thread-safe."""

    name: str
    # Whether usage() walks the medium (a Redis SCAN, an S3 listing) rather than reading
    # counters: status reports then show a cached answer, refreshed off the request path.
    usage_scans: bool = False

    @abstractmethod
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key is (probably) held; a later load may still miss."""

    def presence(self, keys: Sequence[bytes]) -> list[bool | None]:
        """:meth:`contains`, with None for a key the tier could not check (its medium
        failed), so that a caller can tell "not held" from "could not ask". Tiers whose
        checks can fail override it; the default trusts :meth:`contains`."""
        return [bool(held) for held in self.contains(keys)]

    @abstractmethod
    def store(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        """Write each (key, payload view); True where stored. Never keeps the views."""

    @abstractmethod
    def load(self, items: Sequence[tuple[bytes, memoryview]]) -> list[LoadStatus]:
        """Fill each writable view with the key's payload (same length), verified."""

    def load_verified(
        self, items: Sequence[tuple[bytes, memoryview]]
    ) -> tuple[list[LoadStatus], dict[bytes, bytes]]:
        """:meth:`load`, plus the checksum of each chunk the tier verified on the way in
        (key -> checksum), for a caller that would otherwise hash the bytes again. Tiers that
        do not hand their checksums out return an empty dict."""
        return self.load(items), {}

    def loaded_and_committed(self, chunks: Sequence[tuple[bytes, bytes, int]]) -> None:  # noqa: B027
        """Chunks this tier just loaded are now committed in the pool: (key, checksum,
        length) each, the checksum from :meth:`load_verified`. A hook for tiers that track
        what the pool holds (the peer tier publishes them); the default does nothing."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> int:
        """Remove keys; returns how many were held."""

    @abstractmethod
    def usage(self) -> TierUsage: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and files."""

    @classmethod  # noqa: B027 - optional hook
    def check_options(cls, **options: Any) -> None:
        """Refuse options that have the right types but cannot work (a malformed URL),
        with :class:`TierError`, before anything is opened; called with every option."""

    def copies(self) -> str:
        """What a store and a load cost in extra copies of the payload (for the README)."""
        return "unknown"

    @property
    def outage(self) -> Outage:
        """This tier's failure state (see :mod:`tierkv.tiers.outage`): every site that sees
        the tier fail or work reports here, so an outage is logged once, not per batch.
        Logged by the logger of the tier's module; created on first use."""
        found: Outage | None = self.__dict__.get("_outage")
        if found is None:
            new = Outage(self.outage_label(), logging.getLogger(type(self).__module__))
            found = self.__dict__.setdefault("_outage", new)  # atomic: one per tier
        return found

    def outage_label(self) -> str:
        """How the outage log lines name this tier (tiers add where their medium is)."""
        return f"{self.name} tier"


# -- registry ----------------------------------------------------------------------------
TierFactory = Callable[..., Tier]
_REGISTRY: dict[str, TierFactory] = {}


def register_tier(name: str, factory: TierFactory) -> None:
    """Make a tier available to configuration under ``name``."""
    _REGISTRY[name] = factory
    _OPTION_STRUCTS.pop(name, None)


def tier_names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def tier_options(name: str, options: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The options of tier ``name``, checked and typed, without opening anything.

    The tier's constructor signature declares its options, their types and defaults.
    Options from the command line or the environment (``--tier disk:path=...,fsync=false``)
    arrive as strings and become those types (``fsync=false`` is False, ``capacity=100GiB``
    a byte count); typed values (YAML) are checked. An unknown tier, an unknown or missing
    option, a value of the wrong type and what the tier's :meth:`Tier.check_options`
    refuses (a malformed URL) raise :class:`TierError`."""
    _load_builtins()
    factory = _REGISTRY.get(name)
    if factory is None:
        raise TierError(f"unknown tier {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    struct = _OPTION_STRUCTS.get(name)
    if struct is None:
        struct = _OPTION_STRUCTS[name] = signature_struct(factory, f"{name}_options")
    try:
        typed = as_kwargs(convert(dict(options or {}), struct, what=f"tier {name!r}"))
    except OptionError as exc:
        raise TierError(str(exc)) from None
    check = getattr(factory, "check_options", None)
    if check is not None:
        check(**typed)
    return typed


def create_tier(name: str, options: Mapping[str, Any] | None = None) -> Tier:
    """Build (connect, open) the tier ``name`` with its options (see :func:`tier_options`)."""
    return _REGISTRY[name](**tier_options(name, options))


_OPTION_STRUCTS: dict[str, type[Any]] = {}


def _load_builtins() -> None:
    import importlib

    for module in ("disk", "redis", "s3"):
        try:
            importlib.import_module(f"tierkv.tiers.{module}")
        except ImportError as exc:
            # An optional tier whose client library is missing stays unregistered.
            log.debug("tier module %s unavailable: %s", module, exc)
