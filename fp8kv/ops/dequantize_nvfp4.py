"""Dequantize the NVFP4 pages a block table names into a compact paged cache (bf16/fp16/fp32) or
an FP8 (e4m3) workspace.

Grid: ``(batch * pages_per_seq * CHUNKS,)``, ``CHUNKS = cdiv(page_size * num_heads, ROWS)``,
chunk-major. Program ``i * CHUNKS + c`` reads ``ROWS`` head rows (one slot's head each, in layout
order) of page ``block_table.flat[i]`` from the K and V caches -- ``[ROWS, BLOCK_D / 2]`` bytes of
codes and ``[ROWS, BLOCK_D / 16]`` block scales -- and writes ``[ROWS, BLOCK_D]`` elements of
output page ``i``: each byte's two codes (low nibble first, joined in registers), times their
block's e4m3 scale (exact), times the head's global scale (:func:`codec.nvfp4_values`), then the
output rounding (``OUT.KIND``). An FP8 output (``RNE_sat(v / out_scale)``) is looked up
(``TILE.LOOKUP``, :func:`_lookup_side`): a block's 16 codes have at most 16 values, computed
once per block; where the arrays do not allow the lookup's words, each element divides and
rounds.
Padding entries (< 0, == null_page, or past the cache) give zeros, so every output element is
written; the chunk-0 program of entry ``i`` also writes ``new_block_table.flat[i] = i``.
docs/SPEC.md 12.2 is the rule,
:func:`fp8kv.reference.dequantize_nvfp4` its NumPy twin; :func:`fp8kv.dequantize.plan_dequantize` names
every argument and :func:`fp8kv.dequantize.dequantize_operands` says which array each pointer takes.

A kernel of its own (not a branch of ``_dequantize_pages_kernel``) for the reasons given in
:mod:`fp8kv.ops.write_nvfp4`, and for its FP8 output and its scale. Parameters follow
jax-triton's order; the layout is in the records ``CACHE``, ``OUT`` and ``TILE``
(:mod:`fp8kv.constexprs`), strides in bytes for the caches and block scales, in elements for the
outputs. A combined ``[num_pages, 2, ...]`` cache and output work as in
``_dequantize_pages_kernel``.
"""
import triton.language as tl

from ._dual import jit
from .addressing import (head_rows, output_bits, page_at, page_rows, renumber,
                         table_entry)
from .codec import (OUT_FLOAT8_E4M3FN, SCALE_HEAD, SCALE_NONE, decode, divide_by_out_scale,
                    encode_bytes, fp32_to_output_bits, load_scale, nvfp4_fp8_lookup,
                    nvfp4_fp8_table, nvfp4_values, scalar_reciprocal, scalar_scale)


@jit
def _global_scale(scale, head, r_mask, SIDE: tl.constexpr):
    """A side's global scale (``SIDE.STATIC``; ``scale``: its pointer and host value): one per
    row (``head``: each row's), ``[ROWS]``, or a scalar."""
    scale_ptr, scale_value = scale
    if SIDE.STATIC == SCALE_HEAD:
        g = load_scale(scale_ptr, scale_value, head, r_mask, SIDE.STATIC)
    else:
        g = scalar_scale(scale_ptr, scale_value, SIDE.STATIC)
    return g


@jit
def _lookup_side(page, scale, out_div, rows, valid, SIDE: tl.constexpr,
                 OUT_PAGES: tl.constexpr, CACHE: tl.constexpr, OUT: tl.constexpr,
                 TILE: tl.constexpr, EXACT: tl.constexpr):
    """:func:`_dequantize_side` to FP8 by table lookup (``TILE.LOOKUP``): per block, its table
    (:func:`codec.nvfp4_fp8_table`: the bytes of its 16 codes, computed once) and a lookup of its
    16 codes (:func:`codec.nvfp4_fp8_lookup`), 2 int32 words of codes in, 4 words of bytes out.
    Words, not bytes, so that every step is elementwise whatever layout the compiler gives a
    tensor (a byte tensor's registers pack 4 bytes in an order that is the layout's); the plan
    takes this path where the caches and outputs allow 4-byte words
    (:func:`fp8kv.dequantize.plan_dequantize`)."""
    codes_ptr, blocks_ptr, out_ptr = page
    out_scale, out_reciprocal = out_div
    slot, head, r_mask = rows
    FMT: tl.constexpr = CACHE.FMT
    SF: tl.constexpr = FMT.BLOCK_SCALE
    BLOCKS: tl.constexpr = TILE.BLOCK_D // FMT.BLOCK_SIZE
    ROWS: tl.constexpr = TILE.BLOCK // TILE.BLOCK_D
    # [BLOCKS, ROWS] tiles, blocks first: the compiler then spreads a warp's lanes over a row's
    # consecutive blocks, a thread's block is its 8 bytes of codes in and 16 bytes out, and the
    # loads and stores share a layout (rows first, or [ROWS, BLOCK_D] words, would exchange the
    # outputs through shared memory).
    b = tl.arange(0, BLOCKS)
    mask = (b < CACHE.HEAD_DIM // FMT.BLOCK_SIZE)[:, None] & r_mask[None, :]
    if valid:
        word_rows = slot * (SIDE.CODES.SLOT // 4) + head * (SIDE.CODES.HEAD // 4)
        codes = tl.load(codes_ptr.to(tl.pointer_type(tl.int32))
                        + ((b * 2)[:, None] + word_rows[None, :])[:, :, None]
                        + tl.arange(0, 2)[None, None, :], mask=mask[:, :, None], other=0)
        sf = tl.load(blocks_ptr + b[:, None]
                     + (slot * SIDE.SCALES.SLOT + head * SIDE.SCALES.HEAD)[None, :], mask=mask,
                     other=0)
        sv = decode(sf.to(tl.int32), SF, EXACT)                                  # [BLOCKS, ROWS]
        g = _global_scale(scale, head, r_mask, SIDE)
        if SIDE.STATIC == SCALE_HEAD:
            g = g[None, :]
        low, high, neg_low, neg_high = nvfp4_fp8_table(
            sv, g, out_scale, out_reciprocal, SCALED=SIDE.STATIC != SCALE_NONE, OUT=OUT,
            EXACT=EXACT, RECIPROCAL=TILE.RECIPROCAL_DIV)
        first, second = nvfp4_fp8_lookup(codes, low[:, :, None], high[:, :, None],
                                         neg_low[:, :, None], neg_high[:, :, None], EXACT)
        words = tl.reshape(tl.join(first, second), (BLOCKS, ROWS, 4))
    else:
        words = tl.full((BLOCKS, ROWS, 4), 0, tl.int32)
    tl.store(out_ptr.to(tl.pointer_type(tl.int32))
             + ((b * 4)[:, None] + (slot * (OUT_PAGES.SLOT // 4)
                                    + head * (OUT_PAGES.HEAD // 4))[None, :])[:, :, None]
             + tl.arange(0, 4)[None, None, :], words, mask=mask[:, :, None])


@jit
def _dequantize_side(page, scale, out_div, rows, valid, SIDE: tl.constexpr,
                     OUT_PAGES: tl.constexpr, CACHE: tl.constexpr, OUT: tl.constexpr,
                     TILE: tl.constexpr, EXACT: tl.constexpr):
    """One side's ``[ROWS, BLOCK_D]`` tile. ``page``: its cache page, block-scale page and output
    page (``OUT_PAGES``: the output's strides); ``scale``: its global scale's pointer and host
    value; ``out_div``: an FP8 output's scale and its divisor; ``rows``: each row's slot and
    head, and which rows are in the page; ``valid``: the page is real (else zeros)."""
    if TILE.LOOKUP:   # an FP8 output (the plan sets LOOKUP for no other)
        _lookup_side(page, scale, out_div, rows, valid, SIDE, OUT_PAGES, CACHE, OUT, TILE, EXACT)
    else:
        codes_ptr, blocks_ptr, out_ptr = page
        out_scale, out_reciprocal = out_div
        slot, head, r_mask = rows
        FMT: tl.constexpr = CACHE.FMT
        SF: tl.constexpr = FMT.BLOCK_SCALE
        HEAD_DIM: tl.constexpr = CACHE.HEAD_DIM
        BLOCK_D: tl.constexpr = TILE.BLOCK_D
        BLOCK: tl.constexpr = FMT.BLOCK_SIZE
        BLOCKS: tl.constexpr = BLOCK_D // BLOCK
        ROWS: tl.constexpr = TILE.BLOCK // BLOCK_D
        d = tl.arange(0, BLOCK_D)
        # Padding pages are zeros (not 0 * scale, which is NaN for an inf scale); the branch is
        # the whole program's (one table entry), so valid pages pay no select per element.
        if valid:
            j = tl.arange(0, BLOCK_D // 2)
            b = tl.arange(0, BLOCKS)
            codes = tl.load(codes_ptr + head_rows(slot, head, SIDE, False)[:, None]
                            + j[None, :], mask=r_mask[:, None] & (j < HEAD_DIM // 2)[None, :],
                            other=0).to(tl.int32)
            sf = tl.load(blocks_ptr + head_rows(slot, head, SIDE, True)[:, None] + b[None, :],
                         mask=r_mask[:, None] & (b < HEAD_DIM // BLOCK)[None, :], other=0)
            sv = decode(sf.to(tl.int32), SF, EXACT)[:, :, None]               # [ROWS, BLOCKS, 1]
            g = _global_scale(scale, head, r_mask, SIDE)
            if SIDE.STATIC == SCALE_HEAD:
                g = g[:, None, None]
            # Each block's 8 bytes; element 2i is the low nibble: join (lo, hi), read in order.
            lo, hi = nvfp4_values(tl.reshape(codes, (ROWS, BLOCKS, BLOCK // 2)), sv, g,
                                  SCALED=SIDE.STATIC != SCALE_NONE)
            v = tl.reshape(tl.join(lo, hi), (ROWS, BLOCK_D))
            if OUT.KIND == OUT_FLOAT8_E4M3FN:
                if OUT.SCALE != SCALE_NONE:
                    v = divide_by_out_scale(v, out_scale, out_reciprocal, EXACT,
                                            TILE.RECIPROCAL_DIV)
                # Bytes straight from the conversion: no int32 round trip to unpack and repack.
                OUT_FMT: tl.constexpr = OUT.FMT
                bits = encode_bytes(v, OUT_FMT, EXACT)
            else:
                bits = fp32_to_output_bits(v, OUT.KIND, EXACT).to(out_ptr.dtype.element_ty)
        else:
            bits = tl.full((ROWS, BLOCK_D), 0, out_ptr.dtype.element_ty)
        tl.store(out_ptr + head_rows(slot, head, OUT_PAGES, None)[:, None] + d[None, :],
                 bits, mask=r_mask[:, None] & (d < HEAD_DIM)[None, :])


@jit(do_not_specialize=["pages_per_seq"])
def _dequantize_nvfp4_kernel(
    key_cache_ptr, value_cache_ptr, table_ptr, key_scale_ptr, value_scale_ptr, key_block_ptr,
    value_block_ptr, out_scale_ptr,
    pages_per_seq, stride_table_seq, stride_table_page, num_pages, null_page,
    key_scale_value, value_scale_value, out_scale_value,
    key_out_ptr, value_out_ptr, new_table_ptr,
    CACHE: tl.constexpr, OUT: tl.constexpr, TILE: tl.constexpr, EXACT: tl.constexpr,
):
    # Records passed on to helpers are bound to constexpr names first (Triton 3.6).
    KEY: tl.constexpr = CACHE.KEY
    VALUE: tl.constexpr = CACHE.VALUE
    KEY_OUT: tl.constexpr = OUT.KEY
    VALUE_OUT: tl.constexpr = OUT.VALUE
    ROWS: tl.constexpr = TILE.BLOCK // TILE.BLOCK_D
    CHUNKS: tl.constexpr = (CACHE.PAGE_SIZE * CACHE.NUM_HEADS + ROWS - 1) // ROWS
    entry, chunk, page, valid = table_entry(
        table_ptr, pages_per_seq, stride_table_seq, stride_table_page, num_pages, null_page,
        CHUNKS=CHUNKS, HAS_NULL_PAGE=TILE.HAS_NULL_PAGE)
    # The out scale and its reciprocal first: their round trip overlaps the rows'.
    o_s = scalar_scale(out_scale_ptr, out_scale_value, OUT.SCALE)
    o_y = scalar_reciprocal(o_s, OUT.SCALE, EXACT, TILE.RECIPROCAL_DIV)

    key_dst, value_dst = output_bits(key_out_ptr, value_out_ptr, OUT_KIND=OUT.KIND,
                                     COMBINED=CACHE.COMBINED)
    rows = page_rows(chunk, ROWS, CACHE.PAGE_SIZE, CACHE.NUM_HEADS, TILE.HND)
    key_page = (page_at(key_cache_ptr.to(tl.pointer_type(tl.uint8)), page, KEY, False),
                page_at(key_block_ptr.to(tl.pointer_type(tl.uint8)), page, KEY, True),
                page_at(key_dst, entry, KEY_OUT, None))
    _dequantize_side(key_page, (key_scale_ptr, key_scale_value), (o_s, o_y), rows, valid, KEY,
                     KEY_OUT, CACHE, OUT, TILE, EXACT)
    value_page = (page_at(value_cache_ptr.to(tl.pointer_type(tl.uint8)), page, VALUE, False),
                  page_at(value_block_ptr.to(tl.pointer_type(tl.uint8)), page, VALUE, True),
                  page_at(value_dst, entry, VALUE_OUT, None))
    _dequantize_side(value_page, (value_scale_ptr, value_scale_value), (o_s, o_y), rows, valid,
                     VALUE, VALUE_OUT, CACHE, OUT, TILE, EXACT)
    renumber(new_table_ptr, entry, chunk)
