"""NumPy reference: docs/SPEC.md as code, the golden of every test.

Everything here is plain NumPy + ml_dtypes, written for clarity, not speed. Arrays are NumPy arrays
(bf16 / fp8 as ``ml_dtypes`` dtypes); caches may be typed fp8 or raw ``uint8``.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np

from .formats import CANONICAL_NAN_BITS, FORMAT_OF_DTYPE, FORMATS, Fp8Format

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


def resolve_format(cache_dtype: str, fp8_format: str | None) -> Fp8Format:
    """The format of a cache: its own dtype's, or ``fp8_format`` (default e4m3) for uint8."""
    if cache_dtype in FORMAT_OF_DTYPE:
        return FORMAT_OF_DTYPE[cache_dtype]
    return FORMATS[fp8_format or "e4m3"]


def quantize(x: np.ndarray, scale, fmt: Fp8Format) -> np.ndarray:
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


def dequantize(q: np.ndarray, scale, fmt: Fp8Format, out_dtype: str) -> np.ndarray:
    """``round_to(out_dtype)(float32(decode(q)) * scale)``; NaN codes give the canonical NaN."""
    f = np.asarray(q).view(np.uint8).view(np_dtype(fmt.dtype)).astype(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        v = (f * np.asarray(scale, dtype=np.float32)).astype(np.float32)
        out = v.astype(np_dtype(out_dtype))
    bits = out.view(_UINT_OF_SIZE[out.itemsize])
    bits = np.where(np.isnan(v), bits.dtype.type(CANONICAL_NAN_BITS[out_dtype]), bits)
    return bits.astype(bits.dtype).view(np_dtype(out_dtype))


def _scale_array(scale, num_heads: int) -> np.ndarray:
    """A scale as a ``[H, 1]`` fp32 array (None -> 1, float, ``[]``, ``[1]`` or ``[H]``)."""
    s = np.float32(1.0) if scale is None else np.asarray(scale, dtype=np.float32)
    return np.broadcast_to(s.reshape(-1), (num_heads,)).reshape(num_heads, 1)


def _pages_view(cache: np.ndarray, layout: str) -> np.ndarray:
    """Any supported cache as ``[num_pages, page_size, H, D]`` (a view)."""
    if cache.ndim == 3:  # [num_slots, H, D]: NHD with page_size 1
        return cache[:, None]
    return cache if layout == "NHD" else cache.transpose(0, 2, 1, 3)


def write_kv(key, value, key_cache, value_cache, slots, key_scale=None, value_scale=None, *,
             layout="NHD", fp8_format=None):
    """Reference ``write_kv``: returns new copies of ``(key_cache, value_cache)``."""
    out = []
    slots = np.asarray(slots).astype(np.int64)
    for x, cache, scale in ((key, key_cache, key_scale), (value, value_cache, value_scale)):
        cache = np.array(cache, copy=True)
        fmt = resolve_format(cache.dtype.name, fp8_format)
        pages = _pages_view(cache.view(np.uint8), layout)
        page_size = pages.shape[1]
        q = quantize(np.asarray(x), _scale_array(scale, x.shape[1]), fmt)
        for t, slot in enumerate(slots):
            if 0 <= slot < pages.shape[0] * page_size:
                pages[slot // page_size, slot % page_size] = q[t]
        out.append(cache)
    return tuple(out)


def dequantize_pages(key_cache, value_cache, block_table, key_scale=None, value_scale=None, *,
                     dtype="bfloat16", layout="NHD", fp8_format=None, null_page=None):
    """Reference ``dequantize_pages``: ``(key_pages, value_pages, new_block_table)``."""
    table = np.asarray(block_table).astype(np.int64)
    batch, pages_per_seq = table.shape
    results = []
    for cache, scale in ((key_cache, key_scale), (value_cache, value_scale)):
        cache = np.asarray(cache)
        fmt = resolve_format(cache.dtype.name, fp8_format)
        pages = _pages_view(cache.view(np.uint8), layout)
        num_pages, page_size, num_heads, head_dim = pages.shape
        out = np.zeros((batch * pages_per_seq, page_size, num_heads, head_dim), np_dtype(dtype))
        s = _scale_array(scale, num_heads)
        for i, page in enumerate(table.reshape(-1)):
            padding = page < 0 or page >= num_pages or (null_page is not None and page == null_page)
            if not padding:
                out[i] = dequantize(pages[page], s, fmt, dtype)
        if cache.ndim == 3:
            out = out[:, 0]
        elif layout == "HND":
            out = np.ascontiguousarray(out.transpose(0, 2, 1, 3))
        results.append(out)
    new_table = np.arange(batch * pages_per_seq, dtype=np.int32).reshape(batch, pages_per_seq)
    return results[0], results[1], new_table
