"""The ``gpulab`` client commands (quota, usage, jobs) against a small fake hub on a local
port: where ``--url``, ``--token`` and ``--json`` may go, the checks of ``quota set`` on the
name it is given and what it prints, the times of ``jobs show``; and the notebook client's
``submit`` filling in the chief of a parameter-server job. The same against a real hub:
tests/app/test_client.py."""

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gpulab.extensions.client import Client, with_chief
from gpulab.extensions.joblog import render_text, restart_record
from gpulab.hub.cli import build_parser, main
from gpulab.hub.cli.jobs import job_times, print_job, progress_words

CREATED = 1796393131.25  # 2026-12-04 14:05:31.25 UTC
JOB = {"name": "digits", "user": "ann", "strategy": "parameter-server", "state": "Succeeded",
       "reason": "chief-0 exited 0", "gpus": 2, "job_dir": "/shared/users/ann/jobs/digits",
       "created_at": CREATED, "started_at": CREATED + 2, "finished_at": CREATED + 2 + 312,
       "replicas": [{"name": "chief-0", "state": "Succeeded", "restarts": 0, "exit_code": 0,
                     "devices": [], "reason": ""}]}
ADMIN_SCOPES = ["admin:users", "read:users", "read:users:name", "admin:groups", "read:groups",
                "custom:gpulab:admin"]


class FakeHub:
    """The hub's REST API (``/hub/api/``) and the gpulab service's (``/services/gpulab/``):
    a few answers, every request recorded as (method, path, token, body)."""

    def __init__(self):
        self.requests: list[tuple] = []
        self.users = {"ann", "admin"}
        self.groups = {"staff"}
        self.whoami = {"name": "admin", "scopes": ADMIN_SCOPES}
        self.gpulab_admin = True
        self.others: dict[str, str] = {}  # job name -> its owner, not the token's owner
        self.logs_status = 200  # the log API's answer: 503 once "the hub stopped"
        self.unknown: set[str] = set()  # job names nobody has
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _answer(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                token = self.headers.get("Authorization", "").removeprefix("token ")
                hub.requests.append((self.command, self.path, token, body))
                status, out = hub.route(self.command, self.path, body)
                raw = json.dumps(out).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            do_GET = do_PUT = do_POST = do_DELETE = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def route(self, method, path, body):
        api = "/services/gpulab/api/v1/"
        if path == "/hub/api/user":
            return 200, self.whoami
        for kind, known in (("users", self.users), ("groups", self.groups)):
            prefix = f"/hub/api/{kind}/"
            if path.startswith(prefix):
                name = path[len(prefix):]
                visible = name == self.whoami["name"] or any(
                    s.startswith(("read:users", "admin:users", "read:groups", "admin:groups"))
                    and "!" not in s for s in self.whoami["scopes"])
                if name in known and visible:
                    return 200, {"name": name}
                return 404, {"status": 404, "message": "Not Found"}
        if path == api + "me":
            return 200, {"user": self.whoami["name"], "admin": self.gpulab_admin,
                         "quota_text": "no limit but free GPUs", "quota_source": "none",
                         "gpus_held": 0, "holdings": [], "usage_gpu_hours": {"7d": 0, "30d": 0}}
        if path.startswith(api + "quotas/") and method == "PUT":
            if not self.gpulab_admin:
                return 403, {"status": 403, "message": "This needs the scope custom:gpulab:admin "
                             "(a gpulab admin)."}
            scope, _, name = path[len(api + "quotas/"):].partition("/")
            # as the service answers: the disk limit in bytes
            from gpulab.hub.quota.policy import parse_disk

            return 200, {"scope": scope.rstrip("s"), "name": name, "max_per_request": None,
                         "gpu_hours": None, "window_hours": None, **body,
                         "disk": parse_disk(body.get("disk"))}
        if path == api + "jobs" and method == "POST":  # the queue is full: it waits
            return 202, {**JOB, "name": body["name"], "state": "Queued", "started_at": None,
                         "finished_at": None, "reason": "Waits for free GPUs.",
                         "queue": {"position": 2, "estimated_start": None, "ahead": 1,
                                   "ahead_gpus": 4}}
        if path.startswith(api + "jobs/") and "/logs/" in path and self.logs_status != 200:
            return self.logs_status, {"status": self.logs_status}  # as the proxy answers
        job_name, _, query = path[len(api + "jobs/"):].partition("?")
        job_name = job_name.split("/")[0]
        if path.startswith(api + "jobs/") and job_name in self.unknown:
            return 404, {"status": 404, "message": f"You have no job named '{job_name}'."}
        if path.startswith(api + "jobs/") and job_name in self.others:
            if f"user={self.others[job_name]}" not in query:
                return 404, {"status": 404, "message": f"You have no job named '{job_name}'."}
            if "/logs/" not in path:
                return 200, {**JOB, "name": job_name, "user": self.others[job_name]}
        if path.startswith(api + "jobs?") and "all=1" in path:
            return 200, {"jobs": [JOB] + [{**JOB, "name": n, "user": u}
                                          for n, u in self.others.items()]}
        if path.startswith(api + "jobs/") and "/logs/" in path:  # the service's answer
            raw = "raw=1" in path
            return 200, {"replica": "chief-0", "offset": len(LOG), "from": 0, "size": len(LOG),
                         "text": LOG if raw else render_text(LOG), "done": True}
        if path.startswith(api + "jobs/"):
            return 200, JOB
        if path.startswith(api + "jobs"):
            return 200, {"jobs": [JOB]}
        if path.startswith(api + "usage"):
            return 200, {"days": 7, "users": {"ann": 1.5}, "groups": {}}
        return 404, {"status": 404, "message": "Not Found"}

    def paths(self):
        return [(m, p) for m, p, _, _ in self.requests]


@pytest.fixture
def fake(monkeypatch):
    for name in ("GPULAB_URL", "GPULAB_TOKEN", "GPULAB_SERVICE_URL", "JUPYTERHUB_API_TOKEN",
                 "JUPYTERHUB_API_URL", "JUPYTERHUB_PUBLIC_HUB_URL"):
        monkeypatch.delenv(name, raising=False)
    hub = FakeHub()
    yield hub
    hub.server.shutdown()


def gl(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# -- --url, --token, --json before or after the command ------------------------------------

COMMANDS = [("quota", "show"), ("usage",), ("jobs", "list"), ("jobs", "show", "digits")]


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
@pytest.mark.parametrize("where", ["before", "after", "between"])
def test_url_token_and_json_go_before_or_after_the_command(fake, capsys, command, where):
    options = ["--url", fake.url, "--token", "tok-1", "--json"]
    if where == "before":
        argv = [*options, *command]
    elif where == "after":
        argv = [*command, *options]
    else:  # after the command group, before its action (gpulab jobs --url X list)
        argv = [command[0], *options, *command[1:]]
    rc, out, err = gl(capsys, *argv)
    assert rc == 0, err
    assert fake.requests and all(token == "tok-1" for _, _, token, _ in fake.requests)
    json.loads(out)  # --json was heard wherever it stood


def test_the_later_option_wins(fake, capsys):
    rc, _, err = gl(capsys, "--url", "http://127.0.0.1:9", "--token", "early",
                    "jobs", "list", "--url", fake.url, "--token", "late")
    assert rc == 0, err
    assert [t for _, _, t, _ in fake.requests] == ["late"]
    rc, _, err = gl(capsys, "--url", fake.url, "jobs", "--url", "http://127.0.0.1:9", "list",
                    "--token", "t")
    assert rc == 1 and "Cannot reach http://127.0.0.1:9" in err and "Traceback" not in err


def test_gpulab_url_is_the_default_address(fake, capsys, monkeypatch):
    monkeypatch.setenv("GPULAB_URL", fake.url)
    monkeypatch.setenv("GPULAB_TOKEN", "from-env")
    rc, out, err = gl(capsys, "usage")
    assert rc == 0, err
    assert "ann" in out and fake.requests[0][2] == "from-env"


@pytest.mark.parametrize("argv", [["--url", "http://x", "up"], ["--json", "config-reference"],
                                  ["--token", "t", "jobs", "export", "--format", "tfjob",
                                   "--name", "a", "--strategy", "multi-worker-mirrored"]],
                         ids=["up", "config-reference", "jobs export"])
def test_hub_options_before_a_command_that_does_not_call_the_hub_are_refused(capsys, argv):
    rc, out, err = gl(capsys, *argv)
    assert rc == 2 and out == ""
    assert "is an option of the commands that call the hub" in err and "-h" in err


def test_up_keeps_its_own_flags():
    args = build_parser().parse_args(["up", "--port", "8100"])
    assert args.port == 8100 and not hasattr(args, "url")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--url", "http://x"])


def test_help_shows_the_hub_options(capsys):
    with pytest.raises(SystemExit):
        main(["-h"])
    out = capsys.readouterr().out
    assert "--url URL" in out and "$GPULAB_URL" in out and "--token" in out and "--json" in out


# -- quota set: the name is checked, every field is said --------------------------------------

def test_quota_set_prints_every_field(fake, capsys):
    rc, out, err = gl(capsys, "--url", fake.url, "--token", "t", "quota", "set", "--user", "ann",
                      "--max-gpus", "2", "--max-per-request", "1", "--gpu-hours", "100",
                      "--window-hours", "168")
    assert rc == 0, err
    assert out.strip() == ("set user quota ann: 2 GPUs at once, at most 1 per request, "
                           "100 GPU-hours per 168-hour window (7 days), no disk limit")
    assert fake.requests[-1][3] == {"max_gpus": 2, "max_per_request": 1, "gpu_hours": 100.0,
                                    "window_hours": 168}
    rc, out, _ = gl(capsys, "--url", fake.url, "--token", "t", "quota", "set", "--group",
                    "staff", "--max-gpus", "1", "--gpu-hours", "7.5", "--window-hours", "36",
                    "--disk", "1.5T")
    assert rc == 0 and out.strip() == ("set group quota staff: 1 GPU at once, no per-request "
                                       "limit, 7.5 GPU-hours per 36-hour window, 1.5 TiB disk")
    assert fake.requests[-1][3]["disk"] == "1.5T"  # the service reads the units
    rc, out, _ = gl(capsys, "--url", fake.url, "--token", "t", "quota", "set", "--default",
                    "--max-gpus", "4")
    assert rc == 0 and out.strip() == ("set default quota: 4 GPUs at once, no per-request "
                                       "limit, no GPU-hour budget, no disk limit")
    # the user and the group were looked up on the hub; the default quota has no name
    assert [p for _, p in fake.paths() if p.startswith("/hub/api/")] == [
        "/hub/api/user", "/hub/api/users/ann", "/hub/api/user", "/hub/api/groups/staff"]


@pytest.mark.parametrize("kind, name", [("user", "anne"), ("group", "stafff")])
def test_quota_set_refuses_a_name_the_hub_does_not_know(fake, capsys, kind, name):
    argv = ["--url", fake.url, "--token", "t", "quota", "set", f"--{kind}", name, "--max-gpus", "2"]
    rc, out, err = gl(capsys, *argv)
    assert rc == 2 and out == "" and "Traceback" not in err
    assert f"the hub has no {kind} '{name}'" in err and "--force" in err
    page = "/services/gpulab/admin" if kind == "user" else "/hub/admin"
    assert f"{fake.url}{page}" in err
    assert not [m for m, _ in fake.paths() if m == "PUT"]  # nothing was set

    rc, out, err = gl(capsys, *argv, "--force")
    assert rc == 0 and f"quota {name}: 2 GPUs at once" in out, err
    assert fake.paths()[-1] == ("PUT", f"/services/gpulab/api/v1/quotas/{kind}s/{name}")


def test_quota_set_checks_through_the_hubs_api_with_the_same_token(fake, capsys):
    rc, _, err = gl(capsys, "--url", fake.url, "--token", "tok-9", "quota", "set", "--user",
                    "ann", "--max-gpus", "1")
    assert rc == 0, err
    assert fake.paths()[:2] == [("GET", "/hub/api/user"), ("GET", "/hub/api/users/ann")]
    assert {t for _, _, t, _ in fake.requests} == {"tok-9"}


def test_a_gpulab_admin_whose_token_cannot_read_users_is_told_to_check_and_force(fake, capsys):
    # a member of gpulab-admins who is no hub admin: the hub answers 404 for everyone else
    fake.whoami = {"name": "carl", "scopes": ["read:users!user=carl", "custom:gpulab:admin"]}
    argv = ["--url", fake.url, "--token", "t", "quota", "set", "--user", "ann", "--max-gpus", "1"]
    rc, out, err = gl(capsys, *argv)
    assert rc == 2 and out == ""
    assert "cannot check that the user 'ann' exists" in err and "--force" in err
    assert "may not read the hub's users" in err
    rc, out, err = gl(capsys, *argv, "--force")
    assert rc == 0 and "set user quota ann" in out, err


def test_someone_not_a_gpulab_admin_hears_the_services_refusal(fake, capsys):
    fake.whoami = {"name": "bob", "scopes": ["read:users!user=bob"]}
    fake.gpulab_admin = False
    rc, _, err = gl(capsys, "--url", fake.url, "--token", "t", "quota", "set", "--user", "ann",
                    "--max-gpus", "8")
    assert rc == 1 and "custom:gpulab:admin" in err and "HTTP 403" in err


def test_quota_set_with_an_empty_name_is_refused(fake, capsys):
    rc, _, err = gl(capsys, "--url", fake.url, "--token", "t", "quota", "set", "--user", " ",
                    "--max-gpus", "1")
    assert rc == 2 and "--user needs a name" in err and not fake.requests


# -- jobs show: local times and durations; --json raw -----------------------------------------

@pytest.fixture
def utc(monkeypatch):
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def test_job_times_are_local_date_times_with_durations(utc):
    assert job_times(JOB) == ["created  2026-12-04 14:05:31",
                              "started  2026-12-04 14:05:33",
                              "finished 2026-12-04 14:10:45, ran 0:05:12"]
    running = {**JOB, "finished_at": None}
    assert job_times(running, now=CREATED + 2 + 3725)[1] == \
        "started  2026-12-04 14:05:33, running for 1:02:05"
    waiting = {**JOB, "started_at": None, "finished_at": None}
    assert job_times(waiting, now=CREATED + 12)[1:] == ["started  not yet, waiting for 0:00:12"]
    stopped_early = {**JOB, "started_at": None}
    assert job_times(stopped_early)[1:] == ["finished 2026-12-04 14:10:45, never started"]


def test_jobs_show_prints_no_unix_times_and_json_stays_raw(fake, capsys, utc):
    rc, out, err = gl(capsys, "--url", fake.url, "--token", "t", "jobs", "show", "digits")
    assert rc == 0, err
    assert "created  2026-12-04 14:05:31" in out and "ran 0:05:12" in out
    assert not re.search(r"\b1\d{9}\b", out), out
    rc, out, _ = gl(capsys, "--url", fake.url, "--token", "t", "--json", "jobs", "show", "digits")
    assert rc == 0 and json.loads(out)["created_at"] == CREATED


def test_jobs_submit_sends_the_queue_fields_and_says_where_the_job_stands(fake, capsys):
    rc, out, err = gl(capsys, "--url", fake.url, "--token", "t", "jobs", "submit", "--name",
                      "big", "--strategy", "multi-worker-mirrored", "--workers", "2", "--gpus",
                      "2", "--script", "train.py", "--no-wait", "--priority", "5",
                      "--preemptible")
    assert rc == 0, err
    sent = [b for m, p, _, b in fake.requests if m == "POST"][-1]
    assert (sent["wait"], sent["priority"], sent["preemptible"]) == (False, 5, True)
    assert out.strip() == ("submitted big: Queued (2nd in line · start unknown): "
                           "Waits for free GPUs.")
    # without the flags, the spec leaves them to the service's defaults
    gl(capsys, "--url", fake.url, "--token", "t", "jobs", "submit", "--name", "small",
       "--strategy", "multi-worker-mirrored", "--script", "train.py")
    sent = [b for m, p, _, b in fake.requests if m == "POST"][-1]
    assert not {"wait", "priority", "preemptible"} & set(sent), sent


def test_print_job_in_another_time_zone(monkeypatch, capsys):
    monkeypatch.setenv("TZ", "Asia/Kolkata")  # UTC+5:30
    time.tzset()
    try:
        print_job(JOB)
    finally:
        monkeypatch.undo()
        time.tzset()
    assert "created  2026-12-04 19:35:31" in capsys.readouterr().out


LOG = "Epoch 1/1\n\r1/2 [==>...] - loss: 0.9" + "\b" * 24 + "\r2/2 [======] - loss: 0.5\n"


def test_jobs_logs_prints_what_a_terminal_shows_and_raw_on_request(fake, capsys):
    rc, out, err = gl(capsys, "--url", fake.url, "--token", "t", "jobs", "logs", "digits")
    assert rc == 0, err
    assert out == "Epoch 1/1\n2/2 [======] - loss: 0.5\n"
    rc, out, err = gl(capsys, "--url", fake.url, "--token", "t", "jobs", "logs", "digits",
                      "--raw")
    assert rc == 0 and out == LOG, err
    assert any("raw=1" in p for _, p in fake.paths())


def test_jobs_show_prints_a_line_per_restart(capsys, utc):
    job = {**JOB, "replicas": [
        {**JOB["replicas"][0], "restarts": 1, "restart_history": [restart_record(
            restart=1, at=CREATED + 60, exit_code=-9, reason="killed by SIGKILL")]},
        {"name": "ps-0", "state": "Succeeded", "restarts": 1, "exit_code": 0, "devices": [],
         "reason": "", "restart_history": [restart_record(
             restart=1, at=CREATED + 30, exit_code=-9, oom_killed=True,
             reason="killed: out of memory (the default memory limit of replicas is 2Gi)")]}]}
    print_job(job)
    out = capsys.readouterr().out
    assert out.splitlines()[-3:] == [
        "restarts:",
        "  ps-0: restart 1 at 14:06:01 (attempt 2): killed: out of memory (the default memory "
        "limit of replicas is 2Gi) (exit -9)",
        "  chief-0: restart 1 at 14:06:31 (attempt 2): killed by SIGKILL (exit -9)"]
    print_job(JOB)  # none: no such lines
    assert "restart" not in capsys.readouterr().out.split("REASON")[1]


# -- the notebook client: a parameter-server job's chief ---------------------------------------

class Recorder(Client):
    def request(self, method, path, body=None, params=None, timeout=None):
        self.sent = body
        return {"name": body["name"], "state": "Admitted"}


@pytest.mark.parametrize("replicas, sent", [
    ({"ps": 1, "worker": 2}, {"chief": 1, "ps": 1, "worker": 2}),
    (None, {"chief": 1}),
    ({"chief": 1, "ps": 2, "worker": 1}, {"chief": 1, "ps": 2, "worker": 1}),
    ({"chief": 0, "ps": 1, "worker": 1}, {"chief": 0, "ps": 1, "worker": 1}),  # the service says no
], ids=["no chief", "no replicas", "chief named", "chief 0 kept"])
def test_submit_gives_a_parameter_server_job_its_chief(replicas, sent):
    spec = {"name": "ps", "strategy": "parameter-server", "source": "x = 1"}
    if replicas is not None:
        spec["replicas"] = replicas
    before = json.loads(json.dumps(spec))
    gl = Recorder(url="http://hub/services/gpulab/", token="t")
    assert gl.submit(spec).name == "ps"
    assert gl.sent["replicas"] == sent
    assert spec == before  # the caller's spec is not changed


def test_submit_leaves_other_specs_alone():
    spec = {"name": "mw", "strategy": "multi-worker-mirrored", "replicas": {"worker": 2},
            "source": "x"}
    assert with_chief(spec) == spec
    bad = {"name": "ps", "strategy": "parameter-server", "replicas": "three", "source": "x"}
    assert with_chief(bad) == bad  # not a mapping: the service names the field
    gl = Recorder(url="http://hub/services/gpulab/", token="t")
    gl.submit(name="kw", strategy="parameter-server", ps=1, workers=1)
    assert gl.sent["replicas"] == {"chief": 1, "ps": 1, "worker": 1}


# -- gpulab --version; a closed pipe; the progress line's time; --user for admins; -f ---------

GPULAB = str(Path(sys.executable).with_name("gpulab"))  # the console script, as people run it


def test_version_is_the_installed_distributions(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out == f"gpulab {version('gpulab')}\n"
    out = subprocess.run([GPULAB, "--version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout == f"gpulab {version('gpulab')}\n", out.stderr


def closed_pipe_run(argv, env=None) -> subprocess.CompletedProcess:
    """Run the console script with a standard output nobody reads any more (``| head`` that
    has exited): the read end is closed before the command writes a byte."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([GPULAB, *argv], stdout=write, stderr=subprocess.PIPE, text=True,
                              timeout=60, env=env)
    finally:
        os.close(write)
    return proc


def test_a_closed_pipe_ends_quietly():
    proc = closed_pipe_run(["config-reference"])  # the longest output: gpulab … | head
    assert proc.stderr == "" and proc.returncode == 141, proc.stderr


def test_jobs_show_into_a_closed_pipe_ends_quietly(fake):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULAB", "JUPYTERHUB"))}
    proc = closed_pipe_run(["jobs", "show", "digits", "--url", fake.url, "--token", "t"], env)
    assert proc.stderr == "" and proc.returncode == 141, proc.stderr
    assert fake.paths()  # it did ask the hub, and then met the closed pipe
    # the same command into a pipe that is read: the job, whole
    out = subprocess.run(f"'{GPULAB}' jobs show digits --url {fake.url} --token t | head -n 1",
                         shell=True, capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.startswith("digits (ann): Succeeded") and out.stderr == ""


def test_the_progress_line_gives_local_time_not_a_unix_time(fake, capsys, utc):
    fake_job = {**JOB, "progress": {"step": 40, "total": 100, "loss": 0.31,
                                    "time": CREATED + 72}}
    print_job(fake_job, now=CREATED + 84)
    out = capsys.readouterr().out
    assert ("progress: step 40/100 (loss 0.31), reported 2026-12-04 14:06:43 (0:00:12 ago)"
            in out.splitlines())
    assert not re.search(r"\b1\d{9}\b", out), out
    assert progress_words({"step": 3}) == "progress: step 3"  # no time: nothing made up
    assert progress_words(None) == ""


def test_jobs_show_through_the_command_prints_the_progress_time_as_local_time(fake, capsys,
                                                                               utc):
    JOB["progress"] = {"step": 7, "time": CREATED + 60}
    try:
        rc, out, err = gl(capsys, "--url", fake.url, "--token", "t", "jobs", "show", "digits")
    finally:
        del JOB["progress"]
    assert rc == 0, err
    assert "progress: step 7, reported 2026-12-04 14:06:31" in out
    assert not re.search(r"\b1\d{9}\b", out), out


@pytest.mark.parametrize("action", ["show", "stop", "logs"])
def test_an_admin_missing_a_job_hears_whose_it_is(fake, capsys, action):
    fake.others = {"ann-long": "ann"}
    rc, out, err = gl(capsys, "--url", fake.url, "--token", "t", "jobs", action, "ann-long")
    assert rc == 1 and out == "" and "Traceback" not in err
    assert err.strip() == ("gpulab: error: You have no job named 'ann-long'. ann has one: add "
                           "--user ann (an admin may name whose job). (HTTP 404)")
    rc, out, err = gl(capsys, "--url", fake.url, "--token", "t", "jobs", action, "ann-long",
                      "--user", "ann")
    assert rc == 0, err  # the hint works


def test_an_admin_missing_a_job_nobody_has_hears_of_user_and_list_all(fake, capsys):
    fake.others = {"ann-long": "ann"}
    fake.unknown = {"gone"}
    rc, out, err = gl(capsys, "--url", fake.url, "--token", "t", "jobs", "show", "gone")
    assert rc == 1 and out == "" and err.strip() == (
        "gpulab: error: You have no job named 'gone'. To act on another person's job, add "
        "--user NAME (`gpulab jobs list --all` lists everyone's). (HTTP 404)")


def test_someone_not_an_admin_gets_no_admin_hint(fake, capsys):
    fake.others = {"ann-long": "ann"}
    fake.gpulab_admin = False
    rc, _, err = gl(capsys, "--url", fake.url, "--token", "t", "jobs", "show", "ann-long")
    assert rc == 1 and err.strip() == ("gpulab: error: You have no job named 'ann-long'. "
                                       "(HTTP 404)")
    assert not any("all=1" in p for _, p in fake.paths())  # nobody's jobs were asked for


@pytest.mark.parametrize("argv", [
    ["jobs", "submit", "--name", "big", "--strategy", "multi-worker-mirrored", "--script",
     "t.py", "-f"],
    ["jobs", "logs", "big", "-f"]], ids=["submit -f", "logs -f"])
def test_following_when_the_hub_stops_says_the_job_goes_on(fake, capsys, argv):
    fake.logs_status = 503  # what the proxy answers once the hub behind it has stopped
    rc, out, err = gl(capsys, "--url", fake.url, "--token", "t", *argv)
    assert rc == 1 and "Traceback" not in err
    assert err.strip().splitlines() == [
        "gpulab: the hub stopped answering while following job 'big': Service Unavailable "
        "(HTTP 503)",
        "The job goes on without the hub. Follow it again once the hub is back: "
        "gpulab jobs logs big -f  (its state: gpulab jobs show big)"]
    fake.server.shutdown()  # and when nothing answers at all
    fake.server.server_close()
    rc, _, err = gl(capsys, "--url", fake.url, "--token", "t", "jobs", "logs", "big", "worker-1",
                    "-f", "--user", "ann")
    assert rc == 1 and "Traceback" not in err
    lines = err.strip().splitlines()
    assert lines[0].startswith("gpulab: the hub stopped answering while following job 'big': "
                               f"Cannot reach {fake.url}/services/gpulab")
    assert lines[1] == ("The job goes on without the hub. Follow it again once the hub is "
                        "back: gpulab jobs logs big worker-1 --user ann -f  (its state: gpulab "
                        "jobs show big --user ann)")
