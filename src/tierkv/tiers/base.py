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
import inspect
import logging
import struct
import types
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import xxhash

from tierkv.keys import KEY_SIZE
from tierkv.tiers.outage import Outage

log = logging.getLogger(__name__)


class TierError(Exception):
    """A tier cannot be created or is unusable as configured."""


class LoadStatus(enum.IntEnum):
    OK = 0
    MISSING = 1  # not in this tier
    CORRUPT = 2  # present but failed verification (torn, truncated, bit rot, wrong key)
    ERROR = 3  # the medium failed (I/O error, connection lost, timeout)


# The stats counter each load outcome counts in (tiers that keep a Counter of their results).
STATUS_COUNTER = {
    LoadStatus.OK: "loaded",
    LoadStatus.MISSING: "missing",
    LoadStatus.CORRUPT: "corrupt",
    LoadStatus.ERROR: "errors",
}


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


def checksum(data: memoryview | bytes) -> bytes:
    """16-byte XXH3-128 checksum of a chunk payload.

    It guards against torn, truncated and corrupted copies, not against an adversary (who
    could rewrite an unkeyed hash of any kind): ~25 GB/s on one core, releasing the GIL, so
    verifying costs a fraction of the copy it checks (blake3 ran at ~7 GB/s here)."""
    return xxhash.xxh3_128(data).digest()


def byte_view(view: memoryview | bytes | bytearray) -> memoryview:
    """``view`` as a flat unsigned-byte memoryview of the same memory (never a copy); pool
    slices already are. Other shapes and formats are cast, which raises TypeError for memory
    that is not C-contiguous."""
    mv = view if isinstance(view, memoryview) else memoryview(view)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def pack_header(key: bytes, data: memoryview | bytes) -> bytes:
    if len(key) != KEY_SIZE:
        raise ValueError(f"keys are {KEY_SIZE} bytes, got {len(key)}")
    return HEADER.pack(MAGIC, FORMAT_VERSION, 0, len(data), key, checksum(data))


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


def verify(header: Header | None, key: bytes, data: memoryview) -> LoadStatus:
    """Whether ``data`` is the intact payload of ``key`` under ``header``."""
    if header is None or header.key != key or header.length != len(data):
        return LoadStatus.CORRUPT
    return LoadStatus.OK if checksum(data) == header.digest else LoadStatus.CORRUPT


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


def tier_names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def create_tier(name: str, options: dict[str, Any] | None = None) -> Tier:
    """Build the tier ``name`` with its options (keyword arguments of its factory).

    Options from the command line or the environment (``--tier disk:path=...,fsync=false``)
    arrive as strings; each string is converted to the type the factory's signature
    declares for it (bool, int, float, None), so ``fsync=false`` means False, not a
    non-empty (true) string. Values that already have a type (YAML) are passed as they are.
    """
    _load_builtins()
    factory = _REGISTRY.get(name)
    if factory is None:
        raise TierError(f"unknown tier {name!r}; available: {', '.join(sorted(_REGISTRY))}")
    opts = _coerce_options(name, factory, options or {})
    try:
        return factory(**opts)
    except TypeError as exc:
        raise TierError(f"bad options for tier {name!r}: {exc}") from exc


_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def _coerce_options(name: str, factory: TierFactory, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with string values converted to the factory's declared parameter types."""
    try:
        params = inspect.signature(factory, eval_str=True).parameters
    except Exception:  # no signature or unresolvable annotations: pass options unchanged
        return dict(options)
    hints = {n: p.annotation for n, p in params.items() if p.annotation is not p.empty}
    out: dict[str, Any] = {}
    for key, value in options.items():
        hint = hints.get(key)
        if isinstance(value, str) and hint is not None:
            value = _coerce(name, key, value, hint)
        out[key] = value
    return out


def _coerce(tier: str, key: str, value: str, hint: Any) -> Any:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        kinds = set(typing.get_args(hint))
    else:
        kinds = {hint}
    if str in kinds or Any in kinds:
        return value
    text = value.strip().lower()
    if type(None) in kinds and text in ("none", "null", ""):
        return None
    try:
        if bool in kinds:
            if text in _TRUE:
                return True
            if text in _FALSE:
                return False
            raise ValueError("expected true/false, yes/no, on/off or 1/0")
        if int in kinds:
            return int(text)
        if float in kinds:
            return float(text)
    except ValueError as exc:
        raise TierError(f"tier {tier!r}: option {key}={value!r}: {exc}") from None
    return value


def _load_builtins() -> None:
    import importlib

    for module in ("disk", "redis", "s3"):
        try:
            importlib.import_module(f"tierkv.tiers.{module}")
        except ImportError as exc:
            # An optional tier whose client library is missing stays unregistered.
            log.debug("tier module %s unavailable: %s", module, exc)
