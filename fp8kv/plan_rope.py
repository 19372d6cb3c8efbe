"""Launch plan of ``_rope_write_kv_kernel`` (:mod:`fp8kv.ops.rope_write_kv`), from shapes alone.

Grid: ``(cdiv(num_tokens, BLOCK_T), HEAD_GROUPS)``. A program owns ``BLOCK_T`` tokens and one
group of ``KV_HEADS`` kv heads with their ``KV_HEADS * Hq / Hkv`` query heads (all heads when
``HEAD_GROUPS`` is 1): it loads each token's cos/sin once for all of them. The size table
:data:`ROPE_SIZES` holds every choice the GPU measurements make (``python -m bench --only rope``
times the small-batch entries side by side).
"""
from __future__ import annotations

import functools

import triton

from .constexprs import Rope, RopeRows, RopeTile
from .modes import OUT_KIND_OF_DTYPE, Division, ScaleKind
from .plan import CUDA, INT32_REACH, INTERPRET, LaunchPlan, _exact, _rows, cache_record
from .validate_rope import RopeWriteArgs

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
                    fp8q_reciprocal_div=Division.DIV_RN,
                    small_batch_tokens=0, small_block_t=0, small_kv_heads_per_program=0,
                    small_q_tile=1 << 16, small_fp8q_q_tile=1 << 16, small_batch_warps=1,
                    small_reciprocal_div=Division.DIV_RN,
                    small_fp8q_reciprocal_div=Division.DIV_RN,
                    tiny_batch_tokens=0, tiny_batch_tokens_dynamic=0, tiny_batch_tokens_fp8q=0,
                    tiny_block_t=0, tiny_kv_heads_per_program=0, tiny_q_tile=1 << 16,
                    tiny_fp8q_q_tile=1 << 16, tiny_batch_warps=1,
                    tiny_reciprocal_div=Division.DIV_RN,
                    tiny_fp8q_reciprocal_div=Division.DIV_RN, tile=1 << 16),
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
    for cache in (w.key_cache, w.value_cache):
        reach.append(cache.offset + (cache.num_pages - 1) * cache.stride_page
                     + (cache.page_size - 1) * cache.stride_slot + heads * cache.stride_head
                     + cols)
    for sc in (w.key_scale.stored, w.value_scale.stored):
        if sc is not None:
            reach.append((kc.num_pages - 1) * sc.stride_page + (kc.page_size - 1) * sc.stride_slot
                         + heads * sc.stride_head)
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
        ROWS=RopeRows(QUERY=_rows(q, head_dim), QUERY_OUT=_rows(qo, head_dim),
                      KEY=_rows(key, head_dim), KEY_OUT=_rows(ko, head_dim),
                      VALUE=_rows(value, head_dim), COS_SIN=args.cos_sin_cache.strides[0]),
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
        EXACT=_exact(backend, exact))
    num_warps = sizes[prefix + "batch_warps" if prefix else "num_warps"]
    return LaunchPlan(grid, num_warps, scalars, constexprs)
