"""The test command's scripts on a machine without an interpreter a leg needs: one line that says
which leg needs what and how to provide it, a clean non-zero status for that leg, the other legs
still run, and the summary lists them all. Nothing here creates a virtual environment: the legs
stop before that (no interpreter, or an unknown leg)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="needs bash")   # every CI machine has it


def _bare_path(tmp_path: Path) -> str:
    """A PATH with the few tools the scripts call before they look for Python, and no Python
    (nor pyenv): no leg's interpreter can be found on it."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


def _env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("PYTHON3") or k in ("VIRTUAL_ENV", "PYENV_VERSION"))}
    env.update(PATH=_bare_path(tmp_path), PYENV_ROOT=str(tmp_path / "no-pyenv"), **extra)
    return env


def _bash(script: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([BASH, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=60)


def test_find_python_finds_nothing_on_a_bare_path(tmp_path):
    got = _bash('. scripts/find_python.sh; find_python 3.12; echo "status $?"', _env(tmp_path))
    assert got.stdout == "status 1\n", got
    assert got.stderr == ""


def test_find_python_takes_the_variable(tmp_path):
    """PYTHON<major><minor> names the interpreter (here, the one running the tests)."""
    version = "%d.%d" % sys.version_info[:2]
    var = "PYTHON%d%d" % sys.version_info[:2]
    env = _env(tmp_path, **{var: sys.executable})
    got = _bash(f'. scripts/find_python.sh; find_python {version}; echo "status $?"', env)
    assert got.stdout.splitlines() == [sys.executable, "status 0"], got


def test_find_python_rejects_another_version(tmp_path):
    """A PYTHON312 that is not 3.12 is not taken."""
    other = "3.99"
    env = _env(tmp_path, PYTHON399=sys.executable)
    got = _bash(f'. scripts/find_python.sh; find_python {other}; echo "status $?"', env)
    assert got.stdout == "status 1\n", got


def test_missing_interpreter_fails_its_leg_in_one_line(tmp_path):
    venvs = tmp_path / "venvs"
    env = _env(tmp_path, CI_LEGS="jax nope", CI_VENVS=str(venvs))
    got = subprocess.run([BASH, ".ci/run"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert got.returncode == 1, got
    assert "command not found" not in got.stdout + got.stderr
    lines = [line for line in got.stderr.splitlines() if line.startswith("ci_leg.sh:")]
    assert lines == [
        "ci_leg.sh: leg 'jax' needs Python 3.12 (not found on PATH or in pyenv); install it or "
        "set PYTHON312=/path/to/python3.12",
        "ci_leg.sh: unknown leg 'nope' (oldest, newest, torch214, jax)"], got.stderr
    summary = got.stdout.split("=== summary\n")[1].splitlines()
    assert [line.split()[:4] for line in summary] == [["jax", "FAILED", "(exit", "3)"],
                                                       ["nope", "FAILED", "(exit", "2)"]], summary
    assert not venvs.exists()   # the failing leg stopped before making a venv


def test_test_sh_runs_ci_run(tmp_path):
    """The README's command is the CI's: scripts/test.sh passes through to .ci/run."""
    env = _env(tmp_path, CI_LEGS="nope", CI_VENVS=str(tmp_path / "venvs"))
    got = subprocess.run([BASH, "scripts/test.sh"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert got.returncode == 1
    assert "=== summary" in got.stdout and "nope     FAILED (exit 2)" in got.stdout, got
