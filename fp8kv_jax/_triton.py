"""The NVIDIA GPU path: the core's compiled Triton kernels, launched through jax-triton.

Launches follow the core's plan (:mod:`fp8kv.plan`), bound by name (:mod:`fp8kv.binding`), exactly
as ``fp8kv_torch`` does; a cache is an input aliased to its output (``input_output_aliases``), so a
cache donated under ``jax.jit`` is updated in place.
"""
from __future__ import annotations

import functools
import os
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from fp8kv.arrays import ArrayInfo
from fp8kv.binding import bind
from fp8kv.plan import CUDA, plan_dequantize, plan_write
from fp8kv.validate import dequantized_shape

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


# A kernel output that the plan leaves unused (SHARED_OUT: V goes through the K output; a static
# scale's output): jax-triton wants a buffer for it unless it is one of the trailing ones.
_UNUSED_OUTPUT = jax.ShapeDtypeStruct((1,), jnp.uint8)


def _launch(kernel, plan, arrays: dict, aliased: tuple[str, ...] = ()):
    """``triton_call`` of ``kernel`` with ``arrays`` by parameter name (outputs as
    ShapeDtypeStructs); each ``X_out_ptr`` with ``X`` in ``aliased`` reuses input ``X_ptr``.
    Returns the outputs in the kernel's order, None for an unused one."""
    call = bind(kernel, plan, arrays)
    inputs, outputs = call.signature.inputs, call.signature.outputs
    # Trailing outputs that the plan leaves unused (a static write's scale outputs, a combined
    # write's V output) go to the kernel as None, a constexpr, instead of as buffers: each buffer
    # costs a jitted call ~3 us of dispatch (bench/NOTES.md item 22). jax-triton gives arrays to
    # parameters by position, so only a trailing run can go.
    kept = len(outputs)
    while call.outputs[kept - 1] is _UNUSED_OUTPUT:
        kept -= 1
    aliases = {inputs.index(f"{name}_ptr"): outputs.index(f"{name}_out_ptr") for name in aliased}
    # jax-triton types a scalar by its Python type: int -> i32/i64 by value, np.float32 -> fp32
    # (a Python float would become fp64).
    scalars = [np.float32(v) if isinstance(v, float) else int(v) for v in call.scalars]
    results = jax_triton().triton_call(
        *call.inputs, *scalars, kernel=kernel, out_shape=list(call.outputs[:kept]),
        grid=plan.grid, num_warps=plan.num_warps, enable_fp_fusion=plan.enable_fp_fusion,
        input_output_aliases=aliases, name=call.signature.kernel,
        **dict.fromkeys(outputs[kept:]), **call.constexprs)
    return (*results, *[None] * (len(outputs) - kept))


def _like(x):
    """The output that ``x`` is aliased to, or the unused one without ``x``."""
    return _UNUSED_OUTPUT if x is None else jax.ShapeDtypeStruct(x.shape, x.dtype)


@functools.partial(jax.jit, static_argnames=("args",))
def write_kv(key, value, key_cache, value_cache, slots, key_scale, value_scale, key_scale_cache,
             value_scale_cache, *, args):
    """As :func:`fp8kv_jax._jnp.write_kv`: the caches (the combined one alone when
    ``args.combined``; ``value_cache`` is then None), then the side scale arrays (or None)."""
    from fp8kv import ops  # imports Triton: only on this path

    plan = plan_write(args, CUDA)
    # A scale that is not an array is a plan scalar; the kernel still takes a pointer. A side
    # scale array takes the static scale's pointer and is aliased to its scale output.
    key_scale = key_scale_cache if key_scale_cache is not None else key_scale
    value_scale = value_scale_cache if value_scale_cache is not None else value_scale
    arrays = dict(key_ptr=key, value_ptr=value, key_cache_ptr=key_cache,
                  value_cache_ptr=key_cache if args.combined else value_cache, slot_ptr=slots,
                  key_scale_ptr=slots if key_scale is None else key_scale,
                  value_scale_ptr=slots if value_scale is None else value_scale,
                  key_cache_out_ptr=_like(key_cache), value_cache_out_ptr=_like(value_cache),
                  key_scale_out_ptr=_like(key_scale_cache),
                  value_scale_out_ptr=_like(value_scale_cache))
    aliased = ("key_cache",) if args.combined else ("key_cache", "value_cache")
    aliased += ("key_scale",) * (key_scale_cache is not None)
    aliased += ("value_scale",) * (value_scale_cache is not None)
    key_cache, value_cache, ksc, vsc = _launch(ops._write_kv_kernel, plan, arrays, aliased)
    ksc = ksc if key_scale_cache is not None else None
    vsc = vsc if value_scale_cache is not None else None
    return (key_cache, ksc, vsc) if args.combined else (key_cache, value_cache, ksc, vsc)


@functools.partial(jax.jit, static_argnames=("args", "combined"))
def dequantize_pages(key_cache, value_cache, block_table, key_scale, value_scale,
                     key_scale_cache=None, value_scale_cache=None, *, args, combined):
    """As :func:`fp8kv_jax._jnp.dequantize_pages`."""
    from fp8kv import ops  # imports Triton: only on this path

    shape = dequantized_shape(args, combined)
    out = ArrayInfo.contiguous(shape, args.out_dtype, DEVICE)
    plan = plan_dequantize(args, out, None if combined else out, CUDA)
    pages = jax.ShapeDtypeStruct(shape, jnp.dtype(args.out_dtype))
    table = jax.ShapeDtypeStruct((args.batch, args.pages_per_seq), jnp.int32)
    # A combined cache is both cache operands; the plan's value_cache_offset finds V in it. A
    # side scale array takes the static scale's pointer.
    key_scale = key_scale_cache if key_scale_cache is not None else key_scale
    value_scale = value_scale_cache if value_scale_cache is not None else value_scale
    arrays = dict(key_cache_ptr=key_cache,
                  value_cache_ptr=key_cache if value_cache is None else value_cache,
                  table_ptr=block_table,
                  key_scale_ptr=block_table if key_scale is None else key_scale,
                  value_scale_ptr=block_table if value_scale is None else value_scale,
                  key_out_ptr=pages, value_out_ptr=_UNUSED_OUTPUT if combined else pages,
                  new_table_ptr=table)
    key_pages, value_pages, new_table = _launch(ops._dequantize_pages_kernel, plan, arrays)
    return (key_pages, new_table) if combined else (key_pages, value_pages, new_table)
