"""Every bench module imports: the bench reaches into the frontends' launch modules, and a rename
there must fail here rather than on the GPU machine."""
from __future__ import annotations

import importlib
from pathlib import Path

import pytest

pytest.importorskip("torch")   # the bench measures the torch frontend beside the JAX one

MODULES = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "bench").glob("*.py"))
NEEDS_MATPLOTLIB = ("plot",)   # the `bench` extra; every other module imports without it


@pytest.mark.parametrize("module", MODULES)
def test_bench_module_imports(module):
    if module in NEEDS_MATPLOTLIB:
        pytest.importorskip("matplotlib")
    importlib.import_module(f"bench.{module}")
