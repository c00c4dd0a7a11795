"""Each person's Kueue objects, kept equal to their gpulab quota (``c.KubeJobBackend.kueue``).

One `KueueMirror` per process and event loop (the gpulab service's, whose job backend
registers a person's namespace the first time it prepares it). When a namespace is
registered its objects are applied at once (the person's first job finds its queue); then
every ``interval`` seconds the mirror reads the ledger (in one worker thread: quotas, the GPUs
notebooks hold, the budgets used) and applies, by server-side apply, only the objects of the
people whose figures changed (no API request otherwise, but one list of gpulab's
ClusterQueues before such a change and every ``capacity_seconds``: a person whose queue is
gone, because their account was deleted (`KueueMirror.remove`, from
``KubeGPUSpawner.delete_forever``), is forgotten rather than given their queues again, until
their next server or job). The objects are `gpulab.hub.cluster.kueueobjects`'s:

- the ResourceFlavors of GPUs (any model; with ``by_model``, one per model, by the nodes'
  ``nvidia.com/gpu.product``, and the quota's), of CPU and memory, and preemptible work's
  WorkloadPriorityClass, and the root cohort holding the pool: the operator's ``pool``
  (``kueue_gpus``: a count of any model), else the GPUs of the cluster's Ready, schedulable
  nodes (their allocatable ``nvidia.com/gpu``, per model with ``by_model``, listed at most
  every ``capacity_seconds``), applied again when that changes (everyone's queues too when
  the models change);
- per person, the cohort of the group their quota comes from, their two ClusterQueues and two
  LocalQueues (the hub's mirror, ``preemptible=False``, the in-quota ones only: notebook
  servers never wait in the preemptible queue, which the service's mirror makes with the
  person's first job).

What a person's in-quota ClusterQueue admits is what it may borrow from the pool: their gpulab
quota's ``max_gpus`` (no quota: the whole pool). Their GPU notebook pods and their jobs both
wait in it, so both count against one quota, and as no queue owns quota, Kueue never admits
more GPUs than the cluster has however the quotas add up. Both processes that need the
objects keep a mirror (the hub's spawner before a GPU server's pod, the service's job backend
before a job): they apply the same objects from the same ledger and nodes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

from kubernetes_asyncio.client.rest import ApiException

from gpulab.hub.quota.ledger import Ledger
from gpulab.hub.quota.policy import Quota

from .kubeobjects import GPU_MODEL_LABEL, GPU_RESOURCE, MANAGED_BY
from .kueueobjects import (
    QUOTA_FLAVOR,
    gpu_models,
    make_cluster_queues,
    make_cohorts,
    make_default_flavor,
    make_gpu_flavor,
    make_local_queues,
    make_priority_class,
    make_quota_flavor,
    split_by_model,
)
from .namespaces import APPLY, FIELD_MANAGER, LedgerMirror, QuotaIndex, api_message

KUEUE = ("kueue.x-k8s.io", "v1beta2")
_PLURALS = {"ResourceFlavor": "resourceflavors", "WorkloadPriorityClass": "workloadpriorityclasses",
            "Cohort": "cohorts",
            "ClusterQueue": "clusterqueues", "LocalQueue": "localqueues"}


def node_gpus(node: dict) -> int:
    """The GPUs a node gives the pool: its allocatable ``nvidia.com/gpu``, none while it is
    cordoned (unschedulable) or not Ready."""
    if node.get("spec", {}).get("unschedulable"):
        return 0
    ready = [c for c in node.get("status", {}).get("conditions") or [] if c.get("type") == "Ready"]
    if not ready or ready[0].get("status") != "True":
        return 0
    try:
        return max(0, int(node.get("status", {}).get("allocatable", {}).get(GPU_RESOURCE, 0)))
    except (TypeError, ValueError):
        return 0


def pool_of(nodes: list[dict]) -> dict[str | None, int]:
    """The GPUs ``nodes`` give the pool, per model (their ``nvidia.com/gpu.product`` label;
    None for GPU nodes without one)."""
    pool: dict[str | None, int] = {}
    for node in nodes:
        gpus = node_gpus(node)
        if gpus:
            model = (node.get("metadata", {}).get("labels") or {}).get(GPU_MODEL_LABEL) or None
            pool[model] = pool.get(model, 0) + gpus
    return pool


@dataclass(frozen=True)
class Wanted:
    """What a person's Kueue objects should say."""

    max_gpus: int | None  # None: no quota
    group: str | None
    hold: bool


def wanted(quota: Quota | None, source: str, *, budget_used: float) -> Wanted:
    """A person's `Wanted` from their effective quota (and where it comes from: ``user``,
    ``group 'x'``, ``default``, ``none``) and the GPU-hours used in the budget's window."""
    top = None if quota is None else quota.max_gpus
    group = source[len("group '"):-1] if source.startswith("group '") else None
    hold = bool(quota is not None and quota.gpu_hours is not None
                and budget_used >= quota.gpu_hours)
    return Wanted(top, group, hold)


class KueueMirror(LedgerMirror):
    """See the module."""

    what = "Kueue quota"
    _instances: dict[Any, KueueMirror] = {}

    def __init__(self, ledger: Ledger, custom, core, *, interval: float, log: logging.Logger,
                 request_timeout: float = 30.0, capacity_seconds: float = 30.0,
                 pool: int | None = None, by_model: bool = False, preemptible: bool = True):
        self.ledger, self.custom, self.core, self.interval, self.log = (
            ledger, custom, core, interval, log)
        #: whether the person's preemptible ClusterQueue and LocalQueue are made too (the job
        #: backend's mirror); the hub's makes the in-quota pair only, as notebook servers
        #: wait in it alone (bench/scale_kube.py: two requests less at a first spawn)
        self.preemptible = preemptible
        self.pool = pool  # the operator's fixed pool; None: the nodes' GPUs
        self.by_model = by_model  # the nodes' GPUs per model (``kueue_gpu_models``)
        self.request_timeout, self.capacity_seconds = request_timeout, capacity_seconds
        self.capacity: dict[str | None, int] | None = None  # the pool as last applied, per model
        self._flavors: set[str | None] = set()  # the GPU models whose flavors were applied
        self._capacity_read = -math.inf
        self._gone_checked = -math.inf  # when gpulab's ClusterQueues were last listed
        self.users: dict[str, tuple[str, tuple[str, ...], str]] = {}  # ns -> user, groups, label
        self.applied: dict[str, Wanted] = {}
        self._shared_done = False
        self._task: asyncio.Task | None = None
        self.requests = 0

    @classmethod
    def for_loop(cls, ledger: Ledger, custom, core, **kwargs) -> KueueMirror:
        # one per loop and kind (the hub's and the service's are two processes; a test may
        # run both in one loop)
        key = (asyncio.get_running_loop(), kwargs.get("preemptible", True))
        mirror = cls._instances.get(key)
        if (mirror is None or mirror.ledger is not ledger or mirror.pool != kwargs.get("pool")
                or mirror.by_model != kwargs.get("by_model", False)):
            if mirror is not None and mirror._task is not None:
                mirror._task.cancel()
            mirror = cls._instances[key] = cls(ledger, custom, core, **kwargs)
        return mirror

    async def sync_capacity(self, force: bool = False) -> None:
        """The pool (the root cohort): the operator's ``pool``, else the cluster's schedulable
        GPUs (per model with ``by_model``), read at most every ``capacity_seconds`` (one node
        list); applied when it changed (the first time with the flavors and the priority
        class; a new model's flavor before the cohort names it)."""
        if self.pool is not None:
            capacity: dict[str | None, int] = {None: self.pool}
        elif not force and time.monotonic() - self._capacity_read < self.capacity_seconds:
            return
        else:
            resp = await self.core.list_node(_preload_content=False,
                                             _request_timeout=self.request_timeout)
            self.requests += 1
            nodes = json.loads(await resp.read())["items"]
            self._capacity_read = time.monotonic()
            capacity = pool_of(nodes) if self.by_model else {None: sum(node_gpus(n) for n in nodes)}
        if capacity == self.capacity:
            return
        models = gpu_models(capacity)
        objects = [] if self._shared_done else [make_default_flavor(), make_priority_class()]
        if split_by_model(models) and QUOTA_FLAVOR not in self._flavors:
            objects.append(make_quota_flavor())
        objects += [make_gpu_flavor(m) for m in models if m not in self._flavors]
        for obj in objects + make_cohorts(None, capacity):  # flavors before the cohort
            await self._apply_object(obj)
        self._shared_done = True
        self._flavors.update(models)
        if split_by_model(models):
            self._flavors.add(QUOTA_FLAVOR)
        if self.capacity is not None and models != gpu_models(self.capacity):
            self.applied.clear()  # every person's queues list the models' flavors again
        self.log.info("Kueue's GPU pool (cohort gpulab): %s", ", ".join(
            f"{n} {m} GPUs" if m else f"{n} GPUs" for m, n in capacity.items()) or "no GPUs")
        self.capacity = capacity

    async def register(self, namespace: str, user: str, groups: tuple[str, ...],
                       label: str, namespace_ready=None) -> None:
        """Mirror ``namespace``'s person from now on; their objects are applied before this
        returns (raises the API's error if they cannot be). ``namespace_ready``: awaited
        before the objects in the namespace (its LocalQueues) are sent, so that the rest
        (the ledger's read, the ClusterQueues) can go while the namespace is being made."""
        self.users[namespace] = (user, groups, label)
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._run())
        want = (await asyncio.to_thread(self._wanted, [namespace]))[namespace]
        if self.applied.get(namespace) != want:
            await self.apply(namespace, want, namespace_ready)

    # -- reading the ledger (in a worker thread) -------------------------------------------

    def _wanted(self, namespaces: list[str]) -> dict[str, Wanted]:
        """What the objects of ``namespaces``' people should say, from the ledger. One
        person (a registration, at a spawn): their own quota and usage only. More (a pass):
        everyone's quotas in one query and the GPU-hours of everyone with a budget in one
        query per budget window, never one query per person (bench/scale_kube.py: a pass
        over 1,000 people with budgets made 1,001 queries)."""
        now = time.time()
        if len(namespaces) == 1:
            ns = namespaces[0]
            user, groups, _ = self.users[ns]
            quota, source = self.ledger.effective(user, groups)
            used = 0.0
            if quota is not None and quota.gpu_hours is not None:
                since = now - (quota.window_hours or 0) * 3600
                used = self.ledger.usage(since, now, user=user).get(user, 0.0)
            return {ns: wanted(quota, source, budget_used=used)}
        index = QuotaIndex(self.ledger.quotas())
        found = {}
        for ns in namespaces:
            user, groups, _ = self.users[ns]
            found[ns] = (user, *index.effective(user, groups))
        usage: dict[float, dict[str, float]] = {}  # window (hours) -> user -> GPU-hours
        for user, quota, _ in found.values():
            if quota is not None and quota.gpu_hours is not None:
                window = quota.window_hours or 0
                if window not in usage:
                    usage[window] = self.ledger.usage(now - window * 3600, now)
        out = {}
        for ns, (user, quota, source) in found.items():
            used = 0.0
            if quota is not None and quota.gpu_hours is not None:
                used = usage[quota.window_hours or 0].get(user, 0.0)
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

    async def apply(self, namespace: str, want: Wanted, namespace_ready=None) -> None:
        """Apply the person's objects (and, the first time, the shared ones); those in the
        namespace after ``namespace_ready()`` (when given) returns."""
        user, _, label = self.users[namespace]
        await self.sync_capacity(force=self.capacity is None)
        objects: list[dict] = make_cohorts(want.group)[1:]  # the group's, below the root
        kinds = 2 if self.preemptible else 1  # [in-quota, preemptible]
        objects += make_cluster_queues(namespace=namespace, user_label=label,
                                       max_gpus=want.max_gpus, group=want.group,
                                       hold=want.hold, models=gpu_models(self.capacity))[:kinds]
        if namespace not in self.applied:
            objects += make_local_queues(namespace=namespace, user_label=label)[:kinds]
        cohorts = [o for o in objects if o["kind"] == "Cohort"]
        for obj in cohorts:  # in order: the cohorts before the queues naming them
            await self._apply_object(obj)
        # the queues together (Kueue reads a LocalQueue whose ClusterQueue is not there
        # yet as inactive until it is, and nothing is queued in them before this returns):
        # one round trip's wait instead of four (bench/scale_kube.py)
        async def in_namespace(obj: dict) -> None:
            if namespace_ready is not None:
                await namespace_ready()
            await self._apply_object(obj)

        tasks = [asyncio.ensure_future(in_namespace(o) if "namespace" in o["metadata"]
                                       else self._apply_object(o))
                 for o in objects if o not in cohorts]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:  # (one waiting for a namespace that is not coming, too)
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise
        self.applied[namespace] = want
        self.log.info("Kueue quota of %s (namespace %s): %s GPUs%s%s", user, namespace,
                      "any" if want.max_gpus is None else want.max_gpus,
                      f", in group {want.group}'s cohort" if want.group else "",
                      ", held (GPU-hour budget used up)" if want.hold else "")

    async def sync(self) -> int:
        """The pool, then the objects of the people whose figures changed (the people whose
        ClusterQueue is gone forgotten first: `forget_gone`); returns how many people's."""
        try:
            await self.sync_capacity()
        except ApiException as e:
            self.log.warning("Could not update Kueue's GPU pool: %s %s", e.status, api_message(e))
        wants = await asyncio.to_thread(self._wanted, list(self.users))
        # before anyone's queues are applied again (they would be made again if they were
        # deleted), and every capacity_seconds (a returning person is then applied anew)
        again = any(ns in self.applied and self.applied[ns] != w for ns, w in wants.items())
        if again or time.monotonic() - self._gone_checked >= self.capacity_seconds:
            try:
                await self.forget_gone()
            except ApiException as e:
                self.log.warning("Could not list gpulab's ClusterQueues (the hub's RBAC needs "
                                 "list on clusterqueues): %s %s", e.status, api_message(e))
        return await self._apply_changed({ns: w for ns, w in wants.items() if ns in self.users})

    # -- people who left ---------------------------------------------------------------------

    def forget(self, namespace: str) -> None:
        """Mirror ``namespace``'s person no more (until they are registered again)."""
        self.users.pop(namespace, None)
        self.applied.pop(namespace, None)

    async def forget_gone(self) -> list[str]:
        """Forget the people whose in-quota ClusterQueue is gone or being deleted (their
        account was deleted: `remove`, in whichever process did it; or an admin deleted it),
        so that no later pass makes it again; their next server or job (`register`) does.
        One list of gpulab's ClusterQueues, read from etcd (not the watch cache, which may not
        hold a queue just applied yet), when anyone is mirrored; returns whom it forgot."""
        self._gone_checked = time.monotonic()
        if not self.applied:
            return []
        known = list(self.applied)  # applied before the list: each is in its answer if it exists
        resp = await self.custom.list_cluster_custom_object(
            *KUEUE, "clusterqueues", label_selector=_selector(MANAGED_BY),
            _preload_content=False, _request_timeout=self.request_timeout)
        self.requests += 1
        there = {q["metadata"]["name"] for q in json.loads(await resp.read())["items"]
                 if not q["metadata"].get("deletionTimestamp")}
        gone = [ns for ns in known if ns not in there and ns in self.applied]
        for ns in gone:
            user = self.users.get(ns, ("?",))[0]
            self.forget(ns)
            self.log.info("Kueue quota of %s (namespace %s): their ClusterQueue is gone (their "
                          "account was deleted, or an admin deleted it); no longer mirrored, "
                          "until their next server or job", user, ns)
        return gone

    async def remove(self, namespace: str) -> int:
        """The person has left (their hub account is being deleted): delete their two
        ClusterQueues and two LocalQueues and forget them. Kueue keeps a ClusterQueue until
        the work it admitted ends and admits nothing more from it; their namespace, its
        storage and their jobs' records stay. Returns how many objects were deleted (a
        missing one is not an error)."""
        self.forget(namespace)
        deleted = 0
        for obj in (make_cluster_queues(namespace=namespace, user_label="-", max_gpus=0)
                    + make_local_queues(namespace=namespace, user_label="-")):
            meta = obj["metadata"]
            plural = _PLURALS[obj["kind"]]
            self.requests += 1
            try:
                if "namespace" in meta:
                    await self.custom.delete_namespaced_custom_object(
                        *KUEUE, meta["namespace"], plural, meta["name"],
                        _request_timeout=self.request_timeout)
                else:
                    await self.custom.delete_cluster_custom_object(
                        *KUEUE, plural, meta["name"], _request_timeout=self.request_timeout)
                deleted += 1
            except ApiException as e:
                if e.status != 404:
                    raise
        self.log.info("Kueue quota of namespace %s removed (%d objects): its person left",
                      namespace, deleted)
        return deleted


def _selector(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())
