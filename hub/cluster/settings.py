"""`KubeSettings`: the Kubernetes settings notebook servers and training jobs share, declared
and documented once.

A person's notebook servers (`gpulab.spawner.kube.KubeGPUSpawner`) and training jobs
(`gpulab.hub.jobs.kube.KubeJobBackend`, in the gpulab service) use one namespace, one quota
and one folder, so these settings must be the same for both: both classes inherit them from
here (traitlets reads each class's section of the configuration, so ``c.KubeGPUSpawner.<name>``
reaches the spawner), and the hub hands the spawner's values to the service's job backend
(`gpulab.hub.jobs.kube.backend_settings`). Their defaults are `gpulab.hub.cluster.namespaces`'s
constants.
"""

from __future__ import annotations

import os

from traitlets import Bool, Dict, Float, Integer, List, Unicode, default
from traitlets.config import Configurable

from .kubeobjects import container_defaults
from .namespaces import (
    DATASETS_SUBPATH,
    DEFAULT_CONTAINER_LIMITS,
    DEFAULT_CONTAINER_REQUESTS,
    GPU_QUOTA_SYNC_INTERVAL,
    POD_SECURITY_LEVEL,
    SHARED_MOUNT_PATH,
    USER_SUBPATH_TEMPLATE,
)

#: where a pod finds its own namespace (the hub's, when the hub runs in the cluster)
SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def hub_namespace_default() -> str:
    """The hub's namespace: ``$POD_NAMESPACE`` (z2jh sets it in the hub pod), else the
    namespace of the pod's ServiceAccount, else ``default``."""
    if os.environ.get("POD_NAMESPACE"):
        return os.environ["POD_NAMESPACE"]
    try:
        with open(SA_NAMESPACE_FILE) as f:
            return f.read().strip() or "default"
    except OSError:
        return "default"


_HUB_NAMESPACE_HELP = """The namespace of the hub and proxy pods (the z2jh release namespace).
        The NetworkPolicies of the user namespaces let the pods labelled ``component: hub`` or
        ``component: proxy`` there reach notebook servers, and user pods reach the hub pod's
        API (8081) and gpulab service (8002). Default: ``$POD_NAMESPACE`` (set by the chart in
        the hub pod), else the hub's ServiceAccount namespace, else ``default``.
        Example: ``c.KubeGPUSpawner.hub_namespace = "gpulab"``"""

_ALLOWED_EGRESS_HELP = """Where else the pods of user namespaces (notebook servers and
        training replicas) may connect, as NetworkPolicy egress rules (``to`` and/or
        ``ports``; default ``[]``: only the cluster DNS, the hub and the gpulab service). The
        shared storage needs no rule when the kubelet mounts it (NFS, CephFS volumes); a
        server reached from inside the pods does. Keep the clouds' credential endpoints out
        of any broad rule (link-local ``169.254.0.0/16``, ``100.64.0.0/10``,
        ``168.63.129.16``, ``100.100.100.200``). Example: an NFS server, and the internet
        without those and the cluster's private ranges::

            c.KubeGPUSpawner.allowed_egress = [
                {"to": [{"ipBlock": {"cidr": "10.0.0.5/32"}}],
                 "ports": [{"protocol": "TCP", "port": 2049}]},
                {"to": [{"ipBlock": {"cidr": "0.0.0.0/0",
                                     "except": ["169.254.0.0/16", "100.64.0.0/10",
                                                "168.63.129.16/32", "100.100.100.200/32",
                                                "10.0.0.0/8"]}}]},
            ]
        """

_ALLOWED_SERVER_INGRESS_HELP = """Who else may connect to notebook servers, as NetworkPolicy
        ingress rules (``from`` and/or ``ports``) added to the servers' policy of every user
        namespace (default ``[]``: only the hub and proxy pods of ``hub_namespace``, on the
        server's port). For a hub or proxy that does not run in a pod of the cluster (its
        address then matches no pod selector). A rule without ``from`` lets anyone in. Example:
        a proxy at 10.0.0.7::

            c.KubeGPUSpawner.allowed_server_ingress = [
                {"from": [{"ipBlock": {"cidr": "10.0.0.7/32"}}],
                 "ports": [{"protocol": "TCP", "port": 8888}]},
            ]
        """


class KubeSettings(Configurable):
    """Settings of the user namespaces, shared by notebook servers and training jobs: set
    them on ``c.KubeGPUSpawner`` (the gpulab service's ``c.KubeJobBackend`` takes each from
    there unless set on it for jobs alone; ``kueue``, ``kueue_gpus`` and ``kueue_gpu_models``
    are one value for both).

    A mixin of `KubeGPUSpawner <gpulab.spawner.kube.KubeGPUSpawner>` and `KubeJobBackend
    <gpulab.hub.jobs.kube.KubeJobBackend>`; its traits' help is written here once.
    """

    pod_security_level = Unicode(
        POD_SECURITY_LEVEL,
        help="""Pod Security Standard enforced in each user namespace (label
        ``pod-security.kubernetes.io/enforce``): ``baseline`` (default: no privileged pods,
        host paths or host namespaces) or ``restricted``. The label is applied at every spawn
        and when the job backend prepares a namespace.
        Example: ``c.KubeGPUSpawner.pod_security_level = "restricted"``
        """,
    ).tag(config=True)

    default_container_limits = Dict(
        DEFAULT_CONTAINER_LIMITS,
        help="""What a container of a user namespace may use when it names no limit of its
        own, written into every pod the hub makes (notebook servers, and the operator's
        ``init_containers``, ``extra_containers`` and ``modify_pod_hook``'s containers there,
        and training replicas): servers whose profile sets no ``cpu_limit`` / ``mem_limit``,
        replicas whose role sets no ``cpu`` / ``memory``. A server whose own request is higher
        and that sets no limit is refused in words (the API server would refuse its pod). Keys ``cpu``,
        ``memory``, ``ephemeral-storage`` (the container's writable layer, logs and
        ``emptyDir``: the kubelet evicts a pod over it); ``{}``: no defaults. Default
        ``{"cpu": "2", "memory": "8Gi", "ephemeral-storage": "20Gi"}``: without them one
        person's 32 unbounded replicas could take a node's memory and disk and get other
        people's pods evicted. Example:
        ``c.KubeGPUSpawner.default_container_limits = {"cpu": "4", "memory": "16Gi",
        "ephemeral-storage": "50Gi"}``
        """,
    ).tag(config=True)

    default_container_requests = Dict(
        DEFAULT_CONTAINER_REQUESTS,
        help="""What such a container reserves on its node when it names neither a request
        nor a limit of its own (each at most the limit above; a resource with a limit above and
        none here reserves that limit, as a LimitRange's ``defaultRequest``). Default ``{"cpu": "100m", "memory":
        "512Mi", "ephemeral-storage": "1Gi"}``: small, so that idle notebooks and parameter
        servers do not hold nodes from others. With Kueue these count against its pool (cpu,
        memory and ephemeral-storage are covered there). Example:
        ``c.KubeGPUSpawner.default_container_requests = {"cpu": "1", "memory": "4Gi"}``
        """,
    ).tag(config=True)

    shared_volume = Dict(
        None,
        allow_none=True,
        help="""The team's shared ReadWriteMany storage, as a pod volume source, or ``{}``
        (default) for none. Each server and training replica mounts the user's own sub-path
        (``user_subpath_template``) read-write and ``datasets_subpath`` read-only under
        ``shared_mount_path``; jobs run in ``<folder>/jobs/<job>``. Without it, job specs
        with ``source`` work and ``script`` paths are inside the image.
        Example (NFS, allowed by the ``baseline`` Pod Security level)::

            c.KubeGPUSpawner.shared_volume = {"nfs": {"server": "nfs.example.org", "path": "/gpulab"}}
        """,
    ).tag(config=True)

    shared_mount_path = Unicode(
        SHARED_MOUNT_PATH,
        help="""Where the shared storage's folders appear in servers and replicas (default
        ``/gpulab/shared``): ``<path>/users/<name>`` and ``<path>/datasets``, also given to the
        server as ``GPULAB_USER_DIR`` and ``GPULAB_DATASETS_DIR``.""",
    ).tag(config=True)

    user_subpath_template = Unicode(
        USER_SUBPATH_TEMPLATE,
        help="""The user's own folder on the shared storage (a sub-path of it; KubeSpawner's
        template fields, default ``users/{username}``). Only this folder is writable.""",
    ).tag(config=True)

    datasets_subpath = Unicode(
        DATASETS_SUBPATH,
        help="""The shared datasets folder on the shared storage, mounted read-only (default
        ``datasets``; '' for none).""",
    ).tag(config=True)

    hub_namespace = Unicode(help=_HUB_NAMESPACE_HELP).tag(config=True)

    @default("hub_namespace")
    def _hub_namespace_default(self):
        return hub_namespace_default()

    allowed_egress = List(Dict(), help=_ALLOWED_EGRESS_HELP).tag(config=True)
    allowed_server_ingress = List(Dict(), help=_ALLOWED_SERVER_INGRESS_HELP).tag(config=True)

    gpu_quota_sync_interval = Float(
        GPU_QUOTA_SYNC_INTERVAL,
        help=f"""Seconds between two comparisons of the ledger's quotas with the users'
        ResourceQuotas (default {GPU_QUOTA_SYNC_INTERVAL:g}); an admin's quota edit reaches the
        cluster within that (in the hub and in the gpulab service).
        Example: ``c.KubeGPUSpawner.gpu_quota_sync_interval = 10``""",
    ).tag(config=True)

    kueue = Bool(
        False,
        help="""The cluster runs Kueue (v0.17, with JobSet v0.11 for jobs; see the deploy
        guide), which queues and admits gpulab's GPU work. A GPU server's pod then carries
        the person's LocalQueue
        (``kueue.x-k8s.io/queue-name``): it waits, gated, until Kueue admits it within their
        quota (the progress page says why it waits; ``start_timeout`` bounds the wait), and
        the ledger records its GPUs once it runs. Its person's Kueue objects are made from
        the ledger before the pod. User namespaces get no GPU ResourceQuota (it would refuse
        the pods of preemptible work that borrows idle GPUs). Each training job is one
        JobSet in the person's LocalQueue, admitted whole when their quota allows, and the
        ledger follows Kueue's admissions (`gpulab.hub.jobs.kueue.KueueJobBackend`). Default
        False: notebook pods and Indexed Jobs, admitted by the ledger after a capacity check.
        One value for servers and jobs: a different ``c.KubeJobBackend.kueue`` is refused.
        Example: ``c.KubeGPUSpawner.kueue = True``""",
    ).tag(config=True)

    kueue_gpus = Integer(
        None,
        allow_none=True,
        min=0,
        help="""With ``kueue``: the GPUs gpulab's work may take on the cluster all together
        (the pool of Kueue's root cohort ``gpulab``, which every person's queues borrow from,
        each up to their quota). None (default): all GPUs of the cluster's schedulable nodes,
        counted again as nodes come and go. Set it lower to leave GPUs to work outside gpulab.
        The hub's and the service's quota mirrors write the same pool: a different
        ``c.KubeJobBackend.kueue_gpus`` is refused.
        Example: ``c.KubeGPUSpawner.kueue_gpus = 16``""",
    ).tag(config=True)

    kueue_gpu_models = Bool(
        False,
        help="""With ``kueue``: split the pool by GPU model (the nodes' label
        ``nvidia.com/gpu.product``), one ResourceFlavor per model, so that work asking for a
        model (a profile's or a job's node selector) is admitted only when that model's GPUs
        are free, and work asking for none is placed on a model that has them; a person's
        quota then counts the GPUs of every model together as ``gpulab.io/gpus``. Needs this
        entry in Kueue's configuration (``resources.transformations``)::

            - input: nvidia.com/gpu
              strategy: Retain
              outputs: {gpulab.io/gpus: "1"}

        which applies to every workload of the cluster: only for a Kueue that admits
        gpulab's work alone (another team's ClusterQueues would have to cover
        ``gpulab.io/gpus`` too). Without it the quota holds per model only. Ignored with
        ``kueue_gpus`` (a count of any model). Default False: one pool of any model, where
        work for a model whose nodes are full may be admitted and wait for them.
        The hub's and the service's quota mirrors write the same pool: a different
        ``c.KubeJobBackend.kueue_gpu_models`` is refused.
        Example: ``c.KubeGPUSpawner.kueue_gpu_models = True``""",
    ).tag(config=True)

    def container_defaults(self) -> tuple[dict[str, str], dict[str, str]]:
        """``(limits, requests)`` that containers naming none of their own get
        (`gpulab.hub.cluster.kubeobjects.container_defaults`); ValueError naming the
        setting for a bad one."""
        return container_defaults(limits=self.default_container_limits,
                                  requests=self.default_container_requests)
