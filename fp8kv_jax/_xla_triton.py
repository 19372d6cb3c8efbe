"""The NVIDIA GPU path through XLA's own Triton custom call: each launch handed to XLA as Triton IR.

jax-triton 0.3.1 lowers a kernel to a legacy custom call (API version 2) whose ~10 kB backend
config holds the compiled kernel; XLA runs it as a thunk of its own, outside its command buffers,
with tens of microseconds of host work per call. Pallas lowers its GPU kernels instead to the
``__gpu$xla.gpu.triton`` custom call: a typed-FFI backend config holding a Triton IR module, which
XLA compiles with its own Triton into an ordinary kernel launch of the step's executable. This
module does the same for fp8kv's kernels, from the very plan and operand map the other paths use:

* the kernel's Triton IR (TTIR) comes from the installed ``triton`` package (``ASTSource.make_ir``
  and the backend's TTIR passes), with every launch scalar and every unused pointer compiled in as
  a constant -- XLA passes buffers only, the operands then the results -- so the call has exactly
  the arrays it reads and writes (no placeholder inputs, no dummy outputs);
* a host float scale becomes a one-element device array and a host layer a device scalar (the
  kernels' TENSOR kinds: the same fp32 value and the same arithmetic, docs/SPEC.md section 4);
* the IR is parsed with jaxlib's Triton dialect and re-serialized as MLIR bytecode by jaxlib
  itself, the form Pallas hands to XLA (a parse failure falls back to jax-triton here, at trace
  time, with a warning).

Used where :func:`enabled` says so: ``FP8KV_JAX_XLA_TRITON=0`` turns it off, ``=1`` skips the
version check; otherwise jaxlib must be one whose Pallas lowers to this call with this backend
config (:data:`JAXLIB_VERSIONS`) and ``triton`` one whose IR jaxlib's dialect was checked to parse
(:data:`TRITON_SERIES`). ``bench/xla_triton_probe.py`` checks a GPU machine end to end.
"""
from __future__ import annotations

import dataclasses
import functools
import io
import os
import re
import warnings
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp8kv.binding import signature
from fp8kv.modes import ScaleKind
from fp8kv.operands import OperandMap

ENV = "FP8KV_JAX_XLA_TRITON"
TARGET = "__gpu$xla.gpu.triton"
# jaxlib versions whose Pallas lowers GPU kernels to TARGET with a backend config of name, ir,
# num_stages, num_warps, grid_x/y/z and debug (read in their pallas_call_registration.py).
JAXLIB_VERSIONS = ((0, 10, 2), (0, 12, 0))   # [first, past the last)
# triton releases whose TTIR jaxlib's Triton dialect parsed for every kernel variant of the suite.
TRITON_SERIES = ((3, 6),)
NUM_STAGES = 3   # jax-triton's default; a pipelined loop (paged attention's) sets its own
POINTER_TYPES = {"bfloat16": "*bf16", "float16": "*fp16", "float32": "*fp32",
                 "float8_e4m3fn": "*fp8e4nv", "float8_e5m2": "*fp8e5", "uint8": "*u8",
                 "int32": "*i32", "int64": "*i64"}


class XlaTritonWarning(UserWarning):
    """A kernel could not take XLA's Triton call: it runs through jax-triton instead."""


def setting() -> str:
    """``"off"``, ``"on"`` (no version check) or ``"auto"``, from :data:`ENV` (read per trace)."""
    value = os.environ.get(ENV, "").strip().lower()
    if value in ("0", "false", "off", "no"):
        return "off"
    return "on" if value in ("1", "true", "on", "yes") else "auto"


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


@functools.cache
def version_problem() -> str | None:
    """Why the installed versions are not known to work with this path (None: they are)."""
    try:
        import jaxlib.version
        import triton
        from jaxlib.triton import dialect  # noqa: F401 -- jaxlib's Triton MLIR dialect
    except ImportError as e:
        return f"no jaxlib Triton dialect or triton package ({e})"
    jaxlib_version = _version(jaxlib.version.__version__)
    first, past = JAXLIB_VERSIONS
    if not first <= jaxlib_version < past:
        return f"jaxlib {jaxlib.version.__version__} is outside {first}..{past} (exclusive)"
    if _version(triton.__version__)[:2] not in TRITON_SERIES:
        return f"triton {triton.__version__} is not one of {TRITON_SERIES}"
    return None


def enabled() -> bool:
    """Whether kernels take XLA's Triton call (else jax-triton)."""
    mode = setting()
    return mode == "on" or (mode == "auto" and version_problem() is None)


def device_scalars(args, arrays: dict):
    """``(args, arrays)`` with host scalars made device arrays: a host float scale (VALUE) a
    float32 ``[]`` array (TENSOR), a host layer an int32 ``[]`` array. This path compiles every
    launch scalar into the kernel; these two change from call to call (a scale, the layer of a
    loop), so they are read by the kernel instead -- the same values, the same arithmetic."""
    changes, arrays = {}, dict(arrays)
    for side in ("key", "value"):
        scale = getattr(args, f"{side}_scale")
        if scale.kind is ScaleKind.VALUE:
            changes[f"{side}_scale"] = dataclasses.replace(scale, kind=ScaleKind.TENSOR, value=1.0)
            arrays[f"{side}_scale"] = jnp.asarray(np.float32(scale.value))
    layers = args.layers
    if layers is not None and not layers.on_device:
        changes["layers"] = dataclasses.replace(layers, index=None)
        arrays["layer"] = jnp.asarray(layers.index, jnp.int32)
    return (dataclasses.replace(args, **changes) if changes else args), arrays


class KernelCall(NamedTuple):
    """One launch as XLA's Triton call: the kernel's parameters split into compiled-in constants
    and pointers (operands, then results, in the kernel's order)."""

    kernel: object
    constants: tuple          # (parameter, value): constexprs, scalars, unused pointers (None)
    inputs: tuple             # (parameter, argument) of each operand
    outputs: tuple            # (parameter, argument or None) of each result
    aliases: tuple            # (operand index, result index): written in place
    grid: tuple
    num_warps: int

    def pointer_types(self, dtypes: dict) -> tuple:
        """``(parameter, Triton pointer type)`` of every pointer, from ``{parameter: dtype}``."""
        return tuple((p, POINTER_TYPES[dtypes[p]]) for p, _ in self.inputs + self.outputs)


_DUMMY = jax.ShapeDtypeStruct((1,), jnp.uint8)   # a kept unused output (see kernel_call)


def kernel_call(kernel, plan, operands: OperandMap, drop_unused: bool = True) -> KernelCall:
    """The launch of ``kernel`` under ``plan`` as a :class:`KernelCall`. ``drop_unused``: unused
    pointers become None constants (a kernel that does arithmetic on one needs them kept: then
    an unused input takes its placeholder argument and an unused output a 1-byte dummy)."""
    sig = signature(kernel)
    floats = [n for n, v in plan.scalars.items() if isinstance(v, float) and v != 1.0]
    if floats:   # device_scalars makes every applied host float a device array
        raise ValueError(f"{sig.kernel}: host float scalars {floats} cannot be compiled in")
    constants = dict(plan.constexprs)
    constants.update(plan.scalars)
    inputs, outputs = [], []
    for o in operands.inputs:
        if o.used or not drop_unused:
            inputs.append((o.param, o.source))
        else:
            constants[o.param] = None
    in_params = [p for p, _ in inputs]
    aliases = []
    for o in operands.outputs:
        if o.used or not drop_unused:
            if o.aliases:
                aliases.append((in_params.index(o.aliases), len(outputs)))
            outputs.append((o.param, o.source if o.used else None))
        else:
            constants[o.param] = None
    order = {name: i for i, name in enumerate(kernel.arg_names)}
    return KernelCall(kernel, tuple(sorted(constants.items(), key=lambda kv: order[kv[0]])),
                      tuple(inputs), tuple(outputs), tuple(aliases), tuple(plan.grid),
                      plan.num_warps)


# ---------------------------------------------------------------------------------------------
# Triton IR: made by the triton package, parsed and serialized by jaxlib.

def compute_capability() -> int:
    """The default GPU's compute capability (90 on a machine without one: sm_90's IR)."""
    try:
        device = jax.devices("gpu")[0]
        return int(str(device.compute_capability).replace(".", ""))
    except (RuntimeError, AttributeError, ValueError):
        return 90


@functools.lru_cache(maxsize=256)
def ttir(kernel, constants: tuple, pointer_types: tuple, num_warps: int, capability: int) -> str:
    """The kernel's TTIR text (after Triton's TTIR passes) with ``constants`` compiled in and
    ``pointer_types`` as its only parameters, 16-byte aligned (XLA's buffers are)."""
    from triton._C.libtriton import ir as triton_ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler.compiler import make_backend

    consts, types = dict(constants), dict(pointer_types)
    signature_, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(kernel.arg_names):
        if name in consts:
            signature_[name], constexprs[(index,)] = "constexpr", consts[name]
        else:
            signature_[name], attrs[(index,)] = types[name], [["tt.divisibility", 16]]
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    # Exactness does not hang on fp fusion here: the kernels write every FMA explicitly.
    options = backend.parse_options(dict(num_warps=num_warps, num_stages=NUM_STAGES,
                                         enable_fp_fusion=False))
    context = triton_ir.context()
    triton_ir.load_dialects(context)
    backend.load_dialects(context)
    module = ASTSource(kernel, signature_, constexprs=constexprs, attrs=attrs).make_ir(
        target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
        context)
    return str(backend.make_ttir(module, {}, options, capability))


@functools.lru_cache(maxsize=256)
def jaxlib_bytecode(text: str) -> bytes:
    """``text`` (TTIR) parsed with jaxlib's Triton dialect and written as MLIR bytecode, without
    source locations (the form Pallas hands to XLA). Raises where jaxlib cannot parse it."""
    from jax._src.interpreters import mlir as jax_mlir
    from jaxlib.mlir import ir
    from jaxlib.triton import dialect

    context = jax_mlir.make_ir_context()
    dialect.register_dialect(context)
    with context:
        module = ir.Module.parse(text)
        if not module.operation.verify():
            raise ValueError("jaxlib's Triton dialect does not verify the kernel's IR")
        bare = ir.Module.parse(module.operation.get_asm(enable_debug_info=False))
        buffer = io.BytesIO()
        bare.operation.write_bytecode(buffer)
    return buffer.getvalue()


_WARNED: set = set()


def _warn_once(kernel_name: str, error: Exception) -> None:
    if kernel_name not in _WARNED:
        _WARNED.add(kernel_name)
        warnings.warn(f"fp8kv: {kernel_name} cannot take XLA's Triton call "
                      f"({type(error).__name__}: {error}); it runs through jax-triton. "
                      f"{ENV}=0 turns this path off.", XlaTritonWarning, stacklevel=4)


def launch(kernel, plan, operands: OperandMap, arrays: dict, new: dict | None = None):
    """As ``fp8kv_jax._triton._launch``, through XLA's Triton call: the written arrays by
    argument name; None where the kernel's IR cannot be made or parsed (then the caller launches
    through jax-triton)."""
    dtypes = {o.param: jnp.dtype(arrays[o.source].dtype).name for o in operands.inputs}
    for o in operands.outputs:
        dtypes[o.param] = (dtypes[o.aliases] if o.aliases else
                           jnp.dtype(new[o.source].dtype).name if o.used else "uint8")
    call = None
    for drop_unused in (True, False):
        try:
            call = kernel_call(kernel, plan, operands, drop_unused)
            ir_bytes = _ir(call, call.pointer_types(dtypes))
            break
        except Exception as e:   # noqa: BLE001 -- any failure to make or parse the IR falls back
            error, call = e, None
    if call is None:
        _warn_once(signature(kernel).kernel, error)
        return None
    results = _bind(call, ir_bytes, arrays, new)
    return {source: r for (_, source), r in zip(call.outputs, results) if source is not None}


def _ir(call: KernelCall, types: tuple) -> bytes:
    return jaxlib_bytecode(ttir(call.kernel, call.constants, types, call.num_warps,
                                compute_capability()))


def _out_shapes(call: KernelCall, arrays: dict, new: dict | None) -> tuple:
    aliased = {out: call.inputs[i][1] for i, out in call.aliases}
    shapes = []
    for k, (_, source) in enumerate(call.outputs):
        if k in aliased:
            x = arrays[aliased[k]]
            shapes.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
        else:
            shapes.append(new[source] if source is not None else _DUMMY)
    return tuple(shapes)


def _bind(call: KernelCall, ir_bytes: bytes, arrays: dict, new: dict | None) -> list:
    """The custom call (a primitive with a CUDA lowering); tests replace it with an interpreter
    run of the same :class:`KernelCall` (``tests/jax_glue.py``)."""
    out_shapes = _out_shapes(call, arrays, new)
    return kernel_call_p.bind(
        *(arrays[source] for _, source in call.inputs), name=signature(call.kernel).kernel,
        ir_bytes=ir_bytes, grid=call.grid + (1,) * (3 - len(call.grid)),
        num_warps=call.num_warps,
        out_avals=tuple(jax.core.ShapedArray(s.shape, jnp.dtype(s.dtype)) for s in out_shapes),
        aliases=call.aliases)


# ---------------------------------------------------------------------------------------------
# The primitive and its lowering.

def _make_primitive():
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    p = Primitive("fp8kv_xla_triton_call")
    p.multiple_results = True
    p.def_abstract_eval(lambda *avals, out_avals, **_: out_avals)

    def lower(ctx, *operands, name, ir_bytes, grid, num_warps, out_avals, aliases):
        from jaxlib.mlir import ir

        def i32(v):
            return ir.IntegerAttr.get(ir.IntegerType.get_signless(32), v)

        # Pallas's backend config (jaxlib 0.10.2 - 0.11.x), in row-major layouts.
        config = dict(name=ir.StringAttr.get(name), ir=ir.StringAttr.get(ir_bytes),
                      num_stages=i32(NUM_STAGES), num_warps=i32(num_warps), grid_x=i32(grid[0]),
                      grid_y=i32(grid[1]), grid_z=i32(grid[2]), debug=ir.BoolAttr.get(False))
        return jax.ffi.ffi_lowering(TARGET, backend_config=config,
                                    operand_output_aliases=dict(aliases))(ctx, *operands)

    mlir.register_lowering(p, lower, platform="cuda")
    return p


kernel_call_p = _make_primitive()
