"""Dequantize the FP8 pages a block table names into a compact paged cache (bf16/fp16/fp32).

Grid: ``(batch * pages_per_seq * CHUNKS,)``, ``CHUNKS = cdiv(page_elems, BLOCK)``, chunk-major so
that neighbouring programs stream neighbouring bytes. Program ``i * CHUNKS + c`` reads chunk ``c``
of page ``block_table.flat[i]`` from the K and V caches and writes it to output page ``i``; entries
that are padding (< 0, == null_page, or past the cache) get zeros, so every output element is
written. The chunk-0 program of entry ``i`` also writes ``new_block_table.flat[i] = i``. The numpy
twin is :func:`fp8kv.reference.dequantize_pages`; :func:`fp8kv.plan.plan_dequantize` names every
argument and :func:`fp8kv.operands.dequantize_operands` says which array each pointer takes.

Parameters follow jax-triton's order (input arrays, scalars, outputs, constexprs), bound by name
as in ``write_kv``; strides are constexprs (``STRIDE_<array>_<dim>``). A combined
``[num_pages, 2, ...]`` cache is passed as both cache operands with V ``VALUE_CACHE_OFFSET``
elements in; a combined output holds V ``VALUE_OUT_OFFSET`` elements after K and, with
``SHARED_OUT``, is written through the K output pointer alone (jax-triton gives each buffer one
output). Stacked caches (``LAYER_KIND``) move the cache and scale pointers to the call's layer
first (:mod:`fp8kv.ops.layers`); an out-of-range layer reads nothing (zero pages).

Static scales take flat chunks (:func:`_dequantize_flat`). Dynamic scales (``K_DYNAMIC`` /
``V_DYNAMIC`` TOKEN or TOKEN_HEAD, plan constexpr ``ROWWISE``) take ``[ROWS, BLOCK_D]`` tiles of
whole head rows (:func:`_dequantize_rows`): each row's scale is read once, from a side array
(``*_scale_ptr`` with the ``STRIDE_*SC_*`` strides; per token its head stride is 0) or, with
``INLINE_PAD``, from the 4 little-endian bytes after the row's ``HEAD_DIM`` codes; then
``CHUNKS = cdiv(page_size * num_heads, ROWS)``.
"""
import triton.language as tl

from ._dual import jit
from .layers import LAYER_NONE, select_layer
from .table import output_bits, renumber, table_entry
from .codec import SCALE_HEAD, SCALE_NONE, decode, fp32_to_output_bits, load_scale


@jit
def _page_offsets(j, STRIDE_SLOT: tl.constexpr, STRIDE_HEAD: tl.constexpr,
                  NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  HND: tl.constexpr, PACKED: tl.constexpr):
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
        off = s.to(tl.int64) * STRIDE_SLOT + h.to(tl.int64) * STRIDE_HEAD + d
    return off


@jit(do_not_specialize=["pages_per_seq", "layer"])
def _dequantize_pages_kernel(
    key_cache_ptr, value_cache_ptr, table_ptr, key_scale_ptr, value_scale_ptr, layer_ptr,
    pages_per_seq, stride_table_seq, stride_table_page, num_pages, null_page,
    key_scale_value, value_scale_value, layer,
    key_out_ptr, value_out_ptr, new_table_ptr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    STRIDE_KC_PAGE: tl.constexpr, STRIDE_KC_SLOT: tl.constexpr, STRIDE_KC_HEAD: tl.constexpr,
    STRIDE_VC_PAGE: tl.constexpr, STRIDE_VC_SLOT: tl.constexpr, STRIDE_VC_HEAD: tl.constexpr,
    VALUE_CACHE_OFFSET: tl.constexpr,
    STRIDE_KSC_PAGE: tl.constexpr, STRIDE_KSC_SLOT: tl.constexpr, STRIDE_KSC_HEAD: tl.constexpr,
    STRIDE_VSC_PAGE: tl.constexpr, STRIDE_VSC_SLOT: tl.constexpr, STRIDE_VSC_HEAD: tl.constexpr,
    STRIDE_KO_PAGE: tl.constexpr, STRIDE_KO_SLOT: tl.constexpr, STRIDE_KO_HEAD: tl.constexpr,
    STRIDE_VO_PAGE: tl.constexpr, STRIDE_VO_SLOT: tl.constexpr, STRIDE_VO_HEAD: tl.constexpr,
    VALUE_OUT_OFFSET: tl.constexpr,
    FORMAT: tl.constexpr, K_SCALE: tl.constexpr, K_DYNAMIC: tl.constexpr,
    V_SCALE: tl.constexpr, V_DYNAMIC: tl.constexpr, INLINE_PAD: tl.constexpr,
    HND: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, ROWWISE: tl.constexpr,
    OUT_KIND: tl.constexpr, HAS_NULL_PAGE: tl.constexpr, IN_PACKED: tl.constexpr,
    OUT_PACKED: tl.constexpr, SHARED_OUT: tl.constexpr, EXACT: tl.constexpr,
    LAYER_KIND: tl.constexpr, NUM_LAYERS: tl.constexpr,
    STRIDE_KC_LAYER: tl.constexpr, STRIDE_VC_LAYER: tl.constexpr,
    STRIDE_KSC_LAYER: tl.constexpr, STRIDE_VSC_LAYER: tl.constexpr,
):
    if LAYER_KIND != LAYER_NONE:   # stacked caches: this call's layer (fp8kv.ops.layers)
        layer, num_pages = select_layer(layer_ptr, layer, num_pages, KIND=LAYER_KIND,
                                        NUM_LAYERS=NUM_LAYERS)
        key_cache_ptr += layer * STRIDE_KC_LAYER
        value_cache_ptr += layer * STRIDE_VC_LAYER
        if STRIDE_KSC_LAYER != 0:
            key_scale_ptr += layer * STRIDE_KSC_LAYER
        if STRIDE_VSC_LAYER != 0:
            value_scale_ptr += layer * STRIDE_VSC_LAYER
    if ROWWISE:  # [ROWS, BLOCK_D] tiles of whole head rows
        ROWS: tl.constexpr = BLOCK // BLOCK_D
        CHUNKS: tl.constexpr = (PAGE_SIZE * NUM_HEADS + ROWS - 1) // ROWS
    else:        # flat BLOCK-element chunks of the page
        CHUNKS: tl.constexpr = (PAGE_SIZE * NUM_HEADS * HEAD_DIM + BLOCK - 1) // BLOCK
    entry, chunk, page, valid = table_entry(
        table_ptr, pages_per_seq, stride_table_seq, stride_table_page, num_pages, null_page,
        CHUNKS=CHUNKS, HAS_NULL_PAGE=HAS_NULL_PAGE)
    key_dst, value_dst = output_bits(key_out_ptr, value_out_ptr, OUT_KIND=OUT_KIND,
                                     SHARED_OUT=SHARED_OUT)
    kc = key_cache_ptr.to(tl.pointer_type(tl.uint8)) + page * STRIDE_KC_PAGE
    vc = value_cache_ptr.to(tl.pointer_type(tl.uint8)) + (page * STRIDE_VC_PAGE
                                                          + VALUE_CACHE_OFFSET)
    ko = key_dst + entry * STRIDE_KO_PAGE
    vo = value_dst + (entry * STRIDE_VO_PAGE + VALUE_OUT_OFFSET)
    if ROWWISE:
        _dequantize_rows(kc, key_scale_ptr + page * STRIDE_KSC_PAGE, key_scale_value, ko,
                         vc, value_scale_ptr + page * STRIDE_VSC_PAGE, value_scale_value, vo,
                         valid, chunk,
                         STRIDE_KC_SLOT=STRIDE_KC_SLOT, STRIDE_KC_HEAD=STRIDE_KC_HEAD,
                         STRIDE_KSC_SLOT=STRIDE_KSC_SLOT, STRIDE_KSC_HEAD=STRIDE_KSC_HEAD,
                         STRIDE_KO_SLOT=STRIDE_KO_SLOT, STRIDE_KO_HEAD=STRIDE_KO_HEAD,
                         STRIDE_VC_SLOT=STRIDE_VC_SLOT, STRIDE_VC_HEAD=STRIDE_VC_HEAD,
                         STRIDE_VSC_SLOT=STRIDE_VSC_SLOT, STRIDE_VSC_HEAD=STRIDE_VSC_HEAD,
                         STRIDE_VO_SLOT=STRIDE_VO_SLOT, STRIDE_VO_HEAD=STRIDE_VO_HEAD,
                         NUM_HEADS=NUM_HEADS, HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, HND=HND,
                         ROWS=ROWS, BLOCK_D=BLOCK_D, INLINE_PAD=INLINE_PAD, FORMAT=FORMAT,
                         K_SCALE=K_SCALE, K_DYNAMIC=K_DYNAMIC, V_SCALE=V_SCALE,
                         V_DYNAMIC=V_DYNAMIC, OUT_KIND=OUT_KIND, EXACT=EXACT)
    else:
        _dequantize_flat(kc, key_scale_ptr, key_scale_value, ko,
                         vc, value_scale_ptr, value_scale_value, vo, valid, chunk,
                         STRIDE_KC_SLOT=STRIDE_KC_SLOT, STRIDE_KC_HEAD=STRIDE_KC_HEAD,
                         STRIDE_KO_SLOT=STRIDE_KO_SLOT, STRIDE_KO_HEAD=STRIDE_KO_HEAD,
                         STRIDE_VC_SLOT=STRIDE_VC_SLOT, STRIDE_VC_HEAD=STRIDE_VC_HEAD,
                         STRIDE_VO_SLOT=STRIDE_VO_SLOT, STRIDE_VO_HEAD=STRIDE_VO_HEAD,
                         NUM_HEADS=NUM_HEADS, HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, HND=HND,
                         BLOCK=BLOCK, FORMAT=FORMAT, K_SCALE=K_SCALE, V_SCALE=V_SCALE,
                         OUT_KIND=OUT_KIND, IN_PACKED=IN_PACKED, OUT_PACKED=OUT_PACKED,
                         EXACT=EXACT)
    renumber(new_table_ptr, entry, chunk)


@jit
def _dequantize_flat(kc, key_scale_ptr, key_scale_value, ko, vc, value_scale_ptr,
                     value_scale_value, vo, valid, chunk,
                     STRIDE_KC_SLOT: tl.constexpr, STRIDE_KC_HEAD: tl.constexpr,
                     STRIDE_KO_SLOT: tl.constexpr, STRIDE_KO_HEAD: tl.constexpr,
                     STRIDE_VC_SLOT: tl.constexpr, STRIDE_VC_HEAD: tl.constexpr,
                     STRIDE_VO_SLOT: tl.constexpr, STRIDE_VO_HEAD: tl.constexpr,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     HND: tl.constexpr, BLOCK: tl.constexpr, FORMAT: tl.constexpr,
                     K_SCALE: tl.constexpr, V_SCALE: tl.constexpr, OUT_KIND: tl.constexpr,
                     IN_PACKED: tl.constexpr, OUT_PACKED: tl.constexpr, EXACT: tl.constexpr):
    """Static scales: the page as flat ``BLOCK``-element chunks in layout order (contiguous
    bytes when the page is packed, whatever the head_dim). ``kc``/``ko`` (``vc``/``vo``): the
    K (V) cache page and output page. Both sides' loads are issued before either is stored."""
    PAGE_ELEMS: tl.constexpr = PAGE_SIZE * NUM_HEADS * HEAD_DIM
    j = chunk * BLOCK + tl.arange(0, BLOCK)
    in_page = j < PAGE_ELEMS
    # Masks must be boolean blocks: a scalar `valid` broadcast into `in_page & valid` arrives in
    # the interpreter as an integer block, which Triton 3.9's interpreter refuses as a mask.
    load_mask = tl.where(valid, in_page, False)
    key_codes = tl.load(kc + _page_offsets(j, STRIDE_KC_SLOT, STRIDE_KC_HEAD, NUM_HEADS,
                                           HEAD_DIM, PAGE_SIZE, HND, IN_PACKED),
                        mask=load_mask, other=0)
    value_codes = tl.load(vc + _page_offsets(j, STRIDE_VC_SLOT, STRIDE_VC_HEAD, NUM_HEADS,
                                             HEAD_DIM, PAGE_SIZE, HND, IN_PACKED),
                          mask=load_mask, other=0)
    if HND:
        head = j // (PAGE_SIZE * HEAD_DIM)
    else:
        head = (j // HEAD_DIM) % NUM_HEADS
    k = decode(key_codes.to(tl.int32), FORMAT, EXACT)
    v = decode(value_codes.to(tl.int32), FORMAT, EXACT)
    if K_SCALE != SCALE_NONE:
        k = k * load_scale(key_scale_ptr, key_scale_value, head, in_page, K_SCALE)
    if V_SCALE != SCALE_NONE:
        v = v * load_scale(value_scale_ptr, value_scale_value, head, in_page, V_SCALE)
    # Padding pages are zeros (not 0 * scale, which is NaN for an inf scale).
    k_bits = tl.where(valid, fp32_to_output_bits(k, OUT_KIND, EXACT), 0)
    v_bits = tl.where(valid, fp32_to_output_bits(v, OUT_KIND, EXACT), 0)
    tl.store(ko + _page_offsets(j, STRIDE_KO_SLOT, STRIDE_KO_HEAD, NUM_HEADS, HEAD_DIM,
                                PAGE_SIZE, HND, OUT_PACKED),
             k_bits.to(ko.dtype.element_ty), mask=in_page)
    tl.store(vo + _page_offsets(j, STRIDE_VO_SLOT, STRIDE_VO_HEAD, NUM_HEADS, HEAD_DIM,
                                PAGE_SIZE, HND, OUT_PACKED),
             v_bits.to(vo.dtype.element_ty), mask=in_page)


@jit
def _row_scale(scale_ptr, scale_value, codes, row, slot, head, mask, STRIDE_SLOT: tl.constexpr,
               STRIDE_HEAD: tl.constexpr, SCALE: tl.constexpr, DYNAMIC: tl.constexpr,
               HEAD_DIM: tl.constexpr, INLINE_PAD: tl.constexpr):
    """The scale of each row (one slot's head), broadcastable against ``[ROWS, BLOCK_D]``:
    dynamic (``DYNAMIC`` TOKEN or TOKEN_HEAD: inline or from a side array, whose head stride is
    0 per token) or static (``SCALE``)."""
    if DYNAMIC != SCALE_NONE:
        if INLINE_PAD > 0:   # 4 little-endian bytes right after the row's HEAD_DIM codes
            at = codes + (row + HEAD_DIM)
            bits = tl.load(at, mask=mask, other=0).to(tl.int32)
            bits = bits | (tl.load(at + 1, mask=mask, other=0).to(tl.int32) << 8)
            bits = bits | (tl.load(at + 2, mask=mask, other=0).to(tl.int32) << 16)
            bits = bits | (tl.load(at + 3, mask=mask, other=0).to(tl.int32) << 24)
            s = bits.to(tl.float32, bitcast=True)[:, None]
        else:
            s = tl.load(scale_ptr + (slot * STRIDE_SLOT + head * STRIDE_HEAD), mask=mask,
                        other=1.0)[:, None]
    elif SCALE == SCALE_HEAD:
        s = load_scale(scale_ptr, scale_value, head, mask, SCALE)[:, None]
    else:
        s = load_scale(scale_ptr, scale_value, head, mask, SCALE)
    return s


@jit
def _dequantize_rows(kc, ksc, key_scale_value, ko, vc, vsc, value_scale_value, vo, valid, chunk,
                     STRIDE_KC_SLOT: tl.constexpr, STRIDE_KC_HEAD: tl.constexpr,
                     STRIDE_KSC_SLOT: tl.constexpr, STRIDE_KSC_HEAD: tl.constexpr,
                     STRIDE_KO_SLOT: tl.constexpr, STRIDE_KO_HEAD: tl.constexpr,
                     STRIDE_VC_SLOT: tl.constexpr, STRIDE_VC_HEAD: tl.constexpr,
                     STRIDE_VSC_SLOT: tl.constexpr, STRIDE_VSC_HEAD: tl.constexpr,
                     STRIDE_VO_SLOT: tl.constexpr, STRIDE_VO_HEAD: tl.constexpr,
                     NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                     HND: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                     INLINE_PAD: tl.constexpr, FORMAT: tl.constexpr, K_SCALE: tl.constexpr,
                     K_DYNAMIC: tl.constexpr, V_SCALE: tl.constexpr, V_DYNAMIC: tl.constexpr,
                     OUT_KIND: tl.constexpr, EXACT: tl.constexpr):
    """Dynamic scales: ``[ROWS, BLOCK_D]`` tiles, a row being one slot's head (layout order), so
    that each row's scale is loaded once and each row's codes are contiguous (inline rows too).
    ``kc``/``ksc``/``ko``: the K cache page, its side scales' page (the scale pointer where
    static) and the output page; V alike."""
    r = chunk * ROWS + tl.arange(0, ROWS)
    r_mask = r < PAGE_SIZE * NUM_HEADS
    if HND:
        head = r // PAGE_SIZE
        slot = r % PAGE_SIZE
    else:
        slot = r // NUM_HEADS
        head = r % NUM_HEADS
    slot = slot.to(tl.int64)
    head = head.to(tl.int64)
    row_valid = tl.where(valid, r_mask, False)
    d = tl.arange(0, BLOCK_D)
    d_mask = (d < HEAD_DIM)[None, :]
    load_mask = row_valid[:, None] & d_mask
    k_row = slot * STRIDE_KC_SLOT + head * STRIDE_KC_HEAD
    v_row = slot * STRIDE_VC_SLOT + head * STRIDE_VC_HEAD
    k = decode(tl.load(kc + (k_row[:, None] + d[None, :]), mask=load_mask, other=0).to(tl.int32),
               FORMAT, EXACT)
    v = decode(tl.load(vc + (v_row[:, None] + d[None, :]), mask=load_mask, other=0).to(tl.int32),
               FORMAT, EXACT)
    if K_SCALE != SCALE_NONE or K_DYNAMIC != SCALE_NONE:
        k = k * _row_scale(ksc, key_scale_value, kc, k_row, slot, head, row_valid,
                           STRIDE_SLOT=STRIDE_KSC_SLOT, STRIDE_HEAD=STRIDE_KSC_HEAD,
                           SCALE=K_SCALE, DYNAMIC=K_DYNAMIC, HEAD_DIM=HEAD_DIM,
                           INLINE_PAD=INLINE_PAD)
    if V_SCALE != SCALE_NONE or V_DYNAMIC != SCALE_NONE:
        v = v * _row_scale(vsc, value_scale_value, vc, v_row, slot, head, row_valid,
                           STRIDE_SLOT=STRIDE_VSC_SLOT, STRIDE_HEAD=STRIDE_VSC_HEAD,
                           SCALE=V_SCALE, DYNAMIC=V_DYNAMIC, HEAD_DIM=HEAD_DIM,
                           INLINE_PAD=INLINE_PAD)
    # Padding pages are zeros (not 0 * scale, which is NaN for an inf scale).
    k_bits = tl.where(valid, fp32_to_output_bits(k, OUT_KIND, EXACT), 0)
    v_bits = tl.where(valid, fp32_to_output_bits(v, OUT_KIND, EXACT), 0)
    store_mask = r_mask[:, None] & d_mask
    ko_row = slot * STRIDE_KO_SLOT + head * STRIDE_KO_HEAD
    vo_row = slot * STRIDE_VO_SLOT + head * STRIDE_VO_HEAD
    tl.store(ko + (ko_row[:, None] + d[None, :]), k_bits.to(ko.dtype.element_ty), mask=store_mask)
    tl.store(vo + (vo_row[:, None] + d[None, :]), v_bits.to(vo.dtype.element_ty), mask=store_mask)
