"""Fused quantize + scatter of new K/V rows into a paged cache (one launch for K and V).

Grid: ``(cdiv(num_tokens, BLOCK_T), cdiv(NUM_HEADS * HEAD_DIM, ROW_CHUNK))``. A program owns
``BLOCK_T`` tokens and walks one ``ROW_CHUNK``-column chunk of their ``NUM_HEADS * HEAD_DIM`` row
(the whole row unless the plan splits a small batch's rows over several programs: more SMs for a
few tokens) in ``BLOCK_HD`` columns at a time, K and V together so that both loads are in flight
before the stores. Slots below zero (padding) or past the cache are skipped. Offsets
are int32, or int64 (``OFFSETS_64``) where the plan finds an array reaching past 2**31 elements
(:func:`fp8kv.plan.offsets_64`). The numpy twin is
:func:`fp8kv.reference.write_kv`; :func:`fp8kv.plan.plan_write` names every argument and
:func:`fp8kv.operands.write_operands` says which array each pointer takes.

Parameters follow jax-triton's order -- input arrays, scalars, outputs, constexprs -- and are bound
by name (:mod:`fp8kv.binding`). Only what changes between calls of one layout is a runtime
scalar; every stride is a constexpr (``STRIDE_<array>_<dim>``). A cache is an input
(``*_cache_ptr``, for JAX's aliasing) and an output (``*_cache_out_ptr``, written). A combined
``[num_pages, 2, ...]`` cache is passed as both caches, V ``VALUE_CACHE_OFFSET`` elements in; with
``SHARED_OUT`` V is written through the K output pointer, for frontends that give each buffer one
output (jax-triton). Stacked caches (``LAYER_KIND``) move the output pointers to the call's layer
first (:mod:`fp8kv.ops.layers`).

A side whose ``*_DYNAMIC`` kind is not NONE (dynamic scales, per token or per token-head) takes
the other path: its ``[BLOCK_T, BLOCK_H, BLOCK_D]`` tile of whole rows is loaded
(:func:`_load_rows`; both sides before the first amax with ``DYNAMIC_LOADS_FIRST``), then quantized
and stored (:func:`_write_dynamic`), the amax a reduction over the head's dims (and, per token,
over the heads). Each scale goes to ``*_scale_out_ptr`` (a side array, bound to the same buffer as
``*_scale_ptr``) or, with ``INLINE_PAD``, as 4 little-endian bytes (then zeros up to
``INLINE_PAD``) right after the head's ``HEAD_DIM`` codes in the cache row. A dynamic side is
compiled out of the static-scale loop.
"""
import triton.language as tl

from ._dual import jit
from .layers import LAYER_NONE, select_layer
from .slots import cache_bytes, token_rows
from .codec import (SCALE_HEAD, SCALE_NONE, SCALE_TENSOR, SCALE_TOKEN, SCALE_TOKEN_HEAD,
                    SCALE_VALUE, divide_by_group_scale, divide_pair, dynamic_scale, encode,
                    load_as_fp32, load_raw, load_scale, max_combine, raw_to_fp32, scalar_scale)


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
def _write_dynamic(raw, dst, row, scale_dst, scale_row, keep, KIND: tl.constexpr,
                   STRIDE_CACHE_HEAD: tl.constexpr, STRIDE_SCALE_HEAD: tl.constexpr,
                   NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr,
                   BLOCK_D: tl.constexpr, INLINE_PAD: tl.constexpr, FORMAT: tl.constexpr,
                   POW2: tl.constexpr, EXACT: tl.constexpr):
    """Quantize one side's tile ``raw`` (:func:`_load_rows`) with dynamic scales of ``KIND``
    (TOKEN or TOKEN_HEAD) and store codes and scales: the amax a reduction over the dims (and the
    heads, per token), one store -- no loop over heads. ``row``/``scale_row``: each token's cache
    row / scale offset."""
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    h_mask = h < NUM_HEADS
    hd_mask = h_mask[:, None] & (d < HEAD_DIM)[None, :]
    x = raw_to_fp32(raw, EXACT)
    a = tl.abs(x)
    if EXACT:
        # The interpreter's maximum propagates NaN; the GPU's max.f32 drops it (max_combine).
        a = tl.where(x != x, 0.0, a)
    amax = tl.reduce(a, 2, max_combine)                                       # [T, H]
    if KIND == SCALE_TOKEN:
        amax = tl.reduce(amax, 1, max_combine)                                # [T]
    s = dynamic_scale(tl.where(amax != amax, 0.0, amax), FORMAT, POW2, EXACT)  # all-NaN: 0
    s_x = s[:, None, None] if KIND == SCALE_TOKEN else s[:, :, None]
    if POW2:
        # s is a power of two (or inf): RN(1/s) is exact, so x * (1/s) is RN(x / s).
        q = x * tl.math.div_rn(tl.full(s_x.shape, 1.0, tl.float32), s_x)
    elif EXACT:
        q = tl.math.div_rn(x, s_x)
    else:
        q = divide_by_group_scale(x, s_x)
    q = encode(q, FORMAT, EXACT)
    # Side scales are stored with evict_last: a token's scales are 4-32 bytes at a random slot,
    # and held in L2 they merge with their neighbours' into whole lines instead of each costing
    # DRAM a scattered write amid the streamed codes (H200, 65,536 tokens: 108 -> 104 us;
    # bench/NOTES.md). They are a small fraction of the traffic: L2 keeps its room for the rest.
    if KIND == SCALE_TOKEN:
        tl.store(scale_dst + scale_row, s, mask=keep, eviction_policy="evict_last")
    c_head = h * STRIDE_CACHE_HEAD
    tl.store(dst + (row[:, None, None] + (c_head[:, None] + d[None, :])[None, :, :]),
             q.to(tl.uint8), mask=keep[:, None, None] & hd_mask[None, :, :])
    if KIND == SCALE_TOKEN_HEAD:
        store_head_scales(s, dst, row, c_head, scale_dst, scale_row, h * STRIDE_SCALE_HEAD,
                          keep[:, None] & h_mask[None, :], HEAD_DIM=HEAD_DIM,
                          INLINE_PAD=INLINE_PAD)


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
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    STRIDE_KEY_TOKEN: tl.constexpr, STRIDE_KEY_HEAD: tl.constexpr,
    STRIDE_VALUE_TOKEN: tl.constexpr, STRIDE_VALUE_HEAD: tl.constexpr,
    STRIDE_KC_PAGE: tl.constexpr, STRIDE_KC_SLOT: tl.constexpr, STRIDE_KC_HEAD: tl.constexpr,
    STRIDE_VC_PAGE: tl.constexpr, STRIDE_VC_SLOT: tl.constexpr, STRIDE_VC_HEAD: tl.constexpr,
    VALUE_CACHE_OFFSET: tl.constexpr,
    STRIDE_KSC_PAGE: tl.constexpr, STRIDE_KSC_SLOT: tl.constexpr, STRIDE_KSC_HEAD: tl.constexpr,
    STRIDE_VSC_PAGE: tl.constexpr, STRIDE_VSC_SLOT: tl.constexpr, STRIDE_VSC_HEAD: tl.constexpr,
    FORMAT: tl.constexpr, K_SCALE: tl.constexpr, K_DYNAMIC: tl.constexpr,
    V_SCALE: tl.constexpr, V_DYNAMIC: tl.constexpr, SCALE_POW2: tl.constexpr,
    INLINE_PAD: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
    ROW_CHUNK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KEY_PACKED: tl.constexpr,
    VALUE_PACKED: tl.constexpr, CACHE_PACKED: tl.constexpr, RECIPROCAL_DIV: tl.constexpr,
    DYNAMIC_LOADS_FIRST: tl.constexpr, SHARED_OUT: tl.constexpr, OFFSETS_64: tl.constexpr,
    EXACT: tl.constexpr, LAYER_KIND: tl.constexpr, NUM_LAYERS: tl.constexpr,
    STRIDE_KC_LAYER: tl.constexpr, STRIDE_VC_LAYER: tl.constexpr,
    STRIDE_KSC_LAYER: tl.constexpr, STRIDE_VSC_LAYER: tl.constexpr,
):
    if LAYER_KIND != LAYER_NONE:   # stacked caches: this call's layer (fp8kv.ops.layers)
        layer, num_slots = select_layer(layer_ptr, layer, num_slots, KIND=LAYER_KIND,
                                        NUM_LAYERS=NUM_LAYERS)
        key_cache_out_ptr += layer * STRIDE_KC_LAYER
        if not SHARED_OUT:
            value_cache_out_ptr += layer * STRIDE_VC_LAYER
        if STRIDE_KSC_LAYER != 0:
            key_scale_out_ptr += layer * STRIDE_KSC_LAYER
        if STRIDE_VSC_LAYER != 0:
            value_scale_out_ptr += layer * STRIDE_VSC_LAYER
    tok, in_range, keep, page, off = token_rows(slot_ptr, num_tokens, num_slots, BLOCK_T=BLOCK_T,
                                                PAGE_SIZE=PAGE_SIZE, OFFSETS_64=OFFSETS_64)
    key_dst, value_dst = cache_bytes(key_cache_out_ptr, value_cache_out_ptr, SHARED_OUT)
    key_row = page * STRIDE_KC_PAGE + off * STRIDE_KC_SLOT
    value_row = page * STRIDE_VC_PAGE + off * STRIDE_VC_SLOT + VALUE_CACHE_OFFSET
    key_in = tok * STRIDE_KEY_TOKEN
    value_in = tok * STRIDE_VALUE_TOKEN
    K_STATIC: tl.constexpr = K_DYNAMIC == SCALE_NONE
    V_STATIC: tl.constexpr = V_DYNAMIC == SCALE_NONE
    # DYNAMIC_LOADS_FIRST: both sides' loads are in flight before K's amax waits on them (the
    # plan says when that pays: it holds both tiles in registers).
    if not K_STATIC:
        xk = _load_rows(key_ptr, key_in, in_range, STRIDE_HEAD=STRIDE_KEY_HEAD,
                        NUM_HEADS=NUM_HEADS, HEAD_DIM=HEAD_DIM, BLOCK_H=BLOCK_H,
                        BLOCK_D=BLOCK_D, EXACT=EXACT)
    if DYNAMIC_LOADS_FIRST:
        xv = _load_rows(value_ptr, value_in, in_range, STRIDE_HEAD=STRIDE_VALUE_HEAD,
                        NUM_HEADS=NUM_HEADS, HEAD_DIM=HEAD_DIM, BLOCK_H=BLOCK_H,
                        BLOCK_D=BLOCK_D, EXACT=EXACT)
    if not K_STATIC:
        _write_dynamic(xk, key_dst, key_row, key_scale_out_ptr,
                       page * STRIDE_KSC_PAGE + off * STRIDE_KSC_SLOT, keep, KIND=K_DYNAMIC,
                       STRIDE_CACHE_HEAD=STRIDE_KC_HEAD, STRIDE_SCALE_HEAD=STRIDE_KSC_HEAD,
                       NUM_HEADS=NUM_HEADS, HEAD_DIM=HEAD_DIM, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D,
                       INLINE_PAD=INLINE_PAD, FORMAT=FORMAT, POW2=SCALE_POW2, EXACT=EXACT)
    if not V_STATIC:
        if not DYNAMIC_LOADS_FIRST:
            xv = _load_rows(value_ptr, value_in, in_range, STRIDE_HEAD=STRIDE_VALUE_HEAD,
                            NUM_HEADS=NUM_HEADS, HEAD_DIM=HEAD_DIM, BLOCK_H=BLOCK_H,
                            BLOCK_D=BLOCK_D, EXACT=EXACT)
        _write_dynamic(xv, value_dst, value_row, value_scale_out_ptr,
                       page * STRIDE_VSC_PAGE + off * STRIDE_VSC_SLOT, keep, KIND=V_DYNAMIC,
                       STRIDE_CACHE_HEAD=STRIDE_VC_HEAD, STRIDE_SCALE_HEAD=STRIDE_VSC_HEAD,
                       NUM_HEADS=NUM_HEADS, HEAD_DIM=HEAD_DIM, BLOCK_H=BLOCK_H, BLOCK_D=BLOCK_D,
                       INLINE_PAD=INLINE_PAD, FORMAT=FORMAT, POW2=SCALE_POW2, EXACT=EXACT)
    # One scale per side: loaded before the rows, see scalar_scale.
    k_s = scalar_scale(key_scale_ptr, key_scale_value, K_SCALE)
    v_s = scalar_scale(value_scale_ptr, value_scale_value, V_SCALE)
    K_ONE: tl.constexpr = K_STATIC and (K_SCALE == SCALE_VALUE or K_SCALE == SCALE_TENSOR)
    V_ONE: tl.constexpr = V_STATIC and (V_SCALE == SCALE_VALUE or V_SCALE == SCALE_TENSOR)
    ROW: tl.constexpr = NUM_HEADS * HEAD_DIM
    # This program's chunk of the row (grid axis 1; one chunk, the whole row, unless the plan
    # splits the rows of a small static-scale batch -- never a dynamic one, whose scales need
    # whole rows). A multiple of BLOCK_HD, so the tiles below cover the chunk exactly.
    chunk_start = tl.program_id(1) * ROW_CHUNK
    for start in tl.static_range(0, ROW_CHUNK if K_STATIC or V_STATIC else 0, BLOCK_HD):
        col = chunk_start + start + tl.arange(0, BLOCK_HD)
        col_mask = col < ROW
        head = col // HEAD_DIM
        dim = col % HEAD_DIM
        # Packed rows (head stride == HEAD_DIM) address by `col` alone, which keeps the
        # compiler's contiguity proof and so 16-byte accesses.
        k_col = col if KEY_PACKED else head * STRIDE_KEY_HEAD + dim
        v_col = col if VALUE_PACKED else head * STRIDE_VALUE_HEAD + dim
        kc_col = col if CACHE_PACKED else head * STRIDE_KC_HEAD + dim
        vc_col = col if CACHE_PACKED else head * STRIDE_VC_HEAD + dim
        # Loads do not wait for the slots (one DRAM round trip instead of two for small batches);
        # only the stores are masked by them.
        load_mask = in_range[:, None] & col_mask[None, :]
        mask = keep[:, None] & col_mask[None, :]
        if K_STATIC:
            xk = load_as_fp32(key_ptr, key_in[:, None] + k_col[None, :], load_mask, EXACT)
        if V_STATIC:
            xv = load_as_fp32(value_ptr, value_in[:, None] + v_col[None, :], load_mask, EXACT)
        # A scale per head: per column. One scale per side: both sides' divisions in one step.
        if K_STATIC and K_SCALE == SCALE_HEAD:
            xk = tl.math.div_rn(xk, load_scale(key_scale_ptr, key_scale_value, head, col_mask,
                                               K_SCALE)[None, :])
        if V_STATIC and V_SCALE == SCALE_HEAD:
            xv = tl.math.div_rn(xv, load_scale(value_scale_ptr, value_scale_value, head,
                                               col_mask, V_SCALE)[None, :])
        xk, xv = divide_pair(xk, k_s, xv, v_s, K_ON=K_ONE, V_ON=V_ONE, EXACT=EXACT,
                             RECIPROCAL=RECIPROCAL_DIV)
        if K_STATIC:
            qk = encode(xk, FORMAT, EXACT).to(tl.uint8)
        if V_STATIC:
            qv = encode(xv, FORMAT, EXACT).to(tl.uint8)
        if K_STATIC:
            tl.store(key_dst + (key_row[:, None] + kc_col[None, :]), qk, mask=mask)
        if V_STATIC:
            tl.store(value_dst + (value_row[:, None] + vc_col[None, :]), qv, mask=mask)
