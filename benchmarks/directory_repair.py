"""What the directory's anti-entropy costs (``--directory-repair-interval``, default 5 s).

In one process, with the real code (:mod:`tierkv.cluster.digest`, the directory's
:class:`~tierkv.cluster.ring_shard.Shard`), for a node holding ``--keys`` chunks in a ring of
``--members`` members (two replicas):

- holder, every round: hash what it holds and summarise it for every owner (what
  ``RingDirectory._repair`` computes before it sends one small DIGEST per owner). The bound,
  measured in the same run: ``Ring.owners_many`` over the same keys, which routing a
  publish of them costs anyway. Also as a share of one core at the default interval (the
  directory spaces rounds further apart where they would take more than 1 % of a core).
- owner, every change: ``Shard.put`` of the keys with its summaries kept up to date, against
  the same put without summaries (the shard before the anti-entropy, re-implemented here).
- owner, every round: the answer to a DIGEST in sync (O(1)), and on a difference the scan
  that lists a holder's entries in the differing buckets.

    python benchmarks/directory_repair.py [--keys 100000] [--members 4] [--repeat 5]

The last line is machine-readable: ``directory_repair holder_round_ms=A holder_vs_route=B
core_share_pct=C put_overhead=D digest_in_sync_us=E listing_ms=F`` (medians).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from tierkv.cluster import digest
from tierkv.cluster.directory import Where
from tierkv.cluster.ring import Ring
from tierkv.cluster.ring_directory import REPAIR_CPU_SHARE
from tierkv.cluster.ring_shard import Shard

INTERVAL = 5.0


def timed(fn: Callable[[], object], repeat: int) -> list[float]:
    out = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def plain_put(
    table: dict[bytes, tuple[tuple[str, int, int], ...]], entries: list[tuple[bytes, int]]
) -> None:
    """The shard's put before the anti-entropy (no summaries; at most four holders)."""
    for key, where in entries:
        old = table.get(key, ())
        kept = tuple(e for e in old if e[0] != "h")[-3:]
        table[key] = (*kept, ("h", 7, int(where)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    ap.add_argument("--keys", type=int, default=100_000)
    ap.add_argument("--members", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    rng = random.Random(1)
    keys = [rng.randbytes(32) for _ in range(args.keys)]
    entries = [(k, i % 2) for i, k in enumerate(keys)]
    claims = [(k, Where(w)) for k, w in entries]
    members = [f"10.0.0.{i}:8792" for i in range(args.members)]
    ring = Ring(members, 160, 2)

    def holder_round() -> None:
        """What a repair round computes before it sends one DIGEST per owner."""
        held = dict(claims)  # what RingDirectory._repair does with the node's claims
        keys = list(held)
        expected = digest.Expected(keys, list(held.values()), 7, ring.arcs(keys), ring.arc_owners)
        for owner in members:
            expected.summary(owner)

    route = timed(lambda: ring.owners_many(keys), args.repeat)
    round_s = timed(holder_round, args.repeat)

    put: list[float] = []
    bare: list[float] = []
    for _ in range(args.repeat):  # into an empty shard each time: every entry is new
        shard = Shard()
        put += timed(lambda: shard.put("h", 7, entries), 1)  # noqa: B023 - called at once
        table: dict[bytes, tuple[tuple[str, int, int], ...]] = {}
        bare += timed(lambda: plain_put(table, entries), 1)  # noqa: B023 - called at once
    mine = shard.summary("h")
    in_sync = [t / 1000 for t in timed(lambda: [shard.summary("h") for _ in range(1000)], 5)]
    assert not digest.differing(mine, shard.summary("h"))
    listing = timed(lambda: shard.entries_of("h", [3]), args.repeat)
    republish = timed(lambda: shard.put("h", 7, entries), args.repeat)  # nothing changes

    med = statistics.median
    print(f"{args.keys} held keys, {args.members} members, 2 replicas, {args.repeat} runs")
    print(
        f"holder round:   {med(round_s) * 1e3:8.1f} ms (min {min(round_s) * 1e3:.1f}, "
        f"max {max(round_s) * 1e3:.1f}); routing the same keys {med(route) * 1e3:.1f} ms"
    )
    print(
        f"  = {med(round_s) / INTERVAL * 100:.2f} % of one core at one round per {INTERVAL} s "
        f"(rounds are spaced >= {med(round_s) / REPAIR_CPU_SHARE:.1f} s apart by the "
        f"{REPAIR_CPU_SHARE:.0%} cap)"
    )
    print(
        f"owner put:      {med(put) / args.keys * 1e6:8.2f} us/entry with summaries, "
        f"{med(bare) / args.keys * 1e6:.2f} us/entry without; the same entries again "
        f"{med(republish) / args.keys * 1e6:.2f} us/entry"
    )
    print(f"digest in sync: {med(in_sync) * 1e6:8.2f} us; listing one bucket "
          f"{med(listing) * 1e3:.1f} ms (a scan of {len(shard)} entries)")  # fmt: skip
    print(
        f"directory_repair holder_round_ms={med(round_s) * 1e3:.1f} "
        f"holder_vs_route={med(round_s) / med(route):.2f} "
        f"core_share_pct={med(round_s) / INTERVAL * 100:.2f} "
        f"put_overhead={med(put) / med(bare):.2f} "
        f"digest_in_sync_us={med(in_sync) * 1e6:.1f} listing_ms={med(listing) * 1e3:.1f}"
    )


if __name__ == "__main__":
    main()
