"""``StoreSlots.writing`` (wire protocol version 7): a reply without it reads as "none being
written", the behaviour from before the field (a server of version 6 is refused at REGISTER,
but the default is what every reply that names no such chunk relies on)."""

from __future__ import annotations

import msgspec

from tierkv import protocol as p


class OldStoreSlots(msgspec.Struct, array_like=True, tag="store_slots", forbid_unknown_fields=True):
    """StoreSlots as a version-6 peer from before the field knows it."""

    rid: int
    lease: int
    slots: list[p.Slot]
    present: list[int]
    no_space: list[int]


def test_an_older_servers_reply_has_no_page_being_written() -> None:
    old = msgspec.msgpack.encode(OldStoreSlots(7, 3, [p.Slot(1, 0, 64)], [0, 2], []))
    reply = msgspec.msgpack.decode(old, type=p.StoreSlots)
    assert reply.present == [0, 2] and reply.writing == []


def test_pages_being_written_travel() -> None:
    sent = p.StoreSlots(7, 0, [], [0, 2], [1], writing=[2])
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(sent), type=p.StoreSlots) == sent
