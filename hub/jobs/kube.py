"""`KubeJobBackend`: the Kubernetes driver of the job workflow; training jobs as pods made by
Kubernetes' own Job controller.

The workflow (`gpulab.hub.jobs.base.JobBackend`: ``submit``, ``list``, ``get``, ``read_log``,
``stop``, ``recover``, ``ensure_supervisor``, ``shutdown``) is the local driver's; so are the
views and states (Admitted, Starting, Running, Succeeded, Failed, Stopped, with reasons in
words). The outcome of a pass is `gpulab.hub.jobs.rules.decide_kube`'s.

Submit
    The spec is checked (`gpulab.hub.jobs.spec`) before this backend sees it. The backend
    checks that the schedulable nodes of the GPU model can hold every replica at once (node
    allocatable, first fit), admits the job's GPUs whole through the ledger (the same quota as
    notebooks), makes sure the user's namespace and its GPU ResourceQuota exist (as
    `gpulab.spawner.kube.KubeGPUSpawner` does, with the namespace's NetworkPolicies; once per
    namespace per process), then creates the objects of
    `gpulab.hub.jobs.kubeobjects.make_training_job_objects`: the parent headless Service, the
    job's NetworkPolicy (its replicas reach each other and nothing else reaches them), a
    ConfigMap with the code when the spec gave ``source``, and one Indexed Job per role, each
    owned by the Service. API requests per submit: roles + 2 (+1 with ``source``, +1 for a
    cluster, +4 for a namespace this process has not prepared yet).

Clusters
    A spec of ``kind: cluster`` (parameter servers and workers held for the person's notebook
    kernel, issue 38) is made the same way, without a chief or code
    (`gpulab.hub.jobs.kubeobjects`: ``GPULAB_KIND=cluster``, restartable workers, a ps that
    is lost fails it, `cluster_failure_words` saying what to do). Its view adds
    ``cluster``: the servers' addresses (`KubeJobBackend.cluster_addresses`), and its
    NetworkPolicies (`KubeJobBackend.network_policies`) open its TF port to the namespace's
    notebook pods, the owner's, and to nobody else.

Watching
    One shared watch over the Jobs and one over the Pods labelled as gpulab training jobs in
    all namespaces (kubespawner's reflectors); a reconciler reads those caches every
    ``reconcile_interval`` seconds and calls the API only to act. Nothing polls per job.
    Nodes (for the capacity check) are listed at most every ``node_cache_seconds``.

Lifecycle
    A failed replica is replaced by the Job controller while ``backoffLimit`` (the spec's
    ``retries``) lasts, except what the pod failure policy (`pod_failure_policy
    <gpulab.hub.jobs.kubeobjects.pod_failure_policy>`) fails at once: a bad configuration,
    a parameter-server chief's own error. Unlike the local backend, a failed multi-worker
    replica is replaced alone; its peers, having lost it, exit with the runtime's lost-cluster
    code and are replaced in turn (resuming from the last checkpoint).
    ``activeDeadlineSeconds`` is ``max_runtime``. A parameter-server job
    succeeds when its chief's Job completes; a multi-worker job when its worker Job completes.
    Its other role Jobs are then deleted (their pods by garbage collection), the finished Job
    and its pods stay for their logs until the job's parent is deleted. A role Job that fails
    fails the job and the others are deleted. Replicas that stay unschedulable longer than
    ``unschedulable_timeout`` (or whose pods the cluster never makes: a namespace quota or a
    policy refusing them) remove the whole job (its parent) with the reason in words. Stop
    deletes the parent. Every ending releases the job's GPUs in the ledger.

Logs
    ``read_log`` reads the replica's newest pod's log through the pod log API (what the
    container wrote to stdout and stderr). A job's progress (its lead replica's last
    ``GPULAB_PROGRESS`` line) is read from there only when someone looks at that one job
    (``detail``, ``GET jobs/<name>``), at most once per ``progress_cache_seconds``; lists and
    the reconciler never read logs, so watching costs the same however many jobs run.

After a restart of the service, `recover` closes the allocations of jobs that no longer run;
the reconciler picks the running jobs up from the watches (a job whose objects are gone is
marked Failed, lost).
"""

from __future__ import annotations

import asyncio
import calendar
import json
import logging
import time

from kubernetes_asyncio.client.rest import ApiException
from kubespawner.clients import load_config, shared_client
from kubespawner.reflector import MultiNamespaceResourceReflector
from kubespawner.slugs import safe_slug
from traitlets import Dict, Float, Integer, List, Unicode, Union
from traitlets.config import LoggingConfigurable

from gpulab.extensions.contract import (
    EXIT_CONFIG,
    EXIT_INFRA,
    EXIT_PROGRAM,
    FINAL,
)
from gpulab.hub.cluster.settings import KubeSettings
from gpulab.hub.cluster.kubeobjects import parse_quota_refusal
from gpulab.hub.cluster.namespaces import (
    USER_NAMESPACE_TEMPLATE,
    NamespaceSettingsError,
    api_message,
    prepare_user_namespace,
)
from gpulab.hub.cluster.kubeobjects import GPU_MODEL_LABEL, GPU_RESOURCE

from gpulab.extensions.contract import last_progress
from gpulab.extensions.joblog import restart_record, signal_name
from gpulab.hub.jobs.base import JobBackend, JobError, job_view, lead_of, restart_history
from gpulab.hub.jobs.rules import RoleJob, decide_kube
from gpulab.hub.jobs.spec import ROLES, JobSpec
from gpulab.hub.jobs.kubeobjects import (
    CLUSTER_PROGRAM,
    CONTAINER,
    INDEX_LABEL,
    JOB_LABEL,
    ROLE_LABEL,
    SELECTOR,
    SOURCE_PROGRAM,
    TF_PORT,
    Placement,
    make_cluster_coordinator_policy,
    make_job_network_policy,
    make_source_configmap,
    make_training_job_objects,
    mount_source,
    replica_host,
    role_job_name,
    tf_cluster,
)
from gpulab.hub.jobs.store import JobRow
from gpulab.hub.quota.ledger import Allocation, Ledger

log = logging.getLogger("gpulab.jobs.kube")

#: the labels of everything a training job is made of, which the shared watches select
#: (published for `gpulab.hub.jobs.kueue`'s watches too)
JOB_LABELS = dict(kv.split("=") for kv in SELECTOR.split(","))
#: how much of the lead replica's log end a progress read fetches
PROGRESS_TAIL_LINES = 200


class _JobReflector(MultiNamespaceResourceReflector):
    kind = "jobs"
    api_group_name = "BatchV1Api"
    list_method_name = "list_job_for_all_namespaces"


class PodReflector(MultiNamespaceResourceReflector):
    """The shared watch of the replicas' pods (of every driver on Kubernetes)."""

    kind = "pods"


# --------------------------------------------------------------------------- pure helpers


def fit_replicas(*, sizes: list[int], capacities: list[int]) -> bool:
    """Whether replicas of ``sizes`` GPUs fit on nodes of ``capacities`` (first fit, largest
    first: good enough to refuse what can never run)."""
    free = sorted(capacities, reverse=True)
    for size in sorted(sizes, reverse=True):
        for i, f in enumerate(free):
            if f >= size:
                free[i] -= size
                break
        else:
            return False
    return True


def _condition(obj: dict, kind: str) -> dict | None:
    for c in obj.get("status", {}).get("conditions") or []:
        if c.get("type") == kind and c.get("status") == "True":
            return c
    return None


def job_finished(job: dict) -> str | None:
    """``"Complete"``, ``"Failed"`` or None for a batch/v1 Job object."""
    for kind in ("Complete", "Failed"):
        if _condition(job, kind):
            return kind
    return None


def pod_words(pod: dict, *, gpus: int, model: str | None) -> tuple[str, str, int | None]:
    """(replica state, reason in words, exit code) of one replica's pod."""
    status = pod.get("status", {})
    phase = status.get("phase", "Pending")
    cs = (status.get("containerStatuses") or [{}])[0]
    state = cs.get("state") or {}
    if pod["metadata"].get("deletionTimestamp"):
        return "Stopped", "being removed", None
    if phase in ("Succeeded", "Failed"):
        term = state.get("terminated") or {}
        code = term.get("exitCode")
        if phase == "Succeeded":
            return "Succeeded", "exited 0", code if code is not None else 0
        why = term.get("reason") or status.get("reason") or ""
        if why == "OOMKilled":
            return "Failed", "killed: out of memory (OOM); ask for more memory", code
        if why == "DeadlineExceeded":
            return "Failed", "stopped after max_runtime", code
        words = {EXIT_PROGRAM: f"the program raised an error (exit {EXIT_PROGRAM})",
                 EXIT_CONFIG: f"bad job configuration (exit {EXIT_CONFIG})",
                 EXIT_INFRA: "lost its cluster (a ps or peer went away)"}.get(code, f"exited {code}")
        return "Failed", words, code
    if phase == "Running":
        return "Running", "", None
    waiting = (state.get("waiting") or {})
    reason = waiting.get("reason", "")
    if reason in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName"):
        return "Starting", f"the image {cs.get('image', '')} cannot be pulled ({reason})", None
    sched = next((c for c in status.get("conditions") or [] if c.get("type") == "PodScheduled"),
                 None)
    if sched and sched.get("status") == "False" and sched.get("reason") == "Unschedulable":
        return "Starting", unschedulable_words(sched.get("message", ""), gpus=gpus,
                                               model=model), None
    if reason:
        return "Starting", f"waiting ({reason})", None
    return "Starting", "starting", None


def pod_restarts(pods: list[dict], *, gpus: int = 0, model: str | None = None) -> list[dict]:
    """The restarts of one replica from its pods, oldest first (`pod_words` of each): every
    failed pod that a newer pod replaced is a restart (`gpulab.extensions.joblog.
    restart_record`), at the replacement's creation, with the failed container's exit code,
    out of memory where its ``terminated.reason`` is OOMKilled, and the pod's name."""
    out = []
    for old, new in zip(pods, pods[1:]):
        if old.get("status", {}).get("phase") != "Failed":
            continue
        _, why, code = pod_words(old, gpus=gpus, model=model)
        if why == f"exited {code}" and signal_name(code):  # 128 + n: killed by signal n
            why = f"killed by {signal_name(code)}"
        term = (((old["status"].get("containerStatuses") or [{}])[0].get("state") or {})
                .get("terminated") or {})
        at = (k8s_time(new["metadata"].get("creationTimestamp")) or k8s_time(term.get("finishedAt"))
              or 0.0)
        out.append(restart_record(restart=len(out) + 1, at=at, exit_code=code, reason=why,
                                  oom_killed=term.get("reason") == "OOMKilled",
                                  pod=old["metadata"]["name"]))
    return out


def merge_restarts(known: list[dict], seen: list[dict]) -> list[dict]:
    """A replica's restarts kept so far with those its pods show now (by pod): the cluster
    removes failed pods once their replacement runs, so what was seen once is kept."""
    pods = {r.get("pod") for r in known}
    merged = list(known)
    for r in seen:
        if r.get("pod") not in pods:
            merged.append({**r, "restart": len(merged) + 1, "attempt": len(merged) + 2})
    return merged


def cluster_failure_words(states: dict, words: str) -> str:
    """Why a cluster failed, in words the person can act on: a lost parameter server took the
    variables it held with it (``states``: each replica's (state, reason, …) by (role,
    index)); otherwise ``words`` as they are."""
    lost = [f"ps-{i}" for (role, i), v in sorted(states.items()) if role == "ps" and v[0] == "Failed"]
    if not lost:
        return words
    why = next(v[1] for (role, i), v in sorted(states.items()) if role == "ps" and v[0] == "Failed")
    return (f"parameter server {', '.join(lost)} was lost ({why}) and the variables it held "
            "with it: the cluster ended. Restore your model from its last checkpoint and hold "
            "a new cluster.")


def unschedulable_words(message: str, *, gpus: int, model: str | None) -> str:
    of_model = f" of model {model}" if model else ""
    plural = "s" if gpus != 1 else ""
    if gpus and f"Insufficient {GPU_RESOURCE}" in message:
        return f"cannot be scheduled: no node has {gpus} free GPU{plural}{of_model}"
    if gpus and ("node affinity/selector" in message or "untolerated taint" in message):
        return f"cannot be scheduled: no node has GPUs{of_model}"
    if "Insufficient cpu" in message or "Insufficient memory" in message:
        return "cannot be scheduled: no node has enough free CPU or memory"
    return f"cannot be scheduled: {message}" if message else "cannot be scheduled yet"


def _unschedulable_since(pod: dict) -> float | None:
    for c in pod.get("status", {}).get("conditions") or []:
        if (c.get("type") == "PodScheduled" and c.get("status") == "False"
                and c.get("reason") == "Unschedulable"):
            return k8s_time(pod["metadata"].get("creationTimestamp"))
    return None


def k8s_time(value: str | None) -> float | None:
    """A Kubernetes timestamp (``2024-01-02T03:04:05Z``) in seconds since the epoch (None
    where there is none; ValueError where it cannot be read)."""
    if not value:
        return None
    return float(calendar.timegm(time.strptime(value, "%Y-%m-%dT%H:%M:%SZ")))


#: KubeSpawner's own settings a KubeJobBackend takes from KubeGPUSpawner's (under its own
#: names) unless set on KubeJobBackend itself
FROM_KUBESPAWNER = {"namespace_template": "user_namespace_template", "server_port": "port",
                    "server_component": "component_label", "node_selector": "node_selector",
                    "tolerations": "tolerations"}
#: every setting a KubeJobBackend takes from KubeGPUSpawner's unless set on KubeJobBackend
#: itself: those both inherit from `KubeSettings` (one name), and KubeSpawner's own above
SHARED_WITH_SPAWNER = {**{name: name for name in sorted(KubeSettings.class_own_traits(config=True))},
                       **FROM_KUBESPAWNER}
#: the environment variable the gpulab service falls back to for these settings when its
#: config file has no ``GpulabService.kube_jobs`` (the hub writes them there)
SETTINGS_ENV = "GPULAB_KUBE_JOBS"


def backend_settings(config) -> str:
    """The JSON of ``c.KubeJobBackend``'s (and ``c.KueueJobBackend``'s) settings for the
    gpulab service, those it shares
    with ``c.KubeGPUSpawner`` filled from there (one namespace, quota and folder per user)."""
    ours = dict(config.get("KubeJobBackend", {}))
    ours.update(config.get("KueueJobBackend", {}))  # its own settings (queues, CPU, memory)
    # the spawner's values as traitlets gives them to it: its own section over the shared one
    spawner = {**config.get("KubeSettings", {}), **config.get("KubeGPUSpawner", {})}
    if "kueue" in ours and bool(ours["kueue"]) != bool(spawner.get("kueue", False)):
        # one switch: the spawner's pods and the backend's jobs in the same queues, and no
        # GPU ResourceQuota made by one and removed by the other
        raise ValueError("c.KubeJobBackend.kueue and c.KubeGPUSpawner.kueue differ: set "
                         "c.KubeGPUSpawner.kueue only (the job backend takes it from there).")
    for name, default in (("kueue_gpus", None), ("kueue_gpu_models", False)):
        # the hub's and the service's quota mirrors write the same pool: two pools would
        # undo each other for ever
        if name in ours and ours[name] != spawner.get(name, default):
            raise ValueError(f"c.KubeJobBackend.{name} and c.KubeGPUSpawner.{name} differ: set "
                             f"c.KubeGPUSpawner.{name} only (the job backend takes it from there).")
    for mine, theirs in SHARED_WITH_SPAWNER.items():
        if mine not in ours and theirs in spawner:
            ours[mine] = spawner[theirs]
    return json.dumps(ours, sort_keys=True)


class KubeJobBackend(JobBackend, KubeSettings, LoggingConfigurable):
    """Training jobs on Kubernetes: pods of Indexed Jobs in each user's namespace.

    Use it in the gpulab service with the hub's ServiceAccount bound by
    ``helm-values/rbac.yaml``. Its namespace and shared-storage settings are `KubeSettings`,
    which `gpulab.spawner.kube.KubeGPUSpawner` shares (the hub hands the spawner's to the
    service, `backend_settings`), so that a user's notebook and jobs share a namespace, a
    quota and their folders.
    """

    name = "kubernetes"

    image = Unicode("gpulab/singleuser:latest", help="""
        Container image of the replicas when the spec names none (a spec may name one of
        ``c.GPUJobs.allowed_images``). Example: ``c.KubeJobBackend.image = "gpulab/singleuser:1"``
        """).tag(config=True)
    namespace_template = Unicode(USER_NAMESPACE_TEMPLATE, help="""
        The user's namespace; ``{username}`` is KubeSpawner's safe slug of the user name. Must
        equal ``c.KubeGPUSpawner.user_namespace_template`` (default ``gpulab-{username}``).
        """).tag(config=True)
    gpu_model = Unicode(None, allow_none=True, help="""
        GPU model (node label ``nvidia.com/gpu.product``) of the replicas that have GPUs; None
        (default): any GPU node. Example: ``c.KubeJobBackend.gpu_model = "NVIDIA-H100"``
        """).tag(config=True)
    server_port = Integer(8888, help="""
        The notebook servers' port, which the servers' NetworkPolicy opens to the hub and the
        proxy. Taken from ``c.KubeGPUSpawner.port`` (KubeSpawner's trait, default 8888): the
        backend prepares the same namespace and must not write another port there.
        """).tag(config=True)
    server_component = Unicode("singleuser-server", help="""
        The ``component`` label of notebook server pods, which the servers' NetworkPolicy
        selects. Taken from ``c.KubeGPUSpawner.component_label`` (KubeSpawner's trait, default
        ``singleuser-server``).
        """).tag(config=True)
    node_selector = Dict(Unicode(), default_value={}, help="""
        Node labels every replica's pod must match, beside the GPU model's selector; none
        unless set. Taken from ``c.KubeGPUSpawner.node_selector`` (KubeSpawner's trait): an operator who
        puts notebooks on a node pool puts training jobs there too.
        """).tag(config=True)
    tolerations = Union([List(Dict()), Dict()], default_value=[], help="""
        Tolerations of every replica's pod, beside the GPU toleration gpulab adds to GPU
        roles; none unless set. Taken from ``c.KubeGPUSpawner.tolerations`` (KubeSpawner's
        trait: a list of Kubernetes Toleration objects, or a dict of them by name).
        """).tag(config=True)
    unschedulable_timeout = Float(300.0, help="""
        Seconds a replica may stay unschedulable before the whole job is removed with the
        reason (default 300), so that a half-started job never holds GPUs.""").tag(config=True)
    reconcile_interval = Float(1.0, help="""
        Seconds between passes of the reconciler over the shared watches' caches (default 1;
        no API request unless something must be done).""").tag(config=True)
    node_cache_seconds = Float(30.0, help="""
        Seconds a list of the nodes (GPU capacity) is reused (default 30).""").tag(config=True)
    request_timeout = Float(30.0, help="Seconds an API request may take (default 30).").tag(
        config=True)
    progress_cache_seconds = Float(5.0, help="""
        Seconds a job's progress, read from its lead replica's log when someone looks at the
        job, is reused (default 5): one log request per watched job and period, none for jobs
        nobody watches.""").tag(config=True)

    @classmethod
    def from_settings(cls, ledger: Ledger, raw: str | None) -> KubeJobBackend:
        """A backend from the JSON of `backend_settings`."""
        from traitlets.config import Config

        c = Config()
        for k, v in json.loads(raw or "{}").items():
            setattr(c.KubeJobBackend, k, v)
        return cls(ledger, config=c)

    #: a job whose objects could not be created is kept as Failed, with the cluster's reason
    keeps_failed_launches = True

    def __init__(self, ledger: Ledger, **kwargs):
        super().__init__(**kwargs)
        self._setup_workflow(ledger)
        self._ready_ns: set[str] = set()
        self._nodes: tuple[float, list[dict]] = (0.0, [])
        self._jobs_r: _JobReflector | None = None
        self._pods_r: PodReflector | None = None
        self._started = asyncio.Lock()
        self._deleted: set[tuple[str, str]] = set()
        self.api_requests = 0  # requests made outside the shared watches (bench/k8s_jobs.py)
        self._progress: dict[str, tuple[float, dict | None]] = {}  # job id -> (read at, value)

    # -- clients and watches -------------------------------------------------------------

    @property
    def core(self):
        load_config()
        return shared_client("CoreV1Api")

    @property
    def batch(self):
        load_config()
        return shared_client("BatchV1Api")

    @property
    def networking(self):
        load_config()
        return shared_client("NetworkingV1Api")

    async def start_watches(self) -> None:
        """Start the two shared watches (once) and wait for their first lists."""
        async with self._started:
            if self._jobs_r is None:
                load_config()
                jobs = _JobReflector(labels=JOB_LABELS, parent=self)
                pods = PodReflector(labels=JOB_LABELS, parent=self)
                await jobs.start()
                await pods.start()
                self._jobs_r, self._pods_r = jobs, pods

    # -- supervision: the workflow's hooks -------------------------------------------------

    @property
    def supervise_interval(self) -> float:
        return self.reconcile_interval

    async def _start_supervising(self) -> None:
        await self.start_watches()

    async def _supervise_pass(self) -> bool:
        await self.reconcile()
        return True

    async def _stop_supervising(self) -> None:
        """Stop watching; the jobs keep running (a restarted service picks them up)."""
        for r in (self._jobs_r, self._pods_r):
            if r is not None:
                await r.stop()
        self._jobs_r = self._pods_r = None

    # -- names ---------------------------------------------------------------------------

    def _expand(self, template: str, user: str) -> str:
        return template.format(username=safe_slug(user, max_length=48))

    def namespace_of(self, user: str) -> str:
        return self._expand(self.namespace_template, user)

    def user_label(self, user: str) -> str:
        return safe_slug(user, max_length=48)

    # -- queries -------------------------------------------------------------------------

    #: the stable host name of a replica in ``TF_CONFIG`` and a cluster's addresses
    replica_host = staticmethod(replica_host)

    def _view(self, job, reps, detail: bool = False) -> dict:
        view = job_view(job, reps)  # progress: only in `detail` (it costs a log request)
        view["progress"] = None
        view["namespace"] = self.namespace_of(job.user)
        kind = view["spec"].get("kind", "job")
        view.setdefault("kind", kind)
        if kind == "cluster":
            view["cluster"] = self.cluster_addresses(job.user, JobSpec.model_validate(view["spec"]))
        return view

    def cluster_addresses(self, user: str, spec: JobSpec) -> dict[str, list[str]]:
        """``{"ps": ["host:port", ...], "worker": [...]}``: where the owner's notebook kernel
        reaches a cluster's servers (their stable DNS names in the person's namespace, which
        the cluster's NetworkPolicies open to the namespace's notebook pods only)."""
        return tf_cluster(spec=spec, namespace=self.namespace_of(user), port=TF_PORT,
                          host=self.replica_host)

    async def _detail(self, view: dict) -> dict:
        """The job's progress, from its lead replica's log (cached)."""
        view["progress"] = await self._read_progress(view)
        return view

    async def _read_progress(self, view: dict) -> dict | None:
        cached = self._progress.get(view["id"])
        if cached and (view["state"] in FINAL
                       or time.monotonic() - cached[0] < self.progress_cache_seconds):
            return cached[1]
        ns = view["namespace"]
        pods = self._replica_pods(ns, view["name"]).get(lead_of(view["spec"]))
        value = cached[1] if cached else None
        if pods and pods[-1].get("status", {}).get("phase") in ("Running", "Succeeded",
                                                                 "Failed"):
            try:
                self.api_requests += 1
                resp = await self.core.read_namespaced_pod_log(
                    pods[-1]["metadata"]["name"], ns, container=CONTAINER,
                    tail_lines=PROGRESS_TAIL_LINES, _preload_content=False,
                    _request_timeout=self.request_timeout)
                data = await resp.read()
                if resp.status < 400:
                    value = last_progress(data.decode(errors="replace")) or value
            except Exception as e:  # progress is a nicety: never fail a status read for it
                log.info("Progress of %s/%s not read: %s", ns, view["name"], e)
        self._progress[view["id"]] = (time.monotonic(), value)
        return value

    def _pods_of(self, namespace: str, job: str) -> list[dict]:
        pods = self._pods_r.resources.values() if self._pods_r else []
        return [p for p in pods if p["metadata"]["namespace"] == namespace
                and p["metadata"].get("labels", {}).get(JOB_LABEL) == job]

    def _replica_pods(self, namespace: str, job: str) -> dict[tuple[str, int], list[dict]]:
        """The pods of each replica, oldest first."""
        out: dict[tuple[str, int], list[dict]] = {}
        for p in self._pods_of(namespace, job):
            labels = p["metadata"].get("labels", {})
            try:
                key = (labels[ROLE_LABEL], int(labels[INDEX_LABEL]))
            except (KeyError, ValueError):
                continue
            out.setdefault(key, []).append(p)
        for pods in out.values():
            pods.sort(key=lambda p: (p["metadata"].get("creationTimestamp") or "",
                                     p["metadata"]["name"]))
        return out

    async def _read_replica_log(self, job: JobRow, replica: str, offset: int,
                                limit: int) -> tuple[bytes, int, bool]:
        """(up to ``limit`` bytes of the replica's current pod's log from ``offset``, the
        bytes known so far, job finished), through the pod log API."""
        role, index = replica.rsplit("-", 1)
        ns = self.namespace_of(job.user)
        pods = self._replica_pods(ns, job.name).get((role, int(index)))
        done = job.state in FINAL
        if not pods:
            return b"", 0, done
        data = b""
        try:
            self.api_requests += 1
            resp = await self.core.read_namespaced_pod_log(
                pods[-1]["metadata"]["name"], ns, container=CONTAINER,
                limit_bytes=offset + limit, _preload_content=False,
                _request_timeout=self.request_timeout)
            data = await resp.read()
            if resp.status >= 400:  # not raised with _preload_content=False
                raise ApiException(status=resp.status, reason=resp.reason)
        except ApiException as e:
            if e.status in (400, 404):  # not started yet, or gone
                return b"", offset, done
            try:
                why = json.loads(data)["message"]
            except Exception:
                why = api_message(e)
            log.warning("Log of %s/%s %s: %s %s", ns, job.name, replica, e.status, why)
            raise JobError(f"The log of {replica} cannot be read now ({e.status}).", 502,
                           "replica") from e
        return data[offset:], len(data), done

    # -- submit --------------------------------------------------------------------------

    async def _node_capacities(self) -> list[dict]:
        fetched, nodes = self._nodes
        if time.monotonic() - fetched > self.node_cache_seconds:
            self.api_requests += 1
            resp = await self.core.list_node(_preload_content=False,
                                             _request_timeout=self.request_timeout)
            nodes = json.loads(await resp.read())["items"]
            self._nodes = (time.monotonic(), nodes)
        return nodes

    async def check_capacity(self, spec: JobSpec) -> None:
        """Refuse a job that the schedulable GPU nodes of the model could never hold whole."""
        sizes = [spec.gpus_of(r) for r in ROLES for _ in range(spec.count(r)) if spec.gpus_of(r)]
        if not sizes:
            return
        caps = []
        for n in await self._node_capacities():
            if n.get("spec", {}).get("unschedulable"):
                continue
            labels = n["metadata"].get("labels", {})
            if self.gpu_model and labels.get(GPU_MODEL_LABEL) != self.gpu_model:
                continue
            try:
                gpus = int(n.get("status", {}).get("allocatable", {}).get(GPU_RESOURCE, 0))
            except ValueError:
                gpus = 0
            if gpus:
                caps.append(gpus)
        if not fit_replicas(sizes=sizes, capacities=caps):
            of_model = f" of model {self.gpu_model}" if self.gpu_model else ""
            have = ", ".join(str(c) for c in sorted(caps, reverse=True)) or "none"
            raise JobError(
                f"resources: the cluster cannot hold this job at once: {len(sizes)} replicas "
                f"with {', '.join(str(s) for s in sizes)} GPUs{of_model}, and its schedulable "
                f"nodes{of_model} have {have} GPUs.", 409, "resources")

    async def _ensure_namespace(self, user: str, groups: tuple[str, ...]) -> str:
        ns = self.namespace_of(user)
        if ns in self._ready_ns:
            return ns
        try:
            # before the namespace's first replica: nothing outside the job reaches it
            self.api_requests += await prepare_user_namespace(
                api=self.core, ledger=self.ledger, namespace=ns, user=user, groups=groups,
                user_label=self.user_label(user), pod_security_level=self.pod_security_level,
                hub_namespace=self.hub_namespace, allowed_egress=self.allowed_egress,
                allowed_server_ingress=self.allowed_server_ingress,
                server_port=self.server_port, server_component=self.server_component,
                sync_interval=self.gpu_quota_sync_interval,
                request_timeout=self.request_timeout, log=log, networking=self.networking,
                gpu_resource_quota=not self.kueue)
        except NamespaceSettingsError as e:
            raise JobError(f"The cluster's network settings are wrong: {e}" if e.network
                           else str(e), 500) from e
        self._ready_ns.add(ns)
        return ns

    # -- submit: the workflow's hooks ------------------------------------------------------

    async def _prepare(self, user: str, groups: tuple[str, ...], spec: JobSpec) -> None:
        self._container_defaults()  # a bad setting: refused before any request
        await self.check_capacity(spec)

    def _container_defaults(self) -> tuple[dict[str, str], dict[str, str]]:
        try:
            return self.container_defaults()
        except ValueError as e:
            raise JobError(f"The cluster's container defaults are wrong: {e}", 500) from e

    def _user_dir(self, user: str) -> str:
        return (f"{self.shared_mount_path.rstrip('/')}/"
                f"{self._expand(self.user_subpath_template, user)}")

    def _job_dir(self, user: str, spec: JobSpec, prepared) -> str:
        return f"{self._user_dir(user)}/jobs/{spec.name}"

    def _replica_rows(self, spec: JobSpec, allocation: Allocation) -> list[dict]:
        return [dict(role=role, index=index, state="Pending", reason="waiting for its pod",
                     devices="[]") for role, index in spec.replica_names()]

    async def _launch(self, job_id: str, user: str, groups: tuple[str, ...], spec: JobSpec,
                      prepared) -> None:
        ns = self.namespace_of(user)
        await self._create_objects(user, groups, spec, ns, self._user_dir(user),
                                   self._job_dir(user, spec, prepared))
        log.info("Job %s/%s created (%d GPUs)", ns, spec.name, spec.total_gpus)

    async def _unlaunch(self, job_id: str, user: str, spec: JobSpec) -> None:
        # the parent: garbage collection removes whatever else was created
        await self._delete_parent(self.namespace_of(user), spec.name)

    def _launch_error(self, e: BaseException, spec: JobSpec) -> JobError:
        if isinstance(e, JobError):
            return e
        message = self._refusal_words(e)
        log.warning("Job %s could not be created: %s", spec.name, message)
        return JobError(f"The job could not be created: {message}",
                        409 if isinstance(e, ApiException) and e.status == 403 else 502,
                        reason=message)

    @staticmethod
    def _refusal_words(e: Exception) -> str:
        if not isinstance(e, ApiException):
            return str(e)
        msg = api_message(e)
        q = parse_quota_refusal(msg)
        if q:
            return (f"the namespace's GPU quota allows {q['limited']} GPUs, {q['used']} are in "
                    f"use and the job asks for {q['requested']}")
        if e.status == 403:
            return f"not allowed by the cluster: {msg}"
        return msg

    def _placement(self, user: str, spec: JobSpec, ns: str, user_dir: str,
                   job_dir: str) -> Placement:
        """Where the job's replicas run (`gpulab.hub.jobs.kubeobjects.Placement`), for its
        object builders."""
        if spec.is_cluster:
            program = CLUSTER_PROGRAM
        elif spec.source is not None:
            program = SOURCE_PROGRAM
        elif self.shared_volume:
            program = f"{user_dir}/{spec.script}"
        else:
            program = spec.script
        limits, requests = self._container_defaults()
        return Placement(namespace=ns, user_label=self.user_label(user),
                         image=spec.image or self.image, program=program, job_dir=job_dir,
                         user_dir=user_dir, gpu_model=self.gpu_model,
                         shared_volume=self.shared_volume, shared_mount=self.shared_mount_path,
                         user_subpath=self._expand(self.user_subpath_template, user),
                         datasets_subpath=self.datasets_subpath or None,
                         node_selector=self.node_selector or None,
                         tolerations=self.tolerations or None,
                         container_limits=limits, container_requests=requests)

    async def _create_objects(self, user, groups, spec: JobSpec, ns, user_dir, job_dir) -> None:
        where = self._placement(user, spec, ns, user_dir, job_dir)
        await self._ensure_namespace(user, groups)
        service = make_training_job_objects(spec, where)[0]
        self.api_requests += 1
        created = await self.core.create_namespaced_service(
            ns, service, _request_timeout=self.request_timeout)
        uid = created.metadata.uid
        objects = make_training_job_objects(spec, where, parent_uid=uid)[1:]
        creating = [self.networking.create_namespaced_network_policy(
            ns, policy, _request_timeout=self.request_timeout)
            for policy in self.network_policies(user, spec, ns, uid, ("v1", "Service"))]
        if spec.source is not None:
            cm = make_source_configmap(spec=spec, namespace=ns, user_label=self.user_label(user),
                                       parent_uid=uid)
            creating.append(self.core.create_namespaced_config_map(
                ns, cm, _request_timeout=self.request_timeout))
            for job in objects:
                mount_source(job["spec"]["template"]["spec"], job=spec.name)
        creating += [self.batch.create_namespaced_job(ns, job, _request_timeout=self.request_timeout)
                     for job in objects]
        # all at once: the owner exists, and a pod waits for its ConfigMap by itself; a
        # replica started before its job's NetworkPolicy is refused by its peers until then
        # (the namespace's policy refuses every ingress), never open to others. If one
        # fails, submit deletes the parent and garbage collection the rest.
        self.api_requests += len(creating)
        results = await asyncio.gather(*creating, return_exceptions=True)
        for r in results:
            if isinstance(r, BaseException):
                raise r

    def network_policies(self, user: str, spec: JobSpec, ns: str, uid: str | None,
                         parent: tuple[str, str]) -> list[dict]:
        """The job's NetworkPolicies: its replicas reach each other only; a cluster's also
        accept its owner's notebook pods on the TF port, which another policy lets those
        pods reach (`gpulab.hub.jobs.kubeobjects.make_cluster_coordinator_policy`)."""
        label = self.user_label(user)
        coordinator = self.server_component if spec.is_cluster else None
        policies = [make_job_network_policy(job=spec.name, namespace=ns, user_label=label,
                                            parent_uid=uid, parent=parent,
                                            coordinator=coordinator)]
        if coordinator:
            policies.append(make_cluster_coordinator_policy(
                job=spec.name, namespace=ns, user_label=label, coordinator=coordinator,
                parent_uid=uid, parent=parent))
        return policies

    # -- stop and deletion ---------------------------------------------------------------

    async def _delete(self, method, name: str, ns: str) -> None:
        try:
            self.api_requests += 1
            await method(name, ns, propagation_policy="Background",
                         _request_timeout=self.request_timeout)
        except ApiException as e:
            if e.status != 404:
                raise

    async def _delete_parent(self, ns: str, name: str) -> None:
        """Delete the job's parent Service: garbage collection removes everything else."""
        await self._delete(self.core.delete_namespaced_service, name, ns)

    async def _halt(self, view: dict) -> None:
        await self._delete_parent(self.namespace_of(view["user"]), view["name"])

    # -- reconciling -----------------------------------------------------------------------

    async def reconcile(self) -> None:
        """One pass over the active jobs, from the shared watches' caches."""
        if self._jobs_r is None:
            return
        for job_id in await asyncio.to_thread(self._active_to_supervise):
            await self._reconcile_job(job_id)

    async def _reconcile_job(self, job_id: str) -> None:
        job, _ = await asyncio.to_thread(self.store.read, job_id)
        if job is None:
            return
        spec = JobSpec.model_validate_json(job.spec)
        user, name, created = job.user, job.name, job.created_at
        ns = self.namespace_of(user)
        jobs = {role: self._jobs_r.resources.get(f"{ns}/{role_job_name(name, role)}")
                for role in ROLES if spec.count(role)}
        pods = self._replica_pods(ns, name)
        if not any(jobs.values()):
            if time.time() - created > 30:  # the watch has long seen what submit created
                await asyncio.to_thread(self._finish, job_id, "Failed",
                                        "lost: its Kubernetes objects are gone")
            return
        now = time.time()
        outcome: tuple[str, str] | None = None
        delete_roles: list[str] = []
        delete_all = False
        # replicas
        states: dict[tuple[str, int], tuple[str, str, int | None, int]] = {}
        histories: dict[tuple[str, int], list[dict]] = {}  # the restarts its pods show
        for role, index in spec.replica_names():
            mine = pods.get((role, index), [])
            restarts = sum(1 for p in mine if p.get("status", {}).get("phase") == "Failed")
            if not mine:
                states[(role, index)] = ("Pending", "waiting for its pod", None, restarts)
                if (outcome is None and now - created > self.unschedulable_timeout
                        and jobs.get(role) is not None and not job_finished(jobs[role])):
                    # the Job controller could not make the pod: the namespace's quota or an
                    # admission policy refuses it (the reason is in the Job's events)
                    outcome = ("Failed", f"{role}-{index}: the cluster made no pod within "
                               f"{self.unschedulable_timeout:g} s (the namespace's GPU quota "
                               "or a policy refuses it; kubectl describe job "
                               f"{role_job_name(name, role)} -n {ns}); the whole job was removed")
                    delete_all = True
                continue
            st, why, code = pod_words(mine[-1], gpus=spec.gpus_of(role), model=self.gpu_model)
            if st == "Failed" and len(mine) and jobs.get(role) and not job_finished(jobs[role]):
                st, why = "Starting", f"restarting after: {why}"
            states[(role, index)] = (st, why, code, restarts)
            histories[(role, index)] = pod_restarts(mine, gpus=spec.gpus_of(role),
                                                    model=self.gpu_model)
            since = _unschedulable_since(mine[-1])
            if (outcome is None and since is not None and st == "Starting"
                    and why.startswith("cannot be scheduled")
                    and now - max(since, created) > self.unschedulable_timeout):
                outcome = ("Failed", f"{role}-{index} {why} within {self.unschedulable_timeout:g} "
                           "s; the whole job was removed")
                delete_all = True
        if outcome is None:
            roles = {role: None if obj is None else RoleJob(
                         job_finished(obj), (_condition(obj, "Failed") or {}).get("reason", ""))
                     for role, obj in jobs.items()}
            outcome = decide_kube(spec.strategy, name, roles,
                                  {k: (v[0], v[1]) for k, v in states.items()},
                                  retries=spec.retries, max_runtime=spec.max_runtime)
            if outcome is not None and spec.is_cluster and outcome[0] == "Failed":
                outcome = (outcome[0], cluster_failure_words(
                    {k: (v[0], v[1].removeprefix("restarting after: ")) for k, v in states.items()},
                    outcome[1]))
        if outcome is not None:
            if delete_all:
                await self._delete_parent(ns, name)
            else:
                for role, obj in jobs.items():
                    if obj is not None and not job_finished(obj):
                        delete_roles.append(role)
                        await self._delete(self.batch.delete_namespaced_job,
                                           role_job_name(name, role), ns)
        await asyncio.to_thread(self._record_states, job_id, states, outcome, delete_roles, now,
                                histories=histories)

    def _record_states(self, job_id: str, states, outcome, delete_roles, now: float,
                       ended_at: float | None = None, histories=None) -> None:
        """What a reconcile pass saw, in the job's rows (in a thread), and its end if any
        (``ended_at``: when it ended, default now); ``histories``: the restarts each
        replica's pods show (`pod_restarts`), added to those kept."""
        with self.ledger.Session.begin() as s:
            job, reps = self.store.load(s, job_id)
            if job is None or job.state in FINAL:
                return
            for r in reps:
                st, why, code, restarts = states[(r.role, r.index)]
                if outcome is not None and r.role in delete_roles and st != "Succeeded":
                    st, why = "Stopped", f"removed: the job {outcome[0].lower()}"
                # counted from the failed pods a pass sees, which the cluster may remove once
                # their replacement runs (seen on a real node): a count never goes down
                r.state, r.reason, r.exit_code = st, why, code
                r.restarts = max(r.restarts or 0, restarts)
                seen = (histories or {}).get((r.role, r.index))
                if seen:
                    known = restart_history(r)
                    merged = merge_restarts(known, seen)
                    if len(merged) != len(known):
                        r.restart_log = json.dumps(merged)
            if outcome is None:
                running = all(v[0] in ("Running", "Succeeded") for v in states.values())
                if running:
                    job.state = "Running"
                    job.reason = "all replicas running"
                    job.started_at = job.started_at or now
                elif any(v[0] != "Pending" for v in states.values()):
                    job.state = "Starting"
                    waiting = [f"{r}-{i}: {v[1]}" for (r, i), v in sorted(states.items())
                               if v[0] not in ("Running", "Succeeded")]
                    job.reason = "; ".join(waiting[:3])
        if outcome is not None:
            self._finish(job_id, *outcome, at=ended_at)
