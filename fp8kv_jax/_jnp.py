"""The pure-jnp path (CPU, TPU, ...): :mod:`fp8kv.reference` written in jnp, byte for byte.

Each op is one jitted function, static in the validated arguments: an eager call compiles once per
shape, and under the caller's ``jax.jit`` it inlines, so that a donated cache is updated in place
(the scatter writes into its operand's buffer).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp8kv.formats import CANONICAL_NAN_BITS
from fp8kv.modes import ScaleMode

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


def _scale(array, mode: int, value: float, trailing: int):
    """The scale, shaped to broadcast against ``[..., num_kv_heads, *trailing dims]`` (or None)."""
    if mode == ScaleMode.NONE:
        return None
    if mode == ScaleMode.VALUE:
        return jnp.float32(value)
    if mode == ScaleMode.HEAD:
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


def _dequantize(codes, scale, fmt, out_dtype: str, keep):
    """``round(fp32(decode(codes)) * scale)``, canonical NaNs, zeros where ``keep`` is False."""
    v = lax.bitcast_convert_type(codes, jnp.dtype(fmt.dtype)).astype(jnp.float32)
    if scale is not None:
        v = v * scale
    uint = _UINT[jnp.dtype(out_dtype).itemsize]
    bits = lax.bitcast_convert_type(v.astype(out_dtype), uint)
    bits = jnp.where(jnp.isnan(v), uint(CANONICAL_NAN_BITS[out_dtype]), bits)
    # Padding entries are zero pages (not 0 * scale, which is NaN for an infinite scale).
    bits = jnp.where(keep, bits, uint(0))
    return lax.bitcast_convert_type(bits, jnp.dtype(out_dtype))


def _slot_index(slots, cache, layout: str, rank: int, combined: bool):
    """Index of each token's ``[(2,) num_kv_heads, head_dim]`` row for ``.at[]``."""
    keep = _in_range(slots, cache.num_pages * cache.page_size)
    # Padding must point past the last page, which mode="drop" skips (.at[-1] would wrap around).
    page = jnp.where(keep, slots // cache.page_size, cache.num_pages)
    offset = slots % cache.page_size
    index = (page,) + (slice(None),) * combined
    if rank == 3:
        return index
    return index + ((offset,) if layout == "NHD" else (slice(None), offset))


def _scatter(cache, index, codes):
    """Write fp8 codes as bytes: untouched bytes (NaN codes included) stay exactly as they are."""
    raw = lax.bitcast_convert_type(cache, jnp.uint8)
    return lax.bitcast_convert_type(raw.at[index].set(codes, mode="drop"), cache.dtype)


@functools.partial(jax.jit, static_argnames=("args",))
def write_kv(key, value, key_cache, value_cache, slots, key_scale, value_scale, *, args):
    """``(key_cache, value_cache)``, or the combined ``kv_cache`` when ``args.combined``
    (``value_cache`` is then None)."""
    combined = args.combined
    qk = _quantize(key, _scale(key_scale, args.key_scale_mode, args.key_scale_value, 1), args.fmt)
    qv = _quantize(value, _scale(value_scale, args.value_scale_mode, args.value_scale_value, 1),
                   args.fmt)
    index = _slot_index(slots, args.key_cache, args.layout, key_cache.ndim - combined, combined)
    if combined:
        return _scatter(key_cache, index, jnp.stack([qk, qv], axis=1))
    return _scatter(key_cache, index, qk), _scatter(value_cache, index, qv)


def _gather(cache, index, num_pages: int):
    """Pages ``index`` of ``cache`` as bytes; indices past the end give zero bytes."""
    raw = lax.bitcast_convert_type(cache, jnp.uint8)
    if num_pages == 0:  # XLA cannot gather from an empty axis; every entry is padding anyway
        return jnp.zeros(index.shape + raw.shape[1:], jnp.uint8)
    return raw.at[index].get(mode="fill", fill_value=0)


@functools.partial(jax.jit, static_argnames=("args", "combined"))
def dequantize_pages(key_cache, value_cache, block_table, key_scale, value_scale, *, args,
                     combined):
    """``(key_pages, value_pages, new_table)``, or ``(kv_pages, new_table)`` when ``combined``."""
    num_pages = args.key_cache.num_pages
    entries = block_table.reshape(-1)
    keep = _in_range(entries, num_pages)
    info = jnp.iinfo(entries.dtype)
    if args.null_page is not None and info.min <= args.null_page <= info.max:
        keep &= entries != args.null_page
    index = jnp.where(keep, entries, num_pages)
    keep = keep.reshape((-1,) + (1,) * (args.cache_rank - 1))
    trailing = 2 if args.layout == "HND" and args.cache_rank == 4 else 1  # dims after the heads
    ks = _scale(key_scale, args.key_scale_mode, args.key_scale_value, trailing)
    vs = _scale(value_scale, args.value_scale_mode, args.value_scale_value, trailing)
    if combined:
        pages = _gather(key_cache, index, num_pages)
        k_codes, v_codes = pages[:, 0], pages[:, 1]
    else:
        k_codes = _gather(key_cache, index, num_pages)
        v_codes = _gather(value_cache, index, num_pages)
    k = _dequantize(k_codes, ks, args.fmt, args.out_dtype, keep)
    v = _dequantize(v_codes, vs, args.fmt, args.out_dtype, keep)
    new_table = jnp.arange(entries.size, dtype=jnp.int32).reshape(block_table.shape)
    if combined:
        return jnp.stack([k, v], axis=1), new_table
    return k, v, new_table
