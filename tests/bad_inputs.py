"""One table of bad calls for both frontends: each must raise a TypeError / ValueError that names
the argument, before anything is written (docs/SPEC.md, "Errors").

Framework-neutral: a row's ``call(api, a)`` builds its arguments from NumPy arrays through the
converter ``a`` (NumPy -> a torch tensor on the test device, or -> a JAX array; ``a.dtype(name)``
is that framework's dtype) and calls the frontend module ``api`` (``fp8kv_torch`` or
``fp8kv_jax``). ``tests/test_bad_inputs.py`` runs every row through each frontend it applies to,
checks that the torch calls wrote nothing, and that a row both frontends run gives the very same
exception type and message in both.

Every cache and ``out=`` array starts with all its bytes :data:`SENTINEL`, a byte that no write
in these calls would leave in place.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable

import numpy as np

from fp8kv.reference import np_dtype

T, H, D, P, S = 5, 2, 64, 3, 4     # tokens, kv heads, head_dim, pages, page_size
SENTINEL = 0xA5
TORCH, JAX = "torch", "jax"


def poisoned(shape, dtype: str = "uint8") -> np.ndarray:
    """A new array of ``shape`` and ``dtype`` whose every byte is :data:`SENTINEL`."""
    dt = np.dtype(dtype) if dtype.startswith("int") else np_dtype(dtype)
    raw = np.full(tuple(shape) + (dt.itemsize,), SENTINEL, np.uint8)
    return raw.view(dt).reshape(shape)


KEY = (np.arange(T * H * D) % 13 - 6).astype(np.float32).reshape(T, H, D).astype(
    np_dtype("bfloat16"))
SLOTS = np.array([0, 5, 6, 9, 11], np.int32)
TABLE = np.array([[0, 2], [1, -1]], np.int32)
CACHE = poisoned((P, S, H, D))                       # write: uint8 (e4m3 by default)
FP8_CACHE = poisoned((P, S, H, D), "float8_e4m3fn")  # dequantize
INLINE_CACHE = poisoned((P, S, H, D + 4))            # dequantize with inline scales (head_dim D)


def lit(text: str) -> str:
    """A regex matching ``text`` literally."""
    return re.escape(text)


def _call(fn, a, args: dict):
    """``fn(**args)``, NumPy arrays made frontend arrays by ``a`` (other values as they are)."""
    return fn(**{k: a(v) if isinstance(v, np.ndarray) else v for k, v in args.items()})


def write(api, a, **changes):
    args = dict(key=KEY, value=KEY, key_cache=CACHE, value_cache=CACHE, slots=SLOTS)
    return _call(api.write_kv, a, {**args, **changes})


def write_combined(api, a, **changes):
    args = dict(key=KEY, value=KEY, kv_cache=poisoned((P, 2, S, H, D)), slots=SLOTS)
    return _call(api.write_kv_combined, a, {**args, **changes})


def dequantize(api, a, **changes):
    args = dict(key_cache=FP8_CACHE, value_cache=FP8_CACHE, block_table=TABLE)
    return _call(api.dequantize_pages, a, {**args, **changes})


def dequantize_combined(api, a, **changes):
    args = dict(kv_cache=poisoned((P, 2, S, H, D), "float8_e4m3fn"), block_table=TABLE)
    return _call(api.dequantize_pages_combined, a, {**args, **changes})


def _jitted_write(api, a, **changes):
    import jax

    args = dict(key=KEY, value=KEY, key_cache=CACHE, value_cache=CACHE, slots=SLOTS)
    args = {k: a(v) for k, v in {**args, **changes}.items()}
    return jax.jit(api.write_kv)(**args)


def _torch_out(a, *shapes_dtypes):
    """A poisoned ``out=`` tuple for torch (``(shape, dtype name)`` each)."""
    return tuple(a(poisoned(shape, dtype)) for shape, dtype in shapes_dtypes)


PAGES = (4, S, H, D)     # the output pages of TABLE


@dataclass(frozen=True)
class Bad:
    """A bad call, the exception it must raise and a regex its message must match.

    ``only``: None (both frontends, and both must give the same exception type and message),
    ``"torch"`` or ``"jax"``. ``cuda``: needs a CUDA device (torch tensors on two devices).
    """

    id: str
    call: Callable
    exc: type
    match: str
    only: str | None = None
    cuda: bool = False


BAD_CALLS = [
    # write_kv: key / value
    Bad("write-key-int32", lambda api, a: write(api, a, key=KEY.astype(np.int32)), TypeError,
        lit("key: expected dtype bfloat16 or float16 or float32, got int32")),
    Bad("write-key-rank", lambda api, a: write(api, a, key=KEY.reshape(T, H * D)), ValueError,
        lit("key: expected rank 3 [num_tokens, num_kv_heads, head_dim], got shape [5, 128]")),
    Bad("write-value-rank", lambda api, a: write(api, a, value=KEY[0]), ValueError,
        lit("value: expected rank 3 [num_tokens, num_kv_heads, head_dim], got shape [2, 64]")),
    Bad("write-value-shape", lambda api, a: write(api, a, value=KEY[:, :, :32]), ValueError,
        lit("value: expected the shape of key [5, 2, 64], got [5, 2, 32]")),
    Bad("write-value-dtype", lambda api, a: write(api, a, value=KEY.astype(np.float16)),
        TypeError, lit("value: expected the dtype of key (bfloat16), got float16")),
    Bad("write-key-not-a-tensor", lambda api, a: write(api, a, key=KEY.tolist()), TypeError,
        lit("key: expected a torch.Tensor, got list"), only=TORCH),
    Bad("write-key-not-an-array", lambda api, a: write(api, a, key=KEY.tolist()), TypeError,
        lit("key: expected a jax.Array, got list"), only=JAX),
    Bad("write-key-last-stride",
        lambda api, a: write(api, a, key=a(np.ascontiguousarray(KEY.transpose(0, 2, 1)))
                             .transpose(1, 2)),
        ValueError, lit("key: expected a unit-stride last dimension, got strides [128, 1, 2]"),
        only=TORCH),
    # write_kv: caches
    Bad("write-cache-dtype", lambda api, a: write(api, a, key_cache=poisoned((P, S, H, D),
                                                                             "bfloat16")),
        TypeError,
        lit("key_cache: expected dtype float8_e4m3fn or float8_e5m2 or uint8, got bfloat16")),
    Bad("write-cache-rank", lambda api, a: write(api, a, key_cache=CACHE.reshape(P, S * H * D)),
        ValueError, r"key_cache: expected rank 3 .* or rank 4 .*, got shape \[3, 512\]"),
    Bad("write-cache-heads", lambda api, a: write(api, a, key_cache=poisoned((P, S, 4, D)),
                                                  value_cache=poisoned((P, S, 4, D))),
        ValueError, lit("key_cache: expected num_kv_heads=2 and head_dim=64 (those of key), got "
                        "num_kv_heads=4 and head_dim=64 with layout='NHD'")),
    Bad("write-cache-layout-hint", lambda api, a: write(api, a, key_cache=poisoned((P, H, S, D)),
                                                        value_cache=poisoned((P, H, S, D))),
        ValueError, lit("got num_kv_heads=4 and head_dim=64 with layout='NHD'; these shapes fit "
                        "layout='HND'")),
    Bad("write-cache-pair-shape",
        lambda api, a: write(api, a, value_cache=poisoned((P + 1, S, H, D))),
        ValueError, lit("value_cache: expected the shape of key_cache [3, 4, 2, 64], got "
                        "[4, 4, 2, 64]")),
    Bad("write-cache-pair-dtype",
        lambda api, a: write(api, a, value_cache=poisoned((P, S, H, D), "float8_e4m3fn")),
        TypeError, lit("value_cache: expected the dtype of key_cache (uint8), got float8_e4m3fn")),
    Bad("write-cache-last-stride",
        lambda api, a: write(api, a, key_cache=a(poisoned((P, S, D, H))).transpose(2, 3)),
        ValueError, lit("key_cache: expected a unit-stride last dimension, got strides "
                        "[512, 128, 1, 2]"), only=TORCH),
    Bad("write-combined-not-combined",
        lambda api, a: write_combined(api, a, kv_cache=CACHE), ValueError,
        lit("kv_cache: expected a combined cache [num_pages, 2, ...] of rank 4 or 5 "
            "(layout='NHD'), got shape [3, 4, 2, 64]")),
    # write_kv: slots
    Bad("write-slots-int16", lambda api, a: write(api, a, slots=SLOTS.astype(np.int16)),
        TypeError, lit("slots: expected dtype int32 or int64, got int16")),
    Bad("write-slots-float32", lambda api, a: write(api, a, slots=SLOTS.astype(np.float32)),
        TypeError, lit("slots: expected dtype int32 or int64, got float32")),
    Bad("write-slots-shape", lambda api, a: write(api, a, slots=np.arange(T + 1, dtype=np.int32)),
        ValueError, lit("slots: expected shape [5] (one per token), got [6]")),
    Bad("write-slots-not-a-tensor", lambda api, a: write(api, a, slots=SLOTS.tolist()), TypeError,
        lit("slots: expected a torch.Tensor, got list"), only=TORCH),
    Bad("write-slots-strided",
        lambda api, a: write(api, a, slots=a(np.arange(2 * T, dtype=np.int32))[::2]), ValueError,
        lit("slots: expected a contiguous array, got strides [2]"), only=TORCH),
    # write_kv: options
    Bad("write-layout", lambda api, a: write(api, a, layout="NDH"), ValueError,
        lit("layout: expected 'NHD' or 'HND', got 'NDH'")),
    Bad("write-fp8-format-name", lambda api, a: write(api, a, fp8_format="e3m4"), ValueError,
        lit("fp8_format: expected 'e4m3', 'e5m2' or None, got 'e3m4'")),
    Bad("write-fp8-format-contradicts-cache",
        lambda api, a: write(api, a, key_cache=poisoned((P, S, H, D), "float8_e5m2"),
                             value_cache=poisoned((P, S, H, D), "float8_e5m2"), fp8_format="e4m3"),
        ValueError, lit("fp8_format: key_cache is float8_e5m2, which is 'e5m2', got "
                        "fp8_format='e4m3'")),
    # write_kv: static scales
    Bad("write-scale-zero", lambda api, a: write(api, a, key_scale=0.0), ValueError,
        lit("key_scale: expected a finite scale > 0, got 0.0")),
    Bad("write-scale-negative", lambda api, a: write(api, a, value_scale=-1.0), ValueError,
        lit("value_scale: expected a finite scale > 0, got -1.0")),
    Bad("write-scale-nan", lambda api, a: write(api, a, key_scale=float("nan")), ValueError,
        lit("key_scale: expected a finite scale > 0, got nan")),
    Bad("write-scale-tiny", lambda api, a: write(api, a, key_scale=1e-40), ValueError,
        lit("key_scale: expected a scale in the normal fp32 range [2**-126, 3.40282e+38], got "
            "1e-40")),
    Bad("write-scale-huge", lambda api, a: write(api, a, value_scale=1e39), ValueError,
        lit("value_scale: expected a scale in the normal fp32 range [2**-126, 3.40282e+38], got "
            "1e+39")),
    Bad("write-scale-str", lambda api, a: write(api, a, key_scale="1.0"), TypeError,
        lit("key_scale: expected None, a float or a float32 array, got str")),
    Bad("write-scale-dtype", lambda api, a: write(api, a, key_scale=np.ones((), np.float16)),
        TypeError, lit("key_scale: expected dtype float32, got float16")),
    Bad("write-scale-shape", lambda api, a: write(api, a, value_scale=np.ones(3, np.float32)),
        ValueError, lit("value_scale: expected shape [], [1] or [2] (num_kv_heads), got [3]")),
    Bad("write-scale-strided",
        lambda api, a: write(api, a, key_scale=a(np.ones(2 * H, np.float32))[::2]), ValueError,
        lit("key_scale: expected a contiguous array, got strides [2]"), only=TORCH),
    # write_kv: dynamic scales
    Bad("write-scale-cache-dtype",
        lambda api, a: write(api, a, key_scale_cache=poisoned((P, S, H), "float16")), TypeError,
        lit("key_scale_cache: expected dtype float32, got float16")),
    Bad("write-scale-cache-shape",
        lambda api, a: write(api, a, value_scale_cache=poisoned((P, S, H + 1), "float32")),
        ValueError, lit("value_scale_cache: expected shape [3, 4, 2] (per token-head) or [3, 4] "
                        "(per token) for a NHD cache of rank 4, got [3, 4, 3]")),
    Bad("write-scale-and-scale-cache",
        lambda api, a: write(api, a, key_scale=0.5, key_scale_cache=poisoned((P, S, H), "float32")),
        ValueError, lit("key_scale: expected None when key_scale_cache is given (the scales are "
                        "then dynamic), got float")),
    Bad("write-scale-rounding", lambda api, a: write(api, a, scale_rounding="ceil"), ValueError,
        lit("scale_rounding: expected 'exact' or 'pow2', got 'ceil'")),
    Bad("write-inline-width",
        lambda api, a: write(api, a, key_scale_cache="inline", value_scale_cache="inline"),
        ValueError, lit("key_cache: expected a last dimension of head_dim + 4 (68) or "
                        "head_dim + 16 (80) for an inline scale cache, got 64")),
    Bad("write-inline-one-side",
        lambda api, a: write(api, a, key_scale_cache="inline",
                             key_cache=poisoned((P, S, H, D + 4)),
                             value_cache=poisoned((P, S, H, D + 4))),
        ValueError, lit("value_scale_cache: expected 'inline' like the other side's scale cache "
                        "(K and V caches share one shape), got None")),
    Bad("write-scale-cache-str", lambda api, a: write(api, a, key_scale_cache="side"), ValueError,
        lit("key_scale_cache: expected None, 'inline' or a float32 array, got 'side'")),
    Bad("write-scale-cache-list", lambda api, a: write(api, a, key_scale_cache=[1.0]), TypeError,
        lit("key_scale_cache: expected None, 'inline' or a float32 array, got list")),
    # write_kv: devices (torch on two devices)
    Bad("write-cache-on-another-device",
        lambda api, a: write(api, lambda x: a(x, device="cpu"),
                             key_cache=a(CACHE, device="cuda")),
        ValueError, lit("key_cache: expected device cpu (that of key), got cuda:0"),
        only=TORCH, cuda=True),
    Bad("write-scale-on-another-device",
        lambda api, a: write(api, lambda x: a(x, device="cuda"),
                             key_scale=a(np.ones(1, np.float32), device="cpu")),
        ValueError, lit("key_scale: expected device cuda:0 (that of the cache), got cpu"),
        only=TORCH, cuda=True),
    # write_kv under jax.jit: the same checks at trace time
    Bad("write-jit-slots-shape", lambda api, a: _jitted_write(api, a, slots=SLOTS[:2]),
        ValueError, lit("slots: expected shape [5] (one per token), got [2]"), only=JAX),

    # dequantize_pages
    Bad("dequantize-dtype-int8", lambda api, a: dequantize(api, a, dtype=a.dtype("int8")),
        TypeError, lit("dtype: expected one of 'bfloat16', 'float16', 'float32', 'float8_e4m3fn' "
                       "(a string, or the framework's dtype of one), got 'int8'")),
    Bad("dequantize-dtype-not-a-dtype", lambda api, a: dequantize(api, a, dtype=1.5), TypeError,
        lit("dtype: expected one of 'bfloat16', 'float16', 'float32', 'float8_e4m3fn' (a string, "
            "or the framework's dtype of one), got 1.5")),
    Bad("dequantize-table-float32",
        lambda api, a: dequantize(api, a, block_table=TABLE.astype(np.float32)), TypeError,
        lit("block_table: expected dtype int32 or int64, got float32")),
    Bad("dequantize-table-uint8",
        lambda api, a: dequantize(api, a, block_table=TABLE.astype(np.uint8)), TypeError,
        lit("block_table: expected dtype int32 or int64, got uint8")),
    Bad("dequantize-table-rank", lambda api, a: dequantize(api, a, block_table=TABLE.reshape(4)),
        ValueError, lit("block_table: expected rank 2 [batch, pages_per_seq], got shape [4]")),
    Bad("dequantize-null-page-float", lambda api, a: dequantize(api, a, null_page=0.5), TypeError,
        lit("null_page: expected None or an int, got float")),
    Bad("dequantize-null-page-str", lambda api, a: dequantize(api, a, null_page="0"), TypeError,
        lit("null_page: expected None or an int, got str")),
    Bad("dequantize-cache-pair-dtype",
        lambda api, a: dequantize(api, a, value_cache=poisoned((P, S, H, D), "float8_e5m2")),
        TypeError, lit("value_cache: expected the dtype of key_cache (float8_e4m3fn), got "
                       "float8_e5m2")),
    Bad("dequantize-layout", lambda api, a: dequantize(api, a, layout="nhd"), ValueError,
        lit("layout: expected 'NHD' or 'HND', got 'nhd'")),
    Bad("dequantize-scale-shape",
        lambda api, a: dequantize(api, a, key_scale=np.ones((2, 2), np.float32)), ValueError,
        lit("key_scale: expected shape [], [1] or [2] (num_kv_heads), got [2, 2]")),
    Bad("dequantize-combined-not-combined",
        lambda api, a: dequantize_combined(api, a, kv_cache=FP8_CACHE[:, :3]), ValueError,
        lit("kv_cache: expected a combined cache [num_pages, 2, ...] of rank 4 or 5 "
            "(layout='NHD'), got shape [3, 3, 2, 64]")),
    # dequantize_pages: dynamic scales and head_dim
    Bad("dequantize-inline-without-head-dim",
        lambda api, a: dequantize(api, a, key_cache=INLINE_CACHE, value_cache=INLINE_CACHE,
                                  key_scale_cache="inline", value_scale_cache="inline"),
        ValueError, lit("head_dim: expected an int with an inline scale cache (the last dimension "
                        "is head_dim + 4 or head_dim + 16), got None")),
    Bad("dequantize-inline-width",
        lambda api, a: dequantize(api, a, key_cache=INLINE_CACHE, value_cache=INLINE_CACHE,
                                  key_scale_cache="inline", value_scale_cache="inline",
                                  head_dim=60),
        ValueError, lit("key_cache: expected a last dimension of head_dim + 4 (64) or "
                        "head_dim + 16 (76) for an inline scale cache, got 68")),
    Bad("dequantize-head-dim-without-inline",
        lambda api, a: dequantize(api, a, key_cache=INLINE_CACHE, value_cache=INLINE_CACHE,
                                  head_dim=64),
        ValueError, lit("head_dim: expected the last dimension of key_cache (68) without an inline "
                        "scale cache, got 64")),
    Bad("dequantize-head-dim-float", lambda api, a: dequantize(api, a, head_dim=64.0), TypeError,
        lit("head_dim: expected None or an int, got float")),
    Bad("dequantize-scale-and-scale-cache",
        lambda api, a: dequantize(api, a, value_scale=2.0,
                                  value_scale_cache=poisoned((P, S), "float32")),
        ValueError, lit("value_scale: expected None when value_scale_cache is given (the scales "
                        "are then dynamic), got float")),
    # dequantize_pages: out= (torch)
    Bad("dequantize-out-count",
        lambda api, a: dequantize(api, a, out=_torch_out(a, (PAGES, "bfloat16"))), ValueError,
        lit("out: expected (key_pages, value_pages, new_block_table), got 1 tensors"), only=TORCH),
    Bad("dequantize-out-dtype",
        lambda api, a: dequantize(api, a, out=_torch_out(a, (PAGES, "float32"), (PAGES, "float32"),
                                                         ((2, 2), "int32"))),
        TypeError, lit("out[0]: expected dtype torch.bfloat16 (the dtype argument), got "
                       "torch.float32"), only=TORCH),
    Bad("dequantize-out-shape",
        lambda api, a: dequantize(api, a, out=_torch_out(a, (PAGES, "bfloat16"),
                                                         ((5, S, H, D), "bfloat16"),
                                                         ((2, 2), "int32"))),
        ValueError, lit("out[1]: expected shape [4, 4, 2, 64], got [5, 4, 2, 64]"), only=TORCH),
    Bad("dequantize-out-table-dtype",
        lambda api, a: dequantize(api, a, out=_torch_out(a, (PAGES, "bfloat16"),
                                                         (PAGES, "bfloat16"), ((2, 2), "int64"))),
        TypeError, lit("out[-1]: expected dtype int32, got int64"), only=TORCH),
]

assert len({row.id for row in BAD_CALLS}) == len(BAD_CALLS), "row ids must be unique"


def rows(frontend: str) -> list[Bad]:
    """The rows ``frontend`` ("torch" or "jax") runs."""
    return [row for row in BAD_CALLS if row.only in (None, frontend)]


def shared_rows() -> list[Bad]:
    """The rows both frontends run (and must fail alike)."""
    return [row for row in BAD_CALLS if row.only is None]
