#!/usr/bin/env bash
# Run the test suite and/or the benchmark on a machine with a CUDA GPU.
# Usage: bash scripts/gpu.sh [test|bench|all] [extra pytest / bench args...]
#
# Expects python3 with pip, PyTorch built with CUDA, and for the JAX parts jax with CUDA support
# (e.g. `pip install "jax[cuda12]"`). It adds jax-triton 0.3.1 and the test/bench helpers from
# the package index, or, where a folder .whl/ of prepared wheels exists in this checkout (a
# machine without network access), installs those wheels instead and nothing from the index.
# Logs, junit.xml and bench.tgz (the benchmark's CSV, PNG and summary.md) go to $OUT
# (default: bench/out/gpu); the benchmark also stays unpacked in $BENCH_DIR.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PY=${PYTHON:-python3}
OUT=${OUT:-bench/out/gpu}
BENCH_DIR=${BENCH_DIR:-bench/out/latest}
mkdir -p "$OUT" "$BENCH_DIR"
if [ -d .whl ]; then
    SITE=bench/out/.site
    "$PY" -m pip install -q --no-index --no-deps --target "$SITE" .whl/*.whl || exit 1
    export PYTHONPATH="$SITE:$PWD"
else
    "$PY" -m pip install -q "jax-triton==0.3.1" "pytest>=8" pytest-xdist "hypothesis>=6" \
        "matplotlib>=3.8" || exit 1
    export PYTHONPATH="$PWD"
fi
# Triton's kernel cache in a directory of this checkout (ignored by git): compiled kernels are
# reused between the test and bench runs, whatever HOME is. fp8kv and the bench restore this
# variable around `import jax_triton`, which (0.3.1) sets it to "" and would break later
# torch-side launches.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-$PWD/bench/out/.triton-cache}
# JAX would otherwise take 75 % of the GPU's memory when it starts, leaving too little to torch,
# which shares the process in the parity tests and in the benchmark.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
export PYTHONUNBUFFERED=1
what=${1:-all}
shift || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
status=0
if [ "$what" = test ] || [ "$what" = all ]; then
    "$PY" -m pytest tests fp8kv_torch fp8kv_jax --doctest-modules -q -n 8 -p no:cacheprovider \
        --durations=12 --junitxml="$OUT/junit.xml" "$@" 2>&1 | tee "$OUT/pytest.log" | tail -n 60
    status=${PIPESTATUS[0]}
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    "$PY" -m bench --out "$BENCH_DIR" "$@" > "$OUT/bench.log" 2>&1
    bstatus=$?
    tail -n 120 "$OUT/bench.log"
    tar czf "$OUT/bench.tgz" -C "$BENCH_DIR" .
    [ $bstatus -ne 0 ] && status=$bstatus
fi
exit $status
