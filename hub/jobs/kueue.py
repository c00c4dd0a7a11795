"""`KueueJobBackend`: training jobs as JobSets that Kueue queues and admits whole.

On for ``c.KubeJobBackend.kueue = True`` (the cluster runs Kueue and JobSet, the deploy guide's
"Queueing with Kueue"); otherwise `gpulab.hub.jobs.kube.KubeJobBackend` keeps making Indexed
Jobs and checking capacity itself. Both share the workflow (`gpulab.hub.jobs.base`), the
settings of ``c.KubeJobBackend``, the namespaces, the pods' words and the logs.

Submit
    The name rule and the replica bound as always; a job asking more GPUs than the person's
    quota is refused at once (it could never be admitted; preemptible work may borrow, so it
    is not). The job is recorded Queued, without an allocation, and created as one JobSet
    (`gpulab.hub.jobs.kubeobjects.make_training_jobset`), suspended, labelled with the
    person's LocalQueue (``gpulab``, or ``gpulab-preemptible`` for ``preemptible`` jobs),
    then its NetworkPolicy (a cluster's two) and (for ``source``) its code ConfigMap, all owned
    by the JobSet. API requests per submit: 2 (+1 with ``source``, +1 for a cluster, +4 for a
    namespace this process has not prepared yet). A cluster (``kind: cluster``) is admitted
    whole the same way; a failed one whose ps was lost says so in words.

Kueue decides; the ledger follows
    Shared watches over the JobSets (gpulab's label), their pods and Kueue's Workloads; a
    pass over the caches every ``reconcile_interval`` seconds, no API request unless
    something must be done. While a job's Workload is not admitted the job stays Queued with
    Kueue's reason in words. When Kueue admits it, the ledger records the job's GPUs
    (`gpulab.hub.quota.ledger.Ledger.adopt`: usage, GPU-hours and the admin page count them
    as any allocation) and the job is Admitted, then Starting and Running from its pods.
    When Kueue evicts it (preemption of borrowed GPUs, ``waitForPodsReady``), the job is
    Queued again and its allocation closed. JobSet's own conditions end it: Completed is
    Succeeded, Failed is Failed with JobSet's words; every ending closes the allocation.
    Stop deletes the JobSet (garbage collection removes the rest; Kueue forgets its Workload).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

from kubernetes_asyncio.client.rest import ApiException
from kubespawner.clients import load_config, shared_client
from traitlets import Unicode

from gpulab.hub.jobs.base import JobError
from gpulab.hub.jobs.kube import (JOB_LABELS, KubeJobBackend, PodReflector, cluster_failure_words,
                                  k8s_time, pod_restarts, pod_words)
from gpulab.hub.jobs.kubeobjects import (
    JOBSET_API,
    jobset_replica_host,
    make_source_configmap,
    make_training_jobset,
    mount_source,
)
from gpulab.hub.jobs.spec import JobSpec
from gpulab.hub.quota.ledger import AdmissionRefused, Allocation, Request
from gpulab.hub.quota.policy import never_fits
from gpulab.hub.cluster.kueuemirror import KueueMirror
from gpulab.hub.cluster.kueuewatch import CustomReflector, WorkloadReflector
from gpulab.hub.cluster.kueueobjects import (
    LOCAL_QUEUE,
    PREEMPTIBLE_PRIORITY_CLASS,
    PREEMPTIBLE_QUEUE,
    condition,
    ordinal,
    pending_position,
    workload_admitted,
    workload_wait_reason,
)

log = logging.getLogger("gpulab.jobs.kueue")

JOBSET = ("jobset.x-k8s.io", "v1alpha2", "jobsets")
#: seconds after which a job whose JobSet the watch never saw is marked lost
LOST_AFTER = 30.0
#: Kueue's label on a Workload: the uid of the object (JobSet, pod) it is for
JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"
#: the JobSet's annotation with its owner's groups (JSON list)
GROUPS_ANNOTATION = "gpulab.io/groups"


class _JobSetReflector(CustomReflector):
    kind = "jobsets"
    resource = JOBSET


def waiting_words(workload: dict | None, place: int | None = None) -> str:
    """Why a job waits, from its Workload (and ``place``, where it stands in its queue,
    `pending_position`), in words."""
    why = workload_wait_reason(workload)
    if workload is None:
        return f"waiting for GPUs: {why}"
    if condition(workload, "Evicted"):
        return f"waiting for GPUs again: {why}"
    where = ("" if place is None else " (next in line)" if place == 1
             else f" ({ordinal(place)} in line)")
    if why == "waiting for quota":
        return f"waiting for GPUs in the cluster's queue{where}"
    return f"waiting for GPUs in the cluster's queue{where}: {why}"


def _when(value: str | None) -> float | None:
    """A Kubernetes timestamp in seconds (None where there is none or it cannot be read)."""
    try:
        return k8s_time(value)
    except ValueError:
        return None


def jobset_ended(jobset: dict) -> tuple[str, str] | None:
    """(Succeeded or Failed, words) once JobSet says the job is over; else None."""
    if condition(jobset, "Completed"):
        return "Succeeded", "completed"
    failed = condition(jobset, "Failed")
    if failed:
        return "Failed", failed.get("message") or failed.get("reason") or "failed"
    return None


def jobset_ended_at(jobset: dict) -> str | None:
    """The time of JobSet's Completed or Failed condition (None: none, or no time)."""
    done = condition(jobset, "Completed") or condition(jobset, "Failed") or {}
    return done.get("lastTransitionTime")


class KueueJobBackend(KubeJobBackend):
    """Training jobs as JobSets in the person's Kueue LocalQueue; the ledger follows Kueue's
    admissions (see the module's words)."""

    launches_queued = True
    replica_host = staticmethod(jobset_replica_host)

    local_queue = Unicode(LOCAL_QUEUE, help=f"""
        The LocalQueue in each person's namespace that their jobs go to (default
        ``{LOCAL_QUEUE}``, as the Kueue mirror makes it).""").tag(config=True)
    preemptible_queue = Unicode(PREEMPTIBLE_QUEUE, help=f"""
        The LocalQueue of jobs marked ``preemptible`` (default ``{PREEMPTIBLE_QUEUE}``): they
        may borrow idle GPUs and are preempted when their lenders need them.""").tag(config=True)

    def __init__(self, ledger, **kwargs):
        super().__init__(ledger, **kwargs)
        self._jobsets_r: _JobSetReflector | None = None
        self._workloads_r: WorkloadReflector | None = None
        self._wl_by_uid: dict[tuple[str, str], dict] = {}
        self._wl_by_ns: dict[str, list[dict]] = {}

    @property
    def custom(self):
        load_config()
        return shared_client("CustomObjectsApi")

    async def start_watches(self) -> None:
        async with self._started:
            if self._jobsets_r is None:
                load_config()
                watches = [_JobSetReflector(labels=JOB_LABELS, parent=self),
                           PodReflector(labels=JOB_LABELS, parent=self),
                           WorkloadReflector(parent=self)]
                for r in watches:
                    await r.start()
                self._jobsets_r, self._pods_r, self._workloads_r = watches

    async def _start_supervising(self) -> None:
        """The watches, then, for every active job, its NetworkPolicy and code where they
        are missing and its person's quota mirror (a restarted service: a held queue lifts
        when the budget allows, without a new submit)."""
        await super()._start_supervising()
        mirror = self.mirror()
        for job, _ in await asyncio.to_thread(self.store.active):
            ns = self.namespace_of(job.user)
            jobset = self._jobsets_r.resources.get(f"{ns}/{job.name}")
            if jobset is None:
                continue
            # a service that stopped between the JobSet and its companions: the replicas
            # would never reach each other (nor find their code) without them
            try:
                made = await self._create_companions(
                    job.user, JobSpec.model_validate_json(job.spec), ns,
                    jobset["metadata"]["uid"], exist_ok=True)
                if made:
                    log.warning("Job %s/%s: made its NetworkPolicy or code again (%d), missing "
                                "since the service stopped", job.user, job.name, made)
            except Exception as e:  # the job's pass says what its replicas do meanwhile
                log.warning("Job %s/%s: could not check its NetworkPolicy and code: %s",
                            job.user, job.name, e)
            if ns in mirror.users:
                continue
            try:
                groups = tuple(json.loads(jobset["metadata"].get("annotations", {})
                                          .get(GROUPS_ANNOTATION, "[]")))
                await mirror.register(ns, job.user, groups, self.user_label(job.user))
            except Exception as e:  # the next sync or submit tries again
                log.warning("Kueue quota of %s not mirrored yet: %s", job.user, e)

    async def _stop_supervising(self) -> None:
        for r in (self._jobsets_r, self._pods_r, self._workloads_r):
            if r is not None:
                await r.stop()
        self._jobsets_r = self._pods_r = self._workloads_r = None

    # -- the person's queues ----------------------------------------------------------------

    def mirror(self) -> KueueMirror:
        """This event loop's `KueueMirror` (the person's Kueue objects from the ledger)."""
        return KueueMirror.for_loop(
            self.ledger, self.custom, self.core, interval=self.gpu_quota_sync_interval,
            log=log, request_timeout=self.request_timeout,
            capacity_seconds=self.node_cache_seconds, pool=self.kueue_gpus,
            by_model=self.kueue_gpu_models)

    async def _ensure_namespace(self, user: str, groups: tuple[str, ...]) -> str:
        """The namespace (no GPU ResourceQuota), then the person's Kueue objects, applied
        before their first job (raises what the API said if they cannot be)."""
        ns = await super()._ensure_namespace(user, groups)
        mirror = self.mirror()
        if ns not in mirror.applied or mirror.users[ns][1] != tuple(groups):
            await mirror.register(ns, user, tuple(groups), self.user_label(user))
            self.api_requests += mirror.requests
            mirror.requests = 0
        return ns

    # -- submit ----------------------------------------------------------------------------

    async def _prepare(self, user: str, groups: tuple[str, ...], spec: JobSpec) -> None:
        """No capacity check: Kueue admits what fits. A ``priority`` is refused before
        anything is made: in Kueue one number both orders a queue and decides whose admitted
        work may be preempted, across people (every queue borrows from one pool), so a
        person's priority 100 would take GPUs from other people's work of priority 0; their
        jobs wait in submit order instead."""
        self._container_defaults()  # a bad setting: refused before any request
        if spec.priority:
            raise JobError(
                "priority: this cluster's queue (Kueue) cannot order your own jobs by priority "
                "without letting them take GPUs from other people's; your jobs wait in the "
                "order you submit them. Submit without a priority (or with 0).", 400,
                field="priority")

    def _admission(self, req: Request, spec: JobSpec) -> Allocation | None:
        """Queued, always (Kueue admits it); refused at once only when it could never fit the
        person's quota (`never_fits`: Kueue would never admit it; preemptible work may
        borrow)."""
        if not req.gpus:
            return None
        quota, source = self.ledger.effective(req.user, req.groups)
        never = never_fits(quota, req.gpus, borrows=spec.preemptible,
                           can_borrow=not spec.preemptible)
        if never is not None:
            raise AdmissionRefused(never.message(source))
        return None

    async def _create_objects(self, user, groups, spec: JobSpec, ns, user_dir, job_dir) -> None:
        where = self._placement(user, spec, ns, user_dir, job_dir)
        await self._ensure_namespace(user, groups)
        # a job without GPUs is not queued (the ledger never held such work back), nor held
        # by a used-up GPU-hour budget: its JobSet runs at once
        queue = (None if not spec.total_gpus
                 else self.preemptible_queue if spec.preemptible else self.local_queue)
        # preemptible work has a priority below in-quota work's: what in-quota work may preempt
        jobset = make_training_jobset(
            spec, where, queue_name=queue,
            priority_class=PREEMPTIBLE_PRIORITY_CLASS if queue and spec.preemptible else None)
        # the person's groups (their quota may be a group's): a restarted service mirrors
        # the quota of the people whose jobs it finds without waiting for their next submit
        jobset["metadata"].setdefault("annotations", {})[GROUPS_ANNOTATION] = json.dumps(
            sorted(groups))
        if spec.source is not None:
            for rj in jobset["spec"]["replicatedJobs"]:
                mount_source(rj["template"]["spec"]["template"]["spec"], job=spec.name)
        self.api_requests += 1
        created = await self.custom.create_namespaced_custom_object(
            *JOBSET[:2], ns, JOBSET[2], jobset, _request_timeout=self.request_timeout)
        # Kueue may admit the JobSet before these exist: its replicas then wait for the
        # ConfigMap (ContainerCreating) and cannot reach each other until the policy exists
        # (the namespace's own policy refuses all ingress), never open to others
        await self._create_companions(user, spec, ns, created["metadata"]["uid"])

    async def _create_companions(self, user: str, spec: JobSpec, ns: str, uid: str, *,
                                 exist_ok: bool = False) -> int:
        """The job's NetworkPolicy and (for a ``source`` spec) code ConfigMap, owned by its
        JobSet (``uid``); with ``exist_ok`` those that exist already are left as they are.
        Returns how many were created."""
        parent = (JOBSET_API, "JobSet")
        creating = [self.networking.create_namespaced_network_policy(
            ns, policy, _request_timeout=self.request_timeout)
            for policy in self.network_policies(user, spec, ns, uid, parent)]
        if spec.source is not None:
            creating.append(self.core.create_namespaced_config_map(
                ns, make_source_configmap(spec=spec, namespace=ns,
                                          user_label=self.user_label(user), parent_uid=uid,
                                          parent=parent),
                _request_timeout=self.request_timeout))
        self.api_requests += len(creating)
        made = 0
        for r in await asyncio.gather(*creating, return_exceptions=True):
            if isinstance(r, ApiException) and r.status == 409 and exist_ok:
                continue
            if isinstance(r, BaseException):
                raise r
            made += 1
        return made

    async def _delete_parent(self, ns: str, name: str) -> None:
        """Delete the JobSet: garbage collection removes its Jobs, pods, Service, policy and
        code; Kueue forgets its Workload."""
        try:
            self.api_requests += 1
            await self.custom.delete_namespaced_custom_object(
                *JOBSET[:2], ns, JOBSET[2], name, propagation_policy="Background",
                _request_timeout=self.request_timeout)
        except ApiException as e:
            if e.status != 404:
                raise

    # -- following Kueue and JobSet ----------------------------------------------------------

    def _index_workloads(self) -> None:
        """Once per pass: the Workloads by (namespace, the uid of the object they are for:
        Kueue's label ``kueue.x-k8s.io/job-uid``), and by namespace."""
        by_uid: dict[tuple[str, str], dict] = {}
        by_ns: dict[str, list[dict]] = {}
        for w in (self._workloads_r.resources.values() if self._workloads_r else ()):
            meta = w["metadata"]
            ns = meta.get("namespace", "")
            by_ns.setdefault(ns, []).append(w)
            uids = {(meta.get("labels") or {}).get(JOB_UID_LABEL)}
            uids |= {o.get("uid") for o in meta.get("ownerReferences") or []}
            for uid in uids - {None}:
                by_uid[(ns, uid)] = w
        self._wl_by_uid, self._wl_by_ns = by_uid, by_ns

    def _workload_of(self, jobset: dict) -> dict | None:
        meta = jobset["metadata"]
        return self._wl_by_uid.get((meta["namespace"], meta.get("uid")))

    async def reconcile(self) -> None:
        if self._jobsets_r is None:
            return
        self._index_workloads()
        for job_id in await asyncio.to_thread(self._active_to_supervise):
            await self._reconcile_job(job_id)

    async def _reconcile_job(self, job_id: str) -> None:
        job, _ = await asyncio.to_thread(self.store.read, job_id)
        if job is None:
            return
        spec = JobSpec.model_validate_json(job.spec)
        ns = self.namespace_of(job.user)
        jobset = self._jobsets_r.resources.get(f"{ns}/{job.name}")
        now = time.time()
        if jobset is None:
            if now - job.created_at > LOST_AFTER:  # the watch has long seen what submit made
                await asyncio.to_thread(self._finish, job_id, "Failed",
                                        "lost: its JobSet is gone")
            return
        workload = self._workload_of(jobset)
        states = self._replica_states(spec, ns, job.name)
        ended = jobset_ended(jobset)
        if ended is not None:
            state, words = ended
            if state == "Failed":
                failed = [f"{r}-{i}: {v[1]}" for (r, i), v in sorted(states.items())
                          if v[0] == "Failed"]
                words = f"{words}" + (f" ({'; '.join(failed[:3])})" if failed else "")
                if spec.is_cluster:
                    words = cluster_failure_words(states, words)
            # the GPUs were free when JobSet said so, not when this pass saw it (the
            # service may have been down meanwhile)
            at = await asyncio.to_thread(self._seen_late, job, jobset_ended_at(jobset), now)
            await asyncio.to_thread(self._record_states, job_id, states, (state, words), [], now, at,
                                    histories=self._replica_restarts(spec, ns, job.name))
            return
        if workload is not None and workload.get("spec", {}).get("active") is False:
            # an admin deactivated it, or Kueue did (requeued too often): it will not run
            why = workload_wait_reason(workload)
            await self._delete_parent(ns, job.name)
            await asyncio.to_thread(self._finish, job_id, "Failed",
                                    f"taken out of the cluster's queue: {why}")
            return
        if spec.total_gpus and not workload_admitted(workload):
            if job.state != "Queued":  # evicted: preempted, or its pods never got ready
                why = waiting_words(workload)
                log.info("Job %s/%s evicted by Kueue: %s", job.user, job.name, why)
                evicted = condition(workload, "Evicted") or {}
                at = await asyncio.to_thread(self._seen_late, job, evicted.get("lastTransitionTime"), now)
                await asyncio.to_thread(self.store.requeue, job_id, why, at)
            elif job.reason != (why := self._waiting_words(ns, workload)):
                await asyncio.to_thread(self.store.note_queued, job_id, why)
            return
        if job.state == "Queued":
            admitted = condition(workload, "Admitted") or {}
            allocation = await asyncio.to_thread(self.ledger.adopt, Request(
                user=job.user, kind="job", holder=job.name, gpus=spec.total_gpus,
                model=self.gpu_model), _when(admitted.get("lastTransitionTime")))
            if not await asyncio.to_thread(self.store.admit_queued, job_id, allocation,
                                           self._replica_rows(spec, allocation)):
                await asyncio.to_thread(self.ledger.release, allocation.id,
                                        "job no longer waits")
                return
            log.info("Job %s/%s admitted by Kueue (%d GPUs)", job.user, job.name, spec.total_gpus)
        await asyncio.to_thread(self._record_states, job_id, states, None, [], now,
                                histories=self._replica_restarts(spec, ns, job.name))

    def _seen_late(self, job, stamp: str | None, now: float) -> float:
        """When something Kubernetes stamped happened to ``job`` (a condition's
        ``lastTransitionTime``), for closing its allocation then: never later than ``now``,
        never before the allocation opened; ``now`` where there is no readable time."""
        at = _when(stamp)
        if at is None:
            return now
        at = min(at, now)
        allocation = self.ledger.get(job.allocation_id) if job.allocation_id else None
        return max(at, allocation.started_at) if allocation is not None else at

    def _waiting_words(self, ns: str, workload: dict | None) -> str:
        want = KueueMirror._instances.get((asyncio.get_running_loop(), True))
        held = want is not None and want.applied.get(ns) is not None and want.applied[ns].hold
        if held:
            return ("waiting: your GPU-hour budget is used up; it starts when the budget's "
                    "window moves on or an admin raises it (jobs that run go on)")
        return waiting_words(workload, pending_position(self._wl_by_ns.get(ns, []), workload))

    def _replica_states(self, spec: JobSpec, ns: str, name: str) -> dict:
        pods = self._replica_pods(ns, name)
        states = {}
        for role, index in spec.replica_names():
            mine = pods.get((role, index), [])
            restarts = sum(1 for p in mine if p.get("status", {}).get("phase") == "Failed")
            if not mine:
                states[(role, index)] = ("Pending", "waiting for its pod", None, restarts)
                continue
            st, why, code = pod_words(mine[-1], gpus=spec.gpus_of(role), model=self.gpu_model)
            states[(role, index)] = (st, why, code, restarts)
        return states

    def _replica_restarts(self, spec: JobSpec, ns: str, name: str) -> dict:
        """The restarts each replica's pods show (`gpulab.hub.jobs.kube.pod_restarts`)."""
        pods = self._replica_pods(ns, name)
        return {(role, index): pod_restarts(pods.get((role, index), []),
                                            gpus=spec.gpus_of(role), model=self.gpu_model)
                for role, index in spec.replica_names()}



def backend_from_settings(ledger, raw: str | None) -> KubeJobBackend:
    """The Kubernetes job backend of the JSON of `gpulab.hub.jobs.kube.backend_settings`:
    `KueueJobBackend` where they say ``kueue``, else `KubeJobBackend`."""
    cls = KueueJobBackend if json.loads(raw or "{}").get("kueue") else KubeJobBackend
    return cls.from_settings(ledger, raw)
