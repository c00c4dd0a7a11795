"""gpulab.hub.machine.cgroups: what it writes where.

The kernel's enforcement is tested for real in tests/app/test_limits.py and
tests/app/test_jobs_api.py on this machine's hierarchy (cgroup v1 here). A private cgroup v2
hierarchy mounts here, and what it can do for real (the BPF device program, ``cgroup.kill``,
``cgroup.freeze``) is tested on it in tests/unit/test_cgroup2_real.py; but its cpu, memory and
pids controllers cannot be enabled here (they are bound to the v1 hierarchies), so the v2
layout of ``memory.max``, ``cpu.max`` and ``pids.max`` is checked against a folder that stands
in for /sys/fs/cgroup (with the control files the kernel would show)."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulab.hub.machine.cgroups import CPU_PERIOD_US, Cgroups, device_denials, memory_bytes


@pytest.mark.parametrize("text,value", [
    ("512Mi", 512 * 2**20), ("2G", 2 * 10**9), ("1.5Gi", int(1.5 * 2**30)), ("1000", 1000),
    (None, None), ("", None), (300, 300),
])
def test_memory_sizes(text, value):
    assert memory_bytes(text) == value


@pytest.mark.parametrize("text", ["12 GB", "-1", "1e9", "lots"])
def test_bad_memory_sizes_are_refused_in_words(text):
    with pytest.raises(ValueError, match="is not a memory size such as 512Mi"):
        memory_bytes(text)


def fake_v2(root: Path, controllers="cpuset cpu io memory pids") -> Path:
    root.mkdir()
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (root / "cgroup.subtree_control").write_text("cpu memory\n")
    (root / "gpulab").mkdir()
    (root / "gpulab" / "cgroup.controllers").write_text("cpu memory pids\n")
    (root / "gpulab" / "cgroup.subtree_control").write_text("")
    return root


def test_v2_groups_sit_under_gpulab_at_the_top_with_the_limits(tmp_path):
    root = fake_v2(tmp_path / "cg")
    cgroups = Cgroups(2, {"cpu": root / "gpulab", "memory": root / "gpulab",
                          "pids": root / "gpulab"}, bpf_problem="not in a fake folder")
    group = cgroups.make("server-ann-default", memory=256 * 2**20, cpus=1.5, pids=1024)
    d = root / "gpulab" / "server-ann-default"
    assert group.dirs == {"cpu": d, "memory": d, "pids": d}
    assert (d / "memory.max").read_text() == str(256 * 2**20)
    assert (d / "cpu.max").read_text() == f"{int(1.5 * CPU_PERIOD_US)} {CPU_PERIOD_US}"
    assert (d / "pids.max").read_text() == "1024"
    # gpulab's folder hands cpu, memory and pids down to its groups
    assert (root / "gpulab" / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    assert group.procs_files == [d / "cgroup.procs"]
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert group.oom_kills() == 1
    (d / "pids.events").write_text("max 17\n")
    assert group.pids_refused() == 17
    # only a limit that is set is written: a fresh group is unlimited
    other = cgroups.make("job-x-worker-0", cpus=0.5)
    assert not (other.dirs["memory"] / "memory.max").exists()
    assert not (other.dirs["pids"] / "pids.max").exists()
    assert (other.dirs["cpu"] / "cpu.max").read_text() == f"{CPU_PERIOD_US // 2} {CPU_PERIOD_US}"


def test_v2_detection_takes_pids_where_the_hierarchy_offers_it(tmp_path):
    own = tmp_path / "self"
    own.write_text("0::/user.slice/user-0.slice/session-1.scope\n")
    for offered, bound in (("cpuset cpu io memory pids", True), ("cpu memory", False)):
        root = fake_v2(tmp_path / f"cg-{bound}", controllers=offered)
        cgroups, why = Cgroups.detect(root, own)
        assert cgroups is not None, why
        assert cgroups.pids_enforced is bound
        assert set(cgroups.bases) == {"cpu", "memory"} | ({"pids"} if bound else set())
        # the probe's device program loads (as root here) but a plain folder is no group to
        # attach it to: detection says so rather than failing
        assert not cgroups.devices_enforced
        assert "refused to attach a BPF device program to a group" in cgroups.devices_why


def test_unit_names_cannot_leave_gpulab_folder(tmp_path):
    root = fake_v2(tmp_path / "cg")
    cgroups = Cgroups(2, {"cpu": root / "gpulab", "memory": root / "gpulab"})
    group = cgroups.find("../../etc/x y")
    assert all(d.parent == root / "gpulab" for d in group.dirs.values())
    assert group.unit == "etc-x-y"


def test_v2_without_the_memory_controller_says_so(tmp_path):
    root = fake_v2(tmp_path / "cg", controllers="cpuset cpu io pids")
    own = tmp_path / "self"
    own.write_text("0::/\n")
    cgroups, why = Cgroups.detect(root, own)
    assert cgroups is None and why == "the cgroup v2 hierarchy lacks ['memory']"


def test_v1_without_hierarchies_says_so(tmp_path):
    (tmp_path / "cg").mkdir()
    own = tmp_path / "self"
    own.write_text("4:memory:/a\n1:cpu:/\n")
    cgroups, why = Cgroups.detect(tmp_path / "cg", own)
    assert cgroups is None and why.startswith("no cgroup v1 memory hierarchy at ")


def test_this_machine_is_detected():
    """The tests run as root on a machine whose hierarchy gpulab can use (see the module
    docstring): detection finds it and leaves nothing behind."""
    cgroups, why = Cgroups.detect()
    assert cgroups is not None, why
    assert not any(b.exists() and any(p.name.startswith("gpulab-probe") for p in b.iterdir())
                   for b in cgroups.bases.values())


def fake_v1(root: Path) -> Cgroups:
    bases = {}
    for c in ("memory", "cpu", "devices", "freezer"):
        (root / c / "gpulab").mkdir(parents=True)
        bases[c] = root / c / "gpulab"
    return Cgroups(1, bases, gpu_minor=lambda index: {0: 0, 1: 3, 2: 1}[index])


def test_v1_gpus_deny_every_other_nvidia_gpu_node(tmp_path):
    """``gpus=[...]`` names GPU indexes; the group may open only those GPUs' nodes (by their
    minor numbers), and nvidiactl (195:255) stays usable."""
    cgroups = fake_v1(tmp_path)
    assert cgroups.devices_enforced and cgroups.devices_why == ""
    group = cgroups.make("server-u1", gpus=[1])
    assert set(group.dirs) == {"memory", "cpu", "devices", "freezer"}
    # a plain file stands in for devices.deny: each write replaces it, so check the writes
    assert (group.dirs["devices"] / "devices.deny").read_text() == "c 195:254 rwm"
    lines = device_denials([3])
    assert "c 195:3 rwm" not in lines and "c 195:255 rwm" not in lines
    assert "c 195:0 rwm" in lines and "c 195:1 rwm" in lines and len(lines) == 254
    assert len(device_denials([])) == 255
    # no list: devices are left alone
    other = cgroups.make("server-u2")
    assert not (other.dirs["devices"] / "devices.deny").exists()


def test_a_unit_group_is_made_once(tmp_path):
    """make never writes limits onto a group that exists (someone else's, or a stale one)."""
    cgroups = fake_v1(tmp_path)
    cgroups.make("server-u1", memory=100)
    with pytest.raises(FileExistsError):
        cgroups.make("server-u1", memory=200)
    d = tmp_path / "memory" / "gpulab" / "server-u1"
    assert (d / "memory.limit_in_bytes").read_text() == "100"


def test_v2_devices_where_the_kernel_refuses_bpf_are_said_to_be_unenforced(tmp_path):
    """Where the kernel loads no device program (the BPF probe failed: `bpf_problem`),
    devices_why says so and a group is made without one. (Where it loads them, the program
    is tested for real in tests/unit/test_cgroup2_real.py.)"""
    root = fake_v2(tmp_path / "cg")
    cgroups = Cgroups(2, {"cpu": root / "gpulab", "memory": root / "gpulab"},
                      bpf_problem="the kernel refused a BPF device program: Operation not "
                                  "permitted")
    assert not cgroups.devices_enforced
    assert cgroups.devices_why == (
        "cgroup v2 restricts devices only through a BPF device program, and the kernel "
        "refused a BPF device program: Operation not permitted: any local process may open "
        "any GPU")
    cgroups.make("server-u1", gpus=[0])  # accepted, not restricted


def test_remove_kills_a_setsid_grandchild_that_forks(tmp_path):
    """On this machine's real hierarchy: a group's whole tree ends on remove, also a daemon
    that left the session and keeps forking."""
    cgroups, why = Cgroups.detect()
    assert cgroups is not None, why
    group = cgroups.make(f"test-kill-{os.getpid()}", gpus=[0])
    marker = tmp_path / "alive"
    script = (
        "import os, sys, time\n"
        "if os.fork(): sys.exit(0)\n"
        "os.setsid()\n"
        "while True:\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(0.01); os._exit(0)\n"
        f"    open({str(marker)!r}, 'w').write(str(time.time()))\n"
        "    time.sleep(0.005)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", script], preexec_fn=group.join)
    p.wait()
    try:
        deadline = time.time() + 10
        while not marker.exists() and time.time() < deadline:
            time.sleep(0.05)
        assert group.pids(), "the daemon is in the group"
    finally:
        assert group.remove(kill=True)
    assert not group.exists()
    stamp = marker.read_text()
    time.sleep(0.3)
    assert marker.read_text() == stamp, "nothing of the daemon runs any more"


def test_device_allow_list_is_enforced_by_this_kernel(tmp_path):
    """With stand-in nodes 195:0 and 195:1 (no NVIDIA driver here): the group's own GPU opens
    as far as the driver (ENXIO), the other is refused by the cgroup (EPERM)."""
    cgroups, why = Cgroups.detect()
    assert cgroups is not None, why
    assert cgroups.devices_enforced, cgroups.devices_why
    for m in (0, 1):
        os.mknod(tmp_path / f"nvidia{m}", 0o666 | 0o020000, os.makedev(195, m))
    group = cgroups.make(f"test-dev-{os.getpid()}", gpus=[1])  # simulated: minor = index
    try:
        probe = ("import errno, os, sys\n"
                 "for m in (0, 1):\n"
                 "    try:\n"
                 f"        os.close(os.open({str(tmp_path)!r} + f'/nvidia{{m}}', os.O_RDWR))\n"
                 "        print(m, 'opened')\n"
                 "    except OSError as e:\n"
                 "        print(m, errno.errorcode[e.errno])\n")
        out = subprocess.run([sys.executable, "-c", probe], preexec_fn=group.join,
                             capture_output=True, text=True, check=True).stdout
    finally:
        group.remove(kill=True)
    assert out.split("\n")[:2] == ["0 EPERM", "1 ENXIO"], out


def test_the_v2_device_allow_list():
    """What `bpfdevices.allowed_devices` lets a unit open (its program is tested on a real
    cgroup2 mount in tests/unit/test_cgroup2_real.py)."""
    from gpulab.hub.machine.bpfdevices import DEV_CHAR, RW, Rule, allowed_devices, program

    rules = allowed_devices([3, 1], uvm_major=509)
    allowed = {(r.major, r.minor) for r in rules}
    assert {(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 2), (136, None)} < allowed
    assert {(195, 255), (195, 254), (509, 0), (509, 1), (195, 1), (195, 3)} < allowed
    assert (195, 0) not in allowed and (195, 2) not in allowed
    assert all(r.type == DEV_CHAR and r.access == RW for r in rules)  # no mknod, no block
    assert (509, 0) not in {(r.major, r.minor) for r in allowed_devices([0])}
    with pytest.raises(ValueError, match="not the minor of an NVIDIA GPU node"):
        allowed_devices([255])
    # 6 loads, then per rule its tests and `r0 = 1; exit`; last `r0 = 0; exit`
    assert len(program([])) == 8 * 8
    # type, access (no mknod), major, minor
    assert len(program([Rule(DEV_CHAR, 195, 0)])) == 8 * (6 + 4 + 2 + 2)


def test_gpulab_folder_weighs_one_busy_thread_per_cpu(tmp_path):
    """With the kernel's default weight (one busy thread's) on gpulab's folder, all people's
    work together got, on a busy machine, the CPU time of a single thread of any process
    beside it (issue 34's training benchmark: 0.9 CPUs where the same processes started by
    hand had 1.2). The folder gets one thread's weight per CPU, where it still has the
    default; an operator's own value stays."""
    cpus = len(os.sched_getaffinity(0))
    root = fake_v2(tmp_path / "cg")
    (root / "gpulab" / "cpu.weight").write_text("100\n")
    cgroups = Cgroups(2, {"cpu": root / "gpulab", "memory": root / "gpulab"},
                      bpf_problem="not in a fake folder")
    cgroups.make("server-ann-default", person="person-h-ann")
    assert (root / "gpulab" / "cpu.weight").read_text() == str(min(10000, 100 * cpus))
    # v1: cpu.shares of gpulab's folder in the cpu hierarchy
    v1 = fake_v1(tmp_path / "v1")
    (tmp_path / "v1" / "cpu" / "gpulab" / "cpu.shares").write_text("1024\n")
    v1.make("job-x-worker-0", cpus=2)
    assert (tmp_path / "v1" / "cpu" / "gpulab" / "cpu.shares").read_text() == str(1024 * cpus)
    # an operator's own weight is theirs
    (root / "gpulab" / "cpu.weight").write_text("300\n")
    cgroups.make("server-bob-default")
    assert (root / "gpulab" / "cpu.weight").read_text() == "300\n"


def test_gpulab_folder_weight_on_this_machine():
    """On this machine's real hierarchy (v1 here): after a unit is made, gpulab's folder in the
    cpu hierarchy weighs one busy thread per CPU (unless an operator set another weight)."""
    cgroups, why = Cgroups.detect()
    assert cgroups is not None, why
    shares = cgroups.bases["cpu"] / ("cpu.shares" if cgroups.version == 1 else "cpu.weight")
    one = 1024 if cgroups.version == 1 else 100
    want = str(one * len(os.sched_getaffinity(0)))
    before = shares.read_text().strip() if shares.exists() else str(one)
    group = cgroups.make(f"test-weight-{os.getpid()}")
    try:
        assert shares.read_text().strip() == (want if before in (str(one), want) else before)
    finally:
        assert group.remove(kill=True)
