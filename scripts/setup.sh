#!/usr/bin/env bash
# Installs what gpulab needs on this machine (idempotent): a Python virtual environment with
# gpulab, and configurable-http-proxy from npm. Sourced by run.sh and test.sh.
#   GPULAB_HOME   where the environment goes (default /opt/gpulab as root, else ./.gpulab)
#   GPULAB_EXTRAS pip extras to install besides TensorFlow (e.g. "test")
# TensorFlow comes with it, one copy: `gpulab[tf-cuda]` where an NVIDIA driver answers
# (nvidia-smi), else `gpulab[tf]` (the same TensorFlow, run on the CPU). Nothing is installed
# again while the sources, the extras and the pins are what was installed last (a stamp in
# the environment says what that was).
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
tf_extra=tf
if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then tf_extra=tf-cuda; fi
extras="$tf_extra${GPULAB_EXTRAS:+,$GPULAB_EXTRAS}"
# the hash of every file an install from here reads; the stamp of the last install says which
# extras and which sources it installed: installed extras that include the ones asked for now
# are no reason to install again (scripts/stamp.py: test.sh's tf,test serves run.sh's tf)
sources="$(cd "$repo" && find pyproject.toml images/requirements.txt images/requirements-tf.txt \
  hub spawner extensions gpulab-top jupyter-config examples -type f -not -path '*/__pycache__/*' -print0 \
  | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-32)"
plan="$("$py" "$repo/scripts/stamp.py" "$venv/.gpulab-installed" "$extras" "$sources")"
[ -x "$venv/bin/gpulab" ] || plan="install $extras"
if [ "$plan" = ok ]; then
  : # installed, with these extras or more, and nothing changed since
else
  extras="${plan#install }"
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  echo "setup: installing gpulab[$extras] in $venv (a few minutes the first time)" >&2
  "$venv/bin/python" -m pip install -q --upgrade pip
  # an environment made before gpulab[tf]: tensorflow-cpu and tensorflow shared one folder;
  # removing one removes files of the other, so tensorflow is put back whole after it
  if "$venv/bin/python" -m pip show -q tensorflow-cpu >/dev/null 2>&1; then
    "$venv/bin/python" -m pip uninstall -q -y tensorflow-cpu
    "$venv/bin/python" -m pip install -q --no-deps --force-reinstall \
      -c "$repo/images/requirements-tf.txt" tensorflow
  fi
  # setuptools builds in the clone's build/ and never removes what left the sources: a module
  # that moved or went away would still be installed from there (and hide a broken import)
  rm -rf "$repo/build"
  # gpulab's direct dependencies at the versions the images install (images/pin.py writes them)
  "$venv/bin/python" -m pip install -q "$repo[$extras]" \
    -c "$repo/images/requirements.txt" -c "$repo/images/requirements-tf.txt"
  # gpulab itself again: its sources changed, its version number did not
  "$venv/bin/python" -m pip install -q --no-deps --force-reinstall "$repo"
  echo "$extras $sources" > "$venv/.gpulab-installed"
fi
chp_version=5.3.0
if [ ! -x "$GPULAB_HOME/node/node_modules/.bin/configurable-http-proxy" ] || \
   ! grep -q "\"version\": \"$chp_version\"" "$GPULAB_HOME/node/node_modules/configurable-http-proxy/package.json"; then
  npm install --silent --no-audit --no-fund --prefix "$GPULAB_HOME/node" "configurable-http-proxy@$chp_version" >/dev/null
fi
ln -sf "$GPULAB_HOME/node/node_modules/.bin/configurable-http-proxy" "$venv/bin/configurable-http-proxy"
chmod -R a+rX "$GPULAB_HOME"
# `gpulab` on PATH: /usr/local/bin as root, else ~/.local/bin (where Debian's profile looks)
if [ "$(id -u)" = 0 ]; then bindir=/usr/local/bin; else bindir="$HOME/.local/bin"; fi
if mkdir -p "$bindir" 2>/dev/null && ln -sf "$venv/bin/gpulab" "$bindir/gpulab" 2>/dev/null; then
  case ":$PATH:" in *":$bindir:"*) ;; *) echo "setup: gpulab is in $bindir; add it to PATH" >&2 ;; esac
fi
export PATH="$venv/bin:$PATH"
