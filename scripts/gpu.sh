#!/usr/bin/env bash
# GPU run on the lent H200 (see ../shared/GPU.md): the whole suite, then the benchmark.
# Usage: bash scripts/gpu.sh [test|bench|all] [extra pytest / bench args...]; logs go to $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
export HOME=/tmp TRITON_CACHE_DIR=/tmp/triton-cache XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
what=${1:-all}
shift || true
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv,noheader
status=0
if [ "$what" = test ] || [ "$what" = all ]; then
    python3 -m pytest tests fp8kv_torch fp8kv_jax --doctest-modules -q -n 8 -p no:cacheprovider --durations=12 \
        --junitxml="$OUT/junit.xml" "$@" 2>&1 | tee "$OUT/pytest.log" | tail -n 60
    status=${PIPESTATUS[0]}
    # What the DLPack / donation tests found (they print FINDING lines).
    python3 -m pytest -q -s -p no:cacheprovider tests/test_parity.py tests/test_jax.py \
        -k "dlpack_cache_shared or donated_write_cost" 2>&1 | grep FINDING | tee "$OUT/findings.log"
fi
if [ "$what" = bench ] || [ "$what" = all ]; then
    python3 -m bench --out /tmp/bench "$@" > "$OUT/bench.log" 2>&1
    bstatus=$?
    tail -n 120 "$OUT/bench.log"
    tar czf "$OUT/bench.tgz" -C /tmp/bench .
    [ $bstatus -ne 0 ] && status=$bstatus
fi
exit $status
