"""The core's array checks, on array descriptions of any framework.

torch and JAX arrays never reach these checks with negative strides, and a one-GPU machine cannot
put an argument on another device: the frontends' bad-input tables cannot fail these branches, so
they are driven here, framework-neutral, with :class:`~fp8kv.arrays.ArrayInfo`.
"""
from __future__ import annotations

import dataclasses
import re

import pytest

from fp8kv.arrays import ArrayInfo
from fp8kv.dequantize import check_dequantize
from fp8kv.rope_write import check_rope_write
from fp8kv.write import check_write

DEV = "cuda:0"
T, H, D, PAGES, PAGE = 3, 2, 32, 4, 16


def _array(shape, dtype, device=DEV):
    return ArrayInfo.contiguous(shape, dtype, device)


def _flipped(info: ArrayInfo, dim: int = 0) -> ArrayInfo:
    """``info`` read backwards along ``dim`` (a negative stride, as NumPy's ``a[::-1]``)."""
    strides = list(info.strides)
    strides[dim] = -strides[dim]
    return dataclasses.replace(info, strides=tuple(strides))


def _moved(info: ArrayInfo) -> ArrayInfo:
    return dataclasses.replace(info, device="cuda:1")


def _write(**change):
    x = _array((T, H, D), "bfloat16")
    cache = _array((PAGES, PAGE, H, D), "float8_e4m3fn")
    args = dict(key=x, value=x, key_cache=cache, value_cache=cache,
                slots=_array((T,), "int64"), layout="NHD", fp8_format=None)
    args.update(change)
    return check_write(**args)


def _write_nvfp4(**change):
    codes = _array((PAGES, PAGE, H, D // 2), "uint8")
    blocks = _array((PAGES, PAGE, H, D // 16), "float8_e4m3fn")
    args = dict(key_cache=codes, value_cache=codes, key_scale=1.0, value_scale=1.0,
                key_scale_cache=blocks, value_scale_cache=blocks, cache_format="nvfp4")
    args.update(change)
    return _write(**args)


def _rope(**change):
    x = _array((T, H, D), "bfloat16")
    cache = _array((PAGES, PAGE, H, D), "float8_e4m3fn")
    args = dict(query=_array((T, 2 * H, D), "bfloat16"), key=x, value=x, key_cache=cache,
                value_cache=cache, slots=_array((T,), "int64"), positions=_array((T,), "int64"),
                cos_sin_cache=_array((64, D), "float32"), rope_style="neox", rotary_dim=None,
                query_scale=None, query_out=None, layout="NHD", fp8_format=None)
    args.update(change)
    return check_rope_write(**args)


TOKEN_HEAD = _array((PAGES, PAGE, H), "float32")
BLOCKS = _array((PAGES, PAGE, H, D // 16), "float8_e4m3fn")
QUERY_OUT = _array((T, 2 * H, D), "bfloat16")
KEY_OUT = _array((T, H, D), "bfloat16")

# (id, call, message): every call must raise ValueError with exactly this message.
CASES = [
    ("write-cache-negative-stride",
     lambda: _write(key_cache=_flipped(_array((PAGES, PAGE, H, D), "float8_e4m3fn"))),
     "key_cache: expected non-negative strides, got [-1024, 64, 32, 1]"),
    ("write-static-scale-device",
     lambda: _write(key_scale=_moved(_array((), "float32"))),
     "key_scale: expected device cuda:0 (that of the cache), got cuda:1"),
    ("write-dynamic-scale-device",
     lambda: _write(value_scale_cache=_moved(TOKEN_HEAD)),
     "value_scale_cache: expected device cuda:0 (that of the cache), got cuda:1"),
    ("write-dynamic-scale-negative-stride",
     lambda: _write(key_scale_cache=_flipped(TOKEN_HEAD, 1)),
     "key_scale_cache: expected non-negative strides, got [32, -2, 1]"),
    ("write-nvfp4-block-scales-device",
     lambda: _write_nvfp4(key_scale_cache=_moved(BLOCKS)),
     "key_scale_cache: expected device cuda:0 (that of the cache), got cuda:1"),
    ("write-nvfp4-block-scales-negative-stride",
     lambda: _write_nvfp4(value_scale_cache=_flipped(BLOCKS)),
     "value_scale_cache: expected non-negative strides, got [-64, 4, 2, 1]"),
    ("write-layer-device",
     lambda: _write(key_cache=_array((2, PAGES, PAGE, H, D), "float8_e4m3fn"),
                    value_cache=_array((2, PAGES, PAGE, H, D), "float8_e4m3fn"),
                    layer=_array((), "int32", "cpu")),
     "layer: expected device cuda:0 (that of the caches), got cpu"),
    ("dequantize-dynamic-scale-device",
     lambda: check_dequantize(_array((PAGES, PAGE, H, D), "float8_e4m3fn"),
                              _array((PAGES, PAGE, H, D), "float8_e4m3fn"),
                              _array((1, PAGES), "int32"), key_scale_cache=_moved(TOKEN_HEAD),
                              value_scale_cache=TOKEN_HEAD, dtype="bfloat16", layout="NHD",
                              fp8_format=None, null_page=None),
     "key_scale_cache: expected device cuda:0 (that of the cache), got cuda:1"),
    ("rope-cos-sin-negative-stride",
     lambda: _rope(cos_sin_cache=_flipped(_array((64, D), "float32"))),
     "cos_sin_cache: expected non-negative strides, got [-32, 1]"),
    ("rope-query-out-device", lambda: _rope(query_out=_moved(QUERY_OUT)),
     "query_out: expected device cuda:0, got cuda:1"),
    ("rope-query-out-negative-stride", lambda: _rope(query_out=_flipped(QUERY_OUT, 1)),
     "query_out: expected non-negative strides, got [128, -32, 1]"),
    ("rope-key-out-device", lambda: _rope(key_out=_moved(KEY_OUT)),
     "key_out: expected device cuda:0, got cuda:1"),
    ("rope-key-out-dtype", lambda: _rope(key_out=_array((T, H, D), "float16")),
     "key_out: expected dtype bfloat16, got float16"),
]


@pytest.mark.parametrize("call, message", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_array_check_names_argument_expected_and_actual(call, message):
    with pytest.raises((ValueError, TypeError), match=f"^{re.escape(message)}$"):
        call()


def test_valid_descriptions_pass():
    """The same calls without the defect are accepted: each case above fails on its one change."""
    _write(key_scale_cache=TOKEN_HEAD, value_scale_cache=TOKEN_HEAD)
    _write_nvfp4()
    _rope(query_out=QUERY_OUT, key_out=KEY_OUT)
