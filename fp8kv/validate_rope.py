"""Argument checks of ``rope_write_kv`` / ``rope_write_kv_combined`` (docs/SPEC.md, section 12).

The K/V write is checked by :func:`fp8kv.validate.check_write` itself (same errors as
``write_kv``); this module adds the query, the positions, the cos/sin cache, the RoPE options and
the outputs. Errors name the argument, what was expected and what was given, and are raised
before anything is written.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .arrays import ArrayInfo, fmt_shape
from .formats import (E4M3, FORMAT_OF_DTYPE, FORMATS, FP8_FORMATS, INPUT_DTYPES, SLOT_DTYPES,
                      Format)
from .modes import SideScale
from .validate import (WriteArgs, check_choice, check_contiguous, check_dtype,
                       check_nonnegative_strides, check_out, check_same_device, check_scale,
                       check_unit_last_stride, check_write)

ROPE_STYLES = ("neox", "gptj")
COS_SIN_DTYPES = ("float32", "bfloat16", "float16")
QUERY_FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2", "uint8")


@dataclass(frozen=True)
class RopeWriteArgs:
    """A validated ``rope_write_kv`` / ``rope_write_kv_combined`` call: the K/V write, plus what
    the RoPE and the query take; what the plan and the operand map are made from.

    ``query_out``: the given output, or the contiguous one the frontend makes
    (``query_out_given`` False); ``query_format``: the FP8 format of its codes, None for a
    16-bit / fp32 output. ``key_out``: the rotated key's output, None when not written;
    ``key_out_given`` False for one the frontend makes (JAX's ``return_key``).
    """

    write: WriteArgs
    query: ArrayInfo
    positions: ArrayInfo
    cos_sin_cache: ArrayInfo
    rotary_dim: int
    gptj: bool
    query_scale: SideScale
    query_format: Format | None
    query_out: ArrayInfo
    query_out_given: bool
    key_out: ArrayInfo | None
    key_out_given: bool

    @property
    def num_tokens(self) -> int:
        return self.write.num_tokens

    @property
    def max_position(self) -> int:
        return self.cos_sin_cache.shape[0]

    @property
    def combined(self) -> bool:
        return self.write.combined


def check_rotary_dim(rotary_dim, cos_sin_cache: ArrayInfo, head_dim: int) -> int:
    """``R``: the cos/sin cache's width, even, in ``[2, head_dim]``, equal to ``rotary_dim`` if
    given."""
    if rotary_dim is not None and (isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int)):
        raise TypeError(f"rotary_dim: expected None or an int, got {type(rotary_dim).__name__}")
    # rotary_dim's own rule first: with a wrong rotary_dim, the cache's width is not the mistake.
    if rotary_dim is not None and (rotary_dim % 2 or not 2 <= rotary_dim <= head_dim):
        raise ValueError(f"rotary_dim: expected an even int in [2, {head_dim}] (head_dim), got "
                         f"{rotary_dim}")
    width = cos_sin_cache.shape[1]
    if rotary_dim is not None and rotary_dim != width:
        raise ValueError(f"cos_sin_cache: expected rotary_dim={rotary_dim} columns (cos then sin), "
                         f"got shape {fmt_shape(cos_sin_cache.shape)}")
    if width % 2 or not 2 <= width <= head_dim:
        raise ValueError(f"cos_sin_cache: expected an even number of columns (rotary_dim) in "
                         f"[2, {head_dim}] (head_dim), got shape {fmt_shape(cos_sin_cache.shape)}")
    return width


def check_query_scale(query_scale, device: str) -> SideScale:
    """None, a Python number or a float32 array ``[]`` / ``[1]`` (one scale for every query
    element)."""
    if isinstance(query_scale, ArrayInfo):
        check_dtype(query_scale, "query_scale", ("float32",))
        if query_scale.shape not in ((), (1,)):
            raise ValueError(f"query_scale: expected shape [] or [1], got "
                             f"{fmt_shape(query_scale.shape)}")
    return check_scale(query_scale, "query_scale", 1, device)


def _check_output(out, name: str, shape, dtypes, device: str, array_type: type) -> None:
    if not isinstance(out, array_type):
        raise TypeError(f"{name}: expected None or an array, got {type(out).__name__}")
    check_out(out, name, shape, dtypes, device)


def check_rope_write(query, key, value, key_cache=None, value_cache=None, slots=None,
                     positions=None, cos_sin_cache=None, key_scale=None, value_scale=None, *,
                     rope_style, rotary_dim, query_scale, query_out, layout, fp8_format,
                     kv_cache=None, key_scale_cache=None, value_scale_cache=None,
                     scale_rounding="exact", key_out=None, return_key=False) -> RopeWriteArgs:
    """Validate ``rope_write_kv`` (or, with ``kv_cache``, ``rope_write_kv_combined``)
    arguments: :class:`~fp8kv.arrays.ArrayInfo` for arrays, the rest as given.

    ``key_out``: the given rotated-key output (torch) or None; ``return_key``: a new one is made
    (JAX). ``query_out`` None: the frontend makes one of the dtype found here.
    """
    style = check_choice(rope_style, "rope_style", ROPE_STYLES)
    named = {"query": query, "key": key, "value": value}
    named.update({"kv_cache": kv_cache} if kv_cache is not None
                 else {"key_cache": key_cache, "value_cache": value_cache})
    named.update(slots=slots, positions=positions, cos_sin_cache=cos_sin_cache)
    device = check_same_device(named)
    check_dtype(query, "query", INPUT_DTYPES)
    if query.ndim != 3:
        raise ValueError(f"query: expected rank 3 [num_tokens, num_heads, head_dim], got shape "
                         f"{fmt_shape(query.shape)}")
    check_unit_last_stride(query, "query")
    if isinstance(fp8_format, str) and fp8_format in FORMATS and fp8_format not in FP8_FORMATS:
        # A block-scaled format: write_kv's cache_format names it; this op has none.
        names = ", ".join(repr(n) for n in FP8_FORMATS)
        raise ValueError(f"fp8_format: expected {names} or None (rope_write_kv writes the FP8 "
                         f"formats and takes no cache_format; write a {fp8_format} cache with "
                         f"write_kv(..., cache_format={fp8_format!r}) of the rotated key), got "
                         f"{fp8_format!r}")
    write = check_write(key, value, key_cache, value_cache, slots, key_scale, value_scale,
                        layout=layout, fp8_format=fp8_format, kv_cache=kv_cache,
                        key_scale_cache=key_scale_cache, value_scale_cache=value_scale_cache,
                        scale_rounding=scale_rounding)
    num_tokens, num_kv_heads, head_dim = key.shape
    if query.dtype != key.dtype:
        raise TypeError(f"query: expected the dtype of key ({key.dtype}), got {query.dtype}")
    tokens, num_heads, q_dim = query.shape
    if (tokens, q_dim) != (num_tokens, head_dim):
        raise ValueError(f"query: expected [{num_tokens}, num_heads, {head_dim}] (num_tokens and "
                         f"head_dim of key), got shape {fmt_shape(query.shape)}")
    if num_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"query: expected a number of heads that is a positive multiple of "
                         f"num_kv_heads={num_kv_heads}, got {num_heads}")
    check_dtype(positions, "positions", SLOT_DTYPES)
    if positions.shape != (num_tokens,):
        raise ValueError(f"positions: expected shape [{num_tokens}] (one per token), got "
                         f"{fmt_shape(positions.shape)}")
    check_contiguous(positions, "positions")
    check_dtype(cos_sin_cache, "cos_sin_cache", COS_SIN_DTYPES)
    if cos_sin_cache.ndim != 2:
        raise ValueError(f"cos_sin_cache: expected rank 2 [max_position, rotary_dim], got shape "
                         f"{fmt_shape(cos_sin_cache.shape)}")
    check_unit_last_stride(cos_sin_cache, "cos_sin_cache")
    check_nonnegative_strides(cos_sin_cache, "cos_sin_cache")
    rotary = check_rotary_dim(rotary_dim, cos_sin_cache, head_dim)
    qs = check_query_scale(query_scale, device)
    fp8 = query_scale is not None
    array_type = type(query)
    if query_out is None:
        query_format = E4M3 if fp8 else None
        out = ArrayInfo.contiguous(query.shape, E4M3.dtype if fp8 else query.dtype, device)
    else:
        _check_output(query_out, "query_out", query.shape,
                      QUERY_FP8_DTYPES if fp8 else (query.dtype,), device, array_type)
        query_format = FORMAT_OF_DTYPE.get(query_out.dtype, E4M3) if fp8 else None
        out = query_out
    if key_out is not None:
        _check_output(key_out, "key_out", key.shape, (key.dtype,), device, array_type)
    elif return_key:
        key_out = ArrayInfo.contiguous(key.shape, key.dtype, device)
    return RopeWriteArgs(write, query, positions, cos_sin_cache, rotary, style == "gptj", qs,
                         query_format, out, query_out is not None, key_out,
                         key_out is not None and not return_key)


def check_positions_in_range(positions, max_position: int) -> None:
    """The opt-in bounds check of ``rope_write_kv``: every position names a row of the cos/sin
    cache. ``positions``: the values on the host (a NumPy array)."""
    values = np.asarray(positions)
    bad = np.flatnonzero((values < 0) | (values >= max_position))
    if bad.size:
        i = int(bad[0])
        raise ValueError(f"positions: expected every position in [0, {max_position}) (the rows "
                         f"of cos_sin_cache), got {bad.size} outside, the first positions[{i}] = "
                         f"{int(values[i])}")
