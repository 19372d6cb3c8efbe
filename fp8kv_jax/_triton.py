"""The NVIDIA GPU path: the core's compiled Triton kernels, launched through jax-triton.

Launches follow the core's plan (:mod:`fp8kv.plan`) exactly as ``fp8kv_torch`` does; a cache is an
operand aliased to its output (``input_output_aliases``), so a cache donated under ``jax.jit`` is
updated in place. Kernel parameters are array operands, then the plan's scalars, then one pointer
per output.
"""
from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from fp8kv.arrays import ArrayInfo
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
    saved = os.environ.get("TRITON_CACHE_DIR")
    try:
        import jax_triton as jt
    except ImportError as e:
        raise ImportError("fp8kv_jax: arrays on an NVIDIA GPU run the Triton kernels through "
                          "jax-triton, which cannot be imported (pip install jax-triton==0.3.1)"
                          ) from e
    finally:
        if saved is None:
            os.environ.pop("TRITON_CACHE_DIR", None)
        else:
            os.environ["TRITON_CACHE_DIR"] = saved
    return jt


def _launch(kernel, plan, arrays, outputs, aliases):
    # jax-triton types a scalar by its Python type: int -> i32/i64 by value, np.float32 -> fp32
    # (a Python float would become fp64).
    scalars = [np.float32(v) if t == "fp32" else int(v)
               for v, t in zip(plan.scalars, plan.scalar_types)]
    return jax_triton().triton_call(
        *arrays, *scalars, kernel=kernel, out_shape=outputs, grid=plan.grid,
        num_warps=plan.num_warps, input_output_aliases=aliases, **plan.constexprs)


def _like(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype)


@functools.partial(jax.jit, static_argnames=("args", "layout", "combined"))
def write_kv(key, value, key_cache, value_cache, slots, key_scale, value_scale, *, args, layout,
             combined):
    """As :func:`fp8kv_jax._xla.write_kv` (``layout`` is already in ``args``' strides)."""
    from fp8kv import ops  # imports Triton: only on this path

    plan = plan_write(args, CUDA, None, combined)
    # A scale that is not an array is a plan scalar; the kernel still takes a pointer.
    ks = slots if key_scale is None else key_scale
    vs = slots if value_scale is None else value_scale
    if combined:
        (kv_cache,) = _launch(ops._write_kv_combined_kernel, plan,
                              (key, value, key_cache, slots, ks, vs), (_like(key_cache),), {2: 0})
        return kv_cache
    return tuple(_launch(ops._write_kv_kernel, plan,
                         (key, value, key_cache, value_cache, slots, ks, vs),
                         (_like(key_cache), _like(value_cache)), {2: 0, 3: 1}))


@functools.partial(jax.jit, static_argnames=("args", "combined"))
def dequantize_pages(key_cache, value_cache, block_table, key_scale, value_scale, *, args,
                     combined):
    """As :func:`fp8kv_jax._xla.dequantize_pages`."""
    from fp8kv import ops  # imports Triton: only on this path

    shape = dequantized_shape(args, combined)
    out = ArrayInfo.contiguous(shape, args.out_dtype, DEVICE)
    plan = plan_dequantize(args, out, None if combined else out, CUDA)
    pages = jax.ShapeDtypeStruct(shape, jnp.dtype(args.out_dtype))
    table = jax.ShapeDtypeStruct((args.batch, args.pages_per_seq), jnp.int32)
    # A combined cache is both cache operands; the plan's value_in_offset finds V in it.
    value_cache = key_cache if combined else value_cache
    arrays = (key_cache, value_cache, block_table,
              block_table if key_scale is None else key_scale,
              block_table if value_scale is None else value_scale)
    if combined:
        return tuple(_launch(ops._dequantize_pages_combined_kernel, plan, arrays, (pages, table),
                             {}))
    return tuple(_launch(ops._dequantize_pages_kernel, plan, arrays, (pages, pages, table), {}))
