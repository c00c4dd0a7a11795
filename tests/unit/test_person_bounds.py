"""Default limits and the person-level group (issue 36 item 2): the arithmetic of the
defaults, which limit a server gets (profile, operator, default), the nesting of units in
their person's group (on folders that stand in for the v1 and v2 hierarchies, as
tests/unit/test_cgroups.py does), and on this machine's real hierarchy (cgroup v1 here): a
person's memory limit kills a process of a unit that has none of its own, the person's group
goes with their last unit, and units of one person made and removed at once from several
threads never fail. The attack on a real ``gpulab up`` is tests/security/test_memory_bounds.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from types import SimpleNamespace

import pytest
from traitlets.config import Config

from gpulab.hub.deploy.localhub import person_bounds
from gpulab.hub.jobs.spec import GPUJobs, limits_from_json
from gpulab.hub.machine.cgroups import (CPU_PERIOD_US, Cgroups, machine_memory, person_unit,
                                    share_of_cpus, share_of_memory)
from gpulab.hub.machine.inventory import GPUInventory
from gpulab.spawner.local import LocalGPUSpawner
from gpulab.hub.quota.settings import GPULedger
from tests.unit.test_cgroups import fake_v1, fake_v2

GiB, MiB = 2**30, 2**20


# -- the defaults' arithmetic ------------------------------------------------------------------

@pytest.mark.parametrize("fraction, total, share", [
    (0.25, 24 * GiB, 6 * GiB), (0.5, 24 * GiB, 12 * GiB), (0.25, 1000 * MiB + 123, 250 * MiB),
    (0.5, 100 * MiB, 64 * MiB),
], ids=["quarter", "half", "whole-MiB", "at-least-64MiB"])
def test_a_share_of_memory(fraction, total, share):
    assert share_of_memory(fraction, total) == share


@pytest.mark.parametrize("fraction, cpus, share", [
    (0.5, 2, 1.0), (0.75, 2, 1.5), (0.5, 1, 1.0), (0.75, 1, 1.0), (0.75, 64, 48.0),
    (0.75, 6, 4.5), (0.5, 3, 1.5),
])
def test_a_share_of_cpus(fraction, cpus, share):
    assert share_of_cpus(fraction, cpus) == share


def test_machine_memory_is_memtotal(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       24576000 kB\nMemFree:         1000 kB\n")
    assert machine_memory(f) == 24576000 * 1024
    # without it, the kernel's page count
    assert machine_memory(tmp_path / "none") == os.sysconf("SC_PAGE_SIZE") * os.sysconf(
        "SC_PHYS_PAGES")


def test_person_units_are_one_per_hub_and_person():
    assert person_unit("0123abcd", "ann") == "person-0123abcd-ann"
    assert person_unit("ffff0000", "ann") != person_unit("0123abcd", "ann")
    odd = {person_unit("0123abcd", n) for n in ("Ann", "ann", "a/../b", "x" * 300, "ann---1")}
    assert len(odd) == 5
    assert all(len(u) <= 64 and "/" not in u for u in odd)


# -- which limits a server gets --------------------------------------------------------------

@pytest.fixture
def config(tmp_path):
    c = Config()
    c.GPULedger.db_url = f"sqlite:///{tmp_path / 'gpulab.sqlite'}"
    c.GPUInventory.source = "simulated"
    c.GPUInventory.simulated_gpus = 0
    c.LocalGPUSpawner.profile_list = [
        {"display_name": "CPU only", "slug": "cpu", "default": True},
        {"display_name": "Small", "slug": "small",
         "kubespawner_override": {"cpu_limit": 0.5, "mem_limit": "512M"}},
    ]
    GPULedger.clear_instance()
    GPUInventory.clear_instance()
    yield c
    GPULedger.clear_instance()
    GPUInventory.clear_instance()


def spawner(config) -> LocalGPUSpawner:
    user = SimpleNamespace(name="ann", id=1, groups=[], url="/user/ann/")
    return LocalGPUSpawner(config=config, user=user)


def test_a_server_without_limits_in_its_profile_gets_the_defaults(config):
    s = spawner(config)
    assert s.default_mem_limit == share_of_memory(0.25)
    assert s.default_cpu_limit == share_of_cpus(0.5)
    assert s.person_mem_limit == share_of_memory(0.5)
    assert s.person_cpu_limit == share_of_cpus(0.75)
    assert s.oom_score_adj == 500
    s._apply_profile(s.gpu_selection({"profile": "cpu"}))
    assert (s.mem_limit, s.cpu_limit) == (share_of_memory(0.25), share_of_cpus(0.5))
    # a profile's own limits win, and the next start without them gets the defaults back
    s._apply_profile(s.gpu_selection({"profile": "small"}))
    assert (s.mem_limit, s.cpu_limit) == (512 * MiB, 0.5)
    s._apply_profile(s.gpu_selection({"profile": "cpu"}))
    assert (s.mem_limit, s.cpu_limit) == (share_of_memory(0.25), share_of_cpus(0.5))


def test_the_operator_changes_or_drops_the_defaults(config):
    config.LocalGPUSpawner.default_mem_limit = "1G"
    config.LocalGPUSpawner.default_cpu_limit = 0
    assert (spawner(config).mem_limit, spawner(config).cpu_limit) == (GiB, None)
    # the base class's own settings still win over gpulab's defaults
    config.Spawner.mem_limit = "2G"
    config.Spawner.cpu_limit = 3.0
    assert (spawner(config).mem_limit, spawner(config).cpu_limit) == (2 * GiB, 3.0)


def test_the_hub_hands_the_person_bounds_to_the_service_with_the_job_limits(config):
    """One owner: ``c.LocalGPUSpawner.person_*`` and ``oom_score_adj``, carried as job-limit
    fields (the hub's `load_config_file`), and the hub's tag is the spawner's."""
    config.LocalGPUSpawner.person_mem_limit = "3G"
    config.LocalGPUSpawner.person_cpu_limit = 1.25
    config.LocalGPUSpawner.oom_score_adj = 300
    config.JupyterHub.db_url = "sqlite:////srv/hub/jupyterhub.sqlite"
    config.LocalGPUSpawner.max_user_processes = 2048
    bounds = person_bounds(config, LocalGPUSpawner)
    assert bounds == {"person_tag": spawner(config)._hub_tag(), "person_memory": 3 * GiB,
                      "person_cpu": 1.25, "oom_score_adj": 300, "max_user_processes": 2048}
    import dataclasses

    limits = dataclasses.replace(GPUJobs(config=config).limits(), **bounds)
    again = limits_from_json(json.dumps(dataclasses.asdict(limits)))
    assert (again.person_tag, again.person_memory, again.person_cpu, again.oom_score_adj) == (
        bounds["person_tag"], 3 * GiB, 1.25, 300)
    assert spawner(config).person_unit == person_unit(again.person_tag, "ann")
    # a spawner that is not gpulab's local one: replicas get no person-level group
    from jupyterhub.spawner import LocalProcessSpawner

    assert person_bounds(config, LocalProcessSpawner) == {}


def test_the_jobs_process_bound_is_the_spawners_unless_set_apart(config, caplog):
    """``RLIMIT_NPROC`` bounds one account's processes in servers and replicas together: the
    jobs' bound follows ``c.LocalGPUSpawner.max_user_processes``; set on its own it stays, and
    a different figure in both places is said in the log."""
    import dataclasses

    config.LocalGPUSpawner.max_user_processes = 3000
    limits = dataclasses.replace(GPUJobs(config=config).limits(),
                                 **person_bounds(config, LocalGPUSpawner))
    assert limits.max_user_processes == 3000
    config.GPUJobs.max_user_processes = 3000  # the same in both: nothing to say
    with caplog.at_level("WARNING", logger="gpulab"):
        assert "max_user_processes" not in person_bounds(config, LocalGPUSpawner)
    assert "differs" not in caplog.text
    config.GPUJobs.max_user_processes = 5000
    with caplog.at_level("WARNING", logger="gpulab"):
        bounds = person_bounds(config, LocalGPUSpawner)
    assert "max_user_processes" not in bounds
    assert "c.GPUJobs.max_user_processes (5000) differs" in caplog.text


# -- nesting, on stand-in folders --------------------------------------------------------------

def test_v2_units_nest_in_their_persons_group_with_its_limits(tmp_path):
    root = fake_v2(tmp_path / "cg")
    base = root / "gpulab"
    cgroups = Cgroups(2, {"cpu": base, "memory": base, "pids": base}, bpf_problem="a fake")
    server = cgroups.make("server-h-u1-default", memory=512 * MiB, cpus=4, pids=100,
                          person="person-h-ann", person_memory=GiB, person_cpus=1.5)
    person = base / "person-h-ann"
    assert server.dirs == {c: person / "server-h-u1-default" for c in ("cpu", "memory", "pids")}
    assert (person / "memory.max").read_text() == str(GiB)
    assert (person / "cpu.max").read_text() == f"{int(1.5 * CPU_PERIOD_US)} {CPU_PERIOD_US}"
    assert (person / "cgroup.subtree_control").read_text() == "+cpu +memory +pids"
    # the unit's own CPU limit is at most its person's (v1 refuses more; v2 caps it anyway)
    assert (server.dirs["cpu"] / "cpu.max").read_text() == f"{int(1.5 * CPU_PERIOD_US)} " \
        f"{CPU_PERIOD_US}"
    assert (server.dirs["memory"] / "memory.max").read_text() == str(512 * MiB)
    # a replica of the same person: the same group, whose limits are not written again
    # when they are what it has, and are when the operator changed them
    (person / "memory.max").write_text(str(GiB))  # as the kernel shows it
    before = (person / "memory.max").stat().st_mtime_ns
    replica = cgroups.make("job-1-worker-0", person="person-h-ann", person_memory=GiB,
                           person_cpus=1.5)
    assert replica.dirs["memory"].parent == person
    assert (person / "memory.max").stat().st_mtime_ns == before
    cgroups.make("job-1-worker-1", person="person-h-ann", person_memory=2 * GiB,
                 person_cpus=None)
    assert (person / "memory.max").read_text() == str(2 * GiB)
    assert (person / "cpu.max").read_text() == f"max {CPU_PERIOD_US}"
    # another person has a group of their own
    other = cgroups.make("server-h-u2-default", person="person-h-bob", person_memory=GiB)
    assert other.dirs["memory"].parent == base / "person-h-bob"


def test_v1_units_nest_in_their_persons_group_in_every_hierarchy(tmp_path):
    cgroups = fake_v1(tmp_path)
    person = {c: tmp_path / c / "gpulab" / "person-h-ann" for c in ("memory", "cpu",
                                                                    "devices", "freezer")}
    person["memory"].mkdir()
    (person["memory"] / "memory.use_hierarchy").write_text("0")  # an old kernel's default
    group = cgroups.make("server-h-u1-default", memory=512 * MiB, cpus=2.0, gpus=[],
                         person="person-h-ann", person_memory=GiB, person_cpus=1.0)
    assert group.dirs == {c: d / "server-h-u1-default" for c, d in person.items()}
    assert (person["memory"] / "memory.use_hierarchy").read_text() == "1"
    assert (person["memory"] / "memory.limit_in_bytes").read_text() == str(GiB)
    assert (person["cpu"] / "cpu.cfs_quota_us").read_text() == str(CPU_PERIOD_US)
    assert (group.dirs["cpu"] / "cpu.cfs_quota_us").read_text() == str(CPU_PERIOD_US)
    assert (group.dirs["memory"] / "memory.limit_in_bytes").read_text() == str(512 * MiB)


def test_find_knows_where_a_unit_is_without_its_person(tmp_path):
    """Stop (after a hub or service restart too) finds a unit by its name alone: in its
    person's group, or where gpulab made units before person-level groups."""
    root = fake_v2(tmp_path / "cg")
    base = root / "gpulab"
    cgroups = Cgroups(2, {"cpu": base, "memory": base}, bpf_problem="a fake")
    cgroups.make("job-7-chief-0", person="person-h-ann")
    cgroups.make("server-h-u3-old")  # the layout before
    assert cgroups.find("job-7-chief-0").dirs["memory"] == base / "person-h-ann" / "job-7-chief-0"
    assert cgroups.find("server-h-u3-old").dirs["memory"] == base / "server-h-u3-old"
    assert cgroups.find("job-8-chief-0").dirs["memory"] == base / "job-8-chief-0"
    assert not cgroups.find("job-8-chief-0").exists()
    assert cgroups.find("../x", person="../../y").dirs["memory"].parent.parent == base


# -- on this machine's real hierarchy ------------------------------------------------------------

BALLOON = ("import sys\nheld = []\n"
           "for _ in range(int(sys.argv[1])):\n"
           "    held.append(bytearray(16 * 2**20))\n"
           "print('survived', flush=True)\n")


def test_a_persons_memory_limit_bounds_a_unit_without_its_own(tmp_path):
    """The kernel enforces the person's limit on what runs in their units (v1 here: with
    ``memory.use_hierarchy`` 1): 64 MiB for the person, none for the unit, a process that
    takes 256 MiB in 16 MiB steps is killed, counted in its unit; a second unit keeps the
    person's group while the first goes, and the last takes it along."""
    cgroups, why = Cgroups.detect()
    assert cgroups is not None, why
    person = f"person-test-{os.getpid()}"
    first = cgroups.make(f"test-balloon-{os.getpid()}", person=person, person_memory=64 * MiB)
    second = cgroups.make(f"test-other-{os.getpid()}", person=person, person_memory=64 * MiB)
    try:
        folder = first.dirs["memory"].parent
        assert folder.name == person
        if cgroups.version == 1:
            assert (folder / "memory.use_hierarchy").read_text().strip() == "1"
        p = subprocess.run([sys.executable, "-c", BALLOON, "16"], preexec_fn=first.join,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == -9 and "survived" not in p.stdout, (p.returncode, p.stderr)
        assert first.oom_kills() >= 1
        assert first.remove(kill=True)
        assert all(d.parent.is_dir() for d in second.dirs.values())  # the second holds it
    finally:
        first.remove(kill=True)
        assert second.remove(kill=True)
    assert not any(d.parent.exists() for d in second.dirs.values())


def test_units_of_one_person_come_and_go_at_once(tmp_path):
    """Creation and removal race in the person's group: one unit's removal takes the group
    while another's `make` is between the group and its own folder. `make` makes it again
    (create-if-missing), removal leaves a busy group (remove-if-empty): nothing fails, and
    nothing is left."""
    cgroups, why = Cgroups.detect()
    assert cgroups is not None, why
    person, errors = f"person-race-{os.getpid()}", []

    def churn(n: int) -> None:
        try:
            for i in range(25):
                g = cgroups.make(f"test-race-{os.getpid()}-{n}-{i}", person=person,
                                 person_memory=GiB, person_cpus=1.0)
                assert g.remove(kill=False, timeout=2)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(traceback.format_exc())

    threads = [threading.Thread(target=churn, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == [], "\n".join(errors)
    assert not any((b / person).exists() for b in cgroups.bases.values())


def test_a_person_limit_the_kernel_refuses_to_lower_now_is_kept_and_logged(caplog):
    """v1 refuses a parent's CPU quota below a child's (EINVAL): the operator lowered the
    person's CPUs while a unit with the old bound runs. The next unit still starts, and the
    log says the person's limit stays as it was (v2 takes the lower value: it caps children)."""
    cgroups, why = Cgroups.detect()
    assert cgroups is not None, why
    person = f"person-lower-{os.getpid()}"
    first = cgroups.make(f"test-lower-a-{os.getpid()}", cpus=1.0, person=person,
                         person_cpus=1.0)
    try:
        second = cgroups.make(f"test-lower-b-{os.getpid()}", person=person, person_cpus=0.5)
        folder = second.dirs["cpu"].parent
        if cgroups.version == 1:
            assert (folder / "cpu.cfs_quota_us").read_text().strip() == str(CPU_PERIOD_US)
            assert "The CPU limit of " + person + " stays as it was" in caplog.text
        else:
            assert (folder / "cpu.max").read_text().split()[0] == str(CPU_PERIOD_US // 2)
        assert second.remove(kill=True)
    finally:
        assert first.remove(kill=True)
    assert not any((b / person).exists() for b in cgroups.bases.values())
