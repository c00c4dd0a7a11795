#!/usr/bin/env bash
# Installs gpulab and runs the local deployment: bash scripts/run.sh [gpulab up flags]
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/setup.sh"
exec "$GPULAB_HOME/venv/bin/gpulab" up "$@"
