"""gpulab.spawner.cgroups: what it writes where.

The kernel's enforcement is tested for real in tests/app/test_limits.py and
tests/app/test_jobs_api.py on this machine's hierarchy (cgroup v1 here). A cgroup v2 hierarchy
with cpu and memory cannot be mounted here, so the v2 layout is checked against a folder that
stands in for /sys/fs/cgroup (with the control files the kernel would show)."""

from pathlib import Path

import pytest

from gpulab.spawner.cgroups import CPU_PERIOD_US, Cgroups, memory_bytes


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
    (root / "gpulab" / "cgroup.subtree_control").write_text("")
    return root


def test_v2_groups_sit_under_gpulab_at_the_top_with_the_limits(tmp_path):
    root = fake_v2(tmp_path / "cg")
    own = tmp_path / "self"
    own.write_text("0::/user.slice/user-0.slice/session-1.scope\n")
    cgroups = Cgroups(2, {"cpu": root / "gpulab", "memory": root / "gpulab"})
    group = cgroups.make("server-ann-default", memory=256 * 2**20, cpus=1.5)
    d = root / "gpulab" / "server-ann-default"
    assert group.dirs == {"cpu": d, "memory": d}
    assert (d / "memory.max").read_text() == str(256 * 2**20)
    assert (d / "cpu.max").read_text() == f"{int(1.5 * CPU_PERIOD_US)} {CPU_PERIOD_US}"
    # gpulab's folder hands cpu and memory down to its groups
    assert (root / "gpulab" / "cgroup.subtree_control").read_text() == "+cpu +memory"
    assert group.procs_files == [d / "cgroup.procs"]
    (d / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
    assert group.oom_kills() == 1
    # only a limit that is set is written as a number
    other = cgroups.make("job-x-worker-0", cpus=0.5)
    assert (other.dirs["memory"] / "memory.max").read_text() == "max"
    assert (other.dirs["cpu"] / "cpu.max").read_text() == f"{CPU_PERIOD_US // 2} {CPU_PERIOD_US}"


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
    assert not any((b / "gpulab-probe").exists() for b in cgroups.bases.values())
