#!/usr/bin/env bash
# Source this: `. scripts/ci_leg.sh LEG [VENV]`. Creates (or updates) the virtual environment VENV
# (default .venv-LEG) with LEG's pinned versions, installs fp8kv editable with its test and bench
# extras, activates it, and sets LEG_ARGS: the extra pytest arguments of that leg (.ci/run appends
# them to the README's test command), and LEG_MUST_RUN: the test files the leg must run, as
# --must-run arguments (tests/conftest.py fails the run, naming the file, when none of a must-run
# file's tests ran: a module-level importorskip on a broken install is a failure, not a skip).
# The pins are the versions CI tests; pyproject.toml's ranges span them. Without an interpreter of the leg's Python version (scripts/find_python.sh) it says
# in one line what to install or set, and returns 3 before making anything.
#
#   oldest  Python 3.11, torch 2.13.0 (CPU), triton 3.6.0, jax 0.10.2: the lower bounds (triton
#           3.6.0 is the GPU image's).
#   newest  Python 3.11, torch 2.13.0 (CPU), triton 3.9.0, jax 0.10.2 (the newest JAX on 3.11):
#           the kernels under the newest Triton from torch. The test files of fp8kv_jax alone
#           (its launches through the interpreter, XLA's Triton call, sharded jit) run on triton
#           3.6 with JAX 0.10.2 (oldest) and on triton 3.9 with the newest JAX (jax), not again
#           here (CI time).
#   torch214  Python 3.11, torch 2.14.1 with the triton it requires (3.8.0), jax 0.10.2: the
#           newest torch inside the torch extra's range. A CUDA build (~6 GB installed), run on
#           the CPU like the others. What the torch version changes only: custom ops, compile,
#           CUDA graphs' code paths, the fast path's private interfaces, tensors as arrays. The
#           kernels' bytes per format and layout (which depend on Triton's version, not torch's)
#           run on triton 3.6 and 3.9 (oldest, newest), and the fp8kv_jax files as in newest.
#   jax     Python 3.12, triton 3.9.0, jax 0.12.0.1 and no torch: the JAX-only install.
#
# torch is pinned to exactly 2.13.0 or 2.14.1 because those are the builds on this machine's disk
# (2.13.0 a CPU build; 2.14.1 a CUDA build with its CUDA wheels); any other torch request (and any
# torch on 3.12) pulls a multi-GB CUDA build from the index. torch 2.11, the extra's lower bound,
# is what the GPU suite runs (scripts/gpu.sh).
# .ci/run sets up every leg at once, and sets two variables for that (both optional):
#   CI_LEG_LOCK=FILE     the editable install of fp8kv, which writes fp8kv.egg-info into this
#                        checkout, takes an exclusive lock on FILE: one leg at a time.
#   CI_LEG_NO_COMPILE=1  pip does not byte-compile what it installs (about half of the setup's
#                        time); Python compiles what is imported instead, into the venv, where it
#                        may write bytecode (.ci/run clears PYTHONDONTWRITEBYTECODE).
# The caller's shell options are restored at the end; a failing step exits (or fails) the caller.
_ci_leg_opts=$(set +o)
# A command substitution runs without errexit, so $(set +o) never records it: from $- instead.
[[ $- == *e* ]] && _ci_leg_opts+=$'\nset -e'
set -euo pipefail

LEG=${1:?usage: . scripts/ci_leg.sh oldest|newest|torch214|jax [VENV]}
OLDEST_JAX=0.10.2
case "$LEG" in
    oldest) PY_VERSION=3.11; JAX_PIN=$OLDEST_JAX; PINS=("torch==2.13.0" "triton==3.6.0") ;;
    newest) PY_VERSION=3.11; JAX_PIN=0.10.2;      PINS=("torch==2.13.0" "triton==3.9.0") ;;
    torch214) PY_VERSION=3.11; JAX_PIN=0.10.2;    PINS=("torch==2.14.1" "triton==3.8.0") ;;
    jax)    PY_VERSION=3.12; JAX_PIN=0.12.0.1;    PINS=("triton==3.9.0") ;;
    *) echo "ci_leg.sh: unknown leg '$LEG' (oldest, newest, torch214, jax)" >&2
       eval "$_ci_leg_opts"
       return 2 2>/dev/null || exit 2 ;;
esac
PINS+=("jax==$JAX_PIN" "jaxlib==$JAX_PIN")
VENV=${2:-.venv-$LEG}

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# shellcheck source=scripts/find_python.sh
. scripts/find_python.sh
if [ ! -x "$VENV/bin/python" ]; then
    if ! BASE_PYTHON=$(find_python "$PY_VERSION"); then
        echo "ci_leg.sh: leg '$LEG' needs Python $PY_VERSION (not found on PATH or in pyenv);" \
             "install it or set PYTHON${PY_VERSION/./}=/path/to/python$PY_VERSION" >&2
        eval "$_ci_leg_opts"
        return 3 2>/dev/null || exit 3
    fi
    "$BASE_PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
# No wheel cache: it would hold a second copy of every download (GBs for torch214) on a disk
# that may have little room (.ci/run), and a retry below then downloads afresh.
_ci_pip=(python -m pip install -q --no-cache-dir)
[ "${CI_LEG_NO_COMPILE:-}" = 1 ] && _ci_pip+=(--no-compile)
"${_ci_pip[@]}" --upgrade pip
# The pinned wheels are the big downloads (triton, jaxlib, torch 2.14's CUDA wheels): an
# interrupted or corrupt one (a hash mismatch after resumed downloads) gets two more tries, each
# downloading afresh; a full disk or an unknown version fails all three the same way.
for _ci_try in 1 2 3; do
    "${_ci_pip[@]}" "${PINS[@]}" && break
    [ "$_ci_try" -lt 3 ] || false
    echo "ci_leg.sh: installing ${PINS[*]} failed (try $_ci_try of 3); trying again" >&2
done
if [ -n "${CI_LEG_LOCK:-}" ]; then
    # The lock is released when this process ends, however it ends.
    python -c 'import fcntl, subprocess, sys
with open(sys.argv[1], "a") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)
    sys.exit(subprocess.call(sys.argv[2:]))' "$CI_LEG_LOCK" "${_ci_pip[@]}" -e ".[test,bench]"
else
    "${_ci_pip[@]}" -e ".[test,bench]"
fi

# What the leg must have, checked rather than assumed (a reused venv may hold anything).
python - "$LEG" "$PY_VERSION" "${PINS[@]}" <<'PY'
import importlib.metadata as md
import importlib.util
import sys

leg, py, *pins = sys.argv[1:]
problems = []
if "%d.%d" % sys.version_info[:2] != py:
    problems.append(f"Python {sys.version.split()[0]}, expected {py}")
for pin in pins:
    name, version = pin.split("==")
    got = md.version(name).split("+")[0]
    if got != version:
        problems.append(f"{name} {got}, expected {version}")
if leg == "jax" and importlib.util.find_spec("torch") is not None:
    problems.append("torch is installed in the JAX-only leg")
if problems:
    sys.exit(f"ci_leg.sh {leg}: " + "; ".join(problems))
print(f"[{leg}] Python {sys.version.split()[0]}, " + ", ".join(
    f"{n} {md.version(n)}" for n in ("torch", "triton", "jax", "jaxlib")
    if importlib.util.find_spec(n) is not None))
PY

# Every leg must run every test file but those it leaves out on purpose (_ci_leave_out: not run
# at all) and, in the JAX-only leg, those that need torch.
LEG_ARGS=()
LEG_MUST_RUN=(--must-run "tests/test_*.py")
_ci_leave_out() { LEG_ARGS+=(--deselect "$1"); LEG_MUST_RUN+=(--must-run "!$1"); }
case "$LEG" in
    newest|torch214)
        # Same JAX as the oldest leg: the jnp path and its doctests would run exactly as there,
        # so only what torch and Triton run (interpreter kernels, sm_90 compiles) runs again.
        # The jnp path's tests: tests/test_jax.py and those marked jnp in other files.
        if [ "$JAX_PIN" = "$OLDEST_JAX" ]; then
            _ci_leave_out tests/test_jax.py
            LEG_ARGS+=(--deselect fp8kv_jax -m "not jnp")
        fi
        for _ci_f in jax_glue stacked_jax rope_jax nvfp4_jax xla_triton sharded_jit \
                     attention_jax mxfp8_jax; do   # fp8kv_jax's own files (see above)
            _ci_leave_out "tests/test_$_ci_f.py"
        done
        if [ "$LEG" = torch214 ]; then   # what torch's version changes only (see above)
            for _ci_f in write dequantize nvfp4 mxfp8 dynamic_scales rope_write \
                         sm90_compile reference_dynamic reference_nvfp4 reference_mxfp8 \
                         bounds_check; do
                _ci_leave_out "tests/test_$_ci_f.py"
            done
        fi ;;
    jax)
        # fp8kv_torch cannot be imported without torch: its doctest modules are skipped (reported
        # as such); the torch test modules skip themselves, and are the files this leg need not
        # run.
        LEG_ARGS+=(--doctest-ignore-import-errors)
        for _ci_f in attention bench_imports compile_warnings dequantize dynamic_scales fast_path \
                     launch_cache mxfp8 nvfp4 parity rope_write stacked_torch tensor_parallel \
                     torch_integration write; do
            LEG_MUST_RUN+=(--must-run "!tests/test_$_ci_f.py")
        done ;;
esac
eval "$_ci_leg_opts"
unset -f _ci_leave_out
unset _ci_leg_opts _ci_pip _ci_f _ci_try
