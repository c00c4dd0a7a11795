#!/usr/bin/env bash
# Run the gpulab test control plane (etcd, kube-apiserver, kube-controller-manager,
# kube-scheduler, kwok with fake GPU nodes) in the foreground; Ctrl-C stops it and removes
# its temporary folder. Builds the binaries first if needed (see build.sh).
#   tests/cluster/up.sh [--stages FILE]... [--enable-crds Stage] [--queueing] [--node [--image]] [--keep]
# (--queueing: Kueue and JobSet too, see queueing.py; --node: a real node where pods run, as
# root, see node.py; --image: with the gpulab.test/singleuser image of this environment)
# SIGTERM stops it as Ctrl-C does.
# It prints the `export KUBECONFIG=...` line to use from another shell.
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
repo="$(cd "$here/../.." && pwd)"
python="${PYTHON:-/opt/gpulab/venv/bin/python}"
[[ -x "$python" ]] || python="$(command -v python3)"
"$here/build.sh"
cd "$repo"
exec "$python" -m tests.cluster.controlplane "$@"
