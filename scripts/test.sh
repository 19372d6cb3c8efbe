#!/usr/bin/env bash
# Install (scripts/setup.sh) and run the whole test suite: the README's test command, which CI runs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/setup.sh
python -m pytest tests fp8kv_torch fp8kv_jax --doctest-modules -q "$@"
