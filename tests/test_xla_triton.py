"""fp8kv_jax's path through XLA's own Triton call (``fp8kv_jax._xla_triton``).

On any machine: the version check and the off switch; every kernel variant's Triton IR, made by the
installed ``triton``, parses and verifies with jaxlib's Triton dialect, with exactly one pointer
per operand and result; the lowering for CUDA is the ``__gpu$xla.gpu.triton`` call with aliased
caches and no placeholder or dummy arrays; and every case runs byte-exact through the same launch
with the kernel under Triton's interpreter (``tests/jax_glue.py``). Where the IR cannot be made,
jax-triton serves, with a warning. Tests marked ``gpu`` run the call on an NVIDIA GPU against
jax-triton and the reference (``bench/xla_triton_probe.py`` does the same as a script).
"""
from __future__ import annotations

import re
import warnings

import numpy as np
import pytest

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

import fp8kv_jax  # noqa: E402
from fp8kv import ops, reference  # noqa: E402
from fp8kv.arrays import ArrayInfo  # noqa: E402
from fp8kv.dequantize import (  # noqa: E402
    check_dequantize, dequantize_operands, dequantized_shape, plan_dequantize)
from fp8kv.plan import CUDA  # noqa: E402
from fp8kv.write import check_write, plan_write, write_operands  # noqa: E402
from fp8kv_jax import _xla_triton  # noqa: E402
from tests.cases import (DEQUANT_CASES, WRITE_CASES, as_uint, dequant_inputs,  # noqa: E402
                         scale_values, write_inputs)
from tests.jax_glue import use_interpreted_gpu_path, use_interpreted_xla_path  # noqa: E402
from tests.stacked_cases import (STACKED_CASES, dequant_inputs_stacked,  # noqa: E402
                                 expected_dequant, expected_write, write_inputs_stacked)

VERSIONS_OK = _xla_triton.version_problem() is None
needs_versions = pytest.mark.skipif(not VERSIONS_OK, reason=f"XLA's Triton call is not used "
                                    f"with these versions: {_xla_triton.version_problem()}")
ON_GPU = jax.default_backend() == "gpu"
gpu = pytest.mark.gpu
needs_gpu = pytest.mark.skipif(not ON_GPU, reason="needs JAX on an NVIDIA GPU; JAX's backend "
                               f"here is {jax.default_backend()}")
CPU = jax.devices("cpu")[0]


def to_jax(inputs: dict, device=CPU) -> dict:
    return {k: jax.device_put(v, device) if isinstance(v, np.ndarray) else v
            for k, v in inputs.items()}


def assert_same_bits(got, want):
    got = np.asarray(got)
    assert (got.shape, got.dtype) == (want.shape, want.dtype)
    np.testing.assert_array_equal(as_uint(got), as_uint(want))


# ---------------------------------------------------------------------------------------------
# The switch.

@pytest.mark.parametrize("value, mode", [("0", "off"), ("off", "off"), ("1", "on"),
                                         ("", "auto"), (None, "auto")])
def test_environment_switch(value, mode, monkeypatch):
    if value is None:
        monkeypatch.delenv(_xla_triton.ENV, raising=False)
    else:
        monkeypatch.setenv(_xla_triton.ENV, value)
    assert _xla_triton.setting() == mode
    assert _xla_triton.enabled() == (mode == "on" or (mode == "auto" and VERSIONS_OK))


def test_version_check_names_the_version(monkeypatch):
    monkeypatch.setattr(_xla_triton, "JAXLIB_VERSIONS", ((0, 1, 0), (0, 2, 0)))
    _xla_triton.version_problem.cache_clear()
    try:
        assert re.match(r"jaxlib [\d.]+\S* is outside", _xla_triton.version_problem())
        monkeypatch.delenv(_xla_triton.ENV, raising=False)
        assert not _xla_triton.enabled()
        monkeypatch.setenv(_xla_triton.ENV, "1")
        assert _xla_triton.enabled()
    finally:
        monkeypatch.undo()
        _xla_triton.version_problem.cache_clear()


# ---------------------------------------------------------------------------------------------
# The IR of every kernel variant: made by triton, parsed by jaxlib.

def _write_variants():
    for case in WRITE_CASES:
        if not case.tokens:
            continue
        x = ArrayInfo.contiguous((case.tokens, case.heads, case.head_dim), case.dtype, "jax")
        cache = ArrayInfo.contiguous(case.cache_shape, case.cache_dtype, "jax")
        slots = ArrayInfo.contiguous((case.tokens,), case.slots, "jax")
        s = scale_values(case.scale, case.heads, np.random.default_rng(0))
        s = ArrayInfo.contiguous(np.shape(s), "float32", "jax") if isinstance(s, np.ndarray) else s
        yield case.id, check_write(x, x, cache, cache, slots, s, s, layout=case.api_layout,
                                   fp8_format=case.fp8_format)
    for case in STACKED_CASES:
        args = write_inputs_stacked(case)
        infos = {n: ArrayInfo.contiguous(a.shape, a.dtype.name, "jax") if isinstance(
            a, np.ndarray) else a for n, a in args.items() if n not in ("layout", "fp8_format")}
        infos["layer"] = ArrayInfo.contiguous((), "int32", "jax")
        yield case.id, check_write(**infos, layout=args["layout"], fp8_format=args["fp8_format"])


def _dequant_variants():
    for case in DEQUANT_CASES:
        if not case.batch:
            continue
        cache = ArrayInfo.contiguous(case.cache_shape, case.cache_dtype, "jax")
        table = ArrayInfo.contiguous((case.batch, case.pages_per_seq), "int32", "jax")
        s = scale_values(case.scale, case.heads, np.random.default_rng(0))
        s = ArrayInfo.contiguous(np.shape(s), "float32", "jax") if isinstance(s, np.ndarray) else s
        yield case.id, check_dequantize(cache, cache, table, s, s, dtype=case.out,
                                        layout=case.api_layout, fp8_format=case.fp8_format,
                                        null_page=case.null_page)
    for case in STACKED_CASES:
        args = dequant_inputs_stacked(case)
        infos = {n: ArrayInfo.contiguous(a.shape, a.dtype.name, "jax") if isinstance(
            a, np.ndarray) else a for n, a in args.items() if n not in ("layout", "fp8_format")}
        yield case.id, check_dequantize(**infos, layer=1, dtype="bfloat16",
                                        layout=args["layout"], fp8_format=args["fp8_format"],
                                        null_page=None)


def _call_ir(kernel, plan, operands, dtypes):
    """What ``_xla_triton.launch`` hands to XLA: the call and its bytecode (dropping unused
    pointers where the kernel allows)."""
    for drop in (True, False):
        call = _xla_triton.kernel_call(kernel, plan, operands, drop)
        types = call.pointer_types({p: dtypes(p) for p, _ in call.inputs + call.outputs})
        try:
            return call, _xla_triton._ir(call, types)
        except Exception:   # noqa: BLE001 -- as launch: retry with unused pointers kept
            if not drop:
                raise
    raise AssertionError("unreachable")


def _parsed_parameters(ir_bytes: bytes) -> int:
    """The number of parameters of the kernel in ``ir_bytes``, as jaxlib reads it."""
    from jax._src.interpreters import mlir as jax_mlir
    from jaxlib.mlir import ir
    from jaxlib.triton import dialect

    context = jax_mlir.make_ir_context()
    dialect.register_dialect(context)
    with context:
        module = ir.Module.parse(ir_bytes)
        (func,) = module.body.operations
        return len(func.regions[0].blocks[0].arguments)


def _dtypes_of(args, operands, info_of):
    by_param = {o.param: o for o in operands.params}

    def dtype(param):
        o = by_param[param]
        if o.aliases:
            return dtype(o.aliases)
        return info_of(o.source) if o.source is not None else "uint8"
    return dtype


@needs_versions
@pytest.mark.parametrize("name, args", list(_write_variants()), ids=lambda v: v
                         if isinstance(v, str) else "")
def test_write_ir_parses_with_jaxlib(name, args):
    args, _ = _xla_triton.device_scalars(args, {})
    plan = plan_write(args, CUDA)
    operands = write_operands(args)
    names = dict(key=args.key.dtype, value=args.value.dtype, slots="int32", layer="int32",
                 key_scale="float32", value_scale="float32", key_scale_cache="float32",
                 value_scale_cache="float32")
    cache = "uint8" if args.inline_pad else None

    def info_of(source):
        return names.get(source) or cache or _cache_dtype(name)
    call, ir_bytes = _call_ir(ops._write_kv_kernel, plan, operands,
                              _dtypes_of(args, operands, info_of))
    assert _parsed_parameters(ir_bytes) == len(call.inputs) + len(call.outputs)
    used = [o for o in operands.params if o.used]
    assert [p for p, _ in call.inputs + call.outputs] == [o.param for o in used]
    assert call.aliases   # the caches (and side arrays) are written in place


def _cache_dtype(case_id: str) -> str:
    return "float8_e5m2" if "e5m2" in case_id else "float8_e4m3fn"


@needs_versions
@pytest.mark.parametrize("name, args", list(_dequant_variants()), ids=lambda v: v
                         if isinstance(v, str) else "")
def test_dequantize_ir_parses_with_jaxlib(name, args):
    args, _ = _xla_triton.device_scalars(args, {})
    out = ArrayInfo.contiguous(dequantized_shape(args, args.combined), args.out_dtype, "jax")
    plan = plan_dequantize(args, out, None if args.combined else out, CUDA)
    operands = dequantize_operands(args)
    names = dict(block_table="int32", layer="int32", key_scale="float32", value_scale="float32",
                 key_scale_cache="float32", value_scale_cache="float32", key_out=args.out_dtype,
                 value_out=args.out_dtype, kv_out=args.out_dtype, table_out="int32")

    def info_of(source):
        return names.get(source) or ("uint8" if args.inline_pad else _cache_dtype(name))
    call, ir_bytes = _call_ir(ops._dequantize_pages_kernel, plan, operands,
                              _dtypes_of(args, operands, info_of))
    assert _parsed_parameters(ir_bytes) == len(call.inputs) + len(call.outputs)


# ---------------------------------------------------------------------------------------------
# The lowering for CUDA (made on this machine: no GPU needed to lower).

def _export_for_cuda(fn, *avals):
    from jax import export

    check = export.DisabledSafetyCheck.custom_call(_xla_triton.TARGET)
    return export.export(jax.jit(fn, donate_argnums=(2, 3)), platforms=["cuda"],
                         disabled_checks=[check])(*avals).mlir_module()


@needs_versions
def test_cuda_lowering_is_xla_triton_call_with_aliased_stacks_only(monkeypatch):
    monkeypatch.setenv(_xla_triton.ENV, "1")
    monkeypatch.setattr(fp8kv_jax._args, "use_triton", lambda arrays: True)

    def step(k, v, kc, vc, slots, scale):
        return fp8kv_jax.write_kv(k, v, kc, vc, slots, scale, 0.5, layer=jnp.int32(2))

    x = jax.ShapeDtypeStruct((16, 8, 128), jnp.bfloat16)
    stack = jax.ShapeDtypeStruct((4, 64, 16, 8, 128), jnp.float8_e4m3fn)
    text = _export_for_cuda(step, x, x, stack, stack, jax.ShapeDtypeStruct((16,), jnp.int32),
                            jax.ShapeDtypeStruct((), jnp.float32))
    calls = [line for line in text.splitlines() if "stablehlo.custom_call" in line]
    assert len(calls) == 1 and f"@{_xla_triton.TARGET}(" in calls[0]
    # key, value, both stacks, slots, two scales (the host 0.5 as a device scalar), the layer:
    # no placeholder inputs; the two stacks out, aliased: no dummy outputs.
    operands = re.search(r"\) -> \((.*)\)", calls[0])
    assert calls[0].count("output_operand_alias<") == 2
    assert "operand_index = 2" in calls[0] and "operand_index = 3" in calls[0]
    signature = calls[0].rsplit(" : (", 1)[1]
    assert signature.split(") -> (")[0].count("tensor<") == 8
    assert operands.group(1).count("tensor<4x64x16x8x128xf8E4M3FN>") == 2
    assert re.search(r'name = "_write_kv_kernel", num_stages = 3 : i32, num_warps = \d+ : i32',
                     calls[0])


# ---------------------------------------------------------------------------------------------
# Every case through the same launch, the kernel under the interpreter.

# Small enough for the interpreter; every layout, format, scale kind and slot dtype appears.
GLUE_WRITE_CASES = [WRITE_CASES[i] for i in (0, 2, 4, 5, 6, 8, 9)]
GLUE_DEQUANT_CASES = [DEQUANT_CASES[i] for i in (0, 2, 4, 5, 6, 7)]


@needs_versions
@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
@pytest.mark.parametrize("case", GLUE_WRITE_CASES, ids=lambda c: c.id)
def test_write_through_xla_call_in_interpreter(case, combined, monkeypatch):
    use_interpreted_xla_path(monkeypatch)
    inputs = write_inputs(case)
    kwargs = dict(layout=case.api_layout, fp8_format=case.fp8_format)
    expected = reference.write_kv(**inputs, **kwargs)
    with jax.default_device(CPU), jax.enable_x64(case.slots == "int64"), warnings.catch_warnings():
        warnings.simplefilter("error", _xla_triton.XlaTritonWarning)
        if combined:
            inputs["kv_cache"] = np.stack([inputs.pop("key_cache"), inputs.pop("value_cache")], 1)
            got = [fp8kv_jax.write_kv_combined(**to_jax(inputs), **kwargs)]
            expected = [np.stack(expected, axis=1)]
        else:
            got = fp8kv_jax.write_kv(**to_jax(inputs), **kwargs)
    for g, want in zip(got, expected, strict=True):
        assert_same_bits(g, want)


@needs_versions
@pytest.mark.parametrize("combined", [False, True], ids=["separate", "combined"])
@pytest.mark.parametrize("case", GLUE_DEQUANT_CASES, ids=lambda c: c.id)
def test_dequantize_through_xla_call_in_interpreter(case, combined, monkeypatch):
    use_interpreted_xla_path(monkeypatch)
    inputs = dequant_inputs(case)
    kwargs = dict(layout=case.api_layout, fp8_format=case.fp8_format, null_page=case.null_page)
    k, v, table = reference.dequantize_pages(**inputs, dtype=case.out, **kwargs)
    with jax.default_device(CPU), warnings.catch_warnings():
        warnings.simplefilter("error", _xla_triton.XlaTritonWarning)
        if combined:
            inputs["kv_cache"] = np.stack([inputs.pop("key_cache"), inputs.pop("value_cache")], 1)
            got = fp8kv_jax.dequantize_pages_combined(**to_jax(inputs), dtype=case.out, **kwargs)
            expected = (np.stack([k, v], axis=1), table)
        else:
            got = fp8kv_jax.dequantize_pages(**to_jax(inputs), dtype=case.out, **kwargs)
            expected = (k, v, table)
    for g, want in zip(got, expected, strict=True):
        assert_same_bits(g, want)


# One host layer per case: in range for static scales, out of range (-1) for dynamic ones.
@needs_versions
@pytest.mark.parametrize("case, layer", [(c, 1 if c.scales == "static" else -1)
                                         for c in STACKED_CASES],
                         ids=lambda v: v.id if hasattr(v, "id") else f"layer{v}-int")
def test_stacked_through_xla_call_in_interpreter(case, layer, monkeypatch):
    """A host layer and a host scale become device scalars on this path: the same bytes."""
    use_interpreted_xla_path(monkeypatch)
    args = write_inputs_stacked(case)
    expected = expected_write(case, args, layer)
    fn = fp8kv_jax.write_kv_combined if case.combined else fp8kv_jax.write_kv
    with jax.default_device(CPU):
        out = fn(**to_jax(args), layer=layer)
    out = out if isinstance(out, tuple) else (out,)
    for got, want in zip(out, expected.values(), strict=True):
        assert_same_bits(got, want)
    args = dequant_inputs_stacked(case)
    fn = fp8kv_jax.dequantize_pages_combined if case.combined else fp8kv_jax.dequantize_pages
    with jax.default_device(CPU):
        got = fn(**to_jax(args), layer=layer)
    for g, want in zip(got, expected_dequant(case, args, layer), strict=True):
        assert_same_bits(g, want)


def test_unmakeable_ir_falls_back_to_jax_triton_with_a_warning(monkeypatch):
    """Where the kernel's IR cannot be made or parsed, the same launch goes through jax-triton
    (here its interpreter stand-in): one warning per kernel, the same bytes."""
    use_interpreted_gpu_path(monkeypatch)
    monkeypatch.setenv(_xla_triton.ENV, "1")
    monkeypatch.setattr(_xla_triton, "_WARNED", set())

    def broken(*args, **kwargs):
        raise ValueError("a dialect this jaxlib does not know")

    monkeypatch.setattr(_xla_triton, "_ir", broken)
    jax.clear_caches()   # a launch traced by an earlier test would not look at the IR again
    case = WRITE_CASES[0]
    inputs = write_inputs(case)
    expected = reference.write_kv(**inputs)
    with jax.default_device(CPU), jax.enable_x64(True):
        with pytest.warns(_xla_triton.XlaTritonWarning, match="a dialect this jaxlib does not "
                          "know.*runs through jax-triton.*FP8KV_JAX_XLA_TRITON=0"):
            got = fp8kv_jax.write_kv(**to_jax(inputs))
    for g, want in zip(got, expected, strict=True):
        assert_same_bits(g, want)


# ---------------------------------------------------------------------------------------------
# On the GPU: the call itself, against jax-triton and the reference.

GPU_CASES = [WRITE_CASES[i] for i in (0, 3, 4, 6)]


def _gpu_write(case, path: str, monkeypatch):
    monkeypatch.setenv(_xla_triton.ENV, "1" if path == "xla" else "0")
    inputs = write_inputs(case)
    device = jax.devices("gpu")[0]
    # Host float scales stay Python floats (compiled in): as jit arguments they would be traced
    # (float64 under x64), which the API refuses for a scale.
    host = {k: v for k, v in inputs.items() if isinstance(v, float)}
    with jax.enable_x64(case.slots == "int64"):
        step = jax.jit(lambda a: fp8kv_jax.write_kv(**a, **host, layout=case.api_layout,
                                                   fp8_format=case.fp8_format))
        arrays = {k: v for k, v in to_jax(inputs, device).items()
                  if v is not None and k not in host}
        hlo = step.lower(arrays).compile().as_text()
        out = step(arrays)
    return inputs, hlo, out


@gpu
@needs_gpu
@needs_versions
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
def test_gpu_xla_call_matches_jax_triton_and_the_reference(case, monkeypatch):
    inputs, hlo_xla, xla = _gpu_write(case, "xla", monkeypatch)
    _, hlo_jt, jt = _gpu_write(case, "jax-triton", monkeypatch)
    assert _xla_triton.TARGET in hlo_xla and _xla_triton.TARGET not in hlo_jt
    expected = reference.write_kv(**inputs, layout=case.api_layout, fp8_format=case.fp8_format)
    for a, b, want in zip(xla, jt, expected, strict=True):
        assert_same_bits(a, want)
        assert_same_bits(b, want)


@needs_versions
@pytest.mark.parametrize("stacked", [False, True], ids=["one-layer", "stacked"])
def test_xla_call_ir_keeps_16_byte_accesses(stacked):
    """The IR handed to XLA (every scalar a constant, unused pointers gone), compiled for sm_90
    by the triton package: 16-byte loads and stores on the default shapes, IEEE division, no
    flush-to-zero -- what the compiled kernels rely on, here without runtime scalars."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    layers = (4,) if stacked else ()
    x = ArrayInfo.contiguous((4096, 8, 128), "bfloat16", "jax")
    cache = ArrayInfo.contiguous(layers + (300, 16, 8, 128), "float8_e4m3fn", "jax")
    slots = ArrayInfo.contiguous((4096,), "int32", "jax")
    args = check_write(x, x, cache, cache, slots, 0.37, 0.37, layout="NHD", fp8_format=None,
                       layer=2 if stacked else None)
    args, _ = _xla_triton.device_scalars(args, {})
    call = _xla_triton.kernel_call(ops._write_kv_kernel, plan_write(args, CUDA),
                                   write_operands(args))
    dtypes = dict(key_ptr="bfloat16", value_ptr="bfloat16", key_cache_ptr="float8_e4m3fn",
                  value_cache_ptr="float8_e4m3fn", slot_ptr="int32", key_scale_ptr="float32",
                  value_scale_ptr="float32", layer_ptr="int32",
                  key_cache_out_ptr="float8_e4m3fn", value_cache_out_ptr="float8_e4m3fn")
    types = dict(call.pointer_types(dtypes))
    consts = dict(call.constants)
    signature_, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(ops._write_kv_kernel.arg_names):
        if name in consts:
            signature_[name], constexprs[(index,)] = "constexpr", consts[name]
        else:
            signature_[name], attrs[(index,)] = types[name], [["tt.divisibility", 16]]
    compiled = triton.compile(
        ASTSource(ops._write_kv_kernel, signature_, constexprs=constexprs, attrs=attrs),
        target=GPUTarget("cuda", 90, 32),
        options=dict(num_warps=call.num_warps, enable_fp_fusion=False))
    ptx = compiled.asm["ptx"]
    assert "ld.global.v4.b32" in ptx and "st.global.v4.b32" in ptx
    assert "div.rn.f32" in ptx and "ftz" not in ptx
