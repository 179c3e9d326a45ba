"""The cluster's control messages: typed msgspec structs over msgpack (never pickle).

Every request carries a request id the reply echoes; requests and replies travel signed
with the cluster's shared secret (see :mod:`tierkv.cluster.auth`, the secret itself never
crosses the network), and a request that is not gets :class:`Refused`. Messages are
tagged arrays, like the engine protocol, and are only ever extended by appending fields with
defaults. Directory entries name a chunk's holder by node id and its tier as a small int.
"""

from __future__ import annotations

import enum

import msgspec


class Struct(msgspec.Struct, array_like=True, tag=True, forbid_unknown_fields=True):
    """Base of every cluster message."""


class Where(enum.IntEnum):
    """Where a holder keeps a chunk: in its pool (served at once) or on its disk tier (the
    holder promotes it into its pool before sending)."""

    POOL = 0
    DISK = 1


NO_TIER = -1  # a key's tier code where its holder does not hold it (beside Where's codes)


class MemberInfo(msgspec.Struct, array_like=True, frozen=True, forbid_unknown_fields=True):
    """How to reach one server of the cluster. ``incarnation`` changes on every start, so a
    restarted node (same id) is told apart from its previous life."""

    node_id: str
    control: str  # HOST:PORT of its control port (TCP)
    data: str  # HOST:PORT of its data-plane listener (TCP)
    incarnation: int


# -- membership --------------------------------------------------------------------------
class Heartbeat(Struct, tag="hb"):
    rid: int
    sender: MemberInfo
    members: list[MemberInfo]  # the sender's live members (gossip: candidates to probe)


class HeartbeatAck(Struct, tag="hb_ack"):
    rid: int
    sender: MemberInfo
    members: list[MemberInfo]


class Leave(Struct, tag="leave"):
    rid: int
    sender: MemberInfo


class GetMembers(Struct, tag="members"):
    rid: int


class MemberList(Struct, tag="member_list"):
    rid: int
    members: list[MemberInfo]  # live members, the answering node included


# -- directory ---------------------------------------------------------------------------
class Publish(Struct, tag="publish"):
    """Entries of one holder: ``(key, Where)`` pairs."""

    rid: int
    holder: str
    incarnation: int
    entries: list[tuple[bytes, int]]


class Unpublish(Struct, tag="unpublish"):
    rid: int
    holder: str
    keys: list[bytes]


class Handoff(Struct, tag="handoff"):
    """Entries an owner passes to a new owner after a membership change:
    ``(key, holder, incarnation, Where)``."""

    rid: int
    entries: list[tuple[bytes, str, int, int]]


class Resolve(Struct, tag="resolve"):
    rid: int
    keys: list[bytes]


class Resolved(Struct, tag="resolved"):
    """For the keys found, one row per (key, holder) in three columns
    (:mod:`tierkv.cluster.found_columns`): the key's position in the request, the holder's
    index in ``holders``, the Where code."""

    rid: int
    holders: list[str]
    positions: bytes = b""
    holder_of: bytes = b""
    tiers: bytes = b""


class Digest(Struct, tag="digest"):
    """What a holder expects an owner to list for it, summarised per bucket of keys (see
    :mod:`tierkv.cluster.digest`): entry count and XOR of entry hashes per bucket."""

    rid: int
    holder: str
    counts: list[int]
    hashes: list[int]


class DigestDiff(Struct, tag="digest_diff"):
    """An owner's answer to :class:`Digest`: the buckets whose summary differs from its own,
    and its entries of that holder in them: ``(key, incarnation, Where)`` (none: in sync)."""

    rid: int
    buckets: list[int]
    entries: list[tuple[bytes, int, int]]


class GetStatus(Struct, tag="status"):
    rid: int


class NodeStatus(Struct, tag="node_status"):
    """A node's cluster figures (see ``ClusterNode.stats``)."""

    rid: int
    stats: dict[str, object]


class Done(Struct, tag="done"):
    rid: int
    count: int = 0


class Refused(Struct, tag="refused"):
    rid: int
    reason: str


Request = (
    Heartbeat | Leave | GetMembers | Publish | Unpublish | Handoff | Resolve | Digest | GetStatus
)
Reply = HeartbeatAck | MemberList | Resolved | DigestDiff | NodeStatus | Done | Refused

encode = msgspec.msgpack.Encoder().encode
request_decoder = msgspec.msgpack.Decoder(Request)
reply_decoder = msgspec.msgpack.Decoder(Reply)
