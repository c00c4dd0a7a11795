"""Training through gpulab against the same training launched by hand.

The program is ``examples/digits_parameter_server.py`` with 1 chief + 1 ps + 2 workers, both
ways on this machine, in the same run:

- **by hand**: four processes started here with hand-written ``TF_CONFIG`` values on free
  loopback ports, as one would without gpulab (``python -m gpulab.extensions.runtime`` is
  the entry point in both cases, since the program uses the runtime's helpers);
- **gpulab**: the same spec submitted to the jobs API of a `gpulab up` started here
  (``--no-isolation``, so both run as this account), which admits the GPUs, starts and
  supervises the replicas and writes their logs to the job folder.

    python bench/training.py [--epochs 8] [--rounds 3]

Prints, for each, training steps per second (from the program's progress lines, first epoch
left out as warm-up), the time from launch (or submit) to the first finished epoch, and the
peak resident memory per replica, then the ratios gpulab / by hand (goals: steps/s >= 0.95,
time to first step <= 1.05 or so, memory <= 1.05). Rounds alternate the two so that drift on
the machine hits both alike. Numbers are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.app.hubctl import Browser, Hub  # noqa: E402

PROGRAM = ROOT / "examples" / "digits_parameter_server.py"
PREFIX = "GPULAB_PROGRESS "


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PeakMemory(threading.Thread):
    """Samples the resident memory of every process whose GPULAB_JOB_DIR is `job_dir`."""

    def __init__(self, job_dir: Path, every: float = 0.2):
        super().__init__(daemon=True)
        self.job_dir, self.every = str(job_dir), every
        self.peak: dict[int, int] = {}
        self.done = threading.Event()

    def run(self):
        while not self.done.is_set():
            for p in psutil.process_iter(["environ", "memory_info"]):
                env = p.info["environ"] or {}
                if env.get("GPULAB_JOB_DIR") == self.job_dir and p.info["memory_info"]:
                    rss = p.info["memory_info"].rss
                    self.peak[p.pid] = max(self.peak.get(p.pid, 0), rss)
            self.done.wait(self.every)

    def stop(self) -> list[int]:
        self.done.set()
        self.join()
        return sorted(self.peak.values())


def progress(text: str) -> list[dict]:
    return [json.loads(line[len(PREFIX):]) for line in text.splitlines()
            if line.startswith(PREFIX)]


def measure(records: list[dict], t0: float) -> dict:
    if len(records) < 3:
        raise RuntimeError(f"too few progress lines ({len(records)}) to measure")
    first, last = records[0], records[-1]
    return {"steps_per_s": (last["step"] - first["step"]) / (last["time"] - first["time"]),
            "first_step_s": first["time"] - t0}


def by_hand(epochs: int, work: Path) -> dict:
    job = work / f"hand-{time.time_ns()}"
    (job / "logs").mkdir(parents=True)
    cluster = {"chief": [f"127.0.0.1:{free_port()}"], "ps": [f"127.0.0.1:{free_port()}"],
               "worker": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]}
    sampler = PeakMemory(job)
    sampler.start()
    procs = {}
    t0 = time.time()
    for role, addresses in cluster.items():
        for i in range(len(addresses)):
            env = {**os.environ, "TF_CONFIG": json.dumps({"cluster": cluster,
                                                          "task": {"type": role, "index": i}}),
                   "GPULAB_STRATEGY": "parameter-server", "GPULAB_JOB_DIR": str(job),
                   "CUDA_VISIBLE_DEVICES": "", "PYTHONUNBUFFERED": "1"}
            log = open(job / "logs" / f"{role}-{i}.log", "wb")
            procs[(role, i)] = subprocess.Popen(
                [sys.executable, "-m", "gpulab.extensions.runtime", str(PROGRAM),
                 "--epochs", str(epochs)], env=env, cwd=job, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True)
    code = procs[("chief", 0)].wait(900)
    for key, p in procs.items():
        if key != ("chief", 0):
            p.kill()
            p.wait()
    peaks = sampler.stop()
    text = (job / "logs" / "chief-0.log").read_text()
    if code != 0:
        raise RuntimeError(f"the hand-launched chief exited {code}: {text[-2000:]}")
    return {**measure(progress(text), t0), "peak_rss": peaks}


def through_gpulab(epochs: int, hub: Hub, person: Browser) -> dict:
    name = f"bench-{time.time_ns() % 10**9}"
    spec = {"name": name, "strategy": "parameter-server",
            "replicas": {"chief": 1, "ps": 1, "worker": 2},
            "source": PROGRAM.read_text(), "args": ["--epochs", str(epochs)]}
    job_dir = hub.data_dir / "shared" / "users" / person.name / "jobs" / name
    sampler = PeakMemory(job_dir)
    sampler.start()
    t0 = time.time()
    r = person.service("POST", "jobs", json=spec)
    if r.status_code != 201:
        raise RuntimeError(f"submit refused: {r.status_code} {r.text}")
    while True:
        job = person.service("GET", f"jobs/{name}").json()
        if job["state"] in ("Succeeded", "Failed", "Stopped"):
            break
        time.sleep(2)  # rarely: the by-hand run has no watcher competing for the CPU
    peaks = sampler.stop()
    text = person.service("GET", f"jobs/{name}/logs/chief-0").json()["text"]
    if job["state"] != "Succeeded":
        raise RuntimeError(f"the job ended {job['state']}: {job['reason']}: {text[-2000:]}")
    return {**measure(progress(text), t0), "peak_rss": peaks}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gpulab-bench-training-"))
    os.chmod(work, 0o711)
    data = work / "data"
    data.mkdir(mode=0o700)
    # the same CPUs both ways: gpulab's overhead is measured, not its bounds (a person's work
    # together may use 3/4 of the machine's CPUs by default, 1.5 of a 2-core machine's 2;
    # each replica's own default, 2 CPUs, is left as it is)
    config = data / "gpulab_config.py"
    config.write_text("c.LocalGPUSpawner.person_cpu_limit = 0\n")
    config.chmod(0o600)
    hub = Hub(data, "--simulated-gpus", "4", "--no-isolation").start()
    results: dict[str, list[dict]] = {"hand": [], "gpulab": []}
    try:
        admin = Browser(hub, "admin")
        admin.login(hub.admin_password)
        for i in range(args.rounds):
            order = ("hand", "gpulab") if i % 2 == 0 else ("gpulab", "hand")
            for kind in order:
                res = by_hand(args.epochs, work) if kind == "hand" else \
                    through_gpulab(args.epochs, hub, admin)
                results[kind].append(res)
                print(f"round {i + 1} {kind:6s}: {res['steps_per_s']:.1f} steps/s, first epoch "
                      f"after {res['first_step_s']:.1f} s, peak RSS per replica "
                      f"{[round(b / 2**20) for b in res['peak_rss']]} MiB", flush=True)
    finally:
        hub.stop()
        shutil.rmtree(work, ignore_errors=True)

    def med(kind, key):
        return statistics.median(r[key] for r in results[kind])

    def rss(kind):
        return statistics.median(statistics.mean(r["peak_rss"]) for r in results[kind])

    sps = med("gpulab", "steps_per_s") / med("hand", "steps_per_s")
    first = med("gpulab", "first_step_s") / med("hand", "first_step_s")
    mem = rss("gpulab") / rss("hand")
    print(f"steps per second, gpulab / by hand: {sps:.3f} (goal >= 0.95)")
    print(f"time to the first epoch, gpulab / by hand: {first:.3f} (goal ~1, lower is better)")
    print(f"peak resident memory per replica, gpulab / by hand: {mem:.3f} (goal <= 1.05)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
