"""MXFP8 caches (docs/SPEC.md section 13a), JAX: fp8kv_jax against fp8kv.reference, byte for byte.

The jnp path (CPU; any device under ``jax.default_device``), the GPU launch glue run by the
interpreter stand-in for jax-triton and for XLA's Triton call (tests/jax_glue.py: the interpreter
then runs inside an XLA:CPU callback, whose thread flushes subnormals -- which the kernels' exact
path must not see), jax-triton itself on an NVIDIA GPU (tests marked ``gpu``), stacked and
combined caches, donation under ``jax.jit``, and the validation errors. No torch needed.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")  # the optional framework under test
import jax.numpy as jnp  # noqa: E402

import fp8kv_jax  # noqa: E402
from tests.cases import as_uint  # noqa: E402
from tests.mxfp8_cases import CASES, MxCase, inputs, ref_write, table  # noqa: E402
from fp8kv import reference as ref  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
NOT_GPU_REASON = ("needs JAX on an NVIDIA GPU (the jax-triton path); JAX's backend here is "
                  f"{jax.default_backend()}")
GPU = [pytest.mark.gpu, pytest.mark.skipif(not ON_GPU, reason=NOT_GPU_REASON)]
# The jnp path is quick: a few cases on the CPU; every case on a GPU.
JAX_CASES = [pytest.param("cpu", c, marks=pytest.mark.jnp, id=f"cpu-{c.id}") for c in CASES[:2]]
JAX_CASES += [pytest.param("gpu", c, marks=GPU, id=f"gpu-{c.id}") for c in CASES]


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):   # whole arrays: untouched poison bytes compared too
        np.testing.assert_array_equal(as_uint(np.asarray(g)), as_uint(np.asarray(w)))


def round_trip(case, x, outs=("bfloat16", "float16", "float32")):
    """Write, then dequantize the written caches and the poisoned ones: each against the
    reference."""
    got = fp8kv_jax.write_kv(x["key"], x["value"], x["key_cache"], x["value_cache"],
                             x["slots"].astype(np.int32), layout=case.api_layout,
                             key_scale_cache=x["key_scale_cache"],
                             value_scale_cache=x["value_scale_cache"], cache_format="mxfp8")
    want = ref_write(case, x)
    assert_same(got, want)
    poisoned = [x[n] for n in ("key_cache", "value_cache", "key_scale_cache",
                               "value_scale_cache")]
    for out in outs:
        for have, expect in ((got, want), (poisoned, poisoned)):
            pages = fp8kv_jax.dequantize_pages(
                *have[:2], table(case), layout=case.api_layout, key_scale_cache=have[2],
                value_scale_cache=have[3], cache_format="mxfp8", dtype=out, null_page=0)
            assert_same(pages, ref.dequantize_pages(
                *expect[:2], table(case), layout=case.api_layout, key_scale_cache=expect[2],
                value_scale_cache=expect[3], cache_format="mxfp8", dtype=out, null_page=0))
    return got


@pytest.mark.parametrize("platform,case", JAX_CASES)
def test_write_and_dequantize_match_reference(platform, case):
    outs = ("bfloat16", "float16", "float32") if platform == "gpu" else (
        ("bfloat16",) if case.dtype == "bfloat16" else ("float32",))   # fp16: every code below
    with jax.default_device(jax.devices(platform)[0]):
        round_trip(case, inputs(case), outs)


@pytest.mark.parametrize("path", ["jax-triton", "xla"])
def test_gpu_launch_in_interpreter(path, monkeypatch):
    """The Triton paths' launches, interpreted (subnormal inputs and outputs included: the
    special blocks)."""
    from tests.jax_glue import use_interpreted_gpu_path, use_interpreted_xla_path
    (use_interpreted_gpu_path if path == "jax-triton" else use_interpreted_xla_path)(monkeypatch)
    case = CASES[0] if path == "jax-triton" else CASES[1]
    with jax.default_device(jax.devices("cpu")[0]):
        round_trip(case, inputs(case), outs=("bfloat16", "float32"))


@pytest.mark.jnp
def test_every_code_with_every_scale():
    codes = np.tile(np.arange(256, dtype=np.uint8), (256, 1)).reshape(1, 256, 1, 256)
    scales = np.repeat(np.arange(256, dtype=np.uint8), 8).reshape(1, 256, 1, 8)
    tab = np.zeros((1, 1), np.int32)
    with jax.default_device(jax.devices("cpu")[0]):
        for out in ("float32", "bfloat16", "float16"):
            got = fp8kv_jax.dequantize_pages(codes, codes, tab, key_scale_cache=scales,
                                             value_scale_cache=scales, cache_format="mxfp8",
                                             dtype=out)
            assert_same(got, ref.dequantize_pages(codes, codes, tab, key_scale_cache=scales,
                                                  value_scale_cache=scales,
                                                  cache_format="mxfp8", dtype=out))


@pytest.mark.jnp
def test_combined_cache():
    rng = np.random.default_rng(4)
    tokens, h, d, pages, ps = 5, 2, 64, 3, 4
    kv = rng.integers(0, 256, size=(pages, 2, ps, h, d), dtype=np.uint8)
    kb, vb = (rng.integers(0, 256, size=(pages, ps, h, d // 32), dtype=np.uint8) for _ in range(2))
    key, value = (rng.standard_normal((tokens, h, d)).astype(jnp.bfloat16) for _ in range(2))
    slots = np.array([3, -1, 0, 11, 7], np.int32)
    with jax.default_device(jax.devices("cpu")[0]):
        got = fp8kv_jax.write_kv_combined(key, value, kv, slots, key_scale_cache=kb,
                                          value_scale_cache=vb, cache_format="mxfp8")
        pages_out, _ = fp8kv_jax.dequantize_pages_combined(
            got[0], np.array([[2, 0]], np.int32), key_scale_cache=got[1],
            value_scale_cache=got[2], cache_format="mxfp8")
    wk, wv, wkb, wvb = ref.write_kv(key, value, kv[:, 0], kv[:, 1], slots, key_scale_cache=kb,
                                    value_scale_cache=vb, cache_format="mxfp8")
    assert_same([np.asarray(got[0])[:, 0], np.asarray(got[0])[:, 1], got[1], got[2]],
                [wk, wv, wkb, wvb])
    rk, rv, _ = ref.dequantize_pages(wk, wv, np.array([[2, 0]], np.int32), key_scale_cache=wkb,
                                     value_scale_cache=wvb, cache_format="mxfp8")
    assert_same([np.asarray(pages_out)[:, 0], np.asarray(pages_out)[:, 1]], [rk, rv])


@pytest.mark.jnp
@pytest.mark.parametrize("layer", ["array", 5])
def test_stacked_caches(layer):
    case = MxCase(tokens=3, heads=2, head_dim=64, page_size=2, layout="HND")
    x = inputs(case, seed=2)
    stacks = {n: np.stack([x[n]] * 3) for n in ("key_cache", "value_cache", "key_scale_cache",
                                                 "value_scale_cache")}
    arg = jnp.int32(2) if layer == "array" else layer
    index = 2 if layer == "array" else layer
    s = {**x, **stacks}
    with jax.default_device(jax.devices("cpu")[0]):
        got = fp8kv_jax.write_kv(s["key"], s["value"], s["key_cache"], s["value_cache"],
                                 s["slots"].astype(np.int32), layout="HND",
                                 key_scale_cache=s["key_scale_cache"],
                                 value_scale_cache=s["value_scale_cache"], cache_format="mxfp8",
                                 layer=arg)
        want = ref.write_kv(**s, layout="HND", cache_format="mxfp8", layer=index)
        assert_same(got, want)
        pages = fp8kv_jax.dequantize_pages(*got[:2], table(case), layout="HND",
                                           key_scale_cache=got[2], value_scale_cache=got[3],
                                           cache_format="mxfp8", layer=arg, dtype="float32")
    assert_same(pages, ref.dequantize_pages(*want[:2], table(case), layout="HND",
                                            key_scale_cache=want[2], value_scale_cache=want[3],
                                            cache_format="mxfp8", layer=index, dtype="float32"))


@pytest.mark.jnp
def test_donated_caches_under_jit():
    case = MxCase(tokens=4, heads=2, head_dim=32, page_size=4)
    x = inputs(case)
    want = ref_write(case, x)
    step = jax.jit(functools.partial(fp8kv_jax.write_kv, cache_format="mxfp8"),
                   donate_argnames=("key_cache", "value_cache", "key_scale_cache",
                                    "value_scale_cache"))
    with jax.default_device(jax.devices("cpu")[0]):
        got = step(x["key"], x["value"], x["key_cache"], x["value_cache"],
                   x["slots"].astype(np.int32), key_scale_cache=x["key_scale_cache"],
                   value_scale_cache=x["value_scale_cache"])
    assert_same(got, want)


def test_errors_are_the_cores():
    k = jnp.zeros((5, 2, 48), jnp.bfloat16)
    cache = jnp.zeros((3, 4, 2, 48), jnp.uint8)
    blocks = jnp.zeros((3, 4, 2, 1), jnp.uint8)
    with pytest.raises(ValueError, match=r"key: expected a head_dim that is a multiple of 32"):
        fp8kv_jax.write_kv(k, k, cache, cache, jnp.arange(5), key_scale_cache=blocks,
                           value_scale_cache=blocks, cache_format="mxfp8")
    k = jnp.zeros((5, 2, 64), jnp.bfloat16)
    cache = jnp.zeros((3, 4, 2, 64), jnp.float8_e4m3fn)
    blocks = jnp.zeros((3, 4, 2, 2), jnp.uint8)
    with pytest.raises(ValueError, match=r"value_scale: expected None when value_scale_cache is "
                                         r"given"):
        fp8kv_jax.write_kv(k, k, cache, cache, jnp.arange(5), value_scale=0.5,
                           key_scale_cache=blocks, value_scale_cache=blocks, cache_format="mxfp8")
    with pytest.raises(ValueError, match=r"key_scale_cache: expected an array \[3, 4, 2, 2\] of "
                                         r"uint8 .*got shape \[3, 4, 2, 4\]"):
        fp8kv_jax.write_kv(k, k, cache, cache, jnp.arange(5),
                           key_scale_cache=jnp.zeros((3, 4, 2, 4), jnp.uint8),
                           value_scale_cache=blocks, cache_format="mxfp8")
    table_ = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(TypeError, match=r"key_scale_cache: expected dtype uint8, got float32"):
        fp8kv_jax.dequantize_pages(cache, cache, table_, key_scale_cache=blocks.astype(jnp.float32),
                                   value_scale_cache=blocks, cache_format="mxfp8")
    with pytest.raises(ValueError, match=r"key_scale: expected None when key_scale_cache"):
        fp8kv_jax.dequantize_pages(cache, cache, table_, 2.0, key_scale_cache=blocks,
                                   value_scale_cache=blocks, cache_format="mxfp8")

