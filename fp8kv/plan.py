"""Launch plans: grid, warps, and every scalar and constexpr by name, from shapes alone.

Both frontends launch exactly what a plan says (bound by name, :mod:`fp8kv.binding`); nothing here
imports torch or jax. The constexprs are a few records (:mod:`fp8kv.constexprs`): the caches, the
call's rows or outputs, the tile, and ``EXACT``. Plans are cached on the (hashable) validated
arguments, so a steady-state call costs one dict lookup.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import triton

from .arrays import ArrayInfo
from .constexprs import (Cache, NvFp4WriteTile, Output, ReadTile, Rows, Side, Strides,
                         WriteRows, WriteTile)
from .formats import FORMAT_OF_DTYPE, FP8_OUTPUT_DTYPE
from .layout import Layers, combined_halves, paged
from .modes import OUT_KIND_OF_DTYPE, Division, LayerKind, ScaleKind
from .validate import DequantArgs, WriteArgs

INTERPRET, CUDA = "interpret", "cuda"

# Elements per program (per K or V) and warps, per backend (bench/NOTES.md has the measurements
# behind each entry). The interpreter runs one program at a time, slowly, so it gets big
# tiles. Large batches take `num_warps` (one 16-byte load of K and one of V per thread, many
# programs per SM), smaller ones more warps (more memory requests in flight, shorter dependency
# chains per thread): batches of up to `small_batch_elems` row elements use
# `small_batch_warps`, and static-scale ones of up to `decode_batch_elems`
# `decode_batch_warps`.
# reciprocal_div (a fp8kv.modes.Division): how small batches divide by a per-tensor scale --
# DIV_RN: div.rn per element; FMA: one fp32 reciprocal and two FMA corrections per element
# (codec.divide_by_scalar); FP64: one fp64 reciprocal and an fp64 product per element
# (codec.divide_fp64); all exact. Large batches divide with div.rn.
# loads_first_elems: per-token-head writes load both sides' tiles before the first amax when a
# tile has at most this many elements; larger tiles (register pressure) and per-token scales run
# one side after the other. The interpreter takes both orders (per-token-head / per-token).
# split_*: batches of up to split_batch_tokens tokens with static scales split each row into
# chunks of split_chunk columns, one program per (token, chunk) (grid axis 1), with split_warps
# warps and split_division (a fp8kv.modes.Division): a decode step's few tokens then use
# several SMs instead of queueing on one SM's schedulers. Dynamic scales need whole rows and
# never split.
WRITE_SIZES = {
    CUDA: dict(tile=1024, max_block_hd=1024, num_warps=2, small_batch_warps=8,
               small_batch_elems=1 << 20, decode_batch_warps=16, decode_batch_elems=1 << 18,
               reciprocal_div=Division.DIV_RN, loads_first_elems=1024,
               split_batch_tokens=16, split_chunk=128, split_warps=4,
               split_division=Division.DIV_RN),
    INTERPRET: dict(tile=1 << 16, max_block_hd=1 << 16, num_warps=1, small_batch_warps=1,
                    small_batch_elems=0, decode_batch_warps=1, decode_batch_elems=0,
                    reciprocal_div=Division.DIV_RN,
                    loads_first_elems=1 << 16, split_batch_tokens=0, split_chunk=1 << 16,
                    split_warps=1, split_division=Division.DIV_RN),
}
DEQUANT_SIZES = {
    CUDA: dict(block=2048, num_warps=4),
    INTERPRET: dict(block=1 << 16, num_warps=1),
}
# NVFP4 (docs/SPEC.md section 13; kernels write_nvfp4 / dequantize_nvfp4). write: elements of
# whole rows per program and side (tile) and warps. A thread holds one group of 32 consecutive
# elements per side (two blocks; 16 bytes of codes to store), so a tile of 1,024 elements over
# 1 warp maps one group to each thread (one 8 x 128 token). Batches of up to small_batch_elems
# row elements take small_tile and small_batch_warps and, with small_blockwise, load
# [T, H, D/16, 16] blocks over two threads each (a quarter of a group's chain per thread; the
# amax a two-thread reduction) instead of whole groups per thread. loads_first: both sides' loads
# before the first amax. dequantize: output elements per program (block) and warps; lookup: an
# FP8 output by a per-block table (ops/dequantize_nvfp4.py _lookup_side), where the arrays allow
# its 4-byte words, with lookup_block output elements per program. bench/nvfp4.py times the
# variants.
NVFP4_WRITE_SIZES = {
    CUDA: dict(tile=1024, num_warps=1, small_tile=1024, small_batch_warps=4,
               small_batch_elems=1 << 18, loads_first=True, small_blockwise=True),
    INTERPRET: dict(tile=1 << 16, num_warps=1, small_tile=1 << 16, small_batch_warps=1,
                    small_batch_elems=0, loads_first=True, small_blockwise=False),
}
NVFP4_DEQUANT_SIZES = {
    CUDA: dict(block=4096, num_warps=4, reciprocal_div=Division.FP64, lookup=True,
               lookup_block=8192),
    INTERPRET: dict(block=1 << 16, num_warps=1, reciprocal_div=Division.DIV_RN, lookup=True,
                    lookup_block=1 << 16),
}


@dataclass(frozen=True, eq=False)
class LaunchPlan:
    """What to launch: grid, warps, and the kernel's scalars and constexprs by parameter name.

    Scalars are Python ints (Triton types them i32 / i64 by value) and floats, which are fp32
    parameters: only what may change from call to call without a new compile (token and page
    counts, host scale values). Everything fixed by the arrays' layout -- head counts, head_dim,
    page size, every stride -- is a constexpr: an engine's caches and inputs keep their layout
    from step to step, so this costs it no compile, and the compiler sees exact strides
    (alignment and contiguity proofs for 16-byte accesses come from them).
    """

    grid: tuple[int, ...]
    num_warps: int
    scalars: dict = field(default_factory=dict)
    constexprs: dict = field(default_factory=dict)
    # The kernel (a name in fp8kv.ops) that the plan is for: the format chooses it.
    kernel: str = "_write_kv_kernel"
    # Exactness must not depend on a compiler default (Triton fuses a*b+c into an FMA unless told
    # otherwise, jax-triton passes True): every launch says it. The kernels' arithmetic that must
    # round once per step is written with explicit fma / div_rn either way.
    enable_fp_fusion: bool = False

    @property
    def empty(self) -> bool:
        return any(g == 0 for g in self.grid)


def strides(pages, layer: int = 0) -> Strides:
    """The :class:`~fp8kv.constexprs.Strides` of a paged array (a cache, a side scale array,
    dequantized pages; :class:`fp8kv.layout.PagedCache` or :class:`fp8kv.layout.ScaleCache`)
    and its layer stride; all 0 without one (never read)."""
    if pages is None:
        return Strides()
    return Strides(pages.stride_page, pages.stride_slot, pages.stride_head,
                   getattr(pages, "offset", 0), layer)


def cache_record(args: WriteArgs | DequantArgs, scale_pow2: bool = False) -> Cache:
    """The caches of a validated call as the kernels take them (:class:`fp8kv.constexprs.Cache`):
    geometry, format, each side's strides and scaling, the stack."""
    kc, vc = args.key_cache, args.value_cache
    ks, vs = args.key_scale, args.value_scale
    layers = args.layers
    lk = Layers(0, 0, 0) if layers is None else layers
    kind = (LayerKind.NONE if layers is None else
            LayerKind.TENSOR if layers.on_device else LayerKind.VALUE)
    return Cache(
        NUM_HEADS=kc.num_heads, HEAD_DIM=kc.head_dim * args.fmt.codes_per_byte,
        PAGE_SIZE=kc.page_size, FMT=args.fmt.codec,
        KEY=Side(strides(kc, lk.stride_key_cache), strides(ks.stored, lk.stride_key_scale_cache),
                 ks.kind.id, ks.dynamic.id),
        VALUE=Side(strides(vc, lk.stride_value_cache),
                   strides(vs.stored, lk.stride_value_scale_cache), vs.kind.id, vs.dynamic.id),
        INLINE_PAD=args.inline_pad, SCALE_POW2=scale_pow2, COMBINED=args.combined,
        LAYER_KIND=kind.id, NUM_LAYERS=lk.num_layers)


def _scalars(args: WriteArgs | DequantArgs) -> dict:
    """The runtime scalars every K/V kernel takes: both sides' host scale values and (kernels
    that take stacked caches) the host layer -- a runtime scalar, so that one compiled kernel
    serves every layer; 0 where a device array names it or there is no layer axis."""
    layers = args.layers
    scalars = dict(key_scale_value=float(args.key_scale.value),
                   value_scale_value=float(args.value_scale.value))
    if not args.fmt.packed:
        scalars["layer"] = 0 if layers is None or layers.on_device else layers.index
    return scalars


def _exact(backend: str, exact: bool | None) -> bool:
    """The interpreter must take the exact conversions (its own fp8/bf16 casts are wrong)."""
    return backend == INTERPRET if exact is None else exact


def _rows(x: ArrayInfo, head_dim: int) -> Rows:
    """Token rows ``[T, H, D]`` as the kernels take them; packed where a token's heads are
    contiguous."""
    return Rows(x.strides[0], x.strides[1], x.strides[1] == head_dim or x.shape[1] == 1)


INT32_REACH = 2**31 - 1  # the largest element offset that int32 address arithmetic may form


def offsets_64(args: WriteArgs, tokens: int, block_h: int, block_d: int, block_hd: int) -> bool:
    """Whether the write kernel must form its offsets in int64: some offset it computes -- masked
    lanes included: ``tokens`` (the grid's), ``block_h`` heads, ``block_d`` dims or ``block_hd``
    row columns -- may exceed :data:`INT32_REACH` elements. Strides are never negative."""
    kc = args.key_cache
    heads = max(block_h, -(-block_hd // kc.head_dim))   # head index bound of either tile form
    cols = max(block_d, block_hd, kc.head_dim + args.inline_pad)
    reach = [(tokens - 1) * x.strides[0] + heads * x.strides[1] + cols
             for x in (args.key, args.value)]
    for cache in (args.key_cache, args.value_cache):
        reach.append(cache.offset + (cache.num_pages - 1) * cache.stride_page
                     + (cache.page_size - 1) * cache.stride_slot + heads * cache.stride_head + cols)
    for sc in (args.key_scale.stored, args.value_scale.stored):
        if sc is not None:
            reach.append((kc.num_pages - 1) * sc.stride_page + (kc.page_size - 1) * sc.stride_slot
                         + heads * sc.stride_head)
    return max(reach) > INT32_REACH


@functools.lru_cache(maxsize=4096)
def plan_write(args: WriteArgs, backend: str, exact: bool | None = None) -> LaunchPlan:
    """Plan ``_write_kv_kernel`` (``_write_nvfp4_kernel`` for a packed format); ``exact`` forces
    (True) or forbids (False) the exact path."""
    if args.fmt.packed:
        return _plan_write_nvfp4(args, backend, exact)
    sizes = WRITE_SIZES[backend]
    kc, vc = args.key_cache, args.value_cache
    row = kc.num_heads * kc.head_dim
    block_h, block_d = triton.next_power_of_2(kc.num_heads), triton.next_power_of_2(kc.head_dim)
    # A dynamic side takes whole rows as [BLOCK_T, BLOCK_H, BLOCK_D] tiles.
    dynamic = args.key_scale.is_dynamic or args.value_scale.is_dynamic
    elems = args.num_tokens * row
    small = elems <= sizes["small_batch_elems"]
    split = (small and not dynamic and args.num_tokens <= sizes["split_batch_tokens"]
             and row > sizes["split_chunk"])
    # A split row's chunk is one tile: split_chunk rounded up to a power of two (<= max_block_hd).
    block_hd = min(triton.next_power_of_2(sizes["split_chunk"] if split else max(row, 1)),
                   sizes["max_block_hd"])
    row_chunk = block_hd if split else row
    row_programs = -(-row // row_chunk)
    block_t = 1 if split else max(1, sizes["tile"] // (block_h * block_d if dynamic else block_hd))
    if backend == INTERPRET:  # no compile cost here: fit the tile to the batch
        block_t = min(block_t, triton.next_power_of_2(max(args.num_tokens, 1)))
    grid = (triton.cdiv(args.num_tokens, block_t), row_programs)
    scalars = dict(num_tokens=args.num_tokens, num_slots=kc.num_slots, **_scalars(args))
    tile = WriteTile(
        BLOCK_T=block_t, BLOCK_HD=block_hd, ROW_CHUNK=row_chunk, BLOCK_H=block_h,
        BLOCK_D=block_d, CACHE_PACKED=kc.packed_rows and vc.packed_rows,
        DYNAMIC_LOADS_FIRST=(args.key_scale.dynamic is args.value_scale.dynamic
                             is ScaleKind.TOKEN_HEAD
                             and block_t * block_h * block_d <= sizes["loads_first_elems"]),
        RECIPROCAL_DIV=int(sizes["split_division" if split else "reciprocal_div"] if small
                           else Division.DIV_RN),
        # Masked lanes of the last chunk reach column row_programs * row_chunk.
        OFFSETS_64=offsets_64(args, grid[0] * block_t, block_h, block_d,
                              max(block_hd, row_programs * row_chunk)))
    constexprs = dict(CACHE=cache_record(args, args.scale_pow2),
                      ROWS=WriteRows(_rows(args.key, kc.head_dim), _rows(args.value, kc.head_dim)),
                      TILE=tile, EXACT=_exact(backend, exact))
    decode = not dynamic and elems <= sizes["decode_batch_elems"]
    num_warps = (sizes["split_warps"] if split else sizes["decode_batch_warps"] if decode else
                 sizes["small_batch_warps"] if small else sizes["num_warps"])
    return LaunchPlan(grid, num_warps, scalars, constexprs)


def _table_scalars(args: DequantArgs) -> dict:
    """The block table as runtime scalars (its pages and strides, the null page)."""
    table = args.block_table
    return dict(pages_per_seq=max(args.pages_per_seq, 1), stride_table_seq=table.strides[0],
                stride_table_page=table.strides[1], num_pages=args.key_cache.num_pages,
                null_page=-1 if args.null_page is None else args.null_page)


@functools.lru_cache(maxsize=4096)
def plan_dequantize(args: DequantArgs, key_out: ArrayInfo, value_out: ArrayInfo | None,
                    backend: str, exact: bool | None = None, aligned: bool = True) -> LaunchPlan:
    """Plan ``_dequantize_pages_kernel`` (``_dequantize_nvfp4_kernel`` for a packed format). A
    combined call (``args.combined``) has one ``[N, 2, ...]`` output, ``key_out`` (``value_out``
    None). ``aligned``: every array starts at a multiple of 16 bytes (XLA's buffers do; torch
    says per call), which an nvfp4 cache's FP8 lookup needs for its words."""
    if args.combined:
        ko, vo = combined_halves(key_out, args.layout)
    else:
        ko, vo = paged(key_out, args.layout), paged(value_out, args.layout)
    if args.fmt.packed:
        return _plan_dequantize_nvfp4(args, ko, vo, backend, exact, aligned)
    sizes = DEQUANT_SIZES[backend]
    kc, vc = args.key_cache, args.value_cache
    page_elems = kc.page_size * kc.num_heads * kc.head_dim
    block = min(triton.next_power_of_2(max(page_elems, 1)), sizes["block"])
    # Dynamic scales: [ROWS, BLOCK_D] tiles of whole head rows (one scale per row).
    rowwise = args.key_scale.is_dynamic or args.value_scale.is_dynamic
    block_d = triton.next_power_of_2(max(kc.head_dim, 1))
    if rowwise:
        block = max(block, block_d)
        chunks = triton.cdiv(kc.page_size * kc.num_heads, block // block_d)
    else:
        chunks = triton.cdiv(page_elems, block)
    scalars = dict(**_table_scalars(args), **_scalars(args))
    constexprs = dict(
        CACHE=cache_record(args),
        OUT=Output(strides(ko), strides(vo), int(OUT_KIND_OF_DTYPE[args.out_dtype]),
                   PACKED=ko.packed_pages(args.layout) and vo.packed_pages(args.layout)),
        TILE=ReadTile(BLOCK=block, BLOCK_D=block_d, ROWWISE=rowwise,
                      HND=args.layout == "HND" and args.cache_rank == 4,
                      HAS_NULL_PAGE=args.null_page is not None,
                      IN_PACKED=kc.packed_pages(args.layout) and vc.packed_pages(args.layout)),
        EXACT=_exact(backend, exact))
    grid = (args.batch * args.pages_per_seq * chunks,)
    return LaunchPlan(grid, sizes["num_warps"], scalars, constexprs,
                      kernel="_dequantize_pages_kernel")


# ---------------------------------------------------------------------------------------------
# Packed formats (NVFP4)

def _nvfp4_offsets_64(args: WriteArgs, tokens: int, block_h: int, block_d: int) -> bool:
    """:func:`offsets_64` of an nvfp4 write: inputs of ``block_d`` columns, caches of
    ``block_d / 2`` bytes and block scales of ``block_d / block_size`` per head row."""
    fmt = args.fmt
    reach = [(tokens - 1) * x.strides[0] + block_h * x.strides[1] + block_d
             for x in (args.key, args.value)]
    for cache, cols in ((args.key_cache, block_d // fmt.codes_per_byte),
                        (args.value_cache, block_d // fmt.codes_per_byte),
                        (args.key_scale.stored, block_d // fmt.blocks.size),
                        (args.value_scale.stored, block_d // fmt.blocks.size)):
        reach.append(cache.offset + (cache.num_pages - 1) * cache.stride_page
                     + (cache.page_size - 1) * cache.stride_slot + block_h * cache.stride_head
                     + cols)
    return max(reach) > INT32_REACH


def _plan_write_nvfp4(args: WriteArgs, backend: str, exact: bool | None) -> LaunchPlan:
    """Plan ``_write_nvfp4_kernel``: ``[BLOCK_T, BLOCK_H, BLOCK_D]`` tiles of whole rows."""
    sizes = NVFP4_WRITE_SIZES[backend]
    kc = args.key_cache
    head_dim = args.key.shape[2]
    # BLOCK_D holds whole groups of two blocks (32 elements; ops/write_nvfp4.py).
    block_h, block_d = triton.next_power_of_2(kc.num_heads), max(32, triton.next_power_of_2(head_dim))
    small = args.num_tokens * kc.num_heads * head_dim <= sizes["small_batch_elems"]
    block_t = max(1, sizes["small_tile" if small else "tile"] // (block_h * block_d))
    if backend == INTERPRET:  # no compile cost here: fit the tile to the batch
        block_t = min(block_t, triton.next_power_of_2(max(args.num_tokens, 1)))
    scalars = dict(num_tokens=args.num_tokens, num_slots=kc.num_slots, **_scalars(args))
    grid = (triton.cdiv(args.num_tokens, block_t),)
    constexprs = dict(
        CACHE=cache_record(args),
        ROWS=WriteRows(_rows(args.key, head_dim), _rows(args.value, head_dim)),
        TILE=NvFp4WriteTile(
            BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, LOADS_FIRST=sizes["loads_first"],
            BLOCKWISE=small and sizes["small_blockwise"],
            OFFSETS_64=_nvfp4_offsets_64(args, grid[0] * block_t, block_h, block_d)),
        EXACT=_exact(backend, exact))
    num_warps = sizes["small_batch_warps"] if small else sizes["num_warps"]
    return LaunchPlan(grid, num_warps, scalars, constexprs, kernel="_write_nvfp4_kernel")


def _plan_dequantize_nvfp4(args: DequantArgs, ko, vo, backend: str, exact: bool | None,
                           aligned: bool) -> LaunchPlan:
    """Plan ``_dequantize_nvfp4_kernel``: ``[ROWS, BLOCK_D]`` tiles of whole head rows."""
    sizes = NVFP4_DEQUANT_SIZES[backend]
    kc, vc = args.key_cache, args.value_cache
    block_d = triton.next_power_of_2(args.head_dim)
    scalars = dict(**_table_scalars(args), **_scalars(args),
                   out_scale_value=float(args.out_scale.value))
    # FP8 output by lookup: codes and output bytes move as int32 words (ops/dequantize_nvfp4.py).
    words = (kc.stride_page, kc.stride_slot, kc.stride_head, vc.stride_page, vc.stride_slot,
             vc.stride_head, vc.offset, ko.stride_page, ko.stride_slot, ko.stride_head,
             vo.stride_page, vo.stride_slot, vo.stride_head, vo.offset)
    fp8 = args.out_dtype == FP8_OUTPUT_DTYPE
    lookup = sizes["lookup"] and fp8 and aligned and all(n % 4 == 0 for n in words)
    rows = max(1, sizes["lookup_block" if lookup else "block"] // block_d)
    if backend == INTERPRET:  # one program per page where it fits
        rows = min(rows, triton.next_power_of_2(kc.page_size * kc.num_heads))
    constexprs = dict(
        CACHE=cache_record(args),
        OUT=Output(strides(ko), strides(vo), int(OUT_KIND_OF_DTYPE[args.out_dtype]),
                   FMT=FORMAT_OF_DTYPE[FP8_OUTPUT_DTYPE].codec if fp8 else None,
                   SCALE=args.out_scale.kind.id),
        TILE=ReadTile(BLOCK=rows * block_d, BLOCK_D=block_d, ROWWISE=True,
                      HND=args.layout == "HND" and args.cache_rank == 4,
                      HAS_NULL_PAGE=args.null_page is not None,
                      RECIPROCAL_DIV=int(sizes["reciprocal_div"]), LOOKUP=lookup),
        EXACT=_exact(backend, exact))
    chunks = triton.cdiv(kc.page_size * kc.num_heads, rows)
    grid = (args.batch * args.pages_per_seq * chunks,)
    return LaunchPlan(grid, sizes["num_warps"], scalars, constexprs,
                      kernel="_dequantize_nvfp4_kernel")
