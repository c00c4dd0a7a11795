"""Issue 38: a notebook kernel coordinates its person's own cluster, held by gpulab.

A real `gpulab up` (4 simulated GPUs, a 10 s cluster lease); ann's server; one cluster (1 ps,
2 workers of 1 GPU) held for the module by one kernel of hers (``gpulab.cluster``: it waits
until the servers serve, then renews the lease from a thread). TensorFlow's parameter-server
tutorial then runs from other kernels of her server, through the kernel websocket as a
notebook runs it, with only the cluster-creation line changed
(``examples/notebook_coordinator/``: they re-attach to the held cluster by name):

- the custom training loop (``ClusterCoordinator.schedule`` / ``join``, per-worker datasets),
  while a worker is killed: gpulab restarts it and the loop finishes;
- the ``Model.fit`` variant (tf-keras), its checkpoints in ann's folder;
- the holding kernel shuts down: the lease lapses, the cluster stops and its GPUs come back.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import psutil
import pytest

from tests.app.hubctl import GPULAB
from tests.conftest import hub_with_config
from tests.security.test_tensorboard_isolation import kernel_of

pytestmark = pytest.mark.tf

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "notebook_coordinator"
LEASE = 10


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    yield from hub_with_config(workdir, prefix, f"c.GPUJobs.cluster_lease_timeout = {LEASE}\n")


@pytest.fixture(scope="module")
def ann(users):
    person = users["ann"]
    r = person.start_server()
    assert r.status_code in (201, 202), r.text
    return person


@pytest.fixture(scope="module")
def held(ann):
    """The module's cluster, held by a kernel of ann's: (its name, that kernel's ExitStack:
    closing it shuts the kernel down)."""
    name = f"tut-{uuid.uuid4().hex[:6]}"
    with contextlib.ExitStack() as holder:
        run = holder.enter_context(kernel_of(ann))
        out = run("import gpulab, json, sys\n"
                  f"c = gpulab.cluster(ps=1, workers=2, gpus_per_worker=1, name={name!r})\n"
                  "print('HELD', json.dumps(c.addresses))\n", timeout=240)
        assert "HELD" in out, out
        view = ann.service("GET", f"jobs/{name}").json()
        assert view["kind"] == "cluster" and view["state"] == "Running", view
        assert view["gpus"] == 2 and len(view["cluster"]["worker"]) == 2, view
        # holding a cluster imports no TensorFlow in the kernel
        assert run("print('tensorflow' in sys.modules)").strip() == "False"
        try:
            yield name, holder
        finally:
            holder.close()
            ann.service("POST", f"jobs/{name}/stop")


def tutorial(file: str, **values) -> str:
    code = (EXAMPLES / file).read_text()
    for key, value in values.items():
        code = code.replace(key, repr(value))
    return code


def replica_process(name: str, role: str, index: int) -> psutil.Process:
    for p in psutil.process_iter(["environ"]):
        env = p.info["environ"] or {}
        if env.get("GPULAB_JOB_NAME") == name and env.get("GPULAB_KIND") == "cluster":
            task = json.loads(env.get("TF_CONFIG", "{}")).get("task", {})
            if (task.get("type"), task.get("index")) == (role, index):
                return p
    raise LookupError(f"no process of {name} {role}-{index}")


def test_the_tutorials_custom_loop_survives_a_lost_worker(ann, held):
    name, _ = held
    victim = replica_process(name, "worker", 1)
    idle = sum(victim.cpu_times()[:2])
    code = tutorial("custom_loop.py", CLUSTER_NAME=name, NUM_EPOCHS=40)
    with kernel_of(ann) as run, concurrent.futures.ThreadPoolExecutor(1) as pool:
        training = pool.submit(run, code, 240)
        # worker-1 is killed once it works for the coordinator (its CPU time grows)
        deadline = time.time() + 150
        while time.time() < deadline and not training.done():
            if sum(victim.cpu_times()[:2]) > idle + 0.3:
                break
            time.sleep(0.1)
        assert not training.done(), training.result()  # killed while the loop runs
        victim.send_signal(signal.SIGKILL)
        out = training.result(timeout=300)
    assert "Finished epoch 39" in out and "Final loss is" in out, out
    view = ann.service("GET", f"jobs/{name}").json()
    assert view["state"] == "Running", view
    worker = next(r for r in view["replicas"] if r["name"] == "worker-1")
    assert worker["restarts"] >= 1 and worker["state"] == "Running", worker
    assert worker["restart_history"][0]["exit_code"] == -signal.SIGKILL, worker


def test_the_tutorials_model_fit(ann, held):
    name, _ = held
    folder = f"fit-{uuid.uuid4().hex[:4]}"
    with kernel_of(ann) as run:
        home = run("import os\nprint(os.environ['GPULAB_USER_DIR'])").strip()
        out = run(tutorial("model_fit.py", CLUSTER_NAME=name,
                           WORKING_DIR=f"{home}/{folder}"), 240)
    assert "FIT 2" in out, out
    ckpt = Path(home) / folder / "ckpt"
    assert ckpt.is_dir() and any(ckpt.iterdir()), ckpt  # the checkpoint is in her folder


def test_the_holding_kernels_shutdown_gives_the_gpus_back(ann, held, admin):
    name, holder = held
    # (the tutorials' kernels re-attached and went away; the holder still renews)
    assert ann.service("GET", f"jobs/{name}").json()["state"] == "Running"
    # it shows as a cluster: the API's holdings, My GPUs, the admin page, `gpulab jobs list`
    assert any(h["kind"] == "cluster" and h["name"] == name for h in
               ann.service("GET", "me").json()["holdings"])
    mine = ann.s.get(ann.hub.service_url, timeout=60).text
    assert f"<td>cluster</td><td>{name}</td>" in mine
    assert re.search(r'<td class="held-for">\d+:\d\d</td>', mine), mine
    everyone = admin.s.get(admin.hub.service_url + "admin", timeout=60).text
    assert f"cluster '{name}'" in everyone and "held-for" in everyone
    listed = subprocess.run([GPULAB, "jobs", "list"], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "GPULAB_URL": ann.hub.url,
                                             "GPULAB_TOKEN": ann.token()})
    row = next(line for line in listed.stdout.splitlines() if line.startswith(name))
    assert row.split()[2:4] == ["cluster", "Running"], listed.stdout
    holder.close()  # the holding kernel shuts down
    deadline = time.time() + LEASE + 30
    while time.time() < deadline:
        view = ann.service("GET", f"jobs/{name}").json()
        if view["state"] != "Running":
            break
        time.sleep(0.5)
    assert view["state"] == "Stopped" and "lease lapsed" in view["reason"], view
    assert not any(h["name"] == name for h in ann.service("GET", "me").json()["holdings"])
    with pytest.raises(LookupError):
        replica_process(name, "worker", 0)


def test_a_lost_parameter_server_is_said_in_the_cell_with_what_to_do(ann):
    """The ps of a cluster is killed: the cluster fails (its variables are gone), and the
    kernel holding it prints why and what to do, in the cell that holds it."""
    name = f"lost-{uuid.uuid4().hex[:6]}"
    cell = ("import gpulab, time\n"
            f"c = gpulab.cluster(ps=1, workers=1, name={name!r})\n"
            "deadline = time.time() + 120\n"
            "while c.ended is None and time.time() < deadline:\n"
            "    time.sleep(0.5)\n"
            "print('ENDED', c.ended)\n")
    with kernel_of(ann) as run, concurrent.futures.ThreadPoolExecutor(1) as pool:
        holding = pool.submit(run, cell, 240)
        deadline = time.time() + 150
        while time.time() < deadline:  # both servers said they serve
            logs = [ann.service("GET", f"jobs/{name}/logs/{r}").json().get("text", "")
                    for r in ("ps-0", "worker-0")]
            if all("serving at" in text for text in logs):
                break
            time.sleep(0.5)
        time.sleep(3)  # (`gpulab.cluster` connects to them and returns)
        replica_process(name, "ps", 0).send_signal(signal.SIGKILL)
        out = holding.result(timeout=200)
    assert "ps-0 was lost (killed by SIGKILL)" in out, out
    assert "restore it from your last checkpoint" in out, out
    view = ann.service("GET", f"jobs/{name}").json()
    assert view["state"] == "Failed" and view["reason"].startswith("ps-0 was lost"), view
    with pytest.raises(LookupError):
        replica_process(name, "worker", 0)
