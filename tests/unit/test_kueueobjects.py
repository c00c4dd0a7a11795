"""gpulab's quotas as Kueue objects (gpulab.hub.cluster.kueueobjects), as literal dicts."""

import hashlib
import re

import pytest

from gpulab.hub.cluster.kueueobjects import (
    GPU_QUOTA_TRANSFORMATION,
    POOL_CPU,
    POOL_EPHEMERAL_STORAGE,
    POOL_MEMORY,
    PREEMPTIBLE_PRIORITY_CLASS,
    cohort_name,
    gpu_flavor_name,
    gpu_models,
    kueue_words,
    make_cluster_queues,
    make_cohorts,
    make_default_flavor,
    make_gpu_flavor,
    make_local_queues,
    make_priority_class,
    make_quota_flavor,
    pending_workloads_path,
    visibility_place,
)

MANAGED = {"app.kubernetes.io/managed-by": "gpulab"}
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def queues(**kw):
    args = dict(namespace="gpulab-ann", user_label="ann", max_gpus=2)
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


def test_the_in_quota_queue_borrows_up_to_the_quota_and_preempts_only_lower_priorities():
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
                 "flavors": [{"name": "gpulab-gpu", "resources": [
                     {"name": "nvidia.com/gpu", "nominalQuota": "0", "borrowingLimit": "2"}]}]},
                {"coveredResources": ["cpu", "memory", "ephemeral-storage"],
                 "flavors": [{"name": "gpulab-default", "resources": [
                     {"name": "cpu", "nominalQuota": "0"},
                     {"name": "memory", "nominalQuota": "0"},
                     {"name": "ephemeral-storage", "nominalQuota": "0"}]}]},
            ],
            # never another person's in-quota work (priority 0 as its own)
            "preemption": {"reclaimWithinCohort": "LowerPriority",
                           "withinClusterQueue": "LowerPriority"},
        },
    }
    # no quota: borrowing up to the whole pool
    unlimited = queues(max_gpus=None)[0]["spec"]["resourceGroups"][0]["flavors"][0]
    assert unlimited["resources"] == [{"name": "nvidia.com/gpu", "nominalQuota": "0"}]


def test_split_by_model_the_queues_list_a_flavor_per_model_and_the_quota_counts_them_all():
    """A pool split by model (``kueue_gpu_models``): one flavor per model, in the pool's
    order; the person's quota on the GPUs of every model together (``gpulab.io/gpus``) and
    on each model's too (where Kueue lacks the transformation, the quota still holds per
    model). A pool of any model has neither."""
    models = gpu_models({"NVIDIA-H100": 24, None: 2, "NVIDIA-A10": 4})
    assert models == ["NVIDIA-A10", "NVIDIA-H100", None]
    own, pre = queues(models=models)
    gpus, quota, _ = own["spec"]["resourceGroups"]
    assert [f["name"] for f in gpus["flavors"]] == [
        gpu_flavor_name("NVIDIA-A10"), gpu_flavor_name("NVIDIA-H100"), "gpulab-gpu"]
    assert all(f["resources"] == [{"name": "nvidia.com/gpu", "nominalQuota": "0", "borrowingLimit": "2"}]
               for f in gpus["flavors"])
    assert quota["flavors"] == [{"name": "gpulab-quota", "resources": [
        {"name": "gpulab.io/gpus", "nominalQuota": "0", "borrowingLimit": "2"}]}]
    assert [f["name"] for f in pre["spec"]["resourceGroups"][0]["flavors"]] == [
        f["name"] for f in gpus["flavors"]]
    assert gpu_models(None) == gpu_models(6) == gpu_models({}) == gpu_models({None: 3}) == [None]
    assert [g["coveredResources"] for g in queues(models=[None])[0]["spec"]["resourceGroups"]] == [
        ["nvidia.com/gpu"], ["cpu", "memory", "ephemeral-storage"]]
    assert GPU_QUOTA_TRANSFORMATION == {"input": "nvidia.com/gpu", "strategy": "Retain",
                                        "outputs": {"gpulab.io/gpus": "1"}}


def test_the_preemptible_queue_borrows_without_limit_and_gives_back_first():
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
    assert spec["fairSharing"] == {"weight": "0"}  # its borrowed GPUs go back first


def test_preemptible_work_has_a_priority_below_everyone_elses():
    assert make_priority_class() == {
        "apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
        "metadata": {"name": PREEMPTIBLE_PRIORITY_CLASS, "labels": MANAGED},
        "value": -1000, "description": make_priority_class()["description"]}
    assert make_priority_class()["value"] < 0  # a workload without a class has 0


def test_the_root_cohort_holds_the_pool_and_a_groups_cohort_nothing():
    own, pre = queues(group="ml team")
    assert own["spec"]["cohortName"] == cohort_name("ml team")
    # preemptible work right below the root: the first given back, whoever needs GPUs
    assert pre["spec"]["cohortName"] == "gpulab"
    root, group = make_cohorts("ml team")
    assert root["metadata"]["name"] == "gpulab" and root["spec"] == {}
    assert group["metadata"]["name"] == cohort_name("ml team")
    assert group["spec"] == {"parentName": "gpulab"}  # no quota of its own
    assert [c["metadata"]["name"] for c in make_cohorts(None)] == ["gpulab"]
    [pool] = make_cohorts(None, 28)
    assert pool["spec"]["resourceGroups"] == [
        {"coveredResources": ["nvidia.com/gpu"], "flavors": [{"name": "gpulab-gpu", "resources": [
            {"name": "nvidia.com/gpu", "nominalQuota": "28"}]}]},
        {"coveredResources": ["cpu", "memory", "ephemeral-storage"],
         "flavors": [{"name": "gpulab-default", "resources": [
            {"name": "cpu", "nominalQuota": POOL_CPU},
            {"name": "memory", "nominalQuota": POOL_MEMORY},
            {"name": "ephemeral-storage", "nominalQuota": POOL_EPHEMERAL_STORAGE}]}]},
    ]
    [pool] = make_cohorts(None, {"NVIDIA-H100": 24, "NVIDIA-A10": 4})
    gpus, quota, _ = pool["spec"]["resourceGroups"]
    assert gpus["flavors"] == [
        {"name": gpu_flavor_name("NVIDIA-A10"), "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "4"}]},
        {"name": gpu_flavor_name("NVIDIA-H100"), "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "24"}]}]
    assert quota["flavors"] == [{"name": "gpulab-quota", "resources": [{"name": "gpulab.io/gpus", "nominalQuota": "28"}]}]
    assert make_quota_flavor()["spec"] == {} and make_quota_flavor()["metadata"]["name"] == "gpulab-quota"
    [empty] = make_cohorts(None, {})  # no GPU node (yet): a pool of 0
    assert empty["spec"]["resourceGroups"][0]["flavors"][0]["resources"][0]["nominalQuota"] == "0"
    for bad in (-1, {"NVIDIA-H100": -1}, {"NVIDIA-H100": 1.5}):
        with pytest.raises(ValueError, match="capacity"):
            make_cohorts(None, bad)


def test_a_used_up_budget_holds_new_admissions():
    assert all(q["spec"]["stopPolicy"] == "Hold" for q in queues(hold=True))
    assert all("stopPolicy" not in q["spec"] for q in queues())


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_a_bad_gpu_count_is_refused(bad):
    with pytest.raises(ValueError, match="max_gpus"):
        queues(max_gpus=bad)


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
    bob = make_cluster_queues(namespace="gpulab-bob", user_label="bob", max_gpus=1)
    other = make_cluster_queues(namespace="gpulab-bob-preemptible", user_label="bob-preemptible",
                                max_gpus=1)
    names = [q["metadata"]["name"] for q in bob + other]
    assert names == ["gpulab-bob", "gpulab-bob.preemptible", "gpulab-bob-preemptible",
                     "gpulab-bob-preemptible.preemptible"]
    assert len(set(names)) == 4


def test_kueues_words_name_the_quota_and_the_models_plainly():
    h100 = gpu_flavor_name("NVIDIA-H100")
    a10 = gpu_flavor_name("NVIDIA-A10")
    assert kueue_words(
        f"couldn't assign flavors to pod set worker: flavor {h100} doesn't match node affinity, "
        f"insufficient unused quota for nvidia.com/gpu in flavor {a10}, 1 more needed") == (
        "couldn't assign flavors to pod set worker: insufficient unused quota for nvidia-a10 GPUs, 1 more needed")
    assert kueue_words(
        "couldn't assign flavors to pod set worker: insufficient quota for gpulab.io/gpus in flavor "
        "gpulab-quota, previously considered podsets requests (0) + current podset request (1) > "
        "maximum capacity (0)").startswith(
        "couldn't assign flavors to pod set worker: insufficient quota for your GPU quota (GPUs of every model), ")
    assert kueue_words("insufficient unused quota for nvidia.com/gpu in flavor gpulab-gpu, 2 more needed") == (
        "insufficient unused quota for GPUs, 2 more needed")
    assert kueue_words("Preempted to accommodate a workload") == "Preempted to accommodate a workload"


def test_the_visibility_apis_place_counts_from_one():
    pending = [{"metadata": {"name": "a"}, "positionInLocalQueue": 0},
               {"metadata": {"name": "b"}, "positionInLocalQueue": 1},
               {"metadata": {"name": "c"}}]
    assert [visibility_place(pending, n) for n in ("a", "b", "c", "gone")] == [1, 2, None, None]
    assert pending_workloads_path("gpulab-ann", "gpulab") == (
        "/apis/visibility.kueue.x-k8s.io/v1beta2/namespaces/gpulab-ann/localqueues/gpulab/pendingworkloads")
