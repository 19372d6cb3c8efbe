"""Shared fixtures (helpers: :mod:`tests.helpers`)."""
from __future__ import annotations

import pytest

from tests.helpers import DEVICES


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


@pytest.fixture(autouse=True)
def _jnp_launches_no_kernel(request, monkeypatch):
    """A test marked ``jnp`` runs fp8kv_jax's jnp path only: what it checks does not depend on
    the installed Triton (nor torch), which is why the CI legs whose JAX is the oldest leg's do
    not run it again (scripts/ci_leg.sh). It fails if it launches a Triton kernel, compiled or
    interpreted."""
    if request.node.get_closest_marker("jnp") is None:
        return
    import triton.runtime.interpreter
    import triton.runtime.jit

    def refuse(*args, **kwargs):
        raise AssertionError("a test marked jnp launched a Triton kernel")

    monkeypatch.setattr(triton.runtime.interpreter.GridExecutor, "__call__", refuse)
    monkeypatch.setattr(triton.runtime.jit.JITFunction, "run", refuse)
