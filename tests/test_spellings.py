"""One set of spellings in both frontends (:mod:`fp8kv.spelling`): the same dtype strings beside
each framework's dtype objects, the same errors, and ``check_bounds`` a bool in every public
function. Each frontend's cases run where its framework is installed (the JAX-only leg has no
torch)."""
from __future__ import annotations

import doctest

import numpy as np
import pytest

import fp8kv.spelling
from fp8kv.spelling import OUTPUT_DTYPES, check_flag, output_dtype_name

BAD_DTYPE = ("dtype: expected one of 'bfloat16', 'float16', 'float32', 'float8_e4m3fn' (a "
             "string, or the framework's dtype of one), got ")
CODES = np.arange(4 * 4 * 1 * 16, dtype=np.uint8).reshape(4, 4, 1, 16) % 0x70   # finite e4m3
TABLE = np.array([[2, -1, 0]], dtype=np.int32)


def test_core_doctests():
    result = doctest.testmod(fp8kv.spelling)
    assert result.attempted >= 4 and result.failed == 0


@pytest.mark.parametrize("value", [True, False])
def test_check_flag_takes_bools(value):
    assert check_flag(value, "check_bounds") is value


@pytest.mark.parametrize("value, kind", [("yes", "str"), (1, "int"), (None, "NoneType"),
                                         (np.bool_(True), "bool_?")])
def test_check_flag_rejects_the_rest(value, kind):
    with pytest.raises(TypeError, match=rf"^check_bounds: expected a bool, got {kind} \("):
        check_flag(value, "check_bounds")


def test_output_dtype_name():
    for name in OUTPUT_DTYPES:
        assert output_dtype_name(name, lambda d: None) == name
        assert output_dtype_name(object(), lambda d: name) == name
    for bad in ("bf16", "float64", "int8", ""):
        with pytest.raises(TypeError) as e:
            output_dtype_name(bad, lambda d: None)
        assert str(e.value) == BAD_DTYPE + repr(bad)
    with pytest.raises(TypeError, match="got 3$"):
        output_dtype_name(3, lambda d: None)
    float64 = _Dtype("float64")   # a framework dtype of a name outside the list: named by the
    with pytest.raises(TypeError) as e:   # core's name, the same in both frontends
        output_dtype_name(float64, lambda d: d.name)
    assert str(e.value) == BAD_DTYPE + "'float64'"


class _Dtype:
    def __init__(self, name):
        self.name = name

    def __repr__(self):
        return f"Dtype({self.name})"


# ---------------------------------------------------------------------------------------------
# The frontends. Each case is (frontend module, array maker, its dtype objects by name).

def _torch():
    torch = pytest.importorskip("torch")
    import fp8kv_torch
    return fp8kv_torch, torch.from_numpy, {n: getattr(torch, n) for n in OUTPUT_DTYPES}


def _jax():
    pytest.importorskip("jax")
    import jax.numpy as jnp

    import fp8kv_jax
    return fp8kv_jax, jnp.asarray, {n: getattr(jnp, n) for n in OUTPUT_DTYPES}


FRONTENDS = {"torch": _torch, "jax": _jax}


def _host(x) -> np.ndarray:
    """The bytes of an array or tensor (bf16 included), for byte equality."""
    if hasattr(x, "cpu"):   # torch
        import torch
        return x.cpu().contiguous().view(torch.uint8).numpy().copy()
    return np.asarray(x).view(np.uint8).copy()


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("name", [n for n in OUTPUT_DTYPES if n != "float8_e4m3fn"])  # FP8 caches
def test_dtype_string_equals_dtype_object(frontend, name):
    mod, array, dtypes = FRONTENDS[frontend]()
    cache, table = array(CODES.copy()), array(TABLE)
    by_object = mod.dequantize_pages(cache, cache, table, 0.5, 0.25, dtype=dtypes[name])
    by_name = mod.dequantize_pages(cache, cache, table, 0.5, 0.25, dtype=name)
    assert str(by_name[0].dtype).removeprefix("torch.") == name
    for a, b in zip(by_object, by_name):
        assert a.shape == b.shape and np.array_equal(_host(a), _host(b))
    combined = array(np.stack([CODES, CODES], axis=1))
    pages, _ = mod.dequantize_pages_combined(combined, table, dtype=name)
    assert str(pages.dtype).removeprefix("torch.") == name


def test_jax_takes_numpy_dtypes():
    mod, array, _ = _jax()
    cache, table = array(CODES.copy()), array(TABLE)
    k, _, _ = mod.dequantize_pages(cache, cache, table, dtype=np.dtype("float16"))
    assert k.dtype == np.float16
    k, _, _ = mod.dequantize_pages(cache, cache, table, dtype=np.float32)
    assert k.dtype == np.float32


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("bad", ["bf16", "float64", "torch.bfloat16", None, 3])
def test_bad_dtype_same_error(frontend, bad):
    """Strings and non-dtypes give the very same message in both frontends."""
    mod, array, _ = FRONTENDS[frontend]()
    cache, table = array(CODES.copy()), array(TABLE)
    for call in (lambda: mod.dequantize_pages(cache, cache, table, dtype=bad),
                 lambda: mod.dequantize_pages_combined(array(np.stack([CODES] * 2, axis=1)),
                                                       table, dtype=bad)):
        with pytest.raises(TypeError) as e:
            call()
        assert str(e.value) == BAD_DTYPE + repr(bad)


@pytest.mark.parametrize("frontend", FRONTENDS)
def test_other_framework_dtype_objects(frontend):
    """A dtype object of a name outside the list (int8, float64) is refused, the list given."""
    mod, array, _ = FRONTENDS[frontend]()
    cache, table = array(CODES.copy()), array(TABLE)
    wrong = getattr(__import__("torch" if frontend == "torch" else "jax.numpy",
                               fromlist=["int8"]), "int8")
    with pytest.raises(TypeError, match=r"^dtype: expected one of 'bfloat16', 'float16', "
                                        r"'float32', 'float8_e4m3fn' \(a string, or the "
                                        r"framework's dtype of one\), got 'int8'$"):
        mod.dequantize_pages(cache, cache, table, dtype=wrong)


def _write_args(array):
    key = array(np.ones((2, 1, 16), np.float32))
    cache = array(np.zeros((4, 4, 1, 16), np.uint8))
    return key, cache, array(np.array([1, 6]))


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("bad, kind", [("yes", "str"), (1, "int"), (None, "NoneType"),
                                       ("False", "str")])
def test_check_bounds_must_be_a_bool(frontend, bad, kind):
    """Every public function that takes check_bounds refuses a non-bool, before writing."""
    mod, array, _ = FRONTENDS[frontend]()
    key, cache, slots = _write_args(array)
    combined = array(np.zeros((4, 2, 4, 1, 16), np.uint8))
    codes, table = array(CODES.copy()), array(TABLE)
    positions, cos_sin = array(np.array([0, 1])), array(np.ones((4, 16), np.float32))
    calls = {
        "write_kv": lambda: mod.write_kv(key, key, cache, cache, slots, check_bounds=bad),
        "write_kv_combined": lambda: mod.write_kv_combined(key, key, combined, slots,
                                                           check_bounds=bad),
        "dequantize_pages": lambda: mod.dequantize_pages(codes, codes, table, check_bounds=bad),
        "dequantize_pages_combined": lambda: mod.dequantize_pages_combined(
            array(np.stack([CODES] * 2, axis=1)), table, check_bounds=bad),
        "rope_write_kv": lambda: mod.rope_write_kv(key, key, key, cache, cache, slots, positions,
                                                   cos_sin, check_bounds=bad),
        "rope_write_kv_combined": lambda: mod.rope_write_kv_combined(
            key, key, key, combined, slots, positions, cos_sin, check_bounds=bad),
        "paged_attention": lambda: mod.paged_attention(key, cache, cache, table, slots,
                                                       check_bounds=bad),
        "paged_attention_combined": lambda: mod.paged_attention_combined(
            key, combined, table, slots, check_bounds=bad),
    }
    assert set(calls) == {name for name in mod.__all__ if not isinstance(getattr(mod, name), type)}
    for name, call in calls.items():
        with pytest.raises(TypeError) as e:
            call()
        assert str(e.value) == f"check_bounds: expected a bool, got {kind} ({bad!r})", name
    assert not _host(cache).any() and not _host(combined).any()   # nothing written


@pytest.mark.parametrize("frontend", FRONTENDS)
@pytest.mark.parametrize("flag", [True, False])
def test_check_bounds_bools_still_work(frontend, flag):
    mod, array, _ = FRONTENDS[frontend]()
    key, cache, slots = _write_args(array)
    out = mod.write_kv(key, key, cache, cache, slots, 1.0, 1.0, check_bounds=flag)
    written = _host(cache if out is None else out[0])
    assert written.reshape(16, 16)[6].tolist() == [0x38] * 16   # 1.0 in e4m3 at slot 6
