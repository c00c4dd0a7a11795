"""TensorFlow's own tutorial programs as gpulab jobs, changed in nothing but their data source
(docs/from-a-tensorflow-tutorial.md): each is submitted to the jobs API of a real `gpulab up`
and must succeed.

- "Multi-worker training with Keras": ``main.py`` + ``mnist_setup.py`` (two files, sent by
  ``gpulab jobs submit --source-file <folder>``), TensorFlow's own
  ``MultiWorkerMirroredStrategy()`` reading ``TF_CONFIG``, two workers;
- "Parameter server training": TensorFlow's own ``ParameterServerStrategy(cluster_resolver)``
  and ``Model.fit`` with a ``DatasetCreator`` (through the REST API), 1 chief, 1 ps,
  2 workers, whose ps and workers never run the program.

- "Distributed input" (issue 34): its first step sets up two logical CPUs, which TensorFlow
  allows only before it is initialised; then each section makes its own
  ``MirroredStrategy()``. One worker, one (simulated) GPU.

One job per strategy, as the tutorials give them (small models, a few epochs). Beside the
"Distributed input" job runs tests/tf/programs/tf_setup_first.py (every TensorFlow set-up call
first, then ``MirroredStrategy()``) as a job of its own.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.app.hubctl import GPULAB
from tests.app.test_jobs_api import job_dir, wait_state

pytestmark = pytest.mark.tf

TUTORIALS = Path(__file__).resolve().parents[2] / "examples"
MW = TUTORIALS / "tutorial_multi_worker"
PS = TUTORIALS / "tutorial_parameter_server"
INPUT = TUTORIALS / "tutorial_distributed_input"
SETUP_FIRST = Path(__file__).resolve().parent / "programs" / "tf_setup_first.py"


def log_of(person, name, replica) -> str:
    return person.service("GET", f"jobs/{name}/logs/{replica}").json()["text"]


def test_multi_worker_tutorial_of_two_files(hub, users):
    ann = users["ann"]
    env = {**os.environ, "GPULAB_URL": hub.url, "GPULAB_TOKEN": ann.token()}
    r = subprocess.run([GPULAB, "jobs", "submit", "--name", "mnist-mw", "--strategy",
                        "multi-worker-mirrored", "--workers", "2", "--source-file", str(MW),
                        "--json"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    job = wait_state(ann, "mnist-mw", {"Succeeded", "Failed"}, timeout=600)
    logs = {w: log_of(ann, "mnist-mw", w) for w in ("worker-0", "worker-1")}
    assert job["state"] == "Succeeded", (job, logs["worker-0"][-3000:])
    for text in logs.values():  # each worker ran the tutorial's fit to its end
        assert "Epoch 3/3" in text and "70/70" in text, text[-3000:]
    # both files in the job's code folder, the person's, with the entry point as source.py
    code = job_dir(hub, "ann", "mnist-mw") / "code"
    assert sorted(p.name for p in code.iterdir() if p.is_file()) == ["mnist_setup.py",
                                                                     "source.py"]
    assert (code / "source.py").read_text() == (MW / "main.py").read_text()
    assert (code / "mnist_setup.py").read_text() == (MW / "mnist_setup.py").read_text()
    if os.geteuid() == 0:  # isolated: written as root for the person's own account
        owner = (job_dir(hub, "ann", "mnist-mw")).stat().st_uid
        assert {p.stat().st_uid for p in [code, *code.iterdir()]} == {owner}


def test_parameter_server_tutorial(hub, users):
    bob = users["bob"]
    spec = {"name": "ps-tutorial", "strategy": "parameter-server",
            "replicas": {"chief": 1, "ps": 1, "worker": 2},
            "source": (PS / "main.py").read_text()}
    r = bob.service("POST", "jobs", json=spec)
    assert r.status_code == 201, r.text
    job = wait_state(bob, "ps-tutorial", {"Succeeded", "Failed"}, timeout=600)
    chief = log_of(bob, "ps-tutorial", "chief-0")
    assert job["state"] == "Succeeded", (job, chief[-3000:])
    assert "Epoch 5/5" in chief and "20/20" in chief, chief[-3000:]
    # the ps and the workers served (gpulab's server), they never ran the program
    for name in ("ps-0", "worker-0", "worker-1"):
        text = log_of(bob, "ps-tutorial", name)
        assert f"{name} serving at 127.0.0.1:" in text and " running " not in text, text[-2000:]
    assert all(x["restarts"] == 0 for x in job["replicas"]), job["replicas"]


def test_distributed_input_guide_and_tensorflow_set_up_first(hub, users):
    """Issue 34: programs whose first lines set TensorFlow up run as jobs: the guide, and every
    set-up call of tf_setup_first.py, then MirroredStrategy() over the replica's devices (a
    one-worker job: no cluster); on simulated GPUs no replica logs a failed cuInit."""
    ann, carl = users["ann"], users["carl"]
    one_worker = {"strategy": "multi-worker-mirrored", "replicas": {"worker": 1},
                  "resources": {"worker": {"gpus": 1}}}
    r = ann.service("POST", "jobs", json={**one_worker, "name": "distributed-input",
                                          "source": (INPUT / "main.py").read_text()})
    assert r.status_code == 201, r.text
    r = carl.service("POST", "jobs", json={**one_worker, "name": "setup-first",
                                           "source": SETUP_FIRST.read_text(),
                                           "args": ["mirrored"]})
    assert r.status_code == 201, r.text

    job = wait_state(ann, "distributed-input", {"Succeeded", "Failed"}, timeout=600)
    guide = log_of(ann, "distributed-input", "worker-0")
    assert job["state"] == "Succeeded", (job, guide[-3000:])
    assert "1) LogicalDevice(name='/device:CPU:1', device_type='CPU')" in guide, guide[:3000]
    assert guide.count("Loss is ") == 7 + 10 * 5, guide[-3000:]  # the loop, then the epochs
    assert "Traceback" not in guide

    job = wait_state(carl, "setup-first", {"Succeeded", "Failed"}, timeout=600)
    text = log_of(carl, "setup-first", "worker-0")
    assert job["state"] == "Succeeded", (job, text[-3000:])
    line = [x for x in text.splitlines() if x.startswith("RESULT ")][-1]
    result = json.loads(line[len("RESULT "):])
    assert set(result["setup"].values()) == {"ok"}, result["setup"]
    assert result["after"]["virtual_devices"] == ["/device:CPU:0", "/device:CPU:1"]
    assert result["after"]["threading"] == [1, 2]
    assert result["after"]["mixed_precision"][0] == "mixed_bfloat16"
    assert result["after"]["xla"][1] == 6.0
    # MirroredStrategy takes this replica's devices, not the job's cluster: here the two
    # logical CPUs (its GPU is simulated, so TensorFlow sees none; with real GPUs, its GPUs)
    strategy = result["strategy"]
    assert strategy["type"] == "MirroredStrategy" and strategy["replicas"] == 2
    assert strategy["devices"] == ["/job:localhost/replica:0/task:0/device:CPU:0",
                                   "/job:localhost/replica:0/task:0/device:CPU:1"]
    assert strategy["together"] == 2.0
    visible = result["cuda_visible_devices"]  # still the replica's own (simulated) GPU
    assert visible.isdigit() and job["replicas"][0]["devices"] == [int(visible)]

    for text in (guide, text):  # the simulated GPUs are said so, not reported as an error
        assert "failed call to cuInit" not in text
        assert "simulated: no CUDA here, TensorFlow uses the CPU" in text
