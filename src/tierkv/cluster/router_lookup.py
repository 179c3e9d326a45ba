"""KV-aware lookups for routers (``POST /lookup``): which instance can serve how many
leading tokens of a prompt, from which tiers. The controller and every server (ring or
controller mode) answer the same request with this code; they differ only in where the
holders of a batch of keys come from (the controller's index, or a server's directory).

Request (JSON): the namespace, by ``model`` (every namespace of that model that a
registered engine stores in) or by ``namespace`` (32 hex digits, as /status shows it), and
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

from tierkv import keys
from tierkv.cluster.directory import Location, Where
from tierkv.controller import messages as cm
from tierkv.controller.index import prefix_runs
from tierkv.controller.keytable import I8, NO_TIER

MAX_CHUNKS = 65536  # per request
MAX_BODY = 4 * 2**20

Holders = Callable[[list[bytes]], dict[str, I8]]  # keys -> instance -> tier of each key


TokenId = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]  # checked while decoding: no pass


class LookupRequest(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str = ""
    namespace: str = ""
    tokens: list[TokenId] | None = None
    hashes: list[str] | None = None
    chunk_tokens: int = 0


class LookupError_(ValueError):
    """A request that cannot be answered: ``status`` (400, 404) and a clear message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def parse(body: bytes) -> LookupRequest:
    try:
        req = msgspec.json.decode(body, type=LookupRequest)
    except msgspec.ValidationError as exc:
        if "`$.tokens[" in str(exc):
            raise LookupError_(400, f"token ids must be 0 <= id < 2**32 ({exc})") from None
        raise LookupError_(400, f"bad lookup request: {exc}") from None
    except msgspec.DecodeError as exc:
        raise LookupError_(400, f"the body is not JSON: {exc}") from None
    if bool(req.model) == bool(req.namespace):
        raise LookupError_(400, "give exactly one of model or namespace")
    if (req.tokens is None) == (req.hashes is None):
        raise LookupError_(400, "give exactly one of tokens or hashes")
    if not 0 <= req.chunk_tokens <= keys.MAX_CHUNK_TOKENS or (
        req.chunk_tokens and not req.namespace
    ):
        raise LookupError_(
            400, f"chunk_tokens must be 1..{keys.MAX_CHUNK_TOKENS}, and comes with a namespace"
        )
    if req.namespace and not _is_hex(req.namespace, keys.DIGEST_SIZE):
        raise LookupError_(400, "namespace must be 32 hex digits")
    if req.hashes is not None:
        if len(req.hashes) > MAX_CHUNKS:
            raise LookupError_(400, f"more than {MAX_CHUNKS} hashes")
        if not all(_is_hex(h) for h in req.hashes):
            raise LookupError_(400, "hashes must be hex strings of 1-64 bytes")
    return req


def _is_hex(text: str, size: int = 0) -> bool:
    if size and len(text) != 2 * size:
        return False
    try:
        raw = bytes.fromhex(text)
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
    req = parse(body)
    between()
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
    req: LookupRequest, known: Sequence[cm.NamespaceInfo]
) -> list[tuple[bytes, cm.NamespaceInfo | None]]:
    if req.namespace:
        digest = bytes.fromhex(req.namespace)
        info = next((ns for ns in known if ns.digest == digest), None)
        if info is None and req.tokens is not None and not req.chunk_tokens:
            raise LookupError_(
                404,
                f"namespace {req.namespace} is not registered here: its tokens per chunk are "
                "unknown (give chunk_tokens, or look it up by hashes)",
            )
        return [(digest, info)]
    found = {ns.digest: ns for ns in known if ns.model == req.model}
    if not found:
        raise LookupError_(404, f"no engine of model {req.model!r} is registered here")
    return sorted(found.items())


def _keys(req: LookupRequest, digest: bytes, chunk_tokens: int) -> list[bytes]:
    if req.hashes is not None:
        return keys.keys_from_hashes(digest, [bytes.fromhex(h) for h in req.hashes])
    assert req.tokens is not None
    n_chunks = len(req.tokens) // chunk_tokens
    if n_chunks > MAX_CHUNKS:
        raise LookupError_(
            400, f"{n_chunks} chunks of {chunk_tokens} tokens: more than {MAX_CHUNKS}"
        )
    packed = array.array("I", req.tokens[: n_chunks * chunk_tokens])  # a C loop, no numpy
    if sys.byteorder != "little":
        packed.byteswap()
    return keys.chunk_keys(digest, packed.tobytes(), chunk_tokens)


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
