"""A real node for the cluster tier: containerd + runc + a kubelet registered to a ``ControlPlane``.

Where kwok's nodes only pretend, pods bound to this node run: containerd v2 (built from its Go
module by build.sh) with Debian's ``runc``, Debian's CNI plugins (a ``bridge`` with
``host-local`` addresses), the v1.37.2 kubelet and kube-proxy (iptables mode, so Services work),
kube-router's firewall for NetworkPolicies (its network policy controller alone, as k3s embeds
it: iptables and Debian's ``ipset``; kube-proxy and CoreDNS do the rest), and images made here
(``images.py``: no registry is reachable).

The node lives in a network namespace of its own, ``gpulab-node-<id>``, joined to this one by a
veth pair: the node's address is ``NODE_IP`` (the kubelet refuses a loopback one), this side's end
is ``HOST_IP``, and a route sends ``POD_CIDR`` to the node. Its bridge, its packet filters and
kube-proxy's rules live and die with that namespace; nothing is changed in this one but the veth
end and the route, both removed by ``stop()``. The node's components reach the API server, which
listens on this namespace's loopback only, through ``nsforward.py`` (the same port on the
node's loopback). Pods reach this side at ``HOST_IP`` (a hub listening there), and this side
reaches pods at their addresses, as a hub and its proxy do on a cluster.

Its cgroups are under ``/gpulab-node-<id>`` of each cgroup v1 hierarchy (removed by ``stop()``),
containerd's state and the kubelet's folder are in the node's temporary folder. The kubelet runs
with ``failCgroupV1: false`` (this machine's cgroups are v1), and containerd with
``restrict_oom_score_adj`` (processes here lack ``CAP_SYS_RESOURCE``).

The node is tainted ``REAL_NODE_TAINT`` and labelled ``REAL_NODE_LABEL``: only pods that ask for it
(a toleration and a node selector, as operators do for a node pool) land on it, so the kwok
nodes keep the pods of the other tests.

Use::

    with ControlPlane(queueing=True) as cp, Node(cp) as node:
        node.import_image(path_of_an_oci_archive)
        ...
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import yaml

from .controlplane import (
    BIN_DIR,
    BUILD_SCRIPT,
    SERVICE_CIDR,
    ControlPlane,
    ControlPlaneError,
    _Process,
    kubeconfig_dict,
    wait_until,
)
from .images import PAUSE_IMAGE, pause_archive

NODE_BINARIES = ("containerd", "containerd-shim-runc-v2", "ctr", "kubelet", "kube-proxy", "coredns", "kube-router")
FIREWALL_HEALTH_PORT = 20244  # kube-router's /healthz, on the node's loopback
DNS_IP = "10.96.0.10"  # the kube-dns Service's address, in the control plane's SERVICE_CIDR
CNI_DIR = Path("/usr/lib/cni")
HOST_IP = "10.246.0.1"
NODE_IP = "10.246.0.2"
NODE_NET = 30
POD_CIDR = "10.245.0.0/24"
REAL_NODE_LABEL = ("gpulab.test/node", "real")
REAL_NODE_TAINT = {"key": "gpulab.test/node", "value": "real", "effect": "NoSchedule"}
REAL_NODE_TOLERATION = {"key": "gpulab.test/node", "operator": "Equal", "value": "real", "effect": "NoSchedule"}
CGROUP_V1 = Path("/sys/fs/cgroup")


class NodeError(ControlPlaneError):
    """The node could not start (the message ends with its components' log tails)."""


def _run(*argv: str, check: bool = True, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), check=check, capture_output=True, text=True, **kw)


def host_requirements() -> list[str]:
    """What this machine lacks for a node (empty when nothing): Debian packages by name."""
    missing = []
    if not shutil.which("runc"):
        missing.append("runc")
    if not (CNI_DIR / "bridge").exists() or not (CNI_DIR / "host-local").exists():
        missing.append("containernetworking-plugins")
    if not shutil.which("iptables"):
        missing.append("iptables")
    if not shutil.which("nsenter"):
        missing.append("util-linux")
    if not shutil.which("conntrack"):
        missing.append("conntrack")
    if not shutil.which("ipset"):
        missing.append("ipset")
    return missing


class Node:
    """One real node registered to ``cp`` (started), named ``gpulab-node-<id>``."""

    def __init__(self, cp: ControlPlane, *, bin_dir: Path | str = BIN_DIR, start_timeout: float = 120.0,
                 keep_dir: bool | None = None):
        self.cp = cp
        self.bin_dir = Path(bin_dir)
        self.id = uuid.uuid4().hex[:6]
        self.name = f"gpulab-node-{self.id}"
        self.netns = f"gpulab-node-{self.id}"
        self.veth_host = f"gpn{self.id}h"
        self.veth_node = f"gpn{self.id}n"
        self.cgroup = f"/{self.name}"
        self.start_timeout = start_timeout
        self.keep_dir = bool(os.environ.get("GPULAB_CLUSTER_KEEP")) if keep_dir is None else keep_dir
        self.dir: Path | None = None
        self.startup_seconds: float | None = None
        self._procs: list[_Process] = []
        self._made: list[str] = []  # what stop() undoes: "netns", "veth", "route", "cgroups"

    # -- paths

    def _path(self, *parts: str) -> Path:
        assert self.dir is not None
        return self.dir.joinpath(*parts)

    @property
    def netns_path(self) -> str:
        return f"/run/netns/{self.netns}"

    @property
    def containerd_socket(self) -> Path:
        return self._path("containerd-state", "containerd.sock")

    @property
    def logs_dir(self) -> Path:
        return self._path("logs")

    # -- lifecycle

    def __enter__(self) -> Node:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> Node:
        missing = [b for b in NODE_BINARIES if not os.access(self.bin_dir / b, os.X_OK)]
        if missing:
            raise NodeError(f"missing binaries in {self.bin_dir}: {', '.join(missing)}; run {BUILD_SCRIPT}")
        lacking = host_requirements()
        if lacking:
            raise NodeError(f"the real node needs Debian's {' '.join(lacking)} (apt-get install {' '.join(lacking)})")
        t0 = time.monotonic()
        deadline = t0 + self.start_timeout
        assert self.cp.dir is not None, "start the control plane first"
        self.dir = self.cp.dir / self.name
        self.dir.mkdir()
        self.logs_dir.mkdir()
        try:
            self._network()
            self._cgroups()
            self._write_configs()
            self._spawn("apiserver-forward", [sys.executable, "-m", "tests.cluster.nsforward",
                                              self.netns_path, str(self.cp.api_port)],
                        pythonpath=str(Path(__file__).resolve().parents[2]))
            self._spawn_in_node("containerd", [str(self.bin_dir / "containerd"),
                                               f"--config={self._path('containerd.toml')}"])
            self._wait(deadline, "containerd's socket", lambda: self._ctr("version").returncode == 0)
            self.import_image(pause_archive())
            self._start_dns(deadline)
            self._spawn_in_node("kubelet", self._kubelet_argv())
            self._spawn_in_node("kube-proxy", [str(self.bin_dir / "kube-proxy"),
                                               f"--config={self._path('kube-proxy.yaml')}", "--v=1"])
            self._wait(deadline, f"node {self.name} Ready", self._ready)
            self._start_firewall(deadline)
        except BaseException as e:
            tails = self.log_tails()
            self.stop()
            if isinstance(e, (ControlPlaneError, TimeoutError, OSError, subprocess.CalledProcessError)):
                detail = e.stderr if isinstance(e, subprocess.CalledProcessError) else ""
                raise NodeError(f"node did not start: {e} {detail}\n{tails}") from e
            raise
        self.startup_seconds = time.monotonic() - t0
        return self

    def stop(self) -> None:
        """End the node's processes (the kubelet first), then undo the namespace, veth, route
        and cgroups. Pods' containers go with containerd's shims, killed below."""
        for p in reversed(self._procs):
            p.terminate()
            p.wait_or_kill(10)
        self._procs.clear()
        if "cgroups" in self._made:
            self._kill_cgroup_tasks()
        if self.dir is not None:
            self._kill_shims()
            # containers' rootfs mounts, the pods' namespace mounts and the kubelet's volumes
            for line in reversed(Path("/proc/self/mounts").read_text().splitlines()):
                target = line.split()[1].replace("\\040", " ")
                if target.startswith(str(self.dir) + "/"):
                    _run("umount", "-l", target, check=False)
        if "route" in self._made:
            _run("ip", "route", "del", POD_CIDR, "via", NODE_IP, check=False)
        if "veth" in self._made:
            _run("ip", "link", "del", self.veth_host, check=False)
        if "netns" in self._made:
            _run("ip", "netns", "del", self.netns, check=False)
        if "cgroups" in self._made:
            self._remove_cgroups()
        self._made.clear()
        if self.dir is not None and not self.keep_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -- use

    def import_image(self, archive: Path) -> None:
        """Import an OCI image archive into the node's containerd (namespace ``k8s.io``)."""
        r = self._ctr("images", "import", str(archive), timeout=600)
        if r.returncode != 0:
            raise NodeError(f"importing {archive} failed: {r.stderr.strip()}")

    def images(self) -> list[str]:
        r = self._ctr("images", "ls", "-q")
        return r.stdout.split()

    def exec_in_node(self, *argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        """Run a command in the node's network namespace (e.g. ``curl`` a pod)."""
        return _run("nsenter", f"--net={self.netns_path}", *argv, check=False, timeout=timeout)

    def log_tails(self, lines: int = 30) -> str:
        return "\n".join(f"--- {p.name} (last {lines} lines of {p.log})\n{p.tail(lines)}" for p in self._procs)

    # -- internals

    def _ctr(self, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return _run(str(self.bin_dir / "ctr"), f"--address={self.containerd_socket}", "--namespace=k8s.io",
                    *args, check=False, timeout=timeout)

    def _network(self) -> None:
        _run("ip", "netns", "add", self.netns)
        self._made.append("netns")
        inside = ("ip", "-n", self.netns)
        _run(*inside, "link", "set", "lo", "up")
        _run("ip", "link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_node,
             "netns", self.netns)
        self._made.append("veth")
        _run("ip", "addr", "add", f"{HOST_IP}/{NODE_NET}", "dev", self.veth_host)
        _run("ip", "link", "set", self.veth_host, "up")
        _run(*inside, "addr", "add", f"{NODE_IP}/{NODE_NET}", "dev", self.veth_node)
        _run(*inside, "link", "set", self.veth_node, "up")
        _run(*inside, "route", "add", "default", "via", HOST_IP)
        _run("ip", "route", "add", POD_CIDR, "via", NODE_IP)
        self._made.append("route")
        for key, value in (("net.ipv4.ip_forward", "1"), ("net.bridge.bridge-nf-call-iptables", "1"),
                           ("net.ipv4.conf.all.route_localnet", "1")):
            _run("ip", "netns", "exec", self.netns, "sysctl", "-q", "-w", f"{key}={value}", check=False)

    def _hierarchies(self, *, unified: bool = False) -> list[Path]:
        """The cgroup v1 hierarchies; with ``unified``, also the v2 one of this hybrid layout
        (``/sys/fs/cgroup/unified``), where runc makes the containers' cgroups too."""
        return [p for p in CGROUP_V1.iterdir() if p.is_dir() and (
            (p / "tasks").exists() or (unified and (p / "cgroup.procs").exists()))]

    def _cgroups(self) -> None:
        self._made.append("cgroups")
        for h in self._hierarchies():
            d = h / self.name
            d.mkdir(exist_ok=True)
            if (h / "cpuset.cpus").exists():  # a v1 cpuset child starts with no CPUs and no memory nodes
                for f in ("cpuset.cpus", "cpuset.mems"):
                    (d / f).write_text((h / f).read_text())

    def _kill_cgroup_tasks(self) -> None:
        h = CGROUP_V1 / "pids"
        root = h / self.name
        for _ in range(50):
            pids = set()
            for tasks in root.rglob("cgroup.procs") if root.exists() else ():
                with contextlib.suppress(OSError):
                    pids.update(int(x) for x in tasks.read_text().split())
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.1)

    def _kill_shims(self) -> None:
        """containerd's shims (one per pod, detached from containerd) outlive it: end those of
        this node's containerd, known by its socket in their command line."""
        mark = str(self.containerd_socket).encode()
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            if b"containerd-shim" in cmdline and mark in cmdline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(entry.name), signal.SIGKILL)

    def _remove_cgroups(self) -> None:
        for h in self._hierarchies(unified=True):
            root = h / self.name
            if not root.exists():
                continue
            for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                root.rmdir()

    def _write_configs(self) -> None:
        cp = self.cp
        ca_file = cp.ca_file
        server = f"https://127.0.0.1:{cp.api_port}"
        for who, cn, orgs in (("kubelet", f"system:node:{self.name}", ["system:nodes"]),
                              ("kube-proxy", "system:kube-proxy", []),
                              ("coredns", "gpulab-test:coredns", []),
                              ("kube-router", "gpulab-test:kube-router", [])):
            crt, key = cp.issue_certificate(cn, organizations=orgs)
            cfg = kubeconfig_dict(server=server, ca_pem=cp.ca_pem, user=cn, cert_pem=crt, key_pem=key)
            (self._path(f"{who}.kubeconfig")).write_text(yaml.safe_dump(cfg, sort_keys=False))
        crt, key = cp.issue_certificate(self.name, server_names=[self.name], server_ips=[NODE_IP],
                                        client=False, server=True)
        self._path("kubelet.crt").write_bytes(crt)
        self._path("kubelet.key").write_bytes(key)
        self._path("kubelet.key").chmod(0o600)
        self._path("resolv.conf").write_text("")  # the node's own DNS servers: none (no network)
        cni = self._path("cni")
        cni.mkdir()
        (cni / "10-gpulab.conflist").write_text(json.dumps({
            "cniVersion": "1.0.0",
            "name": "gpulab",
            "plugins": [
                {"type": "bridge", "bridge": "cni0", "isGateway": True, "ipMasq": False,
                 "hairpinMode": True,
                 "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_CIDR}]],
                          "routes": [{"dst": "0.0.0.0/0"}], "dataDir": str(self._path("cni-ipam"))}},
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }, indent=1))
        state = self._path("containerd-state")
        self._path("containerd.toml").write_text(f"""\
version = 3
root = "{self._path('containerd-root')}"
state = "{state}"
[grpc]
  address = "{state}/containerd.sock"
[plugins.'io.containerd.cri.v1.runtime']
  restrict_oom_score_adj = true
  netns_mounts_under_state_dir = true
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        Root = "{state}/runc"
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["{CNI_DIR}"]
    conf_dir = "{cni}"
[plugins.'io.containerd.nri.v1.nri']
  disable = true
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "overlayfs"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "{PAUSE_IMAGE}"
""")
        kubelet = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "cgroupRoot": self.cgroup,
            "containerRuntimeEndpoint": f"unix://{self.containerd_socket}",
            "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True},
                               "x509": {"clientCAFile": ca_file}},
            "authorization": {"mode": "Webhook"},
            "address": NODE_IP,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "tlsCertFile": str(self._path("kubelet.crt")),
            "tlsPrivateKeyFile": str(self._path("kubelet.key")),
            "clusterDomain": "cluster.local",
            "clusterDNS": [DNS_IP],
            "resolvConf": str(self._path("resolv.conf")),
            "failSwapOn": False,
            "registerWithTaints": [dict(REAL_NODE_TAINT)],
            # this node shares a disk with the machine: evict for nothing but a full disk, and
            # never collect the images imported here (they cannot be pulled again)
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "1%",
                             "imagefs.available": "1%", "nodefs.inodesFree": "1%"},
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "maxPods": 30,
            "serializeImagePulls": False,
            "enforceNodeAllocatable": ["pods"],
            "nodeStatusUpdateFrequency": "5s",
        }
        self._path("kubelet.yaml").write_text(yaml.safe_dump(kubelet, sort_keys=False))
        proxy = {
            "apiVersion": "kubeproxy.config.k8s.io/v1alpha1",
            "kind": "KubeProxyConfiguration",
            "clientConnection": {"kubeconfig": str(self._path("kube-proxy.kubeconfig"))},
            "mode": "iptables",
            "hostnameOverride": self.name,
            "clusterCIDR": POD_CIDR,
            "healthzBindAddress": "127.0.0.1:10256",
            "metricsBindAddress": "127.0.0.1:10249",
            # leave the machine-wide conntrack table size alone
            "conntrack": {"maxPerCore": 0},
        }
        self._path("kube-proxy.yaml").write_text(yaml.safe_dump(proxy, sort_keys=False))

    def _start_dns(self, deadline: float) -> None:
        """Cluster DNS as on a cluster: CoreDNS's kubernetes plugin answers for Services and pods
        (a JobSet's replicas by host name); it runs in the node's namespace, behind the
        ``kube-dns`` Service at ``DNS_IP`` that kube-proxy sends to it."""
        user = "gpulab-test:coredns"
        self.cp.apply(
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": "gpulab-test:coredns"},
             "rules": [{"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
                        "verbs": ["list", "watch"]},
                       {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                        "verbs": ["list", "watch"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": "gpulab-test:coredns"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole",
                         "name": "gpulab-test:coredns"},
             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]},
            {"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "kube-dns", "namespace": "kube-system",
                          "labels": {"k8s-app": "kube-dns"}},
             "spec": {"clusterIP": DNS_IP, "ports": [
                 {"name": "dns", "port": 53, "protocol": "UDP", "targetPort": 53},
                 {"name": "dns-tcp", "port": 53, "protocol": "TCP", "targetPort": 53}]}},
            {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
             "metadata": {"name": f"kube-dns-{self.id}", "namespace": "kube-system",
                          "labels": {"kubernetes.io/service-name": "kube-dns",
                                     "endpointslice.kubernetes.io/managed-by": "gpulab-test"}},
             "addressType": "IPv4",
             "endpoints": [{"addresses": [NODE_IP], "conditions": {"ready": True}}],
             "ports": [{"name": "dns", "port": 53, "protocol": "UDP"},
                       {"name": "dns-tcp", "port": 53, "protocol": "TCP"}]},
        )
        ready_port = 8181
        self._path("Corefile").write_text(f"""\
.:53 {{
    errors
    ready 127.0.0.1:{ready_port}
    kubernetes cluster.local in-addr.arpa ip6.arpa {{
        kubeconfig {self._path('coredns.kubeconfig')}
        pods insecure
        fallthrough in-addr.arpa ip6.arpa
        ttl 5
    }}
    cache 5
}}
""")
        self._spawn_in_node("coredns", [str(self.bin_dir / "coredns"), "-conf", str(self._path("Corefile"))])

        def ready() -> bool:
            r = self.exec_in_node("python3", "-c", f"import urllib.request as u; print(u.urlopen("
                                  f"'http://127.0.0.1:{ready_port}/ready', timeout=2).status)", timeout=10)
            return r.stdout.strip() == "200"

        self._wait(deadline, "CoreDNS ready", ready)

    def _start_firewall(self, deadline: float) -> None:
        """NetworkPolicies enforced as on a cluster: kube-router's network policy controller
        (``--run-firewall`` alone: no BGP router, no service proxy), in the node's namespace,
        with the read access its upstream ClusterRole grants. It filters pod traffic in the
        bridge (``bridge-nf-call-iptables``) and to the node, with iptables chains and ipsets of
        the node's namespace; pods' own node reaches them (kubelet probes), as upstream."""
        user = "gpulab-test:kube-router"
        self.cp.apply(
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": user},
             "rules": [{"apiGroups": [""], "resources": ["namespaces", "pods", "services", "nodes", "endpoints"],
                        "verbs": ["list", "get", "watch"]},
                       {"apiGroups": ["networking.k8s.io"], "resources": ["networkpolicies"],
                        "verbs": ["list", "get", "watch"]},
                       {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
                        "verbs": ["list", "get", "watch"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": user},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": user},
             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]},
        )
        self._spawn_in_node("kube-router", [
            str(self.bin_dir / "kube-router"),
            "--run-firewall=true", "--run-router=false", "--run-service-proxy=false",
            f"--kubeconfig={self._path('kube-router.kubeconfig')}",
            f"--hostname-override={self.name}",
            f"--service-cluster-ip-range={SERVICE_CIDR}",
            f"--health-port={FIREWALL_HEALTH_PORT}", "--metrics-port=0",
            "--v=1",
        ])

        def ready() -> bool:
            r = self.exec_in_node("python3", "-c", f"import urllib.request as u; print(u.urlopen("
                                  f"'http://127.0.0.1:{FIREWALL_HEALTH_PORT}/healthz', timeout=2).status)",
                                  timeout=10)
            chains = self.exec_in_node("iptables", "-w", "-S", "KUBE-ROUTER-FORWARD", timeout=10)
            return r.stdout.strip() == "200" and chains.returncode == 0

        self._wait(deadline, "kube-router's firewall", ready)

    def _kubelet_argv(self) -> list[str]:
        return [
            str(self.bin_dir / "kubelet"),
            f"--config={self._path('kubelet.yaml')}",
            f"--kubeconfig={self._path('kubelet.kubeconfig')}",
            f"--root-dir={self._path('kubelet')}",
            f"--cert-dir={self._path('kubelet-pki')}",
            f"--hostname-override={self.name}",
            f"--node-ip={NODE_IP}",
            f"--node-labels={REAL_NODE_LABEL[0]}={REAL_NODE_LABEL[1]}",
            "--v=1",
        ]

    def _spawn(self, name: str, argv: list[str], pythonpath: str | None = None) -> None:
        env = {**os.environ, "PATH": f"{self.bin_dir}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"}
        if pythonpath:
            env["PYTHONPATH"] = pythonpath
        p = _Process(name, argv, self.logs_dir / f"{name}.log", env)
        with open(p.log, "w") as f:
            f.write("$ " + " ".join(argv) + "\n")
        p.start()
        self._procs.append(p)

    def _spawn_in_node(self, name: str, argv: list[str]) -> None:
        self._spawn(name, ["nsenter", f"--net={self.netns_path}", *argv])

    def _wait(self, deadline: float, what: str, check: Any) -> None:
        def ok() -> Any:
            for p in self._procs:
                rc = p.exited()
                if rc is not None:
                    raise NodeError(f"{p.name} exited with status {rc} while waiting for {what}")
            try:
                return check()
            except Exception:  # noqa: BLE001
                return False

        wait_until(ok, timeout=max(deadline - time.monotonic(), 1), what=what, fatal=(NodeError,))

    def _ready(self) -> bool:
        status, node = self.cp.api("GET", f"/api/v1/nodes/{self.name}", timeout=5)
        if status != 200:
            return False
        return any(c["type"] == "Ready" and c["status"] == "True" for c in node["status"].get("conditions", []))
