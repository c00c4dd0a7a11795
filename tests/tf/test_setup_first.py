"""Issue 34: a program's first lines may be TensorFlow's set-up, which TensorFlow refuses once
it is initialised; the runtime leaves the first touch of TensorFlow to the program.

One program (``programs/tf_setup_first.py``) makes every set-up call (virtual devices, memory
growth, visible devices, threading, mixed precision, XLA), then a strategy, and prints what
TensorFlow reports. It runs through ``python -m gpulab.extensions.runtime`` (launched by hand
as the local job backend does, see test_runtime_processes.py) once per strategy, and each call
is asserted on its own from that one run: TensorFlow takes 10-20 s to start per process here.

- multi-worker-mirrored, 2 workers: worker-0 takes gpulab's ``runtime.strategy()``, worker-1
  makes its own ``MultiWorkerMirroredStrategy()`` from ``TF_CONFIG`` (as TensorFlow's tutorials
  do); they form one cluster.
- parameter-server, chief + ps + worker: the chief (the coordinator) takes
  ``runtime.strategy()``; the ps and the worker only serve.

Where no GPU exists (here) memory growth and visible devices use the stand-ins that the program
describes (TensorFlow refuses memory growth on a CPU at any time, and a CPU must stay visible).
The same program through a real `gpulab up` is in test_tutorials.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tf.test_runtime_processes import Job

pytestmark = pytest.mark.tf

PROGRAM = Path(__file__).resolve().parent / "programs" / "tf_setup_first.py"
CALLS = ("virtual_devices", "memory_growth", "visible_devices", "threading", "mixed_precision",
         "xla")


def result_of(text: str) -> dict:
    lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
    assert lines, "no RESULT line:\n" + text[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module", params=["multi-worker-mirrored", "parameter-server"])
def run(request, tmp_path_factory):
    """The program's results per replica that ran it, and the logs, for one strategy."""
    strategy = request.param
    counts = {"worker": 2} if strategy == "multi-worker-mirrored" else \
        {"chief": 1, "ps": 1, "worker": 1}
    job = Job(tmp_path_factory.mktemp(strategy) / "job", strategy, counts, PROGRAM,
              ["gpulab,own"])
    try:
        job.start()
        leads = [("worker", 0), ("worker", 1)] if strategy == "multi-worker-mirrored" \
            else [("chief", 0)]
        for key in leads:
            assert job.wait(key) == 0, job.text(key)[-3000:]
        yield {"strategy": strategy, "job": job,
               "results": {f"{r}-{i}": result_of(job.text((r, i))) for r, i in leads}}
    finally:
        job.cleanup()


@pytest.mark.parametrize("call", CALLS)
def test_set_up_call_runs_first(run, call):
    """Each set-up call succeeds: TensorFlow was not initialised before the program."""
    for name, result in run["results"].items():
        assert result["setup"][call] == "ok", (name, result["setup"])


def test_virtual_devices_hold(run):
    for name, result in run["results"].items():
        devices = result["after"]["virtual_devices"]
        assert len(devices) == 2 and devices[0].endswith("CPU:0") \
            and devices[1].endswith("CPU:1"), (name, devices)


def test_memory_growth_stand_in_holds(run):
    # no GPU here: the program checked memory growth's own condition instead (see its doc)
    for result in run["results"].values():
        assert result["after"]["memory_growth"] == "stand-in"


def test_visible_devices_hold(run):
    for result in run["results"].values():
        assert result["after"]["visible_devices"] == ["/physical_device:CPU:0"]


def test_threading_holds(run):
    for result in run["results"].values():
        assert result["after"]["threading"] == [1, 2]


def test_mixed_precision_holds(run):
    # a layer made in the strategy's scope computes in bfloat16, keeps float32 variables
    for result in run["results"].values():
        assert result["after"]["mixed_precision"] == ["mixed_bfloat16", "bfloat16", "float32"]


def test_xla_holds(run):
    for result in run["results"].values():
        jit, doubled = result["after"]["xla"]
        assert jit and doubled == 6.0


def test_the_strategies_span_the_job(run):
    """gpulab's strategy and the program's own from TF_CONFIG are the job's cluster."""
    job, results = run["job"], run["results"]
    if run["strategy"] == "multi-worker-mirrored":
        assert [results[w]["how"] for w in ("worker-0", "worker-1")] == ["gpulab", "own"]
        for result in results.values():
            s = result["strategy"]
            assert s["type"] == "CollectiveAllReduceStrategy" and s["replicas"] == 2
            assert s["together"] == 2.0  # an all-reduce across both workers
            assert s["cluster"] == job.cluster()
        assert "worker-0 made CollectiveAllReduceStrategy for runtime.strategy()" \
            in job.text(("worker", 0))
        assert "made" not in job.text(("worker", 1))  # its own: gpulab made none
    else:
        s = results["chief-0"]["strategy"]
        assert s["type"] == "ParameterServerStrategyV2"
        # the job's ps holds the variables; three closures ran on the job's worker
        assert s["variables_on"] == "/job:ps/replica:0/task:0/device:CPU:0"
        assert s["together"] == 3.0
        assert "chief-0 made ParameterServerStrategyV2 for runtime.strategy()" \
            in job.text(("chief", 0))
        for key in (("ps", 0), ("worker", 0)):
            assert "serving at 127.0.0.1:" in job.text(key) and " running " not in job.text(key)
