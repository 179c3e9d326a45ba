"""Tests for tierkv._streamcopy, the C helper that copies chunks with non-temporal stores, and
tierkv.arraycopy around it: it is built here, it copies exactly what numpy copies for any
shape, strides, offset and element size, writes nothing outside the destination, and
refuses bad arguments without crashing."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv import arraycopy

try:
    from tierkv._streamcopy import copy
except ImportError:  # the first test fails and says why; the others skip
    copy = None
built = pytest.mark.skipif(copy is None, reason="tierkv._streamcopy was not built")


def test_chunks_are_copied_by_the_c_helper() -> None:
    """`make test` installs what the helper needs; a build that silently fell back to numpy
    would copy every chunk a third slower."""
    assert arraycopy.STREAMING, (
        "tierkv._streamcopy was not built: a C compiler and Python's headers must be present "
        "when tierkv is installed (scripts/ensure-system-deps.sh installs them)"
    )
    assert arraycopy.STORES in ("avx2", "sse2", "memcpy")


def _guarded(shape: tuple[int, ...], dtype: Any, offset: int) -> tuple[np.ndarray, np.ndarray]:
    """A zeroed array of ``shape`` starting ``offset`` bytes into a buffer of 0xAB guard bytes
    on both sides (so writes outside it, and unaligned starts, are seen)."""
    itemsize = np.dtype(dtype).itemsize
    nbytes = int(np.prod(shape)) * itemsize
    raw = np.full(nbytes + offset + 256, 0xAB, np.uint8)
    raw[offset : offset + nbytes] = 0
    return raw, raw[offset : offset + nbytes].view(dtype).reshape(shape)


@st.composite
def strided_pairs(draw: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(raw buffer, destination view in it at a random offset, source view): the source a
    random view (sliced, reversed, stepped, axes moved) of a random array."""
    dtype = draw(st.sampled_from([np.uint8, np.int16, np.int32, np.int64]))
    ndim = draw(st.integers(1, 5))
    base_shape = draw(st.lists(st.integers(1, 12), min_size=ndim, max_size=ndim))
    if draw(st.booleans()):  # long contiguous runs: the streaming path
        base_shape[-1] = draw(st.integers(64, 3000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    base = rng.integers(0, 2**7, size=base_shape, dtype=dtype)
    view = base
    for axis in range(ndim):
        step = draw(st.sampled_from([1, 1, 1, 2, -1]))
        start = draw(st.integers(0, base_shape[axis] - 1)) if step == 1 else 0
        index: list[Any] = [slice(None)] * ndim
        index[axis] = slice(start, None, step)
        view = view[tuple(index)]
    if ndim > 1 and draw(st.booleans()):
        view = np.moveaxis(view, draw(st.integers(0, ndim - 1)), draw(st.integers(0, ndim - 1)))
    offset = draw(st.integers(0, 80))
    raw, dst = _guarded(view.shape, dtype, offset)
    if draw(st.booleans()):  # a strided destination too
        raw, wide = _guarded((*view.shape[:-1], view.shape[-1] * 2), dtype, offset)
        dst = wide[..., ::2]
        wide[..., 1::2] = 0x55
    return raw, dst, view


@built
@settings(max_examples=400, deadline=None)
@given(case=strided_pairs())
def test_any_view_is_copied_exactly_and_nothing_else_is_written(
    case: tuple[np.ndarray, np.ndarray, np.ndarray],
) -> None:
    raw, dst, src = case
    before = raw.copy()
    arraycopy.copy_array(dst, src)
    np.testing.assert_array_equal(dst, src)
    # Every byte outside dst's elements is as it was.
    mask = np.ones(raw.size, bool)
    positions = np.arange(dst.size).reshape(dst.shape) if dst.size else np.zeros(0, int)
    starts = (
        (np.array(np.unravel_index(positions.ravel(), dst.shape)).T * dst.strides).sum(axis=1)
        + (dst.__array_interface__["data"][0] - raw.__array_interface__["data"][0])
        if dst.size
        else np.zeros(0, int)
    )
    for k in range(dst.itemsize):
        mask[starts + k] = False
    np.testing.assert_array_equal(raw[mask], before[mask])


@built
def test_a_chunk_of_every_size_and_misalignment() -> None:
    rng = np.random.default_rng(1)
    for n in (1, 15, 63, 64, 255, 256, 257, 1000, 4097, 1 << 20, (2 << 20) + 3):
        for src_off, dst_off in ((0, 0), (3, 1), (1, 31), (16, 7)):
            src = rng.integers(0, 256, n + src_off, dtype=np.uint8)[src_off:]
            raw = np.full(n + dst_off + 64, 0xAB, np.uint8)
            # Under 64 bytes the helper leaves the copy to numpy (False).
            assert copy(raw[dst_off : dst_off + n], src) is (n >= 64)
            arraycopy.copy_array(raw[dst_off : dst_off + n], src)
            np.testing.assert_array_equal(raw[dst_off : dst_off + n], src)
            assert (raw[:dst_off] == 0xAB).all() and (raw[dst_off + n :] == 0xAB).all()


@built
def test_a_vllm_style_gather_of_paged_blocks() -> None:
    """The connector's case: blocks of a stacked paged cache, axes moved, into a chunk."""
    rng = np.random.default_rng(2)
    # [layers, K/V, blocks, kv_heads, block_size, head_size]
    cache = rng.integers(0, 2**15, (4, 2, 40, 2, 16, 64), dtype=np.int16)
    chunk = np.zeros((2, 4, 2, 8 * 16, 64), np.int16)  # [K/V, layers, heads, tokens, dim]
    run = np.moveaxis(cache[:, :, 5:13], 2, -3).swapaxes(0, 1)  # [2, 4, 2, 8, 16, 64]
    arraycopy.copy_array(chunk.reshape(2, 4, 2, 8, 16, 64), run)
    np.testing.assert_array_equal(chunk.reshape(2, 4, 2, 8, 16, 64), run)
    back = np.zeros_like(cache)
    arraycopy.copy_array(np.moveaxis(back[:, :, 5:13], 2, -3).swapaxes(0, 1), run)
    np.testing.assert_array_equal(back[:, :, 5:13], cache[:, :, 5:13])
    assert not back[:, :, :5].any() and not back[:, :, 13:].any()


@built
def test_short_runs_are_left_to_numpy() -> None:
    """A transposed view has runs of one element: the helper copies nothing and says so,
    and copy_array copies with numpy instead."""
    src = np.arange(64 * 64, dtype=np.int32).reshape(64, 64).T
    dst = np.zeros((64, 64), np.int32)
    assert copy(dst, src) is False
    assert not dst.any()
    arraycopy.copy_array(dst, src)
    np.testing.assert_array_equal(dst, src)


@built
def test_overlapping_arrays_are_left_to_numpy() -> None:
    """Byte ranges that overlap (a shifted view, a reversed one, two interleaved ones): the
    helper copies nothing and says so; copy_array's result is numpy's."""
    for make in (
        lambda a: (a[:600], a[256:856]),
        lambda a: (a[256:856], a[:600]),
        lambda a: (a[::-1], a),
        lambda a: (a[::2], a[1::2]),
    ):
        a = np.arange(1024, dtype=np.int64)
        dst, src = make(a)
        assert copy(dst, src) is False
        np.testing.assert_array_equal(a, np.arange(1024))
        expected = np.arange(1024, dtype=np.int64)
        e_dst, e_src = make(expected)
        np.copyto(e_dst, e_src)
        arraycopy.copy_array(dst, src)
        np.testing.assert_array_equal(a, expected)


@built
def test_empty_and_scalar_arrays() -> None:
    assert copy(np.zeros((0, 5)), np.ones((0, 5))) is True
    dst = np.zeros(())
    arraycopy.copy_array(dst, np.ones(()))
    assert dst == 1.0


@built
def test_bad_arguments_are_refused_and_the_helper_keeps_working() -> None:
    a = np.zeros(1024, np.uint8)
    readonly = np.zeros(1024, np.uint8)
    readonly.flags.writeable = False
    cases: list[tuple[Any, Any, type[Exception]]] = [
        (np.zeros(1000), np.zeros(1001), ValueError),  # shapes
        (np.zeros((2, 500)), np.zeros(1000), ValueError),  # dimensions
        (np.zeros(1000, np.int32), np.zeros(1000, np.int64), ValueError),  # item sizes
        (readonly, np.zeros(1024, np.uint8), ValueError),  # numpy: "read-only"
        (b"x" * 100, bytearray(100), BufferError),
        (np.zeros(4), 7, TypeError),
        (None, np.zeros(4), TypeError),
    ]
    try:  # with vLLM (make test): a torch tensor is not a buffer
        import torch

        cases.append((torch.zeros(100), torch.zeros(100), TypeError))
    except ImportError:  # make test-fast on a bare venv
        pass
    for dst, src, error in cases:
        with pytest.raises(error):
            copy(dst, src)
    with pytest.raises(TypeError):
        copy(a)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="does not fit"):
        arraycopy.copy_array(np.zeros(3), np.zeros(4))
    src = np.arange(1024, dtype=np.uint8)
    assert copy(a, src) is True
    np.testing.assert_array_equal(a, src)


@built
def test_threads_copy_at_once() -> None:
    """The copy releases the GIL (the client's copy threads run several at once): eight
    threads each copying their own chunks, every byte where it belongs."""
    rng = np.random.default_rng(3)
    srcs = [rng.integers(0, 256, 3 << 20, dtype=np.uint8) for _ in range(8)]
    dsts = [np.zeros(3 << 20, np.uint8) for _ in range(8)]

    def work(i: int) -> None:
        for _ in range(5):
            arraycopy.copy_array(dsts[i], srcs[i])

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for d, s in zip(dsts, srcs, strict=True):
        np.testing.assert_array_equal(d, s)


@st.composite
def block_copies(draw: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray]:
    """(raw buffer, destination in it, source, axis, runs): a random strided source with
    ``src_blocks`` entries along ``axis``, a destination with ``dst_blocks`` there, and runs
    (j, b, count) that never write a destination block twice, some continuing each other."""
    dtype = draw(st.sampled_from([np.uint8, np.int16, np.int64]))
    ndim = draw(st.integers(1, 5))
    axis = draw(st.integers(0, ndim - 1))
    shape = draw(st.lists(st.integers(1, 6), min_size=ndim, max_size=ndim))
    if draw(st.booleans()):  # long contiguous runs: the streaming path
        shape[-1] = draw(st.integers(64, 700))
    src_blocks, dst_blocks = draw(st.integers(1, 12)), draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    src_shape = [*shape[:axis], src_blocks, *shape[axis + 1 :]]
    src = rng.integers(0, 2**7, size=src_shape, dtype=dtype)
    if ndim > 1 and draw(st.booleans()):  # the blocks' axis elsewhere in memory
        src = np.moveaxis(np.ascontiguousarray(np.moveaxis(src, axis, 0)), 0, axis)
    runs, j = [], draw(st.integers(0, dst_blocks - 1))
    while (j < dst_blocks and draw(st.booleans())) or not runs:
        count = draw(st.integers(1, min(dst_blocks - j, src_blocks)))
        b = draw(st.integers(0, src_blocks - count))
        if runs and draw(st.booleans()) and runs[-1][1] + runs[-1][2] + count <= src_blocks:
            b = runs[-1][1] + runs[-1][2]  # continues the run before (j does too)
            j = runs[-1][0] + runs[-1][2]
            if j + count > dst_blocks:
                break
        runs.append((j, b, count))
        j += count + draw(st.integers(0, 2))
    dst_shape = (*shape[:axis], dst_blocks, *shape[axis + 1 :])
    raw, dst = _guarded(dst_shape, dtype, draw(st.integers(0, 80)))
    return raw, dst, src, axis, np.array(runs, np.int64).reshape(-1, 3)


@built
@settings(max_examples=300, deadline=None)
@given(case=block_copies(), helper=st.booleans())
def test_blocks_picked_along_an_axis_are_copied_exactly_and_nothing_else_is_written(
    case: tuple[np.ndarray, np.ndarray, np.ndarray, int, np.ndarray],
    helper: bool,
) -> None:
    """copy_blocks (the connector's gather and scatter of a chunk's blocks) against numpy, with
    the C helper and with the Python loop a build without it takes."""
    raw, dst, src, axis, runs = case
    expected = dst.copy()
    for j, b, count in runs.tolist():
        index: list[Any] = [slice(None)] * dst.ndim
        index[axis] = slice(j, j + count)
        source = list(index)
        source[axis] = slice(b, b + count)
        expected[tuple(index)] = src[tuple(source)]
    offset = dst.__array_interface__["data"][0] - raw.__array_interface__["data"][0]
    before = raw.copy()
    with pytest.MonkeyPatch.context() as patch:
        if not helper:
            patch.setattr(arraycopy, "_stream_blocks", None)
        arraycopy.copy_blocks(dst, src, axis, runs)
    np.testing.assert_array_equal(dst, expected)
    outside = np.ones(raw.size, bool)
    outside[offset : offset + dst.nbytes] = False
    np.testing.assert_array_equal(raw[outside], before[outside])


@built
def test_bad_block_runs_are_refused_before_anything_is_copied() -> None:
    from tierkv._streamcopy import copy_blocks

    src = np.arange(4 * 10 * 64, dtype=np.int16).reshape(4, 10, 64)
    dst = np.zeros((4, 6, 64), np.int16)
    for runs in ([[0, 0, 1], [5, 9, 2]], [[0, 0, 1], [-1, 0, 1]], [[0, 9, 2]], [[1, 1, 0]]):
        # The first row is good: nothing may be copied when a later one is not.
        for copier in (copy_blocks, arraycopy.copy_blocks):
            with pytest.raises(IndexError, match="outside"):
                copier(dst, src, 1, np.array(runs, np.int64))
            assert not dst.any()
    good = np.array([[0, 2, 3]], np.int64)
    for args, error in [
        ((dst, src, 0, good), ValueError),  # other shapes off the axis
        ((dst, src, 3, good), ValueError),  # no such axis
        ((dst, src.astype(np.int32), 1, good), ValueError),  # item sizes
        ((dst, src, 1, good.astype(np.int32)), ValueError),  # runs not int64
        ((dst, src, 1, np.zeros(4, np.int64)), ValueError),  # not triples
        ((dst, src, 1, good[:, ::2]), ValueError),  # runs not contiguous
        ((dst, src, 1, [0, 2, 3]), TypeError),  # runs not a buffer
    ]:
        with pytest.raises(error):
            copy_blocks(*args)
    assert not dst.any()
    assert copy_blocks(dst, src, 1, good) is True
    np.testing.assert_array_equal(dst[:, :3], src[:, 2:5])
    assert not dst[:, 3:].any()


@built
def test_blocks_whose_axis_lies_inside_a_short_run_are_copied_one_by_one() -> None:
    """A layout whose one-block slice has long runs but whose block axis lies inside the
    contiguous run (Fortran order; a transposed view): a run of several blocks has no plan
    of its own, so it is copied block by block (before: reported done, nothing copied)."""
    from tierkv._streamcopy import copy_blocks

    src = np.asfortranarray(np.arange(16 * 64, dtype=np.int64).reshape(16 * 8, 8))
    dst = np.zeros_like(src, order="F")
    assert copy_blocks(dst, src, 1, np.array([[0, 0, 2], [4, 5, 3]], np.int64)) is True
    np.testing.assert_array_equal(dst[:, [0, 1, 4, 5, 6]], src[:, [0, 1, 5, 6, 7]])
    assert not dst[:, [2, 3, 7]].any()
    t = np.arange(4 * 16 * 4, dtype=np.float32).reshape(4, 16, 4).transpose(1, 0, 2)
    out = np.zeros((4, 16, 4), np.float32).transpose(1, 0, 2)
    for runs in ([[0, 0, 2]], [[0, 0, 1], [1, 1, 1]]):
        out[...] = 0
        copied = copy_blocks(out, t, 1, np.array(runs, np.int64))
        if copied:
            np.testing.assert_array_equal(out[:, :2], t[:, :2])
        arraycopy.copy_blocks(out, t, 1, np.array(runs, np.int64))
        np.testing.assert_array_equal(out[:, :2], t[:, :2])


def test_short_or_overlapping_block_runs_are_left_to_numpy() -> None:
    from tierkv._streamcopy import copy_blocks

    src = np.arange(8 * 64, dtype=np.int16).reshape(8, 64).T  # runs of one element
    dst = np.zeros((64, 4), np.int16)
    runs = np.array([[0, 1, 2], [2, 6, 2]], np.int64)
    assert copy_blocks(dst, src, 1, runs) is False and not dst.any()
    arraycopy.copy_blocks(dst, src, 1, runs)
    np.testing.assert_array_equal(dst, src[:, [1, 2, 6, 7]])
    a = np.arange(16 * 64, dtype=np.int64).reshape(16, 64)
    assert copy_blocks(a[:8], a[4:], 0, np.array([[0, 0, 8]], np.int64)) is False
    expected = a.copy()
    expected[:8] = expected[4:12].copy()
    arraycopy.copy_blocks(a[:8], a[4:], 0, np.array([[0, 0, 8]], np.int64))
    np.testing.assert_array_equal(a, expected)
