"""The manifests beside the helm values (helm-values/*.yaml) against the real API server: every
field known to Kubernetes' schemas (server-side apply with strict field validation), objects
created, and the shared volume's claim bound to its NFS volume by the controller manager."""

import uuid
from pathlib import Path

import pytest
import yaml

from .controlplane import KubectlError, wait_until

pytestmark = pytest.mark.cluster

HELM = Path(__file__).resolve().parents[2] / "helm-values"


def docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((HELM / name).read_text()) if d]


def apply_strict(cp, objects: list[dict], *, dry_run: bool = False) -> str:
    text = yaml.safe_dump_all(objects)
    args = ["apply", "--server-side", "--validate=strict", "--field-manager=gpulab-test", "-f", "-"]
    if dry_run:
        # other tests on the same control plane apply the same objects with their own
        # field manager; a dry run validates without taking their fields over
        args += ["--dry-run=server", "--force-conflicts"]
    return cp.kubectl(*args, input=text).stdout


def test_strict_validation_refuses_a_misspelt_field(control_plane, namespace):
    [policy] = docs("networkpolicy-jobs.yaml")
    policy["metadata"]["namespace"] = namespace
    policy["spec"]["podSelectr"] = policy["spec"].pop("podSelector")
    with pytest.raises(KubectlError) as e:
        apply_strict(control_plane, [policy], dry_run=True)
    assert "podSelectr" in e.value.stderr


def test_rbac_validates(control_plane):
    out = apply_strict(control_plane, docs("rbac.yaml"), dry_run=True)
    assert "clusterrole.rbac.authorization.k8s.io/gpulab-hub" in out


def test_shared_volume_claim_binds_to_the_nfs_volume(control_plane, namespace):
    cp = control_plane
    pv, pvc = docs("shared-volume-nfs.yaml")
    assert pv["spec"]["accessModes"] == pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    name = f"gpulab-shared-{uuid.uuid4().hex[:6]}"  # the volume is cluster-wide: one per test
    pv["metadata"]["name"] = pvc["spec"]["volumeName"] = name
    pvc["metadata"]["namespace"] = namespace
    apply_strict(cp, [pv, pvc])
    try:
        path = f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/gpulab-shared"
        wait_until(lambda: cp.api("GET", path)[1].get("status", {}).get("phase") == "Bound",
                   timeout=60, what="the shared claim to be bound")
        _, volume = cp.api("GET", f"/api/v1/persistentvolumes/{name}", expect=(200,))
        assert volume["spec"]["claimRef"]["namespace"] == namespace
        assert volume["spec"]["nfs"] == {"server": "nfs.example.org", "path": "/export/gpulab"}
        assert volume["spec"]["persistentVolumeReclaimPolicy"] == "Retain"
    finally:
        cp.api("DELETE", f"/api/v1/namespaces/{namespace}/persistentvolumeclaims/gpulab-shared")
        cp.api("DELETE", f"/api/v1/persistentvolumes/{name}")


def test_job_network_policy_applies_in_a_user_namespace(control_plane, namespace):
    cp = control_plane
    [policy] = docs("networkpolicy-jobs.yaml")
    assert policy["metadata"]["namespace"] == "gpulab-ann"  # the example user namespace
    policy["metadata"]["namespace"] = namespace
    apply_strict(cp, [policy])
    _, stored = cp.api("GET", f"/apis/networking.k8s.io/v1/namespaces/{namespace}"
                       "/networkpolicies/gpulab-job-replicas", expect=(200,))
    spec = stored["spec"]
    replicas = {"matchExpressions": [{"key": "gpulab.io/job", "operator": "Exists"}]}
    assert spec["podSelector"] == replicas
    assert sorted(spec["policyTypes"]) == ["Egress", "Ingress"]
    # in: only from replicas (a podSelector alone means this namespace)
    assert spec["ingress"] == [{"from": [{"podSelector": replicas}]}]
    # out: to replicas, and to the cluster DNS on port 53 only
    to_replicas, dns = spec["egress"]
    assert to_replicas == {"to": [{"podSelector": replicas}]}
    assert dns["to"][0]["namespaceSelector"]["matchLabels"] == {
        "kubernetes.io/metadata.name": "kube-system"}
    assert sorted((p["protocol"], p["port"]) for p in dns["ports"]) == [("TCP", 53), ("UDP", 53)]
