"""The Kubernetes settings notebook servers and training jobs share: the hub's namespace and
the help of the NetworkPolicy settings of every user namespace."""

from __future__ import annotations

import os

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


HUB_NAMESPACE_HELP = """The namespace of the hub and proxy pods (the z2jh release namespace).
        The NetworkPolicies of the user namespaces let the pods labelled ``component: hub`` or
        ``component: proxy`` there reach notebook servers, and user pods reach the hub pod's
        API (8081) and gpulab service (8002). Default: ``$POD_NAMESPACE`` (set by the chart in
        the hub pod), else the hub's ServiceAccount namespace, else ``default``.
        Example: ``c.KubeGPUSpawner.hub_namespace = "gpulab"``"""

ALLOWED_EGRESS_HELP = """Where else the pods of user namespaces (notebook servers and
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

ALLOWED_SERVER_INGRESS_HELP = """Who else may connect to notebook servers, as NetworkPolicy
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
