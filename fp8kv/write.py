"""``write_kv`` / ``write_kv_combined``: the checks, the launch plans and the operand maps of
``_write_kv_kernel`` (:mod:`fp8kv.ops.write_kv`) and, for NVFP4, ``_write_nvfp4_kernel``
(:mod:`fp8kv.ops.write_nvfp4`). The rule is docs/SPEC.md sections 3-9 and 13; the reference
:func:`fp8kv.reference.write_kv`; the table entry ``WRITE_KV`` (:mod:`fp8kv.optable`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import triton

from .arrays import ArrayInfo, fmt_shape
from .constexprs import NvFp4WriteTile, WriteRows, WriteTile
from .formats import INPUT_DTYPES, SLOT_DTYPES, Format
from .layout import LAYOUTS, Layers, PagedCache
from .modes import Division, ScaleKind, SideScale
from .operands import (Operand, OperandMap, block_operands, caches_of, layer_input, scale_input,
                       static_input)
from .optable import (CACHE_FORMAT, CHECK_BOUNDS, FP8_FORMAT, KEY_VALUE, LAYER, LAYOUT,
                      SCALE_ROUNDING, SLOTS, Op, caches, from_shapes, scales, sides)
from .plan import (CUDA, INT32_REACH, INTERPRET, LaunchPlan, cache_record, exact_for, kv_reach,
                   kv_scalars, paged_reach, token_rows)
from .validate import (SCALE_ROUNDINGS, check_block_head_dim, check_caches, check_choice,
                       check_contiguous, check_dtype, check_inline, check_layers_supported,
                       check_same_device, check_scale_cache_arg, check_slots_in_range,
                       check_stack_bounds, check_unit_last_stride, named_caches, side_scales,
                       unstack)


@dataclass(frozen=True)
class WriteArgs:
    """A validated ``write_kv`` / ``write_kv_combined`` call: what the plan and the operand map
    (:mod:`fp8kv.operands`) are made from."""

    num_tokens: int
    key: ArrayInfo
    value: ArrayInfo
    key_cache: PagedCache
    value_cache: PagedCache
    fmt: Format
    key_scale: SideScale
    value_scale: SideScale
    layout: str
    combined: bool  # one kv_cache [num_pages, 2, ...]: both cache operands, V at its offset
    # The inline pad (0: none; then both sides are inline and key_cache/value_cache describe the
    # data columns only) and the rounding of dynamic scales.
    inline_pad: int = 0
    scale_pow2: bool = False
    # Stacked caches (layer=): the layer axis and the layer; None without layer=.
    layers: Layers | None = None


def check_write(key, value, key_cache=None, value_cache=None, slots=None, key_scale=None,
                value_scale=None, *, layout,
                fp8_format, kv_cache=None, key_scale_cache=None, value_scale_cache=None,
                scale_rounding="exact", cache_format=None, layer=None) -> WriteArgs:
    """Validate ``write_kv`` (or, with ``kv_cache``, ``write_kv_combined``) arguments."""
    layout = check_choice(layout, "layout", LAYOUTS)
    device = check_same_device({"key": key, "value": value, **named_caches(key_cache, value_cache,
                                                                             kv_cache), "slots": slots})
    (key_cache, value_cache, kv_cache, key_scale_cache, value_scale_cache), layers = unstack(
        layer, device, key_cache, value_cache, kv_cache, key_scale_cache, value_scale_cache)
    for name, x in (("key", key), ("value", value)):
        check_dtype(x, name, INPUT_DTYPES)
        if x.ndim != 3:
            raise ValueError(f"{name}: expected rank 3 [num_tokens, num_kv_heads, head_dim], got shape "
                             f"{fmt_shape(x.shape)}")
        check_unit_last_stride(x, name)
    if value.shape != key.shape:
        raise ValueError(f"value: expected the shape of key {fmt_shape(key.shape)}, got "
                         f"{fmt_shape(value.shape)}")
    if value.dtype != key.dtype:
        raise TypeError(f"value: expected the dtype of key ({key.dtype}), got {value.dtype}")
    kc, vc, fmt, rank = check_caches(key_cache, value_cache, kv_cache, layout, fp8_format,
                                     cache_format)
    check_layers_supported(layers, fmt)
    cache_name = "kv_cache" if kv_cache is not None else "key_cache"
    num_tokens, num_heads, head_dim = key.shape
    key_scale_cache = check_scale_cache_arg(key_scale_cache, "key_scale_cache", fmt=fmt)
    value_scale_cache = check_scale_cache_arg(value_scale_cache, "value_scale_cache", fmt=fmt)
    pow2 = check_choice(scale_rounding, "scale_rounding", SCALE_ROUNDINGS) == "pow2"
    if fmt.block_scaled:   # block scales by the format's rule, no inline scales
        check_block_head_dim(head_dim, fmt, "key")
        if pow2:
            raise ValueError(f"scale_rounding: expected 'exact' for cache_format={fmt.name!r} "
                             f"(its block scales are {fmt.blocks.scale.name}, made by the "
                             f"format's rule), got 'pow2'")
        pad = 0
    else:
        kc, vc, pad = check_inline(key_scale_cache, value_scale_cache, kc, vc, head_dim,
                                   cache_name)
    elems = kc.head_dim * fmt.codes_per_byte   # the cache's head_dim in elements
    if (kc.num_heads, elems) != (num_heads, head_dim):
        other = "HND" if layout == "NHD" else "NHD"
        fits_other = kc.page_size == num_heads and elems == head_dim  # heads <-> page_size
        hint = f"; these shapes fit layout={other!r}" if fits_other else ""
        packed = (f" (a last dimension of {kc.head_dim} bytes, {fmt.codes_per_byte} codes per "
                  f"byte)" if fmt.codes_per_byte > 1 else "")
        raise ValueError(f"{cache_name}: expected num_kv_heads={num_heads} and head_dim={head_dim} "
                         f"(those of key), got num_kv_heads={kc.num_heads} and head_dim={elems}"
                         f"{packed} with layout={layout!r}{hint}")
    check_dtype(slots, "slots", SLOT_DTYPES)
    if slots.shape != (num_tokens,):
        raise ValueError(f"slots: expected shape [{num_tokens}] (one per token), got "
                         f"{fmt_shape(slots.shape)}")
    check_contiguous(slots, "slots")
    ks, vs = side_scales(key_scale, value_scale, key_scale_cache, value_scale_cache, kc, vc,
                         layout, rank, device, num_heads, fmt)
    return WriteArgs(num_tokens, key, value, kc, vc, fmt, ks, vs, layout, kv_cache is not None,
                     pad, pow2, layers)


def write_bounds(args, read) -> None:
    check_stack_bounds(args, read)
    check_slots_in_range(read("slots"), args.key_cache.num_slots)


# Elements per program (per K or V) and warps, per backend (bench/NOTES.md has the measurements
# behind each entry). The interpreter runs one program at a time, slowly, so it gets big tiles.
# Large batches take `num_warps` (one 16-byte load of K and one of V per thread, many programs
# per SM), smaller ones more warps (more memory requests in flight, shorter dependency chains per
# thread): batches of up to `small_batch_elems` row elements use `small_batch_warps`, and
# static-scale ones of up to `decode_batch_elems` `decode_batch_warps`.
# reciprocal_div (a fp8kv.modes.Division, exact either way): how small batches divide by a
# per-tensor scale; large batches divide with div.rn.
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


# NVFP4 (docs/SPEC.md section 13; kernels write_nvfp4 / dequantize_nvfp4). write: elements of
# whole rows per program and side (tile) and warps. A thread holds one group of 32 consecutive
# elements per side (two blocks; 16 bytes of codes to store), so a tile of 1,024 elements over
# 1 warp maps one group to each thread (one 8 x 128 token). Batches of up to small_batch_elems
# row elements take small_tile and small_batch_warps and, with small_blockwise, load
# [T, H, D/16, 16] blocks over two threads each (a quarter of a group's chain per thread; the
# amax a two-thread reduction) instead of whole groups per thread. loads_first: both sides' loads
# before the first amax. dequantize: output elements per program (block) and warps; lookup: an
# FP8 output by a per-block table (ops/dequantize_nvfp4.py _lookup_side), where the arrays allow
# its 4-byte words, with lookup_block output elements per program.
NVFP4_WRITE_SIZES = {
    CUDA: dict(tile=1024, num_warps=1, small_tile=1024, small_batch_warps=4,
               small_batch_elems=1 << 18, loads_first=True, small_blockwise=True),
    INTERPRET: dict(tile=1 << 16, num_warps=1, small_tile=1 << 16, small_batch_warps=1,
                    small_batch_elems=0, loads_first=True, small_blockwise=False),
}


def offsets_64(args: WriteArgs, tokens: int, block_h: int, block_d: int, block_hd: int) -> bool:
    """Whether the write kernel must form its offsets in int64: some offset it computes -- masked
    lanes included: ``tokens`` (the grid's), ``block_h`` heads, ``block_d`` dims or ``block_hd``
    row columns -- may exceed :data:`INT32_REACH` elements. Strides are never negative."""
    kc = args.key_cache
    heads = max(block_h, -(-block_hd // kc.head_dim))   # head index bound of either tile form
    cols = max(block_d, block_hd, kc.head_dim + args.inline_pad)
    reach = [(tokens - 1) * x.strides[0] + heads * x.strides[1] + cols
             for x in (args.key, args.value)]
    return max(reach + kv_reach(args, heads, cols)) > INT32_REACH


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
    scalars = dict(num_tokens=args.num_tokens, num_slots=kc.num_slots, **kv_scalars(args))
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
                      ROWS=WriteRows(token_rows(args.key, kc.head_dim), token_rows(args.value, kc.head_dim)),
                      TILE=tile, EXACT=exact_for(backend, exact))
    decode = not dynamic and elems <= sizes["decode_batch_elems"]
    num_warps = (sizes["split_warps"] if split else sizes["decode_batch_warps"] if decode else
                 sizes["small_batch_warps"] if small else sizes["num_warps"])
    return LaunchPlan(grid, num_warps, scalars, constexprs, kernel="_write_kv_kernel")


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
        reach.append(paged_reach(cache, block_h, cols))
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
    scalars = dict(num_tokens=args.num_tokens, num_slots=kc.num_slots, **kv_scalars(args))
    grid = (triton.cdiv(args.num_tokens, block_t),)
    constexprs = dict(
        CACHE=cache_record(args),
        ROWS=WriteRows(token_rows(args.key, head_dim), token_rows(args.value, head_dim)),
        TILE=NvFp4WriteTile(
            BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, LOADS_FIRST=sizes["loads_first"],
            BLOCKWISE=small and sizes["small_blockwise"],
            OFFSETS_64=_nvfp4_offsets_64(args, grid[0] * block_t, block_h, block_d)),
        EXACT=exact_for(backend, exact))
    num_warps = sizes["small_batch_warps"] if small else sizes["num_warps"]
    return LaunchPlan(grid, num_warps, scalars, constexprs, kernel="_write_nvfp4_kernel")


WRITE_PLACEHOLDER = "slots"


def write_operands(args) -> OperandMap:
    """``_write_kv_kernel``'s arrays for a validated :class:`fp8kv.write.WriteArgs`
    (``_write_nvfp4_kernel``'s for a packed format: a global scale and a block-scale array per
    side)."""
    kc, vc = caches_of(args.combined)
    inputs = (Operand("key_ptr", "key"), Operand("value_ptr", "value"),
              Operand("key_cache_ptr", kc), Operand("value_cache_ptr", vc),
              Operand("slot_ptr", "slots"))
    outputs = (Operand("key_cache_out_ptr", kc, aliases="key_cache_ptr"),
               # A combined cache is one buffer: V goes through the K output (SHARED_OUT).
               Operand("value_cache_out_ptr", None, used=False) if args.combined else
               Operand("value_cache_out_ptr", vc, aliases="value_cache_ptr"))
    if args.fmt.packed:
        blocks_in, blocks_out = block_operands()
        return OperandMap(inputs + (static_input("key", args.key_scale, WRITE_PLACEHOLDER),
                                    static_input("value", args.value_scale, WRITE_PLACEHOLDER))
                          + blocks_in, outputs + blocks_out)
    inputs += (scale_input("key", args.key_scale, WRITE_PLACEHOLDER),
               scale_input("value", args.value_scale, WRITE_PLACEHOLDER),
               layer_input(args, WRITE_PLACEHOLDER))
    for side, scale in (("key", args.key_scale), ("value", args.value_scale)):
        outputs += (Operand(f"{side}_scale_out_ptr", f"{side}_scale_cache",
                            aliases=f"{side}_scale_ptr") if scale.stored is not None
                    else Operand(f"{side}_scale_out_ptr", None, used=False),)
    return OperandMap(inputs, outputs)


# ---------------------------------------------------------------------------------------------
# The op table's entry (fp8kv.optable).

OP = Op(
    "write_kv",
    (*KEY_VALUE, *caches(updated=True), SLOTS, *scales("key", "value"), LAYOUT, FP8_FORMAT,
     *sides(updated=True), SCALE_ROUNDING, CHECK_BOUNDS, CACHE_FORMAT, LAYER),
    check_write, write_bounds, lambda args: {}, lambda args: args.num_tokens == 0,
    write_operands, from_shapes(plan_write),
    returns=("key_cache", "value_cache", "key_scale_cache", "value_scale_cache"),
    splits=("h", "p", "l"), reads=("slots", "layer"),
    xla_triton=lambda args: not args.fmt.packed)
