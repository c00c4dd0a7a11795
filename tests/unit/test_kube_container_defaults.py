"""The operator's container defaults (``default_container_limits`` /
``default_container_requests``) travel in every server pod KubeGPUSpawner creates, not in a
LimitRange of the namespace (one request fewer per spawn, issue 40): each container that
names a resource of its own keeps it, init containers, the operator's extra containers and
what ``modify_pod_hook`` adds get them too, a container the hook adds as a dict as well as
the client's model objects.

KubeSpawner's own ``get_pod_manifest`` builds the pod; the API is a stand-in that records
the pod it is sent (no API server: tests/cluster/test_kube_spawner.py reads a pod the API
server stored)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from kubernetes_asyncio.client import ApiClient
from kubespawner.clients import load_config
from traitlets.config import Config

from gpulab.spawner.kube import KubeGPUSpawner
from gpulab.spawner.mixin import SpawnRefused
from tests.doubles import offline_kubeconfig

LIMITS = {"cpu": "2", "memory": "8Gi", "ephemeral-storage": "20Gi"}
REQUESTS = {"cpu": "100m", "memory": "512Mi", "ephemeral-storage": "1Gi"}


@pytest.fixture
def spawner_of(tmp_path, monkeypatch):
    offline_kubeconfig(tmp_path, monkeypatch)
    load_config.cache_clear()  # (KubeSpawner loads its client configuration once)
    sent = []

    async def create(namespace, pod, **kwargs):
        sent.append(ApiClient().sanitize_for_serialization(pod))

    def make(**traits):
        config = Config()
        config.KubeGPUSpawner.storage_pvc_ensure = False
        for k, v in traits.items():
            setattr(config.KubeGPUSpawner, k, v)
        s = KubeGPUSpawner(config=config, _mock=True)
        s.api = SimpleNamespace(create_namespaced_pod=create)
        return s

    yield make, sent
    load_config.cache_clear()


async def start_pod(s):
    """What KubeSpawner's start does with the pod: its manifest, the hook, the create."""
    pod = await s.get_pod_manifest()
    if s.modify_pod_hook:
        pod = s.modify_pod_hook(s, pod)
    assert await s._make_create_pod_request(pod, 3) is True
    # a second try sends the same object (KubeSpawner's retry): nothing changes
    assert await s._make_create_pod_request(pod, 3) is True


async def test_every_container_of_a_server_pod_gets_what_it_names_none_of(spawner_of):
    make, sent = spawner_of

    def hook(spawner, pod):
        pod.spec.containers.append({"name": "hooked", "image": "h"})  # a dict among models
        return pod

    s = make(cpu_limit=4, mem_guarantee="4G",
             init_containers=[{"name": "init", "image": "i"}],
             extra_containers=[{"name": "side", "image": "x",
                                "resources": {"limits": {"memory": "1Gi"}}}],
             modify_pod_hook=hook)
    await start_pod(s)
    first, again = sent
    assert first == again
    resources = {c["name"]: c["resources"] for c in
                 [*first["spec"]["containers"], *first["spec"]["initContainers"]]}
    assert resources == {
        # the profile's CPU limit is kept (the API server makes it the request too), and its
        # memory request (4G: 4 GiB) under the default memory limit
        "notebook": {"limits": {"cpu": 4.0, "memory": "8Gi", "ephemeral-storage": "20Gi"},
                     "requests": {"memory": 4294967296, "ephemeral-storage": "1Gi"}},
        "side": {"limits": {**LIMITS, "memory": "1Gi"},
                 "requests": {"cpu": "100m", "ephemeral-storage": "1Gi"}},
        "hooked": {"limits": LIMITS, "requests": REQUESTS},
        "init": {"limits": LIMITS, "requests": REQUESTS},
    }


async def test_a_default_limit_alone_reserves_it_and_none_configured_adds_nothing(spawner_of):
    make, sent = spawner_of
    await start_pod(make(default_container_requests={"cpu": "1"}))
    [notebook] = sent[0]["spec"]["containers"]
    # a default limit without a default request reserves that limit (as a LimitRange did)
    assert notebook["resources"] == {
        "limits": LIMITS, "requests": {**LIMITS, "cpu": "1"}}

    sent.clear()
    await start_pod(make(default_container_limits={}, default_container_requests={}))
    [notebook] = sent[0]["spec"]["containers"]
    assert notebook.get("resources", {}) == {}


async def test_a_request_above_the_default_limit_without_a_limit_is_refused_in_words(
        spawner_of):
    """A profile (or a choice of its options) that reserves more than the default limit and
    sets no limit: the API server refused the pod the LimitRange completed; now the spawn is
    refused with what to do, before the pod is sent."""
    make, sent = spawner_of
    s = make(mem_guarantee="16G")
    with pytest.raises(SpawnRefused) as e:
        await s._make_create_pod_request(await s.get_pod_manifest(), 3)
    assert e.value.status_code == 400
    assert e.value.jupyterhub_message == (
        "This server's container 'notebook' asks for a memory request of 17179869184 with no "
        "memory limit of its own, above the default memory limit 8Gi: the cluster would refuse "
        "its pod. Choose less, or ask an admin for a profile that sets a limit too.")
    assert sent == []


async def test_bad_defaults_refuse_the_spawn_before_any_request(spawner_of):
    make, sent = spawner_of
    s = make(default_container_limits={"memory": "1Gi"},
             default_container_requests={"memory": "2Gi"})
    with pytest.raises(SpawnRefused) as e:
        await s._make_create_pod_request(await s.get_pod_manifest(), 3)
    assert e.value.status_code == 500
    assert e.value.jupyterhub_message == (
        "The servers' container defaults are wrong: default_container_requests: memory 2Gi "
        "is above default_container_limits' 1Gi")
    assert sent == []
