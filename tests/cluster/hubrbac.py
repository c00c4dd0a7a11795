"""helm-values/rbac.yaml as the cluster tests apply it: for a hub ServiceAccount in the tests'
own namespace instead of the release namespace ``gpulab``, in the binding's subject and in the
admission policy that limits the hub to the namespaces gpulab owns."""

from __future__ import annotations

from pathlib import Path

import yaml

from .controlplane import wait_until

RBAC = Path(__file__).resolve().parents[2] / "helm-values" / "rbac.yaml"
#: the hub's identity as rbac.yaml names it (the z2jh release namespace "gpulab")
HUB_USER = "system:serviceaccount:gpulab:hub"
POLICY = "gpulab-hub-owned-namespaces"


def hub_rbac_docs(namespace: str) -> list[dict]:
    """The objects of rbac.yaml for ServiceAccount ``hub`` in ``namespace``."""
    docs = [d for d in yaml.safe_load_all(RBAC.read_text()) if d]
    user = f"system:serviceaccount:{namespace}:hub"
    for d in docs:
        for s in d.get("subjects", []):
            s["namespace"] = namespace
        for condition in d.get("spec", {}).get("matchConditions", []):
            assert HUB_USER in condition["expression"], condition
            condition["expression"] = condition["expression"].replace(HUB_USER, user)
    assert user in str(docs), f"rbac.yaml's admission policy should match {HUB_USER}"
    return docs


def hub_kubeconfig(cp, namespace: str) -> str:
    """Apply rbac.yaml for ServiceAccount ``namespace/hub`` and return its kubeconfig once the
    admission policy is in force (a new policy takes a moment to reach the API server's
    admission chain): from then on the hub cannot write outside gpulab's namespaces."""
    if cp.api("GET", f"/api/v1/namespaces/{namespace}")[0] == 404:
        cp.create_namespace(namespace)
    cp.apply(*hub_rbac_docs(namespace))
    path = cp.service_account_kubeconfig(namespace, "hub")
    probe = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "gpulab-probe"}}

    def refused() -> bool:
        r = cp.kubectl("create", "--dry-run=server", "-n", "kube-system", "-f", "-",
                       input=yaml.safe_dump(probe),
                       kubeconfig=path, check=False)
        return r.returncode != 0 and POLICY in r.stderr

    wait_until(refused, timeout=60, interval=0.5,
               what=f"the admission policy {POLICY} to refuse the hub's writes in kube-system")
    return path
