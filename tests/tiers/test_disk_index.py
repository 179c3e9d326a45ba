"""The disk tier's index as a structure of its own: LRU order, generations, bytes per
namespace, eviction overall and within namespaces; checked against a plain model over
random operations (hypothesis, derandomized in make test)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.tiers.disk_index import DiskIndex


def key(ns: int, i: int) -> bytes:
    return bytes([ns]) * 16 + i.to_bytes(16, "big")


def test_lru_order_generations_and_bytes() -> None:
    index = DiskIndex()
    a, b, c = key(1, 1), key(1, 2), key(2, 1)
    gens = [index.add(a, 10), index.add(b, 20), index.add(c, 30)]
    assert gens == sorted(gens) and len(set(gens)) == 3
    assert len(index) == 3 and index.nbytes == 60 and b in index
    assert index.get(a) == (10, gens[0]) and index.get(key(9, 9)) is None
    index.touch(a)  # a is now the most recently used; its generation stays
    assert index.get(a) == (10, gens[0])
    assert index.pop_oldest(15) == [(b, 20)]  # the oldest first, until 15 bytes are freed
    assert index.namespace_usage() == {bytes([1]) * 16: 10, bytes([2]) * 16: 30}
    assert index.namespace_usage([bytes([2]) * 16, bytes([7]) * 16]) == {bytes([2]) * 16: 30}
    assert index.add(a, 5) > gens[2]  # a file of the same key again: a new generation
    assert index.nbytes == 35 and len(index) == 2
    assert index.pop(c) == 30 and index.namespace_usage() == {bytes([1]) * 16: 5}
    assert index.pop_oldest(1000) == [(a, 5)] and index.nbytes == 0 and len(index) == 0
    assert index.pop_oldest(1) == [] and index.namespace_usage() == {}


def test_eviction_within_namespaces_takes_their_oldest_across_them() -> None:
    index = DiskIndex()
    order = [key(1, 1), key(2, 1), key(3, 1), key(1, 2), key(2, 2)]
    for k in order:
        index.add(k, 100)
    index.touch(key(1, 1))  # now the newest of all
    ns1, ns2 = bytes([1]) * 16, bytes([2]) * 16
    assert index.pop_oldest_of([ns1, ns2], 150) == [(key(2, 1), 100), (key(1, 2), 100)]
    assert index.pop_oldest_of([bytes([9]) * 16], 100) == []  # a namespace holding nothing
    assert list(index.namespace_usage()) == [ns1, ns2, bytes([3]) * 16]
    assert index.pop_oldest_of([ns1, ns2], 10**6) == [(key(2, 2), 100), (key(1, 1), 100)]
    assert index.namespace_usage() == {bytes([3]) * 16: 100}


ops = st.lists(
    st.tuples(
        st.sampled_from(["add", "pop", "touch", "evict", "evict_ns"]),
        st.integers(0, 2),  # namespace
        st.integers(0, 5),  # key within it
        st.integers(1, 50),  # a size, or bytes to free
    ),
    max_size=60,
)


@settings(max_examples=200)
@given(ops)
def test_the_index_agrees_with_a_plain_model(steps: list[tuple[str, int, int, int]]) -> None:
    index = DiskIndex()
    model: list[tuple[bytes, int]] = []  # (key, size), least recently used first
    for op, ns, i, n in steps:
        k = key(ns, i)
        held = {kk: size for kk, size in model}
        if op == "add":
            index.add(k, n)
            model = [e for e in model if e[0] != k] + [(k, n)]
        elif op == "pop" and k in held:
            assert index.pop(k) == held[k]
            model = [e for e in model if e[0] != k]
        elif op == "touch" and k in held:
            index.touch(k)
            model = [e for e in model if e[0] != k] + [(k, held[k])]
        elif op in ("evict", "evict_ns"):
            names = [bytes([ns]) * 16] if op == "evict_ns" else None
            candidates = [e for e in model if names is None or e[0][:16] in names]
            want, freed = [], 0
            for e in candidates:
                if freed >= n:
                    break
                want.append(e)
                freed += e[1]
            got = index.pop_oldest(n) if names is None else index.pop_oldest_of(names, n)
            assert got == want
            model = [e for e in model if e not in want]
        assert len(index) == len(model) and index.nbytes == sum(s for _, s in model)
        usage: dict[bytes, int] = {}
        for kk, size in model:
            usage[kk[:16]] = usage.get(kk[:16], 0) + size
        assert index.namespace_usage() == usage
