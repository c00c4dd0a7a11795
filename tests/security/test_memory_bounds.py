"""Memory balloons against a real `gpulab up` (issue 36 item 2): eve allocates memory until
the kernel stops her, in her default notebook (whose profile sets no limit) and in a
training replica (whose role sets none), and the hub, its proxy and the gpulab service live
on and answer, as does vic's kernel.

Before the change a default server had no memory limit at all and a replica 8 GiB, on a
machine whose OOM killer scored the hub like everyone's kernels. Now a server without a
limit of its own gets ``c.LocalGPUSpawner.default_mem_limit`` and every server and replica of
one person nests in that person's group, bounded by ``person_mem_limit``. This hub sets both
small (512M and 1G) so that the balloons stay small and fast: each allocates in 16 MiB steps
up to a little over its bound (700 MiB; 1,400 MiB), never more.

And the kernel's OOM killer is steered: the hub, its proxy and the service have a negative
``oom_score_adj``, eve's server and replica a positive one that eve cannot lower (where root
lacks ``CAP_SYS_RESOURCE``, as on this development machine, the hub stays at 0, and eve can
go no lower than that).
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import psutil
import pytest
import requests

from gpulab.hub.machine.cgroups import Cgroups
from tests.conftest import hub_with_config

pytestmark = pytest.mark.security

DEFAULT_LIMIT = 512 * 2**20
PERSON_LIMIT = 2**30


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    """A `gpulab up` as root whose servers get 512 MiB by default and whose people get 1 GiB
    each, all their servers and replicas together (the operator's settings file)."""
    yield from hub_with_config(workdir, prefix, (
        'c.LocalGPUSpawner.default_mem_limit = "512M"\n'
        'c.LocalGPUSpawner.person_mem_limit = "1G"\n'), gpus=0)


#: allocates 16 MiB at a time up to argv[1] MiB, then says it survived
BALLOON = ("import sys\nheld = []\n"
           "for _ in range(int(sys.argv[1]) // 16):\n"
           "    held.append(bytearray(16 * 2**20))\n"
           "print('survived', flush=True)\n")

#: what a process of eve's sees of itself, and whether it can lower its own OOM score (to
#: 499, just below what it was given, and to -1, below the hub's wherever the hub is)
PROBE = ("import json\n"
         "adj = int(open('/proc/self/oom_score_adj').read())\n"
         "lowered = {}\n"
         "for value in ('-1', '499'):\n"
         "    try:\n"
         "        with open('/proc/self/oom_score_adj', 'w') as f:\n"
         "            f.write(value)\n"
         "        lowered[value] = True\n"
         "    except OSError as e:\n"
         "        lowered[value] = e.strerror\n"
         "print('PROBE ' + json.dumps({'cgroup': open('/proc/self/cgroup').read(),\n"
         "                           'adj': adj, 'lowered': lowered}), flush=True)\n")

#: ``CAP_SYS_RESOURCE``: needed to lower an ``oom_score_adj`` (and, when root writes one, to
#: make it the least its process may set again). This development machine's root lacks it
#: (its container drops it): the hub cannot go below 0 there, and says so in its log
CAP_SYS_RESOURCE = 24


def has_sys_resource(pid: int) -> bool:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) & (1 << CAP_SYS_RESOURCE))
    return False


def assert_cannot_lower(seen: dict, hub) -> None:
    """eve's process started at 500 and can never go below the hub; with
    ``CAP_SYS_RESOURCE`` (root as usual) not even below 500."""
    assert seen["adj"] == 500, seen
    assert seen["lowered"]["-1"] == "Permission denied", seen
    if has_sys_resource(hub.proc.pid):
        assert seen["lowered"]["499"] == "Permission denied", seen


def probe_of(text: str) -> dict:
    for line in text.splitlines():
        if line.startswith("PROBE "):
            return json.loads(line.removeprefix("PROBE "))
    raise AssertionError(f"no probe in: {text[-2000:]}")


def memory_group(cgroup_text: str) -> Path:
    """The memory folder of the gpulab group a /proc/<pid>/cgroup text names."""
    cgroups, why = Cgroups.detect()
    assert cgroups is not None, f"control groups are needed here and missing: {why}"
    for line in cgroup_text.splitlines():
        _, controllers, path = line.split(":", 2)
        if cgroups.version == 2 and controllers == "":
            return Path("/sys/fs/cgroup") / path.lstrip("/")
        if "memory" in controllers.split(","):
            return Path("/sys/fs/cgroup/memory") / path.lstrip("/")
    raise AssertionError(cgroup_text)


def limit_of(folder: Path) -> int:
    f = folder / "memory.max"
    return int((f if f.exists() else folder / "memory.limit_in_bytes").read_text())


def oom_kills(folder: Path) -> int:
    f = folder / "memory.events"
    text = (f if f.exists() else folder / "memory.oom_control").read_text()
    return int(re.search(r"^oom_kill (\d+)", text, re.M).group(1))


def oom_score_adj(pid: int) -> int:
    return int(Path(f"/proc/{pid}/oom_score_adj").read_text())


def gpulab_processes(hub) -> dict[str, int]:
    """The hub (`gpulab up` runs it in its own process), its proxy and the gpulab service."""
    service = [p.pid for p in psutil.Process(hub.proc.pid).children()
               if "gpulab.hub.service" in " ".join(p.cmdline())]
    assert len(service) == 1, service
    return {"hub": hub.proc.pid, "proxy": int((hub.data_dir / "proxy.pid").read_text()),
            "service": service[0]}


def assert_all_answer(hub, vic, before: dict[str, int]) -> None:
    """The hub, the proxy and the service are the same processes as before, and answer;
    vic's kernel too."""
    assert gpulab_processes(hub) == before
    assert requests.get(hub.url + "/hub/api/", timeout=10).status_code == 200
    assert vic.service("GET", "me", timeout=10).status_code == 200
    assert vic.run_in_kernel("print(6 * 7)").strip() == "42"


def test_gpulab_runs_out_of_reach_of_the_oom_killer_and_people_do_not(hub, vic, eve):
    procs = gpulab_processes(hub)
    adj = {name: oom_score_adj(pid) for name, pid in procs.items()}
    if has_sys_resource(hub.proc.pid):
        assert all(v == -900 for v in adj.values()), adj
    else:  # where root may not lower scores: as low as it can be, and the hub says why
        assert all(v <= 0 for v in adj.values()), adj
        assert "The hub's oom_score_adj stays" in hub.output()
        print(f"no CAP_SYS_RESOURCE here: hub, proxy and service stay at {adj}")
    servers = [p for p in psutil.process_iter(["uids", "cmdline"])
               if p.info["uids"] and p.info["uids"].real == eve.account.pw_uid
               and "jupyterhub.singleuser" in " ".join(p.info["cmdline"] or ())]
    assert servers and all(oom_score_adj(p.pid) == 500 for p in servers), servers
    # a kernel of eve's (a child of her server) is at 500 too, and cannot go lower
    assert_cannot_lower(probe_of(eve.run_in_kernel(PROBE)), hub)


def test_a_balloon_in_a_default_notebook_is_killed_in_its_own_group(hub, vic, eve):
    before = gpulab_processes(hub)
    seen = probe_of(eve.run_in_kernel(PROBE))
    unit = memory_group(seen["cgroup"])
    person = unit.parent
    # eve's default server: its own group, with the default limit, in eve's person group
    assert re.fullmatch(r"server-[0-9a-f]{8}-u\d+-default", unit.name), unit
    assert re.fullmatch(r"person-[0-9a-f]{8}-eve", person.name) and person.parent.name == \
        "gpulab", person
    assert limit_of(unit) == DEFAULT_LIMIT and limit_of(person) == PERSON_LIMIT
    kills = oom_kills(unit)
    t = time.monotonic()
    out = eve.run_in_kernel(
        "import subprocess, sys\n"
        f"p = subprocess.run([sys.executable, '-c', {BALLOON!r}, '700'], capture_output=True,\n"
        "                   text=True)\n"
        "print(p.returncode, p.stdout.strip())\n", timeout=120)
    took = time.monotonic() - t
    assert out.split() == ["-9"], out  # killed by the kernel, not 'survived'
    assert oom_kills(unit) > kills
    print(f"eve's 700 MiB balloon in her default notebook: killed at its 512 MiB limit in "
          f"{took:.1f} s; the kernel and server it ran in live on")
    assert eve.run_in_kernel("print(6 * 7)").strip() == "42"  # her server is fine
    assert_all_answer(hub, vic, before)


def test_a_persons_replicas_and_servers_together_stay_within_the_person_limit(hub, vic, eve):
    """A replica's own default is 8 GiB (``c.GPUJobs.default_memory``), and a person may run
    32: the person's group bounds them with eve's server, at 1 GiB here."""
    before = gpulab_processes(hub)
    source = (PROBE + "import subprocess, sys\n"
              f"p = subprocess.run([sys.executable, '-c', {BALLOON!r}, '1400'])\n"
              "print('BALLOON', p.returncode, flush=True)\n"
              # the replica stays (its group with it) until the test has read the group's
              # files and stops the job: a finished job's groups go at once
              "import time\ntime.sleep(600)\n")
    spec = {"name": "balloon", "strategy": "multi-worker-mirrored", "replicas": {"worker": 1},
            "resources": {"worker": {"gpus": 0}}, "source": source, "retries": 0}
    r = eve.service("POST", "jobs", json=spec)
    assert r.status_code == 201, r.text
    deadline, log = time.time() + 180, ""
    while "BALLOON" not in log and time.time() < deadline:
        time.sleep(0.5)
        got = eve.service("GET", "jobs/balloon/logs/worker-0")
        log = got.json().get("text", "") if got.status_code == 200 else ""
    assert "BALLOON -9" in log, log[-2000:]
    seen = probe_of(log)
    assert_cannot_lower(seen, hub)
    unit = memory_group(seen["cgroup"])
    assert unit.name == f"job-{r.json()['id']}-worker-0"
    # the replica nests in the same person group as eve's server
    server = memory_group(probe_of(eve.run_in_kernel(PROBE))["cgroup"])
    assert unit.parent == server.parent and limit_of(unit) == 8 * 2**30
    assert oom_kills(unit) >= 1
    print("eve's 1,400 MiB balloon in a replica (its own limit 8 GiB): killed at her person "
          "limit of 1 GiB, which her server shares")
    assert_all_answer(hub, vic, before)
    eve.service("POST", "jobs/balloon/stop")
