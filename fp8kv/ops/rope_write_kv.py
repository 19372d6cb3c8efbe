"""Fused RoPE + FP8 quantize + paged write of new Q/K/V (one launch; docs/SPEC.md, section 12).

Grid: ``(cdiv(num_tokens, BLOCK_T), HEAD_GROUPS)``. A program owns ``BLOCK_T`` tokens and
``KV_HEADS`` kv heads (with their ``KV_HEADS * NUM_Q_HEADS / NUM_HEADS`` query heads): it loads each
token's position, slot and cos/sin row once for all of them, rotates its query and key rows,
writes the query (16-bit, fp32 or FP8 codes) and, optionally, the rotated key, and quantizes the
rotated key and the value into the cache as ``_write_kv_kernel`` does (its helpers are called
here). The numpy twin is :func:`fp8kv.reference.rope_write_kv`;
:func:`fp8kv.rope_write.plan_rope_write` names every argument and
:func:`fp8kv.rope_write.rope_write_operands` says which array each pointer takes.

A head row is read once, as the tiles its rotation needs, so that a pair's two elements sit in
the same thread:

* ``"neox"`` (pairs ``(i, i + R/2)``): two ``[BLOCK_T, heads, BLOCK_HALF]`` tiles, columns
  ``0 .. R/2 - 1`` and ``R/2 .. R - 1``: each contiguous, each element loaded once;
* ``"gptj"`` (pairs ``(2i, 2i + 1)``): one ``[BLOCK_T, heads, 2 BLOCK_HALF]`` tile of columns
  ``0 .. R - 1``, reshaped to ``[..., BLOCK_HALF, 2]`` and split into even and odd columns in
  registers (a thread's contiguous elements hold whole pairs), joined back after the rotation;
* columns ``R .. D - 1`` (``BLOCK_PASS`` > 0) are a third tile, passed through.

Every load is issued before the first store: the slots, the positions and the rows of K, V and
the first step of Q do not wait for one another (only cos/sin waits for its position), which
keeps a small batch at about two memory round trips. The rotation is ``x_a c - x_b s`` and
``x_b c + x_a s`` in fp32, each product and sum rounded on its own (plans launch with
``enable_fp_fusion=False``).

Parameters follow jax-triton's order -- input arrays, scalars, outputs, constexprs -- bound by
name (:mod:`fp8kv.binding`); the layout is in the records ``CACHE`` (as ``write_kv``'s), ``ROWS``
(every token-row array), ``ROPE`` (the rotation and the query output) and ``TILE``
(:mod:`fp8kv.constexprs`). ``query_out_in_ptr`` / ``key_out_in_ptr`` are never read: they give a
frontend an input buffer to alias an output to (jax-triton's donation).

Helpers take a block of head rows as ``rows = (row, head_off, mask)``: each token's row offset,
each head's offset in a row, and the ``[T, H]`` mask.
"""
import triton.language as tl

from ._dual import jit
from .addressing import cache_bytes, slot_rows, token_slots
from .codec import (OUT_FLOAT32, SCALE_HEAD, SCALE_NONE, SCALE_TOKEN, divide,
                    divide_by_group_scale, dynamic_scale, encode, fp32_to_output_bits,
                    load_as_fp32, load_scale, max_combine, scalar_reciprocal, scalar_scale)
from .write_kv import _load_rows, _write_dynamic, store_head_scales


@jit
def _part(rows, PART: tl.constexpr):
    """Offsets ``[T, H, BLOCK_W]`` of columns ``COL0 .. COL0 + WIDTH - 1`` of a block of head
    rows (``PART``: ``(COL0, WIDTH, BLOCK_W)``), and their mask."""
    row, head_off, mask_th = rows
    COL0: tl.constexpr = PART[0]
    WIDTH: tl.constexpr = PART[1]
    BLOCK_W: tl.constexpr = PART[2]
    w = tl.arange(0, BLOCK_W)
    off = row[:, None, None] + head_off[None, :, None] + (COL0 + w)[None, None, :]
    if WIDTH < BLOCK_W:
        mask = mask_th[:, :, None] & (w < WIDTH)[None, None, :]
    else:   # no column mask: keeps the compiler's proof of 16-byte accesses simple
        mask = mask_th[:, :, None]
    return off, mask


@jit
def _load_parts(ptr, rows, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr,
                EXACT: tl.constexpr):
    """A block of head rows as fp32 tiles ``(a, b, p)``: neox, the two halves of the rotary
    columns; gptj, all rotary columns in ``a`` (``b`` is ``a``); ``p`` the pass-through columns
    (``a`` where there are none). Masked lanes hold zeros."""
    ROTARY_DIM: tl.constexpr = ROPE.ROTARY_DIM
    HALF: tl.constexpr = ROTARY_DIM // 2
    # A part's record takes constexpr names (Triton 3.6 cannot build one from plain values).
    BLOCK_HALF: tl.constexpr = TILE.BLOCK_HALF
    BLOCK_PASS: tl.constexpr = TILE.BLOCK_PASS
    if ROPE.GPTJ:
        off, mask = _part(rows, (0, ROTARY_DIM, 2 * BLOCK_HALF))
        xa = load_as_fp32(ptr, off, mask, EXACT)
        xb = xa
    else:
        off, mask = _part(rows, (0, HALF, BLOCK_HALF))
        xa = load_as_fp32(ptr, off, mask, EXACT)
        xb = load_as_fp32(ptr, off + HALF, mask, EXACT)
    if BLOCK_PASS > 0:
        off, mask = _part(rows, (ROTARY_DIM, HEAD_DIM - ROTARY_DIM, BLOCK_PASS))
        xp = load_as_fp32(ptr, off, mask, EXACT)
    else:
        xp = xa
    return xa, xb, xp


@jit
def _rotate(xa, xb, c, s, GPTJ: tl.constexpr, BLOCK_HALF: tl.constexpr):
    """The rotated tiles ``(ya, yb)`` of :func:`_load_parts`' ``(a, b)`` (gptj: ``yb`` is
    ``ya``); ``c``, ``s``: ``[T, 1, BLOCK_HALF]``. Each product, sum and difference is one fp32
    operation (no FMA: the plans disable fusion)."""
    if GPTJ:
        T: tl.constexpr = xa.shape[0]
        H: tl.constexpr = xa.shape[1]
        # A thread's contiguous columns are whole (even, odd) pairs: reshape and split stay in
        # its registers.
        x1, x2 = tl.split(tl.reshape(xa, (T, H, BLOCK_HALF, 2)))
        y1 = x1 * c - x2 * s
        y2 = x2 * c + x1 * s
        ya = tl.reshape(tl.join(y1, y2), (T, H, 2 * BLOCK_HALF))
        yb = ya
    else:
        ya = xa * c - xb * s
        yb = xb * c + xa * s
    return ya, yb


@jit
def _quantize_static(x, s, divisor, scale_ptr, scale_value, head, col_mask, KIND: tl.constexpr,
                     FMT: tl.constexpr, RECIPROCAL_DIV: tl.constexpr, EXACT: tl.constexpr):
    """One side's ``[BLOCK_T, BLOCK_HD]`` codes (uint8) with a static scale of ``KIND``: none,
    one scale ``s`` (``divisor``: its :func:`~fp8kv.ops.codec.scalar_reciprocal`) or per head
    (gathered here: ``head`` is each column's)."""
    if KIND == SCALE_HEAD:
        x = tl.math.div_rn(x, load_scale(scale_ptr, scale_value, head, col_mask, KIND)[None, :])
    elif KIND != SCALE_NONE:
        x = divide(x, s, divisor, EXACT, RECIPROCAL_DIV)
    return encode(x, FMT, EXACT).to(tl.uint8)


@jit
def _codes(y, s, rcp, s_head, KIND: tl.constexpr, FMT: tl.constexpr,
           RECIPROCAL_DIV: tl.constexpr, EXACT: tl.constexpr):
    """FP8 codes (int32) of a ``[T, H, W]`` tile with a static scale of ``KIND``: none, one
    scale ``s`` (``rcp`` its :func:`~fp8kv.ops.codec.scalar_reciprocal`) or per head
    (``s_head``: ``[H]``)."""
    if KIND == SCALE_HEAD:
        y = tl.math.div_rn(y, s_head[None, :, None])
    elif KIND != SCALE_NONE:
        y = divide(y, s, rcp, EXACT, RECIPROCAL_DIV)
    return encode(y, FMT, EXACT)


@jit
def _emit(y, dst, rows, ok, scale, PART: tl.constexpr, FMT: tl.constexpr, SCALE: tl.constexpr,
          OUT_KIND: tl.constexpr, RECIPROCAL_DIV: tl.constexpr, EXACT: tl.constexpr):
    """Store one part (``PART``, see :func:`_part`) of rotated rows: codes of ``FMT`` with a
    static scale of ``SCALE`` (``scale``: ``(s, rcp, s_head)``, see :func:`_codes`), or, without
    ``FMT``, the bits of ``OUT_KIND``. Tokens whose position is out of range (``ok`` False) get
    zero bytes."""
    if FMT is None:
        v = fp32_to_output_bits(y, OUT_KIND, EXACT)
    else:
        s, rcp, s_head = scale
        v = _codes(y, s, rcp, s_head, KIND=SCALE, FMT=FMT, RECIPROCAL_DIV=RECIPROCAL_DIV,
                   EXACT=EXACT)
    v = tl.where(ok[:, None, None], v, 0)
    off, mask = _part(rows, PART)
    tl.store(dst + off, v.to(dst.dtype.element_ty), mask=mask)


@jit
def _emit_parts(parts, dst, rows, ok, scale, FMT: tl.constexpr, SCALE: tl.constexpr,
                OUT_KIND: tl.constexpr, HEAD_DIM: tl.constexpr, ROPE: tl.constexpr,
                TILE: tl.constexpr, EXACT: tl.constexpr):
    """:func:`_emit` of every part of rotated rows (``parts``: :func:`_load_parts`' tiles,
    rotated; query_out, key_out, static-scale K)."""
    ya, yb, yp = parts
    ROTARY_DIM: tl.constexpr = ROPE.ROTARY_DIM
    HALF: tl.constexpr = ROTARY_DIM // 2
    BLOCK_HALF: tl.constexpr = TILE.BLOCK_HALF
    BLOCK_PASS: tl.constexpr = TILE.BLOCK_PASS
    DIV: tl.constexpr = TILE.RECIPROCAL_DIV
    if ROPE.GPTJ:
        _emit(ya, dst, rows, ok, scale, (0, ROTARY_DIM, 2 * BLOCK_HALF), FMT, SCALE, OUT_KIND,
              DIV, EXACT)
    else:
        _emit(ya, dst, rows, ok, scale, (0, HALF, BLOCK_HALF), FMT, SCALE, OUT_KIND, DIV, EXACT)
        _emit(yb, dst, rows, ok, scale, (HALF, HALF, BLOCK_HALF), FMT, SCALE, OUT_KIND, DIV,
              EXACT)
    if BLOCK_PASS > 0:
        _emit(yp, dst, rows, ok, scale, (ROTARY_DIM, HEAD_DIM - ROTARY_DIM, BLOCK_PASS),
              FMT, SCALE, OUT_KIND, DIV, EXACT)


@jit
def _row_amax(y, EXACT: tl.constexpr):
    """``max |y|`` over the last axis, NaNs ignored (see :func:`fp8kv.ops.codec.max_combine`)."""
    a = tl.abs(y)
    if EXACT:
        a = tl.where(y != y, 0.0, a)
    return tl.reduce(a, 2, max_combine)


@jit
def _store_codes(y, s_x, rcp, dst, rows, PART: tl.constexpr, FMT: tl.constexpr,
                 POW2: tl.constexpr, EXACT: tl.constexpr):
    """Codes of one part (``PART``, see :func:`_part`) of rotated K rows with their dynamic
    scales ``s_x`` (``rcp``: ``1 / s_x``, exact for POW2), as ``_write_dynamic`` makes them,
    stored into the cache."""
    if POW2:
        q = y * rcp
    elif EXACT:
        q = tl.math.div_rn(y, s_x)
    else:
        q = divide_by_group_scale(y, s_x)
    off, mask = _part(rows, PART)
    tl.store(dst + off, encode(q, FMT, EXACT).to(tl.uint8), mask=mask)


@jit
def _write_rotated_dynamic(parts, codes, scales, h, h_mask, keep, SIDE: tl.constexpr,
                           CACHE: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr,
                           EXACT: tl.constexpr):
    """Rotated K rows with dynamic scales (``SIDE.DYNAMIC``: TOKEN or TOKEN_HEAD):
    ``_write_dynamic`` for rows held as parts -- the amax is the max of the parts', then each
    part is quantized and stored (``codes``: the cache and each token's row offset), then the
    scales (``scales``: the side array and each token's offset, or inline bytes). ``h``: the
    program's kv heads."""
    ya, yb, yp = parts
    dst, row = codes
    scale_dst, scale_row = scales
    # Passed on to helpers, or in a part's record: constexpr names (Triton 3.6).
    FMT: tl.constexpr = CACHE.FMT
    POW2: tl.constexpr = CACHE.SCALE_POW2
    HEAD_DIM: tl.constexpr = CACHE.HEAD_DIM
    ROTARY_DIM: tl.constexpr = ROPE.ROTARY_DIM
    BLOCK_HALF: tl.constexpr = TILE.BLOCK_HALF
    BLOCK_PASS: tl.constexpr = TILE.BLOCK_PASS
    amax = _row_amax(ya, EXACT)                                                   # [T, H]
    if not ROPE.GPTJ:
        amax = tl.maximum(amax, _row_amax(yb, EXACT))
    if TILE.BLOCK_PASS > 0:
        amax = tl.maximum(amax, _row_amax(yp, EXACT))
    if SIDE.DYNAMIC == SCALE_TOKEN:
        amax = tl.reduce(amax, 1, max_combine)                                    # [T]
    s = dynamic_scale(tl.where(amax != amax, 0.0, amax), FMT, POW2, EXACT)        # all-NaN: 0
    s_x = s[:, None, None] if SIDE.DYNAMIC == SCALE_TOKEN else s[:, :, None]
    rcp = tl.math.div_rn(tl.full(s_x.shape, 1.0, tl.float32), s_x)
    mask_th = keep[:, None] & h_mask[None, :]
    head_off = h * SIDE.CODES.HEAD
    rows = (row, head_off, mask_th)
    if ROPE.GPTJ:
        _store_codes(ya, s_x, rcp, dst, rows, (0, ROTARY_DIM, 2 * BLOCK_HALF), FMT, POW2, EXACT)
    else:
        _store_codes(ya, s_x, rcp, dst, rows, (0, ROTARY_DIM // 2, BLOCK_HALF), FMT, POW2,
                     EXACT)
        _store_codes(yb, s_x, rcp, dst, rows, (ROTARY_DIM // 2, ROTARY_DIM // 2, BLOCK_HALF),
                     FMT, POW2, EXACT)
    if BLOCK_PASS > 0:
        _store_codes(yp, s_x, rcp, dst, rows, (ROTARY_DIM, HEAD_DIM - ROTARY_DIM, BLOCK_PASS),
                     FMT, POW2, EXACT)
    # Where the scales go: as _write_dynamic stores them (side arrays with evict_last).
    if SIDE.DYNAMIC == SCALE_TOKEN:
        tl.store(scale_dst + scale_row, s, mask=keep, eviction_policy="evict_last")
    else:
        store_head_scales(s, dst, row, head_off, scale_dst, scale_row, h * SIDE.SCALES.HEAD,
                          mask_th, HEAD_DIM=HEAD_DIM, INLINE_PAD=CACHE.INLINE_PAD)


@jit
def _load_value_chunk(value_ptr, value_in, in_range, h0, start: tl.constexpr,
                      ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, TILE: tl.constexpr,
                      EXACT: tl.constexpr):
    """Columns ``start .. start + BLOCK_VD - 1`` of the program's value rows (its ``KV_HEADS``
    heads from ``h0``), ``[T, BLOCK_VD]`` fp32, as ``_write_kv_kernel``'s static loop reads
    them."""
    col = start + tl.arange(0, TILE.BLOCK_VD)
    col_mask = col < TILE.KV_HEADS * HEAD_DIM
    head = col // HEAD_DIM
    # Packed rows address by column alone (contiguity proofs for 16-byte loads).
    v_col = (h0 * HEAD_DIM + col if ROWS.VALUE.PACKED
             else (h0 + head) * ROWS.VALUE.HEAD + col % HEAD_DIM)
    return load_as_fp32(value_ptr, value_in[:, None] + v_col[None, :],
                        in_range[:, None] & col_mask[None, :], EXACT)


@jit
def _store_value_chunk(xv, scale, dst, row, keep, h0, start: tl.constexpr, SIDE: tl.constexpr,
                       CACHE: tl.constexpr, TILE: tl.constexpr, EXACT: tl.constexpr):
    """Quantize and store a :func:`_load_value_chunk` (``_write_kv_kernel``'s static path);
    ``scale``: V's static scale, its divisor, pointer and host value."""
    s, rcp, value_scale_ptr, value_scale_value = scale
    HEAD_DIM: tl.constexpr = CACHE.HEAD_DIM
    FMT: tl.constexpr = CACHE.FMT
    col = start + tl.arange(0, TILE.BLOCK_VD)
    col_mask = col < TILE.KV_HEADS * HEAD_DIM
    head = col // HEAD_DIM
    c_col = (h0 * HEAD_DIM + col if TILE.CACHE_PACKED
             else (h0 + head) * SIDE.CODES.HEAD + col % HEAD_DIM)
    qv = _quantize_static(xv, s, rcp, value_scale_ptr, value_scale_value, h0 + head, col_mask,
                          KIND=SIDE.STATIC, FMT=FMT, RECIPROCAL_DIV=TILE.RECIPROCAL_DIV,
                          EXACT=EXACT)
    tl.store(dst + (row[:, None] + c_col[None, :]), qv, mask=keep[:, None] & col_mask[None, :])


@jit(do_not_specialize=["num_tokens", "max_position"])
def _rope_write_kv_kernel(
    query_ptr, key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_ptr, position_ptr,
    cos_sin_ptr, query_scale_ptr, key_scale_ptr, value_scale_ptr, query_out_in_ptr,
    key_out_in_ptr,
    num_tokens, num_slots, max_position, query_scale_value, key_scale_value, value_scale_value,
    query_out_ptr, key_cache_out_ptr, value_cache_out_ptr, key_scale_out_ptr,
    value_scale_out_ptr, key_out_ptr,
    CACHE: tl.constexpr, ROWS: tl.constexpr, ROPE: tl.constexpr, TILE: tl.constexpr,
    EXACT: tl.constexpr,
):
    # Records passed on to helpers are bound to constexpr names first (Triton 3.6).
    KEY: tl.constexpr = CACHE.KEY
    VALUE: tl.constexpr = CACHE.VALUE
    FMT: tl.constexpr = CACHE.FMT
    Q_FMT: tl.constexpr = ROPE.Q_FMT
    QPP: tl.constexpr = TILE.KV_HEADS * (ROPE.NUM_Q_HEADS // CACHE.NUM_HEADS)   # query heads
    HALF: tl.constexpr = ROPE.ROTARY_DIM // 2
    HEAD_DIM: tl.constexpr = CACHE.HEAD_DIM
    KV_HEADS: tl.constexpr = TILE.KV_HEADS
    BLOCK_HQ: tl.constexpr = TILE.BLOCK_HQ
    BLOCK_HALF: tl.constexpr = TILE.BLOCK_HALF
    h0 = tl.program_id(1) * KV_HEADS          # the program's first kv head
    q0 = tl.program_id(1) * QPP               # and first query head
    tok, in_range, slot_ok, page, off = token_slots(
        slot_ptr, num_tokens, num_slots, BLOCK_T=TILE.BLOCK_T, PAGE_SIZE=CACHE.PAGE_SIZE,
        OFFSETS_64=TILE.OFFSETS_64)
    pos = tl.load(position_ptr + tok, mask=in_range, other=-1).to(tl.int64)
    pos_ok = in_range & (pos >= 0) & (pos < max_position)
    keep = pos_ok & slot_ok
    pos = tl.where(pos_ok, pos, 0)
    if not TILE.OFFSETS_64:   # as the rows (token_slots): int64 only where an array needs it
        pos = pos.to(tl.int32)
    q_in = tok * ROWS.QUERY.TOKEN
    k_in = tok * ROWS.KEY.TOKEN
    value_in = tok * ROWS.VALUE.TOKEN
    h = h0 + tl.arange(0, TILE.BLOCK_H)
    hq = tl.arange(0, BLOCK_HQ)
    if TILE.OFFSETS_64:
        h = h.to(tl.int64)
        hq = hq.to(tl.int64)
    h_mask = tl.arange(0, TILE.BLOCK_H) < KV_HEADS
    kv_mask = in_range[:, None] & h_mask[None, :]
    q_mask = in_range[:, None] & (hq < QPP)[None, :]

    # Every load before the first store (see the module docstring).
    xka, xkb, xkp = _load_parts(key_ptr, (k_in, h * ROWS.KEY.HEAD, kv_mask), HEAD_DIM, ROPE,
                                TILE, EXACT)
    V_STATIC: tl.constexpr = VALUE.DYNAMIC == SCALE_NONE
    if V_STATIC:
        xv = _load_value_chunk(value_ptr, value_in, in_range, h0, 0, ROWS, HEAD_DIM, TILE,
                               EXACT)
    else:
        xv = _load_rows(value_ptr, value_in + h0 * ROWS.VALUE.HEAD, in_range,
                        STRIDE_HEAD=ROWS.VALUE.HEAD, NUM_HEADS=KV_HEADS, HEAD_DIM=HEAD_DIM,
                        BLOCK_H=TILE.BLOCK_H, BLOCK_D=TILE.BLOCK_D, EXACT=EXACT)
    xqa, xqb, xqp = _load_parts(query_ptr, (q_in, (q0 + hq) * ROWS.QUERY.HEAD, q_mask), HEAD_DIM,
                                ROPE, TILE, EXACT)
    i = tl.arange(0, BLOCK_HALF)
    cs_off = (pos * ROWS.COS_SIN)[:, None, None] + i[None, None, :]
    cs_mask = pos_ok[:, None, None] & (i < HALF)[None, None, :]
    c = load_as_fp32(cos_sin_ptr, cs_off, cs_mask, EXACT)            # [T, 1, BLOCK_HALF]
    s = load_as_fp32(cos_sin_ptr, cs_off + HALF, cs_mask, EXACT)
    # One scale per side and for the query: loaded (and inverted) before the rows arrive.
    k_s = scalar_scale(key_scale_ptr, key_scale_value, KEY.STATIC)
    v_s = scalar_scale(value_scale_ptr, value_scale_value, VALUE.STATIC)
    q_s = scalar_scale(query_scale_ptr, query_scale_value, ROPE.Q_SCALE)
    k_y = scalar_reciprocal(k_s, KEY.STATIC, EXACT, TILE.RECIPROCAL_DIV)
    v_y = scalar_reciprocal(v_s, VALUE.STATIC, EXACT, TILE.RECIPROCAL_DIV)
    q_y = scalar_reciprocal(q_s, ROPE.Q_SCALE, EXACT, TILE.RECIPROCAL_DIV)
    if KEY.STATIC == SCALE_HEAD:
        k_head = load_scale(key_scale_ptr, key_scale_value, h, h_mask, SCALE_HEAD)
    else:
        k_head = k_s

    key_dst, value_dst = cache_bytes(key_cache_out_ptr, value_cache_out_ptr, CACHE.COMBINED)
    key_row, key_scale_row = slot_rows(page, off, KEY)
    value_row, value_scale_row = slot_rows(page, off, VALUE)
    if ROPE.Q_OUT_KIND == OUT_FLOAT32:
        bits_ty: tl.constexpr = tl.uint32
    else:
        bits_ty: tl.constexpr = tl.uint16
    if Q_FMT is None:
        q_dst = query_out_ptr.to(tl.pointer_type(bits_ty))
    else:
        q_dst = query_out_ptr.to(tl.pointer_type(tl.uint8))

    # K: rotate, then quantize into the cache (and the rotated rows into key_out).
    yka, ykb = _rotate(xka, xkb, c, s, GPTJ=ROPE.GPTJ, BLOCK_HALF=BLOCK_HALF)
    if ROPE.KEY_OUT:
        _emit_parts((yka, ykb, xkp), key_out_ptr.to(tl.pointer_type(bits_ty)),
                    (tok * ROWS.KEY_OUT.TOKEN, h * ROWS.KEY_OUT.HEAD, kv_mask), pos_ok,
                    (k_s, k_y, k_s), None, SCALE_NONE, ROPE.Q_OUT_KIND,
                    HEAD_DIM, ROPE, TILE, EXACT)
    if KEY.DYNAMIC == SCALE_NONE:
        _emit_parts((yka, ykb, xkp), key_dst,
                    (key_row, h * KEY.CODES.HEAD, keep[:, None] & h_mask[None, :]), keep,
                    (k_s, k_y, k_head), FMT, KEY.STATIC, ROPE.Q_OUT_KIND,
                    HEAD_DIM, ROPE, TILE, EXACT)
    else:
        _write_rotated_dynamic((yka, ykb, xkp), (key_dst, key_row),
                               (key_scale_out_ptr, key_scale_row), h, h_mask,
                               keep, KEY, CACHE, ROPE, TILE, EXACT)

    # V: as write_kv (its helpers), the program's kv heads only.
    if V_STATIC:
        END: tl.constexpr = KV_HEADS * HEAD_DIM
        STEP: tl.constexpr = TILE.BLOCK_VD
        for start in tl.static_range(0, END, STEP):
            if start > 0:
                xv = _load_value_chunk(value_ptr, value_in, in_range, h0, start, ROWS,
                                       HEAD_DIM, TILE, EXACT)
            _store_value_chunk(xv, (v_s, v_y, value_scale_ptr, value_scale_value), value_dst,
                               value_row, keep, h0, start, VALUE, CACHE, TILE, EXACT)
    else:
        _write_dynamic(xv, value_dst, value_row + h0 * VALUE.CODES.HEAD, value_scale_out_ptr,
                       value_scale_row + h0 * VALUE.SCALES.HEAD, keep,
                       SIDE=VALUE, CACHE=CACHE, NUM_HEADS=KV_HEADS, BLOCK_H=TILE.BLOCK_H,
                       BLOCK_D=TILE.BLOCK_D, EXACT=EXACT)

    # Q: the first step's rows are loaded above; the others load in their step.
    for hq0 in tl.static_range(0, QPP, BLOCK_HQ):
        if hq0 > 0:
            q_mask = in_range[:, None] & ((hq0 + hq) < QPP)[None, :]
            xqa, xqb, xqp = _load_parts(query_ptr, (q_in, (q0 + hq0 + hq) * ROWS.QUERY.HEAD,
                                                    q_mask), HEAD_DIM, ROPE, TILE, EXACT)
        yqa, yqb = _rotate(xqa, xqb, c, s, GPTJ=ROPE.GPTJ, BLOCK_HALF=BLOCK_HALF)
        _emit_parts((yqa, yqb, xqp), q_dst,
                    (tok * ROWS.QUERY_OUT.TOKEN, (q0 + hq0 + hq) * ROWS.QUERY_OUT.HEAD, q_mask),
                    pos_ok, (q_s, q_y, q_s), Q_FMT, ROPE.Q_SCALE,
                    ROPE.Q_OUT_KIND, HEAD_DIM, ROPE, TILE, EXACT)
