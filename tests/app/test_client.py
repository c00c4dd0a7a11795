"""The notebook's Python client (gpulab.extensions.client) against a real gpulab service on a
real `gpulab up`: submit, status, logs (whole and followed), wait, stop, quota and holdings,
the service's errors as `GpulabError` (message and field), isolation between people, and the
client and the ``%%gpulab_train`` magic inside a real notebook server with its own token.

The programs are tiny (see test_jobs_api.py), but every replica still starts TensorFlow.
"""

import json
import time

import pytest

from gpulab.extensions.client import Client, GpulabError

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
