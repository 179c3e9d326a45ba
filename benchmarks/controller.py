"""The controller's index at the scale of LMCache's controller experiment: 100 instances x 1M
chunks each, in the real index (:class:`tierkv.controller.index.ControllerIndex`).

Columns (the seed's RegistryTree figures in brackets):

- lookup_us: a lookup of a 512-chunk prefix asked of the whole index, per key, median over
  repeats [8.2 us]. Each prefix is one instance's keys. Measured once the background merge
  has folded every report into the filter's sorted array (``settle``).
- memory_gb: resident set growth of the process while the index is filled, in GB (10**9
  bytes), with the filling's temporary key buffers freed [5.87 GB].
- full_report_ms: one instance's full report (1M keys, 32 bytes each, as they arrive on the
  wire) applied: fingerprints, the table built, swapped in; median of 3 [60 ms]. Timed
  with no merge under way; the merge of its entries into the filter's sorted array, which
  a controller does in the background, is timed after it and printed apart.
- full_report_tp4_ms: the same for an instance whose engine runs 4 tensor-parallel ranks:
  its keys are of 4 namespaces (one per rank), taking turns in the report, and are counted
  per namespace (which ``POST /lookup`` and the controller's instance table read); median
  of 3.
- deregister_ms: one instance with 1M chunks deregistered; median of 3 [8 ms].
- lookup512_wire_p50_us: a 512-chunk lookup (``Resolve``, signed, over the control
  channel's TCP on loopback) through a running controller serving this index, p50 of
  ``--wire-lookups``, the reply decoded. The controller's parts
  (:class:`tierkv.controller.app.Controller`: control server, handlers, reaper) run in this
  process on their own threads, so the client and the controller share one interpreter: an
  upper bound of a separate process's figure.

Use ``--instances`` / ``--chunks`` for a smaller run; ``--busy-cores 1`` measures with a core
kept busy by a spinning process (``busy_cores.py``; the line is then ``controller_busy``).
The last line of output is
``controller lookup_us=A memory_gb=B full_report_ms=C deregister_ms=D lookup512_wire_p50_us=E
full_report_tp4_ms=F``.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import numpy as np

from busy_cores import add_option, kept_busy, line_name
from stop_signals import exit_on_stop_signals
from tierkv.cluster import controller_messages as cm
from tierkv.cluster import messages as m
from tierkv.cluster.control import ControlClient
from tierkv.controller.app import Controller
from tierkv.controller.config import ControllerConfig
from tierkv.controller.index import ControllerIndex

KEY = 32
NAMESPACE = b"N" * 16  # one model: every instance's keys share a namespace
TP_NAMESPACES = 4  # full_report_tp4_ms: an engine's 4 ranks, a namespace each


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def random_keys(n: int, namespaces: int = 1) -> bytes:
    """``n`` keys, concatenated (how a report carries them): of one namespace, or of
    ``namespaces`` (those of tensor-parallel ranks) taking turns."""
    arr = np.frombuffer(os.urandom(n * KEY), dtype=np.uint8).reshape(n, KEY).copy()
    digests = np.frombuffer(NAMESPACE + os.urandom(16 * (namespaces - 1)), dtype=np.uint8)
    arr[:, :16] = digests.reshape(namespaces, 16)[np.arange(n) % namespaces]
    return arr.tobytes()


def main() -> None:
    exit_on_stop_signals()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--instances", type=int, default=100)
    ap.add_argument("--chunks", type=int, default=1_000_000, help="chunks per instance")
    ap.add_argument("--lookups", type=int, default=50, help="512-chunk lookups timed")
    ap.add_argument("--wire-lookups", type=int, default=200, help="lookups over the wire")
    add_option(ap)
    args = ap.parse_args()
    with kept_busy(args.busy_cores):
        measure(args)


def measure(args: argparse.Namespace) -> None:
    """Everything but the argument parsing: the index filled, the figures printed."""
    n_inst, n = args.instances, args.chunks

    index = ControllerIndex()
    tiers = np.zeros(n, dtype=np.int8)
    samples: dict[str, bytes] = {}
    gc.collect()
    base = rss_bytes()
    t0 = time.perf_counter()
    for i in range(n_inst):
        blob = random_keys(n)
        index.replace(f"inst-{i}", blob, tiers)
        if i % max(1, n_inst // 10) == 0:
            samples[f"inst-{i}"] = blob[: 512 * KEY * 4]
        del blob
    fill_s = time.perf_counter() - t0
    t = time.perf_counter()
    index.settle()  # the reports not merged by the background thread yet
    settle_s = time.perf_counter() - t
    gc.collect()
    memory = rss_bytes() - base - sum(len(b) for b in samples.values())
    print(
        f"filled {n_inst} x {n} chunks in {fill_s:.1f} s, then {settle_s:.1f} s to merge "
        f"the last reports ({index.merges} merges in all); {index.total()} keys"
    )
    print(
        f"memory: rss growth {memory / 1e9:.3f} GB ({memory / (n_inst * n):.1f} B/chunk); "
        f"tables and filter {index.nbytes() / 1e9:.3f} GB"
    )

    # Lookups: 512-chunk prefixes of sampled instances.
    per_key: list[float] = []
    names = list(samples)
    for r in range(args.lookups):
        blob = samples[names[r % len(names)]]
        start = (r // len(names)) % 4 * 512 * KEY
        prefix = blob[start : start + 512 * KEY]
        t = time.perf_counter()
        found = index.lookup(prefix)
        per_key.append((time.perf_counter() - t) / 512 * 1e6)
        if (found[names[r % len(names)]] < 0).any():
            raise RuntimeError("a sampled prefix was not found")
    lookup_us = statistics.median(per_key)
    print(
        f"lookup: {lookup_us:.2f} us/key (median of {len(per_key)} 512-chunk lookups, "
        f"p90 {sorted(per_key)[int(0.9 * len(per_key))]:.2f})"
    )

    wire_us = wire_p50(index, [samples[name] for name in names], args.wire_lookups)
    print(f"lookup over the wire: p50 {wire_us:.0f} us per 512-chunk lookup")

    # Full report and deregistration of one instance, 3 times each; then 3 full reports of an
    # instance whose engine has 4 tensor-parallel ranks (4 namespaces).
    reports: list[float] = []
    drops: list[float] = []
    merges: list[float] = []
    for r in range(3):
        blob = random_keys(n)
        index.settle()  # the report timed alone, not beside the previous one's merge
        t = time.perf_counter()
        index.replace("inst-0", blob, tiers)
        reports.append((time.perf_counter() - t) * 1e3)
        del blob
        t = time.perf_counter()
        index.settle()
        merges.append(time.perf_counter() - t)
        t = time.perf_counter()
        dropped = index.drop(f"inst-{r + 1}")
        drops.append((time.perf_counter() - t) * 1e3)
        if dropped != n:
            raise RuntimeError(f"deregistered {dropped} keys, not {n}")
    tp_reports: list[float] = []
    for _ in range(3):
        blob = random_keys(n, TP_NAMESPACES)
        index.settle()
        t = time.perf_counter()
        index.replace("inst-0", blob, tiers)
        tp_reports.append((time.perf_counter() - t) * 1e3)
        del blob
        if len(index.namespaces("inst-0")) != TP_NAMESPACES:
            raise RuntimeError("a report of 4 namespaces was not counted per namespace")
    index.close()
    full_report_ms = statistics.median(reports)
    tp_report_ms = statistics.median(tp_reports)
    deregister_ms = statistics.median(drops)
    print(f"full report: {full_report_ms:.1f} ms (median of {reports!r})")
    print(
        f"full report of {TP_NAMESPACES} namespaces (an engine with {TP_NAMESPACES} "
        f"tensor-parallel ranks): {tp_report_ms:.1f} ms (median of {tp_reports!r})"
    )
    print(f"its merge into the filter (in the background in a controller): {merges!r} s")
    print(f"deregister: {deregister_ms:.2f} ms (median of {drops!r})")
    print(
        f"{line_name('controller', args.busy_cores)} lookup_us={lookup_us:.2f} "
        f"memory_gb={memory / 1e9:.2f} "
        f"full_report_ms={full_report_ms:.1f} deregister_ms={deregister_ms:.2f} "
        f"lookup512_wire_p50_us={wire_us:.0f} full_report_tp4_ms={tp_report_ms:.1f}"
    )


def wire_p50(index: ControllerIndex, blobs: list[bytes], lookups: int) -> float:
    """p50 (us) of 512-chunk Resolve round trips through a controller serving ``index``."""
    cfg = ControllerConfig(port=0, http_port=0, auth_token="bench", dead_after=1e9)
    controller = Controller(cfg)
    service = controller.service
    service.index = index
    for name in index.instances():  # members the answers can name (never reaped here)
        member = m.MemberInfo(name, name, f"{name}:1", 1)
        service.on_register(cm.Register(0, member, []))
    controller.start()
    client = ControlClient(cfg.auth_token, 5.0, decoder=cm.reply_decoder)
    addr = f"127.0.0.1:{controller.control.port}"
    times: list[float] = []
    try:
        for r in range(lookups):
            blob = blobs[r % len(blobs)]
            keys = [blob[i * KEY : (i + 1) * KEY] for i in range(512)]
            t = time.perf_counter()
            reply = client.call(addr, m.Resolve(0, keys))
            times.append((time.perf_counter() - t) * 1e6)
            if not isinstance(reply, cm.Located) or len(reply.positions) < 512 * 4:
                raise RuntimeError(f"a wire lookup did not find its prefix: {reply!r:.200}")
    finally:
        client.close()
        controller.close()
    return statistics.median(times)


if __name__ == "__main__":
    main()
