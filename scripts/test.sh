#!/usr/bin/env bash
# Installs gpulab with its test dependencies and runs the whole test suite.
#   bash scripts/test.sh                 everything
#   bash scripts/test.sh -m "not app"    only the fast unit tier (any pytest arguments)
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# System packages the tests drive for real: Debian's Chromium (the browser tier),
# PostgreSQL's server (the ledger's concurrency tests start their own cluster), and for the
# cluster tier's real node (tests/cluster/node.py) runc, the CNI plugins, iptables and
# conntrack (kube-proxy), ipset (kube-router's NetworkPolicy firewall), debootstrap (the
# notebook image's root filesystem), systemd's systemd-analyze (checks the unit that
# `gpulab service install` writes; systemd need not be running), and Prometheus (scrapes
# the gpulab service's metrics in tests/app/test_metrics_prometheus.py; its packaged
# service is not started).
need=()
command -v chromium >/dev/null || need+=(chromium)
ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || need+=(postgresql)
command -v runc >/dev/null || need+=(runc)
[ -x /usr/lib/cni/bridge ] || need+=(containernetworking-plugins)
command -v iptables >/dev/null || need+=(iptables)
command -v conntrack >/dev/null || need+=(conntrack)
command -v ipset >/dev/null || need+=(ipset)
command -v debootstrap >/dev/null || need+=(debootstrap)
command -v systemd-analyze >/dev/null || need+=(systemd)
command -v prometheus >/dev/null || need+=(prometheus)
if ((${#need[@]})); then
  if [[ $(id -u) -ne 0 ]]; then
    echo "scripts/test.sh: missing ${need[*]}; run as root (sudo) so it can apt-get install them" >&2
    exit 1
  fi
  echo "scripts/test.sh: installing ${need[*]} with apt-get"
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${need[@]}"
fi
GPULAB_EXTRAS=test source "$repo/scripts/setup.sh"
cd "$repo"
exec "$GPULAB_HOME/venv/bin/python" -m pytest "$@"
