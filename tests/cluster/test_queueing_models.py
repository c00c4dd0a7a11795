"""Kueue's pool split by GPU model (``c.KubeGPUSpawner.kueue_gpu_models``, issue 18), on a
control plane of its own whose Kueue has the resource transformation the deploy guide names
(`gpulab.hub.cluster.kueueobjects.GPU_QUOTA_TRANSFORMATION`: every GPU a pod asks for also counts as
one ``gpulab.io/gpus``). The job backend runs as the hub's ServiceAccount, as in
``test_queueing.py`` (whose fixtures this module reuses with its own control plane).

The fake nodes: 3 x 8 H100 and 4 A10 (``controlplane.DEFAULT_NODES``).
"""

from __future__ import annotations

import uuid

import pytest

from gpulab.hub.cluster.kueueobjects import GPU_QUOTA_TRANSFORMATION, QUOTA_RESOURCE, gpu_flavor_name

from .controlplane import GPU_PRODUCT_LABEL, GPU_RESOURCE
from .test_queueing import hub_kubeconfig, jobset_pods, kueue_backend, mw, pool_gpus, queueing_plane, until

pytestmark = pytest.mark.cluster

__all__ = ["hub_kubeconfig", "kueue_backend"]  # fixtures, resolved against this module's cp


@pytest.fixture(scope="module")
def cp(request, tmp_path_factory):
    plane = queueing_plane(request, tmp_path_factory, kueue_settings={
        "resources": {"transformations": [dict(GPU_QUOTA_TRANSFORMATION)]}})
    yield plane
    plane.stop()


@pytest.fixture
def kueue_backend_settings():
    return {"kueue_gpu_models": True}


def models_of(cp, pods) -> set[str]:
    nodes = {n["metadata"]["name"]: n for n in cp.kubectl_json("get", "nodes")["items"]}
    return {nodes[p["spec"]["nodeName"]]["metadata"]["labels"][GPU_PRODUCT_LABEL] for p in pods}


async def test_work_for_a_model_waits_for_that_model_and_the_quota_counts_every_model(cp, kueue_backend):
    """A job for A10s waits, whole and without a pod, while the A10s are taken, though many
    H100s are free (one pool of any model would admit it, its pods Pending); a job for
    H100s meanwhile runs on H100 nodes; the person's quota counts both models together, so a
    job that fits the H100s but not the quota waits too; freeing the A10s starts both."""
    from gpulab.hub.quota.policy import Quota

    b = kueue_backend
    user = f"m{uuid.uuid4().hex[:6]}"
    b.ledger.set_quota("user", user, Quota(max_gpus=6), actor="admin")
    ns = b.namespace_of(user)
    a10, h100 = gpu_flavor_name("NVIDIA-A10"), gpu_flavor_name("NVIDIA-H100")
    try:
        b.gpu_model = "NVIDIA-A10"
        await b.submit(user, (), mw("a10-all", 4))
        await until(lambda: b.get(user, "a10-all")["state"] == "Running", "the A10 job Running")
        assert pool_gpus(cp) == {a10: "4", h100: "24", "total": "28"}
        cq = cp.kubectl_json("get", "clusterqueue", ns)
        gpus, quota, _ = cq["spec"]["resourceGroups"]
        assert [f["name"] for f in gpus["flavors"]] == [a10, h100]
        assert quota["coveredResources"] == [QUOTA_RESOURCE]
        assert quota["flavors"][0]["resources"][0]["borrowingLimit"] == "6"
        assert models_of(cp, jobset_pods(cp, ns, "a10-all")) == {"NVIDIA-A10"}

        await b.submit(user, (), mw("a10-more", 1))
        view = await until(lambda: "insufficient" in (v := b.get(user, "a10-more"))["reason"] and v,
                           "the second A10 job waiting")
        assert view["state"] == "Queued" and "for nvidia-a10 GPUs" in view["reason"], view["reason"]
        assert "h100" not in view["reason"], view["reason"]  # nor the models it did not ask for
        assert jobset_pods(cp, ns, "a10-more") == []

        b.gpu_model = "NVIDIA-H100"
        await b.submit(user, (), mw("h100", 2))
        await until(lambda: b.get(user, "h100")["state"] == "Running", "the H100 job Running")
        assert models_of(cp, jobset_pods(cp, ns, "h100")) == {"NVIDIA-H100"}
        # 4 A10 + 2 H100 = the quota of 6: one more H100 waits, though 22 H100s are free
        await b.submit(user, (), mw("h100-more", 1))
        view = await until(lambda: "insufficient" in (v := b.get(user, "h100-more"))["reason"] and v,
                           "the job over the quota waiting")
        assert "your GPU quota (GPUs of every model)" in view["reason"], view["reason"]
        assert jobset_pods(cp, ns, "h100-more") == []
        assert sorted((a.holder, a.gpus) for a in b.ledger.open_allocations(user=user)) == [
            ("a10-all", 4), ("h100", 2)]

        await b.stop(user, "a10-all")
        await until(lambda: b.get(user, "a10-more")["state"] == "Running", "the second A10 job Running")
        await until(lambda: b.get(user, "h100-more")["state"] == "Running", "the third H100 job Running")
        assert models_of(cp, jobset_pods(cp, ns, "a10-more")) == {"NVIDIA-A10"}
        workload = next(w for w in cp.kubectl_json("get", "workloads", "-n", ns)["items"]
                        if w["metadata"]["ownerReferences"][0]["name"] == "h100-more")
        (assignment,) = workload["status"]["admission"]["podSetAssignments"]
        assert assignment["flavors"][GPU_RESOURCE] == h100
        assert assignment["flavors"][QUOTA_RESOURCE] == "gpulab-quota"
    finally:
        cp.kubectl("delete", "jobsets", "--all", "-n", ns, "--wait=false", check=False)
        cp.kubectl("delete", "clusterqueue", ns, f"{ns}.preemptible", "--wait=false", check=False)
