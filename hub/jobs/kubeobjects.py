"""The Kubernetes objects of a training job, built by pure functions (no I/O).

`make_training_job_objects` returns, for one `JobSpec`:

- a headless Service ``<job>`` (``clusterIP: None``, ``publishNotReadyAddresses``): the
  job's **parent**. Every other object names it in ``ownerReferences``, so deleting the
  Service deletes the whole job through garbage collection (Jobs, then their pods). A Service
  is cheap, is needed anyway for the replicas' DNS names, and the hub may already create one;
- one ``batch/v1`` Indexed Job ``<job>-<role>`` per replica role (chief, ps, worker,
  evaluator), ``completions = parallelism = <replicas of the role>``. Its pods get the host
  name ``<job>-<role>-<index>`` and the Service as ``subdomain``, so each replica has the
  stable name ``<job>-<role>-<index>.<job>.<namespace>.svc``.

``TF_CONFIG`` is per pod, yet a pod template is per role: the template sets
``GPULAB_TASK_INDEX`` from the pod's completion-index annotation (a ``fieldRef``) and
``TF_CONFIG`` as JSON whose task index is ``$(GPULAB_TASK_INDEX)``, which the kubelet expands
(Kubernetes' dependent environment variables). The runtime reads a plain ``TF_CONFIG`` as
always. Everything the person wrote that reaches the container's ``command`` (the program
path, ``args``) or ``env`` values is escaped (`escape_expansion`: every ``$`` doubled), so
that the kubelet's ``$(VAR)`` expansion hands the replica exactly what was written.

`make_job_network_policy` is the job's NetworkPolicy: its replicas accept connections from,
and open them to, the replicas of the same job only (beside the user namespace's own
policies, `gpulab.hub.cluster.kubeobjects.make_user_network_policies`, which refuse every other
ingress). A TF server runs any graph it is sent, so nothing but its own job may reach it.

Labels (``kubectl get jobs,pods,svc -l gpulab.io/job=<job>``): ``gpulab.io/user``,
``gpulab.io/job``, ``gpulab.io/role`` (Jobs and pods), and on pods Kubernetes' own
``batch.kubernetes.io/job-completion-index`` for the index, e.g.
``kubectl get pods -l gpulab.io/job=digits,gpulab.io/role=worker,batch.kubernetes.io/job-completion-index=1``.

Pods: restart policy ``Never`` (a failed replica is replaced by the Job controller within
``backoffLimit`` = the spec's ``retries``; `pod_failure_policy` says which failures are not
retried), ``activeDeadlineSeconds`` = ``max_runtime``, the GPU
limit, toleration and model node selector on roles with GPUs, the user's shared folders as in
notebooks (`gpulab.hub.cluster.kubeobjects.server_pod_settings`), no service-account token, no
privilege escalation, no host paths.

A **cluster** (``kind: cluster``, issue 38: parameter servers and workers held for the
person's notebook kernel, which coordinates them) is built by the same functions: no chief
and no code, every replica the runtime with ``GPULAB_KIND=cluster`` serving its
``TF_CONFIG`` task (`CLUSTER_PROGRAM` stands where a job's program is). Its workers are
restartable: a lost worker pod is replaced by the Job controller under the same host name
(``backoffLimit`` = ``retries``), and the coordinator carries on; its parameter servers are
not (``backoffLimit`` 0): a lost ps fails the cluster, whose variables died with it.
`tf_cluster` gives the addresses the notebook kernel connects to. Beside the replicas' own
policy, which then also lets the namespace's notebook pods in on the TF port,
`make_cluster_coordinator_policy` lets those notebook pods (the owner's: the namespace is
the person's) open connections to the cluster's replicas on that port.

`make_tfjob` renders the same job as a Kubeflow ``TFJob`` (``kubeflow.org/v1``) for clusters
that run the legacy training operator (which writes ``TF_CONFIG`` itself).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpulab.hub.cluster.kubeobjects import (COMPONENT_LABEL, MANAGED_BY, USER_LABEL, escape_expansion,
                                       server_pod_settings, with_container_defaults,
                                       with_runtime_default_seccomp)
from gpulab.hub.cluster.kueueobjects import PRIORITY_CLASS_LABEL, QUEUE_NAME_LABEL
from gpulab.hub.cluster.kubeobjects import GPU_MODEL_LABEL, GPU_RESOURCE
from gpulab.hub.cluster.namespaces import SHARED_MOUNT_PATH

from gpulab.hub.jobs.spec import ROLES, JobSpec

JOB_LABEL = "gpulab.io/job"
ROLE_LABEL = "gpulab.io/role"
INDEX_LABEL = "batch.kubernetes.io/job-completion-index"  # set by Kubernetes on Indexed Job pods
COMPONENT = {"app.kubernetes.io/component": "training-job"}
#: the label selector of everything a training job is made of (the backend's shared watches)
SELECTOR = "app.kubernetes.io/managed-by=gpulab,app.kubernetes.io/component=training-job"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
CONTAINER = "tensorflow"  # the name the Kubeflow training operator expects, too
#: where a job's code given as text (``source``) appears in its replicas (a ConfigMap)
SOURCE_MOUNT = "/gpulab/job-source"
SOURCE_PROGRAM = f"{SOURCE_MOUNT}/source.py"
TF_PORT = 2222
#: what a cluster's replicas get where a job's get the program: the runtime serves the
#: replica's ``TF_CONFIG`` task and runs no program (ps and workers of a parameter-server
#: cluster never do), so this is never opened
CLUSTER_PROGRAM = "gpulab-cluster"
#: the environment variable that tells the runtime a replica belongs to a cluster
KIND_ENV = "GPULAB_KIND"
INDEX_ENV = "GPULAB_TASK_INDEX"
#: a replica's command (then the program and its arguments): the job folder and its logs/ are
#: made by the container's own user (not by the container runtime as root, which a shared
#: NFS volume would refuse or leave unwritable), then the runtime runs in the job folder
REPLICA_COMMAND = ["sh", "-c", 'mkdir -p "$GPULAB_JOB_DIR/logs" && cd "$GPULAB_JOB_DIR" && '
                   'exec python -m gpulab.extensions.runtime "$@"', "gpulab-replica"]
_INDEX_FIELD = f"metadata.annotations['{INDEX_LABEL}']"
_TFJOB_ROLES = {"chief": "Chief", "ps": "PS", "worker": "Worker", "evaluator": "Evaluator"}


@dataclass(frozen=True)
class Placement:
    """Where one job's replicas run and what they run, beside the spec: what every builder
    of a job's objects (`make_training_job_objects`, `make_training_jobset`, `make_tfjob`)
    takes. ``program`` and ``job_dir`` are paths inside the container (on the shared
    volume); ``user_dir`` is the user's folder there (``GPULAB_USER_DIR``); ``shared_*``,
    ``user_subpath`` and ``datasets_subpath`` mount the shared storage as notebook servers
    have it (`KubeSettings <gpulab.hub.cluster.settings.KubeSettings>`); ``node_selector``
    and ``tolerations`` (KubeSpawner's traits of the same names, for a node pool) go to
    every pod, the GPU model's selector and the GPU toleration added to them;
    ``container_limits`` / ``container_requests`` fill in what a role names none of."""

    namespace: str
    user_label: str
    image: str
    program: str
    job_dir: str
    user_dir: str
    gpu_model: str | None = None
    shared_volume: Mapping[str, Any] | None = None
    shared_mount: str = SHARED_MOUNT_PATH
    user_subpath: str = ""
    datasets_subpath: str | None = None
    port: int = TF_PORT
    node_selector: Mapping[str, str] | None = None
    tolerations: list | dict | None = None
    #: the operator's container defaults (`gpulab.hub.cluster.kubeobjects.container_defaults`'
    #: checked pair) for what a role names none of
    container_limits: Mapping[str, str] | None = None
    container_requests: Mapping[str, str] | None = None


def job_labels(*, user_label: str, job: str, role: str | None = None) -> dict[str, str]:
    labels = {**MANAGED_BY, **COMPONENT, USER_LABEL: user_label, JOB_LABEL: job}
    if role:
        labels[ROLE_LABEL] = role
    return labels


def role_job_name(job: str, role: str) -> str:
    return f"{job}-{role}"


def replica_host(*, job: str, role: str, index: int, namespace: str) -> str:
    """The stable DNS name of one replica: ``<job>-<role>-<index>.<job>.<namespace>.svc``."""
    return f"{job}-{role}-{index}.{job}.{namespace}.svc"


def jobset_replica_host(*, job: str, role: str, index: int, namespace: str) -> str:
    """The stable DNS name of one replica of a JobSet:
    ``<job>-<role>-0-<index>.<job>.<namespace>.svc``. JobSet names the one Job of each
    replicated job ``<jobset>-<role>-0``, its Indexed pods take the host name
    ``<Job>-<index>``, and JobSet's headless Service (DNS host names on) is named after it."""
    return f"{job}-{role}-0-{index}.{job}.{namespace}.svc"


def tf_cluster(*, spec: JobSpec, namespace: str, port: int = TF_PORT,
               host=replica_host) -> dict[str, list[str]]:
    """``TF_CONFIG``'s cluster: every role but the evaluator, by stable host name (``host``:
    `replica_host` for the Jobs and Service gpulab makes, `jobset_replica_host` for a JobSet)."""
    return {role: [f"{host(job=spec.name, role=role, index=i, namespace=namespace)}:{port}"
                   for i in range(spec.count(role))]
            for role in ROLES if role != "evaluator" and spec.count(role)}


def tf_config_template(*, cluster: Mapping[str, list[str]], role: str) -> str:
    """``TF_CONFIG`` with the task index left as ``$(GPULAB_TASK_INDEX)`` for the kubelet."""
    return (f'{{"cluster": {json.dumps(cluster, sort_keys=False)}, '
            f'"task": {{"type": "{role}", "index": $({INDEX_ENV})}}}}')


def _resources(spec: JobSpec, role: str) -> dict[str, dict[str, str]]:
    res = spec.resources.get(role)
    out: dict[str, dict[str, str]] = {}
    if res is None:
        return out
    if res.cpu is not None:
        out.setdefault("requests", {})["cpu"] = f"{res.cpu:g}"
        out.setdefault("limits", {})["cpu"] = f"{res.cpu:g}"
    if res.memory is not None:
        out.setdefault("requests", {})["memory"] = res.memory
        out.setdefault("limits", {})["memory"] = res.memory
    if res.gpus:
        out.setdefault("limits", {})[GPU_RESOURCE] = str(res.gpus)
    return out


def _pod_spec(*, spec: JobSpec, role: str, where: Placement, env: list[dict]) -> dict:
    gpus = spec.gpus_of(role)
    shared = server_pod_settings(
        gpus=gpus, tolerations=where.tolerations or [], volumes=[], volume_mounts=[],
        environment={}, home=None, shared_volume=where.shared_volume,
        shared_mount=where.shared_mount, user_subpath=where.user_subpath,
        datasets_subpath=where.datasets_subpath)
    container: dict[str, Any] = {
        "name": CONTAINER,
        "image": where.image,
        "command": [*REPLICA_COMMAND, escape_expansion(where.program),
                    *(escape_expansion(a) for a in spec.args)],
        "workingDir": where.user_dir,
        "env": [*env, *({"name": k, "value": v} for k, v in shared["environment"].items()
                        if k not in {e["name"] for e in env}),
                *({"name": k, "value": escape_expansion(v)} for k, v in spec.env.items())],
        "ports": [{"name": "tf", "containerPort": where.port}],
        "resources": with_container_defaults(
            _resources(spec, role), limits=where.container_limits or {},
            requests=where.container_requests or {}),
        "securityContext": {"allowPrivilegeEscalation": False, "privileged": False},
    }
    if shared["volume_mounts"]:
        container["volumeMounts"] = shared["volume_mounts"]
    pod: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        # the container runtime's seccomp filter, as for notebook pods (issue 33)
        "securityContext": with_runtime_default_seccomp(None),
        "containers": [container],
    }
    if shared["volumes"]:
        pod["volumes"] = shared["volumes"]
    if shared["tolerations"]:
        pod["tolerations"] = shared["tolerations"]
    selector = dict(where.node_selector or {})
    if gpus and where.gpu_model:
        selector[GPU_MODEL_LABEL] = where.gpu_model
    if selector:
        pod["nodeSelector"] = selector
    return pod


def pod_failure_policy(*, strategy: str, role: str) -> dict:
    """When a failed pod is not worth a retry. A pod evicted or preempted (condition
    ``DisruptionTarget``) does not count against the retries; a bad configuration (the
    runtime's exit 2) fails the job at once, as does the chief of a parameter-server job
    failing with its own error (exit 1: the program raised), as in the local backend. Any
    other failure (a worker's error, a lost cluster, exit 75) is retried while
    ``backoffLimit`` lasts."""
    fatal = [1, 2] if (strategy == "parameter-server" and role == "chief") else [2]
    return {"rules": [
        {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
        {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                              "values": fatal}},
    ]}


def make_training_job_objects(spec: JobSpec, where: Placement, *,
                              parent_uid: str | None = None) -> list[dict]:
    """``[service, *jobs]``: the parent Service, then one Indexed Job per role (ROLES order).
    With ``parent_uid`` (the created Service's uid) every Job names the Service as its owner.
    """
    namespace, user_label, port = where.namespace, where.user_label, where.port
    labels = job_labels(user_label=user_label, job=spec.name)
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": spec.name, "namespace": namespace, "labels": labels},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {USER_LABEL: user_label, JOB_LABEL: spec.name},
            "ports": [{"name": "tf", "port": port, "targetPort": port}],
        },
    }
    owner = ([{"apiVersion": "v1", "kind": "Service", "name": spec.name, "uid": parent_uid}]
             if parent_uid else None)
    objects = [service]
    for role, pod, role_labels in _role_pods(spec=spec, where=where, host=replica_host):
        pod["subdomain"] = spec.name
        job_spec = _role_job_spec(spec=spec, role=role, pod=pod, labels=role_labels)
        meta: dict[str, Any] = {"name": role_job_name(spec.name, role), "namespace": namespace,
                                "labels": role_labels}
        if owner:
            meta["ownerReferences"] = owner
        objects.append({"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
                        "spec": job_spec})
    return objects


def _role_job_spec(*, spec: JobSpec, role: str, pod: dict, labels: dict) -> dict[str, Any]:
    """The Indexed Job of one role: one pod per replica, replaced on failure within the
    spec's retries (`pod_failure_policy` says what is not worth one), ``max_runtime`` as the
    deadline."""
    n = spec.count(role)
    job_spec: dict[str, Any] = {
        "completionMode": "Indexed",
        "completions": n,
        "parallelism": n,
        "backoffLimit": spec.retries,
        "podReplacementPolicy": "Failed",
        "podFailurePolicy": pod_failure_policy(strategy=spec.strategy, role=role),
        "template": {"metadata": {"labels": labels}, "spec": pod},
    }
    if spec.is_cluster and role == "ps":
        # a parameter server holds the variables the coordinator trains: a new one would
        # serve none of them, so a lost ps fails the cluster (the kernel restores from its
        # checkpoint into a new cluster) instead of coming back empty under the same name
        job_spec["backoffLimit"] = 0
        del job_spec["podFailurePolicy"]
    if spec.max_runtime:
        job_spec["activeDeadlineSeconds"] = spec.max_runtime
    return job_spec


def _role_env(*, spec: JobSpec, cluster: Mapping[str, list[str]], role: str, job_dir: str,
              user_dir: str) -> list[dict]:
    kind = [{"name": KIND_ENV, "value": spec.kind}] if spec.is_cluster else []
    return [
        {"name": INDEX_ENV, "valueFrom": {"fieldRef": {"fieldPath": _INDEX_FIELD}}},
        {"name": "TF_CONFIG", "value": tf_config_template(cluster=cluster, role=role)},
        {"name": "GPULAB_STRATEGY", "value": spec.strategy},
        {"name": "GPULAB_JOB_NAME", "value": spec.name},
        {"name": "GPULAB_JOB_DIR", "value": job_dir},
        {"name": "GPULAB_USER_DIR", "value": user_dir},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
        *kind,
    ]


def _role_pods(*, spec: JobSpec, where: Placement, host):
    """``(role, pod spec, role labels)`` of each role the spec has, in ROLES order, their
    ``TF_CONFIG`` naming the replicas by ``host`` (`replica_host`, `jobset_replica_host`)."""
    cluster = tf_cluster(spec=spec, namespace=where.namespace, port=where.port, host=host)
    for role in ROLES:
        if not spec.count(role):
            continue
        env = _role_env(spec=spec, cluster=cluster, role=role, job_dir=where.job_dir,
                        user_dir=where.user_dir)
        pod = _pod_spec(spec=spec, role=role, where=where, env=env)
        yield role, pod, job_labels(user_label=where.user_label, job=spec.name, role=role)


def jobset_success_roles(spec: JobSpec) -> list[str]:
    """The replicated jobs whose completion is the job's success: the chief of a
    parameter-server job (its ps and workers serve it and never end by themselves); the
    workers of a multi-worker job (an evaluator runs beside them); all of a cluster (its
    servers end only when it is stopped)."""
    if spec.is_cluster:
        return ["ps", "worker"]
    return ["chief"] if spec.strategy == "parameter-server" else ["worker"]


def make_training_jobset(spec: JobSpec, where: Placement, *, queue_name: str | None = None,
                         priority_class: str | None = None) -> dict:
    """The job as one JobSet (``jobset.x-k8s.io/v1alpha2``): a replicated job per role (one
    Indexed Job each, as `make_training_job_objects` makes them), JobSet's own headless
    Service for the stable host names in ``TF_CONFIG`` (`jobset_replica_host`), and:

    - ``successPolicy``: done when the roles of `jobset_success_roles` have all completed;
    - ``failurePolicy``: a role's Job that fails is not retried as a whole (its pods had the
      spec's ``retries`` already, and a bad configuration or a parameter-server chief's own
      error fails at once, `pod_failure_policy`), except the parameter servers: a ps that is
      lost for good restarts the whole JobSet (fresh servers, the chief restores its last
      checkpoint), within ``retries`` restarts;
    - with ``queue_name`` (the person's Kueue LocalQueue), created suspended with the label
      ``kueue.x-k8s.io/queue-name``: Kueue admits it whole, then unsuspends it; with
      ``priority_class``, Kueue's WorkloadPriorityClass of it (label
      ``kueue.x-k8s.io/priority-class``).

    `gpulab.hub.jobs.kueue.KueueJobBackend` creates it; `KubeJobBackend` (no Kueue) creates
    `make_training_job_objects`."""
    labels = job_labels(user_label=where.user_label, job=spec.name)
    if queue_name:
        labels[QUEUE_NAME_LABEL] = queue_name
    if priority_class:
        labels[PRIORITY_CLASS_LABEL] = priority_class
    replicated = [{
        "name": role,
        "replicas": 1,
        "template": {"metadata": {"labels": role_labels},
                     "spec": _role_job_spec(spec=spec, role=role, pod=pod, labels=role_labels)},
    } for role, pod, role_labels in _role_pods(spec=spec, where=where, host=jobset_replica_host)]
    rules: list[dict[str, Any]] = []
    if spec.is_cluster:
        # the coordinator is the notebook kernel: fresh servers would not hold its variables
        rules.append({"name": "lostParameterServer", "action": "FailJobSet",
                      "targetReplicatedJobs": ["ps"]})
    elif spec.count("ps"):
        rules.append({"name": "lostParameterServer", "action": "RestartJobSet",
                      "targetReplicatedJobs": ["ps"],
                      "onJobFailureReasons": ["BackoffLimitExceeded"]})
    rules.append({"name": "replicaFailed", "action": "FailJobSet"})
    return {
        "apiVersion": JOBSET_API,
        "kind": "JobSet",
        "metadata": {"name": spec.name, "namespace": where.namespace, "labels": labels},
        "spec": {
            "suspend": bool(queue_name),
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "replicatedJobs": replicated,
            "successPolicy": {"operator": "All",
                              "targetReplicatedJobs": jobset_success_roles(spec)},
            "failurePolicy": {"maxRestarts": 0 if spec.is_cluster else spec.retries,
                              "rules": rules},
        },
    }


def job_network_policy_name(job: str) -> str:
    """``<job>-replicas``: never the name of a namespace policy (`USER_PODS_POLICY
    <gpulab.hub.cluster.kubeobjects.USER_PODS_POLICY>` and `SERVERS_POLICY
    <gpulab.hub.cluster.kubeobjects.SERVERS_POLICY>` do not end so) nor of another job's."""
    return f"{job}-replicas"


def _policy_meta(*, name: str, job: str, namespace: str, user_label: str,
                 parent_uid: str | None, parent: tuple[str, str]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace,
                            "labels": job_labels(user_label=user_label, job=job)}
    if parent_uid:
        meta["ownerReferences"] = [{"apiVersion": parent[0], "kind": parent[1], "name": job,
                                    "uid": parent_uid}]
    return meta


def _replica_selector(*, user_label: str, job: str) -> dict:
    return {"matchLabels": {USER_LABEL: user_label, JOB_LABEL: job}}


def make_job_network_policy(*, job: str, namespace: str, user_label: str,
                            parent_uid: str | None = None, parent: tuple[str, str] = ("v1", "Service"),
                            coordinator: str | None = None, port: int = TF_PORT) -> dict:
    """The NetworkPolicy of one training job: its replicas (pods labelled with the user and
    the job) accept connections only from replicas of the same job and open them only to
    those (any port: gRPC, and NCCL's own ports between GPU workers). With ``parent_uid``
    (the job's ``parent``: its Service, or its JobSet ``(JOBSET_API, "JobSet")``) it goes
    with the job.

    With ``coordinator`` (a cluster's: the ``component`` label of notebook server pods,
    KubeSpawner's ``component_label``) the replicas also accept connections on ``port`` (their
    TF servers') from the notebook pods of their namespace, which is the owner's: the kernel
    that coordinates them. No other pod, namespace or port."""
    def replicas() -> dict:
        return _replica_selector(user_label=user_label, job=job)

    ingress: list[dict[str, Any]] = [{"from": [{"podSelector": replicas()}]}]
    if coordinator:
        ingress.append({"from": [{"podSelector": {"matchLabels": {COMPONENT_LABEL: coordinator}}}],
                        "ports": [{"protocol": "TCP", "port": port}]})
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _policy_meta(name=job_network_policy_name(job), job=job, namespace=namespace,
                                 user_label=user_label, parent_uid=parent_uid, parent=parent),
        "spec": {
            "podSelector": replicas(),
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": [{"to": [{"podSelector": replicas()}]}],
        },
    }


def cluster_coordinator_policy_name(job: str) -> str:
    """``<cluster>-coordinator``: no job's policy (those end in ``-replicas``) nor a
    namespace policy is so named."""
    return f"{job}-coordinator"


def make_cluster_coordinator_policy(*, job: str, namespace: str, user_label: str,
                                    coordinator: str, port: int = TF_PORT,
                                    parent_uid: str | None = None,
                                    parent: tuple[str, str] = (JOBSET_API, "JobSet")) -> dict:
    """The NetworkPolicy that lets the owner's notebook pods (``component: <coordinator>``
    in the person's namespace) open connections to their cluster's replicas on ``port``,
    beyond what the namespace's policy lets every pod open (DNS, the hub). An egress-only
    policy: it adds nothing to what reaches the notebook pods. Goes with the cluster
    (``parent_uid``)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _policy_meta(name=cluster_coordinator_policy_name(job), job=job,
                                 namespace=namespace, user_label=user_label,
                                 parent_uid=parent_uid, parent=parent),
        "spec": {
            "podSelector": {"matchLabels": {COMPONENT_LABEL: coordinator}},
            "policyTypes": ["Egress"],
            "egress": [{"to": [{"podSelector": _replica_selector(user_label=user_label, job=job)}],
                        "ports": [{"protocol": "TCP", "port": port}]}],
        },
    }


def make_tfjob(spec: JobSpec, where: Placement) -> dict:
    """The job as a Kubeflow ``TFJob`` (v1): replica types Chief (not Master), PS, Worker,
    Evaluator; ``runPolicy.cleanPodPolicy: Running`` (running pods are removed when the job
    ends), ``backoffLimit`` from ``retries``, ``activeDeadlineSeconds`` from ``max_runtime``.
    The operator sets ``TF_CONFIG``; restart policy ``ExitCode`` retries the runtime's
    retryable exits (signals, 75 lost cluster) but not a program error."""
    labels = job_labels(user_label=where.user_label, job=spec.name)
    replica_specs = {}
    for role in ROLES:
        n = spec.count(role)
        if not n:
            continue
        env = [
            {"name": "GPULAB_STRATEGY", "value": spec.strategy},
            {"name": "GPULAB_JOB_NAME", "value": spec.name},
            {"name": "GPULAB_JOB_DIR", "value": where.job_dir},
            {"name": "GPULAB_USER_DIR", "value": where.user_dir},
            {"name": "PYTHONUNBUFFERED", "value": "1"},
        ]
        pod = _pod_spec(spec=spec, role=role, where=where, env=env)
        pod["containers"][0]["ports"] = [{"name": "tfjob-port", "containerPort": where.port}]
        del pod["restartPolicy"]  # the operator's restartPolicy below decides
        replica_specs[_TFJOB_ROLES[role]] = {
            "replicas": n,
            "restartPolicy": "ExitCode",
            "template": {"metadata": {"labels": job_labels(user_label=where.user_label,
                                                           job=spec.name, role=role)},
                         "spec": pod},
        }
    run_policy: dict[str, Any] = {"cleanPodPolicy": "Running", "backoffLimit": spec.retries}
    if spec.max_runtime:
        run_policy["activeDeadlineSeconds"] = spec.max_runtime
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "TFJob",
        "metadata": {"name": spec.name, "namespace": where.namespace, "labels": labels},
        "spec": {"runPolicy": run_policy, "tfReplicaSpecs": replica_specs},
    }


def make_source_configmap(*, spec: JobSpec, namespace: str, user_label: str,
                          parent_uid: str | None = None,
                          parent: tuple[str, str] = ("v1", "Service")) -> dict:
    """The ConfigMap ``<job>-source`` holding the code of a spec given as ``source``: the
    entry point as ``source.py`` and the spec's ``files`` beside it (plain names, valid keys:
    `gpulab.hub.jobs.spec.FILE_NAME_RE`), all in `SOURCE_MOUNT`, the entry point's folder and
    so on the replicas' import path."""
    meta: dict[str, Any] = {"name": f"{spec.name}-source", "namespace": namespace,
                            "labels": job_labels(user_label=user_label, job=spec.name)}
    if parent_uid:
        meta["ownerReferences"] = [{"apiVersion": parent[0], "kind": parent[1],
                                    "name": spec.name, "uid": parent_uid}]
    return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": meta,
            "data": {"source.py": spec.source or "", **spec.files}}


def mount_source(pod: dict, *, job: str) -> dict:
    """``pod`` (a pod spec) with the job's source ConfigMap mounted at `SOURCE_MOUNT`."""
    pod.setdefault("volumes", []).append({"name": "source", "configMap": {"name": f"{job}-source"}})
    pod["containers"][0].setdefault("volumeMounts", []).append(
        {"name": "source", "mountPath": SOURCE_MOUNT, "readOnly": True})
    return pod
