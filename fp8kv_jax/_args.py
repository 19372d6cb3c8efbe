"""JAX arrays -> the core's ArrayInfo -> validated arguments, and which path runs them.

Validation is the core's (:mod:`fp8kv.validate`), so both frontends raise the same errors; how a
kernel is launched is the core's plan (:mod:`fp8kv.plan`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fp8kv.arrays import ArrayInfo

# JAX arrays have no strides and no per-array device the core could compare (jit places them):
# every array is contiguous and lives on this one "device".
DEVICE = "jax"


def as_array(x, name: str):
    """``x`` as a JAX array (a NumPy array is converted); anything else is a TypeError."""
    if isinstance(x, jax.Array):
        return x
    if isinstance(x, np.ndarray):
        return jnp.asarray(x)
    raise TypeError(f"{name}: expected a jax.Array, got {type(x).__name__}")


def as_scale(scale):
    """A scale or scale cache as given, a NumPy array as a JAX array (the core checks the rest)."""
    return jnp.asarray(scale) if isinstance(scale, np.ndarray) else scale


def host_values(x, name: str) -> np.ndarray:
    """``x``'s values on the host, for the opt-in bounds checks (a device sync)."""
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"check_bounds: reads {name} on the host, which needs a concrete array, "
                        f"got a traced one (under jax.jit); check outside the jitted function")
    return np.asarray(x)


def info(x: jax.Array, name: str) -> ArrayInfo:
    """What the core validates of an array (:func:`as_array` made it one; ``name`` is unused)."""
    return ArrayInfo.contiguous(x.shape, jnp.dtype(x.dtype).name, DEVICE)


def jax_name(dtype) -> str | None:
    """The name of a JAX or NumPy dtype (``jnp.bfloat16``, ``np.dtype("float32")``), else None."""
    if dtype is None:   # jnp.dtype(None) is the default float type: not a spelling of one
        return None
    try:
        return jnp.dtype(dtype).name
    except (TypeError, ValueError):
        return None


def _is_cuda(device) -> bool:
    # ROCm devices are "gpu" too, but the kernels are planned and tested for NVIDIA only.
    return device.platform == "gpu" and "rocm" not in device.client.platform_version.lower()


def _default_device():
    """Where a trace's arrays will live: ``jax.default_device``, else the default backend."""
    device = jax.config.jax_default_device
    if device is None:
        return jax.devices()[0]
    return jax.devices(device)[0] if isinstance(device, str) else device


def use_triton(arrays) -> bool:
    """Whether the Triton kernels run these arrays: they live on an NVIDIA GPU.

    Concrete arrays say where they live; under a trace (jit, shard_map) they will live on the
    default device.
    """
    devices = {d for x in arrays if isinstance(x, jax.Array) and not isinstance(x, jax.core.Tracer)
               for d in x.devices()}
    return all(_is_cuda(d) for d in devices or {_default_device()})
