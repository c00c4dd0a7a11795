"""Shared watches over Kueue's custom resources (kubespawner's reflector), and the hub's one
watch over Kueue's Workloads for the progress of waiting notebook servers.

`CustomReflector` is kubespawner's shared watch (``MultiNamespaceResourceReflector``: one list,
then one watch, over all namespaces) for a custom resource; the gpulab service's job backend
watches JobSets and Workloads with it (`gpulab.hub.jobs.kueue`).

`WorkloadWatch` is the hub's: while a GPU server waits gated in its person's Kueue queue, its
progress stream (the spawn-pending page) says why it waits and where it stands, from its
Workload. Each stream used to list its namespace's Workloads and ask Kueue's visibility API
every 2 seconds: 60 requests a minute for each waiting server whose page is open
(bench/scale_kube.py). Now the hub keeps one watch over all Workloads, started by the first
stream that needs it and stopped `IDLE_SECONDS` after the last one ended, so a hub where
nobody waits makes no request for it, and one where many wait makes the watch's (a list when
it starts, then one every ``restart_seconds`` or so as kubespawner's watches do) whatever
their number. A stream reads the watch's cache, and asks the visibility API for its place
again only when its namespace's Workloads changed or `PLACE_SECONDS` passed: the person's
LocalQueue holds their own work alone, so their place moves when that does.
"""

from __future__ import annotations

import asyncio
import logging
import time
from types import SimpleNamespace

from kubespawner import KubeSpawner
from kubespawner.reflector import MultiNamespaceResourceReflector

WORKLOAD = ("kueue.x-k8s.io", "v1beta2", "workloads")
#: seconds the hub's Workload watch runs on after the last waiting server's stream ended
IDLE_SECONDS = 60.0
#: seconds after which a stream asks Kueue's visibility API for its place again even though
#: its namespace's Workloads did not change
PLACE_SECONDS = 30.0
#: the watch's key among kubespawner's shared reflectors (``KubeSpawner.reflectors``), so
#: that ``KubeSpawner._stop_all_reflectors`` stops it with the others
REFLECTOR_KEY = ("gpulab-kueue-workloads", "*")

log = logging.getLogger("gpulab.cluster.kueuewatch")


class CustomReflector(MultiNamespaceResourceReflector):
    """kubespawner's shared watch over a custom resource (``resource``: group, version,
    plural) in all namespaces."""

    api_group_name = "CustomObjectsApi"
    list_method_name = "list_objects"
    resource: tuple[str, str, str] = ("", "", "")

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        custom, (group, version, plural) = self.api, self.resource

        async def list_objects(**kw):
            return await custom.list_cluster_custom_object(group, version, plural, **kw)

        self.api = SimpleNamespace(list_objects=list_objects)


class WorkloadReflector(CustomReflector):
    kind = "workloads"
    resource = WORKLOAD


class WorkloadWatch:
    """The hub's shared watch over Kueue's Workloads (see the module): `acquire` it while a
    stream needs it, `release` it after; `in_namespace` and `version` read its cache."""

    _instance: WorkloadWatch | None = None

    def __init__(self, idle_seconds: float = IDLE_SECONDS):
        self.idle_seconds = idle_seconds
        self.users = 0
        self._stopper: asyncio.TimerHandle | None = None
        self._starting: asyncio.Future | None = None
        self._index_of: object = None  # the reflector's resources dict the index was made of
        self._index_at = -1.0
        self._by_ns: dict[str, list[dict]] = {}

    @classmethod
    def shared(cls) -> WorkloadWatch:
        if cls._instance is None:
            cls._instance = cls()
        return cls._instance

    @property
    def reflector(self) -> WorkloadReflector | None:
        r = KubeSpawner.reflectors.get(REFLECTOR_KEY)
        if r is None or r.watch_task is None or r.watch_task.done():
            return None  # never started, stopped, or given up (its failures are logged)
        return r

    async def acquire(self, parent) -> bool:
        """Count one more user and start the watch if it does not run (its first list
        loaded before this returns); False, with the reason logged, where it cannot start
        (the hub may not list Workloads in all namespaces: each stream then reads its own)."""
        self.users += 1
        if self._stopper is not None:
            self._stopper.cancel()
            self._stopper = None
        if self.reflector is not None:
            return True
        if self._starting is None or self._starting.done():
            self._starting = asyncio.ensure_future(self._start(parent))
        try:
            return await asyncio.shield(self._starting)
        except asyncio.CancelledError:
            self.release()
            raise

    async def _start(self, parent) -> bool:
        old = KubeSpawner.reflectors.pop(REFLECTOR_KEY, None)
        if old is not None:
            await old.stop()
        reflector = WorkloadReflector(parent=parent, on_failure=None)
        try:
            await reflector.start()
        except Exception as e:  # noqa: BLE001 - logged; the streams read their own
            log.warning("Cannot watch Kueue's Workloads in all namespaces (%s): each waiting "
                        "server's progress reads its namespace's instead",
                        getattr(e, "status", None) or type(e).__name__)
            await reflector.stop()
            return False
        KubeSpawner.reflectors[REFLECTOR_KEY] = reflector
        return True

    def release(self) -> None:
        """One user less; the watch stops `idle_seconds` after the last."""
        self.users = max(0, self.users - 1)
        if self.users == 0 and self._stopper is None:
            self._stopper = asyncio.get_running_loop().call_later(
                self.idle_seconds, lambda: asyncio.ensure_future(self._stop_if_idle()))

    async def _stop_if_idle(self) -> None:
        self._stopper = None
        if self.users:
            return
        reflector = KubeSpawner.reflectors.pop(REFLECTOR_KEY, None)
        if reflector is not None:
            await reflector.stop()
            log.info("Stopped watching Kueue's Workloads: no server waits in a queue")

    def in_namespace(self, namespace: str) -> list[dict] | None:
        """The Workloads of ``namespace`` in the watch's cache (None: no watch runs). The
        cache is indexed by namespace at most once a second, for every stream together."""
        r = self.reflector
        if r is None:
            return None
        now = time.monotonic()
        if self._index_of is not r.resources or now - self._index_at >= 1.0:
            by_ns: dict[str, list[dict]] = {}
            for w in list(r.resources.values()):
                by_ns.setdefault(w["metadata"].get("namespace", ""), []).append(w)
            self._by_ns, self._index_of, self._index_at = by_ns, r.resources, now
        return self._by_ns.get(namespace, [])

    @staticmethod
    def version(workloads: list[dict]) -> tuple:
        """What changes when any of ``workloads`` changes, comes or goes."""
        return tuple(sorted((w["metadata"].get("name"), w["metadata"].get("resourceVersion"))
                            for w in workloads))
