"""The quota file under concurrent changes: every change is on disk when its call returns,
the file ends as the last state, and no writer holds a lock while it writes."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import msgspec
import pytest

from tierkv.allocator import Allocator
from tierkv.index import ObjectIndex
from tierkv.server.quota_values import QuotaError
from tierkv.server.quotas import QuotaFile, Quotas
from tierkv.tenants import TenantIds


def make(path: Path) -> Quotas:
    tenants = TenantIds()
    index = ObjectIndex(Allocator(1 << 20, 4096), tenants=tenants)
    return Quotas(
        index, tenants, limits={}, defaults={"pool": None, "disk": None}, mode="soft",
        path=str(path),
    )  # fmt: skip


def on_disk(path: Path) -> QuotaFile:
    return msgspec.json.decode(path.read_bytes(), type=QuotaFile)


def test_every_change_is_on_disk_when_its_call_returns(tmp_path: Path) -> None:
    path = tmp_path / "quotas.json"
    quotas = make(path)
    errors: list[str] = []

    def writer(t: int) -> None:
        for i in range(25):
            name = f"tenant-{t}-{i}"
            quotas.set(name, {"pool": 1000 * t + i})
            if on_disk(path).limits.get(name) != 1000 * t + i:  # durable before returning
                errors.append(name)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert errors == []
    final = on_disk(path).limits
    assert len(final) == 6 * 25 and final["tenant-5-24"] == 5024
    # A restarted server reads the same state back.
    again = make(path)
    again.load()
    assert again.limit_of("tenant-3-7") == (3007, "quota")


def test_no_lock_is_held_while_the_file_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While one change is being fsynced, reading the quotas does not wait for it."""
    path = tmp_path / "quotas.json"
    quotas = make(path)
    inside, release = threading.Event(), threading.Event()
    real_fsync = os.fsync

    def slow_fsync(fd: int) -> None:
        inside.set()
        release.wait(10)
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", slow_fsync)
    th = threading.Thread(target=quotas.set, args=("slow", {"pool": 5}))
    th.start()
    assert inside.wait(10)
    assert quotas.limit_of("slow") == (5, "quota")  # the lock is free during the I/O
    assert quotas.config()["mode"] == "soft"
    release.set()
    th.join(10)
    assert on_disk(path).limits == {"slow": 5}


@pytest.mark.parametrize(
    ("entries", "words"),
    [
        ({"limits": {"t": -5}}, "pool quota of"),
        ({"limits": {"t": 2**70}}, "at most"),
        ({"limits": {"": 5}}, "non-empty"),
        ({"limits": {"x" * 2000: 5}}, "at most 1024"),
        ({"tier_limits": {"s3": {"t": 5}}}, "unknown tier 's3'"),
        ({"tier_limits": {"disk": {"~other": 5}}}, "takes no disk quota"),
        ({"tier_defaults": {"disk": -1}}, "disk default"),
        ({"tier_defaults": {"redis": 1}}, "unknown tier 'redis'"),
        ({"default_set": True, "default_limit": -1}, "pool default"),
        ({"mode": "strict"}, "mode 'strict'"),
        ({"version": 2}, "version 2"),
    ],
)
def test_a_hand_edited_file_is_checked_as_the_api_checks(
    tmp_path: Path, entries: dict[str, object], words: str
) -> None:
    """The file's entries were applied unchecked: a negative quota, one past 8 EiB, an empty
    name, a tier with no quotas or an unknown mode were taken (or silently dropped). The
    server refuses to start, naming the file and the entry."""
    path = tmp_path / "quotas.json"
    path.write_bytes(msgspec.json.encode(entries))
    with pytest.raises(QuotaError, match=str(path)) as refused:
        make(path).load()
    assert words in str(refused.value)
    path.write_bytes(
        msgspec.json.encode({"limits": {"t": 5}, "tier_limits": {"disk": {"t": None}}})
    )
    good = make(path)
    good.load()
    assert good.limit_of("t") == (5, "quota")
