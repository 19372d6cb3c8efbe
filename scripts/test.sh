#!/usr/bin/env bash
# Install and run the whole test suite: exactly what CI runs (.ci/run).
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/../.ci/run" "$@"
