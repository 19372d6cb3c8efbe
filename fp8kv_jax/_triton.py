"""The NVIDIA GPU path: the core's compiled Triton kernels, launched as XLA's own Triton call
(:mod:`fp8kv_jax._xla_triton`, where the installed versions allow) or through jax-triton.

Launches follow the core's plan (:mod:`fp8kv.plan`), bound by name (:mod:`fp8kv.binding`), and its
operand map (:mod:`fp8kv.operands`), exactly as ``fp8kv_torch`` does; an array written in place is
an input aliased to its output (``input_output_aliases``), so a cache donated under ``jax.jit`` is
updated in place.
"""
from __future__ import annotations

import functools
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from fp8kv.arrays import ArrayInfo
from fp8kv.attention import WORKSPACE, attention_operands, merge_operands, plan_attention
from fp8kv.binding import bind
from fp8kv.operands import OperandMap
from fp8kv.optable import OPS
from fp8kv.plan import CUDA

from . import _xla_triton
from ._args import DEVICE


@functools.cache
def jax_triton():
    """``import jax_triton``, undoing the ``TRITON_CACHE_DIR=""`` that 0.3.1 sets on import.

    That empty cache dir makes every later torch-side Triton launch in the process fail; jax-triton
    itself compiles without Triton's cache. Imported on first use, so that ``import fp8kv_jax``
    works where jax-triton cannot be imported (CPU-only jaxlib).
    """
    try:
        with mock.patch.dict(os.environ):  # restored on exit, whatever the import changed
            import jax_triton as jt
    except ImportError as e:
        raise ImportError("fp8kv_jax: arrays on an NVIDIA GPU run the Triton kernels through "
                          "jax-triton, which cannot be imported (pip install jax-triton==0.3.1)"
                          ) from e
    return jt


# A kernel output that the plan leaves unused (a combined cache: V goes through the K output; a
# static scale's output): jax-triton wants a buffer for it unless it is one of the trailing ones.
_UNUSED_OUTPUT = jax.ShapeDtypeStruct((1,), jnp.uint8)


def _launch(kernel, plan, operands: OperandMap, arrays: dict, new: dict | None = None,
            xla: bool = False) -> dict:
    """``triton_call`` of ``kernel``: each input parameter takes its argument from ``arrays``
    (by argument name), each output is aliased to its input (written in place), a new output
    of the shape ``new[argument]`` (a ShapeDtypeStruct), or unused. Returns the written
    arrays by argument name. ``xla``: XLA's Triton call where the kernel's IR allows."""
    from fp8kv.ops import kernel_for
    kernel = kernel_for(kernel, interpret=False)   # raises where Triton cannot compile it
    if xla:
        written = _xla_triton.launch(kernel, plan, operands, arrays, new)
        if written is not None:
            return written
    outputs = []
    for o in operands.outputs:
        if o.aliases:
            x = arrays[o.source]
            outputs.append(jax.ShapeDtypeStruct(x.shape, x.dtype))
        else:
            outputs.append(new[o.source] if o.used else _UNUSED_OUTPUT)
    call = bind(kernel, plan, {o.param: arrays[o.source] for o in operands.inputs}
                | {o.param: s for o, s in zip(operands.outputs, outputs)})
    in_params = [o.param for o in operands.inputs]
    aliases = {in_params.index(o.aliases): k for k, o in enumerate(operands.outputs)
               if o.aliases}
    # Trailing outputs that the plan leaves unused (a static write's scale outputs, a combined
    # write's V output) go to the kernel as None, a constexpr, instead of as buffers: each buffer
    # adds dispatch cost to every jitted call (bench/NOTES.md). jax-triton gives arrays to
    # parameters by position, so only a trailing run can go.
    kept = len(outputs)
    while kept and not operands.outputs[kept - 1].used:
        kept -= 1
    # jax-triton types a scalar by its Python type: int -> i32/i64 by value, np.float32 -> fp32
    # (a Python float would become fp64).
    scalars = [np.float32(v) if isinstance(v, float) else int(v) for v in call.scalars]
    results = jax_triton().triton_call(
        *call.inputs, *scalars, kernel=kernel, out_shape=list(call.outputs[:kept]),
        grid=plan.grid, num_warps=plan.num_warps, enable_fp_fusion=plan.enable_fp_fusion,
        input_output_aliases=aliases, name=call.signature.kernel,
        **dict.fromkeys(o.param for o in operands.outputs[kept:]), **call.constexprs)
    return {o.source: r for o, r in zip(operands.outputs, results) if o.used}


def launch(op: str, arrays: dict, *, args) -> dict:
    """As :func:`fp8kv_jax._jnp.launch`: the kernels of ``op`` (a family) as the op table plans
    them. A given output that is also a new one (``rope_write_kv``'s ``query_out``) is aliased:
    written in place when donated."""
    entry = OPS[op]
    if entry.workspace:   # several kernels and their scratch arrays
        return _paged_attention(arrays, args=args)
    return _one_kernel(arrays, op=op, args=args,
                       xla=_xla_triton.enabled() and entry.xla_triton(args))


# The path is a static argument: FP8KV_JAX_XLA_TRITON is read per call, and a jitted function
# traced for one path must not serve the other.
@functools.partial(jax.jit, static_argnames=("op", "args", "xla"))
def _one_kernel(arrays: dict, *, op: str, args, xla: bool) -> dict:
    """The launch of an op of one kernel, as the op table plans it (``op``: its family)."""
    from fp8kv import ops  # imports Triton: only on this path

    if xla:
        args, arrays = _xla_triton.device_scalars(args, arrays)
    entry, new = OPS[op], _new(op, args)
    outs = {name: ArrayInfo.contiguous(x.shape, x.dtype.name, DEVICE) for name, x in new.items()}
    plan = entry.plan(args, outs, CUDA)
    return _launch(getattr(ops, plan.kernel), plan, entry.operands(args), arrays, new, xla=xla)


def _new(op: str, args) -> dict:
    """The outputs a call of ``op`` makes (the op table's), as ShapeDtypeStructs by name."""
    return {name: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
            for name, (shape, dtype) in OPS[op].made(args).items()}


@functools.partial(jax.jit, static_argnames=("args",))
def _paged_attention(given: dict, *, args) -> dict:
    """The attention kernel and, where the plan splits the tokens, the merge of its fp32
    partials (docs/SPEC.md section 16), through jax-triton: the kernels torch runs, compiled by
    the installed Triton. (XLA's own compile of the same IR ignores the token loop's pipelining
    and gave other output bytes than torch's: bench/NOTES.md.)"""
    from fp8kv import ops  # imports Triton: only on this path

    plan = plan_attention(args, CUDA)   # two kernels where the tokens are split
    new = {"out": jax.ShapeDtypeStruct(args.out_shape, jnp.dtype(args.out_dtype)),
           **{n: jax.ShapeDtypeStruct(getattr(plan, n), jnp.float32) for n in WORKSPACE}}
    written = _launch(ops._paged_attention_kernel, plan.attention,
                      attention_operands(args, plan), given, new)
    if plan.merge is not None:   # (its output aliases the attention grid's where that wrote rows)
        written = _launch(ops._attention_merge_kernel, plan.merge, merge_operands(args, plan),
                          {**given, **written}, new)
    return {"out": written["out"]}
