"""Launch plans: grid, block sizes, warps, constexprs and scalar arguments, from shapes alone.

Both frontends launch exactly what a plan says; nothing here imports torch or jax. Plans are cached
on the (hashable) validated arguments, so a steady-state call costs one dict lookup.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .arrays import ArrayInfo
from .validate import DequantArgs, WriteArgs, page_is_packed

INTERPRET, CUDA = "interpret", "cuda"

# Elements per program (per K or V) and warps, per backend. The interpreter runs one program at a
# time at ~2 ms each, so it gets big tiles. On the H200 (bench/NOTES.md) 1024-element tiles win at
# every size; large batches want 2 warps (one 16-byte load of K and one of V per thread, many
# programs per SM), small ones 8 warps (more memory requests in flight, shorter dependency chains
# per thread): batches of up to `small_batch_elems` row elements use `small_batch_warps`.
# reciprocal_div: small batches divide by a per-tensor scale with one reciprocal and FMA
# corrections (exact, see fp8_math.divide), which shortens each thread's dependency chain
# (16 tokens: 2.39 vs 2.50 us); large batches keep div.rn, faster there (97.8 vs 100.0 us).
WRITE_SIZES = {
    CUDA: dict(tile=1024, max_block_hd=1024, num_warps=2, small_batch_warps=8,
               small_batch_elems=1 << 20, reciprocal_div=True),
    INTERPRET: dict(tile=1 << 16, max_block_hd=1 << 16, num_warps=1, small_batch_warps=1,
                    small_batch_elems=0, reciprocal_div=False),
}
DEQUANT_SIZES = {
    CUDA: dict(block=2048, num_warps=4),
    INTERPRET: dict(block=1 << 16, num_warps=1),
}


def next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class LaunchPlan:
    """What to launch: ``kernel[grid](*arrays, *scalars, *outputs, num_warps=..., **constexprs)``.

    ``scalar_types`` gives each scalar's Triton type ("i32", "i64", "fp32") for frontends such as
    jax-triton that type scalars themselves.
    """

    grid: tuple[int, ...]
    num_warps: int
    constexpr_items: tuple[tuple[str, object], ...]
    scalars: tuple
    scalar_types: tuple[str, ...]

    @property
    def constexprs(self) -> dict:
        return dict(self.constexpr_items)

    @property
    def empty(self) -> bool:
        return any(g == 0 for g in self.grid)


def pow2_divisor(*values: int, cap: int = 16) -> int:
    """The largest power of two, at most ``cap``, dividing every value (0 is divisible by all)."""
    align = cap
    for v in values:
        while v % align:
            align //= 2
    return align


def _int_type(v: int) -> str:
    return "i32" if -(2 ** 31) <= v < 2 ** 31 else "i64"


def _scalars(values):
    values = tuple(values)
    types = tuple("fp32" if isinstance(v, float) else _int_type(v) for v in values)
    return values, types


@functools.lru_cache(maxsize=4096)
def plan_write(args: WriteArgs, backend: str, exact: bool | None = None,
               combined: bool = False) -> LaunchPlan:
    """Plan ``_write_kv_kernel`` (or ``_write_kv_combined_kernel`` when ``combined``)."""
    sizes = WRITE_SIZES[backend]
    kc, vc = args.key_cache, args.value_cache
    row = kc.num_heads * kc.head_dim
    block_hd = min(next_pow2(row), sizes["max_block_hd"])
    block_t = max(1, sizes["tile"] // block_hd)
    if backend == INTERPRET:  # no compile cost here: fit the tile to the batch
        block_t = min(block_t, next_pow2(max(args.num_tokens, 1)))
    small = args.num_tokens * row <= sizes["small_batch_elems"]
    num_warps = sizes["small_batch_warps"] if small else sizes["num_warps"]
    key, value = args.key, args.value
    strides = [args.num_tokens, kc.num_pages * kc.page_size,
               key.strides[0], key.strides[1], value.strides[0], value.strides[1],
               kc.stride_page, kc.stride_slot, kc.stride_head]
    if combined:
        strides.append(args.value_offset)
    else:
        strides += [vc.stride_page, vc.stride_slot, vc.stride_head]
    scalars, types = _scalars(strides + [float(args.key_scale_value), float(args.value_scale_value)])
    constexprs = (
        ("NUM_HEADS", kc.num_heads), ("HEAD_DIM", kc.head_dim), ("PAGE_SIZE", kc.page_size),
        ("BLOCK_T", block_t), ("BLOCK_HD", block_hd),
        ("K_SCALE_MODE", args.key_scale_mode), ("V_SCALE_MODE", args.value_scale_mode),
        ("E5M2", args.fmt.name == "e5m2"), ("EXACT", backend == INTERPRET if exact is None else exact),
        ("KEY_PACKED", key.strides[1] == kc.head_dim or kc.num_heads == 1),
        ("VALUE_PACKED", value.strides[1] == kc.head_dim or kc.num_heads == 1),
        ("CACHE_PACKED", kc.packed_rows and vc.packed_rows),
        ("IN_ALIGN", pow2_divisor(key.strides[0], value.strides[0], key.strides[1],
                                  value.strides[1])),
        ("CACHE_ALIGN", pow2_divisor(kc.stride_page, kc.stride_slot, kc.stride_head, vc.stride_page,
                                     vc.stride_slot, vc.stride_head, args.value_offset)),
        ("RECIPROCAL_DIV", sizes["reciprocal_div"] and small),
    )
    return LaunchPlan((cdiv(args.num_tokens, block_t),), num_warps, constexprs, scalars, types)


OUT_KINDS = {"bfloat16": 0, "float16": 1, "float32": 2}


def page_strides(out: ArrayInfo, args: DequantArgs) -> tuple[int, int, int]:
    """``(page, slot, head)`` strides of an output laid out like the cache (rank 3: slot is 0)."""
    s = out.strides
    if args.cache_rank == 3:
        return (s[0], 0, s[1])
    return (s[0], s[1], s[2]) if args.layout == "NHD" else (s[0], s[2], s[1])


@functools.lru_cache(maxsize=4096)
def plan_dequantize(args: DequantArgs, key_out: ArrayInfo, value_out: ArrayInfo | None,
                    backend: str, exact: bool | None = None) -> LaunchPlan:
    """Plan ``_dequantize_pages_kernel``, or ``_dequantize_pages_combined_kernel`` when
    ``value_out`` is None and ``key_out`` is a combined ``[N, 2, ...]`` output.
    """
    combined = value_out is None
    ko = page_strides(key_out.drop_dim(1) if combined else key_out, args)
    vo = (key_out.strides[1],) if combined else page_strides(value_out, args)
    sizes = DEQUANT_SIZES[backend]
    kc, vc = args.key_cache, args.value_cache
    page_elems = kc.page_size * kc.num_heads * kc.head_dim
    block = min(next_pow2(page_elems), sizes["block"])
    num_entries = args.batch * args.pages_per_seq
    table = args.block_table
    null_page = -1 if args.null_page is None else args.null_page
    values = [num_entries, max(args.pages_per_seq, 1), table.strides[0], table.strides[1],
              kc.num_pages, null_page, args.value_in_offset,
              kc.stride_page, kc.stride_slot, kc.stride_head,
              vc.stride_page, vc.stride_slot, vc.stride_head, *ko, *vo,
              float(args.key_scale_value), float(args.value_scale_value)]
    scalars, types = _scalars(values)

    def packed(strides):
        return page_is_packed(args.layout, kc.page_size, kc.num_heads, kc.head_dim, strides[1],
                              strides[2])

    out_packed = packed(ko) and (combined or packed(vo))
    constexprs = (
        ("NUM_HEADS", kc.num_heads), ("HEAD_DIM", kc.head_dim), ("PAGE_SIZE", kc.page_size),
        ("HND", args.layout == "HND" and args.cache_rank == 4), ("BLOCK", block),
        ("K_SCALE_MODE", args.key_scale_mode), ("V_SCALE_MODE", args.value_scale_mode),
        ("E5M2", args.fmt.name == "e5m2"), ("OUT_KIND", OUT_KINDS[args.out_dtype]),
        ("EXACT", backend == INTERPRET if exact is None else exact),
        ("HAS_NULL_PAGE", args.null_page is not None),
        ("IN_PACKED", kc.packed_pages(args.layout) and vc.packed_pages(args.layout)),
        ("OUT_PACKED", out_packed),
        ("IN_ALIGN", pow2_divisor(kc.stride_page, kc.stride_slot, kc.stride_head, vc.stride_page,
                                  vc.stride_slot, vc.stride_head, args.value_in_offset)),
        ("OUT_ALIGN", pow2_divisor(*ko, *vo)),
    )
    grid = (num_entries * cdiv(page_elems, block),)
    return LaunchPlan(grid, sizes["num_warps"], constexprs, scalars, types)
