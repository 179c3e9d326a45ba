"""The controller's control messages, in the cluster's conventions (:mod:`tierkv.cluster.
messages`: tagged msgspec arrays, a request id echoed by the reply, signed with the shared
secret by :mod:`tierkv.cluster.control`). Requests, refusals, status and lookups that mean
the same thing as the cluster's are the cluster's own structs (``Resolve``, ``Refused``,
``GetStatus``, ``NodeStatus``, ``MemberInfo``).

Keys travel packed: ``keys`` is the concatenation of 32-byte keys and ``tiers`` one byte per
key (a :class:`~tierkv.cluster.messages.Where`), so a batch of 65536 admits is two byte
strings, not 65536 objects. A server's ``boot`` token is its ``MemberInfo.incarnation``
(it changes on every start); the controller's ``boot`` token comes back in every reply that
a server acts on, so both sides notice when the other restarted.
"""

from __future__ import annotations

import msgspec

from tierkv.cluster import messages as m
from tierkv.cluster.messages import Struct
from tierkv.keys import DIGEST_SIZE, MAX_CHUNK_TOKENS

MAX_NAMESPACES = 4096  # per server
MAX_MODEL = 256  # characters of a model name


class NamespaceInfo(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """One engine namespace a server serves: its digest (the first 16 bytes of its keys),
    the model, and the tokens per chunk its keys are hashed over (a router's token ids
    become keys with them, :func:`tierkv.keys.chunk_keys`)."""

    digest: bytes
    model: str
    chunk_tokens: int
    world_size: int = 1
    rank: int = 0

    def problem(self) -> str:
        """Why this record is unacceptable ("" if it is fine)."""
        if len(self.digest) != DIGEST_SIZE:
            return f"a namespace digest must be {DIGEST_SIZE} bytes"
        if not 0 < len(self.model) <= MAX_MODEL:
            return f"a model name must have 1-{MAX_MODEL} characters"
        if not 0 < self.chunk_tokens <= MAX_CHUNK_TOKENS or not 0 <= self.rank < self.world_size:
            return f"chunk_tokens must be 1..{MAX_CHUNK_TOKENS} and 0 <= rank < world_size"
        return ""


class Register(Struct, tag="c_register"):
    """A server joins (again): who it is, where its data plane is, its engines' namespaces.
    The controller drops entries of a previous boot of the same instance."""

    rid: int
    member: m.MemberInfo
    namespaces: list[NamespaceInfo]


class Namespaces(Struct, tag="c_namespaces"):
    """The namespaces of a registered server's engines changed (an engine registered or
    left): the full list, which replaces the previous one."""

    rid: int
    instance: str
    boot: int
    namespaces: list[NamespaceInfo]


class Registered(Struct, tag="c_registered"):
    rid: int
    controller_boot: int


class Heartbeat(Struct, tag="c_hb"):
    rid: int
    instance: str
    boot: int
    seq: int  # the last report or sync sequence number the controller acknowledged


class HeartbeatReply(Struct, tag="c_hb_ack"):
    """``known`` False: the controller does not know this boot of the instance (it restarted,
    or declared the server dead), or not at the heartbeat's sequence number (its entries
    differ from what the server holds): register again and send a full sync."""

    rid: int
    controller_boot: int
    known: bool


class Report(Struct, tag="c_report"):
    """Admits (``keys`` with ``tiers``) and evicts of one server, in order: ``seq`` is one
    more than the previous report's or the full sync's ``seq``."""

    rid: int
    instance: str
    boot: int
    seq: int
    keys: bytes
    tiers: bytes
    evicts: bytes


class SyncBatch(Struct, tag="c_sync"):
    """Part of a full sync: everything the server holds as of report ``seq``. Parts are
    numbered from 0; the part with ``last`` set swaps the collected snapshot in.
    ``total_keys``: the keys of the whole sync (the controller takes room for all of them
    at part 0, so that a sync it starts always ends); -1: not told."""

    rid: int
    instance: str
    boot: int
    seq: int
    part: int
    last: bool
    keys: bytes
    tiers: bytes
    total_keys: int = -1


class Ack(Struct, tag="c_ack"):
    """``ok`` False: the report or sync part was not applied (unknown boot, a gap in the
    sequence numbers, a bad batch): the server registers again and sends a full sync."""

    rid: int
    controller_boot: int
    ok: bool
    reason: str = ""


class Deregister(Struct, tag="c_deregister"):
    rid: int
    instance: str
    boot: int


class Located(Struct, tag="c_located"):
    """The answer to a :class:`~tierkv.cluster.messages.Resolve`: for the keys held, one row
    per (key, holder) in three columns (:mod:`tierkv.cluster.found_columns`): the key's
    position in the request, the holder's index in ``holders`` (their member records, with
    data-plane addresses), the Where code."""

    rid: int
    holders: list[m.MemberInfo]
    positions: bytes = b""
    holder_of: bytes = b""
    tiers: bytes = b""


Request = (
    Register | Namespaces | Heartbeat | Report | SyncBatch | Deregister | m.Resolve | m.GetStatus
)
Reply = Registered | HeartbeatReply | Ack | Located | m.NodeStatus | m.Done | m.Refused

request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
