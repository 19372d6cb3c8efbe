#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the benchmark: `python -m bench` (CSV + PNG per table and
# summary.md in bench/out/; exit status 1 if a table failed). setup.sh installs a CPU-only torch:
# there, `python -m bench` runs only a short harness check through Triton's CPU interpreter, whose
# numbers are not performance.
# For real numbers, run on a machine with a CUDA GPU: bash scripts/gpu.sh bench
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
python -m bench "$@"
