"""Bad input: every row of tests/bad_inputs.py through each frontend it applies to.

torch: the exception and message, and not one byte written (caches and ``out=`` tensors start
poisoned; every tensor the call was given is compared after it). JAX: the exception and message.
Rows both frontends run: the very same exception type and message from both (the core's).
"""
from __future__ import annotations

import numpy as np
import pytest

from tests import bad_inputs
from tests.bad_inputs import SENTINEL
from tests.helpers import requires_cuda


def _params(rows):
    return [pytest.param(row, id=row.id, marks=[requires_cuda] if row.cuda else [])
            for row in rows]


class TorchArrays:
    """``a`` for torch: NumPy -> a new tensor on ``device``; remembers each tensor and its bytes."""

    def __init__(self, device: str):
        self.device = device
        self.made = []   # (tensor, its bytes when made)

    def __call__(self, x, device=None):
        from tests.helpers import bits, to_torch

        t = to_torch(x, device or self.device)
        self.made.append((t, bits(t).copy()))
        return t

    @staticmethod
    def dtype(name: str):
        import torch

        return getattr(torch, name)


class JaxArrays:
    """``a`` for JAX: NumPy -> a JAX array on the default device."""

    def __call__(self, x):
        import jax.numpy as jnp

        return jnp.asarray(x)

    @staticmethod
    def dtype(name: str):
        import jax.numpy as jnp

        return jnp.dtype(name)


def _error(call) -> tuple[type, str]:
    with pytest.raises((TypeError, ValueError)) as info:
        call()
    return type(info.value), str(info.value)


@pytest.mark.parametrize("row", _params(bad_inputs.rows("torch")))
def test_torch_rejects(row, device):
    pytest.importorskip("torch")
    import fp8kv_torch
    from tests.helpers import bits

    arrays = TorchArrays(device)
    with pytest.raises(row.exc, match=row.match):
        row.call(fp8kv_torch, arrays)
    # Nothing written: every tensor the call was given holds the bytes it was made with, the
    # caches (and out= tensors) among them still all SENTINEL.
    assert any(bool((before.view(np.uint8) == SENTINEL).all()) for _, before in arrays.made)
    for t, before in arrays.made:
        np.testing.assert_array_equal(bits(t), before)


@pytest.mark.parametrize("row", _params(bad_inputs.rows("jax")))
def test_jax_rejects(row):
    pytest.importorskip("jax")
    import fp8kv_jax

    with pytest.raises(row.exc, match=row.match):
        row.call(fp8kv_jax, JaxArrays())


@pytest.mark.parametrize("row", _params(bad_inputs.shared_rows()))
def test_torch_and_jax_raise_the_same_error(row, device):
    pytest.importorskip("torch")
    pytest.importorskip("jax")
    import fp8kv_jax
    import fp8kv_torch

    torch_error = _error(lambda: row.call(fp8kv_torch, TorchArrays(device)))
    jax_error = _error(lambda: row.call(fp8kv_jax, JaxArrays()))
    assert torch_error == jax_error
    assert torch_error[0] is row.exc
