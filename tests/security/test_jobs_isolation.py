"""Attacks on local training jobs, made by eve against vic (issue 12 items 1, 6, 8, 9, 11, 12
for jobs, issue 13 item 3, the GPU queue of issue 17, and issue 33 items 5 and 8 for replicas).

vic runs one multi-worker job for the whole module (`vic_job`): its two workers reach each
other's TensorFlow servers through the addresses in ``TF_CONFIG``, worker 0 writes
``/tmp/my_working_dir/secret`` (as TensorFlow's tutorials do) and starts a ``setsid sleep``
grandchild, worker 1 reads the secret back (one /tmp per job); worker 0 also leaves a file in
``/dev/shm`` and a System V shared memory segment. eve runs one job of her own
(`eve_job`) that prints its environment, makes ``/tmp/my_working_dir`` itself, and prints what
it sees of ``/dev/shm``, System V segments and the processes in ``/proc``. Every test
attacks as eve (her shell, ``eve.sh``, or her jobs) and checks that vic's job is untouched; the
last one stops vic's job and checks that nothing of it is left.

The programs are plain Python (the runtime still makes the job's strategy, so each replica
starts TensorFlow once: that is what proves TensorFlow's own servers work in the sandbox).
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import requests

from gpulab.hub.deploy.serviceconfig import SERVICE_CONFIG_NAME
from gpulab.hub.jobs.local import ENV_ALLOW, ENV_ALLOW_PREFIXES, TMP_ROOT
from gpulab.hub.service import ENV_FALLBACKS
from gpulab.hub.machine import sandbox
from gpulab.hub.machine.cgroups import Cgroups

from tests.app.hubctl import Hub
from tests.conftest import end_jobs_of

pytestmark = pytest.mark.security

#: this module's hub bounds each person's active replicas to this many (c.GPUJobs)
BOUND = 4

VIC = r"""
import json, os, socket, subprocess, sys, time
from gpulab.extensions import runtime
# the job's TensorFlow servers: the runtime starts them with gpulab's strategy, on the
# program's first call (the program touches TensorFlow first, issue 34)
runtime.strategy()
cfg = json.loads(os.environ["TF_CONFIG"])
me = cfg["task"]["index"]
peer = cfg["cluster"]["worker"][1 - me]
host, port = peer.rsplit(":", 1)
for _ in range(300):
    try:
        socket.create_connection((host, int(port)), timeout=5).close()
        break
    except OSError:
        time.sleep(0.2)
else:
    sys.exit(f"cannot reach {peer}")
print("reached", peer, flush=True)
if me == 0:
    os.makedirs("/tmp/my_working_dir", exist_ok=True)
    with open("/tmp/my_working_dir/secret", "w") as f:
        f.write("vic-secret-42")
    child = subprocess.Popen(["setsid", "sleep", "1000"])
    with open("/dev/shm/vic-shm-secret", "w") as f:  # shared memory, POSIX and System V
        f.write("vic-shm-42")
    made = subprocess.run(["ipcmk", "-M", "4096"], capture_output=True, text=True, check=True)
    with open("shmid", "w") as f:
        f.write(made.stdout.split()[-1])
    with open("grandchild", "w") as f:
        f.write(str(child.pid))
else:
    while not os.path.exists("/tmp/my_working_dir/secret"):
        time.sleep(0.1)
    print("shared tmp:", open("/tmp/my_working_dir/secret").read(), flush=True)
with open(f"ready-{me}", "w") as f:
    f.write(str(os.getpid()))
time.sleep(900)
"""

EVE = r"""
import json, os, time
print("ENV " + json.dumps(dict(os.environ)), flush=True)
print("vic's secret visible:", os.path.exists("/tmp/my_working_dir/secret"), flush=True)
os.makedirs("/tmp/my_working_dir")
with open("/tmp/my_working_dir/mine", "w") as f:
    f.write("eve")
print("made /tmp/my_working_dir", flush=True)
print("SHM " + json.dumps(os.listdir("/dev/shm")), flush=True)
print("SYSV " + json.dumps(open("/proc/sysvipc/shm").read().splitlines()[1:]), flush=True)
procs = {}
for p in os.listdir("/proc"):
    if p.isdigit():
        try:
            procs[p] = open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace")
        except OSError:
            pass
print("PROCS " + json.dumps({"me": os.getpid(), "cmd": procs}), flush=True)
with open("ready-0", "w") as f:
    f.write(str(os.getpid()))
time.sleep(900)
"""


def mw(name, workers, source, gpus=0, **extra):
    return {"name": name, "strategy": "multi-worker-mirrored", "replicas": {"worker": workers},
            "resources": {"worker": {"gpus": gpus}}, "source": source, **extra}


def wait_state(person, name, states, timeout=180):
    deadline = time.time() + timeout
    while True:
        job = person.service("GET", f"jobs/{name}").json()
        if job["state"] in states or time.time() > deadline:
            assert job["state"] in states, job
            return job
        time.sleep(0.3)


def wait_files(folder: Path, names: list[str], timeout=240) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            values = [(folder / n).read_text() for n in names]
            if all(values):
                return [int(v) for v in values]
        except FileNotFoundError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{names} did not appear in {folder}")


def log_of(person, job: str, replica: str) -> str:
    return person.service("GET", f"jobs/{job}/logs/{replica}").json()["text"]


def snapshot(folder: Path) -> dict[str, tuple[int, float]]:
    """Every file below `folder` with its size and modification time."""
    return {str(p.relative_to(folder)): (p.lstat().st_size, p.lstat().st_mtime)
            for p in sorted(folder.rglob("*"))}


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    """This module's own `gpulab up` (root, 4 simulated GPUs), with a small replica bound."""
    data = workdir / "data"
    data.mkdir(mode=0o700)
    config = data / "gpulab_config.py"
    config.write_text(f"c.GPUJobs.max_replicas_per_user = {BOUND}\n")
    config.chmod(0o600)
    h = Hub(data, "--simulated-gpus", "4", "--user-prefix", prefix).start()
    yield h
    h.stop()
    end_jobs_of(h.data_dir)


@pytest.fixture(scope="module")
def vic_job(hub, vic):
    """vic's running two-worker job: (its view, its folder, worker pids, grandchild pid)."""
    r = vic.service("POST", "jobs", json=mw("vic-train", 2, VIC))
    assert r.status_code == 201, r.text
    job = r.json()
    folder = Path(job["job_dir"])
    pids = wait_files(folder, ["ready-0", "ready-1"])
    grandchild = wait_files(folder, ["grandchild"])[0]
    yield job, folder, pids, grandchild
    vic.service("POST", "jobs/vic-train/stop")  # (a test failed before stopping it)


@pytest.fixture(scope="module")
def eve_job(hub, eve, vic_job):
    """eve's running one-worker job, started after vic's wrote its secret: (view, pid)."""
    r = eve.service("POST", "jobs", json=mw("eve-probe", 1, EVE))
    assert r.status_code == 201, r.text
    job = r.json()
    pid = wait_files(Path(job["job_dir"]), ["ready-0"])[0]
    yield job, pid
    eve.service("POST", "jobs/eve-probe/stop")  # its sandbox goes with it


def assert_vic_untouched(vic, vic_job):
    job, folder, pids, grandchild = vic_job
    view = vic.service("GET", "jobs/vic-train").json()
    assert view["state"] == "Running", view
    assert [x["state"] for x in view["replicas"]] == ["Running", "Running"], view
    for pid in pids:
        assert psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    assert (TMP_ROOT / job["id"] / "my_working_dir" / "secret").read_text() == "vic-secret-42"


def host_addresses() -> list[str]:
    """The machine's own IPv4 addresses (loopback and the others)."""
    out = ["127.0.0.1"]
    for addrs in psutil.net_if_addrs().values():
        out += [a.address for a in addrs if a.family.name == "AF_INET"
                and a.address not in out]
    return out


PROBE = r"""
import json, socket, sys
out = {}
for host, port in json.loads(sys.argv[1]):
    try:
        socket.create_connection((host, port), timeout=3).close()
        out[f"{host}:{port}"] = "connected"
    except OSError as e:
        out[f"{host}:{port}"] = type(e).__name__
print(json.dumps(out))
"""


def test_nothing_outside_a_job_reaches_its_tensorflow_servers(vic, eve, vic_job):
    """Item 1: vic's replicas serve TF gRPC only inside the job's loopback-only network."""
    job, folder, pids, _ = vic_job
    ports = [int(a.rsplit(":", 1)[1])
             for a in json.loads(psutil.Process(pids[0]).environ()["TF_CONFIG"])
             ["cluster"]["worker"]]
    # vic's workers reached each other at their TF_CONFIG addresses
    for i in (0, 1):
        assert "reached 127.0.0.1:" in log_of(vic, "vic-train", f"worker-{i}")
    # each replica is in the job's network namespace, not the machine's
    netns = sandbox.NETNS_DIR / job["id"]
    job_net = os.stat(netns).st_ino
    for pid in pids:
        assert os.stat(f"/proc/{pid}/ns/net").st_ino == job_net
    assert os.stat("/proc/self/ns/net").st_ino != job_net
    # the servers do listen, inside the job's namespace
    targets = json.dumps([["127.0.0.1", p] for p in ports])
    inside = subprocess.run(["nsenter", f"--net={netns}", "python3", "-c", PROBE, targets],
                            capture_output=True, text=True, timeout=30)
    assert inside.returncode == 0, inside.stderr
    assert set(json.loads(inside.stdout).values()) == {"connected"}, inside.stdout
    # eve, from her terminal: on loopback and on every address of the machine, nothing
    targets = json.dumps([[h, p] for h in host_addresses() for p in ports])
    r = eve.sh(f"python3 -c '{PROBE}' '{targets}'", check=True)
    outside = json.loads(r.stdout)
    assert "connected" not in outside.values(), outside
    assert len(outside) == 2 * len(host_addresses())
    assert_vic_untouched(vic, vic_job)


def _service_environ(hub) -> dict[str, str]:
    """The environment of this hub's gpulab service (found by its ``--config=<data>/…``),
    with the settings of its private config file added under their variables' names."""
    config = hub.data_dir / SERVICE_CONFIG_NAME
    for p in psutil.process_iter(["cmdline", "environ"]):
        cmd = p.info["cmdline"] or []
        if "gpulab.hub.service" in cmd and f"--config={config}" in cmd:
            settings = json.loads(config.read_text())["GpulabService"]
            return {**(p.info["environ"] or {}),
                    **{ENV_FALLBACKS[k]: (str(int(v)) if isinstance(v, bool) else str(v))
                       for k, v in settings.items()}}
    raise LookupError("no gpulab service process")


def test_a_replica_environment_holds_no_secret_of_the_service(hub, vic, eve, vic_job, eve_job):
    """Item 6: eve's job prints its environment: nothing of the service's own."""
    text = log_of(eve, "eve-probe", "worker-0")
    line = next(x for x in text.splitlines() if x.startswith("ENV "))
    env = json.loads(line[4:])
    service = _service_environ(hub)
    assert service.get("JUPYTERHUB_API_TOKEN"), "the service should have a hub token"
    for name in ("JPY_API_TOKEN", "JUPYTERHUB_API_TOKEN", "JUPYTERHUB_API_URL",
                 "GPULAB_LEDGER_URL", "GPULAB_JOB_LIMITS"):
        assert name not in env, name
    assert not [k for k in env if k.startswith(("JUPYTERHUB_", "JPY_"))], sorted(env)
    # no value of the service's environment off the allow-list reaches the job, and no
    # secret of the service appears anywhere in it
    allowed = {k for k in service if k in ENV_ALLOW or k.startswith(ENV_ALLOW_PREFIXES)}
    values = set(env.values())
    leaked = {k for k, v in service.items()
              if k not in allowed and k not in ("HOME", "USER") and len(v) >= 4 and v in values}
    assert not leaked, sorted(leaked)
    secrets = {k: v for k, v in service.items()
               if re.search("TOKEN|SECRET|PASSWORD|KEY|CERT|LEDGER_URL", k) and len(v) >= 12}
    assert "JUPYTERHUB_API_TOKEN" in secrets
    assert not [k for k, v in secrets.items() if v in line], sorted(secrets)
    # and it is eve's own account, with her own home
    assert env["USER"] == eve.account.pw_name and env["HOME"] == eve.account.pw_dir
    assert_vic_untouched(vic, vic_job)


def test_the_services_config_file_is_closed_to_other_accounts(hub, eve):
    """The service's settings file holds the ledger's URL (a database password on a real
    deployment): eve can neither read it, nor put a file or link of hers in its place, nor
    find its values in the service's command line or environment."""
    path = hub.data_dir / SERVICE_CONFIG_NAME
    ledger_url = json.loads(path.read_text())["GpulabService"]["ledger_url"]
    pid = next(p.pid for p in psutil.process_iter(["cmdline"])
               if f"--config={path}" in (p.info["cmdline"] or []))
    r = eve.sh(f"cat '{path}'; cat /proc/{pid}/environ; tr '\\0' ' ' < /proc/{pid}/cmdline; "
               f"ls -la '{hub.data_dir}'")
    assert "Permission denied" in r.stderr
    assert ledger_url not in r.stdout + r.stderr and "gpulab.sqlite" not in r.stdout
    for attack in (f"ln -sf /tmp/eve '{path}'", f"echo '{{}}' > '{path}'",
                   f"echo '{{}}' > '{hub.data_dir}/.{path.name}.x.tmp'"):
        assert eve.sh(attack).returncode != 0, attack
    info = os.lstat(path)
    assert stat.S_ISREG(info.st_mode) and stat.S_IMODE(info.st_mode) == 0o600
    assert info.st_uid == os.geteuid() and ledger_url in path.read_text()


def test_every_job_has_a_private_tmp(vic, eve, vic_job, eve_job):
    """Item 11: vic's /tmp/my_working_dir is neither seen by nor in the way of eve."""
    job, *_ = vic_job
    # all of vic's replicas share one /tmp
    assert "shared tmp: vic-secret-42" in log_of(vic, "vic-train", "worker-1")
    # eve's job does not see vic's folder, and makes the same path itself
    text = log_of(eve, "eve-probe", "worker-0")
    assert "vic's secret visible: False" in text, text[-2000:]
    assert "made /tmp/my_working_dir" in text, text[-2000:]
    # eve's terminal sees neither, and cannot look into the jobs' /tmp folders
    r = eve.sh("cat /tmp/my_working_dir/secret; ls /tmp/my_working_dir; "
               f"ls {TMP_ROOT}; ls {TMP_ROOT / job['id']}")
    assert "vic-secret" not in r.stdout and r.returncode != 0, (r.stdout, r.stderr)
    assert "Permission denied" in r.stderr, r.stderr
    assert not Path("/tmp/my_working_dir/secret").exists()
    st = os.stat(TMP_ROOT)
    assert st.st_uid == 0 and st.st_mode & 0o077 == 0
    st = os.stat(TMP_ROOT / job["id"])
    assert st.st_uid == vic.account.pw_uid and st.st_mode & 0o077 == 0
    assert_vic_untouched(vic, vic_job)


def _eve_saw(text: str, what: str):
    line = next(x for x in text.splitlines() if x.startswith(what + " "))
    return json.loads(line[len(what) + 1:])


def test_a_replicas_ipc_and_processes_are_its_own(hub, vic, eve, vic_job, eve_job):
    """Issue 33 items 5 and 8: vic's replica made a /dev/shm file and a System V segment;
    eve's replica (and her shell) sees neither, and eve's replica lists only her own
    processes (a /proc with hidepid=invisible), none of vic's replicas nor the service."""
    job, folder, pids, _ = vic_job
    vic_uid = str(vic.account.pw_uid)
    text = log_of(eve, "eve-probe", "worker-0")
    assert "vic-shm-secret" not in _eve_saw(text, "SHM"), text[-2000:]
    assert all(row.split()[7] != vic_uid for row in _eve_saw(text, "SYSV")), text[-2000:]
    procs = _eve_saw(text, "PROCS")
    assert str(procs["me"]) in procs["cmd"], procs  # she sees her own
    assert not {str(p) for p in pids} & set(procs["cmd"]), procs
    assert "vic-train" not in json.dumps(procs), procs
    owners = set()
    for p in procs["cmd"]:  # (eve's own notebook server is among them)
        try:
            owners.add(psutil.Process(int(p)).uids().real)
        except psutil.NoSuchProcess:
            pass
    assert owners == {eve.account.pw_uid}, procs
    # eve's shell (the machine's own /dev/shm and IPC namespace): nothing of vic's either
    r = eve.sh("ls /dev/shm; cat /dev/shm/vic-shm-secret; cat /proc/sysvipc/shm")
    assert "vic-shm" not in r.stdout, r.stdout
    rows = [f for f in map(str.split, r.stdout.splitlines())
            if len(f) > 7 and f[0].lstrip("-").isdigit()]
    assert all(f[7] != vic_uid for f in rows), r.stdout
    # vic's segment is where she made it: in her replica's own IPC namespace
    shmid = (folder / "shmid").read_text()
    seen = subprocess.run(["nsenter", "-t", str(pids[0]), "--ipc", "cat", "/proc/sysvipc/shm"],
                          capture_output=True, text=True, check=True).stdout.splitlines()[1:]
    assert any(row.split()[1] == shmid and row.split()[7] == vic_uid for row in seen), seen
    assert Path(f"/proc/{pids[0]}/root/dev/shm/vic-shm-secret").read_text() == "vic-shm-42"
    assert_vic_untouched(vic, vic_job)


def _group_of(job_id: str, replica: str):
    cgroups, why = Cgroups.detect()
    assert cgroups is not None, f"control groups are needed for this test: {why}"
    return cgroups, cgroups.find(f"job-{job_id}-{replica}")


def test_gpu_less_replicas_are_bounded(hub, vic, eve, vic_job, eve_job):
    """Item 12: a 0-GPU replica has default CPU and memory limits, and eve's replicas are
    bounded across her jobs (refused whole, nothing left behind)."""
    job, pid = eve_job
    cgroups, group = _group_of(job["id"], "worker-0")
    assert pid in group.pids()
    mem, cpu = group.dirs["memory"], group.dirs["cpu"]
    # 2 CPUs, or her person's bound where that is less (three quarters of a 2-CPU machine)
    from gpulab.hub.machine.cgroups import share_of_cpus

    quota = int(min(2.0, share_of_cpus(0.75)) * 100_000)
    if cgroups.version == 1:
        assert int((mem / "memory.limit_in_bytes").read_text()) == 8 * 2**30
        assert int((cpu / "cpu.cfs_quota_us").read_text()) == quota
    else:
        assert int((mem / "memory.max").read_text()) == 8 * 2**30
        assert (cpu / "cpu.max").read_text().split()[0] == str(quota)
    # eve holds 1 replica; BOUND more would go over the bound
    r = eve.service("POST", "jobs", json=mw("swarm", BOUND, EVE))
    assert r.status_code == 409, r.text
    body = r.json()
    assert body["field"] == "replicas", body
    assert f"at most {BOUND} replicas" in body["message"] and "1 are active" in body["message"]
    assert eve.service("GET", "jobs/swarm").status_code == 404
    assert not (Path(job["job_dir"]).parent / "swarm").exists()
    assert [j["name"] for j in eve.service("GET", "jobs").json()["jobs"]] == ["eve-probe"]
    # vic's replicas count for vic, not for eve
    assert_vic_untouched(vic, vic_job)


GPU_PROBE = r"""
import errno, json, os, sys
out = {}
for path in sys.argv[1:]:
    try:
        os.close(os.open(path, os.O_RDWR))
        out[path] = "opened"
    except OSError as e:
        out[path] = errno.errorcode[e.errno]
print("DEVICES " + json.dumps(out), flush=True)
"""


def test_a_replica_opens_only_its_own_gpus(hub, vic, eve, vic_job, eve_job):
    """Item 8 (with item 7's device allow-list): eve's replica is given one GPU; of stand-in
    NVIDIA device nodes (major 195, no driver here) the kernel lets it open only that one
    (ENXIO: allowed, no device behind it) and refuses the others (EPERM: the devices
    controller), whatever ``CUDA_VISIBLE_DEVICES`` says."""
    cgroups, why = Cgroups.detect()
    assert cgroups is not None, f"control groups are needed for this test: {why}"
    assert cgroups.devices_enforced, cgroups.devices_why
    dev = Path(eve_job[0]["job_dir"]).parent.parent / "stand-in-dev"  # seen in her /tmp too
    dev.mkdir(mode=0o755, exist_ok=True)
    nodes = []
    for minor in range(4):
        node = dev / f"nvidia{minor}"
        if not node.exists():
            os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(195, minor))
        os.chmod(node, 0o666)
        nodes.append(str(node))
    r = eve.service("POST", "jobs", json=mw("gpu-probe", 1, GPU_PROBE, gpus=1, args=nodes))
    assert r.status_code == 201, r.text
    job = wait_state(eve, "gpu-probe", {"Succeeded", "Failed"})
    assert job["state"] == "Succeeded", job
    [mine] = job["replicas"][0]["devices"]
    text = log_of(eve, "gpu-probe", "worker-0")
    seen = json.loads(next(x for x in text.splitlines() if x.startswith("DEVICES "))[8:])
    assert seen == {n: ("ENXIO" if i == mine else "EPERM") for i, n in enumerate(nodes)}, seen
    # outside any replica's group (eve's terminal), the same nodes are merely driverless
    r = eve.sh(f"python3 -c '{GPU_PROBE}' {' '.join(nodes)}", check=True)
    assert set(json.loads(r.stdout[8:]).values()) == {"ENXIO"}, r.stdout
    assert_vic_untouched(vic, vic_job)


def test_a_replica_never_works_in_a_folder_swapped_for_a_link(hub, vic, eve, vic_job):
    """Item 9: eve's replica swaps its own job folder for a link to vic's job folder and
    dies, so that it is restarted there: the restart never enters vic's folder. And when it
    fails with a program error instead (no restart), the job still ends: its log is not
    read through the link."""
    _, vic_folder, _, _ = vic_job
    before = snapshot(vic_folder)

    def swap(ending):
        return ("import os, signal, sys\n"
                "here = os.getcwd()\n"
                "if os.path.exists('pwned'):\n"
                "    sys.exit(0)\n"
                "open(os.path.join(os.getcwd(), 'pwned'), 'w').write(here)\n"
                "os.rename(here, here + '.moved')\n"
                f"os.symlink({str(vic_folder)!r}, here)\n"
                f"{ending}\n")

    # killed: a retry is due, and the restart finds the link
    r = eve.service("POST", "jobs", json=mw("hop", 1, swap(
        "os.kill(os.getpid(), signal.SIGKILL)"), retries=2))
    assert r.status_code == 201, r.text
    job = wait_state(eve, "hop", {"Failed", "Succeeded"}, timeout=240)
    assert job["state"] == "Failed" and "link" in job["reason"], job
    # the program's own error: failed at once, its reason without the log behind the link
    r = eve.service("POST", "jobs", json=mw("hop2", 1, swap(
        "raise SystemExit('bye vic')"), retries=2))
    assert r.status_code == 201, r.text
    job = wait_state(eve, "hop2", {"Failed", "Succeeded"}, timeout=240)
    assert job["state"] == "Failed" and "exit 1" in job["reason"], job
    assert snapshot(vic_folder) == before  # nothing written, nothing replaced
    assert not (vic_folder / "pwned").exists()
    for p in psutil.process_iter(["cwd"]):
        assert not (p.info["cwd"] or "").startswith(str(vic_folder)) or p.pid in vic_job[2] \
            or p.pid == vic_job[3], p
    assert_vic_untouched(vic, vic_job)


def test_a_submit_that_fails_after_admission_leaves_nothing(hub, vic, eve, vic_job, eve_job):
    """Issue 13 item 3: a link planted in the new job's logs/ fails the start; the job is
    not left Admitted and its GPU comes back."""
    _, vic_folder, _, _ = vic_job
    target = vic_folder / "ready-0"
    before = target.read_text()
    home = Path(eve_job[0]["job_dir"]).parent  # eve's jobs/ folder
    eve.sh(f"mkdir -p {home}/trap/logs && ln -s {target} {home}/trap/logs/worker-0.log",
           check=True)
    held = [h for h in eve.service("GET", "me").json()["holdings"] if h["kind"] == "job"]
    r = eve.service("POST", "jobs", json=mw("trap", 1, EVE, gpus=1))
    assert r.status_code == 409, r.text
    assert r.json()["field"] == "name" and "link" in r.json()["message"], r.json()
    assert eve.service("GET", "jobs/trap").status_code == 404
    assert "trap" not in [j["name"] for j in eve.service("GET", "jobs").json()["jobs"]]
    after = [h for h in eve.service("GET", "me").json()["holdings"] if h["kind"] == "job"]
    assert after == held, after
    assert target.read_text() == before and not target.is_symlink()
    assert_vic_untouched(vic, vic_job)


QUEUED_SLEEP = "import time\ntime.sleep(900)\n"


def test_eve_can_neither_see_nor_move_nor_take_vics_place_in_the_gpu_queue(
        hub, admin, vic, eve, vic_job, eve_job):
    """Issue 17 as the other person: vic's GPUs are all busy and his next job waits in line.
    eve sees nothing of it (the queue, the job, the reason), cannot cancel, hold or move it
    (another's entry answers exactly as an unknown one), a job of hers with the same name waits
    as her own, her queued jobs count against her replica bound, and after all that vic's
    job starts by itself when his GPUs come back."""
    for who in ("vic", "eve"):
        assert admin.service("PUT", f"quotas/users/{who}", json={"max_gpus": 4}).status_code == 200
    try:
        # the module's two servers hold 1 GPU each: vic's job takes the other 2
        busy = [h["gpus"] for p in (vic, eve) for h in p.service("GET", "me").json()["holdings"]]
        assert sum(busy) == 2, busy
        r = vic.service("POST", "jobs", json=mw("vic-gpus", 1, QUEUED_SLEEP, gpus=2))
        assert r.status_code == 201, r.text
        r = vic.service("POST", "jobs", json=mw("vic-later", 1, QUEUED_SLEEP, gpus=1))
        assert r.status_code == 202 and r.json()["state"] == "Queued", r.text
        line = vic.service("GET", "queue").json()["entries"]
        assert [(e["holder"], e["position"]) for e in line] == [("vic-later", 1)], line
        entry = line[0]["id"]

        # eve sees nothing of it, though the line is planned once for everyone who reads it
        # within a second (issue 40): the admin's read, just before hers, planned it whole
        assert len(admin.service("GET", "queue").json()["entries"]) >= 1
        mine = eve.service("GET", "queue")
        assert mine.status_code == 200 and mine.json()["entries"] == [], mine.text
        assert "vic" not in mine.text
        assert eve.service("GET", "jobs/vic-later").status_code == 404
        # another's entry answers as an unknown one: no oracle for ids
        unknown = "0" * 32
        for action in ("cancel", "hold", "release", "top"):
            theirs = eve.service("POST", f"queue/{entry}/{action}")
            nobody = eve.service("POST", f"queue/{unknown}/{action}")
            assert theirs.status_code == nobody.status_code in (403, 404), (action, theirs.text)
            assert theirs.json() == nobody.json(), (action, theirs.text, nobody.text)
            assert "vic" not in theirs.text
        assert eve.service("POST", "jobs/vic-later/stop").status_code == 404
        # her own job of the same name waits as hers; vic's entry is the same one
        r = eve.service("POST", "jobs", json=mw("vic-later", 1, QUEUED_SLEEP, gpus=1))
        assert r.status_code == 202 and r.json()["state"] == "Queued", r.text
        assert "vic" not in r.json()["reason"].replace("vic-later", "")
        # her queued jobs count against her replica bound: eve-probe, vic-later, two more
        for i in range(BOUND - 2):
            r = eve.service("POST", "jobs", json=mw(f"flood{i}", 1, QUEUED_SLEEP, gpus=1))
            assert r.status_code == 202, r.text
        r = eve.service("POST", "jobs", json=mw("flood-over", 1, QUEUED_SLEEP, gpus=1))
        assert r.status_code == 409 and r.json()["field"] == "replicas", r.text
        assert eve.service("GET", "jobs/flood-over").status_code == 404
        vics = vic.service("GET", "queue").json()["entries"]
        assert [(e["id"], e["holder"], e["user"]) for e in vics] == [
            (entry, "vic-later", "vic")], vics
        for name in ["vic-later"] + [f"flood{i}" for i in range(BOUND - 2)]:
            assert eve.service("POST", f"jobs/{name}/stop").status_code == 200
        assert vic.service("GET", "jobs/vic-later").json()["state"] == "Queued"
        assert_vic_untouched(vic, vic_job)

        # vic's GPUs come back: his job starts by itself
        assert vic.service("POST", "jobs/vic-gpus/stop").status_code == 200
        wait_state(vic, "vic-later", ("Admitted", "Starting", "Running"), timeout=60)
    finally:
        for name in ("vic-gpus", "vic-later"):
            vic.service("POST", f"jobs/{name}/stop")
        for name in ["vic-later"] + [f"flood{i}" for i in range(BOUND - 2)]:
            eve.service("POST", f"jobs/{name}/stop")
        for who in ("vic", "eve"):
            admin.service("DELETE", f"quotas/users/{who}")
    assert [h for h in vic.service("GET", "me").json()["holdings"] if h["kind"] == "job"] == []


def test_eve_cannot_read_who_holds_the_gpus_from_the_metrics(hub, admin, vic, eve, vic_job):
    """Issue 39: ``/services/gpulab/metrics`` names everyone's holdings (user, job, device).
    eve, from her own shell with her own hub token, gets 403 and no series, however she sends
    the token (header, ``?token=``), and the hub will not make her a token with
    ``read:metrics``; a token of the admin's with that scope alone reads vic's job there."""
    script = r"""
    url="${SERVICE}metrics"
    curl -s -o out-h -w '%{http_code} ' -H "Authorization: Bearer $JUPYTERHUB_API_TOKEN" "$url"
    curl -s -o out-q -w '%{http_code} ' "$url?token=$JUPYTERHUB_API_TOKEN"
    curl -s -o out-n -w '%{http_code} ' "$url"
    curl -s -o out-t -w '%{http_code}' -X POST -H "Authorization: token $JUPYTERHUB_API_TOKEN" \
        -d '{"scopes": ["read:metrics"]}' "$HUB/hub/api/users/eve/tokens"
    echo; cat out-h out-q out-n; echo; cat out-t
    """
    # (the service's own address: its own host name with subdomains, which curl maps to
    # loopback as browsers do)
    r = eve.sh(f"cd $(mktemp -d) && {script}", check=True, env={"SERVICE": hub.service_url})
    codes, metrics, minted = (r.stdout.split("\n", 2) + ["", ""])[:3]
    # (a token in the URL: refused as hers, or not read at all where the hub turns it off)
    header, in_url, none, mint = codes.split()
    # (the hub refuses the token with 400: "Not assigning requested scopes read:metrics")
    assert (header, none, mint) == ("403", "401", "400") and in_url in ("401", "403"), r.stdout
    assert "gpulab_" not in metrics and "vic" not in metrics, metrics
    assert "token" not in json.loads(minted) and "read:metrics" in minted, minted
    # the same endpoint with a read:metrics token: vic's job is there (what eve was denied)
    made = admin.api("POST", "/users/admin/tokens", json={"scopes": ["read:metrics"]})
    assert made.status_code == 201, made.text
    seen = requests.get(hub.service_url + "metrics", timeout=30,
                        headers={"Authorization": f"Bearer {made.json()['token']}"})
    assert seen.status_code == 200 and 'user="vic"' in seen.text, seen.text[:500]
    assert_vic_untouched(vic, vic_job)


def test_stop_ends_everything_a_replica_started(hub, vic, vic_job):
    """Item 8: vic's replica's ``setsid`` grandchild does not outlive stop, and the job's
    groups, network namespace and /tmp go with it."""
    job, folder, pids, grandchild = vic_job
    gc = psutil.Process(grandchild)
    assert gc.name() == "sleep" and os.getsid(grandchild) == grandchild  # its own session
    assert os.getsid(grandchild) != os.getpgid(pids[0])
    cgroups, group = _group_of(job["id"], "worker-0")
    assert grandchild in group.pids()
    r = vic.service("POST", "jobs/vic-train/stop")
    assert r.status_code == 200 and r.json()["state"] == "Stopped", r.text
    deadline = time.time() + 10
    while time.time() < deadline and not all(
            not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE
            for p in (*pids, grandchild)):
        time.sleep(0.1)
    for p in (*pids, grandchild):
        assert not psutil.pid_exists(p) or psutil.Process(p).status() == psutil.STATUS_ZOMBIE, p
    assert not group.exists()
    assert not (sandbox.NETNS_DIR / job["id"]).exists()
    assert not (TMP_ROOT / job["id"]).exists()
    assert not [h for h in vic.service("GET", "me").json()["holdings"] if h["kind"] == "job"]
