"""``gpulab jobs export --format tfjob``: a job spec rendered as a Kubeflow TFJob, no hub."""

import pytest
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
    # its GPUs, and gpulab's default CPU, memory and disk (as the hub's own replicas get them)
    assert c["name"] == "tensorflow" and c["resources"] == {
        "limits": {"nvidia.com/gpu": "2", "cpu": "2", "memory": "8Gi", "ephemeral-storage": "20Gi"},
        "requests": {"cpu": "100m", "memory": "512Mi", "ephemeral-storage": "1Gi"}}
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


def _program(folder):
    folder.mkdir()
    (folder / "main.py").write_text("import mnist_setup\n")
    (folder / "mnist_setup.py").write_text("X = 1\n")
    (folder / ".hidden.py").write_text("no\n")
    (folder / "notes.txt").write_text("not code\n")
    (folder / "sub").mkdir()
    (folder / "sub" / "deep.py").write_text("no\n")
    return folder


@pytest.mark.parametrize("how", ["files", "folder", "entry-last"])
def test_several_source_files_go_in_the_config_map_beside_the_entry_point(tmp_path, capsys,
                                                                         how):
    d = _program(tmp_path / "prog")
    argv = {"files": ["--source-file", str(d / "main.py"), "--source-file",
                      str(d / "mnist_setup.py"), "--source-file", str(d / "notes.txt")],
            "folder": ["--source-file", str(d), "--source-file", str(d / "notes.txt")],
            "entry-last": ["--source-file", str(d / "mnist_setup.py"), "--source-file",
                           str(d / "notes.txt"), "--source-file", str(d / "main.py"),
                           "--entry", "main.py"]}[how]
    rc, docs, err = export(capsys, "--name", "mw", "--strategy", "multi-worker-mirrored",
                           "--workers", "2", *argv, "--user", "ann", "--namespace", "team")
    assert rc == 0, err
    # the entry point is source.py; the others beside it, by their names (a folder: its .py
    # files, not hidden ones, not subfolders); one mount, the entry point's folder
    assert docs[0]["data"] == {"source.py": "import mnist_setup\n", "mnist_setup.py": "X = 1\n",
                               "notes.txt": "not code\n"}
    pod = docs[1]["spec"]["tfReplicaSpecs"]["Worker"]["template"]["spec"]
    assert pod["containers"][0]["command"][-1] == "/gpulab/job-source/source.py"


@pytest.mark.parametrize("argv,words", [
    (["--source-file", "{d}/main.py", "--entry", "other.py"], "--entry other.py: not one of"),
    (["--script", "x.py", "--entry", "main.py"], "--entry names one of the files"),
    (["--source-file", "{d}/main.py", "--source-file", "{t}/main.py"], "two source files"),
    (["--source-file", "{o}"], "has no main.py and several .py files"),
    (["--source-file", "{d}/sub/none"], "holds no .py files"),
    (["--source-file", "{d}/missing.py"], "cannot read"),
], ids=["unknown-entry", "entry-without-files", "same-name", "ambiguous-folder", "empty-folder",
        "missing"])
def test_source_file_mistakes_are_one_line(tmp_path, capsys, argv, words):
    d = _program(tmp_path / "prog")
    (d / "sub" / "none").mkdir()
    o, t = tmp_path / "other", tmp_path / "third"
    o.mkdir()
    t.mkdir()
    (o / "a.py").write_text("")
    (o / "b.py").write_text("")
    (t / "main.py").write_text("")
    argv = [a.format(d=d, o=o, t=t) for a in argv]
    rc, docs, err = export(capsys, "--name", "mw", "--strategy", "multi-worker-mirrored",
                           "--workers", "1", *argv, "--user", "ann")
    assert rc == 2 and words in err and "Traceback" not in err, err


def test_a_bad_file_name_is_refused_naming_files(tmp_path, capsys):
    f = tmp_path / "my file.py"
    f.write_text("")
    (tmp_path / "main.py").write_text("print(1)\n")
    rc, docs, err = export(capsys, "--name", "mw", "--strategy", "multi-worker-mirrored",
                           "--workers", "1", "--source-file", str(tmp_path / "main.py"),
                           "--source-file", str(f), "--user", "ann")
    assert rc == 2 and "files: 'my file.py' is not a plain file name" in err, err
