"""fp8kv_jax against the NumPy reference, byte for byte: the jnp path on CPU, jax-triton on a GPU.

Every case of tests/cases.py runs through the public API (whole poisoned caches are compared), plus
combined caches, every 16-bit input pattern and every fp8 code, jit with donation and traced
arguments, shard_map over kv heads and property tests (bad inputs: tests/test_bad_inputs.py).
Tests marked ``gpu`` need JAX on an NVIDIA GPU (with jax-triton) and are skipped, with that
reason, elsewhere.
"""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

jax = pytest.importorskip("jax")  # the optional framework under test
import jax.numpy as jnp  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fp8kv_jax  # noqa: E402
from tests.cases import (DEQUANT_CASES, WRITE_CASES, DequantCase, WriteCase, as_uint,  # noqa: E402
                         dequant_inputs, random_values, write_inputs)
from fp8kv import reference  # noqa: E402
from fp8kv.formats import FORMATS  # noqa: E402
from fp8kv.reference import np_dtype  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ON_GPU = jax.default_backend() == "gpu"
NOT_GPU_REASON = "needs JAX on an NVIDIA GPU (the jax-triton path); JAX's backend here is " + \
    jax.default_backend()


def gpu_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not ON_GPU, reason=NOT_GPU_REASON)(fn))


# The CPU variant always runs; on a GPU machine it pins JAX to its CPU device (the jnp path).
PLATFORMS = ["cpu", pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not ON_GPU, reason=NOT_GPU_REASON)])]


def to_jax(inputs: dict) -> dict:
    """NumPy arrays -> JAX arrays (int64 stays int64 only under ``jax.enable_x64``)."""
    return {k: jnp.asarray(v) if isinstance(v, np.ndarray) else v for k, v in inputs.items()}


def assert_same_bits(got, want):
    got = np.asarray(got)
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    np.testing.assert_array_equal(as_uint(got), as_uint(want))


def write_kwargs(case):
    return dict(layout=case.api_layout, fp8_format=case.fp8_format)


def dequant_kwargs(case):
    return dict(layout=case.api_layout, fp8_format=case.fp8_format, null_page=case.null_page)


def subprocess_env(**extra) -> dict:
    """This environment, with the checkout and tests/ first on the path (kept: e.g. jax-triton's)."""
    path = [str(REPO), os.environ.get("PYTHONPATH", "")]
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p), **extra)


def run_python(code: str, **env) -> str:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          env=subprocess_env(**env), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


# ---------------------------------------------------------------------------------------------
# Every shared case, byte for byte against the reference.

@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: c.id)
def test_write_kv(case):
    inputs = write_inputs(case)
    expected = reference.write_kv(**inputs, **write_kwargs(case))
    with jax.enable_x64(case.slots == "int64"):
        args = to_jax(inputs)
        assert args["slots"].dtype == case.slots
        out = fp8kv_jax.write_kv(**args, **write_kwargs(case))
    assert len(out) == 2
    for got, want in zip(out, expected):
        assert_same_bits(got, want)


@pytest.mark.parametrize("case", WRITE_CASES, ids=lambda c: c.id)
def test_write_kv_combined(case):
    inputs = write_inputs(case)
    expected = np.stack(reference.write_kv(**inputs, **write_kwargs(case)), axis=1)
    kv = np.stack([inputs.pop("key_cache"), inputs.pop("value_cache")], axis=1)
    got = fp8kv_jax.write_kv_combined(kv_cache=jnp.asarray(kv), **to_jax(inputs),
                                      **write_kwargs(case))
    assert_same_bits(got, expected)


@pytest.mark.parametrize("case", DEQUANT_CASES, ids=lambda c: c.id)
def test_dequantize_pages(case):
    inputs = dequant_inputs(case)
    expected = reference.dequantize_pages(**inputs, dtype=case.out, **dequant_kwargs(case))
    out = fp8kv_jax.dequantize_pages(**to_jax(inputs), dtype=getattr(jnp, case.out),
                                     **dequant_kwargs(case))
    assert len(out) == 3
    for got, want in zip(out, expected):
        assert_same_bits(got, want)


@pytest.mark.parametrize("case", DEQUANT_CASES, ids=lambda c: c.id)
def test_dequantize_pages_combined(case):
    inputs = dequant_inputs(case)
    k, v, table = reference.dequantize_pages(**inputs, dtype=case.out, **dequant_kwargs(case))
    kv = np.stack([inputs.pop("key_cache"), inputs.pop("value_cache")], axis=1)
    pages, new_table = fp8kv_jax.dequantize_pages_combined(
        jnp.asarray(kv), **to_jax(inputs), dtype=getattr(jnp, case.out), **dequant_kwargs(case))
    assert_same_bits(pages, np.stack([k, v], axis=1))
    assert_same_bits(new_table, table)


# ---------------------------------------------------------------------------------------------
# Exhaustive conversions: every bf16 / fp16 input pattern, every fp8 code.

@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_write_every_16bit_pattern(dtype, fmt):
    x = np.arange(1 << 16, dtype=np.uint16).view(np_dtype(dtype)).reshape(1024, 4, 16)
    inputs = dict(key=x, value=x[::-1].copy(), key_cache=np.zeros(x.shape, np.uint8),
                  value_cache=np.zeros(x.shape, np.uint8), slots=np.arange(1024, dtype=np.int32),
                  key_scale=0.37,  # host float: correctly rounded division by a non-power of 2
                  value_scale=np.array([3.5, 0.1, 1.0, 1 / 3], np.float32))  # per head
    expected = reference.write_kv(**inputs, fp8_format=fmt)
    for got, want in zip(fp8kv_jax.write_kv(**to_jax(inputs), fp8_format=fmt), expected):
        assert_same_bits(got, want)


@pytest.mark.parametrize("out", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_dequantize_every_code(fmt, out):
    codes = np.tile(np.arange(256, dtype=np.uint8), 8).reshape(2, 16, 4, 16)  # NHD, 4 heads
    cache = codes.view(np_dtype(FORMATS[fmt].dtype))
    inputs = dict(key_cache=cache, value_cache=cache[::-1].copy(),
                  block_table=np.array([[1, -1, 0]], np.int32),
                  key_scale=np.array([0.37, 3.5, 2.0 ** -20, 448.0], np.float32),
                  value_scale=np.array(np.inf, np.float32))  # inf * 0 = NaN; padding stays 0
    expected = reference.dequantize_pages(**inputs, dtype=out)
    for got, want in zip(fp8kv_jax.dequantize_pages(**to_jax(inputs), dtype=out), expected):
        assert_same_bits(got, want)


# ---------------------------------------------------------------------------------------------
# jit: donation, traced arguments, no retracing per content.

@pytest.mark.parametrize("platform", PLATFORMS)
def test_jit_donated_write_is_in_place(platform):
    device = jax.devices(platform)[0]
    case = WriteCase(tokens=9, heads=2, head_dim=64, page_size=16, scale="head", slots="int32")
    inputs = write_inputs(case)
    expected = reference.write_kv(**inputs)
    with jax.default_device(device):
        args = {k: jax.device_put(v, device) for k, v in to_jax(inputs).items()}
        key_cache, value_cache = args.pop("key_cache"), args.pop("value_cache")
        pointers = key_cache.unsafe_buffer_pointer(), value_cache.unsafe_buffer_pointer()
        step = jax.jit(fp8kv_jax.write_kv, donate_argnames=("key_cache", "value_cache"))
        out = step(key_cache=key_cache, value_cache=value_cache, **args)
        jax.block_until_ready(out)
    assert key_cache.is_deleted() and value_cache.is_deleted()
    assert tuple(c.unsafe_buffer_pointer() for c in out) == pointers
    for got, want in zip(out, expected):
        assert_same_bits(got, want)


def test_jit_traces_once_per_shape():
    """Slots, block tables and scales are traced: new contents reuse the compiled program."""
    traces = []

    @jax.jit
    def step(key, key_cache, slots, scale, block_table):
        traces.append(None)
        key_cache, _ = fp8kv_jax.write_kv(key, key, key_cache, key_cache, slots, scale, scale)
        return fp8kv_jax.dequantize_pages(key_cache, key_cache, block_table, scale, scale,
                                          dtype=jnp.float32)

    rng = np.random.default_rng(1)
    case = DequantCase(batch=2, pages_per_seq=3, heads=2, head_dim=16, page_size=4, num_pages=6)
    key = random_values(rng, (5, 2, 16), "bfloat16")
    cache = dequant_inputs(case)["key_cache"]
    for seed in range(3):
        rng = np.random.default_rng(seed)
        slots = rng.permutation(24)[:5].astype(np.int32)
        scale = np.float32(rng.random() + 0.5)
        table = rng.integers(-1, 6, size=(2, 3)).astype(np.int32)
        written, _ = reference.write_kv(key, key, cache, cache, slots, scale, scale)
        expected = reference.dequantize_pages(written, written, table, scale, scale,
                                              dtype="float32")
        got = step(key, cache, slots, scale, table)
        for g, want in zip(got, expected):
            assert_same_bits(g, want)
    assert len(traces) == 1


def scales(heads):
    """None, a host float, or an fp32 array ([], [1] or [heads]), in [2^-6, 2^6].

    XLA:CPU flushes fp32 subnormal results to zero: scales stay far from making any.
    """
    value = st.floats(2.0 ** -6, 2.0 ** 6, width=32)
    array = functools.partial(np.array, dtype=np.float32)
    return st.one_of(st.none(), value, value.map(array),
                     st.lists(value, min_size=1, max_size=1).map(array),
                     st.lists(value, min_size=heads, max_size=heads).map(array))


def draw_cache(data, max_pages):
    """(cache shape, API layout, num_kv_heads, head_dim, page_size) of a small random cache."""
    layout = data.draw(st.sampled_from(["NHD", "HND", "3D"]), "layout")
    heads = data.draw(st.integers(1, 3), "heads")
    head_dim = data.draw(st.sampled_from([1, 3, 8]), "head_dim")
    page_size = 1 if layout == "3D" else data.draw(st.integers(1, 4), "page_size")
    pages = data.draw(st.integers(0, max_pages), "num_pages")
    shape = {"NHD": (pages, page_size, heads, head_dim), "HND": (pages, heads, page_size, head_dim),
             "3D": (pages, heads, head_dim)}[layout]
    return shape, "NHD" if layout == "3D" else layout, heads, head_dim, page_size


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_write_kv_property(data):
    shape, layout, heads, head_dim, page_size = draw_cache(data, max_pages=3)
    num_slots, tokens = shape[0] * page_size, data.draw(st.integers(0, 6), "tokens")
    drawn = data.draw(st.lists(st.integers(-3, num_slots + 2), min_size=tokens, max_size=tokens))
    # Duplicate slots have no specified winner: keep the first of each, pad the others.
    slots = np.array([s if not 0 <= s < num_slots or s not in drawn[:i] else -1
                      for i, s in enumerate(drawn)], np.int32)
    fmt = data.draw(st.sampled_from(["e4m3", "e5m2"]), "fmt")
    dtype = data.draw(st.sampled_from(["bfloat16", "float16", "float32"]), "dtype")
    typed = data.draw(st.booleans(), "typed")
    cache_dtype = np_dtype(FORMATS[fmt].dtype if typed else "uint8")
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), "seed"))
    inputs = dict(key=random_values(rng, (tokens, heads, head_dim), dtype),
                  value=random_values(rng, (tokens, heads, head_dim), dtype),
                  key_cache=rng.integers(0, 256, shape, dtype=np.uint8).view(cache_dtype),
                  value_cache=rng.integers(0, 256, shape, dtype=np.uint8).view(cache_dtype),
                  slots=slots, key_scale=data.draw(scales(heads), "key_scale"),
                  value_scale=data.draw(scales(heads), "value_scale"))
    kwargs = dict(layout=layout, fp8_format=None if typed else fmt)
    expected = reference.write_kv(**inputs, **kwargs)
    for got, want in zip(fp8kv_jax.write_kv(**to_jax(inputs), **kwargs), expected):
        assert_same_bits(got, want)


@settings(max_examples=30, deadline=None)
@given(data=st.data())
def test_dequantize_pages_property(data):
    shape, layout, heads, _, _ = draw_cache(data, max_pages=4)
    batch, per_seq = data.draw(st.integers(0, 3), "batch"), data.draw(st.integers(0, 3), "per_seq")
    entries = st.lists(st.integers(-2, shape[0] + 1), min_size=batch * per_seq,
                       max_size=batch * per_seq)
    rng = np.random.default_rng(data.draw(st.integers(0, 2 ** 32 - 1), "seed"))
    inputs = dict(key_cache=rng.integers(0, 256, shape, dtype=np.uint8),
                  value_cache=rng.integers(0, 256, shape, dtype=np.uint8),
                  block_table=np.reshape(np.array(data.draw(entries, "table"), np.int32),
                                         (batch, per_seq)),
                  key_scale=data.draw(scales(heads), "key_scale"),
                  value_scale=data.draw(scales(heads), "value_scale"))
    kwargs = dict(layout=layout, fp8_format=data.draw(st.sampled_from(["e4m3", "e5m2"]), "fmt"),
                  null_page=data.draw(st.one_of(st.none(), st.integers(-1, shape[0])), "null_page"),
                  dtype=data.draw(st.sampled_from(["bfloat16", "float16", "float32"]), "dtype"))
    expected = reference.dequantize_pages(**inputs, **kwargs)
    for got, want in zip(fp8kv_jax.dequantize_pages(**to_jax(inputs), **kwargs), expected):
        assert_same_bits(got, want)


# ---------------------------------------------------------------------------------------------
# shard_map over kv heads.

HEADS = "heads"
SHARD_WRITE_CASE = WriteCase(tokens=9, heads=4, head_dim=32, page_size=8, layout="HND",
                             scale="head", slots="int32")
SHARD_DEQUANT_CASE = DequantCase(batch=2, pages_per_seq=3, heads=4, head_dim=32, page_size=8,
                                 scale="head", null_page=0)


def sharded_write(mesh, inputs):
    """``write_kv`` of an HND cache under shard_map, K/V/caches/scales split over kv heads."""
    tokens, caches, scale = P(None, HEADS, None), P(None, HEADS, None, None), P(HEADS)
    fn = jax.shard_map(functools.partial(fp8kv_jax.write_kv, layout="HND"), mesh=mesh,
                       in_specs=(tokens, tokens, caches, caches, P(), scale, scale),
                       out_specs=(caches, caches))
    specs = (tokens, tokens, caches, caches, P(), scale, scale)
    names = ("key", "value", "key_cache", "value_cache", "slots", "key_scale", "value_scale")
    args = [jax.device_put(inputs[n], NamedSharding(mesh, s)) for n, s in zip(names, specs)]
    return jax.jit(fn)(*args)


def sharded_dequantize(mesh, inputs):
    """``dequantize_pages`` of NHD caches under shard_map, the table replicated."""
    caches, scale = P(None, None, HEADS, None), P(HEADS)
    fn = jax.shard_map(functools.partial(fp8kv_jax.dequantize_pages, null_page=0), mesh=mesh,
                       in_specs=(caches, caches, P(), scale, scale),
                       out_specs=(caches, caches, P()))
    specs = (caches, caches, P(), scale, scale)
    names = ("key_cache", "value_cache", "block_table", "key_scale", "value_scale")
    args = [jax.device_put(inputs[n], NamedSharding(mesh, s)) for n, s in zip(names, specs)]
    return jax.jit(fn)(*args)


def test_shard_map_one_device():
    mesh = Mesh(np.array(jax.devices()[:1]), (HEADS,))
    inputs = write_inputs(SHARD_WRITE_CASE)
    for got, want in zip(sharded_write(mesh, inputs), reference.write_kv(**inputs, layout="HND")):
        assert_same_bits(got, want)
    inputs = dequant_inputs(SHARD_DEQUANT_CASE)
    expected = reference.dequantize_pages(**inputs, null_page=0)
    for got, want in zip(sharded_dequantize(mesh, inputs), expected):
        assert_same_bits(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_GPU or len(jax.devices()) < 2,
                    reason="needs JAX on 2 NVIDIA GPUs")
def test_shard_map_two_gpus_matches_unsharded():
    """Two GPUs, each holding 2 of the 4 kv heads: jax-triton launches on both devices."""
    mesh = Mesh(np.array(jax.devices()[:2]), (HEADS,))
    inputs = write_inputs(SHARD_WRITE_CASE)
    expected = reference.write_kv(**inputs, layout="HND")
    for sharded, want in zip(sharded_write(mesh, inputs), expected):
        assert len(sharded.sharding.device_set) == 2
        assert_same_bits(sharded, want)
    inputs = dequant_inputs(SHARD_DEQUANT_CASE)
    expected = reference.dequantize_pages(**inputs, null_page=0)
    for sharded, want in zip(sharded_dequantize(mesh, inputs), expected):
        assert_same_bits(sharded, want)


def test_shard_map_two_cpu_devices_matches_unsharded():
    """Two forced host devices (a fresh process): each holds 2 of the 4 kv heads."""
    out = run_python("""
        import jax, numpy as np
        from jax.sharding import Mesh
        import fp8kv_jax
        from tests import test_jax
        from tests.cases import as_uint, dequant_inputs, write_inputs
        assert len(jax.devices()) == 2, jax.devices()
        mesh = Mesh(np.array(jax.devices()), (test_jax.HEADS,))
        inputs = write_inputs(test_jax.SHARD_WRITE_CASE)
        pairs = zip(test_jax.sharded_write(mesh, inputs),
                    fp8kv_jax.write_kv(**test_jax.to_jax(inputs), layout="HND"))
        inputs = dequant_inputs(test_jax.SHARD_DEQUANT_CASE)
        pairs = [*pairs, *zip(test_jax.sharded_dequantize(mesh, inputs),
                              fp8kv_jax.dequantize_pages(**test_jax.to_jax(inputs), null_page=0))]
        assert len(pairs) == 5
        for sharded, whole in pairs:
            assert len(sharded.sharding.device_set) == 2, sharded.sharding
            np.testing.assert_array_equal(as_uint(np.asarray(sharded)), as_uint(np.asarray(whole)))
        print("OK")
        """, XLA_FLAGS="--xla_force_host_platform_device_count=2", JAX_PLATFORMS="cpu")
    assert out.strip().endswith("OK")


# ---------------------------------------------------------------------------------------------
# Imports: light, and jax-triton's environment change undone.

def test_import_needs_neither_torch_nor_jax_triton():
    out = run_python("""
        import sys, fp8kv_jax
        print(sorted(m for m in ("torch", "jax_triton") if m in sys.modules))
        """)
    assert out.strip() == "[]"


@pytest.mark.parametrize("saved", ["/tmp/fp8kv-triton-cache", None], ids=["set", "unset"])
def test_jax_triton_import_keeps_triton_cache_dir(tmp_path, saved):
    """A stand-in jax_triton does what 0.3.1 does on import; the variable must survive it."""
    (tmp_path / "jax_triton.py").write_text("import os\nos.environ['TRITON_CACHE_DIR'] = ''\n")
    env = {k: v for k, v in subprocess_env().items() if k != "TRITON_CACHE_DIR"}
    if saved is not None:
        env["TRITON_CACHE_DIR"] = saved
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import os, sys
        sys.path.insert(0, {str(tmp_path)!r})
        from fp8kv_jax import _triton
        assert _triton.jax_triton().__file__.startswith({str(tmp_path)!r})
        print(repr(os.environ.get("TRITON_CACHE_DIR")))
        """)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == repr(saved)


# ---------------------------------------------------------------------------------------------
# GPU only: in-place cost, kernel reuse.

@gpu_test
def test_gpu_donated_writes_keep_the_buffers_of_small_and_large_caches():
    """Jitted, donated writes into 4 MiB and 1 GiB caches: each step returns the very buffers it
    was given, and the bytes are the reference's (``python -m bench`` times such steps per cache
    size: a copy of the cache would make the time grow with it)."""
    heads, head_dim, page_size, tokens = 8, 128, 16, 256
    rng = np.random.default_rng(0)
    key = random_values(rng, (tokens, heads, head_dim), "bfloat16")
    value = random_values(rng, (tokens, heads, head_dim), "bfloat16")
    step = jax.jit(functools.partial(fp8kv_jax.write_kv, key_scale=0.37, value_scale=0.37),
                   donate_argnums=(2, 3))
    args = jnp.asarray(key), jnp.asarray(value)
    for nbytes in (4 << 20, 1 << 30):
        shape = (nbytes // (page_size * heads * head_dim), page_size, heads, head_dim)
        caches = (jnp.zeros(shape, jnp.float8_e4m3fn), jnp.zeros(shape, jnp.float8_e4m3fn))
        pointers = tuple(c.unsafe_buffer_pointer() for c in caches)
        expected = (np.zeros(shape, np.uint8),) * 2
        # Two steps, the second's slots half the first's (rewritten), half new; none repeated.
        pool = rng.choice(shape[0] * page_size, tokens + tokens // 2, replace=False)
        first = pool[:tokens].astype(np.int32)
        second = np.concatenate([pool[: tokens // 2], pool[tokens:]]).astype(np.int32)
        for slots in (first, second):
            donated = caches
            caches = jax.block_until_ready(step(*args, *caches, jnp.asarray(slots)))
            assert all(c.is_deleted() for c in donated)
            assert tuple(c.unsafe_buffer_pointer() for c in caches) == pointers, nbytes
            expected = reference.write_kv(key, value, *expected, slots, 0.37, 0.37,
                                          fp8_format="e4m3")
        for got, want in zip(caches, expected):
            assert np.array_equal(np.asarray(got).view(np.uint8), want), nbytes
        del caches, donated, expected


@gpu_test
def test_gpu_new_batch_size_reuses_the_triton_kernel():
    """The token count is a runtime scalar: a new batch size recompiles XLA, not the kernel."""
    compiled = fp8kv_jax._triton.jax_triton().triton_lib._COMPILED_KERNEL_CACHE
    cache = jnp.zeros((8, 16, 2, 64), jnp.float8_e4m3fn)
    sizes = []
    for tokens in (5, 7, 100):
        x = jnp.ones((tokens, 2, 64), jnp.bfloat16)
        jax.block_until_ready(fp8kv_jax.write_kv(x, x, cache, cache, jnp.arange(tokens), 0.5, 0.5))
        sizes.append(len(compiled))
    assert sizes[0] == sizes[1] == sizes[2], sizes


# ---------------------------------------------------------------------------------------------
# End to end: write a prefill's K/V, dequantize its pages, attend over the compact cache.

@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_prefill_attention_within_fp8_bound(fmt):
    """write_kv -> dequantize_pages -> jax.nn.dot_product_attention vs attention over bf16 K/V.

    The error must stay within the bound derived in ``attention_bound`` (as in the torch test).
    """
    from tests.attention_bound import attention_error_bound, prefill_block_table

    rng = np.random.default_rng(7)
    hkv, group, d, page_size, num_pages = 2, 3, 64, 16, 40
    lens = [37, 80, 5]
    table = prefill_block_table(rng, lens, page_size, num_pages)
    seqs = [(random_values(rng, (n, hkv * group, d), "bfloat16", specials=False),
             (rng.standard_normal((n, hkv, d)).astype(np.float32)).astype(np_dtype("bfloat16")),
             (rng.standard_normal((n, hkv, d)) * 3).astype(np.float32).astype(np_dtype("bfloat16")))
            for n in lens]
    fmax = FORMATS[fmt].max_value
    k_scale = max(float(np.abs(k.astype(np.float32)).max()) for _, k, _ in seqs) / fmax * 1.01
    v_scale = max(float(np.abs(v.astype(np.float32)).max()) for _, _, v in seqs) / fmax * 1.01
    k_cache = jnp.zeros((num_pages, page_size, hkv, d), jnp.uint8)
    v_cache = jnp.zeros_like(k_cache)
    for b, (_, k, v) in enumerate(seqs):
        pos = np.arange(len(k))
        slots = (table[b, pos // page_size] * page_size + pos % page_size).astype(np.int32)
        k_cache, v_cache = fp8kv_jax.write_kv(jnp.asarray(k), jnp.asarray(v), k_cache, v_cache,
                                              jnp.asarray(slots), k_scale, v_scale, fp8_format=fmt)
    kp, vp, new_table = fp8kv_jax.dequantize_pages(k_cache, v_cache, jnp.asarray(table), k_scale,
                                                   v_scale, fp8_format=fmt, null_page=0)
    kp, vp, new_table = np.asarray(kp), np.asarray(vp), np.asarray(new_table)
    for b, (q, k, v) in enumerate(seqs):
        n = len(k)
        pos = np.arange(n)
        rows = new_table[b][pos // page_size]
        k_deq, v_deq = kp[rows, pos % page_size], vp[rows, pos % page_size]

        def attend(kk, vv):  # fp32 attention with GQA, causal: isolates the FP8 error
            f32 = lambda a: jnp.asarray(a.astype(np.float32))[None]  # noqa: E731
            return np.asarray(jax.nn.dot_product_attention(f32(q), f32(kk), f32(vv),
                                                           is_causal=True))[0]

        got, want = attend(k_deq, v_deq), attend(k, v)
        mask = np.tril(np.ones((n, n), dtype=bool))
        for hq in range(hkv * group):
            h = hq // group
            as64 = lambda a: a[:, h].astype(np.float64)  # noqa: E731
            bound = attention_error_bound(q[:, hq].astype(np.float64), as64(k), as64(v),
                                          as64(v_deq), k_scale, v_scale, fmt, mask)
            err = np.abs(got[:, hq].astype(np.float64) - want[:, hq])
            assert np.all(err <= bound), f"seq {b} head {hq}: max err/bound {np.max(err / bound)}"
            assert err.max() > 0  # not vacuous: FP8 did change the result
