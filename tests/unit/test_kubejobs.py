"""The pure parts of KubeJobBackend: capacity fit, replica states in words, settings."""

import json

import pytest
from traitlets.config import Config

from gpulab.hub.deploy.kubernetes import gpulab_kube_service, gpulab_kube_settings
from gpulab.hub.jobs.kube import (
    KubeJobBackend,
    backend_settings,
    fit_replicas,
    job_finished,
    merge_restarts,
    pod_restarts,
    pod_words,
    unschedulable_words,
)
from gpulab.hub.quota.ledger import Ledger


@pytest.mark.parametrize("sizes,capacities,fits", [
    ([8, 8, 8], [8, 8, 8, 4], True),
    ([8, 8, 8, 8], [8, 8, 8, 4], False),
    ([4, 4, 4, 4, 4, 4, 4], [8, 8, 8, 4], True),
    ([4] * 8, [8, 8, 8, 4], False),
    ([2, 6, 6, 2], [8, 8], True),
    ([1], [], False),
    ([], [], True),
], ids=["three-full-nodes", "one-too-many", "halves", "halves-too-many", "pairs", "no-nodes",
        "nothing"])
def test_fit_replicas(sizes, capacities, fits):
    assert fit_replicas(sizes=sizes, capacities=capacities) is fits


def pod(phase="Pending", terminated=None, waiting=None, conditions=(), deleting=False):
    cs = {"image": "img:1", "state": {}}
    if terminated:
        cs["state"]["terminated"] = terminated
    if waiting:
        cs["state"]["waiting"] = {"reason": waiting}
    meta = {"name": "p"}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"phase": phase, "containerStatuses": [cs],
                                         "conditions": list(conditions)}}


UNSCHED = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
           "message": "0/5 nodes are available: 3 Insufficient nvidia.com/gpu."}


@pytest.mark.parametrize("p,expected", [
    (pod("Running"), ("Running", "", None)),
    (pod("Succeeded", {"exitCode": 0}), ("Succeeded", "exited 0", 0)),
    (pod("Failed", {"exitCode": 1, "reason": "Error"}),
     ("Failed", "the program raised an error (exit 1)", 1)),
    (pod("Failed", {"exitCode": 75}), ("Failed", "lost its cluster (a ps or peer went away)", 75)),
    (pod("Failed", {"exitCode": 137, "reason": "OOMKilled"}),
     ("Failed", "killed: out of memory (OOM); ask for more memory", 137)),
    (pod(waiting="ImagePullBackOff"),
     ("Starting", "the image img:1 cannot be pulled (ImagePullBackOff)", None)),
    (pod(conditions=[UNSCHED]),
     ("Starting", "cannot be scheduled: no node has 4 free GPUs of model NVIDIA-H100", None)),
    (pod(waiting="ContainerCreating"), ("Starting", "waiting (ContainerCreating)", None)),
    (pod("Running", deleting=True), ("Stopped", "being removed", None)),
], ids=["running", "done", "error", "lost-cluster", "oom", "image", "unschedulable", "creating",
        "deleting"])
def test_pod_words(p, expected):
    assert pod_words(p, gpus=4, model="NVIDIA-H100") == expected


def named(p, name, created):
    p["metadata"].update(name=name, creationTimestamp=created)
    return p


def test_pod_restarts_from_the_failed_pods_a_newer_pod_replaced():
    """Issue 34: each restart of a replica, from its pods' status (oldest first): the failed
    container's exit code and reason (OOMKilled), when the replacement was made."""
    pods = [named(pod("Failed", {"exitCode": 137, "reason": "OOMKilled"}), "w-a", "2026-12-07T10:00:00Z"),
            named(pod("Failed", {"exitCode": 137, "reason": "Error"}), "w-b", "2026-12-07T10:01:00Z"),
            named(pod("Failed", {"exitCode": 1, "reason": "Error"}), "w-c", "2026-12-07T10:02:00Z"),
            named(pod("Running"), "w-d", "2026-12-07T10:03:00Z")]
    at = [1796637660.0, 1796637720.0, 1796637780.0]  # 10:01, 10:02, 10:03 UTC
    assert pod_restarts(pods, gpus=1) == [
        {"restart": 1, "attempt": 2, "at": at[0], "exit_code": 137, "signal": "SIGKILL",
         "oom_killed": True, "reason": "killed: out of memory (OOM); ask for more memory",
         "pod": "w-a"},
        {"restart": 2, "attempt": 3, "at": at[1], "exit_code": 137, "signal": "SIGKILL",
         "oom_killed": False, "reason": "killed by SIGKILL", "pod": "w-b"},
        {"restart": 3, "attempt": 4, "at": at[2], "exit_code": 1, "signal": None,
         "oom_killed": False, "reason": "the program raised an error (exit 1)", "pod": "w-c"}]
    # the newest pod failed, and nothing replaced it (yet): no restart
    assert pod_restarts(pods[:3]) == pod_restarts(pods)[:2]
    assert pod_restarts([named(pod("Running"), "only", "2026-12-07T10:00:00Z")]) == []


def test_restarts_seen_once_are_kept_when_the_cluster_removes_the_pods():
    first = pod_restarts([named(pod("Failed", {"exitCode": 137}), "w-a", "2026-12-07T10:00:00Z"),
                          named(pod("Running"), "w-b", "2026-12-07T10:01:00Z")])
    # w-a is gone; w-b failed and w-c replaced it
    later = pod_restarts([named(pod("Failed", {"exitCode": 1}), "w-b", "2026-12-07T10:01:00Z"),
                          named(pod("Running"), "w-c", "2026-12-07T10:02:00Z")])
    merged = merge_restarts(first, later)
    assert [(r["pod"], r["restart"], r["attempt"]) for r in merged] == [("w-a", 1, 2), ("w-b", 2, 3)]
    assert merge_restarts(merged, later) == merged


def test_unschedulable_words():
    assert unschedulable_words("0/5 nodes are available: 1 node(s) didn't match Pod's node "
                               "affinity/selector.", gpus=1, model="NVIDIA-B200") == (
        "cannot be scheduled: no node has GPUs of model NVIDIA-B200")
    assert unschedulable_words("0/5 nodes: Insufficient memory", gpus=0, model=None) == (
        "cannot be scheduled: no node has enough free CPU or memory")


def test_job_finished():
    assert job_finished({"status": {}}) is None
    assert job_finished({"status": {"conditions": [
        {"type": "SuccessCriteriaMet", "status": "True"},
        {"type": "Complete", "status": "True"}]}}) == "Complete"
    assert job_finished({"status": {"conditions": [
        {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded"}]}}) == "Failed"


def test_settings_shared_with_the_spawner_reach_the_service(tmp_path):
    c = Config()
    c.KubeGPUSpawner.user_namespace_template = "team-{username}"
    c.KubeGPUSpawner.shared_volume = {"nfs": {"server": "nfs", "path": "/x"}}
    c.KubeJobBackend.gpu_model = "NVIDIA-H100"
    c.KubeJobBackend.shared_mount_path = "/data"
    raw = backend_settings(c)
    assert json.loads(raw) == {"gpu_model": "NVIDIA-H100", "namespace_template": "team-{username}",
                               "shared_mount_path": "/data",
                               "shared_volume": {"nfs": {"server": "nfs", "path": "/x"}}}
    settings = gpulab_kube_settings(ledger_url="sqlite://", kube_jobs=raw)
    assert settings["job_backend"] == "kubernetes" and settings["kube_jobs"] == raw
    b = KubeJobBackend.from_settings(Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}"), raw)
    assert b.namespace_of("Ann.Lee") == f"team-{b.user_label('Ann.Lee')}"  # KubeSpawner's slug
    assert b.namespace_of("ann") == "team-ann" and b.gpu_model == "NVIDIA-H100"
    assert b.shared_mount_path == "/data" and b.datasets_subpath == "datasets"


def test_the_spawners_node_pool_is_the_jobs_unless_the_backend_says_otherwise(tmp_path):
    """KubeSpawner's ``node_selector`` and ``tolerations`` set for notebooks reach the job
    backend (replicas run on the same node pool); the backend's own setting wins."""
    tol = [{"key": "dedicated", "operator": "Equal", "value": "ml", "effect": "NoSchedule"}]
    c = Config()
    c.KubeGPUSpawner.node_selector = {"pool": "ml"}
    c.KubeGPUSpawner.tolerations = tol
    b = KubeJobBackend.from_settings(Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}"), backend_settings(c))
    assert b.node_selector == {"pool": "ml"} and b.tolerations == tol
    c.KubeJobBackend.node_selector = {"pool": "batch"}
    assert json.loads(backend_settings(c))["node_selector"] == {"pool": "batch"}


def test_network_settings_are_the_spawners_and_the_hub_namespace_reaches_the_service(
        tmp_path, monkeypatch):
    nfs = [{"to": [{"ipBlock": {"cidr": "10.0.0.5/32"}}], "ports": [{"protocol": "TCP", "port": 2049}]}]
    c = Config()
    c.KubeGPUSpawner.allowed_egress = nfs
    raw = backend_settings(c)
    assert json.loads(raw) == {"allowed_egress": nfs}
    # the service gets only the environment it is given: the hub's namespace goes with it
    env = gpulab_kube_service(config_file="/hub/gpulab_service_config.json",
                              service_ip="1.2.3.4", hub_namespace="jhub")["environment"]
    assert env == {"POD_NAMESPACE": "jhub"}
    monkeypatch.setenv("POD_NAMESPACE", env["POD_NAMESPACE"])
    b = KubeJobBackend.from_settings(Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}"), raw)
    assert b.allowed_egress == nfs and b.hub_namespace == "jhub"
    monkeypatch.delenv("POD_NAMESPACE")
    monkeypatch.setattr("gpulab.hub.cluster.settings.SA_NAMESPACE_FILE", str(tmp_path / "no-such-file"))
    assert KubeJobBackend.from_settings(Ledger(f"sqlite:///{tmp_path / 'm.sqlite'}"),
                                        raw).hub_namespace == "default"
