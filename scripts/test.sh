#!/usr/bin/env bash
# Installs gpulab with its test dependencies and runs the whole test suite.
#   bash scripts/test.sh                 everything
#   bash scripts/test.sh -m "not app"    only the fast unit tier (any pytest arguments)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GPULAB_EXTRAS=test source "$repo/scripts/setup.sh"
cd "$repo"
exec "$GPULAB_HOME/venv/bin/python" -m pytest "$@"
