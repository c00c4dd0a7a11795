"""Kubernetes mode for real (issue 19): a real hub with KubeGPUSpawner, and the gpulab service
with Kueue + JobSet, run notebooks and training jobs in pods of a real node (``node.py``:
containerd, runc, a kubelet, kube-proxy and CoreDNS), with the hub's RBAC-bound credentials.

The hub is configured as the z2jh chart configures it from ``helm-values/values.yaml``
(`gpulab.hub.deploy.kubernetes.kubernetes_config` on a chart-like configuration), but for what
this machine cannot have: a dummy login instead of the identity provider, a SQLite ledger, no
home PVC (no storage provisioner), and the shared storage as a host folder behind a PV and PVC
in the person's namespace instead of an NFS export (this kernel has no NFS). It runs on this
side of the node's veth, at ``HOST_IP``; pods reach it through the ``hub`` Service of its
namespace (selector-less, an EndpointSlice to ``HOST_IP``), by cluster DNS and kube-proxy, as
they reach the hub pod on a cluster; the NetworkPolicies let them (and the proxy in) by
address, as an operator configures a hub outside the cluster. The node is reserved by a taint: the hub puts notebooks
and (through KubeSpawner's ``node_selector`` and ``tolerations``, shared with the job backend)
training replicas there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import requests

from gpulab.hub.cluster.kubeobjects import make_user_namespace
from tests.app.hubctl import Browser, Hub, free_port
from tests.app.test_jobs_api import wait_state
from tests.tf.test_jobs_training import accuracy

from . import hubrbac
from .controlplane import ControlPlane, wait_until
from .images import NOTEBOOK_UID, singleuser_archive
from .node import HOST_IP, NODE_IP, REAL_NODE_LABEL, REAL_NODE_TOLERATION, Node

pytestmark = [pytest.mark.cluster, pytest.mark.node]

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
HUB_NAMESPACE = "gpulab-hub"
PEOPLE = ("ann", "bob")
PASSWORD = "pw"
SHARED_MOUNT = "/gpulab/shared"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The control plane with Kueue and JobSet, one real node, the notebook image in it."""
    plane = ControlPlane(queueing=True)
    plane.start()
    node = Node(plane)
    try:
        node.start()
        t0 = time.monotonic()
        image, archive = singleuser_archive(Path(sys.prefix))
        node.import_image(archive)
        print(f"control plane {plane.startup_seconds:.1f}s, node {node.startup_seconds:.1f}s, "
              f"image {time.monotonic() - t0:.1f}s ({plane.dir})")
        yield plane, node, image
    finally:
        node.stop()
        plane.stop()


@pytest.fixture(scope="module")
def shared(cluster):
    """The team's storage: a host folder with ``users/<name>`` (theirs) and ``datasets/``
    (root's, read-only for everyone), offered in each person's namespace as the PVC
    ``gpulab-shared`` of a hostPath PV, as an operator would provision it."""
    plane, _, _ = cluster
    root = Path(tempfile.mkdtemp(prefix="gpulab-shared-"))
    os.chmod(root, 0o755)
    (root / "datasets").mkdir()
    (root / "datasets" / "README").write_text("team data\n")
    for person in PEOPLE:
        home = root / "users" / person
        home.mkdir(parents=True)
        os.chown(home, NOTEBOOK_UID, 100)
        ns = f"gpulab-{person}"
        plane.apply(make_user_namespace(name=ns, user_label=person))
        plane.apply(
            {"apiVersion": "v1", "kind": "PersistentVolume", "metadata": {"name": f"shared-{person}"},
             "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"],
                      "persistentVolumeReclaimPolicy": "Retain", "storageClassName": "",
                      "claimRef": {"namespace": ns, "name": "gpulab-shared"},
                      "hostPath": {"path": str(root), "type": "Directory"}}},
            {"apiVersion": "v1", "kind": "PersistentVolumeClaim",
             "metadata": {"name": "gpulab-shared", "namespace": ns},
             "spec": {"accessModes": ["ReadWriteMany"], "storageClassName": "",
                      "volumeName": f"shared-{person}", "resources": {"requests": {"storage": "1Gi"}}}},
        )
    yield root
    shutil.rmtree(root, ignore_errors=True)


HUB_CONFIG = """\
import os
from gpulab.hub.deploy.kubernetes import kubernetes_config

# what the chart makes of helm-values/values.yaml (hub.config), for this machine
c.JupyterHub.authenticator_class = "dummy"
c.DummyAuthenticator.password = {password!r}
c.Authenticator.allow_all = True
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {port}
c.JupyterHub.hub_ip = {host_ip!r}
c.JupyterHub.hub_port = {hub_port}
# servers reach the hub through its Service, as in the chart (the proxy, here outside the
# cluster, at the hub's own address)
c.KubeGPUSpawner.hub_connect_url = "http://hub.{hub_ns}.svc.cluster.local:{hub_port}"
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{proxy_api}"
c.JupyterHub.db_url = "sqlite:///{dir}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{dir}/cookie_secret"
c.JupyterHub.allow_named_servers = True
c.KubeGPUSpawner.image = {image!r}
c.KubeGPUSpawner.start_timeout = 240
c.KubeGPUSpawner.enable_user_namespaces = True
c.KubeGPUSpawner.user_namespace_template = "gpulab-{{username}}"
c.KubeGPUSpawner.pod_security_level = "baseline"
c.KubeGPUSpawner.kueue = True
c.KubeGPUSpawner.storage_pvc_ensure = False
c.KubeGPUSpawner.shared_volume = {{"persistentVolumeClaim": {{"claimName": "gpulab-shared"}}}}
# the operator's node pool (KubeSpawner's own traits): the real node
c.KubeGPUSpawner.node_selector = {node_selector!r}
c.KubeGPUSpawner.tolerations = [{toleration!r}]
# kube-router enforces the NetworkPolicies. This cluster's DNS serves on its node's own network
# (as NodeLocal DNSCache does), and the hub and proxy run outside the cluster, at HOST_IP: no pod
# selector matches them, so the operator names them by address
c.KubeGPUSpawner.allowed_egress = {egress!r}
c.KubeGPUSpawner.allowed_server_ingress = {ingress!r}
c.KubeGPUSpawner.cpu_limit = 2
c.KubeGPUSpawner.mem_limit = "3G"
# what a notebook reserves on the node (z2jh's singleuser.cpu/memory.guarantee): without it
# the request is the limit, 2 CPUs, the whole node, and the job replicas (which reserve the
# namespace's default 100m each) would wait for the notebook to stop
c.KubeGPUSpawner.cpu_guarantee = 0.2
c.KubeGPUSpawner.mem_guarantee = "512M"
c.GPUJobs.allowed_images = [{image!r}]
c.KubeJobBackend.image = {image!r}
c.GPULedger.pool = "kubernetes"
# the cluster test's kernel drives its cluster with TensorFlow's own API, without the lease
# thread of gpulab.cluster(): its cluster must not end for want of renewals meanwhile
c.GPUJobs.cluster_lease_timeout = 600
# the service finds the API server as the hub does (in a pod: the in-cluster configuration)
c.JupyterHub.services = [{{"name": "gpulab", "environment": {{"KUBECONFIG": os.environ["KUBECONFIG"]}}}}]
kubernetes_config(c, first_admin="admin", service_ip={host_ip!r}, config_dir="{dir}/service")
"""


class KubeHub:
    """The chart's hub (``python3 -m gpulab.hub.deploy.kubehub``, as helm-values' ``hub.args``
    starts it) with the configuration above, its proxy and the gpulab service."""

    # URLs of servers and the service as `Browser` builds them (no subdomains here)
    subdomains = False
    host_of, user_url, service_url = Hub.host_of, Hub.user_url, Hub.service_url

    def __init__(self, folder: Path, kubeconfig: str, image: str):
        self.dir = folder
        self.port, self.hub_port, self.proxy_api = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.service_api = self.url + "/services/gpulab/api/v1/"
        (folder / "jupyterhub_config.py").write_text(HUB_CONFIG.format(
            password=PASSWORD, port=self.port, host_ip=HOST_IP, hub_port=self.hub_port,
            hub_ns=HUB_NAMESPACE, proxy_api=self.proxy_api, dir=folder, image=image,
            node_selector={REAL_NODE_LABEL[0]: REAL_NODE_LABEL[1]}, toleration=REAL_NODE_TOLERATION,
            egress=[{"to": [{"ipBlock": {"cidr": f"{NODE_IP}/32"}}],
                     "ports": [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]},
                    {"to": [{"ipBlock": {"cidr": f"{HOST_IP}/32"}}],
                     "ports": [{"protocol": "TCP", "port": self.hub_port}, {"protocol": "TCP", "port": 8002}]}],
            ingress=[{"from": [{"ipBlock": {"cidr": f"{HOST_IP}/32"}}],
                      "ports": [{"protocol": "TCP", "port": 8888}]}]))
        self.env = {**os.environ, "KUBECONFIG": kubeconfig, "POD_NAMESPACE": HUB_NAMESPACE,
                    "POD_IP": HOST_IP, "GPULAB_LEDGER_URL": f"sqlite:///{folder}/ledger.sqlite",
                    "PATH": f"{Path(sys.executable).parent}:{os.environ.get('PATH', '')}"}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 90) -> KubeHub:
        self.log = open(self.dir / "hub.log", "ab")
        self.proc = subprocess.Popen([sys.executable, "-m", "gpulab.hub.deploy.kubehub",
                                      "--config", "jupyterhub_config.py"],
                                     cwd=self.dir, env=self.env, stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def up() -> bool:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyterhub exited {self.proc.returncode}: {self.output()[-3000:]}")
            try:
                return (requests.get(self.url + "/hub/api/", timeout=2).ok
                        and requests.get(self.service_api + "openapi.json", timeout=2).ok)
            except requests.ConnectionError:
                return False

        wait_until(up, timeout=timeout, interval=0.5, what="the hub and the gpulab service",
                   fatal=(RuntimeError,))
        return self

    def output(self) -> str:
        return (self.dir / "hub.log").read_text(errors="replace")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


@pytest.fixture(scope="module")
def hub(cluster, shared, tmp_path_factory):
    plane, _, image = cluster
    kubeconfig = hubrbac.hub_kubeconfig(plane, HUB_NAMESPACE)
    h = KubeHub(tmp_path_factory.mktemp("kubehub"), kubeconfig, image)
    # the chart's hub Service, its pod being this side of the node's veth
    plane.apply(
        {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "hub", "namespace": HUB_NAMESPACE},
         "spec": {"ports": [{"name": "hub", "port": h.hub_port, "targetPort": h.hub_port},
                            {"name": "gpulab", "port": 8002, "targetPort": 8002}]}},
        {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
         "metadata": {"name": "hub-test", "namespace": HUB_NAMESPACE,
                      "labels": {"kubernetes.io/service-name": "hub",
                                 "endpointslice.kubernetes.io/managed-by": "gpulab-test"}},
         "addressType": "IPv4", "endpoints": [{"addresses": [HOST_IP], "conditions": {"ready": True}}],
         "ports": [{"name": "hub", "port": h.hub_port, "protocol": "TCP"},
                   {"name": "gpulab", "port": 8002, "protocol": "TCP"}]},
    )
    h.start()
    yield h
    h.stop()


@pytest.fixture(scope="module")
def people(hub):
    made = {}
    for name in PEOPLE:
        b = Browser(hub, name)
        b.login(PASSWORD)
        made[name] = b
    return made


def pod_of(plane, ns: str, selector: str) -> dict:
    _, pods = plane.api("GET", f"/api/v1/namespaces/{ns}/pods?labelSelector={selector}", expect=(200,))
    assert len(pods["items"]) == 1, [p["metadata"]["name"] for p in pods["items"]]
    return pods["items"][0]


def test_a_notebook_server_runs_in_a_pod_of_the_node(cluster, hub, people, shared):
    """KubeGPUSpawner's pod on the real node: the server answers through the proxy, a kernel
    runs in it, the person's shared folder is writable and ``datasets/`` is not, no
    service-account token is mounted, and Pod Security's level holds for the namespace."""
    plane, node, image = cluster
    ann = people["ann"]
    r = ann.start_server()
    assert r.status_code in (201, 202), r.text
    ann.wait_ready(timeout=240)
    pod = pod_of(plane, "gpulab-ann", "component=singleuser-server")
    assert pod["spec"]["nodeName"] == node.name and pod["status"]["phase"] == "Running"
    assert pod["status"]["podIP"].startswith("10.245."), pod["status"]
    # through the proxy, with the person's token
    r = requests.get(hub.url + "/user/ann/api/status", headers={"Authorization": f"token {ann.token()}"})
    assert r.status_code == 200 and "kernels" in r.json(), r.text
    out = ann.run_in_kernel(textwrap.dedent(f"""\
        import os, socket
        print("host", socket.gethostname())
        print("uid", os.getuid())
        mine = os.environ["GPULAB_USER_DIR"]
        with open(os.path.join(mine, "note.txt"), "w") as f:
            f.write("written in the pod")
        try:
            open("{SHARED_MOUNT}/datasets/mine.txt", "w")
            print("datasets writable")
        except OSError as e:
            print("datasets", type(e).__name__)
        print("token", os.path.exists("/var/run/secrets/kubernetes.io/serviceaccount/token"))
        # the runtime's seccomp filter (issue 33): mode 2, and no user namespace with all
        # capabilities (the first step of most container escapes)
        print("seccomp", [l.split()[1] for l in open("/proc/self/status") if l.startswith("Seccomp:")])
        import subprocess
        r = subprocess.run(["unshare", "-Urm", "true"], capture_output=True, text=True)
        print("unshare", r.returncode, r.stderr.strip())
        print("hub", socket.gethostbyname("hub.{HUB_NAMESPACE}.svc.cluster.local"))
        import urllib.request
        url = os.environ["GPULAB_SERVICE_URL"] + "api/v1/openapi.json"
        print("service", url, urllib.request.urlopen(url, timeout=30).status)
        """), timeout=120)
    assert f"host {pod['metadata']['name']}" in out, out
    assert f"uid {NOTEBOOK_UID}" in out and "datasets OSError" in out and "token False" in out, out
    assert "seccomp ['2']" in out, out
    assert re.search(r"^unshare [1-9]\d* .*(Operation not permitted|Permission denied)", out, re.M), out
    assert re.search(r"^hub 10\.96\.\d+\.\d+$", out, re.M), out  # the hub Service's ClusterIP
    # the gpulab service, through the hub Service's extra port, as the chart sets it up
    assert f"service http://hub.{HUB_NAMESPACE}.svc.cluster.local:8002/services/gpulab/api/v1/openapi.json 200" in out, out
    assert (shared / "users" / "ann" / "note.txt").read_text() == "written in the pod"
    assert not (shared / "datasets" / "mine.txt").exists()
    # Pod Security "baseline" of the namespace: a privileged pod is refused there
    bad = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "priv", "namespace": "gpulab-ann"},
           "spec": {"containers": [{"name": "c", "image": image,
                                    "securityContext": {"privileged": True}}]}}
    status, body = plane.api("POST", "/api/v1/namespaces/gpulab-ann/pods", bad)
    assert status == 403 and "baseline" in json.dumps(body), body
    ann.stop_server()
    wait_until(lambda: not plane.api("GET", "/api/v1/namespaces/gpulab-ann/pods?labelSelector="
                                            "component=singleuser-server")[1]["items"],
               timeout=60, what="the notebook pod gone")


PROBE = """\
import socket, sys


def probe(host, port):
    s = socket.socket()
    s.settimeout(5)
    try:
        s.connect((host, int(port)))
        return "open"
    except OSError as e:
        return "closed " + type(e).__name__
    finally:
        s.close()

"""


def probe_lines(targets: dict[str, tuple[str, int]]) -> str:
    """Python code that prints ``<name> open`` or ``<name> closed <error>`` for each target."""
    return PROBE + "".join(f"print({name!r}, probe({host!r}, {port}), flush=True)\n"
                           for name, (host, port) in targets.items())


def probed(out: str) -> dict[str, str]:
    """``{name: "open" | "closed <error>"}`` from what `probe_lines` printed."""
    return {m.group(1): m.group(2) for m in re.finditer(r"^(\S+) (open|closed \w+)$", out, re.M)}


def opened(results: dict[str, str]) -> dict[str, bool]:
    """Which connections went through (a refusal by a policy is a reset or a timeout)."""
    return {name: r == "open" for name, r in results.items()}


def test_network_policies_keep_peoples_pods_apart(cluster, hub, people, shared):
    """kube-router enforces the policies gpulab makes. Bob's parameter-server job: its chief
    reaches its ps and worker on their TF port (its own job), the hub and the gpulab service,
    but not Ann's notebook. Ann's notebook pod reaches the hub but not Bob's TF servers. A pod
    of another team (a namespace gpulab does not manage, so no policy limits what it opens)
    reaches neither Bob's TF servers nor Ann's notebook. The node itself reaches both, so
    they are listening and only the policies refuse; the proxy reaches Ann's notebook."""
    plane, node, image = cluster
    ann, bob = people["ann"], people["bob"]
    assert ann.start_server().status_code in (201, 202)
    ann.wait_ready(timeout=240)
    try:
        notebook_ip = pod_of(plane, "gpulab-ann", "component=singleuser-server")["status"]["podIP"]
        hub_host = f"hub.{HUB_NAMESPACE}.svc.cluster.local"
        # Bob's job: the chief runs only after its ps and worker accept connections on their
        # TF port (the runtime waits for them); then it probes, and stays until stopped
        program = probe_lines({"ann-notebook": (notebook_ip, 8888), "hub": (hub_host, hub.hub_port),
                               "service": (hub_host, 8002)}) + "import time\ntime.sleep(600)\n"
        r = bob.service("POST", "jobs", json={
            "name": "tf-servers", "strategy": "parameter-server",
            "replicas": {"chief": 1, "ps": 1, "worker": 1}, "source": program})
        assert r.status_code in (201, 202), r.text
        deadline = time.time() + 300
        chief = {}
        while time.time() < deadline and len(chief) < 3:
            job = bob.service("GET", "jobs/tf-servers").json()
            assert job["state"] not in ("Failed", "Succeeded", "Stopped"), job
            chief = probed(bob.service("GET", "jobs/tf-servers/logs/chief-0").json()["text"])
            time.sleep(1)
        assert opened(chief) == {"ann-notebook": False, "hub": True, "service": True}, chief
        pods = plane.api("GET", "/api/v1/namespaces/gpulab-bob/pods?labelSelector=gpulab.io/job=tf-servers")[1]
        servers = {p["metadata"]["labels"]["gpulab.io/role"]: p["status"]["podIP"] for p in pods["items"]}
        targets = {"bob-ps": (servers["ps"], 2222), "bob-worker": (servers["worker"], 2222),
                   "ann-notebook": (notebook_ip, 8888)}

        # Ann's notebook pod: the hub yes, Bob's TF servers no
        out = probed(ann.run_in_kernel(probe_lines({"bob-ps": targets["bob-ps"], "bob-worker": targets["bob-worker"],
                                                    "hub": (hub_host, hub.hub_port)}), timeout=60))
        assert opened(out) == {"bob-ps": False, "bob-worker": False, "hub": True}, out

        # another team's pod, which no policy limits: refused by Bob's and Ann's pods
        plane.create_namespace("other-team")
        plane.apply({"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe", "namespace": "other-team"},
                     "spec": {"nodeSelector": {REAL_NODE_LABEL[0]: REAL_NODE_LABEL[1]},
                              "tolerations": [REAL_NODE_TOLERATION], "restartPolicy": "Never",
                              "automountServiceAccountToken": False,
                              "containers": [{"name": "probe", "image": image, "imagePullPolicy": "Never",
                                              "command": ["python3", "-c", probe_lines(
                                                  {**targets, "dns": (NODE_IP, 53)})]}]}})
        wait_until(lambda: plane.api("GET", "/api/v1/namespaces/other-team/pods/probe")[1]
                   .get("status", {}).get("phase") in ("Succeeded", "Failed"), timeout=120, what="the probe pod")
        _, log = plane.api("GET", "/api/v1/namespaces/other-team/pods/probe/log")
        assert opened(probed(log)) == {"bob-ps": False, "bob-worker": False, "ann-notebook": False,
                                       "dns": True}, log

        # the node itself (as its kubelet's probes would): everything listens
        r = node.exec_in_node("python3", "-c", probe_lines(targets))
        assert opened(probed(r.stdout)) == {"bob-ps": True, "bob-worker": True, "ann-notebook": True}, r
        assert bob.service("POST", "jobs/tf-servers/stop").status_code == 200
        wait_state(bob, "tf-servers", {"Stopped"}, timeout=120)
    finally:
        ann.stop_server()
        plane.api("DELETE", "/api/v1/namespaces/other-team")


COORDINATE = """\
import json, os, socket, time
os.environ["GRPC_FAIL_FAST"] = "use_caller"
cluster = json.loads({cluster!r})
for address in cluster["ps"] + cluster["worker"]:  # the servers listen once TF is imported
    host, port = address.rsplit(":", 1)
    deadline = time.time() + 150
    while True:
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            break
        except OSError:
            if time.time() > deadline:
                raise
            time.sleep(1)
import tensorflow as tf
resolver = tf.distribute.cluster_resolver.SimpleClusterResolver(
    tf.train.ClusterSpec(cluster), rpc_layer="grpc")
strategy = tf.distribute.ParameterServerStrategy(resolver)
coordinator = tf.distribute.coordinator.ClusterCoordinator(strategy)
with strategy.scope():
    v = tf.Variable(0.0)


@tf.function
def step():
    v.assign_add(1.0)
    return v.read_value()


for _ in range(3):
    coordinator.schedule(step)
coordinator.join()
print("variable on", v.device, flush=True)
print("value", float(v.numpy()), flush=True)
"""


def probe_pod(plane, image: str, ns: str, targets: dict[str, tuple[str, int]]) -> None:
    """A pod of the real node in ``ns`` that `probe_lines` ``targets``, labelled as a notebook
    server (``component: singleuser-server``)."""
    plane.apply({"apiVersion": "v1", "kind": "Pod",
                 "metadata": {"name": "cluster-probe", "namespace": ns,
                              "labels": {"component": "singleuser-server"}},
                 "spec": {"nodeSelector": {REAL_NODE_LABEL[0]: REAL_NODE_LABEL[1]},
                          "tolerations": [REAL_NODE_TOLERATION], "restartPolicy": "Never",
                          "automountServiceAccountToken": False,
                          "securityContext": {"runAsUser": NOTEBOOK_UID, "runAsNonRoot": True},
                          "containers": [{"name": "probe", "image": image, "imagePullPolicy": "Never",
                                          "resources": {"requests": {"cpu": "50m"}},
                                          "command": ["python3", "-c", probe_lines(targets)]}]}})


def probe_pod_results(plane, ns: str) -> dict[str, str]:
    path = f"/api/v1/namespaces/{ns}/pods/cluster-probe"
    wait_until(lambda: plane.api("GET", path)[1].get("status", {}).get("phase") in ("Succeeded", "Failed"),
               timeout=120, what=f"the probe pod in {ns}")
    return probed(plane.api("GET", path + "/log")[1])


def test_a_notebook_kernel_coordinates_its_held_cluster_that_no_one_else_reaches(cluster, hub, people, shared):
    """Issue 38 on the real node: Ann holds a cluster (a ps and a one-GPU worker, no chief, no
    code), which Kueue admits whole (the node advertises 2 GPUs for this test); her notebook
    pod's kernel coordinates it at the addresses its view gives, with TensorFlow's own
    ParameterServerStrategy and ClusterCoordinator: steps run on the worker and the variable
    lives on the ps. Pods labelled as notebook servers in Bob's namespace and in another
    team's (no policy limits what it opens) reach neither server; the node itself reaches
    both, so only the policies refuse. Stop ends it and Kueue forgets it."""
    plane, node, image = cluster
    ann = people["ann"]
    status = f"/api/v1/nodes/{node.name}/status"
    gpus = [{"op": "add", "path": f"/status/{part}/nvidia.com~1gpu", "value": "2"}
            for part in ("capacity", "allocatable")]
    plane.api("PATCH", status, gpus, content_type="application/json-patch+json", expect=(200,))
    try:
        # the server first: the kernel holding a cluster is its person's (and the server's
        # start is not slowed down by the cluster's TensorFlow servers starting beside it)
        assert ann.start_server(wait=False).status_code in (201, 202)
        ann.wait_ready(timeout=240)
        r = ann.service("POST", "jobs", json={
            "name": "held", "kind": "cluster", "strategy": "parameter-server",
            "replicas": {"ps": 1, "worker": 1}, "resources": {"worker": {"gpus": 1}}})
        assert r.status_code in (201, 202), r.text
        job = wait_state(ann, "held", {"Running", "Failed", "Stopped"}, timeout=300)
        assert job["state"] == "Running", job
        assert job["kind"] == "cluster" and job["gpus"] == 1
        assert job["cluster"] == {"ps": ["held-ps-0-0.held.gpulab-ann.svc:2222"],
                                  "worker": ["held-worker-0-0.held.gpulab-ann.svc:2222"]}, job
        workloads = plane.api("GET", "/apis/kueue.x-k8s.io/v1beta2/namespaces/gpulab-ann/workloads")[1]
        (workload,) = [w for w in workloads["items"]
                       if any(o["name"] == "held" for o in w["metadata"].get("ownerReferences", []))]
        assert any(c["type"] == "Admitted" and c["status"] == "True"
                   for c in workload["status"]["conditions"]), workload["status"]

        out = ann.run_in_kernel(COORDINATE.format(cluster=json.dumps(job["cluster"])), timeout=300)
        assert "variable on /job:ps/replica:0/task:0/device:CPU:0" in out, out
        assert "value 3.0" in out, out

        pods = plane.api("GET", "/api/v1/namespaces/gpulab-ann/pods?labelSelector=gpulab.io/job=held")[1]
        targets = {f"ann-{p['metadata']['labels']['gpulab.io/role']}": (p["status"]["podIP"], 2222)
                   for p in pods["items"]}
        assert set(targets) == {"ann-ps", "ann-worker"}
        plane.create_namespace("another-team")
        for ns in ("gpulab-bob", "another-team"):
            probe_pod(plane, image, ns, targets)
        for ns in ("gpulab-bob", "another-team"):
            assert opened(probe_pod_results(plane, ns)) == {"ann-ps": False, "ann-worker": False}, ns
        r = node.exec_in_node("python3", "-c", probe_lines(targets))
        assert opened(probed(r.stdout)) == {"ann-ps": True, "ann-worker": True}, r

        assert ann.service("POST", "jobs/held/stop").status_code == 200
        assert wait_state(ann, "held", {"Stopped"}, timeout=120)["state"] == "Stopped"
        wait_until(lambda: not [w for w in plane.api(
            "GET", "/apis/kueue.x-k8s.io/v1beta2/namespaces/gpulab-ann/workloads")[1]["items"]
            if w["metadata"]["uid"] == workload["metadata"]["uid"]], timeout=60,
            what="Kueue's workload of the cluster gone")
    finally:
        ann.stop_server()
        plane.api("DELETE", "/api/v1/namespaces/another-team")
        plane.api("DELETE", "/api/v1/namespaces/gpulab-bob/pods/cluster-probe")
        plane.api("PATCH", status, [{"op": "remove", "path": f"/status/{part}/nvidia.com~1gpu"}
                                    for part in ("capacity", "allocatable")],
                  content_type="application/json-patch+json")


def replica_process(job: str, role: str, index: int, timeout: float = 180) -> psutil.Process:
    """The process of replica ``role-index`` of ``job`` running in a pod of the node (a
    container's processes are this machine's, in namespaces of their own)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for p in psutil.process_iter(["environ", "status"]):
            try:
                env = p.info["environ"] or {}
            except psutil.Error:
                continue
            # a pod's (the kubelet gives every container the API's Service), not a local
            # replica of a test of the tiers running beside this one
            if (env.get("GPULAB_JOB_NAME") != job or "TF_CONFIG" not in env
                    or "KUBERNETES_SERVICE_HOST" not in env):
                continue
            task = json.loads(env["TF_CONFIG"])["task"]
            if (task["type"], task["index"]) == (role, index) and p.info["status"] != psutil.STATUS_ZOMBIE:
                return p
        time.sleep(0.5)
    raise TimeoutError(f"no running {role}-{index} of {job}")


def wait_epochs(person, name, epochs, timeout=400) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = person.service("GET", f"jobs/{name}").json()
        assert job["state"] not in ("Failed", "Succeeded", "Stopped"), job
        if (job.get("progress") or {}).get("epoch", 0) >= epochs:
            return job
        time.sleep(1)
    raise TimeoutError(f"job {name} did not report {epochs} epochs")


def test_a_parameter_server_job_runs_in_pods_and_survives_a_killed_worker(cluster, hub, people, shared):
    """The parameter-server digits example as a JobSet on the node: its replicas find each
    other by the host names of TF_CONFIG (cluster DNS), the progress and logs reach the jobs
    API, TensorBoard's and the checkpoints' files land in the person's shared folder, and a
    worker killed mid-training is replaced while the job goes on to Succeeded."""
    plane, node, _ = cluster
    bob = people["bob"]
    spec = {"name": "digits-ps", "strategy": "parameter-server",
            "replicas": {"chief": 1, "ps": 1, "worker": 2},
            "source": (EXAMPLES / "digits_parameter_server.py").read_text(),
            "args": ["--sleep-per-epoch", "1"], "retries": 3}
    r = bob.service("POST", "jobs", json=spec)
    assert r.status_code in (201, 202), r.text
    wait_epochs(bob, "digits-ps", 1)
    pods = plane.api("GET", "/api/v1/namespaces/gpulab-bob/pods?labelSelector=gpulab.io/job=digits-ps")[1]
    assert {p["spec"]["nodeName"] for p in pods["items"]} == {node.name}
    worker = replica_process("digits-ps", "worker", 1)
    # replicas run under the container runtime's seccomp filter too (issue 33)
    status = Path(f"/proc/{worker.pid}/status").read_text()
    assert re.search(r"^Seccomp:\s+2$", status, re.M), status
    worker.send_signal(signal.SIGKILL)

    job = wait_state(bob, "digits-ps", {"Succeeded", "Failed"}, timeout=600)
    chief_log = bob.service("GET", "jobs/digits-ps/logs/chief-0").json()["text"]
    assert job["state"] == "Succeeded", (job, chief_log[-3000:])
    assert accuracy(chief_log) >= 0.90
    worker1 = next(x for x in job["replicas"] if x["name"] == "worker-1")
    assert worker1["restarts"] >= 1, job["replicas"]
    folder = shared / "users" / "bob" / "jobs" / "digits-ps"
    assert list((folder / "tensorboard").rglob("events.out.tfevents.*")), sorted(folder.rglob("*"))
    assert [p for p in (folder / "checkpoints").rglob("*") if p.is_file()]


def test_a_multi_worker_job_runs_in_pods_and_tensorboard_shows_it(cluster, hub, people, shared):
    """The multi-worker example as a JobSet to Succeeded; then TensorBoard, in the person's
    notebook pod, lists its run (and refuses another person)."""
    ann = people["ann"]
    spec = {"name": "digits-mw", "strategy": "multi-worker-mirrored", "replicas": {"worker": 2},
            "source": (EXAMPLES / "digits_multi_worker.py").read_text()}
    r = ann.service("POST", "jobs", json=spec)
    assert r.status_code in (201, 202), r.text
    job = wait_state(ann, "digits-mw", {"Succeeded", "Failed"}, timeout=600)
    log = ann.service("GET", "jobs/digits-mw/logs/worker-0").json()["text"]
    assert job["state"] == "Succeeded", (job, log[-3000:])
    assert accuracy(log) >= 0.90
    assert job["progress"] and job["progress"]["step"] >= 1
    folder = shared / "users" / "ann" / "jobs" / "digits-mw"
    assert list((folder / "tensorboard").rglob("events.out.tfevents.*")), sorted(folder.rglob("*"))
    # TensorBoard in the person's notebook pod shows the job's run, read from shared storage
    assert ann.start_server().status_code in (201, 202)
    ann.wait_ready(timeout=240)
    try:
        base = f"{hub.url}/user/ann/tensorboard/"
        headers = {"Authorization": f"token {ann.token()}"}
        r = requests.get(base, headers=headers, timeout=120)  # started on first use
        assert r.status_code == 200 and "TensorBoard" in r.text, r.text[:300]
        runs: list = []
        deadline = time.time() + 90
        while time.time() < deadline:
            runs = requests.get(base + "data/runs", headers=headers, timeout=30).json()
            if any(run.startswith("jobs/digits-mw/") or run.startswith("digits-mw/") for run in runs):
                break
            time.sleep(1)
        assert any("digits-mw" in run for run in runs), runs
        bob = people["bob"]
        r = requests.get(base, headers={"Authorization": f"token {bob.token()}"},
                         allow_redirects=False, timeout=30)
        assert r.status_code == 403, (r.status_code, r.text[:200])
    finally:
        ann.stop_server()


def test_a_copied_cookie_dies_at_logout_on_the_charts_hub(hub):
    """The chart's hub (`GpulabKubeHub`, started as the chart starts it); `kubernetes_config`
    makes its logout end the person's sessions as the local hub's does
    (tests/security/test_hub_doors.py)."""
    cal = Browser(hub, "cal")
    cal.login(PASSWORD)
    assert cal.api("GET", "/user").json()["name"] == "cal"
    copy = Browser(hub, "cal")
    copy.s.cookies.update(cal.s.cookies)
    assert copy.api("GET", "/user").status_code == 200
    assert cal.s.get(hub.url + "/hub/logout", allow_redirects=False).status_code == 302
    r = copy.api("POST", "/users/cal/tokens", json={"note": "a thief's"})
    assert r.status_code == 403, (r.status_code, r.text)
    assert copy.api("GET", "/user").status_code == 403
