"""Fused quantize + scatter of new K/V rows into a paged FP8 cache (one launch for K and V).

Grid: ``(cdiv(num_tokens, BLOCK_T),)``. A program owns ``BLOCK_T`` tokens and walks their
``NUM_HEADS * HEAD_DIM`` row in ``BLOCK_HD`` columns at a time, K and V together so that both loads
are in flight before the stores. Slots below zero (padding) or past the cache are skipped. Page and
row offsets are int64: a cache may exceed 2**31 elements. The numpy twin is
:func:`fp8kv.reference.write_kv`; :func:`fp8kv.plan.plan_write` names every argument.

Parameters follow jax-triton's order -- input arrays, scalars, outputs, constexprs -- and are bound
by name (:mod:`fp8kv.binding`). A cache is an input (``*_cache_ptr``, for JAX's aliasing) and an
output (``*_cache_out_ptr``, written). A combined ``[num_pages, 2, ...]`` cache is passed as both
caches, V ``value_cache_offset`` elements in; with ``SHARED_OUT`` V is written through the K output
pointer, for frontends that give each buffer one output (jax-triton).
"""
import triton.language as tl

from ._dual import jit
from .fp8_math import (SCALE_HEAD, SCALE_NONE, divide, fp32_to_fp8_code, load_as_fp32,
                       load_scale)


@jit(do_not_specialize=["num_tokens"])
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, key_scale_ptr, value_scale_ptr,
    num_tokens, num_slots, stride_key_token, stride_key_head, stride_value_token, stride_value_head,
    stride_kc_page, stride_kc_slot, stride_kc_head, stride_vc_page, stride_vc_slot, stride_vc_head,
    value_cache_offset, key_scale_value, value_scale_value,
    key_cache_out_ptr, value_cache_out_ptr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
    K_SCALE_MODE: tl.constexpr, V_SCALE_MODE: tl.constexpr, E5M2: tl.constexpr, EXACT: tl.constexpr,
    KEY_PACKED: tl.constexpr, VALUE_PACKED: tl.constexpr, CACHE_PACKED: tl.constexpr,
    IN_ALIGN: tl.constexpr, CACHE_ALIGN: tl.constexpr, RECIPROCAL_DIV: tl.constexpr,
    SHARED_OUT: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=in_range, other=-1).to(tl.int64)
    keep = in_range & (slot >= 0) & (slot < num_slots)
    slot = tl.where(keep, slot, 0)
    page = slot // PAGE_SIZE
    off = slot % PAGE_SIZE
    key_dst = key_cache_out_ptr.to(tl.pointer_type(tl.uint8))
    if SHARED_OUT:
        value_dst = key_dst
    else:
        value_dst = value_cache_out_ptr.to(tl.pointer_type(tl.uint8))
    # The plan's alignment promises: jax-triton does not specialize integer arguments on
    # divisibility as torch-side launches do, and without them no access is 16 bytes wide.
    # A promise must be made where its value is computed.
    key_row = tl.multiple_of(page * stride_kc_page + off * stride_kc_slot, CACHE_ALIGN)
    value_row = tl.multiple_of(page * stride_vc_page + off * stride_vc_slot + value_cache_offset,
                               CACHE_ALIGN)
    key_in = tl.multiple_of(tok * stride_key_token, IN_ALIGN)
    value_in = tl.multiple_of(tok * stride_value_token, IN_ALIGN)
    ROW: tl.constexpr = NUM_HEADS * HEAD_DIM
    for start in tl.static_range(0, ROW, BLOCK_HD):
        col = start + tl.arange(0, BLOCK_HD)
        col_mask = col < ROW
        head = col // HEAD_DIM
        dim = col % HEAD_DIM
        # Packed rows (head stride == HEAD_DIM) address by `col` alone, which keeps the
        # compiler's contiguity proof and so 16-byte accesses.
        k_col = col if KEY_PACKED else tl.multiple_of(head * stride_key_head, IN_ALIGN) + dim
        v_col = col if VALUE_PACKED else tl.multiple_of(head * stride_value_head, IN_ALIGN) + dim
        kc_col = col if CACHE_PACKED else tl.multiple_of(head * stride_kc_head, CACHE_ALIGN) + dim
        vc_col = col if CACHE_PACKED else tl.multiple_of(head * stride_vc_head, CACHE_ALIGN) + dim
        # Loads do not wait for the slots (one DRAM round trip instead of two for small batches);
        # only the stores are masked by them.
        load_mask = in_range[:, None] & col_mask[None, :]
        mask = keep[:, None] & col_mask[None, :]
        xk = load_as_fp32(key_ptr, key_in[:, None] + k_col[None, :], load_mask, EXACT)
        xv = load_as_fp32(value_ptr, value_in[:, None] + v_col[None, :], load_mask, EXACT)
        if K_SCALE_MODE != SCALE_NONE:
            ks = load_scale(key_scale_ptr, key_scale_value, head, col_mask, K_SCALE_MODE)
            xk = divide(xk, ks if K_SCALE_MODE != SCALE_HEAD else ks[None, :],
                        K_SCALE_MODE != SCALE_HEAD, EXACT, RECIPROCAL_DIV)
        if V_SCALE_MODE != SCALE_NONE:
            vs = load_scale(value_scale_ptr, value_scale_value, head, col_mask, V_SCALE_MODE)
            xv = divide(xv, vs if V_SCALE_MODE != SCALE_HEAD else vs[None, :],
                        V_SCALE_MODE != SCALE_HEAD, EXACT, RECIPROCAL_DIV)
        qk = fp32_to_fp8_code(xk, E5M2, EXACT).to(tl.uint8)
        qv = fp32_to_fp8_code(xv, E5M2, EXACT).to(tl.uint8)
        tl.store(key_dst + (key_row[:, None] + kc_col[None, :]), qk, mask=mask)
        tl.store(value_dst + (value_row[:, None] + vc_col[None, :]), qv, mask=mask)
