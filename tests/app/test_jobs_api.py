"""Training jobs through the gpulab service's API and the CLI, on a real `gpulab up`.

The programs here are small Python programs run by the gpulab runtime (which makes the
job's TensorFlow strategy before they start, so each replica still starts TensorFlow): they
exercise the backend's admission, processes, logs, supervision, stop and recovery without
training. Real training through the same API is in tests/tf/test_jobs_training.py.
"""

import json
import os
import re
import signal
import stat
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import requests

from gpulab.hub.deploy.serviceconfig import SERVICE_CONFIG_NAME
from gpulab.hub.jobs.local import TMP_ROOT
from gpulab.hub.quota.ledger import Ledger
from gpulab.hub.service import ENV_FALLBACKS
from gpulab.hub.machine.cgroups import Cgroups
from gpulab.hub.machine.sandbox import NETNS_DIR

#: as root every job runs in a sandbox of its own (network namespace, private /tmp)
SANDBOXED = os.geteuid() == 0

from tests.app.hubctl import GPULAB

pytestmark = pytest.mark.app

HELLO = """
import json, os, sys
task = json.loads(os.environ["TF_CONFIG"])["task"]
print(f"hello from {task['type']}-{task['index']} on GPUs [{os.environ['CUDA_VISIBLE_DEVICES']}]")
print("args", sys.argv[1:])
"""

# runs until stopped; leaves its pid where the test can find it
SLEEPER = """
import json, os, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
with open(f"pid-{task['type']}-{task['index']}", "w") as f:
    f.write(str(os.getpid()))
print("sleeping", flush=True)
time.sleep(600)
"""


def mw(name, workers=2, gpus=0, source=HELLO, **extra):
    return {"name": name, "strategy": "multi-worker-mirrored", "replicas": {"worker": workers},
            "resources": {"worker": {"gpus": gpus}}, "source": source, **extra}


def wait_state(person, name, states, timeout=180, user=None):
    q = f"?user={user}" if user else ""
    deadline = time.time() + timeout
    while time.time() < deadline:
        job = person.service("GET", f"jobs/{name}{q}").json()
        if job["state"] in states:
            return job
        time.sleep(0.3)
    raise TimeoutError(f"job {name} is {job['state']} ({job['reason']}), not {states}")


def job_dir(hub, user, name) -> Path:
    return hub.data_dir / "shared" / "users" / user / "jobs" / name


def wait_pids(folder: Path, n: int, timeout=120) -> list[int]:
    deadline = time.time() + timeout
    while time.time() < deadline:
        pids = [int(p.read_text()) for p in folder.glob("pid-*") if p.read_text()]
        if len(pids) == n:
            return pids
        time.sleep(0.2)
    raise TimeoutError(f"{n} replicas did not start in {folder}")


def job_processes(folder: Path) -> list[psutil.Process]:
    """Every live process started for the job (replicas and what they started)."""
    out = []
    for p in psutil.process_iter(["environ", "status"]):
        env = p.info["environ"] or {}
        if env.get("GPULAB_JOB_DIR") == str(folder) and p.info["status"] != psutil.STATUS_ZOMBIE:
            out.append(p)
    return out


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def holdings(person):
    return person.service("GET", "me").json()["holdings"]


def test_job_runs_on_disjoint_gpus_with_logs_and_history(hub, users):
    ann = users["ann"]
    assert ann.service("GET", "me").json()["jobs"] == {"backend": "local", "images": [],
                                                      "available": True, "reason": ""}
    r = ann.service("POST", "jobs", json=mw("hello", gpus=1, args=["--epochs", "3"]))
    assert r.status_code == 201, r.text
    assert r.json()["gpus"] == 2 and r.json()["state"] in ("Running", "Succeeded")
    job = wait_state(ann, "hello", {"Succeeded", "Failed"})
    assert job["state"] == "Succeeded", job
    assert [x["state"] for x in job["replicas"]] == ["Succeeded", "Succeeded"]
    devices = [x["devices"] for x in job["replicas"]]
    assert len(devices[0]) == 1 and len(devices[1]) == 1 and devices[0] != devices[1]

    log = ann.service("GET", "jobs/hello/logs/worker-1").json()
    assert f"hello from worker-1 on GPUs [{devices[1][0]}]" in log["text"]
    assert "args ['--epochs', '3']" in log["text"]
    assert log["done"] and log["offset"] == log["size"] > 0
    # reading on from the end gives nothing more
    more = ann.service("GET", f"jobs/hello/logs/worker-1?offset={log['offset']}&follow=1").json()
    assert more["text"] == "" and more["done"]
    assert ann.service("GET", "jobs/hello/logs/ps-0").status_code == 404

    # kept as history; its GPUs are back
    assert "hello" in [j["name"] for j in ann.service("GET", "jobs").json()["jobs"]]
    assert not [h for h in holdings(ann) if h["kind"] == "job"]
    again = ann.service("POST", "jobs", json=mw("hello"))
    assert again.status_code == 409 and again.json()["field"] == "name"


def test_only_the_owner_or_an_admin_sees_and_stops_a_job(hub, users, admin):
    ann, bob = users["ann"], users["bob"]
    assert ann.service("POST", "jobs", json=mw("private", workers=1, gpus=1,
                                                source=SLEEPER)).status_code == 201
    folder = job_dir(hub, "ann", "private")
    wait_pids(folder, 1)
    # bob has no job of that name, and may not ask for ann's
    assert bob.service("GET", "jobs/private").status_code == 404
    for method, path in (("GET", "jobs/private?user=ann"), ("POST", "jobs/private/stop?user=ann"),
                         ("GET", "jobs/private/logs/worker-0?user=ann"), ("GET", "jobs?user=ann"),
                         ("GET", "jobs?all=1")):
        r = bob.service(method, path)
        assert r.status_code == 403, (method, path, r.status_code, r.text)
        assert r.json()["message"]
    assert bob.service("POST", "jobs/private/stop").status_code == 404
    assert "private" not in [j["name"] for j in bob.service("GET", "jobs").json()["jobs"]]
    # anonymous and scope-less callers
    assert requests.get(hub.service_api + "jobs/private").status_code == 401
    assert requests.post(hub.service_api + "jobs", json=mw("anon")).status_code == 401
    noscope = ann.api("POST", "/users/ann/tokens",
                      json={"note": "no scope", "scopes": ["read:users:name!user"]}).json()["token"]
    assert ann.service("GET", "jobs", token=noscope).status_code == 403
    assert ann.service("POST", "jobs", token=noscope, json=mw("ns")).status_code == 403
    assert wait_state(ann, "private", {"Running"})["state"] == "Running"

    # an admin sees everyone's and may stop it
    everyone = admin.service("GET", "jobs?all=1").json()["jobs"]
    assert ("ann", "private") in [(j["user"], j["name"]) for j in everyone]
    assert admin.service("GET", "jobs/private/logs/worker-0?user=ann").json()["text"]
    stopped = admin.service("POST", "jobs/private/stop?user=ann")
    assert stopped.status_code == 200, stopped.text
    assert stopped.json()["state"] == "Stopped" and "admin" in stopped.json()["reason"]


def test_stop_ends_every_replica_and_releases_its_gpus(hub, users, admin):
    ann = users["ann"]
    spec = {"name": "sleepy", "strategy": "parameter-server",
            "replicas": {"chief": 1, "ps": 1, "worker": 2}, "resources": {"worker": {"gpus": 1}},
            "source": SLEEPER}
    # the chief is the only replica that runs the program under parameter-server; ps and
    # workers run TensorFlow servers
    r = ann.service("POST", "jobs", json=spec)
    assert r.status_code == 201, r.text
    folder = job_dir(hub, "ann", "sleepy")
    pids = wait_pids(folder, 1)
    job_id = r.json()["id"]
    # as root the job has its own network namespace and /tmp while it runs
    assert not SANDBOXED or (NETNS_DIR / job_id).exists() and (TMP_ROOT / job_id).is_dir()
    replicas = {x["name"] for x in r.json()["replicas"]}
    assert replicas == {"chief-0", "ps-0", "worker-0", "worker-1"}
    held = [h for h in holdings(ann) if h["kind"] == "job" and h["name"] == "sleepy"]
    assert held and held[0]["gpus"] == 2
    # how busy each held GPU is: these are simulated, and every view says so
    assert [(u["device"], u["measured"], u["why"]) for u in held[0]["usage"]] == \
        [(d, False, "simulated") for d in held[0]["devices"]]
    view = ann.service("GET", "jobs/sleepy").json()
    workers = [x for x in view["replicas"] if x["role"] == "worker"]
    assert [u["text"] for x in workers for u in x["usage"]] == \
        [f"GPU {d}: simulated (nothing to measure)" for x in workers for d in x["devices"]]
    page = requests.get(hub.service_url + "admin",
                        headers={"Authorization": f"token {admin.token()}"})
    assert page.status_code == 200, page.text
    assert 'class="gpu-usage"' in page.text and "simulated (nothing to measure)" in page.text
    assert len(job_processes(folder)) >= 4
    t0 = time.time()
    job = ann.service("POST", "jobs/sleepy/stop").json()
    assert job["state"] == "Stopped"
    assert all(x["state"] != "Running" for x in job["replicas"])
    assert time.time() - t0 < 30
    assert all(gone(p) for p in pids)
    assert job_processes(folder) == []
    assert not [h for h in holdings(ann) if h["name"] == "sleepy"]
    assert not (NETNS_DIR / job_id).exists() and not (TMP_ROOT / job_id).exists()
    # stopping again is harmless
    assert ann.service("POST", "jobs/sleepy/stop").json()["state"] == "Stopped"


def test_a_failing_program_fails_at_once_with_its_error_in_the_reason(hub, users):
    """Issue 14: the program's own error is not retried (it would raise again), and the
    job's reason names it: the exception and the line of the person's code."""
    ann = users["ann"]
    spec = mw("broken", workers=1, gpus=1, retries=1,
              source="import json\n\nraise ValueError('bad learning rate')\n")
    assert ann.service("POST", "jobs", json=spec).status_code == 201
    job = wait_state(ann, "broken", {"Succeeded", "Failed"})
    assert job["state"] == "Failed", job
    assert job["reason"] == ("worker-0 failed: the program raised an error (exit 1); see its "
                             "log (logs/worker-0.log). ValueError: bad learning rate "
                             "(source.py, line 3)"), job["reason"]
    worker = job["replicas"][0]
    assert worker["restarts"] == 0 and worker["exit_code"] == 1
    log = ann.service("GET", "jobs/broken/logs/worker-0").json()["text"]
    assert log.count("ValueError: bad learning rate") == 1
    assert not [h for h in holdings(ann) if h["name"] == "broken"]


MAIN = """
import json, os
import helper
print("main sees", helper.greeting(), json.load(open(os.path.join(os.path.dirname(__file__), "params.json"))))
"""
HELPER = """
def greeting():
    return "hello from helper"

def broken():
    raise ValueError("bad shape in helper")
"""


def test_a_program_of_several_files(hub, users):
    """Issue 14 item 8: ``files`` go beside the entry point (``source``), in the job's code
    folder on every replica's import path; a failing helper is named in the reason; a bad
    file name is refused naming ``files`` with nothing made."""
    ann = users["ann"]
    spec = mw("several", workers=2, source=MAIN,
              files={"helper.py": HELPER, "params.json": '{"lr": 0.1}'})
    r = ann.service("POST", "jobs", json=spec)
    assert r.status_code == 201, r.text
    assert r.json()["spec"]["files"] == spec["files"]
    job = wait_state(ann, "several", {"Succeeded", "Failed"})
    assert job["state"] == "Succeeded", job
    for w in ("worker-0", "worker-1"):
        log = ann.service("GET", f"jobs/several/logs/{w}").json()["text"]
        assert "main sees hello from helper {'lr': 0.1}" in log, log[-2000:]
    code = job_dir(hub, "ann", "several") / "code"
    assert sorted(p.name for p in code.iterdir() if p.is_file()) == [
        "helper.py", "params.json", "source.py"]
    assert not (job_dir(hub, "ann", "several") / "source.py").exists()

    spec = mw("several-broken", workers=1, source="import helper\nhelper.broken()\n",
              files={"helper.py": HELPER})
    assert ann.service("POST", "jobs", json=spec).status_code == 201
    job = wait_state(ann, "several-broken", {"Succeeded", "Failed"})
    assert job["state"] == "Failed" and job["reason"].endswith(
        "ValueError: bad shape in helper (helper.py, line 6)"), job["reason"]

    for name in ("../x.py", "sub/x.py", ".hidden", "source.py", "x\u2215y.py"):
        r = ann.service("POST", "jobs", json=mw("several-bad", source=MAIN,
                                                   files={name: "x = 1"}))
        assert r.status_code == 400 and r.json()["field"] == "files", (name, r.text)
    assert ann.service("GET", "jobs/several-bad").status_code == 404
    assert not job_dir(hub, "ann", "several-bad").exists()


# worker-0 is killed (SIGKILL) in its first two runs; worker-1 finishes every time
DIES_TWICE = """
import json, os, signal
task = json.loads(os.environ["TF_CONFIG"])["task"]
if task["index"] == 0:
    runs = len(os.listdir("deaths")) if os.path.isdir("deaths") else 0
    if runs < 2:
        os.makedirs(f"deaths/{runs}")
        os.kill(os.getpid(), signal.SIGKILL)
print("done", flush=True)
"""


def test_a_restart_of_all_workers_is_one_retry(hub, users):
    """Issue 14: in a multi-worker job every worker restarts together; that is one retry,
    however many workers there are (two killed rounds of two workers fit `retries: 2`)."""
    ann = users["ann"]
    assert ann.service("POST", "jobs", json=mw("phoenix", workers=2, source=DIES_TWICE,
                                               retries=2)).status_code == 201
    job = wait_state(ann, "phoenix", {"Succeeded", "Failed"}, timeout=300)
    assert job["state"] == "Succeeded", job
    assert [r["restarts"] for r in job["replicas"]] == [2, 2], job["replicas"]

    # Issue 34: each restart is in the job's view (which replica, when, why) ...
    w0, w1 = job["replicas"]
    assert [(h["restart"], h["attempt"], h["exit_code"], h["signal"], h["oom_killed"],
             h["reason"]) for h in w0["restart_history"]] == [
        (n, n + 1, -9, "SIGKILL", False, "killed by SIGKILL") for n in (1, 2)]
    # the other worker was stopped to restart with it (or lost its peer and exited)
    assert [h["restart"] for h in w1["restart_history"]] == [1, 2]
    assert all(h["reason"] == "stopped to restart with worker-0" and h["exit_code"] is None
               or h["exit_code"] is not None for h in w1["restart_history"]), w1
    submitted = job["created_at"]
    assert all(submitted <= h["at"] <= job["finished_at"]
               for r in (w0, w1) for h in r["restart_history"])
    # ... and in the log where the new attempt starts, so that the output seen twice is
    # explained (the log as a terminal shows it, and raw)
    markers = r"^--- restart (\d) of worker 0 at \d\d:\d\d:\d\d: previous attempt killed by SIGKILL \(exit -9\) ---$"
    log = ann.service("GET", "jobs/phoenix/logs/worker-0").json()
    assert [int(n) for n in re.findall(markers, log["text"], re.M)] == [1, 2], log["text"]
    assert log["text"].rstrip().endswith("done") and log["text"].count("done") == 1
    raw = ann.service("GET", "jobs/phoenix/logs/worker-0?raw=1").json()
    assert raw["from"] == 0 and len(re.findall(markers, raw["text"], re.M)) == 2
    assert re.search(r"^--- restart 2 of worker 1 at .*: previous attempt ",
                     log_w1 := ann.service("GET", "jobs/phoenix/logs/worker-1").json()["text"],
                     re.M), log_w1
    # the CLI shows a line per restart
    out = subprocess.run([GPULAB, "jobs", "show", "phoenix"], capture_output=True, text=True,
                         env={**os.environ, "GPULAB_URL": hub.url, "GPULAB_TOKEN": ann.token()},
                         timeout=60)
    assert re.search(r"^  worker-0: restart 1 at \d\d:\d\d:\d\d \(attempt 2\): killed by "
                     r"SIGKILL \(exit -9\)$", out.stdout, re.M), out.stdout + out.stderr


BAD_BODIES = [
    ("zero workers", mw("bad1", workers=0), "replicas.worker"),
    ("unknown strategy", {**mw("bad2"), "strategy": "allreduce"}, "strategy"),
    ("chief count 2", {"name": "bad3", "strategy": "parameter-server",
                       "replicas": {"chief": 2, "ps": 1, "worker": 1}, "source": HELLO},
     "replicas.chief"),
    ("script outside", {**mw("bad4", source=None), "script": "/etc/passwd.py"}, "script"),
    ("dot-dot", {**mw("bad5", source=None), "script": "../bob/x.py"}, "script"),
    ("TF_CONFIG", {**mw("bad6"), "env": {"TF_CONFIG": "{}"}}, "env"),
    ("oversize source", mw("bad7", source="x = 1\n" * 45_000), "source"),
    ("oversize body", mw("bad7", source="x = 1\n" * 60_000), "body"),
    ("missing script", {**mw("bad8", source=None), "script": "nothere.py"}, "script"),
    ("link to another's file", {**mw("bad9", source=None), "script": "bobs.py"}, "script"),
    ("not JSON", "not json", "body"),
    ("too many gpus", mw("bad10", workers=2, gpus=3), "resources"),
]


@pytest.mark.parametrize("body,field", [b[1:] for b in BAD_BODIES], ids=[b[0] for b in BAD_BODIES])
def test_bad_specs_get_400_naming_the_field_and_nothing_is_made(hub, users, body, field):
    carl = users["carl"]
    mine = hub.data_dir / "shared" / "users" / "carl"
    bobs = hub.data_dir / "shared" / "users" / "bob" / "secret.py"
    if body is not None and isinstance(body, dict) and body.get("script") == "bobs.py":
        bobs.parent.mkdir(parents=True, exist_ok=True)
        bobs.write_text("print('bob')\n")
        mine.mkdir(parents=True, exist_ok=True)
        (mine / "bobs.py").unlink(missing_ok=True)
        (mine / "bobs.py").symlink_to(bobs)
    kw = {"data": body} if isinstance(body, str) else {"json": body}
    r = carl.service("POST", "jobs", **kw)
    assert 400 <= r.status_code < 500 and r.status_code != 404, (r.status_code, r.text)
    assert r.json()["field"] == field, r.json()
    assert r.json()["message"]
    assert carl.service("GET", "jobs").json()["jobs"] == []
    assert holdings(carl) == []
    assert not (mine / "jobs").exists() or not any((mine / "jobs").iterdir())


def test_job_over_quota_with_a_notebook_is_refused_whole_when_it_asks_not_to_wait(
        hub, users, admin):
    bob = users["bob"]
    assert admin.service("PUT", "quotas/users/bob", json={"max_gpus": 2}).status_code == 200
    try:
        bob.start_server("", {"profile": "gpu-1"})
        r = bob.service("POST", "jobs", json=mw("big", workers=2, gpus=1, wait=False))
        assert r.status_code == 409, r.text
        message = r.json()["message"]
        assert "notebook" in message and "2" in message, message
        assert bob.service("GET", "jobs/big").status_code == 404
        assert [h["kind"] for h in holdings(bob)] == ["notebook"]
        assert not job_dir(hub, "bob", "big").exists()
        # one GPU still fits
        ok = bob.service("POST", "jobs", json=mw("small", workers=1, gpus=1))
        assert ok.status_code == 201, ok.text
        assert wait_state(bob, "small", {"Succeeded", "Failed"})["state"] == "Succeeded"
    finally:
        bob.stop_server("")
        admin.service("DELETE", "quotas/users/bob")


def test_a_job_that_does_not_fit_waits_in_the_queue_and_starts_when_gpus_come_back(
        hub, users, admin):
    """Issue 17: with the person's GPUs held by their notebook, a job is Queued (202) at
    position 1 with the reason in words, survives in the list, and starts by itself within
    2 s of the notebook giving the GPUs back; a queued job can be stopped; a job that could
    never fit is still refused at once."""
    bob = users["bob"]
    assert admin.service("PUT", "quotas/users/bob", json={"max_gpus": 2}).status_code == 200
    try:
        assert bob.start_server("", {"profile": "gpu-2"}).status_code in (201, 202)
        r = bob.service("POST", "jobs", json=mw("later", workers=2, gpus=1, source=SLEEPER))
        assert r.status_code == 202, r.text
        job = r.json()
        assert job["state"] == "Queued" and job["queue"]["position"] == 1, job
        assert "GPU" in job["reason"] and job["queue"]["ahead"] == 0, job
        assert [h["kind"] for h in holdings(bob)] == ["notebook"]  # nothing half-made
        assert [j["state"] for j in bob.service("GET", "jobs").json()["jobs"]
                if j["name"] == "later"] == ["Queued"]
        # a second one waits behind it; the queue API lists both, in order
        r2 = bob.service("POST", "jobs", json=mw("after", workers=1, gpus=1, source=SLEEPER))
        assert r2.status_code == 202 and r2.json()["queue"]["position"] == 2, r2.text
        line = bob.service("GET", "queue").json()
        assert line["enabled"] and [(e["holder"], e["position"]) for e in line["entries"]] == [
            ("later", 1), ("after", 2)], line
        entry = line["entries"][1]["id"]
        # the admin page lists the line, each entry with its actions
        html = admin.s.get(hub.service_url + "admin", timeout=60).text
        rows = re.findall(r'<tr data-entry="([0-9a-f]{32})" data-user="bob">\s*'
                          r'<td class="position">(\w+)</td>', html)
        assert [(e, p) for e, p in rows] == [(line["entries"][0]["id"], "1"), (entry, "2")], \
            html[html.find('id="queue"'):][:2000]
        assert f'data-entry="{entry}"' in html and 'name="top"' in html
        assert all(e["user"] == "bob" for e in admin.service("GET", "queue").json()["entries"])
        # an admin's actions: not for bob; hold (audited), then cancel, which stops the job
        assert bob.service("POST", f"queue/{entry}/top").status_code == 403
        held = admin.service("POST", f"queue/{entry}/hold")
        assert held.status_code == 200 and held.json()["held"], held.text
        assert bob.service("GET", "jobs/after").json()["queue"]["position"] is None
        assert admin.service("POST", f"queue/{entry}/drop").status_code == 404
        audit = admin.service("GET", "audit").json()["audit"]
        assert any(a["scope"] == "queue" and a["name"] == "bob/job/after" for a in audit), audit
        assert admin.service("POST", f"queue/{entry}/cancel").status_code == 200
        stopped = bob.service("GET", "jobs/after").json()
        assert stopped["state"] == "Stopped" and "admin" in stopped["reason"], stopped
        assert admin.service("POST", f"queue/{entry}/cancel").status_code == 404  # gone
        assert [e["holder"] for e in bob.service("GET", "queue").json()["entries"]] == ["later"]
        # never fits (more than the quota allows at once): refused now, not queued
        never = bob.service("POST", "jobs", json=mw("huge", workers=3, gpus=1))
        assert never.status_code == 409 and never.json()["field"] == "resources", never.text
        assert bob.service("GET", "jobs/huge").status_code == 404

        bob.stop_server("")
        freed = time.monotonic()
        deadline = freed + 30
        while time.monotonic() < deadline:
            job = bob.service("GET", "jobs/later").json()
            if job["state"] != "Queued":
                break
            time.sleep(0.1)
        started_after = time.monotonic() - freed
        assert job["state"] in ("Admitted", "Starting", "Running"), job
        assert started_after < 2.0, f"started {started_after:.2f} s after the GPUs came back"
        assert sorted(d for r in job["replicas"] for d in r["devices"]).__len__() == 2, job
        wait_pids(job_dir(hub, "bob", "later"), 2)
        assert [h["kind"] for h in holdings(bob)] == ["job"]
    finally:
        for name in ("later", "after"):
            bob.service("POST", f"jobs/{name}/stop")
        bob.stop_server("")
        admin.service("DELETE", "quotas/users/bob")
    assert holdings(bob) == []


def _service_process(hub) -> psutil.Process:
    """This hub's gpulab service: ``python -m gpulab.hub.service --config=<data>/…``."""
    option = f"--config={hub.data_dir / SERVICE_CONFIG_NAME}"
    for p in psutil.process_iter(["cmdline"]):
        cmd = p.info["cmdline"] or []
        if "gpulab.hub.service" in cmd and option in cmd:
            return p
    raise LookupError("no gpulab service process")


def _wait_service(hub, old_pid, timeout=90):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            p = _service_process(hub)
            if p.pid != old_pid and requests.get(hub.service_api + "openapi.json", timeout=2).ok:
                return p
        except (LookupError, requests.ConnectionError):
            pass
        time.sleep(0.3)
    raise TimeoutError("the hub did not restart the gpulab service")


def test_the_service_reads_its_settings_from_its_private_config_file(hub):
    """`gpulab up`'s hub starts the service with ``--config=<data>/gpulab_service_config.json``:
    the ledger's URL, the operator's intervals and the TLS files are there, private to the
    hub's account, and none of them is in the service's environment."""
    service = _service_process(hub)
    path = hub.data_dir / SERVICE_CONFIG_NAME
    info = path.stat()
    assert stat.S_IMODE(info.st_mode) == 0o600 and info.st_uid == service.uids().real
    settings = json.loads(path.read_text())["GpulabService"]
    assert settings["ledger_url"] == f"sqlite:///{hub.data_dir / 'gpulab.sqlite'}"
    assert settings["reconcile_seconds"] == 2.0  # the operator's c.GPULedger.reconcile_interval
    assert settings["shared_dir"] == str(hub.data_dir / "shared")
    assert all(Path(settings[f"ssl_{n}"]).is_file()
               for n in ("keyfile", "certfile", "client_ca", "hub_ca"))
    env = service.environ()
    assert env.get("JUPYTERHUB_API_TOKEN")  # what the hub gives every service stays there
    assert not set(ENV_FALLBACKS.values()) & set(env), sorted(env)


def test_service_killed_mid_job_recovers_state_and_gpus(hub, users):
    ann = users["ann"]
    # job 1 survives the outage whole: re-adopted, then it finishes normally
    finish_later = SLEEPER.replace("time.sleep(600)",
                                   "while not os.path.exists('go'): time.sleep(0.1)\n"
                                   "print('finished', flush=True)")
    assert ann.service("POST", "jobs", json=mw("survivor", workers=2, gpus=1,
                                               source=finish_later)).status_code == 201
    # job 2 loses a replica while the service is down: marked lost, the rest killed
    assert ann.service("POST", "jobs", json=mw("victim", workers=2, gpus=1,
                                               source=SLEEPER)).status_code == 201
    survivor, victim = job_dir(hub, "ann", "survivor"), job_dir(hub, "ann", "victim")
    survivor_pids, victim_pids = wait_pids(survivor, 2), wait_pids(victim, 2)

    service = _service_process(hub)
    service.send_signal(signal.SIGKILL)
    deadline = time.time() + 10
    while not gone(service.pid):  # a zombie until the hub reaps it
        assert time.time() < deadline
        time.sleep(0.1)
    os.kill(victim_pids[0], signal.SIGKILL)
    _wait_service(hub, service.pid)

    lost = wait_state(ann, "victim", {"Failed"})
    assert "lost" in lost["reason"], lost
    # the lost job's sandbox is gone, the adopted one's kept
    assert not (NETNS_DIR / lost["id"]).exists() and not (TMP_ROOT / lost["id"]).exists()
    assert all(gone(p) for p in victim_pids)
    job = ann.service("GET", "jobs/survivor").json()
    assert job["state"] == "Running", job
    assert not SANDBOXED or (NETNS_DIR / job["id"]).exists() and (TMP_ROOT / job["id"]).is_dir()
    assert all(not gone(p) for p in survivor_pids)
    held = {h["name"]: h["gpus"] for h in holdings(ann) if h["kind"] == "job"}
    assert held == {"survivor": 2}, held

    (survivor / "go").write_text("")
    done = wait_state(ann, "survivor", {"Succeeded", "Failed"})
    assert done["state"] == "Succeeded", done
    assert not [h for h in holdings(ann) if h["kind"] == "job"]


def test_cli_submit_follow_list_show_logs_stop(hub, users, workdir):
    ann = users["ann"]
    env = {**os.environ, "GPULAB_URL": hub.url, "GPULAB_TOKEN": ann.token()}
    program = workdir / "cli_job.py"
    program.write_text(HELLO)

    def gl(*args):
        return subprocess.run([GPULAB, "jobs", *args], env=env, capture_output=True, text=True,
                              timeout=120)

    r = gl("submit", "--name", "cli-one", "--strategy", "multi-worker-mirrored", "--workers", "1",
           "--source-file", str(program), "--arg", "x", "-f")
    assert r.returncode == 0, r.stderr
    assert "hello from worker-0" in r.stdout and "cli-one: Succeeded" in r.stdout

    spec = workdir / "spec.yaml"
    spec.write_text("name: cli-two\nstrategy: multi-worker-mirrored\nreplicas: {worker: 1}\n"
                    "source: |\n" + "".join(f"  {line}\n" for line in SLEEPER.splitlines()))
    r = gl("submit", str(spec), "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["name"] == "cli-two"
    wait_pids(job_dir(hub, "ann", "cli-two"), 1)
    r = gl("list")
    assert r.returncode == 0 and "cli-two" in r.stdout and "Running" in r.stdout, r.stdout
    r = gl("show", "cli-two")
    assert r.returncode == 0 and "worker-0" in r.stdout and "Running" in r.stdout, r.stdout
    r = gl("logs", "cli-two")
    assert r.returncode == 0 and "sleeping" in r.stdout
    r = gl("stop", "cli-two")
    assert r.returncode == 0 and "Stopped" in r.stdout

    # bad input: a clear message and a non-zero exit, nothing submitted
    r = gl("submit", "--name", "cli-bad", "--strategy", "multi-worker-mirrored",
           "--workers", "0", "--source-file", str(program))
    assert r.returncode == 1 and "replicas.worker" in r.stderr, r.stderr
    r = gl("submit", "--name", "cli-bad", "--strategy", "multi-worker-mirrored",
           "--env", "NOEQUALS", "--source-file", str(program))
    assert r.returncode == 2 and "NAME=VALUE" in r.stderr
    r = gl("submit", str(workdir / "missing.yaml"))
    assert r.returncode == 2 and "cannot read" in r.stderr
    r = gl("show", "nope")
    assert r.returncode == 1 and "no job named 'nope'" in r.stderr
    assert "cli-bad" not in gl("list").stdout


def test_links_in_a_users_folder_are_never_followed(hub, users):
    """A person who owns their folder can put links in it; the service (root) must not
    follow them into someone else's files, for writing or for reading logs."""
    ann, carl = users["ann"], users["carl"]
    shared = hub.data_dir / "shared" / "users"
    secret = shared / "bob" / "secret.txt"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_text("bob's secret\n")
    before = sorted(p.name for p in secret.parent.iterdir())

    # a job folder that is a link to bob's folder: refused, nothing written there
    (shared / "carl" / "jobs").mkdir(parents=True, exist_ok=True)
    (shared / "carl" / "jobs" / "linked").symlink_to(secret.parent)
    r = carl.service("POST", "jobs", json=mw("linked", workers=1, gpus=1))
    assert r.status_code == 409 and r.json()["field"] == "name", r.text
    assert "link" in r.json()["message"]
    assert sorted(p.name for p in secret.parent.iterdir()) == before
    assert holdings(carl) == []

    # a replica's log replaced by a link to bob's file: not served
    log = job_dir(hub, "ann", "hello") / "logs" / "worker-1.log"
    log.unlink()
    log.symlink_to(secret)
    r = ann.service("GET", "jobs/hello/logs/worker-1")
    assert r.status_code == 409, r.text
    assert "secret" not in r.text and r.json()["message"]
    assert ann.service("GET", "jobs/hello").status_code == 200


def test_job_limits_come_from_the_operators_config(workdir, prefix):
    from tests.app.hubctl import Browser, Hub

    data = workdir / "limited"
    data.mkdir(mode=0o711)
    (data / "gpulab_config.py").write_text("c.GPUJobs.max_replicas = 2\n"
                                           "c.GPUJobs.max_source_bytes = 1000\n")
    hub = Hub(data, "--simulated-gpus", "2", "--user-prefix", prefix).start()
    try:
        admin = Browser(hub, "admin")
        admin.login(hub.admin_password)
        r = admin.service("POST", "jobs", json=mw("three", workers=3))
        assert r.status_code == 400 and r.json()["field"] == "replicas", r.text
        assert "at most 2 replicas" in r.json()["message"]
        r = admin.service("POST", "jobs", json=mw("long", workers=1, source="x = 1\n" * 200))
        assert r.status_code == 400 and r.json()["field"] == "source", r.text
        assert admin.service("GET", "jobs").json()["jobs"] == []
    finally:
        hub.stop()


def test_without_tensorflow_the_hub_offers_no_training_and_says_why(workdir, prefix):
    """Issue 14: a Python for training that cannot import TensorFlow (Debian's own, here)
    makes no job that fails in a second: the service says why in ``me``, refuses a submit
    with 503 and that reason, and the CLI prints it."""
    from tests.app.hubctl import Browser, Hub

    data = workdir / "no-tf"
    data.mkdir(mode=0o711)
    (data / "gpulab_config.py").write_text('c.GPUJobs.python = "/usr/bin/python3"\n')
    hub = Hub(data, "--simulated-gpus", "1", "--user-prefix", prefix).start()
    try:
        admin = Browser(hub, "admin")
        admin.login(hub.admin_password)
        jobs = admin.service("GET", "me").json()["jobs"]
        assert jobs["available"] is False, jobs
        assert "TensorFlow" in jobs["reason"] and "/usr/bin/python3" in jobs["reason"]
        assert "scripts/run.sh" in jobs["reason"]
        r = admin.service("POST", "jobs", json=mw("first", workers=1))
        assert r.status_code == 503 and r.json()["message"] == jobs["reason"], r.text
        assert admin.service("GET", "jobs").json()["jobs"] == []
        env = {**os.environ, "GPULAB_URL": hub.url, "GPULAB_TOKEN": admin.token()}
        program = workdir / "no_tf_job.py"
        program.write_text("print(1)\n")
        cli = subprocess.run([GPULAB, "jobs", "submit", "--name", "cli", "--strategy",
                              "multi-worker-mirrored", "--workers", "1", "--source-file",
                              str(program)],
                             env=env, capture_output=True, text=True, timeout=60)
        assert cli.returncode != 0 and "TensorFlow and tf-keras cannot be imported" in cli.stderr, cli
        assert "Traceback" not in cli.stderr
    finally:
        hub.stop()


def test_a_replica_over_its_memory_limit_is_killed_and_the_job_says_so(hub, users):
    """A role's cpu/memory are enforced with a control group per replica (as root)."""
    ann = users["ann"]
    source = ("print(open('/proc/self/cgroup').read(), flush=True)\n"
              "b = bytearray(4 * 2**30)\n"
              "print('survived', flush=True)\n")
    spec = mw("hungry", workers=1, source=source, retries=1)
    spec["resources"]["worker"].update({"memory": "2Gi", "cpu": 1})
    r = ann.service("POST", "jobs", json=spec)
    assert r.status_code == 201, r.text
    job = wait_state(ann, "hungry", {"Failed", "Succeeded"})
    worker = job["replicas"][0]
    assert worker["exit_code"] == -9, worker
    # the role's limit, and the person's for all their work (half this machine's memory)
    from gpulab.hub.jobs.local import _size
    from gpulab.hub.machine.cgroups import share_of_memory

    why = ("killed: out of memory (the worker role's memory limit is 2Gi, and all your servers "
           f"and replicas together may use {_size(share_of_memory(0.5))})")
    assert worker["reason"] == why
    assert job["reason"] == (f"worker-0 failed ({why}) after 1 restart of the workers "
                             "(retries: 1)")
    # the restart between the two attempts says why (issue 34): the group's OOM count
    (restart,) = worker["restart_history"]
    assert (restart["exit_code"], restart["signal"], restart["oom_killed"]) == (-9, "SIGKILL", True)
    text = ann.service("GET", "jobs/hungry/logs/worker-0").json()["text"]
    assert re.search(rf"/gpulab/person-[0-9a-f]{{8}}-ann/job-{job['id']}-worker-0\n", text), text
    assert "survived" not in text
    assert re.search(r"^--- restart 1 of worker 0 at \d\d:\d\d:\d\d: previous attempt "
                     + re.escape(why) + r" \(exit -9\) ---$", text, re.M), text
    # the replica's group went with the job
    cgroups, why = Cgroups.detect()
    assert cgroups is not None, why
    assert not any(d.exists() for d in cgroups.find(f"job-{job['id']}-worker-0").dirs.values())


def test_concurrent_submits_of_one_name_start_one_job(hub, users):
    """Issue 13: eight submits of one name at once: one job, seven 409s naming the name, and
    only that job's GPU held (nothing half-made by the ones refused)."""
    import concurrent.futures

    bob = users["bob"]
    before = holdings(bob)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda _: bob.service(
            "POST", "jobs", json=mw("twice", workers=1, gpus=1, source=SLEEPER)), range(8)))
    codes = sorted(r.status_code for r in answers)
    assert codes == [201] + [409] * 7, [(r.status_code, r.text[:200]) for r in answers]
    assert all(r.json()["field"] == "name" and "already have a job named 'twice'" in
               r.json()["message"] for r in answers if r.status_code == 409)
    held = [h for h in holdings(bob) if h not in before]
    assert [(h["kind"], h["name"], h["gpus"]) for h in held] == [("job", "twice", 1)], held
    assert bob.service("POST", "jobs/twice/stop").json()["state"] == "Stopped"
    assert holdings(bob) == before


def test_the_jobs_of_a_deleted_account_are_stopped_and_their_gpus_freed(hub, users, admin):
    """An admin deletes a person in the hub while their job runs: the service stops the job
    (its reason says why), its processes end and its GPUs come back, within a pass of the
    reconciler (every 2 s here)."""
    from tests.app.hubctl import Browser
    from tests.conftest import PASSWORD

    dora = Browser(hub, "dora")
    assert dora.signup(PASSWORD).status_code == 200
    assert admin.approve("dora").status_code == 200
    dora.login(PASSWORD)
    r = dora.service("POST", "jobs", json=mw("left-behind", workers=1, gpus=1, source=SLEEPER))
    assert r.status_code == 201, r.text
    folder = job_dir(hub, "dora", "left-behind")
    pids = wait_pids(folder, 1)
    ledger = Ledger(f"sqlite:///{hub.data_dir / 'gpulab.sqlite'}")
    assert [a.gpus for a in ledger.open_allocations(user="dora")] == [1]
    # a person who is still there keeps their job
    r = users["bob"].service("POST", "jobs", json=mw("stays", workers=1, source=SLEEPER))
    assert r.status_code == 201, r.text

    token = dora.token()
    r = admin.api("DELETE", "/users/dora")
    assert r.status_code == 204, r.text
    job = wait_state(admin, "left-behind", {"Stopped"}, timeout=60, user="dora")
    # the token dora made is refused by the service too, after its 5 s cache at most
    t0 = time.monotonic()
    while dora.service("GET", "me", token=token).status_code == 200:
        assert time.monotonic() - t0 < 15, "a deleted account's token still works"
        time.sleep(0.5)
    assert dora.service("POST", "jobs", json=mw("after", workers=1)).status_code == 401
    assert job["reason"] == "stopped: dora's account was deleted"
    assert all(gone(p) for p in pids) and job_processes(folder) == []
    assert ledger.open_allocations(user="dora") == []
    time.sleep(3)  # a pass of the reconciler later
    assert wait_state(users["bob"], "stays", {"Running", "Succeeded", "Failed", "Stopped"},
                      timeout=60)["state"] == "Running"
    assert users["bob"].service("POST", "jobs/stays/stop").json()["state"] == "Stopped"
    ledger.engine.dispose()


def test_a_cluster_needs_its_persons_server_and_only_clusters_take_leases(hub, users):
    """Issue 38's API edges: a held cluster lives in its person's notebook network (refused,
    409 naming ``kind``, while they have no server: nothing is held); the lease renews a
    cluster only: bad input is a 400 naming ``idle_for``, a job a 409, no such name a 404."""
    carl = users["carl"]
    spec = {"name": "held", "kind": "cluster", "strategy": "parameter-server",
            "replicas": {"ps": 1, "worker": 1}, "resources": {"worker": {"gpus": 1}}}
    if os.geteuid() == 0:  # (without root there are no namespaces: it would start)
        r = carl.service("POST", "jobs", json=spec)
        assert r.status_code == 409 and r.json()["field"] == "kind", r.text
        assert "start your server first" in r.json()["message"]
        assert carl.service("GET", "jobs/held").status_code == 404
        assert holdings(carl) == []
    r = carl.service("POST", "jobs/nothing/lease", json={"idle_for": 1})
    assert r.status_code == 404, r.text
    r = carl.service("POST", "jobs", json=mw("plain", 1))
    assert r.status_code == 201, r.text
    try:
        for body, status, field in (({"idle_for": -1}, 400, "idle_for"),
                                    ({"idle_for": "soon"}, 400, "idle_for"),
                                    ([1], 400, "idle_for"), ({}, 409, "name")):
            r = carl.service("POST", "jobs/plain/lease", json=body)
            assert (r.status_code, r.json().get("field")) == (status, field), r.text
        assert "not a held cluster" in r.json()["message"]
    finally:
        carl.service("POST", "jobs/plain/stop")
