"""Each person's Kueue objects, kept equal to their gpulab quota (``c.KubeJobBackend.kueue``).

One `KueueMirror` per process and event loop (the gpulab service's, whose job backend
registers a person's namespace the first time it prepares it). When a namespace is
registered its objects are applied at once (the person's first job finds its queue); then
every ``interval`` seconds the mirror reads the ledger (in one worker thread: quotas, the GPUs
notebooks hold, the budgets used) and applies, by server-side apply, only the objects of the
people whose figures changed (no API request otherwise). The objects are
`gpulab.spawner.kueueobjects`'s:

- the ResourceFlavors of the GPU model and of CPU and memory, and the root cohort (once per
  process);
- per person, the cohort of the group their quota comes from, their two ClusterQueues and two
  LocalQueues.

What a person's in-quota ClusterQueue admits (its nominal GPU quota, of any GPU model: one
flavor, ``gpulab-gpu``, as gpulab's quota counts GPUs of every model together; each pod's own
node selector picks the model) is their gpulab quota's ``max_gpus``: their GPU notebook pods
and their jobs both wait in it, so both count against one quota. No quota at all is
`UNLIMITED`. Both processes that need the objects keep a mirror (the hub's spawner before a
GPU server's pod, the service's job backend before a job): they apply the same objects from
the same ledger.
A GPU-hour budget used up holds the ClusterQueue (``stopPolicy: Hold``): what runs goes on,
nothing new is admitted, and the job's reason says why; the hold lifts when the budget's
window moves on or the admin raises it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio.client.rest import ApiException

from gpulab.hub.quota.ledger import Ledger
from gpulab.hub.quota.policy import Quota

from .kueueobjects import (
    make_cluster_queues,
    make_cohorts,
    make_default_flavor,
    make_gpu_flavor,
    make_local_queues,
)
from .namespaces import APPLY, FIELD_MANAGER, api_message, effective_quota_of

#: the nominal GPU quota of a person without any quota (only the hardware limits them)
UNLIMITED = 10_000
KUEUE = ("kueue.x-k8s.io", "v1beta2")
_PLURALS = {"ResourceFlavor": "resourceflavors", "Cohort": "cohorts",
            "ClusterQueue": "clusterqueues", "LocalQueue": "localqueues"}


@dataclass(frozen=True)
class Wanted:
    """What a person's Kueue objects should say."""

    max_gpus: int
    group: str | None
    hold: bool


def wanted(quota: Quota | None, source: str, *, budget_used: float) -> Wanted:
    """A person's `Wanted` from their effective quota (and where it comes from: ``user``,
    ``group 'x'``, ``default``, ``none``) and the GPU-hours used in the budget's window."""
    top = UNLIMITED if quota is None else quota.max_gpus
    group = source[len("group '"):-1] if source.startswith("group '") else None
    hold = bool(quota is not None and quota.gpu_hours is not None
                and budget_used >= quota.gpu_hours)
    return Wanted(top, group, hold)


class KueueMirror:
    """See the module."""

    _instances: dict[Any, KueueMirror] = {}

    def __init__(self, ledger: Ledger, custom, *, interval: float, models: list[str | None],
                 cpu: str, memory: str, log: logging.Logger, request_timeout: float = 30.0):
        self.ledger, self.custom, self.interval, self.log = ledger, custom, interval, log
        self.models, self.cpu, self.memory = models, cpu, memory
        self.request_timeout = request_timeout
        self.users: dict[str, tuple[str, tuple[str, ...], str]] = {}  # ns -> user, groups, label
        self.applied: dict[str, Wanted] = {}
        self._shared_done = False
        self._task: asyncio.Task | None = None
        self.requests = 0

    @classmethod
    def for_loop(cls, ledger: Ledger, custom, **kwargs) -> KueueMirror:
        loop = asyncio.get_running_loop()
        mirror = cls._instances.get(loop)
        if mirror is None or mirror.ledger is not ledger:
            if mirror is not None and mirror._task is not None:
                mirror._task.cancel()
            mirror = cls._instances[loop] = cls(ledger, custom, **kwargs)
        return mirror

    async def register(self, namespace: str, user: str, groups: tuple[str, ...],
                       label: str) -> None:
        """Mirror ``namespace``'s person from now on; their objects are applied before this
        returns (raises the API's error if they cannot be)."""
        self.users[namespace] = (user, groups, label)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        want = (await asyncio.to_thread(self._wanted, [namespace]))[namespace]
        if self.applied.get(namespace) != want:
            await self.apply(namespace, want)

    # -- reading the ledger (in a worker thread) -------------------------------------------

    def _wanted(self, namespaces: list[str]) -> dict[str, Wanted]:
        rows = self.ledger.quotas()
        out = {}
        now = time.time()
        for ns in namespaces:
            user, groups, _ = self.users[ns]
            quota, source = effective_quota_of(rows, user, groups)
            used = 0.0
            if quota is not None and quota.gpu_hours is not None:
                since = now - (quota.window_hours or 0) * 3600
                used = self.ledger.usage(since, now, user=user).get(user, 0.0)
            out[ns] = wanted(quota, source, budget_used=used)
        return out

    # -- writing Kueue's objects -------------------------------------------------------------

    async def _apply_object(self, obj: dict) -> None:
        kind, meta = obj["kind"], obj["metadata"]
        common = dict(field_manager=FIELD_MANAGER, force=True, _content_type=APPLY,
                      _request_timeout=self.request_timeout)
        self.requests += 1
        if "namespace" in meta:
            await self.custom.patch_namespaced_custom_object(
                *KUEUE, meta["namespace"], _PLURALS[kind], meta["name"], obj, **common)
        else:
            await self.custom.patch_cluster_custom_object(
                *KUEUE, _PLURALS[kind], meta["name"], obj, **common)

    async def apply(self, namespace: str, want: Wanted) -> None:
        """Apply the person's objects (and, the first time, the shared ones)."""
        user, _, label = self.users[namespace]
        objects: list[dict] = []
        if not self._shared_done:
            objects += [make_gpu_flavor(m) for m in dict.fromkeys(self.models)]
            objects.append(make_default_flavor())
        objects += make_cohorts(want.group)[0 if not self._shared_done else 1:]
        objects += make_cluster_queues(namespace=namespace, user_label=label,
                                       max_gpus=want.max_gpus, models=self.models,
                                       cpu=self.cpu, memory=self.memory, group=want.group,
                                       hold=want.hold)
        if namespace not in self.applied:
            objects += make_local_queues(namespace=namespace, user_label=label)
        for obj in objects:  # in order: flavors and cohorts before the queues naming them
            await self._apply_object(obj)
        self._shared_done = True
        self.applied[namespace] = want
        self.log.info("Kueue quota of %s (namespace %s): %d GPUs%s%s", user, namespace,
                      want.max_gpus, f", in group {want.group}'s cohort" if want.group else "",
                      ", held (GPU-hour budget used up)" if want.hold else "")

    async def sync(self) -> int:
        """Apply the objects of the people whose figures changed; returns how many."""
        wants = await asyncio.to_thread(self._wanted, list(self.users))
        n = 0
        for ns, want in wants.items():
            if self.applied.get(ns) == want:
                continue
            try:
                await self.apply(ns, want)
                n += 1
            except ApiException as e:
                self.log.warning("Could not update the Kueue quota of namespace %s: %s %s",
                                 ns, e.status, api_message(e))
        return n

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval)
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception:  # a ledger or API hiccup must not end the mirror
                self.log.exception("Kueue quota mirror: sync failed")
