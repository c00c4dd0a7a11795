"""A pod watch that wakes whoever waits for a pod when the watch sees it change.

KubeSpawner waits for a new server's pod to run by reading its shared pod watch (the
``PodReflector``'s store) with JupyterHub's ``exponential_backoff``: the pauses between two
reads grow to 5 s, drawn at random. A pod that Kueue admits a few seconds after its creation
is then seen running up to 5 s after it runs (``bench/scale_kube.py``, 500 spawns under Kueue:
stock KubeSpawner's p99 from the pod's Ready to its start's end 5.0-5.5 s; KubeGPUSpawner's,
waiting so, 1.6-2.0 s, whole-second timestamps included). `WakingPodReflector` is that
reflector with a store that wakes the waiters of a pod (`WakingPodReflector.changed`) when
the watch writes it, and everyone when a full list replaces the store; `KubeGPUSpawner`
waits so for its pod (`gpulab.spawner.kube.KubeGPUSpawner.is_pod_running`).

The store is still a plain ``dict`` to every reader (KubeSpawner's ``pod_reflector.pods``);
writes happen on the hub's event loop, as the reflector's watch runs there.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

from kubespawner.spawner import PodReflector
from traitlets import default, observe, validate


class WakingStore(dict):
    """A reflector's store (``resources``) that calls ``changed(key)`` after each write of a
    key: ``store[key] = pod``, ``pop``, ``del``."""

    __slots__ = ("_changed",)

    def __init__(self, items: dict, changed: Callable[[str], None]):
        super().__init__(items)
        self._changed = changed

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        self._changed(key)

    def __delitem__(self, key: str) -> None:
        super().__delitem__(key)
        self._changed(key)

    def pop(self, key: str, *default: Any) -> Any:
        value = super().pop(key, *default)
        self._changed(key)
        return value


class WakingPodReflector(PodReflector):
    """KubeSpawner's pod reflector whose store wakes the waiters of a pod on each change."""

    def _waiters(self) -> dict[str, set[asyncio.Future]]:
        # made on first use: traitlets sets ``resources`` (and so wakes) before __init__ ends
        waiters = self.__dict__.get("_pod_waiters")
        if waiters is None:
            waiters = self.__dict__["_pod_waiters"] = {}
        return waiters

    def _wake(self, key: str) -> None:
        for future in self._waiters().pop(key, ()):
            if not future.done():
                future.set_result(None)

    @default("resources")
    def _empty_store(self) -> WakingStore:
        return WakingStore({}, self._wake)

    @validate("resources")
    def _waking_store(self, proposal) -> WakingStore:
        value = proposal["value"]
        if isinstance(value, WakingStore):
            return value
        return WakingStore(value, self._wake)

    @observe("resources")
    def _store_replaced(self, change) -> None:
        # a full list (the watch's start or restart): any pod may have changed
        for key in list(self._waiters()):
            self._wake(key)

    async def changed(self, key: str, timeout: float) -> bool:
        """Wait until the watch writes pod ``key`` (``"namespace/name"``), or a full list
        replaces the store, for at most ``timeout`` seconds; False if it timed out."""
        future = asyncio.get_running_loop().create_future()
        waiters = self._waiters().setdefault(key, set())
        waiters.add(future)
        try:
            # (not `wait_for`: on Python 3.11 it drops a cancel that comes after the wake and
            # before this task runs again, and the start would wait on past its stop)
            done, _ = await asyncio.wait({future}, timeout=timeout)
            return bool(done)
        finally:
            future.cancel()
            waiters.discard(future)
            if not waiters and self._waiters().get(key) is waiters:
                del self._waiters()[key]


__all__ = ["WakingPodReflector", "WakingStore"]
