"""The test command's scripts on a machine without an interpreter a leg needs: one line that says
which leg needs what and how to provide it, a clean non-zero status for that leg, the other legs
still run, and the summary lists them all. Nothing here creates a virtual environment: the legs
stop before that (no interpreter, or an unknown leg), or find a stand-in venv whose ``python``
records what it is asked to do (pip, the version check, pytest) instead of doing it."""
from __future__ import annotations

import os
import re
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
    if not bin_dir.exists():
        bin_dir.mkdir()
        for tool in ("bash", "dirname", "mktemp", "rm", "cat", "grep", "sleep", "df", "tar",
                     "mkdir", "ln", "ls"):
            (bin_dir / tool).symlink_to(shutil.which(tool))
    return str(bin_dir)


def _env(tmp_path: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith(("PYTHON3", "CI_")) or k in ("VIRTUAL_ENV", "PYENV_VERSION"))}
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
    assert [line.split()[:4] for line in summary[:2]] == [["jax", "FAILED", "(exit", "3)"],
                                                           ["nope", "FAILED", "(exit", "2)"]], summary
    assert summary[2].startswith("total: ") and len(summary) == 3, summary
    assert not venvs.exists()   # the failing leg stopped before making a venv


def test_test_sh_runs_ci_run(tmp_path):
    """The README's command is the CI's: scripts/test.sh passes through to .ci/run."""
    env = _env(tmp_path, CI_LEGS="nope", CI_VENVS=str(tmp_path / "venvs"))
    got = subprocess.run([BASH, "scripts/test.sh"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert got.returncode == 1
    assert "=== summary" in got.stdout and "nope     FAILED (exit 2)" in got.stdout, got


# A stand-in for a leg's venv: its ``python`` (a bash script) logs every call to calls.log (and
# pytest's arguments, one a line, to pytest-args; its working directory and own path to
# pytest-where, the directory's entries to pytest-tree; every leg's calls in order to
# all-calls.log), makes its pip installs wait until the other stand-in legs (OTHERS) have started
# theirs (so that setups one after another would time out), and fails where told to (FAIL_PIP: the pins' install; PYTEST_RC:
# the test command's status). ``python -c`` (ci_leg.sh's lock around the editable install) runs
# the real interpreter.
FAKE_PYTHON = r"""#!/usr/bin/env bash
here=$(cd "$(dirname "$0")/.." && pwd)
echo "$*" >> "$here/calls.log"
echo "${here##*/}" >> "$here/../all-calls.log"
case "$1 $2" in
    "-m pip")
        : > "$here/pip-started"
        for other in $OTHERS; do
            n=0
            until [ -e "$other/pip-started" ]; do
                n=$((n + 1)); [ $n -gt 300 ] && { echo "$other never started" >&2; exit 9; }
                sleep 0.1
            done
        done
        if [ -n "${FAIL_PIP:-}" ] && [[ "$*" == *"=="* ]]; then
            echo "ERROR: No matching distribution found for $FAIL_PIP" >&2; exit 1
        fi ;;
    "-m pytest") printf '%s\n' "${@:3}" > "$here/pytest-args"
                 printf '%s\n' "$PWD" "$0" > "$here/pytest-where"; ls -A > "$here/pytest-tree"
                 echo "pytest ran in ${here##*/}"; exit "${PYTEST_RC:-0}" ;;
    "- "*) cat > /dev/null; echo "[$2] Python $3 (stand-in)" ;;
    "-c "*) exec REAL_PYTHON "$@" ;;
    *) echo "unexpected: $*" >&2; exit 8 ;;
esac
"""


def _stand_in_venvs(tmp_path: Path, legs: dict) -> Path:
    """legs: leg -> extra environment of its python; returns the CI_VENVS folder."""
    venvs = tmp_path / "venvs"
    dirs = {leg: venvs / f".venv-{leg}" for leg in legs}
    for leg, extra in legs.items():
        bin_dir = dirs[leg] / "bin"
        bin_dir.mkdir(parents=True)
        python = bin_dir / "python"
        python.write_text(FAKE_PYTHON.replace("REAL_PYTHON", sys.executable))
        python.chmod(0o755)
        others = " ".join(str(d) for other, d in dirs.items() if other != leg)
        exports = "".join(f"export {k}={v}\n" for k, v in extra.items())
        (bin_dir / "activate").write_text(
            f"export PATH={bin_dir}:$PATH VIRTUAL_ENV={dirs[leg]} OTHERS='{others}'\n{exports}")
    return venvs


def _ci_run(tmp_path: Path, legs: str, venvs: Path, *args: str,
            **extra) -> subprocess.CompletedProcess:
    """.ci/run with the stand-in venvs; the legs set up at once (whatever room the disk has
    here) unless ``extra`` says otherwise."""
    extra = {"CI_SETUP": "at-once", **extra}
    env = _env(tmp_path, CI_LEGS=legs, CI_VENVS=str(venvs), TMPDIR=str(tmp_path), **extra)
    return subprocess.run([BASH, ".ci/run", *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


def _summary(got) -> list:
    return [line.split()[:4] for line in got.stdout.split("=== summary\n")[1].splitlines()[:-1]]


def test_setups_run_at_once_then_each_leg_runs_the_readme_command(tmp_path):
    venvs = _stand_in_venvs(tmp_path, {"newest": {}, "oldest": {}})
    got = _ci_run(tmp_path, "newest oldest", venvs, "-k", "some_test")
    assert got.returncode == 0, got
    assert got.stdout.index("pytest ran in .venv-newest") < got.stdout.index(
        "pytest ran in .venv-oldest"), got.stdout
    assert "[newest] Python 3.11 (stand-in)" in got.stdout and "FAILED" not in got.stdout
    assert _summary(got) == [["newest", "passed", "(exit", "0)"],
                             ["oldest", "passed", "(exit", "0)"]], got.stdout
    readme = ["tests", "fp8kv_torch", "fp8kv_jax", "--doctest-modules", "-q", "-n", "auto"]
    newest = ["--deselect", "tests/test_jax.py", "--deselect", "fp8kv_jax", "-m", "not jnp"]
    newest += [a for f in JAX_FILES for a in ("--deselect", f)]
    for leg, leg_args in (("newest", newest),
                          ("oldest", [])):
        calls = (venvs / f".venv-{leg}" / "calls.log").read_text().splitlines()
        pip = [c for c in calls if c.startswith("-m pip install")]
        assert len(pip) == 3 and all("--no-compile" in c for c in pip), calls
        assert any(c.endswith("/editable.lock python -m pip install -q --no-cache-dir "
                              "--no-compile -e "
                              ".[test,bench]") for c in calls), calls   # the locked install
        assert calls[-1].startswith("-m pytest "), calls
        pytest_args = (venvs / f".venv-{leg}" / "pytest-args").read_text().splitlines()
        assert pytest_args == readme + leg_args + ["-k", "some_test"], pytest_args
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "venvs"]   # work folder gone


def test_a_failed_setup_fails_its_leg_with_its_log_and_the_others_run(tmp_path):
    venvs = _stand_in_venvs(tmp_path, {"oldest": {"FAIL_PIP": "torch==2.13.0"},
                                       "newest": {"PYTEST_RC": "5"}, "torch214": {}})
    got = _ci_run(tmp_path, "oldest newest nope torch214", venvs)
    assert got.returncode == 1, got
    assert "leg oldest: setup failed (exit 1); its log:" in got.stderr
    assert "ERROR: No matching distribution found for torch==2.13.0" in got.stderr
    assert re.search(r"^leg oldest: \d+ GB free in \S+ \(its venv takes about 3 GB; setup "
                     r"at-once\)$", got.stderr, re.M), got.stderr
    assert "ci_leg.sh: unknown leg 'nope' (oldest, newest, torch214, jax)" in got.stderr
    assert "leg newest: pytest collected no tests" in got.stderr
    assert "pytest ran in .venv-oldest" not in got.stdout
    assert "pytest ran in .venv-newest" in got.stdout and "pytest ran in .venv-torch214" in got.stdout
    assert _summary(got) == [["oldest", "FAILED", "(exit", "1)"],
                             ["newest", "FAILED", "(exit", "5)"],
                             ["nope", "FAILED", "(exit", "2)"],
                             ["torch214", "passed", "(exit", "0)"]], got.stdout


DF_5GB = """#!/usr/bin/env bash
echo "Filesystem 1024-blocks Used Available Capacity Mounted on"
echo "/dev/x 100000000 94757120 5242880 95% /"
"""


def test_short_of_disk_each_leg_is_set_up_just_before_its_tests(tmp_path):
    """With less room than the legs' venvs take at once (df says 5 GB; newest + oldest take 6),
    leg after leg: setup, then tests; a venv that was there before the run is kept."""
    venvs = _stand_in_venvs(tmp_path, {"newest": {"OTHERS": "''"}, "oldest": {"OTHERS": "''"}})
    df = Path(_bare_path(tmp_path)) / "df"
    df.unlink()
    df.write_text(DF_5GB)
    df.chmod(0o755)
    got = _ci_run(tmp_path, "newest oldest", venvs, CI_SETUP="")
    assert got.returncode == 0, got
    assert got.stdout.startswith(
        f"setup: one leg at a time (5 GB free in {venvs}; the legs' venvs take about 6 GB at "
        "once)\n"), got.stdout
    order = [line.split()[0] for line in (venvs / "all-calls.log").read_text().splitlines()]
    first_oldest = order.index(".venv-oldest")
    assert set(order[:first_oldest]) == {".venv-newest"} and ".venv-newest" not in order[
        first_oldest:], order
    assert (venvs / ".venv-newest" / "pytest-args").exists()
    assert _summary(got) == [["newest", "passed", "(exit", "0)"],
                             ["oldest", "passed", "(exit", "0)"]], got.stdout
    bad = _ci_run(tmp_path, "newest", venvs, CI_SETUP="sometimes")
    assert bad.returncode == 2
    assert "CI_SETUP: expected at-once or one-by-one, got 'sometimes'" in bad.stderr


JAX_FILES = [f"tests/test_{n}.py" for n in ("jax_glue", "stacked_jax", "rope_jax", "nvfp4_jax",
                                            "xla_triton", "sharded_jit", "attention_jax",
                                            "mxfp8_jax")]
KERNEL_FILES = [f"tests/test_{n}.py" for n in (
    "write", "dequantize", "nvfp4", "mxfp8", "dynamic_scales", "rope_write", "sm90_compile",
    "reference_dynamic", "reference_nvfp4", "reference_mxfp8", "bounds_check")]


@pytest.mark.parametrize("leg, files", [("newest", JAX_FILES),
                                        ("torch214", JAX_FILES + KERNEL_FILES)])
def test_newest_and_torch214_leave_out_what_other_legs_run(tmp_path, leg, files):
    """scripts/ci_leg.sh's header: newest leaves out fp8kv_jax's own files, torch214 those and
    the kernels' byte tests; the files they leave out exist (a renamed file would otherwise run
    there again, unnoticed)."""
    venvs = _stand_in_venvs(tmp_path, {leg: {}})
    got = _ci_run(tmp_path, leg, venvs)
    assert got.returncode == 0, got
    args = (venvs / f".venv-{leg}" / "pytest-args").read_text().splitlines()
    left_out = [a for d, a in zip(args, args[1:]) if d == "--deselect"]
    assert left_out == ["tests/test_jax.py", "fp8kv_jax"] + files, args
    assert all((ROOT / f).is_file() for f in left_out if f.endswith(".py")), left_out
    assert ["-m", "not jnp"] in [args[i:i + 2] for i in range(len(args))], args


def test_legs_run_in_a_copy_named_fp8kv_with_their_venvs_inside(tmp_path):
    """.ci/run's tests run where a clone named fp8kv would run them, whatever this checkout is
    called: a copy of the working tree at <tmp>/fp8kv-ci.*/fp8kv (no .git, no venvs of its own),
    the leg's python started through a link inside it (so its files' paths contain "fp8kv")."""
    venvs = _stand_in_venvs(tmp_path, {"oldest": {}})
    got = _ci_run(tmp_path, "oldest", venvs)
    assert got.returncode == 0, got
    cwd, python = (venvs / ".venv-oldest" / "pytest-where").read_text().splitlines()
    assert re.fullmatch(rf"{re.escape(str(tmp_path))}/fp8kv-ci\.\w+/fp8kv", cwd), cwd
    assert python == f"{cwd}/.venv-oldest/bin/python"
    tree = set((venvs / ".venv-oldest" / "pytest-tree").read_text().split())
    assert {"README.md", "pyproject.toml", "tests", "fp8kv", ".ci", ".venv-oldest"} <= tree
    assert not tree & {".git", ".venv", "build", "fp8kv.egg-info"}, tree
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin", "venvs"]   # the copy is gone


def _must_run(args: list) -> list:
    return [a for d, a in zip(args, args[1:]) if d == "--must-run"]


def _torch_test_files() -> set:
    """The test files that skip whole without torch (a module-level importorskip)."""
    return {f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
            if re.search(r'^(\w+ = )?pytest\.importorskip\("torch"\)', p.read_text(), re.M)}


def test_each_leg_declares_the_files_it_must_run(tmp_path):
    """Every test file, less what the leg leaves out (and, without torch, the torch files); no
    declared name is stale. With arguments of the caller's (a subset) the check is off."""
    from tests.conftest import must_run_files

    legs = ("oldest", "newest", "torch214", "jax")
    venvs = _stand_in_venvs(tmp_path, {leg: {} for leg in legs})
    got = _ci_run(tmp_path, " ".join(legs), venvs)
    assert got.returncode == 0, got
    every = sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py"))
    deselected = {}
    for leg in legs:
        args = (venvs / f".venv-{leg}" / "pytest-args").read_text().splitlines()
        files, stale = must_run_files(ROOT, _must_run(args))
        assert stale == [], (leg, stale)
        deselected[leg] = {a for d, a in zip(args, args[1:]) if d == "--deselect"}
        left_out = set(every) - set(files)
        if leg == "jax":
            assert left_out == _torch_test_files() and len(left_out) == 15, left_out
        else:
            assert left_out == deselected[leg] - {"fp8kv_jax"}, (leg, left_out)
    assert deselected["oldest"] == set() and len(deselected["newest"]) == 10
    assert len(deselected["torch214"]) == 21
    got = _ci_run(tmp_path, "oldest", venvs, "-k", "rope")
    args = (venvs / ".venv-oldest" / "pytest-args").read_text().splitlines()
    assert _must_run(args) == [] and args[-2:] == ["-k", "rope"], args


# A framework that cannot be imported, as on a broken install: what `import torch` then meets.
BLOCKED_TORCH = 'raise ModuleNotFoundError("No module named \'torch\' (blocked)", name="torch")\n'


def _pytest_without_torch(tmp_path, *args) -> subprocess.CompletedProcess:
    blocked = tmp_path / "blocked"
    (blocked / "torch").mkdir(parents=True, exist_ok=True)
    (blocked / "torch" / "__init__.py").write_text(BLOCKED_TORCH)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(blocked), str(ROOT)]))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/test_write.py", "tests/test_frontend_imports.py", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("workers", [[], ["-n", "2"]], ids=["one process", "xdist"])
def test_a_must_run_file_that_skips_whole_fails_the_run_naming_it(tmp_path, workers):
    must = ["--must-run", "tests/test_write.py", "--must-run", "tests/test_frontend_imports.py"]
    got = _pytest_without_torch(tmp_path, *workers, *must)
    assert got.returncode == 1, got.stdout + got.stderr
    assert ("tests/test_write.py: none of its tests ran (skipped: could not import 'torch': No "
            "module named 'torch' (blocked))") in got.stdout, got.stdout
    assert "tests/test_frontend_imports.py" not in got.stdout.split("(--must-run)")[1]
    plain = _pytest_without_torch(tmp_path, *workers)   # not declared: a skip, as before
    assert plain.returncode == 0 and "1 skipped" in plain.stdout, plain.stdout + plain.stderr


def test_a_must_run_name_that_names_no_file_fails(tmp_path):
    got = _pytest_without_torch(tmp_path, "--must-run", "tests/test_frontend_imports.py",
                                "--must-run", "!tests/test_renamed.py")
    assert got.returncode == 1, got.stdout + got.stderr
    assert "--must-run !tests/test_renamed.py: matches no test file" in got.stdout


@pytest.mark.jnp
def test_a_jnp_test_that_launches_a_triton_kernel_fails():
    """The newest and torch214 legs skip the tests marked jnp (scripts/ci_leg.sh) because they
    run no Triton kernel: tests/conftest.py fails one that does, interpreted or compiled."""
    triton = pytest.importorskip("triton")
    pytest.importorskip("jax")   # tests.jax_glue
    import numpy as np
    import triton.language as tl

    from fp8kv import ops
    from tests.jax_glue import HostArray

    @triton.jit
    def one(x_ptr):
        tl.store(x_ptr, 1)

    x = np.zeros(1, np.int32)
    with pytest.raises(AssertionError, match="a test marked jnp launched a Triton kernel"):
        ops.interpreted(one)[(1,)](HostArray(x))
    with pytest.raises(AssertionError, match="a test marked jnp launched a Triton kernel"):
        one[(1,)](HostArray(x))
    assert x[0] == 0
