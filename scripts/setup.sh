#!/usr/bin/env bash
# Create .venv and install fp8kv with everything its tests and benchmark need (the test and bench
# extras), on a fresh CPU-only machine with Python 3.11. Idempotent; sourced by bench.sh. The
# versions are CI's oldest leg (scripts/ci_leg.sh): triton 3.6.0 is the H200 image's version, so
# the interpreter and the sm_90 compile check run the Triton that the GPU runs. CI itself
# (.ci/run) makes one venv per leg.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
. scripts/ci_leg.sh oldest .venv
