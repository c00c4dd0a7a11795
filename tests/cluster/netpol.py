"""Who may connect to whom under a set of NetworkPolicies (networking.k8s.io/v1), as the
Kubernetes documentation defines it, for tests that check policies by what they allow.

The test control plane stores NetworkPolicies but has no network (kwok plays the kubelets), so
no packet can be sent; `allowed` answers what a conforming implementation (Calico, Cilium,
kube-network-policies) lets through:

- a pod is isolated for ingress (egress) when a policy of its namespace selects it with
  ``Ingress`` (``Egress``) among its ``policyTypes`` (default: Ingress, plus Egress when it has
  egress rules); a pod that is not isolated accepts (opens) everything;
- an isolated pod accepts (opens) a connection when a rule of one of the policies selecting it
  matches the peer (``from``/``to``: empty means anyone) and the port (``ports``: empty means
  any);
- a connection goes through when the source may open it and the destination may accept it.

Peers: ``podSelector`` alone means pods of the policy's namespace, ``namespaceSelector`` alone
all pods of the selected namespaces, both together the selected pods of the selected
namespaces, ``ipBlock`` an address outside the cluster (pods are never matched by an
``ipBlock`` here: implementations differ on pod addresses, and gpulab's rules rely on neither).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Endpoint:
    """A pod (``namespace`` and ``labels``; ``ns_labels`` its namespace's labels) or an address
    outside the cluster (``ip`` only)."""

    namespace: str | None = None
    labels: dict = field(default_factory=dict)
    ns_labels: dict = field(default_factory=dict)
    ip: str | None = None

    @staticmethod
    def pod(namespace: str, ns_labels: dict | None = None, **labels: str) -> Endpoint:
        return Endpoint(namespace, dict(labels),
                        {"kubernetes.io/metadata.name": namespace, **(ns_labels or {})})

    @staticmethod
    def address(ip: str) -> Endpoint:
        return Endpoint(ip=ip)


def selects(selector: dict | None, labels: dict) -> bool:
    """A LabelSelector (``{}``: everything) against ``labels``."""
    selector = selector or {}
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values") or []
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": not (key in labels and labels[key] in values),
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def _types(policy: dict) -> list[str]:
    spec = policy["spec"]
    if spec.get("policyTypes"):
        return spec["policyTypes"]
    return ["Ingress", *(["Egress"] if spec.get("egress") else [])]


def _peer_matches(peer: dict, policy_ns: str, other: Endpoint) -> bool:
    if "ipBlock" in peer:
        if other.ip is None or other.namespace is not None:
            return False
        ip = ipaddress.ip_address(other.ip)
        block = peer["ipBlock"]
        return (ip in ipaddress.ip_network(block["cidr"])
                and not any(ip in ipaddress.ip_network(x) for x in block.get("except") or []))
    if other.namespace is None:
        return False
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], other.ns_labels):
            return False
    elif other.namespace != policy_ns:
        return False
    return selects(peer.get("podSelector"), other.labels)


def _port_matches(ports: list | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for p in ports:
        if p.get("protocol", "TCP") != protocol:
            continue
        if "port" not in p:
            return True
        if isinstance(p["port"], int) and p["port"] <= port <= p.get("endPort", p["port"]):
            return True
    return False


def _side_allows(policies: list[dict], pod: Endpoint, other: Endpoint, port: int,
                 protocol: str, kind: str) -> bool:
    if pod.namespace is None:  # an address outside the cluster: no policy of ours applies
        return True
    rules_key, peers_key = ("ingress", "from") if kind == "Ingress" else ("egress", "to")
    selecting = [p for p in policies if p["metadata"]["namespace"] == pod.namespace
                 and kind in _types(p) and selects(p["spec"].get("podSelector"), pod.labels)]
    if not selecting:
        return True
    for p in selecting:
        for rule in p["spec"].get(rules_key) or []:
            peers = rule.get(peers_key) or []
            if ((not peers or any(_peer_matches(x, p["metadata"]["namespace"], other)
                                  for x in peers))
                    and _port_matches(rule.get("ports"), port, protocol)):
                return True
    return False


def allowed(policies: list[dict], src: Endpoint, dst: Endpoint, port: int,
            protocol: str = "TCP") -> bool:
    """Whether ``src`` may open a connection to ``dst`` on ``port`` under ``policies``."""
    return (_side_allows(policies, src, dst, port, protocol, "Egress")
            and _side_allows(policies, dst, src, port, protocol, "Ingress"))
