"""CPU and memory limits of a profile, enforced on a local server by its control group: a
researcher's program over the memory limit is killed (not the machine's other work), a busy
loop is throttled to the CPU limit, and what the server leaves behind ends with it. A server
whose profile sets no limits gets the defaults (``c.LocalGPUSpawner.default_mem_limit`` /
``default_cpu_limit``), and every server nests in its person's group."""

import json
import re
from pathlib import Path

import pytest

from gpulab.hub.machine.cgroups import Cgroups
from tests.app.hubctl import Hub

pytestmark = pytest.mark.app

PROFILES = [
    {"display_name": "CPU only", "slug": "cpu", "default": True},
    {"display_name": "Small: half a CPU, 512 MiB", "slug": "small",
     "kubespawner_override": {"cpu_limit": 0.5, "mem_limit": "512M"}},
]


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    data = workdir / "data"
    data.mkdir(mode=0o700)
    (data / "gpulab_config.py").write_text(f"c.LocalGPUSpawner.profile_list = {PROFILES!r}\n")
    (data / "gpulab_config.py").chmod(0o600)
    h = Hub(data, "--simulated-gpus", "0", "--user-prefix", prefix).start()
    yield h
    h.stop()


def cgroup_dirs(text: str) -> dict[str, Path]:
    """The memory and cpu folders of the group a /proc/<pid>/cgroup text names."""
    cgroups, why = Cgroups.detect()
    assert cgroups is not None, why
    dirs = {}
    for line in text.splitlines():
        if line.count(":") < 2:  # not a /proc/<pid>/cgroup line (a kernel's other output)
            continue
        _, controllers, path = line.split(":", 2)
        if cgroups.version == 2 and controllers == "":
            return {"memory": Path("/sys/fs/cgroup") / path.lstrip("/"),
                    "cpu": Path("/sys/fs/cgroup") / path.lstrip("/")}
        for c in controllers.split(","):
            if c in ("memory", "cpu"):
                dirs[c] = Path("/sys/fs/cgroup") / c / path.lstrip("/")
    return dirs


def test_profile_limits_are_enforced_on_the_server(hub, users):
    ann = users["ann"]
    r = ann.start_server("small", {"profile": "small"})
    assert r.status_code in (201, 202), r.text
    try:
        probe = ann.run_in_kernel(
            "import json, os, subprocess, sys, time\n"
            "print(json.dumps({'cgroup': open('/proc/self/cgroup').read(),\n"
            "                  'env': [os.environ.get('MEM_LIMIT'), os.environ.get('CPU_LIMIT')]}))\n",
            server="small")
        seen = json.loads(probe)
        assert seen["env"] == [str(512 * 2**20), "0.5"]
        dirs = cgroup_dirs(seen["cgroup"])
        # the group is named by the hub's user id and the server's name (unambiguous), in
        # the group of its person
        assert all(re.search(r"/gpulab/person-[0-9a-f]{8}-ann/server-[0-9a-f]{8}-u\d+-small$",
                             str(d)) for d in dirs.values()), dirs
        memory, cpu = dirs["memory"], dirs["cpu"]

        # within the limit: fine; over it: that program is killed, the server lives on
        out = ann.run_in_kernel(
            "import subprocess, sys\n"
            "for mb in (64, 900):\n"
            "    p = subprocess.run([sys.executable, '-c', f'b = bytearray({mb} * 2**20); print(len(b))'],\n"
            "                       capture_output=True, text=True)\n"
            "    print(mb, p.returncode)\n", server="small", timeout=90)
        assert out.split("\n")[:2] == ["64 0", "900 -9"], out
        events = (memory / ("memory.events" if (memory / "memory.events").exists()
                            else "memory.oom_control")).read_text()
        assert int(re.search(r"oom_kill (\d+)", events).group(1)) >= 1

        # a busy loop gets half a CPU: the kernel throttles the group
        out = ann.run_in_kernel(
            "import time\nt = time.time()\nwhile time.time() - t < 2: pass\n"
            "import os; print(round(os.times().user, 2))\n", server="small", timeout=60)
        stat = dict(line.split() for line in (cpu / "cpu.stat").read_text().splitlines())
        assert int(stat["nr_throttled"]) > 0, stat
        assert float(out) < 1.5, out
    finally:
        ann.stop_server("small")
    # the group (and anything the server left in it) is gone with the server
    assert not memory.exists() and not cpu.exists()


def test_a_server_without_limits_in_its_profile_gets_the_defaults(hub, users):
    """Every server has a group of its own (its GPU devices, a clean stop); one whose profile
    sets no limits gets the defaults: a quarter of the machine's memory, half its CPUs (at
    least one), within its person's group (half the memory, three quarters of the CPUs)."""
    from gpulab.hub.machine.cgroups import CPU_PERIOD_US, share_of_cpus, share_of_memory

    bob = users["bob"]
    assert bob.start_server("", {"profile": "cpu"}).status_code in (201, 202)
    try:
        dirs = cgroup_dirs(bob.run_in_kernel("print(open('/proc/self/cgroup').read())"))
        assert all(re.search(r"/gpulab/person-[0-9a-f]{8}-bob/server-[0-9a-f]{8}-u\d+-default$",
                             str(d)) for d in dirs.values()), dirs
        memory, cpu = dirs["memory"], dirs["cpu"]
        unit_cpu = int(share_of_cpus(0.5) * CPU_PERIOD_US)
        person_cpu = int(share_of_cpus(0.75) * CPU_PERIOD_US)
        if (memory / "memory.max").exists():
            assert int((memory / "memory.max").read_text()) == share_of_memory(0.25)
            assert int((memory.parent / "memory.max").read_text()) == share_of_memory(0.5)
            assert int((cpu / "cpu.max").read_text().split()[0]) == unit_cpu
            assert int((cpu.parent / "cpu.max").read_text().split()[0]) == person_cpu
        else:
            assert int((memory / "memory.limit_in_bytes").read_text()) == share_of_memory(0.25)
            assert int((memory.parent / "memory.limit_in_bytes").read_text()) == \
                share_of_memory(0.5)
            assert int((cpu / "cpu.cfs_quota_us").read_text()) == unit_cpu
            assert int((cpu.parent / "cpu.cfs_quota_us").read_text()) == person_cpu
    finally:
        bob.stop_server()
    # the server's group is gone, and so is bob's, which held nothing else
    assert not memory.exists() and not cpu.exists()
    assert not memory.parent.exists() and not cpu.parent.exists()
