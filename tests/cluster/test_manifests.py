"""The manifests beside the helm values (helm-values/*.yaml), and the NetworkPolicies gpulab
makes, against the real API server: every field known to Kubernetes' schemas (server-side apply
with strict field validation; the admission policy's CEL compiles), objects created, and the
shared volume's claim bound to its NFS volume by the controller manager."""

import uuid
from pathlib import Path

import pytest
import yaml

from gpulab.hub.jobs.kubeobjects import make_job_network_policy
from gpulab.hub.cluster.kubeobjects import make_user_network_policies

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


def values_egress() -> list[dict]:
    values = yaml.safe_load((HELM / "values.yaml").read_text())
    return values["hub"]["config"]["KubeGPUSpawner"]["allowed_egress"]


def test_strict_validation_refuses_a_misspelt_field(control_plane, namespace):
    policy = make_job_network_policy(job="j", namespace=namespace, user_label="ann")
    policy["spec"]["podSelectr"] = policy["spec"].pop("podSelector")
    with pytest.raises(KubectlError) as e:
        apply_strict(control_plane, [policy], dry_run=True)
    assert "podSelectr" in e.value.stderr


def test_rbac_validates(control_plane):
    out = apply_strict(control_plane, docs("rbac.yaml"), dry_run=True)
    assert "clusterrole.rbac.authorization.k8s.io/gpulab-hub" in out
    # the API server compiles the policy's CEL when it is made: a typo is refused
    assert "validatingadmissionpolicy.admissionregistration.k8s.io/gpulab-hub-owned-namespaces" in out
    policy = docs("rbac.yaml")[2]
    policy["spec"]["validations"][0]["expression"] += " && variables.nope"
    with pytest.raises(KubectlError) as e:
        apply_strict(control_plane, [policy], dry_run=True)
    assert "nope" in e.value.stderr


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


def test_gpulabs_network_policies_apply_in_a_user_namespace(control_plane, namespace):
    """What the spawner and the job backend apply, with the values' allowed_egress, is valid
    to the API server and stored as built (so that comparing it with the built spec says
    whether someone changed it)."""
    cp = control_plane
    policies = make_user_network_policies(namespace=namespace, user_label="ann",
                                          hub_namespace="gpulab", allowed_egress=values_egress())
    policies.append(make_job_network_policy(job="digits", namespace=namespace, user_label="ann"))
    apply_strict(cp, policies)
    for policy in policies:
        _, stored = cp.api("GET", f"/apis/networking.k8s.io/v1/namespaces/{namespace}"
                           f"/networkpolicies/{policy['metadata']['name']}", expect=(200,))
        assert stored["spec"] == policy["spec"]
    user_pods = policies[0]["spec"]
    assert user_pods["podSelector"] == {} and "ingress" not in user_pods  # nothing comes in
    internet = user_pods["egress"][-1]["to"][0]["ipBlock"]
    assert internet["cidr"] == "0.0.0.0/0" and "169.254.0.0/16" in internet["except"]
