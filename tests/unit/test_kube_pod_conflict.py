"""A pod create that KubeSpawner meets with 409 (the pod is there already: most often its own
create that timed out on the hub's side under load, then was made) is answered by KubeSpawner
with ``stop(True)`` and a new create, and the start goes on: KubeGPUSpawner then keeps the
GPUs admitted for that start (on 3db6b70 its `stop` released them, and the new pod ran on
GPUs the ledger had given back). A stop of the server itself still releases them.

The pod in the way is kept when it is this start's own (its mark, `START_ANNOTATION`): the
next try takes it as made, where KubeSpawner's delete raced the next create (a late DELETE
removed the new pod and the spawn waited `start_timeout`). One of an earlier start is deleted,
as KubeSpawner does. tests/cluster/test_kube_spawner.py has the same against the API server.

KubeSpawner's own `_make_create_pod_request` runs, against an API that answers 409 (a mock
instance: no API server); KubeSpawner's `stop` (delete the pod, wait for it to go) is
recorded instead of run, and so is the release of the GPUs."""

from __future__ import annotations

import asyncio

from types import SimpleNamespace

import pytest

from kubernetes_asyncio.client.exceptions import ApiException
from kubespawner import KubeSpawner
from kubespawner.clients import load_config
from traitlets.config import Config

from gpulab.spawner.kube import START_ANNOTATION, KubeGPUSpawner
from tests.doubles import offline_kubeconfig


async def test_a_pod_in_the_way_of_a_start_keeps_the_starts_gpus(tmp_path, monkeypatch):
    offline_kubeconfig(tmp_path, monkeypatch)
    load_config.cache_clear()  # (KubeSpawner loads its client configuration once)
    calls = []

    async def base_stop(self, now=False):  # KubeSpawner's: delete the pod, wait for it
        calls.append(("delete pod", now))

    async def release(self, reason="server stopped"):
        calls.append(("release GPUs", reason))

    async def create(namespace, pod):
        calls.append(("create pod", pod.metadata.name))
        raise ApiException(status=409, reason="Conflict")

    monkeypatch.setattr(KubeSpawner, "stop", base_stop)
    monkeypatch.setattr(KubeGPUSpawner, "release_gpus_async", release)
    config = Config()
    config.KubeGPUSpawner.storage_pvc_ensure = False
    spawner = KubeGPUSpawner(config=config, _mock=True)
    spawner.api = SimpleNamespace(create_namespaced_pod=create)
    pod = SimpleNamespace(metadata=SimpleNamespace(name="jupyter-ann"), to_str=lambda: "pod")

    assert await spawner._make_create_pod_request(pod, 3) is False  # KubeSpawner: try again
    assert calls == [("create pod", "jupyter-ann"), ("delete pod", True)], calls

    calls.clear()
    await spawner.stop()  # the server's own stop: its GPUs go back
    assert calls == [("delete pod", False), ("release GPUs", "server stopped")], calls
    load_config.cache_clear()


def pod_named(name, annotations=None, deleting=None):
    return SimpleNamespace(metadata=SimpleNamespace(
        name=name, annotations=annotations, deletion_timestamp=deleting), to_str=lambda: "pod")


@pytest.mark.parametrize("in_the_way, kept", [
    ("own", True),            # this start's create, answered late: taken as made
    ("own-deleting", False),  # this start's, being deleted: KubeSpawner waits for it to go
    ("earlier", False),       # an earlier start's: deleted, as KubeSpawner does
    ("gone", None),           # gone before it was read: the create is tried again
])
async def test_a_starts_own_pod_in_the_way_is_kept_not_deleted(tmp_path, monkeypatch,
                                                                in_the_way, kept):
    offline_kubeconfig(tmp_path, monkeypatch)
    load_config.cache_clear()
    calls = []
    stored = {}

    async def base_stop(self, now=False):
        calls.append(("delete pod", now))

    async def release(self, reason="server stopped"):
        calls.append(("release GPUs", reason))

    async def create(namespace, pod):
        calls.append(("create pod", pod.metadata.name))
        if not stored:  # the first try is made on the server, its answer lost (a timeout)
            mark = pod.metadata.annotations[START_ANNOTATION]
            stored["pod"] = pod_named(
                pod.metadata.name,
                {START_ANNOTATION: "an-earlier-start" if in_the_way == "earlier" else mark},
                "2026-12-07T00:00:00Z" if in_the_way == "own-deleting" else None)
            raise asyncio.TimeoutError
        raise ApiException(status=409, reason="Conflict")

    async def read(name, namespace):
        calls.append(("read pod", name))
        if in_the_way == "gone":
            raise ApiException(status=404, reason="Not Found")
        return stored["pod"]

    monkeypatch.setattr(KubeSpawner, "stop", base_stop)
    monkeypatch.setattr(KubeGPUSpawner, "release_gpus_async", release)
    config = Config()
    config.KubeGPUSpawner.storage_pvc_ensure = False
    spawner = KubeGPUSpawner(config=config, _mock=True)
    spawner.pod_name = "jupyter-ann"
    spawner.api = SimpleNamespace(create_namespaced_pod=create, read_namespaced_pod=read)
    pod = pod_named("jupyter-ann")

    assert await spawner._make_create_pod_request(pod, 3) is False  # timed out: try again
    assert await spawner._make_create_pod_request(pod, 3) is False  # 409
    tries = [("create pod", "jupyter-ann")] * 2 + [("read pod", "jupyter-ann")]
    if kept is False:
        assert calls == tries + [("delete pod", True)], calls  # no GPUs released
        return
    assert calls == tries, calls  # nothing deleted, nothing released
    calls.clear()
    made = await spawner._make_create_pod_request(pod, 3)
    if kept:
        assert made is True and calls == [], calls  # the third try takes the pod as made
    else:
        assert made is False and calls == [("create pod", "jupyter-ann"),
                                           ("read pod", "jupyter-ann")], calls
    load_config.cache_clear()


async def test_each_start_marks_its_pod_anew(tmp_path, monkeypatch):
    """A start's mark is its own: the same for each try of one start (the same pod object),
    fresh for the next start, over any value the manifest had (an operator's
    extra_annotations), so a mark kept from an earlier start never takes a pod as made."""
    offline_kubeconfig(tmp_path, monkeypatch)
    load_config.cache_clear()
    config = Config()
    config.KubeGPUSpawner.storage_pvc_ensure = False
    spawner = KubeGPUSpawner(config=config, _mock=True)
    first = pod_named("jupyter-ann", {START_ANNOTATION: "an-operators", "keep": "me"})
    mark = spawner._mark_start(first)
    assert mark not in (None, "an-operators") and spawner._mark_start(first) == mark
    assert first.metadata.annotations == {START_ANNOTATION: mark, "keep": "me"}
    spawner._own_pod = mark  # that start's pod was taken as made
    second = pod_named("jupyter-ann", {START_ANNOTATION: "an-operators"})
    again = spawner._mark_start(second)
    assert again not in (mark, "an-operators") and spawner._own_pod is None
    load_config.cache_clear()
