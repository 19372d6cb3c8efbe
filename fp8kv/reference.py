"""NumPy reference: docs/SPEC.md as code, the golden of every test.

Everything here is plain NumPy + ml_dtypes, written for clarity, not speed. Arrays are NumPy arrays
(bf16 / fp8 as ``ml_dtypes`` dtypes); caches may be typed fp8 or raw ``uint8``.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .formats import (CANONICAL_NAN_BITS, DYNAMIC_SCALE_FLOOR, E4M3, FORMATS, FP8_OUTPUT_DTYPE,
                      MXFP8, NVFP4, Format, resolve_format)
from .validate import (INLINE, ROPE_STYLES, SCALE_ROUNDINGS, check_choice, check_inline_pad,
                       check_no_static_scale, check_scale_cache_arg)

_NP_DTYPES = {
    "bfloat16": np.dtype(ml_dtypes.bfloat16),
    "float16": np.dtype(np.float16),
    "float32": np.dtype(np.float32),
    "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    "uint8": np.dtype(np.uint8),
}
_UINT_OF_SIZE = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def np_dtype(name: str) -> np.dtype:
    return _NP_DTYPES[name]


def quantize(x: np.ndarray, scale, fmt: Format) -> np.ndarray:
    """fp8 bytes (uint8) of ``x / scale``: fp32 division, RNE, saturation, NaN -> ``fmt.nan_code``.

    ``scale`` broadcasts against ``x`` (a per-head scale of shape ``[H]`` against ``[..., H, D]``
    must be passed as ``scale[:, None]``).
    """
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        y = x.astype(np.float32) / np.asarray(scale, dtype=np.float32)
    # ml_dtypes' cast returns NaN past the format's rounding boundary: clip first (NaN stays NaN).
    y = np.clip(y, -fmt.max_value, fmt.max_value).astype(np.float32)
    q = y.astype(np_dtype(fmt.dtype)).view(np.uint8)
    return np.where(np.isnan(y), np.uint8(fmt.nan_code), q).astype(np.uint8)


def dequantize(q: np.ndarray, scale, fmt: Format, out_dtype: str) -> np.ndarray:
    """``round_to(out_dtype)(float32(decode(q)) * scale)``; NaN codes give the canonical NaN."""
    f = np.asarray(q).view(np.uint8).view(np_dtype(fmt.dtype)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        v = (f * np.asarray(scale, dtype=np.float32)).astype(np.float32)
    return round_output(v, out_dtype)


def round_output(v: np.ndarray, out_dtype: str) -> np.ndarray:
    """fp32 ``v`` rounded (RNE) to ``out_dtype`` (bfloat16, float16, float32), IEEE style; NaN
    gives the canonical NaN (docs/SPEC.md section 3)."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = v.astype(np_dtype(out_dtype))
    bits = out.view(_UINT_OF_SIZE[out.itemsize])
    bits = np.where(np.isnan(v), bits.dtype.type(CANONICAL_NAN_BITS[out_dtype]), bits)
    return bits.astype(bits.dtype).view(np_dtype(out_dtype))


# ---------------------------------------------------------------------------------------------
# Dynamic scales: one fp32 scale per written token, or per written token and kv head.

GRANULARITIES = ("token", "token_head")
SCALE_FLOOR = np.float32(DYNAMIC_SCALE_FLOOR)  # 1e-6 in fp32: the smallest dynamic scale (before pow2 rounding)


def _as_format(fmt) -> Format:
    if isinstance(fmt, Format):
        return fmt
    if isinstance(fmt, str) and fmt in FORMATS:
        return FORMATS[fmt]
    raise ValueError(f"fmt: expected one of {sorted(FORMATS)} or a Format, got {fmt!r}")


def _pow2_ceil(s: np.ndarray) -> np.ndarray:
    """The smallest power of two ``>= s`` for fp32 ``s > 0`` (exact; ``inf`` stays ``inf``)."""
    s = np.asarray(s, dtype=np.float32)
    # frexp splits s = m * 2**e with 0.5 <= m < 1. s is itself a power of two exactly when
    # m == 0.5 (s = 2**(e-1)); otherwise 2**(e-1) < s < 2**e and the answer is 2**e.
    m, e = np.frexp(s)
    k = np.where(m == 0.5, e - 1, e)
    p = np.ldexp(np.float32(1.0), k).astype(np.float32)
    return np.where(np.isfinite(s), p, s).astype(np.float32)


def dynamic_scales(x, fmt, granularity, rounding) -> np.ndarray:
    """The dynamic dequant scales of new K or V ``x`` ``[T, H, D]``: fp32 ``[T, H]`` or ``[T]``.

    ``fmt``: an :class:`Format` or its name (``"e4m3"``, ``"e5m2"``); ``granularity``:
    ``"token_head"`` (one scale per token and kv head, ``[T, H]``) or ``"token"`` (one per token
    over all its heads, ``[T]``); ``rounding``: ``"exact"`` or ``"pow2"``. For each group:

    * ``amax = max |float32(x)|``. NaN elements are ignored (an all-NaN group has amax 0); an
      infinite element makes amax infinite. Subnormal inputs are kept as they are (no flush).
    * ``s = float32(amax / fmt.max_value)`` (one IEEE fp32 division), then ``s = max(s, 1e-6)``
      with ``1e-6`` as fp32, so an all-zero group gets ``s = float32(1e-6)``.
    * ``rounding="pow2"``: ``s`` becomes the smallest power of two ``>= s`` (an e8m0 value;
      multiplying by it is exact, so dequantization adds no rounding of its own).

    The codes are then ``quantize(x, s)``. An infinite amax gives ``s = inf``: every finite element
    of the group is written as a zero code (``x / inf = +-0``) and the infinite ones as
    ``fmt.nan_code`` (``inf / inf`` is NaN); on readback ``0 * inf`` is NaN, so such a group
    dequantizes to NaN everywhere.

    >>> x = np.array([[[1.0, -896.0], [0.0, 0.0]]], dtype=np.float32)     # T=1, H=2, D=2
    >>> dynamic_scales(x, "e4m3", "token_head", "exact").tolist()
    [[2.0, 9.999999974752427e-07]]
    >>> dynamic_scales(x, "e4m3", "token_head", "pow2").tolist()          # 2**1, 2**-19
    [[2.0, 1.9073486328125e-06]]
    >>> dynamic_scales(x, "e4m3", "token", "exact").tolist()
    [2.0]
    """
    fmt = _as_format(fmt)
    check_choice(granularity, "granularity", GRANULARITIES)
    check_choice(rounding, "rounding", SCALE_ROUNDINGS)
    x = np.asarray(x)
    if x.ndim != 3:
        raise ValueError(f"x: expected rank 3 [num_tokens, num_kv_heads, head_dim], got shape "
                         f"{list(x.shape)}")
    a = np.abs(x.astype(np.float32))
    a = np.where(np.isnan(a), np.float32(0.0), a)   # NaNs count as 0; inf survives the max
    axes = (2,) if granularity == "token_head" else (1, 2)
    amax = a.max(axis=axes, initial=np.float32(0.0)).astype(np.float32)
    s = (amax / np.float32(fmt.max_value)).astype(np.float32)  # fp32 / fp32: IEEE division
    s = np.maximum(s, SCALE_FLOOR)
    return _pow2_ceil(s) if rounding == "pow2" else s


def _scale_array(scale, num_heads: int) -> np.ndarray:
    """A scale as a ``[H, 1]`` fp32 array (None -> 1, float, ``[]``, ``[1]`` or ``[H]``)."""
    s = np.float32(1.0) if scale is None else np.asarray(scale, dtype=np.float32)
    return np.broadcast_to(s.reshape(-1), (num_heads,)).reshape(num_heads, 1)


def _pages_view(cache: np.ndarray, layout: str) -> np.ndarray:
    """Any supported cache as ``[num_pages, page_size, H, D]`` (a view)."""
    if cache.ndim == 3:  # [num_slots, H, D]: NHD with page_size 1
        return cache[:, None]
    return cache if layout == "NHD" else cache.transpose(0, 2, 1, 3)


def scale_cache_shapes(cache_shape, layout: str) -> dict:
    """The side scale cache shapes a K/V cache of ``cache_shape`` accepts, by granularity.

    ``[P, S, H, D]`` NHD -> ``[P, S, H]`` / ``[P, S]``; ``[P, H, S, D]`` HND -> ``[P, H, S]`` /
    ``[P, S]``; ``[num_slots, H, D]`` -> ``[num_slots, H]`` / ``[num_slots]``.

    >>> scale_cache_shapes((9, 4, 16, 128), "HND")
    {'token_head': (9, 4, 16), 'token': (9, 16)}
    """
    shape = tuple(int(n) for n in cache_shape)
    if len(shape) == 3:
        return {"token_head": shape[:2], "token": shape[:1]}
    slot_dim = 1 if layout == "NHD" else 2
    return {"token_head": shape[:3], "token": (shape[0], shape[slot_dim])}


def _side_scales_view(scale_cache: np.ndarray, cache_shape, layout: str, name: str):
    """``(view, granularity)``: a side scale cache as ``[num_pages, page_size, H or 1]``."""
    if scale_cache.dtype != np.float32:
        raise TypeError(f"{name}: expected dtype float32, got {scale_cache.dtype}")
    shapes = scale_cache_shapes(cache_shape, layout)
    if scale_cache.shape == shapes["token_head"]:   # the cache's shape without head_dim
        return _pages_view(scale_cache[..., None], layout)[..., 0], "token_head"
    if scale_cache.shape == shapes["token"]:
        view = scale_cache[:, None, None] if len(cache_shape) == 3 else scale_cache[:, :, None]
        return view, "token"
    raise ValueError(f"{name}: expected shape {list(shapes['token_head'])} (per token-head) or "
                     f"{list(shapes['token'])} (per token) for a {layout} cache of shape "
                     f"{list(cache_shape)}, got {list(scale_cache.shape)}")


def write_kv(key, value, key_cache, value_cache, slots, key_scale=None, value_scale=None, *,
             layout="NHD", fp8_format=None, key_scale_cache=None, value_scale_cache=None,
             scale_rounding="exact", cache_format=None, layer=None):
    """Reference ``write_kv``: new copies of the caches; nothing is modified in place.

    ``cache_format="nvfp4"`` (docs/SPEC.md section 13): uint8 caches ``[..., D/2]``, block-scale
    arrays ``key_scale_cache`` / ``value_scale_cache`` ``[..., D/16]`` (e4m3 or uint8), global
    scales ``key_scale`` / ``value_scale``; returns ``(key_cache, value_cache, key_scale_cache,
    value_scale_cache)``, each a new copy.

    ``layer`` (docs/SPEC.md section 14): the caches and side scale arrays are stacked
    ``[num_layers, ...]`` and layer ``layer`` is written (:func:`write_kv_layer`).

    Static scales (``key_scale`` / ``value_scale``: None, a float, ``[]``, ``[1]`` or ``[H]``)
    quantize every token with the same scale. Dynamic scales: pass ``key_scale_cache`` (and/or
    ``value_scale_cache``; K and V are independent) and leave that side's static scale None.
    Each written token gets :func:`dynamic_scales` (``rounding=scale_rounding``), which is stored
    at its slot:

    * a float32 side array whose shape gives the granularity (see :func:`scale_cache_shapes`):
      the cache's shape without ``head_dim`` (per token-head: ``[P, S, H]`` NHD, ``[P, H, S]``
      HND, ``[num_slots, H]``) or without heads and ``head_dim`` (per token: ``[P, S]``,
      ``[num_slots]``). Only the written slots change.
    * ``"inline"`` (per token-head): the cache's last dimension is ``head_dim + 4`` or
      ``head_dim + 16`` (``head_dim`` from ``key``); each head row holds its ``head_dim`` codes,
      then the fp32 scale in little-endian byte order, then (``+16``) 12 zero bytes.

    Slots ``< 0`` or past the cache are padding: nothing is written for them, codes or scales.

    Returns ``(key_cache, value_cache)``, or ``(key_cache, value_cache, key_scale_cache,
    value_scale_cache)`` when a side array is given for K or V (the other entry is None when that
    side has no side array: static scales or ``"inline"``).
    """
    check_choice(scale_rounding, "scale_rounding", SCALE_ROUNDINGS)
    if layer is not None:
        return write_kv_layer(layer, key, value, key_cache, value_cache, slots, key_scale,
                              value_scale, layout=layout, fp8_format=fp8_format,
                              key_scale_cache=key_scale_cache, value_scale_cache=value_scale_cache,
                              scale_rounding=scale_rounding, cache_format=cache_format)
    fp8_format = cache_format or fp8_format
    slots = np.asarray(slots).astype(np.int64)
    out, scale_out = [], []
    for side, x, cache, scale, scale_cache in (
            ("key", key, key_cache, key_scale, key_scale_cache),
            ("value", value, value_cache, value_scale, value_scale_cache)):
        cache = np.array(cache, copy=True)
        fmt = resolve_format(cache.dtype.name, fp8_format)
        if not fmt.block_scaled:
            check_scale_cache_arg(scale_cache, f"{side}_scale_cache", np.ndarray)
        if not fmt.packed:   # nvfp4's block scales come with a global (static) scale
            check_no_static_scale(scale, scale_cache, f"{side}_scale")
        x = np.asarray(x)
        num_tokens, num_heads, head_dim = x.shape
        pages = _pages_view(cache.view(np.uint8), layout)   # [P, S, H, width]
        num_pages, page_size, _, width = pages.shape
        side_scales = None   # the [P, S, H or 1 (, blocks)] view of a side array being written
        if fmt.block_scaled:   # codes and block scales [T, H, D / block size]
            scale_cache = np.array(scale_cache, copy=True)
            side_scales = _pages_view(scale_cache.view(np.uint8), layout)
            rows, s = (quantize_nvfp4(x, _scale_array(scale, num_heads)) if fmt.packed
                       else quantize_mxfp8(x))
        elif scale_cache is None:
            rows = quantize(x, _scale_array(scale, num_heads), fmt)      # [T, H, D] codes
        else:
            inline = isinstance(scale_cache, str)
            if inline:
                pad = check_inline_pad(width, head_dim, f"{side}_cache")
                granularity = "token_head"
            else:
                scale_cache = np.array(scale_cache, copy=True)
                side_scales, granularity = _side_scales_view(scale_cache, cache.shape, layout,
                                                             f"{side}_scale_cache")
            s = dynamic_scales(x, fmt, granularity, scale_rounding)      # [T, H] or [T]
            rows = quantize(x, s[:, :, None] if granularity == "token_head" else s[:, None, None],
                            fmt)
            if inline:   # append each head's scale bytes (little-endian fp32), then zeros
                tail = np.zeros((num_tokens, num_heads, pad), dtype=np.uint8)
                tail[..., :4] = s.astype("<f4").view(np.uint8).reshape(num_tokens, num_heads, 4)
                rows = np.concatenate([rows, tail], axis=-1)
        for t, slot in enumerate(slots):
            if 0 <= slot < num_pages * page_size:
                page, offset = divmod(int(slot), page_size)
                pages[page, offset] = rows[t]
                if side_scales is not None:
                    side_scales[page, offset] = s[t]
        out.append(cache)
        scale_out.append(None if side_scales is None else scale_cache)
    if all(s is None for s in scale_out):
        return tuple(out)
    return tuple(out) + tuple(scale_out)


def dequantize_pages(key_cache, value_cache, block_table, key_scale=None, value_scale=None, *,
                     dtype="bfloat16", layout="NHD", fp8_format=None, null_page=None,
                     key_scale_cache=None, value_scale_cache=None, head_dim=None,
                     cache_format=None, out_scale=None, layer=None):
    """Reference ``dequantize_pages``: ``(key_pages, value_pages, new_block_table)``.

    ``cache_format="nvfp4"``: block scales in ``key_scale_cache`` / ``value_scale_cache``, global
    scales in ``key_scale`` / ``value_scale``; pages of ``D = 2 x`` the caches' last dimension.
    ``dtype="float8_e4m3fn"`` (nvfp4 only) gives e4m3 codes of the values divided by
    ``out_scale`` (None: 1).

    ``layer`` (docs/SPEC.md section 14): the caches and side scale arrays are stacked
    ``[num_layers, ...]`` and layer ``layer`` is read; out of range, every page is zero.

    Static scales (``key_scale`` / ``value_scale``) or dynamic ones, read per token
    (``key_scale_cache`` / ``value_scale_cache``, with that side's static scale None; K and V are
    independent): a float32 side array as written by :func:`write_kv` (per token-head or per
    token, told by its shape), or ``"inline"``: the scale is the little-endian fp32 in bytes
    ``head_dim .. head_dim + 3`` of each head row (any bytes after it are ignored).

    With ``"inline"``, ``head_dim=`` is required: the cache's last dimension is ``head_dim + 4``
    or ``head_dim + 16``, which alone cannot tell them apart (a width of 148 is 144 + 4 or
    132 + 16). When given without an inline cache it must equal the caches' last dimension.
    The outputs hold ``head_dim`` columns (the data only). Padding entries of the block table
    (``< 0``, past the cache, or ``== null_page``) give zero pages and read no scale.
    """
    if head_dim is not None and (isinstance(head_dim, bool) or not isinstance(head_dim, int)):
        raise TypeError(f"head_dim: expected None or an int, got {type(head_dim).__name__}")
    if layer is not None:
        stacks = dict(key_cache=key_cache, value_cache=value_cache,
                      key_scale_cache=key_scale_cache, value_scale_cache=value_scale_cache)
        one = _one_layer(layer, stacks)
        if one is None:   # out of range: every entry is padding, nothing is read
            one = {n: np.zeros(a.shape[1:], a.dtype) for n, a in stacks.items()
                   if isinstance(a, np.ndarray)}
            block_table = np.full(np.shape(block_table), -1, np.int64)
        one = {**stacks, **one}
        return dequantize_pages(one.pop("key_cache"), one.pop("value_cache"), block_table,
                                key_scale, value_scale, dtype=dtype, layout=layout,
                                fp8_format=fp8_format, null_page=null_page, head_dim=head_dim,
                                cache_format=cache_format, out_scale=out_scale, **one)
    fp8_format = cache_format or fp8_format
    inline_given = any(isinstance(c, str) and c == INLINE for c in (key_scale_cache,
                                                                     value_scale_cache))
    if inline_given and head_dim is None:
        raise ValueError("head_dim: expected an int with an inline scale cache (the last dimension "
                         "is head_dim + 4 or head_dim + 16), got None")
    table = np.asarray(block_table).astype(np.int64)
    results = []
    for side, cache, scale, scale_cache in (("key", key_cache, key_scale, key_scale_cache),
                                            ("value", value_cache, value_scale, value_scale_cache)):
        cache = np.asarray(cache)
        fmt = resolve_format(cache.dtype.name, fp8_format)
        if not fmt.block_scaled:
            check_scale_cache_arg(scale_cache, f"{side}_scale_cache", np.ndarray)
        if not fmt.packed:
            check_no_static_scale(scale, scale_cache, f"{side}_scale")
        pages = _pages_view(cache.view(np.uint8), layout)
        num_heads, width = pages.shape[2:]
        static = _scale_array(scale, num_heads)
        if fmt.block_scaled:   # pages of codes_per_byte x the caches' last dimension
            data_dim = fmt.codes_per_byte * width
            side_scales = _pages_view(np.asarray(scale_cache).view(np.uint8), layout)
        elif isinstance(scale_cache, str):   # inline
            check_inline_pad(width, head_dim, f"{side}_cache")
            data_dim = head_dim
            # [P, S, H]: the 4 scale bytes of every head row, read as little-endian fp32
            side_scales = np.ascontiguousarray(pages[..., head_dim:head_dim + 4]).view("<f4")
            side_scales = side_scales.astype(np.float32)   # [P, S, H, 1]: broadcasts over data
        else:
            if head_dim is not None and head_dim != width:
                raise ValueError(f"head_dim: expected the last dimension of {side}_cache "
                                 f"({width}) without an inline scale cache, got {head_dim}")
            data_dim = width
            side_scales = None
            if scale_cache is not None:
                view, _ = _side_scales_view(np.asarray(scale_cache), cache.shape, layout,
                                            f"{side}_scale_cache")
                side_scales = view[..., None]                   # [P, S, H or 1, 1]

        def page_values(page):   # called within this iteration: its variables are current
            if fmt.packed:
                return dequantize_nvfp4(pages[page], side_scales[page], static, dtype, out_scale)
            if fmt.block_scaled:
                return dequantize_mxfp8(pages[page], side_scales[page], dtype)
            s = static if side_scales is None else side_scales[page]
            return dequantize(pages[page, ..., :data_dim], s, fmt, dtype)

        results.append(_compact_pages(table, null_page, pages.shape, data_dim, dtype, cache.ndim,
                                      layout, page_values))
    return results[0], results[1], _renumbered_table(table)


def _compact_pages(table, null_page, pages_shape, data_dim, dtype, rank, layout, page_values):
    """The pages ``table`` names, in its order, as one ``[batch * pages_per_seq, ...]`` array of
    ``dtype`` in the caches' layout and rank: entry ``i`` is ``page_values(page)`` ([S, H,
    data_dim]), or zeros for a padding entry (negative, past the cache, or ``null_page``)."""
    num_pages, page_size, num_heads = pages_shape[:3]
    out = np.zeros((table.size, page_size, num_heads, data_dim), np_dtype(dtype))
    for i, page in enumerate(table.reshape(-1)):
        padding = page < 0 or page >= num_pages or (null_page is not None and page == null_page)
        if not padding:
            out[i] = page_values(page)
    if rank == 3:
        return out[:, 0]
    return np.ascontiguousarray(out.transpose(0, 2, 1, 3)) if layout == "HND" else out


def _renumbered_table(table):
    """The compact cache's block table: entry ``i`` (row-major) names page ``i``."""
    return np.arange(table.size, dtype=np.int32).reshape(table.shape)


# ---------------------------------------------------------------------------------------------
# RoPE + write (docs/SPEC.md, section 12).

def rope_pairs(head_dim: int, rotary_dim: int, rope_style: str) -> tuple[np.ndarray, np.ndarray]:
    """The element indices ``(a, b)`` of each rotated pair ``i < rotary_dim / 2``: ``neox``
    pairs ``(i, i + R/2)``, ``gptj`` ``(2i, 2i + 1)``.

    >>> [a.tolist() for a in rope_pairs(8, 4, "neox")]
    [[0, 1], [2, 3]]
    >>> [a.tolist() for a in rope_pairs(8, 4, "gptj")]
    [[0, 2], [1, 3]]
    """
    check_choice(rope_style, "rope_style", ROPE_STYLES)
    half = np.arange(rotary_dim // 2)
    if rope_style == "neox":
        return half, half + rotary_dim // 2
    return 2 * half, 2 * half + 1


def position_ok(positions, max_position: int) -> np.ndarray:
    """Which positions name a row of the cos/sin cache (``0 <= p < max_position``)."""
    p = np.asarray(positions).astype(np.int64)
    return (p >= 0) & (p < max_position)


def rope(x, positions, cos_sin_cache, *, rope_style="neox", rotary_dim=None) -> np.ndarray:
    """Rotated ``x`` ``[T, H, D]`` as float32: section 12's rule, each operation rounded to fp32.

    ``positions`` ``[T]``; ``cos_sin_cache`` ``[max_position, R]`` (cos in the first ``R/2``
    columns, sin in the rest; fp32, bf16 or fp16). Elements from ``R`` on pass through; rows of
    positions outside ``[0, max_position)`` are +0.0.

    >>> cs = np.array([[0.0, 1.0]], np.float32)           # one position: cos 0, sin 1
    >>> rope(np.array([[[1.0, 2.0, 7.0]]], np.float32), np.array([0]), cs).tolist()
    [[[-2.0, 1.0, 7.0]]]
    """
    x = np.asarray(x).astype(np.float32)
    cs = np.asarray(cos_sin_cache).astype(np.float32)
    rotary_dim = cs.shape[1] if rotary_dim is None else rotary_dim
    half = rotary_dim // 2
    ok = position_ok(positions, cs.shape[0])
    rows = np.zeros((len(ok), cs.shape[1]), np.float32)
    rows[ok] = cs[np.asarray(positions).astype(np.int64)[ok]]
    c, s = rows[:, None, :half], rows[:, None, half:rotary_dim]
    a, b = rope_pairs(x.shape[-1], rotary_dim, rope_style)
    y = x.copy()
    with np.errstate(over="ignore", invalid="ignore", under="ignore"):
        # float32 arrays: every product, sum and difference is rounded to fp32 on its own.
        y[..., a] = x[..., a] * c - x[..., b] * s
        y[..., b] = x[..., b] * c + x[..., a] * s
    y[~ok] = 0.0
    return y


def rope_write_kv(query, key, value, key_cache, value_cache, slots, positions, cos_sin_cache,
                  key_scale=None, value_scale=None, *, rope_style="neox", rotary_dim=None,
                  query_scale=None, query_out=None, return_key=False, layout="NHD",
                  fp8_format=None, key_scale_cache=None, value_scale_cache=None,
                  scale_rounding="exact"):
    """Reference ``rope_write_kv``: :func:`rope` of ``query`` and ``key``, then :func:`write_kv`
    of the rotated key (fp32) and ``value``. Nothing is modified in place.

    ``query_scale`` None: ``query_out`` is the rotated query rounded to ``query``'s dtype;
    otherwise (a float or a float32 array ``[]`` / ``[1]``) its FP8 codes
    ``quantize(y, query_scale)``, e4m3 unless ``query_out`` (an array whose dtype the result
    takes; its contents are not read) is ``float8_e5m2``. Tokens whose position is outside
    ``[0, len(cos_sin_cache))`` get all-zero ``query_out`` (and key) rows and write nothing.

    Returns ``(query_out, key_cache, value_cache)``, then ``(key_scale_cache,
    value_scale_cache)`` when a side scale array is given, then the rotated key in ``key``'s
    dtype when ``return_key``.
    """
    query, key = np.asarray(query), np.asarray(key)
    options = dict(rope_style=rope_style, rotary_dim=rotary_dim)
    yq = rope(query, positions, cos_sin_cache, **options)
    yk = rope(key, positions, cos_sin_cache, **options)
    ok = position_ok(positions, np.asarray(cos_sin_cache).shape[0])
    if query_scale is None:
        q = round_output(yq, query.dtype.name)
    else:
        out_dtype = np.asarray(query_out).dtype.name if query_out is not None else "float8_e4m3fn"
        fmt = FORMATS["e5m2" if out_dtype == "float8_e5m2" else "e4m3"]
        q = quantize(yq, np.asarray(query_scale, np.float32).reshape(()), fmt).view(
            np_dtype(out_dtype))
    q[~ok] = np.zeros((), q.dtype)   # all-zero bytes, whatever the scale
    slots = np.where(ok, np.asarray(slots).astype(np.int64), -1)
    written = write_kv(yk, value, key_cache, value_cache, slots, key_scale, value_scale,
                       layout=layout, fp8_format=fp8_format, key_scale_cache=key_scale_cache,
                       value_scale_cache=value_scale_cache, scale_rounding=scale_rounding)
    out = (q,) + tuple(written)
    if return_key:
        out += (round_output(yk, key.dtype.name),)
    return out


# ---------------------------------------------------------------------------------------------
# NVFP4 (docs/SPEC.md section 13): E2M1 codes, an e4m3 scale per 16 elements, a global scale.

_E2M1 = np.array(NVFP4.magnitudes, dtype=np.float64)   # value of each magnitude code 0..7


def e2m1_magnitude(a) -> np.ndarray:
    """The E2M1 magnitude code (0..7, uint8) of fp32 ``a >= 0``: the nearest of 0, 0.5, 1, 1.5,
    2, 3, 4, 6, ties to the even code; above 6 (inf included) gives 7.

    >>> e2m1_magnitude(np.float32([0.25, 0.26, 0.75, 1.25, 2.5, 3.5, 5.0, 5.01, np.inf])).tolist()
    [0, 1, 2, 2, 4, 6, 6, 7, 7]
    """
    a = np.minimum(np.asarray(a, dtype=np.float64), 6.0)   # fp32 -> fp64 and |a - v|: exact
    dist = np.abs(a[..., None] - _E2M1)
    tied = dist == dist.min(axis=-1, keepdims=True)         # one code, or two neighbours
    codes = np.arange(_E2M1.size)
    even = np.where(tied & (codes % 2 == 0), codes, _E2M1.size).min(axis=-1)
    return np.where(even < _E2M1.size, even, tied.argmax(axis=-1)).astype(np.uint8)


def _blocks(x, fmt: Format) -> np.ndarray:
    """``x`` ``[..., D]`` as ``[..., D / size, size]``: the blocks of ``fmt`` (nvfp4, mxfp8)."""
    x = np.asarray(x)
    size = fmt.blocks.size
    if x.shape[-1] % size:
        what = " (head_dim)" if fmt is MXFP8 else ""
        raise ValueError(f"x: expected a last dimension{what} that is a multiple of {size}, "
                         f"got {x.shape[-1]}")
    return x.reshape(x.shape[:-1] + (x.shape[-1] // size, size))


def quantize_nvfp4(x, g=None):
    """NVFP4 codes and block scales of ``x`` ``[..., D]`` (``D`` a multiple of 16) with global
    dequant scale ``g`` (None: 1; else fp32, broadcasting against ``[..., D/16]``, e.g. ``[H, 1]``
    for ``x`` of shape ``[T, H, D]``).

    Returns ``(codes, block_scales)``: uint8 ``[..., D/2]`` (element ``2i`` in the low nibble)
    and uint8 ``[..., D/16]`` (e4m3 bytes). Per block of 16 (docs/SPEC.md 12.1): ``amax`` (NaN as
    0), ``sf = e4m3(amax / (6 g))``, ``d = e4m3_value(sf) * g``; ``d == 0`` gives zero codes,
    otherwise each code is the nearest E2M1 value of ``x / d`` (ties to even, saturating at 6)
    with the sign of ``x``, and 0 for a NaN quotient.

    >>> codes, sf = quantize_nvfp4(np.float32([[0, 1, -1, 3, 6, -6, 0.75, 1.25] + [0] * 8]))
    >>> [hex(b) for b in codes[0, :4]], hex(sf[0, 0])  # amax 6: sf = 1.0 (0x38), d = 1
    (['0x20', '0x5a', '0xf7', '0x22'], '0x38')
    """
    blocks = _blocks(x, NVFP4).astype(np.float32)                   # [..., NB, 16]
    g = np.float32(1.0) if g is None else np.asarray(g, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        a = np.abs(blocks)
        amax = np.where(np.isnan(a), np.float32(0.0), a).max(axis=-1)     # [..., NB]
        six_g = (np.float32(6.0) * g).astype(np.float32)
        sf = quantize((amax / six_g).astype(np.float32), np.float32(1.0), E4M3)
        d = (sf.view(np_dtype(E4M3.dtype)).astype(np.float32) * g).astype(np.float32)
        y = (blocks / d[..., None]).astype(np.float32)
    mag = e2m1_magnitude(np.where(np.isnan(y), np.float32(0.0), np.abs(y)))
    code = mag | (np.signbit(blocks).astype(np.uint8) << 3)
    code = np.where(np.isnan(y) | (d == 0)[..., None], np.uint8(0), code).astype(np.uint8)
    code = code.reshape(code.shape[:-2] + (-1,))
    return (code[..., 0::2] | (code[..., 1::2] << 4)).astype(np.uint8), sf


def e2m1_values(codes) -> np.ndarray:
    """fp32 values ``[..., 2 W]`` of packed codes ``[..., W]`` (low nibble first); ``0x8`` is -0.0.

    >>> e2m1_values(np.uint8([0x8f, 0x21])).tolist()
    [-6.0, -0.0, 0.5, 1.0]
    """
    c = np.asarray(codes).view(np.uint8)
    nib = np.stack([c & 0xF, c >> 4], axis=-1).reshape(c.shape[:-1] + (2 * c.shape[-1],))
    mag = _E2M1.astype(np.float32)[nib & 0x7]
    return np.where(nib & 0x8, -mag, mag).astype(np.float32)


def dequantize_nvfp4(codes, block_scales, g=None, out_dtype="bfloat16", out_scale=None):
    """Values of NVFP4 ``codes`` ``[..., D/2]`` with ``block_scales`` ``[..., D/16]`` (e4m3 bytes)
    and global scale ``g`` (as in :func:`quantize_nvfp4`), as ``out_dtype`` ``[..., D]``.

    ``v = (e2m1 * e4m3_value(sf)) * g`` in fp32 (the first product is exact), then rounded to
    ``out_dtype`` (NaN: canonical NaN); ``out_dtype="float8_e4m3fn"`` gives the e4m3 codes of
    ``v / out_scale`` (None: 1) as :func:`quantize` writes them.

    >>> sf = np.uint8([[0x3C]])                                         # e4m3 1.5
    >>> dequantize_nvfp4(np.uint8([[0x8f] + [0x22] * 7]), sf, 0.5, "float32")[0, :3]
    array([-4.5 , -0.  ,  0.75], dtype=float32)
    """
    sv = np.asarray(block_scales).view(np.uint8).view(np_dtype(E4M3.dtype)).astype(np.float32)
    g = np.float32(1.0) if g is None else np.asarray(g, dtype=np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        p = (_blocks(e2m1_values(codes), NVFP4) * sv[..., None]).astype(np.float32)   # exact
        v = (p * np.asarray(g)[..., None]).astype(np.float32)
    v = v.reshape(v.shape[:-2] + (-1,))
    if out_dtype == FP8_OUTPUT_DTYPE:
        scale = np.float32(1.0) if out_scale is None else out_scale
        return quantize(v, scale, E4M3).view(np_dtype(FP8_OUTPUT_DTYPE))
    return round_output(v, out_dtype)


# ---------------------------------------------------------------------------------------------
# MXFP8 (docs/SPEC.md section 13a): e4m3 codes, an E8M0 power-of-two scale per 32 elements.

def e8m0_value(e) -> np.ndarray:
    """fp32 ``2**(e - 127)`` of E8M0 bytes ``e`` (``0`` is the subnormal 2**-127); ``0xFF`` is
    NaN.

    >>> e8m0_value(np.uint8([127, 128, 0, 255])).tolist()
    [1.0, 2.0, 5.877471754111438e-39, nan]
    """
    e = np.asarray(e).astype(np.int64)
    v = np.ldexp(np.float32(1.0), (np.minimum(e, 254) - 127).astype(np.int32)).astype(np.float32)
    return np.where(e == 0xFF, np.float32(np.nan), v).astype(np.float32)


def mxfp8_scale_codes(blocks) -> np.ndarray:
    """The E8M0 byte of each block (last axis) of fp32 ``blocks``: 0xFF where the block holds a
    NaN or an infinity, else ``max(floor(log2(amax)) - 8 + 127, 0)`` -- the OCP shared exponent
    (e4m3's largest power of two is 2**8), clamped at 2**-127. ``floor(log2(amax))`` is the
    exponent field of ``amax`` minus 127 (a subnormal or zero ``amax``: exponent field 0, which
    the clamp takes as it does any exponent below -127).

    >>> mxfp8_scale_codes(np.float32([[448, 1], [0, -0.0], [255.9, 1], [np.inf, 1]])).tolist()
    [127, 0, 126, 255]
    """
    bits = np.asarray(blocks, dtype=np.float32).view(np.uint32) & np.uint32(0x7FFFFFFF)
    nonfinite = (bits >= 0x7F800000).any(axis=-1)
    amax_bits = bits.max(axis=-1, initial=0)          # fp32 magnitudes order as their bits
    exp_field = (amax_bits >> 23).astype(np.int64)
    return np.where(nonfinite, 0xFF, np.maximum(exp_field - 8, 0)).astype(np.uint8)


def quantize_mxfp8(x):
    """MXFP8 codes and block scales of ``x`` ``[..., D]`` (``D`` a multiple of 32): uint8
    ``[..., D]`` (e4m3 bytes) and uint8 ``[..., D/32]`` (E8M0 bytes, :func:`mxfp8_scale_codes`).
    Each code is :func:`quantize` of ``float32(x) / X`` with ``X = 2**(e - 127)`` its block's
    scale (NaN for ``e = 0xFF``: every code 0x7F).

    >>> codes, e = quantize_mxfp8(np.float32([[448, -1, 0.5, -0.0] + [0] * 28]))
    >>> [hex(c) for c in codes[0, :4]], e.tolist()       # amax 448: X = 2**0, e = 127
    (['0x7e', '0xb8', '0x30', '0x80'], [[127]])
    """
    blocks = _blocks(x, MXFP8).astype(np.float32)                   # [..., NB, 32]
    e = mxfp8_scale_codes(blocks)
    codes = quantize(blocks, e8m0_value(e)[..., None], MXFP8)
    return codes.reshape(codes.shape[:-2] + (-1,)), e


def dequantize_mxfp8(codes, block_scales, out_dtype="bfloat16"):
    """Values of MXFP8 ``codes`` ``[..., D]`` (e4m3 bytes) with ``block_scales`` ``[..., D/32]``
    (E8M0 bytes) as ``out_dtype``: ``decode_e4m3(c) * 2**(e - 127)`` in fp32 (exact unless it
    overflows), then rounded to ``out_dtype`` (NaN: the canonical NaN).

    >>> dequantize_mxfp8(np.uint8([[0x7e, 0xb8] + [0] * 30]), np.uint8([[135]]), "float32")[0, :2]
    array([114688.,   -256.], dtype=float32)
    """
    c = _blocks(np.asarray(codes).view(np.uint8), MXFP8)
    f = c.view(np_dtype(MXFP8.dtype)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        v = (f * e8m0_value(np.asarray(block_scales).view(np.uint8))[..., None]).astype(np.float32)
    return round_output(v.reshape(v.shape[:-2] + (-1,)), out_dtype)


# ---------------------------------------------------------------------------------------------
# Stacked caches: [num_layers, ...] arrays and the layer a call reads or writes.

def _one_layer(layer, stacks: dict):
    """Layer ``layer`` of each stacked array of ``stacks`` (NumPy arrays; others are left out),
    or None when ``layer`` is out of range (``< 0`` or ``>= num_layers``: no wrap-around)."""
    layer = int(np.asarray(layer))
    arrays = {n: np.asarray(a) for n, a in stacks.items() if isinstance(a, np.ndarray)}
    num_layers = arrays["key_cache"].shape[0]
    if not 0 <= layer < num_layers:
        return None
    return {n: a[layer] for n, a in arrays.items()}


def write_kv_layer(layer, key, value, key_cache, value_cache, slots, key_scale=None,
                   value_scale=None, **kwargs):
    """:func:`write_kv` into layer ``layer`` of stacked ``[num_layers, ...]`` caches (and side
    scale arrays): new copies of the whole stacks, every other layer unchanged; an out-of-range
    ``layer`` writes nothing. Returns what :func:`write_kv` returns, with the stacks.

    >>> cache = np.zeros((3, 2, 1, 1, 2), np.uint8)               # 3 layers of 2 pages x 1 slot
    >>> k, v = write_kv_layer(1, np.ones((1, 1, 2), np.float32), np.ones((1, 1, 2), np.float32),
    ...                       cache, cache, np.array([1]))
    >>> k[:, 1, 0, 0].tolist()                                      # layer 1, slot 1 only
    [[0, 0], [56, 56], [0, 0]]
    >>> bool(write_kv_layer(3, np.ones((1, 1, 2)), np.ones((1, 1, 2)), cache, cache,
    ...                     np.array([1]))[0].any())                  # out of range: nothing
    False
    """
    names = ("key_cache", "value_cache", "key_scale_cache", "value_scale_cache")
    stacks = dict(zip(names, (key_cache, value_cache, kwargs.get("key_scale_cache"),
                              kwargs.get("value_scale_cache"))))
    copies = {n: np.array(a, copy=True) for n, a in stacks.items() if isinstance(a, np.ndarray)}
    one = _one_layer(layer, copies)
    if one is not None:
        written = write_kv(key, value, one.pop("key_cache"), one.pop("value_cache"), slots,
                           key_scale, value_scale, **{**kwargs, **one})
        for name, array in zip(names, written):
            if array is not None:
                copies[name][int(np.asarray(layer))] = array
    has_side = any(n.endswith("scale_cache") for n in copies)
    return tuple(copies.get(n) for n in names[:4 if has_side else 2])
