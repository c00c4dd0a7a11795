"""`gpulab up` refuses bad input with a message and exit code 2, starting nothing."""

import subprocess

import pytest

from .hubctl import GPULAB


def up(*args):
    return subprocess.run([GPULAB, "up", *args], capture_output=True, text=True, timeout=60)


def test_data_folder_that_cannot_be_made(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    r = up("--data-dir", str(blocker / "data"), "--port", "18999")
    assert r.returncode == 2
    assert "Cannot create the data folder" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (["--port", "0"], "--port must be a port number"),
        (["--port", "9000", "--hub-port", "9000"], "four different ports"),
        (["--idle-timeout", "-5"], "--idle-timeout"),
        (["--simulated-gpus", "-1"], "--simulated-gpus"),
        (["--subdomain-host", "http://192.168.1.5:8000"], "an address has no subdomains"),
        (["--subdomain-host", "http://localhost:8000/jh"], "must have no path"),
    ],
    ids=["port-zero", "same-ports", "negative-timeout", "negative-gpus", "subdomains-of-an-ip",
         "subdomain-host-with-path"],
)
def test_bad_flags(tmp_path, args, message):
    r = up("--data-dir", str(tmp_path / "d"), *args)
    assert r.returncode == 2 and message in r.stderr
    assert not (tmp_path / "d").exists()  # nothing made


def test_real_gpus_that_cannot_be_restricted_are_named(tmp_path, monkeypatch):
    """`gpulab up` warns loudly where NVIDIA GPUs exist and their device nodes cannot be
    restricted (cgroup v2 without a device program, or no control groups at all)."""
    from gpulab.hub.cli import up as cli
    from gpulab.hub.machine import cgroups

    assert cli._gpus_not_enforced(str(tmp_path)) is None  # no GPU: nothing to say
    (tmp_path / "nvidiactl").touch()
    assert cli._gpus_not_enforced(str(tmp_path)) is None
    (tmp_path / "nvidia0").touch()
    # cgroup v2: enforced where the kernel takes gpulab's BPF device program (issue 36) ...
    v2 = cgroups.Cgroups(2, {})
    v2.bpf_problem = ""
    monkeypatch.setattr(cgroups, "_detected", (v2, ""))
    assert cli._gpus_not_enforced(str(tmp_path)) is None
    # ... and named where it refuses it
    v2 = cgroups.Cgroups(2, {})
    v2.bpf_problem = "the kernel refused to load it (Operation not permitted)"
    monkeypatch.setattr(cgroups, "_detected", (v2, ""))
    why = cli._gpus_not_enforced(str(tmp_path))
    assert "BPF device program" in why and "refused to load it" in why, why
    monkeypatch.setattr(cgroups, "_detected", (None, "the hub does not run as root"))
    assert cli._gpus_not_enforced(str(tmp_path)) == "no control groups: the hub does not run as root"
    v1 = cgroups.Cgroups(1, {"memory": tmp_path, "cpu": tmp_path, "devices": tmp_path})
    monkeypatch.setattr(cgroups, "_detected", (v1, ""))
    assert cli._gpus_not_enforced(str(tmp_path)) is None


@pytest.mark.app
def test_a_gpulab_service_that_exits_stops_the_hub_with_exit_1(tmp_path):
    """The login page no longer waits for the gpulab service (issue 37: `GpulabHub.
    start_service` waits for it beside the rest), but a service that exits at start still
    stops the hub, as JupyterHub does for a managed service, and `gpulab up` exits 1."""
    import os

    from .hubctl import Hub

    broken = tmp_path / "broken"  # any Python started with it on its path exits 3 at once
    broken.mkdir(mode=0o755)
    (broken / "sitecustomize.py").write_text("import os\nos._exit(3)\n")
    data = tmp_path / "data"
    data.mkdir(mode=0o711)
    os.chmod(tmp_path, 0o711)
    (data / "gpulab_config.py").write_text(
        f'c.JupyterHub.services = [{{"name": "gpulab", "environment": '
        f'{{"PYTHONPATH": "{broken}"}}}}]\n')
    hub = Hub(data, "--simulated-gpus", "1", "--no-isolation", "--idle-timeout", "0")
    with pytest.raises(RuntimeError, match="exited 1"):
        hub.start(timeout=90)
    out = hub.output()
    assert "Service gpulab exited with status 3" in out, out[-3000:]
    hub.stop()
