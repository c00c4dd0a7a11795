"""gpulab's quotas as Kueue objects (gpulab.spawner.kueueobjects), as literal dicts."""

import hashlib
import re

import pytest

from gpulab.spawner.kueueobjects import (
    cohort_name,
    gpu_flavor_name,
    make_cluster_queues,
    make_cohorts,
    make_default_flavor,
    make_gpu_flavor,
    make_local_queues,
)

MANAGED = {"app.kubernetes.io/managed-by": "gpulab"}
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def queues(**kw):
    args = dict(namespace="gpulab-ann", user_label="ann", max_gpus=2,
                models=["NVIDIA-H100"], cpu="32", memory="128Gi")
    args.update(kw)
    return make_cluster_queues(**args)


def test_flavors_select_nodes_by_gpu_model():
    assert make_gpu_flavor("NVIDIA-H100") == {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ResourceFlavor",
        # changed by the slug (upper case), so the text's hash keeps it apart from others
        "metadata": {"name": "gpulab-gpu-nvidia-h100-"
                     + hashlib.sha256(b"NVIDIA-H100").hexdigest()[:8], "labels": MANAGED},
        "spec": {"nodeLabels": {"nvidia.com/gpu.product": "NVIDIA-H100"}}}
    assert make_gpu_flavor(None)["metadata"]["name"] == "gpulab-gpu"
    assert make_gpu_flavor(None)["spec"] == {}
    assert make_default_flavor()["metadata"]["name"] == "gpulab-default"


@pytest.mark.parametrize("texts", [
    ["NVIDIA-H100", "nvidia-h100", "NVIDIA H100", "nvidia-h100-"],
    ["ml team", "ml-team", "ML-TEAM", "ml_team"],
    ["x" * 80, "x" * 81],
])
def test_names_are_dns_labels_and_never_shared(texts):
    for name_of in (gpu_flavor_name, cohort_name):
        names = [name_of(t) for t in texts]
        assert len(set(names)) == len(texts), names
        for n in names:
            assert len(n) <= 63 and DNS_LABEL.fullmatch(n), n


def test_the_in_quota_queue_never_borrows_and_takes_its_quota_back():
    own = queues()[0]
    assert own == {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "ClusterQueue",
        "metadata": {"name": "gpulab-ann", "labels": {**MANAGED, "gpulab.io/user": "ann"}},
        "spec": {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "gpulab-ann"}},
            "cohortName": "gpulab",
            "queueingStrategy": "BestEffortFIFO",
            "resourceGroups": [
                {"coveredResources": ["nvidia.com/gpu"],
                 "flavors": [{"name": gpu_flavor_name("NVIDIA-H100"), "resources": [
                     {"name": "nvidia.com/gpu", "nominalQuota": "2", "borrowingLimit": "0"}]}]},
                {"coveredResources": ["cpu", "memory"],
                 "flavors": [{"name": "gpulab-default", "resources": [
                     {"name": "cpu", "nominalQuota": "32", "borrowingLimit": "0"},
                     {"name": "memory", "nominalQuota": "128Gi", "borrowingLimit": "0"}]}]},
            ],
            "preemption": {"reclaimWithinCohort": "Any", "withinClusterQueue": "LowerPriority"},
        },
    }


def test_the_preemptible_queue_only_borrows_and_preempts_nobody():
    pre = queues()[1]
    assert pre["metadata"]["name"] == "gpulab-ann.preemptible"
    spec = pre["spec"]
    assert spec["namespaceSelector"] == {
        "matchLabels": {"kubernetes.io/metadata.name": "gpulab-ann"}}
    for group in spec["resourceGroups"]:
        for flavor in group["flavors"]:
            for r in flavor["resources"]:
                assert r["nominalQuota"] == "0" and "borrowingLimit" not in r, r
    assert spec["preemption"] == {"reclaimWithinCohort": "Never", "withinClusterQueue": "Never"}


def test_a_group_quota_puts_both_queues_in_the_groups_cohort_below_the_root():
    for q in queues(group="ml team"):
        assert q["spec"]["cohortName"] == cohort_name("ml team")
    root, group = make_cohorts("ml team")
    assert root["metadata"]["name"] == "gpulab" and root["spec"] == {}
    assert group["metadata"]["name"] == cohort_name("ml team")
    assert group["spec"] == {"parentName": "gpulab"}  # no quota of its own: members' add up
    assert [c["metadata"]["name"] for c in make_cohorts(None)] == ["gpulab"]


def test_a_used_up_budget_holds_new_admissions():
    assert all(q["spec"]["stopPolicy"] == "Hold" for q in queues(hold=True))
    assert all("stopPolicy" not in q["spec"] for q in queues())


def test_every_model_gets_the_quota_in_its_flavor():
    gpu_group = queues(models=["NVIDIA-H100", "NVIDIA-A10", "NVIDIA-H100"])[0][
        "spec"]["resourceGroups"][0]
    assert [f["name"] for f in gpu_group["flavors"]] == [
        gpu_flavor_name("NVIDIA-H100"), gpu_flavor_name("NVIDIA-A10")]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2", None])
def test_a_bad_gpu_count_is_refused(bad):
    with pytest.raises(ValueError, match="max_gpus"):
        queues(max_gpus=bad)
    with pytest.raises(ValueError, match="model"):
        queues(models=[])


def test_local_queues_point_at_the_persons_cluster_queues():
    assert make_local_queues(namespace="gpulab-ann", user_label="ann") == [
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
         "metadata": {"name": "gpulab", "namespace": "gpulab-ann",
                      "labels": {**MANAGED, "gpulab.io/user": "ann"}},
         "spec": {"clusterQueue": "gpulab-ann"}},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "LocalQueue",
         "metadata": {"name": "gpulab-preemptible", "namespace": "gpulab-ann",
                      "labels": {**MANAGED, "gpulab.io/user": "ann"}},
         "spec": {"clusterQueue": "gpulab-ann.preemptible"}},
    ]


def test_no_persons_queue_is_named_as_anothers_preemptible_one():
    """User "bob-preemptible" has namespace gpulab-bob-preemptible: never the name of bob's
    preemptible ClusterQueue (a namespace cannot hold the dot that name has)."""
    bob = make_cluster_queues(namespace="gpulab-bob", user_label="bob", max_gpus=1,
                              models=[None], cpu="1", memory="1Gi")
    other = make_cluster_queues(namespace="gpulab-bob-preemptible", user_label="bob-preemptible",
                                max_gpus=1, models=[None], cpu="1", memory="1Gi")
    names = [q["metadata"]["name"] for q in bob + other]
    assert names == ["gpulab-bob", "gpulab-bob.preemptible", "gpulab-bob-preemptible",
                     "gpulab-bob-preemptible.preemptible"]
    assert len(set(names)) == 4
