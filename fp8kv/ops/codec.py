"""The kernels' codec: fp32 <-> cache codes per format, scales, division and output rounding.

A format reaches the kernels as its row's record, :class:`fp8kv.formats.Codec` (the ``FMT``
field of :class:`fp8kv.constexprs.Cache`): :func:`encode` and :func:`decode` are written once over
its fields (exponent and mantissa bits, bias, largest code, NaN code, infinities or not), so a new
FP8-like format is a new row, not a new branch. Scale kinds reach them as ids
(:class:`fp8kv.modes.ScaleKind`), compared by equality.

NVFP4 (a packed format: two 4-bit codes per byte, each depending on its block) has kernels of its
own (``write_nvfp4``, ``dequantize_nvfp4``). Its helpers are at the end of this module: the block
scales, the division by them, E2M1 encoding (one implementation: fp32 arithmetic, exact on every
path) and decoding, and the FP8 output's per-block table and lookup (PTX ``prmt`` through
``tl.inline_asm_elementwise`` on the GPU, elementwise on int32 words, so no layout assumption;
integer selection on the exact path).

Each conversion has two implementations selected by the ``EXACT`` constexpr:

* fast  -- the hardware conversions of the codec's ``TRITON_DTYPE`` (``cvt.rn.satfinite`` to fp8,
  ``cvt.rn`` to bf16/fp16);
* exact -- integer arithmetic on the IEEE bit patterns. Triton's CPU interpreter rounds fp32->fp8
  and fp32->bf16 wrongly (docs/SPEC.md), so the interpreter runs this path; the GPU suite proves both
  paths give the same bytes on every bf16/fp16 pattern. A format without a hardware dtype takes
  it on every path.

Codes travel as int32 holding 0..255 (fp8) or as the output's unsigned bit pattern.
"""
import triton.language as tl

from .. import formats
from ..modes import Division, OutKind, ScaleKind
from ._dual import jit

# Every number below comes from fp8kv.formats / fp8kv.modes: kernels see them as constexpr globals.
DIV_FP64: tl.constexpr = tl.constexpr(int(Division.FP64))
SCALE_NONE: tl.constexpr = tl.constexpr(ScaleKind.NONE.id)
SCALE_VALUE: tl.constexpr = tl.constexpr(ScaleKind.VALUE.id)
SCALE_TENSOR: tl.constexpr = tl.constexpr(ScaleKind.TENSOR.id)
SCALE_HEAD: tl.constexpr = tl.constexpr(ScaleKind.HEAD.id)
SCALE_TOKEN: tl.constexpr = tl.constexpr(ScaleKind.TOKEN.id)
SCALE_TOKEN_HEAD: tl.constexpr = tl.constexpr(ScaleKind.TOKEN_HEAD.id)
SCALE_BLOCK: tl.constexpr = tl.constexpr(ScaleKind.BLOCK.id)
SCALE_FLOOR: tl.constexpr = tl.constexpr(formats.DYNAMIC_SCALE_FLOOR)
OUT_BFLOAT16: tl.constexpr = tl.constexpr(int(OutKind.BFLOAT16))
OUT_FLOAT16: tl.constexpr = tl.constexpr(int(OutKind.FLOAT16))
OUT_FLOAT32: tl.constexpr = tl.constexpr(int(OutKind.FLOAT32))
OUT_FLOAT8_E4M3FN: tl.constexpr = tl.constexpr(int(OutKind.FLOAT8_E4M3FN))
NAN_BITS_BF16: tl.constexpr = tl.constexpr(formats.CANONICAL_NAN_BITS["bfloat16"])
NAN_BITS_FP16: tl.constexpr = tl.constexpr(formats.CANONICAL_NAN_BITS["float16"])
NAN_BITS_FP32: tl.constexpr = tl.constexpr(formats.CANONICAL_NAN_BITS["float32"])
_INF: tl.constexpr = tl.constexpr(float("inf"))
# 2**23, which added to a value in [0, 2**22) rounds it to an integer (RNE) in the low mantissa
# bits (E2M1 encoding).
ROUND_TO_INT: tl.constexpr = tl.constexpr(2.0 ** 23)
# No NaN constexpr: Triton re-checks a kernel's globals on every launch with `!=`, and NaN != NaN.


@jit
def load_scale(scale_ptr, scale_value, head, head_mask, KIND: tl.constexpr):
    """A static scale (``KIND`` VALUE, TENSOR or HEAD): a scalar, or a per-element vector
    gathered by ``head``."""
    if KIND == SCALE_VALUE:
        s = scale_value
    elif KIND == SCALE_TENSOR:
        s = tl.load(scale_ptr)
    else:
        s = tl.load(scale_ptr + head, mask=head_mask, other=1.0)
    return s


@jit
def reciprocal_divide(x, s, y):
    """``(q0, q2)``: ``x / s`` from ``y = RN(1/s)`` as ``q0 = RN(x y)`` and two FMA corrections
    ``q_{i+1} = RN(q_i - RN(q_i s - x) y)``.

    ``q0`` is within 2 ulps of ``x/s``, ``q1`` then within 1 ulp, and by Markstein's theorem (``y``
    within half an ulp of ``1/s``, ``q1`` within one ulp of ``x/s``, exact remainder)
    ``q2 = RN(x/s)`` -- where nothing overflows or underflows; the callers say where that holds.
    The remainder is taken as ``q s - x`` (not ``x - q s``) so that a +-0 ``x`` keeps its sign
    through the corrections. Negations are products: Triton lowers ``-v`` as ``0 - v``, which
    turns a -0 into +0 (for ``s = inf``, ``y = 0`` and ``-y`` must be -0).
    """
    neg_y = y * -1.0
    neg_x = x * -1.0
    q0 = x * y
    q1 = tl.math.fma(tl.math.fma(q0, s, neg_x), neg_y, q0)
    return q0, tl.math.fma(tl.math.fma(q1, s, neg_x), neg_y, q1)


@jit
def scalar_scale(scale_ptr, scale_value, KIND: tl.constexpr):
    """A per-tensor static scale (``KIND`` VALUE or TENSOR) as one fp32 value. Programs load it
    before their rows, so that its round trip overlaps theirs (loaded after a row's division, a
    second scale cost a small write a whole extra trip). Other kinds: ``scale_value`` (1.0, never
    applied; a per-head scale is gathered per column by :func:`load_scale`)."""
    if KIND == SCALE_TENSOR:
        s = tl.load(scale_ptr)
    else:
        s = scale_value
    return s


@jit
def scalar_divisor(s):
    """``(s1, y, f1, f2)`` for :func:`divide_by_scalar`: ``s = s1 / (f1 f2)`` with ``f1``, ``f2``
    powers of two and ``|s1|`` in ``[1, 2)`` when ``s`` is finite and nonzero (subnormal
    included; the sign stays on ``s1``), else ``s1 = s`` and ``f1 = f2 = 1``; ``y = RN(1 / s1)``.
    Scalar work, once per program."""
    bits = s.to(tl.int32, bitcast=True)
    subnormal = ((bits & 0x7F800000) == 0) & ((bits & 0x7FFFFF) != 0)
    s = tl.where(subnormal, s * 18446744073709551616.0, s)          # * 2**64, exact
    bits = s.to(tl.int32, bitcast=True)
    exp = (bits >> 23) & 0xFF
    finite = (exp > 0) & (exp < 255)
    s1 = tl.where(finite, ((bits & -2139095041) | 0x3F800000).to(tl.float32, bitcast=True), s)
    k = tl.where(finite, 127 - exp + tl.where(subnormal, 64, 0), 0)   # f1 f2 = 2**k, -127..190
    k1 = k >> 1
    f1 = ((k1 + 127) << 23).to(tl.float32, bitcast=True)
    f2 = ((k - k1 + 127) << 23).to(tl.float32, bitcast=True)
    return s1, reciprocal_rn(s1), f1, f2


@jit
def reciprocal_rn(s):
    """``RN(1 / s)`` for ``|s|`` in ``[1, 2)`` (IEEE's ``1 / s`` for +-0, +-inf and NaN), without a
    branch: ``div_rn`` checks its operands and may call a slow path, and that control flow kept
    the compiler from running two sides' reciprocals side by side.

    ``y0 = 1 / s`` (the GPU's approximate division: within 2 ulps) is refined by two Newton steps
    in fp64 (relative error below 2**-52), then rounded to fp32. That rounding is ``RN(1/s)``:
    ``1/s`` is never an fp32 midpoint and lies at least 2**-49 (relative) from every one, far
    more than the fp64 error. The GPU suite compares it with ``div_rn`` for every fp32 ``s`` in
    ``[1, 2)``, both signs.
    """
    y0 = 1.0 / s
    a = s.to(tl.float64)
    y = y0.to(tl.float64)
    y = tl.math.fma(tl.math.fma(a * -1.0, y, 1.0), y, y)
    y = tl.math.fma(tl.math.fma(a * -1.0, y, 1.0), y, y)
    m = tl.abs(s)
    return tl.where((m >= 1.0) & (m < 2.0), y.to(tl.float32), y0)


@jit
def divide_by_scalar(x, s1, y, f1, f2):
    """``RN(x / s)`` for one scale ``s`` of any value (:func:`scalar_divisor` gave ``s1``, ``y``,
    ``f1``, ``f2``), without a branch.

    ``x' = x f1 f2`` is ``x`` scaled by the power of two that brings ``s`` to ``s1`` in
    ``[1, 2)``, so ``x' / s1 = x / s`` exactly and :func:`reciprocal_divide` (Markstein's
    theorem: ``y = RN(1/s1)``, the remainder exact) gives ``RN(x' / s1)`` wherever
    ``2**-40 <= |q0| <= 2**40``. Everywhere else ``q0`` already has the fp8 code of ``RN(x / s)``:
    a ``q0`` that small is +-0 in fp8 (with its sign), that large saturates; ``x'`` overflows only
    where ``|x / s| > 2**126`` (saturates) and loses bits in the subnormal range only where
    ``|x / s| < 2**-126`` (+-0 in fp8); s = +-0, +-inf or NaN give IEEE's inf, 0 or NaN through
    ``y``. One code path for every scale keeps a small write's code short: an out-of-line branch
    to per-element ``div_rn`` would sit on a small write's critical path. The GPU suite checks it
    against ``div_rn`` on all 2**32 fp32 inputs for a set of scales, extremes included.
    """
    xs = (x * f1) * f2
    q0, q2 = reciprocal_divide(xs, s1, y)
    a = tl.abs(q0)
    return tl.where((a >= 2.0 ** -40) & (a <= 2.0 ** 40), q2, q0)


@jit
def reciprocal_fp64(s):
    """``RN64(1 / s)`` of an fp32 ``s`` (``div.rn.f64``: +-inf for +-0, +-0 for +-inf, NaN for
    NaN). Once per program."""
    return 1.0 / s.to(tl.float64)


@jit
def divide_fp64(x, r):
    """The fp32 quotient ``RN32(RN64(x r))`` for ``r = RN64(1/s)`` (:func:`reciprocal_fp64`),
    which has the fp8 code of ``RN(x / s)`` for every ``x`` and ``s``.

    ``x r`` is ``x / s`` within a relative 2**-52 (two fp64 roundings), and no fp64 product of
    fp32 values overflows or underflows. An exact fp32 quotient ``x / s`` is never an fp32
    midpoint where it is normal, and lies at least 2**-49 (relative) from every one (its
    significand is a ratio of 24-bit integers), so rounding the product to fp32 gives
    ``RN(x / s)`` there; a quotient below 2**-126 is +-0 in fp8 however it rounds, and the
    product keeps its sign; zeros, infinities and NaNs follow IEEE's division through ``r``.
    One fp64 product and two conversions per element, after a single ``div.rn.f64`` per program:
    the shortest chain from a loaded scale to the codes. The GPU suite compares it with
    ``div_rn``'s codes on all 2**32 fp32 inputs for a set of scales, extremes included.
    """
    return (x.to(tl.float64) * r).to(tl.float32)


@jit
def scalar_reciprocal(s, KIND: tl.constexpr, EXACT: tl.constexpr, RECIPROCAL: tl.constexpr):
    """:func:`divide`'s divisor for one scale ``s`` of ``KIND`` (VALUE or TENSOR), made once per
    program: :func:`scalar_divisor`'s ``(s1, y, f1, f2)`` on the reciprocal path
    (``RECIPROCAL`` a :class:`fp8kv.modes.Division`), :func:`reciprocal_fp64` in each place on
    the fp64 path, else ``s`` itself in each place (unused)."""
    if RECIPROCAL == DIV_FP64 and not EXACT and (KIND == SCALE_VALUE or KIND == SCALE_TENSOR):
        r = reciprocal_fp64(s)
        divisor = (r, r, r, r)
    elif RECIPROCAL and not EXACT and (KIND == SCALE_VALUE or KIND == SCALE_TENSOR):
        divisor = scalar_divisor(s)
    else:
        divisor = (s, s, s, s)
    return divisor


@jit
def divide(x, s, divisor, EXACT: tl.constexpr, RECIPROCAL: tl.constexpr):
    """``RN(x / s)`` for one scale ``s`` (``divisor``: its :func:`scalar_reciprocal`):
    :func:`divide_by_scalar` on the reciprocal path, :func:`divide_fp64` on the fp64 path, else
    ``div_rn``."""
    if EXACT or not RECIPROCAL:
        q = tl.math.div_rn(x, s)
    elif RECIPROCAL == DIV_FP64:
        q = divide_fp64(x, divisor[0])
    else:
        q = divide_by_scalar(x, divisor[0], divisor[1], divisor[2], divisor[3])
    return q


@jit
def divide_pair(xk, sk, xv, sv, K_ON: tl.constexpr, V_ON: tl.constexpr, EXACT: tl.constexpr,
                RECIPROCAL: tl.constexpr):
    """``xk / sk`` (where ``K_ON``) and ``xv / sv`` (where ``V_ON``), correctly rounded (IEEE
    fp32), for one scale per side; a side that is off is returned as it is. ``RECIPROCAL`` (a
    :class:`fp8kv.modes.Division`; fast path, small batches): :func:`divide_by_scalar` or
    :func:`divide_fp64`, else ``div_rn``."""
    # A side that is on has one scale (VALUE or TENSOR, already loaded): TENSOR stands for both.
    if K_ON:
        xk = divide(xk, sk, scalar_reciprocal(sk, SCALE_TENSOR, EXACT, RECIPROCAL), EXACT,
                    RECIPROCAL)
    if V_ON:
        xv = divide(xv, sv, scalar_reciprocal(sv, SCALE_TENSOR, EXACT, RECIPROCAL), EXACT,
                    RECIPROCAL)
    return xk, xv


@jit
def divide_by_group_scale(x, s):
    """``x / s`` for a dynamic scale (``s`` = the group's scale, broadcastable to ``x``), giving
    ``RN(x / s)`` wherever that quantizes to more than +-0 -- the same fp8 code as ``div_rn``.

    One reciprocal per group (``y = RN(1/s)``), then per element :func:`reciprocal_divide`,
    without :func:`divide`'s range checks: ``x`` is in its own group, so ``|x / s|`` is at most
    about the format's max, and ``s >= 2**-20`` (the floor), which keeps ``y`` normal and every
    remainder exact unless ``|x / s| < 2**-83`` -- a quotient that is +-0 in fp8 however it
    rounds, with ``x``'s sign (kept by the corrections). An infinite scale corrects with 0 instead
    of ``inf``: ``q0`` (+-0, or NaN for ``x = inf``) is then already right. The GPU suite checks
    it against ``div_rn`` on every fp32 input within 27 binades below the amax.
    """
    y = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    return reciprocal_divide(x, tl.where(s == _INF, 0.0, s), y)[1]


@jit
def load_as_fp32(ptr, offsets, mask, EXACT: tl.constexpr):
    """Load bf16/fp16/fp32 values as fp32 (:func:`load_raw`, then :func:`raw_to_fp32`)."""
    return raw_to_fp32(load_raw(ptr, offsets, mask, EXACT), EXACT)


@jit
def load_raw(ptr, offsets, mask, EXACT: tl.constexpr):
    """Load bf16/fp16/fp32 values as stored -- bf16 as its uint16 bits when EXACT (the
    interpreter's bf16 conversions are wrong); 0 where masked."""
    if EXACT and ptr.dtype.element_ty == tl.bfloat16:
        raw = tl.load(ptr.to(tl.pointer_type(tl.uint16)) + offsets, mask=mask, other=0)
    else:
        raw = tl.load(ptr + offsets, mask=mask, other=0)
    return raw


@jit
def raw_to_fp32(raw, EXACT: tl.constexpr):
    """fp32 of what :func:`load_raw` returned (uint16 there only for bf16 bits)."""
    if EXACT and raw.dtype == tl.uint16:
        x = (raw.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        x = raw.to(tl.float32)
    return x


@jit
def encode(y, FMT: tl.constexpr, EXACT: tl.constexpr):
    """The code of fp32 ``y`` in the format of codec ``FMT`` (int32; fp8: 0..255): RNE,
    saturating, NaN -> the format's NaN code."""
    if EXACT or FMT.TRITON_DTYPE is None:
        MAN_BITS: tl.constexpr = FMT.MAN_BITS
        BIAS: tl.constexpr = FMT.BIAS
        u = y.to(tl.int32, bitcast=True)
        a = u & 0x7FFFFFFF
        sign = (u >> 24) & 0x80
        exp = a >> 23
        # Normal fp8 range: keep MAN_BITS of the mantissa, round half to even on the dropped bits;
        # a carry out of the mantissa correctly bumps the exponent.
        SHIFT: tl.constexpr = 23 - MAN_BITS
        rounded = a + ((1 << (SHIFT - 1)) - 1) + ((a >> SHIFT) & 1)
        normal = (rounded >> SHIFT) - ((127 - BIAS) << MAN_BITS)
        # Subnormal fp8 range: the code is the significand shifted down, rounded half to even.
        mant = (a & 0x7FFFFF) | tl.where(exp > 0, 0x800000, 0)
        shift = tl.minimum((151 - BIAS - MAN_BITS) - tl.maximum(exp, 1), 30)
        quot = mant >> shift
        rem = mant & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        round_up = (rem > half) | ((rem == half) & ((quot & 1) == 1))
        sub = quot + round_up.to(tl.int32)
        code = tl.where(a >= ((128 - BIAS) << 23), normal, sub)
        code = tl.minimum(code, FMT.MAX_CODE)  # saturate (covers inf)
        code = tl.where(a > 0x7F800000, FMT.NAN_CODE, code | sign)
    else:
        # Triton lowers the cast to cvt.rn.satfinite (sm_90): it saturates (inf included) and
        # gives 0x7F for NaN, which is what the spec pins -- no clamp needed. The GPU suite checks
        # this path against the exact one on every bf16/fp16 pattern and random fp32.
        code = y.to(tl.dtype(FMT.TRITON_DTYPE)).to(tl.uint8, bitcast=True).to(tl.int32)
    return code


@jit
def decode(code, FMT: tl.constexpr, EXACT: tl.constexpr):
    """fp32 value of a code of codec ``FMT`` (int32; fp8: 0..255); NaN codes give a NaN, an
    infinity code (formats with infinities) gives inf."""
    if EXACT or FMT.TRITON_DTYPE is None:
        MAN_BITS: tl.constexpr = FMT.MAN_BITS
        BIAS: tl.constexpr = FMT.BIAS
        mag = code & 0x7F
        exp = mag >> MAN_BITS
        man = mag & ((1 << MAN_BITS) - 1)
        normal = (((exp + (127 - BIAS)) << 23) | (man << (23 - MAN_BITS))).to(tl.float32, bitcast=True)
        value = tl.where(exp == 0, man.to(tl.float32) * FMT.SUBNORMAL_UNIT, normal)
        quiet_nan = (mag | 0x7FC00000).to(tl.float32, bitcast=True)
        if FMT.HAS_INF:   # the all-ones exponent: inf with a zero mantissa, NaN otherwise
            INF_MAGNITUDE: tl.constexpr = ((1 << FMT.EXP_BITS) - 1) << MAN_BITS
            value = tl.where(mag == INF_MAGNITUDE, _INF, value)
            value = tl.where(mag > INF_MAGNITUDE, quiet_nan, value)
        else:             # the NaN code's magnitude alone is NaN (e4m3fn: 0x7F)
            value = tl.where(mag == FMT.NAN_CODE, quiet_nan, value)
        # Set the sign with bits: Triton lowers -x as 0 - x, which loses -0.
        sign = (code & 0x80) << 24
        value = (value.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)
    else:
        value = code.to(tl.uint8).to(tl.dtype(FMT.TRITON_DTYPE), bitcast=True).to(tl.float32)
    return value


@jit
def fp32_to_output_bits(v, OUT_KIND: tl.constexpr, EXACT: tl.constexpr):
    """Bits of ``v`` rounded (RNE) to the output dtype; NaN -> the canonical NaN.

    OUT_KIND: a :class:`fp8kv.modes.OutKind` (bf16 / fp16 bits in an int32, or fp32 bits).
    """
    is_nan = v != v
    if OUT_KIND == OUT_BFLOAT16:
        if EXACT:
            u = v.to(tl.int32, bitcast=True)
            a = u & 0x7FFFFFFF
            bits = ((a + 0x7FFF + ((a >> 16) & 1)) >> 16) | ((u >> 16) & 0x8000)
        else:
            bits = v.to(tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int32)
        bits = tl.where(is_nan, NAN_BITS_BF16, bits)
    elif OUT_KIND == OUT_FLOAT16:
        bits = v.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.int32)
        bits = tl.where(is_nan, NAN_BITS_FP16, bits)
    else:
        bits = tl.where(is_nan, NAN_BITS_FP32, v.to(tl.int32, bitcast=True))
    return bits


@jit
def max_combine(a, b):
    """Combiner of ``tl.reduce`` for an amax. Compiled, ``tl.maximum`` is ``max.f32``, which
    returns the other operand when one is NaN (the spec's amax ignores NaN; a group of NaNs only
    reduces to NaN); the interpreter's propagates NaN, so the exact path clears NaNs first.

    Our own jitted function rather than ``tl.max``'s library combiner, so that the interpreter
    twin (:mod:`fp8kv.ops._dual`) rebinds it like every other helper.
    """
    return tl.maximum(a, b)


@jit
def dynamic_scale(amax, FMT: tl.constexpr, POW2: tl.constexpr, EXACT: tl.constexpr):
    """The dynamic dequant scale of a group: ``max(RN(amax / fmax), floor)``, then (POW2) the
    smallest power of two ``>= s``, exactly, on the fp32 bits (``inf`` stays ``inf``).

    The fast path divides by the constant ``fmax`` with :func:`reciprocal_divide` and the
    constant ``RN(1/fmax)`` (a quotient small enough to underflow in it is far below the floor),
    the exact path with ``div_rn``. The GPU suite compares the two on every finite fp32 amax.
    """
    FMAX: tl.constexpr = FMT.MAX_VALUE
    RCP_FMAX: tl.constexpr = FMT.RCP_MAX_VALUE
    if EXACT:
        s = tl.math.div_rn(amax, tl.full(amax.shape, FMAX, tl.float32))
    else:
        s = tl.where(amax == _INF, amax, reciprocal_divide(amax, FMAX, RCP_FMAX)[1])
    s = tl.maximum(s, tl.full(amax.shape, SCALE_FLOOR, tl.float32))
    if POW2:
        # s >= the floor is a positive normal or +inf: a power of two has a zero mantissa;
        # otherwise the next power up is the exponent field plus one, mantissa zero.
        u = s.to(tl.int32, bitcast=True)
        up = ((u >> 23) + 1) << 23
        keep = ((u & 0x7FFFFF) == 0) | (u >= 0x7F800000)
        s = tl.where(keep, u, up).to(tl.float32, bitcast=True)
    return s


# ---------------------------------------------------------------------------------------------
# MXFP8 (docs/SPEC.md section 13a): e4m3 codes, one E8M0 scale per block of 32.

@jit
def mxfp8_block_scales(x):
    """``(e, r)`` of the blocks of ``x`` (fp32 ``[T, H, NB, block size]``): ``e`` the E8M0 code
    (int32 ``[T, H, NB]``) and ``r = 2**(127 - e)`` the reciprocal of its scale, broadcastable
    to ``x`` (NaN for ``e = 0xFF``).

    All on the bits: ``|x|``'s bit patterns order as its magnitudes, and NaN and the infinities
    are the patterns from 0x7F800000 up, so one integer maximum is both the amax and the
    non-finite test -- no float maximum, whose NaN handling differs between the GPU and the
    interpreter. ``e = max(exponent field - 8, 0)`` (subnormal and zero amax: field 0), at most
    246, so ``r`` is a normal fp32 (2**-119 .. 2**127): the product ``x r`` is ``RN(x / X)``.
    """
    a = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
    amax = tl.reduce(a, 3, max_combine)
    e = tl.where(amax >= 0x7F800000, 255, tl.maximum((amax >> 23) - 8, 0))
    r = tl.where(e == 255, NAN_BITS_FP32, (254 - e) << 23).to(tl.float32, bitcast=True)
    return e, r[:, :, :, None]


@jit
def mxfp8_quotient(x, e, r, EXACT: tl.constexpr):
    """``x / 2**(e - 127)`` for the e4m3 code (:func:`encode`): ``x r`` (``r``:
    :func:`mxfp8_block_scales`'), NaN where ``e`` is 0xFF. ``e``, ``r`` broadcastable to ``x``.

    The exact path works on the bits, so that no float operation sees a subnormal: a host that
    flushes them (the interpreter inside an XLA:CPU callback runs with its thread's
    flush-to-zero flags) then still gives the GPU's bytes. ``k = 127 - e``; a normal ``x`` gets
    ``k`` added to its exponent field; a subnormal one (mantissa ``m``, ``x = m 2**-149``) is
    ``float(m) * 2**(k - 149)``, two normal operands with a normal product, where ``k >= 24``;
    every other quotient is below 2**-126, whose e4m3 code is ``+-0`` -- what the GPU's product
    gives it -- and is written as the signed zero.
    """
    if EXACT:
        u = x.to(tl.int32, bitcast=True)
        a = u & 0x7FFFFFFF
        sign = u & -2147483648                                    # int32 0x80000000
        exp = a >> 23
        k = 127 - e
        scaled = exp + k
        y = tl.where(scaled >= 1, (scaled << 23) | (a & 0x7FFFFF), 0)
        f = tl.where(k >= 24, (k - 22) << 23, 0).to(tl.float32, bitcast=True)
        sub = ((a & 0x7FFFFF).to(tl.float32) * f).to(tl.int32, bitcast=True)
        y = tl.where(exp == 0, tl.where(k >= 24, sub, 0), y) | sign
        q = tl.where(e == 255, NAN_BITS_FP32, y).to(tl.float32, bitcast=True)
    else:
        q = x * r
    return q


@jit
def mxfp8_values(v, e, EXACT: tl.constexpr):
    """``v * 2**(e - 127)`` of e4m3 values ``v`` (:func:`decode`) and E8M0 codes ``e`` (int32
    0..255, broadcastable): exact (an e4m3 value has at most 4 significant bits, and the
    smallest product, 2**-136, is on fp32's subnormal grid), +-inf past fp32's range, NaN for a
    NaN ``v`` or ``e = 0xFF``.

    The fast path multiplies by :func:`e8m0_values`; the exact path adds ``e - 127`` to the
    exponent field and shifts the significand into a subnormal result (losing no bit), so that
    no float operation sees a subnormal (see :func:`mxfp8_quotient`).
    """
    if EXACT:
        u = v.to(tl.int32, bitcast=True)
        a = u & 0x7FFFFFFF
        exp = a >> 23
        scaled = exp + (e - 127)
        normal = (scaled << 23) | (a & 0x7FFFFF)
        sub = ((a & 0x7FFFFF) | 0x800000) >> tl.minimum(1 - scaled, 31)
        y = tl.where(scaled >= 255, 0x7F800000, tl.where(scaled >= 1, normal, sub))
        y = tl.where(a == 0, 0, y)
        y = tl.where((a > 0x7F800000) | (e == 255), NAN_BITS_FP32, y | (u & -2147483648))
        out = y.to(tl.float32, bitcast=True)
    else:
        out = v * e8m0_values(e)
    return out


@jit
def e8m0_values(e):
    """fp32 ``2**(e - 127)`` of E8M0 codes ``e`` (int32 0..255): ``e = 0`` the subnormal
    2**-127, 0xFF NaN. Built from bits."""
    bits = tl.where(e == 255, NAN_BITS_FP32, tl.where(e == 0, 0x00400000, e << 23))
    return bits.to(tl.float32, bitcast=True)


# ---------------------------------------------------------------------------------------------
# NVFP4 (docs/SPEC.md section 13): E2M1 codes, one e4m3 scale per block of 16, a global scale.

@jit
def nvfp4_block_scales(amax, g, FMT: tl.constexpr, EXACT: tl.constexpr):
    """``(sf, d)`` of each block: ``sf`` the code (int32 0..255) in ``FMT``'s block-scale codec
    (e4m3) of ``amax / (6 g)`` -- 6 the largest E2M1 value -- and ``d = sf's value * g``, its
    dequant scale. ``g``: the global scale, broadcastable to ``amax``. Every step is one IEEE
    fp32 operation (``div_rn``; the fp32 products round once)."""
    SF: tl.constexpr = FMT.BLOCK_SCALE
    six_g = tl.broadcast_to(g * FMT.MAX_VALUE, amax.shape)
    sf = encode(tl.math.div_rn(amax, six_g), SF, EXACT)
    return sf, decode(sf, SF, EXACT) * g


@jit
def block_reciprocal(d, amax, EXACT: tl.constexpr):
    """``(fast, y)`` for :func:`divide_by_block_scale`: whether this program may divide by
    reciprocals (one value for the whole program) and ``y = RN(1/d)`` per block (0 where ``d`` is
    0).

    Reciprocals serve a program whose every block has ``d`` NaN, 0, or in ``[2**-90, 2**90]``
    with ``amax <= 16 d``: then ``|x / d| <= 16``, no quotient is near the fp32 limits and
    Markstein's theorem makes :func:`reciprocal_divide` exact. Others (tiny or huge global scales,
    saturated block scales, infinities) and the interpreter take ``div_rn``.
    """
    if EXACT:
        fast = 0
        y = d
    else:
        ok = (d != d) | (d == 0.0) | ((d >= 2.0 ** -90) & (d <= 2.0 ** 90) & (amax <= d * 16.0))
        fast = tl.min(ok.to(tl.int32))
        y = tl.where(d == 0.0, 0.0, tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d))
    return fast, y


@jit
def divide_by_block_scale(x, d, y, fast, EXACT: tl.constexpr):
    """``RN(x / d)``, ``d`` (and ``y``, ``fast``: :func:`block_reciprocal`) broadcastable to ``x``;
    NaN quotients become 0, and a block with ``d = 0`` gives +-0 (its codes are 0 whatever the
    quotient: :func:`nvfp4_sign_mask` clears their signs). On the reciprocal path a NaN quotient
    is the hardware's canonical NaN (sign bit clear), which :func:`encode_e2m1` writes as 0. The
    GPU suite compares both paths on every bf16 pattern.
    """
    if EXACT:
        q = tl.math.div_rn(x, tl.where(d == 0.0, _INF, d))
        q = tl.where(q != q, 0.0, q)
    else:
        if fast == 1:   # the same branch for the whole program
            q = reciprocal_divide(x, d, y)[1]
        else:
            q = tl.math.div_rn(x, tl.where(d == 0.0, _INF, d))
            q = tl.where(q != q, 0.0, q)
    return q


@jit
def nvfp4_sign_mask(d):
    """Per block: 8 (the E2M1 sign bit) where codes carry their sign, 0 where ``d`` is 0 or NaN
    (all codes 0x0)."""
    return tl.where((d != 0.0) & (d == d), 8, 0)


@jit
def encode_e2m1(q, sign_mask, FMT: tl.constexpr):
    """4-bit E2M1 codes (bits 0-3 of an int32; bits 4-23 zero, the higher ones not) of
    quotients ``q`` (NaN-free, or the fast path's canonical NaN): the magnitude is ``|q|`` rounded to the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6, ties to
    the even code, saturating at 6; the sign bit is ``q``'s, kept where ``sign_mask`` is 8.

    Rounding on fp32 arithmetic alone (the same on every path): with ``R = 2**23``,
    ``RN(2|q| + R) - R``, ``RN(|q| + R + 2) - R`` and ``RN(|q|/2 + R + 4) - R`` are the codes
    that the grids of step 0.5, 1 and 2 give (offset by the codes of 0, 2 and 4), each exact for
    its binade and too large outside it, so their minimum, capped at 7, is the code. Each is one
    rounding of an exact sum (``2|q|`` and ``|q|/2`` are exact), ties to even; the sums' low
    bits are the code. Checked against the boundary table on every fp32 value in [0, 16].
    """
    a = tl.maximum(tl.abs(q), 0.0)   # max.f32 turns the canonical NaN into 0
    m = tl.minimum(tl.minimum(tl.math.fma(a, 2.0, ROUND_TO_INT), a + (ROUND_TO_INT + 2.0)),
                   tl.minimum(tl.math.fma(a, 0.5, ROUND_TO_INT + 4.0),
                              ROUND_TO_INT + FMT.MAX_CODE))
    sign = (q.to(tl.int32, bitcast=True) >> 28) & sign_mask
    # m's bits are 0x4B000000 + the code: bits 4-23 are zero, so callers that keep the low
    # nibble (pack codes into bytes) need not clear the high ones.
    return m.to(tl.int32, bitcast=True) | sign


@jit
def nvfp4_values(codes, sv, g, SCALED: tl.constexpr):
    """fp32 ``(e2m1 * sv) * g`` (``SCALED``; else ``e2m1 * sv``) of both codes of each byte of
    ``codes`` (int32 0..255): ``(low nibble's, high nibble's)``, exact bits. ``sv``: the block's
    e4m3 value, ``g``: the global scale, both broadcastable.

    A code's magnitude bits at bit 9 of an fp16, its sign at bit 15, make the fp16 with exponent
    field ``m >> 1`` and top mantissa bit ``m & 1``: ``e2m1(m) * 2**-14`` (for ``m = 1`` the
    subnormal ``0.5 * 2**-14``: fp16 and E2M1 both have subnormals at exponent field 0). Both
    codes of a byte become one word of two fp16 with three integer operations: ``u = b * 4097``
    holds the byte twice (bits 0-7 and 12-19), and ``u << 9`` / ``u << 12`` bring each nibble's
    magnitude / sign bits to their fp16 places. Widening to fp32 is exact (and normal, so no flush
    to zero touches it); times ``sv * 2**14`` it is the exact ``e2m1 * sv`` (6 significant bits,
    normal), which the product with ``g`` rounds once. IEEE signs throughout.
    """
    u = codes * 4097
    halves = ((u << 9) & 0x0E000E00) | ((u << 12) & -0x7FFF8000)   # int32 0x80008000
    scale = sv * 16384.0
    lo = (halves & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * scale
    hi = ((halves >> 16) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * scale
    if SCALED:
        lo = lo * g
        hi = hi * g
    return lo, hi


@jit
def divide_by_out_scale(x, s, divisor, EXACT: tl.constexpr, RECIPROCAL: tl.constexpr):
    """``RN(x / s)`` for one output scale ``s`` per program (``divisor``: its
    :func:`scalar_reciprocal`).

    A power of two ``s`` in ``[2**-126, 2**126)`` multiplies by its exact reciprocal (``f1 f2``
    of :func:`scalar_divisor`, or the fp64 reciprocal, exact in fp32: the same real number,
    rounded once; one instruction per element); other scales take :func:`divide`.
    """
    if EXACT or not RECIPROCAL:
        q = divide(x, s, divisor, EXACT, RECIPROCAL)
    else:
        u = s.to(tl.int32, bitcast=True)
        if ((u & 0x7FFFFF) == 0) & (u >= 0x00800000) & (u < 0x7E800000):
            if RECIPROCAL == DIV_FP64:
                q = x * divisor[0].to(tl.float32)   # RN64(1/s) = 1/s, an fp32 power of two
            else:
                q = x * (divisor[2] * divisor[3])
        else:
            q = divide(x, s, divisor, EXACT, RECIPROCAL)
    return q


@jit
def encode_bytes(y, FMT: tl.constexpr, EXACT: tl.constexpr):
    """:func:`encode` as uint8 bytes (FP8 formats): on the fast path straight from the hardware
    conversion, without :func:`encode`'s int32 codes (which a store of bytes would repack)."""
    if EXACT or FMT.TRITON_DTYPE is None:
        code = encode(y, FMT, EXACT).to(tl.uint8)
    else:
        code = y.to(tl.dtype(FMT.TRITON_DTYPE)).to(tl.uint8, bitcast=True)
    return code


# The GPU's lookup (nvfp4_fp8_lookup): one word of 8 codes ($2, low nibble first) and its
# block's table ($3, $4: e4m3 bytes of codes 0..3 and 4..7; $5, $6: of codes 8..11 and 12..15)
# -> the codes' 8 bytes in memory order ($0: codes 0..3, $1: codes 4..7). prmt.b32 d, a, b, s
# gives byte i of d from byte s[4i+2:4i] of {b, a} -- a 3-bit index, so 8 entries per lookup,
# four codes per instruction -- or, with s[4i+3] set, that byte's sign bit replicated. Per four
# codes: their bytes in the positive table and in the negative one, their sign bits as
# 0xFF/0x00 bytes (from the msbs of the word's bytes, the odd codes' signs, and of the word
# << 4's, the even codes'), then lop3 0xD8 = sign ? negative : positive.
_BYTE_LOOKUP_PTX: tl.constexpr = tl.constexpr("""{
.reg .b32 s, h, w4, e, n, m;
and.b32 s, $2, 0x77777777;
shr.b32 h, s, 16;
shl.b32 w4, $2, 4;
prmt.b32 e, $3, $4, s;
prmt.b32 n, $5, $6, s;
prmt.b32 m, $2, w4, 0x9D8C;
lop3.b32 $0, e, n, m, 0xD8;
prmt.b32 e, $3, $4, h;
prmt.b32 n, $5, $6, h;
prmt.b32 m, $2, w4, 0xBFAE;
lop3.b32 $1, e, n, m, 0xD8;
}""")


# Four fp32 values -> their e4m3 bytes as one int32 word (first value in the low byte): two
# cvt.rn.satfinite.e4m3x2.f32 (the conversion Triton emits for .to(tl.float8e4nv); its d takes
# the first source in the high byte) and one move of the halves.
_CVT_WORD_PTX: tl.constexpr = tl.constexpr("""{
.reg .b16 lo, hi;
cvt.rn.satfinite.e4m3x2.f32 lo, $2, $1;
cvt.rn.satfinite.e4m3x2.f32 hi, $4, $3;
mov.b32 $0, {lo, hi};
}""")


@jit
def fp8_word(a, b, c, d, FMT: tl.constexpr, EXACT: tl.constexpr):
    """The codes (:func:`encode`) of ``a, b, c, d`` in codec ``FMT`` (e4m3, whose hardware
    conversion the fast path packs four at a time) in an int32, ``a`` lowest."""
    if EXACT:
        word = (encode(a, FMT, EXACT) | (encode(b, FMT, EXACT) << 8)
                | (encode(c, FMT, EXACT) << 16) | (encode(d, FMT, EXACT) << 24))
    else:
        tl.static_assert(FMT.TRITON_DTYPE == "fp8e4nv", "the packed conversion is e4m3's")
        word = tl.inline_asm_elementwise(_CVT_WORD_PTX, "=r,f,f,f,f", [a, b, c, d],
                                         dtype=tl.int32, is_pure=True, pack=1)
    return word


@jit
def _nvfp4_table_word(sv, g, out_scale, out_reciprocal, E0: tl.constexpr, E1: tl.constexpr,
                      E2: tl.constexpr, E3: tl.constexpr, SCALED: tl.constexpr,
                      OUT: tl.constexpr, EXACT: tl.constexpr, RECIPROCAL: tl.constexpr):
    """The bytes of E2M1 magnitudes ``E0..E3`` of each block (:func:`nvfp4_fp8_table`) in an
    int32, ``E0``'s lowest (:func:`_nvfp4_table_value` each)."""
    v0 = _nvfp4_table_value(sv, g, out_scale, out_reciprocal, E0, SCALED, OUT.SCALE, EXACT,
                            RECIPROCAL)
    v1 = _nvfp4_table_value(sv, g, out_scale, out_reciprocal, E1, SCALED, OUT.SCALE, EXACT,
                            RECIPROCAL)
    v2 = _nvfp4_table_value(sv, g, out_scale, out_reciprocal, E2, SCALED, OUT.SCALE, EXACT,
                            RECIPROCAL)
    v3 = _nvfp4_table_value(sv, g, out_scale, out_reciprocal, E3, SCALED, OUT.SCALE, EXACT,
                            RECIPROCAL)
    FMT: tl.constexpr = OUT.FMT
    return fp8_word(v0, v1, v2, v3, FMT, EXACT)


@jit
def _nvfp4_scaled_words(sv, g, out_scale, out_reciprocal, SCALED: tl.constexpr,
                        OUT: tl.constexpr, EXACT: tl.constexpr, RECIPROCAL: tl.constexpr):
    """:func:`nvfp4_fp8_table`'s two words from three quotients per block: magnitudes 0.5, 1,
    2, 4 are powers of two times 1 and 3, 6 twice and four times 1.5, and a product or quotient
    by a power of two is exact in fp32's normal range. Outside it the bytes agree too: a
    quotient below 2**-125 is +-0 in e4m3 however it is scaled, one past fp32's range saturates
    (448) as the scaled one does; the caller makes sure that no ``RN(sv * g)`` is subnormal or
    overflows."""
    q0 = _nvfp4_table_value(sv, g, out_scale, out_reciprocal, 0.0, SCALED, OUT.SCALE, EXACT,
                            RECIPROCAL)
    q1 = _nvfp4_table_value(sv, g, out_scale, out_reciprocal, 1.0, SCALED, OUT.SCALE, EXACT,
                            RECIPROCAL)
    q3 = _nvfp4_table_value(sv, g, out_scale, out_reciprocal, 1.5, SCALED, OUT.SCALE, EXACT,
                            RECIPROCAL)
    FMT: tl.constexpr = OUT.FMT
    return (fp8_word(q0, q1 * 0.5, q1, q3, FMT, EXACT),
            fp8_word(q1 * 2.0, q3 * 2.0, q1 * 4.0, q3 * 4.0, FMT, EXACT))


@jit
def _nvfp4_table_value(sv, g, out_scale, out_reciprocal, E2M1: tl.constexpr,
                       SCALED: tl.constexpr, OUT_SCALE: tl.constexpr, EXACT: tl.constexpr,
                       RECIPROCAL: tl.constexpr):
    """``((E2M1 * sv) * g) / out_scale`` (fp32, each operation rounded)."""
    v = sv * E2M1
    if SCALED:
        v = v * g
    if OUT_SCALE != SCALE_NONE:
        v = divide(v, out_scale, out_reciprocal, EXACT, RECIPROCAL)
    return v


@jit
def nvfp4_fp8_table(sv, g, out_scale, out_reciprocal, SCALED: tl.constexpr, OUT: tl.constexpr,
                    EXACT: tl.constexpr, RECIPROCAL: tl.constexpr):
    """Per block (``sv``: its block scale's value; ``g`` broadcastable), the bytes in the FP8
    output's codec (``OUT.FMT``, e4m3) that its 16 codes dequantize to, as four int32 words
    (bytes of codes 0..3, 4..7, 8..11, 12..15): the per-element rule -- ``(e2m1 * sv) * g``
    (``SCALED``; :func:`nvfp4_values`), divided by ``out_scale`` (unless ``OUT.SCALE`` is none;
    :func:`divide`), RNE with saturation -- once per block for the eight magnitudes: three
    quotients scaled by powers of two (:func:`_nvfp4_scaled_words`) where every block's
    ``RN(sv * g)`` is 0 as ``sv`` or ``g`` is, NaN, infinite as ``g`` is, or normal up to
    ``2**125``; else (subnormal or overflowing products, a program at a time) eight quotients. A
    negative code's byte is its magnitude's with the sign bit flipped, except NaN's 0x7F: the
    products, the division and the rounding are odd functions, and every NaN is written 0x7F.
    ``e2m1 * sv`` is exact (6 significant bits)."""
    if SCALED:
        gb = tl.abs(tl.broadcast_to(g, sv.shape))
        p = tl.abs(sv * g)
        ok = (((p >= 2.0 ** -125) & (p <= 2.0 ** 125)) | (sv == 0.0) | (gb == 0.0) | (p != p)
              | (gb == _INF))
        # The program's vote (tl.reduce with our combiner: the interpreter twin rebinds it).
        scaled = tl.reduce(tl.reshape(1 - ok.to(tl.int32), (ok.numel,)), 0, max_combine) == 0
    else:
        scaled = True   # sv alone: an e4m3 value, 0 or NaN
    if scaled:
        low, high = _nvfp4_scaled_words(sv, g, out_scale, out_reciprocal, SCALED, OUT, EXACT,
                                        RECIPROCAL)
    else:
        low = _nvfp4_table_word(sv, g, out_scale, out_reciprocal, 0.0, 0.5, 1.0, 1.5, SCALED,
                                OUT, EXACT, RECIPROCAL)
        high = _nvfp4_table_word(sv, g, out_scale, out_reciprocal, 2.0, 3.0, 4.0, 6.0, SCALED,
                                 OUT, EXACT, RECIPROCAL)
    # A byte of 0x7F carries into bit 7 when 1 is added to its low seven bits: NaN, no sign.
    low_nan = ((low & 0x7F7F7F7F) + 0x01010101) & -0x7F7F7F80     # int32 0x80808080
    high_nan = ((high & 0x7F7F7F7F) + 0x01010101) & -0x7F7F7F80
    return low, high, low ^ low_nan ^ -0x7F7F7F80, high ^ high_nan ^ -0x7F7F7F80


@jit
def nvfp4_fp8_lookup(codes, low, high, neg_low, neg_high, EXACT: tl.constexpr):
    """The FP8 bytes of ``codes`` (int32 words of 8 codes, low nibble first) from their
    block's table (:func:`nvfp4_fp8_table`, broadcastable): ``(first, second)``, the words of
    codes 0..3 and 4..7. The GPU looks four codes up per ``prmt`` (:data:`_BYTE_LOOKUP_PTX`);
    the exact path selects each code's byte with integer arithmetic."""
    if EXACT:
        first = tl.full(codes.shape, 0, tl.int32)
        second = tl.full(codes.shape, 0, tl.int32)
        for i in tl.static_range(8):
            c = (codes >> (4 * i)) & 15
            word = tl.where(c < 4, low, tl.where(c < 8, high, tl.where(c < 12, neg_low, neg_high)))
            byte = (word >> (8 * (c & 3))) & 0xFF
            if i < 4:
                first = first | (byte << (8 * i))
            else:
                second = second | (byte << (8 * (i - 4)))
    else:
        first, second = tl.inline_asm_elementwise(
            _BYTE_LOOKUP_PTX, "=r,=r,r,r,r,r,r", [codes, low, high, neg_low, neg_high],
            dtype=(tl.int32, tl.int32), is_pure=True, pack=1)
    return first, second
