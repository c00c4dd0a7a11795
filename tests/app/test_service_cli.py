"""`gpulab service` as an operator runs it (the installed command), and the unit it writes
checked by systemd's own `systemd-analyze verify` against this installation's real `gpulab`.

systemd is not PID 1 on this machine (a container): the tests show what happens then (the
unit written, nothing enabled, said plainly, exit 0). Enabling and starting the unit where
systemd runs is `systemctl`'s, which nothing here can run."""

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from .hubctl import GPULAB

pytestmark = pytest.mark.app

UNIT = "etc/systemd/system/gpulab.service"


def service(*args, user=None, cwd="/"):
    command = [GPULAB, "service", *args]
    if user:
        command = ["runuser", "-u", user, "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, cwd=cwd)


def verify(unit: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True,
                          text=True, timeout=60)


@pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                    reason="systemd-analyze is missing (Debian package systemd; scripts/test.sh "
                    "installs it)")
def test_install_writes_a_unit_that_systemd_accepts(tmp_path):
    root = tmp_path / "root"
    r = service("install", "--root", str(root), "--port", "8080", "--ip", "0.0.0.0",
                "--data-dir", "/srv/gpulab data", "--admin-user", "boss")
    assert r.returncode == 0, r.stderr
    assert "not enabled or started" in r.stdout
    unit = root / UNIT
    assert unit.stat().st_mode & 0o777 == 0o644
    text = unit.read_text()
    assert (f'ExecStart={GPULAB} up --ip 0.0.0.0 --port 8080 --data-dir "/srv/gpulab data" '
            "--admin-user boss\n") in text
    assert f"Environment=PATH={os.path.dirname(GPULAB)}:" in text
    v = verify(unit)
    # systemd-analyze says nothing about a unit it fully understands (an unknown key or a
    # bad value is a warning on stderr, with exit code 0)
    assert v.returncode == 0 and v.stdout + v.stderr == "", v.stdout + v.stderr
    # a broken unit is noticed: the same check fails on a program that is not there
    broken = tmp_path / "gpulab.service"
    broken.write_text(text.replace(f"ExecStart={GPULAB}", "ExecStart=/nonexistent/gpulab"))
    assert verify(broken).returncode != 0

    # installed again with other flags, the unit is rewritten
    r = service("install", "--root", str(root), "--data-dir", "/srv/gpulab", "--no-isolation")
    assert r.returncode == 0, r.stderr
    assert f"ExecStart={GPULAB} up --data-dir /srv/gpulab --no-isolation\n" in unit.read_text()
    r = service("status", "--root", str(root))
    assert r.returncode == 3 and "--data-dir /srv/gpulab --no-isolation" in r.stdout

    r = service("uninstall", "--root", str(root))
    assert r.returncode == 0 and not unit.exists()
    assert service("uninstall", "--root", str(root)).returncode == 0  # nothing to remove
    r = service("status", "--root", str(root))
    assert r.returncode == 4 and "not installed" in r.stdout


@pytest.mark.parametrize("args,message", [
    (["--port", "0"], "--port must be a port number"),
    (["--port", "9000", "--hub-port", "9000"], "four different ports"),
    (["--proxy", "/nonexistent/chp"], "--proxy /nonexistent/chp: no such program"),
    (["--admin-user", "a\nb"], "control character"),
    (["--data-dir", "/srv/a\nb"], "control character"),
], ids=["port-zero", "same-ports", "no-proxy", "admin-newline", "dir-newline"])
def test_bad_flags_write_nothing(tmp_path, args, message):
    r = service("install", "--root", str(tmp_path), *args)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / UNIT).exists()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to act as another account")
@pytest.mark.parametrize("action", ["install", "uninstall"])
def test_only_root_installs_or_removes_the_service(action):
    r = service(action, user="nobody")
    assert r.returncode == 2
    assert f"run it as root (sudo gpulab service {action} ...)" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="writes /etc/systemd/system as root")
def test_without_systemd_the_unit_is_written_and_that_is_said(tmp_path):
    """This machine's own /etc: written, not enabled (systemd is not PID 1 here), removed."""
    if os.path.isdir("/run/systemd/system"):
        pytest.skip("systemd runs here: installing would start a hub")
    unit = Path("/", UNIT)
    if unit.exists():
        pytest.skip(f"{unit} exists already: not touching it")
    data = tmp_path / "data"
    try:
        r = service("install", "--data-dir", str(data))
        assert r.returncode == 0, r.stderr
        assert "systemd is not running on this machine" in r.stdout
        assert "written but not enabled or started" in r.stdout
        assert unit.exists()
        assert not Path("/etc/systemd/system/multi-user.target.wants/gpulab.service").exists()
        # anyone may ask
        r = service("status", user="nobody")
        assert r.returncode == 3 and "systemd is not running" in r.stdout
    finally:
        r = service("uninstall")
    assert r.returncode == 0 and not unit.exists()
