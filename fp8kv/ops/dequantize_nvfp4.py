"""Dequantize the NVFP4 pages a block table names into a compact paged cache (bf16/fp16/fp32) or
an FP8 (e4m3) workspace.

Grid: ``(batch * pages_per_seq * CHUNKS,)``, ``CHUNKS = cdiv(page_size * num_heads, ROWS)``,
chunk-major. Program ``i * CHUNKS + c`` reads ``ROWS`` head rows (one slot's head each, in layout
order) of page ``block_table.flat[i]`` from the K and V caches -- ``[ROWS, BLOCK_D / 2]`` bytes of
codes and ``[ROWS, BLOCK_D / 16]`` block scales -- and writes ``[ROWS, BLOCK_D]`` elements of
output page ``i``: each byte's two codes (low nibble first, joined in registers), times their
block's e4m3 scale (exact), times the head's global scale (:func:`codec.nvfp4_values`), then the
output rounding (``OUT_KIND``). An FP8 output (``RNE_sat(v / out_scale)``) is looked up
(``LOOKUP``, :func:`_lookup_side`): a block's 16 codes have at most 16 values, computed once per
block; where the arrays do not allow the lookup's words, each element divides and rounds.
Padding entries (< 0, == null_page, or past the cache) give zeros, so every output element is
written; the chunk-0 program of entry ``i`` also writes ``new_block_table.flat[i] = i``.
docs/SPEC.md 12.2 is the rule,
:func:`fp8kv.reference.dequantize_nvfp4` its NumPy twin; :func:`fp8kv.plan.plan_dequantize` names
every argument and :func:`fp8kv.operands.dequantize_operands` says which array each pointer takes.

A kernel of its own (not a branch of ``_dequantize_pages_kernel``) for the reasons given in
:mod:`fp8kv.ops.write_nvfp4`, and for its FP8 output and its scale. Parameters follow
jax-triton's order; strides are constexprs, in bytes for the caches and block scales, in elements
for the outputs. A combined ``[num_pages, 2, ...]`` cache and output work as in
``_dequantize_pages_kernel`` (``VALUE_CACHE_OFFSET``, ``VALUE_OUT_OFFSET``, ``SHARED_OUT``).
"""
import triton.language as tl

from ._dual import jit
from .codec import (FMT_E4M3, NVFP4_BLOCK, OUT_FLOAT8_E4M3FN, SCALE_HEAD, SCALE_NONE, decode,
                    divide_by_out_scale, encode_bytes, fp32_to_output_bits, load_scale,
                    nvfp4_e4m3_lookup, nvfp4_e4m3_table, nvfp4_values, scalar_reciprocal,
                    scalar_scale)
from .table import output_bits, renumber, table_entry


@jit
def _lookup_side(codes_ptr, blocks_ptr, out_ptr, scale_ptr, scale_value, out_scale, out_reciprocal,
                 slot, head, r_mask, valid,
                 STRIDE_C_SLOT: tl.constexpr, STRIDE_C_HEAD: tl.constexpr,
                 STRIDE_B_SLOT: tl.constexpr, STRIDE_B_HEAD: tl.constexpr,
                 STRIDE_O_SLOT: tl.constexpr, STRIDE_O_HEAD: tl.constexpr,
                 KIND: tl.constexpr, OUT_SCALE: tl.constexpr, HEAD_DIM: tl.constexpr,
                 ROWS: tl.constexpr, BLOCK_D: tl.constexpr, RECIPROCAL_DIV: tl.constexpr,
                 EXACT: tl.constexpr):
    """:func:`_dequantize_side` to FP8 by table lookup (``LOOKUP``): per block, its table
    (:func:`codec.nvfp4_e4m3_table`: the e4m3 bytes of its 16 codes, computed once) and a
    lookup of its 16 codes (:func:`codec.nvfp4_e4m3_lookup`), 2 int32 words of codes in, 4 words
    of bytes out. Words, not bytes, so that every step is elementwise whatever layout the
    compiler gives a tensor (a byte tensor's registers pack 4 bytes in an order that is the
    layout's); the plan takes this path where the caches and outputs allow 4-byte words
    (:func:`fp8kv.plan.plan_dequantize`)."""
    BLOCKS: tl.constexpr = BLOCK_D // NVFP4_BLOCK
    # [BLOCKS, ROWS] tiles, blocks first: the compiler then spreads a warp's lanes over a row's
    # consecutive blocks, a thread's block is its 8 bytes of codes in and 16 bytes out, and the
    # loads and stores share a layout (rows first, or [ROWS, BLOCK_D] words, cost 6-8 % more
    # time: an exchange of outputs through shared memory; bench/NOTES.md).
    b = tl.arange(0, BLOCKS)
    mask = (b < HEAD_DIM // NVFP4_BLOCK)[:, None] & r_mask[None, :]
    if valid:
        codes = tl.load(codes_ptr.to(tl.pointer_type(tl.int32))
                        + ((b * 2)[:, None] + (slot * (STRIDE_C_SLOT // 4)
                                               + head * (STRIDE_C_HEAD // 4))[None, :])[:, :, None]
                        + tl.arange(0, 2)[None, None, :], mask=mask[:, :, None], other=0)
        sf = tl.load(blocks_ptr + b[:, None]
                     + (slot * STRIDE_B_SLOT + head * STRIDE_B_HEAD)[None, :], mask=mask, other=0)
        sv = decode(sf.to(tl.int32), FMT_E4M3, EXACT)                            # [BLOCKS, ROWS]
        if KIND == SCALE_HEAD:
            g = load_scale(scale_ptr, scale_value, head, r_mask, KIND)[None, :]
        else:
            g = scalar_scale(scale_ptr, scale_value, KIND)
        low, high, neg_low, neg_high = nvfp4_e4m3_table(
            sv, g, out_scale, out_reciprocal, SCALED=KIND != SCALE_NONE, OUT_SCALE=OUT_SCALE,
            EXACT=EXACT, RECIPROCAL=RECIPROCAL_DIV)
        first, second = nvfp4_e4m3_lookup(codes, low[:, :, None], high[:, :, None],
                                          neg_low[:, :, None], neg_high[:, :, None], EXACT)
        words = tl.reshape(tl.join(first, second), (BLOCKS, ROWS, 4))
    else:
        words = tl.full((BLOCKS, ROWS, 4), 0, tl.int32)
    tl.store(out_ptr.to(tl.pointer_type(tl.int32))
             + ((b * 4)[:, None] + (slot * (STRIDE_O_SLOT // 4)
                                    + head * (STRIDE_O_HEAD // 4))[None, :])[:, :, None]
             + tl.arange(0, 4)[None, None, :], words, mask=mask[:, :, None])


@jit
def _dequantize_side(codes_ptr, blocks_ptr, out_ptr, scale_ptr, scale_value, out_scale,
                     out_reciprocal, slot, head, r_mask, valid,
                     STRIDE_C_SLOT: tl.constexpr, STRIDE_C_HEAD: tl.constexpr,
                     STRIDE_B_SLOT: tl.constexpr, STRIDE_B_HEAD: tl.constexpr,
                     STRIDE_O_SLOT: tl.constexpr, STRIDE_O_HEAD: tl.constexpr,
                     KIND: tl.constexpr, OUT_SCALE: tl.constexpr, HEAD_DIM: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_D: tl.constexpr, OUT_KIND: tl.constexpr,
                     RECIPROCAL_DIV: tl.constexpr, LOOKUP: tl.constexpr, EXACT: tl.constexpr):
    """One side's ``[ROWS, BLOCK_D]`` tile: ``codes_ptr`` / ``blocks_ptr`` / ``out_ptr`` are its
    cache page, block-scale page and output page; ``slot``/``head`` each row's."""
    if LOOKUP:   # an FP8 output (the plan sets LOOKUP for no other)
        _lookup_side(codes_ptr, blocks_ptr, out_ptr, scale_ptr, scale_value, out_scale,
                     out_reciprocal, slot, head, r_mask, valid,
                     STRIDE_C_SLOT=STRIDE_C_SLOT, STRIDE_C_HEAD=STRIDE_C_HEAD,
                     STRIDE_B_SLOT=STRIDE_B_SLOT, STRIDE_B_HEAD=STRIDE_B_HEAD,
                     STRIDE_O_SLOT=STRIDE_O_SLOT, STRIDE_O_HEAD=STRIDE_O_HEAD, KIND=KIND,
                     OUT_SCALE=OUT_SCALE, HEAD_DIM=HEAD_DIM, ROWS=ROWS, BLOCK_D=BLOCK_D,
                     RECIPROCAL_DIV=RECIPROCAL_DIV, EXACT=EXACT)
    else:
        BLOCKS: tl.constexpr = BLOCK_D // NVFP4_BLOCK
        d = tl.arange(0, BLOCK_D)
        # Padding pages are zeros (not 0 * scale, which is NaN for an inf scale); the branch is
        # the whole program's (one table entry), so valid pages pay no select per element.
        if valid:
            j = tl.arange(0, BLOCK_D // 2)
            b = tl.arange(0, BLOCKS)
            codes = tl.load(codes_ptr + (slot * STRIDE_C_SLOT + head * STRIDE_C_HEAD)[:, None]
                            + j[None, :], mask=r_mask[:, None] & (j < HEAD_DIM // 2)[None, :],
                            other=0).to(tl.int32)
            sf = tl.load(blocks_ptr + (slot * STRIDE_B_SLOT + head * STRIDE_B_HEAD)[:, None]
                         + b[None, :],
                         mask=r_mask[:, None] & (b < HEAD_DIM // NVFP4_BLOCK)[None, :], other=0)
            sv = decode(sf.to(tl.int32), FMT_E4M3, EXACT)[:, :, None]        # [ROWS, BLOCKS, 1]
            if KIND == SCALE_HEAD:
                g = load_scale(scale_ptr, scale_value, head, r_mask, KIND)[:, None, None]
            else:
                g = scalar_scale(scale_ptr, scale_value, KIND)
            # Each block's 8 bytes; element 2i is the low nibble: join (lo, hi), read in order.
            lo, hi = nvfp4_values(tl.reshape(codes, (ROWS, BLOCKS, NVFP4_BLOCK // 2)), sv, g,
                                  SCALED=KIND != SCALE_NONE)
            v = tl.reshape(tl.join(lo, hi), (ROWS, BLOCK_D))
            if OUT_KIND == OUT_FLOAT8_E4M3FN:
                if OUT_SCALE != SCALE_NONE:
                    v = divide_by_out_scale(v, out_scale, out_reciprocal, EXACT, RECIPROCAL_DIV)
                # Bytes straight from the conversion: no int32 round trip to unpack and repack.
                bits = encode_bytes(v, FMT_E4M3, EXACT)
            else:
                bits = fp32_to_output_bits(v, OUT_KIND, EXACT).to(out_ptr.dtype.element_ty)
        else:
            bits = tl.full((ROWS, BLOCK_D), 0, out_ptr.dtype.element_ty)
        tl.store(out_ptr + (slot * STRIDE_O_SLOT + head * STRIDE_O_HEAD)[:, None] + d[None, :],
                 bits, mask=r_mask[:, None] & (d < HEAD_DIM)[None, :])


@jit(do_not_specialize=["pages_per_seq"])
def _dequantize_nvfp4_kernel(
    key_cache_ptr, value_cache_ptr, table_ptr, key_scale_ptr, value_scale_ptr, key_block_ptr,
    value_block_ptr, out_scale_ptr,
    pages_per_seq, stride_table_seq, stride_table_page, num_pages, null_page,
    key_scale_value, value_scale_value, out_scale_value,
    key_out_ptr, value_out_ptr, new_table_ptr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    STRIDE_KC_PAGE: tl.constexpr, STRIDE_KC_SLOT: tl.constexpr, STRIDE_KC_HEAD: tl.constexpr,
    STRIDE_VC_PAGE: tl.constexpr, STRIDE_VC_SLOT: tl.constexpr, STRIDE_VC_HEAD: tl.constexpr,
    VALUE_CACHE_OFFSET: tl.constexpr,
    STRIDE_KB_PAGE: tl.constexpr, STRIDE_KB_SLOT: tl.constexpr, STRIDE_KB_HEAD: tl.constexpr,
    STRIDE_VB_PAGE: tl.constexpr, STRIDE_VB_SLOT: tl.constexpr, STRIDE_VB_HEAD: tl.constexpr,
    STRIDE_KO_PAGE: tl.constexpr, STRIDE_KO_SLOT: tl.constexpr, STRIDE_KO_HEAD: tl.constexpr,
    STRIDE_VO_PAGE: tl.constexpr, STRIDE_VO_SLOT: tl.constexpr, STRIDE_VO_HEAD: tl.constexpr,
    VALUE_OUT_OFFSET: tl.constexpr,
    K_SCALE: tl.constexpr, V_SCALE: tl.constexpr, OUT_SCALE: tl.constexpr, HND: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_D: tl.constexpr, OUT_KIND: tl.constexpr,
    HAS_NULL_PAGE: tl.constexpr, SHARED_OUT: tl.constexpr, RECIPROCAL_DIV: tl.constexpr,
    LOOKUP: tl.constexpr, EXACT: tl.constexpr,
):
    CHUNKS: tl.constexpr = (PAGE_SIZE * NUM_HEADS + ROWS - 1) // ROWS
    entry, chunk, page, valid = table_entry(
        table_ptr, pages_per_seq, stride_table_seq, stride_table_page, num_pages, null_page,
        CHUNKS=CHUNKS, HAS_NULL_PAGE=HAS_NULL_PAGE)
    # The out scale and its reciprocal first: their round trip overlaps the rows'.
    o_s = scalar_scale(out_scale_ptr, out_scale_value, OUT_SCALE)
    o_y = scalar_reciprocal(o_s, OUT_SCALE, EXACT, RECIPROCAL_DIV)

    key_dst, value_dst = output_bits(key_out_ptr, value_out_ptr, OUT_KIND=OUT_KIND,
                                     SHARED_OUT=SHARED_OUT)
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
    codes = key_cache_ptr.to(tl.pointer_type(tl.uint8))
    blocks = key_block_ptr.to(tl.pointer_type(tl.uint8))
    _dequantize_side(codes + page * STRIDE_KC_PAGE, blocks + page * STRIDE_KB_PAGE,
                     key_dst + entry * STRIDE_KO_PAGE, key_scale_ptr, key_scale_value, o_s, o_y,
                     slot, head, r_mask, valid,
                     STRIDE_C_SLOT=STRIDE_KC_SLOT, STRIDE_C_HEAD=STRIDE_KC_HEAD,
                     STRIDE_B_SLOT=STRIDE_KB_SLOT, STRIDE_B_HEAD=STRIDE_KB_HEAD,
                     STRIDE_O_SLOT=STRIDE_KO_SLOT, STRIDE_O_HEAD=STRIDE_KO_HEAD, KIND=K_SCALE,
                     OUT_SCALE=OUT_SCALE, HEAD_DIM=HEAD_DIM, ROWS=ROWS, BLOCK_D=BLOCK_D,
                     OUT_KIND=OUT_KIND, RECIPROCAL_DIV=RECIPROCAL_DIV, LOOKUP=LOOKUP, EXACT=EXACT)
    codes = value_cache_ptr.to(tl.pointer_type(tl.uint8))
    blocks = value_block_ptr.to(tl.pointer_type(tl.uint8))
    _dequantize_side(codes + (page * STRIDE_VC_PAGE + VALUE_CACHE_OFFSET),
                     blocks + page * STRIDE_VB_PAGE,
                     value_dst + (entry * STRIDE_VO_PAGE + VALUE_OUT_OFFSET), value_scale_ptr,
                     value_scale_value, o_s, o_y, slot, head, r_mask, valid,
                     STRIDE_C_SLOT=STRIDE_VC_SLOT, STRIDE_C_HEAD=STRIDE_VC_HEAD,
                     STRIDE_B_SLOT=STRIDE_VB_SLOT, STRIDE_B_HEAD=STRIDE_VB_HEAD,
                     STRIDE_O_SLOT=STRIDE_VO_SLOT, STRIDE_O_HEAD=STRIDE_VO_HEAD, KIND=V_SCALE,
                     OUT_SCALE=OUT_SCALE, HEAD_DIM=HEAD_DIM, ROWS=ROWS, BLOCK_D=BLOCK_D,
                     OUT_KIND=OUT_KIND, RECIPROCAL_DIV=RECIPROCAL_DIV, LOOKUP=LOOKUP, EXACT=EXACT)
    renumber(new_table_ptr, entry, chunk)
