"""A call fails the same way every time, whatever calls came before it.

``True == 1 == 1.0`` and they hash alike, so a cache keyed on argument values alone would serve a
call with ``True`` the launch that a call with ``1.0`` made (and skip the validation that rejects
a bool). For every non-tensor option of every public function: the error of a first call with a
bad value (on empty caches) must be the error of the 1st, 2nd and 100th such call after warm-up
calls with a good value -- the good value being, where one exists, one that compares equal to the
bad one.
"""
from __future__ import annotations

import numpy as np
import pytest

HEADS, HEAD_DIM = 2, 16

# (function, option, good value, bad value): the good value is passed on every warm-up call.
OPTIONS = [
    ("write_kv", "key_scale", 1.0, True),
    ("write_kv", "value_scale", 1.0, True),
    ("write_kv", "key_scale", 1, True),
    ("write_kv", "layout", "NHD", "nhd"),
    ("write_kv", "fp8_format", None, 0),
    ("write_kv", "key_scale_cache", None, False),
    ("write_kv", "value_scale_cache", None, 0),
    ("write_kv", "scale_rounding", "exact", "Exact"),
    ("write_kv", "check_bounds", False, 0),
    ("write_kv_combined", "key_scale", 1.0, True),
    ("write_kv_combined", "check_bounds", False, 0),
    ("dequantize_pages", "key_scale", 1.0, True),
    ("dequantize_pages", "value_scale", 1.0, True),
    ("dequantize_pages", "null_page", 0, False),
    ("dequantize_pages", "null_page", 1, 1.0),
    ("dequantize_pages", "head_dim", HEAD_DIM, float(HEAD_DIM)),
    ("dequantize_pages", "layout", "NHD", "nhd"),
    ("dequantize_pages", "fp8_format", None, False),
    ("dequantize_pages", "check_bounds", False, 0),
    ("dequantize_pages_combined", "null_page", 0, False),
    ("dequantize_pages_combined", "value_scale", 1.0, True),
    ("write_kv", "cache_format", None, 0),
    ("write_kv_combined", "cache_format", "e4m3", False),
    ("dequantize_pages", "cache_format", None, 0),
    ("dequantize_pages", "out_scale", None, True),
]


def _ids(option):
    fn, name, good, bad = option
    return f"{fn}-{name}-{good!r}-then-{bad!r}"


def _arrays(np_to):
    """The tensor arguments of each function, made by ``np_to`` (NumPy -> frontend array)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((3, HEADS, HEAD_DIM)).astype(np.float32)
    cache = np.zeros((4, 4, HEADS, HEAD_DIM), np.uint8)
    slots = np.array([0, 5, 9], np.int32)
    table = np.array([[0, 2]], np.int32)
    return {
        "write_kv": (np_to(x), np_to(x), np_to(cache), np_to(cache.copy()), np_to(slots)),
        "write_kv_combined": (np_to(x), np_to(x), np_to(np.stack([cache, cache], 1)),
                              np_to(slots)),
        "dequantize_pages": (np_to(cache), np_to(cache.copy()), np_to(table)),
        "dequantize_pages_combined": (np_to(np.stack([cache, cache], 1)), np_to(table)),
    }


def _error(call):
    try:
        call()
    except Exception as e:   # noqa: BLE001 -- which exception is what is compared
        return type(e), str(e)
    return None


def _check(frontend, arrays, clear, option):
    fn_name, name, good, bad = option
    fn = getattr(frontend, fn_name)
    args = arrays[fn_name]
    clear()
    first = _error(lambda: fn(*args, **{name: bad}))
    assert first is not None and first[0] in (TypeError, ValueError), first
    for _ in range(3):   # warm-up: validated, by the key, by the last-call check
        fn(*args, **{name: good})
    seen = [_error(lambda: fn(*args, **{name: bad})) for _ in range(100)]
    assert seen[0] == seen[1] == seen[99] == first
    assert set(seen) == {first}


@pytest.mark.parametrize("option", OPTIONS, ids=_ids)
def test_torch_fails_the_same_after_equal_values_of_another_type(option, device):
    pytest.importorskip("torch")
    import fp8kv_torch
    from fp8kv_torch import _launch
    from tests.helpers import to_torch

    _check(fp8kv_torch, _arrays(lambda a: to_torch(a, device)), _launch.clear_launch_caches,
           option)


@pytest.mark.parametrize("option", OPTIONS, ids=_ids)
def test_jax_fails_the_same_after_equal_values_of_another_type(option):
    jnp = pytest.importorskip("jax.numpy")
    import fp8kv_jax

    _check(fp8kv_jax, _arrays(jnp.asarray), lambda: None, option)
