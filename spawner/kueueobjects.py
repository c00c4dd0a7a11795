"""gpulab's quota ledger in Kueue's terms (``kueue.x-k8s.io/v1beta2``), built by pure functions.

`gpulab.spawner.kueuemirror.KueueMirror` applies them (``c.KubeJobBackend.kueue``).

On a cluster gpulab keeps its ledger (notebooks and jobs, GPU-hour budgets, the admin page) and
lets Kueue decide who runs when. The objects below say a person's quota as Kueue objects, to
be kept current from the ledger by server-side apply (as the ResourceQuota mirror of
`gpulab.spawner.namespaces` is):

- `make_gpu_flavor`: one ResourceFlavor per GPU model, selecting nodes by the label
  ``nvidia.com/gpu.product`` (no model: any GPU node); `make_default_flavor` for CPU and memory.
- `make_cohorts`: the root cohort ``gpulab`` and, for a group, a cohort of its own below it.
  A person's ClusterQueues sit in the cohort of the group their quota comes from (the root
  one when it is their own or the default quota): unused quota is lent within the tree, and
  taken back first within the group. A group quota in gpulab is each member's quota (the
  most generous applies, `gpulab.hub.quota.policy.effective_quota`), so the group cohort has
  no quota of its own: its members' nominal quotas add up.
- `make_cluster_queues`: per person, two ClusterQueues, both admitting only workloads of the
  person's own namespace (``namespaceSelector``), so a LocalQueue made in another namespace
  that names them admits nothing:

  - ``<namespace>`` (in-quota work): the person's GPU quota as nominal quota, never
    borrowing; it lends what it does not use and takes it back by preempting borrowers
    (``reclaimWithinCohort: Any``). With ``hold`` (a GPU-hour budget used up) it admits
    nothing new (``stopPolicy: Hold``) while what runs goes on.
  - ``<namespace>.preemptible``: no quota of its own; it only borrows idle quota, so its work
    is what the lenders preempt when they need their GPUs back. Work marked preemptible goes
    here, and only such work borrows.

- `make_local_queues`: the two LocalQueues in the person's namespace, `LOCAL_QUEUE` and
  `PREEMPTIBLE_QUEUE`, the names gpulab's pods and JobSets carry in the label
  ``kueue.x-k8s.io/queue-name``.

CPU and memory are covered too (Kueue admits only workloads whose every requested resource a
ClusterQueue covers), with the operator's per-person amounts.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from .kubeobjects import MANAGED_BY, USER_LABEL
from .profiles import GPU_MODEL_LABEL, GPU_RESOURCE

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
#: what a person's ClusterQueue covers of CPU and memory (Kueue admits only work whose every
#: requested resource a queue covers): enough never to be what limits them, GPUs do
QUEUE_CPU = "1000"
QUEUE_MEMORY = "4Ti"


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


def make_default_flavor() -> dict:
    return {"apiVersion": KUEUE_API, "kind": "ResourceFlavor",
            "metadata": {"name": DEFAULT_FLAVOR, "labels": dict(MANAGED_BY)}, "spec": {}}


def cohort_name(group: str | None) -> str:
    """The root cohort, or ``gpulab-group-<group>`` for a group's members."""
    return ROOT_COHORT if group is None else f"gpulab-group-{_slug(group, 50)}"


def make_cohorts(group: str | None) -> list[dict]:
    """The cohorts a person's queues need: the root, and their group's below it."""
    root = {"apiVersion": KUEUE_API, "kind": "Cohort",
            "metadata": {"name": ROOT_COHORT, "labels": dict(MANAGED_BY)}, "spec": {}}
    if group is None:
        return [root]
    return [root, {"apiVersion": KUEUE_API, "kind": "Cohort",
                   "metadata": {"name": cohort_name(group), "labels": dict(MANAGED_BY)},
                   "spec": {"parentName": ROOT_COHORT}}]


def _count(name: str, value: Any) -> str:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
    return str(value)


def make_cluster_queues(*, namespace: str, user_label: str, max_gpus: int,
                        models: list[str | None], cpu: str, memory: str,
                        group: str | None = None, hold: bool = False) -> list[dict]:
    """``[in-quota, preemptible]``: the person's two ClusterQueues (see the module)."""
    gpus = _count("max_gpus", max_gpus)
    if not models:
        raise ValueError("at least one GPU model (None: any) is needed")

    def queue(name: str, own: bool) -> dict:
        def resource(res: str, amount: str) -> dict:
            # in-quota work never borrows; preemptible work has nothing but what it borrows
            return ({"name": res, "nominalQuota": amount, "borrowingLimit": "0"} if own
                    else {"name": res, "nominalQuota": "0"})
        spec: dict[str, Any] = {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": namespace}},
            "cohortName": cohort_name(group),
            "queueingStrategy": "BestEffortFIFO",
            "resourceGroups": [
                {"coveredResources": [GPU_RESOURCE],
                 "flavors": [{"name": gpu_flavor_name(m),
                              "resources": [resource(GPU_RESOURCE, gpus)]}
                             for m in dict.fromkeys(models)]},
                {"coveredResources": ["cpu", "memory"],
                 "flavors": [{"name": DEFAULT_FLAVOR,
                              "resources": [resource("cpu", cpu), resource("memory", memory)]}]},
            ],
            "preemption": ({"reclaimWithinCohort": "Any", "withinClusterQueue": "LowerPriority"}
                           if own else
                           {"reclaimWithinCohort": "Never", "withinClusterQueue": "Never"}),
        }
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
    """Why Kueue has not admitted the work (Kueue's own words where it gave some)."""
    if workload is None:
        return "the cluster's queue has not taken it in yet"
    evicted = condition(workload, "Evicted")
    if evicted:
        return evicted.get("message") or evicted.get("reason") or "evicted"
    pending = condition(workload, "QuotaReserved", "False")
    if pending and pending.get("message"):
        return pending["message"]
    return "waiting for quota"


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


def ordinal(n: int) -> str:
    """1st, 2nd, 3rd, 4th, ..., 11th, 12th, 13th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"
