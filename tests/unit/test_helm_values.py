"""helm-values/: the z2jh values name real settings, and the RBAC covers what the spawner does."""

from pathlib import Path

import pytest
import yaml

from gpulab.spawner.kube import KubeGPUSpawner
from gpulab.spawner.mixin import GPULedger
from gpulab.spawner.profiles import parse_profiles

HELM = Path(__file__).resolve().parents[2] / "helm-values"


@pytest.fixture(scope="module")
def values():
    return yaml.safe_load((HELM / "values.yaml").read_text())


def test_spawner_settings_are_traits(values):
    config = values["hub"]["config"]
    assert config["JupyterHub"]["spawner_class"] == "gpulab.spawner.kube.KubeGPUSpawner"
    for cls, section in ((KubeGPUSpawner, "KubeGPUSpawner"), (GPULedger, "GPULedger")):
        traits = cls.class_traits(config=True)
        unknown = sorted(set(config[section]) - set(traits))
        assert not unknown, f"{section}: {unknown} are not settings"
        for name, value in config[section].items():
            traits[name].validate(None, value)  # TraitError when the value is malformed


def test_profiles_parse_and_home_storage_is_the_spawners(values):
    profiles = parse_profiles(values["singleuser"]["profileList"])
    assert [(p.slug, p.gpus, p.model) for p in profiles] == [
        ("cpu", 0, None), ("h100-1", 1, "NVIDIA-H100"), ("h100-4", 4, "NVIDIA-H100")]
    assert values["singleuser"]["storage"]["type"] == "none"  # not mounted twice
    assert values["singleuser"]["cloudMetadata"]["blockWithIptables"] is False  # privileged


def test_rbac_binds_the_hub_service_account_to_the_cluster_role():
    role, binding = yaml.safe_load_all((HELM / "rbac.yaml").read_text())
    assert role["kind"] == "ClusterRole" and binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "hub", "namespace": "gpulab"}]
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    for needed in [("", "namespaces", "patch"), ("", "resourcequotas", "patch"),
                   ("", "pods", "watch"), ("", "pods", "create"), ("", "events", "watch"),
                   ("", "nodes", "list"), ("", "persistentvolumeclaims", "create"),
                   ("batch", "jobs", "create")]:
        assert needed in granted, needed
    assert not [x for x in granted if x[1] == "secrets" or x[2] == "*"]  # least privilege
