"""Collections never scan the per-chunk index entries, and every collection's pause is
counted (and a long one logged)."""

from __future__ import annotations

import gc
import logging
import os

import pytest

from tierkv import gc_pauses
from tierkv.allocator import Allocator
from tierkv.gc_pauses import PAUSES, GcPauseCollector
from tierkv.index import ObjectIndex


def test_index_entries_are_not_tracked_by_the_collector() -> None:
    chunks = 20_000
    index = ObjectIndex(Allocator(chunks * 4096))
    gc.collect()
    before = len(gc.get_objects())
    for _ in range(chunks // 500):
        res = index.reserve_write([os.urandom(32) for _ in range(500)], 4096, 1)
        index.commit(res.lease_id, 1)
    gc.collect()
    assert index.stats().objects == chunks
    # One tracked object per chunk would be 20000 more; the index's own containers only.
    assert len(gc.get_objects()) - before < 100


def test_every_collection_is_counted_by_generation() -> None:
    collector = GcPauseCollector()
    before = list(PAUSES.counts)
    gc.collect(0)
    gc.collect(2)
    assert PAUSES.counts[0] >= before[0] + 1 and PAUSES.counts[2] >= before[2] + 1
    assert PAUSES.longest[2] > 0 and PAUSES.seconds[2] >= PAUSES.longest[2]
    families = {f.name: f for f in collector.collect()}
    assert set(families) == {
        "tierkv_gc_collections", "tierkv_gc_pause_seconds", "tierkv_gc_pause_max_seconds"
    }  # fmt: skip
    full = [s for s in families["tierkv_gc_collections"].samples if s.labels["generation"] == "2"]
    assert full[0].value == PAUSES.counts[2]


def test_a_long_pause_is_logged(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(gc_pauses, "LOG_PAUSE_S", 0.0)
    PAUSES.install()
    with caplog.at_level(logging.WARNING, logger="tierkv.gc_pauses"):
        gc.collect(2)
    assert not caplog.records  # a process that only embeds a server does not log them
    monkeypatch.setattr(PAUSES, "log_long", True)
    with caplog.at_level(logging.WARNING, logger="tierkv.gc_pauses"):
        gc.collect(2)
    assert any("generation 2" in r.getMessage() for r in caplog.records)


def test_installing_twice_watches_once() -> None:
    PAUSES.install()
    PAUSES.install()
    assert gc.callbacks.count(PAUSES._callback) == 1
