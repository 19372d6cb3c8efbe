"""JAX frontend of fp8kv: exact FP8 paged KV-cache write (with fused RoPE), page
dequantization, and paged decode attention over every cache format.

Arrays on an NVIDIA GPU run the core's compiled Triton kernels, handed to XLA as its own Triton
call where the installed jaxlib and triton allow (``FP8KV_JAX_XLA_TRITON=0`` turns that off), else
through jax-triton (imported on first use); everywhere else (CPU, TPU) a pure-jnp path gives the
very same bytes (docs/SPEC.md). Under a trace (``jax.jit``, ``shard_map``) the path is that of
JAX's default device (``jax.default_device`` selects another). Caches sharded with a
``NamedSharding`` stay sharded under plain ``jax.jit``: every call has a partitioning rule
(docs/SPEC.md section 15).

Every function returns new arrays. To update a cache in place, donate it under ``jax.jit``:

>>> import functools, jax, jax.numpy as jnp, fp8kv_jax
>>> step = jax.jit(functools.partial(fp8kv_jax.write_kv, key_scale=0.5), donate_argnums=(2, 3))
>>> k_cache = jnp.zeros((4, 16, 1, 8), jnp.float8_e4m3fn)    # 4 pages of 16 slots, 1 head
>>> v_cache = jnp.zeros_like(k_cache)
>>> x = jnp.ones((2, 1, 8), jnp.bfloat16)                     # 2 tokens
>>> k_cache, v_cache = step(x, x, k_cache, v_cache, jnp.array([3, 40]))
>>> k_cache[2, 8, 0, :2].astype(jnp.float32).tolist()         # slot 40 = page 2, offset 8
[2.0, 2.0]

Stacked ``[num_layers, ...]`` caches and ``layer=`` (docs/SPEC.md section 14): a decode step over
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

try:
    import jax
except ImportError as e:   # JAX is the extra "jax" of fp8kv, not a dependency: say so
    # (ModuleNotFoundError: what pytest.importorskip and tools expect of a missing module)
    raise ModuleNotFoundError(f"fp8kv_jax needs JAX, which cannot be imported ({e}): "
                              'pip install "fp8kv[jax]" (or "fp8kv[jax-gpu]" for NVIDIA GPUs)',
                              name="jax") from e
import jax.numpy as jnp
from jax.typing import DTypeLike

from fp8kv.optable import JAX, OPS, Role
from fp8kv.spelling import check_flag, output_dtype_name
from fp8kv.validate import frontend_args

from . import _args, _jnp, _shard, _triton
from ._args import as_array
from ._xla_triton import XlaTritonWarning

__all__ = ["write_kv", "write_kv_combined", "dequantize_pages", "dequantize_pages_combined",
           "rope_write_kv", "rope_write_kv_combined", "XlaTritonWarning",
           "paged_attention", "paged_attention_combined"]

Scale = Union[float, jax.Array, None]
ScaleCache = Union[jax.Array, str, None]
Layer = Union[int, jax.Array, None]


def _call(op: str, named: dict):
    """One call of a public function (``named``: its arguments by name), as the op table
    (:mod:`fp8kv.optable`) declares it: validated by the core, run on the Triton kernels or the
    jnp path, through the partitioning rule where the arrays may be sharded (:mod:`._shard`);
    its results as the function returns them."""
    entry = OPS[op]
    for name in _FLAGS:
        if name in named:
            check_flag(named[name], name)
    arrays = {name: as_array(named[name], name) for name in entry.required(JAX)}
    optional = {name: _args.as_scale(named[name]) for name in entry.optional(JAX)}
    for name, x in optional.items():
        if x is not None and entry.arg(name).role is Role.OUTPUT:
            optional[name] = as_array(x, name)
    options = {name: named[name] for name in entry.options(JAX)}
    if "dtype" in options:
        options["dtype"] = output_dtype_name(options["dtype"], _args.jax_name)
    args = entry.check(**frontend_args(_args.info, jax.Array, arrays, optional), **options)
    values = {**arrays, **optional}
    if named["check_bounds"]:
        entry.bounds(args, lambda name: _args.host_values(values[name], name)
                     if isinstance(values[name], jax.Array) else values[name])
    # What the kernel reads or writes: None for a host float (a plan scalar), no scale, "inline"
    given = {**arrays, **{n: x if isinstance(x, jax.Array) else None for n, x in optional.items()}}
    made = entry.made(args)
    outputs = tuple(n for n in entry.returns
                    if n in made or (entry.arg(n).updated and given[n] is not None))
    if entry.empty(args):  # nothing to compute: no launch
        updated = {**given, **{n: jnp.zeros(shape, dtype) for n, (shape, dtype) in made.items()
                               if given.get(n) is None}}
    else:
        written = [given[n] for n in entry.optional(JAX)
                   if entry.arg(n).role in (Role.SIDE, Role.OUTPUT)]
        impl = _triton if _args.use_triton([*arrays.values(), *written]) else _jnp
        host = {name: x for name, x in optional.items() if given[name] is None}
        updated = _shard.run(op, impl, given, args, outputs, {**options, **host})
    sides = [n for n in entry.returns if entry.arg(n).role is Role.SIDE]
    with_sides = any(given[n] is not None for n in sides)
    results = [updated.get(n) for n in entry.returns
               if n in outputs or (n in sides and with_sides)]
    return results[0] if len(results) == 1 else tuple(results)


_FLAGS = ("check_bounds", "return_key")   # checked first, in this order


def write_kv(key: jax.Array, value: jax.Array, key_cache: jax.Array, value_cache: jax.Array,
             slots: jax.Array, key_scale: Scale = None, value_scale: Scale = None, *,
             layout: str = "NHD", fp8_format: str | None = None,
             key_scale_cache: ScaleCache = None, value_scale_cache: ScaleCache = None,
             scale_rounding: str = "exact", check_bounds: bool = False,
             cache_format: str | None = None, layer: Layer = None) -> tuple:
    """Quantize ``key``/``value`` to FP8 (or NVFP4) and write them into a paged cache, in one
    launch.

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
    cache_format : {None, "e4m3", "e5m2", "nvfp4", "mxfp8"}
        The cache's format (pass it or ``fp8_format``, not both). ``"nvfp4"`` (docs/SPEC.md
        section 13): ``uint8`` caches of ``head_dim / 2`` bytes per head row (NHD
        ``[num_pages, page_size, H, D/2]``, HND ``[num_pages, H, page_size, D/2]``,
        ``[num_slots, H, D/2]``; ``head_dim`` a multiple of 16), two E2M1 codes per byte;
        ``key_scale_cache``/``value_scale_cache`` (required) hold the e4m3 block scales,
        ``float8_e4m3fn`` or ``uint8`` arrays of the caches' shape with last dim ``D/16``;
        ``key_scale``/``value_scale`` are the global scales. ``"mxfp8"`` (section 13a): e4m3
        codes, ``float8_e4m3fn`` or ``uint8`` caches (``head_dim`` a multiple of 32);
        ``key_scale_cache``/``value_scale_cache`` (required) hold one E8M0 power-of-two scale
        per 32 elements, ``uint8`` arrays of the caches' shape with last dim ``D/32``; no
        ``key_scale``/``value_scale``.
    layer : None, int or jax.Array
        Stacked caches (docs/SPEC.md section 14): given, every cache (and side scale array) has
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
        Only when a side scale array is given (for K or V; always for nvfp4 and mxfp8: the
        block scales): the arrays with the written tokens' scales (None for a side without a
        side array). Donate them like the caches.

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

    NVFP4: 16 elements, one block; its amax 6 gives the block scale 1.0 (6 / 6).

    >>> x = jnp.linspace(-6, 6, 16).reshape(1, 1, 16)                   # head_dim 16
    >>> codes = jnp.zeros((2, 4, 1, 8), jnp.uint8)                      # head_dim / 2 bytes
    >>> blocks = jnp.zeros((2, 4, 1, 1), jnp.float8_e4m3fn)             # head_dim / 16 scales
    >>> kc, vc, kb, vb = fp8kv_jax.write_kv(x, x, codes, codes, jnp.array([5]),
    ...                                     key_scale_cache=blocks, value_scale_cache=blocks,
    ...                                     cache_format="nvfp4")
    >>> kb[1, 1, 0].astype(jnp.float32).tolist(), [hex(b) for b in kc[1, 1, 0, :3].tolist()]
    ([1.0], ['0xff', '0xee', '0xcd'])
    >>> k, v, table = fp8kv_jax.dequantize_pages(kc, vc, jnp.array([[1]]), key_scale_cache=kb,
    ...                                          value_scale_cache=vb, cache_format="nvfp4",
    ...                                          dtype=jnp.float32)
    >>> k[0, 1, 0, :8].tolist()
    [-6.0, -6.0, -4.0, -4.0, -3.0, -2.0, -1.0, -0.5]
    """
    return _call("write_kv", locals())


def write_kv_combined(key: jax.Array, value: jax.Array, kv_cache: jax.Array, slots: jax.Array,
                      key_scale: Scale = None, value_scale: Scale = None, *, layout: str = "NHD",
                      fp8_format: str | None = None, key_scale_cache: ScaleCache = None,
                      value_scale_cache: ScaleCache = None, scale_rounding: str = "exact",
                      check_bounds: bool = False, cache_format: str | None = None,
                      layer: Layer = None):
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
    return _call("write_kv_combined", locals())


def dequantize_pages(key_cache: jax.Array, value_cache: jax.Array, block_table: jax.Array,
                     key_scale: Scale = None, value_scale: Scale = None, *,
                     dtype: DTypeLike = jnp.bfloat16, layout: str = "NHD",
                     fp8_format: str | None = None, null_page: int | None = None,
                     key_scale_cache: ScaleCache = None, value_scale_cache: ScaleCache = None,
                     head_dim: int | None = None, check_bounds: bool = False,
                     cache_format: str | None = None, out_scale: Scale = None,
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
        Or the same as a NumPy dtype or by name (``"bfloat16"``, ``"float16"``, ``"float32"``,
        as ``fp8kv_torch`` takes them).
        For an nvfp4 cache also ``jnp.float8_e4m3fn``: an FP8 workspace, with ``out_scale``.
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
    cache_format : {None, "e4m3", "e5m2", "nvfp4", "mxfp8"}
        As in :func:`write_kv`. ``"nvfp4"``: block scales in ``key_scale_cache`` /
        ``value_scale_cache``, global scales in ``key_scale`` / ``value_scale``; the pages hold
        ``head_dim = 2 x`` the caches' last dimension elements per head row. ``"mxfp8"``: the
        E8M0 block scales in ``key_scale_cache`` / ``value_scale_cache``, no static scales.
    out_scale : None, float or jax.Array
        With ``dtype=jnp.float8_e4m3fn``: the FP8 output's dequant scale, ``out =
        e4m3(value / out_scale)`` (a float32 ``[]``/``[1]`` array may be traced).
    layer : None, int or jax.Array
        Stacked caches (docs/SPEC.md section 14), as in :func:`write_kv`: the pages are read from
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
    return _call("dequantize_pages", locals())


def dequantize_pages_combined(kv_cache: jax.Array, block_table: jax.Array, key_scale: Scale = None,
                              value_scale: Scale = None, *, dtype: DTypeLike = jnp.bfloat16,
                              layout: str = "NHD", fp8_format: str | None = None,
                              null_page: int | None = None, key_scale_cache: ScaleCache = None,
                              value_scale_cache: ScaleCache = None,
                              head_dim: int | None = None, check_bounds: bool = False,
                              cache_format: str | None = None, out_scale: Scale = None,
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
    return _call("dequantize_pages_combined", locals())


def rope_write_kv(query: jax.Array, key: jax.Array, value: jax.Array, key_cache: jax.Array,
                  value_cache: jax.Array, slots: jax.Array, positions: jax.Array,
                  cos_sin_cache: jax.Array, key_scale: Scale = None, value_scale: Scale = None, *,
                  query_scale: Scale = None, rope_style: str = "neox",
                  rotary_dim: int | None = None, layout: str = "NHD", fp8_format: str | None = None,
                  query_out: jax.Array | None = None, return_key: bool = False,
                  key_scale_cache: ScaleCache = None, value_scale_cache: ScaleCache = None,
                  scale_rounding: str = "exact", check_bounds: bool = False) -> tuple:
    """Apply RoPE to ``query`` and ``key``, then quantize K and V to FP8 and write them into a
    paged cache, in one launch (docs/SPEC.md, section 12).

    The result is exactly :func:`write_kv` of the rotated key (fp32), the rotation being
    ``y_a = RN(RN(x_a c) - RN(x_b s))``, ``y_b = RN(RN(x_b c) + RN(x_a s))`` in fp32 (no FMA).

    Parameters
    ----------
    query : jax.Array
        ``[num_tokens, num_heads, head_dim]``, the dtype of ``key``; ``num_heads`` a multiple of
        ``num_kv_heads``.
    key, value : jax.Array
        ``[num_tokens, num_kv_heads, head_dim]``, bfloat16 / float16 / float32.
    key_cache, value_cache : jax.Array
        As in :func:`write_kv`: NHD ``[num_pages, page_size, num_kv_heads, head_dim]``, HND
        ``[num_pages, num_kv_heads, page_size, head_dim]`` or ``[num_slots, num_kv_heads,
        head_dim]``; ``float8_e4m3fn``, ``float8_e5m2`` or ``uint8``.
    slots : jax.Array
        ``[num_tokens]`` int32 (int64 with ``jax_enable_x64``), as in :func:`write_kv`
        (``< 0``: padding, no K/V write; the query row is still rotated).
    positions : jax.Array
        ``[num_tokens]`` int32 (int64 with ``jax_enable_x64``), each token's row of
        ``cos_sin_cache``; may be traced. A position outside ``[0, max_position)`` gives an
        all-zero query (and key) row and writes no K/V.
    cos_sin_cache : jax.Array
        ``[max_position, rotary_dim]`` float32 / bfloat16 / float16: cos in the first
        ``rotary_dim / 2`` columns, sin in the rest (vLLM / FlashInfer convention).
    key_scale, value_scale : None, float or jax.Array
        Dequant scales of the cache, as in :func:`write_kv`.
    rope_style : {"neox", "gptj"}
        Pairs ``(i, i + rotary_dim / 2)`` (NeoX, Llama) or ``(2i, 2i + 1)`` (GPT-J).
    rotary_dim : int, optional
        The rotated columns (default: the width of ``cos_sin_cache``, which it must equal); even,
        at most ``head_dim``. Columns from ``rotary_dim`` on pass through.
    query_scale : None, float or jax.Array
        None: the rotated query in ``query``'s dtype. A float or a float32 array ``[]`` / ``[1]``
        (may be traced): FP8 codes ``RNE_sat(y / query_scale)`` (for FP8 attention).
    query_out : jax.Array, optional
        An array whose shape and dtype the rotated query takes (``query``'s dtype, or with
        ``query_scale`` ``float8_e4m3fn``, ``float8_e5m2`` or ``uint8`` for e4m3 codes); its
        contents are not read. On an NVIDIA GPU it is the kernel's output buffer (donated under
        ``jax.jit``, it receives the result in place); the jnp path makes a new array.
    return_key : bool
        Also return the rotated key, in ``key``'s dtype.
    layout, fp8_format, key_scale_cache, value_scale_cache, scale_rounding
        As in :func:`write_kv` (dynamic scales take the amax of the rotated key rows).
    check_bounds : bool
        Debugging aid (off by default): read ``positions`` and ``slots`` on the host and raise
        ``ValueError`` for a position outside the cos/sin cache or a slot past the cache. Needs
        concrete arrays: refused (``TypeError``) under ``jax.jit``.

    Returns
    -------
    query_out : jax.Array
        The rotated query ``[num_tokens, num_heads, head_dim]``.
    key_cache, value_cache : jax.Array
        The caches with the tokens written; every byte that no written slot names is unchanged.
    key_scale_cache, value_scale_cache : jax.Array or None
        Only when a side scale array is given, as in :func:`write_kv`.
    key_out : jax.Array
        Only with ``return_key``: the rotated key ``[num_tokens, num_kv_heads, head_dim]``.

    Note
    ----
    JAX arrays are immutable: nothing passed in is modified. Under ``jax.jit`` with the caches
    (and ``query_out``) donated, the results reuse their buffers and only the written rows of the
    caches are touched.

    Examples
    --------
    >>> import jax.numpy as jnp, fp8kv_jax
    >>> qkv = jnp.array([[1.0, 2.0, 3.0, 4.0, 8.0, -8.0]], jnp.bfloat16)  # Hq=Hkv=1, D=2
    >>> q, k, v = (qkv[:, i:i + 2].reshape(1, 1, 2) for i in (0, 2, 4))
    >>> cos_sin = jnp.array([[1.0, 0.0], [0.0, 1.0]])                     # positions 0 and 1
    >>> k_cache = jnp.zeros((2, 4, 1, 2), jnp.float8_e4m3fn)
    >>> q_rot, k_cache, v_cache = fp8kv_jax.rope_write_kv(
    ...     q, k, v, k_cache, jnp.zeros_like(k_cache), jnp.array([5]), jnp.array([1]), cos_sin,
    ...     key_scale=0.5)
    >>> q_rot.astype(jnp.float32).tolist(), k_cache[1, 1, 0].astype(jnp.float32).tolist()
    ([[[-2.0, 1.0]]], [-8.0, 6.0])
    """
    return _call("rope_write_kv", locals())


def rope_write_kv_combined(query: jax.Array, key: jax.Array, value: jax.Array,
                           kv_cache: jax.Array, slots: jax.Array, positions: jax.Array,
                           cos_sin_cache: jax.Array, key_scale: Scale = None,
                           value_scale: Scale = None, *, query_scale: Scale = None,
                           rope_style: str = "neox", rotary_dim: int | None = None,
                           layout: str = "NHD", fp8_format: str | None = None,
                           query_out: jax.Array | None = None, return_key: bool = False,
                           key_scale_cache: ScaleCache = None,
                           value_scale_cache: ScaleCache = None, scale_rounding: str = "exact",
                           check_bounds: bool = False) -> tuple:
    """:func:`rope_write_kv` into one combined cache (vLLM / FlashInfer style).

    Parameters
    ----------
    kv_cache : jax.Array
        ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (NHD),
        ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (HND) or
        ``[num_slots, 2, num_kv_heads, head_dim]``; index 0 of dim 1 is K, index 1 is V.

    Other parameters are those of :func:`rope_write_kv`.

    Returns
    -------
    tuple
        ``(query_out, kv_cache)``, then ``(key_scale_cache, value_scale_cache)`` when a side
        scale array is given, then ``key_out`` with ``return_key``.

    Note
    ----
    As in :func:`rope_write_kv`: new arrays, or the same buffers when donated under ``jax.jit``.

    Examples
    --------
    >>> import jax.numpy as jnp, fp8kv_jax
    >>> x = jnp.array([[[1.0, 2.0]]])                         # 1 token, 1 head, head_dim 2
    >>> q, kv = fp8kv_jax.rope_write_kv_combined(x, x, x, jnp.zeros((2, 2, 4, 1, 2), jnp.uint8),
    ...                                          jnp.array([6]), jnp.array([0]),
    ...                                          jnp.array([[0.0, 1.0]]))
    >>> q.tolist(), kv[1, :, 2, 0].tolist()                   # cos 0, sin 1: (-x2, x1)
    ([[[-2.0, 1.0]]], [[192, 56], [56, 64]])
    """
    return _call("rope_write_kv_combined", locals())


def paged_attention(query: jax.Array, key_cache: jax.Array, value_cache: jax.Array,
                    block_table: jax.Array, seq_lens: jax.Array, key_scale: Scale = None,
                    value_scale: Scale = None, *, query_start_loc: jax.Array | None = None,
                    softmax_scale: float | None = None, sliding_window: int | None = None,
                    logits_soft_cap: float | None = None, sinks: jax.Array | None = None,
                    key_scale_cache: ScaleCache = None, value_scale_cache: ScaleCache = None,
                    cache_format: str | None = None, layout: str = "NHD",
                    head_dim: int | None = None, layer: Layer = None,
                    max_query_len: int | None = None, check_bounds: bool = False) -> jax.Array:
    """Attention of new query tokens over a paged KV cache, read as :func:`write_kv` wrote it
    (docs/SPEC.md section 16): FP8, NVFP4 or bf16 / fp16 pages, no dequantized copy.

    Parameters
    ----------
    query : jax.Array
        ``[num_tokens, num_heads, head_dim]``, bfloat16 or float16. Query head ``j`` attends
        with kv head ``j // (num_heads // num_kv_heads)``.
    key_cache, value_cache : jax.Array
        The caches of :func:`write_kv` (any format, layout and rank; ``layer=``: stacked
        ``[num_layers, ...]``), or unquantized bfloat16 / float16 caches of the query's dtype:

        * ``layout="NHD"``: ``[num_pages, page_size, num_kv_heads, head_dim]``
        * ``layout="HND"``: ``[num_pages, num_kv_heads, page_size, head_dim]``
        * either layout: ``[num_slots, num_kv_heads, head_dim]`` (page_size 1)

        (nvfp4: ``head_dim / 2`` bytes; inline scales: ``head_dim + 4`` / ``+ 16`` bytes.)
    block_table : jax.Array
        ``[num_seqs, max_pages]`` int32; may be traced.
    seq_lens : jax.Array
        ``[num_seqs]`` int32, the tokens in the cache (the query tokens included); may be traced.
    key_scale, value_scale : None, float or jax.Array
        The static scales the cache was written with (float32 ``[]``, ``[1]`` or
        ``[num_kv_heads]``); nvfp4: the global scales. None with dynamic scales.
    query_start_loc : jax.Array, optional
        ``[num_seqs + 1]`` int32: sequence ``b``'s query tokens are rows
        ``query_start_loc[b] .. query_start_loc[b + 1] - 1`` (up to 16), at its last positions,
        causal among themselves. None: one token per sequence.
    softmax_scale : float, optional
        Default ``1 / sqrt(head_dim)``.
    sliding_window : int, optional
        A token at position ``p`` sees positions ``p - sliding_window + 1 .. p``.
    logits_soft_cap : float, optional
        Scores become ``cap * tanh(score / cap)``.
    sinks : jax.Array, optional
        ``[num_heads]`` float32: a logit per query head added to the softmax's denominator.
    key_scale_cache, value_scale_cache : None, jax.Array or "inline"
        Dynamic scales as :func:`write_kv` stored them; nvfp4, mxfp8: the block scales.
    cache_format : {None, "e4m3", "e5m2", "nvfp4", "mxfp8"}
        The format of a uint8 cache (None: the cache's dtype, or e4m3).
    layout : {"NHD", "HND"}
    head_dim : int, optional
        The data columns of an inline-scale cache (default: the query's).
    layer : None, int or jax.Array
        Stacked caches: the layer read (an int32 array may be traced, e.g. a ``lax.scan``
        index). Out of range: zeros.
    max_query_len : int, optional
        The longest query of the call (1..16; default ``min(16, num_tokens)`` with
        ``query_start_loc``): it sizes the launch.
    check_bounds : bool
        Read ``seq_lens`` (and ``query_start_loc``, ``layer``) on the host and raise for a
        sequence past its block-table row or a query longer than allowed; concrete arrays only.

    Returns
    -------
    jax.Array
        ``[num_tokens, num_heads, head_dim]`` in the query's dtype: within docs/SPEC.md
        section 16.3's bound of fp64 attention over the cache's values; on NVIDIA GPUs the
        bytes of ``fp8kv_torch.paged_attention`` (the same kernels and plan).

    Note
    ----
    The caches are read where they are (under ``jax.jit`` no copy is made); caches sharded over
    kv heads with a ``NamedSharding`` stay sharded (queries and output over query heads).

    Examples
    --------
    >>> import jax.numpy as jnp, fp8kv_jax
    >>> x = jnp.arange(1.0, 6.0)[:, None, None] * jnp.ones((5, 1, 16))  # 5 tokens' K = V
    >>> k, v = fp8kv_jax.write_kv(x, x, jnp.zeros((2, 4, 1, 16), jnp.float8_e4m3fn),
    ...                           jnp.zeros((2, 4, 1, 16), jnp.float8_e4m3fn), jnp.arange(5))
    >>> out = fp8kv_jax.paged_attention(jnp.zeros((1, 2, 16), jnp.bfloat16), k, v,
    ...                                 jnp.array([[0, 1]], jnp.int32), jnp.array([5], jnp.int32))
    >>> out[0, :, 0].tolist()                                            # the mean of 1..5
    [3.0, 3.0]
    """
    return _call("paged_attention", locals())


def paged_attention_combined(query: jax.Array, kv_cache: jax.Array, block_table: jax.Array,
                             seq_lens: jax.Array, key_scale: Scale = None,
                             value_scale: Scale = None, *,
                             query_start_loc: jax.Array | None = None,
                             softmax_scale: float | None = None,
                             sliding_window: int | None = None,
                             logits_soft_cap: float | None = None,
                             sinks: jax.Array | None = None, key_scale_cache: ScaleCache = None,
                             value_scale_cache: ScaleCache = None,
                             cache_format: str | None = None, layout: str = "NHD",
                             head_dim: int | None = None, layer: Layer = None,
                             max_query_len: int | None = None,
                             check_bounds: bool = False) -> jax.Array:
    """:func:`paged_attention` over one combined cache.

    Parameters
    ----------
    kv_cache : jax.Array
        ``[num_pages, 2, page_size, num_kv_heads, head_dim]`` (NHD),
        ``[num_pages, 2, num_kv_heads, page_size, head_dim]`` (HND) or
        ``[num_slots, 2, num_kv_heads, head_dim]``: index 0 of dim 1 is K, 1 is V.

    Other parameters are those of :func:`paged_attention`.

    Returns
    -------
    jax.Array
        As :func:`paged_attention`.

    Note
    ----
    As :func:`paged_attention`: the cache is only read.

    Examples
    --------
    >>> import jax.numpy as jnp, fp8kv_jax
    >>> kv = jnp.zeros((1, 2, 4, 1, 16), jnp.bfloat16).at[0, 1, :2].set(2.0)  # V of tokens 0, 1
    >>> out = fp8kv_jax.paged_attention_combined(jnp.zeros((1, 1, 16), jnp.bfloat16), kv,
    ...                                          jnp.array([[0]], jnp.int32),
    ...                                          jnp.array([2], jnp.int32))
    >>> out[0, 0, :2].tolist()
    [2.0, 2.0]
    """
    return _call("paged_attention_combined", locals())
