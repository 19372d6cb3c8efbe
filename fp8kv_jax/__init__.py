"""JAX frontend of fp8kv: exact FP8 paged KV-cache write and page dequantization.

Arrays on an NVIDIA GPU run the core's compiled Triton kernels, handed to XLA as its own Triton
call where the installed jaxlib and triton allow (``FP8KV_JAX_XLA_TRITON=0`` turns that off), else
through jax-triton (imported on first use); everywhere else (CPU, TPU) a pure-jnp path gives the
very same bytes (docs/SPEC.md). Under a trace (``jax.jit``, ``shard_map``) the path is that of
JAX's default device (``jax.default_device`` selects another). Caches sharded with a
``NamedSharding`` stay sharded under plain ``jax.jit``: every call has a partitioning rule
(docs/SPEC.md section 13).

Every function returns new arrays. To update a cache in place, donate it under ``jax.jit``:

>>> import functools, jax, jax.numpy as jnp, fp8kv_jax
>>> step = jax.jit(functools.partial(fp8kv_jax.write_kv, key_scale=0.5), donate_argnums=(2, 3))
>>> k_cache = jnp.zeros((4, 16, 1, 8), jnp.float8_e4m3fn)    # 4 pages of 16 slots, 1 head
>>> v_cache = jnp.zeros_like(k_cache)
>>> x = jnp.ones((2, 1, 8), jnp.bfloat16)                     # 2 tokens
>>> k_cache, v_cache = step(x, x, k_cache, v_cache, jnp.array([3, 40]))
>>> k_cache[2, 8, 0, :2].astype(jnp.float32).tolist()         # slot 40 = page 2, offset 8
[2.0, 2.0]

Stacked ``[num_layers, ...]`` caches and ``layer=`` (docs/SPEC.md section 12): a decode step over
the layers with ``lax.scan``, the stacks carried and updated in place:

>>> def layer_step(caches, xs):
...     layer, k, v = xs                                       # this layer's new K/V
...     return fp8kv_jax.write_kv(k, v, *caches, jnp.array([3, 40]), 0.5, 0.5, layer=layer), None
>>> decode = jax.jit(lambda caches, xs: jax.lax.scan(layer_step, caches, xs)[0],
...                  donate_argnums=(0,))
>>> stacks = tuple(jnp.zeros((3, 4, 16, 1, 8), jnp.float8_e4m3fn) for _ in "kv")  # 3 layers
>>> kv = jnp.arange(1, 4, dtype=jnp.bfloat16)[:, None, None, None] * jnp.ones((3, 2, 1, 8))
>>> k_stack, v_stack = decode(stacks, (jnp.arange(3), kv, kv))
>>> k_stack[:, 2, 8, 0, 0].astype(jnp.float32).tolist()             # each layer its own K
[2.0, 4.0, 6.0]
"""
from __future__ import annotations

from typing import Union

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from fp8kv.validate import (check_bool, check_dequantize, check_layer_in_range,
                            check_slots_in_range, check_table_in_range, check_write,
                            dequantized_shape, frontend_args)

from . import _args, _jnp, _shard, _triton
from ._args import as_array, as_scales, device_array
from ._xla_triton import XlaTritonWarning

__all__ = ["write_kv", "write_kv_combined", "dequantize_pages", "dequantize_pages_combined",
           "XlaTritonWarning"]

Scale = Union[float, jax.Array, None]
ScaleCache = Union[jax.Array, str, None]
Layer = Union[int, jax.Array, None]


_SIDE_ARRAYS = ("key_scale_cache", "value_scale_cache")


def _scales(key_scale, value_scale, key_scale_cache, value_scale_cache) -> dict:
    """The scale arguments by name, NumPy arrays made JAX arrays (the core checks the rest)."""
    return dict(zip(("key_scale", "value_scale") + _SIDE_ARRAYS,
                    as_scales(key_scale, value_scale, key_scale_cache, value_scale_cache)))


def _check_layer_bounds(layer, layers) -> None:
    """``check_bounds``' check of ``layer=`` (a device array is read on the host)."""
    if layers is not None:
        check_layer_in_range(_args.host_values(layer, "layer") if isinstance(layer, jax.Array)
                             else layer, layers.num_layers)


def _write(arrays: dict, scales: dict, layout, fp8_format, scale_rounding, check_bounds,
           layer=None):
    """The new caches (``arrays``' cache entries, in order), then the new side scale arrays
    (None for a side without one) if any is given."""
    check_bool(check_bounds, "check_bounds")
    arrays = {name: as_array(x, name) for name, x in arrays.items()}
    (layer,) = as_scales(layer)
    args = check_write(**frontend_args(_args.info, jax.Array, arrays, {**scales, "layer": layer}),
                       layout=layout, fp8_format=fp8_format, scale_rounding=scale_rounding)
    if check_bounds:
        _check_layer_bounds(layer, args.layers)
        check_slots_in_range(_args.host_values(arrays["slots"], "slots"),
                             args.key_cache.num_slots)
    caches = [name for name in arrays if name.endswith("cache")]
    sides = {name: device_array(scales[name]) for name in _SIDE_ARRAYS}
    given = {**arrays, **{name: device_array(s) for name, s in scales.items()},
             "layer": device_array(layer)}
    has_side = any(s is not None for s in sides.values())
    if args.num_tokens == 0:  # nothing to write: no launch
        updated = given
    else:
        impl = _triton if _args.use_triton([*arrays.values(), *sides.values()]) else _jnp
        written = caches + [n for n in _SIDE_ARRAYS if sides[n] is not None]
        options = dict(layout=layout, fp8_format=fp8_format, scale_rounding=scale_rounding,
                       layer=layer if given["layer"] is None else None,
                       **{n: s for n, s in scales.items() if given[n] is None})
        updated = _shard.run("write", impl, given, args, tuple(written), options)
    tail = [updated.get(name) for name in _SIDE_ARRAYS] if has_side else []
    return tuple(updated[name] for name in caches) + tuple(tail)


def write_kv(key: jax.Array, value: jax.Array, key_cache: jax.Array, value_cache: jax.Array,
             slots: jax.Array, key_scale: Scale = None, value_scale: Scale = None, *,
             layout: str = "NHD", fp8_format: str | None = None,
             key_scale_cache: ScaleCache = None, value_scale_cache: ScaleCache = None,
             scale_rounding: str = "exact", check_bounds: bool = False,
             layer: Layer = None) -> tuple:
    """Quantize ``key``/``value`` to FP8 and write them into a paged cache, in one launch.

    Parameters
    ----------
    key, value : jax.Array
        ``[num_tokens, num_kv_heads, head_dim]``, bfloat16 / float16 / float32.
    key_cache, value_cache : jax.Array
        ``float8_e4m3fn``, ``float8_e5m2`` or raw ``uint8``, same shape:

        * ``layout="NHD"``: ``[num_pages, page_size, num_kv_heads, head_dim]``
        * ``layout="HND"``: ``[num_pages, num_kv_heads, page_size, head_dim]``
        * either layout: ``[num_slots, num_kv_heads, head_dim]`` (page_size 1)
    slots : jax.Array
        ``[num_tokens]`` int32 (int64 with ``jax_enable_x64``), ``slot = page * page_size +
        offset``. Tokens with ``slot < 0`` (padding) or ``slot >= num_pages * page_size`` are
        not written.
    key_scale, value_scale : None, float or jax.Array
        Dequant scales: ``q = fp8(x / scale)``. An array is float32 of shape ``[]``, ``[1]`` (per
        tensor) or ``[num_kv_heads]`` (per head); it may be traced (no recompilation per value),
        whereas a Python float is compiled in.
    layout : {"NHD", "HND"}
    fp8_format : {None, "e4m3", "e5m2"}
        Format of a ``uint8`` cache (default ``"e4m3"``); must match a typed cache if given.
    key_scale_cache, value_scale_cache : None, jax.Array or "inline"
        Dynamic scales (K and V independent; that side's ``key_scale``/``value_scale`` must then
        be None): each written token gets its scale from its own values, ``s = max(amax / fmax,
        1e-6)`` (docs/SPEC.md, "Dynamic scales"), stored at its slot. A float32 array whose shape
        gives the granularity:

        * per token-head: ``[num_pages, page_size, num_kv_heads]`` (NHD),
          ``[num_pages, num_kv_heads, page_size]`` (HND), ``[num_slots, num_kv_heads]`` (rank 3);
        * per token: ``[num_pages, page_size]``, ``[num_slots]`` (rank 3).

        ``"inline"`` (both sides, per token-head): the caches' last dimension is ``head_dim + 4``
        or ``head_dim + 16``; each head row holds its codes, then the fp32 scale (little-endian),
        then zeros.
    scale_rounding : {"exact", "pow2"}
        ``"pow2"`` rounds each dynamic scale up to a power of two.
    check_bounds : bool
        Debugging aid (off by default): read ``slots`` on the host and raise ``ValueError`` if a
        slot is past the cache (instead of skipping it). Needs concrete arrays: refused
        (``TypeError``) under ``jax.jit``.
    layer : None, int or jax.Array
        Stacked caches (docs/SPEC.md section 12): given, every cache (and side scale array) has
        a leading layer axis, ``[num_layers, ...]`` with ``...`` as above, and the tokens go to
        layer ``layer``: an int, or an int32 array of shape ``[]`` that may be traced (e.g. the
        index of a ``lax.scan`` or ``fori_loop`` over layers: one compiled kernel serves every
        layer). Out of range (no wrap-around): nothing is written (``check_bounds=True``:
        ``ValueError``).

    Returns
    -------
    key_cache, value_cache : jax.Array
        The caches with the tokens written; every byte that no written slot names is unchanged.
        With ``layer``, the whole stacks (every other layer unchanged).
    key_scale_cache, value_scale_cache : jax.Array or None
        Only when a side scale array is given (for K or V): the arrays with the written tokens'
        scales (None for a side without a side array). Donate them like the caches.

    Note
    ----
    JAX arrays are immutable: the caches passed in are not modified. Under ``jax.jit`` with the
    caches donated (``donate_argnums``) the returned caches reuse their buffers and only the
    written rows are touched, so a step costs the same whatever the cache size; without donation
    XLA copies each cache first. Rounding is IEEE fp32 division, then round-to-nearest-even with
    saturation (NaN -> 0x7F), identical on every backend (docs/SPEC.md).

    Examples
    --------
    >>> import jax.numpy as jnp, fp8kv_jax
    >>> key = jnp.array([[[1.0, -2.0, 500.0, 0.3]]], dtype=jnp.bfloat16)   # 1 token, 1 head
    >>> k_cache = jnp.zeros((2, 4, 1, 4), dtype=jnp.float8_e4m3fn)         # 2 pages of 4
    >>> k_cache, v_cache = fp8kv_jax.write_kv(key, key, k_cache, jnp.zeros_like(k_cache),
    ...                                       jnp.array([5]), key_scale=0.5)
    >>> k_cache[1, 1, 0].astype(jnp.float32).tolist()
    [2.0, -4.0, 448.0, 0.625]
    """
    return _write(dict(key=key, value=value, key_cache=key_cache, value_cache=value_cache,
                       slots=slots),
                  _scales(key_scale, value_scale, key_scale_cache, value_scale_cache), layout,
                  fp8_format, scale_rounding, check_bounds, layer)


def write_kv_combined(key: jax.Array, value: jax.Array, kv_cache: jax.Array, slots: jax.Array,
                      key_scale: Scale = None, value_scale: Scale = None, *, layout: str = "NHD",
                      fp8_format: str | None = None, key_scale_cache: ScaleCache = None,
                      value_scale_cache: ScaleCache = None, scale_rounding: str = "exact",
                      check_bounds: bool = False, layer: Layer = None):
    """:func:`write_kv` into one combined cache (vLLM / FlashInfer style).

    Parameters
    ----------
    kv_cache : jax.Array
        ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (NHD),
        ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (HND) or
        ``[num_slots, 2, num_kv_heads, head_dim]``; index 0 of dim 1 is K, index 1 is V. With
        ``layer``: ``[num_layers, ...]`` of these.

    Other parameters are those of :func:`write_kv`; side scale arrays are shaped as for one
    half of ``kv_cache`` (separate K and V arrays).

    Returns
    -------
    kv_cache : jax.Array
        The cache with the tokens written; with a side scale array,
        ``(kv_cache, key_scale_cache, value_scale_cache)`` as in :func:`write_kv`.

    Note
    ----
    As in :func:`write_kv`: a new array, or the same buffer when ``kv_cache`` is donated under
    ``jax.jit``.

    Examples
    --------
    >>> import jax.numpy as jnp, fp8kv_jax
    >>> x = jnp.ones((1, 1, 4))
    >>> kv = jnp.zeros((2, 2, 4, 1, 4), jnp.uint8)
    >>> kv = fp8kv_jax.write_kv_combined(x, -x, kv, jnp.array([6]))
    >>> kv[1, :, 2, 0].tolist()
    [[56, 56, 56, 56], [184, 184, 184, 184]]
    """
    out = _write(dict(key=key, value=value, kv_cache=kv_cache, slots=slots),
                 _scales(key_scale, value_scale, key_scale_cache, value_scale_cache), layout,
                 fp8_format, scale_rounding, check_bounds, layer)
    return out[0] if len(out) == 1 else out


def _dequantize(arrays: dict, scales: dict, dtype, layout, fp8_format, null_page, head_dim,
                check_bounds, layer=None):
    """``(key_pages, value_pages, new_block_table)``, or ``(kv_pages, new_block_table)`` for a
    combined ``arrays["kv_cache"]``."""
    check_bool(check_bounds, "check_bounds")
    arrays = {name: as_array(x, name) for name, x in arrays.items()}
    (layer,) = as_scales(layer)
    args = check_dequantize(**frontend_args(_args.info, jax.Array, arrays,
                                            {**scales, "layer": layer}),
                            dtype=_args.dtype_name(dtype), layout=layout, fp8_format=fp8_format,
                            null_page=null_page, head_dim=head_dim)
    if check_bounds:
        _check_layer_bounds(layer, args.layers)
        check_table_in_range(_args.host_values(arrays["block_table"], "block_table"),
                             args.key_cache.num_pages, null_page)
    outputs = ("kv_out", "table_out") if args.combined else ("key_out", "value_out", "table_out")
    if args.batch * args.pages_per_seq == 0:  # no pages to read: no launch
        pages = jnp.zeros(dequantized_shape(args, args.combined), args.out_dtype)
        table = jnp.zeros((args.batch, args.pages_per_seq), jnp.int32)
        return (pages,) * (len(outputs) - 1) + (table,)
    given = {**arrays, **{name: device_array(s) for name, s in scales.items()},
             "layer": device_array(layer)}
    sides = [device_array(scales[name]) for name in _SIDE_ARRAYS]
    impl = _triton if _args.use_triton([*arrays.values(), *sides]) else _jnp
    options = dict(layout=layout, fp8_format=fp8_format, null_page=null_page, head_dim=head_dim,
                   layer=layer if given["layer"] is None else None,
                   **{n: s for n, s in scales.items() if given[n] is None})
    out = _shard.run("dequantize", impl, given, args, outputs, options)
    return tuple(out[name] for name in outputs)


def dequantize_pages(key_cache: jax.Array, value_cache: jax.Array, block_table: jax.Array,
                     key_scale: Scale = None, value_scale: Scale = None, *,
                     dtype: DTypeLike = jnp.bfloat16, layout: str = "NHD",
                     fp8_format: str | None = None, null_page: int | None = None,
                     key_scale_cache: ScaleCache = None, value_scale_cache: ScaleCache = None,
                     head_dim: int | None = None, check_bounds: bool = False,
                     layer: Layer = None) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Dequantize the pages a block table names into a compact paged cache + renumbered table.

    Parameters
    ----------
    key_cache, value_cache : jax.Array
        FP8 caches as in :func:`write_kv`, typed or ``uint8``:

        * ``layout="NHD"``: ``[num_pages, page_size, num_kv_heads, head_dim]``
        * ``layout="HND"``: ``[num_pages, num_kv_heads, page_size, head_dim]``
        * either layout: ``[num_slots, num_kv_heads, head_dim]``
    block_table : jax.Array
        ``[batch, pages_per_seq]`` int32 (int64 with ``jax_enable_x64``); may be traced (no
        recompilation per content). Entries ``< 0``, equal to ``null_page``, or ``>= num_pages``
        are padding.
    key_scale, value_scale : None, float or jax.Array
        As in :func:`write_kv`: ``out = round(fp32(decode(q)) * scale)``.
    dtype : jnp.bfloat16 (default), jnp.float16 or jnp.float32
    layout : {"NHD", "HND"}
    fp8_format : {None, "e4m3", "e5m2"}
    null_page : int, optional
        A page id that also means padding (vLLM's null block is 0).
    key_scale_cache, value_scale_cache : None, jax.Array or "inline"
        Dynamic scales as written by :func:`write_kv` (shapes there), read per slot instead of a
        static scale (that side's ``key_scale``/``value_scale`` must be None).
    head_dim : int, optional
        Required with ``"inline"`` (the caches' last dimension is ``head_dim + 4`` or
        ``head_dim + 16``); the pages then hold ``head_dim`` columns. Otherwise, if given, it must
        equal the caches' last dimension.
    check_bounds : bool
        Debugging aid (off by default): read ``block_table`` on the host and raise
        ``ValueError`` if an entry is past the cache (instead of giving a zero page). Needs
        concrete arrays: refused (``TypeError``) under ``jax.jit``.
    layer : None, int or jax.Array
        Stacked caches (docs/SPEC.md section 12), as in :func:`write_kv`: the pages are read from
        layer ``layer`` of ``[num_layers, ...]`` caches (and side scale arrays). Out of range:
        every page is zero (``check_bounds=True``: ``ValueError``).

    Returns
    -------
    key_pages, value_pages : jax.Array
        ``[batch * pages_per_seq, ...page]`` in the cache's layout (NHD
        ``[N, page_size, num_kv_heads, head_dim]``, HND ``[N, num_kv_heads, page_size, head_dim]``,
        or ``[N, num_kv_heads, head_dim]``), ``dtype``: output page ``i`` is cache page
        ``block_table.reshape(-1)[i]`` dequantized; padding entries give zero pages. NaN codes
        give the canonical quiet NaN of ``dtype``.
    new_block_table : jax.Array
        ``arange(batch * pages_per_seq).reshape(batch, pages_per_seq)``, int32.

    Note
    ----
    The caches are only read; the outputs are new arrays, every element of them written.

    Examples
    --------
    >>> import jax.numpy as jnp, fp8kv_jax
    >>> cache = jnp.full((3, 2, 1, 4), 0x38, dtype=jnp.uint8)   # every byte is 1.0 in e4m3
    >>> k, v, table = fp8kv_jax.dequantize_pages(cache, cache, jnp.array([[2, -1]]), key_scale=0.5)
    >>> k[:, 0, 0].tolist(), table.tolist()
    ([[0.5, 0.5, 0.5, 0.5], [0.0, 0.0, 0.0, 0.0]], [[0, 1]])
    """
    return _dequantize(dict(key_cache=key_cache, value_cache=value_cache, block_table=block_table),
                       _scales(key_scale, value_scale, key_scale_cache, value_scale_cache), dtype,
                       layout, fp8_format, null_page, head_dim, check_bounds, layer)


def dequantize_pages_combined(kv_cache: jax.Array, block_table: jax.Array, key_scale: Scale = None,
                              value_scale: Scale = None, *, dtype: DTypeLike = jnp.bfloat16,
                              layout: str = "NHD", fp8_format: str | None = None,
                              null_page: int | None = None, key_scale_cache: ScaleCache = None,
                              value_scale_cache: ScaleCache = None,
                              head_dim: int | None = None, check_bounds: bool = False,
                              layer: Layer = None) -> tuple[jax.Array, jax.Array]:
    """:func:`dequantize_pages` from and to combined ``[N, 2, ...]`` caches (FlashInfer TRT-LLM).

    Parameters
    ----------
    kv_cache : jax.Array
        ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (NHD),
        ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (HND) or
        ``[num_slots, 2, num_kv_heads, head_dim]``; K at index 0 of dim 1, V at index 1. With
        ``layer``: ``[num_layers, ...]`` of these.

    Other parameters are those of :func:`dequantize_pages` (side scale arrays shaped as for one
    half of ``kv_cache``).

    Returns
    -------
    kv_pages : jax.Array
        ``[N, 2, page_size, num_kv_heads, head_dim]`` (NHD), ``[N, 2, num_kv_heads, page_size,
        head_dim]`` (HND) or ``[N, 2, num_kv_heads, head_dim]``, ``dtype``, where
        ``N = batch * pages_per_seq``; K at index 0 of dim 1, V at index 1.
    new_block_table : jax.Array
        ``[batch, pages_per_seq]`` int32.

    Note
    ----
    The cache is only read; the outputs are new arrays.

    Examples
    --------
    >>> import jax.numpy as jnp, fp8kv_jax
    >>> kv = jnp.full((2, 2, 1, 1, 2), 0xB8, dtype=jnp.uint8)   # -1.0 in e4m3
    >>> pages, table = fp8kv_jax.dequantize_pages_combined(kv, jnp.array([[1]]))
    >>> pages.shape, pages[0, 1, 0, 0].tolist()
    ((1, 2, 1, 1, 2), [-1.0, -1.0])
    """
    return _dequantize(dict(kv_cache=kv_cache, block_table=block_table),
                       _scales(key_scale, value_scale, key_scale_cache, value_scale_cache), dtype,
                       layout, fp8_format, null_page, head_dim, check_bounds, layer)
