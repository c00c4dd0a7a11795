"""A pod create that KubeSpawner meets with 409 (the pod is there already: most often its own
create that timed out on the hub's side under load, then was made) is answered by KubeSpawner
with ``stop(True)`` and a new create, and the start goes on: KubeGPUSpawner then keeps the
GPUs admitted for that start (on 3db6b70 its `stop` released them, and the new pod ran on
GPUs the ledger had given back). A stop of the server itself still releases them.

KubeSpawner's own `_make_create_pod_request` runs, against an API that answers 409 (a mock
instance: no API server); KubeSpawner's `stop` (delete the pod, wait for it to go) is
recorded instead of run, and so is the release of the GPUs."""

from __future__ import annotations

from types import SimpleNamespace

from kubernetes_asyncio.client.exceptions import ApiException
from kubespawner import KubeSpawner
from kubespawner.clients import load_config
from traitlets.config import Config

from gpulab.spawner.kube import KubeGPUSpawner
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
