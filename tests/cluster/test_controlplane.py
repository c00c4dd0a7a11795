"""The test control plane behaves like a GPU cluster: scheduling, quota, namespaces, RBAC."""

import json

import pytest

from .controlplane import GPU_PRODUCT_LABEL, GPU_RESOURCE, GPU_TAINT, GPU_TOLERATION, wait_until

pytestmark = pytest.mark.cluster

IMAGE = "registry.invalid/gpulab/never-pulled:1"  # kwok runs no containers


def gpu_pod(name, *, gpus, product="NVIDIA-H100"):
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name},
        "spec": {
            "containers": [
                {
                    "name": "main",
                    "image": IMAGE,
                    "resources": {
                        "requests": {"cpu": "1", "memory": "1Gi"},
                        "limits": {"memory": "1Gi", GPU_RESOURCE: str(gpus)},
                    },
                }
            ],
            "nodeSelector": {GPU_PRODUCT_LABEL: product},
            "tolerations": [dict(GPU_TOLERATION)],
        },
    }


def create(cp, namespace, obj, kind="pods"):
    status, body = cp.api("POST", f"/api/v1/namespaces/{namespace}/{kind}", obj)
    assert status == 201, body
    return body


def get_pod(cp, namespace, name):
    return cp.kubectl_json("get", "pod", name, "-n", namespace)


def condition(obj, type_):
    return next((c for c in obj.get("status", {}).get("conditions", []) if c["type"] == type_), None)


def test_fake_nodes_are_ready_with_their_gpus(control_plane):
    nodes = {n["metadata"]["name"]: n for n in control_plane.kubectl_json("get", "nodes")["items"]}
    expected = {
        "gpu-h100-0": ("NVIDIA-H100", "8"),
        "gpu-h100-1": ("NVIDIA-H100", "8"),
        "gpu-h100-2": ("NVIDIA-H100", "8"),
        "gpu-a10-0": ("NVIDIA-A10", "4"),
        "cpu-0": (None, None),
    }
    assert set(expected) <= set(nodes), sorted(nodes)
    for name, (product, gpus) in expected.items():
        node = nodes[name]
        assert condition(node, "Ready")["status"] == "True", (name, node["status"].get("conditions"))
        assert node["metadata"]["labels"].get(GPU_PRODUCT_LABEL) == product, name
        assert node["status"]["capacity"].get(GPU_RESOURCE) == gpus, name
        assert node["status"]["allocatable"].get(GPU_RESOURCE) == gpus, name
        taints = node["spec"].get("taints", [])
        if gpus:
            assert {k: t[k] for t in taints for k in ("key", "value", "effect")} == GPU_TAINT, name
        else:
            assert taints == [], name


def test_gpu_pod_is_bound_to_an_h100_node_and_runs(control_plane, namespace):
    create(control_plane, namespace, gpu_pod("two-gpus", gpus=2))

    def running():
        pod = get_pod(control_plane, namespace, "two-gpus")
        return pod if pod["status"].get("phase") == "Running" else None

    pod = wait_until(running, timeout=60, what="pod two-gpus Running",
                     on_timeout=lambda: json.dumps(get_pod(control_plane, namespace, "two-gpus")["status"]))
    assert pod["spec"]["nodeName"].startswith("gpu-h100-"), pod["spec"].get("nodeName")
    assert condition(pod, "PodScheduled")["status"] == "True"
    assert condition(pod, "Ready")["status"] == "True"
    assert pod["status"]["podIP"]


def test_pod_asking_too_many_gpus_stays_pending(control_plane, namespace):
    create(control_plane, namespace, gpu_pod("nine-gpus", gpus=9))

    def unschedulable():
        c = condition(get_pod(control_plane, namespace, "nine-gpus"), "PodScheduled")
        return c if c and c["status"] == "False" and c.get("reason") == "Unschedulable" else None

    cond = wait_until(unschedulable, timeout=60, what="PodScheduled=False/Unschedulable on nine-gpus")
    assert f"Insufficient {GPU_RESOURCE}" in cond["message"], cond

    def failed_scheduling_event():
        events = control_plane.kubectl_json(
            "get", "events", "-n", namespace,
            "--field-selector", "involvedObject.name=nine-gpus,reason=FailedScheduling",
        )["items"]
        return [e for e in events if f"Insufficient {GPU_RESOURCE}" in e["message"]]

    wait_until(failed_scheduling_event, timeout=30, what="a FailedScheduling event for nine-gpus")
    pod = get_pod(control_plane, namespace, "nine-gpus")
    assert pod["status"]["phase"] == "Pending"
    assert not pod["spec"].get("nodeName")


def test_resource_quota_refuses_pod_over_the_gpu_limit(control_plane, namespace):
    cp = control_plane
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "gpus"},
        "spec": {"hard": {f"requests.{GPU_RESOURCE}": "2"}},
    }
    create(cp, namespace, quota, kind="resourcequotas")
    # admission refuses every pod until the quota controller has computed the status
    wait_until(
        lambda: cp.kubectl_json("get", "resourcequota", "gpus", "-n", namespace).get("status", {}).get("hard"),
        timeout=30, what="the quota controller to fill in ResourceQuota gpus' status",
    )

    status, body = cp.api("POST", f"/api/v1/namespaces/{namespace}/pods", gpu_pod("three", gpus=3))
    assert status == 403, body
    assert body["reason"] == "Forbidden"
    assert "exceeded quota: gpus" in body["message"], body["message"]
    assert f"requested: requests.{GPU_RESOURCE}=3" in body["message"], body["message"]

    r = cp.kubectl("create", "-n", namespace, "-f", "-", input=json.dumps(gpu_pod("three", gpus=3)), check=False)
    assert r.returncode != 0
    assert "(Forbidden)" in r.stderr and "exceeded quota" in r.stderr, r.stderr

    create(cp, namespace, gpu_pod("two", gpus=2))  # within the quota: admitted


def test_deleting_a_namespace_removes_it_and_its_pods(control_plane):
    cp = control_plane
    cp.create_namespace("t-doomed")
    pod = gpu_pod("cpu-only", gpus=0)
    del pod["spec"]["nodeSelector"], pod["spec"]["tolerations"]
    pod["spec"]["containers"][0]["resources"] = {}
    create(cp, "t-doomed", pod)
    wait_until(lambda: get_pod(cp, "t-doomed", "cpu-only")["status"].get("phase") == "Running",
               timeout=60, what="pod t-doomed/cpu-only Running")
    assert get_pod(cp, "t-doomed", "cpu-only")["spec"]["nodeName"] == "cpu-0"

    cp.kubectl("delete", "namespace", "t-doomed", "--wait=false")

    def gone():
        return cp.api("GET", "/api/v1/namespaces/t-doomed")[0] == 404

    wait_until(gone, timeout=90, what="namespace t-doomed to be deleted",
               on_timeout=lambda: json.dumps(cp.api("GET", "/api/v1/namespaces/t-doomed")[1].get("status")))


def test_job_pods_complete_and_the_job_succeeds(control_plane, namespace):
    cp = control_plane
    job = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": "one-shot"},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [{"name": "main", "image": IMAGE}],
                }
            },
        },
    }
    status, body = cp.api("POST", f"/apis/batch/v1/namespaces/{namespace}/jobs", job)
    assert status == 201, body

    def complete():
        j = cp.kubectl_json("get", "job", "one-shot", "-n", namespace)
        c = condition(j, "Complete")
        return j if c and c["status"] == "True" else None

    j = wait_until(complete, timeout=60, what="job one-shot Complete",
                   on_timeout=lambda: json.dumps(cp.kubectl_json("get", "job", "one-shot", "-n", namespace)["status"]))
    assert j["status"]["succeeded"] == 1


def test_service_account_token_without_rbac_is_forbidden(control_plane, namespace):
    cp = control_plane
    kubeconfig = cp.service_account_kubeconfig(namespace, "nobody")

    r = cp.kubectl("get", "pods", kubeconfig=kubeconfig, check=False)
    assert r.returncode != 0
    assert "(Forbidden)" in r.stderr, r.stderr
    assert f'User "system:serviceaccount:{namespace}:nobody" cannot list resource "pods"' in r.stderr, r.stderr

    # the same token works once a Role grants exactly that
    cp.kubectl("create", "role", "pod-reader", "-n", namespace, "--verb=list", "--resource=pods")
    cp.kubectl("create", "rolebinding", "nobody-reads-pods", "-n", namespace,
               "--role=pod-reader", f"--serviceaccount={namespace}:nobody")
    r = wait_until(lambda: (lambda r: r if r.returncode == 0 else None)(
        cp.kubectl("get", "pods", "-o", "json", kubeconfig=kubeconfig, check=False)),
        timeout=30, what="the RoleBinding to take effect")
    assert json.loads(r.stdout)["items"] == []
    r = cp.kubectl("get", "pods", "-n", "default", kubeconfig=kubeconfig, check=False)
    assert "(Forbidden)" in r.stderr, r.stderr
