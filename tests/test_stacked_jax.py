"""Stacked caches in JAX (``layer=``, docs/SPEC.md section 14), byte for byte against the reference.

Every stacked case runs through the jnp path and through fp8kv_jax's GPU launch glue with the
kernels under Triton's interpreter (:mod:`tests.jax_glue`); a traced layer under ``lax.scan``,
``fori_loop`` and a Python loop updates donated stacks in place (no copy of a stack in the compiled
HLO); bad ``layer`` values and mismatched stacks raise before anything runs. Tests marked ``gpu``
repeat this on an NVIDIA GPU (the Triton path) and are skipped elsewhere.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import fp8kv_jax  # noqa: E402
from fp8kv import reference  # noqa: E402
from tests.cases import as_uint, random_values  # noqa: E402
from tests.jax_glue import use_interpreted_gpu_path  # noqa: E402
from tests.stacked_cases import (LAYERS, STACKED_CASES, StackedCase,  # noqa: E402
                                 dequant_inputs_stacked, expected_dequant, expected_write,
                                 layer_id, write_inputs_stacked)

ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs JAX on an NVIDIA GPU (the Triton path); "
                               f"JAX's backend here is {jax.default_backend()}")


def jax_layer(layer):
    value, where = layer
    return jnp.asarray(value, jnp.int32) if where == "array" else value


def on(device, args: dict) -> dict:
    return {n: jax.device_put(a, device) if isinstance(a, np.ndarray) else a
            for n, a in args.items()}


def written_names(case: StackedCase, args: dict) -> list:
    names = ["kv_cache"] if case.combined else ["key_cache", "value_cache"]
    if isinstance(args.get("key_scale_cache"), np.ndarray):
        names += ["key_scale_cache", "value_scale_cache"]
    return names


def write(case: StackedCase, args: dict, layer, device) -> dict:
    """fp8kv_jax's stacked write on ``device``: the written arrays by name."""
    fn = fp8kv_jax.write_kv_combined if case.combined else fp8kv_jax.write_kv
    with jax.default_device(device):
        out = fn(**on(device, args), layer=layer)
    out = out if isinstance(out, tuple) else (out,)
    return dict(zip(written_names(case, args), out, strict=True))


def assert_same_bits(got, want):
    got = np.asarray(got)
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    np.testing.assert_array_equal(as_uint(got), as_uint(want))


def check_write(case, layer, device):
    args = write_inputs_stacked(case)
    expected = expected_write(case, args, layer[0])
    got = write(case, args, jax_layer(layer), device)
    assert set(got) == set(expected)
    for name, want in expected.items():
        assert_same_bits(got[name], want)


def check_dequant(case, layer, device):
    args = dequant_inputs_stacked(case)
    expected = expected_dequant(case, args, layer[0])
    fn = fp8kv_jax.dequantize_pages_combined if case.combined else fp8kv_jax.dequantize_pages
    with jax.default_device(device):
        got = fn(**on(device, args), layer=jax_layer(layer))
    for g, want in zip(got, expected, strict=True):
        assert_same_bits(g, want)


CPU = jax.devices("cpu")[0]


@pytest.mark.jnp
@pytest.mark.parametrize("layer", LAYERS, ids=layer_id)
@pytest.mark.parametrize("case", STACKED_CASES, ids=lambda c: c.id)
def test_stacked_write_jnp(case, layer):
    check_write(case, layer, CPU)


@pytest.mark.jnp
@pytest.mark.parametrize("layer", LAYERS, ids=layer_id)
@pytest.mark.parametrize("case", STACKED_CASES, ids=lambda c: c.id)
def test_stacked_dequantize_jnp(case, layer):
    check_dequant(case, layer, CPU)


GLUE_LAYERS = [LAYERS[1], LAYERS[2]]   # a device layer in range, a host layer out of range


@pytest.mark.parametrize("layer", GLUE_LAYERS, ids=layer_id)
@pytest.mark.parametrize("case", STACKED_CASES, ids=lambda c: c.id)
def test_stacked_write_gpu_launch_in_interpreter(case, layer, monkeypatch):
    use_interpreted_gpu_path(monkeypatch)
    check_write(case, layer, CPU)


@pytest.mark.parametrize("layer", GLUE_LAYERS, ids=layer_id)
@pytest.mark.parametrize("case", STACKED_CASES, ids=lambda c: c.id)
def test_stacked_dequantize_gpu_launch_in_interpreter(case, layer, monkeypatch):
    use_interpreted_gpu_path(monkeypatch)
    check_dequant(case, layer, CPU)


@gpu
@needs_gpu
@pytest.mark.parametrize("layer", LAYERS, ids=layer_id)
@pytest.mark.parametrize("case", STACKED_CASES, ids=lambda c: c.id)
def test_gpu_stacked_write(case, layer):
    check_write(case, layer, jax.devices("gpu")[0])


@gpu
@needs_gpu
@pytest.mark.parametrize("layer", LAYERS, ids=layer_id)
@pytest.mark.parametrize("case", STACKED_CASES, ids=lambda c: c.id)
def test_gpu_stacked_dequantize(case, layer):
    check_dequant(case, layer, jax.devices("gpu")[0])


# ---------------------------------------------------------------------------------------------
# Loops over layers: a traced layer, donated stacks, no copy of a stack.

L, PAGES, PAGE, HEADS, DIM, TOKENS = 4, 6, 4, 2, 64, 5


def copies_of(hlo: str, shape) -> list:
    """The HLO ``copy`` instructions whose result is an fp8 or byte array of ``shape`` (a stack).

    (XLA:CPU runs a typed cache's same-width ``bitcast-convert`` to bytes as a loop over the
    array: the jnp path reads and writes fp8 caches as bytes, which on the CPU costs a pass over
    a typed stack per call -- in place, not a copy; a uint8 stack needs none.)"""
    dims = ",".join(map(str, shape))
    return [line.strip() for line in hlo.splitlines()
            if re.search(rf"=\s*(f8e4m3fn|f8e5m2|u8)\[{dims}\]\S*\s+(copy|copy-start)\(", line)]


def loop_inputs(seed=0, dtype="float8_e4m3fn", tokens=TOKENS):
    rng = np.random.default_rng(seed)
    shape = (L, PAGES, PAGE, HEADS, DIM)
    caches = [rng.integers(0, 256, shape, dtype=np.uint8).view(dtype) for _ in range(2)]
    keys = random_values(rng, (L, tokens, HEADS, DIM), "bfloat16")
    values = random_values(rng, (L, tokens, HEADS, DIM), "bfloat16")
    slots = rng.permutation(PAGES * PAGE)[:tokens].astype(np.int32)
    return caches, keys, values, slots


def loop_expected(caches, keys, values, slots):
    k, v = caches
    for layer in range(L):
        k, v = reference.write_kv(keys[layer], values[layer], k, v, slots, 0.5, 2.0, layer=layer,
                                  fp8_format="e4m3")
    return k, v


def scan_step(k_cache, v_cache, keys, values, slots):
    def body(caches, x):
        layer, key, value = x
        return fp8kv_jax.write_kv(key, value, *caches, slots, 0.5, 2.0, layer=layer,
                                  fp8_format="e4m3"), None

    caches, _ = jax.lax.scan(body, (k_cache, v_cache), (jnp.arange(L), keys, values))
    return caches


def fori_step(k_cache, v_cache, keys, values, slots):
    def body(layer, caches):
        return fp8kv_jax.write_kv(keys[layer], values[layer], *caches, slots, 0.5, 2.0,
                                  layer=layer, fp8_format="e4m3")

    return jax.lax.fori_loop(0, L, body, (k_cache, v_cache))


def python_step(k_cache, v_cache, keys, values, slots):
    for layer in range(L):
        k_cache, v_cache = fp8kv_jax.write_kv(keys[layer], values[layer], k_cache, v_cache,
                                              slots, 0.5, 2.0, layer=layer, fp8_format="e4m3")
    return k_cache, v_cache


LOOPS = {"scan": scan_step, "fori_loop": fori_step, "python-loop": python_step}
PLATFORMS = [pytest.param("cpu", marks=pytest.mark.jnp),   # XLA:CPU arrays: the jnp path
             pytest.param("gpu", marks=[gpu, needs_gpu])]


# XLA:CPU runs an fp8 array's byte view as a loop over it, and turns a one-token scatter through
# it into an update that is then copied (docs/SPEC.md section 11): uint8 stacks there.
STACKS = [pytest.param("float8_e4m3fn", TOKENS, id=f"e4m3-T{TOKENS}"),
          pytest.param("uint8", 1, id="uint8-T1")]


@pytest.mark.parametrize("dtype, tokens", STACKS)
@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("loop", LOOPS)
def test_loop_over_layers_updates_donated_stacks_in_place(loop, platform, dtype, tokens):
    device = jax.devices(platform)[0]
    caches, keys, values, slots = loop_inputs(dtype=dtype, tokens=tokens)
    expected = loop_expected(caches, keys, values, slots)
    with jax.default_device(device):
        step = jax.jit(LOOPS[loop], donate_argnums=(0, 1))
        # Arrays of XLA's own (device_put of a NumPy array may alias it, and then copies).
        args = [jnp.array(a, copy=True) for a in (*caches, keys, values, slots)]
        hlo = step.lower(*args).compile().as_text()
        pointers = [a.unsafe_buffer_pointer() for a in args[:2]]
        out = jax.block_until_ready(step(*args))
    assert copies_of(hlo, caches[0].shape) == []
    assert [o.unsafe_buffer_pointer() for o in out] == pointers
    for got, want in zip(out, expected, strict=True):
        assert_same_bits(got, want)


@gpu
@needs_gpu
@pytest.mark.parametrize("loop", LOOPS)
def test_gpu_loop_over_layers_in_place_through_jax_triton(loop, monkeypatch):
    """The same loops with FP8KV_JAX_XLA_TRITON=0: jax-triton's custom call aliases the whole
    stacks too."""
    monkeypatch.setenv("FP8KV_JAX_XLA_TRITON", "0")
    jax.clear_caches()
    test_loop_over_layers_updates_donated_stacks_in_place(loop, "gpu", "float8_e4m3fn", TOKENS)
    test_loop_over_layers_updates_donated_stacks_in_place(loop, "gpu", "uint8", 1)


def test_hlo_check_sees_a_copy_without_donation():
    """The copy check is not vacuous: without donation XLA copies each stack."""
    caches, keys, values, slots = loop_inputs()
    hlo = jax.jit(scan_step).lower(*caches, keys, values, slots).compile().as_text()
    assert len(copies_of(hlo, caches[0].shape)) == 2


def dequant_scan(k_cache, v_cache, tables):
    def body(_, x):
        layer, table = x
        k, v, _ = fp8kv_jax.dequantize_pages(k_cache, v_cache, table, 0.5, 2.0,
                                             dtype=jnp.float32, layer=layer)
        return None, (k, v)

    return jax.lax.scan(body, None, (jnp.arange(L), tables))[1]


@pytest.mark.parametrize("platform", PLATFORMS)
def test_dequantize_under_scan_reads_each_layer_without_copying_a_stack(platform):
    device = jax.devices(platform)[0]
    caches, _, _, _ = loop_inputs()
    tables = np.random.default_rng(3).integers(-1, PAGES + 1, (L, 2, 3)).astype(np.int32)
    with jax.default_device(device):
        step = jax.jit(dequant_scan)
        args = [jax.device_put(a, device) for a in (*caches, tables)]
        hlo = step.lower(*args).compile().as_text()
        k, v = step(*args)
    assert copies_of(hlo, caches[0].shape) == []
    for layer in range(L):
        want = reference.dequantize_pages(*caches, tables[layer], 0.5, 2.0, dtype="float32",
                                          layer=layer)
        assert_same_bits(k[layer], want[0])
        assert_same_bits(v[layer], want[1])


# ---------------------------------------------------------------------------------------------
# Bad layer values and mismatched stacks: the core's errors, before anything runs.

X = jnp.zeros((3, 2, 8), jnp.bfloat16)
STACK = jnp.zeros((4, 5, 16, 2, 8), jnp.float8_e4m3fn)
SLOTS = jnp.arange(3, dtype=jnp.int32)
TABLE = jnp.zeros((2, 3), jnp.int32)
SIDE = jnp.zeros((4, 5, 16, 2), jnp.float32)


def _write(**kw):
    args = dict(key=X, value=X, key_cache=STACK, value_cache=STACK, slots=SLOTS, layer=1)
    args.update(kw)
    return lambda: fp8kv_jax.write_kv(**args)


BAD_LAYERS = {
    "bool": (_write(layer=True), TypeError,
             "layer: expected None, an int or an int32 array of shape \\[\\], got bool"),
    "float": (_write(layer=1.0), TypeError, "layer: expected None, an int .* got float"),
    "string": (_write(layer="1"), TypeError, "layer: expected None, an int .* got str"),
    "float-array": (_write(layer=jnp.float32(1)), TypeError,
                    "layer: expected dtype int32 or int64, got float32"),
    "uint8-array": (_write(layer=jnp.uint8(1)), TypeError,
                    "layer: expected dtype int32 or int64, got uint8"),
    "shape-1": (_write(layer=jnp.ones(1, jnp.int32)), ValueError,
                r"layer: expected an int or an array of shape \[\], got shape \[1\]"),
    # A rank-3 cache cannot be a stack (rank 4 would be: a stack of [num_slots, H, D] caches).
    "unstacked-cache": (_write(key_cache=STACK[0, 0], value_cache=STACK[0, 0]), ValueError,
                        r"key_cache: expected a stacked cache \[num_layers, ...\] of rank 4 or 5 "
                        r"\(layer= is given\), got shape \[16, 2, 8\]"),
    "layers-differ": (_write(value_cache=STACK[:3]), ValueError,
                      r"value_cache: expected the shape of key_cache \[4, 5, 16, 2, 8\], got "
                      r"\[3, 5, 16, 2, 8\]"),
    "pages-differ": (_write(value_cache=STACK[:, :4]), ValueError,
                     r"value_cache: expected the shape of key_cache"),
    "side-array-unstacked": (_write(key_scale_cache=SIDE[0], value_scale_cache=SIDE[0]),
                             ValueError, r"key_scale_cache: expected a stacked array "
                             r"\[num_layers=4, ...\] \(layer= is given; the leading axis of the "
                             r"caches\), got shape \[5, 16, 2\]"),
    "side-array-layers": (_write(key_scale_cache=SIDE, value_scale_cache=SIDE[:2]), ValueError,
                          r"value_scale_cache: expected a stacked array \[num_layers=4, ...\]"),
    "combined-rank": (lambda: fp8kv_jax.write_kv_combined(X, X, STACK[0], SLOTS, layer=0),
                      ValueError,
                      r"kv_cache: expected a stacked cache \[num_layers, ...\] of rank 5 or 6 "
                      r"\(layer= is given\), got shape \[5, 16, 2, 8\]"),
    "combined-no-kv-axis": (lambda: fp8kv_jax.write_kv_combined(X, X, STACK, SLOTS, layer=0),
                            ValueError,
                            r"kv_cache: expected a combined cache \[num_pages, 2, ...\]"),
    "check-bounds-past": (_write(layer=4, check_bounds=True), ValueError,
                          r"layer: expected 0 <= layer < 4 \(num_layers\), got 4"),
    "check-bounds-negative": (_write(layer=jnp.int32(-1), check_bounds=True), ValueError,
                              r"layer: expected 0 <= layer < 4 \(num_layers\), got -1"),
    "dequant-float": (lambda: fp8kv_jax.dequantize_pages(STACK, STACK, TABLE, layer=0.0),
                      TypeError, "layer: expected None, an int .* got float"),
    "dequant-unstacked": (lambda: fp8kv_jax.dequantize_pages(STACK[0, 0], STACK[0, 0], TABLE,
                                                             layer=0),
                          ValueError, r"key_cache: expected a stacked cache"),
    "dequant-check-bounds": (lambda: fp8kv_jax.dequantize_pages(STACK, STACK, TABLE, layer=7,
                                                                check_bounds=True),
                             ValueError, r"layer: expected 0 <= layer < 4 \(num_layers\), got 7"),
}


@pytest.mark.parametrize("name", BAD_LAYERS)
def test_bad_layer_raises(name):
    call, error, match = BAD_LAYERS[name]
    with pytest.raises(error, match=match):
        call()


def test_check_bounds_with_a_traced_layer_is_refused():
    with pytest.raises(TypeError, match="check_bounds: reads layer on the host"):
        jax.jit(lambda layer: fp8kv_jax.write_kv(X, X, STACK, STACK, SLOTS, layer=layer,
                                                 check_bounds=True))(jnp.int32(0))


def test_bool_layer_fails_the_same_after_int_layers():
    for _ in range(3):
        _write(layer=1)()
    for _ in range(3):
        with pytest.raises(TypeError, match="got bool"):
            _write(layer=True)()
