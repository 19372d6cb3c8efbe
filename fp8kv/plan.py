"""Launch plans: grid, warps, and every scalar and constexpr by name, from shapes alone.

Both frontends launch exactly what a plan says (bound by name, :mod:`fp8kv.binding`); nothing here
imports torch or jax. Plans are cached on the (hashable) validated arguments, so a steady-state
call costs one dict lookup.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import triton

from .arrays import ArrayInfo
from .formats import FP8_OUTPUT_DTYPE
from .layout import combined_halves, paged
from .modes import OUT_KIND_OF_DTYPE, Division, LayerKind, ScaleKind, SideScale
from .validate import DequantArgs, WriteArgs

INTERPRET, CUDA = "interpret", "cuda"

# Elements per program (per K or V) and warps, per backend. The interpreter runs one program at a
# time at ~2 ms each, so it gets big tiles. On the H200 (bench/NOTES.md) 1024-element tiles win at
# every size; large batches want 2 warps (one 16-byte load of K and one of V per thread, many
# programs per SM), small ones more (more memory requests in flight, shorter dependency chains
# per thread): batches of up to `small_batch_elems` row elements use `small_batch_warps`, and
# static-scale ones of up to `decode_batch_elems` `decode_batch_warps` (graph replay, 8 x 128
# rows: 1,024 tokens 4.23 us with 8 warps vs 4.84 with 16; 256 tokens 2.78 with 16 vs 2.84 with
# 8 warps and FMA).
# reciprocal_div (a fp8kv.modes.Division): how small batches divide by a per-tensor scale --
# DIV_RN: div.rn per element; FMA: one fp32 reciprocal and two FMA corrections per element
# (codec.divide_by_scalar); FP64: one fp64 reciprocal and an fp64 product per element
# (codec.divide_fp64); all exact. With 16 / 8 warps div.rn measured fastest (1,024 tokens: 4.23
# vs 4.44 us with FMA); large batches keep div.rn too (97.8 vs 100.0 us).
# loads_first_elems: per-token-head writes load both sides' tiles before the first amax when a
# tile has at most this many elements (H200, 65,536 tokens, 8 x 128: 107.4 vs 109.6 us); larger
# tiles (8 x 256: 234 vs 211 us, register pressure) and per-token scales (8 x 128: 112 vs 107 us)
# run one side after the other. The interpreter takes both orders (per-token-head / per-token).
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
# elements per side (two blocks; 16 bytes of codes to store), so tile = 1,024 x warps maps one
# group to each thread: 2,048 over 2 warps for large batches, 1,024 over 1 warp (one 8 x 128
# token) for batches of up to small_batch_elems row elements. loads_first: both sides' loads
# before the first amax. dequantize: output elements per program and warps. SASS of the default
# write: ~24 instructions per element on the reciprocal path; first guesses, to be measured
# (bench/nvfp4.py has the variants). small_blockwise: small batches load [T, H, D/16, 16] blocks
# over two threads each (a quarter of a group's chain per thread; the amax a two-thread
# reduction) instead of whole groups per thread. lookup: an FP8 output by a per-block table
# (ops/dequantize_nvfp4.py _lookup_side), where the arrays allow its 4-byte words, with
# lookup_block output elements per program (16 x 512 pages on the H200: 156 / 207 us per element
# at out_scale 2**-2 / 0.37 -> 110-111 with 4,096 elements, 107-108 with 8,192; bench/NOTES.md).
NVFP4_WRITE_SIZES = {
    # Measured on the H200 (bench/nvfp4.py variants): 1,024-element tiles with one warp beat
    # 2,048 with two at 65,536 tokens (129 vs 136 us); four warps beat one at 1-256 tokens, and
    # the blockwise layout beats whole groups there (1 / 256 tokens: 2.68 / 3.49 vs 2.87 /
    # 3.72 us).
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


def _strides(prefix: str, pages) -> dict:
    """``STRIDE_<prefix>_{PAGE,SLOT,HEAD}`` of a paged array (a cache, an output, a side scale
    array); all 0 without one (never read)."""
    page, slot, head = (0, 0, 0) if pages is None else (pages.stride_page, pages.stride_slot,
                                                         pages.stride_head)
    return {f"STRIDE_{prefix}_PAGE": page, f"STRIDE_{prefix}_SLOT": slot,
            f"STRIDE_{prefix}_HEAD": head}


def _side(prefix: str, scale: SideScale) -> dict:
    """A side's scale constexprs: its static kind and its dynamic kind, as ids."""
    return {f"{prefix}_SCALE": scale.kind.id, f"{prefix}_DYNAMIC": scale.dynamic.id}


def _shared(args: WriteArgs | DequantArgs, backend: str, exact: bool | None) -> tuple[dict, dict]:
    """``(scalars, constexprs)`` that both kernels take alike: the caches, scales and format.

    The interpreter must take the exact conversions (its own fp8/bf16 casts are wrong)."""
    kc, vc = args.key_cache, args.value_cache
    ks, vs = args.key_scale, args.value_scale
    scalars = dict(key_scale_value=float(ks.value), value_scale_value=float(vs.value))
    constexprs = dict(
        NUM_HEADS=kc.num_heads, HEAD_DIM=kc.head_dim, PAGE_SIZE=kc.page_size,
        **_strides("KC", kc), **_strides("VC", vc), VALUE_CACHE_OFFSET=vc.offset,
        **_strides("KSC", ks.stored), **_strides("VSC", vs.stored),
        FORMAT=args.fmt.id, **_side("K", ks), **_side("V", vs), INLINE_PAD=args.inline_pad,
        EXACT=backend == INTERPRET if exact is None else exact)
    return scalars, constexprs


def layer_params(args) -> tuple[dict, dict]:
    """``(scalars, constexprs)`` of stacked caches (``args.layers``; docs/SPEC.md section 14):
    the host layer (a runtime scalar, so that one compiled kernel serves every layer; 0 where a
    device array names it or there is no layer axis), how the kernel finds it
    (``LAYER_KIND``), the stack's depth and each stacked array's layer stride. Any kernel with
    cache pointers takes them alike (:func:`fp8kv.ops.layers.select_layer`)."""
    layers = args.layers
    if layers is None:
        kind, layers_ = LayerKind.NONE, None
    else:
        kind, layers_ = (LayerKind.TENSOR if layers.on_device else LayerKind.VALUE), layers
    return ({"layer": 0 if layers_ is None or layers_.on_device else layers_.index},
            {"LAYER_KIND": kind.id, "NUM_LAYERS": 0 if layers_ is None else layers_.num_layers,
             "STRIDE_KC_LAYER": 0 if layers_ is None else layers_.stride_key_cache,
             "STRIDE_VC_LAYER": 0 if layers_ is None else layers_.stride_value_cache,
             "STRIDE_KSC_LAYER": 0 if layers_ is None else layers_.stride_key_scale_cache,
             "STRIDE_VSC_LAYER": 0 if layers_ is None else layers_.stride_value_scale_cache})


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
    """Plan ``_write_kv_kernel`` (``_write_nvfp4_kernel`` for an nvfp4 cache); ``exact`` forces
    (True) or forbids (False) the exact path."""
    if args.fmt.block_size:
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
    key, value = args.key, args.value
    scalars, constexprs = _shared(args, backend, exact)
    layer_scalars, layer_constexprs = layer_params(args)   # stacked caches
    scalars.update(layer_scalars)
    constexprs.update(layer_constexprs)
    scalars.update(num_tokens=args.num_tokens, num_slots=kc.num_slots)
    constexprs.update(
        STRIDE_KEY_TOKEN=key.strides[0], STRIDE_KEY_HEAD=key.strides[1],
        STRIDE_VALUE_TOKEN=value.strides[0], STRIDE_VALUE_HEAD=value.strides[1],
        BLOCK_T=block_t, BLOCK_HD=block_hd, ROW_CHUNK=row_chunk, BLOCK_H=block_h,
        BLOCK_D=block_d,
        SCALE_POW2=args.scale_pow2,
        KEY_PACKED=key.strides[1] == kc.head_dim or kc.num_heads == 1,
        VALUE_PACKED=value.strides[1] == kc.head_dim or kc.num_heads == 1,
        CACHE_PACKED=kc.packed_rows and vc.packed_rows,
        RECIPROCAL_DIV=int(sizes["split_division" if split else "reciprocal_div"] if small
                           else Division.DIV_RN),
        DYNAMIC_LOADS_FIRST=(args.key_scale.dynamic is args.value_scale.dynamic
                             is ScaleKind.TOKEN_HEAD
                             and block_t * block_h * block_d <= sizes["loads_first_elems"]),
        # One buffer holds both caches: V goes through the K output (one output per buffer).
        SHARED_OUT=args.combined)
    grid = (triton.cdiv(args.num_tokens, block_t), row_programs)
    # Masked lanes of the last chunk reach column row_programs * row_chunk.
    constexprs["OFFSETS_64"] = offsets_64(args, grid[0] * block_t, block_h, block_d,
                                          max(block_hd, row_programs * row_chunk))
    decode = not dynamic and elems <= sizes["decode_batch_elems"]
    num_warps = (sizes["split_warps"] if split else sizes["decode_batch_warps"] if decode else
                 sizes["small_batch_warps"] if small else sizes["num_warps"])
    return LaunchPlan(grid, num_warps, scalars, constexprs)


@functools.lru_cache(maxsize=4096)
def plan_dequantize(args: DequantArgs, key_out: ArrayInfo, value_out: ArrayInfo | None,
                    backend: str, exact: bool | None = None, aligned: bool = True) -> LaunchPlan:
    """Plan ``_dequantize_pages_kernel`` (``_dequantize_nvfp4_kernel`` for an nvfp4 cache). A
    combined call (``args.combined``) has one ``[N, 2, ...]`` output, ``key_out`` (``value_out``
    None). ``aligned``: every array starts at a multiple of 16 bytes (XLA's buffers do; torch
    says per call), which an nvfp4 cache's FP8 lookup needs for its words."""
    if args.combined:
        ko, vo = combined_halves(key_out, args.layout)
    else:
        ko, vo = paged(key_out, args.layout), paged(value_out, args.layout)
    if args.fmt.block_size:
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
    table = args.block_table
    scalars, constexprs = _shared(args, backend, exact)
    layer_scalars, layer_constexprs = layer_params(args)   # stacked caches
    scalars.update(layer_scalars)
    constexprs.update(layer_constexprs)
    scalars.update(
        pages_per_seq=max(args.pages_per_seq, 1), stride_table_seq=table.strides[0],
        stride_table_page=table.strides[1], num_pages=kc.num_pages,
        null_page=-1 if args.null_page is None else args.null_page)
    constexprs.update(
        **_strides("KO", ko), **_strides("VO", vo), VALUE_OUT_OFFSET=vo.offset,
        HND=args.layout == "HND" and args.cache_rank == 4, BLOCK=block, BLOCK_D=block_d,
        ROWWISE=rowwise, OUT_KIND=int(OUT_KIND_OF_DTYPE[args.out_dtype]),
        HAS_NULL_PAGE=args.null_page is not None,
        IN_PACKED=kc.packed_pages(args.layout) and vc.packed_pages(args.layout),
        OUT_PACKED=ko.packed_pages(args.layout) and vo.packed_pages(args.layout),
        SHARED_OUT=args.combined)
    grid = (args.batch * args.pages_per_seq * chunks,)
    return LaunchPlan(grid, sizes["num_warps"], scalars, constexprs,
                      kernel="_dequantize_pages_kernel")


# ---------------------------------------------------------------------------------------------
# NVFP4

def _nvfp4_offsets_64(args: WriteArgs, tokens: int, block_h: int, block_d: int) -> bool:
    """:func:`offsets_64` of an nvfp4 write: inputs of ``block_d`` columns, caches of
    ``block_d / 2`` bytes and block scales of ``block_d / 16`` per head row."""
    reach = [(tokens - 1) * x.strides[0] + block_h * x.strides[1] + block_d
             for x in (args.key, args.value)]
    for cache, cols in ((args.key_cache, block_d // 2), (args.value_cache, block_d // 2),
                        (args.key_scale.stored, block_d // 16),
                        (args.value_scale.stored, block_d // 16)):
        reach.append(cache.offset + (cache.num_pages - 1) * cache.stride_page
                     + (cache.page_size - 1) * cache.stride_slot + block_h * cache.stride_head
                     + cols)
    return max(reach) > INT32_REACH


def _plan_write_nvfp4(args: WriteArgs, backend: str, exact: bool | None) -> LaunchPlan:
    """Plan ``_write_nvfp4_kernel``: ``[BLOCK_T, BLOCK_H, BLOCK_D]`` tiles of whole rows."""
    sizes = NVFP4_WRITE_SIZES[backend]
    kc, vc = args.key_cache, args.value_cache
    head_dim = args.key.shape[2]
    # BLOCK_D holds whole groups of two blocks (32 elements; ops/write_nvfp4.py).
    block_h, block_d = triton.next_power_of_2(kc.num_heads), max(32, triton.next_power_of_2(head_dim))
    small = args.num_tokens * kc.num_heads * head_dim <= sizes["small_batch_elems"]
    block_t = max(1, sizes["small_tile" if small else "tile"] // (block_h * block_d))
    if backend == INTERPRET:  # no compile cost here: fit the tile to the batch
        block_t = min(block_t, triton.next_power_of_2(max(args.num_tokens, 1)))
    ks, vs = args.key_scale, args.value_scale
    key, value = args.key, args.value
    scalars = dict(num_tokens=args.num_tokens, num_slots=kc.num_slots,
                   key_scale_value=float(ks.value), value_scale_value=float(vs.value))
    grid = (triton.cdiv(args.num_tokens, block_t),)
    constexprs = dict(
        NUM_HEADS=kc.num_heads, HEAD_DIM=head_dim, PAGE_SIZE=kc.page_size,
        STRIDE_KEY_TOKEN=key.strides[0], STRIDE_KEY_HEAD=key.strides[1],
        STRIDE_VALUE_TOKEN=value.strides[0], STRIDE_VALUE_HEAD=value.strides[1],
        **_strides("KC", kc), **_strides("VC", vc), VALUE_CACHE_OFFSET=vc.offset,
        **_strides("KB", ks.stored), **_strides("VB", vs.stored),
        K_SCALE=ks.kind.id, V_SCALE=vs.kind.id, BLOCK_T=block_t, BLOCK_H=block_h,
        BLOCK_D=block_d, LOADS_FIRST=sizes["loads_first"],
        BLOCKWISE=small and sizes["small_blockwise"], SHARED_OUT=args.combined,
        OFFSETS_64=_nvfp4_offsets_64(args, grid[0] * block_t, block_h, block_d),
        EXACT=backend == INTERPRET if exact is None else exact)
    num_warps = sizes["small_batch_warps"] if small else sizes["num_warps"]
    return LaunchPlan(grid, num_warps, scalars, constexprs, kernel="_write_nvfp4_kernel")


def _plan_dequantize_nvfp4(args: DequantArgs, ko, vo, backend: str, exact: bool | None,
                           aligned: bool) -> LaunchPlan:
    """Plan ``_dequantize_nvfp4_kernel``: ``[ROWS, BLOCK_D]`` tiles of whole head rows."""
    sizes = NVFP4_DEQUANT_SIZES[backend]
    kc, vc = args.key_cache, args.value_cache
    ks, vs, os = args.key_scale, args.value_scale, args.out_scale
    block_d = triton.next_power_of_2(args.head_dim)
    table = args.block_table
    scalars = dict(
        pages_per_seq=max(args.pages_per_seq, 1), stride_table_seq=table.strides[0],
        stride_table_page=table.strides[1], num_pages=kc.num_pages,
        null_page=-1 if args.null_page is None else args.null_page,
        key_scale_value=float(ks.value), value_scale_value=float(vs.value),
        out_scale_value=float(os.value))
    codes_and_out = dict(**_strides("KC", kc), **_strides("VC", vc), VALUE_CACHE_OFFSET=vc.offset,
                         **_strides("KO", ko), **_strides("VO", vo), VALUE_OUT_OFFSET=vo.offset)
    # FP8 output by lookup: codes and output bytes move as int32 words (ops/dequantize_nvfp4.py).
    lookup = (sizes["lookup"] and args.out_dtype == FP8_OUTPUT_DTYPE and aligned
              and all(n % 4 == 0 for n in codes_and_out.values()))
    rows = max(1, sizes["lookup_block" if lookup else "block"] // block_d)
    if backend == INTERPRET:  # one program per page where it fits
        rows = min(rows, triton.next_power_of_2(kc.page_size * kc.num_heads))
    constexprs = dict(
        NUM_HEADS=kc.num_heads, HEAD_DIM=args.head_dim, PAGE_SIZE=kc.page_size, **codes_and_out,
        **_strides("KB", ks.stored), **_strides("VB", vs.stored),
        K_SCALE=ks.kind.id, V_SCALE=vs.kind.id, OUT_SCALE=os.kind.id,
        HND=args.layout == "HND" and args.cache_rank == 4, ROWS=rows, BLOCK_D=block_d,
        OUT_KIND=int(OUT_KIND_OF_DTYPE[args.out_dtype]), HAS_NULL_PAGE=args.null_page is not None,
        SHARED_OUT=args.combined, RECIPROCAL_DIV=int(sizes["reciprocal_div"]),
        LOOKUP=lookup, EXACT=backend == INTERPRET if exact is None else exact)
    chunks = triton.cdiv(kc.page_size * kc.num_heads, rows)
    grid = (args.batch * args.pages_per_seq * chunks,)
    return LaunchPlan(grid, sizes["num_warps"], scalars, constexprs,
                      kernel="_dequantize_nvfp4_kernel")
