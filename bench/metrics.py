"""The metrics endpoint at scale: ``/services/gpulab/metrics`` with 1,000 people and 100 held
GPUs, against a baseline measured in the same run on the same service.

    python bench/metrics.py [--requests 200] [--rounds 3] [--history 20000]

The gpulab service's own tornado application (`gpulab.hub.service.app.make_app`) on a
loopback port, over a real SQLite ledger holding: 100 devices, all held (100 allocations of
1 GPU, by 100 people, half notebooks, half jobs), 50 entries waiting in the queue and
`--history` past allocations over 30 days (their people's GPU-hours count against the
groups' budgets, so every one of the 1,000 people has a budget series), `--history` / 10 past
jobs and their replicas, and 20 group quotas with GPU-hour budgets. The hub is a stand-in
here (no hub runs in this benchmark): its user directory is a list of 1,000 people in 20
groups, and its token check a loopback handler that answers for one token with the scopes
``read:metrics``, ``access:services!service=gpulab`` and ``custom:gpulab:admin`` (the
service caches the answer 5 s, as it does with the real hub).

Prints the median and p99 time of a scrape (goal: under 100 ms), its size, and its ratio to
the baseline: the same token's GET of ``/api/v1/allocations`` (the same authentication, one
ledger read in a worker thread, everyone's 100 open allocations as JSON). Rounds alternate the two so that drift on
the machine hits both alike. GPU usage is not measured (simulated GPUs); NVML reads happen
in a sampler thread, never in a scrape.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpulab.hub.jobs.store import JobRow, ReplicaRow  # noqa: E402
from gpulab.hub.quota.ledger import DeviceInfo, Ledger, Request  # noqa: E402
from gpulab.hub.quota.policy import Quota  # noqa: E402
from gpulab.hub.quota.rows import AllocationRow  # noqa: E402
from gpulab.hub.quota.waiting import Queue  # noqa: E402

TOKEN = "bench-token"
PEOPLE, GROUPS, HELD, WAITING = 1000, 20, 100, 50


class StandInDirectory:
    """The hub's user list, as the service would read it from the hub API."""

    def __init__(self, users):
        self._users = users

    async def users(self):
        return self._users

    async def users_now(self):
        return self._users

    async def groups_of(self, name):
        return next((u["groups"] for u in self._users if u["name"] == name), [])

    def forget(self):
        pass


def fill(ledger: Ledger, history: int) -> list[dict]:
    rng = random.Random(1)
    now = time.time()
    names = [f"user{i:04d}" for i in range(PEOPLE)]
    users = [{"name": n, "groups": [f"group{i % GROUPS}"], "admin": False}
             for i, n in enumerate(names)]
    ledger.sync_inventory(DeviceInfo(i, uuid=f"GPU-{i}", model="H100", simulated=True)
                          for i in range(HELD))
    for g in range(GROUPS):
        ledger.set_quota("group", f"group{g}", Quota(4, gpu_hours=500, window_hours=24 * 30),
                         actor="bench")
    rows = []
    for i in range(history):
        start = now - rng.uniform(3600, 30 * 86400)
        rows.append(dict(id=uuid.uuid4().hex, pool="local", kind=rng.choice(["notebook", "job"]),
                         holder=f"h{i}", user=rng.choice(names), gpus=rng.choice([1, 2, 4]),
                         model=None, devices="[]", started_at=start,
                         ended_at=start + rng.uniform(60, 3 * 3600), end_reason="bench"))
    jobs, replicas = [], []
    for i in range(history // 10):
        jid = uuid.uuid4().hex
        jobs.append(dict(id=jid, user=rng.choice(names), name=f"j{i}", backend="local",
                         spec="{}", state=rng.choice(["Succeeded", "Failed", "Stopped"]),
                         reason="", allocation_id=None, job_dir="", created_at=now - i,
                         started_at=now - i, finished_at=now - i + 1))
        replicas += [dict(job_id=jid, role="worker", index=k, state="Succeeded", reason="",
                          pid=0, pid_started=0.0, port=0, devices="[]",
                          restarts=rng.choice([0, 0, 0, 1]), exit_code=0, restart_log="[]")
                     for k in range(2)]
    with ledger.engine.begin() as conn:
        if rows:
            conn.execute(AllocationRow.__table__.insert(), rows)
        if jobs:
            conn.execute(JobRow.__table__.insert(), jobs)
            conn.execute(ReplicaRow.__table__.insert(), replicas)
    for i in range(HELD):  # every GPU held, by 100 people
        ledger.admit(Request(names[i * 7], "notebook" if i % 2 else "job", f"held{i}", 1,
                             groups=(f"group{(i * 7) % GROUPS}",)))
    queue = Queue(ledger)
    for i in range(WAITING):
        queue.enqueue(Request(names[500 + i], "job", f"waits{i}", 1,
                              groups=(f"group{(500 + i) % GROUPS}",)), now=now - 60 * i)
    return users


def serve(ledger: Ledger, users: list[dict]) -> tuple[str, threading.Thread]:
    """The service's application and a stand-in of the hub's token check, on loopback ports,
    in a thread of their own (the loop the measurements wait on)."""
    from tornado import web
    from tornado.ioloop import IOLoop

    from tests.app.hubctl import free_port

    hub_port, port = free_port(), free_port()

    class WhoAmI(web.RequestHandler):  # the hub's GET /hub/api/user, for the one token
        def get(self):
            if self.request.headers.get("Authorization", "").split()[-1] != TOKEN:
                raise web.HTTPError(403)
            self.finish(json.dumps({"kind": "user", "name": "prometheus", "admin": False,
                                    "groups": [], "scopes": [
                                        "read:metrics", "access:services!service=gpulab",
                                        "custom:gpulab:admin"]}))

    os.environ.update(JUPYTERHUB_API_URL=f"http://127.0.0.1:{hub_port}/hub/api",
                      JUPYTERHUB_API_TOKEN="service-token", JUPYTERHUB_SERVICE_PREFIX="/services/gpulab/")
    ready = threading.Event()

    def run():
        asyncio.set_event_loop(asyncio.new_event_loop())
        from gpulab.hub.service.app import make_app

        web.Application([("/hub/api/user", WhoAmI)]).listen(hub_port, "127.0.0.1")
        make_app(ledger, "/services/gpulab/", "/hub/", StandInDirectory(users)).listen(
            port, "127.0.0.1")
        IOLoop.current().add_callback(ready.set)
        IOLoop.current().start()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ready.wait(30)
    return f"http://127.0.0.1:{port}/services/gpulab/", t


def measure(session: requests.Session, url: str, n: int) -> tuple[list[float], int, float]:
    """Wall times of `n` GETs, the answer's size, and the process's CPU seconds per GET
    (the service's and the client's: they share this process)."""
    took, size = [], 0
    cpu = time.process_time()
    for _ in range(n):
        t = time.perf_counter()
        r = session.get(url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30)
        took.append(time.perf_counter() - t)
        assert r.status_code == 200, (url, r.status_code, r.text[:300])
        size = len(r.content)
    return took, size, (time.process_time() - cpu) / n


def p99(xs):
    return statistics.quantiles(xs, n=100)[98]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=200, help="requests of each per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--history", type=int, default=20_000, help="past allocations")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        ledger = Ledger(f"sqlite:///{d}/ledger.sqlite")
        ledger.migrate()
        t0 = time.perf_counter()
        users = fill(ledger, args.history)
        print(f"ledger: {PEOPLE} people in {GROUPS} groups, {HELD} of {HELD} GPUs held, "
              f"{WAITING} waiting, {args.history} past allocations, {args.history // 10} past "
              f"jobs (filled in {time.perf_counter() - t0:.1f} s)")
        base, _ = serve(ledger, users)
        s = requests.Session()
        runs = {"metrics": [], "baseline": []}
        cpu = {"metrics": [], "baseline": []}
        urls = {"metrics": base + "metrics", "baseline": base + "api/v1/allocations"}
        sizes = {}
        for name in urls:  # warm: the token check, the first read of the directory
            measure(s, urls[name], 5)
        for r in range(args.rounds):
            order = ("metrics", "baseline") if r % 2 == 0 else ("baseline", "metrics")
            for name in order:
                took, sizes[name], per = measure(s, urls[name], args.requests)
                runs[name] += took
                cpu[name].append(per)
        m, b = runs["metrics"], runs["baseline"]
        body = s.get(urls["metrics"], headers={"Authorization": f"Bearer {TOKEN}"}).text
        series = sum(1 for line in body.splitlines() if line and not line.startswith("#"))
        cm, cb = statistics.median(cpu["metrics"]), statistics.median(cpu["baseline"])
        print(f"metrics  median {statistics.median(m) * 1000:6.1f} ms, p99 {p99(m) * 1000:6.1f} "
              f"ms (goal < 100 ms), CPU {cm * 1000:5.1f} ms per scrape; "
              f"{sizes['metrics'] / 1024:.0f} KiB, {series} samples")
        print(f"baseline median {statistics.median(b) * 1000:6.1f} ms, p99 {p99(b) * 1000:6.1f} "
              f"ms, CPU {cb * 1000:5.1f} ms (GET api/v1/allocations: same token check, one "
              f"ledger read, {sizes['baseline'] / 1024:.0f} KiB)")
        print(f"ratio metrics / baseline: median {statistics.median(m) / statistics.median(b):.2f}, "
              f"p99 {p99(m) / p99(b):.2f}, CPU {cm / cb:.2f}")
        print(f"load average while measured: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
        ledger.engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
