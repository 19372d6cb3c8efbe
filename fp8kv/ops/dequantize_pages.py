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

Static scales take flat chunks (:func:`_dequantize_flat`). Dynamic scales (``K_SCALE_MODE`` /
``V_SCALE_MODE`` TOKEN or TOKEN_HEAD, plan constexpr ``ROWWISE``) take ``[ROWS, BLOCK_D]`` tiles
of whole head rows (:func:`_dequantize_rows`): each row's scale is read once, from a side array
(``*_scale_ptr`` with the ``stride_*sc_*`` strides; per token its head stride is 0) or, with
``INLINE_PAD``, from the 4 little-endian bytes after the row's ``HEAD_DIM`` codes; then
``CHUNKS = cdiv(page_size * num_heads, ROWS)``.
"""
import triton.language as tl

from ._dual import jit
from .fp8_math import (OUT_FLOAT32, SCALE_HEAD, SCALE_NONE, SCALE_TOKEN, fp8_code_to_fp32,
                       fp32_to_output_bits, load_scale)


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
    BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, ROWWISE: tl.constexpr, INLINE_PAD: tl.constexpr,
    K_SCALE_MODE: tl.constexpr, V_SCALE_MODE: tl.constexpr,
    E5M2: tl.constexpr, OUT_KIND: tl.constexpr, EXACT: tl.constexpr, HAS_NULL_PAGE: tl.constexpr,
    IN_PACKED: tl.constexpr, OUT_PACKED: tl.constexpr, IN_ALIGN: tl.constexpr,
    OUT_ALIGN: tl.constexpr, SHARED_OUT: tl.constexpr,
):
    if ROWWISE:  # [ROWS, BLOCK_D] tiles of whole head rows
        ROWS: tl.constexpr = BLOCK // BLOCK_D
        CHUNKS: tl.constexpr = (PAGE_SIZE * NUM_HEADS + ROWS - 1) // ROWS
    else:        # flat BLOCK-element chunks of the page
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

    if OUT_KIND == OUT_FLOAT32:
        bits_ty: tl.constexpr = tl.uint32
    else:
        bits_ty: tl.constexpr = tl.uint16
    key_dst = key_out_ptr.to(tl.pointer_type(bits_ty))
    if SHARED_OUT:
        value_dst = key_dst
    else:
        value_dst = value_out_ptr.to(tl.pointer_type(bits_ty))
    # Alignment promises from the plan (see write_kv): keep 16-byte accesses under jax-triton.
    kc_base = tl.multiple_of(page * stride_kc_page, IN_ALIGN)
    vc_base = tl.multiple_of(page * stride_vc_page + value_cache_offset, IN_ALIGN)
    if ROWWISE:
        _dequantize_rows(key_cache_ptr.to(tl.pointer_type(tl.uint8)),
                         value_cache_ptr.to(tl.pointer_type(tl.uint8)), key_scale_ptr,
                         value_scale_ptr, key_dst, value_dst, valid, chunk, kc_base, vc_base,
                         tl.multiple_of(entry * stride_ko_page, OUT_ALIGN),
                         tl.multiple_of(entry * stride_vo_page + value_out_offset, OUT_ALIGN),
                         stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head,
                         stride_ko_slot, stride_ko_head, stride_vo_slot, stride_vo_head,
                         page * stride_ksc_page, stride_ksc_slot, stride_ksc_head,
                         page * stride_vsc_page, stride_vsc_slot, stride_vsc_head,
                         key_scale_value, value_scale_value, NUM_HEADS, HEAD_DIM, PAGE_SIZE, HND,
                         ROWS, BLOCK_D, INLINE_PAD, K_SCALE_MODE, V_SCALE_MODE, E5M2, OUT_KIND,
                         EXACT, IN_ALIGN, OUT_ALIGN)
    else:
        _dequantize_flat(key_cache_ptr.to(tl.pointer_type(tl.uint8)),
                         value_cache_ptr.to(tl.pointer_type(tl.uint8)), key_scale_ptr,
                         value_scale_ptr, key_dst, value_dst, valid, entry, chunk, kc_base,
                         vc_base, stride_kc_slot, stride_kc_head, stride_vc_slot, stride_vc_head,
                         stride_ko_page, stride_ko_slot, stride_ko_head, stride_vo_page,
                         stride_vo_slot, stride_vo_head, value_out_offset, key_scale_value,
                         value_scale_value, NUM_HEADS, HEAD_DIM, PAGE_SIZE, HND, BLOCK,
                         K_SCALE_MODE, V_SCALE_MODE, E5M2, OUT_KIND, EXACT, IN_PACKED, OUT_PACKED,
                         OUT_ALIGN)
    if chunk == 0:
        tl.store(new_table_ptr + entry, entry.to(tl.int32))


@jit
def _dequantize_flat(kc_u8, vc_u8, key_scale_ptr, value_scale_ptr, key_dst, value_dst, valid,
                     entry, chunk, kc_base, vc_base, stride_kc_slot, stride_kc_head,
                     stride_vc_slot, stride_vc_head, stride_ko_page, stride_ko_slot,
                     stride_ko_head, stride_vo_page, stride_vo_slot, stride_vo_head,
                     value_out_offset, key_scale_value, value_scale_value,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     HND: tl.constexpr, BLOCK: tl.constexpr, K_SCALE_MODE: tl.constexpr,
                     V_SCALE_MODE: tl.constexpr, E5M2: tl.constexpr, OUT_KIND: tl.constexpr,
                     EXACT: tl.constexpr, IN_PACKED: tl.constexpr, OUT_PACKED: tl.constexpr,
                     OUT_ALIGN: tl.constexpr):
    """Static scales: the page as flat ``BLOCK``-element chunks in layout order (contiguous
    bytes when the page is packed, whatever the head_dim)."""
    PAGE_ELEMS: tl.constexpr = PAGE_SIZE * NUM_HEADS * HEAD_DIM
    j = chunk * BLOCK + tl.arange(0, BLOCK)
    in_page = j < PAGE_ELEMS
    # Masks must be boolean blocks: a scalar `valid` broadcast into `in_page & valid` arrives in
    # the interpreter as an integer block, which Triton 3.9's interpreter refuses as a mask.
    load_mask = tl.where(valid, in_page, False)
    kc_off = kc_base + _page_offsets(j, stride_kc_slot, stride_kc_head, NUM_HEADS, HEAD_DIM,
                                     PAGE_SIZE, HND, IN_PACKED)
    vc_off = vc_base + _page_offsets(j, stride_vc_slot, stride_vc_head, NUM_HEADS, HEAD_DIM,
                                     PAGE_SIZE, HND, IN_PACKED)
    key_codes = tl.load(kc_u8 + kc_off, mask=load_mask, other=0)
    value_codes = tl.load(vc_u8 + vc_off, mask=load_mask, other=0)
    if HND:
        head = j // (PAGE_SIZE * HEAD_DIM)
    else:
        head = (j // HEAD_DIM) % NUM_HEADS
    k = fp8_code_to_fp32(key_codes.to(tl.int32), E5M2, EXACT)
    v = fp8_code_to_fp32(value_codes.to(tl.int32), E5M2, EXACT)
    if K_SCALE_MODE != SCALE_NONE:
        k = k * load_scale(key_scale_ptr, key_scale_value, head, in_page, K_SCALE_MODE)
    if V_SCALE_MODE != SCALE_NONE:
        v = v * load_scale(value_scale_ptr, value_scale_value, head, in_page, V_SCALE_MODE)
    # Padding pages are zeros (not 0 * scale, which is NaN for an inf scale).
    bits_ty: tl.constexpr = key_dst.dtype.element_ty
    k_bits = tl.where(valid, fp32_to_output_bits(k, OUT_KIND, EXACT), 0).to(bits_ty)
    v_bits = tl.where(valid, fp32_to_output_bits(v, OUT_KIND, EXACT), 0).to(bits_ty)
    ko_off = tl.multiple_of(entry * stride_ko_page, OUT_ALIGN) + _page_offsets(
        j, stride_ko_slot, stride_ko_head, NUM_HEADS, HEAD_DIM, PAGE_SIZE, HND, OUT_PACKED)
    vo_off = tl.multiple_of(entry * stride_vo_page + value_out_offset, OUT_ALIGN) + _page_offsets(
        j, stride_vo_slot, stride_vo_head, NUM_HEADS, HEAD_DIM, PAGE_SIZE, HND, OUT_PACKED)
    tl.store(key_dst + ko_off, k_bits, mask=in_page)
    tl.store(value_dst + vo_off, v_bits, mask=in_page)


@jit
def _row_scale(scale_ptr, codes, row, scale_off, stride_sc_slot, stride_sc_head, slot, head,
               scale_value, mask, MODE: tl.constexpr, HEAD_DIM: tl.constexpr,
               INLINE_PAD: tl.constexpr):
    """The scale of each row (one slot's head), broadcastable against ``[ROWS, BLOCK_D]``."""
    if MODE >= SCALE_TOKEN:
        if INLINE_PAD > 0:   # 4 little-endian bytes right after the row's HEAD_DIM codes
            at = codes + (row + HEAD_DIM)
            bits = tl.load(at, mask=mask, other=0).to(tl.int32)
            bits = bits | (tl.load(at + 1, mask=mask, other=0).to(tl.int32) << 8)
            bits = bits | (tl.load(at + 2, mask=mask, other=0).to(tl.int32) << 16)
            bits = bits | (tl.load(at + 3, mask=mask, other=0).to(tl.int32) << 24)
            s = bits.to(tl.float32, bitcast=True)[:, None]
        else:                # side array; per token its head stride is 0
            s = tl.load(scale_ptr + (scale_off + slot * stride_sc_slot + head * stride_sc_head),
                        mask=mask, other=1.0)[:, None]
    elif MODE == SCALE_HEAD:
        s = load_scale(scale_ptr, scale_value, head, mask, MODE)[:, None]
    else:
        s = load_scale(scale_ptr, scale_value, head, mask, MODE)
    return s


@jit
def _dequantize_rows(kc_u8, vc_u8, key_scale_ptr, value_scale_ptr, key_dst, value_dst, valid,
                     chunk, kc_base, vc_base, ko_base, vo_base, stride_kc_slot, stride_kc_head,
                     stride_vc_slot, stride_vc_head, stride_ko_slot, stride_ko_head,
                     stride_vo_slot, stride_vo_head, ksc_off, stride_ksc_slot, stride_ksc_head,
                     vsc_off, stride_vsc_slot, stride_vsc_head, key_scale_value,
                     value_scale_value, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                     PAGE_SIZE: tl.constexpr, HND: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_D: tl.constexpr, INLINE_PAD: tl.constexpr, K_SCALE_MODE: tl.constexpr,
                     V_SCALE_MODE: tl.constexpr, E5M2: tl.constexpr, OUT_KIND: tl.constexpr,
                     EXACT: tl.constexpr, IN_ALIGN: tl.constexpr, OUT_ALIGN: tl.constexpr):
    """Dynamic scales: ``[ROWS, BLOCK_D]`` tiles, a row being one slot's head (layout order), so
    that each row's scale is loaded once and each row's codes are contiguous (inline rows too)."""
    r = chunk * ROWS + tl.arange(0, ROWS)
    d = tl.arange(0, BLOCK_D)
    r_mask = r < PAGE_SIZE * NUM_HEADS
    if HND:
        head = r // PAGE_SIZE
        slot = r % PAGE_SIZE
    else:
        slot = r // NUM_HEADS
        head = r % NUM_HEADS
    slot = slot.to(tl.int64)
    head = head.to(tl.int64)
    mask = r_mask[:, None] & (d < HEAD_DIM)[None, :]
    row_valid = tl.where(valid, r_mask, False)
    load_mask = row_valid[:, None] & (d < HEAD_DIM)[None, :]
    k_row = kc_base + tl.multiple_of(slot * stride_kc_slot + head * stride_kc_head, IN_ALIGN)
    v_row = vc_base + tl.multiple_of(slot * stride_vc_slot + head * stride_vc_head, IN_ALIGN)
    k = fp8_code_to_fp32(tl.load(kc_u8 + (k_row[:, None] + d[None, :]), mask=load_mask,
                                 other=0).to(tl.int32), E5M2, EXACT)
    v = fp8_code_to_fp32(tl.load(vc_u8 + (v_row[:, None] + d[None, :]), mask=load_mask,
                                 other=0).to(tl.int32), E5M2, EXACT)
    if K_SCALE_MODE != SCALE_NONE:
        k = k * _row_scale(key_scale_ptr, kc_u8, k_row, ksc_off, stride_ksc_slot,
                           stride_ksc_head, slot, head, key_scale_value, row_valid, K_SCALE_MODE,
                           HEAD_DIM, INLINE_PAD)
    if V_SCALE_MODE != SCALE_NONE:
        v = v * _row_scale(value_scale_ptr, vc_u8, v_row, vsc_off, stride_vsc_slot,
                           stride_vsc_head, slot, head, value_scale_value, row_valid,
                           V_SCALE_MODE, HEAD_DIM, INLINE_PAD)
    # Padding pages are zeros (not 0 * scale, which is NaN for an inf scale).
    bits_ty: tl.constexpr = key_dst.dtype.element_ty
    k_bits = tl.where(valid, fp32_to_output_bits(k, OUT_KIND, EXACT), 0).to(bits_ty)
    v_bits = tl.where(valid, fp32_to_output_bits(v, OUT_KIND, EXACT), 0).to(bits_ty)
    ko_row = ko_base + tl.multiple_of(slot * stride_ko_slot + head * stride_ko_head, OUT_ALIGN)
    vo_row = vo_base + tl.multiple_of(slot * stride_vo_slot + head * stride_vo_head, OUT_ALIGN)
    tl.store(key_dst + (ko_row[:, None] + d[None, :]), k_bits, mask=mask)
    tl.store(value_dst + (vo_row[:, None] + d[None, :]), v_bits, mask=mask)
