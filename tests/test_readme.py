"""The README's Python snippets run as written (on a CPU machine too)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.helpers import jnp_where_jax_runs_on_the_cpu

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPETS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
# A JAX snippet without torch runs on JAX's default device: the jnp path where that is the CPU.
PARAMS = [pytest.param(i, marks=jnp_where_jax_runs_on_the_cpu()
                       if "fp8kv_jax" in code and "torch" not in code else [])
          for i, code in enumerate(SNIPPETS)]


def test_readme_has_snippets():
    assert len(SNIPPETS) >= 2


@pytest.mark.parametrize("index", PARAMS)
def test_readme_snippet_runs(index):
    code = SNIPPETS[index]
    for module in re.findall(r"import ([\w, .]+)", code.splitlines()[0]):
        for name in module.split(","):
            pytest.importorskip(name.strip().split(".")[0])
    exec(compile(code, f"README.md snippet {index}", "exec"), {})
