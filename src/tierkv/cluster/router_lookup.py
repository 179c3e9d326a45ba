"""KV-aware lookups for routers (``POST /lookup``): which instance can serve how many
leading tokens of a prompt, from which tiers. The controller and every server (ring or
controller mode) answer the same request with this code; they differ only in where the
holders of a batch of keys come from (the controller's index, or a server's directory).

Request (JSON): the namespace, by ``model`` (every namespace of that model that a
registered engine stores in: the model as the engine names it, which an engine's connector
registers with what its chunk bytes mean appended, ``|kv=...``; the whole registered name
matches too) or by ``namespace`` (32 hex digits, as /status shows it), and
the prompt, as ``tokens`` (token ids; the namespace's tokens per chunk hash them, full
chunks only, as a server does) or ``hashes`` (an engine's own chained chunk hashes, hex).
``chunk_tokens`` gives the tokens per chunk of a namespace no engine registered where the
request is answered (a ring-mode server knows only its own engines' namespaces).

Answer: one row per (instance, namespace) that holds the first chunk: its id, data-plane
address, how many leading chunks and tokens it can serve, and how many of those chunks are
in each tier. Every holder is listed, best first.
"""

from __future__ import annotations

import array
import sys
from collections.abc import Callable, Sequence
from typing import Annotated, Any

import msgspec
import numpy as np
import numpy.typing as npt

from tierkv import keys
from tierkv import protocol as p
from tierkv.cluster import controller_messages as cm
from tierkv.cluster.directory import Location, Where
from tierkv.cluster.messages import NO_TIER

MAX_CHUNKS = 65536  # per request
MAX_BODY = 4 * 2**20
# The bodies of lookups received and not yet answered, all together (an HTTP server's): past
# it a lookup is answered 503, try again (each body was read before its turn, so routers
# sending many at once had the server hold all of them).
MAX_HELD_BODIES = 64 * 2**20

I8 = npt.NDArray[np.int8]
Holders = Callable[[list[bytes]], dict[str, I8]]  # keys -> instance -> tier of each key


TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]  # checked while decoding: no pass


class LookupRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str = ""
    namespace: str = ""
    tokens: list[TokenId] | None = None
    hashes: list[str] | None = None
    chunk_tokens: int = 0


class RouterQueryError(ValueError):
    """A request that cannot be answered: ``status`` (400, 404) and a clear message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status

    def body(self) -> bytes:
        """The JSON body of the answer: ``{"error": message}``."""
        return msgspec.json.encode({"error": str(self)})


def parse(body: bytes) -> LookupRequest:
    """A ``POST /lookup`` body, decoded (JSON; token ids checked while decoding)."""
    try:
        return msgspec.json.decode(body, type=LookupRequest)
    except msgspec.ValidationError as exc:
        if "`$.tokens[" in str(exc):
            raise RouterQueryError(400, f"token ids must be 0 <= id < 2**32 ({exc})") from None
        raise RouterQueryError(400, f"bad lookup request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise RouterQueryError(400, f"the body is not JSON: {exc}") from None


def query_of(req: LookupRequest) -> p.RouterQuery:
    """A decoded request, packed (token ids as bytes, hex as bytes) and checked
    (:func:`check`): what a server's HTTP front sends the server (one C pass each: 4k token
    ids in Python cost more than the rest of a lookup)."""
    if req.namespace and not _is_hex(req.namespace, keys.DIGEST_SIZE):
        raise RouterQueryError(400, "namespace must be 32 hex digits")
    if req.hashes is not None and not all(_is_hex(h) for h in req.hashes):
        raise RouterQueryError(400, "hashes must be hex strings of 1-64 bytes")
    tokens = None
    if req.tokens is not None:
        packed = array.array("I", req.tokens)  # a C loop, no numpy
        if sys.byteorder != "little":
            packed.byteswap()
        tokens = packed.tobytes()
    hashes = [keys.from_hex(h) for h in req.hashes] if req.hashes is not None else None
    namespace = keys.from_hex(req.namespace)
    return check(p.RouterQuery(req.model, namespace, tokens, hashes, req.chunk_tokens))


def check(query: p.RouterQuery) -> p.RouterQuery:
    """``query`` if it can be answered, else RouterQueryError (400) saying why."""
    if bool(query.model) == bool(query.namespace):
        raise RouterQueryError(400, "give exactly one of model or namespace")
    if (query.tokens is None) == (query.hashes is None):
        raise RouterQueryError(400, "give exactly one of tokens or hashes")
    if not 0 <= query.chunk_tokens <= keys.MAX_CHUNK_TOKENS or (
        query.chunk_tokens and not query.namespace
    ):
        raise RouterQueryError(
            400, f"chunk_tokens must be 1..{keys.MAX_CHUNK_TOKENS}, and comes with a namespace"
        )
    if query.namespace and len(query.namespace) != keys.DIGEST_SIZE:
        raise RouterQueryError(400, "namespace must be 32 hex digits")
    if query.tokens is not None and len(query.tokens) % 4:
        raise RouterQueryError(400, "token ids must be packed as 4 bytes each")
    if query.hashes is not None:
        if len(query.hashes) > MAX_CHUNKS:
            raise RouterQueryError(400, f"more than {MAX_CHUNKS} hashes")
        if not all(0 < len(h) <= keys.MAX_PRECOMPUTED_HASH_SIZE for h in query.hashes):
            raise RouterQueryError(400, "hashes must be hex strings of 1-64 bytes")
    return query


def _is_hex(text: str, size: int = 0) -> bool:
    if size and len(text) != 2 * size:
        return False
    try:
        raw = keys.from_hex(text)
    except ValueError:
        return False
    return 0 < len(raw) <= keys.MAX_PRECOMPUTED_HASH_SIZE


def _no_pause() -> None:
    pass


def answer(
    body: bytes,
    namespaces: Sequence[cm.NamespaceInfo],
    holders: Holders,
    address: Callable[[str], str | None],
    between: Callable[[], None] = _no_pause,
) -> dict[str, Any]:
    """The reply to a lookup ``body``, given the namespaces known here, the holders of a
    batch of keys and the data address of an instance (None: not a live instance).
    ``between`` is called between the steps (parse, hash, directory, reply): a server's
    check point that lets its engines' requests go first
    (:mod:`tierkv.server.engine_first`)."""
    between()
    query = query_of(parse(body))
    return answer_query(query, namespaces, holders, address, between)


def answer_query(
    query: p.RouterQuery,
    namespaces: Sequence[cm.NamespaceInfo],
    holders: Holders,
    address: Callable[[str], str | None],
    between: Callable[[], None] = _no_pause,
) -> dict[str, Any]:
    """:func:`answer` for a request already decoded and packed (:func:`query_of`)."""
    between()
    req = check(query)
    targets = _namespaces(req, namespaces)
    rows: list[dict[str, Any]] = []
    chunks = 0
    for digest, info in targets:
        chunk_tokens = info.chunk_tokens if info is not None else req.chunk_tokens
        ks = _keys(req, digest, chunk_tokens)
        chunks = max(chunks, len(ks))
        if not ks:
            continue
        between()
        held = holders(ks)
        between()
        for instance, (run, tiers) in prefix_runs(held).items():
            addr = address(instance)
            if addr is None:
                continue
            rows.append(
                {
                    "instance": instance,
                    "address": addr,
                    "namespace": digest.hex(),
                    "model": info.model if info is not None else "",
                    "chunks": run,
                    "tokens": run * chunk_tokens if chunk_tokens else None,
                    "tiers": {w.name.lower(): tiers[int(w)] for w in Where},
                }
            )
    rows.sort(key=lambda r: (-r["chunks"], r["instance"], r["namespace"]))
    return {"chunks": chunks, "instances": rows}


def _namespaces(
    req: p.RouterQuery, known: Sequence[cm.NamespaceInfo]
) -> list[tuple[bytes, cm.NamespaceInfo | None]]:
    if req.namespace:
        digest = req.namespace
        info = next((ns for ns in known if ns.digest == digest), None)
        if info is None and req.tokens is not None and not req.chunk_tokens:
            raise RouterQueryError(
                404,
                f"namespace {digest.hex()} is not registered here: its tokens per chunk are "
                "unknown (give chunk_tokens, or look it up by hashes)",
            )
        return [(digest, info)]
    found = {ns.digest: ns for ns in known if keys.is_of_model(ns.model, req.model)}
    if not found:
        raise RouterQueryError(404, f"no engine of model {req.model!r} is registered here")
    return sorted(found.items())


def _keys(req: p.RouterQuery, digest: bytes, chunk_tokens: int) -> list[bytes]:
    if req.hashes is not None:
        return keys.keys_from_hashes(digest, req.hashes)
    assert req.tokens is not None
    n_chunks = len(req.tokens) // 4 // chunk_tokens
    if n_chunks > MAX_CHUNKS:
        raise RouterQueryError(
            400, f"{n_chunks} chunks of {chunk_tokens} tokens: more than {MAX_CHUNKS}"
        )
    return keys.chunk_keys(digest, req.tokens[: n_chunks * chunk_tokens * 4], chunk_tokens)


def from_locations(locations: list[list[Location]]) -> dict[str, I8]:
    """A directory's answer (holders of each key) as instance -> tier of each key."""
    out: dict[str, I8] = {}
    for pos, locs in enumerate(locations):
        for loc in locs:
            tiers = out.get(loc.holder)
            if tiers is None:
                tiers = out[loc.holder] = np.full(len(locations), NO_TIER, dtype=np.int8)
            tiers[pos] = int(loc.where)
    return out


def prefix_runs(found: dict[str, I8]) -> dict[str, tuple[int, list[int]]]:
    """Per instance: how many leading keys it holds (their tier codes, :class:`Where`, or
    ``NO_TIER``), and how many of those in each tier."""
    out: dict[str, tuple[int, list[int]]] = {}
    for instance, tiers in found.items():
        missing = np.flatnonzero(tiers < 0)
        run = int(missing[0]) if missing.size else int(tiers.size)
        if run:
            counts = np.bincount(tiers[:run].astype(np.int64), minlength=len(Where))
            out[instance] = (run, [int(x) for x in counts])
    return out
