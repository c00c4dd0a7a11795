"""Training through gpulab against the same training launched by hand.

The program is ``examples/digits_parameter_server.py`` with 1 chief + 1 ps + 2 workers, both
ways on this machine, in the same run:

- **by hand**: four processes started here with hand-written ``TF_CONFIG`` values on free
  loopback ports, as one would without gpulab (``python -m gpulab.extensions.runtime`` is
  the entry point in both cases, since the program uses the runtime's helpers);
- **gpulab**: the same spec submitted to the jobs API of a `gpulab up` started here
  (``--no-isolation``, so both run as this account), which admits the GPUs, starts the
  replicas in their sandbox (control groups, network and mount namespaces), supervises them
  and writes their logs to the job folder; the bench polls the job every 2 s, as a job view
  would.

    python bench/training.py [--epochs 8] [--rounds 6]

Each round runs both, in ABBA order (the side that goes first alternates), and prints for
each: training steps per second and the replicas' CPU time (user + system, all four
processes, read with psutil) per step, both over the window from the first to the last
progress line (the first epoch, with TensorFlow's start-up, is left out); the CPUs the
replicas had and those the rest of the machine used meanwhile (the hub's share apart); the
time from launch (or submit) to the first finished epoch and when the replica processes were
started; and the peak resident memory per replica. At the end: each figure's ratio gpulab /
by hand *within each round*, as median [min–max] over the rounds (goals: steps/s >= 0.95,
CPU time per step <= 1.05, time to the first epoch ~1, memory <= 1.05).

Steps per second follow the CPUs the replicas get, which on a small busy machine swing from
round to round with what else runs (other load counts per thread, gpulab's work as a whole
weighs one thread per CPU: `gpulab.hub.machine.cgroups`); CPU time per step hardly depends on
other load, so it is the figure for gpulab's own overhead. Numbers are printed, never
asserted.
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


class Replicas(threading.Thread):
    """Samples the replicas of one run (the processes whose ``GPULAB_JOB_DIR`` is `job_dir`):
    their peak resident memory, and their CPU time (user + system, all threads) as a series
    over time, from which `cpu_between` reads what they used in a window. The machine's
    process table is scanned only until all `expected` replicas are found; then only those
    are read, every `every` seconds (the sampler's own load stays small and the same both
    ways)."""

    def __init__(self, job_dir: Path, expected: int = 4, every: float = 0.1):
        super().__init__(daemon=True)
        self.job_dir, self.expected, self.every = str(job_dir), expected, every
        self.procs: dict[int, psutil.Process] = {}
        self.peak: dict[int, int] = {}
        self.cpu: dict[int, float] = {}
        self.sys: dict[int, float] = {}
        # (time, CPU seconds of all replicas, busy CPU seconds of the whole machine, the
        # replicas' system CPU seconds)
        self.series: list[tuple[float, float, float, float]] = []
        self.done = threading.Event()

    def _find(self):
        for p in psutil.process_iter(["environ"]):
            env = p.info["environ"] or {}
            if env.get("GPULAB_JOB_DIR") == self.job_dir and p.pid not in self.procs:
                self.procs[p.pid] = p

    def run(self):
        next_scan = 0.0
        while not self.done.is_set():
            now = time.monotonic()
            if len(self.procs) < self.expected and now >= next_scan:
                self._find()
                next_scan = now + 0.25
            for pid, p in list(self.procs.items()):
                try:
                    with p.oneshot():
                        t, rss = p.cpu_times(), p.memory_info().rss
                except psutil.Error:  # ended: its last figures stay
                    continue
                self.cpu[pid] = t.user + t.system
                self.sys[pid] = t.system
                self.peak[pid] = max(self.peak.get(pid, 0), rss)
            m = psutil.cpu_times()
            busy = sum(m) - m.idle - getattr(m, "iowait", 0.0)
            self.series.append((time.time(), sum(self.cpu.values()), busy,
                                sum(self.sys.values())))
            self.done.wait(self.every)

    def stop(self) -> list[int]:
        self.done.set()
        self.join()
        return sorted(self.peak.values())

    def started(self) -> float:
        """When the last of the replicas' processes started (time.time())."""
        times = []
        for p in self.procs.values():
            try:
                times.append(p.create_time())
            except psutil.Error:
                pass
        return max(times)

    def cpu_at(self, t: float) -> tuple[float, ...]:
        """(the replicas' CPU seconds, the machine's busy CPU seconds, the replicas' system
        CPU seconds) at time `t`,
        interpolated between samples."""
        s = self.series
        for (t0, *a), (t1, *b) in zip(s, s[1:]):
            if t0 <= t <= t1:
                f = (t - t0) / (t1 - t0) if t1 > t0 else 0.0
                return tuple(x + (y - x) * f for x, y in zip(a, b))
        raise RuntimeError(f"no CPU samples around {t} ({len(s)} samples)")


def hub_cpu(hub: Hub) -> float:
    """CPU seconds so far of `gpulab up` and what it runs (hub, proxy, gpulab service), the
    replicas left out."""
    total = 0.0
    try:
        top = psutil.Process(hub.proc.pid)
        for p in [top, *top.children(recursive=True)]:
            try:
                with p.oneshot():
                    if "GPULAB_JOB_DIR" in (p.environ() or {}):
                        continue
                    t = p.cpu_times()
            except psutil.Error:
                continue
            total += t.user + t.system  # (not children_*: the service reaps the replicas)
    except psutil.Error:
        pass
    return total


def progress(text: str) -> list[dict]:
    return [json.loads(line[len(PREFIX):]) for line in text.splitlines()
            if line.startswith(PREFIX)]


def measure(records: list[dict], t0: float, replicas: Replicas) -> dict:
    """A run's figures over the window from its first to its last progress line (the first
    epoch, with TensorFlow's start-up and tracing, is left out)."""
    if len(records) < 3:
        raise RuntimeError(f"too few progress lines ({len(records)}) to measure")
    first, last = records[0], records[-1]
    steps, seconds = last["step"] - first["step"], last["time"] - first["time"]
    (cpu0, busy0, sys0), (cpu1, busy1, sys1) = (replicas.cpu_at(first["time"]),
                                                replicas.cpu_at(last["time"]))
    return {"steps_per_s": steps / seconds,
            "first_step_s": first["time"] - t0,
            # of which: until all four replica processes were started (by hand: Popen)
            "start_s": replicas.started() - t0,
            # CPU time (user + system) of all four replicas per training step: what the work
            # costs, whatever else the machine's CPUs are busy with meanwhile
            "cpu_ms_per_step": 1000 * (cpu1 - cpu0) / steps,
            "sys_ms_per_step": 1000 * (sys1 - sys0) / steps,  # of it, in the kernel
            # CPUs the replicas had on average, and those the rest of the machine used
            "replica_cpus": (cpu1 - cpu0) / seconds,
            "other_cpus": max(0.0, (busy1 - busy0) - (cpu1 - cpu0)) / seconds,
            "window": (first["time"], last["time"])}


def by_hand(epochs: int, work: Path) -> dict:
    job = work / f"hand-{time.time_ns()}"
    (job / "logs").mkdir(parents=True)
    cluster = {"chief": [f"127.0.0.1:{free_port()}"], "ps": [f"127.0.0.1:{free_port()}"],
               "worker": [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]}
    sampler = Replicas(job)
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
    return {**measure(progress(text), t0, sampler), "peak_rss": peaks}


def through_gpulab(epochs: int, hub: Hub, person: Browser) -> dict:
    name = f"bench-{time.time_ns() % 10**9}"
    spec = {"name": name, "strategy": "parameter-server",
            "replicas": {"chief": 1, "ps": 1, "worker": 2},
            "source": PROGRAM.read_text(), "args": ["--epochs", str(epochs)]}
    job_dir = hub.data_dir / "shared" / "users" / person.name / "jobs" / name
    sampler = Replicas(job_dir)
    sampler.start()
    t0 = time.time()
    r = person.service("POST", "jobs", json=spec)
    if r.status_code != 201:
        raise RuntimeError(f"submit refused: {r.status_code} {r.text}")
    while True:  # as a person's job view would, every 2 s
        job = person.service("GET", f"jobs/{name}").json()
        if job["state"] in ("Succeeded", "Failed", "Stopped"):
            break
        time.sleep(2)
    peaks = sampler.stop()
    text = person.service("GET", f"jobs/{name}/logs/chief-0").json()["text"]
    if job["state"] != "Succeeded":
        raise RuntimeError(f"the job ended {job['state']}: {job['reason']}: {text[-2000:]}")
    return {**measure(progress(text), t0, sampler), "peak_rss": peaks}


def spread(values: list[float]) -> str:
    """median [min–max] of `values`."""
    return (f"{statistics.median(values):.3f} [{min(values):.3f}–{max(values):.3f}]")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=6)
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
    rounds: list[dict[str, dict]] = []
    try:
        admin = Browser(hub, "admin")
        admin.login(hub.admin_password)
        for i in range(args.rounds):
            # ABBA: each side goes first in every other round, so drift hits both alike
            order = ("hand", "gpulab") if i % 2 == 0 else ("gpulab", "hand")
            rounds.append({})
            for kind in order:
                h0, w0 = hub_cpu(hub), time.time()
                res = by_hand(args.epochs, work) if kind == "hand" else \
                    through_gpulab(args.epochs, hub, admin)
                res["hub_cpus"] = (hub_cpu(hub) - h0) / (time.time() - w0)
                rounds[-1][kind] = res
                print(f"round {i + 1} {kind:6s}: {res['steps_per_s']:6.1f} steps/s, "
                      f"{res['cpu_ms_per_step']:5.1f} ms CPU/step ({res['sys_ms_per_step']:4.1f} system), "
                      f"replicas had "
                      f"{res['replica_cpus']:.2f} CPUs, others used {res['other_cpus']:.2f} "
                      f"(the hub {res['hub_cpus']:.2f}), first epoch after "
                      f"{res['first_step_s']:.1f} s (started after {res['start_s']:.2f} s), peak RSS per replica "
                      f"{[round(b / 2**20) for b in res['peak_rss']]} MiB", flush=True)
    finally:
        hub.stop()
        shutil.rmtree(work, ignore_errors=True)

    def paired(key, of=lambda r, key: r[key]):
        return [of(r["gpulab"], key) / of(r["hand"], key) for r in rounds]

    def rss(r, _):
        return statistics.mean(r["peak_rss"])

    print(f"{len(rounds)} rounds, ratios gpulab / by hand of the same round, median [min–max]:")
    print(f"  steps per second:          {spread(paired('steps_per_s'))} (goal >= 0.95)")
    print(f"  CPU time per step:         {spread(paired('cpu_ms_per_step'))} "
          "(goal <= 1.05; insensitive to other load)")
    print(f"  time to the first epoch:   {spread(paired('first_step_s'))} (goal ~1)")
    print(f"  peak memory per replica:   {spread(paired('peak_rss', rss))} (goal <= 1.05)")
    for kind in ("hand", "gpulab"):
        print(f"  {kind:6s} medians: "
              f"{statistics.median(r[kind]['steps_per_s'] for r in rounds):.1f} steps/s, "
              f"{statistics.median(r[kind]['cpu_ms_per_step'] for r in rounds):.1f} ms CPU/step "
              f"({statistics.median(r[kind]['sys_ms_per_step'] for r in rounds):.1f} system), "
              f"others used {statistics.median(r[kind]['other_cpus'] for r in rounds):.2f} CPUs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
