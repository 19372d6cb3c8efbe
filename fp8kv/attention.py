"""``paged_attention``: checks, launch plan, operand map and NumPy reference (docs/SPEC.md section 16).

The kernels are :mod:`fp8kv.ops.paged_attention`. Everything a kernel's constexprs describe is one
named tuple here (the caches' rows, how each side is read, the tiles, the options), made from the
validated call (:class:`AttentionArgs`) by :func:`plan_attention`; both frontends launch what it
returns and nothing else.
"""
from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass
from numbers import Real
from typing import NamedTuple, Optional

import numpy as np
import triton

from . import reference, validate
from .arrays import ArrayInfo, fmt_shape
from .constexprs import Cache, Side, Strides
from .formats import Format
from .layout import LAYOUTS, Layers, PagedCache
from .modes import OUT_KIND_OF_DTYPE, LayerKind, ScaleKind, SideScale
from .operands import Operand, OperandMap
from .optable import (CACHE_FORMAT, CHECK_BOUNDS, LAYER, LAYOUT, TORCH, Arg, Op, Role, caches,
                      from_shapes, option, scales, sides)
from .plan import CUDA, INTERPRET, LaunchPlan, cache_record, strides

QUERY_DTYPES = ("bfloat16", "float16")
PLAIN_DTYPES = QUERY_DTYPES            # unquantized caches: read as stored
MAX_QUERY_LEN = 16                     # query tokens per sequence (speculative decoding, MTP)
MAX_HEAD_DIM = 256

# How a side's elements become MMA operands (Reading.kind) and where its dynamic scales are
# (Reading.columns); the kernels compare these ids.
READ_PLAIN, READ_FP8, READ_NVFP4, READ_MXFP8 = 0, 1, 2, 3
COLUMNS_NONE, COLUMNS_ARRAY, COLUMNS_INLINE = 0, 1, 2


# ---------------------------------------------------------------------------------------------
# The kernels' constexprs.

class Reading(NamedTuple):
    """How one side (K or V) is read: ``kind`` (READ_*; the codes' format is the cache's
    ``FMT``), the static scale kind (a ScaleKind id), where dynamic scales are (COLUMNS_*),
    whether the call has a side array for it (dynamic or block scales), head_dim and its
    power-of-two tile width, and ``unit``, what the fp16 operand is multiplied by to give the
    value (NVFP4: 2**14); ``fuse_scale`` (NVFP4): the block scales multiply the codes inside
    the unpacking asm (``ATTENTION_SIZES``); ``transposed`` (V): the tile is read as
    ``[W, D, N]``, the PV MMA's A operand V^T, which Triton's pipeline then brings from shared
    memory with ``ldmatrix.trans``; ``quads`` (NVFP4's V): the codes are read four to a 16-bit
    element, which reaches that operand as it is stored and is unpacked there."""

    kind: int
    scale: int
    columns: int
    side: bool
    head_dim: int
    block_d: int
    unit: float
    plain_bf16: bool = False   # READ_PLAIN: a bf16 (else fp16) cache
    fuse_scale: bool = False
    quads: bool = False
    transposed: bool = False


class QueryRows(NamedTuple):
    stride_token: int
    stride_head: int


class Geometry(NamedTuple):
    num_heads: int
    num_kv_heads: int
    group: int
    head_dim: int
    page_size: int
    stride_table_page: int


class Tiles(NamedTuple):
    """``block_m`` query rows (the MMAs' N) x ``warps * block_n`` tokens (their M) per step;
    ``splits`` programs per row tile share the tokens (the plan's ``SPLITS``, SPEC 16.2);
    ``m_tiles`` row tiles per (sequence, kv head); ``stages`` the token loop's software
    pipelining; ``peel``: the first tile is taken before the loop, ``prefetch`` the tiles after
    it asked of L2, ``pdl`` the merge launched as a dependent (see ``ATTENTION_SIZES``).
    ``block_b`` > 0: the shares are balanced on the device over ``seq_lens`` (read as a block
    of ``block_b``), at most ``split_cap`` per sequence, each at least ``min_share`` tokens;
    ``merged``: some row tile may be split (partials and the merge kernel). ``align_end``: a
    share's tiles end at its end (the peeled one takes the remainder); ``column_sums``: row
    sums kept per token column (see ``ATTENTION_SIZES``)."""

    block_m: int
    block_n: int
    warps: int
    splits: int
    m_tiles: int
    stages: int
    peel: bool = False
    prefetch: int = 0
    pdl: bool = False
    block_b: int = 0
    split_cap: int = 1
    min_share: int = 1
    merged: bool = False
    align_end: bool = False
    column_sums: bool = False


class Options(NamedTuple):
    varlen: bool         # query_start_loc: several query tokens per sequence, causal
    window: bool
    soft_cap: bool
    sinks: bool
    exact: bool
    out_kind: int
    pipelined: bool      # compiled kernels: the token loop is Triton's pipelined range, and
    #                      the L2 prefetch and the dependent launch's waits are emitted (the
    #                      interpreter has no instruction for them)
    softmax_scale: float  # a model's constants, compiled in (XLA's Triton call compiles in
    cap: float            # every scalar; a host float may not change per call there)


class Constants(NamedTuple):
    """Every constexpr of the attention kernels, as one parameter ``C``."""

    query: QueryRows
    cache: Cache         # the caches as every kernel takes them (fp8kv.constexprs)
    key_read: Reading    # (not "value": a Triton constexpr's own attribute)
    value_read: Reading
    geometry: Geometry
    tiles: Tiles
    options: Options


# Per backend: query rows per tile (the MMAs' N: the next power of two of a call's rows per
# (sequence, kv head), from ``min_block_m``, the MMA's 8 columns, up to ``block_m``), tokens per
# warp and step, warps; the token loop's pipelining (``stages``; Triton keeps (stages - 1) // 2
# tiles in flight here) for calls that fill the GPU and for split calls; splits are added to
# calls of fewer than ``split_below`` programs, up to about ``target_programs``, each split
# taking at least ``min_split_tokens`` tokens; ``pow2_splits``: the split count rounded up to a
# power of two (else the count that reaches the target).
# ``packed``: what a packed-code cache (nvfp4) reads with instead: one warp per program, and
# calls of fewer than 1,024 programs split up to about 1,024 -- where two warps share a program
# its loop waits at their barriers three times a step and its end exchanges their states, and
# NVFP4's unpacking leaves each warp few cycles to lose;
# ``plain``: the same for a bf16 / fp16 cache (twice the shared memory per pipelined tile);
# ``blocked``: an MXFP8 cache, one warp per program (its tile's blocks are a batch of one warp's
# dots), split like ``packed``.
# bench/NOTES.md ("Paged attention") has the measurements behind the CUDA row (``python -m
# bench --only attention_sweep``). The interpreter runs one program at a time: small tiles,
# and splits already for small calls so that the merge kernel runs in CPU tests.
# ``peel``: take each program's first tile before the token loop where the key side is read as
# FP8 or NVFP4 codes (PEELED_READS). Their query is scaled into fp16 before its MMA layout, which
# Triton reaches through shared memory; with its only user inside the loop Triton reloads the
# operand there every step and keeps its buffer (the query broadcast to every warp) beside the
# pipeline's. A user before the loop moves the load out: the operand stays in registers. The
# sm_90 compile of the e4m3 Llama decode (5 stages) then fits four programs per SM, not three,
# and takes fewer instructions per step, for more registers and one tile read outside the
# pipeline (bench/NOTES.md has the numbers). The interpreter peels too, so that CPU tests run
# the guarded tile (an empty share reads nothing). Every load of the peeled tile and the query
# is issued before any of them is converted (the kernel says why). ``prefetch``: the K and V
# rows of that many tiles after the peeled one are asked of L2 with it (their block-table
# entries loaded beside its own), as the pipelined loop only starts its first loads once the
# peeled tile is done; keys with per-token scales (a side array the prefetch leaves out) read
# without it.
# ``fuse_scale``: NVFP4 codes and their block scales become MMA operands in one asm per four
# bytes (fp16 pairs out), instead of an unpacking asm and fp16 multiplies outside it, around
# which Triton splits and rejoins every pair: fewer instructions per step in the sm_90 compile,
# the same products. The interpreter has no asm: there it changes nothing.
# ``balance_seqs``, ``balance_programs``: calls of up to ``balance_seqs`` sequences share their
# tokens out on the device, from ``seq_lens`` (SPEC 16.2): about ``balance_programs`` more
# programs than the split count gives are spread over the sequences by length, so that one long
# sequence among short ones does not leave one program per kv head reading it alone. Extra
# programs that a batch of equal lengths does not use return at once. Off on CUDA for now
# (bench/NOTES.md, "Ragged batches": one long sequence among short ones 2.9-3.5x faster, but
# those unused programs cost NVFP4's equal lengths a third at the middle shapes, the prologue
# 2-10 %); the interpreter's row balances, so that CPU tests run it.
# ``align_end`` (with ``peel``): a share's tiles end at its end, the peeled tile taking what
# whole tiles leave over at its start, so that the loop's tiles need no clamp or mask (SPEC
# 16.2). ``column_sums``: a row's softmax sum kept per token column of the tile and added up
# once at the share's end, instead of a reduction across the warp's lanes every step. Each
# takes instructions out of the loop's step, whose count sets NVFP4's time; ``split_*`` are
# the same for split calls (``stages`` / ``split_stages`` alike). On the H200 the two made
# NVFP4's split shapes 1.5-2 % faster but its unsplit 256 x 1,024 9 % slower, and FP8 gained
# nothing (bench/NOTES.md): the CUDA row gives them to NVFP4's split calls alone (``packed``;
# an H100 read each split shape 0.4-0.7 % faster so); the interpreter's row takes both
# everywhere, so that CPU tests run them.
_ONE_WARP_SPLIT_TO_1024 = dict(warps=1, split_below=1024, target_programs=1024,
                               balance_programs=1024, min_split_tokens=128, pow2_splits=False)
ATTENTION_SIZES = {
    CUDA: dict(block_m=16, min_block_m=8, block_n=32, warps=2, stages=5, split_stages=5,
               split_below=512, target_programs=264, min_split_tokens=256, max_splits=64,
               merge_rows=4, merge_warps=4, merge_splits=32, peel=True, prefetch=1, pdl=True,
               fuse_scale=True, pow2_splits=True, balance_seqs=0, balance_programs=264,
               align_end=False, column_sums=False, split_align_end=False,
               split_column_sums=False,
               packed=dict(_ONE_WARP_SPLIT_TO_1024, split_align_end=True, split_column_sums=True),
               plain=dict(stages=4, split_stages=4),
               blocked=dict(_ONE_WARP_SPLIT_TO_1024)),
    INTERPRET: dict(block_m=16, min_block_m=8, block_n=16, warps=2, stages=1, split_stages=1,
                    split_below=4, target_programs=4, min_split_tokens=16, max_splits=4,
                    merge_rows=16, merge_warps=1, merge_splits=2, peel=True, prefetch=0,
                    pdl=False, fuse_scale=True, pow2_splits=True, balance_seqs=64,
                    balance_programs=4, align_end=True, column_sums=True,
                    split_align_end=True, split_column_sums=True, packed={}, plain={},
                    blocked=dict(warps=1)),
}
PEELED_READS = (READ_FP8, READ_NVFP4, READ_MXFP8)
# ``pdl``: the merge launched as a programmatic dependent of the attention grid (it waits for
# the grid's end inside, ``gdc_wait``), so its launch overlaps the grid's last programs. Triton's
# ``launch_pdl`` and its ``gdc_*`` functions are recent: used only where this Triton has them,
# and ``FP8KV_PDL=0`` turns them off (the same bytes either way; jax-triton launches without the
# attribute, where the wait returns at once).


def _has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.language.extra import cuda
    except ImportError:
        return False
    return ("launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})
            and hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents"))


PDL = os.environ.get("FP8KV_PDL", "1") != "0" and _has_pdl()


# ---------------------------------------------------------------------------------------------
# Checks.

@dataclass(frozen=True)
class AttentionArgs:
    """A validated ``paged_attention`` / ``paged_attention_combined`` call."""

    num_tokens: int
    num_seqs: int
    num_heads: int
    head_dim: int
    query: ArrayInfo
    key_cache: PagedCache          # data columns only (inline scales: head_dim bytes)
    value_cache: PagedCache
    fmt: Format | None             # None: an unquantized (bf16 / fp16) cache
    key_scale: SideScale
    value_scale: SideScale
    layout: str
    cache_rank: int
    combined: bool
    inline_pad: int
    layers: Layers | None
    block_table: ArrayInfo
    varlen: bool
    max_query_len: int
    softmax_scale: float
    sliding_window: int | None
    logits_soft_cap: float | None
    sinks: bool

    @property
    def num_kv_heads(self) -> int:
        return self.key_cache.num_heads

    @property
    def out_dtype(self) -> str:
        return self.query.dtype

    @property
    def out_shape(self) -> tuple[int, int, int]:
        return (self.num_tokens, self.num_heads, self.head_dim)


def _check_int(value, name: str, low: int, high: int | None = None, what: str = "an int"):
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name}: expected {what}, got {type(value).__name__}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name}: expected {what} {bound}, got {value}")
    return value


def _check_float(value, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name}: expected None or a float, got {type(value).__name__}")
    value = float(value)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected a finite float > 0, got {value}")
    return value


def _check_vector(info, name: str, dtype: str, length: int, device: str, what: str) -> None:
    if not isinstance(info, ArrayInfo):
        raise TypeError(f"{name}: expected an array, got {type(info).__name__}")
    validate.check_dtype(info, name, (dtype,))
    if info.shape != (length,):
        raise ValueError(f"{name}: expected shape [{length}] ({what}), got "
                         f"{fmt_shape(info.shape)}")
    validate.check_contiguous(info, name)
    validate.check_device(info, name, device)


def _plain_caches(key_cache, value_cache, kv_cache, layout, query):
    """Unquantized caches: ``(kc, vc, rank)``, the caches' dtype the query's."""
    for name, cache in validate.named_caches(key_cache, value_cache, kv_cache).items():
        if cache.dtype != query.dtype:
            raise TypeError(f"{name}: expected dtype {query.dtype} (that of query) for an "
                            f"unquantized cache, got {cache.dtype}")
    if kv_cache is not None:
        kc, vc = validate.check_cache(kv_cache, layout, "kv_cache", True, PLAIN_DTYPES)
        return kc, vc, kv_cache.ndim - 1
    kc = validate.check_cache(key_cache, layout, "key_cache", dtypes=PLAIN_DTYPES)
    vc = validate.check_cache(value_cache, layout, "value_cache", dtypes=PLAIN_DTYPES)
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache: expected the shape of key_cache "
                         f"{fmt_shape(key_cache.shape)}, got {fmt_shape(value_cache.shape)}")
    return kc, vc, key_cache.ndim


def check_attention(query, key_cache=None, value_cache=None, block_table=None, seq_lens=None,
                    key_scale=None, value_scale=None, *, kv_cache=None, query_start_loc=None,
                    softmax_scale=None, sliding_window=None, logits_soft_cap=None, sinks=None,
                    key_scale_cache=None, value_scale_cache=None, cache_format=None,
                    layout="NHD", head_dim=None, layer=None,
                    max_query_len=None) -> AttentionArgs:
    """Validate ``paged_attention`` (``kv_cache``: ``paged_attention_combined``) arguments."""
    layout = validate.check_choice(layout, "layout", LAYOUTS)
    if not isinstance(query, ArrayInfo):
        raise TypeError(f"query: expected an array, got {type(query).__name__}")
    caches = validate.named_caches(key_cache, value_cache, kv_cache)
    device = validate.check_same_device({"query": query, **caches, "block_table": block_table,
                                         "seq_lens": seq_lens})
    validate.check_dtype(query, "query", QUERY_DTYPES)
    if query.ndim != 3:
        raise ValueError(f"query: expected rank 3 [num_tokens, num_heads, head_dim], got shape "
                         f"{fmt_shape(query.shape)}")
    validate.check_unit_last_stride(query, "query")
    validate.check_nonnegative_strides(query, "query")
    (key_cache, value_cache, kv_cache, key_scale_cache, value_scale_cache), layers = \
        validate.unstack(layer, device, key_cache, value_cache, kv_cache, key_scale_cache,
                         value_scale_cache)
    cache_name = "kv_cache" if kv_cache is not None else "key_cache"
    first = kv_cache if kv_cache is not None else key_cache
    num_tokens, num_heads, q_dim = query.shape
    if head_dim is not None:
        head_dim = _check_int(head_dim, "head_dim", 1)
    plain = first.dtype in PLAIN_DTYPES
    pad = 0
    if plain:
        if cache_format is not None:
            raise ValueError(f"cache_format: expected None for an unquantized {first.dtype} "
                             f"cache, got {cache_format!r}")
        for name, given in (("key_scale", key_scale), ("value_scale", value_scale),
                            ("key_scale_cache", key_scale_cache),
                            ("value_scale_cache", value_scale_cache)):
            if given is not None:
                raise ValueError(f"{name}: expected None for an unquantized {first.dtype} "
                                 f"cache (its values are read as stored), got "
                                 f"{type(given).__name__}")
        kc, vc, rank = _plain_caches(key_cache, value_cache, kv_cache, layout, query)
        fmt, ks, vs = None, SideScale(), SideScale()
        elems = kc.head_dim
    else:
        kc, vc, fmt, rank = validate.check_caches(key_cache, value_cache, kv_cache, layout, None,
                                                  cache_format)
        key_scale_cache = validate.check_scale_cache_arg(key_scale_cache, "key_scale_cache",
                                                         fmt=fmt)
        value_scale_cache = validate.check_scale_cache_arg(value_scale_cache,
                                                           "value_scale_cache", fmt=fmt)
        if fmt.block_scaled:
            elems = kc.head_dim * fmt.codes_per_byte
            validate.check_block_head_dim(elems, fmt, cache_name)
            ks, vs = validate.block_side_scales(key_scale, value_scale, key_scale_cache,
                                                 value_scale_cache, kc, vc, layout, rank,
                                                 device, kc.num_heads, fmt)
        else:
            inline = validate.INLINE in (key_scale_cache, value_scale_cache)
            if inline and head_dim is None:
                head_dim = q_dim   # the query's head_dim tells the row's data columns
            kc, vc, pad = validate.check_inline(key_scale_cache, value_scale_cache, kc, vc,
                                                head_dim, cache_name)
            elems = kc.head_dim
            ks, vs = validate.side_scales(key_scale, value_scale, key_scale_cache,
                                           value_scale_cache, kc, vc, layout, rank, device,
                                           kc.num_heads)
        if layers is not None and fmt.block_scaled:
            validate.check_layers_supported(layers, fmt)
    if head_dim is not None and head_dim != elems:
        raise ValueError(f"head_dim: expected that of {cache_name} ({elems}), got {head_dim}")
    if q_dim != elems:
        raise ValueError(f"query: expected head_dim {elems} (that of {cache_name}), got {q_dim}")
    if elems % 16 or elems > MAX_HEAD_DIM:
        raise ValueError(f"{cache_name}: expected a head_dim that is a multiple of 16 and at most "
                         f"{MAX_HEAD_DIM}, got {elems}")
    num_kv_heads = kc.num_heads
    if num_heads % num_kv_heads:
        raise ValueError(f"query: expected num_heads a multiple of num_kv_heads ({num_kv_heads}, "
                         f"of {cache_name}), got {num_heads}")
    if not isinstance(block_table, ArrayInfo):
        raise TypeError(f"block_table: expected an array, got {type(block_table).__name__}")
    validate.check_dtype(block_table, "block_table", ("int32",))
    if block_table.ndim != 2:
        raise ValueError(f"block_table: expected rank 2 [num_seqs, max_pages], got shape "
                         f"{fmt_shape(block_table.shape)}")
    validate.check_nonnegative_strides(block_table, "block_table")
    num_seqs = block_table.shape[0]
    if not isinstance(seq_lens, ArrayInfo):
        raise TypeError(f"seq_lens: expected an array, got {type(seq_lens).__name__}")
    _check_vector(seq_lens, "seq_lens", "int32", num_seqs, device, "num_seqs, of block_table")
    varlen = query_start_loc is not None
    if varlen:
        _check_vector(query_start_loc, "query_start_loc", "int32", num_seqs + 1, device,
                      "num_seqs + 1")
        if num_tokens > MAX_QUERY_LEN * num_seqs:
            raise ValueError(f"query: expected at most {MAX_QUERY_LEN} query tokens per sequence "
                             f"({MAX_QUERY_LEN * num_seqs} for {num_seqs} sequences), got "
                             f"{num_tokens} tokens")
        longest = min(MAX_QUERY_LEN, num_tokens) if max_query_len is None else _check_int(
            max_query_len, "max_query_len", 1, MAX_QUERY_LEN)
    else:
        if num_tokens != num_seqs:
            raise ValueError(f"query: expected num_tokens == num_seqs ({num_seqs}, one decode "
                             f"token per sequence; pass query_start_loc for more), got "
                             f"{num_tokens}")
        if max_query_len is not None and _check_int(max_query_len, "max_query_len", 1,
                                                    MAX_QUERY_LEN) != 1:
            raise ValueError(f"max_query_len: expected 1 without query_start_loc, got "
                             f"{max_query_len}")
        longest = 1
    scale = 1.0 / math.sqrt(elems) if softmax_scale is None else _check_float(
        softmax_scale, "softmax_scale")
    window = None if sliding_window is None else _check_int(sliding_window, "sliding_window", 1,
                                                            2**31 - 1)
    cap = None if logits_soft_cap is None else _check_float(logits_soft_cap, "logits_soft_cap")
    if sinks is not None:
        _check_vector(sinks, "sinks", "float32", num_heads, device, "num_heads")
    return AttentionArgs(num_tokens, num_seqs, num_heads, elems, query, kc, vc, fmt, ks, vs,
                         layout, rank, kv_cache is not None, pad, layers, block_table, varlen,
                         longest, scale, window, cap, sinks is not None)


def check_out(out: ArrayInfo, args: AttentionArgs) -> None:
    """A caller's ``out=``: the query's shape and dtype, contiguous rows."""
    validate.check_out(out, "out", args.out_shape, (args.out_dtype,), args.query.device)
    d = args.head_dim
    if out.strides[:2] != (args.num_heads * d, d):
        raise ValueError(f"out: expected a contiguous array (strides {fmt_shape((args.num_heads * d, d, 1))}), "
                         f"got strides {fmt_shape(out.strides)}")


def attention_bounds(args: AttentionArgs, read) -> None:
    """The opt-in ``check_bounds`` of a validated call (``read(name)``: an argument's values on
    the host)."""
    if args.layers is not None:
        validate.check_layer_in_range(read("layer"), args.layers.num_layers)
    check_seq_lens_in_range(read("seq_lens"), read("query_start_loc") if args.varlen else None,
                            args.block_table.shape[1], args.key_cache.page_size,
                            args.max_query_len)


def check_seq_lens_in_range(seq_lens, query_start_loc, pages_per_seq: int, page_size: int,
                            max_query_len: int) -> None:
    """The opt-in bounds check: every sequence fits its block-table row and holds its query
    tokens, and no query is longer than ``max_query_len`` (host values)."""
    lens = np.asarray(seq_lens)
    bad = np.flatnonzero((lens < 0) | (lens > pages_per_seq * page_size))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"seq_lens: expected 0 <= seq_lens <= {pages_per_seq * page_size} "
                         f"(max_pages * page_size, of block_table), got seq_lens[{b}] = "
                         f"{int(lens[b])}")
    q_lens = np.ones_like(lens) if query_start_loc is None else np.diff(np.asarray(query_start_loc))
    bad = np.flatnonzero((q_lens < 0) | (q_lens > max_query_len) | (q_lens > lens))
    if bad.size:
        b = int(bad[0])
        raise ValueError(f"query_start_loc: expected 0 <= query length <= min(max_query_len="
                         f"{max_query_len}, seq_lens) per sequence, got {int(q_lens[b])} for "
                         f"sequence {b} (seq_lens {int(lens[b])})")


# ---------------------------------------------------------------------------------------------
# Plan.

@dataclass(frozen=True, eq=False)
class AttentionPlan:
    """The attention kernel's launch, and the merge's where the tokens may be split
    (``merge`` None: the attention kernel writes the output); the fp32 workspace's shapes (the
    partials, and -- balanced -- each output row's first partial and share count, as int32
    bits)."""

    attention: LaunchPlan
    merge: LaunchPlan | None
    partial_out: tuple[int, ...]
    partial_stats: tuple[int, ...]
    partial_rows: tuple[int, ...]

    @property
    def empty(self) -> bool:
        return self.attention.empty

    @property
    def balanced(self) -> bool:
        """The shares are balanced over ``seq_lens`` on the device (SPEC 16.2)."""
        return self.attention.constexprs["C"].tiles.block_b > 0


def _cache(args: AttentionArgs) -> Cache:
    """The caches' record: :func:`fp8kv.plan.cache_record`'s, with no codec for a bf16 / fp16
    cache (read as stored)."""
    if args.fmt is not None:
        return cache_record(args)
    layers = args.layers or Layers(0, 0, 0)
    kind = (LayerKind.NONE if args.layers is None else
            LayerKind.TENSOR if args.layers.on_device else LayerKind.VALUE)
    none = ScaleKind.NONE.id
    return Cache(args.num_kv_heads, args.head_dim, args.key_cache.page_size, None,
                 Side(strides(args.key_cache, layers.stride_key_cache), Strides(), none, none),
                 Side(strides(args.value_cache, layers.stride_value_cache), Strides(), none,
                      none),
                 COMBINED=args.combined, LAYER_KIND=kind.id, NUM_LAYERS=layers.num_layers)


def _reading(args: AttentionArgs, side: SideScale, head_dim: int, sizes: dict,
             value: bool = False) -> Reading:
    """How ``side`` is read; V (``value``) always transposed, as the PV MMA's A operand."""
    return _reading_kind(args, side, head_dim, sizes, value)._replace(transposed=value)


def _reading_kind(args: AttentionArgs, side: SideScale, head_dim: int, sizes: dict,
                  value: bool) -> Reading:
    block_d = triton.next_power_of_2(head_dim)
    fmt = args.fmt
    if fmt is None:
        return Reading(READ_PLAIN, ScaleKind.NONE.id, COLUMNS_NONE, False, head_dim, block_d,
                       1.0, args.query.dtype == "bfloat16")
    if fmt.packed:
        return Reading(READ_NVFP4, side.kind.id, COLUMNS_NONE, True, head_dim, block_d, 2.0 ** 14,
                       fuse_scale=sizes["fuse_scale"], quads=value)
    if fmt.block_scaled:   # mxfp8: e4m3 codes as fp16 operands, a batch of dots per block
        return Reading(READ_MXFP8, side.kind.id, COLUMNS_NONE, True, head_dim, block_d, 1.0)
    columns = (COLUMNS_INLINE if args.inline_pad and side.is_dynamic else
               COLUMNS_ARRAY if side.is_dynamic else COLUMNS_NONE)
    return Reading(READ_FP8, side.kind.id, columns, columns == COLUMNS_ARRAY, head_dim, block_d,
                   1.0)


def splits_for(programs: int, max_context: int, tile: int, sizes: dict) -> int:
    """Splits per (sequence, kv head, row tile) that bring the call to ``target_programs``
    (a power of two with ``pow2_splits``), each split keeping ``min_split_tokens`` (and a whole
    tile); 1 for an empty call."""
    if programs == 0 or programs >= sizes["split_below"]:
        return 1
    want = -(-sizes["target_programs"] // programs)
    most = max(1, max_context // max(sizes["min_split_tokens"], tile))
    splits = min(want, most, sizes["max_splits"])
    if splits <= 1:
        return 1
    return triton.next_power_of_2(splits) if sizes["pow2_splits"] else splits


@functools.lru_cache(maxsize=1024)
def plan_attention(args: AttentionArgs, backend: str, exact: bool | None = None) -> AttentionPlan:
    """Plan :func:`fp8kv.ops.paged_attention._paged_attention_kernel` (and the merge)."""
    sizes = ATTENTION_SIZES[backend]
    if args.fmt is None:
        sizes = {**sizes, **sizes["plain"]}
    elif args.fmt.packed:
        sizes = {**sizes, **sizes["packed"]}
    elif args.fmt.block_scaled:
        sizes = {**sizes, **sizes["blocked"]}
    exact = backend == INTERPRET if exact is None else exact
    d = args.head_dim
    kc = args.key_cache
    group = args.num_heads // args.num_kv_heads
    block_m = min(sizes["block_m"],
                  max(sizes["min_block_m"], triton.next_power_of_2(args.max_query_len * group)))
    m_tiles = -(-args.max_query_len * group // block_m)
    heads = args.num_kv_heads * m_tiles   # programs per slot
    seqs = args.num_seqs
    warps = sizes["warps"]
    tile = warps * sizes["block_n"]
    max_context = args.block_table.shape[1] * kc.page_size
    splits = splits_for(seqs * heads, max_context, tile, sizes)
    split = "" if splits == 1 else "split_"
    schedule = _schedule(seqs, heads, splits, sizes)
    query = args.query
    key_read = _reading(args, args.key_scale, d, sizes)
    peel = sizes["peel"] and key_read.kind in PEELED_READS
    pdl = sizes["pdl"] and schedule.merged and PDL
    consts = Constants(
        QueryRows(query.strides[0], query.strides[1]), _cache(args),
        key_read, _reading(args, args.value_scale, d, sizes, value=True),
        Geometry(args.num_heads, args.num_kv_heads, group, d, kc.page_size,
                 args.block_table.strides[1]),
        Tiles(block_m, sizes["block_n"], warps, splits, m_tiles,
              sizes[split + "stages"], peel,
              sizes["prefetch"] if peel and key_read.columns == COLUMNS_NONE else 0, pdl,
              schedule.block_b, schedule.split_cap,
              max(sizes["min_split_tokens"], tile), schedule.merged,
              peel and sizes[split + "align_end"], sizes[split + "column_sums"]),
        Options(args.varlen, args.sliding_window is not None, args.logits_soft_cap is not None,
                args.sinks, exact, int(OUT_KIND_OF_DTYPE[args.out_dtype]), backend == CUDA,
                args.softmax_scale, float(args.logits_soft_cap or 1.0)))
    scalars = dict(
        key_scale_value=float(args.key_scale.value),
        value_scale_value=float(args.value_scale.value), window=int(args.sliding_window or 0),
        layer=0 if args.layers is None or args.layers.on_device else args.layers.index,
        stride_table=args.block_table.strides[0], num_seqs=seqs)
    main = LaunchPlan((heads, schedule.slots), warps, scalars, dict(C=consts),
                      kernel="_paged_attention_kernel")
    rows = args.num_tokens * args.num_heads
    if not schedule.merged:
        return AttentionPlan(main, None, (0,), (0,), (0,))
    partials = rows * splits if schedule.block_b == 0 else schedule.slots * heads * block_m
    merge = LaunchPlan((-(-rows // sizes["merge_rows"]),), sizes["merge_warps"],
                       dict(num_rows=rows, num_partials=partials),
                       dict(C=consts, BLOCK_D=triton.next_power_of_2(d),
                            BLOCK_S=min(triton.next_power_of_2(schedule.split_cap),
                                        sizes["merge_splits"]),
                            ROWS=sizes["merge_rows"]),
                       kernel="_attention_merge_kernel", launch_pdl=pdl)
    # Split alike, every row's SPLITS partials side by side; balanced, one per row of each
    # program, and each row's (first partial, count).
    return AttentionPlan(main, merge, (partials, d), (partials, 2),
                         (0,) if schedule.block_b == 0 else (rows, 2))


class Schedule(NamedTuple):
    """The programs of each (kv head, row tile) (``slots``), how the tokens are shared among
    them (``block_b`` > 0: balanced over ``seq_lens`` on the device), the most shares of one
    sequence, and whether any row tile may be split (SPEC 16.2)."""

    slots: int
    block_b: int
    split_cap: int
    merged: bool


def _schedule(seqs: int, heads: int, splits: int, sizes: dict) -> Schedule:
    """Up to ``balance_seqs`` sequences, the shares are balanced on the device: each sequence
    has ``splits`` slots, and ``min(seqs - 1, balance_programs / heads)`` more are spread over
    them in proportion to their lengths (a long sequence among short ones takes most of them);
    ``seq_lens`` is read as a block of a power of four (few compiled variants)."""
    if not 0 < seqs <= sizes["balance_seqs"] or heads == 0:
        return Schedule(seqs * splits, 0, splits, splits > 1)
    extra = min(seqs - 1, -(-sizes["balance_programs"] // heads))
    slots = seqs * splits + extra
    cap = max(splits, min(sizes["max_splits"], 1 + slots - seqs))
    block_b = 16
    while block_b < seqs:
        block_b *= 4
    return Schedule(slots, block_b, cap, cap > 1)


# ---------------------------------------------------------------------------------------------
# Operands: which argument each kernel pointer takes.

PLACEHOLDER = "seq_lens"   # an int32 array every call has: the pointer of what is not read


def attention_operands(args: AttentionArgs, plan: AttentionPlan | None = None) -> OperandMap:
    """``_paged_attention_kernel``'s arrays (read only, but the outputs): with ``plan``, the
    output or the workspace marked unused (with a uniform split only the workspace is written;
    a balanced one writes the rows of unsplit row tiles directly)."""
    merged = plan is not None and plan.merge is not None
    direct = not merged or plan.balanced
    kc, vc = ("kv_cache", "kv_cache") if args.combined else ("key_cache", "value_cache")

    def optional(param, source, used):
        return Operand(param, source if used else PLACEHOLDER, used=used)

    ks, vs = args.key_scale, args.value_scale
    inputs = (Operand("query_ptr", "query"), Operand("key_cache_ptr", kc),
              Operand("value_cache_ptr", vc), Operand("table_ptr", "block_table"),
              Operand("seq_lens_ptr", "seq_lens"),
              optional("query_start_ptr", "query_start_loc", args.varlen),
              optional("key_scale_ptr", "key_scale", ks.kind.on_device),
              optional("value_scale_ptr", "value_scale", vs.kind.on_device),
              optional("key_side_ptr", "key_scale_cache", ks.stored is not None),
              optional("value_side_ptr", "value_scale_cache", vs.stored is not None),
              optional("sinks_ptr", "sinks", args.sinks),
              optional("layer_ptr", "layer", args.layers is not None and args.layers.on_device))
    return OperandMap(inputs, (Operand("out_ptr", "out", used=direct),
                               Operand("partial_out_ptr", "partial_out", used=merged),
                               Operand("partial_stats_ptr", "partial_stats", used=merged),
                               Operand("partial_rows_ptr", "partial_rows",
                                       used=merged and plan.balanced)))


def merge_operands(args: AttentionArgs, plan: AttentionPlan) -> OperandMap:
    """The merge's arrays. After a balanced attention grid the output is updated in place (the
    rows that grid wrote stay), so ``out_ptr`` shares the buffer of ``written_ptr``, a
    parameter the kernel never reads."""
    balanced = plan.balanced
    return OperandMap((Operand("partial_out_ptr", "partial_out"),
                       Operand("partial_stats_ptr", "partial_stats"),
                       Operand("partial_rows_ptr", "partial_rows" if balanced else PLACEHOLDER,
                               used=balanced),
                       Operand("sinks_ptr", "sinks" if args.sinks else "partial_stats",
                               used=args.sinks),
                       Operand("written_ptr", "out" if balanced else "partial_stats",
                               used=False)),
                      (Operand("out_ptr", "out",
                               aliases="written_ptr" if balanced else None),))


WORKSPACE = ("partial_out", "partial_stats", "partial_rows")


# ---------------------------------------------------------------------------------------------
# Reference (fp64 over the caches' dequantized values) and the spec's error bound.

def _values(cache, block_table, scale, scale_cache, layout, cache_format, head_dim):
    """fp32 values ``[num_seqs, pages_per_seq * page_size, H, D]`` of one side's pages (one
    layer's, one half of a combined cache), in token order: as stored for a bf16 / fp16 cache,
    else the reference ``dequantize_pages`` of a call with this side alone."""
    table = np.asarray(block_table)
    cache = np.asarray(cache)
    if cache.dtype == np.float16 or cache.dtype.name == "bfloat16":
        pages = cache[np.clip(table.reshape(-1), 0, cache.shape[0] - 1)].astype(np.float32)
    else:
        kw = dict(dtype="float32", layout=layout, cache_format=cache_format, head_dim=head_dim,
                  key_scale_cache=scale_cache, value_scale_cache=scale_cache)
        pages = np.asarray(reference.dequantize_pages(cache, cache, table, scale, scale, **kw)[0],
                           np.float32)
    if pages.ndim == 4 and layout == "HND":           # [N, H, S, D] -> [N, S, H, D]
        pages = pages.transpose(0, 2, 1, 3)
    if pages.ndim == 3:                                 # rank-3 caches: page_size 1
        pages = pages[:, None]
    b, p = table.shape
    return pages.reshape(b, p * pages.shape[1], pages.shape[2], pages.shape[3])


def paged_attention(query, key_cache, value_cache, block_table, seq_lens, key_scale=None,
                    value_scale=None, *, query_start_loc=None, softmax_scale=None,
                    sliding_window=None, logits_soft_cap=None, sinks=None,
                    key_scale_cache=None, value_scale_cache=None, cache_format=None,
                    layout="NHD", head_dim=None, layer=None, kv_cache=None):
    """Reference ``paged_attention`` in fp64: ``(out, vmax, score_mass)``, each
    ``[num_tokens, num_heads, ...]``: the attention output over the caches' values (read as
    :func:`fp8kv.reference.dequantize_pages` gives them), the largest ``|v|`` each row sees and
    ``max_t sum_d |q_d k_td| * softmax_scale`` (for :func:`error_bound`). ``kv_cache`` replaces
    both caches (combined)."""
    q = np.asarray(query).astype(np.float64)
    lens = np.asarray(seq_lens).astype(np.int64)
    num_tokens, num_heads, d = q.shape
    if layer is not None:   # stacked caches: one layer's; out of range, no sequence has tokens
        stacked = kv_cache if kv_cache is not None else key_cache
        if not 0 <= int(layer) < np.shape(stacked)[0]:
            lens = np.zeros_like(lens)
            layer = 0

        def pick(a):
            return a if a is None or isinstance(a, str) else np.asarray(a)[int(layer)]
        key_cache, value_cache, kv_cache = pick(key_cache), pick(value_cache), pick(kv_cache)
        key_scale_cache, value_scale_cache = pick(key_scale_cache), pick(value_scale_cache)
    sides = []
    for cache, scale, sc, half in ((key_cache, key_scale, key_scale_cache, 0),
                                   (value_cache, value_scale, value_scale_cache, 1)):
        src = cache if kv_cache is None else np.asarray(kv_cache)[:, half]
        sides.append(_values(src, block_table, scale, sc, layout, cache_format,
                             head_dim).astype(np.float64))
    keys, values = sides
    num_kv = keys.shape[2]
    group = num_heads // num_kv
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else float(softmax_scale)
    starts = (np.arange(len(lens) + 1) if query_start_loc is None
              else np.asarray(query_start_loc).astype(np.int64))
    out = np.zeros((num_tokens, num_heads, d))
    vmax = np.zeros((num_tokens, num_heads, 1))
    mass = np.zeros((num_tokens, num_heads, 1))
    sink = None if sinks is None else np.asarray(sinks).astype(np.float64)
    for b, n in enumerate(lens):
        q_len = int(starts[b + 1] - starts[b])
        for i in range(q_len):
            tok = int(starts[b]) + i
            pos = int(n) - q_len + i
            lo = 0 if sliding_window is None else max(0, pos - int(sliding_window) + 1)
            seen = slice(lo, pos + 1)
            for hq in range(num_heads):
                h = hq // group
                k, v = keys[b, seen, h], values[b, seen, h]
                if k.shape[0] == 0 and sink is None:
                    continue
                s = (k @ q[tok, hq]) * scale
                if logits_soft_cap is not None:
                    s = logits_soft_cap * np.tanh(s / logits_soft_cap)
                top = max(s.max(initial=-np.inf), -np.inf if sink is None else sink[hq])
                p = np.exp(s - top)
                den = p.sum() + (0.0 if sink is None else math.exp(sink[hq] - top))
                out[tok, hq] = 0.0 if den == 0 else (p @ v) / den   # NaN stays NaN
                vmax[tok, hq] = np.abs(v).max(initial=0.0)
                mass[tok, hq] = (np.abs(k) @ np.abs(q[tok, hq])).max(initial=0.0) * scale
    return out, vmax, mass


def error_bound(ref_out, vmax, mass, head_dim: int) -> np.ndarray:
    """The spec's bound on ``|out - ref_out|`` (docs/SPEC.md section 16.3)."""
    delta = head_dim * 2.0 ** -24 * mass
    return 2.0 ** -8 * (np.abs(ref_out) + vmax) + np.expm1(2 * delta) * vmax


# ---------------------------------------------------------------------------------------------
# The op table's entry (fp8kv.optable).

OP = Op(
    "paged_attention",
    (Arg("query", Role.INPUT, "queries [num_tokens, num_heads, head_dim]", dims="t H d"),
     *caches(updated=False),
     Arg("block_table", Role.INPUT, "each sequence's pages", dims="b q"),
     Arg("seq_lens", Role.INPUT, "each sequence's tokens in the cache", dims="b"),
     *scales("key", "value"),
     Arg("query_start_loc", Role.INPUT, "each sequence's first query row", optional=True,
         dims="B"),
     option("softmax_scale", "the scores' scale (default 1 / sqrt(head_dim))",
            Optional[float]),
     option("sliding_window", "the tokens a query sees", Optional[int]),
     option("logits_soft_cap", "cap * tanh(score / cap)", Optional[float]),
     Arg("sinks", Role.INPUT, "one sink logit per query head", optional=True, dims="H"),
     *sides(updated=False), CACHE_FORMAT, LAYOUT,
     option("head_dim", "the data columns of an inline cache", Optional[int]), LAYER,
     option("max_query_len", "the longest query (sizes the launch)", Optional[int]),
     CHECK_BOUNDS,
     Arg("out", Role.OUTPUT, "the attention output", optional=True, made=True, dims="t H d",
         frontends=(TORCH,), result="out", contiguous=True)),
    check_attention, attention_bounds, lambda args: {"out": (args.out_shape, args.out_dtype)},
    lambda args: args.num_tokens == 0, attention_operands,
    from_shapes(plan_attention), returns=("out",), splits=("h",),
    reads=("seq_lens", "query_start_loc", "layer"), workspace=WORKSPACE)
