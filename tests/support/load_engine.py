"""A background engine for tests that need a server under load: ``python -m
support.load_engine ENDPOINT NAME SEED SECONDS [TENANT]`` (from ``tests/``, or with it on the
path).

It registers, prints "ready", then until SECONDS have passed (or it is terminated) it looks
up a document, retrieves what was found, stores the whole document and ends the session.
The documents cycle: a fresh one (misses), one of RECURRING documents in turn (more than a
small pool holds, so by its turn it was evicted and comes back from a tier), and the
previous one again (pool hits).
"""

from __future__ import annotations

import sys
import time

import numpy as np

from support.servers import CHUNK_SHAPE, CHUNK_SIZE, chunk_data, register
from tierkv.client import Client

CHUNKS = 4
RECURRING = 40  # x CHUNKS x 32 KiB: 5 MiB per engine


def main() -> int:
    endpoint, name, seed, seconds = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
    tenant = sys.argv[5] if len(sys.argv) > 5 else ""
    with Client(endpoint, timeout=30.0) as client:
        register(client, name=name, tenant_salt=tenant)
        print("ready", flush=True)
        out = [np.zeros(CHUNK_SHAPE, np.float32) for _ in range(CHUNKS)]
        end = time.monotonic() + seconds
        i = doc = 0
        while time.monotonic() < end:
            if i % 3 == 0:
                doc = RECURRING + i
            elif i % 3 == 1:
                doc = (i // 3) % RECURRING
            # else: the previous document again
            base = (seed * 1_000_000 + doc) * CHUNKS * CHUNK_SIZE
            tokens = list(range(base, base + CHUNKS * CHUNK_SIZE))
            rid = f"{name}-{i}"
            client.lookup(tokens, request_id=rid, wait=True)
            client.retrieve(request_id=rid, out=out)
            client.store(tokens, [chunk_data(tokens, k) for k in range(CHUNKS)])
            client.end_session(rid)
            i += 1
    print("rounds", i, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
