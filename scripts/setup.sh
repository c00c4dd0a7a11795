#!/usr/bin/env bash
# Installs what gpulab needs on this machine (idempotent): a Python virtual environment with
# gpulab, and configurable-http-proxy from npm. Sourced by run.sh and test.sh.
#   GPULAB_HOME   where the environment goes (default /opt/gpulab as root, else ./.gpulab)
#   GPULAB_EXTRAS pip extras to install (e.g. "test")
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
if [ "$(id -u)" = 0 ]; then default_home=/opt/gpulab; else default_home="$repo/.gpulab"; fi
export GPULAB_HOME="${GPULAB_HOME:-$default_home}"
venv="$GPULAB_HOME/venv"
# Debian's Python, readable by every account: per-user servers run as their own accounts.
py="$(command -v /usr/bin/python3.11 || command -v python3)"
if ! "$py" -c 'import ensurepip' 2>/dev/null; then
  if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
  else echo "setup: python3-venv is missing; install it (apt-get install python3-venv)" >&2; exit 1; fi
fi
command -v npm >/dev/null || { echo "setup: npm is missing; install Node.js 20 with npm" >&2; exit 1; }
mkdir -p "$GPULAB_HOME"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
spec="$repo"; [ -n "${GPULAB_EXTRAS:-}" ] && spec="$repo[$GPULAB_EXTRAS]"
# gpulab's direct dependencies at the versions the images install (images/pin.py writes them)
"$venv/bin/python" -m pip install -q "$spec" \
  -c "$repo/images/requirements.txt" -c "$repo/images/requirements-tf.txt"
# Always reinstall gpulab itself (the source changes; the version number does not).
"$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$repo"
chp_version=5.3.0
if [ ! -x "$GPULAB_HOME/node/node_modules/.bin/configurable-http-proxy" ] || \
   ! grep -q "\"version\": \"$chp_version\"" "$GPULAB_HOME/node/node_modules/configurable-http-proxy/package.json"; then
  npm install --silent --no-audit --no-fund --prefix "$GPULAB_HOME/node" "configurable-http-proxy@$chp_version" >/dev/null
fi
ln -sf "$GPULAB_HOME/node/node_modules/.bin/configurable-http-proxy" "$venv/bin/configurable-http-proxy"
chmod -R a+rX "$GPULAB_HOME"
export PATH="$venv/bin:$PATH"
