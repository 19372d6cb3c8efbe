#!/usr/bin/env bash
# Create .venv and install fp8kv with everything its tests and benchmark need, on a fresh
# CPU-only machine (Python 3.11). Idempotent; sourced by test.sh and bench.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip
# Pins for this CPU machine only (pyproject keeps ranges): torch 2.13.0 is the CPU wheel on disk
# (any other request pulls a multi-GB CUDA build); triton 3.6.0 is the H200 image's version, so the
# interpreter and the sm_90 compile check run the Triton that the GPU runs.
python -m pip install -q "torch==2.13.0" "triton==3.6.0" "jax==0.10.2"
python -m pip install -q -e ".[test,bench]"
