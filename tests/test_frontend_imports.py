"""A frontend imported without its framework says which extra to install (docs/SPEC.md section 8):
torch and JAX are extras of fp8kv, not dependencies. Each case runs in a fresh interpreter in
which the framework cannot be imported (``sys.modules[name] = None``), whatever is installed."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

BLOCKED_IMPORT = """
    import json, sys
    sys.modules[{blocked!r}] = None      # what `import {blocked}` meets where it is not installed
    try:
        import {frontend}
    except ImportError as e:
        print("RESULT " + json.dumps([type(e).__name__, e.name, str(e)]))
    else:
        print("RESULT null")
"""


@pytest.mark.parametrize("frontend,blocked,extra", [
    ("fp8kv_torch", "torch", 'pip install "fp8kv[torch]"'),
    ("fp8kv_jax", "jax", 'pip install "fp8kv[jax]"'),
])
def test_frontend_without_its_framework_names_the_extra(frontend, blocked, extra):
    code = textwrap.dedent(BLOCKED_IMPORT.format(blocked=blocked, frontend=frontend))
    got = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert got.returncode == 0, got.stderr
    result = json.loads(got.stdout.split("RESULT ")[1])
    assert result is not None, f"import {frontend} succeeded without {blocked}"
    kind, name, message = result
    # ModuleNotFoundError (an ImportError): pytest.importorskip of the frontend still skips.
    assert kind == "ModuleNotFoundError" and name == blocked, result
    assert message.startswith(f"{frontend} needs ") and extra in message, message
    assert f"import of {blocked} halted" in message   # the original reason is kept
