"""Paged decode attention over every fp8kv cache format (docs/SPEC.md section 16).

Grid ``(num_kv_heads * M_TILES, SLOTS)``. Program ``(h * M_TILES + m, slot)`` takes, of the
sequence ``b`` and the share ``split`` that ``slot`` stands for (sequences take consecutive
slots, one per share: ``SPLITS`` each, or balanced over ``seq_lens`` on the device:
:func:`balanced_share`), query rows ``m * BLOCK_M ...`` of kv head ``h`` -- row ``r`` is query
token ``r // GROUP`` of the sequence and query head ``h * GROUP + r % GROUP``, so a GQA group
shares every K/V tile it reads -- and the ``split``-th share of the tokens those rows see.
Its ``W`` warps each take ``BLOCK_N`` consecutive tokens of a ``W * BLOCK_N`` tile (a batch of
``W`` dots: no warp waits for another inside the loop) and keep their own online softmax; the
program merges them at the end. The tokens are the MMAs' M dimension and the query rows their N
(scores K Q^T, the output's transpose V^T P^T: :func:`attend_tile`). A program whose rows see
one share writes the output; otherwise it writes fp32 partials (``acc``, row max, row sum)
that :func:`_attention_merge_kernel` combines in split order, so a call gives the same bytes
every time (with the plan's ``pdl`` that kernel is launched as a programmatic dependent of this
grid and waits for it inside).

Reading a tile: the token's page comes from the block table (tokens past the visible range are
clamped to its last token, so no load reaches an unused page or block-table entry, and their
scores are masked). Quantized formats become fp16 MMA operands exactly (e4m3 / e5m2 codes,
NVFP4 codes times their block scale); the query becomes fp16 times a power of two; every other
scale multiplies a score column, a probability column or the result (SPEC section 16.2). MXFP8's
E8M0 block scales (2**-127 .. 2**127 along a head row: no fp16 holds them) stay outside the
operands: each block of 32 columns is a dot of its own (one warp takes a tile's blocks as a
batch), its scores times the block's scale, its probabilities times each token's scale in units
of the block's largest.

Parameters follow the other kernels' order (input arrays, scalars, outputs, constexprs); the
geometry comes as named-tuple constexprs (:mod:`fp8kv.attention` makes them).
"""
import triton.language as tl

from .. import attention
from ._dual import jit
from .codec import (NAN_BITS_FP32, SCALE_HEAD, SCALE_TENSOR, e8m0_values,
                    fp32_to_output_bits, max_combine)
from .addressing import LAYER_NONE, at_layer, select_layer, slot_rows

try:   # programmatic dependent launch (Triton >= 3.4; fp8kv.attention.PDL decides its use)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:   # pragma: no cover - the plan never asks for it then
    gdc_launch_dependents = gdc_wait = None

# The ids of fp8kv.attention: how a side's elements become MMA operands, where its dynamic
# scales are.
READ_PLAIN: tl.constexpr = tl.constexpr(attention.READ_PLAIN)
READ_FP8: tl.constexpr = tl.constexpr(attention.READ_FP8)
READ_NVFP4: tl.constexpr = tl.constexpr(attention.READ_NVFP4)
READ_MXFP8: tl.constexpr = tl.constexpr(attention.READ_MXFP8)
COLUMNS_NONE: tl.constexpr = tl.constexpr(attention.COLUMNS_NONE)
COLUMNS_ARRAY: tl.constexpr = tl.constexpr(attention.COLUMNS_ARRAY)
COLUMNS_INLINE: tl.constexpr = tl.constexpr(attention.COLUMNS_INLINE)
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)
_NEG_INF: tl.constexpr = tl.constexpr(float("-inf"))


@jit
def _sum_combine(a, b):
    """Combiner of ``tl.reduce`` for sums: our own, so that the interpreter twin rebinds it
    (Triton's ``tl.sum`` and ``tl.max`` are compiled functions of its library)."""
    return a + b


# Four e4m3 bytes (one 32-bit register) to four fp16 values, two per instruction (a constexpr:
# the only kind of global a Triton function may read).
_E4M3X4_TO_FP16 = tl.constexpr("""{
        .reg .b16 lo, hi;
        mov.b32 {lo, hi}, $2;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        }""")


def _high_bytes_ptx(src: str) -> str:
    """The four bytes of ``src`` as the high bytes of two fp16 pairs (``$0``: bytes 0-1, ``$1``:
    2-3), each moved in front of a zero low byte by prmt."""
    return f"    prmt.b32 $0, {src}, 0, 0x1404;\n    prmt.b32 $1, {src}, 0, 0x3424;\n"


# Four e5m2 bytes to four fp16 values: an e5m2 code is the high byte of the fp16 of its value
# (the same sign, exponent bias and field widths, two mantissa bits) -- every code, inf and NaN
# alike, keeps its bits.
_E5M2X4_TO_FP16 = tl.constexpr("{\n" + _high_bytes_ptx("$2") + "}")


@jit
def _fp16_of_fp8_pairs(codes, ASM: tl.constexpr, HELD: tl.constexpr):
    """fp16 values of FP8 bytes by ``ASM`` (:data:`_E4M3X4_TO_FP16`, :data:`_E5M2X4_TO_FP16`),
    four bytes per instruction pair. ``HELD``: marked impure, so that Triton converts the codes
    where they are loaded and hands fp16 to the MMA operand layout (ldmatrix.trans for V),
    instead of moving the conversion after a byte-wise gather of V's transposed operand."""
    return tl.inline_asm_elementwise(ASM, "=r,=r,r", [codes], dtype=tl.float16,
                                     is_pure=not HELD, pack=4)


@jit
def fp16_of_fp8(codes, F: tl.constexpr, TRANSPOSED: tl.constexpr, EXACT: tl.constexpr):
    """fp16 of FP8 codes (uint8) of format ``F`` (a :class:`fp8kv.formats.Codec`), exact:
    sign, then the magnitude's bits moved into fp16's field and scaled by ``2**(15 - bias)``
    (a power of two; fp16 holds every e4m3 and e5m2 value). A NaN code gives a NaN, e5m2's inf
    an inf. The fast paths: e4m3 the hardware conversion (the same values), e5m2 its byte as
    the fp16's high byte (the same bits)."""
    if F.EXP_BITS == 4 and F.MAN_BITS == 3 and not EXACT:
        x = _fp16_of_fp8_pairs(codes, _E4M3X4_TO_FP16, TRANSPOSED)
    elif F.EXP_BITS == 5 and F.MAN_BITS == 2 and F.BIAS == 15 and not EXACT:
        x = _fp16_of_fp8_pairs(codes, _E5M2X4_TO_FP16, TRANSPOSED)
    else:
        c = codes.to(tl.uint16)
        mag = c & 0x7F
        bits = ((c & 0x80) << 8) | (mag << (10 - F.MAN_BITS))
        if not F.HAS_INF:   # e4m3fn: one NaN magnitude, no inf (a quiet fp16 NaN, any sign)
            bits = tl.where(mag == (F.NAN_CODE & 0x7F), bits | 0x7E00, bits)
        x = bits.to(tl.float16, bitcast=True)
        if F.BIAS != 15:
            UNIT: tl.constexpr = 2.0 ** (15 - F.BIAS)
            x = x * UNIT
    return x


# NVFP4 nibbles of four bytes to fp16 bits: each fp16's high byte is sign << 7 | magnitude << 1
# (computed on all four bytes of ``src`` at once: ``h`` from the low nibbles, ``g`` from the high
# ones, byte k from byte k), later moved in front of a zero low byte (:func:`_high_bytes_ptx`).
_LOW_NIBBLES_PTX = """
    shl.b32 a, {src}, 1;
    and.b32 a, a, 0x0E0E0E0E;
    shl.b32 b, {src}, 4;
    and.b32 b, b, 0x80808080;
    or.b32 h, a, b;
"""
_HIGH_NIBBLES_PTX = """
    shr.b32 a, {src}, 3;
    and.b32 a, a, 0x0E0E0E0E;
    and.b32 b, {src}, 0x80808080;
    or.b32 g, a, b;
"""


def _nibbles_ptx(high: bool) -> str:
    """One half of four bytes' nibbles (``$2``) to two fp16 pairs (``$0``: bytes 0-1, ``$1``:
    2-3)."""
    body = (_HIGH_NIBBLES_PTX if high else _LOW_NIBBLES_PTX).format(src="$2")
    return "{\n    .reg .b32 a, b, h, g;" + body + _high_bytes_ptx("g" if high else "h") + "}"


_NVFP4_EVEN_PTX: tl.constexpr = tl.constexpr(_nibbles_ptx(False))
_NVFP4_ODD_PTX: tl.constexpr = tl.constexpr(_nibbles_ptx(True))

# The high bytes of all eight nibbles of $4 (the K asm's input).
_NVFP4_HIGH_BYTES = ("\n    .reg .b32 a, b, h, g;" + _LOW_NIBBLES_PTX.format(src="$4")
                     + _HIGH_NIBBLES_PTX.format(src="$4").lstrip("\n"))


def _scaled_pairs_ptx(pairs) -> str:
    """The asm of :data:`_NVFP4_HIGH_BYTES`, then output ``$k`` for each ``(bytes, selector,
    scale)`` of ``pairs``: two of those high bytes moved in front of zero low bytes by ``prmt``,
    the fp16 pair times the scale pair."""
    return "{" + _NVFP4_HIGH_BYTES + "".join(
        f"    prmt.b32 a, {src}, 0, {selector};\n    mul.rn.f16x2 ${k}, a, {scale};\n"
        for k, (src, selector, scale) in enumerate(pairs)) + "}"


# K: four bytes of a token's row to fp16 pairs (bytes 0-1, then 2-3, of h and of g), each times
# its block scales (``$5`` of bytes 0-1, ``$6`` of 2-3, as fp16 pairs): the MMA operands leave the
# asm as the 32-bit pairs the dot takes, where a multiply outside it makes Triton unpack and
# repack every fp16 around it.
_NVFP4_SCALED_PTX: tl.constexpr = tl.constexpr(_scaled_pairs_ptx((
    ("h", "0x1404", "$5"), ("h", "0x3424", "$6"), ("g", "0x1404", "$5"), ("g", "0x3424", "$6"))))

# V: four codes of a token (16 bits) and the same four of the next token ($4: the two as the
# 32-bit pair that the transposed MMA operand holds) to fp16 pairs (token, next token), one per
# code position 0..3, each times the two tokens' block scales: their e4m3 bytes as one 16-bit
# pair ($5), one cvt to an fp16 pair (an fp16 operand made outside would take a byte gather, a
# conversion and a repack per pair). No byte moves between the tokens: ldmatrix.trans already
# paired them (bytes 0 and 2, 1 and 3), which is why V is read this way, and each pair's two
# fp16 words sit 16 bits apart as its two codes do, so one shift puts both magnitudes at bits
# 9-11 and another both signs at bit 15: masks and shifts, no prmt. The shifts run on the FMA
# pipe; NVFP4's unpacking keeps the ALU pipe the busiest (bench/NOTES.md).
_V_CODE_SHIFTS = (("l", "shl", 9, "shl", 12), ("u", "shl", 5, "shl", 8),
                  ("l", "shl", 1, "shl", 4), ("u", "shr", 3, None, 0))


def _quads_ptx() -> str:
    """The V asm: ``l`` / ``u`` the low / high nibbles of the four bytes; for code position
    ``c`` (:data:`_V_CODE_SHIFTS`) ``(l or u) shifted by the magnitude's shift | shifted by the
    sign's``, masked to bits 9-11 and 15 of each fp16, times the scale pair."""
    body = ("{\n    .reg .b32 l, u, a, b, x, s;\n    cvt.rn.f16x2.e4m3x2 s, $5;\n"
            "    and.b32 l, $4, 0x0F0F0F0F;\n    and.b32 u, $4, 0xF0F0F0F0;\n")
    for k, (src, mag_op, mag, sign_op, sign) in enumerate(_V_CODE_SHIFTS):
        body += f"    {mag_op}.b32 a, {src}, {mag};\n"
        b = src
        if sign_op:
            body += f"    {sign_op}.b32 b, {src}, {sign};\n"
            b = "b"
        # lop3 0xA8: (a | b) & c
        body += (f"    lop3.b32 x, a, {b}, 0x8E008E00, 0xA8;\n"
                 f"    mul.rn.f16x2 ${k}, x, s;\n")
    return body + "}"


_NVFP4_QUADS_PTX: tl.constexpr = tl.constexpr(_quads_ptx())


@jit
def _e2m1_fp16(bits):
    """fp16 of the E2M1 code in the low 4 bits of ``bits`` (uint16) times ``2**-14``, exactly:
    sign to bit 15, magnitude to bits 9-11 (the interpreter's path of the unpacking asm)."""
    return (((bits & 0x7) << 9) | ((bits & 0x8) << 12)).to(tl.float16, bitcast=True)


@jit
def _per_element(block_values, shape: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``[A, B, blocks]`` block values repeated over the ``shape[-1] / blocks`` elements of
    their block: ``shape``; ``TRANSPOSED``: ``[A, blocks, C]`` repeated along axis 1."""
    if TRANSPOSED:
        blocks: tl.constexpr = block_values.shape[1]
        x = tl.reshape(tl.broadcast_to(block_values[:, :, None, :],
                                       (shape[0], blocks, shape[1] // blocks, shape[2])), shape)
    else:
        blocks: tl.constexpr = block_values.shape[-1]
        x = tl.reshape(tl.broadcast_to(block_values[:, :, :, None],
                                       (shape[0], shape[1], blocks, shape[2] // blocks)), shape)
    return x


@jit
def fp16_of_nvfp4_quads(quads, block_scales, F: tl.constexpr, EXACT: tl.constexpr):
    """``(c0, c1, c2, c3)``, each ``[W, D / 4, N]``: fp16 of NVFP4 codes read four to a uint16
    and transposed, ``[W, D / 4, N]`` (code ``c`` of each: element ``4j + c``), times their
    block scales ``[W, D / 16, N]``, as :func:`fp16_of_nvfp4` makes them: V^T, the PV MMA's A
    operand, which ``ldmatrix.trans`` fills with the codes as stored."""
    # The exact path's scale conversion stays pure, as K's: marked impure it gave the PV dot
    # other operand layouts than the fast path's, and a large call other bytes (bench/NOTES.md).
    if EXACT:
        scale = _per_element(fp16_of_fp8(block_scales, F, False, EXACT), quads.shape, True)
        x = quads.to(tl.uint16)
        c0 = _e2m1_fp16(x) * scale
        c1 = _e2m1_fp16(x >> 4) * scale
        c2 = _e2m1_fp16(x >> 8) * scale
        c3 = _e2m1_fp16(x >> 12) * scale
    else:   # the two tokens' scale bytes reach the asm as one 16-bit pair ("h")
        c0, c1, c2, c3 = tl.inline_asm_elementwise(
            _NVFP4_QUADS_PTX, "=r,=r,=r,=r,r,h",
            [quads, _per_element(block_scales, quads.shape, True)],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
    return c0, c1, c2, c3


@jit
def fp16_of_nvfp4(codes, block_scales, F: tl.constexpr, EXACT: tl.constexpr,
                  FUSED: tl.constexpr):
    """``(even, odd)``: fp16 of the low and the high nibbles of NVFP4 pairs ``[..., D / 2]``
    (elements ``2i`` and ``2i + 1``) times their e4m3 block scales ``[..., D / 16]``, exact: a
    code ``c`` as the fp16 bits ``(c & 7) << 9`` is its E2M1 value times ``2**-14``; the block
    scale is an fp16 value too; their product, the element times ``2**-14`` (at most 0.17, a
    multiple of ``2**-24`` -- the smallest code times the smallest scale -- with at most 6
    significant bits: an fp16 subnormal below ``2**-14``), needs no rounding. The caller
    multiplies by ``2**14``. Even and odd elements stay apart: the dots take them as two halves
    of the head dimension (the query's and the output's columns split alike), so no nibble is
    moved next to its neighbour. ``FUSED``: codes and scales in one asm (the same products).
    This is K's operand (pairs along the head dimension); V's is :func:`fp16_of_nvfp4_quads`."""
    bs = fp16_of_fp8(block_scales, F, False, EXACT)                          # [..., D/16]
    shape: tl.constexpr = codes.shape
    blocks: tl.constexpr = block_scales.shape[-1]
    if FUSED and not EXACT:
        scale = _per_element(bs, shape, False)
        even, odd = tl.inline_asm_elementwise(_NVFP4_SCALED_PTX, "=r,=r,=r,=r,r,r,r",
                                              [codes, scale], dtype=(tl.float16, tl.float16),
                                              is_pure=True, pack=4)
    else:
        if EXACT:
            c = codes.to(tl.uint16)
            even = _e2m1_fp16(c)
            odd = _e2m1_fp16(c >> 4)
        else:   # the same bits, four bytes at a time
            even = tl.inline_asm_elementwise(_NVFP4_EVEN_PTX, "=r,=r,r", [codes],
                                             dtype=tl.float16, is_pure=True, pack=4)
            odd = tl.inline_asm_elementwise(_NVFP4_ODD_PTX, "=r,=r,r", [codes],
                                            dtype=tl.float16, is_pure=True, pack=4)
        # Each block's 8 bytes times its scale.
        even = tl.reshape(tl.reshape(even, (shape[0], shape[1], blocks, 8)) * bs[:, :, :, None],
                          shape)
        odd = tl.reshape(tl.reshape(odd, (shape[0], shape[1], blocks, 8)) * bs[:, :, :, None],
                         shape)
    return even, odd


@jit
def plain_to_fp32(bits, BF16: tl.constexpr):
    """fp32 of bf16 / fp16 bits (uint16), exactly."""
    if BF16:
        x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        x = bits.to(tl.float16, bitcast=True).to(tl.float32)
    return x


@jit
def _load(ptrs, mask, other, live, GUARD: tl.constexpr):
    """``tl.load(ptrs)`` where ``mask`` (None: everywhere) and, with ``GUARD``, where the scalar
    ``live`` holds (``other`` elsewhere, 0 if None). ``GUARD == 2`` (the interpreter): ``live``
    made a block of ``ptrs``' shape first, as Triton 3.9's interpreter takes no scalar boolean
    in a load's mask."""
    if GUARD == 2:
        live = tl.full(ptrs.shape, 0, tl.int32) < live.to(tl.int32)
    if GUARD:
        mask = live if mask is None else mask & live
        other = 0 if other is None else other
    if mask is None:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=mask, other=other)
    return x


@jit
def _at_columns(rows, cols, TRANSPOSED: tl.constexpr):
    """``rows[:, :, None] + cols`` (``rows``: ``[W, N]`` pointers): ``[W, N, C]``, or
    ``[W, C, N]`` when ``TRANSPOSED``."""
    if TRANSPOSED:
        x = rows[:, None, :] + cols[None, :, None]
    else:
        x = rows[:, :, None] + cols[None, None, :]
    return x


@jit
def _columns(ok, TRANSPOSED: tl.constexpr):
    """A column mask ``[C]`` broadcastable against :func:`_at_columns`' result."""
    if TRANSPOSED:
        x = ok[None, :, None]
    else:
        x = ok[None, None, :]
    return x


@jit
def _at_blocks(rows, R: tl.constexpr, TRANSPOSED: tl.constexpr):
    """``rows`` (``[1, N]``: one warp) at each of their ``NB = block_d / 32`` blocks' 32
    columns, ``[NB, N, 32]``, or ``[NB, 32, N]`` when ``TRANSPOSED`` (no reshape: the rows'
    alignment, and with it the loads' width, stays visible to Triton)."""
    tl.static_assert(rows.shape[0] == 1, "MXFP8 tiles are read by one warp per program")
    NB: tl.constexpr = R.block_d // 32
    b = tl.arange(0, NB)[:, None, None] * 32
    j = tl.arange(0, 32)
    if TRANSPOSED:   # (the warps' axis of rows, 1, broadcast to the blocks')
        x = rows[:, None, :] + b + j[None, :, None]
    else:
        x = rows[:, :, None] + b + j[None, None, :]
    return x


@jit
def load_codes(cache_ptr, rows, live, R: tl.constexpr, EXACT: tl.constexpr,
               GUARD: tl.constexpr):
    """One side's codes of a tile as stored, ``[W, BLOCK_N, D]`` (NVFP4: ``D / 2`` bytes, or
    ``D / 4`` uint16 with ``R.quads``; MXFP8: ``[NB, BLOCK_N, 32]``, one warp's blocks of 32; a
    bf16 / fp16 cache's bits where the interpreter would read them), transposed (``[W, D,
    BLOCK_N]``, ``[NB, 32, BLOCK_N]``) with ``R.transposed``. ``rows``: their rows'
    offsets in the cache (:func:`fp8kv.ops.addressing.slot_rows`; the pointer is at the
    program's kv head). With ``GUARD``, nothing is read unless ``live`` (zeros instead)."""
    TR: tl.constexpr = R.transposed
    if R.kind != READ_PLAIN:   # codes are bytes, whatever the cache's dtype
        cache_ptr = cache_ptr.to(tl.pointer_type(tl.uint8))
    elif EXACT:   # the interpreter's bf16 is wrong: its bits
        cache_ptr = cache_ptr.to(tl.pointer_type(tl.uint16))
    if R.kind == READ_NVFP4 and R.quads:   # four codes to a uint16
        d = tl.arange(0, R.block_d // 4)
        codes = _load(_at_columns((cache_ptr + rows).to(tl.pointer_type(tl.uint16)), d, TR),
                      _columns(d < R.head_dim // 4, TR), 0, live, GUARD)
    elif R.kind == READ_NVFP4:
        d = tl.arange(0, R.block_d // 2)
        codes = _load(_at_columns(cache_ptr + rows, d, TR), _columns(d < R.head_dim // 2, TR), 0,
                      live, GUARD)
    elif R.kind == READ_MXFP8:   # each block of 32 a batch of the dots
        at = _at_blocks(cache_ptr + rows, R, TR)
        if R.block_d == R.head_dim:
            codes = _load(at, None, None, live, GUARD)
        else:   # head_dim 96: the padding block's codes are zeros
            codes = _load(at, _at_blocks(rows * 0, R, TR) < R.head_dim, 0, live, GUARD)
    else:
        d = tl.arange(0, R.block_d)
        if R.block_d == R.head_dim:
            codes = _load(_at_columns(cache_ptr + rows, d, TR), None, None, live, GUARD)
        else:   # head_dim 80, 96, ...: the tile's padding columns are zeros
            codes = _load(_at_columns(cache_ptr + rows, d, TR), _columns(d < R.head_dim, TR), 0,
                          live, GUARD)
    return codes


@jit
def load_scales(cache_ptr, side_ptr, rows, live, R: tl.constexpr, F: tl.constexpr,
                GUARD: tl.constexpr):
    """``(blocks, columns)``: the block scales of a tile's codes (NVFP4: e4m3 ``[W, BLOCK_N,
    D / 16]``, transposed as the codes; MXFP8: E8M0 ``[NB, BLOCK_N]``, one warp's; else 0) and
    the tokens' dynamic scales ``[W, BLOCK_N]`` (1.0 without), as
    :func:`load_codes` reads codes; ``rows``: the rows' offsets in the cache and in the side
    array."""
    TR: tl.constexpr = R.transposed
    rows, srows = rows
    blocks = 0
    if R.kind == READ_NVFP4:
        db = tl.arange(0, R.block_d // 16)
        blocks = _load(_at_columns(side_ptr.to(tl.pointer_type(tl.uint8)) + srows, db, TR),
                       _columns(db < R.head_dim // 16, TR), 0, live, GUARD)
    elif R.kind == READ_MXFP8:   # E8M0 bytes [NB, N] (one warp), K's and V's alike (padding: 0)
        db = tl.arange(0, R.block_d // F.BLOCK_SIZE)[:, None]
        blocks = _load(side_ptr.to(tl.pointer_type(tl.uint8)) + srows + db,
                       db < R.head_dim // F.BLOCK_SIZE, 0, live, GUARD)
    if R.columns == COLUMNS_ARRAY:
        columns = _load(side_ptr + srows, None, None, live, GUARD)
    elif R.columns == COLUMNS_INLINE:   # the fp32 after the row's head_dim codes
        columns = _load((cache_ptr.to(tl.pointer_type(tl.uint8)) + rows + R.head_dim)
                        .to(tl.pointer_type(tl.float32)), None, None, live, GUARD)
    else:
        columns = 1.0
    return blocks, columns


@jit
def load_tile(cache_ptr, side_ptr, rows, live, R: tl.constexpr, F: tl.constexpr,
              EXACT: tl.constexpr, GUARD: tl.constexpr):
    """``(codes, blocks, columns)``: one side's bytes of a tile, as :func:`load_codes` and
    :func:`load_scales` read them. :func:`tile_operand` makes the MMA operand: apart, so that
    a tile outside the pipelined loop can issue every load before its first conversion waits
    for bytes."""
    codes = load_codes(cache_ptr, rows[0], live, R, EXACT, GUARD)
    blocks, columns = load_scales(cache_ptr, side_ptr, rows, live, R, F, GUARD)
    return codes, blocks, columns


@jit
def tile_operand(raw, R: tl.constexpr, F: tl.constexpr, TRANSPOSED: tl.constexpr,
                 EXACT: tl.constexpr):
    """``(tile, columns)``: the MMA operand of :func:`load_tile`'s bytes ``raw`` and the tokens'
    dynamic scales; ``F``: the cache's codec."""
    codes, blocks, columns = raw
    if R.kind == READ_NVFP4 and R.quads:
        BLOCK_CODES: tl.constexpr = F.BLOCK_SCALE
        tile = fp16_of_nvfp4_quads(codes, blocks, BLOCK_CODES, EXACT)
    elif R.kind == READ_NVFP4:
        BLOCK_CODES: tl.constexpr = F.BLOCK_SCALE   # (a nested constexpr is passed by name)
        tile = fp16_of_nvfp4(codes, blocks, BLOCK_CODES, EXACT, R.fuse_scale)
    elif R.kind == READ_FP8:
        tile = fp16_of_fp8(codes, F, TRANSPOSED, EXACT)
    elif R.kind == READ_MXFP8:   # the e4m3 codes as fp16; their block scales go beside them
        tile = fp16_of_fp8(codes, F, TRANSPOSED, EXACT)
        columns = blocks
    elif EXACT:   # READ_PLAIN: fp32 of the bits
        tile = plain_to_fp32(codes, R.plain_bf16)
    else:
        tile = codes
    return tile, columns


@jit
def load_query(query_ptr, q_token, q_head, row_ok, Q: tl.constexpr, R_K: tl.constexpr,
               EXACT: tl.constexpr):
    """The ``[BLOCK_M, D]`` query rows as stored (where the interpreter would read bf16 or an
    unquantized cache's fp16: their bits, uint16); :func:`query_operand` prepares them."""
    d = tl.arange(0, R_K.block_d)
    offs = q_token[:, None] * Q.stride_token + q_head[:, None] * Q.stride_head + d[None, :]
    mask = row_ok[:, None] & (d < R_K.head_dim)[None, :]
    if EXACT and (R_K.kind == READ_PLAIN or query_ptr.dtype.element_ty == tl.bfloat16):
        q = tl.load(query_ptr.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
    else:
        q = tl.load(query_ptr + offs, mask=mask, other=0)
    return q


@jit
def query_operand(q, R_K: tl.constexpr):
    """``(operand, unscale)``: :func:`load_query`'s rows as the MMA's A operand -- as stored for a
    bf16/fp16 cache, else fp16 times ``2**k`` with ``k`` putting the largest ``|q|`` in
    ``[2**14, 2**15)`` (bf16 values then round only below ``2**-25`` of it) -- and ``2**-k``."""
    if R_K.kind == READ_PLAIN:
        if q.dtype == tl.uint16:   # fp32 operands (the interpreter's bf16 is wrong)
            q = plain_to_fp32(q, R_K.plain_bf16)
        unscale = 1.0
    else:
        if q.dtype == tl.uint16:   # bf16 bits: exact widening
            x = (q.to(tl.int32) << 16).to(tl.float32, bitcast=True)
        else:
            x = q.to(tl.float32)
        amax = tl.reduce(tl.reduce(tl.abs(x), 1, max_combine), 0, max_combine)
        exp = (amax.to(tl.int32, bitcast=True) >> 23) & 0xFF     # biased exponent of amax
        k = tl.where((amax > 0) & (exp < 255), 141 - exp, 0)     # 2**k amax in [2**14, 2**15)
        k = tl.minimum(tl.maximum(k, -126), 126)
        up = ((k + 127) << 23).to(tl.float32, bitcast=True)
        q = (x * up).to(tl.float16)
        unscale = ((127 - k) << 23).to(tl.float32, bitcast=True)
        if R_K.kind == READ_NVFP4:   # even and odd columns, as the K tile has them
            q = tl.split(tl.reshape(q, (q.shape[0], q.shape[1] // 2, 2)))
    return q, unscale


@jit
def static_scale(scale_ptr, scale_value, head, KIND: tl.constexpr):
    """A side's static scale (a :class:`fp8kv.modes.ScaleKind` id): the host value (1.0 for
    none), the device scalar, or kv head ``head``'s entry."""
    if KIND == SCALE_TENSOR:
        s = tl.load(scale_ptr)
    elif KIND == SCALE_HEAD:
        s = tl.load(scale_ptr + head)
    else:
        s = scale_value
    return s


@jit
def _soft_cap(s, cap):
    """``cap * tanh(s / cap)``, from exp2 (overflow-free: tanh of ``|x|``, then the sign)."""
    x = tl.abs(s) / cap
    e = tl.math.exp2(x * (-2.0 * LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(s < 0, -t, t) * cap


# Where a tile lies in its share (``EDGE``): inside it (no token to clamp or mask: the tiles
# after the peeled one), maybe past its end (the tiles of a loop without a peeled tile), or
# the peeled tile, which ends where the share's other tiles begin and so may start before the
# share (and lies past its end where the share is empty).
INSIDE: tl.constexpr = tl.constexpr(0)
PAST_END: tl.constexpr = tl.constexpr(1)
PEELED: tl.constexpr = tl.constexpr(2)


@jit
def tile_rows(t0, seen, table, live, C: tl.constexpr, GUARD: tl.constexpr,
              EDGE: tl.constexpr):
    """``(t, k_rows, v_rows)``: the tokens of the tile of ``W * BLOCK_N`` from ``t0`` and their
    K and V rows (:func:`fp8kv.ops.addressing.slot_rows`). ``seen``: the share's first token
    and end, the last visible token, the rows' positions, the window. Tokens outside the share
    (``EDGE``) read the rows of its first or of the last visible one. ``GUARD``: a tile that may
    lie past the share's end (``live`` false), where nothing may be read -- not even the block
    table's entry of the clamped last token, as a sequence without tokens has none."""
    CACHE: tl.constexpr = C.cache
    KEY: tl.constexpr = CACHE.KEY
    VALUE: tl.constexpr = CACHE.VALUE
    G: tl.constexpr = C.geometry
    T: tl.constexpr = C.tiles
    begin, end, last, pos3, window = seen
    w = tl.arange(0, T.warps)
    n = tl.arange(0, T.block_n)
    t = t0 + w[:, None] * T.block_n + n[None, :]                 # [W, BLOCK_N]
    tc = t
    if EDGE == PEELED:
        tc = tl.maximum(tc, begin)
    if EDGE != INSIDE:
        tc = tl.minimum(tc, last)
    tc = tc.to(tl.uint32)   # (never negative: unsigned division is cheaper)
    page = _load(table + (tc // G.page_size).to(tl.int32) * G.stride_table_page, None, None,
                 live, GUARD).to(tl.int64)
    slot = (tc % G.page_size).to(tl.int32)
    k_rows = slot_rows(page, slot, KEY)
    if KEY == VALUE:   # the same strides (V of a combined cache: its own offset, compiled in)
        v_rows = k_rows
    else:
        v_rows = slot_rows(page, slot, VALUE)
    return t, k_rows, v_rows


@jit
def read_keys(t0, seen, sides, table, live, C: tl.constexpr, GUARD: tl.constexpr,
              EDGE: tl.constexpr):
    """``(t, k, k_cols, v_rows)``: :func:`tile_rows`'s tokens, their K operand and dynamic
    scales (:func:`tile_operand`) and their V rows; ``sides``: the K and V caches' and side
    arrays' pointers."""
    R_K: tl.constexpr = C.key_read   # (nested constexprs are passed by name)
    FMT: tl.constexpr = C.cache.FMT
    EXACT: tl.constexpr = C.options.exact
    t, k_rows, v_rows = tile_rows(t0, seen, table, live, C, GUARD, EDGE)
    raw = load_tile(sides[0], sides[2], k_rows, live, R_K, FMT, EXACT, GUARD)
    k, k_cols = tile_operand(raw, R_K, FMT, False, EXACT)
    return t, k, k_cols, v_rows


@jit
def load_values(v_rows, sides, live, C: tl.constexpr, GUARD: tl.constexpr):
    """:func:`load_tile` of a tile's V rows."""
    R_V: tl.constexpr = C.value_read
    FMT: tl.constexpr = C.cache.FMT
    return load_tile(sides[1], sides[3], v_rows, live, R_V, FMT, C.options.exact, GUARD)


@jit
def value_operand(raw, C: tl.constexpr):
    """``(v, v_cols)``: the V operand of :func:`load_values`' bytes and their dynamic scales."""
    R_V: tl.constexpr = C.value_read
    FMT: tl.constexpr = C.cache.FMT
    return tile_operand(raw, R_V, FMT, True, C.options.exact)


# Ask L2 for one 128-byte line at each address where the predicate holds (a hint: no result,
# no fault; marked impure so that it is kept).
_PREFETCH_L2: tl.constexpr = tl.constexpr("""{
    .reg .pred p;
    setp.ne.b32 p, $2, 0;
    @p prefetch.global.L2 [$1];
    mov.b32 $0, 0;
}""")


@jit
def _prefetch_l2(ptrs, ok):
    tl.inline_asm_elementwise(_PREFETCH_L2, "=r,l,r", [ptrs.to(tl.int64, bitcast=True),
                                                       ok.to(tl.int32)],
                              dtype=tl.int32, is_pure=False, pack=1)


@jit
def pages_ahead(t0, seen, table, C: tl.constexpr):
    """``(page, slot, ok)`` of the ``T.prefetch`` tiles from ``t0`` (``ok``: inside the share):
    their block-table entries, loaded (masked) beside the peeled tile's."""
    G: tl.constexpr = C.geometry
    T: tl.constexpr = C.tiles
    end = seen[1]
    t = t0 + tl.arange(0, T.prefetch * T.warps * T.block_n)
    ok = t < end
    page = tl.load(table + (t // G.page_size) * G.stride_table_page, mask=ok, other=0)
    return page.to(tl.int64), t % G.page_size, ok


@jit
def prefetch_rows(ahead, sides, C: tl.constexpr):
    """Prefetch into L2 the K and V rows of :func:`pages_ahead`'s tokens: the token loop's
    first loads then find them there instead of starting their DRAM round trips after the
    peeled tile's."""
    CACHE: tl.constexpr = C.cache
    KEY: tl.constexpr = CACHE.KEY
    VALUE: tl.constexpr = CACHE.VALUE
    R_K: tl.constexpr = C.key_read
    page, slot, ok = ahead
    ROW_BYTES: tl.constexpr = R_K.head_dim // 2 if R_K.kind == READ_NVFP4 else R_K.head_dim
    k_rows = slot_rows(page, slot, KEY)[0]
    v_rows = slot_rows(page, slot, VALUE)[0]
    k_ptr = sides[0].to(tl.pointer_type(tl.uint8))
    v_ptr = sides[1].to(tl.pointer_type(tl.uint8))
    for line in tl.static_range(0, ROW_BYTES, 128):
        _prefetch_l2(k_ptr + k_rows + line, ok)
        _prefetch_l2(v_ptr + v_rows + line, ok)


@jit
def attend_tile(state, qt, keys, values, seen, sides, scales, live, C: tl.constexpr,
                GUARD: tl.constexpr, EDGE: tl.constexpr):
    """One step of the token loop: a tile read by :func:`read_keys` (``keys``) folded into the
    online softmax ``state`` = ``(m, l, acc, v_exp)``; its V operand ``values`` as
    :func:`value_operand` gives it, or None: read here, after the scores (in the pipelined loop
    Triton issues the loads ahead anyway). ``qt``: the query rows' transpose ``[W, D, M]``;
    ``scales``: the score scale and the soft cap; ``C``: the constexprs; ``EDGE``: which of the
    tile's tokens may lie outside the share (masked). A guarded tile past the share's end
    leaves the state as it is (every score is masked).

    Tokens are the MMAs' M dimension and query rows their N (scores ``[W, N, M]`` = K Q^T, the
    output's transpose ``[W, D, M]`` += V^T P^T): a GQA group of 4 or 8 heads fills an MMA's 8
    columns, where as its 16 rows three quarters of every score, exponential and rescaled
    accumulator would be padding."""
    R_K: tl.constexpr = C.key_read
    R_V: tl.constexpr = C.value_read
    OPT: tl.constexpr = C.options
    T: tl.constexpr = C.tiles
    m_i, l_i, acc, v_exp = state
    begin, end, last, pos3, window = seen
    score_scale, soft_cap = scales
    t, k, k_cols, v_rows = keys
    if R_K.kind == READ_NVFP4:   # even and odd halves of the head dimension
        s = tl.dot(k[0], qt[0])
        s = tl.dot(k[1], qt[1], s)
    elif R_K.kind == READ_MXFP8:   # a dot per block of 32 (one warp), times its 2**(e - 127)
        sb = tl.dot(k, qt)                                          # [NB, N, M]
        s = tl.reduce(sb * e8m0_values(k_cols.to(tl.int32))[:, :, None], 0, _sum_combine)[None]
    else:
        s = tl.dot(k, qt, input_precision="ieee")                  # [W, N, M]
    s = s * score_scale
    if R_K.columns != COLUMNS_NONE:
        s = s * k_cols[:, :, None]
    if OPT.soft_cap:
        s = _soft_cap(s, soft_cap) * LOG2E
    if EDGE != INSIDE or OPT.varlen or OPT.window:   # (a tile inside a share: no mask)
        t3 = t[:, :, None]
        ok = tl.full(t3.shape, 1, tl.int1)
        if EDGE != INSIDE:
            ok = ok & (t3 < end)
        if EDGE == PEELED:
            ok = ok & (t3 >= begin)
        if OPT.varlen:                                          # causal among the queries
            ok = ok & (t3 <= pos3)
        if OPT.window:
            ok = ok & (t3 > pos3 - window)
        s = tl.where(ok, s, _NEG_INF)
    m_new = tl.maximum(m_i, tl.reduce(s, 1, max_combine))
    m_use = tl.where(m_new == _NEG_INF, 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_use)
    p = tl.math.exp2(s - m_use[:, None, :])
    if T.column_sums:   # per token column (no shuffles a step): added up at the share's end
        l_i = tl.fma(l_i, alpha[:, None, :], p)
    else:
        l_i = l_i * alpha + tl.reduce(p, 1, _sum_combine)
    if values is None:
        values = value_operand(load_values(v_rows, sides, live, C, GUARD), C)
    v, v_cols = values
    if R_V.columns != COLUMNS_NONE:
        # Probabilities times the tokens' V scales, in units of 2**v_exp: the largest scale
        # seen so far (a power of two, so the rescaling of acc is exact).
        col_bits = tl.reduce(v_cols.to(tl.int32, bitcast=True), 1, max_combine)
        tile_exp = (tl.reduce(col_bits, 0, max_combine) >> 23) - 127
        new_exp = tl.maximum(v_exp, tile_exp)
        alpha = alpha * ((127 + v_exp - new_exp) << 23).to(tl.float32, bitcast=True)
        v_exp = new_exp
        unit = ((127 - v_exp) << 23).to(tl.float32, bitcast=True)
        p = p * (v_cols * unit)[:, :, None]
    if R_V.kind == READ_MXFP8:
        # Block b's probabilities times the tokens' 2**e of block b, in units of 2**v_exp[b]:
        # the largest seen so far in block b (a power of two: the rescaling of acc is exact).
        e = v_cols.to(tl.int32)                                     # [NB, N]
        tile_exp = tl.reduce(tl.where(e == 255, 0, e), 1, max_combine)   # [NB]
        new_exp = tl.maximum(v_exp, tile_exp)
        down = _pow2_at_most_1(v_exp - new_exp, v_exp)              # [NB]
        unit = _pow2_at_most_1(e - new_exp[:, None], e)             # NaN where e is 0xFF
        v_exp = new_exp
        pb = (p * unit[:, :, None]).to(tl.float16)                  # [NB, N, M] (one warp)
        acc = tl.dot(v, pb, acc * (alpha * down[:, None])[:, None, :])
    elif R_V.kind == READ_NVFP4:   # output columns 4j + c, c = 0..3 (fp16_of_nvfp4_quads)
        pv = p.to(tl.float16)
        acc = (tl.dot(v[0], pv, acc[0] * alpha[:, None, :]),
               tl.dot(v[1], pv, acc[1] * alpha[:, None, :]),
               tl.dot(v[2], pv, acc[2] * alpha[:, None, :]),
               tl.dot(v[3], pv, acc[3] * alpha[:, None, :]))
    else:
        acc = acc * alpha[:, None, :]
        acc = tl.dot(v, p.to(v.dtype), acc, input_precision="ieee")
    m_i = m_new
    return m_i, l_i, acc, v_exp


@jit
def _pow2_at_most_1(x, e):
    """fp32 ``2**x`` of int32 ``x <= 0``, 0 below ``2**-126`` (no subnormal: XLA:CPU, where the
    interpreter also runs, would flush one), NaN where the E8M0 code ``e`` is 0xFF."""
    bits = tl.where(x >= -126, (x + 127) << 23, 0)
    return tl.where(e == 255, NAN_BITS_FP32, bits).to(tl.float32, bitcast=True)


@jit
def warps_sum(x, WARPS: tl.constexpr):
    """The sum over axis 0 (the warps) of ``[W, M, D]``. Two warps (the size tables'): the
    warps' axis moved last and split, ``x0 + x1`` -- one exchange through shared memory, where
    ``tl.reduce`` over an axis across warps takes a tree of them."""
    if WARPS == 2:
        a, b = tl.split(tl.permute(x, (1, 2, 0)))
        s = a + b
    else:
        s = tl.reduce(x, 0, _sum_combine)
    return s


@jit
def balanced_share(seq_lens_ptr, slot, num_seqs, window, C: tl.constexpr):
    """``(b, split, splits, seq_len)``: the sequence whose share ``slot`` reads (``b >=
    num_seqs`` past the last share), which of its ``splits`` shares, and its length. Each
    sequence has one slot and a part of the others in proportion to its length ``n``, at most
    the plan's cap and ``n / min_share`` (SPEC 16.2); sequences take consecutive slots."""
    G: tl.constexpr = C.geometry
    T: tl.constexpr = C.tiles
    idx = tl.arange(0, T.block_b)
    lens = tl.load(seq_lens_ptr + idx, mask=idx < num_seqs, other=0)
    n = tl.maximum(lens, 0)
    if C.options.window:   # what a row tile can see: the window and the rows' own span
        n = tl.minimum(n, window + T.m_tiles * T.block_m // G.group)
    n = n.to(tl.int64)
    total = tl.maximum(tl.reduce(n, 0, _sum_combine), 1)
    extra = tl.num_programs(1) - num_seqs
    splits = tl.minimum(tl.minimum(1 + n * extra // total, T.split_cap),
                        tl.maximum(n // T.min_share, 1))
    splits = tl.where(idx < num_seqs, splits, 0).to(tl.int32)
    after = tl.associative_scan(splits, 0, _sum_combine)
    b = tl.reduce((after <= slot).to(tl.int32), 0, _sum_combine)
    mine = idx == b
    first = tl.reduce(tl.where(mine, after - splits, 0), 0, _sum_combine)
    return (b, slot - first, tl.reduce(tl.where(mine, splits, 0), 0, _sum_combine),
            tl.reduce(tl.where(mine, lens, 0), 0, _sum_combine))


@jit(do_not_specialize=["layer", "window", "stride_table", "num_seqs"])
def _paged_attention_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, table_ptr, seq_lens_ptr, query_start_ptr,
    key_scale_ptr, value_scale_ptr, key_side_ptr, value_side_ptr, sinks_ptr, layer_ptr,
    key_scale_value, value_scale_value, window, layer, stride_table, num_seqs,
    out_ptr, partial_out_ptr, partial_stats_ptr, partial_rows_ptr,
    C: tl.constexpr,
):
    Q: tl.constexpr = C.query
    CACHE: tl.constexpr = C.cache
    KEY: tl.constexpr = CACHE.KEY
    VALUE: tl.constexpr = CACHE.VALUE
    R_K: tl.constexpr = C.key_read
    R_V: tl.constexpr = C.value_read
    G: tl.constexpr = C.geometry
    T: tl.constexpr = C.tiles
    OPT: tl.constexpr = C.options
    if T.pdl and OPT.pipelined:   # the merge may be launched now: it waits for this grid's end
        gdc_launch_dependents()
    hm = tl.program_id(0)
    slot = tl.program_id(1)
    m_tile = hm % T.m_tiles
    h = hm // T.m_tiles
    if T.block_b > 0:
        b, split, splits, seq_len = balanced_share(seq_lens_ptr, slot, num_seqs, window, C)
        if b >= num_seqs:   # a slot this call's lengths leave unused
            return
    else:
        b = slot // T.splits
        split = slot % T.splits
        splits = T.splits
    if OPT.varlen:
        q_first = tl.load(query_start_ptr + b)
        q_len = tl.load(query_start_ptr + b + 1) - q_first
    else:
        q_first = b
        q_len = 1
    # Rows: query token i = r // GROUP of the sequence, head g = r % GROUP of the group.
    rows = m_tile * T.block_m + tl.arange(0, T.block_m)
    i = rows // G.group
    row_ok = i < q_len
    q_token = q_first + i
    q_head = h * G.group + rows % G.group
    # The query's bytes requested first thing: nothing before them depends on a load.
    q_raw = load_query(query_ptr, q_token, q_head, row_ok, Q, R_K, OPT.exact)
    k_static = static_scale(key_scale_ptr, key_scale_value, h, R_K.scale)
    v_static = static_scale(value_scale_ptr, value_scale_value, h, R_V.scale)
    if T.block_b == 0:
        seq_len = tl.load(seq_lens_ptr + b)
    if CACHE.LAYER_KIND != LAYER_NONE:   # stacked caches: move to the call's layer
        layer, seq_len = select_layer(layer_ptr, layer, seq_len, KIND=CACHE.LAYER_KIND,
                                      NUM_LAYERS=CACHE.NUM_LAYERS)
        key_cache_ptr = at_layer(key_cache_ptr, layer, KEY, False)
        value_cache_ptr = at_layer(value_cache_ptr, layer, VALUE, False)
        if R_K.side:
            key_side_ptr = at_layer(key_side_ptr, layer, KEY, True)
        if R_V.side:
            value_side_ptr = at_layer(value_side_ptr, layer, VALUE, True)
    pos = seq_len - q_len + i                    # each row's position in the sequence
    # The tokens these rows see: [lo, hi), split into ``splits`` shares of whole tiles.
    i_first = (m_tile * T.block_m) // G.group
    i_end = tl.minimum(q_len, (m_tile * T.block_m + T.block_m + G.group - 1) // G.group)
    hi = tl.maximum(seq_len - q_len + i_end, 0)
    if OPT.window:
        lo = tl.maximum(seq_len - q_len + i_first - window + 1, 0)
    else:
        lo = 0
    hi = tl.where(i_end > i_first, hi, lo)
    TILE: tl.constexpr = T.warps * T.block_n
    share = ((tl.maximum(hi - lo, 0) + splits - 1) // splits + TILE - 1) // TILE * TILE
    start = lo + split * share
    end = tl.minimum(start + share, hi)
    last = tl.maximum(hi - 1, 0)

    table = table_ptr + b.to(tl.int64) * stride_table
    # Every pointer at this program's kv head (a side array only where the call has one: an
    # unused pointer may be a compiled-in None).
    key_cache_ptr += h * KEY.CODES.HEAD
    value_cache_ptr += h * VALUE.CODES.HEAD
    if R_K.side:
        key_side_ptr += h * KEY.SCALES.HEAD
    if R_V.side:
        value_side_ptr += h * VALUE.SCALES.HEAD
    sides = (key_cache_ptr, value_cache_ptr, key_side_ptr, value_side_ptr)
    seen = (start, end, last, pos[None, None, :], window)
    # The first tile before the loop (``peel``): the query's MMA operand then has a user outside
    # the loop too, so Triton loads it from shared memory once, here, and keeps it in registers
    # (with one user in the loop it reloads it there every step, and its shared buffer stays
    # allocated beside the pipeline's). Outside the pipeline nothing issues its loads early, and
    # a conversion waits for its bytes at a barrier (its layout change goes through shared
    # memory) that no later load passes: the tile's scales, V's codes and K's codes are all
    # requested (after the query's) before any of them is converted, so that their round trips
    # overlap -- in that order, as Triton puts a load's layout change right after it.
    GUARD: tl.constexpr = 1 if OPT.pipelined else 2
    FMT: tl.constexpr = CACHE.FMT
    if T.peel:
        PREFETCH: tl.constexpr = T.prefetch > 0 and OPT.pipelined   # (no asm interpreted)
        # ``align_end``: the share's tiles end at its end: the peeled one takes what a whole
        # number of tiles leaves over at its start (and tokens before it, masked), so that every
        # tile in the loop lies inside the share, with no token to clamp or mask.
        if T.align_end:
            first = end - (tl.maximum(end - start, 0) + TILE - 1) // TILE * TILE
            FIRST_EDGE: tl.constexpr = PEELED
        else:
            first = start
            FIRST_EDGE: tl.constexpr = PAST_END
        if PREFETCH:   # the next tiles' block-table entries, requested with the first's
            ahead = pages_ahead(first + TILE, seen, table, C)
        live = start < end
        first_t, first_k_rows, first_v_rows = tile_rows(first, seen, table, live, C, GUARD,
                                                        FIRST_EDGE)
        k_scales = load_scales(sides[0], sides[2], first_k_rows, live, R_K, FMT, GUARD)
        v_scales = load_scales(sides[1], sides[3], first_v_rows, live, R_V, FMT, GUARD)
        v_codes = load_codes(sides[1], first_v_rows[0], live, R_V, OPT.exact, GUARD)
        k_codes = load_codes(sides[0], first_k_rows[0], live, R_K, OPT.exact, GUARD)
        if PREFETCH:
            prefetch_rows(ahead, sides, C)
    q, unscale = query_operand(q_raw, R_K)
    if R_K.kind == READ_NVFP4:
        HALF: tl.constexpr = R_K.block_d // 2
        qt = (tl.broadcast_to(tl.trans(q[0])[None, :, :], [T.warps, HALF, T.block_m]),
              tl.broadcast_to(tl.trans(q[1])[None, :, :], [T.warps, HALF, T.block_m]))
    elif R_K.kind == READ_MXFP8:   # [NB, 32, M]: block b of the query's columns (one warp)
        qt = tl.reshape(tl.trans(q), [R_K.block_d // 32, 32, T.block_m])
    else:
        qt = tl.broadcast_to(tl.trans(q)[None, :, :], [T.warps, R_K.block_d, T.block_m])
    score_scale = OPT.softmax_scale * k_static * unscale * R_K.unit
    if not OPT.soft_cap:
        score_scale = score_scale * LOG2E
    m_i = tl.full([T.warps, T.block_m], _NEG_INF, tl.float32)
    if T.column_sums:
        l_i = tl.full([T.warps, T.block_n, T.block_m], 0.0, tl.float32)
    else:
        l_i = tl.full([T.warps, T.block_m], 0.0, tl.float32)
    if R_V.kind == READ_NVFP4:   # output columns 4j + c, c = 0..3 (transposed, as every acc)
        acc = (tl.full([T.warps, R_V.block_d // 4, T.block_m], 0.0, tl.float32),
               tl.full([T.warps, R_V.block_d // 4, T.block_m], 0.0, tl.float32),
               tl.full([T.warps, R_V.block_d // 4, T.block_m], 0.0, tl.float32),
               tl.full([T.warps, R_V.block_d // 4, T.block_m], 0.0, tl.float32))
    elif R_V.kind == READ_MXFP8:   # [NB, 32, M]: block b of the output's columns (one warp)
        acc = tl.full([R_V.block_d // 32, 32, T.block_m], 0.0, tl.float32)
    else:
        acc = tl.full([T.warps, R_V.block_d, T.block_m], 0.0, tl.float32)
    # 2**v_exp: the unit of acc (dynamic V scales; MXFP8: one per block, 2**(v_exp - 127))
    if R_V.kind == READ_MXFP8:
        v_exp = tl.full([R_V.block_d // 32], 0, tl.int32)
    else:
        v_exp = 0
    state = (m_i, l_i, acc, v_exp)
    scales = (score_scale, OPT.cap)
    if T.peel:
        k, k_cols = tile_operand((k_codes, k_scales[0], k_scales[1]), R_K, FMT, False,
                                 OPT.exact)
        first_keys = (first_t, k, k_cols, first_v_rows)
        first_values = value_operand((v_codes, v_scales[0], v_scales[1]), C)
        state = attend_tile(state, qt, first_keys, first_values, seen, sides, scales,
                            start < end, C, GUARD, FIRST_EDGE)
        first += TILE
        EDGE: tl.constexpr = INSIDE if T.align_end else PAST_END
    else:
        first = start
        EDGE: tl.constexpr = PAST_END
    if OPT.pipelined:
        for t0 in tl.range(first, end, TILE, num_stages=T.stages):
            keys = read_keys(t0, seen, sides, table, True, C, 0, EDGE)
            state = attend_tile(state, qt, keys, None, seen, sides, scales, True, C, 0, EDGE)
    else:   # the interpreter takes loop bounds from host scalars only: a while loop there
        t0 = first
        while t0 < end:
            keys = read_keys(t0, seen, sides, table, True, C, 0, EDGE)
            state = attend_tile(state, qt, keys, None, seen, sides, scales, True, C, 0, EDGE)
            t0 += TILE
    m_i, l_i, acc, v_exp = state
    if T.column_sums:
        l_i = tl.reduce(l_i, 1, _sum_combine)

    # Merge the warps' softmax states.
    m_all = tl.reduce(m_i, 0, max_combine)
    m_all_use = tl.where(m_all == _NEG_INF, 0.0, m_all)
    weight = tl.math.exp2(m_i - m_all_use[None, :])
    l_all = tl.reduce(l_i * weight, 0, _sum_combine)
    if R_V.kind == READ_NVFP4:   # columns 4j + c back in order
        s0 = tl.trans(warps_sum(acc[0] * weight[:, None, :], T.warps))
        s1 = tl.trans(warps_sum(acc[1] * weight[:, None, :], T.warps))
        s2 = tl.trans(warps_sum(acc[2] * weight[:, None, :], T.warps))
        s3 = tl.trans(warps_sum(acc[3] * weight[:, None, :], T.warps))
        o = tl.reshape(tl.join(tl.join(s0, s2), tl.join(s1, s3)), (T.block_m, R_V.block_d))
    else:
        if R_V.kind == READ_MXFP8:   # the blocks in order (one warp); each times its scale below
            acc = tl.reshape(acc, (1, R_V.block_d, T.block_m))
        o = tl.trans(warps_sum(acc * weight[:, None, :], T.warps))
    out_scale = v_static * R_V.unit
    if R_V.columns != COLUMNS_NONE:
        out_scale = out_scale * ((127 + v_exp) << 23).to(tl.float32, bitcast=True)
    if R_V.kind == READ_MXFP8:
        block_scale = e8m0_values(v_exp)
        o = o * tl.reshape(tl.broadcast_to(block_scale[:, None], (block_scale.shape[0], 32)),
                           (R_V.block_d,))[None, :]
    o = o * out_scale
    q_row = (q_first + i).to(tl.int64) * G.num_heads + h * G.group + rows % G.group
    d = tl.arange(0, R_V.block_d)
    d_ok = d < R_V.head_dim
    if T.merged and T.block_b == 0:
        # Every row split alike: partial ``q_row * SPLITS + split``, found by the merge from
        # its row alone (no index to load first: one round trip fewer before its sums).
        part = q_row * T.splits + split
        tl.store(partial_out_ptr + part[:, None] * R_V.head_dim + d[None, :], o,
                 mask=row_ok[:, None] & d_ok[None, :])
        tl.store(partial_stats_ptr + part * 2, m_all, mask=row_ok)
        tl.store(partial_stats_ptr + part * 2 + 1, l_all, mask=row_ok)
    elif T.merged:
        # Balanced: partial ``(slot * programs_per_slot + hm) * BLOCK_M + r`` for row r of the
        # tile; the first share tells the merge where its row's partials start and how many
        # there are (one: written here).
        SLOT_PARTIALS: tl.constexpr = G.num_kv_heads * T.m_tiles * T.block_m
        part = (slot.to(tl.int64) * SLOT_PARTIALS + hm * T.block_m
                + tl.arange(0, T.block_m))
        # (the program's scalars as row vectors: a mask is a vector of booleans)
        row_splits = tl.full([T.block_m], 0, tl.int32) + splits
        first_share = row_ok & (tl.full([T.block_m], 0, tl.int32) + split == 0)
        index = partial_rows_ptr.to(tl.pointer_type(tl.int32)) + q_row * 2
        tl.store(index, part.to(tl.int32), mask=first_share)
        tl.store(index + 1, row_splits, mask=first_share)
        split_rows = row_ok & (row_splits > 1)
        tl.store(partial_out_ptr + part[:, None] * R_V.head_dim + d[None, :], o,
                 mask=split_rows[:, None] & d_ok[None, :])
        tl.store(partial_stats_ptr + part * 2, m_all, mask=split_rows)
        tl.store(partial_stats_ptr + part * 2 + 1, l_all, mask=split_rows)
        finish(o, m_all, l_all, q_row, row_ok & (row_splits == 1), d, d_ok, sinks_ptr, out_ptr,
               C)
    else:
        finish(o, m_all, l_all, q_row, row_ok, d, d_ok, sinks_ptr, out_ptr, C)


@jit
def finish(o, m, l, q_row, row_ok, d, d_ok, sinks_ptr, out_ptr, C: tl.constexpr):
    """Write ``o / l`` (``[ROWS, D]`` in units of ``2**m``, row sums ``l``) with the rows' sinks
    in the denominator; rows that see nothing (``l`` 0, no sink) give zeros."""
    G: tl.constexpr = C.geometry
    OPT: tl.constexpr = C.options
    if OPT.sinks:
        sink = tl.load(sinks_ptr + q_row % G.num_heads, mask=row_ok, other=0.0) * LOG2E
        top = tl.maximum(m, sink)
        top = tl.where(top == _NEG_INF, 0.0, top)
        keep = tl.math.exp2(m - top)
        l = l * keep + tl.math.exp2(sink - top)
        o = o * keep[:, None]
    o = o / tl.where(l == 0.0, 1.0, l)[:, None]
    bits = fp32_to_output_bits(o, OUT_KIND=OPT.out_kind, EXACT=OPT.exact)
    dst = out_ptr.to(tl.pointer_type(tl.uint16))
    tl.store(dst + q_row[:, None] * G.head_dim + d[None, :], bits.to(tl.uint16),
             mask=row_ok[:, None] & d_ok[None, :])


@jit
def share_partials(first, count, row_ok, k, s, STRIDE: tl.constexpr):
    """``(part, ok)``: the partials' indices of shares ``k + s`` of each row (``[ROWS,
    BLOCK_S]``, ``first`` the row's first partial, ``STRIDE`` apart) and where they exist."""
    part = first[:, None] + (k + s[None, :]) * STRIDE
    ok = row_ok[:, None] & (k + s[None, :] < count[:, None])
    return part, ok


@jit
def merge_block(partial_out_ptr, partial_stats_ptr, first, count, row_ok, k, s, d, d_ok,
                STRIDE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Shares ``k + s`` of each row (:func:`share_partials`): their row maxima, row sums and
    ``[ROWS, BLOCK_S, D]`` partials."""
    part, ok = share_partials(first, count, row_ok, k, s, STRIDE)
    m = tl.load(partial_stats_ptr + part * 2, mask=ok, other=_NEG_INF)
    l = tl.load(partial_stats_ptr + part * 2 + 1, mask=ok, other=0.0)
    parts = tl.load(partial_out_ptr + part[:, :, None] * HEAD_DIM + d[None, None, :],
                    mask=ok[:, :, None] & d_ok[None, None, :], other=0.0)
    return m, l, parts


@jit(do_not_specialize=["num_rows"])
def _attention_merge_kernel(partial_out_ptr, partial_stats_ptr, partial_rows_ptr, sinks_ptr,
                            written_ptr, num_rows, num_partials, out_ptr, C: tl.constexpr,
                            BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, ROWS: tl.constexpr):
    """Combine the partials of ``ROWS`` output rows (token, query head) per program, in split
    order; a row of one share is left as the attention grid wrote it (``written_ptr``, never
    read: the buffer ``out_ptr`` shares, so that an aliasing frontend keeps those rows)."""
    G: tl.constexpr = C.geometry
    T: tl.constexpr = C.tiles
    if T.pdl and C.options.pipelined:   # launched before the attention grid ended: wait for it
        gdc_wait()
    q_row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = q_row < num_rows
    q_row = tl.where(row_ok, q_row, 0).to(tl.int64)
    if T.block_b == 0:   # every row split alike: its partials side by side, at its index
        first = q_row * T.splits
        count = tl.full([ROWS], T.splits, tl.int32)
        STRIDE: tl.constexpr = 1
    else:   # balanced: where the row's first share said; a row of one share is written
        index = partial_rows_ptr.to(tl.pointer_type(tl.int32)) + q_row * 2
        first = tl.load(index, mask=row_ok, other=0).to(tl.int64)
        count = tl.load(index + 1, mask=row_ok, other=1)
        STRIDE: tl.constexpr = G.num_kv_heads * T.m_tiles * T.block_m
        # The index of a query row past the last sequence's (a padded batch) is never written:
        # kept inside the workspace (a written one is already).
        count = tl.minimum(tl.maximum(count, 1), T.split_cap)
        first = tl.minimum(tl.maximum(first, 0), num_partials - 1 - (count - 1) * STRIDE)
        row_ok = row_ok & (count > 1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    d_ok = d < G.head_dim
    if BLOCK_S >= T.split_cap:
        # Every row's shares in one block: their partials requested together, one pass.
        m, l, parts = merge_block(partial_out_ptr, partial_stats_ptr, first, count, row_ok, 0,
                                  s, d, d_ok, STRIDE, G.head_dim)
        top = tl.reduce(m, 1, max_combine)
        weight = tl.math.exp2(m - tl.where(top == _NEG_INF, 0.0, top)[:, None])   # 0: empty
        l = tl.reduce(l * weight, 1, _sum_combine)
        o = tl.reduce(parts * weight[:, :, None], 1, _sum_combine)
    else:
        # Blocks of BLOCK_S shares in split order, twice: each row's largest partial max, then
        # its partials weighted and summed (a block of every share's [ROWS, D] partials at the
        # plan's cap would not fit in registers).
        shares = tl.reduce(tl.where(row_ok, count, 0), 0, max_combine)
        top = tl.full([ROWS], _NEG_INF, tl.float32)
        k = 0
        while k < shares:
            part, ok = share_partials(first, count, row_ok, k, s, STRIDE)
            m = tl.load(partial_stats_ptr + part * 2, mask=ok, other=_NEG_INF)
            top = tl.maximum(top, tl.reduce(m, 1, max_combine))
            k += BLOCK_S
        top_use = tl.where(top == _NEG_INF, 0.0, top)
        o = tl.full([ROWS, BLOCK_D], 0.0, tl.float32)
        l = tl.full([ROWS], 0.0, tl.float32)
        k = 0
        while k < shares:
            m, l_k, parts = merge_block(partial_out_ptr, partial_stats_ptr, first, count,
                                        row_ok, k, s, d, d_ok, STRIDE, G.head_dim)
            weight = tl.math.exp2(m - top_use[:, None])                     # 0: empty shares
            l += tl.reduce(l_k * weight, 1, _sum_combine)
            o += tl.reduce(parts * weight[:, :, None], 1, _sum_combine)
            k += BLOCK_S
    finish(o, top, l, q_row, row_ok, d, d_ok, sinks_ptr, out_ptr, C)
