"""gpulab.hub.machine.delegation: under systemd with ``Delegate=yes`` (cgroup v2), gpulab's groups
sit inside the service's own group, and the hub's processes move to a leaf beside them.

The marks systemd sets are real extended attributes (``trusted.delegate``, which needs root),
on a folder standing in for /sys/fs/cgroup and on a real cgroup2 mount: this machine's
unified hierarchy has no cpu or memory controller (they are v1's here), so the move of
processes and ``cgroup.kill`` inside the delegated subtree are shown there, and
`Cgroups.detect` against the stand-in folder."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gpulab.hub.machine.cgroups import Cgroups
from gpulab.hub.machine.delegation import HUB_LEAF, delegated_top, is_delegated

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="trusted.* attributes need root")


def service_group(root: Path, path: str, mark: bool = True) -> Path:
    d = root / path
    d.mkdir(parents=True)
    (d / "cgroup.procs").write_text("")
    (d / "cgroup.subtree_control").write_text("")
    if mark:
        os.setxattr(d, "trusted.delegate", b"1")
    return d


def own(tmp_path: Path, group: str) -> Path:
    f = tmp_path / "self"
    f.write_text(f"1:name=systemd:/\n0::{group}\n")
    return f


def test_not_delegated_anywhere_but_at_its_own_group(tmp_path):
    root = tmp_path / "cg"
    user = service_group(root, "user.slice/user-1000.slice/user@1000.service")
    service_group(root, "user.slice/user-1000.slice/user@1000.service/app.slice/x.scope",
                  mark=False)
    assert is_delegated(user)
    # a root shell inside a person's user manager: that subtree is the manager's
    assert delegated_top(root, own(tmp_path, "/user.slice/user-1000.slice/user@1000.service"
                                              "/app.slice/x.scope")) is None
    # a terminal, the top of the hierarchy (a container's namespace), no v2 line (v1 only)
    service_group(root, "user.slice/user-0.slice/session-1.scope", mark=False)
    assert delegated_top(root, own(tmp_path, "/user.slice/user-0.slice/session-1.scope")) is None
    assert delegated_top(root, own(tmp_path, "/")) is None
    (tmp_path / "v1").write_text("4:memory:/a\n1:cpu:/\n")
    assert delegated_top(root, tmp_path / "v1") is None
    # marked, but its processes cannot be moved (no cgroup.procs): not used, no exception
    odd = root / "system.slice" / "odd.service"
    odd.mkdir(parents=True)
    os.setxattr(odd, "trusted.delegate", b"1")
    assert delegated_top(root, own(tmp_path, "/system.slice/odd.service")) is None


def test_detect_puts_gpulabs_groups_inside_the_service(tmp_path):
    """Once the hub is in its leaf (as `delegated_top` leaves it), the leaf's parent is the
    top of gpulab's groups, not the hierarchy's root."""
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    (root / "cgroup.subtree_control").write_text("cpu memory\n")
    top = service_group(root, "system.slice/gpulab.service")
    service_group(root, f"system.slice/gpulab.service/{HUB_LEAF}", mark=False)
    (top / "gpulab").mkdir()
    (top / "gpulab" / "cgroup.subtree_control").write_text("")
    me = own(tmp_path, f"/system.slice/gpulab.service/{HUB_LEAF}")
    assert delegated_top(root, me) == top
    cgroups, why = Cgroups.detect(root, me)
    assert cgroups is not None, why
    assert cgroups.bases == {"cpu": top / "gpulab", "memory": top / "gpulab",
                             "pids": top / "gpulab"}
    assert not (root / "gpulab").exists()  # nothing at the top of the hierarchy
    # controllers are handed down from the service's group to gpulab's
    assert (top / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"


MOVE = textwrap.dedent("""
    import os, subprocess, sys
    from pathlib import Path
    from gpulab.hub.machine.cgroups import Group
    from gpulab.hub.machine.delegation import delegated_top, own_v2_group
    mount, top = Path(sys.argv[1]), Path(sys.argv[2])
    before = own_v2_group()
    os.setxattr(top, "trusted.delegate", b"1")  # as systemd marks a Delegate=yes unit
    child = subprocess.Popen(["sleep", "300"])
    unit = top / "gpulab" / "server-ann"
    try:
        for pid in (os.getpid(), child.pid):  # as systemd starts the unit: all in its group
            (top / "cgroup.procs").write_text(str(pid))
        print("top", delegated_top(mount, "/proc/self/cgroup"))
        print("again", delegated_top(mount, "/proc/self/cgroup"))
        print("self", own_v2_group())
        print("child", own_v2_group(f"/proc/{child.pid}/cgroup"))
        print("left", (top / "cgroup.procs").read_text().split())
        # a server's group inside the delegated subtree: cgroup.kill ends a setsid daemon
        unit.mkdir(parents=True)
        daemon = subprocess.Popen(["setsid", "sleep", "300"])
        (unit / "cgroup.procs").write_text(str(daemon.pid))
        Group("server-ann", 2, {"cpu": unit, "memory": unit}).kill()
        print("daemon", daemon.wait(10))
    finally:
        child.kill()
        child.wait()
        (mount / before.lstrip("/") / "cgroup.procs").write_text(str(os.getpid()))
        for d in (unit, unit.parent, top / "hub", top, top.parent):
            if d.exists():
                d.rmdir()
""")


def test_the_hub_moves_into_its_leaf_on_a_real_cgroup2_mount(tmp_path):
    mount = tmp_path / "cg2"
    mount.mkdir()
    slice_ = f"gpulab-test-{os.getpid()}.slice"
    (tmp_path / "move.py").write_text(MOVE)
    top = f"{mount}/{slice_}/gpulab.service"
    r = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t cgroup2 none {mount} && mkdir -p {top} && "
         f"exec {sys.executable} {tmp_path}/move.py {mount} {top}"],
        capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    service = f"/{slice_}/gpulab.service"
    assert out["top"] == f"{mount}{service}"
    assert out["again"] == out["top"]  # found again from the leaf, nothing moved twice
    assert out["self"] == f"{service}/{HUB_LEAF}"
    assert out["child"] == f"{service}/{HUB_LEAF}"  # what the hub had started, too
    assert out["left"] == "[]"  # the service's group holds no process: it can hand down
    assert out["daemon"] == "-9"
