"""The Kubernetes objects of KubeGPUSpawner, compared with literal dicts."""

import pytest

from gpulab.spawner.kube import effective_max_gpus
from gpulab.spawner.kubeobjects import (
    explain_unschedulable,
    free_gpus_by_node,
    make_gpu_quota,
    make_user_namespace,
    parse_quota_refusal,
    server_pod_settings,
)


def test_user_namespace_enforces_pod_security_baseline():
    assert make_user_namespace(name="gpulab-ann", user_label="ann") == {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": "gpulab-ann",
            "labels": {
                "app.kubernetes.io/managed-by": "gpulab",
                "gpulab.io/user": "ann",
                "pod-security.kubernetes.io/enforce": "baseline",
                "pod-security.kubernetes.io/enforce-version": "latest",
            },
        },
    }


def test_user_namespace_refuses_an_unknown_level():
    with pytest.raises(ValueError, match="pod_security must be one of"):
        make_user_namespace(name="n", user_label="ann", pod_security="lax")


def test_gpu_quota():
    assert make_gpu_quota(namespace="gpulab-ann", max_gpus=2, user_label="ann") == {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {
            "name": "gpulab-gpus",
            "namespace": "gpulab-ann",
            "labels": {"app.kubernetes.io/managed-by": "gpulab", "gpulab.io/user": "ann"},
        },
        "spec": {"hard": {"requests.nvidia.com/gpu": "2"}},
    }


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True], ids=["negative", "float", "str", "bool"])
def test_gpu_quota_needs_a_whole_number(bad):
    with pytest.raises(ValueError):
        make_gpu_quota(namespace="n", max_gpus=bad, user_label="ann")


SHARED = {"nfs": {"server": "nfs.example.org", "path": "/gpulab"}}


def settings(**kw):
    args = dict(gpus=2, tolerations=[], volumes=[], volume_mounts=[], environment={"A": "1"},
                home={"claim": "claim-ann", "mount": "/home/jovyan"}, shared_volume=SHARED,
                shared_mount="/gpulab/shared", user_subpath="users/ann", datasets_subpath="datasets")
    args.update(kw)
    return server_pod_settings(**args)


def test_server_settings_with_gpus_home_and_shared_storage():
    assert settings() == {
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "volumes": [
            {"name": "home", "persistentVolumeClaim": {"claimName": "claim-ann"}},
            {"name": "gpulab-shared", "nfs": {"server": "nfs.example.org", "path": "/gpulab"}},
        ],
        "volume_mounts": [
            {"name": "home", "mountPath": "/home/jovyan"},
            {"name": "gpulab-shared", "mountPath": "/gpulab/shared/users/ann", "subPath": "users/ann"},
            {"name": "gpulab-shared", "mountPath": "/gpulab/shared/datasets", "subPath": "datasets",
             "readOnly": True},
        ],
        "environment": {
            "A": "1",
            "GPULAB_SHARED_DIR": "/gpulab/shared",
            "GPULAB_USER_DIR": "/gpulab/shared/users/ann",
            "GPULAB_DATASETS_DIR": "/gpulab/shared/datasets",
        },
    }


def test_server_settings_without_gpus_or_storage_keep_the_configured_values():
    configured_tolerations = [{"key": "x", "operator": "Exists"}]
    out = settings(gpus=0, tolerations=configured_tolerations, home=None, shared_volume=None)
    assert out == {
        "tolerations": [{"key": "x", "operator": "Exists"}],
        "volumes": [],
        "volume_mounts": [],
        "environment": {"A": "1"},
    }
    assert out["tolerations"] is not configured_tolerations  # a copy: the config stays as it was


def test_server_settings_extend_dict_shaped_traits():
    out = settings(tolerations={"a": {"key": "a"}}, volumes={"v": {"name": "v"}},
                   volume_mounts={"v": {"name": "v", "mountPath": "/v"}}, home=None,
                   datasets_subpath=None)
    assert out["tolerations"] == {
        "a": {"key": "a"},
        "gpulab-gpu": {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
    }
    assert out["volumes"] == {"v": {"name": "v"}, "gpulab-shared": {"name": "gpulab-shared", **SHARED}}
    assert out["volume_mounts"] == {
        "v": {"name": "v", "mountPath": "/v"},
        "gpulab-shared-user": {"name": "gpulab-shared", "mountPath": "/gpulab/shared/users/ann",
                               "subPath": "users/ann"},
    }
    assert "GPULAB_DATASETS_DIR" not in out["environment"]


@pytest.mark.parametrize("subpath", ["", "/users/ann", "users/../bob", ".."],
                         ids=["empty", "absolute", "escapes", "parent"])
def test_server_settings_refuse_a_sub_path_outside_the_share(subpath):
    with pytest.raises(ValueError, match="user_subpath"):
        settings(user_subpath=subpath)


def node(name, gpus, model="NVIDIA-H100", unschedulable=False):
    n = {"metadata": {"name": name, "labels": {"nvidia.com/gpu.product": model} if gpus else {}},
         "spec": {"unschedulable": True} if unschedulable else {},
         "status": {"allocatable": {"nvidia.com/gpu": str(gpus)} if gpus else {"cpu": "8"}}}
    return n


def pod(node_name, gpus, phase="Running", where="limits"):
    return {"spec": {"nodeName": node_name,
                     "containers": [{"resources": {where: {"nvidia.com/gpu": str(gpus)}}},
                                    {"resources": {}}]},
            "status": {"phase": phase}}


def test_free_gpus_by_node():
    nodes = [node("h0", 8), node("h1", 8), node("a0", 4, "NVIDIA-A10"), node("cpu", 0),
             node("h2", 8, unschedulable=True)]
    pods = [pod("h0", 6), pod("h0", 1, where="requests"), pod("h1", 8, phase="Succeeded"),
            pod("a0", 4), pod("cpu", 0), pod("elsewhere", 3)]
    assert free_gpus_by_node(nodes=nodes, pods=pods) == {"h0": 1, "h1": 8, "a0": 0}
    assert free_gpus_by_node(nodes=nodes, pods=pods, model="NVIDIA-H100") == {"h0": 1, "h1": 8}
    assert free_gpus_by_node(nodes=nodes, pods=pods, model="NVIDIA-B200") == {}


INSUFFICIENT = ("0/5 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, "
                "1 node(s) had untolerated taint {x: y}, 3 Insufficient nvidia.com/gpu. "
                "preemption: 0/5 nodes are available: 5 No preemption victims found.")


@pytest.mark.parametrize(
    "message, gpus, model, free, expected",
    [
        (INSUFFICIENT, 4, "NVIDIA-H100", {"h0": 2, "h1": 0},
         "No node has 4 free GPUs of model NVIDIA-H100 (most free on one node: 2); waiting."),
        (INSUFFICIENT, 9, None, {"h0": 8}, "No node has 9 free GPUs (most free on one node: 8); waiting."),
        ("0/5 nodes are available: 5 node(s) didn't match Pod's node affinity/selector.", 1,
         "NVIDIA-B200", {},
         "No node has GPUs of model NVIDIA-B200; waiting (ask an admin which GPU models the "
         "cluster has)."),
        ('0/5 nodes are available: persistentvolumeclaim "claim-ann" not found.', 1, None, {"h0": 8},
         "The storage volume 'claim-ann' of this server does not exist; waiting for it."),
        ("0/5 nodes are available: pod has unbound immediate PersistentVolumeClaims.", 0, None, {},
         "A storage volume of this server is not ready yet (not bound to a disk); waiting."),
        ("0/5 nodes are available: 5 Insufficient cpu.", 0, None, {}, None),
    ],
    ids=["gpus-busy", "too-many", "no-such-model", "missing-pvc", "unbound-pvc", "other"],
)
def test_explain_unschedulable(message, gpus, model, free, expected):
    assert explain_unschedulable(message, gpus=gpus, model=model, free_by_node=free) == expected


def test_parse_quota_refusal():
    message = ('pods "jupyter-ann" is forbidden: exceeded quota: gpulab-gpus, requested: '
               "requests.nvidia.com/gpu=2, used: requests.nvidia.com/gpu=1, limited: "
               "requests.nvidia.com/gpu=2")
    assert parse_quota_refusal(message) == {"requested": 2, "used": 1, "limited": 2}
    assert parse_quota_refusal("exceeded quota: q, requested: pods=1, used: pods=1, limited: pods=1") is None
    assert parse_quota_refusal('pods "x" is forbidden: violates PodSecurity') is None


ROWS = [
    {"scope": "default", "name": "", "max_gpus": 1},
    {"scope": "group", "name": "vision", "max_gpus": 4, "gpu_hours": 10.0, "window_hours": 24},
    {"scope": "group", "name": "nlp", "max_gpus": 2},
    {"scope": "user", "name": "carl", "max_gpus": 0},
]


@pytest.mark.parametrize(
    "rows, user, groups, expected",
    [
        (ROWS, "ann", (), 1),
        (ROWS, "ann", ("nlp", "vision"), 4),
        (ROWS, "carl", ("vision",), 0),
        ([], "ann", ("nlp",), None),
    ],
    ids=["default", "most-generous-group", "user-wins", "none"],
)
def test_effective_max_gpus(rows, user, groups, expected):
    assert effective_max_gpus(rows, user, groups) == expected
