"""``TRITON_INTERPRET=1`` in a process that runs fp8kv (docs/SPEC.md section 9): CPU tensors give
the same bytes as without it (they run the interpreter anyway); a compiled launch -- CUDA
tensors, JAX arrays on the GPU -- raises, at the first call of every op of both frontends, one
error that names the variable and says what to do, before anything is written. Without it
Triton's own library functions would be interpreter functions, and a kernel that calls one
would fail deep inside Triton's compiler.

The variable counts when Triton is imported, so each case runs ``tests/interpret_calls.py`` in a
fresh interpreter. Without a GPU the call sites of compiled launches are reached by sending CPU
arrays down the GPU path (``--as-gpu``); on a GPU the real calls run (``gpu`` tests)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import HAS_CUDA

ROOT = Path(__file__).resolve().parents[1]
MESSAGE = ("RuntimeError: fp8kv: TRITON_INTERPRET is set, so Triton cannot compile fp8kv's "
           "kernels for CUDA tensors / arrays on the GPU. Unset TRITON_INTERPRET and start the "
           "process again: fp8kv runs CPU tensors under Triton's interpreter without it.")
CALLS = ["write_kv", "write_kv_combined", "write_kv stacked", "write_kv nvfp4", "dequantize_pages",
         "dequantize_pages_combined", "dequantize_pages stacked", "dequantize_pages nvfp4",
         "rope_write_kv", "rope_write_kv_combined"]


def _has(module: str) -> bool:
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def _frontends(*, gpu: bool = False):
    """torch and jax, each skipped where its framework (or, for ``gpu``, its GPU) is missing."""
    def jax_gpu() -> bool:
        import jax
        return jax.default_backend() == "gpu"

    torch_ok = _has("torch") and (HAS_CUDA or not gpu)
    jax_ok = _has("jax") and (not gpu or jax_gpu())
    where = "a CUDA GPU" if gpu else "the framework"
    return [pytest.param("torch", marks=pytest.mark.skipif(not torch_ok, reason=f"needs {where}")),
            pytest.param("jax", marks=pytest.mark.skipif(not jax_ok, reason=f"needs {where}"))]


def _run(frontend: str, device: str, interpret: bool, *extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    if device == "cpu":   # a CPU call touches no GPU, as on a machine without one
        env["JAX_PLATFORMS"] = "cpu"
    env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")   # JAX would take 75 % of the GPU
    got = subprocess.run([sys.executable, "-m", "tests.interpret_calls", frontend, device, *extra],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert got.returncode == 0, got.stdout + got.stderr
    results = [json.loads(line[len("RESULT "):]) for line in got.stdout.splitlines()
               if line.startswith("RESULT ")]
    assert [r["call"] for r in results] == CALLS, got.stdout
    return {r["call"]: r for r in results}


def _all_raised_and_wrote_nothing(results: dict) -> None:
    for call, r in results.items():
        assert r["raised"] == MESSAGE, (call, r)
        assert r["untouched"], f"{call} wrote before it raised"


def _all_ran(results: dict) -> None:
    for call, r in results.items():
        assert r["raised"] is None and r["digest"], (call, r)


def test_check_passes_without_the_variable(monkeypatch):
    from fp8kv.ops import _dual

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert _dual.check_compiled_launch() is None


def test_the_variable_set_after_import_is_refused(monkeypatch):
    from fp8kv import ops

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET is set, so Triton cannot compile"):
        ops.kernel_for(ops._write_kv_kernel, interpret=False)
    assert ops.kernel_for(ops._write_kv_kernel, interpret=True) is not ops._write_kv_kernel


def test_the_variable_set_at_import_and_unset_since_is_refused(monkeypatch):
    """What a process that imported Triton with the variable set and unset it later is in: its
    library functions stay interpreter functions (here: ``tl.max`` replaced by a non-JIT one)."""
    import triton.language as tl

    from fp8kv.ops import _dual

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(tl, "max", lambda *args, **kwargs: None)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET was set when Triton was imported"):
        _dual.check_compiled_launch()


@pytest.mark.parametrize("frontend", _frontends())
def test_cpu_calls_give_the_same_bytes_with_the_variable(frontend):
    plain = _run(frontend, "cpu", interpret=False)
    _all_ran(plain)
    assert _run(frontend, "cpu", interpret=True) == plain


@pytest.mark.parametrize("frontend", _frontends())
def test_compiled_launches_refuse_the_variable(frontend):
    """The GPU path of every op, reached with CPU arrays: each call raises before it writes."""
    _all_raised_and_wrote_nothing(_run(frontend, "cpu", True, "--as-gpu"))


@pytest.mark.gpu
@pytest.mark.parametrize("frontend", _frontends(gpu=True))
def test_gpu_calls_with_the_variable_raise_and_without_it_give_the_cpu_bytes(frontend):
    _all_raised_and_wrote_nothing(_run(frontend, "gpu", interpret=True))
    on_gpu = _run(frontend, "gpu", interpret=False)
    _all_ran(on_gpu)
    assert on_gpu == _run(frontend, "cpu", interpret=False)
