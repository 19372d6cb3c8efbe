"""Fused quantize + scatter of new K/V rows into a paged cache (one launch for K and V).

Grid: ``(cdiv(num_tokens, BLOCK_T), cdiv(NUM_HEADS * HEAD_DIM, ROW_CHUNK))``. A program owns
``BLOCK_T`` tokens and walks one ``ROW_CHUNK``-column chunk of their ``NUM_HEADS * HEAD_DIM`` row
(the whole row unless the plan splits a small batch's rows over several programs: more SMs for a
few tokens) in ``BLOCK_HD`` columns at a time, K and V together so that both loads are in flight
before the stores. Slots below zero (padding) or past the cache are skipped. Offsets
are int32, or int64 (``TILE.OFFSETS_64``) where the plan finds an array reaching past 2**31
elements (:func:`fp8kv.write.offsets_64`). The numpy twin is :func:`fp8kv.reference.write_kv`;
:func:`fp8kv.write.plan_write` names every argument and :func:`fp8kv.write.write_operands` says
which array each pointer takes.

Parameters follow jax-triton's order -- input arrays, scalars, outputs, constexprs -- and are bound
by name (:mod:`fp8kv.binding`). Only what changes between calls of one layout is a runtime
scalar; the layout is in the constexpr records (:mod:`fp8kv.constexprs`): ``CACHE`` (the caches'
geometry, format, strides and scaling), ``ROWS`` (the new rows' strides) and ``TILE``. A cache is
an input (``*_cache_ptr``, for JAX's aliasing) and an output (``*_cache_out_ptr``, written). A
combined ``[num_pages, 2, ...]`` cache is passed as both caches, V ``CACHE.VALUE.CODES.OFFSET``
elements in, and written through the K output pointer (``CACHE.COMBINED``), for frontends that
give each buffer one output (jax-triton). Stacked caches move the output pointers to the call's
layer first (:mod:`fp8kv.ops.addressing`).

A side whose dynamic kind is not NONE (dynamic scales, per token or per token-head) takes the
other path: its ``[BLOCK_T, BLOCK_H, BLOCK_D]`` tile of whole rows is loaded (:func:`_load_rows`;
both sides before the first amax with ``TILE.DYNAMIC_LOADS_FIRST``), then quantized and stored
(:func:`_write_dynamic`), the amax a reduction over the head's dims (and, per token, over the
heads). Each scale goes to ``*_scale_out_ptr`` (a side array, bound to the same buffer as
``*_scale_ptr``) or, with ``CACHE.INLINE_PAD``, as 4 little-endian bytes (then zeros up to the
pad) right after the head's ``HEAD_DIM`` codes in the cache row. A dynamic side is compiled out
of the static-scale loop.
"""
import triton.language as tl

from ._dual import jit
from .addressing import (LAYER_NONE, at_layer, cache_bytes, row_columns, select_layer,
                         slot_rows, token_slots)
from .codec import (SCALE_BLOCK, SCALE_HEAD, SCALE_NONE, SCALE_TENSOR, SCALE_TOKEN,
                    SCALE_TOKEN_HEAD, SCALE_VALUE, divide_by_group_scale, divide_pair,
                    dynamic_scale, encode, load_as_fp32, load_raw, load_scale, max_combine,
                    mxfp8_block_scales, mxfp8_quotient, raw_to_fp32, scalar_scale)


@jit
def _load_rows(x_ptr, row, in_range, STRIDE_HEAD: tl.constexpr, NUM_HEADS: tl.constexpr,
               HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
               EXACT: tl.constexpr):
    """The ``[BLOCK_T, BLOCK_H, BLOCK_D]`` (token, head, dim) tile of whole rows of one side, as
    stored (converted to fp32 by :func:`_write_dynamic`: fewer registers while both sides' loads
    are in flight); ``row``: each token's row offset."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hd_mask = (h < NUM_HEADS)[:, None] & (d < HEAD_DIM)[None, :]
    col = (h * STRIDE_HEAD)[:, None] + d[None, :]
    return load_raw(x_ptr, row[:, None, None] + col[None, :, :],
                    in_range[:, None, None] & hd_mask[None, :, :], EXACT)


@jit
def _write_dynamic(raw, dst, row, scale_dst, scale_row, keep, SIDE: tl.constexpr,
                   CACHE: tl.constexpr, NUM_HEADS: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr, EXACT: tl.constexpr):
    """Quantize one side's tile ``raw`` (:func:`_load_rows`) with its dynamic scales
    (``SIDE.DYNAMIC``: TOKEN, TOKEN_HEAD, or BLOCK: mxfp8's E8M0 scale per block of a head row,
    :func:`codec.mxfp8_block_scales`) and store codes and scales: the amax a reduction over the
    dims (the block's, or also the heads' per token), one store -- no loop over heads.
    ``row``/``scale_row``: each token's cache row / scale offset; ``NUM_HEADS``: the tile's
    heads."""
    KIND: tl.constexpr = SIDE.DYNAMIC
    FMT: tl.constexpr = CACHE.FMT
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = h < NUM_HEADS
    hd_mask = h_mask[:, None] & (d < CACHE.HEAD_DIM)[None, :]
    x = raw_to_fp32(raw, EXACT)
    if KIND == SCALE_BLOCK:
        # Block scales (mxfp8): one E8M0 code per BLOCK_SIZE columns of a head row; BLOCK_D, a
        # power of two >= HEAD_DIM (a multiple of BLOCK_SIZE), holds whole blocks.
        BLOCK: tl.constexpr = FMT.BLOCK_SIZE
        xb = tl.reshape(x, (x.shape[0], BLOCK_H, BLOCK_D // BLOCK, BLOCK))
        e, r = mxfp8_block_scales(xb)
        q = mxfp8_quotient(xb, e[:, :, :, None], r, EXACT)
        q = encode(tl.reshape(q, (x.shape[0], BLOCK_H, BLOCK_D)), FMT, EXACT)
    else:
        a = tl.abs(x)
        if EXACT:
            # The interpreter's maximum propagates NaN; the GPU's max.f32 drops it (max_combine).
            a = tl.where(x != x, 0.0, a)
        amax = tl.reduce(a, 2, max_combine)                                   # [T, H]
        if KIND == SCALE_TOKEN:
            amax = tl.reduce(amax, 1, max_combine)                            # [T]
        s = dynamic_scale(tl.where(amax != amax, 0.0, amax), FMT, CACHE.SCALE_POW2,
                          EXACT)  # all-NaN: 0
        s_x = s[:, None, None] if KIND == SCALE_TOKEN else s[:, :, None]
        if CACHE.SCALE_POW2:
            # s is a power of two (or inf): RN(1/s) is exact, so x * (1/s) is RN(x / s).
            q = x * tl.math.div_rn(tl.full(s_x.shape, 1.0, tl.float32), s_x)
        elif EXACT:
            q = tl.math.div_rn(x, s_x)
        else:
            q = divide_by_group_scale(x, s_x)
        q = encode(q, FMT, EXACT)
    # Side scales are stored with evict_last: a token's scales are 4-32 bytes at a random slot,
    # and held in L2 they merge with their neighbours' into whole lines instead of each costing
    # DRAM a scattered write amid the streamed codes. They are a small fraction of the traffic:
    # L2 keeps its room for the rest.
    if KIND == SCALE_TOKEN:
        tl.store(scale_dst + scale_row, s, mask=keep, eviction_policy="evict_last")
    c_head = h * SIDE.CODES.HEAD
    tl.store(dst + (row[:, None, None] + (c_head[:, None] + d[None, :])[None, :, :]),
             q.to(tl.uint8), mask=keep[:, None, None] & hd_mask[None, :, :])
    if KIND == SCALE_BLOCK:
        b = tl.arange(0, BLOCK_D // FMT.BLOCK_SIZE)
        tl.store(scale_dst + (scale_row[:, None, None] + (h * SIDE.SCALES.HEAD)[None, :, None]
                              + b[None, None, :]), e.to(tl.uint8),
                 mask=(keep[:, None] & h_mask[None, :])[:, :, None]
                 & (b < CACHE.HEAD_DIM // FMT.BLOCK_SIZE)[None, None, :],
                 eviction_policy="evict_last")
    if KIND == SCALE_TOKEN_HEAD:
        store_head_scales(s, dst, row, c_head, scale_dst, scale_row, h * SIDE.SCALES.HEAD,
                          keep[:, None] & h_mask[None, :], HEAD_DIM=CACHE.HEAD_DIM,
                          INLINE_PAD=CACHE.INLINE_PAD)


@jit
def store_head_scales(s, dst, row, head_off, scale_dst, scale_row, scale_head_off, mask,
                      HEAD_DIM: tl.constexpr, INLINE_PAD: tl.constexpr):
    """Store per-token-head scales ``s`` ``[T, H]`` (where ``mask``): with ``INLINE_PAD``, as 4
    little-endian bytes (then zeros up to ``INLINE_PAD``) right after each head's ``HEAD_DIM``
    codes in the cache row (``dst + row + head_off``), else into the side array
    (``scale_dst + scale_row + scale_head_off``)."""
    if INLINE_PAD > 0:
        j = tl.arange(0, INLINE_PAD)
        bits = s.to(tl.int32, bitcast=True)   # s > 0: no sign bit to smear
        byte = tl.where(j[None, None, :] < 4,
                        (bits[:, :, None] >> ((8 * j) & 31)[None, None, :]) & 0xFF, 0)
        tl.store(dst + (row[:, None, None] + (head_off + HEAD_DIM)[None, :, None]
                        + j[None, None, :]), byte.to(tl.uint8), mask=mask[:, :, None])
    else:
        tl.store(scale_dst + (scale_row[:, None] + scale_head_off[None, :]), s, mask=mask,
                 eviction_policy="evict_last")


@jit(do_not_specialize=["num_tokens", "layer"])
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, key_scale_ptr, value_scale_ptr,
    layer_ptr,
    num_tokens, num_slots, key_scale_value, value_scale_value, layer,
    key_cache_out_ptr, value_cache_out_ptr, key_scale_out_ptr, value_scale_out_ptr,
    CACHE: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr, EXACT: tl.constexpr,
):
    KEY: tl.constexpr = CACHE.KEY
    VALUE: tl.constexpr = CACHE.VALUE
    FMT: tl.constexpr = CACHE.FMT
    if CACHE.LAYER_KIND != LAYER_NONE:   # stacked caches: this call's layer
        layer, num_slots = select_layer(layer_ptr, layer, num_slots, KIND=CACHE.LAYER_KIND,
                                        NUM_LAYERS=CACHE.NUM_LAYERS)
        key_cache_out_ptr = at_layer(key_cache_out_ptr, layer, KEY, False)
        if not CACHE.COMBINED:
            value_cache_out_ptr = at_layer(value_cache_out_ptr, layer, VALUE, False)
        if KEY.SCALES.LAYER != 0:
            key_scale_out_ptr = at_layer(key_scale_out_ptr, layer, KEY, True)
        if VALUE.SCALES.LAYER != 0:
            value_scale_out_ptr = at_layer(value_scale_out_ptr, layer, VALUE, True)
    tok, in_range, keep, page, off = token_slots(slot_ptr, num_tokens, num_slots,
                                                 BLOCK_T=TILE.BLOCK_T, PAGE_SIZE=CACHE.PAGE_SIZE,
                                                 OFFSETS_64=TILE.OFFSETS_64)
    key_dst, value_dst = cache_bytes(key_cache_out_ptr, value_cache_out_ptr, CACHE.COMBINED)
    key_row, key_scale_row = slot_rows(page, off, KEY)
    value_row, value_scale_row = slot_rows(page, off, VALUE)
    key_in = tok * ROWS.KEY.TOKEN
    value_in = tok * ROWS.VALUE.TOKEN
    K_STATIC: tl.constexpr = KEY.DYNAMIC == SCALE_NONE
    V_STATIC: tl.constexpr = VALUE.DYNAMIC == SCALE_NONE
    # DYNAMIC_LOADS_FIRST: both sides' loads are in flight before K's amax waits on them (the
    # plan says when that pays: it holds both tiles in registers).
    if not K_STATIC:
        xk = _load_rows(key_ptr, key_in, in_range, STRIDE_HEAD=ROWS.KEY.HEAD,
                        NUM_HEADS=CACHE.NUM_HEADS, HEAD_DIM=CACHE.HEAD_DIM, BLOCK_H=TILE.BLOCK_H,
                        BLOCK_D=TILE.BLOCK_D, EXACT=EXACT)
    if TILE.DYNAMIC_LOADS_FIRST:
        xv = _load_rows(value_ptr, value_in, in_range, STRIDE_HEAD=ROWS.VALUE.HEAD,
                        NUM_HEADS=CACHE.NUM_HEADS, HEAD_DIM=CACHE.HEAD_DIM, BLOCK_H=TILE.BLOCK_H,
                        BLOCK_D=TILE.BLOCK_D, EXACT=EXACT)
    if not K_STATIC:
        _write_dynamic(xk, key_dst, key_row, key_scale_out_ptr, key_scale_row, keep, SIDE=KEY,
                       CACHE=CACHE, NUM_HEADS=CACHE.NUM_HEADS, BLOCK_H=TILE.BLOCK_H,
                       BLOCK_D=TILE.BLOCK_D, EXACT=EXACT)
    if not V_STATIC:
        if not TILE.DYNAMIC_LOADS_FIRST:
            xv = _load_rows(value_ptr, value_in, in_range, STRIDE_HEAD=ROWS.VALUE.HEAD,
                            NUM_HEADS=CACHE.NUM_HEADS, HEAD_DIM=CACHE.HEAD_DIM,
                            BLOCK_H=TILE.BLOCK_H, BLOCK_D=TILE.BLOCK_D, EXACT=EXACT)
        _write_dynamic(xv, value_dst, value_row, value_scale_out_ptr, value_scale_row, keep,
                       SIDE=VALUE, CACHE=CACHE, NUM_HEADS=CACHE.NUM_HEADS, BLOCK_H=TILE.BLOCK_H,
                       BLOCK_D=TILE.BLOCK_D, EXACT=EXACT)
    # One scale per side: loaded before the rows, see scalar_scale.
    k_s = scalar_scale(key_scale_ptr, key_scale_value, KEY.STATIC)
    v_s = scalar_scale(value_scale_ptr, value_scale_value, VALUE.STATIC)
    K_ONE: tl.constexpr = K_STATIC and (KEY.STATIC == SCALE_VALUE or KEY.STATIC == SCALE_TENSOR)
    V_ONE: tl.constexpr = V_STATIC and (VALUE.STATIC == SCALE_VALUE
                                        or VALUE.STATIC == SCALE_TENSOR)
    ROW: tl.constexpr = CACHE.NUM_HEADS * CACHE.HEAD_DIM
    # This program's chunk of the row (grid axis 1; one chunk, the whole row, unless the plan
    # splits the rows of a small static-scale batch -- never a dynamic one, whose scales need
    # whole rows). A multiple of BLOCK_HD, so the tiles below cover the chunk exactly.
    chunk_start = tl.program_id(1) * TILE.ROW_CHUNK
    END: tl.constexpr = TILE.ROW_CHUNK if K_STATIC or V_STATIC else 0
    STEP: tl.constexpr = TILE.BLOCK_HD
    for start in tl.static_range(0, END, STEP):
        col = chunk_start + start + tl.arange(0, TILE.BLOCK_HD)
        col_mask = col < ROW
        head = col // CACHE.HEAD_DIM
        # Loads do not wait for the slots (one DRAM round trip instead of two for small batches);
        # only the stores are masked by them.
        load_mask = in_range[:, None] & col_mask[None, :]
        mask = keep[:, None] & col_mask[None, :]
        if K_STATIC:
            xk = load_as_fp32(key_ptr, key_in[:, None] + row_columns(
                col, CACHE.HEAD_DIM, ROWS.KEY.HEAD, ROWS.KEY.PACKED)[None, :], load_mask, EXACT)
        if V_STATIC:
            xv = load_as_fp32(value_ptr, value_in[:, None] + row_columns(
                col, CACHE.HEAD_DIM, ROWS.VALUE.HEAD, ROWS.VALUE.PACKED)[None, :], load_mask,
                EXACT)
        # A scale per head: per column. One scale per side: both sides' divisions in one step.
        if K_STATIC and KEY.STATIC == SCALE_HEAD:
            xk = tl.math.div_rn(xk, load_scale(key_scale_ptr, key_scale_value, head, col_mask,
                                               KEY.STATIC)[None, :])
        if V_STATIC and VALUE.STATIC == SCALE_HEAD:
            xv = tl.math.div_rn(xv, load_scale(value_scale_ptr, value_scale_value, head,
                                               col_mask, VALUE.STATIC)[None, :])
        xk, xv = divide_pair(xk, k_s, xv, v_s, K_ON=K_ONE, V_ON=V_ONE, EXACT=EXACT,
                             RECIPROCAL=TILE.RECIPROCAL_DIV)
        if K_STATIC:
            qk = encode(xk, FMT, EXACT).to(tl.uint8)
        if V_STATIC:
            qv = encode(xv, FMT, EXACT).to(tl.uint8)
        if K_STATIC:
            tl.store(key_dst + (key_row[:, None] + row_columns(
                col, CACHE.HEAD_DIM, KEY.CODES.HEAD, TILE.CACHE_PACKED)[None, :]), qk, mask=mask)
        if V_STATIC:
            tl.store(value_dst + (value_row[:, None] + row_columns(
                col, CACHE.HEAD_DIM, VALUE.CODES.HEAD, TILE.CACHE_PACKED)[None, :]), qv,
                mask=mask)
