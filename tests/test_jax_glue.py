"""fp8kv_jax's GPU launch code -- plan, binding, aliases, scalar types -- with the real kernels run
under Triton's interpreter (tests.jax_glue), byte for byte against the reference. No torch: this
runs on every CI leg, the JAX-only one included."""
from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")

import fp8kv_jax  # noqa: E402
from fp8kv import reference  # noqa: E402
from tests.cases import (DEQUANT_CASES, WRITE_CASES, as_uint, dequant_inputs,  # noqa: E402
                         write_inputs)
from tests.jax_glue import use_interpreted_gpu_path  # noqa: E402
from tests.rope_cases import ROPE_CASES, rope_inputs  # noqa: E402
from tests.rope_cases import expected as rope_expected  # noqa: E402
from tests.rope_cases import options as rope_options  # noqa: E402


def to_jax(inputs: dict, device) -> dict:
    return {k: jax.device_put(v, device) if isinstance(v, np.ndarray) else v
            for k, v in inputs.items()}


def write_kwargs(case):
    return dict(layout=case.api_layout, fp8_format=case.fp8_format)


def dequant_kwargs(case):
    return dict(layout=case.api_layout, fp8_format=case.fp8_format, null_page=case.null_page)


GLUE_WRITE_CASES = [WRITE_CASES[i] for i in (0, 2, 5, 6, 8)]
GLUE_DEQUANT_CASES = [DEQUANT_CASES[i] for i in (0, 2, 3, 4, 5, 6)]


@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
@pytest.mark.parametrize("case", GLUE_WRITE_CASES, ids=lambda c: c.id)
def test_gpu_write_launch_in_interpreter(case, combined, monkeypatch):
    use_interpreted_gpu_path(monkeypatch)
    inputs = write_inputs(case)
    expected = reference.write_kv(**inputs, **write_kwargs(case))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), jax.enable_x64(case.slots == "int64"):
        if combined:
            inputs["kv_cache"] = np.stack([inputs.pop("key_cache"), inputs.pop("value_cache")], 1)
            got = [fp8kv_jax.write_kv_combined(**to_jax(inputs, cpu), **write_kwargs(case))]
            expected = [np.stack(expected, axis=1)]
        else:
            got = fp8kv_jax.write_kv(**to_jax(inputs, cpu), **write_kwargs(case))
    for g, want in zip(got, expected, strict=True):
        np.testing.assert_array_equal(as_uint(np.asarray(g)), as_uint(want))


@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
@pytest.mark.parametrize("case", GLUE_DEQUANT_CASES, ids=lambda c: c.id)
def test_gpu_dequantize_launch_in_interpreter(case, combined, monkeypatch):
    use_interpreted_gpu_path(monkeypatch)
    inputs = dequant_inputs(case)
    k, v, table = reference.dequantize_pages(**inputs, dtype=case.out, **dequant_kwargs(case))
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        if combined:
            inputs["kv_cache"] = np.stack([inputs.pop("key_cache"), inputs.pop("value_cache")], 1)
            got = fp8kv_jax.dequantize_pages_combined(**to_jax(inputs, cpu), dtype=case.out,
                                                      **dequant_kwargs(case))
            expected = (np.stack([k, v], axis=1), table)
        else:
            got = fp8kv_jax.dequantize_pages(**to_jax(inputs, cpu), dtype=case.out,
                                             **dequant_kwargs(case))
            expected = (k, v, table)
    for g, want in zip(got, expected, strict=True):
        g = np.asarray(g)
        assert (g.shape, g.dtype) == (want.shape, want.dtype)
        np.testing.assert_array_equal(as_uint(g), as_uint(want))


GLUE_ROPE_CASES = [ROPE_CASES[i] for i in (0, 3, 6, 7, 9, 10)]


@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
@pytest.mark.parametrize("case", GLUE_ROPE_CASES, ids=lambda c: c.id)
def test_gpu_rope_write_launch_in_interpreter(case, combined, monkeypatch):
    """fp8kv_jax.rope_write_kv's jax-triton launch: query_out given (aliased) for odd token
    counts and FP8 formats other than the default, else a new output; the rotated key a new
    output; caches and side scale arrays aliased. (Inputs without fp32 subnormals: XLA:CPU
    flushes them on their way to the interpreter.)"""
    use_interpreted_gpu_path(monkeypatch)
    inputs = rope_inputs(case, subnormals=False)
    want = rope_expected(case, inputs)
    given = case.q_out in ("e5m2", "uint8") or case.tokens % 2 == 1
    arrays = {k: v for k, v in inputs.items() if k != "key_out"}
    if not given:
        arrays.pop("query_out")
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu), jax.enable_x64(case.slots == "int64"):
        if combined:
            arrays["kv_cache"] = np.stack([arrays.pop("key_cache"), arrays.pop("value_cache")], 1)
            out = fp8kv_jax.rope_write_kv_combined(**to_jax(arrays, cpu), return_key=True,
                                                   **rope_options(case))
            out = (out[0], *np.moveaxis(np.asarray(out[1]), 1, 0), *out[2:])
        else:
            out = fp8kv_jax.rope_write_kv(**to_jax(arrays, cpu), return_key=True,
                                          **rope_options(case))
    assert len(out) == len(want)
    for g, (name, w) in zip(out, want.items()):
        g = np.asarray(g)
        assert (g.shape, g.dtype) == (w.shape, w.dtype), name
        np.testing.assert_array_equal(as_uint(g), as_uint(w), err_msg=name)


def test_every_op_of_the_table_has_a_jnp_path_and_an_unknown_one_says_so():
    """Ops are found by name (the table's families), so a missing function is named, not a
    KeyError."""
    from fp8kv.optable import OPS
    from fp8kv_jax import _jnp

    assert {op.family for op in OPS.values()} == {"write_kv", "dequantize_pages",
                                                   "rope_write_kv", "paged_attention"}
    for op in OPS.values():
        assert callable(getattr(_jnp, op.family, None)), op.family
    with pytest.raises(NotImplementedError, match="fp8kv_jax.no_such_op: no jnp path"):
        _jnp.launch("no_such_op", {}, args=None)
