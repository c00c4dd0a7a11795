"""The notebook's Python client (gpulab.extensions.client) against a real gpulab service on a
real `gpulab up`: submit, status, logs (whole and followed), wait, stop, quota and holdings,
the service's errors as `GpulabError` (message and field), isolation between people, and the
client and the ``%%gpulab_train`` magic inside a real notebook server with its own token.

The programs are tiny (see test_jobs_api.py), but every replica still starts TensorFlow.
"""

import json
import os
import re
import subprocess
import time

import pytest

from gpulab.extensions.client import Client, GpulabError

from .hubctl import GPULAB

pytestmark = pytest.mark.app

COUNT = """
import json, os, sys, time
task = json.loads(os.environ["TF_CONFIG"])["task"]
for i in range(3):
    print(f"{task['type']}-{task['index']} line {i}", flush=True)
    time.sleep(0.5)
"""

SLEEPER = """
import time
print("sleeping", flush=True)
time.sleep(600)
"""


def client_of(hub, person) -> Client:
    return Client(hub_url=hub.url, token=person.token())


def wait_for(job, states, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        view = job.status()
        if view["state"] in states:
            return view
        time.sleep(0.5)
    raise TimeoutError(f"{job.name} is {view['state']}, not {states}")


def test_submit_follow_logs_wait_and_holdings(hub, users):
    gl = client_of(hub, users["ann"])
    me = gl.me()
    assert me["user"] == "ann" and me["inventory"]["total"] == 4
    assert set(gl.quota()) == {"quota", "quota_text", "gpus_held", "holdings", "inventory"}

    job = gl.submit(name="cl-count", strategy="multi-worker-mirrored", workers=2, gpus=1,
                    source=COUNT, args=["--epochs", "1"])
    assert job.name == "cl-count" and job.view["gpus"] == 2
    assert job.view["state"] in ("Admitted", "Starting", "Running")
    held = [h for h in gl.holdings() if h["kind"] == "job" and h["name"] == "cl-count"]
    assert held and held[0]["gpus"] == 2

    followed = "".join(job.logs("worker-1", follow=True))  # ends when the job has ended
    assert [ln for ln in followed.splitlines() if "line" in ln] == \
        ["worker-1 line 0", "worker-1 line 1", "worker-1 line 2"]
    final = job.wait(timeout=120)
    assert final["state"] == "Succeeded", final
    assert job.logs("worker-1") == followed
    assert "worker-0 line 2" in job.logs()  # the lead replica by default
    assert "cl-count" in [j["name"] for j in gl.jobs()]
    assert not [h for h in gl.holdings() if h["name"] == "cl-count"]


def test_service_errors_carry_its_message_and_field(hub, users):
    gl = client_of(hub, users["ann"])
    with pytest.raises(GpulabError) as e:
        gl.submit(name="cl-bad", strategy="multi-worker-mirrored", workers=0, source="x=1")
    assert (e.value.status, e.value.field) == (400, "replicas.worker")
    assert "replicas.worker" in e.value.message and "at least 1 worker" in str(e.value)

    with pytest.raises(GpulabError) as e:
        gl.submit(name="cl-big", strategy="multi-worker-mirrored", workers=2, gpus=3,
                  source="x=1")
    assert e.value.field == "resources" and "Job 'cl-big' was not started" in e.value.message

    with pytest.raises(GpulabError) as e:
        gl.submit({"name": "cl-x", "strategy": "multi-worker-mirrored", "source": "x",
                   "colour": "red"})
    assert e.value.status == 400 and "unknown field 'colour'" in e.value.message

    with pytest.raises(GpulabError) as e:
        gl.job("nope").status()
    assert e.value.status == 404 and e.value.message == "You have no job named 'nope'."

    with pytest.raises(GpulabError) as e:
        Client(hub_url=hub.url, token="not-a-token").me()
    assert e.value.status in (401, 403) and e.value.message

    # the service's own address (GPULAB_SERVICE_URL), bypassing the proxy, answers the same
    # over the hub's internal TLS: the service's certificate is verified against the hub's CA
    # and a client certificate of one of the hub's CAs is required (here the hub's own)
    certs = hub.data_dir / "tls" / "internal-ssl"
    direct_url = f"https://127.0.0.1:{hub.service_port}/services/gpulab/"
    direct = Client(url=direct_url, token=users["ann"].token(),
                    ca_file=str(certs / "hub-ca" / "hub-ca.crt"),
                    client_cert=str(certs / "hub-internal" / "hub-internal.crt"),
                    client_key=str(certs / "hub-internal" / "hub-internal.key"))
    assert direct.me()["user"] == "ann"
    # ...not in plain HTTP, nor without a client certificate, nor trusting the system's CAs
    for bad in (Client(url=direct_url.replace("https:", "http:"), token="t"),
                Client(url=direct_url, token="t", ca_file=direct.ca_file, client_cert=""),
                Client(url=direct_url, token="t", ca_file="", client_cert=direct.client_cert,
                       client_key=direct.client_key)):
        with pytest.raises(GpulabError) as e:
            bad.me()
        assert e.value.status is None and "cannot be reached" in e.value.message, e.value

    with pytest.raises(GpulabError) as e:
        Client(hub_url="http://127.0.0.1:9", token="t").me()
    assert e.value.status is None and "cannot be reached" in e.value.message


def test_stop_releases_gpus_and_others_cannot_see_or_stop(hub, users):
    ann, bob = client_of(hub, users["ann"]), client_of(hub, users["bob"])
    job = ann.submit(name="cl-sleepy", strategy="parameter-server", ps=1, workers=1, gpus=1,
                     source=SLEEPER)
    wait_for(job, {"Running"})
    # a replica name that does not exist is named in the error
    with pytest.raises(GpulabError) as e:
        job.logs("worker-7")
    assert e.value.status == 404 and e.value.field == "replica" and "chief-0" in e.value.message

    # bob: no such job of his, and ann's is forbidden, also to stop
    with pytest.raises(GpulabError) as e:
        bob.job("cl-sleepy").status()
    assert e.value.status == 404
    for call in (lambda: bob.job("cl-sleepy", user="ann").status(),
                 lambda: bob.job("cl-sleepy", user="ann").stop(),
                 lambda: bob.job("cl-sleepy", user="ann").logs("chief-0"),
                 lambda: bob.jobs(user="ann")):
        with pytest.raises(GpulabError) as e:
            call()
        assert e.value.status == 403 and e.value.message == \
            "You may only see and act on your own jobs."
    assert "cl-sleepy" not in [j["name"] for j in bob.jobs()]
    assert job.status()["state"] == "Running"

    t0 = time.time()
    view = job.stop()
    assert view["state"] == "Stopped" and "ann" in view["reason"]
    assert time.time() - t0 < 30
    assert job.wait(timeout=5)["state"] == "Stopped"
    assert not [h for h in ann.holdings() if h["name"] == "cl-sleepy"]

    # wait() gives up after its timeout on a job that goes on
    other = ann.submit(name="cl-wait", strategy="multi-worker-mirrored", workers=1,
                       source=SLEEPER)
    try:
        with pytest.raises(TimeoutError, match="cl-wait is still"):
            other.wait(timeout=1, interval=0.3)
    finally:
        assert other.stop()["state"] == "Stopped"


def test_client_and_magic_inside_a_notebook_server(hub, users):
    """The server's own token (JUPYTERHUB_API_TOKEN) may call the service: the client
    configures itself from the server's environment, and the magic submits the cell."""
    ann = users["ann"]
    ann.start_server("", {"profile": "cpu"})
    try:
        out = ann.run_in_kernel(
            "import os, json\n"
            f"os.environ.setdefault('GPULAB_URL', {hub.url!r})\n"
            "from gpulab.extensions import Client\n"
            "gl = Client()\n"
            "print(json.dumps({'user': gl.me()['user'], 'token': os.environ['JUPYTERHUB_API_TOKEN'] "
            "== gl.token, 'url': gl.url, 'ca': gl.ca_file == os.environ['JUPYTERHUB_SSL_CLIENT_CA']}))\n",
            timeout=60)
        # straight to the service over TLS, verified with the CA bundle the hub gave the server
        assert json.loads(out.strip().splitlines()[-1]) == {
            "user": "ann", "token": True, "ca": True,
            "url": f"https://127.0.0.1:{hub.service_port}/services/gpulab/"}

        out = ann.run_in_kernel(
            "import os\n"
            f"os.environ.setdefault('GPULAB_URL', {hub.url!r})\n"
            "get_ipython().run_line_magic('load_ext', 'gpulab.extensions')\n"
            "get_ipython().run_cell_magic('gpulab_train', '--workers 0', 'print(1)')\n"
            "get_ipython().run_cell_magic('gpulab_train', '--name cl-magic --strategy "
            "multi-worker-mirrored --workers 1 --no-view', 'print(\"from the magic\")')\n"
            "print(_gpulab_job.wait(timeout=120)['state'])\n"
            "print(_gpulab_job.logs())\n", timeout=180)
        assert "%%gpulab_train: A job needs at least 1 worker." in out
        assert "gpulab: job cl-magic submitted" in out
        assert "Succeeded" in out and "from the magic" in out
        assert "Traceback" not in out

        # the launcher submits with the server's token; its JobView follows the job to the end
        out = ann.run_in_kernel(
            "import os, json\n"
            f"os.environ.setdefault('GPULAB_URL', {hub.url!r})\n"
            "from gpulab.extensions import TrainingLauncher\n"
            "w = TrainingLauncher(name='cl-widget', strategy='multi-worker-mirrored', "
            "workers=2, gpus=1, code='print(\"from the launcher\")')\n"
            "assert w.loaded.wait(60)\n"  # the quota is read behind the form
            "assert not w.launch_button.disabled, w.reason.value\n"
            "w.launch_button.click()\n"
            "v = w.job_view\n"
            "v._thread.join(150)\n"
            "print(json.dumps({'state': v.view['state'], 'log': v.log_plain, 'message': "
            "w.message.value, 'replicas': v.replicas.value.count('data-state=\\'Succeeded')}))\n",
            timeout=180)
        result = json.loads(out.strip().splitlines()[-1])
        assert result["state"] == "Succeeded" and "from the launcher" in result["log"], result
        assert result["replicas"] == 2 and "submitted" in result["message"]
    finally:
        ann.stop_server("")


def cli(*argv, env=None):
    """The ``gpulab`` command as a person runs it, without GPULAB_* from this environment."""
    base = {k: v for k, v in os.environ.items()
            if not k.startswith(("GPULAB_", "JUPYTERHUB_"))}
    return subprocess.run([GPULAB, *argv], env={**base, **(env or {})}, capture_output=True,
                          text=True, timeout=120)


def test_cli_options_before_the_command_and_gpulab_url(hub, users):
    token = users["ann"].token()
    for argv in (["--url", hub.url, "--token", token, "--json", "jobs", "list"],
                 ["jobs", "list", "--url", hub.url, "--token", token, "--json"],
                 ["--url", hub.url, "--json", "quota", "show", "--token", token],
                 ["--token", token, "--json", "usage", "--url", hub.url]):
        r = cli(*argv)
        assert r.returncode == 0, (argv, r.stderr)
        json.loads(r.stdout)
    # given before and after the command, the later wins
    r = cli("--url", "http://127.0.0.1:9", "--token", "nope", "jobs", "list", "--url", hub.url,
            "--token", token)
    assert r.returncode == 0 and r.stdout.startswith("NAME"), r.stderr
    r = cli("--url", hub.url, "--token", token, "jobs", "list", "--url", "http://127.0.0.1:9")
    assert r.returncode == 1 and "Cannot reach http://127.0.0.1:9" in r.stderr
    assert "Traceback" not in r.stderr
    # $GPULAB_URL is the hub's address when --url is not given
    r = cli("quota", "show", env={"GPULAB_URL": hub.url, "GPULAB_TOKEN": token})
    assert r.returncode == 0 and r.stdout.startswith("ann: "), r.stderr
    # gpulab up keeps its own flags
    r = cli("--url", hub.url, "up")
    assert r.returncode == 2 and "not of `gpulab up`" in r.stderr


def test_submit_a_parameter_server_spec_without_a_chief_and_show_its_times(hub, users):
    """Client().submit(spec): a parameter-server spec that names no chief gets one; one that
    names a chief is sent as it is. `gpulab jobs show` then gives local times, --json the
    API's Unix times."""
    ann = users["ann"]
    gl = client_of(hub, ann)
    spec = {"name": "cl-nochief", "strategy": "parameter-server",
            "replicas": {"ps": 1, "worker": 1}, "source": "print('the chief ran', flush=True)"}
    job = gl.submit(spec)
    assert spec["replicas"] == {"ps": 1, "worker": 1}  # the caller's spec is left alone
    assert [r["name"] for r in job.view["replicas"]] == ["chief-0", "ps-0", "worker-0"]
    assert job.view["spec"]["replicas"]["chief"] == 1
    final = job.wait(timeout=150)
    assert final["state"] == "Succeeded", final
    assert "the chief ran" in job.logs()

    with pytest.raises(GpulabError) as e:  # a chief the spec names is the spec's
        gl.submit({**spec, "name": "cl-nochief-0", "replicas": {"chief": 0, "ps": 1, "worker": 1}})
    assert e.value.status == 400 and e.value.field == "replicas.chief"

    token = ann.token()
    r = cli("--url", hub.url, "--token", token, "jobs", "show", "cl-nochief")
    assert r.returncode == 0, r.stderr
    when = lambda ts: time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))  # noqa: E731
    ran = int(final["finished_at"] - final["started_at"])
    assert f"created  {when(final['created_at'])}" in r.stdout, r.stdout
    assert f"started  {when(final['started_at'])}" in r.stdout
    assert f"finished {when(final['finished_at'])}, ran {ran // 3600}:{ran // 60 % 60:02d}:" \
        f"{ran % 60:02d}" in r.stdout
    assert not re.search(r"\b1\d{9}(\.\d+)?\b", r.stdout), r.stdout  # no Unix times
    r = cli("--json", "--url", hub.url, "--token", token, "jobs", "show", "cl-nochief")
    assert r.returncode == 0 and json.loads(r.stdout)["created_at"] == final["created_at"]


def test_cli_quota_set_checks_the_name_and_says_every_field(hub, admin, users):
    token = admin.token()

    def quota(*argv, who=token):
        return cli("--url", hub.url, "--token", who, "quota", *argv)

    # a user the hub does not know: refused, nothing stored; --force sets it anyway
    r = quota("set", "--user", "anne", "--max-gpus", "2")
    assert r.returncode == 2 and "Traceback" not in r.stderr and r.stdout == ""
    assert "the hub has no user 'anne'" in r.stderr
    assert f"{hub.service_url}admin" in r.stderr and "--force" in r.stderr
    assert admin.service("GET", "quotas/users/anne").status_code == 404
    r = quota("set", "--user", "anne", "--max-gpus", "2", "--force")
    assert r.returncode == 0 and "set user quota anne: 2 GPUs at once" in r.stdout, r.stderr
    assert quota("unset", "--user", "anne").returncode == 0

    # a user the hub knows: every field set is said
    r = quota("set", "--user", "carl", "--max-gpus", "2", "--max-per-request", "1",
              "--gpu-hours", "50", "--window-hours", "48")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == ("set user quota carl: 2 GPUs at once, at most 1 per request, "
                                "50 GPU-hours per 48-hour window (2 days), no disk limit")
    assert admin.service("GET", "quotas/users/carl").json()["window_hours"] == 48
    assert quota("unset", "--user", "carl").returncode == 0

    # groups likewise
    r = quota("set", "--group", "cl-team", "--max-gpus", "1")
    assert r.returncode == 2 and "the hub has no group 'cl-team'" in r.stderr
    assert f"{hub.url}/hub/admin" in r.stderr
    assert admin.api("POST", "/groups/cl-team", json={"users": ["bob"]}).status_code == 201
    try:
        r = quota("set", "--group", "cl-team", "--max-gpus", "1", "--gpu-hours", "10",
                  "--window-hours", "24")
        assert r.returncode == 0 and r.stdout.strip() == (
            "set group quota cl-team: 1 GPU at once, no per-request limit, "
            "10 GPU-hours per 24-hour window (1 day), no disk limit"), r.stderr
        assert quota("unset", "--group", "cl-team").returncode == 0
    finally:
        admin.api("DELETE", "/groups/cl-team")

    # someone who is not a gpulab admin hears the service's refusal, not a name check
    r = quota("set", "--user", "ann", "--max-gpus", "8", who=users["bob"].token())
    assert r.returncode == 1 and "custom:gpulab:admin" in r.stderr, r.stderr
