"""TensorFlow's own tutorial programs as gpulab jobs, changed in nothing but their data source
(docs/from-a-tensorflow-tutorial.md): each is submitted to the jobs API of a real `gpulab up`
and must succeed.

- "Multi-worker training with Keras": ``main.py`` + ``mnist_setup.py`` (two files, sent by
  ``gpulab jobs submit --source-file <folder>``), TensorFlow's own
  ``MultiWorkerMirroredStrategy()`` reading ``TF_CONFIG``, two workers;
- "Parameter server training": TensorFlow's own ``ParameterServerStrategy(cluster_resolver)``
  and ``Model.fit`` with a ``DatasetCreator`` (through the REST API), 1 chief, 1 ps,
  2 workers, whose ps and workers never run the program.

One job per strategy, as the tutorials give them (small models, a few epochs).
"""

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
