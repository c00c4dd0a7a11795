"""gpulab's quota ledger in Kueue's terms (``kueue.x-k8s.io/v1beta2``), built by pure functions.

`gpulab.hub.cluster.kueuemirror.KueueMirror` applies them (``c.KubeJobBackend.kueue``).

On a cluster gpulab keeps its ledger (notebooks and jobs, GPU-hour budgets, the admin page) and
lets Kueue decide who runs when. The objects below say a person's quota as Kueue objects, to
be kept current from the ledger by server-side apply (as the ResourceQuota mirror of
`gpulab.hub.cluster.namespaces` is):

- `make_gpu_flavor`: the ResourceFlavor of GPUs, ``gpulab-gpu`` (any model: gpulab's quota
  counts GPUs of every model together; each pod's own node selector picks its model).
  With the pool split by model (``kueue_gpu_models``), one flavor per model instead
  (``gpulab-gpu-<model>``, selecting the nodes labelled ``nvidia.com/gpu.product=<model>``;
  ``gpulab-gpu`` for GPU nodes that say no model), so that Kueue admits work for a model only
  when that model's GPUs are free and puts it on those nodes; the quota, which no per-model
  limit can say, is then `QUOTA_RESOURCE` (flavor `make_quota_flavor`), the GPUs of every
  model together, which `GPU_QUOTA_TRANSFORMATION` in Kueue's configuration makes every
  ``nvidia.com/gpu`` a pod asks for count as too. `make_default_flavor`: CPU and memory.
- `make_cohorts`: the root cohort ``gpulab``, which holds the pool: the cluster's GPUs
  (counted from its nodes; per model and their sum as `QUOTA_RESOURCE` when split), and, for
  a group, a cohort of its own below it. A person's
  ClusterQueues sit in the cohort of the group their quota comes from (the root one when it
  is their own or the default quota); their preemptible ClusterQueue sits right below the
  root whatever their group.
- `make_cluster_queues`: per person, two ClusterQueues, both admitting only workloads of the
  person's own namespace (``namespaceSelector``), so a LocalQueue made in another namespace
  that names them admits nothing. Neither holds quota of its own: both borrow from the pool,
  so Kueue never admits more GPUs than the cluster has, however the quotas add up.

  - ``<namespace>`` (in-quota work): borrows up to the person's GPU quota
    (``borrowingLimit``; split by model, of `QUOTA_RESOURCE` and of each model's GPUs, so the
    quota still holds per model where Kueue's configuration lacks the transformation). With
    ``hold`` (a GPU-hour budget used up) it admits nothing new (``stopPolicy: Hold``) while what runs goes on. When the pool is full, its work waits
    for GPUs to come back, taking back those lent to preemptible work first; fair sharing
    decides whose waiting work is admitted first.
  - ``<namespace>.preemptible``: borrows without a limit, with fair-sharing weight 0: its
    work is the first whose GPUs are taken back when anyone's in-quota work needs them.
    Work marked preemptible goes here, with the priority class `PREEMPTIBLE_PRIORITY_CLASS`
    (`make_priority_class`): in-quota work preempts only work of a lower priority, so it
    never takes GPUs from another person's in-quota work.

- `make_local_queues`: the two LocalQueues in the person's namespace, `LOCAL_QUEUE` and
  `PREEMPTIBLE_QUEUE`, the names gpulab's pods and JobSets carry in the label
  ``kueue.x-k8s.io/queue-name``.

CPU, memory and ephemeral storage are covered too (Kueue admits only workloads whose every
requested resource a ClusterQueue covers), from the pool's large `POOL_CPU`, `POOL_MEMORY` and
`POOL_EPHEMERAL_STORAGE`.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .kubeobjects import GPU_MODEL_LABEL, GPU_RESOURCE, MANAGED_BY, USER_LABEL

KUEUE_API = "kueue.x-k8s.io/v1beta2"
ROOT_COHORT = "gpulab"
LOCAL_QUEUE = "gpulab"
PREEMPTIBLE_QUEUE = "gpulab-preemptible"
DEFAULT_FLAVOR = "gpulab-default"
#: a namespace name cannot hold a dot, so no person's namespace (ClusterQueue) is another's
#: preemptible ClusterQueue (user "bob-preemptible" would collide with bob's "-preemptible")
PREEMPTIBLE_SUFFIX = ".preemptible"
#: the label that puts a pod or a JobSet in a LocalQueue
QUEUE_NAME_LABEL = "kueue.x-k8s.io/queue-name"
#: the scheduling gate Kueue's pod integration puts on a pod until its Workload is admitted
ADMISSION_GATE = "kueue.x-k8s.io/admission"
#: the WorkloadPriorityClass of preemptible work (label ``kueue.x-k8s.io/priority-class``):
#: below every in-quota workload's priority (0), so in-quota work preempts it and nothing else
PRIORITY_CLASS_LABEL = "kueue.x-k8s.io/priority-class"
PREEMPTIBLE_PRIORITY_CLASS = "gpulab-preemptible"
PREEMPTIBLE_PRIORITY = -1000
#: the CPU and memory of the root cohort's pool (Kueue admits only work whose every requested
#: resource a queue covers): enough never to be what limits anyone, GPUs do
POOL_CPU = "100000"
POOL_MEMORY = "10000Ti"
#: and of ephemeral storage (the hub gives every container of its pods a request of it,
#: `gpulab.hub.cluster.kubeobjects.with_container_defaults`)
POOL_EPHEMERAL_STORAGE = "10000Ti"
#: the GPUs of every model together, as gpulab's quota counts them: Kueue's configuration
#: turns each ``nvidia.com/gpu`` a workload asks for into one of these too
#: (`GPU_QUOTA_TRANSFORMATION`), and a person's ClusterQueue may borrow their quota of it
QUOTA_RESOURCE = "gpulab.io/gpus"
QUOTA_FLAVOR = "gpulab-quota"
#: the entry of Kueue's Configuration (``resources.transformations``) that makes
#: `QUOTA_RESOURCE` count the GPUs workloads ask for (``Retain``: nvidia.com/gpu is still
#: assigned a model's flavor)
GPU_QUOTA_TRANSFORMATION = {"input": GPU_RESOURCE, "strategy": "Retain", "outputs": {QUOTA_RESOURCE: "1"}}


def _slug(text: str, room: int) -> str:
    """A DNS label part for any text: lower-case letters, digits and '-', with a short hash of
    the text where that changed it (two texts never share a slug)."""
    plain = re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")
    if plain == text and len(plain) <= room:
        return plain
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    return f"{plain[:room - 9].rstrip('-')}-{digest}".lstrip("-")


def gpu_flavor_name(model: str | None) -> str:
    """``gpulab-gpu-<model>`` (e.g. ``gpulab-gpu-nvidia-h100``); ``gpulab-gpu`` for any model."""
    return "gpulab-gpu" if not model else f"gpulab-gpu-{_slug(model, 52)}"


def make_gpu_flavor(model: str | None) -> dict:
    spec: dict[str, Any] = {"nodeLabels": {GPU_MODEL_LABEL: model}} if model else {}
    return {"apiVersion": KUEUE_API, "kind": "ResourceFlavor",
            "metadata": {"name": gpu_flavor_name(model), "labels": dict(MANAGED_BY)},
            "spec": spec}


def make_quota_flavor() -> dict:
    """The flavor of `QUOTA_RESOURCE` (no node labels: it places nothing)."""
    return {"apiVersion": KUEUE_API, "kind": "ResourceFlavor",
            "metadata": {"name": QUOTA_FLAVOR, "labels": dict(MANAGED_BY)}, "spec": {}}


def split_by_model(models: Sequence[str | None]) -> bool:
    """Whether a pool of these models is split by model (then queues also cover
    `QUOTA_RESOURCE`, the GPUs of every model together)."""
    return any(m is not None for m in models)


def gpu_models(capacity: Mapping[str | None, int] | int | None) -> list[str | None]:
    """The models of a pool (a count per model, or one count of any model), in the order
    queues list their flavors: named models by name, then GPUs of no known model."""
    if capacity is None or isinstance(capacity, int):
        return [None]
    named = sorted(m for m in capacity if m is not None)
    return [*named, *([None] if None in capacity or not named else [])]


def make_default_flavor() -> dict:
    return {"apiVersion": KUEUE_API, "kind": "ResourceFlavor",
            "metadata": {"name": DEFAULT_FLAVOR, "labels": dict(MANAGED_BY)}, "spec": {}}


def make_priority_class() -> dict:
    """The WorkloadPriorityClass preemptible work carries (see `PREEMPTIBLE_PRIORITY_CLASS`)."""
    return {"apiVersion": KUEUE_API, "kind": "WorkloadPriorityClass",
            "metadata": {"name": PREEMPTIBLE_PRIORITY_CLASS, "labels": dict(MANAGED_BY)},
            "value": PREEMPTIBLE_PRIORITY,
            "description": "gpulab: preemptible work, borrowing idle GPUs until their owners "
                           "need them"}


def cohort_name(group: str | None) -> str:
    """The root cohort, or ``gpulab-group-<group>`` for a group's members."""
    return ROOT_COHORT if group is None else f"gpulab-group-{_slug(group, 50)}"


def make_cohorts(group: str | None, capacity: Mapping[str | None, int] | int | None = None) -> list[dict]:
    """The cohorts a person's queues need: the root, and their group's below it. With
    ``capacity`` (the cluster's GPUs: a count per model, None for GPUs of no known model; or
    one count of any model), the root holds the whole pool: each model's GPUs in its flavor,
    their sum as `QUOTA_RESOURCE`, and `POOL_CPU` CPUs and `POOL_MEMORY` of memory, which
    every person's queues borrow from, each up to their quota."""
    spec: dict[str, Any] = {}
    if capacity is not None:
        counts = {None: capacity} if isinstance(capacity, int) else dict(capacity) or {None: 0}
        total = sum(int(_count("capacity", n)) for n in counts.values())
        models = gpu_models(counts)
        spec["resourceGroups"] = [
            {"coveredResources": [GPU_RESOURCE],
             "flavors": [{"name": gpu_flavor_name(m), "resources": [
                 {"name": GPU_RESOURCE, "nominalQuota": _count("capacity", counts.get(m, 0))}]}
                 for m in models]},
            *([{"coveredResources": [QUOTA_RESOURCE],
                "flavors": [{"name": QUOTA_FLAVOR, "resources": [
                    {"name": QUOTA_RESOURCE, "nominalQuota": str(total)}]}]}] if split_by_model(models) else []),
            {"coveredResources": ["cpu", "memory", "ephemeral-storage"],
             "flavors": [{"name": DEFAULT_FLAVOR, "resources": [
                 {"name": "cpu", "nominalQuota": POOL_CPU},
                 {"name": "memory", "nominalQuota": POOL_MEMORY},
                 {"name": "ephemeral-storage", "nominalQuota": POOL_EPHEMERAL_STORAGE}]}]},
        ]
    root = {"apiVersion": KUEUE_API, "kind": "Cohort",
            "metadata": {"name": ROOT_COHORT, "labels": dict(MANAGED_BY)}, "spec": spec}
    if group is None:
        return [root]
    return [root, {"apiVersion": KUEUE_API, "kind": "Cohort",
                   "metadata": {"name": cohort_name(group), "labels": dict(MANAGED_BY)},
                   "spec": {"parentName": ROOT_COHORT}}]


def _count(name: str, value: Any) -> str:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    return str(value)


def make_cluster_queues(*, namespace: str, user_label: str, max_gpus: int | None,
                        group: str | None = None, hold: bool = False,
                        models: Sequence[str | None] = (None,)) -> list[dict]:
    """``[in-quota, preemptible]``: the person's two ClusterQueues (see the module).
    ``max_gpus`` None: no quota (borrowing up to the whole pool). ``models``: the pool's
    (`gpu_models`), whose flavors the queues list in that order."""
    limit = None if max_gpus is None else _count("max_gpus", max_gpus)

    def borrowing(resource: str, own: bool) -> dict[str, Any]:
        r: dict[str, Any] = {"name": resource, "nominalQuota": "0"}
        if own and limit is not None:
            r["borrowingLimit"] = limit
        return r

    def queue(name: str, own: bool) -> dict:
        spec: dict[str, Any] = {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            # the preemptible queue right below the root, whatever the group: fair sharing
            # compares the subtrees below the two queues' common cohort, and only a queue of
            # its own (weight 0) counts as the first to give back; inside a group's cohort
            # (weight 1) its GPUs would be as hard to take back as the group's in-quota work
            "cohortName": cohort_name(group) if own else ROOT_COHORT,
            "queueingStrategy": "BestEffortFIFO",
            "resourceGroups": [
                {"coveredResources": [GPU_RESOURCE],
                 "flavors": [{"name": gpu_flavor_name(m), "resources": [borrowing(GPU_RESOURCE, own)]}
                             for m in models]},
                *([{"coveredResources": [QUOTA_RESOURCE],
                    "flavors": [{"name": QUOTA_FLAVOR, "resources": [borrowing(QUOTA_RESOURCE, own)]}]}]
                  if split_by_model(models) else []),
                {"coveredResources": ["cpu", "memory", "ephemeral-storage"],
                 "flavors": [{"name": DEFAULT_FLAVOR,
                              "resources": [{"name": "cpu", "nominalQuota": "0"},
                                            {"name": "memory", "nominalQuota": "0"},
                                            {"name": "ephemeral-storage", "nominalQuota": "0"}]}]},
            ],
            # in-quota work takes GPUs back only from work of a lower priority (preemptible
            # work's `PREEMPTIBLE_PRIORITY_CLASS`), never from another person's in-quota work;
            # fair sharing orders who is admitted first, and the preemptible queue's weight 0
            # makes its borrowed GPUs the first taken back
            "preemption": ({"reclaimWithinCohort": "LowerPriority",
                            "withinClusterQueue": "LowerPriority"}
                           if own else
                           {"reclaimWithinCohort": "Never", "withinClusterQueue": "Never"}),
        }
        if not own:
            spec["fairSharing"] = {"weight": "0"}
        if hold:
            spec["stopPolicy"] = "Hold"
        return {"apiVersion": KUEUE_API, "kind": "ClusterQueue",
                "metadata": {"name": name, "labels": {**MANAGED_BY, USER_LABEL: user_label}},
                "spec": spec}

    return [queue(namespace, True), queue(namespace + PREEMPTIBLE_SUFFIX, False)]


def make_local_queues(*, namespace: str, user_label: str) -> list[dict]:
    """``[in-quota, preemptible]``: the LocalQueues of the person's namespace."""
    def local(name: str, cluster_queue: str) -> dict:
        return {"apiVersion": KUEUE_API, "kind": "LocalQueue",
                "metadata": {"name": name, "namespace": namespace,
                             "labels": {**MANAGED_BY, USER_LABEL: user_label}},
                "spec": {"clusterQueue": cluster_queue}}
    return [local(LOCAL_QUEUE, namespace),
            local(PREEMPTIBLE_QUEUE, namespace + PREEMPTIBLE_SUFFIX)]


# -- reading Kueue's Workloads ------------------------------------------------------------


def condition(obj: dict | None, kind: str, status: str = "True") -> dict | None:
    """The condition ``kind`` of ``obj`` if it has that ``status``, else None."""
    for c in (obj or {}).get("status", {}).get("conditions") or []:
        if c.get("type") == kind and c.get("status") == status:
            return c
    return None


def workload_admitted(workload: dict | None) -> bool:
    """Whether Kueue admits the work now (admitted and not being evicted)."""
    return bool(condition(workload, "Admitted")) and not condition(workload, "Evicted")


def workload_wait_reason(workload: dict | None) -> str:
    """Why Kueue has not admitted the work (Kueue's own words where it gave some, with
    gpulab's resource and flavor names said plainly: `kueue_words`)."""
    if workload is None:
        return "the cluster's queue has not taken it in yet"
    evicted = condition(workload, "Evicted")
    if evicted:
        return kueue_words(evicted.get("message") or evicted.get("reason") or "evicted")
    pending = condition(workload, "QuotaReserved", "False")
    if pending and pending.get("message"):
        return kueue_words(pending["message"])
    return "waiting for quota"


_OTHER_MODEL = re.compile(r"(, )?flavor gpulab-gpu\S* doesn't match node affinity")
_MODEL_FLAVOR = re.compile(r"nvidia\.com/gpu in flavor gpulab-gpu-([a-z0-9-]+?)(?:-[0-9a-f]{8})?(?=[,;\s]|$)")


def kueue_words(message: str) -> str:
    """Kueue's message about gpulab's queues with its names said plainly: the quota's
    resource as the person's GPU quota, a model's flavor as that model's GPUs; the flavors of
    the models the work did not ask for are left out."""
    out = _OTHER_MODEL.sub("", message).replace(": , ", ": ")
    out = out.replace(f"{QUOTA_RESOURCE} in flavor {QUOTA_FLAVOR}", "your GPU quota (GPUs of every model)")
    out = _MODEL_FLAVOR.sub(lambda m: f"{m.group(1)} GPUs", out)
    return out.replace(f"{GPU_RESOURCE} in flavor {gpu_flavor_name(None)}", "GPUs")


def pending_position(workloads: list[dict], mine: dict | None) -> int | None:
    """Where ``mine`` stands among the Workloads of its LocalQueue that wait (not admitted,
    not finished), in the order Kueue's BestEffortFIFO takes them (higher priority first,
    then older first): 1 is next; None when it does not wait."""
    def waiting(w: dict) -> bool:
        return not workload_admitted(w) and not condition(w, "Finished")

    if mine is None or not waiting(mine):
        return None
    queue = mine.get("spec", {}).get("queueName")
    line = sorted((w for w in workloads if waiting(w)
                   and w.get("spec", {}).get("queueName") == queue),
                  key=lambda w: (-(w.get("spec", {}).get("priority") or 0),
                                 w["metadata"].get("creationTimestamp") or "",
                                 w["metadata"].get("name") or ""))
    uid = mine["metadata"].get("uid")
    return next((i for i, w in enumerate(line, 1) if w["metadata"].get("uid") == uid), None)


#: Kueue's visibility API (an aggregated API of Kueue's controller): the pending workloads of a
#: LocalQueue, each with its position, as Kueue's scheduler orders them
VISIBILITY_API = "visibility.kueue.x-k8s.io/v1beta2"


def pending_workloads_path(namespace: str, local_queue: str) -> str:
    return f"/apis/{VISIBILITY_API}/namespaces/{namespace}/localqueues/{local_queue}/pendingworkloads"


def visibility_place(pending: list[dict], workload_name: str) -> int | None:
    """Where ``workload_name`` stands in its LocalQueue by the visibility API's answer
    (``positionInLocalQueue``, from 0): 1 is next; None when it is not pending there."""
    for w in pending:
        if w.get("metadata", {}).get("name") == workload_name:
            position = w.get("positionInLocalQueue")
            return position + 1 if isinstance(position, int) and position >= 0 else None
    return None


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
