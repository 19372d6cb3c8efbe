"""Argument checks shared by both frontends, raised before anything is launched or written.

Errors name the argument, what was expected and what was given: ``TypeError`` for a wrong kind or
dtype, ``ValueError`` for a wrong value, shape, layout or device.
"""
from __future__ import annotations

import math
from numbers import Real

import numpy as np

from .arrays import ArrayInfo, fmt_shape
from .formats import (CACHE_DTYPES, FORMAT_OF_DTYPE, FORMATS, FP8_FORMATS, FP8_OUTPUT_DTYPE,
                      Format, resolve_format)
from .layout import (INLINE_PADS, Layers, PagedCache, block_scales_shape,
                     combined_halves, expected_cache_shape, inline_data, paged,
                     scale_cache as scale_cache_geometry, scale_cache_shapes)
from .modes import ScaleKind, SideScale

FP32_MIN_NORMAL = 2.0 ** -126
FP32_MAX = float.fromhex("0x1.fffffep127")


def check_choice(value, name: str, choices) -> str:
    """``value``, one of the strings ``choices`` (a ValueError naming them otherwise)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected {' or '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def check_format_name(fp8_format, cache_format):
    """``(argument, name)``: which of ``fp8_format`` (the FP8 formats) and ``cache_format`` (any
    format) names the cache's format, and the name (None: the cache's dtype, or e4m3)."""
    if fp8_format is not None and (not isinstance(fp8_format, str)
                                   or fp8_format not in FP8_FORMATS):
        names = ", ".join(repr(n) for n in FP8_FORMATS)
        hint = (f" (name it with cache_format={fp8_format!r})"
                if isinstance(fp8_format, str) and fp8_format in FORMATS else "")
        raise ValueError(f"fp8_format: expected {names} or None{hint}, got {fp8_format!r}")
    if cache_format is None:
        return "fp8_format", fp8_format
    if not isinstance(cache_format, str) or cache_format not in FORMATS:
        names = ", ".join(repr(n) for n in FORMATS)
        raise ValueError(f"cache_format: expected {names} or None, got {cache_format!r}")
    if fp8_format is not None:
        raise ValueError(f"cache_format: expected None when fp8_format is given (both name the "
                         f"cache's format: pass one), got {cache_format!r} with "
                         f"fp8_format={fp8_format!r}")
    return "cache_format", cache_format


def check_format(cache: ArrayInfo, fp8_format, name: str, cache_format=None) -> Format:
    """The cache's format (a row of :data:`fp8kv.formats.FORMATS`): its dtype's, or the named
    one for a uint8 cache (a block-scaled format: uint8, or the typed dtype of its codes)."""
    arg, given = check_format_name(fp8_format, cache_format)
    if given is not None and FORMATS[given].block_scaled:
        fmt = FORMATS[given]
        if cache.dtype not in ("uint8", fmt.dtype):
            expected, codes = (("uint8", "two 4-bit codes per byte") if fmt.packed else
                               (f"uint8 or {fmt.dtype}", f"{fmt.dtype} codes"))
            raise TypeError(f"{name}: expected dtype {expected} for {arg}={given!r} ({codes}), "
                            f"got {cache.dtype}")
        return fmt
    fmt = resolve_format(cache.dtype, given)
    if cache.dtype in FORMAT_OF_DTYPE and given not in (None, fmt.name):
        raise ValueError(f"{arg}: {name} is {cache.dtype}, which is {fmt.name!r}, "
                         f"got {arg}={given!r}")
    return fmt


def check_dtype(info: ArrayInfo, name: str, allowed) -> None:
    if info.dtype not in allowed:
        raise TypeError(f"{name}: expected dtype {' or '.join(allowed)}, got {info.dtype}")


def check_unit_last_stride(info: ArrayInfo, name: str) -> None:
    if info.ndim and info.shape[-1] > 1 and 0 not in info.shape and info.strides[-1] != 1:
        raise ValueError(f"{name}: expected a unit-stride last dimension, got strides "
                         f"{fmt_shape(info.strides)}")


def check_contiguous(info: ArrayInfo, name: str) -> None:
    """A 1-D array the kernels read by index alone (slots, per-head scales)."""
    if info.ndim == 1 and info.shape[0] > 1 and info.strides[0] != 1:
        raise ValueError(f"{name}: expected a contiguous array, got strides {fmt_shape(info.strides)}")


def check_nonnegative_strides(info: ArrayInfo, name: str) -> None:
    if any(s < 0 for s in info.strides):
        raise ValueError(f"{name}: expected non-negative strides, got {fmt_shape(info.strides)}")


def check_device(info: ArrayInfo, name: str, device: str, owner: str | None = "the cache") -> None:
    """``info`` on ``device``; ``owner`` names whose device that is (None: nobody's)."""
    if info.device != device:
        whose = f" (that of {owner})" if owner else ""
        raise ValueError(f"{name}: expected device {device}{whose}, got {info.device}")


def check_same_device(named: dict) -> str:
    devices = {name: a.device for name, a in named.items() if isinstance(a, ArrayInfo)}
    first_name, first = next(iter(devices.items()))
    for name, device in devices.items():
        if device != first:
            raise ValueError(f"{name}: expected device {first} (that of {first_name}), got {device}")
    return first


def check_cache(cache: ArrayInfo, layout: str, name: str, combined: bool = False,
                dtypes=CACHE_DTYPES):
    """Check a cache's dtype (one of ``dtypes``), rank and strides; return it as pages
    (``combined``: K and V)."""
    check_dtype(cache, name, dtypes)
    check_unit_last_stride(cache, name)
    half = cache
    if combined:
        if cache.ndim not in (4, 5) or cache.shape[1] != 2:
            raise ValueError(f"{name}: expected a combined cache [num_pages, 2, ...] of rank 4 or 5 "
                             f"(layout={layout!r}), got shape {fmt_shape(cache.shape)}")
        half = cache.drop_dim(1)
    if half.ndim not in (3, 4):
        raise ValueError(f"{name}: expected rank 3 {expected_cache_shape(layout, 3)} or rank 4 "
                         f"{expected_cache_shape(layout, 4)}, got shape {fmt_shape(half.shape)}")
    check_nonnegative_strides(cache, name)
    return combined_halves(cache, layout) if combined else paged(cache, layout)


def named_caches(key_cache, value_cache, kv_cache) -> dict:
    if kv_cache is not None:
        return {"kv_cache": kv_cache}
    return {"key_cache": key_cache, "value_cache": value_cache}


def check_caches(key_cache, value_cache, kv_cache, layout: str, fp8_format, cache_format=None):
    """K and V as pages, their format and rank: from ``kv_cache`` if given (combined), else from
    the pair."""
    if kv_cache is not None:
        kc, vc = check_cache(kv_cache, layout, "kv_cache", combined=True)
        return (kc, vc, check_format(kv_cache, fp8_format, "kv_cache", cache_format),
                kv_cache.ndim - 1)
    k = check_cache(key_cache, layout, "key_cache")
    v = check_cache(value_cache, layout, "value_cache")
    if value_cache.shape != key_cache.shape:
        raise ValueError(f"value_cache: expected the shape of key_cache {fmt_shape(key_cache.shape)}, "
                         f"got {fmt_shape(value_cache.shape)}")
    if value_cache.dtype != key_cache.dtype:
        raise TypeError(f"value_cache: expected the dtype of key_cache ({key_cache.dtype}), got "
                        f"{value_cache.dtype}")
    return k, v, check_format(key_cache, fp8_format, "key_cache", cache_format), key_cache.ndim


def check_scale(scale, name: str, num_heads: int, device: str) -> SideScale:
    """A static scale: None, a Python number or an fp32 device array ``[]``/``[1]``/``[H]``."""
    if scale is None:
        return SideScale()
    if isinstance(scale, ArrayInfo):
        check_dtype(scale, name, ("float32",))
        if scale.shape not in ((), (1,), (num_heads,)):
            raise ValueError(f"{name}: expected shape [], [1] or [{num_heads}] (num_kv_heads), got "
                             f"{fmt_shape(scale.shape)}")
        check_device(scale, name, device)
        check_contiguous(scale, name)
        per_head = scale.shape == (num_heads,) and num_heads > 1
        return SideScale(ScaleKind.HEAD if per_head else ScaleKind.TENSOR)
    if isinstance(scale, bool) or not isinstance(scale, Real):
        raise TypeError(f"{name}: expected None, a float or a float32 array, got {type(scale).__name__}")
    value = float(scale)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name}: expected a finite scale > 0, got {value}")
    # The kernels take the scale as an fp32 argument: it must be a normal fp32 number.
    if not FP32_MIN_NORMAL <= value <= FP32_MAX:
        raise ValueError(f"{name}: expected a scale in the normal fp32 range [2**-126, "
                         f"{FP32_MAX:.6g}], got {value}")
    if value == 1.0:  # x / 1 == x exactly: skip the division
        return SideScale()
    return SideScale(ScaleKind.VALUE, value)


INLINE = "inline"
SCALE_ROUNDINGS = ("exact", "pow2")
ROPE_STYLES = ("neox", "gptj")


def check_scale_cache_arg(scale_cache, name: str, array_type: type = ArrayInfo,
                          fmt: Format | None = None):
    """None, ``"inline"`` or an array: an :class:`ArrayInfo` (a frontend's array), or what
    ``array_type`` says (the reference's NumPy arrays); anything else raises. For a block-scaled
    format (``fmt``) an array of block scales is required: that check is
    :func:`check_block_scales`'."""
    if fmt is not None and fmt.block_scaled:
        if scale_cache is not None and not isinstance(scale_cache, (str, array_type)):
            raise TypeError(f"{name}: expected an array of {fmt.name} block scales "
                            f"({' or '.join(fmt.blocks.dtypes)}), got {type(scale_cache).__name__}")
        return scale_cache
    if isinstance(scale_cache, str):
        if scale_cache != INLINE:
            raise ValueError(f"{name}: expected None, 'inline' or a float32 array, got "
                             f"{scale_cache!r}")
    elif scale_cache is not None and not isinstance(scale_cache, array_type):
        raise TypeError(f"{name}: expected None, 'inline' or a float32 array, got "
                        f"{type(scale_cache).__name__}")
    return scale_cache


def check_no_static_scale(scale, scale_cache, scale_name: str) -> None:
    """A side with dynamic scales (``scale_cache`` given) takes no static scale."""
    if scale is not None and scale_cache is not None:
        raise ValueError(f"{scale_name}: expected None when {scale_name}_cache is given (the "
                         f"scales are then dynamic), got {type(scale).__name__}")


def check_inline_pad(width: int, head_dim: int, cache_name: str) -> int:
    """The bytes after each head's ``head_dim`` codes in an inline-scale cache row of ``width``."""
    pad = width - head_dim
    if pad not in INLINE_PADS:
        raise ValueError(f"{cache_name}: expected a last dimension of head_dim + 4 "
                         f"({head_dim + 4}) or head_dim + 16 ({head_dim + 16}) for an inline "
                         f"scale cache, got {width}")
    return pad


def check_inline(key_scale_cache, value_scale_cache, kc: PagedCache, vc: PagedCache,
                 head_dim, cache_name: str):
    """Both or neither inline; with inline, the caches as pages of their ``head_dim`` data
    columns and the pad (4 or 16). Returns ``(kc, vc, pad)``."""
    k_inline, v_inline = key_scale_cache == INLINE, value_scale_cache == INLINE
    if k_inline != v_inline:
        given, other = (("value_scale_cache", value_scale_cache) if k_inline
                        else ("key_scale_cache", key_scale_cache))
        raise ValueError(f"{given}: expected 'inline' like the other side's scale cache (K and V "
                         f"caches share one shape), got "
                         f"{other if other is None or isinstance(other, str) else 'an array'}")
    if not k_inline:
        return kc, vc, 0
    pad = check_inline_pad(kc.head_dim, head_dim, cache_name)
    return inline_data(kc, head_dim), inline_data(vc, head_dim), pad


def check_scale_cache(scale_cache, name: str, scale, scale_name: str, cache: PagedCache,
                      layout: str, rank: int, device: str) -> SideScale | None:
    """One side's dynamic scales; None without them."""
    if scale_cache is None:
        return None
    check_no_static_scale(scale, scale_cache, scale_name)
    if scale_cache == INLINE:
        return SideScale(dynamic=ScaleKind.TOKEN_HEAD)
    check_dtype(scale_cache, name, ("float32",))
    shapes = scale_cache_shapes(cache, layout, rank)
    if scale_cache.shape not in shapes.values():
        raise ValueError(f"{name}: expected shape {fmt_shape(shapes['token_head'])} (per token-head) "
                         f"or {fmt_shape(shapes['token'])} (per token) for a {layout} cache of rank "
                         f"{rank}, got {fmt_shape(scale_cache.shape)}")
    check_device(scale_cache, name, device)
    check_nonnegative_strides(scale_cache, name)
    geometry = scale_cache_geometry(scale_cache, layout, rank)
    return SideScale(dynamic=ScaleKind.TOKEN_HEAD if geometry.per_head else ScaleKind.TOKEN,
                     stored=geometry)


def check_block_head_dim(head_dim: int, fmt: Format, name: str) -> None:
    """A head_dim (of ``name``) that a block-scaled format can hold: whole blocks of scales."""
    size = fmt.blocks.size
    if head_dim % size:
        raise ValueError(f"{name}: expected a head_dim that is a multiple of {size} for "
                         f"cache_format={fmt.name!r} (one block scale per {size} elements), got "
                         f"{head_dim}")


def check_block_scales(scale_cache, name: str, cache: PagedCache, layout: str, rank: int,
                       device: str, fmt: Format) -> PagedCache:
    """One side's block-scale array (required): the cache's shape with ``head_dim /
    fmt.blocks.size`` scales per head row, of one of ``fmt.blocks.dtypes``. Returns its
    geometry."""
    shape = block_scales_shape(cache, layout, rank, fmt)
    dtypes = fmt.blocks.dtypes
    expected = (f"an array {fmt_shape(shape)} of {' or '.join(dtypes)} (the cache's shape with "
                f"head_dim / {fmt.blocks.size} = {shape[-1]} block scales per head row)")
    if not isinstance(scale_cache, ArrayInfo):
        raise ValueError(f"{name}: expected the block scales of an {fmt.name} cache, "
                         f"{expected}, got {scale_cache!r}")
    check_dtype(scale_cache, name, dtypes)
    if scale_cache.shape != shape:
        raise ValueError(f"{name}: expected {expected}, got shape {fmt_shape(scale_cache.shape)}")
    check_device(scale_cache, name, device)
    check_nonnegative_strides(scale_cache, name)
    check_unit_last_stride(scale_cache, name)
    return paged(scale_cache, layout)


def block_side_scales(key_scale, value_scale, key_scale_cache, value_scale_cache, kc, vc,
                       layout, rank, device, num_heads, fmt) -> tuple[SideScale, SideScale]:
    """Both sides of a block-scaled format: the block scales and, for a packed format (nvfp4),
    a static global scale; the others' block scales are their only scales."""
    sides = []
    for side, scale, sc, cache in (("key", key_scale, key_scale_cache, kc),
                                   ("value", value_scale, value_scale_cache, vc)):
        stored = check_block_scales(sc, f"{side}_scale_cache", cache, layout, rank, device, fmt)
        if not fmt.packed:
            check_no_static_scale(scale, sc, f"{side}_scale")
        static = check_scale(scale, f"{side}_scale", num_heads, device)
        sides.append(SideScale(static.kind, static.value, ScaleKind.BLOCK, stored))
    return tuple(sides)


def check_out_scale(out_scale, out_dtype: str, device: str) -> SideScale:
    """The scale of an FP8 output (``dtype=float8_e4m3fn``): None, a number or an fp32 device
    array ``[]``/``[1]``; any other output takes none."""
    if out_scale is None:
        return SideScale()
    if out_dtype != FP8_OUTPUT_DTYPE:
        raise ValueError(f"out_scale: expected None unless dtype is {FP8_OUTPUT_DTYPE} (it scales "
                         f"the FP8 output), got "
                         f"{'an array' if isinstance(out_scale, ArrayInfo) else repr(out_scale)} "
                         f"with dtype {out_dtype}")
    return check_scalar_scale(out_scale, "out_scale", device)


def check_scalar_scale(scale, name: str, device: str) -> SideScale:
    """One scale for every element: None, a Python number or a float32 array ``[]`` / ``[1]``."""
    if isinstance(scale, ArrayInfo) and scale.shape not in ((), (1,)):
        check_dtype(scale, name, ("float32",))
        raise ValueError(f"{name}: expected shape [] or [1], got {fmt_shape(scale.shape)}")
    return check_scale(scale, name, 1, device)


def side_scales(key_scale, value_scale, key_scale_cache, value_scale_cache, kc, vc, layout, rank,
                device, num_heads, fmt: Format | None = None) -> tuple[SideScale, SideScale]:
    """Both sides' :class:`~fp8kv.modes.SideScale`, static or dynamic (:func:`block_side_scales`
    for a block-scaled ``fmt``)."""
    if fmt is not None and fmt.block_scaled:
        return block_side_scales(key_scale, value_scale, key_scale_cache, value_scale_cache, kc,
                                 vc, layout, rank, device, num_heads, fmt)
    sides = []
    for side, scale, sc, cache in (("key", key_scale, key_scale_cache, kc),
                                   ("value", value_scale, value_scale_cache, vc)):
        dynamic = check_scale_cache(sc, f"{side}_scale_cache", scale, f"{side}_scale", cache,
                                    layout, rank, device)
        sides.append(dynamic or check_scale(scale, f"{side}_scale", num_heads, device))
    return tuple(sides)


def check_layers_supported(layers, fmt: Format) -> None:
    """Stacked caches (``layer=``) are FP8 caches: the packed-code kernels (nvfp4) address one
    layer's caches (pass that layer's views, e.g. ``cache[layer]``)."""
    if layers is not None and fmt.packed:
        raise ValueError(f"layer: expected None with cache_format={fmt.name!r} (stacked caches "
                         f"take the FP8 formats; pass one layer's caches), got a layer")


def frontend_args(info, array_type: type, arrays: dict, scales: dict) -> dict:
    """:func:`check_write` / :func:`check_dequantize` arguments by name, from a frontend's own:
    ``info(x, name)`` of each of ``arrays`` (the arrays the call must have: it raises for a wrong
    type, naming it), and of each of ``scales`` (scales and scale caches) that is an
    ``array_type``; the others (None, a number, ``"inline"``, a wrong type) as they are, for the
    checks to judge."""
    args = {name: info(x, name) for name, x in arrays.items()}
    args.update((name, info(x, name) if isinstance(x, array_type) else x)
                for name, x in scales.items())
    return args


def check_out(out: ArrayInfo, name: str, shape, dtypes, device: str) -> None:
    """A caller-provided output: exact shape, one of ``dtypes``, same device, unit last stride,
    no stride negative."""
    check_dtype(out, name, dtypes)
    if out.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {fmt_shape(shape)}, got {fmt_shape(out.shape)}")
    check_device(out, name, device, owner=None)
    check_unit_last_stride(out, name)
    check_nonnegative_strides(out, name)


def check_slots_in_range(slots, num_slots: int) -> None:
    """The opt-in bounds check of ``write_kv``: every non-negative slot names a cache row.

    ``slots``: the slot values on the host (a NumPy array). Negative slots are padding.
    """
    bad = np.flatnonzero(np.asarray(slots) >= num_slots)
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"slots: expected every slot < {num_slots} (num_pages * page_size) or "
                         f"< 0 (padding), got {bad.size} past the cache, the first slots[{i}] = "
                         f"{int(np.asarray(slots)[i])}")


# ---------------------------------------------------------------------------------------------
# Stacked caches (docs/SPEC.md section 14): layer= says every cache argument has a layer axis.

LAYER_DTYPES = ("int32", "int64")


def check_layer(layer, device: str):
    """``layer``: None (no layer axis), a host int (returned as an int) or an int32 / int64 device
    array of shape ``[]`` on ``device`` (returned as it is)."""
    if layer is None:
        return None
    if isinstance(layer, ArrayInfo):
        check_dtype(layer, "layer", LAYER_DTYPES)
        if layer.shape != ():
            raise ValueError(f"layer: expected an int or an array of shape [], got shape "
                             f"{fmt_shape(layer.shape)}")
        check_device(layer, "layer", device, owner="the caches")
        return layer
    if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
        raise TypeError(f"layer: expected None, an int or an int32 array of shape [], got "
                        f"{type(layer).__name__}")
    return int(layer)


def unstack(layer, device: str, key_cache, value_cache, kv_cache, key_scale_cache,
            value_scale_cache):
    """``((key_cache, value_cache, kv_cache, key_scale_cache, value_scale_cache), layers)``.

    Without ``layer``: the arguments as given and None. With it: each stacked array (a cache or
    a side scale array; None and ``"inline"`` pass through) as one layer of it -- the layer axis
    dropped, for the checks and plans of one layer -- and the :class:`~fp8kv.layout.Layers`.
    Raises for a bad ``layer`` and for arrays without the same leading layer axis.
    """
    arrays = (key_cache, value_cache, kv_cache, key_scale_cache, value_scale_cache)
    layer = check_layer(layer, device)
    if layer is None:
        return arrays, None
    caches = named_caches(key_cache, value_cache, kv_cache)
    ranks = (5, 6) if kv_cache is not None else (4, 5)
    for name, cache in caches.items():
        if not isinstance(cache, ArrayInfo) or cache.ndim not in ranks:
            got = (f"shape {fmt_shape(cache.shape)}" if isinstance(cache, ArrayInfo)
                   else "no array")
            raise ValueError(f"{name}: expected a stacked cache [num_layers, ...] of rank "
                             f"{ranks[0]} or {ranks[1]} (layer= is given), got {got}")
    first_name, first = next(iter(caches.items()))
    for name, cache in caches.items():
        if cache.shape != first.shape:
            raise ValueError(f"{name}: expected the shape of {first_name} "
                             f"{fmt_shape(first.shape)}, got {fmt_shape(cache.shape)}")
    num_layers = first.shape[0]
    strides = []
    for name, array in zip(("key_cache", "value_cache", "kv_cache", "key_scale_cache",
                            "value_scale_cache"), arrays):
        if not isinstance(array, ArrayInfo):
            strides.append(0)
        elif array.ndim == 0 or array.shape[0] != num_layers:
            raise ValueError(f"{name}: expected a stacked array [num_layers={num_layers}, ...] "
                             f"(layer= is given; the leading axis of the caches), got shape "
                             f"{fmt_shape(array.shape)}")
        elif array.strides[0] < 0:
            raise ValueError(f"{name}: expected non-negative strides, got "
                             f"{fmt_shape(array.strides)}")
        else:
            strides.append(array.strides[0])
    k_stride, v_stride = (strides[2], strides[2]) if kv_cache is not None else strides[:2]
    layers = Layers(num_layers, k_stride, v_stride, strides[3], strides[4],
                    None if isinstance(layer, ArrayInfo) else layer)
    one = tuple(a.drop_dim(0) if isinstance(a, ArrayInfo) else a for a in arrays)
    return one, layers


def check_layer_in_range(layer, num_layers: int) -> None:
    """The opt-in bounds check of ``layer=``: ``0 <= layer < num_layers`` (``layer``: the host
    value, e.g. a device array read on the host)."""
    value = int(np.asarray(layer))
    if not 0 <= value < num_layers:
        raise ValueError(f"layer: expected 0 <= layer < {num_layers} (num_layers), got {value}")


def check_stack_bounds(args, read) -> None:
    """The opt-in bounds check of a validated call's ``layer=`` (``read("layer")``: its host
    value); nothing without stacked caches."""
    if args.layers is not None:
        check_layer_in_range(read("layer"), args.layers.num_layers)
