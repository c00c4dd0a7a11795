#!/usr/bin/env bash
# Installs gpulab (when something changed) and runs the local deployment:
#   bash scripts/run.sh [gpulab up flags]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
for arg in "$@"; do
  if [[ $arg == -h || $arg == --help ]]; then
    if [ "$(id -u)" = 0 ]; then home="${GPULAB_HOME:-/opt/gpulab}"; else home="${GPULAB_HOME:-$repo/.gpulab}"; fi
    if [ -x "$home/venv/bin/gpulab" ]; then exec "$home/venv/bin/gpulab" up --help; fi
    cat <<'USAGE'
usage: bash scripts/run.sh [gpulab up flags]

Installs gpulab with TensorFlow into /opt/gpulab (as root; else ./.gpulab) the first time, or
when its sources changed, then runs `gpulab up`: the hub on http://localhost:8000. The flags
are `gpulab up`'s (README, "gpulab up flags"); after the first install this help lists them.
USAGE
    exit 0
  fi
done
source "$repo/scripts/setup.sh"
exec "$GPULAB_HOME/venv/bin/gpulab" up "$@"
