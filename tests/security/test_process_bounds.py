"""Fork bombs against a real `gpulab up` (issue 36 item 1): eve starts processes until the
kernel refuses, in her notebook server and in a training replica, with the default bounds
(``c.LocalGPUSpawner.pids_limit``, 1024 a server; ``c.GPUJobs.pids_per_replica``, 512 a
replica, on machines up to 128 CPUs). Each bomb is itself bounded (at most 3,000 forks, the
children sleep 60 s) so that the code before the bound, which refused nothing, ran 3,000
processes here rather than exhausting the machine's 32,768 process numbers.

Meanwhile vic's ``GET me`` on the gpulab service is timed (the slowest answer is printed and
must stay under 5 s) and vic's kernel still answers. Then eve's server and job are stopped and
nothing of her account runs any more.
"""

from __future__ import annotations

import json
import threading
import time

import psutil
import pytest
import requests

from gpulab.hub.machine.cgroups import Cgroups

pytestmark = pytest.mark.security

#: a small program (not the kernel's or the replica's own process, so each fork copies
#: little) that forks sleeping children until the kernel refuses, at most 3,000
BOMB = r"""
import json, os, time
forked, refused = 0, None
for _ in range(3000):
    try:
        pid = os.fork()
    except OSError as e:
        refused = e.errno
        break
    if pid == 0:  # off the pipe its parent's reader waits on
        null = os.open("/dev/null", os.O_RDWR)
        os.dup2(null, 1)
        os.dup2(null, 2)
        time.sleep(60)
        os._exit(0)
    forked += 1
print("BOMB " + json.dumps({"forked": forked, "errno": refused,
                            "cgroup": open("/proc/self/cgroup").read()}), flush=True)
"""

#: runs BOMB in a child of the kernel or replica (in its group, as its account)
LAUNCH = ("import subprocess, sys\n"
          f"r = subprocess.run([sys.executable, '-c', {BOMB!r}], capture_output=True, "
          "text=True, timeout=120)\n"
          "print(r.stdout + r.stderr, flush=True)\n")


class Watch:
    """vic's ``GET me`` on the gpulab service, again and again in a thread: every answer's
    status and time."""

    def __init__(self, vic):
        self.url = vic.hub.service_api + "me"
        self.headers = {"Authorization": f"token {vic.token()}"}
        self.answers: list[tuple[int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                code = requests.get(self.url, headers=self.headers, timeout=30).status_code
            except requests.RequestException:
                code = 0
            self.answers.append((code, time.monotonic() - t))
            time.sleep(0.05)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join(timeout=60)

    @property
    def slowest(self) -> float:
        return max(t for _, t in self.answers)


def bomb_result(output: str) -> dict:
    for line in output.splitlines():
        if line.startswith("BOMB "):
            return json.loads(line.removeprefix("BOMB "))
    raise AssertionError(f"the bomb printed no result: {output[-2000:]}")


def pids_group(cgroup_text: str) -> tuple[Cgroups, str]:
    """(this machine's cgroups, the unit) of the gpulab group a /proc/<pid>/cgroup names."""
    cgroups, why = Cgroups.detect()
    assert cgroups is not None, f"control groups are needed here and missing: {why}"
    assert cgroups.pids_enforced, "this machine has a pids controller (checked in the issue)"
    for line in cgroup_text.splitlines():
        _, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(",") or (cgroups.version == 2 and controllers == ""):
            assert "/gpulab/" in path, cgroup_text
            return cgroups, path.rsplit("/", 1)[1]
    raise AssertionError(cgroup_text)


def assert_bounded(result: dict, bound: int, cgroups: Cgroups, unit: str) -> None:
    group = cgroups.find(unit)
    assert (group.dirs["pids"] / "pids.max").read_text().strip() == str(bound)
    # refused (EAGAIN) below the bound: the server's or replica's own processes and
    # threads count too
    assert result["errno"] == 11, result
    assert 0 < result["forked"] < bound, result
    assert group.pids_refused() > 0


def account_processes(uid: int, marker: str = "") -> list[psutil.Process]:
    """The processes of the account `uid` (whose command line holds `marker`)."""
    return [p for p in psutil.process_iter(["uids", "cmdline"])
            if p.info["uids"] and p.info["uids"].real == uid
            and marker in " ".join(p.info["cmdline"] or ())]


def wait_gone(uid: int, marker: str = "", timeout: float = 20) -> list[psutil.Process]:
    deadline = time.time() + timeout
    while (left := account_processes(uid, marker)) and time.time() < deadline:
        time.sleep(0.2)
    return left


def test_a_fork_bomb_in_a_server_stops_at_its_bound(hub, vic, eve):
    t = time.monotonic()
    assert vic.run_in_kernel("print(6 * 7)").strip() == "42"  # a new kernel each time
    vic_kernel_before = time.monotonic() - t
    with Watch(vic) as watch:
        out = eve.run_in_kernel(LAUNCH, timeout=180)
        result = bomb_result(out)
        # while eve's children hold her server at its bound: vic's kernel still answers
        t = time.monotonic()
        assert vic.run_in_kernel("print(6 * 7)").strip() == "42"
        vic_kernel = time.monotonic() - t
        time.sleep(2)
    cgroups, unit = pids_group(result["cgroup"])
    assert_bounded(result, 1024, cgroups, unit)
    print(f"server bomb: {result['forked']} forks then EAGAIN; vic's GET me: "
          f"{len(watch.answers)} answers, slowest {watch.slowest:.3f} s; vic's kernel "
          f"{vic_kernel:.2f} s to start and answer (before the bomb {vic_kernel_before:.2f} s)")
    assert watch.answers and all(code == 200 for code, _ in watch.answers), watch.answers
    assert watch.slowest < 5, watch.answers
    # eve's server stops and takes everything of hers with it
    eve.stop_server()
    assert wait_gone(eve.account.pw_uid) == []
    assert not cgroups.find(unit).exists()


def test_a_fork_bomb_in_a_replica_stops_at_its_bound(hub, vic, eve):
    spec = {"name": "bomb", "strategy": "multi-worker-mirrored", "replicas": {"worker": 1},
            "resources": {"worker": {"gpus": 0}},
            "source": LAUNCH + "import time\ntime.sleep(600)\n"}
    with Watch(vic) as watch:
        r = eve.service("POST", "jobs", json=spec)
        assert r.status_code == 201, r.text
        deadline, log = time.time() + 240, ""
        while "BOMB " not in log and time.time() < deadline:
            time.sleep(0.5)
            got = eve.service("GET", "jobs/bomb/logs/worker-0")
            log = got.json().get("text", "") if got.status_code == 200 else ""
        result = bomb_result(log)
        time.sleep(2)
    cgroups, unit = pids_group(result["cgroup"])
    assert unit == f"job-{r.json()['id']}-worker-0"
    assert_bounded(result, 512, cgroups, unit)
    print(f"replica bomb: {result['forked']} forks then EAGAIN; vic's GET me: "
          f"{len(watch.answers)} answers, slowest {watch.slowest:.3f} s")
    assert watch.answers and all(code == 200 for code, _ in watch.answers), watch.answers
    assert watch.slowest < 5, watch.answers
    assert len(account_processes(eve.account.pw_uid, "BOMB")) == result["forked"]
    assert eve.service("POST", "jobs/bomb/stop").status_code in (200, 202)
    assert wait_gone(eve.account.pw_uid, "BOMB") == []
    assert not cgroups.find(unit).exists()
