"""The pure-jnp path (CPU, TPU, ...): :mod:`fp8kv.reference` written in jnp, byte for byte.

Each op is one jitted function, static in the validated arguments: an eager call compiles once per
shape, and under the caller's ``jax.jit`` it inlines, so that a donated cache is updated in place
(the scatter writes into its operand's buffer). Stacked caches (``args.layers``) are indexed with
the layer as the first index of that one scatter / gather: no layer is sliced out and back.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8kv.dequantize import DequantArgs
from fp8kv.formats import CANONICAL_NAN_BITS, DYNAMIC_SCALE_FLOOR, E4M3, FP8_OUTPUT_DTYPE, NVFP4
from fp8kv.modes import ScaleKind, SideScale

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def launch(op: str, arrays: dict, *, args) -> dict:
    """``op`` (a family: an op and its combined form) on ``arrays`` (by argument name; None
    where absent) for the validated call ``args``: the function of this module named as the op,
    ``(arrays, *, args) -> {output: array}``."""
    fn = globals().get(op)
    if fn is None:
        raise NotImplementedError(f"fp8kv_jax.{op}: no jnp path (arrays off NVIDIA GPUs); "
                                  "on an NVIDIA GPU its Triton kernel runs")
    return fn(arrays, args=args)


def _scale(array, scale: SideScale, trailing: int):
    """The static scale, shaped to broadcast against ``[..., num_kv_heads, *trailing dims]``
    (None without one; dynamic scales come from :func:`_stored_scales`)."""
    if scale.kind is ScaleKind.NONE:
        return None
    if scale.kind is ScaleKind.VALUE:
        return jnp.float32(scale.value)
    if scale.kind is ScaleKind.HEAD:
        return array.reshape((-1,) + (1,) * trailing)
    return array.reshape(())


def _in_range(index, size: int):
    """``0 <= index < size`` without a Python int that overflows ``index``'s dtype."""
    return (index >= 0) & (index <= min(size - 1, jnp.iinfo(index.dtype).max))


def _quantize(x, scale, fmt):
    """fp8 codes (uint8) of ``x / scale``, as :func:`fp8kv.reference.quantize`."""
    y = x.astype(jnp.float32)
    if scale is not None:
        # XLA rewrites a division by a broadcast as a multiplication by the reciprocal, which is
        # not correctly rounded; behind the barrier the divisor is an opaque array.
        y = y / lax.optimization_barrier(jnp.broadcast_to(scale, y.shape))
    nan = jnp.isnan(y)
    # The fp8 cast gives NaN past the format's last rounding boundary (e4m3: 464): saturate first.
    y = jnp.clip(y, -fmt.max_value, fmt.max_value)
    codes = lax.bitcast_convert_type(y.astype(jnp.dtype(fmt.dtype)), jnp.uint8)
    return jnp.where(nan, jnp.uint8(fmt.nan_code), codes)


def _round_output(v, out_dtype: str, keep):
    """fp32 ``v`` rounded to ``out_dtype``, canonical NaNs, zeros where ``keep`` is False."""
    uint = _UINT[jnp.dtype(out_dtype).itemsize]
    bits = lax.bitcast_convert_type(v.astype(out_dtype), uint)
    bits = jnp.where(jnp.isnan(v), uint(CANONICAL_NAN_BITS[out_dtype]), bits)
    # Padding entries are zero pages (not 0 * scale, which is NaN for an infinite scale).
    bits = jnp.where(keep, bits, uint(0))
    return lax.bitcast_convert_type(bits, jnp.dtype(out_dtype))


def _slot_index(slots, cache, layout: str, rank: int, combined: bool):
    """Index of each token's ``[(2,) num_kv_heads, head_dim]`` row for ``.at[]`` (in a side
    scale array: its ``[num_kv_heads]`` or single entry)."""
    keep = _in_range(slots, cache.num_pages * cache.page_size)
    # Padding must point past the last page, which mode="drop" skips (.at[-1] would wrap around).
    page = jnp.where(keep, slots // cache.page_size, cache.num_pages)
    offset = slots % cache.page_size
    index = (page,) + (slice(None),) * combined
    if rank == 3:
        return index
    return index + ((offset,) if layout == "NHD" else (slice(None), offset))


def _layer_index(arrays, layers):
    """The layer of stacked arrays as a leading ``.at[]`` index, out of range as ``num_layers``
    (which ``mode="drop"`` skips and ``mode="fill"`` fills: no wrap-around); None without a layer
    axis."""
    if layers is None:
        return None
    if not layers.on_device:
        return layers.index if layers.host_in_range else layers.num_layers
    layer = arrays["layer"]
    return jnp.where(_in_range(layer, layers.num_layers), layer, layers.num_layers)


def _layered(layer, index: tuple) -> tuple:
    return index if layer is None else (layer,) + index


def _scatter(array, index, values):
    """Write ``values`` as bytes: untouched bytes (NaN codes included) stay exactly as they are."""
    raw = lax.bitcast_convert_type(array, jnp.uint8)
    values = lax.bitcast_convert_type(values, jnp.uint8)
    return lax.bitcast_convert_type(raw.at[index].set(values, mode="drop"), array.dtype)


def _dynamic_scales(x, fmt, per_head: bool, pow2: bool):
    """As :func:`fp8kv.reference.dynamic_scales`: ``[T, H]`` (per head) or ``[T]`` fp32."""
    a = jnp.abs(x.astype(jnp.float32))
    a = jnp.where(jnp.isnan(a), jnp.float32(0.0), a)
    amax = a.max(axis=2 if per_head else (1, 2), initial=jnp.float32(0.0))
    # A division by a constant would become a multiply by its (inexact) reciprocal: see _quantize.
    s = amax / lax.optimization_barrier(jnp.full(amax.shape, fmt.max_value, jnp.float32))
    s = jnp.maximum(s, jnp.float32(DYNAMIC_SCALE_FLOOR))
    if pow2:  # the next power of two up, on the bits (s is a positive normal or +inf)
        u = lax.bitcast_convert_type(s, jnp.uint32)
        up = ((u >> 23) + 1) << 23
        keep = ((u & 0x7FFFFF) == 0) | (u >= 0x7F800000)
        s = lax.bitcast_convert_type(jnp.where(keep, u, up), jnp.float32)
    return s


def _quantize_mxfp8(x, fmt):
    """``(codes [T, H, D], E8M0 codes [T, H, D / 32])``, as :func:`fp8kv.reference.quantize_mxfp8`:
    the amax and its exponent on the bits, the quotient by the power of two with :func:`mul_rn`
    (exact on subnormal inputs, which XLA:CPU's float operations would flush)."""
    t, h, d = x.shape
    size = fmt.blocks.size
    if x.dtype == jnp.bfloat16:   # fp32 bits by a shift: no float operation sees a subnormal
        u = lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32) << 16
    else:
        u = lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    u = u.reshape(t, h, d // size, size)
    amax = (u & jnp.uint32(0x7FFFFFFF)).max(axis=-1)
    e = jnp.where(amax >= 0x7F800000, jnp.uint32(255),
                  jnp.maximum((amax >> 23).astype(jnp.int32) - 8, 0).astype(jnp.uint32))
    r = jnp.where(e == 255, jnp.uint32(CANONICAL_NAN_BITS["float32"]), (254 - e) << 23)
    q = mul_rn(lax.bitcast_convert_type(u, jnp.float32),
               lax.bitcast_convert_type(r, jnp.float32)[..., None])
    return _quantize(q, None, fmt).reshape(t, h, d), e.astype(jnp.uint8)


def _mxfp8_values(codes, e, fmt):
    """fp32 values of mxfp8 codes, as :func:`fp8kv.reference.dequantize_mxfp8`: the product by
    ``2**(e - 127)`` with :func:`mul_rn` (exact for a subnormal scale or product)."""
    v = lax.bitcast_convert_type(codes, jnp.dtype(fmt.dtype)).astype(jnp.float32)
    size = fmt.blocks.size
    v = v.reshape(v.shape[:-1] + (v.shape[-1] // size, size))
    e = e.astype(jnp.uint32)   # the E8M0 byte 0 is the subnormal 2**-127, 0xFF is NaN
    bits = jnp.where(e == 255, jnp.uint32(CANONICAL_NAN_BITS["float32"]),
                     jnp.where(e == 0, jnp.uint32(0x00400000), e << 23))
    return mul_rn(v, lax.bitcast_convert_type(bits, jnp.float32)[..., None]).reshape(codes.shape)


def _quantize_side(x, array, scale: SideScale, args):
    """``(codes [T, H, D or D + pad], the scales stored or None)`` of one side."""
    if args.fmt.packed:
        return _quantize_nvfp4(x, _scale(array, scale, 1))
    if scale.dynamic is ScaleKind.BLOCK:
        return _quantize_mxfp8(x, args.fmt)
    if not scale.is_dynamic:
        return _quantize(x, _scale(array, scale, 1), args.fmt), None
    per_head = scale.dynamic is ScaleKind.TOKEN_HEAD
    s = _dynamic_scales(x, args.fmt, per_head, args.scale_pow2)
    codes = _quantize(x, s[:, :, None] if per_head else s[:, None, None], args.fmt)
    if args.inline_pad:  # the scale's little-endian bytes, then zeros, after each head's codes
        tail = lax.bitcast_convert_type(s, jnp.uint8)   # [T, H, 4]
        zeros = jnp.zeros(tail.shape[:2] + (args.inline_pad - 4,), jnp.uint8)
        codes = jnp.concatenate([codes, tail, zeros], axis=-1)
    return codes, s


@functools.partial(jax.jit, static_argnames=("args",))
def write_kv(arrays: dict, *, args) -> dict:
    """The updated arrays by argument name, from ``arrays`` (the call's, by argument name; None
    for an absent scale): the caches (``kv_cache`` when ``args.combined``), then each side
    scale array given."""
    combined = args.combined
    slots = arrays["slots"]
    qk, sk = _quantize_side(arrays["key"], arrays["key_scale"], args.key_scale, args)
    qv, sv = _quantize_side(arrays["value"], arrays["value_scale"], args.value_scale, args)
    cache = arrays["kv_cache" if combined else "key_cache"]
    layer = _layer_index(arrays, args.layers)
    rank = cache.ndim - combined - (layer is not None)
    index = _layered(layer, _slot_index(slots, args.key_cache, args.layout, rank, combined))
    if combined:
        out = {"kv_cache": _scatter(cache, index, jnp.stack([qk, qv], axis=1))}
    else:
        out = {"key_cache": _scatter(cache, index, qk),
               "value_cache": _scatter(arrays["value_cache"], index, qv)}
    for side, s, scale in (("key", sk, args.key_scale), ("value", sv, args.value_scale)):
        if scale.stored is not None:
            # A side array is indexed as its cache without head_dim (block scales: as its cache);
            # a per-token one ([P, S] in either layout) as an NHD cache without heads.
            layout = args.layout if scale.dynamic is not ScaleKind.TOKEN else "NHD"
            index = _layered(layer, _slot_index(slots, args.key_cache, layout, rank, False))
            out[f"{side}_scale_cache"] = _scatter(arrays[f"{side}_scale_cache"], index, s)
    return out


def _gather(array, index, num_pages: int, layer=None, fill=0):
    """Pages ``index`` of ``array`` (of its layer ``layer`` if stacked), one-byte dtypes as
    bytes; indices past the end give ``fill``."""
    if array.dtype.itemsize == 1:
        array = lax.bitcast_convert_type(array, jnp.uint8)
    stacked = layer is not None
    if num_pages == 0 or (stacked and array.shape[0] == 0):
        # XLA cannot gather from an empty axis; every entry is padding anyway
        return jnp.full(index.shape + array.shape[1 + stacked:], fill, array.dtype)
    return array.at[_layered(layer, (index,))].get(mode="fill", fill_value=fill)


def _stored_scales(scale_cache, codes, index, num_pages, kind, args, layer=None):
    """``(codes [N, ..., D], scales broadcasting against them)`` for a dynamic side."""
    if args.inline_pad:
        d = args.key_cache.head_dim
        s = lax.bitcast_convert_type(codes[..., d:d + 4], jnp.float32)
        return codes[..., :d], s[..., None]
    s = _gather(scale_cache, index, num_pages, layer, fill=1.0)
    if kind is ScaleKind.TOKEN and args.cache_rank == 4:   # [N, page_size]
        s = s[:, :, None] if args.layout == "NHD" else s[:, None, :]
    elif kind is ScaleKind.TOKEN:                           # [N]
        s = s[:, None]
    return codes, s.reshape(s.shape + (1,) * (codes.ndim - s.ndim))


@functools.partial(jax.jit, static_argnames=("args",))
def dequantize_pages(arrays: dict, *, args) -> dict:
    """The outputs by argument name (``key_out``, ``value_out``, ``table_out``; ``kv_out``,
    ``table_out`` when ``args.combined``) from ``arrays`` (the call's, by argument name)."""
    num_pages = args.key_cache.num_pages
    block_table = arrays["block_table"]
    # The entries that name a page (not padding, past the cache or null_page); the others read
    # page num_pages, one past the cache.
    entries = block_table.reshape(-1)
    keep = _in_range(entries, num_pages)
    info = jnp.iinfo(entries.dtype)
    if args.null_page is not None and info.min <= args.null_page <= info.max:
        keep &= entries != args.null_page
    index = jnp.where(keep, entries, num_pages)
    layer = _layer_index(arrays, args.layers)
    if layer is not None:   # an out-of-range layer reads nothing: zero pages (not 0 * scale)
        keep &= layer < args.layers.num_layers
    keep = keep.reshape((-1,) + (1,) * (args.cache_rank - 1))
    # The static scale broadcasts against the dims after the heads (nvfp4: [..., D/16, 16]).
    trailing = (2 if args.layout == "HND" and args.cache_rank == 4 else 1) + args.fmt.packed
    if args.combined:
        pages = _gather(arrays["kv_cache"], index, num_pages, layer)
        codes = pages[:, 0], pages[:, 1]
    else:
        codes = (_gather(arrays["key_cache"], index, num_pages, layer),
                 _gather(arrays["value_cache"], index, num_pages, layer))
    sides = []
    for c, side, scale in zip(codes, ("key", "value"), (args.key_scale, args.value_scale)):
        s = _scale(arrays[f"{side}_scale"], scale, trailing)
        if scale.dynamic is ScaleKind.BLOCK:   # nvfp4, mxfp8: the block scales' bytes, as the codes
            blocks = _gather(arrays[f"{side}_scale_cache"], index, num_pages, layer)
            v = (_nvfp4_values(c, blocks, s) if args.fmt.packed
                 else _mxfp8_values(c, blocks, args.fmt))
        else:
            if scale.is_dynamic:
                c, s = _stored_scales(arrays[f"{side}_scale_cache"], c, index, num_pages,
                                      scale.dynamic, args, layer)
            v = lax.bitcast_convert_type(c, jnp.dtype(args.fmt.dtype)).astype(jnp.float32)
            if s is not None:
                v = v * s
        if args.out_dtype == FP8_OUTPUT_DTYPE:   # nvfp4's FP8 workspace
            q = _quantize(v, _scale(arrays["out_scale"], args.out_scale, 0), E4M3)
            sides.append(lax.bitcast_convert_type(jnp.where(keep, q, jnp.uint8(0)),
                                                  jnp.dtype(FP8_OUTPUT_DTYPE)))
        else:
            sides.append(_round_output(v, args.out_dtype, keep))
    k, v = sides
    new_table = jnp.arange(block_table.size, dtype=jnp.int32).reshape(block_table.shape)
    if args.combined:
        return {"kv_out": jnp.stack([k, v], axis=1), "table_out": new_table}
    return {"key_out": k, "value_out": v, "table_out": new_table}


# rope_write_kv (docs/SPEC.md, section 12)

def mul_rn(a, b):
    """``RN(a * b)`` of fp32 arrays, computed on their bit patterns with integer arithmetic.

    XLA:CPU contracts ``a * b - c * d`` into a fused multiply-add (one rounding instead of two:
    about a quarter of random fp32 inputs then differ), and an ``optimization_barrier`` between
    the product and the sum does not survive to code generation. A product made of integer
    operations is never contracted. Subnormal inputs and results are exact here (no float
    operation runs); NaN results are the canonical quiet NaN.
    """
    ua, ub = (lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32) for x in (a, b))
    sign = (ua ^ ub) & jnp.uint32(0x80000000)

    def unpack(u):
        e = ((u >> 23) & 0xFF).astype(jnp.int32)
        m = u & 0x7FFFFF
        # Significand with its leading one at bit 23 (subnormals shifted up), and its exponent.
        shift = jnp.where(e == 0, lax.clz(m).astype(jnp.int32) - 8, 0)
        sig = jnp.where(e == 0, m << shift.astype(jnp.uint32), m | 0x800000)
        return e, m, sig, jnp.where(e == 0, 1 - shift, e)

    ea, ma, sa, xa = unpack(ua)
    eb, mb, sb, xb = unpack(ub)
    # The 48-bit product of the 24-bit significands, from 12-bit halves: hi * 2**24 + lo.
    ah, al, bh, bl = sa >> 12, sa & 0xFFF, sb >> 12, sb & 0xFFF
    mid = ah * bl + al * bh
    t = al * bl + ((mid & 0xFFF) << 12)
    lo = t & 0xFFFFFF
    hi = ah * bh + (mid >> 12) + (t >> 24)
    top = hi >= 0x800000                                   # product >= 2**47
    sig = jnp.where(top, hi, (hi << 1) | (lo >> 23))        # 24 bits, leading one at bit 23
    rest = jnp.where(top, lo, (lo << 1) & 0xFFFFFF)         # the dropped bits, out of 2**24
    e = xa + xb - 127 + top.astype(jnp.int32)               # biased exponent of sig * 2**-23
    # Normal result: round half to even on `rest`; a carry out of `sig` bumps the exponent.
    up = (rest > 0x800000) | ((rest == 0x800000) & ((sig & 1) == 1))
    normal = (jnp.maximum(e - 1, 0).astype(jnp.uint32) << 23) + sig + up.astype(jnp.uint32)
    normal = jnp.where((normal >> 23) >= 255, jnp.uint32(0x7F800000), normal)
    # Subnormal result: shift right by k = 1 - e (k >= 25: below half the smallest subnormal).
    k = jnp.clip(1 - e, 1, 24).astype(jnp.uint32)
    q = sig >> k
    rem = sig & ((jnp.uint32(1) << k) - 1)
    half = jnp.uint32(1) << (k - 1)
    up = (rem > half) | ((rem == half) & ((rest != 0) | ((q & 1) == 1)))
    sub = jnp.where(1 - e >= 25, jnp.uint32(0), q + up.astype(jnp.uint32))
    bits = jnp.where(e >= 1, normal, sub)
    nan_a = (ea == 255) & (ma != 0)
    nan_b = (eb == 255) & (mb != 0)
    inf_a, inf_b = (ea == 255) & (ma == 0), (eb == 255) & (mb == 0)
    zero_a, zero_b = (ea == 0) & (ma == 0), (eb == 0) & (mb == 0)
    bits = jnp.where(zero_a | zero_b, jnp.uint32(0), bits)
    bits = jnp.where(inf_a | inf_b, jnp.uint32(0x7F800000), bits)
    bits = bits | sign
    nan = nan_a | nan_b | (inf_a & zero_b) | (zero_a & inf_b)
    bits = jnp.where(nan, jnp.uint32(CANONICAL_NAN_BITS["float32"]), bits)
    return lax.bitcast_convert_type(bits, jnp.float32)


def _rotate(x, c, s, args):
    """Section 12's rotation of ``x`` ``[T, H, D]`` (fp32) with ``c``, ``s`` ``[T, 1, R/2]``:
    the four products by one :func:`mul_rn` (one copy of its integer arithmetic to compile),
    then one fp32 subtraction or addition each."""
    rotary = args.rotary_dim
    if args.gptj:
        a, b = x[..., 0:rotary:2], x[..., 1:rotary:2]
    else:
        a, b = x[..., :rotary // 2], x[..., rotary // 2:rotary]
    c, s = (jnp.broadcast_to(v, a.shape) for v in (c, s))
    p = mul_rn(jnp.stack([a, b, b, a]), jnp.stack([c, s, c, s]))
    ya = p[0] - p[1]
    yb = p[2] + p[3]
    if args.gptj:
        rotated = jnp.stack([ya, yb], axis=-1).reshape(a.shape[:2] + (rotary,))
    else:
        rotated = jnp.concatenate([ya, yb], axis=-1)
    return jnp.concatenate([rotated, x[..., rotary:]], axis=-1)


@functools.partial(jax.jit, static_argnames=("args",))
def rope_write_kv(arrays: dict, *, args) -> dict:
    """The outputs by argument name from ``arrays`` (the call's, by argument name): ``query_out``,
    what :func:`write_kv` returns for the rotated key, and ``key_out`` when ``args.key_out``."""
    positions = arrays["positions"]
    ok = _in_range(positions, args.max_position)
    if args.max_position == 0:   # every position is out of range (XLA cannot gather from 0 rows)
        rows = jnp.zeros((positions.shape[0], args.rotary_dim), jnp.float32)
    else:
        rows = arrays["cos_sin_cache"][jnp.where(ok, positions, 0)].astype(jnp.float32)
    half = args.rotary_dim // 2
    c, s = rows[:, None, :half], rows[:, None, half:]
    # Query and key heads rotated together (one rotation to compile).
    q_heads = args.query.shape[1]
    y = _rotate(jnp.concatenate([arrays["query"], arrays["key"]], axis=1).astype(jnp.float32),
                c, s, args)
    yq, yk = y[:, :q_heads], y[:, q_heads:]
    if args.query_format is None:
        query_out = _round_output(yq, args.query.dtype, ok[:, None, None])
    else:
        codes = _quantize(yq, _scale(arrays["query_scale"], args.query_scale, 0), args.query_format)
        codes = jnp.where(ok[:, None, None], codes, jnp.uint8(0))
        query_out = lax.bitcast_convert_type(codes, jnp.dtype(args.query_out.dtype))
    slots = jnp.where(ok, arrays["slots"], -1)
    out = write_kv({**arrays, "key": yk, "slots": slots}, args=args.write)
    out["query_out"] = query_out
    if args.key_out is not None:
        out["key_out"] = _round_output(yk, args.write.key.dtype, ok[:, None, None])
    return out


# NVFP4 (docs/SPEC.md section 13), as fp8kv.reference.quantize_nvfp4 / dequantize_nvfp4.

_E2M1 = jnp.array(NVFP4.magnitudes, jnp.float32)
# |y| passes boundary k (its code is the number passed): strictly for the ties that round down.
_E2M1_BOUNDARIES = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
                    (3.5, True), (5.0, False))


def _sign_bits(x):
    """1 where ``x``'s sign bit is set (read from its own bits: XLA:CPU may flush subnormals)."""
    bits = lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])
    return (bits >> (8 * x.dtype.itemsize - 1)).astype(jnp.uint8)


def _quantize_nvfp4(x, g):
    """``(codes [T, H, D/2], block scales [T, H, D/16])``, uint8, of ``x`` ``[T, H, D]`` with
    global scale ``g`` (None, a scalar or ``[H, 1]``)."""
    t, h, d = x.shape
    blocks = x.astype(jnp.float32).reshape(t, h, d // NVFP4.blocks.size, NVFP4.blocks.size)
    g = jnp.float32(1.0) if g is None else g
    a = jnp.abs(blocks)
    amax = jnp.where(jnp.isnan(a), jnp.float32(0.0), a).max(axis=-1)            # [T, H, NB]
    # Divisors behind barriers: XLA would divide by a multiply with an inexact reciprocal.
    s = amax / lax.optimization_barrier(jnp.broadcast_to(jnp.float32(6.0) * g, amax.shape))
    sf = _quantize(s, None, E4M3)
    scale = lax.bitcast_convert_type(sf, jnp.dtype(E4M3.dtype)).astype(jnp.float32) * g
    y = blocks / lax.optimization_barrier(jnp.broadcast_to(scale[..., None], blocks.shape))
    a = jnp.abs(y)
    mag = sum(((a >= b) if ties_up else (a > b)).astype(jnp.uint8)
              for b, ties_up in _E2M1_BOUNDARIES)
    sign = _sign_bits(x).reshape(blocks.shape)
    code = jnp.where(jnp.isnan(y) | (scale == 0)[..., None], jnp.uint8(0), mag | (sign << 3))
    code = code.reshape(t, h, d)
    return code[..., 0::2] | (code[..., 1::2] << 4), sf


def _nvfp4_values(codes, blocks, g):
    """fp32 ``(e2m1 * block scale) * g`` of gathered codes ``[..., D/2]`` and block scales
    ``[..., D/16]``; ``g`` broadcasts against ``[..., D/16, 16]``."""
    nibbles = jnp.stack([codes & 0xF, codes >> 4], axis=-1)
    nibbles = nibbles.reshape(blocks.shape + (NVFP4.blocks.size,))
    mag = _E2M1[nibbles & 0x7]
    e2m1 = jnp.where((nibbles & 0x8) != 0, -mag, mag)
    sv = lax.bitcast_convert_type(blocks, jnp.dtype(E4M3.dtype)).astype(jnp.float32)
    v = e2m1 * sv[..., None]                                   # exact: 6 significant bits
    if g is not None:
        v = v * g
    return v.reshape(codes.shape[:-1] + (2 * codes.shape[-1],))


# paged_attention (docs/SPEC.md section 16)

def _attention_values(given: dict, args):
    """K and V ``[num_seqs, max_pages * page_size, num_kv_heads, head_dim]`` fp32 in token
    order (padding entries of the block table give zeros: never seen)."""
    table = given["block_table"]
    if args.fmt is None:   # as stored
        pages = []
        layer = None
        if args.layers is not None:
            layer = jnp.clip(_layer_index(given, args.layers), 0, args.layers.num_layers - 1)
        index = jnp.clip(table.reshape(-1), 0, args.key_cache.num_pages - 1)
        for side, name in ((0, "key_cache"), (1, "value_cache")):
            cache = given["kv_cache" if args.combined else name]
            if layer is not None:
                cache = cache[layer]
            if args.combined:
                cache = cache[:, side]
            pages.append(cache[index].astype(jnp.float32))
    else:
        dq = DequantArgs(args.num_seqs, table.shape[1], args.block_table, args.key_cache,
                         args.value_cache, args.fmt, "float32", args.layout, args.cache_rank,
                         None, args.key_scale, args.value_scale, args.combined, args.inline_pad,
                         None, args.layers)
        absent = ("key_scale", "value_scale", "key_scale_cache", "value_scale_cache", "layer",
                  "key_cache", "value_cache", "kv_cache", "out_scale")
        out = dequantize_pages({**dict.fromkeys(absent), **given}, args=dq)
        pages = ((out["kv_out"][:, 0], out["kv_out"][:, 1]) if args.combined
                 else (out["key_out"], out["value_out"]))
    result = []
    for p in pages:
        if args.cache_rank == 4 and args.layout == "HND":
            p = jnp.swapaxes(p, 1, 2)
        if args.cache_rank == 3:
            p = p[:, None]
        result.append(p.reshape(args.num_seqs, -1, p.shape[2], p.shape[3]))
    return result


@functools.partial(jax.jit, static_argnames=("args",))
def paged_attention(given: dict, *, args) -> dict:
    """``{"out": ...}``: docs/SPEC.md section 16.2's formula in fp32 over the values
    :func:`dequantize_pages` gives (within 16.3's bound; the GPU's kernel has its own bytes)."""
    k, v = _attention_values(given, args)                                # [B, N, Hkv, D]
    lens = given["seq_lens"]
    if args.layers is not None:   # an out-of-range layer: no token seen
        layer = _layer_index(given, args.layers)
        lens = jnp.where((layer >= 0) & (layer < args.layers.num_layers), lens, 0)
    tokens = jnp.arange(args.num_tokens)
    if args.varlen:
        qsl = given["query_start_loc"]
        seq = jnp.clip(jnp.searchsorted(qsl, tokens, side="right") - 1, 0, args.num_seqs - 1)
        pos = lens[seq] - (qsl[seq + 1] - qsl[seq]) + (tokens - qsl[seq])
    else:
        seq = tokens
        pos = lens - 1
    group = args.num_heads // args.num_kv_heads
    q = given["query"].astype(jnp.float32).reshape(args.num_tokens, args.num_kv_heads, group,
                                                    args.head_dim)
    ks, vs = k[seq], v[seq]                                     # [T, N, Hkv, D]
    s = jnp.einsum("thgd,tnhd->thgn", q, ks, precision=lax.Precision.HIGHEST)
    s = s * jnp.float32(args.softmax_scale)
    if args.logits_soft_cap is not None:
        cap = jnp.float32(args.logits_soft_cap)
        s = cap * jnp.tanh(s / cap)
    t = jnp.arange(ks.shape[1])
    seen = t[None, :] <= pos[:, None]
    if args.sliding_window is not None:
        seen &= t[None, :] > (pos[:, None] - args.sliding_window)
    seen = seen[:, None, None, :]
    s = jnp.where(seen, s, -jnp.inf)
    top = s.max(axis=-1, keepdims=True, initial=-jnp.inf)   # a table of no pages: no token
    if args.sinks:
        sink = given["sinks"].reshape(1, args.num_kv_heads, group, 1)
        top = jnp.maximum(top, sink)
    top = jnp.where(jnp.isfinite(top), top, 0.0)
    p = jnp.where(seen, jnp.exp(s - top), 0.0)
    den = p.sum(axis=-1, keepdims=True)
    if args.sinks:
        den = den + jnp.exp(sink - top)
    # An unseen token's value may be NaN (a padding entry's page, a slot past the length, a
    # token before the window): its zero probability would not cancel it in the sum.
    vs = jnp.where(seen[:, 0, 0, :, None, None], vs, 0.0)
    o = jnp.einsum("thgn,tnhd->thgd", p, vs, precision=lax.Precision.HIGHEST)
    o = jnp.where(den > 0, o / jnp.where(den > 0, den, 1.0), 0.0)
    return {"out": o.reshape(args.out_shape).astype(args.out_dtype)}
