"""Fused quantize + scatter of new K/V rows into a paged FP8 cache (one launch for K and V).

Grid: ``(cdiv(num_tokens, BLOCK_T),)``. A program owns ``BLOCK_T`` tokens and walks their
``NUM_HEADS * HEAD_DIM`` row in ``BLOCK_HD`` columns at a time, K and V together so that both loads
are in flight before the stores. Slots below zero (padding) or past the cache are skipped. Page and
row offsets are int64: a cache may exceed 2**31 elements. The numpy twin is
:func:`fp8kv.reference.write_kv`; :mod:`fp8kv.plan` picks the constexprs.

Kernel parameters follow jax-triton's convention -- array operands, then scalars, then one pointer
per output -- so that torch (which passes each cache twice) and JAX (which aliases the cache input
to the output) call the very same kernel.
"""
import triton.language as tl

from ._dual import jit
from .fp8_math import (SCALE_HEAD, SCALE_NONE, divide, fp32_to_fp8_code, load_as_fp32,
                       load_scale)


@jit
def _write_rows(key_ptr, value_ptr, key_dst_ptr, value_dst_ptr, key_scale_ptr, value_scale_ptr,
                key_scale_value, value_scale_value, tok, key_row, value_row, in_range, keep,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_kc_head, stride_vc_head,
                NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_HD: tl.constexpr,
                K_SCALE_MODE: tl.constexpr, V_SCALE_MODE: tl.constexpr, E5M2: tl.constexpr,
                EXACT: tl.constexpr, KEY_PACKED: tl.constexpr, VALUE_PACKED: tl.constexpr,
                CACHE_PACKED: tl.constexpr, IN_ALIGN: tl.constexpr, CACHE_ALIGN: tl.constexpr,
                RECIPROCAL_DIV: tl.constexpr):
    key_dst = key_dst_ptr.to(tl.pointer_type(tl.uint8))
    value_dst = value_dst_ptr.to(tl.pointer_type(tl.uint8))
    ROW: tl.constexpr = NUM_HEADS * HEAD_DIM
    # The plan's alignment promises: jax-triton does not specialize integer arguments on
    # divisibility as torch-side launches do, and without them no access is 16 bytes wide.
    # (A promise must be made where its value is computed: key_row / value_row are made so by
    # the kernels.)
    key_in = tl.multiple_of(tok * stride_kt, IN_ALIGN)
    value_in = tl.multiple_of(tok * stride_vt, IN_ALIGN)
    for start in tl.static_range(0, ROW, BLOCK_HD):
        col = start + tl.arange(0, BLOCK_HD)
        col_mask = col < ROW
        head = col // HEAD_DIM
        dim = col % HEAD_DIM
        # Packed rows (head stride == HEAD_DIM) address by `col` alone, which keeps the
        # compiler's contiguity proof and so 16-byte accesses.
        k_col = col if KEY_PACKED else tl.multiple_of(head * stride_kh, IN_ALIGN) + dim
        v_col = col if VALUE_PACKED else tl.multiple_of(head * stride_vh, IN_ALIGN) + dim
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


@jit
def _token_block(slot_ptr, num_tokens, num_slots, PAGE_SIZE: tl.constexpr, BLOCK_T: tl.constexpr):
    """This program's tokens, which exist, which to write, and their (page, offset) in the cache."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = tok < num_tokens
    slot = tl.load(slot_ptr + tok, mask=in_range, other=-1).to(tl.int64)
    keep = in_range & (slot >= 0) & (slot < num_slots)
    slot = tl.where(keep, slot, 0)
    return tok, in_range, keep, slot // PAGE_SIZE, slot % PAGE_SIZE


@jit(do_not_specialize=["num_tokens"])
def _write_kv_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, key_scale_ptr, value_scale_ptr,
    num_tokens, num_slots, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_page, stride_kc_slot, stride_kc_head, stride_vc_page, stride_vc_slot, stride_vc_head,
    key_scale_value, value_scale_value,
    key_cache_out_ptr, value_cache_out_ptr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
    K_SCALE_MODE: tl.constexpr, V_SCALE_MODE: tl.constexpr, E5M2: tl.constexpr, EXACT: tl.constexpr,
    KEY_PACKED: tl.constexpr, VALUE_PACKED: tl.constexpr, CACHE_PACKED: tl.constexpr,
    IN_ALIGN: tl.constexpr, CACHE_ALIGN: tl.constexpr, RECIPROCAL_DIV: tl.constexpr,
):
    """Separate K and V caches (each may be any strided view)."""
    tok, in_range, keep, page, off = _token_block(slot_ptr, num_tokens, num_slots, PAGE_SIZE,
                                                  BLOCK_T)
    key_row = tl.multiple_of(page * stride_kc_page + off * stride_kc_slot, CACHE_ALIGN)
    value_row = tl.multiple_of(page * stride_vc_page + off * stride_vc_slot, CACHE_ALIGN)
    _write_rows(key_ptr, value_ptr, key_cache_out_ptr, value_cache_out_ptr, key_scale_ptr,
                value_scale_ptr, key_scale_value, value_scale_value, tok, key_row, value_row,
                in_range, keep,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_kc_head, stride_vc_head,
                NUM_HEADS, HEAD_DIM, BLOCK_HD, K_SCALE_MODE, V_SCALE_MODE, E5M2, EXACT,
                KEY_PACKED, VALUE_PACKED, CACHE_PACKED, IN_ALIGN, CACHE_ALIGN, RECIPROCAL_DIV)


@jit(do_not_specialize=["num_tokens"])
def _write_kv_combined_kernel(
    key_ptr, value_ptr, kv_cache_ptr, slot_ptr, key_scale_ptr, value_scale_ptr,
    num_tokens, num_slots, stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kc_page, stride_kc_slot, stride_kc_head, value_offset,
    key_scale_value, value_scale_value,
    kv_cache_out_ptr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_HD: tl.constexpr,
    K_SCALE_MODE: tl.constexpr, V_SCALE_MODE: tl.constexpr, E5M2: tl.constexpr, EXACT: tl.constexpr,
    KEY_PACKED: tl.constexpr, VALUE_PACKED: tl.constexpr, CACHE_PACKED: tl.constexpr,
    IN_ALIGN: tl.constexpr, CACHE_ALIGN: tl.constexpr, RECIPROCAL_DIV: tl.constexpr,
):
    """One ``[num_pages, 2, ...]`` cache: V lives ``value_offset`` elements after K.

    JAX has no strided views, so a combined cache is one operand aliased to one output.
    """
    tok, in_range, keep, page, off = _token_block(slot_ptr, num_tokens, num_slots, PAGE_SIZE,
                                                  BLOCK_T)
    key_row = tl.multiple_of(page * stride_kc_page + off * stride_kc_slot, CACHE_ALIGN)
    value_row = tl.multiple_of(key_row + value_offset, CACHE_ALIGN)
    _write_rows(key_ptr, value_ptr, kv_cache_out_ptr, kv_cache_out_ptr, key_scale_ptr,
                value_scale_ptr, key_scale_value, value_scale_value, tok, key_row, value_row,
                in_range, keep,
                stride_kt, stride_kh, stride_vt, stride_vh, stride_kc_head, stride_kc_head,
                NUM_HEADS, HEAD_DIM, BLOCK_HD, K_SCALE_MODE, V_SCALE_MODE, E5M2, EXACT,
                KEY_PACKED, VALUE_PACKED, CACHE_PACKED, IN_ALIGN, CACHE_ALIGN, RECIPROCAL_DIV)
