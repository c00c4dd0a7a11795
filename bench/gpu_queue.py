"""The queue: time of one `plan` pass with 1,000 and 10,000 waiting entries, and the time from
GPUs released to the next queued job's replicas started.

    python bench/gpu_queue.py [--repeat 20] [--rounds 5]

A pass is what the service runs whenever GPUs come back or work arrives
(`gpulab.hub.quota.queue.plan`): fair-share order over 50 people, one head with a reservation
on an 8-GPU machine whose GPUs are all busy, every other entry's place and estimated start.
The baseline, measured in the same run, is sorting the same entries by submit time (what a
first-come-first-served queue does at the least). Prints the median pass, its ratio to the
baseline, and the goal: under 50 ms at 1,000 entries.

Release to start: a real `LocalJobBackend` with its queue over a SQLite ledger with two
simulated GPUs; a notebook allocation holds both, a 2-GPU job waits (Queued); the clock runs
from the notebook's release to the job's replicas started by the supervisor's pass (their
processes spawned). The baseline, measured in the same run, is spawning one such process
directly (``python -c pass``). Goal: under 1 s plus that process start.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpulab.hub.quota.policy import Quota  # noqa: E402
from gpulab.hub.quota.queue import Device, Person, Running, Waiting, plan  # noqa: E402

H = 3600.0
NOW = 1_000_000.0


def scenario(n: int):
    devices = [Device(i, "H100") for i in range(8)]
    running = [Running(f"r{i}", f"u{i}", "job", (i,), NOW - H, max_runtime=(2 + i) * H)
               for i in range(8)]
    people = {f"u{i}": Person(Quota(4), usage=float(i % 7)) for i in range(50)}
    queue = [Waiting(f"w{i}", f"u{i % 50}", "job", 1 + i % 4, NOW + i, priority=i % 3,
                     max_runtime=None if i % 5 == 0 else H * (1 + i % 3)) for i in range(n)]
    return devices, running, queue, people


def timed(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


async def release_to_start(rounds: int) -> list[float]:
    """Seconds from a notebook's release of both GPUs to the queued job's replicas started."""
    from gpulab.hub.jobs.local import LocalJobBackend, UserAccount
    from gpulab.hub.jobs.spec import parse_spec
    from gpulab.hub.quota.ledger import DeviceInfo, Ledger, Request
    from gpulab.hub.quota.waiting import Queue

    folder = Path(tempfile.mkdtemp(prefix="gpulab-bench-queue-"))
    ledger = Ledger(f"sqlite:///{folder}/ledger.sqlite")
    ledger.migrate()
    ledger.ensure_pool()
    ledger.sync_inventory([DeviceInfo(i, f"sim-{i}", "Simulated", 1024, True) for i in range(2)])
    (folder / "users" / "bob").mkdir(parents=True)
    backend = LocalJobBackend(ledger, lambda u: UserAccount(u, folder / "users" / u),
                              sandboxed=False, queue=Queue(ledger))
    out = []
    for i in range(rounds):
        notebook = ledger.admit(Request(user="ann", kind="notebook", holder="", gpus=2))
        spec = parse_spec({"name": f"queued-{i}", "strategy": "multi-worker-mirrored",
                           "replicas": {"worker": 1}, "resources": {"worker": {"gpus": 2}},
                           "source": "import time\ntime.sleep(60)\n"})
        view = await backend.submit("bob", (), spec)
        assert view["state"] == "Queued", view
        await asyncio.sleep(1.0)  # the supervisor is in its usual rhythm of passes
        t0 = time.perf_counter()
        ledger.release(notebook.id)
        while (await asyncio.to_thread(backend.get, "bob", spec.name))["state"] == "Queued":
            await asyncio.sleep(0.002)
        out.append(time.perf_counter() - t0)
        await backend.stop("bob", spec.name)
    await backend.shutdown()
    return out


def process_start(rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    for n in (1_000, 10_000):
        devices, running, queue, people = scenario(n)
        p = plan(devices, running, queue, people, NOW)
        assert len(p.waiting) == n
        ours = timed(lambda: plan(devices, running, queue, people, NOW), args.repeat)
        base = timed(lambda: sorted(queue, key=lambda w: (w.submitted_at, w.id)), args.repeat)
        goal = "  (goal < 50 ms)" if n == 1_000 else ""
        print(f"{n:>6} waiting: pass {ours * 1000:7.2f} ms   first-come-first-served sort "
              f"{base * 1000:6.2f} ms   ratio {ours / base:5.1f}{goal}")
    latency = statistics.median(asyncio.run(release_to_start(args.rounds)))
    start = process_start(args.rounds)
    print(f"release to start: {latency * 1000:7.1f} ms   a process start {start * 1000:6.1f} ms   "
          f"ratio {latency / start:5.1f}   (goal < 1000 ms + a process start: "
          f"{'met' if latency < 1.0 + start else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
