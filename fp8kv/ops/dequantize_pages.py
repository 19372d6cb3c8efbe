"""Dequantize the FP8 pages a block table names into a compact paged cache (bf16/fp16/fp32).

Grid: ``(batch * pages_per_seq * CHUNKS,)``, ``CHUNKS = cdiv(page_elems, BLOCK)``, chunk-major so
that neighbouring programs stream neighbouring bytes. Program ``i * CHUNKS + c`` reads chunk ``c``
of page ``block_table.flat[i]`` from the K and V caches and writes it to output page ``i``; entries
that are padding (< 0, == null_page, or past the cache) get zeros, so every output element is
written. The chunk-0 program of entry ``i`` also writes ``new_block_table.flat[i] = i``. The numpy
twin is :func:`fp8kv.reference.dequantize_pages`; :func:`fp8kv.plan.plan_dequantize` names every
argument.

Parameters follow jax-triton's order (input arrays, scalars, outputs, constexprs), bound by name
as in ``write_kv``. A combined ``[num_pages, 2, ...]`` cache is passed as both cache operands with
V ``value_cache_offset`` elements in; a combined output holds V ``value_out_offset`` elements after
K and, with ``SHARED_OUT``, is written through the K output pointer alone (jax-triton gives each
buffer one output).

Dynamic scales (``K_SCALE_MODE`` / ``V_SCALE_MODE`` TOKEN or TOKEN_HEAD) are gathered per element
from its slot (and head): from a side array (``*_scale_ptr`` with the ``stride_*sc_*`` strides; per
token its head stride is 0) or, with ``INLINE_PAD``, from the 4 little-endian bytes after each head's
``HEAD_DIM`` codes in the cache row.
"""
import triton.language as tl

from ._dual import jit
from .fp8_math import (OUT_FLOAT32, SCALE_NONE, SCALE_TOKEN, fp8_code_to_fp32,
                       fp32_to_output_bits, load_scale)


@jit
def _stored_scale(scale_ptr, codes, row, stride_head, scale_off, stride_sc_slot, stride_sc_head,
                  slot, head, mask, HEAD_DIM: tl.constexpr, INLINE_PAD: tl.constexpr):
    """Per element: the dynamic scale of its slot and head. ``codes``: the cache as bytes,
    ``row``: the element's page row (int64); ``scale_off``: the page's offset in the side array."""
    if INLINE_PAD > 0:
        at = codes + (row + head.to(tl.int64) * stride_head + HEAD_DIM)
        bits = tl.load(at, mask=mask, other=0).to(tl.int32)
        bits = bits | (tl.load(at + 1, mask=mask, other=0).to(tl.int32) << 8)
        bits = bits | (tl.load(at + 2, mask=mask, other=0).to(tl.int32) << 16)
        bits = bits | (tl.load(at + 3, mask=mask, other=0).to(tl.int32) << 24)
        s = bits.to(tl.float32, bitcast=True)
    else:
        s = tl.load(scale_ptr + (scale_off + slot.to(tl.int64) * stride_sc_slot
                                 + head.to(tl.int64) * stride_sc_head), mask=mask, other=1.0)
    return s


@jit
def _page_offsets(j, stride_slot, stride_head, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                  PAGE_SIZE: tl.constexpr, HND: tl.constexpr, PACKED: tl.constexpr):
    """Element offsets within a page for flat layout-order indices ``j``."""
    if PACKED:
        off = j
    else:
        d = j % HEAD_DIM
        if HND:
            h = j // (PAGE_SIZE * HEAD_DIM)
            s = (j // HEAD_DIM) % PAGE_SIZE
        else:
            s = j // (NUM_HEADS * HEAD_DIM)
            h = (j // HEAD_DIM) % NUM_HEADS
        off = s.to(tl.int64) * stride_slot + h.to(tl.int64) * stride_head + d
    return off


@jit(do_not_specialize=["pages_per_seq"])
def _dequantize_pages_kernel(
    key_cache_ptr, value_cache_ptr, table_ptr, key_scale_ptr, value_scale_ptr,
    pages_per_seq, stride_table_seq, stride_table_page, num_pages, null_page,
    stride_kc_page, stride_kc_slot, stride_kc_head, stride_vc_page, stride_vc_slot, stride_vc_head,
    value_cache_offset,
    stride_ko_page, stride_ko_slot, stride_ko_head, stride_vo_page, stride_vo_slot, stride_vo_head,
    value_out_offset, key_scale_value, value_scale_value,
    stride_ksc_page, stride_ksc_slot, stride_ksc_head, stride_vsc_page, stride_vsc_slot,
    stride_vsc_head,
    key_out_ptr, value_out_ptr, new_table_ptr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, HND: tl.constexpr,
    BLOCK: tl.constexpr, INLINE_PAD: tl.constexpr, K_SCALE_MODE: tl.constexpr, V_SCALE_MODE: tl.constexpr,
    E5M2: tl.constexpr, OUT_KIND: tl.constexpr, EXACT: tl.constexpr, HAS_NULL_PAGE: tl.constexpr,
    IN_PACKED: tl.constexpr, OUT_PACKED: tl.constexpr, IN_ALIGN: tl.constexpr,
    OUT_ALIGN: tl.constexpr, SHARED_OUT: tl.constexpr,
):
    CHUNKS: tl.constexpr = (PAGE_SIZE * NUM_HEADS * HEAD_DIM + BLOCK - 1) // BLOCK
    pid = tl.program_id(0)
    entry = (pid // CHUNKS).to(tl.int64)
    chunk = pid % CHUNKS
    b = entry // pages_per_seq
    page = tl.load(table_ptr + b * stride_table_seq
                   + (entry - b * pages_per_seq) * stride_table_page).to(tl.int64)
    valid = (page >= 0) & (page < num_pages)
    if HAS_NULL_PAGE:
        valid = valid & (page != null_page)
    page = tl.where(valid, page, 0)

    PAGE_ELEMS: tl.constexpr = PAGE_SIZE * NUM_HEADS * HEAD_DIM
    j = chunk * BLOCK + tl.arange(0, BLOCK)
    in_page = j < PAGE_ELEMS
    # Masks must be boolean blocks: a scalar `valid` broadcast into `in_page & valid` arrives in
    # the interpreter as an integer block, which Triton 3.9's interpreter refuses as a mask.
    load_mask = tl.where(valid, in_page, False)
    # Alignment promises from the plan (see write_kv): keep 16-byte accesses under jax-triton.
    kc_base = tl.multiple_of(page * stride_kc_page, IN_ALIGN)
    vc_base = tl.multiple_of(page * stride_vc_page + value_cache_offset, IN_ALIGN)
    kc_off = kc_base + _page_offsets(j, stride_kc_slot, stride_kc_head, NUM_HEADS, HEAD_DIM,
                                     PAGE_SIZE, HND, IN_PACKED)
    vc_off = vc_base + _page_offsets(j, stride_vc_slot, stride_vc_head, NUM_HEADS, HEAD_DIM,
                                     PAGE_SIZE, HND, IN_PACKED)
    key_codes = tl.load(key_cache_ptr.to(tl.pointer_type(tl.uint8)) + kc_off, mask=load_mask,
                        other=0)
    value_codes = tl.load(value_cache_ptr.to(tl.pointer_type(tl.uint8)) + vc_off, mask=load_mask,
                          other=0)

    if HND:
        head = j // (PAGE_SIZE * HEAD_DIM)
    else:
        head = (j // HEAD_DIM) % NUM_HEADS
    k = fp8_code_to_fp32(key_codes.to(tl.int32), E5M2, EXACT)
    v = fp8_code_to_fp32(value_codes.to(tl.int32), E5M2, EXACT)
    if K_SCALE_MODE >= SCALE_TOKEN or V_SCALE_MODE >= SCALE_TOKEN:
        if HND:
            slot = (j // HEAD_DIM) % PAGE_SIZE
        else:
            slot = j // (NUM_HEADS * HEAD_DIM)
        # Row starts of each element's slot (head 0) in the caches, as bytes.
        k_row = kc_base + slot.to(tl.int64) * stride_kc_slot
        v_row = vc_base + slot.to(tl.int64) * stride_vc_slot
    if K_SCALE_MODE >= SCALE_TOKEN:
        k = k * _stored_scale(key_scale_ptr, key_cache_ptr.to(tl.pointer_type(tl.uint8)), k_row,
                              stride_kc_head, page * stride_ksc_page, stride_ksc_slot,
                              stride_ksc_head, slot, head, load_mask, HEAD_DIM, INLINE_PAD)
    elif K_SCALE_MODE != SCALE_NONE:
        k = k * load_scale(key_scale_ptr, key_scale_value, head, in_page, K_SCALE_MODE)
    if V_SCALE_MODE >= SCALE_TOKEN:
        v = v * _stored_scale(value_scale_ptr, value_cache_ptr.to(tl.pointer_type(tl.uint8)),
                              v_row, stride_vc_head, page * stride_vsc_page, stride_vsc_slot,
                              stride_vsc_head, slot, head, load_mask, HEAD_DIM, INLINE_PAD)
    elif V_SCALE_MODE != SCALE_NONE:
        v = v * load_scale(value_scale_ptr, value_scale_value, head, in_page, V_SCALE_MODE)
    # Padding pages are zeros (not 0 * scale, which is NaN for an inf scale).
    k_bits = tl.where(valid, fp32_to_output_bits(k, OUT_KIND, EXACT), 0)
    v_bits = tl.where(valid, fp32_to_output_bits(v, OUT_KIND, EXACT), 0)

    ko_off = tl.multiple_of(entry * stride_ko_page, OUT_ALIGN) + _page_offsets(
        j, stride_ko_slot, stride_ko_head, NUM_HEADS, HEAD_DIM, PAGE_SIZE, HND, OUT_PACKED)
    vo_off = tl.multiple_of(entry * stride_vo_page + value_out_offset, OUT_ALIGN) + _page_offsets(
        j, stride_vo_slot, stride_vo_head, NUM_HEADS, HEAD_DIM, PAGE_SIZE, HND, OUT_PACKED)
    if OUT_KIND == OUT_FLOAT32:
        bits_ty: tl.constexpr = tl.uint32
    else:
        bits_ty: tl.constexpr = tl.uint16
    key_dst = key_out_ptr.to(tl.pointer_type(bits_ty))
    if SHARED_OUT:
        value_dst = key_dst
    else:
        value_dst = value_out_ptr.to(tl.pointer_type(bits_ty))
    tl.store(key_dst + ko_off, k_bits.to(bits_ty), mask=in_page)
    tl.store(value_dst + vo_off, v_bits.to(bits_ty), mask=in_page)
    if chunk == 0:
        tl.store(new_table_ptr + entry, entry.to(tl.int32))

