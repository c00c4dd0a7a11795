"""Kueue and JobSet on the test control plane (``ControlPlane(queueing=True)``): a JobSet is
admitted whole by quota or waits suspended without a pod; a notebook pod waits gated.

Each test has a ClusterQueue of its own (4 H100 GPUs, one ResourceFlavor for
``nvidia.com/gpu.product=NVIDIA-H100``) and a LocalQueue in a fresh namespace. kwok runs the
pods and keeps them Running (no Stage ends them), so quota frees only when a test deletes.
"""

import uuid

import pytest
import yaml

from .conftest import _build
from .controlplane import (
    DEFAULT_STAGES,
    GPU_PRODUCT_LABEL,
    GPU_RESOURCE,
    GPU_TOLERATION,
    ControlPlane,
    wait_until,
)
from .queueing import QUEUE_NAME_LABEL

pytestmark = pytest.mark.cluster

IMAGE = "registry.invalid/gpulab/never-pulled:1"  # kwok runs no containers
FLAVOR = "nvidia-h100"
GPUS_PER_QUEUE = 4
JOBSET_LABEL = "jobset.sigs.k8s.io/jobset-name"
ADMISSION_GATE = "kueue.x-k8s.io/admission"
WAIT = 60


@pytest.fixture(scope="module")
def cp(request, tmp_path_factory):
    """A control plane of its own with Kueue and JobSet, whose pods run until deleted."""
    _build(request.config)
    stages = [d for d in yaml.safe_load_all(DEFAULT_STAGES.read_text())
              if d and d["metadata"]["name"] != "pod-job-done"]
    path = tmp_path_factory.mktemp("kwok") / "stages.yaml"
    path.write_text(yaml.safe_dump_all(stages))
    plane = ControlPlane(queueing=True, kwok_stages=[path])
    plane.start()
    print(f"control plane with Kueue and JobSet up in {plane.startup_seconds:.1f}s ({plane.dir})")
    plane.apply({
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor", "metadata": {"name": FLAVOR},
        "spec": {"nodeLabels": {GPU_PRODUCT_LABEL: "NVIDIA-H100"}, "tolerations": [dict(GPU_TOLERATION)]},
    })
    yield plane
    plane.stop()


@pytest.fixture
def queue(cp):
    """(namespace, LocalQueue name): a ClusterQueue of GPUS_PER_QUEUE H100s for one namespace."""
    ns = f"q-{uuid.uuid4().hex[:8]}"
    cp.create_namespace(ns)
    cq = f"cq-{ns}"
    cp.apply(
        {
            "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue", "metadata": {"name": cq},
            "spec": {
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "resourceGroups": [{
                    "coveredResources": ["cpu", "memory", GPU_RESOURCE],
                    "flavors": [{"name": FLAVOR, "resources": [
                        {"name": "cpu", "nominalQuota": "32"},
                        {"name": "memory", "nominalQuota": "128Gi"},
                        {"name": GPU_RESOURCE, "nominalQuota": str(GPUS_PER_QUEUE)},
                    ]}],
                }],
            },
        },
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
         "metadata": {"name": "team", "namespace": ns}, "spec": {"clusterQueue": cq}},
    )
    wait_until(lambda: condition(cp.kubectl_json("get", "clusterqueue", cq), "Active") == "True",
               timeout=WAIT, what=f"ClusterQueue {cq} Active")
    wait_until(lambda: condition(cp.kubectl_json("get", "localqueue", "team", "-n", ns), "Active") == "True",
               timeout=WAIT, what=f"LocalQueue {ns}/team Active")
    yield ns, "team"
    cp.kubectl("delete", "jobsets,pods", "--all", "-n", ns, "--wait=false", check=False)
    cp.api("DELETE", f"/api/v1/namespaces/{ns}")
    cp.kubectl("delete", "clusterqueue", cq, "--wait=false", check=False)


def condition(obj, type_):
    c = next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), None)
    return c and c["status"]


def container(gpus):
    return {
        "name": "main",
        "image": IMAGE,
        "resources": {"requests": {"cpu": "1", "memory": "1Gi"}, "limits": {"memory": "1Gi", GPU_RESOURCE: str(gpus)}},
    }


def jobset(name, queue_name, *, workers, gpus):
    """A JobSet of one replicated Job "worker" x ``workers``, each one pod of ``gpus`` GPUs."""
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "labels": {QUEUE_NAME_LABEL: queue_name}},
        "spec": {
            "replicatedJobs": [{
                "name": "worker",
                "replicas": workers,
                "template": {"spec": {
                    "parallelism": 1, "completions": 1, "backoffLimit": 0,
                    "template": {"spec": {
                        "restartPolicy": "Never",
                        "containers": [container(gpus)],
                        "tolerations": [dict(GPU_TOLERATION)],
                    }},
                }},
            }],
        },
    }


def notebook_pod(name, queue_name, *, gpus):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {QUEUE_NAME_LABEL: queue_name}},
        "spec": {"containers": [container(gpus)], "tolerations": [dict(GPU_TOLERATION)]},
    }


def create(cp, ns, obj):
    cp.kubectl("create", "-n", ns, "-f", "-", input=yaml.safe_dump(obj))


def workload_of(cp, ns, kind, name):
    """The Workload Kueue made for object ``kind/name`` (None before it exists)."""
    for w in cp.kubectl_json("get", "workloads.kueue.x-k8s.io", "-n", ns)["items"]:
        if any(o["kind"] == kind and o["name"] == name for o in w["metadata"].get("ownerReferences", [])):
            return w
    return None


def admitted(cp, ns, kind, name):
    w = workload_of(cp, ns, kind, name)
    return w if w and condition(w, "Admitted") == "True" else None


def jobset_pods(cp, ns, name):
    return cp.kubectl_json("get", "pods", "-n", ns, "-l", f"{JOBSET_LABEL}={name}")["items"]


def running_on_h100(cp, pods):
    nodes = {n["metadata"]["name"]: n for n in cp.kubectl_json("get", "nodes")["items"]}
    return all(
        p["status"].get("phase") == "Running"
        and nodes[p["spec"]["nodeName"]]["metadata"]["labels"].get(GPU_PRODUCT_LABEL) == "NVIDIA-H100"
        for p in pods
    )


def wait_jobset_running(cp, ns, name, workers):
    w = wait_until(lambda: admitted(cp, ns, "JobSet", name), timeout=WAIT, what=f"JobSet {ns}/{name} admitted")
    js = cp.kubectl_json("get", "jobset", name, "-n", ns)
    wait_until(lambda: cp.kubectl_json("get", "jobset", name, "-n", ns)["spec"].get("suspend") is False,
               timeout=WAIT, what=f"JobSet {ns}/{name} unsuspended")
    pods = wait_until(
        lambda: (p := jobset_pods(cp, ns, name)) and len(p) == workers and running_on_h100(cp, p) and p,
        timeout=WAIT, what=f"{workers} pods of JobSet {ns}/{name} Running on H100 nodes")
    return w, js, pods


def test_a_jobset_is_admitted_whole_and_runs_on_gpu_nodes(cp, queue):
    ns, lq = queue
    create(cp, ns, jobset("train", lq, workers=2, gpus=1))
    w, _, pods = wait_jobset_running(cp, ns, "train", 2)
    assert w["status"]["admission"]["clusterQueue"] == f"cq-{ns}"
    (podset,) = w["status"]["admission"]["podSetAssignments"]
    assert podset["count"] == 2
    assert podset["flavors"][GPU_RESOURCE] == FLAVOR
    assert podset["resourceUsage"][GPU_RESOURCE] == "2"
    assert {p["spec"]["nodeSelector"][GPU_PRODUCT_LABEL] for p in pods} == {"NVIDIA-H100"}


def test_a_jobset_over_the_remaining_quota_waits_suspended_without_pods(cp, queue):
    ns, lq = queue
    create(cp, ns, jobset("first", lq, workers=2, gpus=1))
    wait_jobset_running(cp, ns, "first", 2)
    create(cp, ns, jobset("second", lq, workers=2, gpus=2))  # 4 GPUs; 2 are left
    w = wait_until(
        lambda: (w := workload_of(cp, ns, "JobSet", "second")) and condition(w, "QuotaReserved") == "False" and w,
        timeout=WAIT, what="the second JobSet's Workload pending")
    assert "insufficient" in next(c for c in w["status"]["conditions"] if c["type"] == "QuotaReserved")["message"]
    assert condition(w, "Admitted") != "True"
    assert cp.kubectl_json("get", "jobset", "second", "-n", ns)["spec"]["suspend"] is True
    assert jobset_pods(cp, ns, "second") == []
    jobs = cp.kubectl_json("get", "jobs", "-n", ns, "-l", f"{JOBSET_LABEL}=second")["items"]
    assert all(j["spec"].get("suspend") for j in jobs)  # JobSet makes its Jobs suspended, or none yet

    cp.kubectl("delete", "jobset", "first", "-n", ns)
    wait_jobset_running(cp, ns, "second", 2)


def test_a_notebook_pod_waits_gated_until_quota_frees(cp, queue):
    ns, lq = queue
    create(cp, ns, jobset("train", lq, workers=2, gpus=1))
    wait_jobset_running(cp, ns, "train", 2)
    create(cp, ns, notebook_pod("jupyter-ann", lq, gpus=3))  # 3 GPUs; 2 are left
    w = wait_until(
        lambda: (w := workload_of(cp, ns, "Pod", "jupyter-ann")) and condition(w, "QuotaReserved") == "False" and w,
        timeout=WAIT, what="the notebook pod's Workload pending")
    assert condition(w, "Admitted") != "True"
    pod = cp.kubectl_json("get", "pod", "jupyter-ann", "-n", ns)
    assert {"name": ADMISSION_GATE} in pod["spec"].get("schedulingGates", [])
    assert not pod["spec"].get("nodeName")
    assert pod["status"].get("phase") == "Pending"

    cp.kubectl("delete", "jobset", "train", "-n", ns)
    wait_until(lambda: admitted(cp, ns, "Pod", "jupyter-ann"), timeout=WAIT, what="the notebook pod admitted")
    pod = wait_until(
        lambda: (p := cp.kubectl_json("get", "pod", "jupyter-ann", "-n", ns))["status"].get("phase") == "Running" and p,
        timeout=WAIT, what="the notebook pod Running")
    assert not pod["spec"].get("schedulingGates")
    assert pod["spec"]["nodeSelector"][GPU_PRODUCT_LABEL] == "NVIDIA-H100"
    assert pod["spec"]["nodeName"].startswith("gpu-h100-")
