"""``dequantize_pages`` / ``dequantize_pages_combined``: the checks, the launch plans and the
operand maps of ``_dequantize_pages_kernel`` (:mod:`fp8kv.ops.dequantize_pages`) and, for NVFP4,
``_dequantize_nvfp4_kernel`` (:mod:`fp8kv.ops.dequantize_nvfp4`). The rule is docs/SPEC.md
sections 10 and 13; the reference :func:`fp8kv.reference.dequantize_pages`; the table entry
``DEQUANTIZE_PAGES`` (:mod:`fp8kv.optable`).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Optional

import numpy as np
import triton

from .arrays import ArrayInfo, fmt_shape
from .constexprs import Output, ReadTile
from .formats import FORMAT_OF_DTYPE, FORMATS, FP8_OUTPUT_DTYPE, Format
from .layout import LAYOUTS, Layers, PagedCache, combined_halves, paged, pages_shape
from .modes import OUT_KIND_OF_DTYPE, Division, SideScale
from .operands import (Operand, OperandMap, block_operands, caches_of, layer_input, scale_input,
                       static_input)
from .optable import (CACHE_FORMAT, CHECK_BOUNDS, FP8_FORMAT, LAYER, LAYOUT, TORCH, Arg, Op, Role,
                      caches, option, scales, sides)
from .plan import CUDA, INTERPRET, LaunchPlan, cache_record, exact_for, kv_scalars, strides
from .validate import (INLINE, check_block_head_dim, check_caches, check_choice, check_dtype,
                       check_inline, check_layers_supported, check_out_scale, check_same_device,
                       check_scale_cache_arg, check_stack_bounds, named_caches, side_scales,
                       unstack)


@dataclass(frozen=True)
class DequantArgs:
    """A validated ``dequantize_pages`` / ``dequantize_pages_combined`` call (a combined cache
    gives a combined output)."""

    batch: int
    pages_per_seq: int
    block_table: ArrayInfo
    key_cache: PagedCache
    value_cache: PagedCache
    fmt: Format
    out_dtype: str
    layout: str
    cache_rank: int
    null_page: int | None
    key_scale: SideScale
    value_scale: SideScale
    combined: bool = False
    inline_pad: int = 0
    # Of an FP8 output (nvfp4 caches). None stands for no scale: a dataclass instance as a default
    # is a constant torch 2.11's Dynamo cannot trace (the torch.compile path validates).
    out_scale: SideScale | None = None
    layers: Layers | None = None         # stacked caches (layer=), as in WriteArgs
    @property
    def head_dim(self) -> int:
        """The pages' head_dim, in elements (nvfp4: two per cache byte)."""
        return self.key_cache.head_dim * self.fmt.codes_per_byte


def check_dequantize(key_cache=None, value_cache=None, block_table=None, key_scale=None,
                     value_scale=None, *, dtype, layout,
                     fp8_format, null_page, kv_cache=None, key_scale_cache=None,
                     value_scale_cache=None, head_dim=None, cache_format=None,
                     out_scale=None, layer=None) -> DequantArgs:
    layout = check_choice(layout, "layout", LAYOUTS)
    device = check_same_device({**named_caches(key_cache, value_cache, kv_cache),
                                "block_table": block_table})
    (key_cache, value_cache, kv_cache, key_scale_cache, value_scale_cache), layers = unstack(
        layer, device, key_cache, value_cache, kv_cache, key_scale_cache, value_scale_cache)
    kc, vc, fmt, rank = check_caches(key_cache, value_cache, kv_cache, layout, fp8_format,
                                     cache_format)
    check_layers_supported(layers, fmt)
    cache_name = "kv_cache" if kv_cache is not None else "key_cache"
    key_scale_cache = check_scale_cache_arg(key_scale_cache, "key_scale_cache", fmt=fmt)
    value_scale_cache = check_scale_cache_arg(value_scale_cache, "value_scale_cache", fmt=fmt)
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int)):
        raise TypeError(f"head_dim: expected None or an int, got {type(head_dim).__name__}")
    if fmt.block_scaled:   # the pages hold codes_per_byte x the caches' last dimension
        elems = kc.head_dim * fmt.codes_per_byte
        if head_dim is not None and head_dim != elems:
            raise ValueError(f"head_dim: expected that of {cache_name} ({elems}: {kc.head_dim} "
                             f"bytes of {fmt.codes_per_byte} codes), got {head_dim}")
        check_block_head_dim(elems, fmt, cache_name)
        pad = 0
    else:
        if key_scale_cache == INLINE or value_scale_cache == INLINE:
            if head_dim is None:
                raise ValueError("head_dim: expected an int with an inline scale cache (the last "
                                 "dimension is head_dim + 4 or head_dim + 16), got None")
        elif head_dim is not None and head_dim != kc.head_dim:
            raise ValueError(f"head_dim: expected the last dimension of {cache_name} "
                             f"({kc.head_dim}) without an inline scale cache, got {head_dim}")
        kc, vc, pad = check_inline(key_scale_cache, value_scale_cache, kc, vc, head_dim,
                                   cache_name)
    if dtype not in fmt.out_dtypes:
        allowed = ", ".join(fmt.out_dtypes[:-1]) + " or " + fmt.out_dtypes[-1]
        takers = [f.name for f in FORMATS.values() if dtype in f.out_dtypes]
        hint = (f" ({dtype} output is for cache_format="
                f"{' or '.join(repr(n) for n in takers)})" if takers else "")
        raise TypeError(f"dtype: expected {allowed}{hint}, got {dtype}")
    check_dtype(block_table, "block_table", ("int32", "int64"))
    if block_table.ndim != 2:
        raise ValueError(f"block_table: expected rank 2 [batch, pages_per_seq], got shape "
                         f"{fmt_shape(block_table.shape)}")
    if null_page is not None and (isinstance(null_page, bool) or not isinstance(null_page, int)):
        raise TypeError(f"null_page: expected None or an int, got {type(null_page).__name__}")
    ks, vs = side_scales(key_scale, value_scale, key_scale_cache, value_scale_cache, kc, vc,
                         layout, rank, device, kc.num_heads, fmt)
    os = check_out_scale(out_scale, dtype, device)
    batch, pages_per_seq = block_table.shape
    return DequantArgs(batch, pages_per_seq, block_table, kc, vc, fmt, dtype, layout, rank,
                       null_page, ks, vs, kv_cache is not None, pad, os, layers)


def dequantized_shape(args: DequantArgs, combined: bool) -> tuple[int, ...]:
    """Shape of ``key_pages`` (or of the combined output): ``head_dim`` elements per head row."""
    return pages_shape(replace(args.key_cache, head_dim=args.head_dim), args.layout,
                       args.cache_rank, args.batch * args.pages_per_seq, combined)


def check_table_in_range(block_table, num_pages: int, null_page: int | None) -> None:
    """The opt-in bounds check of ``dequantize_pages``: every entry names a page or is padding
    (< 0, or ``null_page``)."""
    table = np.asarray(block_table)
    past = table >= num_pages
    if null_page is not None:
        past &= table != null_page
    bad = np.argwhere(past)
    if bad.size:
        b, p = (int(i) for i in bad[0])
        raise ValueError(f"block_table: expected every entry < {num_pages} (num_pages) or < 0 "
                         f"(padding), got {len(bad)} past the cache, the first "
                         f"block_table[{b}, {p}] = {int(table[b, p])}")


def dequantize_bounds(args, read) -> None:
    check_stack_bounds(args, read)
    check_table_in_range(read("block_table"), args.key_cache.num_pages, args.null_page)


def dequantize_made(args) -> dict:
    pages = (dequantized_shape(args, args.combined), args.out_dtype)
    names = ("kv_out",) if args.combined else ("key_out", "value_out")
    return {**dict.fromkeys(names, pages), "table_out": ((args.batch, args.pages_per_seq), "int32")}


DEQUANT_SIZES = {
    CUDA: dict(block=2048, num_warps=4),
    INTERPRET: dict(block=1 << 16, num_warps=1),
}


NVFP4_DEQUANT_SIZES = {
    CUDA: dict(block=4096, num_warps=4, reciprocal_div=Division.FP64, lookup=True,
               lookup_block=8192),
    INTERPRET: dict(block=1 << 16, num_warps=1, reciprocal_div=Division.DIV_RN, lookup=True,
                    lookup_block=1 << 16),
}


def table_scalars(args: DequantArgs) -> dict:
    """The block table as runtime scalars (its pages and strides, the null page)."""
    table = args.block_table
    return dict(pages_per_seq=max(args.pages_per_seq, 1), stride_table_seq=table.strides[0],
                stride_table_page=table.strides[1], num_pages=args.key_cache.num_pages,
                null_page=-1 if args.null_page is None else args.null_page)


def plan_call(args: DequantArgs, outs: dict, backend: str, exact: bool | None = None,
              aligned: bool = True) -> LaunchPlan:
    """The op table's planner (:attr:`fp8kv.optable.Op.plan`): :func:`plan_dequantize` with the
    call's outputs (``outs``: ``{"key_out", "value_out"}`` or ``{"kv_out"}``, ArrayInfo)."""
    return plan_dequantize(args, outs.get("kv_out") or outs["key_out"], outs.get("value_out"),
                           backend, exact, aligned)


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
    scalars = dict(**table_scalars(args), **kv_scalars(args))
    constexprs = dict(
        CACHE=cache_record(args),
        OUT=Output(strides(ko), strides(vo), int(OUT_KIND_OF_DTYPE[args.out_dtype]),
                   PACKED=ko.packed_pages(args.layout) and vo.packed_pages(args.layout)),
        TILE=ReadTile(BLOCK=block, BLOCK_D=block_d, ROWWISE=rowwise,
                      HND=args.layout == "HND" and args.cache_rank == 4,
                      HAS_NULL_PAGE=args.null_page is not None,
                      IN_PACKED=kc.packed_pages(args.layout) and vc.packed_pages(args.layout)),
        EXACT=exact_for(backend, exact))
    grid = (args.batch * args.pages_per_seq * chunks,)
    return LaunchPlan(grid, sizes["num_warps"], scalars, constexprs,
                      kernel="_dequantize_pages_kernel")


def _plan_dequantize_nvfp4(args: DequantArgs, ko, vo, backend: str, exact: bool | None,
                           aligned: bool) -> LaunchPlan:
    """Plan ``_dequantize_nvfp4_kernel``: ``[ROWS, BLOCK_D]`` tiles of whole head rows."""
    sizes = NVFP4_DEQUANT_SIZES[backend]
    kc, vc = args.key_cache, args.value_cache
    block_d = triton.next_power_of_2(args.head_dim)
    scalars = dict(**table_scalars(args), **kv_scalars(args),
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
        EXACT=exact_for(backend, exact))
    chunks = triton.cdiv(kc.page_size * kc.num_heads, rows)
    grid = (args.batch * args.pages_per_seq * chunks,)
    return LaunchPlan(grid, sizes["num_warps"], scalars, constexprs,
                      kernel="_dequantize_nvfp4_kernel")


DEQUANTIZE_PLACEHOLDER = "block_table"


def dequantize_operands(args) -> OperandMap:
    """``_dequantize_pages_kernel``'s arrays for a validated
    :class:`fp8kv.dequantize.DequantArgs` (a combined cache gives a combined output;
    ``_dequantize_nvfp4_kernel``'s for a packed format)."""
    kc, vc = caches_of(args.combined)
    inputs = (Operand("key_cache_ptr", kc), Operand("value_cache_ptr", vc),
              Operand("table_ptr", "block_table"))
    if args.fmt.packed:   # global scales, block scales, the FP8 output's scale
        out_scale = (Operand("out_scale_ptr", "out_scale") if args.out_scale.kind.on_device
                     else Operand("out_scale_ptr", DEQUANTIZE_PLACEHOLDER, used=False))
        inputs += (static_input("key", args.key_scale, DEQUANTIZE_PLACEHOLDER),
                   static_input("value", args.value_scale, DEQUANTIZE_PLACEHOLDER),
                   *block_operands()[0], out_scale)
    else:
        inputs += (scale_input("key", args.key_scale, DEQUANTIZE_PLACEHOLDER),
                   scale_input("value", args.value_scale, DEQUANTIZE_PLACEHOLDER),
                   layer_input(args, DEQUANTIZE_PLACEHOLDER))
    if args.combined:
        pages = (Operand("key_out_ptr", "kv_out"), Operand("value_out_ptr", None, used=False))
    else:
        pages = (Operand("key_out_ptr", "key_out"), Operand("value_out_ptr", "value_out"))
    return OperandMap(inputs, pages + (Operand("new_table_ptr", "table_out"),))


# ---------------------------------------------------------------------------------------------
# The op table's entry (fp8kv.optable).

_PAGES = tuple(Arg(f"{side}_out", Role.OUTPUT, f"the {side.upper()} pages read", made=True,
                   dims="pages", frontends=(), result=f"{side}_pages", combined="kv_out")
               for side in ("key", "value"))
_TABLE_OUT = Arg("table_out", Role.OUTPUT, "the renumbered block table", made=True, dims="b q",
                 frontends=(), result="new_block_table", contiguous=True)

OP = Op(
    "dequantize_pages",
    (*caches(updated=False),
     Arg("block_table", Role.INPUT, "each sequence's pages (< 0: padding)", dims="b q"),
     *scales("key", "value"),
     option("dtype", "the pages' dtype", schema=None),   # the torch op's: its outputs' dtype
     LAYOUT, FP8_FORMAT, option("null_page", "a page id that is padding too", Optional[int]),
     Arg("out", Role.OUTPUT, "preallocated outputs", optional=True, frontends=(TORCH,),
         parts=("key_out", "value_out", "table_out")),
     *sides(updated=False), option("head_dim", "the pages' head_dim", Optional[int]),
     CHECK_BOUNDS, CACHE_FORMAT,
     Arg("out_scale", Role.SCALE, "the FP8 pages' scale", optional=True, dims="any"), LAYER,
     *_PAGES, _TABLE_OUT),
    check_dequantize, dequantize_bounds, dequantize_made,
    lambda args: args.batch * args.pages_per_seq == 0, dequantize_operands,
    plan_call, returns=("key_out", "value_out", "table_out"), splits=("h",),
    reads=("block_table", "layer"),
    xla_triton=lambda args: not args.fmt.packed)
