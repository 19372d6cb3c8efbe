"""``rope_write_kv`` / ``rope_write_kv_combined``: the checks, the launch plan and the operand
map of ``_rope_write_kv_kernel`` (:mod:`fp8kv.ops.rope_write_kv`). The rule is docs/SPEC.md
section 12; the reference :func:`fp8kv.reference.rope_write_kv`; the table entry
``ROPE_WRITE_KV`` (:mod:`fp8kv.optable`).

The K/V write is checked by :func:`fp8kv.write.check_write` itself (same errors as
``write_kv``); the checks here add the query, the positions, the cos/sin cache, the RoPE options
and the outputs.

Plan: grid ``(cdiv(num_tokens, BLOCK_T), HEAD_GROUPS)``. A program owns ``BLOCK_T`` tokens and
one group of ``KV_HEADS`` kv heads with their ``KV_HEADS * Hq / Hkv`` query heads (all heads when
``HEAD_GROUPS`` is 1): it loads each token's cos/sin once for all of them. The size table
:data:`ROPE_SIZES` holds every choice the GPU measurements make (``python -m bench --only rope``
times the small-batch entries side by side).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numpy as np
import triton

from .arrays import ArrayInfo, fmt_shape
from .constexprs import Rope, RopeRows, RopeTile
from .formats import E4M3, FORMAT_OF_DTYPE, FORMATS, FP8_FORMATS, INPUT_DTYPES, SLOT_DTYPES, Format
from .modes import OUT_KIND_OF_DTYPE, Division, ScaleKind, SideScale
from .operands import Operand, OperandMap, caches_of, scale_input
from .optable import (CHECK_BOUNDS, FP8_FORMAT, JAX, KEY_VALUE, LAYOUT, SCALE_ROUNDING, SLOTS,
                      TORCH, Arg, Op, Role, caches, from_shapes, option, scales, sides)
from .plan import (CUDA, INT32_REACH, INTERPRET, LaunchPlan, cache_record, exact_for, kv_reach,
                   token_rows)
from .validate import (ROPE_STYLES, check_choice, check_contiguous, check_dtype,
                       check_nonnegative_strides, check_out, check_same_device, check_scalar_scale,
                       check_slots_in_range, check_unit_last_stride, named_caches)
from .write import WRITE_PLACEHOLDER, WriteArgs, check_write, write_operands

COS_SIN_DTYPES = ("float32", "bfloat16", "float16")
QUERY_FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2", "uint8")


@dataclass(frozen=True)
class RopeWriteArgs:
    """A validated ``rope_write_kv`` / ``rope_write_kv_combined`` call: the K/V write, plus what
    the RoPE and the query take; what the plan and the operand map are made from.

    ``query_out``: the given output, or the contiguous one the frontend makes
    (``query_out_given`` False); ``query_format``: the FP8 format of its codes, None for a
    16-bit / fp32 output. ``key_out``: the rotated key's output, None when not written;
    ``key_out_given`` False for one the frontend makes (JAX's ``return_key``).
    """

    write: WriteArgs
    query: ArrayInfo
    positions: ArrayInfo
    cos_sin_cache: ArrayInfo
    rotary_dim: int
    gptj: bool
    query_scale: SideScale
    query_format: Format | None
    query_out: ArrayInfo
    query_out_given: bool
    key_out: ArrayInfo | None
    key_out_given: bool

    @property
    def num_tokens(self) -> int:
        return self.write.num_tokens

    @property
    def max_position(self) -> int:
        return self.cos_sin_cache.shape[0]

    @property
    def combined(self) -> bool:
        return self.write.combined


def check_rotary_dim(rotary_dim, cos_sin_cache: ArrayInfo, head_dim: int) -> int:
    """``R``: the cos/sin cache's width, even, in ``[2, head_dim]``, equal to ``rotary_dim`` if
    given."""
    if rotary_dim is not None and (isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int)):
        raise TypeError(f"rotary_dim: expected None or an int, got {type(rotary_dim).__name__}")
    # rotary_dim's own rule first: with a wrong rotary_dim, the cache's width is not the mistake.
    if rotary_dim is not None and (rotary_dim % 2 or not 2 <= rotary_dim <= head_dim):
        raise ValueError(f"rotary_dim: expected an even int in [2, {head_dim}] (head_dim), got "
                         f"{rotary_dim}")
    width = cos_sin_cache.shape[1]
    if rotary_dim is not None and rotary_dim != width:
        raise ValueError(f"cos_sin_cache: expected rotary_dim={rotary_dim} columns (cos then sin), "
                         f"got shape {fmt_shape(cos_sin_cache.shape)}")
    if width % 2 or not 2 <= width <= head_dim:
        raise ValueError(f"cos_sin_cache: expected an even number of columns (rotary_dim) in "
                         f"[2, {head_dim}] (head_dim), got shape {fmt_shape(cos_sin_cache.shape)}")
    return width


def _check_output(out, name: str, shape, dtypes, device: str, array_type: type) -> None:
    if not isinstance(out, array_type):
        raise TypeError(f"{name}: expected None or an array, got {type(out).__name__}")
    check_out(out, name, shape, dtypes, device)


def check_rope_write(query, key, value, key_cache=None, value_cache=None, slots=None,
                     positions=None, cos_sin_cache=None, key_scale=None, value_scale=None, *,
                     rope_style, rotary_dim, query_scale, query_out, layout, fp8_format,
                     kv_cache=None, key_scale_cache=None, value_scale_cache=None,
                     scale_rounding="exact", key_out=None, return_key=False) -> RopeWriteArgs:
    """Validate ``rope_write_kv`` (or, with ``kv_cache``, ``rope_write_kv_combined``)
    arguments: :class:`~fp8kv.arrays.ArrayInfo` for arrays, the rest as given.

    ``key_out``: the given rotated-key output (torch) or None; ``return_key``: a new one is made
    (JAX). ``query_out`` None: the frontend makes one of the dtype found here.
    """
    style = check_choice(rope_style, "rope_style", ROPE_STYLES)
    device = check_same_device({"query": query, "key": key, "value": value,
                                **named_caches(key_cache, value_cache, kv_cache), "slots": slots,
                                "positions": positions, "cos_sin_cache": cos_sin_cache})
    check_dtype(query, "query", INPUT_DTYPES)
    if query.ndim != 3:
        raise ValueError(f"query: expected rank 3 [num_tokens, num_heads, head_dim], got shape "
                         f"{fmt_shape(query.shape)}")
    check_unit_last_stride(query, "query")
    if isinstance(fp8_format, str) and fp8_format in FORMATS and fp8_format not in FP8_FORMATS:
        # A block-scaled format: write_kv's cache_format names it; this op has none.
        names = ", ".join(repr(n) for n in FP8_FORMATS)
        raise ValueError(f"fp8_format: expected {names} or None (rope_write_kv writes the FP8 "
                         f"formats and takes no cache_format; write a {fp8_format} cache with "
                         f"write_kv(..., cache_format={fp8_format!r}) of the rotated key), got "
                         f"{fp8_format!r}")
    write = check_write(key, value, key_cache, value_cache, slots, key_scale, value_scale,
                        layout=layout, fp8_format=fp8_format, kv_cache=kv_cache,
                        key_scale_cache=key_scale_cache, value_scale_cache=value_scale_cache,
                        scale_rounding=scale_rounding)
    num_tokens, num_kv_heads, head_dim = key.shape
    if query.dtype != key.dtype:
        raise TypeError(f"query: expected the dtype of key ({key.dtype}), got {query.dtype}")
    tokens, num_heads, q_dim = query.shape
    if (tokens, q_dim) != (num_tokens, head_dim):
        raise ValueError(f"query: expected [{num_tokens}, num_heads, {head_dim}] (num_tokens and "
                         f"head_dim of key), got shape {fmt_shape(query.shape)}")
    if num_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"query: expected a number of heads that is a positive multiple of "
                         f"num_kv_heads={num_kv_heads}, got {num_heads}")
    check_dtype(positions, "positions", SLOT_DTYPES)
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions: expected shape [{num_tokens}] (one per token), got "
                         f"{fmt_shape(positions.shape)}")
    check_contiguous(positions, "positions")
    check_dtype(cos_sin_cache, "cos_sin_cache", COS_SIN_DTYPES)
    if cos_sin_cache.ndim != 2:
        raise ValueError(f"cos_sin_cache: expected rank 2 [max_position, rotary_dim], got shape "
                         f"{fmt_shape(cos_sin_cache.shape)}")
    check_unit_last_stride(cos_sin_cache, "cos_sin_cache")
    check_nonnegative_strides(cos_sin_cache, "cos_sin_cache")
    rotary = check_rotary_dim(rotary_dim, cos_sin_cache, head_dim)
    qs = check_scalar_scale(query_scale, "query_scale", device)
    fp8 = query_scale is not None
    array_type = type(query)
    if query_out is None:
        query_format = E4M3 if fp8 else None
        out = ArrayInfo.contiguous(query.shape, E4M3.dtype if fp8 else query.dtype, device)
    else:
        _check_output(query_out, "query_out", query.shape,
                      QUERY_FP8_DTYPES if fp8 else (query.dtype,), device, array_type)
        query_format = FORMAT_OF_DTYPE.get(query_out.dtype, E4M3) if fp8 else None
        out = query_out
    if key_out is not None:
        _check_output(key_out, "key_out", key.shape, (key.dtype,), device, array_type)
    elif return_key:
        key_out = ArrayInfo.contiguous(key.shape, key.dtype, device)
    return RopeWriteArgs(write, query, positions, cos_sin_cache, rotary, style == "gptj", qs,
                         query_format, out, query_out is not None, key_out,
                         key_out is not None and not return_key)


def check_positions_in_range(positions, max_position: int) -> None:
    """The opt-in bounds check of ``rope_write_kv``: every position names a row of the cos/sin
    cache. ``positions``: the values on the host (a NumPy array)."""
    values = np.asarray(positions)
    bad = np.flatnonzero((values < 0) | (values >= max_position))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"positions: expected every position in [0, {max_position}) (the rows "
                         f"of cos_sin_cache), got {bad.size} outside, the first positions[{i}] = "
                         f"{int(values[i])}")


def rope_bounds(args, read) -> None:
    check_positions_in_range(read("positions"), args.max_position)
    check_slots_in_range(read("slots"), args.write.key_cache.num_slots)


def rope_made(args) -> dict:
    made = {"query_out": (args.query.shape, args.query_out.dtype)}
    if args.key_out is not None:
        made["key_out"] = (args.write.key.shape, args.write.key.dtype)
    return made


# Per backend (bench/NOTES.md has the measurements behind each entry). Batches of up to
# `small_batch_tokens` tokens take the `small_*` entries, and of up to `tiny_batch_tokens`
# (`tiny_batch_tokens_dynamic` with dynamic K/V scales, else `tiny_batch_tokens_fp8q` with an FP8
# query) the `tiny_*` ones (a decode step's few tokens: spread over more SMs).
# * block_t: tokens per program. The interpreter fits it to the batch, up to `tile` elements of
#   query per program (it runs one program at a time, ~ms each).
# * kv_heads_per_program: kv heads (with their query heads) per program; 0 means all of them (one
#   program per token block loads cos/sin once for every head). Fewer heads give a token several
#   programs: more loads in flight for a tiny batch, cos/sin read once per program. Per-token
#   dynamic scales need every kv head of a token in one program (their amax): they always take 0.
# * q_tile: query elements per step of the program's loop over its query heads (registers);
#   fp8q_q_tile with an FP8 query (its fp64 division holds twice the registers per element).
# * v_tile: value elements per step of the static-scale V loop (as write_kv's tile).
# * num_warps; reciprocal_div / fp8q_reciprocal_div (with an FP8 query, whose 4x more
#   divisions make the per-element cost count): how a batch divides by a per-tensor scale (a
#   fp8kv.modes.Division, exact either way: fp8kv.ops.codec.divide), as write_kv does.
ROPE_SIZES = {
    CUDA: dict(block_t=1, kv_heads_per_program=0, q_tile=4096, fp8q_q_tile=1024, v_tile=1024,
               num_warps=4, reciprocal_div=Division.DIV_RN, fp8q_reciprocal_div=Division.FP64,
               small_batch_tokens=256, small_block_t=1, small_kv_heads_per_program=0,
               small_q_tile=4096, small_fp8q_q_tile=4096, small_batch_warps=4,
               small_reciprocal_div=Division.FMA, small_fp8q_reciprocal_div=Division.FP64,
               tiny_batch_tokens=64, tiny_batch_tokens_dynamic=16, tiny_batch_tokens_fp8q=256,
               tiny_block_t=1, tiny_kv_heads_per_program=2, tiny_q_tile=4096,
               tiny_fp8q_q_tile=4096, tiny_batch_warps=4, tiny_reciprocal_div=Division.DIV_RN,
               tiny_fp8q_reciprocal_div=Division.FP64),
    INTERPRET: dict(block_t=0, kv_heads_per_program=0, q_tile=1 << 16, fp8q_q_tile=1 << 16,
                    v_tile=1 << 16, num_warps=1, reciprocal_div=Division.DIV_RN,
                    fp8q_reciprocal_div=Division.DIV_RN, small_batch_tokens=0, small_block_t=0,
                    small_kv_heads_per_program=0, small_q_tile=1 << 16,
                    small_fp8q_q_tile=1 << 16, small_batch_warps=1,
                    small_reciprocal_div=Division.DIV_RN, small_fp8q_reciprocal_div=Division.DIV_RN,
                    tiny_batch_tokens=0, tiny_batch_tokens_dynamic=0, tiny_batch_tokens_fp8q=0,
                    tiny_block_t=0, tiny_kv_heads_per_program=0, tiny_q_tile=1 << 16,
                    tiny_fp8q_q_tile=1 << 16, tiny_batch_warps=1,
                    tiny_reciprocal_div=Division.DIV_RN, tiny_fp8q_reciprocal_div=Division.DIV_RN,
                    tile=1 << 16),
}


def _kv_heads_per_program(num_heads: int, want: int) -> int:
    """The largest divisor of ``num_heads`` that is at most ``want`` (0: all heads)."""
    if want <= 0 or want >= num_heads:
        return num_heads
    return max(d for d in range(1, want + 1) if num_heads % d == 0)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


def rope_offsets_64(args: RopeWriteArgs, tokens: int, block_heads: int, block_cols: int,
                    block_hd: int) -> bool:
    """Whether some element offset the kernel forms -- masked lanes included: ``tokens`` (the
    grid's), up to ``block_heads`` heads or ``block_hd`` columns past a program's first head,
    ``block_cols`` columns of a row -- may exceed :data:`fp8kv.plan.INT32_REACH`."""
    w = args.write
    kc = w.key_cache
    heads = max(block_heads, -(-block_hd // max(kc.head_dim, 1))) + max(args.query.shape[1],
                                                                         kc.num_heads)
    cols = max(block_cols, block_hd, kc.head_dim + w.inline_pad)
    arrays = [w.key, w.value, args.query, args.query_out] + (
        [args.key_out] if args.key_out is not None else [])
    reach = [(tokens - 1) * x.strides[0] + heads * x.strides[1] + cols for x in arrays]
    reach += kv_reach(w, heads, cols)
    cs = args.cos_sin_cache
    reach.append((args.max_position - 1) * cs.strides[0] + cols)
    return max(reach) > INT32_REACH


@functools.lru_cache(maxsize=4096)
def plan_rope_write(args: RopeWriteArgs, backend: str, exact: bool | None = None) -> LaunchPlan:
    """Plan ``_rope_write_kv_kernel``; ``exact`` forces (True) or forbids (False) the exact
    conversions."""
    sizes = ROPE_SIZES[backend]
    w = args.write
    kc, vc = w.key_cache, w.value_cache
    num_heads, head_dim = kc.num_heads, kc.head_dim
    q_heads = args.query.shape[1]
    group = q_heads // num_heads
    rotary = args.rotary_dim
    dynamic = w.key_scale.is_dynamic or w.value_scale.is_dynamic
    fp8q = "fp8q_" if args.query_format is not None else ""
    tiny = sizes["tiny_batch_tokens" + ("_dynamic" if dynamic else "_fp8q" if fp8q else "")]
    prefix = ("tiny_" if args.num_tokens <= tiny else
              "small_" if args.num_tokens <= sizes["small_batch_tokens"] else "")
    per_token = ScaleKind.TOKEN in (w.key_scale.dynamic, w.value_scale.dynamic)
    kv_heads = (num_heads if per_token
                else _kv_heads_per_program(num_heads, sizes[prefix + "kv_heads_per_program"]))
    q_per_program = kv_heads * group
    block_d = _pow2(head_dim)
    if backend == INTERPRET:  # no compile cost here: fit the tile to the batch
        block_t = max(1, min(_pow2(args.num_tokens), sizes["tile"] // (_pow2(q_per_program)
                                                                        * block_d)))
    else:
        block_t = sizes[prefix + "block_t"]
    block_hq = min(_pow2(q_per_program),
                   max(1, sizes[prefix + fp8q + "q_tile"] // (block_t * block_d)))
    block_vd = min(_pow2(kv_heads * head_dim), sizes["v_tile"])
    q, qo, key, value = args.query, args.query_out, w.key, w.value
    ko = args.key_out if args.key_out is not None else key
    scalars = dict(num_tokens=args.num_tokens, num_slots=kc.num_slots,
                   max_position=args.max_position, key_scale_value=float(w.key_scale.value),
                   value_scale_value=float(w.value_scale.value),
                   query_scale_value=float(args.query_scale.value))
    grid = (triton.cdiv(args.num_tokens, block_t), num_heads // kv_heads)
    q_fmt = args.query_format
    constexprs = dict(
        CACHE=cache_record(w, w.scale_pow2),
        ROWS=RopeRows(QUERY=token_rows(q, head_dim), QUERY_OUT=token_rows(qo, head_dim),
                      KEY=token_rows(key, head_dim), KEY_OUT=token_rows(ko, head_dim),
                      VALUE=token_rows(value, head_dim), COS_SIN=args.cos_sin_cache.strides[0]),
        ROPE=Rope(NUM_Q_HEADS=q_heads, ROTARY_DIM=rotary, GPTJ=args.gptj,
                  Q_FMT=None if q_fmt is None else q_fmt.codec, Q_SCALE=args.query_scale.kind.id,
                  Q_OUT_KIND=int(OUT_KIND_OF_DTYPE[args.query.dtype]),
                  KEY_OUT=args.key_out is not None),
        TILE=RopeTile(
            BLOCK_T=block_t, KV_HEADS=kv_heads, BLOCK_H=_pow2(kv_heads), BLOCK_HQ=block_hq,
            BLOCK_D=block_d, BLOCK_HALF=_pow2(rotary // 2),
            BLOCK_PASS=_pow2(head_dim - rotary) if head_dim > rotary else 0, BLOCK_VD=block_vd,
            CACHE_PACKED=kc.packed_rows and vc.packed_rows,
            RECIPROCAL_DIV=int(sizes[prefix + fp8q + "reciprocal_div"]),
            OFFSETS_64=rope_offsets_64(args, grid[0] * block_t, max(_pow2(kv_heads), block_hq),
                                       block_d, block_vd)),
        EXACT=exact_for(backend, exact))
    num_warps = sizes[prefix + "batch_warps" if prefix else "num_warps"]
    return LaunchPlan(grid, num_warps, scalars, constexprs, kernel="_rope_write_kv_kernel")


def rope_write_operands(args) -> OperandMap:
    """``_rope_write_kv_kernel``'s arrays for a validated
    :class:`fp8kv.rope_write.RopeWriteArgs`: the K/V write's, plus the query, positions,
    cos/sin cache and query scale, and the outputs ``query_out`` and ``key_out``.

    ``query_out_in_ptr`` / ``key_out_in_ptr`` are never read: they hold a given output's buffer
    as an input, so that the output can alias it (jax-triton's donation; torch passes the same
    tensor). An output the frontend makes (torch's allocated ``query_out``, JAX's new arrays) is
    a new output instead.
    """
    w = args.write
    kc, vc = caches_of(w.combined)

    def given_output(name: str, given: bool, used: bool = True):
        if not used:
            return (Operand(f"{name}_in_ptr", WRITE_PLACEHOLDER, used=False),
                    Operand(f"{name}_ptr", None, used=False))
        if given:
            return (Operand(f"{name}_in_ptr", name, used=False),
                    Operand(f"{name}_ptr", name, aliases=f"{name}_in_ptr"))
        return (Operand(f"{name}_in_ptr", WRITE_PLACEHOLDER, used=False),
                Operand(f"{name}_ptr", name))

    q_in, q_out = given_output("query_out", args.query_out_given)
    k_in, k_out = given_output("key_out", args.key_out_given, args.key_out is not None)
    qs = args.query_scale
    inputs = (Operand("query_ptr", "query"), Operand("key_ptr", "key"),
              Operand("value_ptr", "value"), Operand("key_cache_ptr", kc),
              Operand("value_cache_ptr", vc), Operand("slot_ptr", "slots"),
              Operand("position_ptr", "positions"), Operand("cos_sin_ptr", "cos_sin_cache"),
              Operand("query_scale_ptr", "query_scale") if qs.kind.on_device
              else Operand("query_scale_ptr", WRITE_PLACEHOLDER, used=False),
              scale_input("key", w.key_scale, WRITE_PLACEHOLDER),
              scale_input("value", w.value_scale, WRITE_PLACEHOLDER), q_in, k_in)
    write_outputs = write_operands(w).outputs
    return OperandMap(inputs, (q_out,) + write_outputs + (k_out,))


# ---------------------------------------------------------------------------------------------
# The op table's entry (fp8kv.optable).

OP = Op(
    "rope_write_kv",
    (Arg("query", Role.INPUT, "queries [num_tokens, num_heads, head_dim]", dims="t H d"),
     *KEY_VALUE, *caches(updated=True), SLOTS,
     Arg("positions", Role.INPUT, "each token's row of cos_sin_cache", dims="t"),
     Arg("cos_sin_cache", Role.INPUT, "cos and sin per position", dims="m r"),
     *scales("key", "value"),
     Arg("query_scale", Role.SCALE, "FP8 query codes' scale", optional=True, dims="any"),
     option("rope_style", "neox or gptj", str),
     option("rotary_dim", "the rotated columns", Optional[int]), LAYOUT, FP8_FORMAT,
     Arg("query_out", Role.OUTPUT, "the rotated query", optional=True, made=True, dims="t H d"),
     Arg("key_out", Role.OUTPUT, "the rotated key", optional=True, dims="t h d",
         frontends=(TORCH,)),
     option("return_key", "also return the rotated key", frontends=(JAX,)),
     *sides(updated=True), SCALE_ROUNDING, CHECK_BOUNDS),
    check_rope_write, rope_bounds, rope_made, lambda args: args.num_tokens == 0,
    rope_write_operands, from_shapes(plan_rope_write),
    returns=("query_out", "key_cache", "value_cache", "key_scale_cache", "value_scale_cache",
             "key_out"),
    splits=("h", "p"), reads=("positions", "slots"), paged="write")
