"""Benchmark: hashing 128k token ids (512 chunks of 256) into chunk keys.

Times ``chunk_keys`` on the three forms tokens arrive in: a uint32 numpy array, packed
little-endian bytes (what the server receives on the wire) and a Python list (what a naive
client sends). The bound, measured in the same run, is SHA-256 (the keys' hash) over the same
bytes in one call: the chain hashes them in 512 calls, each with a 16-byte link and its own
final padding block. Also times the chain's loop in Python, what runs where the C helper
(``tierkv._keychain``) was not built. Reports medians over repeats; the last line is
``hash_128k_tokens_ms=X`` for the packed-bytes (server) path.

Usage: python benchmarks/hashing.py [--repeats N]
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import time
from collections.abc import Callable

import numpy as np

from tierkv import keys
from tierkv.keys import DEFAULT_CHUNK_SIZE, Namespace, chunk_keys

NUM_TOKENS = 128 * 1024
TARGET_MS = 5.0


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=51)
    args = parser.parse_args()

    namespace = Namespace(model="bench-model", kv_dtype="bfloat16", layout="KV_2LTD:bench")
    digest = namespace.digest()
    rng = np.random.default_rng(0)
    as_array = rng.integers(0, 128_000, NUM_TOKENS, dtype=np.uint32)
    as_bytes = as_array.astype("<u4").tobytes()
    as_list = as_array.tolist()
    chunks = NUM_TOKENS // DEFAULT_CHUNK_SIZE

    expected = chunk_keys(digest, as_bytes)
    assert len(expected) == chunks
    assert chunk_keys(digest, as_array) == expected == chunk_keys(digest, as_list)

    bound = median_ms(lambda: hashlib.sha256(as_bytes).digest(), args.repeats)
    results = {
        "uint32 array": median_ms(lambda: chunk_keys(digest, as_array), args.repeats),
        "packed bytes": median_ms(lambda: chunk_keys(digest, as_bytes), args.repeats),
        "python list": median_ms(lambda: chunk_keys(digest, as_list), args.repeats),
    }
    # The chain's loop in Python (what runs where tierkv._keychain was not built).
    step = DEFAULT_CHUNK_SIZE * 4
    view = memoryview(as_bytes)
    python_ms = median_ms(
        lambda: keys._hash_pieces_python(digest, view, 0, len(as_bytes), step, digest),
        args.repeats,
    )

    mib = len(as_bytes) / 2**20
    print(
        f"hashing {NUM_TOKENS} tokens = {chunks} chunks of {DEFAULT_CHUNK_SIZE} "
        f"({mib:.2f} MiB), median of {args.repeats}, {os.cpu_count()} CPUs"
    )
    print(f"  {'bound: sha256, one call':<26} {bound:8.3f} ms  {mib / bound * 1e3:9.0f} MiB/s")
    for name, ms in results.items():
        print(
            f"  {'chunk_keys, ' + name:<26} {ms:8.3f} ms  {mib / ms * 1e3:9.0f} MiB/s"
            f"  {ms / bound:6.1f}x bound  {ms / chunks * 1e3:6.2f} us/chunk"
        )
    print(
        f"  {'the loop in Python':<26} {python_ms:8.3f} ms  {mib / python_ms * 1e3:9.0f} MiB/s"
        f"  {python_ms / bound:6.1f}x bound  (chunk_keys hashes in "
        f"{'C, tierkv._keychain' if keys.NATIVE_CHAIN else 'Python: _keychain not built'})"
    )
    server_ms = results["packed bytes"]
    verdict = "within" if server_ms <= TARGET_MS else "OVER"
    print(f"  server path {verdict} the {TARGET_MS:.0f} ms target")
    print(f"hash_128k_tokens_ms={server_ms:.3f}")


if __name__ == "__main__":
    main()
