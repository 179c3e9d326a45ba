"""What the demo prints: a progress bar while it runs, then totals over every request and the
server's own statistics.

Throughputs are bytes moved divided by the time spent inside ``store()``/``retrieve()``
(both RPCs and the copy), summed over the engines: the speed one engine sees, not the
aggregate of engines running side by side.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

from tierkv import protocol as p
from tierkv.demo.kv import KV_DTYPE, SimModel
from tierkv.demo.simulated_engine import CHUNK_TOKENS, RequestRecord
from tierkv.demo.workload import Workload
from tierkv.pool import format_bytes


@dataclass
class DemoReport:
    workload: Workload
    model: SimModel
    engines: int
    records: list[RequestRecord] = field(default_factory=list)
    wall_s: float = 0.0
    settle_s: float = 0.0  # waited between rounds for the write-behind to the tiers
    engine_failures: list[str] = field(default_factory=list)
    server_stats: p.Stats | None = None

    @property
    def chunk_bytes(self) -> int:
        return self.model.bytes_per_token * CHUNK_TOKENS

    def count(self, name: str, repeats_only: bool = False) -> int:
        """Sum of an int field of :class:`RequestRecord` over all requests, or over the 2nd
        and later questions of each document only."""
        return sum(int(getattr(r, name)) for r in self.records if r.query or not repeats_only)

    def seconds(self, name: str) -> float:
        """Sum of a time field of :class:`RequestRecord` over all requests."""
        return sum(float(getattr(r, name)) for r in self.records)

    @property
    def corrupt_chunks(self) -> int:
        return sum(len(r.corrupt_chunks) for r in self.records)

    @property
    def complete(self) -> bool:
        return not self.engine_failures and len(self.records) == self.workload.requests

    @property
    def ok(self) -> bool:
        """Every request ran and every chunk loaded from the cache was verified intact."""
        return self.complete and self.corrupt_chunks == 0

    def format(self) -> str:
        w, m = self.workload, self.model
        cb = self.chunk_bytes
        looked_up, hits = self.count("full_chunks"), self.count("hit_chunks")
        loaded = self.count("retrieved_chunks")
        prompt_tokens, loaded_tokens = self.count("tokens"), loaded * CHUNK_TOKENS
        repeat_chunks = self.count("full_chunks", repeats_only=True)
        repeat_hits = self.count("hit_chunks", repeats_only=True)
        requests = len(self.records)
        lines = [
            f"tierkv demo: Long-Doc-QA, {w.documents} documents x {w.doc_tokens} tokens, "
            f"{w.queries_per_doc} questions each, {self.engines} engine processes",
            f"model {m.name}: {format_bytes(m.bytes_per_token)} of {KV_DTYPE} KV per token, "
            f"{format_bytes(cb)} per {CHUNK_TOKENS}-token chunk",
            "",
            f"  requests      {requests} of {w.requests} in {self.wall_s:.1f} s",
            f"  chunk hits    {hits} of {looked_up} looked up ({_pct(hits, looked_up)}); "
            f"{repeat_hits} of {repeat_chunks} ({_pct(repeat_hits, repeat_chunks)}) for the "
            "2nd and later questions",
            *self._tier_hits(hits),
            f"  token hits    {loaded_tokens} of {prompt_tokens} prompt tokens "
            f"({_pct(loaded_tokens, prompt_tokens)})",
            "  retrieve      " + _moved(loaded, cb, self.seconds("retrieve_s")),
            "  store         "
            + _moved(self.count("stored_chunks"), cb, self.seconds("store_s"))
            + f" ({self.count('present_chunks')} already present, "
            f"{self.count('no_space_chunks')} skipped: pool full)",
            f"  prefill       {self.count('prefill_tokens')} tokens computed in "
            f"{self.seconds('prefill_s'):.2f} s; {loaded_tokens} saved "
            f"({_pct(loaded_tokens, prompt_tokens)} of the prompts)",
            f"  lookups       {requests}, {_ms(self.seconds('lookup_s'), requests)} on average",
            f"  verification  {loaded} loaded chunks checked byte for byte in "
            f"{self.seconds('verify_s'):.2f} s: {self.corrupt_chunks} failures",
        ]
        for failure in self.engine_failures:
            lines.append("  FAILED        " + failure.rstrip().replace("\n", "\n    "))
        if self.server_stats is not None:
            lines += ["", format_server_stats(self.server_stats)]
        return "\n".join(lines)

    def _tier_hits(self, hits: int) -> list[str]:
        """Where the hits came from: the pool, or the tiers (prefetched during the lookup),
        split per tier by what the server loaded from each."""
        tiers = self.server_stats.tiers if self.server_stats is not None else []
        from_tiers = self.count("tier_hit_chunks")
        if not tiers and not from_tiers:
            return []
        from_pool = hits - from_tiers
        per_tier = ", ".join(f"{t.name} loaded {t.loaded_chunks}" for t in tiers)
        return [
            f"  hits by tier  pool {from_pool} ({_pct(from_pool, hits)}), slower tiers "
            f"{from_tiers} ({_pct(from_tiers, hits)})"
            + (f" [server: {per_tier}]" if per_tier else "")
            + f"; {self.seconds('prefetch_s'):.2f} s waiting for prefetches"
            + (
                f", {self.settle_s:.2f} s between rounds for the write-behind"
                if self.settle_s
                else ""
            )
        ]


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def _ms(seconds: float, count: int) -> str:
    return f"{1000.0 * seconds / count:.2f} ms" if count else "-"


def _moved(chunks: int, chunk_bytes: int, seconds: float) -> str:
    nbytes = chunks * chunk_bytes
    rate = f"{nbytes / seconds / 1e9:.2f} GB/s" if seconds > 0 else "-"
    return f"{chunks} chunks, {nbytes / 1e9:.2f} GB in {seconds:.2f} s: {rate}"


def format_server_stats(s: p.Stats) -> str:
    """The server's view (``Client.stats()``), after the run."""
    pct = 100.0 * s.used / s.capacity if s.capacity else 0.0
    requests = ", ".join(f"{k} {v}" for k, v in sorted(s.requests.items())) or "none"
    lines = [
        f"server: tierkv {s.server_version}, up {s.uptime_s:.1f} s, pool {s.pool_name}",
        f"  pool          {format_bytes(s.used)} of {format_bytes(s.capacity)} used ({pct:.1f}%)"
        f", {s.objects} objects ({s.ready} ready, {s.writing} being written, "
        f"{s.read_locked} read-locked)",
        f"  clients       {s.clients} registered, {s.sessions} lookup sessions, "
        f"{s.write_leases} store and {s.read_leases} read leases open",
        f"  evictions     {s.evictions} ({format_bytes(s.evicted_bytes)}); expired "
        f"{s.expired_write_slots} store slots, {s.expired_read_locks} read locks",
        f"  requests      {requests}",
    ]
    for t in s.tiers:
        cap = f" of {format_bytes(t.capacity)}" if t.capacity else ""
        failures = ", ".join(f"{k} {v}" for k, v in sorted(t.load_failures.items())) or "none"
        lines.append(
            f"  tier {t.name:<8} {t.objects} chunks, {format_bytes(t.bytes_used)}{cap}; "
            f"written {t.written_chunks} ({t.write_failures} failed); loaded "
            f"{t.loaded_chunks} ({format_bytes(t.loaded_bytes)}); load failures: {failures}"
        )
    if s.tiers:
        lines.append(
            f"  tiering       prefetches {s.prefetch_started} ({s.prefetch_rejected} rejected, "
            f"{s.prefetch_timed_out} timed out); write-behind queue {s.write_behind_queued} "
            f"({s.write_behind_dropped} dropped)"
        )
    if s.errors:
        errors = ", ".join(f"{k} {v}" for k, v in sorted(s.errors.items()))
        lines.append(f"  errors        {errors}")
    return "\n".join(lines)


class ProgressBar:
    """A one-line bar redrawn with a carriage return; silent unless the stream is a TTY."""

    def __init__(self, total: int, stream: TextIO | None = None, width: int = 30) -> None:
        self.total = total
        self.stream = stream or sys.stderr
        self.width = width
        self.enabled = self.stream.isatty()
        self.started = time.monotonic()

    def update(self, done: int, note: str = "") -> None:
        if not self.enabled:
            return
        filled = self.width * done // self.total if self.total else self.width
        bar = "#" * filled + "-" * (self.width - filled)
        elapsed = time.monotonic() - self.started
        self.stream.write(f"\r  [{bar}] {done}/{self.total} requests {elapsed:5.1f} s  {note}")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()
