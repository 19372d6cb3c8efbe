"""Shared test helpers: the torch devices to run on and NumPy <-> torch conversion.

Every torch test is parametrized over ``device``: ``cpu`` runs the Triton kernels under the
interpreter (the exact conversion path), ``cuda`` runs them compiled. A machine without CUDA runs
the ``cpu`` half only; the GPU suite runs both.
"""
from __future__ import annotations

import numpy as np
import pytest

try:  # the JAX tests run without torch; the torch test modules importorskip it themselves
    import torch
except ImportError:
    torch = None

HAS_CUDA = torch is not None and torch.cuda.is_available()
DEVICES = ["cpu"] + (["cuda"] if HAS_CUDA else [])
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (runs in the GPU suite)")

# itemsize -> (NumPy unsigned, torch same-size) types for bit views
_BITS = {1: ("uint8", "uint8"), 2: ("uint16", "int16"), 4: ("uint32", "int32"), 8: ("uint64", "int64")}


def torch_dtype(name: str):
    return getattr(torch, name)


def to_torch(a, device):
    """A NumPy array (ml_dtypes included) as a torch tensor with the same bytes, on ``device``."""
    if a is None or isinstance(a, float):
        return a
    a = np.array(a, order="C", copy=True)
    signed = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}[a.itemsize]
    return torch.from_numpy(a.view(signed)).view(torch_dtype(a.dtype.name)).to(device)


def bits(t) -> np.ndarray:
    """Raw bits of a tensor as a NumPy unsigned array (NaN payloads included)."""
    t = t.detach().contiguous().cpu()
    np_bits, torch_bits = _BITS[t.element_size()]
    return t.view(getattr(torch, torch_bits)).numpy().view(np_bits)


def jnp_where_jax_runs_on_the_cpu() -> list:
    """``[pytest.mark.jnp]`` where JAX's default backend is the CPU, else ``[]``: a JAX call on the
    default device runs fp8kv_jax's jnp path only there (tests/conftest.py)."""
    try:
        import jax
    except ImportError:
        return []
    return [pytest.mark.jnp] if jax.default_backend() == "cpu" else []


def block_scaled_dequant_args(write_args: dict, fmt: str, **changes) -> dict:
    """``dequantize_pages`` arguments over the caches and block-scale caches of a good
    ``write_kv`` call of the block-scaled format ``fmt`` (a one-sequence, two-page table), with
    ``changes`` (``cache_format`` among them too)."""
    args = dict(key_cache=write_args["key_cache"], value_cache=write_args["value_cache"],
                block_table=torch.zeros(1, 2, dtype=torch.int32),
                key_scale_cache=write_args["key_scale_cache"],
                value_scale_cache=write_args["value_scale_cache"], cache_format=fmt)
    args.update(changes)
    return args


def raises_and_writes_nothing(call, args: dict, exc, match) -> None:
    """``call(**args)`` raises ``exc`` matching ``match`` and leaves every cache and scale-cache
    tensor among ``args`` as it was."""
    names = [n for n in ("key_cache", "value_cache", "kv_cache", "key_scale_cache",
                         "value_scale_cache") if isinstance(args.get(n), torch.Tensor)]
    before = [bits(args[n]) for n in names]
    with pytest.raises(exc, match=match):
        call(**args)
    for b, n in zip(before, names):
        np.testing.assert_array_equal(bits(args[n]), b)
