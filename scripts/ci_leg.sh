#!/usr/bin/env bash
# Source this: `. scripts/ci_leg.sh LEG [VENV]`. Creates (or updates) the virtual environment VENV
# (default .venv-LEG) with LEG's pinned versions, installs fp8kv editable with its test extras,
# activates it, and sets LEG_ARGS: the extra pytest arguments of that leg (.ci/run appends them to
# the README's test command). The pins are the versions CI tests; pyproject.toml's ranges span them.
#
#   oldest  Python 3.11, torch 2.13.0 (CPU), triton 3.6.0, jax 0.10.2: the lower bounds (triton
#           3.6.0 is the GPU image's).
#   newest  Python 3.11, torch 2.13.0 (CPU), triton 3.9.0, jax 0.10.2 (the newest JAX on 3.11).
#   jax     Python 3.12, triton 3.9.0, jax 0.12.0.1 and no torch: the JAX-only install.
#
# torch is pinned to exactly 2.13.0 because that is the CPU build on this machine's disk; any other
# torch request (and any torch on 3.12) pulls a multi-GB CUDA build.
# The caller's shell options are restored at the end; a failing step exits (or fails) the caller.
_ci_leg_opts=$(set +o)
set -euo pipefail

LEG=${1:?usage: . scripts/ci_leg.sh oldest|newest|jax [VENV]}
OLDEST_JAX=0.10.2
case "$LEG" in
    oldest) PY_VERSION=3.11; JAX_PIN=$OLDEST_JAX; PINS=("torch==2.13.0" "triton==3.6.0") ;;
    newest) PY_VERSION=3.11; JAX_PIN=0.10.2;      PINS=("torch==2.13.0" "triton==3.9.0") ;;
    jax)    PY_VERSION=3.12; JAX_PIN=0.12.0.1;    PINS=("triton==3.9.0") ;;
    *) echo "ci_leg.sh: unknown leg '$LEG' (oldest, newest, jax)" >&2; eval "$_ci_leg_opts"
       return 2 2>/dev/null || exit 2 ;;
esac
PINS+=("jax==$JAX_PIN" "jaxlib==$JAX_PIN")
VENV=${2:-.venv-$LEG}

cd "$(dirname "${BASH_SOURCE[0]}")/.."

# An interpreter of exactly this minor version: PYTHON<major><minor> (e.g. PYTHON312) if set, else
# pythonX.Y on PATH, else a pyenv-installed X.Y.
find_python() {
    local want=$1 var="PYTHON${1/./}" cand v root
    for cand in "${!var:-}" "python$want"; do
        if [ -n "$cand" ] && "$cand" -c "import sys; sys.exit(sys.version_info[:2] != tuple(map(int, '$want'.split('.'))))" 2>/dev/null; then
            command -v "$cand"; return 0
        fi
    done
    if command -v pyenv >/dev/null; then
        root=$(pyenv root)
        for v in $(pyenv versions --bare 2>/dev/null | grep -E "^${want//./\\.}\.[0-9]+$" | sort -V -r); do
            [ -x "$root/versions/$v/bin/python" ] && { echo "$root/versions/$v/bin/python"; return 0; }
        done
    fi
    echo "ci_leg.sh: no Python $want found (set PYTHON${want/./})" >&2
    return 1
}

if [ ! -x "$VENV/bin/python" ]; then
    "$(find_python "$PY_VERSION")" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
python -m pip install -q --upgrade pip
python -m pip install -q "${PINS[@]}"
python -m pip install -q -e ".[test]"

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

LEG_ARGS=()
case "$LEG" in
    newest)
        # Same JAX (and torch) as the oldest leg: the jnp path and its doctests would run exactly
        # as there, so only what Triton runs (interpreter kernels, sm_90 compiles) runs again.
        if [ "$JAX_PIN" = "$OLDEST_JAX" ]; then
            LEG_ARGS+=(--deselect tests/test_jax.py --deselect fp8kv_jax)
        fi ;;
    jax)
        # fp8kv_torch cannot be imported without torch: its doctest modules are skipped (reported
        # as such); the torch test modules skip themselves.
        LEG_ARGS+=(--doctest-ignore-import-errors) ;;
esac
eval "$_ci_leg_opts"
unset _ci_leg_opts
