#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the benchmark: `python -m bench` (tables + CSV + PNG in bench/out).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
python -m bench "$@"
