"""Redis / Valkey tier: one string value per chunk, holding the 64-byte record header and the
payload, written and read in pipelines.

Layout: the chunk with 32-byte key ``k`` lives under ``<key_prefix><hex(k)>``. The key's first
half is the namespace digest, so chunks of different namespaces never share a Redis key. The
value is ``header || payload`` (see :mod:`tierkv.tiers.records`), optionally with a TTL
(``SET ... EX``). One key per chunk keeps every operation a single command (atomic, no
companion keys to go stale) and lets Redis's own eviction policy (``maxmemory-policy``) drop
whole chunks.

Copies and the GIL. The tier's bulk commands (the SETs of a store, the GETs of a load) go
directly over the socket of one of redis-py's pooled connections (:mod:`tierkv.tiers.resp`;
redis-py still makes, authenticates and pools the connections, and runs every other
command). A SET is sent as one RESP bulk string assembled from two buffers, the 64-byte record
header and the pool's ``memoryview``, in pieces: no copy in user space (the packer and the
exchange on the socket: :mod:`tierkv.tiers.redis_wire`). A GET reply's payload is
received straight into its slot, in pieces, with the GIL released, and checksummed as it
lands. Through redis-py and hiredis it took three copies, two of them in C calls that hold
the GIL for a whole 8 MiB value, and a server prefetching from Redis kept its RPC loop waiting
behind them (``benchmarks/load.py --slow-tier redis``: lookup p99 10.1 ms before, 5.6 and 6.4
after; the GIL profile of the server no longer shows the Redis tier).

A value found corrupt (bad header, length or checksum, or not a string) is deleted, by a
script that deletes it only if it is still the value that was read: a store that replaced it
meanwhile is kept. A value of another length than the slot that is itself a whole record of
the key is kept (the caller asked for the wrong size). A value of another length is neither
read into memory nor sent back: only its first 64 bytes are kept (the rest is received and
dropped), and the script compares its length and those bytes (a good record of that length
with that header would have been a whole record of the key, kept): 8 foreign 64 MiB values
under the keys of a load of 4 KiB chunks took 576 MiB when they were read and sent whole.

Failures never raise out of a batch: a lost connection makes the whole batch ``ERROR`` /
``False`` (redis-py reconnects on the next call, so the tier recovers when Redis comes back);
a per-command error (``OOM`` under ``maxmemory``, ``WRONGTYPE``) affects only its item.
Failures are counted and logged through the tier's :class:`~tierkv.tiers.outage.Outage`: one
WARNING when Redis stops answering, one INFO line with the count when it works again, that
is when a command of a batch succeeds: a Redis that answers every command with an error
(``OOM``, ``READONLY``) is still down (each such batch used to end the outage and start
another, logged every time). Commands of a batch refused while others worked (``OOM`` for
some values) are counted and logged at most once a minute, without an outage (ending one and
starting another at every such batch made the tier flap).

``socket_timeout`` bounds each reply as a whole, however slowly its bytes trickle in (not
the whole pipeline: a batch's replies add up to ``max_pipeline_bytes``, which a slower link
could not bring in within one timeout); a whole pipeline, its commands sent and its
replies read, is bounded by ``socket_timeout`` plus its bytes at ``min_rate``
(:mod:`tierkv.tiers.transfer`: a server taking a store's values a few bytes at a time, or
answering each command just within the timeout, held a thread for as long as it lasted),
and a timeout is not retried (``retries`` is
about connection errors): a stalled Redis costs one timeout per batch, not
``retries + 1``.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

from tierkv.options import Size
from tierkv.redaction import redacted_url
from tierkv.tiers.base import LoadStatus, Tier, TierError, TierUsage
from tierkv.tiers.counts import TierCounts
from tierkv.tiers.records import HEADER_SIZE, byte_view, misfit, pack_header, unpack_header, verify
from tierkv.tiers.redis_wire import Concat, GatherPacker, exchange
from tierkv.tiers.registry import register_tier
from tierkv.tiers.resp import Filled, Misfit, Replies, ReplyError
from tierkv.tiers.transfer import MIN_RATE

try:
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import RedisError
    from redis.retry import Retry
except ImportError:  # pragma: no cover - exercised only without the optional dependency
    redis = None  # type: ignore[assignment]

log = logging.getLogger(__name__)
T = TypeVar("T")

_DEL_BATCH = 1000
# What follows the prefix in a chunk's key (redis_key: the key's 64 hex digits), for SCAN MATCH.
_KEY_GLOB = b"[0-9a-f]" * 64
_SCAN_COUNT = 1000
# Delete KEYS[1] if it still holds what a load found corrupt: ARGV[1] "string" and ARGV[2] the
# value read (one of the slot's size); ARGV[1] "head", ARGV[2] the length of a value of
# another size and ARGV[3] its first 64 bytes (all of it when shorter); or ARGV[1] "other"
# for a value that was not a string.
_DROP_CORRUPT = """
local t = redis.call('TYPE', KEYS[1])['ok']
if ARGV[1] == 'other' then
  if t ~= 'string' and t ~= 'none' then return redis.call('DEL', KEYS[1]) end
  return 0
end
if t ~= 'string' then return 0 end
if ARGV[1] == 'head' then
  if redis.call('STRLEN', KEYS[1]) == tonumber(ARGV[2])
      and redis.call('GETRANGE', KEYS[1], 0, 63) == ARGV[3] then
    return redis.call('DEL', KEYS[1])
  end
  return 0
end
if redis.call('GET', KEYS[1]) == ARGV[2] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def _wrong_type(reply: Exception) -> bool:
    """Whether a per-command error says that our key holds a value of another type."""
    return str(reply).startswith("WRONGTYPE")


def _glob_escape(text: bytes) -> bytes:
    """``text`` with Redis glob metacharacters escaped, for ``SCAN MATCH``."""
    out = bytearray()
    for byte in text:
        if byte in b"*?[]\\":
            out += b"\\"
        out.append(byte)
    return bytes(out)


# -- the tier ------------------------------------------------------------------------------
class RedisTier(Tier):
    """Chunks in a Redis or Valkey server, one string value per chunk.

    Options (the documentation's reference is generated from this list):

        url  ``redis://host:port/db``, ``rediss://`` for TLS, ``unix:///path``
        key_prefix  the prefix of every key tierkv writes
        ttl  seconds a value lives (none: until deleted, or evicted by Redis)
        socket_timeout  seconds a batch's commands may take (their replies included);
             not retried
        socket_connect_timeout  seconds a connection may take
        max_connections  connections in the pool; callers beyond wait for one
        pool_timeout  seconds a caller waits for a free connection
        retries  reconnect attempts per batch after a connection error (not after a
             timeout)
        max_pipeline_bytes  a load batch is split into pipelines whose replies together
             stay under this many bytes
        min_rate  bytes per second below which a batch fails: a pipeline must be sent
             and answered within ``socket_timeout`` plus its bytes at this rate (a
             server taking the commands or sending the replies a few bytes at a time,
             each within the timeout, held a thread for as long as it lasted)
    """

    name = "redis"
    usage_scans = True  # usage() SCANs the keyspace and sizes every key

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        key_prefix: str = "tierkv:",
        ttl: float | None = None,
        socket_timeout: float = 5.0,
        socket_connect_timeout: float = 2.0,
        max_connections: int = 16,
        pool_timeout: float = 10.0,
        retries: int = 1,
        max_pipeline_bytes: Size = 64 << 20,
        min_rate: Size = MIN_RATE,
    ) -> None:
        self.check_options(
            url=url,
            ttl=ttl,
            max_connections=max_connections,
            retries=retries,
            min_rate=min_rate,
        )
        self._min_rate = min_rate
        self.url = url
        self._prefix = key_prefix.encode()
        # SET EX wants whole seconds; round up so a chunk never expires early.
        self._ttl = None if ttl is None else max(1, -(-int(ttl * 1000) // 1000))
        self._max_pipeline_bytes = max(1, max_pipeline_bytes)
        # Connection errors only (redis-py also retries timeouts by default): a stalled server
        # would cost retries + 1 socket timeouts per batch.
        self._retry = Retry(
            ExponentialBackoff(cap=0.5, base=0.02),
            retries,
            supported_errors=(RedisConnectionError,),
        )
        try:
            self._pool = redis.BlockingConnectionPool.from_url(
                url,
                max_connections=max_connections,
                timeout=pool_timeout,
                socket_timeout=socket_timeout,
                socket_connect_timeout=socket_connect_timeout,
                retry=self._retry,
                command_packer=GatherPacker(),
            )
        except ValueError as exc:
            raise TierError(f"redis tier: bad url {redacted_url(url)!r}: {exc}") from exc
        self._client = redis.Redis(connection_pool=self._pool)
        self._counts = TierCounts()
        self._last_usage = TierUsage(0, 0, 0)
        try:
            self._client.ping()
        except RedisError as exc:
            # Not fatal: batches report ERROR until the server is reachable.
            self.outage.failed("connect", exc, 0)

    @classmethod
    def check_options(cls, **options: Any) -> None:
        if redis is None:
            raise TierError("the redis tier needs redis-py: pip install 'tierkv[redis]'")
        url, ttl = options.get("url", ""), options.get("ttl")
        try:
            redis.connection.parse_url(url)  # type: ignore[no-untyped-call]
        except ValueError as exc:
            raise TierError(f"redis tier: bad url {redacted_url(url)!r}: {exc}") from None
        if ttl is not None and not ttl > 0:
            raise TierError(f"redis tier: ttl must be positive seconds, got {ttl!r}")
        if options.get("max_connections", 1) < 1:
            raise TierError(
                f"redis tier: max_connections must be >= 1, got {options['max_connections']}"
            )
        if options.get("min_rate", 1) < 1:
            raise TierError(f"redis tier: min_rate must be >= 1 byte/s, got {options['min_rate']}")
        if options.get("retries", 0) < 0:
            raise TierError(f"redis tier: retries must be >= 0, got {options['retries']}")
        for name in ("socket_timeout", "socket_connect_timeout", "pool_timeout"):
            value = options.get(name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise TierError(f"redis tier: {name} must be positive seconds, got {value!r}")

    # -- helpers ---------------------------------------------------------------------------
    def _safe_url(self) -> str:
        kwargs = self._pool.connection_kwargs
        if "path" in kwargs:
            return f"unix://{kwargs['path']}"
        return f"{kwargs.get('host')}:{kwargs.get('port')}/{kwargs.get('db', 0)}"

    def outage_label(self) -> str:
        return f"redis tier {self._safe_url()}"

    def redis_key(self, key: bytes) -> bytes:
        """The Redis key of a chunk key."""
        return self._prefix + key.hex().encode()

    def _failed(self, op: str, exc: object, items: int) -> None:
        self._counts.add(errors=items)
        self.outage.failed(op, exc, items)

    def stats(self) -> dict[str, int]:
        """Counters since start: stored, store_failed, loaded, missing, corrupt,
        corrupt_deleted, errors."""
        return self._counts.snapshot()

    def _pipelined(self, commands: Sequence[tuple[Any, ...]]) -> list[Any]:
        """Run ``commands`` in one non-transactional pipeline; per-command errors come back
        as exception objects in the result list, connection errors raise."""
        with self._client.pipeline(transaction=False) as pipe:
            for command in commands:
                pipe.execute_command(*command)  # type: ignore[no-untyped-call]
            replies: list[Any] = pipe.execute(raise_on_error=False)
        return replies

    def _on_socket(self, commands: Sequence[tuple[Any, ...]], read: Callable[[Replies], T]) -> T:
        """Send ``commands`` pipelined on one of the pool's connections, in pieces (a value's
        pool view as it is), and read their replies with ``read`` (:mod:`tierkv.tiers.resp`);
        retried after a connection error as redis-py retries its own commands. A connection
        whose replies were not all read cleanly is closed, never reused."""
        conn = self._pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            # A failed attempt has closed the connection already; the next one reconnects.
            result = self._retry.call_with_retry(
                lambda: exchange(conn, commands, read, self._min_rate), lambda _exc: None
            )
        finally:
            self._pool.release(conn)  # type: ignore[no-untyped-call]
        return result

    # -- Tier ------------------------------------------------------------------------------
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [bool(held) for held in self.presence(keys)]

    def presence(self, keys: Sequence[bytes]) -> list[bool | None]:
        if not keys:
            return []
        try:
            replies = self._pipelined([("EXISTS", self.redis_key(k)) for k in keys])
        except (RedisError, OSError) as exc:
            self._failed("contains", exc, len(keys))
            return [None] * len(keys)
        self._refusals("EXISTS", [r for r in replies if isinstance(r, Exception)], len(replies))
        return [r == 1 if isinstance(r, int) else None for r in replies]

    def store(self, items: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        if not items:
            return []
        results = [False] * len(items)
        commands: list[tuple[Any, ...]] = []
        positions: list[int] = []
        ttl = () if self._ttl is None else ("EX", self._ttl)
        for i, (key, view) in enumerate(items):
            try:
                data = byte_view(view)
                value = Concat(pack_header(key, data), data)
            except (ValueError, TypeError) as exc:
                log.warning("redis tier: not storing chunk %s: %s", key.hex()[:16], exc)
                self._counts.add(store_failed=1)
                continue
            commands.append(("SET", self.redis_key(key), value, *ttl))
            positions.append(i)
        if not commands:
            return results
        try:
            replies = self._on_socket(commands, lambda r: [r.simple() for _ in commands])
        except (RedisError, OSError) as exc:
            self._failed("store", exc, len(commands))
            self._counts.add(store_failed=len(commands))
            return results
        finally:
            commands.clear()  # drop the references to the pool views
        refused: list[Exception] = []
        for i, reply in zip(positions, replies, strict=True):
            if isinstance(reply, ReplyError):
                refused.append(reply)  # e.g. OOM under maxmemory with noeviction
            else:
                results[i] = reply == b"OK"
        self._counts.add(store_failed=len(refused), stored=sum(results))
        self._refusals("SET", refused, len(replies))
        return results

    def _refusals(
        self, op: str, refused: Sequence[object], answered: int, count: bool = True
    ) -> None:
        """The outcome of a batch of ``answered`` commands of which ``refused`` got an error
        reply: the tier works if any command did (refusals of some are logged without an
        outage: ending one and starting another at every such batch made the tier flap);
        if every one was refused (OOM, READONLY), it is down. The refusals are counted in
        ``errors`` unless ``count`` is False (a load counts its ERROR statuses itself)."""
        if count and refused:
            self._counts.add(errors=len(refused))
        if len(refused) < answered:
            self.outage.ok()
            if refused:
                self.outage.refused(op, refused[0], len(refused))
        elif refused:
            self.outage.failed(op, refused[0], len(refused))

    def load(self, items: Sequence[tuple[bytes, memoryview]]) -> list[LoadStatus]:
        return self.load_verified(items)[0]

    def load_verified(
        self, items: Sequence[tuple[bytes, memoryview]]
    ) -> tuple[list[LoadStatus], dict[bytes, bytes]]:
        statuses: list[LoadStatus] = []
        sums: dict[bytes, bytes] = {}
        failed = False
        for batch in self._load_batches(items):
            if failed:
                # A whole pipeline failed (Redis down, stalled, refusing): asking again for
                # the next one would only wait out the socket timeout once more, and a load
                # is used up to its first failure anyway.
                skipped = [LoadStatus.ERROR] * len(batch)
                self._counts.add_loads(skipped)
                statuses.extend(skipped)
                continue
            got = self._load_batch(batch, sums)
            statuses.extend(got)
            failed = all(status is LoadStatus.ERROR for status in got)
        return statuses, sums

    def _load_batches(
        self, items: Sequence[tuple[bytes, memoryview]]
    ) -> Iterator[Sequence[tuple[bytes, memoryview]]]:
        """Consecutive slices of ``items`` whose replies fit in ``max_pipeline_bytes``."""
        start, size = 0, 0
        for i, (_key, view) in enumerate(items):
            need = HEADER_SIZE + view.nbytes
            if i > start and size + need > self._max_pipeline_bytes:
                yield items[start:i]
                start, size = i, 0
            size += need
        if start < len(items):
            yield items[start:]

    def _load_batch(
        self, items: Sequence[tuple[bytes, memoryview]], sums: dict[bytes, bytes]
    ) -> list[LoadStatus]:
        """Load one pipeline's items; the checksum of each intact one goes to ``sums``."""
        headers = [memoryview(bytearray(HEADER_SIZE)) for _ in items]
        dests = [byte_view(view) for _, view in items]

        def read(replies: Replies) -> list[Filled | Misfit | ReplyError | None]:
            return [replies.value_into(h, d) for h, d in zip(headers, dests, strict=True)]

        try:
            replies = self._on_socket([("GET", self.redis_key(k)) for k, _ in items], read)
        except (RedisError, OSError) as exc:
            self._failed("load", exc, len(items))
            return [LoadStatus.ERROR] * len(items)
        statuses: list[LoadStatus] = []
        # (key, what tells the corrupt value: itself, a Misfit, or the WRONGTYPE error)
        bad: list[tuple[bytes, object]] = []
        for (key, _), header, dest, reply in zip(items, headers, dests, replies, strict=True):
            status, drop = self._fill(key, header, dest, reply)
            statuses.append(status)
            if status is LoadStatus.OK and isinstance(reply, Filled):
                sums[key] = reply.digest
            if drop:
                value = bytes(header) + bytes(dest) if isinstance(reply, Filled) else reply
                bad.append((key, value))
        # (WRONGTYPE is not refused: Redis looked the key up)
        refused = [r for r in replies if isinstance(r, ReplyError) and not _wrong_type(r)]
        self._refusals("GET", refused, len(replies), count=False)  # (add_loads counts them)
        self._counts.add_loads(statuses)
        if bad:
            self._drop_corrupt(bad)
        return statuses

    def _fill(
        self,
        key: bytes,
        header: memoryview,
        dest: memoryview,
        reply: Filled | Misfit | ReplyError | None,
    ) -> tuple[LoadStatus, bool]:
        """Verify one GET reply, whose payload is in ``dest`` already when it has the
        expected size: the status, and whether the stored value is corrupt (to be
        deleted). ``dest`` holds the chunk only when the status is OK."""
        if reply is None:
            return LoadStatus.MISSING, False
        if isinstance(reply, ReplyError):
            # WRONGTYPE: something else lives under our key. Anything else: the server failed
            # (counted and logged by the batch).
            if _wrong_type(reply):
                log.warning("redis tier: %s holds a non-string value; deleting it", key.hex()[:16])
                return LoadStatus.CORRUPT, True
            return LoadStatus.ERROR, False
        if isinstance(reply, Misfit):  # not HEADER_SIZE + dest.nbytes bytes
            header_found = unpack_header(reply.head)
            drop = misfit(log, "redis", header_found, key, reply.size, dest.nbytes)
            return LoadStatus.CORRUPT, drop
        status = verify(unpack_header(header), key, dest, reply.digest)
        if status is not LoadStatus.OK:
            log.warning("redis tier: %s failed verification; deleting it", key.hex()[:16])
        return status, status is not LoadStatus.OK

    def _drop_corrupt(self, bad: Sequence[tuple[bytes, object]]) -> None:
        """Delete values a load found corrupt, each only if it is still the value read: one
        of the slot's size is compared whole (bounded by the batch's size), one of another
        size by its length and first bytes (:class:`Misfit`: it may be of any size)."""
        commands: list[tuple[Any, ...]] = []
        for key, reply in bad:
            rkey = self.redis_key(key)
            if isinstance(reply, bytes):
                commands.append(("EVAL", _DROP_CORRUPT, 1, rkey, "string", reply))
            elif isinstance(reply, Misfit):
                commands.append(("EVAL", _DROP_CORRUPT, 1, rkey, "head", reply.size, reply.head))
            else:
                commands.append(("EVAL", _DROP_CORRUPT, 1, rkey, "other", ""))
        try:
            replies = self._pipelined(commands)
        except (RedisError, OSError) as exc:
            self._failed("deleting corrupt values", exc, len(bad))
            return
        failed = [r for r in replies if isinstance(r, Exception)]
        self._refusals("deleting corrupt values", failed, len(replies))
        self._counts.add(corrupt_deleted=sum(1 for r in replies if r == 1))

    def delete(self, keys: Sequence[bytes]) -> int:
        removed = 0
        for start in range(0, len(keys), _DEL_BATCH):
            batch = [self.redis_key(k) for k in keys[start : start + _DEL_BATCH]]
            try:
                removed += int(self._client.delete(*batch))
            except (RedisError, OSError) as exc:
                self._failed("delete", exc, len(batch))
            else:
                self.outage.ok()
        return removed

    def usage(self) -> TierUsage:
        """Chunks and bytes of this tier's keys (a SCAN: cost grows with the keyspace) and
        Redis's ``maxmemory`` as the capacity (0 when unlimited). Only keys named as the tier
        names its chunks count (:meth:`redis_key`: the prefix and 64 hex digits): those of a
        deployment whose prefix extends this one's (``tierkv:b:`` beside ``tierkv:``) were
        counted in both."""
        try:
            objects = stored = 0
            pattern = _glob_escape(self._prefix) + _KEY_GLOB
            batch: list[bytes] = []
            for key in self._client.scan_iter(match=pattern, count=_SCAN_COUNT):
                batch.append(key)
                if len(batch) >= _SCAN_COUNT:
                    objects, stored = self._add_sizes(batch, objects, stored)
            objects, stored = self._add_sizes(batch, objects, stored)
            info = self._client.info("memory")
            capacity = int(info.get("maxmemory", 0))
        except (RedisError, OSError) as exc:
            self._failed("usage", exc, 0)
            return self._last_usage
        self.outage.ok()
        self._last_usage = TierUsage(objects, stored, capacity)
        return self._last_usage

    def _add_sizes(self, batch: list[bytes], objects: int, stored: int) -> tuple[int, int]:
        if batch:
            sizes = self._pipelined([("STRLEN", k) for k in batch])
            for size in sizes:
                if isinstance(size, int) and size > 0:  # 0: expired or deleted meanwhile
                    objects += 1
                    stored += size
            batch.clear()
        return objects, stored

    def close(self) -> None:
        self._pool.disconnect()

    def copies(self) -> str:
        return (
            "store: no copy of the payload (header and pool view go to sendall as separate "
            "buffers of one SET); one checksum read pass for the header. "
            "load: no copy in user space (each reply's payload is received into its slot, "
            "checksummed as it lands; the 64-byte header and the reply lines pass through a "
            "small buffer)."
        )


class ValkeyTier(RedisTier):
    """The same tier under the name ``valkey`` (Valkey speaks the Redis protocol)."""

    name = "valkey"


register_tier("redis", RedisTier)
register_tier("valkey", ValkeyTier)
