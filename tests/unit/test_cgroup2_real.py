"""gpulab.hub.machine.cgroups and .bpfdevices on a real cgroup v2 hierarchy (root only).

This machine's /sys/fs/cgroup is the v1 (hybrid) layout, but a private ``mount -t cgroup2``
works beside it (each test module mounts its own under a temporary folder and unmounts it
after). What the kernel does there is real: the ``BPF_PROG_TYPE_CGROUP_DEVICE`` program gpulab
attaches, ``cgroup.kill``, ``cgroup.freeze``. What it cannot show: v2's ``cpu``, ``memory`` and
``pids`` controllers cannot be enabled on this mount (the kernel has bound them to the v1
hierarchies), so ``memory.max``, ``cpu.max`` and ``pids.max`` are checked against a stand-in
folder in tests/unit/test_cgroups.py, and here only that asking for them fails in words.

GPUs are stand-in device nodes made with ``mknod`` (no NVIDIA driver here): opening one the
device program allows fails with ENXIO (the driver is missing), one it refuses with EPERM.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpulab.hub.machine import bpfdevices
from gpulab.hub.machine.cgroups import Cgroups, limit_user_processes

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="mounting cgroup2 needs root")


@pytest.fixture(scope="module")
def v2():
    """A private cgroup2 mount, and gpulab's groups on it (GPU index = minor)."""
    top = Path(tempfile.mkdtemp(prefix="gpulab-cg2-"))
    mount = top / "cg"
    mount.mkdir()
    r = subprocess.run(["mount", "-t", "cgroup2", "none", str(mount)],
                       capture_output=True, text=True)
    assert r.returncode == 0, f"a private cgroup2 mount is needed here: {r.stderr}"
    cgroups = Cgroups(2, {"cpu": mount / "gpulab", "memory": mount / "gpulab"},
                      gpu_minor=lambda index: index)
    try:
        yield cgroups
    finally:
        for d in sorted(mount.rglob("*"), key=lambda p: -len(p.parts)):
            if d.is_dir():
                try:
                    (d / "cgroup.kill").write_text("1")
                except OSError:
                    pass
                for _ in range(100):
                    try:
                        d.rmdir()
                        break
                    except OSError:
                        time.sleep(0.02)
        subprocess.run(["umount", str(mount)], check=True)
        mount.rmdir()
        top.rmdir()


@pytest.fixture
def nodes(tmp_path):
    """Stand-in device nodes: GPUs 0 and 1, nvidiactl, nvidia-uvm (major 511, minors 0, 2),
    /dev/mem's numbers (1:1) and a block device (7:0), all mode 0666."""
    made = {"nvidia0": (195, 0), "nvidia1": (195, 1), "nvidiactl": (195, 255),
            "uvm": (511, 0), "uvm2": (511, 2), "mem": (1, 1)}
    for name, (major, minor) in made.items():
        os.mknod(tmp_path / name, 0o666 | stat.S_IFCHR, os.makedev(major, minor))
    os.mknod(tmp_path / "loop", 0o666 | stat.S_IFBLK, os.makedev(7, 0))
    return tmp_path


PROBE = (
    "import errno, json, os, sys\n"
    "out = {}\n"
    "for path in sys.argv[1:]:\n"
    "    try:\n"
    "        os.close(os.open(path, os.O_RDWR))\n"
    "        out[os.path.basename(path)] = 'opened'\n"
    "    except OSError as e:\n"
    "        out[os.path.basename(path)] = errno.errorcode[e.errno]\n"
    "print(json.dumps(out))\n")


def opens(paths, join=None) -> dict:
    """What a process (inside `join`'s group, if given) gets opening each of `paths`."""
    r = subprocess.run([sys.executable, "-c", PROBE, *map(str, paths)],
                       preexec_fn=join, capture_output=True, text=True, check=True)
    return json.loads(r.stdout)


def test_this_mount_offers_no_cpu_or_memory_and_detection_says_so(v2):
    mount = v2.bases["memory"].parent
    cgroups, why = Cgroups.detect(mount, "/proc/self/cgroup")
    assert cgroups is None and why == "the cgroup v2 hierarchy lacks ['cpu', 'memory']"
    # asking for a limit here fails in words, and leaves no group behind
    with pytest.raises(OSError):
        v2.make(f"limited-{os.getpid()}", memory=2**30)
    assert not v2.find(f"limited-{os.getpid()}").exists()


def test_the_device_program_allows_the_units_gpu_and_refuses_the_rest(v2, nodes):
    assert v2.devices_enforced, v2.devices_why
    group = v2.make(f"server-gpu0-{os.getpid()}", gpus=[0])
    try:
        assert bpfdevices.attached(group.dirs["memory"]) == 1
        paths = [nodes / n for n in ("nvidia0", "nvidia1", "nvidiactl", "mem", "loop")]
        paths += [Path("/dev/null"), Path("/dev/urandom")]
        inside = opens(paths, join=group.join)
        # root inside the group too: the program does not ask who opens
        assert inside == {"nvidia0": "ENXIO", "nvidia1": "EPERM", "nvidiactl": "ENXIO",
                          "mem": "EPERM", "loop": "EPERM", "null": "opened",
                          "urandom": "opened"}, inside
        outside = opens(paths)
        assert outside["nvidia1"] == "ENXIO" and outside["mem"] != "EPERM", outside
        # a GPU-less unit may open no GPU at all, its shared nodes still
        none = v2.make(f"server-cpu-{os.getpid()}", gpus=[])
        try:
            seen = opens(paths[:3], join=none.join)
            assert seen == {"nvidia0": "EPERM", "nvidia1": "EPERM", "nvidiactl": "ENXIO"}
        finally:
            assert none.remove()
    finally:
        assert group.remove()


def test_nvidia_uvm_is_allowed_at_the_major_the_driver_registered(v2, nodes, tmp_path):
    devices = tmp_path / "devices"
    devices.write_text("Character devices:\n  1 mem\n195 nvidia-frontend\n511 nvidia-uvm\n"
                       "\nBlock devices:\n  7 loop\n")
    assert bpfdevices.nvidia_uvm_major(devices) == 511
    assert bpfdevices.nvidia_uvm_major(tmp_path / "absent", tmp_path / "absent") is None
    # not loaded yet, but its node says which major it has
    assert bpfdevices.nvidia_uvm_major(tmp_path / "absent", nodes / "uvm") == 511
    group = v2.find(f"uvm-{os.getpid()}")
    group.dirs["memory"].mkdir(parents=True)
    try:
        bpfdevices.attach(group.dirs["memory"], bpfdevices.allowed_devices([1], uvm_major=511))
        seen = opens([nodes / "uvm", nodes / "uvm2", nodes / "nvidia1"], join=group.join)
        assert seen == {"uvm": "ENXIO", "uvm2": "EPERM", "nvidia1": "ENXIO"}, seen
    finally:
        assert group.remove()


DAEMON = (
    "import os, sys, time\n"
    "if os.fork(): sys.exit(0)\n"
    "os.setsid()\n"
    "while True:\n"
    "    if os.fork() == 0:\n"
    "        time.sleep(0.01); os._exit(0)\n"
    "    open(sys.argv[1], 'w').write(str(time.time()))\n"
    "    time.sleep(0.005)\n")


def start_daemon(group, marker: Path) -> None:
    """A daemon that left its session and keeps forking, inside `group`."""
    subprocess.run([sys.executable, "-c", DAEMON, str(marker)], preexec_fn=group.join,
                   check=True)
    deadline = time.time() + 10
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.05)
    assert group.pids(), "the daemon runs in the group"


def assert_ended(marker: Path) -> None:
    stamp = marker.read_text()
    time.sleep(0.3)
    assert marker.read_text() == stamp, "nothing of the daemon runs any more"


@pytest.mark.parametrize("use_kill_file", [True, False], ids=["cgroup.kill", "cgroup.freeze"])
def test_stop_ends_a_setsid_daemon(v2, tmp_path, use_kill_file):
    """``cgroup.kill`` (kernel 5.14+), and the freeze-kill-thaw a kernel without it gets."""
    group = v2.make(f"server-daemon-{os.getpid()}")
    marker = tmp_path / "alive"
    start_daemon(group, marker)
    d = group.dirs["memory"]
    if use_kill_file:
        group.kill()
    else:
        group.kill(use_kill_file=False)
        assert "frozen 0" in (d / "cgroup.events").read_text()  # thawed again
    deadline = time.time() + 5
    while group.pids() and time.time() < deadline:
        time.sleep(0.02)
    assert group.pids() == []
    assert_ended(marker)
    assert group.remove() and not group.exists()


def test_freezing_stops_a_group(v2, tmp_path):
    """What the fallback relies on: a frozen group runs nothing (no fork escapes the kill)."""
    group = v2.make(f"server-freeze-{os.getpid()}")
    marker = tmp_path / "alive"
    start_daemon(group, marker)
    d = group.dirs["memory"]
    try:
        (d / "cgroup.freeze").write_text("1")
        deadline = time.time() + 2
        while "frozen 1" not in (d / "cgroup.events").read_text() and time.time() < deadline:
            time.sleep(0.01)
        assert "frozen 1" in (d / "cgroup.events").read_text()
        assert_ended(marker)
    finally:
        assert group.remove()


def test_rlimit_nproc_bounds_an_accounts_forks():
    """Where no groups can be made: RLIMIT_NPROC, set as root before dropping to the account,
    stops a fork loop at the bound (an account with no other process: uid 54321)."""
    loop = (
        "import os, time\n"
        "n = 0\n"
        "try:\n"
        "    for n in range(200):\n"
        "        if os.fork() == 0:\n"
        "            time.sleep(5); os._exit(0)\n"
        "except BlockingIOError as e:\n"
        "    print('refused after', n)\n"
        "os.killpg(0, 9)\n")

    def preexec():
        os.setpgid(0, 0)
        limit_user_processes(20)
        os.setgid(54321)
        os.setgroups([])
        os.setuid(54321)

    r = subprocess.run([sys.executable, "-c", loop], preexec_fn=preexec,
                       capture_output=True, text=True, timeout=30)
    assert "refused after 19" in r.stdout, (r.stdout, r.stderr)


def test_device_programs_need_a_right_group(v2, tmp_path):
    """Attaching to a folder that is no cgroup fails in words (BPFError), not silently."""
    with pytest.raises(bpfdevices.BPFError):
        bpfdevices.attach(tmp_path, bpfdevices.allowed_devices([0]))
