"""The training runtime with real TensorFlow processes, launched by hand (no hub).

Each replica is ``python -m gpulab.extensions.runtime <example> ...`` with a hand-written
``TF_CONFIG`` on free loopback ports, the job folder as working directory and its output
appended to ``logs/<role>-<index>.log``, as the local job backend does. TensorFlow takes 5-20 s
to start per process here, so each test starts its cluster once and drives it through its
scenario.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpulab.extensions import runtime as rt

pytestmark = pytest.mark.tf

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
PS_EXAMPLE = EXAMPLES / "digits_parameter_server.py"
MW_EXAMPLE = EXAMPLES / "digits_multi_worker.py"
START = 240  # seconds a cluster may take to start and train, on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Job:
    """A job folder and the replica processes started in it (killed when the test ends)."""

    def __init__(self, folder: Path, strategy: str, counts: dict[str, int], program: Path,
                 args=()):
        self.dir, self.strategy, self.program, self.args = folder, strategy, program, list(args)
        (folder / "logs").mkdir(parents=True)
        (folder / "checkpoints").mkdir()
        self.ports = {(role, i): free_port() for role, n in counts.items() for i in range(n)}
        self.procs: dict[tuple[str, int], subprocess.Popen] = {}
        self.all: list[subprocess.Popen] = []

    def cluster(self) -> dict:
        out: dict[str, list[str]] = {}
        for (role, _), port in sorted(self.ports.items()):
            if role != "evaluator":
                out.setdefault(role, []).append(f"127.0.0.1:{port}")
        return out

    def start(self, *keys):
        for key in keys or list(self.ports):
            role, index = key
            env = dict(os.environ,
                       TF_CONFIG=json.dumps({"cluster": self.cluster(),
                                             "task": {"type": role, "index": index}}),
                       GPULAB_STRATEGY=self.strategy, GPULAB_JOB_NAME=self.dir.name,
                       GPULAB_JOB_DIR=str(self.dir), CUDA_VISIBLE_DEVICES="",
                       PYTHONUNBUFFERED="1", TF_CPP_MIN_LOG_LEVEL="1")
            env.pop("TF_USE_LEGACY_KERAS", None)  # the runtime sets it
            with open(self.log(key), "ab") as log:
                p = subprocess.Popen(
                    [sys.executable, "-m", "gpulab.extensions.runtime", str(self.program),
                     *self.args],
                    cwd=self.dir, env=env, stdout=log, stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL, start_new_session=True)
            self.procs[key] = p
            self.all.append(p)
        return self

    def log(self, key) -> Path:
        return self.dir / "logs" / f"{key[0]}-{key[1]}.log"

    def exit_file(self, key) -> int:
        return int((self.dir / "logs" / f"{key[0]}-{key[1]}.exit").read_text())

    def text(self, key, since: int = 0) -> str:
        return self.log(key).read_bytes()[since:].decode(errors="replace")

    def wait(self, key, timeout: float = START) -> int:
        try:
            return self.procs[key].wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{key[0]}-{key[1]} still runs after {timeout} s; its log ends:\n"
                        + self.text(key)[-3000:])

    def wait_for_epoch(self, key, epoch: int, since: int = 0, timeout: float = START) -> float:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            done = [r["epoch"] for r in progress(self.text(key, since))]
            if done and done[-1] >= epoch:
                return time.monotonic()
            if self.procs[key].poll() is not None:
                pytest.fail(f"{key[0]}-{key[1]} exited {self.procs[key].returncode} before "
                            f"epoch {epoch}:\n" + self.text(key)[-3000:])
            time.sleep(0.05)
        pytest.fail(f"{key[0]}-{key[1]} did not reach epoch {epoch} in {timeout} s")

    def kill(self, key, sig=signal.SIGKILL) -> float:
        os.killpg(self.procs[key].pid, sig)
        return time.monotonic()

    def cleanup(self):
        for p in self.all:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(10)


@pytest.fixture
def jobs(tmp_path):
    made: list[Job] = []

    def make(name, *args, **kwargs) -> Job:
        job = Job(tmp_path / name, *args, **kwargs)
        made.append(job)
        return job

    yield make
    for job in made:
        job.cleanup()


def progress(text: str) -> list[dict]:
    return [r for r in map(rt.parse_progress_line, text.splitlines()) if r]


def accuracy_of(text: str) -> float:
    found = re.findall(r"^test accuracy: (\d\.\d{4})$", text, re.M)
    assert found, "no 'test accuracy' line:\n" + text[-3000:]
    return float(found[-1])




def resumed_from(text: str) -> int:
    found = re.findall(r"^resuming from epoch (\d+)$", text, re.M)
    assert found, "no 'resuming from epoch' line:\n" + text[-3000:]
    return int(found[-1])


def assert_summaries_and_checkpoints(job: Job):
    events = list((job.dir / "tensorboard").rglob("events.out.tfevents.*"))
    assert events and all(e.stat().st_size > 0 for e in events)
    assert (job.dir / "checkpoints" / "chief" / "checkpoint").is_file()
    assert list((job.dir / "checkpoints" / "chief").glob("ckpt-*.index"))
    # the other replicas' temporary copies are gone
    assert not list(job.dir.rglob("workertemp_*"))


def test_parameter_server_example(jobs):
    """1 chief + 1 ps + 2 workers train to >= 0.90; then SIGTERM ends the servers at once."""
    job = jobs("ps", "parameter-server", {"chief": 1, "ps": 1, "worker": 2}, PS_EXAMPLE,
               ["--epochs", "8"]).start()
    chief = ("chief", 0)
    assert job.wait(chief) == 0, job.text(chief)[-3000:]
    out = job.text(chief)
    assert "chief-0 running " in out and "chief-0 made ParameterServerStrategy" in out
    assert job.exit_file(chief) == 0
    assert accuracy_of(out) >= 0.90
    steps = progress(out)
    assert [r["epoch"] for r in steps] == list(range(1, 9))
    assert steps[-1]["step"] == steps[-1]["total"] > 0 and "loss" in steps[-1]
    assert_summaries_and_checkpoints(job)
    for key in (("ps", 0), ("worker", 0), ("worker", 1)):
        assert job.procs[key].poll() is None, f"{key} should serve until it is stopped"
        assert "serving at 127.0.0.1:" in job.text(key)
    t0 = time.monotonic()
    for key in (("ps", 0), ("worker", 0), ("worker", 1)):
        job.procs[key].send_signal(signal.SIGTERM)
    for key in (("ps", 0), ("worker", 0), ("worker", 1)):
        assert job.wait(key, 10) in (-signal.SIGTERM, 128 + signal.SIGTERM)
    assert time.monotonic() - t0 < 10


def test_multi_worker_example(jobs):
    """2 workers train in step to >= 0.90 (the same weights, so the same accuracy)."""
    job = jobs("mw", "multi-worker-mirrored", {"worker": 2}, MW_EXAMPLE,
               ["--epochs", "8"]).start()
    for key in job.procs:
        assert job.wait(key) == 0, job.text(key)[-3000:]
    acc = [accuracy_of(job.text(key)) for key in sorted(job.procs)]
    assert acc[0] >= 0.90 and acc[0] == acc[1]
    assert "worker-0 made CollectiveAllReduceStrategy" in job.text(("worker", 0))
    assert [r["epoch"] for r in progress(job.text(("worker", 0)))] == list(range(1, 9))
    assert_summaries_and_checkpoints(job)


def test_parameter_server_faults(jobs):
    """A worker killed and restarted at its address is taken back by the coordinator; a ps
    killed ends the chief with EXIT_INFRA; ps and chief restarted (the workers keep running)
    resume from the last epoch's checkpoint and finish."""
    job = jobs("psfault", "parameter-server", {"chief": 1, "ps": 1, "worker": 2}, PS_EXAMPLE,
               ["--epochs", "10", "--sleep-per-epoch", "0.3"]).start()
    chief, ps, worker1 = ("chief", 0), ("ps", 0), ("worker", 1)

    job.wait_for_epoch(chief, 2)
    time.sleep(0.1)
    job.kill(worker1)
    job.wait(worker1, 10)
    time.sleep(1)
    job.start(worker1)  # same address; the coordinator reconnects when it is back
    job.wait_for_epoch(chief, 5)
    time.sleep(0.1)
    killed = job.kill(ps)
    assert job.wait(chief, 60) == rt.EXIT_INFRA, job.text(chief)[-3000:]
    lost_after = time.monotonic() - killed
    assert lost_after < 60
    first = job.text(chief)
    assert "gpulab runtime: the cluster was lost" in first
    assert job.exit_file(chief) == rt.EXIT_INFRA
    last_reported = progress(first)[-1]["epoch"]
    assert 5 <= last_reported < 10, "the ps was killed after training had finished"

    offset = job.log(chief).stat().st_size
    job.start(ps, chief)
    assert job.wait(chief) == 0, job.text(chief, offset)[-3000:]
    second = job.text(chief, offset)
    resumed = resumed_from(second)
    # the checkpoint of every reported epoch was written before it was reported: at most the
    # epoch in flight when the ps died is repeated (one checkpoint interval)
    assert last_reported <= resumed <= last_reported + 1
    assert [r["epoch"] for r in progress(second)] == list(range(resumed + 1, 11))
    assert accuracy_of(second) >= 0.90 and job.exit_file(chief) == 0
    assert_summaries_and_checkpoints(job)
    print(f"chief exited {rt.EXIT_INFRA} {lost_after:.1f} s after the ps was killed; "
          f"reported epoch {last_reported}, resumed from epoch {resumed}")


def test_multi_worker_peer_loss(jobs):
    """A worker killed ends its peer with EXIT_INFRA; both restarted resume together."""
    job = jobs("mwfault", "multi-worker-mirrored", {"worker": 2}, MW_EXAMPLE,
               ["--epochs", "10", "--sleep-per-epoch", "0.3"]).start()
    w0, w1 = ("worker", 0), ("worker", 1)
    job.wait_for_epoch(w0, 3)
    time.sleep(0.1)
    killed = job.kill(w1)
    assert job.wait(w0, 60) == rt.EXIT_INFRA, job.text(w0)[-3000:]
    lost_after = time.monotonic() - killed
    last_reported = progress(job.text(w0))[-1]["epoch"]
    offsets = {k: job.log(k).stat().st_size for k in (w0, w1)}
    job.start(w0, w1)
    for key in (w0, w1):
        assert job.wait(key) == 0, job.text(key, offsets[key])[-3000:]
    resumed = [resumed_from(job.text(k, offsets[k])) for k in (w0, w1)]
    assert resumed[0] == resumed[1] and last_reported <= resumed[0] <= last_reported + 1
    assert accuracy_of(job.text(w0, offsets[w0])) >= 0.90
    print(f"worker-0 exited {rt.EXIT_INFRA} {lost_after:.1f} s after worker-1 was killed; "
          f"reported epoch {last_reported}, resumed from epoch {resumed[0]}")


PROGRAM = """
import sys
from gpulab.extensions import runtime
import tensorflow as tf
assert runtime.strategy() is runtime.strategy() is tf.distribute.get_strategy()
assert runtime.task() == ("evaluator", 0) and not runtime.is_chief()
assert tf.keras.__name__.startswith("tf_keras"), tf.keras.__name__
print("args", sys.argv[1:], flush=True)
if sys.argv[1] == "value":
    raise ValueError("the program's own mistake")
if sys.argv[1] == "unavailable":
    raise tf.errors.UnavailableError(None, None, "peer gone")
"""


def test_program_errors_and_bad_configuration(jobs):
    """An evaluator runs the program with the default strategy; its exception exits 1 (or
    EXIT_INFRA for TensorFlow's UnavailableError); a bad TF_CONFIG exits 2 with one line."""
    runs = {}
    for arg in ("value", "unavailable", "ok"):
        job = jobs(f"eval-{arg}", "parameter-server",
                   {"chief": 1, "ps": 1, "worker": 1, "evaluator": 1}, Path("program.py"), [arg])
        (job.dir / "program.py").write_text(PROGRAM)
        runs[arg] = job.start(("evaluator", 0))

    bad = subprocess.run(
        [sys.executable, "-m", "gpulab.extensions.runtime", "program.py"],
        env=dict(os.environ, TF_CONFIG='{"cluster": {"worker": ["127.0.0.1:1"]}',
                 GPULAB_STRATEGY="multi-worker-mirrored"),
        capture_output=True, text=True, timeout=30)
    assert bad.returncode == rt.EXIT_CONFIG
    assert bad.stderr.startswith("gpulab runtime: bad configuration: TF_CONFIG is not valid JSON")
    assert bad.stderr.count("\n") == 1

    evaluator = ("evaluator", 0)
    expected = {"value": rt.EXIT_PROGRAM, "unavailable": rt.EXIT_INFRA, "ok": rt.EXIT_OK}
    for arg, job in runs.items():
        assert job.wait(evaluator) == expected[arg], job.text(evaluator)[-3000:]
        out = job.text(evaluator)
        assert f"args ['{arg}']" in out
        assert job.exit_file(evaluator) == expected[arg]
    assert "ValueError: the program's own mistake" in runs["value"].text(evaluator)
    assert "gpulab runtime: the program raised ValueError; exit 1" in runs["value"].text(evaluator)
    assert "the cluster was lost (UnavailableError)" in runs["unavailable"].text(evaluator)
