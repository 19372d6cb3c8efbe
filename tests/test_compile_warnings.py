"""``torch.compile(fullgraph=True)`` of functions that call fp8kv's ops warns about nothing of
fp8kv's (Dynamo warns, for instance, when it traces through an ``lru_cache``-wrapped function:
the frontends' trace-time code must not call one).

A warning is fp8kv's when it is raised from one of the package's own module files -- not when
some path merely contains "fp8kv": a checkout named fp8kv holds the venvs of scripts/test.sh, and
torch's own deprecation warnings come from files under it."""
from __future__ import annotations

import warnings
from pathlib import Path

import pytest

import fp8kv

torch = pytest.importorskip("torch")
import fp8kv_torch  # noqa: E402

PACKAGES = ("fp8kv", "fp8kv_torch", "fp8kv_jax")
OWN_FILES = frozenset(str(f.resolve()) for package in PACKAGES
                      for f in (Path(fp8kv.__file__).resolve().parents[1] / package).rglob("*.py"))


def _ours(w: warnings.WarningMessage) -> bool:
    return str(Path(w.filename).resolve()) in OWN_FILES or "lru_cache" in str(w.message)


def _warning(filename: str, message: str = "something") -> warnings.WarningMessage:
    return warnings.WarningMessage(message, DeprecationWarning, filename, 1)


def test_ours_are_the_package_files_not_paths_that_contain_its_name(tmp_path):
    """What made the suite fail in a clone named fp8kv: torch's warning from a venv inside it."""
    clone = tmp_path / "fp8kv"
    torch_file = clone / ".venv-oldest/lib/python3.11/site-packages/torch/jit/_script.py"
    assert not _ours(_warning(str(torch_file), "torch.jit.script_method is deprecated"))
    assert not _ours(_warning(str(clone / "fp8kv_torch" / "_ops.py")))   # another checkout's
    assert _ours(_warning(fp8kv_torch._ops.__file__))
    assert _ours(_warning(str(Path(fp8kv.__file__).parent / "ops" / ".." / "validate.py")))
    assert _ours(_warning("<frozen importlib>", "lru_cache wrapped function traced"))
    assert {"_launch.py", "_shard.py", "_dual.py"} <= {Path(f).name for f in OWN_FILES}


def test_compile_fullgraph_without_warnings():
    torch._dynamo.reset()
    key = torch.randn(3, 2, 16, dtype=torch.bfloat16)
    k_cache = torch.zeros(4, 4, 2, 16, dtype=torch.float8_e4m3fn)
    v_cache = torch.zeros_like(k_cache)
    kv = torch.zeros(4, 2, 4, 2, 16, dtype=torch.float8_e4m3fn)
    slots = torch.tensor([0, 5, 9])
    table = torch.tensor([[1, 2]], dtype=torch.int32)

    def write(k, kc, vc, kv, s):
        fp8kv_torch.write_kv(k, k, kc, vc, s, 0.5, 0.5)
        fp8kv_torch.write_kv_combined(k, k, kv, s, 0.5, 0.5)
        return kc

    def dequantize(kc, vc, kv, t):   # allocating: the outputs are made in the trace
        return (fp8kv_torch.dequantize_pages(kc, vc, t, 0.5, 0.5, dtype="float16"),
                fp8kv_torch.dequantize_pages_combined(kv, t, 0.5, 0.5))

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(write, fullgraph=True)(key, k_cache, v_cache, kv, slots)
        (k, v, new_table), (pages, _) = torch.compile(dequantize, fullgraph=True)(
            k_cache, v_cache, kv, table)
    ours = [f"{w.category.__name__}: {w.message}" for w in caught if _ours(w)]
    assert ours == []
    # The compiled calls ran: what was written reads back as the eager calls give it.
    want = fp8kv_torch.dequantize_pages(k_cache, v_cache, table, 0.5, 0.5, dtype=torch.float16)
    assert k.dtype == torch.float16 and torch.equal(k, want[0]) and torch.equal(v, want[1])
    assert k[0].abs().sum() > 0 and pages.shape == (2, 2, 4, 2, 16)
