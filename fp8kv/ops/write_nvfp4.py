"""Fused NVFP4 quantize + scatter of new K/V rows into a paged cache (one launch for K and V).

Grid: ``(cdiv(num_tokens, BLOCK_T),)``. A program owns ``BLOCK_T`` tokens. Per side it loads their
whole rows as four ``[BLOCK_T, BLOCK_H, BLOCK_D / 32, 8]`` pieces (:func:`_load_piece`: groups of
two blocks of 16, held whole by one thread; with ``TILE.BLOCKWISE``, for small batches, as
``[BLOCK_T, BLOCK_H, BLOCK_D / 16, 16]`` blocks over two threads each, :func:`_load_blocks`),
reduces each block to its amax, computes the block's
e4m3 scale and dequant scale ``d`` (:func:`codec.nvfp4_block_scales`), rounds ``x / d`` to E2M1
codes (:func:`codec.divide_by_block_scale`, :func:`codec.encode_e2m1`), packs code pairs into
bytes in registers (element ``2i`` in the low nibble) and stores 16 bytes of codes per group and
the group's two block scales. Slots below zero (padding) or past the cache write nothing.
docs/SPEC.md section 13 is the rule, :func:`fp8kv.reference.quantize_nvfp4` its NumPy twin;
:func:`fp8kv.write.plan_write` names every argument and :func:`fp8kv.write.write_operands` says
which array each pointer takes.

Why a kernel of its own rather than branches of ``_write_kv_kernel``: a side has a global scale
(``*_scale_ptr``, a static kind) *and* block scales (``*_block_ptr``, read for JAX's aliasing and
written through ``*_block_out_ptr``), so the operands differ; codes are packed two per byte, so
every cache offset and width differs; and the FP8 kernel, tuned on its own, keeps its code.

Parameters follow jax-triton's order (input arrays, scalars, outputs, constexprs) and are bound
by name (:mod:`fp8kv.binding`); the layout is in the records ``CACHE``, ``ROWS`` and ``TILE``
(:mod:`fp8kv.constexprs`; strides in bytes for the uint8 caches and block scales).
``TILE.BLOCK_D`` (a power of two, at least 32) covers ``HEAD_DIM``. A combined
``[num_pages, 2, ...]`` cache is passed as both caches, V its strides' ``OFFSET`` bytes in,
written through the K output (``CACHE.COMBINED``). Offsets are int32, or int64
(``TILE.OFFSETS_64``) where an array reaches past 2**31 elements.
"""
import triton.language as tl

from ._dual import jit
from .addressing import cache_bytes, slot_rows, token_slots
from .codec import (SCALE_HEAD, block_reciprocal, divide_by_block_scale, encode_e2m1, load_raw,
                    load_scale, max_combine, nvfp4_block_scales, nvfp4_sign_mask, raw_to_fp32,
                    scalar_scale)


# A program's tiles are [BLOCK_T, BLOCK_H, BLOCK_D / GROUP, PIECE] pieces: piece p of group g of a
# head row is its elements GROUP g + PIECE p .. + PIECE - 1. Triton gives a thread at most 16
# bytes (8 bf16) of one load, so a row loaded whole would split each block of 16 over two
# threads (a shuffle for the amax, every block scale computed twice). Four loads of 8-element
# pieces have the same layout: each thread holds whole groups of two blocks (pieces 0-1 and 2-3)
# and owns 16 bytes of their codes.
PIECE: tl.constexpr = tl.constexpr(8)
GROUP: tl.constexpr = tl.constexpr(32)


@jit
def _global_scale(scale_ptr, scale_value, KIND: tl.constexpr, NUM_HEADS: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """A side's global scale: ``[1, BLOCK_H, 1]`` per head (1 for masked heads), else a scalar
    (``scale_value``, 1.0 for NONE)."""
    if KIND == SCALE_HEAD:
        h = tl.arange(0, BLOCK_H)
        g = load_scale(scale_ptr, scale_value, h, h < NUM_HEADS, KIND)[None, :, None]
    else:
        g = scalar_scale(scale_ptr, scale_value, KIND)
    return g


@jit
def _load_columns(x_ptr, row, in_range, col, STRIDE_HEAD: tl.constexpr, NUM_HEADS: tl.constexpr,
                  HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, EXACT: tl.constexpr):
    """Columns ``col`` (a ``[n, w]`` tile of head-row columns) of every head of the tokens' rows
    (``row``: each token's offset), as stored (bf16 as bits when EXACT): ``[BLOCK_T, BLOCK_H, n,
    w]``."""
    h = tl.arange(0, BLOCK_H)
    offsets = (row[:, None, None, None] + (h * STRIDE_HEAD)[None, :, None, None]
               + col[None, None, :, :])
    mask = (in_range[:, None, None, None] & (h < NUM_HEADS)[None, :, None, None]
            & (col < HEAD_DIM)[None, None, :, :])
    return load_raw(x_ptr, offsets, mask, EXACT)


@jit
def _load_piece(x_ptr, row, in_range, piece: tl.constexpr, STRIDE_HEAD: tl.constexpr,
                CACHE: tl.constexpr, TILE: tl.constexpr, EXACT: tl.constexpr):
    """Piece ``piece`` of every group of the tokens' rows: ``[BLOCK_T, BLOCK_H, BLOCK_D / GROUP,
    PIECE]`` (:func:`_load_columns`)."""
    col = ((tl.arange(0, TILE.BLOCK_D // GROUP) * GROUP)[:, None]
           + (piece * PIECE + tl.arange(0, PIECE)))
    return _load_columns(x_ptr, row, in_range, col, STRIDE_HEAD, CACHE.NUM_HEADS, CACHE.HEAD_DIM,
                         TILE.BLOCK_H, EXACT)


@jit
def _load_pieces(x_ptr, row, in_range, STRIDE_HEAD: tl.constexpr, CACHE: tl.constexpr,
                 TILE: tl.constexpr, EXACT: tl.constexpr):
    """The four pieces of one side's rows (:func:`_load_piece`), all loads in flight at once."""
    return (_load_piece(x_ptr, row, in_range, 0, STRIDE_HEAD, CACHE, TILE, EXACT),
            _load_piece(x_ptr, row, in_range, 1, STRIDE_HEAD, CACHE, TILE, EXACT),
            _load_piece(x_ptr, row, in_range, 2, STRIDE_HEAD, CACHE, TILE, EXACT),
            _load_piece(x_ptr, row, in_range, 3, STRIDE_HEAD, CACHE, TILE, EXACT))


@jit
def _magnitudes(x, EXACT: tl.constexpr):
    """``|x|``; on the exact path NaN as 0 (the interpreter's maximum propagates NaN, the GPU's
    max.f32 drops it: max_combine)."""
    a = tl.abs(x)
    if EXACT:
        a = tl.where(x != x, 0.0, a)
    return a


@jit
def _amax_over_last(a):
    """The amax over the last axis of magnitudes ``a`` (:func:`_magnitudes`). max.f32 of two
    NaNs is NaN: a block of NaNs alone reduces to NaN, whose amax is 0."""
    amax = tl.reduce(a, 3, max_combine)
    return tl.where(amax != amax, 0.0, amax)


@jit
def _block_amax(x0, x1, EXACT: tl.constexpr):
    """The amax of the blocks made of pieces ``x0`` and ``x1``, NaN counting as 0."""
    return _amax_over_last(tl.maximum(_magnitudes(x0, EXACT), _magnitudes(x1, EXACT)))


@jit
def _piece_bytes(x, d, y, fast, sign_mask, FMT: tl.constexpr, EXACT: tl.constexpr):
    """The ``PIECE / 2`` bytes of a piece's codes (element 2i in the low nibble)."""
    codes = encode_e2m1(divide_by_block_scale(x, d, y, fast, EXACT), sign_mask, FMT)
    lo, hi = tl.split(tl.reshape(codes, (x.shape[0], x.shape[1], x.shape[2], PIECE // 2, 2)))
    return (lo | (hi << 4)).to(tl.uint8)


@jit
def _write_side(pieces, g, dst, row, block_dst, block_row, keep, SIDE: tl.constexpr,
                CACHE: tl.constexpr, TILE: tl.constexpr, EXACT: tl.constexpr):
    """Quantize one side's pieces (:func:`_load_pieces`) with global scale ``g`` and store their
    codes (at ``dst + row``: each token's cache row) and block scales (``block_dst +
    block_row``)."""
    FMT: tl.constexpr = CACHE.FMT
    BLOCK_H: tl.constexpr = TILE.BLOCK_H
    BLOCK_D: tl.constexpr = TILE.BLOCK_D
    HEAD_DIM: tl.constexpr = CACHE.HEAD_DIM
    r0, r1, r2, r3 = pieces
    x0, x1 = raw_to_fp32(r0, EXACT), raw_to_fp32(r1, EXACT)
    x2, x3 = raw_to_fp32(r2, EXACT), raw_to_fp32(r3, EXACT)
    amax0, amax1 = _block_amax(x0, x1, EXACT), _block_amax(x2, x3, EXACT)   # [T, H, groups]
    sf0, d0 = nvfp4_block_scales(amax0, g, FMT, EXACT)   # g = 1.0 without a global scale: exact
    sf1, d1 = nvfp4_block_scales(amax1, g, FMT, EXACT)
    fast0, y0 = block_reciprocal(d0, amax0, EXACT)
    fast1, y1 = block_reciprocal(d1, amax1, EXACT)
    fast = fast0 * fast1
    d0, y0, m0 = d0[:, :, :, None], y0[:, :, :, None], nvfp4_sign_mask(d0)[:, :, :, None]
    d1, y1, m1 = d1[:, :, :, None], y1[:, :, :, None], nvfp4_sign_mask(d1)[:, :, :, None]
    # A group's 16 bytes in order: pieces 0..3, each PIECE / 2 bytes.
    b01 = tl.join(_piece_bytes(x0, d0, y0, fast, m0, FMT, EXACT),
                  _piece_bytes(x1, d0, y0, fast, m0, FMT, EXACT))
    b23 = tl.join(_piece_bytes(x2, d1, y1, fast, m1, FMT, EXACT),
                  _piece_bytes(x3, d1, y1, fast, m1, FMT, EXACT))
    packed = tl.reshape(tl.permute(tl.join(b01, b23), (0, 1, 2, 5, 4, 3)),
                        (r0.shape[0], BLOCK_H, BLOCK_D // GROUP, GROUP // 2))
    h = tl.arange(0, BLOCK_H)
    h_mask = keep[:, None, None, None] & (h < CACHE.NUM_HEADS)[None, :, None, None]
    j = (tl.arange(0, BLOCK_D // GROUP) * (GROUP // 2))[:, None] + tl.arange(0, GROUP // 2)
    tl.store(dst + (row[:, None, None, None] + (h * SIDE.CODES.HEAD)[None, :, None, None]
                    + j[None, None, :, :]),
             packed, mask=h_mask & (j < HEAD_DIM // 2)[None, None, :, :])
    b = (tl.arange(0, BLOCK_D // GROUP) * (GROUP // FMT.BLOCK_SIZE))[:, None] + tl.arange(0, 2)
    tl.store(block_dst + (block_row[:, None, None, None]
                          + (h * SIDE.SCALES.HEAD)[None, :, None, None] + b[None, None, :, :]),
             tl.join(sf0, sf1).to(tl.uint8),
             mask=h_mask & (b < HEAD_DIM // FMT.BLOCK_SIZE)[None, None, :, :])


@jit
def _load_blocks(x_ptr, row, in_range, STRIDE_HEAD: tl.constexpr, CACHE: tl.constexpr,
                 TILE: tl.constexpr, EXACT: tl.constexpr):
    """The tokens' whole rows as ``[BLOCK_T, BLOCK_H, BLOCK_D / 16, 16]`` blocks
    (:func:`_load_columns`): the ``BLOCKWISE`` layout, where two threads share a block (8
    elements, 16 bytes each)."""
    BLOCK: tl.constexpr = CACHE.FMT.BLOCK_SIZE
    col = (tl.arange(0, TILE.BLOCK_D // BLOCK) * BLOCK)[:, None] + tl.arange(0, BLOCK)
    return _load_columns(x_ptr, row, in_range, col, STRIDE_HEAD, CACHE.NUM_HEADS, CACHE.HEAD_DIM,
                         TILE.BLOCK_H, EXACT)


@jit
def _write_blocks(raw, g, dst, row, block_dst, block_row, keep, SIDE: tl.constexpr,
                  CACHE: tl.constexpr, TILE: tl.constexpr, EXACT: tl.constexpr):
    """:func:`_write_side` for ``BLOCKWISE`` tiles (:func:`_load_blocks`): the amax of a block
    is a reduction over its two threads, and each thread divides, encodes and stores its 8
    elements (4 bytes of codes) -- a quarter of a group's work per thread, for batches too small
    to fill the GPU, where a thread's chain of work is the latency."""
    FMT: tl.constexpr = CACHE.FMT
    BLOCK: tl.constexpr = FMT.BLOCK_SIZE
    BLOCK_H: tl.constexpr = TILE.BLOCK_H
    BLOCK_D: tl.constexpr = TILE.BLOCK_D
    HEAD_DIM: tl.constexpr = CACHE.HEAD_DIM
    x = raw_to_fp32(raw, EXACT)
    amax = _amax_over_last(_magnitudes(x, EXACT))
    sf, d = nvfp4_block_scales(amax, g, FMT, EXACT)
    fast, y = block_reciprocal(d, amax, EXACT)
    codes = encode_e2m1(divide_by_block_scale(x, d[:, :, :, None], y[:, :, :, None], fast, EXACT),
                        nvfp4_sign_mask(d)[:, :, :, None], FMT)
    lo, hi = tl.split(tl.reshape(codes, (x.shape[0], BLOCK_H, BLOCK_D // BLOCK, BLOCK // 2, 2)))
    h = tl.arange(0, BLOCK_H)
    h_mask = keep[:, None, None] & (h < CACHE.NUM_HEADS)[None, :, None]
    j = (tl.arange(0, BLOCK_D // BLOCK) * (BLOCK // 2))[:, None] + tl.arange(0, BLOCK // 2)
    tl.store(dst + (row[:, None, None, None] + (h * SIDE.CODES.HEAD)[None, :, None, None]
                    + j[None, None, :, :]),
             (lo | (hi << 4)).to(tl.uint8),
             mask=h_mask[:, :, :, None] & (j < HEAD_DIM // 2)[None, None, :, :])
    b = tl.arange(0, BLOCK_D // BLOCK)
    tl.store(block_dst + (block_row[:, None, None] + (h * SIDE.SCALES.HEAD)[None, :, None]
                          + b[None, None, :]),
             sf.to(tl.uint8), mask=h_mask & (b < HEAD_DIM // BLOCK)[None, None, :])


@jit(do_not_specialize=["num_tokens"])
def _write_nvfp4_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, key_scale_ptr, value_scale_ptr,
    key_block_ptr, value_block_ptr,
    num_tokens, num_slots, key_scale_value, value_scale_value,
    key_cache_out_ptr, value_cache_out_ptr, key_block_out_ptr, value_block_out_ptr,
    CACHE: tl.constexpr, ROWS: tl.constexpr, TILE: tl.constexpr, EXACT: tl.constexpr,
):
    KEY: tl.constexpr = CACHE.KEY
    VALUE: tl.constexpr = CACHE.VALUE
    tok, in_range, keep, page, off = token_slots(slot_ptr, num_tokens, num_slots,
                                                 BLOCK_T=TILE.BLOCK_T, PAGE_SIZE=CACHE.PAGE_SIZE,
                                                 OFFSETS_64=TILE.OFFSETS_64)
    key_dst, value_dst = cache_bytes(key_cache_out_ptr, value_cache_out_ptr, CACHE.COMBINED)
    # Block scales may be typed float8_e4m3fn: stored as their bytes.
    key_blocks = key_block_out_ptr.to(tl.pointer_type(tl.uint8))
    value_blocks = value_block_out_ptr.to(tl.pointer_type(tl.uint8))
    # Global scales are loaded before the rows, so that their round trip overlaps the rows'.
    kg = _global_scale(key_scale_ptr, key_scale_value, KEY.STATIC, CACHE.NUM_HEADS, TILE.BLOCK_H)
    vg = _global_scale(value_scale_ptr, value_scale_value, VALUE.STATIC, CACHE.NUM_HEADS,
                       TILE.BLOCK_H)
    key_in = tok * ROWS.KEY.TOKEN
    value_in = tok * ROWS.VALUE.TOKEN
    key_row, key_block_row = slot_rows(page, off, KEY)
    value_row, value_block_row = slot_rows(page, off, VALUE)
    if TILE.BLOCKWISE:   # small batches: blocks over two threads (both sides' loads first)
        kx = _load_blocks(key_ptr, key_in, in_range, ROWS.KEY.HEAD, CACHE, TILE, EXACT)
        vx = _load_blocks(value_ptr, value_in, in_range, ROWS.VALUE.HEAD, CACHE, TILE, EXACT)
        _write_blocks(kx, kg, key_dst, key_row, key_blocks, key_block_row, keep,
                      KEY, CACHE, TILE, EXACT)
        _write_blocks(vx, vg, value_dst, value_row, value_blocks,
                      value_block_row, keep, VALUE, CACHE, TILE, EXACT)
    else:
        kp = _load_pieces(key_ptr, key_in, in_range, ROWS.KEY.HEAD, CACHE, TILE, EXACT)
        if TILE.LOADS_FIRST:
            vp = _load_pieces(value_ptr, value_in, in_range, ROWS.VALUE.HEAD, CACHE, TILE, EXACT)
        _write_side(kp, kg, key_dst, key_row, key_blocks, key_block_row, keep,
                    KEY, CACHE, TILE, EXACT)
        if not TILE.LOADS_FIRST:
            vp = _load_pieces(value_ptr, value_in, in_range, ROWS.VALUE.HEAD, CACHE, TILE, EXACT)
        _write_side(vp, vg, value_dst, value_row, value_blocks, value_block_row,
                    keep, VALUE, CACHE, TILE, EXACT)
