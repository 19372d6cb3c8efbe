"""NVFP4 caches (docs/SPEC.md section 13), JAX: fp8kv_jax against fp8kv.reference, byte for byte.

The jnp path (CPU; any device under ``jax.default_device``), the GPU launch glue run by the
interpreter stand-in for jax-triton (tests/jax_glue.py), jax-triton itself on an NVIDIA GPU
(tests marked ``gpu``), donation under ``jax.jit``, and the validation errors. No torch needed.
"""
from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")  # the optional framework under test
import jax.numpy as jnp  # noqa: E402

import fp8kv_jax  # noqa: E402
from tests.cases import as_uint  # noqa: E402
from tests.nvfp4_cases import CASES, NvCase, inputs, ref_write  # noqa: E402
from fp8kv import reference as ref  # noqa: E402

ON_GPU = jax.default_backend() == "gpu"
NOT_GPU_REASON = ("needs JAX on an NVIDIA GPU (the jax-triton path); JAX's backend here is "
                  f"{jax.default_backend()}")
PLATFORMS = [pytest.param("cpu", marks=pytest.mark.jnp),   # XLA:CPU arrays: the jnp path
             pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
                 not ON_GPU, reason=NOT_GPU_REASON)])]
JAX_CASES = [CASES[0], CASES[2], CASES[3]]


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):   # whole arrays: untouched poison bytes compared too
        np.testing.assert_array_equal(as_uint(np.asarray(g)), as_uint(np.asarray(w)))


def round_trip(case, x):
    """Write, then dequantize to bf16 and to an FP8 workspace: each against the reference."""
    scales = {n: (jnp.asarray(x[n]) if isinstance(x[n], np.ndarray) else x[n])
              for n in ("key_scale", "value_scale")}
    got = fp8kv_jax.write_kv(x["key"], x["value"], x["key_cache"], x["value_cache"],
                             x["slots"].astype(np.int32), **scales, layout=case.api_layout,
                             key_scale_cache=x["key_scale_cache"],
                             value_scale_cache=x["value_scale_cache"], cache_format="nvfp4")
    want = ref_write(case, x)
    assert_same(got, want)
    table = np.array([[1, -1, 0], [case.pages - 1, case.pages + 3, 0]], np.int32)
    for out, out_scale in (("bfloat16", None), ("float32", None), ("float8_e4m3fn", 0.25),
                           ("float8_e4m3fn", np.float32(0.37))):
        pages = fp8kv_jax.dequantize_pages(
            *got[:2], table, **scales, layout=case.api_layout, key_scale_cache=got[2],
            value_scale_cache=got[3], cache_format="nvfp4", dtype=out, out_scale=out_scale,
            null_page=0)
        assert_same(pages, ref.dequantize_pages(
            *want[:2], table, x["key_scale"], x["value_scale"], layout=case.api_layout,
            key_scale_cache=want[2], value_scale_cache=want[3], cache_format="nvfp4", dtype=out,
            out_scale=out_scale, null_page=0))
    return got


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("case", JAX_CASES, ids=lambda c: c.id)
def test_write_and_dequantize_match_reference(case, platform):
    with jax.default_device(jax.devices(platform)[0]):
        round_trip(case, inputs(case))


@pytest.mark.parametrize("case", JAX_CASES[:2], ids=lambda c: c.id)
def test_gpu_launch_in_interpreter(case, monkeypatch):
    from tests.jax_glue import use_interpreted_gpu_path
    use_interpreted_gpu_path(monkeypatch)
    with jax.default_device(jax.devices("cpu")[0]):
        round_trip(case, inputs(case))


def test_combined_cache():
    rng = np.random.default_rng(4)
    tokens, h, d, pages, ps = 5, 2, 32, 3, 4
    kv = rng.integers(0, 256, size=(pages, 2, ps, h, d // 2), dtype=np.uint8)
    kb, vb = (rng.integers(0, 256, size=(pages, ps, h, d // 16), dtype=np.uint8) for _ in range(2))
    key, value = (rng.standard_normal((tokens, h, d)).astype(jnp.bfloat16) for _ in range(2))
    slots = np.array([3, -1, 0, 11, 7], np.int32)
    with jax.default_device(jax.devices("cpu")[0]):
        got = fp8kv_jax.write_kv_combined(key, value, kv, slots, 0.01, 0.02, key_scale_cache=kb,
                                          value_scale_cache=vb, cache_format="nvfp4")
        pages_out, _ = fp8kv_jax.dequantize_pages_combined(
            got[0], np.array([[2, 0]], np.int32), 0.01, 0.02, key_scale_cache=got[1],
            value_scale_cache=got[2], cache_format="nvfp4")
    wk, wv, wkb, wvb = ref.write_kv(key, value, kv[:, 0], kv[:, 1], slots, 0.01, 0.02,
                                    key_scale_cache=kb, value_scale_cache=vb, cache_format="nvfp4")
    assert_same([np.asarray(got[0])[:, 0], np.asarray(got[0])[:, 1], got[1], got[2]],
                [wk, wv, wkb, wvb])
    rk, rv, _ = ref.dequantize_pages(wk, wv, np.array([[2, 0]], np.int32), 0.01, 0.02,
                                     key_scale_cache=wkb, value_scale_cache=wvb,
                                     cache_format="nvfp4")
    assert_same([np.asarray(pages_out)[:, 0], np.asarray(pages_out)[:, 1]], [rk, rv])


def test_donated_caches_under_jit():
    case = NvCase(tokens=4, heads=2, head_dim=32, page_size=4)
    x = inputs(case)
    want = ref_write(case, x)
    step = jax.jit(functools.partial(fp8kv_jax.write_kv, cache_format="nvfp4"),
                   donate_argnames=("key_cache", "value_cache", "key_scale_cache",
                                    "value_scale_cache"))
    with jax.default_device(jax.devices("cpu")[0]):
        got = step(x["key"], x["value"], x["key_cache"], x["value_cache"],
                   x["slots"].astype(np.int32), x["key_scale"], x["value_scale"],
                   key_scale_cache=x["key_scale_cache"], value_scale_cache=x["value_scale_cache"])
    assert_same(got, want)


def test_errors_are_the_cores():
    k = jnp.zeros((5, 2, 40), jnp.bfloat16)
    cache = jnp.zeros((3, 4, 2, 20), jnp.uint8)
    blocks = jnp.zeros((3, 4, 2, 2), jnp.uint8)
    with pytest.raises(ValueError, match=r"key: expected a head_dim that is a multiple of 16"):
        fp8kv_jax.write_kv(k, k, cache, cache, jnp.arange(5), key_scale_cache=blocks,
                           value_scale_cache=blocks, cache_format="nvfp4")
    with pytest.raises(ValueError, match=r"fp8_format: expected 'e4m3', 'e5m2' or None \(name it "
                                         r"with cache_format='nvfp4'\)"):
        fp8kv_jax.write_kv(k, k, cache, cache, jnp.arange(5), fp8_format="nvfp4")
    cache = jnp.zeros((3, 4, 2, 32), jnp.uint8)
    blocks = jnp.zeros((3, 4, 2, 4), jnp.uint8)
    table = jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match=r"out_scale: expected None unless dtype is float8_e4m3fn"):
        fp8kv_jax.dequantize_pages(cache, cache, table, key_scale_cache=blocks,
                                   value_scale_cache=blocks, cache_format="nvfp4", out_scale=2.0)
    with pytest.raises(TypeError, match=r"key_scale_cache: expected dtype float8_e4m3fn or uint8"):
        fp8kv_jax.dequantize_pages(cache, cache, table, key_scale_cache=blocks.astype(jnp.float32),
                                   value_scale_cache=blocks, cache_format="nvfp4")
