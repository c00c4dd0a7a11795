"""The Kubernetes objects and pod settings of `KubeGPUSpawner`, built by pure functions.

Every function here takes keyword-only arguments, does no I/O and returns plain dicts (the
JSON the API server receives), so the tests compare them with literal dicts
(tests/unit/test_kubeobjects.py). The spawner only gathers its settings and calls them.

- `make_user_namespace`: a user's namespace, labelled for Pod Security admission.
- `make_gpu_quota`: the ResourceQuota on ``requests.nvidia.com/gpu`` that mirrors a user's quota.
- `container_defaults`, `with_container_defaults`: the operator's CPU, memory and
  ephemeral-storage defaults, written into every container of the pods the hub makes that
  names none of its own.
- `make_user_network_policies`: the NetworkPolicies of a user namespace (nothing reaches a
  user's pods but the hub and the proxy, and their own job's replicas; they reach DNS, the hub,
  the gpulab service and what the operator allows).
- `escape_expansion`: user text as the kubelet must pass it on (no ``$(VAR)`` expansion).
- `server_pod_settings`: the KubeSpawner trait values that add the GPU toleration, the home
  volume, the shared
  storage (the user's own sub-path read-write, the datasets read-only) and its environment.
- `free_gpus_by_node`, `explain_unschedulable`: the scheduler's reasons in plain words.
- `parse_quota_refusal`: the numbers in the API server's 403 "exceeded quota" message.
- `with_runtime_default_seccomp`: a pod security context with the container runtime's default
  seccomp filter where none is chosen.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Iterable, Mapping
from fractions import Fraction
from typing import Any

#: the extended resource of NVIDIA's device plugin, and the label GPU feature discovery gives
#: a node (the model, as `gpulab.hub.quota.queue.normalize_model` reads it)
GPU_RESOURCE = "nvidia.com/gpu"
GPU_MODEL_LABEL = "nvidia.com/gpu.product"

#: the taint GPU node pools carry (and the toleration GPU pods get)
GPU_TOLERATION = {"key": GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}
#: name of the ResourceQuota in each user's namespace
QUOTA_NAME = "gpulab-gpus"
QUOTA_RESOURCE = f"requests.{GPU_RESOURCE}"
#: the resources gpulab gives containers defaults for
LIMITED_RESOURCES = ("cpu", "memory", "ephemeral-storage")
_QUANTITY = re.compile(r"[0-9]+(\.[0-9]+)?(m|k|Ki|M|Mi|G|Gi|T|Ti|P|Pi|E|Ei)?")
MANAGED_BY = {"app.kubernetes.io/managed-by": "gpulab"}
USER_LABEL = "gpulab.io/user"
POD_SECURITY_LEVELS = ("privileged", "baseline", "restricted")

#: NetworkPolicy of every pod of a user namespace: no ingress; egress to DNS, the hub, the
#: gpulab service and the operator's ``allowed_egress``
USER_PODS_POLICY = "gpulab-user-pods"
#: NetworkPolicy of the notebook servers: ingress from the hub and the proxy, on the server port
SERVERS_POLICY = "gpulab-servers"
#: the label z2jh gives its pods (``component: hub`` / ``proxy``), KubeSpawner its servers
COMPONENT_LABEL = "component"
#: the hub pod's ports that user pods may reach: the hub API and the gpulab service (z2jh's
#: hub Service 8081; ``hub.service.extraPorts`` 8002 in helm-values/values.yaml)
HUB_API_PORT = 8081
GPULAB_SERVICE_PORT = 8002
#: the cluster DNS (kube-dns / CoreDNS in kube-system, as z2jh's own policies name it)
DNS_PEER = {
    "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kube-system"}},
    "podSelector": {"matchLabels": {"k8s-app": "kube-dns"}},
}
DNS_PORTS = [{"protocol": "UDP", "port": 53}, {"protocol": "TCP", "port": 53}]
#: the container runtime's default seccomp filter (containerd's, CRI-O's): it refuses the
#: system calls of most container escapes (``unshare`` of a user namespace, ``keyctl``,
#: ``bpf``, ``mount`` ...), which a pod without a profile may make (Kubernetes' default is
#: ``Unconfined`` unless the kubelet runs with ``seccompDefault: true``)
RUNTIME_DEFAULT_SECCOMP = {"type": "RuntimeDefault"}


def with_runtime_default_seccomp(security_context: Mapping[str, Any] | None) -> dict:
    """``security_context`` (a pod's, camelCase keys) with ``seccompProfile`` RuntimeDefault
    where it names no profile; a profile chosen there is kept. A container's own
    ``seccompProfile`` still wins over the pod's (Kubernetes' rule), so an operator who needs
    another profile for the notebook container sets it there or here."""
    context = dict(security_context or {})
    context.setdefault("seccompProfile", dict(RUNTIME_DEFAULT_SECCOMP))
    return context


def escape_expansion(text: str) -> str:
    """``text`` as it must be written in a container's ``command``, ``args`` or ``env`` value
    so that the kubelet, which expands ``$(VAR)`` there, hands the process exactly ``text``.

    The kubelet turns ``$$`` into ``$`` and ``$(NAME)`` into the variable's value, so every
    ``$`` is doubled (doubling only ``$(`` is not enough: ``$$(X)`` would become ``$$$(X)``,
    which the kubelet reads as ``$`` and then the value of ``X``).
    """
    return text.replace("$", "$$")


def make_user_namespace(*, name: str, user_label: str, pod_security: str = "baseline") -> dict:
    """A user's namespace; Pod Security admission enforces ``pod_security`` (latest version).

    ``user_label`` must be a valid label value (KubeSpawner's safe user name is).
    """
    if pod_security not in POD_SECURITY_LEVELS:
        raise ValueError(f"pod_security must be one of {', '.join(POD_SECURITY_LEVELS)}, "
                         f"got {pod_security!r}")
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {
            "name": name,
            "labels": {
                **MANAGED_BY,
                USER_LABEL: user_label,
                "pod-security.kubernetes.io/enforce": pod_security,
                "pod-security.kubernetes.io/enforce-version": "latest",
            },
        },
    }


def make_default_service_account(*, namespace: str, user_label: str) -> dict:
    """The ``default`` ServiceAccount of a user namespace, as the hub applies it with the
    namespace's other objects: every pod there runs as it, and none mounts its token.

    The API server admits a pod only once its ServiceAccount exists; for ``default``, made by
    the controller-manager after the namespace, its admission plugin waits and looks again up
    to 10 times (100-200 ms apart). In a storm of first spawns that wait was most of a
    spawn's own time (bench/scale_kube.py: the plugin's mean 117 ms a create, pod creates
    answered in p50 2.2 s against stock's 0.16 s, 45 % timing out); made here, it is there
    before the pod."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "default", "namespace": namespace,
                     "labels": {**MANAGED_BY, USER_LABEL: user_label}},
        "automountServiceAccountToken": False,
    }


_SUFFIX = {"m": Fraction(1, 1000), "": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12,
           "P": 10**15, "E": 10**18, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
           "Pi": 2**50, "Ei": 2**60}


def quantity(text: str) -> Fraction:
    """The value of a Kubernetes quantity in `_QUANTITY`'s form (``500m``, ``8Gi``, ``2``)."""
    m = _QUANTITY.fullmatch(text)
    if not m:
        raise ValueError(f"{text!r} is not a quantity such as 2, 500m or 8Gi")
    suffix = m.group(2) or ""
    return Fraction(text[:len(text) - len(suffix)]) * _SUFFIX[suffix]


def check_quantities(name: str, values: Mapping[str, Any]) -> dict[str, str]:
    """``values`` (resource -> quantity) as strings, for `LIMITED_RESOURCES` only; ValueError
    naming ``name`` and the bad entry otherwise."""
    out = {}
    for resource, value in values.items():
        if resource not in LIMITED_RESOURCES:
            raise ValueError(f"{name}: {resource!r} is not one of {', '.join(LIMITED_RESOURCES)}")
        text = str(value)
        if isinstance(value, bool) or not _QUANTITY.fullmatch(text):
            raise ValueError(f"{name}: {resource} {value!r} is not a quantity such as 2, 500m "
                             "or 8Gi")
        out[resource] = text
    return out


def container_defaults(*, limits: Mapping[str, Any],
                       requests: Mapping[str, Any]) -> tuple[dict[str, str], dict[str, str]]:
    """The operator's defaults of a container of a user namespace (``default_container_limits``,
    ``default_container_requests``), checked: ``(limits, requests)``, the requests completed
    as a LimitRange's ``defaultRequest`` is (a resource with a default limit and no default
    request reserves its limit). ValueError naming the setting and the bad entry, and for a
    default request above the default limit of its resource (the API server would refuse
    every pod that gets both)."""
    lim = check_quantities("default_container_limits", limits)
    req = check_quantities("default_container_requests", requests)
    for resource, value in req.items():
        if resource in lim and quantity(value) > quantity(lim[resource]):
            raise ValueError(f"default_container_requests: {resource} {value} is above "
                             f"default_container_limits' {lim[resource]}")
    return lim, {**lim, **req}


class ContainerDefaultsError(ValueError):
    """A container's own request of ``resource`` is above the default limit it would get."""

    def __init__(self, resource: str, request: Any, limit: str):
        super().__init__(f"a {resource} request of {request} with no {resource} limit of its "
                         f"own, above the default {resource} limit {limit}")
        self.resource, self.request, self.limit = resource, request, limit


def _own_quantity(value: Any) -> Fraction | None:
    """A container's own quantity (KubeSpawner writes numbers: ``cpu_guarantee`` 0.5,
    ``mem_guarantee`` in bytes), or None where it is no quantity this module reads."""
    if isinstance(value, bool):
        return None
    try:
        return quantity(str(value))
    except ValueError:
        try:
            return Fraction(str(value))  # 1e3, .5
        except ValueError:
            return None


def with_container_defaults(resources: Mapping[str, Any] | None, *,
                            limits: Mapping[str, Any],
                            requests: Mapping[str, Any]) -> dict[str, dict]:
    """One container's ``resources`` (``limits``, ``requests``) with the operator's defaults
    (`container_defaults`' pair) of the resources it names none of, as the LimitRange that
    user namespaces had gave them at admission; every pod the hub makes carries them instead
    (one API request fewer at each spawn and job, bench/scale_kube.py). A resource without a
    limit gets the default limit; one with neither a limit nor a request, the default request
    (with a limit and no request the API server makes the request the limit: nothing is
    added). A request of its own above the default limit, with no limit of its own, is a
    `ContainerDefaultsError`, as the LimitRange's limit made the API server refuse the pod
    (the request is not taken as the limit: a profile's choice of requests would then reserve
    without bound). Other keys are kept; the result is a new dict, without an empty
    ``limits`` or ``requests``."""
    out = dict(resources or {})
    own_limits = dict(out.get("limits") or {})
    lim, req = dict(own_limits), dict(out.get("requests") or {})
    for resource, value in limits.items():
        if resource in lim:
            continue
        own, default = _own_quantity(req.get(resource)), _own_quantity(value)
        if own is not None and default is not None and own > default:
            raise ContainerDefaultsError(resource, req[resource], value)
        lim[resource] = value
    for resource, value in requests.items():
        if resource not in req and resource not in own_limits:
            req[resource] = value
    for key, value in (("limits", lim), ("requests", req)):
        if value:
            out[key] = value
        else:
            out.pop(key, None)
    return out


def make_gpu_quota(*, namespace: str, max_gpus: int, user_label: str, name: str = QUOTA_NAME) -> dict:
    """The ResourceQuota that caps the GPUs requested by all pods in ``namespace``."""
    if not isinstance(max_gpus, int) or isinstance(max_gpus, bool) or max_gpus < 0:
        raise ValueError(f"max_gpus must be a whole number >= 0, got {max_gpus!r}")
    return {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {**MANAGED_BY, USER_LABEL: user_label},
        },
        "spec": {"hard": {QUOTA_RESOURCE: str(max_gpus)}},
    }


def _hub_namespace_selector(hub_namespace: str) -> dict:
    return {"matchLabels": {"kubernetes.io/metadata.name": hub_namespace}}


def make_user_network_policies(
    *,
    namespace: str,
    user_label: str,
    hub_namespace: str,
    server_port: int = 8888,
    server_component: str = "singleuser-server",
    allowed_egress: Iterable[Mapping[str, Any]] = (),
    allowed_server_ingress: Iterable[Mapping[str, Any]] = (),
) -> list[dict]:
    """The NetworkPolicies gpulab keeps in each user namespace: ``[user pods, servers]``.

    - `USER_PODS_POLICY` selects every pod of the namespace (servers, training replicas,
      anything else): no ingress at all, unless another policy below allows it; egress only
      to the cluster DNS (port 53), to the hub pod (``component: hub`` in ``hub_namespace``)
      on the hub API and gpulab service ports, and to ``allowed_egress`` (NetworkPolicy
      egress rules of the operator, e.g. an NFS server reached from inside pods, a package
      mirror, or the internet without the cloud metadata address).
    - `SERVERS_POLICY` lets the hub and the proxy (``component`` ``hub`` or ``proxy`` in
      ``hub_namespace``) reach the notebook servers (KubeSpawner's ``component:
      <server_component>`` pods) on ``server_port``, and, by ``allowed_server_ingress``
      (NetworkPolicy ingress rules of the operator: a hub or proxy outside the cluster), whom
      the operator names; nobody else.

    A training job's replicas reach each other through the job's own policy
    (`gpulab.hub.jobs.kubeobjects.make_job_network_policy`). NetworkPolicies add up: a pod
    accepts what any policy selecting it allows, so these two never open replicas to others.
    """
    rules = _policy_rules("allowed_egress", "egress", "to", allowed_egress)
    ingress_rules = _policy_rules("allowed_server_ingress", "ingress", "from", allowed_server_ingress)
    labels = {**MANAGED_BY, USER_LABEL: user_label}
    hub_ns = _hub_namespace_selector(hub_namespace)
    egress: list[dict] = [
        {"to": [copy.deepcopy(DNS_PEER)], "ports": copy.deepcopy(DNS_PORTS)},
        {"to": [{"namespaceSelector": hub_ns,
                 "podSelector": {"matchLabels": {COMPONENT_LABEL: "hub"}}}],
         "ports": [{"protocol": "TCP", "port": HUB_API_PORT},
                   {"protocol": "TCP", "port": GPULAB_SERVICE_PORT}]},
        *copy.deepcopy(rules),
    ]
    user_pods = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": USER_PODS_POLICY, "namespace": namespace, "labels": dict(labels)},
        "spec": {"podSelector": {}, "policyTypes": ["Ingress", "Egress"], "egress": egress},
    }
    servers = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": SERVERS_POLICY, "namespace": namespace, "labels": dict(labels)},
        "spec": {
            "podSelector": {"matchLabels": {COMPONENT_LABEL: server_component}},
            "policyTypes": ["Ingress"],
            "ingress": [{
                "from": [{"namespaceSelector": _hub_namespace_selector(hub_namespace),
                          "podSelector": {"matchExpressions": [{
                              "key": COMPONENT_LABEL, "operator": "In",
                              "values": ["hub", "proxy"]}]}}],
                "ports": [{"protocol": "TCP", "port": server_port}],
            }, *copy.deepcopy(ingress_rules)],
        },
    }
    return [user_pods, servers]


def _policy_rules(setting: str, kind: str, peers: str, rules: Iterable[Mapping[str, Any]]) -> list[dict]:
    """``rules`` as a list of NetworkPolicy rules, each a mapping with ``peers`` and/or
    ``ports`` (lists) and nothing else; `ValueError` naming ``setting`` otherwise."""
    out = []
    for rule in rules:
        if (not isinstance(rule, Mapping) or not rule or set(rule) - {peers, "ports"}
                or not all(isinstance(v, list) for v in rule.values())):
            raise ValueError(f"{setting}: each rule is a NetworkPolicy {kind} rule with "
                             f"'{peers}' and/or 'ports' (lists), got {rule!r}")
        out.append(dict(rule))
    return out


def _with(value: list | dict, key: str, item: dict) -> list | dict:
    """``value`` (a KubeSpawner list-or-dict trait value) plus ``item``, as a new value."""
    if isinstance(value, dict):
        return {**copy.deepcopy(value), key: item}
    return [*copy.deepcopy(list(value)), item]


def server_pod_settings(
    *,
    gpus: int,
    tolerations: list | dict,
    volumes: list | dict,
    volume_mounts: list | dict,
    environment: Mapping[str, Any],
    home: Mapping[str, str] | None,
    shared_volume: Mapping[str, Any] | None,
    shared_mount: str,
    user_subpath: str,
    datasets_subpath: str | None,
) -> dict[str, Any]:
    """New values of KubeSpawner's ``tolerations``, ``volumes``, ``volume_mounts`` and
    ``environment`` traits for one server, from their current values.

    - ``gpus`` > 0 adds `GPU_TOLERATION` (the GPU count and model themselves come from the
      profile's ``extra_resource_limits`` and ``node_selector``).
    - ``home`` (``{"claim": <PVC name>, "mount": <path>}``; None: none) mounts the user's home
      volume.
    - ``shared_volume`` (a pod volume source, e.g. ``{"persistentVolumeClaim": {"claimName":
      "gpulab-shared"}}``; None or ``{}``, the traits' default: no shared storage) is mounted twice: ``user_subpath``
      read-write at ``<shared_mount>/<user_subpath>`` and ``datasets_subpath`` read-only at
      ``<shared_mount>/<datasets_subpath>``; ``GPULAB_*_DIR`` variables name the folders.
    """
    out: dict[str, Any] = {
        "tolerations": _with(tolerations, "gpulab-gpu", dict(GPU_TOLERATION)) if gpus > 0
        else copy.deepcopy(tolerations),
        "volumes": copy.deepcopy(volumes),
        "volume_mounts": copy.deepcopy(volume_mounts),
        "environment": dict(environment),
    }
    if home:
        out["volumes"] = _with(out["volumes"], "gpulab-home", {
            "name": "home", "persistentVolumeClaim": {"claimName": home["claim"]}})
        out["volume_mounts"] = _with(out["volume_mounts"], "gpulab-home", {
            "name": "home", "mountPath": home["mount"]})
    if not shared_volume:  # an empty source would be defaulted to an emptyDir by the cluster
        return out
    if not user_subpath or user_subpath.startswith("/") or ".." in user_subpath.split("/"):
        raise ValueError(f"user_subpath must be a relative path inside the share, got {user_subpath!r}")
    root = shared_mount.rstrip("/")
    out["volumes"] = _with(out["volumes"], "gpulab-shared", {"name": "gpulab-shared", **shared_volume})
    out["volume_mounts"] = _with(out["volume_mounts"], "gpulab-shared-user", {
        "name": "gpulab-shared", "mountPath": f"{root}/{user_subpath}", "subPath": user_subpath,
    })
    env = {"GPULAB_SHARED_DIR": root, "GPULAB_USER_DIR": f"{root}/{user_subpath}"}
    if datasets_subpath:
        out["volume_mounts"] = _with(out["volume_mounts"], "gpulab-shared-datasets", {
            "name": "gpulab-shared", "mountPath": f"{root}/{datasets_subpath}",
            "subPath": datasets_subpath, "readOnly": True,
        })
        env["GPULAB_DATASETS_DIR"] = f"{root}/{datasets_subpath}"
    out["environment"].update(env)
    return out


# --------------------------------------------------------------------------- plain words


def _quantity(value: Any) -> int:
    try:
        return int(str(value))
    except ValueError:
        return 0


def free_gpus_by_node(*, nodes: Iterable[Mapping], pods: Iterable[Mapping],
                      model: str | None = None) -> dict[str, int]:
    """Free GPUs per schedulable GPU node (of ``model`` when given): allocatable minus the
    GPU requests of the pods bound to it that have not finished."""
    free: dict[str, int] = {}
    for n in nodes:
        meta, spec = n.get("metadata", {}), n.get("spec", {})
        if spec.get("unschedulable"):
            continue
        if model and meta.get("labels", {}).get(GPU_MODEL_LABEL) != model:
            continue
        total = _quantity(n.get("status", {}).get("allocatable", {}).get(GPU_RESOURCE, 0))
        if total > 0:
            free[meta["name"]] = total
    for p in pods:
        node = p.get("spec", {}).get("nodeName")
        if node not in free or p.get("status", {}).get("phase") in ("Succeeded", "Failed"):
            continue
        for c in p["spec"].get("containers", []):
            res = c.get("resources") or {}
            asked = (res.get("requests") or {}).get(GPU_RESOURCE, (res.get("limits") or {}).get(GPU_RESOURCE, 0))
            free[node] -= _quantity(asked)
    return {k: max(v, 0) for k, v in free.items()}


_MISSING_PVC = re.compile(r'persistentvolumeclaim "([^"]+)" not found')


def explain_unschedulable(message: str, *, gpus: int, model: str | None,
                          free_by_node: Mapping[str, int]) -> str | None:
    """The scheduler's FailedScheduling ``message`` in plain words, or None to keep it.

    ``free_by_node``: `free_gpus_by_node` for the pod's GPU model.
    """
    of_model = f" of model {model}" if model else ""
    plural = "s" if gpus != 1 else ""
    m = _MISSING_PVC.search(message)
    if m:
        return f"The storage volume '{m.group(1)}' of this server does not exist; waiting for it."
    if "unbound immediate PersistentVolumeClaims" in message:
        return "A storage volume of this server is not ready yet (not bound to a disk); waiting."
    if gpus > 0 and not free_by_node:
        return f"No node has GPUs{of_model}; waiting (ask an admin which GPU models the cluster has)."
    if gpus > 0 and f"Insufficient {GPU_RESOURCE}" in message:
        most = max(free_by_node.values())
        return (f"No node has {gpus} free GPU{plural}{of_model} "
                f"(most free on one node: {most}); waiting.")
    return None


_QUOTA_PART = re.compile(r"(requested|used|limited): " + re.escape(QUOTA_RESOURCE) + r"=(\d+)")


def parse_quota_refusal(message: str) -> dict[str, int] | None:
    """``{"requested": r, "used": u, "limited": l}`` for the GPUs in an API server message
    ``exceeded quota: <name>, requested: requests.nvidia.com/gpu=3, used: ..., limited: ...``;
    None when the message is not a GPU quota refusal."""
    if "exceeded quota" not in message:
        return None
    found = {k: int(v) for k, v in _QUOTA_PART.findall(message)}
    return found if {"requested", "used", "limited"} <= set(found) else None
