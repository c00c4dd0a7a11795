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
py="$GPULAB_HOME/venv/bin/python"
# With arguments: one pytest, as asked. Without (the whole suite): the cluster tier (its own
# Kubernetes control planes and real node, in processes of their own; tests/cluster and the
# Kubernetes attacks) runs in a second pytest beside the other tiers, which mostly wait on
# hubs, browsers and TensorFlow; its report follows theirs, and either failing fails the run.
# GPULAB_TEST_SERIAL=1: every tier in one pytest, one after the other; so too on a machine
# where no account holds uid 1000: the real node's pods run as that uid of this machine
# (tests/cluster/images.py), and the other tiers' first test account would get it beside them
# (its removal kills its uid's processes).
if (($#)) || [[ -n ${GPULAB_TEST_SERIAL:-} ]] || ! getent passwd 1000 >/dev/null; then
  exec "$py" -m pytest "$@"
fi
cluster_tier=(tests/cluster tests/security/test_kube_isolation.py)
log="$(mktemp -t gpulab-cluster-tier.XXXXXX)"
# bash starts a background command with SIGINT ignored: put back, Ctrl-C stops both pytests;
# the tier keeps a pytest cache of its own
GPULAB_TEST_BESIDE=1 "$py" -c 'import os, signal, sys
signal.signal(signal.SIGINT, signal.SIG_DFL)
os.execv(sys.executable, [sys.executable, "-m", "pytest", *sys.argv[1:]])' \
  -o cache_dir=.pytest_cache/cluster-tier "${cluster_tier[@]}" >"$log" 2>&1 &
beside=$!
trap 'kill -INT "$beside" 2>/dev/null || true; wait "$beside" 2>/dev/null || true; rm -f "$log"' EXIT
set +e
"$py" -m pytest "${cluster_tier[@]/#/--ignore=}"
rest=$?
if kill -0 "$beside" 2>/dev/null; then
  echo "scripts/test.sh: waiting for the cluster tier (running beside the others since the start) ..."
fi
wait "$beside"
tier=$?
trap - EXIT
echo
echo "================ the cluster tier (run beside the others): ${cluster_tier[*]} ================"
cat "$log"
rm -f "$log"
# pytest's 5: no test collected (a selection without any of them) is no failure
((rest == 5)) && rest=0
((tier == 5)) && tier=0
echo "scripts/test.sh: the other tiers exit $rest, the cluster tier exit $tier"
if ((rest != 0)); then exit "$rest"; fi
exit "$tier"
