"""The private layer of fp8kv_torch (``_fast``) is optional and observable.

Each of its checks is forced to fail here (monkeypatched); the calls must then take the public
path with identical bytes and identical errors, and say so with one FastPathWarning per process.
``FP8KV_FAST=0`` turns the layer off. The checks that concern compiled launches run on the GPU.
"""
from __future__ import annotations

import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.helpers import bits, requires_cuda  # noqa: E402
from fp8kv_torch import (FastPathWarning, _fast, _launch, dequantize_pages,  # noqa: E402
                         dequantize_pages_combined, write_kv, write_kv_combined)


def _session(device, seed):
    """A short engine session: every op, static and dynamic scales, allocating and ``out=``,
    each signature called three times (validated, by key, by the last-call check), then a bad
    call. Returns the bits of every tensor written and the bad call's error."""
    g = torch.Generator().manual_seed(seed)
    k, v = (torch.randn(5, 2, 32, generator=g).to(torch.bfloat16).to(device) for _ in range(2))
    slots = torch.tensor([3, 0, -1, 17, 9], device=device)
    table = torch.tensor([[1, 0], [-1, 2]], dtype=torch.int32, device=device)
    scale = torch.tensor(0.25, device=device)
    written = []
    for _ in range(3):
        kc, vc = (torch.full((5, 4, 2, 32), 0x11, dtype=torch.uint8, device=device)
                  for _ in range(2))
        sc = [torch.full((5, 4, 2), -1.0, device=device) for _ in range(2)]
        kv = torch.full((5, 2, 4, 2, 32), 0x22, dtype=torch.uint8, device=device)
        write_kv(k, v, kc, vc, slots, scale, 0.5)
        write_kv(k, v, kc, vc, slots, key_scale_cache=sc[0], value_scale_cache=sc[1])
        write_kv_combined(k, v, kv, slots, scale, scale)
        outs = tuple(torch.empty(s, dtype=d, device=device) for s, d in (
            ((4, 4, 2, 32), torch.float32), ((4, 4, 2, 32), torch.float32), ((2, 2), torch.int32)))
        dequantize_pages(kc, vc, table, scale, 0.5, dtype=torch.float32, out=outs)
        new = dequantize_pages(kc, vc, table, key_scale_cache=sc[0], value_scale_cache=sc[1])
        combined = dequantize_pages_combined(kv, table, scale, scale)
        written += [kc, vc, *sc, kv, *outs, *new, *combined]
    try:
        write_kv(k, v, kc, vc, slots[:2], scale, scale)
    except ValueError as e:
        error = (type(e), str(e))
    return [bits(t) for t in written], error


def _run(device, monkeypatch, **patches):
    """``_session`` from empty caches with the fast path on (whatever FP8KV_FAST says: the suite
    also runs with it off) and ``patches`` applied to ``_fast`` (a check forced to fail, or the
    path turned off); returns its result and the FastPathWarnings it raised."""
    _launch.clear_launch_caches()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        monkeypatch.setattr(_fast, "_WARNED", set())
        for name, value in {"ENABLED": True, **patches}.items():
            monkeypatch.setattr(_fast, name, value)
        result = _session(device, seed=1)
    return result, [w for w in caught if issubclass(w.category, FastPathWarning)]


def _same(got, want):
    (got_bits, got_error), (want_bits, want_error) = got, want
    assert got_error == want_error
    assert len(got_bits) == len(want_bits)
    for g, w in zip(got_bits, want_bits):
        np.testing.assert_array_equal(g, w)


def _failing_guard_check():
    """What ``_tensor_guard`` does when torch's guards fail their self-test (or are gone)."""
    original = _fast._tensor_guard.__wrapped__

    def broken_guards(*tensors, **kwargs):
        raise AttributeError("no TensorGuards here")

    def check():
        import torch._C._dynamo.guards as guards
        saved = guards.TensorGuards
        guards.TensorGuards = broken_guards
        try:
            return original()
        finally:
            guards.TensorGuards = saved
    return check


def test_a_failed_guard_check_takes_the_public_path(device, monkeypatch):
    want, warned = _run(device, monkeypatch)
    assert not warned and _fast._tensor_guard() is not None
    got, warned = _run(device, monkeypatch, _tensor_guard=_failing_guard_check())
    _same(got, want)
    assert len(warned) == 1, [str(w.message) for w in warned]
    assert "'torch_tensor_guards'" in str(warned[0].message)
    assert not _launch._LAST     # no last-call check was made


def test_fast_off_takes_the_public_path(device, monkeypatch):
    want, _ = _run(device, monkeypatch)
    if device == "cuda":   # the default path launches directly on the GPU suite's Triton
        assert any("direct_launcher" in getattr(r.runner, "__qualname__", "")
                   for r in _launch._READY.values())
    got, warned = _run(device, monkeypatch, ENABLED=False)
    _same(got, want)
    assert not warned and not _launch._LAST
    for ready in _launch._READY.values():   # Triton's own runner, never the direct launcher
        assert "direct_launcher" not in getattr(ready.runner, "__qualname__", "")


def test_the_environment_variable_turns_the_fast_path_off():
    """FP8KV_FAST is read when ``_fast`` is imported. One process (torch is imported once) imports
    it with the variable unset, then executes it again (``importlib.reload``) under each value."""
    code = textwrap.dedent("""
        import importlib, os, sys
        os.environ.pop("FP8KV_FAST", None)
        import fp8kv_torch._fast as f
        print("unset", f.ENABLED)
        for value in sys.argv[1:]:
            os.environ["FP8KV_FAST"] = value
            print(repr(value), importlib.reload(f).ENABLED)
        """)
    want = {"0": False, "off": False, "1": True, "": True}
    out = subprocess.run([sys.executable, "-c", code, *want], capture_output=True, text=True,
                         check=True).stdout
    assert out.splitlines() == ["unset True", *(f"{v!r} {e}" for v, e in want.items())], out


@requires_cuda
@pytest.mark.parametrize("check", ["triton_runner", "triton_c_launcher"])
def test_gpu_a_failed_launcher_check_takes_the_public_path(check, monkeypatch):
    """On the GPU: the runner check failing gives Triton's runner; the C-launcher check failing
    gives the launcher object (the path of Triton 3.7-3.9). Same bytes, same errors, one
    warning."""
    want, warned = _run("cuda", monkeypatch)
    assert not warned
    patch = {"triton_runner": {"_runner_matches": lambda cls: False},
             "triton_c_launcher": {"_launcher_matches": lambda cls: False}}[check]
    got, warned = _run("cuda", monkeypatch, **patch)
    _same(got, want)
    assert len(warned) == 1 and f"'{check}'" in str(warned[0].message)
