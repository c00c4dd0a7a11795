"""The queue's scheduling pass: time of one `plan` pass with 1,000 and 10,000 waiting entries.

    python bench/queue.py [--repeat 20]

A pass is what the service runs whenever GPUs come back or work arrives
(`gpulab.hub.quota.queue.plan`): fair-share order over 50 people, one head with a reservation
on an 8-GPU machine whose GPUs are all busy, every other entry's place and estimated start.
The baseline, measured in the same run, is sorting the same entries by submit time (what a
first-come-first-served queue does at the least). Prints the median pass, its ratio to the
baseline, and the goal: under 50 ms at 1,000 entries.
"""

from __future__ import annotations

import argparse
import statistics
import sys
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=20)
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
    return 0


if __name__ == "__main__":
    sys.exit(main())
