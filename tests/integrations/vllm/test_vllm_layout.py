"""Layout detection and block <-> chunk copies on real torch tensors.

The CPU cases use KV caches allocated by vLLM itself (``allocate_kv_cache``) and filled by
the CPU attention backend's own kernel (``cpu_attn_reshape_and_cache``), whose block format
depends on the ISA (K transposed for ``vec``, pair-packed for ``amx``): a block moved through
a chunk must hold exactly what the kernel would have written there itself. MLA caches are
allocated the same way and filled by the CPU MLA backend's own cache write.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from support import vllm_engine

try:
    import torch

    from tierkv.integrations.vllm.layout import (
        BLOCK_FIRST,
        KV_FIRST,
        MLA,
        MLA_FORMAT,
        NATIVE,
        SPLIT_LAST,
        CacheGeometry,
        KVLayoutSettingError,
        PagedKVLayout,
        UnsupportedLayoutError,
        block_runs,
        detect_layout,
    )
except ImportError:  # the conftest fails every test with the reason
    pass

pytestmark = pytest.mark.vllm


LAYERS, BLOCKS, BLOCK, HEADS, HEAD = 3, 8, 32, 2, 32
CHUNK = 64  # two blocks per chunk


def vllm_cpu_caches(dtype: Any = None) -> dict[str, Any]:
    """Per-layer KV caches exactly as vLLM's CPU worker allocates them (LBHNC)."""
    return vllm_engine.vllm_cpu_caches(LAYERS, BLOCKS, BLOCK, HEADS, HEAD, dtype)


def cpu_isa(dtype: Any) -> str:
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, BLOCK, HEAD))


def cpu_backend_write(cache: Any, key: Any, value: Any, blocks: list[int]) -> None:
    """Write K/V of ``len(blocks) * BLOCK`` tokens into ``blocks`` with the CPU backend's
    kernel, viewing the cache as the backend does."""
    from vllm import _custom_ops as ops

    n_blocks, heads, block, _ = cache.shape
    k_cache, v_cache = cache.view(n_blocks, heads, block * 2, -1).chunk(2, dim=2)
    slots = torch.tensor([b * block + t for b in blocks for t in range(block)], dtype=torch.long)
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, slots, cpu_isa(cache.dtype))


def cpu_backends(dtype: Any) -> dict[str, str]:
    return {f"model.layers.{i}.self_attn.attn": f"CPU_ATTN/{cpu_isa(dtype)}" for i in range(LAYERS)}


GEOMETRY_ARGS = (BLOCK, HEADS, HEAD)


def test_cpu_layout_is_native_tagged_with_its_isa_and_stacked() -> None:
    caches = vllm_cpu_caches()
    layout = detect_layout(caches, CacheGeometry(*GEOMETRY_ARGS), cpu_backends(torch.float32))
    assert layout.kind == NATIVE
    assert layout.num_layers == LAYERS
    assert layout.num_blocks == BLOCKS
    assert layout.stacked is not None  # one copy call per block for all layers
    assert layout.chunk_shape(CHUNK) == [LAYERS, HEADS, CHUNK, 2 * HEAD]
    assert layout.token_axis == 2
    assert layout.format_tag == f"native:CPU_ATTN/{cpu_isa(torch.float32)}:bs{BLOCK}:kb{BLOCK}"
    assert layout.dtype_name == "float32"
    # Zero-copy views: they alias vLLM's memory.
    name = layout.layer_names[1]
    assert layout.views[1].data_ptr() == caches[name].data_ptr()


def test_cpu_layout_without_its_isa_is_refused() -> None:
    caches = vllm_cpu_caches()
    backends = {name: "CPU_ATTN" for name in caches}
    with pytest.raises(UnsupportedLayoutError, match="ISA"):
        detect_layout(caches, CacheGeometry(*GEOMETRY_ARGS), backends)


def test_layers_are_ordered_naturally_and_shared_layers_kept_once() -> None:
    caches = vllm_cpu_caches()
    names = list(caches)
    shuffled = {names[2]: caches[names[2]], names[0]: caches[names[0]], names[1]: caches[names[1]]}
    shuffled["model.layers.10.self_attn.attn"] = caches[names[1]]  # KV sharing: same tensor
    backend = f"CPU_ATTN/{cpu_isa(torch.float32)}"
    layout = detect_layout(
        shuffled, CacheGeometry(*GEOMETRY_ARGS), {name: backend for name in shuffled}
    )
    assert layout.layer_names == tuple(names)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_cpu_blocks_moved_through_a_chunk_equal_what_the_kernel_writes(dtype_name: str) -> None:
    """Engine X computes a chunk into blocks 5 and 2; it travels through a chunk into blocks
    6 and 1 of engine Y; there it must equal what Y's kernel writes for the same K/V."""
    dtype = getattr(torch, dtype_name)
    x, y, reference = vllm_cpu_caches(dtype), vllm_cpu_caches(dtype), vllm_cpu_caches(dtype)
    gen = torch.Generator().manual_seed(1)
    for name in sorted(x):
        key = torch.randn(CHUNK, HEADS, HEAD, generator=gen).to(dtype)
        value = torch.randn(CHUNK, HEADS, HEAD, generator=gen).to(dtype)
        cpu_backend_write(x[name], key, value, [5, 2])
        cpu_backend_write(reference[name], key, value, [6, 1])

    backends = cpu_backends(dtype)
    lx = detect_layout(x, CacheGeometry(*GEOMETRY_ARGS), backends)
    ly = detect_layout(y, CacheGeometry(*GEOMETRY_ARGS), backends)
    chunk = torch.zeros(lx.chunk_shape(CHUNK), dtype=dtype)
    lx.read_block(5, chunk, 0)
    lx.read_block(2, chunk, BLOCK)
    ly.write_block(6, chunk, 0)
    ly.write_block(1, chunk, BLOCK)
    for name in y:
        assert torch.equal(y[name], reference[name])  # blocks 6, 1 right; the rest untouched


def test_round_trip_through_a_numpy_slot_view() -> None:
    """Chunks travel as numpy views of the pool (bfloat16 as uint16): no copy, exact bytes."""
    import numpy as np

    caches = vllm_cpu_caches(torch.bfloat16)
    layout = detect_layout(caches, CacheGeometry(*GEOMETRY_ARGS), cpu_backends(torch.bfloat16))
    for t in caches.values():
        t.copy_(torch.randn(t.shape, generator=torch.Generator().manual_seed(3)).to(t.dtype))
    slot = np.zeros(layout.chunk_shape(CHUNK), dtype=np.uint16)
    tensor = layout.chunk_tensor(slot)
    assert tensor.dtype == torch.bfloat16 and tensor.data_ptr() == slot.ctypes.data
    layout.read_block(3, tensor, 0)
    layout.read_block(4, tensor, BLOCK)
    copies = {name: t.clone() for name, t in caches.items()}
    for t in caches.values():
        t.zero_()
    layout.write_block(3, layout.chunk_tensor(slot), 0)
    layout.write_block(4, layout.chunk_tensor(slot), BLOCK)
    for name, t in caches.items():
        assert torch.equal(t[3:5], copies[name][3:5])


def split_last_caches() -> dict[str, Any]:
    """GPU-style 4-D caches: per token and head, K then V along the last axis (contiguous
    per layer, as FlashAttention/Triton backends see them)."""
    return {
        f"model.layers.{i}.self_attn.attn": torch.randn(
            BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=torch.Generator().manual_seed(10 + i)
        )
        for i in range(LAYERS)
    }


def test_split_last_layout_for_gpu_backends() -> None:
    caches = split_last_caches()
    backends = {name: "FLASH_ATTN" for name in caches}
    layout = detect_layout(caches, CacheGeometry(*GEOMETRY_ARGS), backends)
    assert layout.kind == SPLIT_LAST
    assert layout.stacked is None  # separate allocations: one copy per layer
    chunk = torch.zeros(layout.chunk_shape(CHUNK))
    layout.read_block(7, chunk, 0)
    for layer, name in enumerate(layout.layer_names):
        block = caches[name][7]  # [heads, tokens, 2 * head]
        assert torch.equal(chunk[0, layer, :, :BLOCK], block[..., :HEAD])
        assert torch.equal(chunk[1, layer, :, :BLOCK], block[..., HEAD:])


def test_legacy_five_dimensional_layouts() -> None:
    gen = torch.Generator().manual_seed(4)
    kv_first = {"l.0": torch.randn(2, BLOCKS, BLOCK, HEADS, HEAD, generator=gen)}
    layout = detect_layout(kv_first, CacheGeometry(*GEOMETRY_ARGS))
    assert layout.kind == KV_FIRST
    chunk = torch.zeros(layout.chunk_shape(BLOCK))
    layout.read_block(2, chunk, 0)
    assert torch.equal(chunk[1, 0], kv_first["l.0"][1, 2].transpose(0, 1))

    block_first = {"l.0": torch.randn(BLOCKS, 2, BLOCK, HEADS, HEAD, generator=gen)}
    layout = detect_layout(block_first, CacheGeometry(*GEOMETRY_ARGS))
    assert layout.kind == BLOCK_FIRST
    layout.write_block(4, chunk, 0)
    assert torch.equal(block_first["l.0"][4, 0], chunk[0, 0].transpose(0, 1))


def test_kernel_blocks_smaller_than_vllm_blocks() -> None:
    """A vLLM block split into two kernel blocks of half the tokens."""
    gen = torch.Generator().manual_seed(4)
    caches = {"l.0": torch.randn(2 * BLOCKS, HEADS, BLOCK // 2, 2 * HEAD, generator=gen)}
    layout = detect_layout(caches, CacheGeometry(*GEOMETRY_ARGS), {"l.0": "TRITON_ATTN"})
    assert layout.sub_blocks == 2 and layout.num_blocks == BLOCKS
    chunk = torch.zeros(layout.chunk_shape(BLOCK))
    layout.read_block(3, chunk, 0)
    half = BLOCK // 2
    assert torch.equal(chunk[0, 0, :, :half], caches["l.0"][6][..., :HEAD])
    assert torch.equal(chunk[0, 0, :, half:], caches["l.0"][7][..., :HEAD])


@pytest.mark.parametrize(
    ("caches", "backends", "message"),
    [
        ({"l.0": (BLOCKS, BLOCK, 576)}, {}, "MLA cache spec"),
        ({"l.0": (BLOCKS, HEADS, BLOCK, 2 * HEAD)}, {"l.0": "SOME_NEW_BACKEND"}, "does not know"),
        ({"l.0": (BLOCKS, HEADS + 1, BLOCK, 2 * HEAD)}, {"l.0": "CPU_ATTN/vec"}, "not match"),
        ({"l.0": (BLOCKS, HEADS, 24, 2 * HEAD)}, {"l.0": "TRITON_ATTN"}, "does not match"),
        (
            {"l.0": (BLOCKS, HEADS, BLOCK, 2 * HEAD), "l.1": (BLOCKS, HEADS, BLOCK // 2, 2 * HEAD)},
            {"l.0": "CPU_ATTN/vec", "l.1": "CPU_ATTN/vec"},
            "layers differ",
        ),
    ],
)
def test_unknown_layouts_are_refused(
    caches: dict[str, tuple[int, ...]], backends: dict[str, str], message: str
) -> None:
    tensors = {name: torch.zeros(shape) for name, shape in caches.items()}
    with pytest.raises(UnsupportedLayoutError, match=message):
        detect_layout(tensors, CacheGeometry(*GEOMETRY_ARGS), backends)


def test_override_names_the_content_of_an_unknown_backend() -> None:
    caches = split_last_caches()
    layout = detect_layout(
        caches, CacheGeometry(*GEOMETRY_ARGS), {n: "SOME_NEW_BACKEND" for n in caches}, "split_last"
    )
    assert isinstance(layout, PagedKVLayout) and layout.kind == SPLIT_LAST


def test_native_override_for_an_unknown_backend_tags_it() -> None:
    caches = split_last_caches()
    layout = detect_layout(
        caches, CacheGeometry(*GEOMETRY_ARGS), {n: "SOME_NEW_BACKEND" for n in caches}, "native"
    )
    assert layout.format_tag.startswith("native:SOME_NEW_BACKEND:")


@pytest.mark.parametrize(
    ("backend", "kv_layout"),
    [("CPU_ATTN/vec", "split_last"), ("FLASH_ATTN", "native"), ("TRITON_ATTN", "native")],
)
def test_an_override_contradicting_a_known_backend_is_a_configuration_error(
    backend: str, kv_layout: str
) -> None:
    """kv_layout is for backends tierkv does not know: on a known one another content
    tagged the blocks with a format they are not in (a CPU_ATTN engine's native blocks
    stored as split_last, which FLASH_ATTN engines load as K|V halves): refused at start,
    naming the backend. The content tierkv knows, or auto, is accepted."""
    caches = split_last_caches()
    backends = dict.fromkeys(caches, backend)
    with pytest.raises(KVLayoutSettingError, match=rf"{backend}.*only for attention backends"):
        detect_layout(caches, CacheGeometry(*GEOMETRY_ARGS), backends, kv_layout)
    known = "native" if backend.startswith("CPU_ATTN") else "split_last"
    for content in ("auto", known):
        assert detect_layout(caches, CacheGeometry(*GEOMETRY_ARGS), backends, content).kind == known


def geometry_of(name: str) -> CacheGeometry:
    """The cache spec's geometry of a layout of :func:`layouts_of_every_kind`."""
    return mla_geometry() if name == "mla" else CacheGeometry(*GEOMETRY_ARGS)


def torch_copies(layout: PagedKVLayout) -> PagedKVLayout:
    """The same layout with its host views dropped: copies go through torch ``copy_``, as
    they do for caches on an accelerator."""
    clone = copy.copy(layout)
    clone.host_views = clone.host_stacked = None
    return clone


def layouts_of_every_kind() -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    """(name, caches, backends) for every layout the copies handle: native CPU (stacked),
    split_last stacked and per layer, kernel sub-blocks, both 5-D layouts, bfloat16."""
    gen = torch.Generator().manual_seed(5)
    one_allocation = torch.randn(LAYERS, BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=gen)
    bf16 = vllm_cpu_caches(torch.bfloat16)
    for t in bf16.values():
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    mla = vllm_engine.vllm_cpu_mla_caches(LAYERS, BLOCKS, BLOCK, LATENT)
    for t in mla.values():
        t.copy_(torch.randn(t.shape, generator=gen))
    return [
        ("native", bf16, cpu_backends(torch.bfloat16)),
        ("mla", mla, dict.fromkeys(mla, "CPU_MLA")),
        ("split_last", split_last_caches(), dict.fromkeys(split_last_caches(), "FLASH_ATTN")),
        (
            "split_last_stacked",
            {f"model.layers.{i}.attn": one_allocation[i] for i in range(LAYERS)},
            {f"model.layers.{i}.attn": "FLASH_ATTN" for i in range(LAYERS)},
        ),
        (
            "sub_blocks",
            {"l.0": torch.randn(2 * BLOCKS, HEADS, BLOCK // 2, 2 * HEAD, generator=gen)},
            {"l.0": "TRITON_ATTN"},
        ),
        ("kv_first", {"l.0": torch.randn(2, BLOCKS, BLOCK, HEADS, HEAD, generator=gen)}, {}),
        (
            "block_first",
            {"l.0": torch.randn(BLOCKS, 2, HEADS, BLOCK, HEAD, generator=gen).transpose(2, 3)},
            {"l.0": "FLASHINFER"},
        ),
    ]


@pytest.mark.parametrize("index", range(7))
def test_host_copies_equal_torch_copies_for_every_layout(index: int) -> None:
    """The numpy copies of host caches move exactly what torch ``copy_`` moves, both ways,
    for several blocks of a chunk in any order."""
    name, caches, backends = layouts_of_every_kind()[index]
    layout = detect_layout(caches, geometry_of(name), backends)
    assert layout.host_views is not None, name
    assert (layout.stacked is None) == (name == "split_last"), name  # per layer: the one case
    reference = torch_copies(layout)
    blocks = [(1, 5), (0, 2)]  # chunk position, vLLM block
    host = torch.zeros(layout.chunk_shape(CHUNK), dtype=layout.dtype)
    expected = torch.zeros_like(host)
    layout.read_blocks(blocks, host)
    reference.read_blocks(blocks, expected)
    assert torch.equal(host, expected) and host.any(), name

    before = {n: t.clone() for n, t in caches.items()}
    source = torch.randn(host.shape, generator=torch.Generator().manual_seed(6)).to(host.dtype)
    layout.write_blocks([(0, 6), (1, 3)], source)
    written = {n: t.clone() for n, t in caches.items()}
    for n, t in caches.items():
        t.copy_(before[n])
    reference.write_blocks([(0, 6), (1, 3)], source)
    for n, t in caches.items():
        assert torch.equal(t, written[n]), (name, n)
        assert not torch.equal(t, before[n]), (name, n)


def test_block_offsets_must_be_whole_blocks() -> None:
    caches = split_last_caches()
    layout = detect_layout(
        caches, CacheGeometry(*GEOMETRY_ARGS), dict.fromkeys(caches, "FLASH_ATTN")
    )
    with pytest.raises(ValueError, match="multiple of the block size"):
        layout.read_block(1, torch.zeros(layout.chunk_shape(CHUNK)), BLOCK // 2)


@pytest.mark.parametrize("index", range(7))
@pytest.mark.parametrize("host", [True, False])
def test_runs_of_consecutive_blocks_copy_what_single_blocks_do(index: int, host: bool) -> None:
    """A chunk's blocks in runs of consecutive block ids (copied one run at a time) move the
    same bytes, both ways, as the same blocks copied one at a time; numpy and torch."""
    name, caches, backends = layouts_of_every_kind()[index]
    layout = detect_layout(caches, geometry_of(name), backends)
    layout = layout if host else torch_copies(layout)
    wide = 4 * CHUNK  # eight blocks: runs of 3, 1 and 2, and a lone one
    blocks = [(0, 1), (1, 2), (2, 3), (3, 7), (4, 4), (5, 5), (7, 0)]
    assert [n for _, _, n in block_runs(blocks)] == [3, 1, 2, 1]
    got = torch.zeros(layout.chunk_shape(wide), dtype=layout.dtype)
    expected = torch.zeros_like(got)
    layout.read_blocks(blocks, got)
    for pair in blocks:
        layout.read_blocks([pair], expected)
    assert torch.equal(got, expected) and got.any(), name

    before = {n: t.clone() for n, t in caches.items()}
    source = torch.randn(got.shape, generator=torch.Generator().manual_seed(7)).to(got.dtype)
    layout.write_blocks(blocks, source)
    written = {n: t.clone() for n, t in caches.items()}
    for n, t in caches.items():
        t.copy_(before[n])
    for pair in blocks:
        layout.write_blocks([pair], source)
    for n, t in caches.items():
        assert torch.equal(t, written[n]), (name, n)
        assert not torch.equal(t, before[n]), (name, n)


# -- MLA ---------------------------------------------------------------------------------------
LATENT, LORA, ROPE = 576, 512, 64  # DeepSeek-V2: kv_lora_rank + qk_rope_head_dim


def mla_geometry() -> CacheGeometry:
    """The MLA test caches' geometry (built when a test asks: vLLM may not be installed)."""
    return CacheGeometry(BLOCK, 1, LATENT, latent=True)


def mla_caches(dtype: Any = None) -> dict[str, Any]:
    """Per-layer MLA caches exactly as vLLM's CPU worker allocates them."""
    return vllm_engine.vllm_cpu_mla_caches(LAYERS, BLOCKS, BLOCK, LATENT, dtype)


def cpu_mla_write(cache: Any, kv_c: Any, k_pe: Any, blocks: list[int]) -> None:
    """Write the latents of ``len(blocks) * BLOCK`` tokens into ``blocks`` with the CPU MLA
    backend's own cache write (``CPUMLAImpl.do_kv_cache_update``, which reads nothing of
    the layer it belongs to)."""
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    slots = torch.tensor([b * BLOCK + t for b in blocks for t in range(BLOCK)], dtype=torch.long)
    impl = object.__new__(CPUMLAImpl)
    impl.do_kv_cache_update(kv_c, k_pe.unsqueeze(1), cache, slots, "auto", torch.ones(()))


def mla_backends() -> dict[str, str]:
    return {f"model.layers.{i}.self_attn.attn": "CPU_MLA" for i in range(LAYERS)}


def test_mla_layout_is_one_latent_head_stacked_with_a_shared_format() -> None:
    caches = mla_caches()
    layout = detect_layout(caches, mla_geometry(), mla_backends())
    assert layout.kind == MLA and layout.latent and layout.as_stored
    assert layout.format_tag == MLA_FORMAT  # the same for every listed MLA backend
    assert layout.chunk_shape(CHUNK) == [LAYERS, 1, CHUNK, LATENT]
    assert layout.token_axis == 2 and layout.num_blocks == BLOCKS
    assert layout.stacked is not None
    name = layout.layer_names[2]
    assert layout.views[2].data_ptr() == caches[name].data_ptr()  # zero-copy views


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_mla_chunk_holds_each_token_latent_contiguously_and_moves_byte_exact(
    dtype_name: str,
) -> None:
    """Engine X's backend writes a chunk's latents into blocks 5 and 2; the chunk holds, per
    layer, exactly the tokens' ``kv_c ++ k_pe`` in order (a contiguous copy of what was
    written); scattered into blocks 6 and 1 of engine Y, Y equals what Y's backend writes
    there for the same latents, byte for byte, and no other block changed."""
    dtype = getattr(torch, dtype_name)
    x, y, reference = mla_caches(dtype), mla_caches(dtype), mla_caches(dtype)
    gen = torch.Generator().manual_seed(11)
    latents = []
    for name in sorted(x, key=lambda n: int(n.split(".")[2])):
        kv_c = torch.randn(CHUNK, LORA, generator=gen).to(dtype)
        k_pe = torch.randn(CHUNK, ROPE, generator=gen).to(dtype)
        cpu_mla_write(x[name], kv_c, k_pe, [5, 2])
        cpu_mla_write(reference[name], kv_c, k_pe, [6, 1])
        latents.append(torch.cat([kv_c, k_pe], dim=-1))
    lx = detect_layout(x, mla_geometry(), mla_backends())
    ly = detect_layout(y, mla_geometry(), mla_backends())
    chunk = torch.zeros(lx.chunk_shape(CHUNK), dtype=dtype)
    lx.read_blocks([(0, 5), (1, 2)], chunk)
    assert torch.equal(chunk[:, 0], torch.stack(latents))  # [layers, tokens, latent]
    ly.write_blocks([(0, 6), (1, 1)], chunk)
    for name in y:
        assert torch.equal(y[name].view(torch.uint8), reference[name].view(torch.uint8))


def has_amx() -> bool:
    with open("/proc/cpuinfo") as fh:
        return "amx_tile" in fh.read().split()


@pytest.mark.skipif(not has_amx(), reason="vLLM's AMX_MLA kernels need a CPU with AMX tiles")
def test_amx_mla_writes_the_same_latent_bytes_as_cpu_mla() -> None:
    """AMX_MLA (vLLM's MLA backend on CPUs with AMX tiles, bfloat16) writes its cache with a
    kernel of its own: per token slot, the same ``kv_c ++ k_pe`` bytes as CPU_MLA, so its
    chunks are the shared latent format."""
    from vllm import _custom_ops as ops

    dtype = torch.bfloat16
    amx_block = 32  # AMX_MLA's blocks: a multiple of 32 tokens
    geometry = CacheGeometry(amx_block, 1, LATENT, latent=True)
    gen = torch.Generator().manual_seed(13)
    kv_c = torch.randn(2 * amx_block, LORA, generator=gen).to(dtype)
    k_pe = torch.randn(2 * amx_block, ROPE, generator=gen).to(dtype)
    blocks = [5, 2]
    slots = torch.tensor([b * amx_block + t for b in blocks for t in range(amx_block)])
    amx = torch.zeros(BLOCKS, 1, amx_block, LATENT, dtype=dtype)
    ops.amx_mla_concat_and_cache(kv_c, k_pe, amx.view(BLOCKS, amx_block, LATENT), slots)
    cpu = torch.zeros_like(amx)
    from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

    impl = object.__new__(CPUMLAImpl)
    impl.do_kv_cache_update(kv_c, k_pe.unsqueeze(1), cpu, slots, "auto", torch.ones(()))
    assert torch.equal(amx.view(torch.uint8), cpu.view(torch.uint8)) and amx.any()
    layout = detect_layout({"l.0": amx}, geometry, {"l.0": "AMX_MLA"})
    assert layout.format_tag == MLA_FORMAT
    chunk = torch.zeros(layout.chunk_shape(2 * amx_block), dtype=dtype)
    layout.read_blocks([(0, 5), (1, 2)], chunk)
    assert torch.equal(chunk[0, 0], torch.cat([kv_c, k_pe], dim=-1))


def test_mla_three_dimensional_gpu_caches_map_to_the_same_chunk() -> None:
    """GPU MLA backends hand ``[blocks, tokens, latent]`` per layer: the chunk is the same
    as from the four-dimensional CPU view of the same bytes."""
    gen = torch.Generator().manual_seed(12)
    flat = {f"model.layers.{i}.self_attn.attn": torch.randn(BLOCKS, BLOCK, LATENT, generator=gen)
            for i in range(LAYERS)}  # fmt: skip
    four = {n: t.unsqueeze(1) for n, t in flat.items()}
    backends = dict.fromkeys(flat, "TRITON_MLA")
    a = detect_layout(flat, mla_geometry(), backends)
    b = detect_layout(four, mla_geometry(), backends)
    assert a.chunk_shape(CHUNK) == b.chunk_shape(CHUNK) and a.format_tag == b.format_tag
    got_a, got_b = torch.zeros(a.chunk_shape(CHUNK)), torch.zeros(b.chunk_shape(CHUNK))
    a.read_blocks([(0, 3), (1, 7)], got_a)
    b.read_blocks([(0, 3), (1, 7)], got_b)
    assert torch.equal(got_a, got_b) and got_a.any()


@pytest.mark.parametrize(
    ("backend", "shape", "message"),
    [
        ("FLASHMLA_SPARSE", (BLOCKS, 1, BLOCK, LATENT), "knows the latent cache format"),
        ("", (BLOCKS, 1, BLOCK, LATENT), "knows the latent cache format"),
        ("CPU_MLA", (BLOCKS, 2, BLOCK, LATENT), "does not match"),
        ("CPU_MLA", (BLOCKS, 1, BLOCK, LATENT + 64), "does not match"),
        ("CPU_MLA", (BLOCKS, 1, 24, LATENT), "does not match"),
    ],
)
def test_mla_caches_tierkv_cannot_map_are_refused(
    backend: str, shape: tuple[int, ...], message: str
) -> None:
    with pytest.raises(UnsupportedLayoutError, match=message):
        detect_layout({"l.0": torch.zeros(shape)}, mla_geometry(), {"l.0": backend})


# -- several KV cache groups (vLLM's hybrid allocator) ---------------------------------------------
def test_grouped_layers_copy_their_own_groups_blocks_and_skip_null_ones() -> None:
    """Two layers of two groups sharing one tensor (as vLLM's hybrid allocator lays them
    out: a block belongs to one group at a time): each layer moves its own group's blocks,
    a group's null block (0: behind a sliding window) is never read nor written."""
    shared = torch.randn(BLOCKS, HEADS, BLOCK, 2 * HEAD, generator=torch.Generator().manual_seed(9))
    caches = {"model.layers.0.attn": shared, "model.layers.1.attn": shared}
    groups = {"model.layers.0.attn": 0, "model.layers.1.attn": 1}
    layout = detect_layout(
        caches, CacheGeometry(*GEOMETRY_ARGS), dict.fromkeys(caches, "TRITON_ATTN"), groups=groups
    )
    assert layout.num_layers == 2 and layout.layer_groups == (0, 1)
    for copies in (layout, torch_copies(layout)):
        chunk = torch.zeros(copies.chunk_shape(CHUNK))
        copies.read_blocks([(0, (5, 2)), (1, (6, 0))], chunk)
        assert torch.equal(chunk[0, 0, :, :BLOCK], shared[5][..., :HEAD])
        assert torch.equal(chunk[0, 0, :, BLOCK:], shared[6][..., :HEAD])
        assert torch.equal(chunk[1, 1, :, :BLOCK], shared[2][..., HEAD:])
        assert not chunk[:, 1, :, BLOCK:].any()  # layer 1's null block: not read

        before = shared.clone()
        source = torch.randn(chunk.shape, generator=torch.Generator().manual_seed(10))
        copies.write_blocks([(0, (3, 0)), (1, (4, 7))], source)
        assert torch.equal(shared[3][..., :HEAD], source[0, 0, :, :BLOCK])
        assert torch.equal(shared[4][..., :HEAD], source[0, 0, :, BLOCK:])
        assert torch.equal(shared[7][..., HEAD:], source[1, 1, :, BLOCK:])
        untouched = [b for b in range(BLOCKS) if b not in (3, 4, 7)]
        assert torch.equal(shared[untouched], before[untouched])  # block 0 included
        shared.copy_(before)
