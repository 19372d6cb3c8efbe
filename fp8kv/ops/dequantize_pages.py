"""Dequantize the FP8 pages a block table names into a compact paged cache (bf16/fp16/fp32).

Grid: ``(batch * pages_per_seq * CHUNKS,)``, ``CHUNKS = cdiv(page_elems, BLOCK)``, chunk-major so
that neighbouring programs stream neighbouring bytes. Program ``i * CHUNKS + c`` reads chunk ``c``
of page ``block_table.flat[i]`` from the K and V caches and writes it to output page ``i``; entries
that are padding (< 0, == null_page, or past the cache) get zeros, so every output element is
written. The chunk-0 program of entry ``i`` also writes ``new_block_table.flat[i] = i``. The numpy
twin is :func:`fp8kv.reference.dequantize_pages`; :func:`fp8kv.dequantize.plan_dequantize` names every
argument and :func:`fp8kv.dequantize.dequantize_operands` says which array each pointer takes.

Parameters follow jax-triton's order (input arrays, scalars, outputs, constexprs), bound by name
as in ``write_kv``; the layout is in the records ``CACHE``, ``OUT`` (the output pages) and
``TILE`` (:mod:`fp8kv.constexprs`). A combined ``[num_pages, 2, ...]`` cache is passed as both
cache operands with V at its strides' ``OFFSET``; a combined output holds V at ``OUT.VALUE``'s
offset and is written through the K output pointer alone (``CACHE.COMBINED``: jax-triton gives
each buffer one output). Stacked caches move the cache and scale pointers to the call's layer
first (:mod:`fp8kv.ops.addressing`); an out-of-range layer reads nothing (zero pages).

Static scales take flat chunks (:func:`_dequantize_flat`). Dynamic scales (a side's dynamic kind
TOKEN, TOKEN_HEAD or BLOCK, ``TILE.ROWWISE``) take ``[ROWS, BLOCK_D]`` tiles of whole head rows
(:func:`_dequantize_rows`): each row's scale is read once, from a side array (per token its head
stride is 0) or, with ``CACHE.INLINE_PAD``, from the 4 little-endian bytes after the row's
``HEAD_DIM`` codes; mxfp8's block scales (BLOCK) are a row's bytes of its side array, one per
block of its codes (:func:`_block_scales`); then ``CHUNKS = cdiv(page_size * num_heads, ROWS)``.
"""
import triton.language as tl

from ._dual import jit
from .addressing import (LAYER_NONE, at_layer, head_rows, output_bits, page_at, page_offsets,
                         page_rows, renumber, select_layer, table_entry)
from .codec import (SCALE_BLOCK, SCALE_HEAD, SCALE_NONE, decode, fp32_to_output_bits,
                    load_scale, mxfp8_values)


@jit(do_not_specialize=["pages_per_seq", "layer"])
def _dequantize_pages_kernel(
    key_cache_ptr, value_cache_ptr, table_ptr, key_scale_ptr, value_scale_ptr, layer_ptr,
    pages_per_seq, stride_table_seq, stride_table_page, num_pages, null_page,
    key_scale_value, value_scale_value, layer,
    key_out_ptr, value_out_ptr, new_table_ptr,
    CACHE: tl.constexpr, OUT: tl.constexpr, TILE: tl.constexpr, EXACT: tl.constexpr,
):
    # Records passed on to helpers are bound to constexpr names first (Triton 3.6).
    KEY: tl.constexpr = CACHE.KEY
    VALUE: tl.constexpr = CACHE.VALUE
    KEY_OUT: tl.constexpr = OUT.KEY
    VALUE_OUT: tl.constexpr = OUT.VALUE
    if CACHE.LAYER_KIND != LAYER_NONE:   # stacked caches: this call's layer
        layer, num_pages = select_layer(layer_ptr, layer, num_pages, KIND=CACHE.LAYER_KIND,
                                        NUM_LAYERS=CACHE.NUM_LAYERS)
        key_cache_ptr = at_layer(key_cache_ptr, layer, KEY, False)
        value_cache_ptr = at_layer(value_cache_ptr, layer, VALUE, False)
        if KEY.SCALES.LAYER != 0:
            key_scale_ptr = at_layer(key_scale_ptr, layer, KEY, True)
        if VALUE.SCALES.LAYER != 0:
            value_scale_ptr = at_layer(value_scale_ptr, layer, VALUE, True)
    if TILE.ROWWISE:  # [ROWS, BLOCK_D] tiles of whole head rows
        ROWS: tl.constexpr = TILE.BLOCK // TILE.BLOCK_D
        CHUNKS: tl.constexpr = (CACHE.PAGE_SIZE * CACHE.NUM_HEADS + ROWS - 1) // ROWS
    else:        # flat BLOCK-element chunks of the page
        CHUNKS: tl.constexpr = (CACHE.PAGE_SIZE * CACHE.NUM_HEADS * CACHE.HEAD_DIM + TILE.BLOCK
                                - 1) // TILE.BLOCK
    entry, chunk, page, valid = table_entry(
        table_ptr, pages_per_seq, stride_table_seq, stride_table_page, num_pages, null_page,
        CHUNKS=CHUNKS, HAS_NULL_PAGE=TILE.HAS_NULL_PAGE)
    key_dst, value_dst = output_bits(key_out_ptr, value_out_ptr, OUT_KIND=OUT.KIND,
                                     COMBINED=CACHE.COMBINED)
    kc = page_at(key_cache_ptr.to(tl.pointer_type(tl.uint8)), page, KEY, False)
    vc = page_at(value_cache_ptr.to(tl.pointer_type(tl.uint8)), page, VALUE, False)
    ko = page_at(key_dst, entry, KEY_OUT, None)
    vo = page_at(value_dst, entry, VALUE_OUT, None)
    if TILE.ROWWISE:
        _dequantize_rows((kc, page_at(key_scale_ptr, page, KEY, True), key_scale_value, ko),
                         (vc, page_at(value_scale_ptr, page, VALUE, True), value_scale_value,
                          vo), valid, chunk, CACHE=CACHE, OUT=OUT, ROWS=ROWS, TILE=TILE,
                         EXACT=EXACT)
    else:
        _dequantize_flat((kc, key_scale_ptr, key_scale_value, ko),
                         (vc, value_scale_ptr, value_scale_value, vo), valid, chunk, CACHE=CACHE,
                         OUT=OUT, TILE=TILE, EXACT=EXACT)
    renumber(new_table_ptr, entry, chunk)


@jit
def _dequantize_flat(key, value, valid, chunk, CACHE: tl.constexpr, OUT: tl.constexpr,
                     TILE: tl.constexpr, EXACT: tl.constexpr):
    """Static scales: the page as flat ``BLOCK``-element chunks in layout order (contiguous
    bytes when the page is packed, whatever the head_dim). ``key`` (``value``): the K (V) cache
    page, scale pointer and host value, and output page. Both sides' loads are issued before
    either is stored."""
    kc, key_scale_ptr, key_scale_value, ko = key
    vc, value_scale_ptr, value_scale_value, vo = value
    KEY_CODES: tl.constexpr = CACHE.KEY.CODES
    VALUE_CODES: tl.constexpr = CACHE.VALUE.CODES
    FMT: tl.constexpr = CACHE.FMT
    NUM_HEADS: tl.constexpr = CACHE.NUM_HEADS
    HEAD_DIM: tl.constexpr = CACHE.HEAD_DIM
    PAGE_SIZE: tl.constexpr = CACHE.PAGE_SIZE
    K_SCALE: tl.constexpr = CACHE.KEY.STATIC
    V_SCALE: tl.constexpr = CACHE.VALUE.STATIC
    PAGE_ELEMS: tl.constexpr = PAGE_SIZE * NUM_HEADS * HEAD_DIM
    j = chunk * TILE.BLOCK + tl.arange(0, TILE.BLOCK)
    in_page = j < PAGE_ELEMS
    # Masks must be boolean blocks: a scalar `valid` broadcast into `in_page & valid` arrives in
    # the interpreter as an integer block, which Triton 3.9's interpreter refuses as a mask.
    load_mask = tl.where(valid, in_page, False)
    key_codes = tl.load(kc + page_offsets(j, KEY_CODES, NUM_HEADS, HEAD_DIM, PAGE_SIZE,
                                          TILE.HND, TILE.IN_PACKED),
                        mask=load_mask, other=0)
    value_codes = tl.load(vc + page_offsets(j, VALUE_CODES, NUM_HEADS, HEAD_DIM, PAGE_SIZE,
                                            TILE.HND, TILE.IN_PACKED),
                          mask=load_mask, other=0)
    if TILE.HND:
        head = j // (PAGE_SIZE * HEAD_DIM)
    else:
        head = (j // HEAD_DIM) % NUM_HEADS
    k = decode(key_codes.to(tl.int32), FMT, EXACT)
    v = decode(value_codes.to(tl.int32), FMT, EXACT)
    if K_SCALE != SCALE_NONE:
        k = k * load_scale(key_scale_ptr, key_scale_value, head, in_page, K_SCALE)
    if V_SCALE != SCALE_NONE:
        v = v * load_scale(value_scale_ptr, value_scale_value, head, in_page, V_SCALE)
    # Padding pages are zeros (not 0 * scale, which is NaN for an inf scale).
    k_bits = tl.where(valid, fp32_to_output_bits(k, OUT.KIND, EXACT), 0)
    v_bits = tl.where(valid, fp32_to_output_bits(v, OUT.KIND, EXACT), 0)
    KEY_OUT: tl.constexpr = OUT.KEY
    VALUE_OUT: tl.constexpr = OUT.VALUE
    tl.store(ko + page_offsets(j, KEY_OUT, NUM_HEADS, HEAD_DIM, PAGE_SIZE, TILE.HND,
                               OUT.PACKED),
             k_bits.to(ko.dtype.element_ty), mask=in_page)
    tl.store(vo + page_offsets(j, VALUE_OUT, NUM_HEADS, HEAD_DIM, PAGE_SIZE, TILE.HND,
                               OUT.PACKED),
             v_bits.to(vo.dtype.element_ty), mask=in_page)


@jit
def _row_scale(scale_ptr, scale_value, codes, row, slot, head, mask, SIDE: tl.constexpr,
               HEAD_DIM: tl.constexpr, INLINE_PAD: tl.constexpr):
    """The scale of each row (one slot's head), broadcastable against ``[ROWS, BLOCK_D]``:
    dynamic (``SIDE.DYNAMIC`` TOKEN or TOKEN_HEAD: inline or from a side array, whose head
    stride is 0 per token) or static (``SIDE.STATIC``)."""
    if SIDE.DYNAMIC != SCALE_NONE:
        if INLINE_PAD > 0:   # 4 little-endian bytes right after the row's HEAD_DIM codes
            at = codes + (row + HEAD_DIM)
            bits = tl.load(at, mask=mask, other=0).to(tl.int32)
            bits = bits | (tl.load(at + 1, mask=mask, other=0).to(tl.int32) << 8)
            bits = bits | (tl.load(at + 2, mask=mask, other=0).to(tl.int32) << 16)
            bits = bits | (tl.load(at + 3, mask=mask, other=0).to(tl.int32) << 24)
            s = bits.to(tl.float32, bitcast=True)[:, None]
        else:
            s = tl.load(scale_ptr + head_rows(slot, head, SIDE, True), mask=mask,
                        other=1.0)[:, None]
    elif SIDE.STATIC == SCALE_HEAD:
        s = load_scale(scale_ptr, scale_value, head, mask, SIDE.STATIC)[:, None]
    else:
        s = load_scale(scale_ptr, scale_value, head, mask, SIDE.STATIC)
    return s


@jit
def _block_scales(scale_page, slot, head, d, mask, SIDE: tl.constexpr, BLOCK: tl.constexpr):
    """Block scales (mxfp8): each element's E8M0 byte (its block, ``d // BLOCK``, of its row)
    as int32, ``[ROWS, BLOCK_D]`` (:func:`codec.mxfp8_values` applies them); ``scale_page``: the
    page of the side's block-scale array."""
    at = head_rows(slot, head, SIDE, True)[:, None] + (d // BLOCK)[None, :]
    return tl.load(scale_page + at, mask=mask, other=127).to(tl.int32)


@jit
def _dequantize_rows(key, value, valid, chunk, CACHE: tl.constexpr, OUT: tl.constexpr,
                     ROWS: tl.constexpr, TILE: tl.constexpr, EXACT: tl.constexpr):
    """Dynamic scales: ``[ROWS, BLOCK_D]`` tiles, a row being one slot's head (layout order), so
    that each row's scale is loaded once and each row's codes are contiguous (inline rows too).
    ``key``: the K cache page, its side scales' page (the scale pointer where static), its host
    scale value and the output page; ``value`` alike."""
    kc, ksc, key_scale_value, ko = key
    vc, vsc, value_scale_value, vo = value
    KEY: tl.constexpr = CACHE.KEY
    VALUE: tl.constexpr = CACHE.VALUE
    FMT: tl.constexpr = CACHE.FMT
    HEAD_DIM: tl.constexpr = CACHE.HEAD_DIM
    slot, head, r_mask = page_rows(chunk, ROWS, CACHE.PAGE_SIZE, CACHE.NUM_HEADS, TILE.HND)
    row_valid = tl.where(valid, r_mask, False)
    d = tl.arange(0, TILE.BLOCK_D)
    d_mask = (d < HEAD_DIM)[None, :]
    load_mask = row_valid[:, None] & d_mask
    k_row = head_rows(slot, head, KEY, False)
    v_row = head_rows(slot, head, VALUE, False)
    k = decode(tl.load(kc + (k_row[:, None] + d[None, :]), mask=load_mask, other=0).to(tl.int32),
               FMT, EXACT)
    v = decode(tl.load(vc + (v_row[:, None] + d[None, :]), mask=load_mask, other=0).to(tl.int32),
               FMT, EXACT)
    if KEY.DYNAMIC == SCALE_BLOCK:
        k = mxfp8_values(k, _block_scales(ksc, slot, head, d, load_mask, SIDE=KEY,
                                          BLOCK=FMT.BLOCK_SIZE), EXACT)
    elif KEY.STATIC != SCALE_NONE or KEY.DYNAMIC != SCALE_NONE:
        k = k * _row_scale(ksc, key_scale_value, kc, k_row, slot, head, row_valid, SIDE=KEY,
                           HEAD_DIM=HEAD_DIM, INLINE_PAD=CACHE.INLINE_PAD)
    if VALUE.DYNAMIC == SCALE_BLOCK:
        v = mxfp8_values(v, _block_scales(vsc, slot, head, d, load_mask, SIDE=VALUE,
                                          BLOCK=FMT.BLOCK_SIZE), EXACT)
    elif VALUE.STATIC != SCALE_NONE or VALUE.DYNAMIC != SCALE_NONE:
        v = v * _row_scale(vsc, value_scale_value, vc, v_row, slot, head, row_valid, SIDE=VALUE,
                           HEAD_DIM=HEAD_DIM, INLINE_PAD=CACHE.INLINE_PAD)
    # Padding pages are zeros (not 0 * scale, which is NaN for an inf scale).
    k_bits = tl.where(valid, fp32_to_output_bits(k, OUT.KIND, EXACT), 0)
    v_bits = tl.where(valid, fp32_to_output_bits(v, OUT.KIND, EXACT), 0)
    store_mask = r_mask[:, None] & d_mask
    KEY_OUT: tl.constexpr = OUT.KEY
    VALUE_OUT: tl.constexpr = OUT.VALUE
    ko_row = head_rows(slot, head, KEY_OUT, None)
    vo_row = head_rows(slot, head, VALUE_OUT, None)
    tl.store(ko + (ko_row[:, None] + d[None, :]), k_bits.to(ko.dtype.element_ty), mask=store_mask)
    tl.store(vo + (vo_row[:, None] + d[None, :]), v_bits.to(vo.dtype.element_ty), mask=store_mask)
