"""``gpulab jobs export --format tfjob``: a job spec rendered as a Kubeflow TFJob, no hub."""

import yaml

from gpulab.hub.cli import main

SPEC = """\
name: digits
strategy: parameter-server
replicas: {chief: 1, ps: 2, worker: 3}
resources: {worker: {gpus: 2}}
script: examples/train.py
max_runtime: 600
retries: 4
"""


def export(capsys, *argv):
    rc = main(["jobs", "export", "--format", "tfjob", *argv])
    out, err = capsys.readouterr()
    return rc, list(yaml.safe_load_all(out)), err


def test_export_renders_chief_ps_workers_with_clean_pod_policy(tmp_path, capsys):
    (tmp_path / "spec.yaml").write_text(SPEC)
    rc, docs, _ = export(capsys, str(tmp_path / "spec.yaml"), "--user", "ann",
                         "--gpu-model", "NVIDIA-H100", "--nfs", "nfs.example.org:/gpulab")
    assert rc == 0 and [d["kind"] for d in docs] == ["TFJob"]
    tfjob = docs[0]
    assert tfjob["apiVersion"] == "kubeflow.org/v1"
    assert tfjob["metadata"]["namespace"] == "gpulab-ann"
    assert tfjob["spec"]["runPolicy"] == {"cleanPodPolicy": "Running", "backoffLimit": 4,
                                          "activeDeadlineSeconds": 600}
    replicas = tfjob["spec"]["tfReplicaSpecs"]
    assert {k: v["replicas"] for k, v in replicas.items()} == {"Chief": 1, "PS": 2, "Worker": 3}
    assert "Master" not in replicas
    worker = replicas["Worker"]["template"]["spec"]
    c = worker["containers"][0]
    assert c["name"] == "tensorflow" and c["resources"] == {"limits": {"nvidia.com/gpu": "2"}}
    assert c["command"][-1] == "/gpulab/shared/users/ann/examples/train.py"
    assert worker["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H100"}
    assert worker["volumes"] == [{"name": "gpulab-shared",
                                  "nfs": {"server": "nfs.example.org", "path": "/gpulab"}}]
    assert not any(e["name"] == "TF_CONFIG" for e in c["env"])  # the operator sets it


def test_export_of_source_code_adds_its_config_map(tmp_path, capsys):
    (tmp_path / "t.py").write_text("print('hi')\n")
    rc, docs, _ = export(capsys, "--name", "mw", "--strategy", "multi-worker-mirrored",
                         "--workers", "2", "--source-file", str(tmp_path / "t.py"),
                         "--user", "ann", "--namespace", "team")
    assert rc == 0 and [d["kind"] for d in docs] == ["ConfigMap", "TFJob"]
    assert docs[0]["metadata"]["name"] == "mw-source"
    assert docs[0]["data"] == {"source.py": "print('hi')\n"}
    pod = docs[1]["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["volumes"] == [{"name": "source", "configMap": {"name": "mw-source"}}]
    assert pod["containers"][0]["command"][-1] == "/gpulab/job-source/source.py"


def test_export_refuses_a_bad_spec_naming_the_field(capsys):
    rc, docs, err = export(capsys, "--name", "x", "--strategy", "parameter-server",
                           "--workers", "1", "--ps", "0", "--script", "a.py")
    assert rc == 2 and "replicas.ps" in err
