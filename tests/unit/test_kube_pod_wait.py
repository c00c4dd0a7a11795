"""A start waits for its pod through the pod watch, not through JupyterHub's growing backoff.

KubeSpawner's start reads its shared pod watch with ``exponential_backoff``, whose pauses
grow at random up to 5 s: a pod that runs a few seconds after its creation (Kueue admitting
it) was seen running up to 5 s late (bench/scale_kube.py). KubeGPUSpawner's
``is_pod_running`` gives that backoff, in the start's own wait, an awaitable that answers when
the watch writes the pod running (`WakingPodReflector`). JupyterHub's own
``exponential_backoff`` runs here, with KubeSpawner's test of the pod; the watch's writes
are made by hand (no API server: the reflector's store is written as its watch writes it)."""

from __future__ import annotations

import asyncio
import inspect
import warnings

from types import SimpleNamespace

import pytest

from jupyterhub.utils import exponential_backoff
from kubespawner import KubeSpawner
from kubespawner.clients import load_config
from traitlets.config import Config

from gpulab.hub.cluster.podwatch import WakingPodReflector, WakingStore
from gpulab.spawner import kube
from gpulab.spawner.kube import KubeGPUSpawner
from tests.doubles import offline_kubeconfig


def pod(phase: str) -> dict:
    running = phase == "Running"
    return {"metadata": {"name": "jupyter-ann", "namespace": "gpulab-ann", "uid": "u1"},
            "status": {"phase": phase, "podIP": "10.0.0.7" if running else None,
                       "containerStatuses": [{"ready": running}]}}


@pytest.fixture
async def spawner(tmp_path, monkeypatch):
    offline_kubeconfig(tmp_path, monkeypatch)
    load_config()
    monkeypatch.setattr(KubeSpawner, "reflectors", {})
    config = Config()
    config.KubeGPUSpawner.storage_pvc_ensure = False
    config.KubeGPUSpawner.start_timeout = 60
    s = KubeGPUSpawner(config=config, _mock=True)
    s.namespace, s.pod_name = "gpulab-ann", "jupyter-ann"
    yield s
    load_config.cache_clear()


def watch_of(s, reflector) -> None:
    KubeSpawner.reflectors[s._get_reflector_key("pods")] = reflector


async def start_wait(s, looks: list):
    """KubeSpawner's wait for the running pod (its `_start`'s last backoff), run as the
    start's own task; ``looks`` gets each answer its test gave."""
    key = f"{s.namespace}/{s.pod_name}"

    async def wait():
        def look():
            answer = s.is_pod_running(s.pod_reflector.pods.get(key, None))
            looks.append(answer)
            return answer
        await exponential_backoff(look, f"pod {key} did not start in {s.start_timeout} seconds!",
                                  timeout=s.start_timeout)
        return key

    s._start_future = asyncio.ensure_future(wait())
    return s._start_future


async def test_the_store_wakes_the_waiters_of_a_pod_at_each_write(spawner):
    reflector = WakingPodReflector(parent=spawner, namespace="gpulab-ann")
    assert isinstance(reflector.resources, WakingStore) and reflector.pods == {}
    key = "gpulab-ann/jupyter-ann"
    assert await reflector.changed(key, 0.05) is False  # nothing written: it times out

    woken = asyncio.ensure_future(reflector.changed(key, 30))
    other = asyncio.ensure_future(reflector.changed("gpulab-bob/jupyter-bob", 30))
    await asyncio.sleep(0)
    reflector.resources["gpulab-bob/x"] = pod("Pending")  # another key wakes nobody here
    await asyncio.sleep(0)
    assert not woken.done()
    reflector.resources[key] = pod("Pending")  # as the watch writes it
    assert await woken is True and not other.done()

    woken = asyncio.ensure_future(reflector.changed(key, 30))
    await asyncio.sleep(0)
    reflector.resources.pop(key, None)  # the watch's DELETED
    assert await woken is True

    woken = asyncio.ensure_future(reflector.changed(key, 30))
    await asyncio.sleep(0)
    reflector.resources = {key: pod("Running")}  # a full list (the watch restarted)
    assert await woken is True and await other is True
    assert isinstance(reflector.resources, WakingStore)  # still waking
    assert reflector._waiters() == {}  # nobody left behind


async def test_a_start_sees_its_pod_run_at_the_watchs_write_not_after_a_backoff(spawner):
    reflector = WakingPodReflector(parent=spawner, namespace="gpulab-ann")
    watch_of(spawner, reflector)
    key = "gpulab-ann/jupyter-ann"
    reflector.resources[key] = pod("Pending")  # made, gated: Kueue has not admitted it
    looks: list = []
    started = await start_wait(spawner, looks)

    # meanwhile anyone else (JupyterHub's poll) gets KubeSpawner's bool, not an awaitable
    await asyncio.sleep(0.3)
    assert spawner.is_pod_running(reflector.pods[key]) is False
    reflector.resources[key] = pod("Pending")  # admitted and placed: still not running
    await asyncio.sleep(1.5)  # past the backoff's first pauses (0.2, 0.4, 0.8 s at most)
    assert not started.done()
    reflector.resources[key] = pod("Running")
    assert await asyncio.wait_for(started, 5) == key
    # one look in all: the backoff never slept; its one test answered when the watch wrote
    # the pod running (KubeSpawner's bool would have made it look again and again, each
    # time after a longer random pause)
    assert len(looks) == 1 and inspect.isawaitable(looks[0]) and not looks[0]
    assert spawner.is_pod_running(reflector.pods[key]) is True


async def test_the_wait_gives_up_at_start_timeout_with_kubespawners_error(spawner):
    spawner.start_timeout = 1
    reflector = WakingPodReflector(parent=spawner, namespace="gpulab-ann")
    watch_of(spawner, reflector)
    reflector.resources["gpulab-ann/jupyter-ann"] = pod("Pending")
    looks: list = []
    started = await start_wait(spawner, looks)
    with pytest.raises(asyncio.TimeoutError, match="did not start in 1 seconds"):
        await asyncio.wait_for(started, 10)


async def test_a_watch_that_wakes_nobody_is_read_again_and_again(spawner, monkeypatch):
    # a pod watch a stock KubeSpawner of the same process started (a plain store)
    monkeypatch.setattr(kube, "POD_LOOK_SECONDS", 0.05)
    key = "gpulab-ann/jupyter-ann"
    watch_of(spawner, SimpleNamespace(pods={key: pod("Pending")}))
    looks: list = []
    started = await start_wait(spawner, looks)
    await asyncio.sleep(0.3)
    assert not started.done()
    spawner.pod_reflector.pods[key] = pod("Running")
    assert await asyncio.wait_for(started, 5) == key and len(looks) == 1


async def test_kubegpuspawner_watches_pods_with_the_waking_store(spawner, monkeypatch):
    # KubeSpawner's own `_start_watching_pods` (its labels, its namespaces), our reflector
    made = []

    async def start(self):
        made.append(self)
        self.first_load_future.set_result(None)

    monkeypatch.setattr(WakingPodReflector, "start", start)
    reflector = await spawner._start_watching_pods()
    assert isinstance(reflector, WakingPodReflector) and made == [reflector]
    assert reflector.labels == {"component": spawner.component_label}
    assert spawner.pod_reflector is reflector
    assert await spawner._start_watching_pods() is reflector and len(made) == 1  # kept

    # a stock KubeSpawner's watch of the same process (a plain store) is replaced: same
    # selection, and its spawners read the new one (KubeSpawner's reflectors are shared)
    stopped = []

    class Plain:
        async def stop(self):
            stopped.append(self)

    old = Plain()
    watch_of(spawner, old)
    reflector = await spawner._start_watching_pods()
    assert isinstance(reflector, WakingPodReflector) and made[-1] is reflector
    assert stopped == [old] and KubeSpawner.reflectors[spawner._get_reflector_key("pods")] is reflector


async def test_inside_the_start_a_bool_test_reads_not_running_and_leaves_nothing_unawaited(spawner):
    # an operator's hook (modify_pod_hook, after_pod_created_hook) runs in the start's task:
    # a pod that does not run yet is not running to it, as to KubeSpawner
    reflector = WakingPodReflector(parent=spawner, namespace="gpulab-ann")
    watch_of(spawner, reflector)
    key = "gpulab-ann/jupyter-ann"
    reflector.resources[key] = pod("Pending")
    answers = []

    async def hook():
        answers.append(bool(spawner.is_pod_running(reflector.pods[key])))

    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "coroutine ... was never awaited"
        spawner._start_future = asyncio.ensure_future(hook())
        await spawner._start_future
        import gc
        gc.collect()
    assert answers == [False]


async def test_a_start_cancelled_as_its_pod_runs_ends_cancelled(spawner):
    # JupyterHub cancels a start it stopped waiting for; the wake and the cancel in the same
    # pass of the loop must not leave the start waiting on (Python 3.11's wait_for drops such
    # a cancel)
    reflector = WakingPodReflector(parent=spawner, namespace="gpulab-ann")
    watch_of(spawner, reflector)
    key = "gpulab-ann/jupyter-ann"
    reflector.resources[key] = pod("Pending")
    looks: list = []
    started = await start_wait(spawner, looks)
    await asyncio.sleep(0.2)
    reflector.resources[key] = pod("Pending")  # wakes the wait: the pod still does not run
    started.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(started, 5)
    assert reflector._waiters() == {}
