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

from fp8kv.formats import CANONICAL_NAN_BITS, DYNAMIC_SCALE_FLOOR
from fp8kv.modes import ScaleKind, SideScale

_UINT = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}


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


def _scatter(cache, index, codes):
    """Write fp8 codes as bytes: untouched bytes (NaN codes included) stay exactly as they are."""
    raw = lax.bitcast_convert_type(cache, jnp.uint8)
    return lax.bitcast_convert_type(raw.at[index].set(codes, mode="drop"), cache.dtype)


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


def _quantize_side(x, array, scale: SideScale, args):
    """``(codes [T, H, D or D + pad], dynamic scales or None)`` of one side."""
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
            # A side array is indexed as its cache without head_dim; a per-token one ([P, S] in
            # either layout) as an NHD cache without heads.
            layout = args.layout if scale.dynamic is ScaleKind.TOKEN_HEAD else "NHD"
            sc = arrays[f"{side}_scale_cache"]
            out[f"{side}_scale_cache"] = sc.at[_layered(layer, _slot_index(
                slots, args.key_cache, layout, rank, False))].set(s, mode="drop")
    return out


def _gather(cache, index, num_pages: int, layer=None):
    """Pages ``index`` of ``cache`` (of its layer ``layer`` if stacked) as bytes; indices past the
    end give zero bytes."""
    raw = lax.bitcast_convert_type(cache, jnp.uint8)
    stacked = layer is not None
    if num_pages == 0 or (stacked and raw.shape[0] == 0):
        # XLA cannot gather from an empty axis; every entry is padding anyway
        return jnp.zeros(index.shape + raw.shape[1 + stacked:], jnp.uint8)
    return raw.at[_layered(layer, (index,))].get(mode="fill", fill_value=0)


def _stored_scales(scale_cache, codes, index, num_pages, kind, args, layer=None):
    """``(codes [N, ..., D], scales broadcasting against them)`` for a dynamic side."""
    if args.inline_pad:
        d = args.key_cache.head_dim
        s = lax.bitcast_convert_type(codes[..., d:d + 4], jnp.float32)
        return codes[..., :d], s[..., None]
    if num_pages == 0 or (layer is not None and scale_cache.shape[0] == 0):
        s = jnp.ones(index.shape + scale_cache.shape[1 + (layer is not None):], jnp.float32)
    else:
        s = scale_cache.at[_layered(layer, (index,))].get(mode="fill", fill_value=1.0)
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
    trailing = 2 if args.layout == "HND" and args.cache_rank == 4 else 1  # dims after the heads
    if args.combined:
        pages = _gather(arrays["kv_cache"], index, num_pages, layer)
        codes = pages[:, 0], pages[:, 1]
    else:
        codes = (_gather(arrays["key_cache"], index, num_pages, layer),
                 _gather(arrays["value_cache"], index, num_pages, layer))
    sides = []
    for c, side, scale in ((codes[0], "key", args.key_scale), (codes[1], "value", args.value_scale)):
        s = _scale(arrays[f"{side}_scale"], scale, trailing)
        if scale.is_dynamic:
            c, s = _stored_scales(arrays[f"{side}_scale_cache"], c, index, num_pages,
                                  scale.dynamic, args, layer)
        sides.append(_dequantize(c, s, args.fmt, args.out_dtype, keep))
    k, v = sides
    new_table = jnp.arange(entries.size, dtype=jnp.int32).reshape(block_table.shape)
    if args.combined:
        return {"kv_out": jnp.stack([k, v], axis=1), "table_out": new_table}
    return {"key_out": k, "value_out": v, "table_out": new_table}
