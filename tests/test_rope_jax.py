"""fp8kv_jax.rope_write_kv against the NumPy reference, byte for byte: the jnp path on CPU (inputs
without fp32 subnormals, which XLA:CPU flushes), jax-triton on a GPU; the integer-exact product
of the jnp path; jit with donation; torch parity; errors."""
from __future__ import annotations

import functools

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import fp8kv_jax  # noqa: E402
from fp8kv import reference as ref  # noqa: E402
from fp8kv_jax._jnp import mul_rn  # noqa: E402
from tests.cases import as_uint  # noqa: E402
from tests.rope_cases import (ROPE_CASES, RopeCase, expected, options,  # noqa: E402
                              rope_inputs)

ON_GPU = jax.default_backend() == "gpu"
NOT_GPU_REASON = "needs JAX on an NVIDIA GPU (the jax-triton path); JAX's backend here is " + \
    jax.default_backend()
PLATFORMS = [pytest.param("cpu", marks=pytest.mark.jnp),   # XLA:CPU arrays: the jnp path
             pytest.param("gpu", marks=[pytest.mark.gpu, pytest.mark.skipif(
                 not ON_GPU, reason=NOT_GPU_REASON)])]
ARRAYS = ("query", "key", "value", "key_cache", "value_cache", "slots", "positions",
          "cos_sin_cache", "key_scale", "value_scale")


def call(case: RopeCase, inputs: dict, device, *, query_out=True, fn=fp8kv_jax.rope_write_kv,
         **extra) -> dict:
    """One call through fp8kv_jax on ``device``; returns the outputs by name."""
    put = {k: jax.device_put(v, device) if isinstance(v, np.ndarray) else v
           for k, v in inputs.items()}
    with jax.default_device(device):
        out = fn(*[put[n] for n in ARRAYS], query_scale=put["query_scale"],
                 query_out=put["query_out"] if query_out else None, return_key=True,
                 key_scale_cache=put["key_scale_cache"],
                 value_scale_cache=put["value_scale_cache"], **options(case), **extra)
    names = ["query_out", "key_cache", "value_cache"]
    if isinstance(inputs["key_scale_cache"], np.ndarray):
        names += ["key_scale_cache", "value_scale_cache"]
    return dict(zip(names + ["key_out"], out, strict=True))


def assert_outputs(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name, g in got.items():
        g = np.asarray(g)
        assert (g.shape, g.dtype) == (want[name].shape, want[name].dtype), name
        np.testing.assert_array_equal(as_uint(g), as_uint(want[name]), err_msg=name)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("case", ROPE_CASES, ids=lambda c: c.id)
def test_matches_reference(case, platform):
    inputs = rope_inputs(case, subnormals=platform != "cpu")
    # A query_out gives a dtype other than the default (e5m2, uint8) or, for odd token counts,
    # the default's buffer; else a new array is made.
    given = case.q_out in ("e5m2", "uint8") or case.tokens % 2 == 1
    with jax.enable_x64(case.slots == "int64"):
        got = call(case, inputs, jax.devices(platform)[0], query_out=given)
    assert_outputs(got, expected(case, inputs))


def test_mul_rn_is_the_fp32_product():
    """The jnp path's product, integer arithmetic on bit patterns: RN(a * b) for raw bit patterns,
    for exponents that under- and overflow, and near the subnormal boundary (NaNs as NaN)."""
    rng = np.random.default_rng(0)
    n = 1 << 20
    raw = rng.integers(0, 2 ** 32, (2, n), dtype=np.uint64).astype(np.uint32)
    exps = rng.integers(0, 256, (2, n)).astype(np.uint32) << 23
    near = rng.integers(40, 90, (2, n)).astype(np.uint32) << 23
    mant = rng.integers(0, 2 ** 23, (2, n)).astype(np.uint32)
    sign = rng.integers(0, 2, (2, n)).astype(np.uint32) << 31
    product = jax.jit(mul_rn)
    for a, b in (raw, exps | mant | sign, near | mant | sign):
        a, b = a.view(np.float32), b.view(np.float32)
        with np.errstate(all="ignore"):
            want = a * b
        got = np.asarray(product(a, b))
        nan = np.isnan(want)
        np.testing.assert_array_equal(np.isnan(got), nan)
        np.testing.assert_array_equal(got.view(np.uint32)[~nan], want.view(np.uint32)[~nan])


def test_jnp_rotation_is_not_contracted():
    """``x_a c - x_b s`` as written in jnp gives XLA:CPU a fused multiply-add; the jnp path's
    rotation does not (every bf16 pattern, against the reference)."""
    x = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(
        ref.np_dtype("bfloat16")).reshape(512, 1, 128)
    # Products and results stay clear of fp32 subnormals, which XLA:CPU flushes.
    x = np.where(np.abs(x.astype(np.float32)) < 2.0 ** -100, 0, x).astype(x.dtype)
    cs = np.array([[np.cos(1.0)] * 64 + [np.sin(1.0)] * 64, [0.6] * 64 + [0.8] * 64], np.float32)
    positions = np.arange(512) % 2
    case = RopeCase(tokens=512, q_heads=1, kv_heads=1, head_dim=128, max_position=2)
    inputs = rope_inputs(case)
    inputs.update(query=x, key=x, cos_sin_cache=cs, positions=positions)
    got = call(case, inputs, jax.devices("cpu")[0])
    want = expected(case, inputs)
    np.testing.assert_array_equal(as_uint(np.asarray(got["query_out"])),
                                  as_uint(want["query_out"]))
    np.testing.assert_array_equal(as_uint(np.asarray(got["key_cache"])),
                                  as_uint(want["key_cache"]))


@pytest.mark.parametrize("case", [ROPE_CASES[i] for i in (2, 6, 8)], ids=lambda c: c.id)
def test_combined_and_the_outputs_in_order(case):
    inputs = rope_inputs(case, seed=2, subnormals=False)
    want = expected(case, inputs)
    kv = np.stack([inputs.pop("key_cache"), inputs.pop("value_cache")], axis=1)
    sides = isinstance(inputs["key_scale_cache"], np.ndarray)
    with jax.enable_x64(True):
        out = fp8kv_jax.rope_write_kv_combined(
            *[jnp.asarray(inputs[n]) for n in ("query", "key", "value")], jnp.asarray(kv),
            *[jnp.asarray(inputs[n]) for n in ("slots", "positions", "cos_sin_cache")],
            *[jnp.asarray(s) if isinstance(s, np.ndarray) else s
              for s in (inputs["key_scale"], inputs["value_scale"])],
            query_scale=inputs["query_scale"], query_out=jnp.asarray(inputs["query_out"]),
            key_scale_cache=inputs["key_scale_cache"],
            value_scale_cache=inputs["value_scale_cache"], **options(case))
    assert len(out) == (4 if sides else 2)   # (query_out, kv_cache[, scale caches]), no key_out
    np.testing.assert_array_equal(as_uint(np.asarray(out[0])), as_uint(want["query_out"]))
    np.testing.assert_array_equal(as_uint(np.asarray(out[1])), as_uint(
        np.stack([want["key_cache"], want["value_cache"]], axis=1)))
    if sides:
        np.testing.assert_array_equal(np.asarray(out[2]), want["key_scale_cache"])
        np.testing.assert_array_equal(np.asarray(out[3]), want["value_scale_cache"])


@pytest.mark.parametrize("case", [ROPE_CASES[i] for i in (1, 3, 7, 9)], ids=lambda c: c.id)
def test_torch_parity(case):
    """fp8kv_torch (the Triton kernel, interpreted) and fp8kv_jax (jnp) give the same bytes."""
    pytest.importorskip("torch")
    from tests.test_rope_write import run

    inputs = rope_inputs(case, seed=3, subnormals=False)
    torch_bits = run(case, inputs, "cpu")
    with jax.enable_x64(True):
        jax_out = call(case, inputs, jax.devices("cpu")[0])
    for name, bits in torch_bits.items():
        np.testing.assert_array_equal(as_uint(np.asarray(jax_out[name])), bits, err_msg=name)


@pytest.mark.parametrize("platform", PLATFORMS)
def test_jit_donated_call_is_in_place(platform):
    """Caches and side scale arrays donated -- and query_out on the GPU path, whose kernel writes
    it (the jnp path makes a new array and leaves it unused): the results are the same
    buffers."""
    device = jax.devices(platform)[0]
    case = RopeCase(tokens=9, q_heads=4, kv_heads=2, head_dim=64, scale="token_head",
                    q_out="e5m2", q_scale="tensor", slots="int32")
    inputs = rope_inputs(case, subnormals=platform != "cpu")
    want = expected(case, inputs)
    donated = ("key_cache", "value_cache", "key_scale_cache", "value_scale_cache") + (
        ("query_out",) if platform == "gpu" else ())
    with jax.default_device(device):
        # .copy(): buffers of JAX's own (on the CPU, device_put may wrap a NumPy array's memory,
        # which XLA cannot donate)
        args = {k: jax.device_put(v, device).copy() if isinstance(v, np.ndarray) else v
                for k, v in inputs.items() if k != "key_out"}
        pointers = [args[n].unsafe_buffer_pointer() for n in donated]
        step = jax.jit(functools.partial(fp8kv_jax.rope_write_kv, **options(case)),
                       donate_argnames=donated)
        out = jax.block_until_ready(step(**args))
    assert all(args[n].is_deleted() for n in donated)
    got = dict(zip(("query_out", "key_cache", "value_cache", "key_scale_cache",
                    "value_scale_cache"), out, strict=True))
    assert [got[n].unsafe_buffer_pointer() for n in donated] == pointers
    assert_outputs(got, {k: want[k] for k in got})


def test_jit_traces_once_per_shape():
    """Positions, slots, cos/sin and an array query scale are traced: new contents reuse the
    compiled program."""
    traces = []

    @jax.jit
    def step(q, k, v, kc, vc, slots, positions, cs, qs):
        traces.append(1)
        return fp8kv_jax.rope_write_kv(q, k, v, kc, vc, slots, positions, cs, query_scale=qs)

    case = RopeCase(tokens=4, q_heads=2, kv_heads=1, head_dim=32, slots="int32",
                    q_out="e4m3", q_scale="tensor", scale="none")
    for seed in range(3):
        inputs = rope_inputs(case, seed=seed, subnormals=False)
        out = step(*[inputs[n] for n in ARRAYS[:8]], inputs["query_scale"])
        want = expected(case, inputs)
        np.testing.assert_array_equal(as_uint(np.asarray(out[0])), as_uint(want["query_out"]))
    assert len(traces) == 1


def _bad(**changes):
    case = RopeCase(tokens=3, q_heads=2, kv_heads=1, head_dim=32, slots="int32", scale="none")
    inputs = rope_inputs(case)
    args = {n: inputs[n] for n in ARRAYS[:8]}
    args.update(changes)
    return args


@pytest.mark.parametrize("args,kwargs,error,message", [
    (_bad(positions=np.arange(3.0)), {}, TypeError,
     "positions: expected dtype int32 or int64, got float"),
    (_bad(positions=[0, 1, 2]), {}, TypeError, "positions: expected a jax.Array, got list"),
    (_bad(cos_sin_cache=np.zeros((8, 31), np.float32)), {}, ValueError,
     "cos_sin_cache: expected an even number of columns"),
    (_bad(query=np.zeros((3, 3, 32), np.float32)), {}, TypeError,
     "query: expected the dtype of key"),
    (_bad(), dict(rope_style="gpt-j"), ValueError, "rope_style: expected 'neox' or 'gptj'"),
    (_bad(), dict(return_key=1), TypeError, "return_key: expected a bool, got int"),
    (_bad(), dict(query_scale=0.5, query_out=jnp.zeros((3, 2, 32), jnp.bfloat16)), TypeError,
     "query_out: expected dtype float8_e4m3fn or float8_e5m2 or uint8, got bfloat16"),
    (_bad(), dict(query_out="q"), TypeError, "query_out: expected a jax.Array, got str"),
], ids=["positions-float", "positions-list", "rotary-odd", "query-dtype", "rope-style",
        "return-key", "query-out-dtype", "query-out-type"])
def test_bad_input_raises(args, kwargs, error, message):
    with pytest.raises(error, match=message.replace("[", r"\[").replace("(", r"\(")):
        fp8kv_jax.rope_write_kv(**args, **kwargs)


def test_check_bounds():
    args = _bad(positions=np.array([0, 64, 1], np.int32))
    with pytest.raises(ValueError, match=r"positions: expected every position in \[0, 64\)"):
        fp8kv_jax.rope_write_kv(**args, check_bounds=True)
    with pytest.raises(TypeError, match="check_bounds: reads positions on the host"):
        jax.jit(functools.partial(fp8kv_jax.rope_write_kv, check_bounds=True))(**args)
