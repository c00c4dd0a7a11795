"""Admission throughput and latency under contention, and the service's memory at scale.

    python bench/admission.py [--threads 20] [--requests 2000] [--repeats 3] [--no-postgres]

1. For SQLite and a real PostgreSQL server (started here from Debian's binaries, as the tests
   do): admissions per second and p99 latency with `--threads` concurrent callers, each
   admission (or refusal: 20 callers share 8 GPUs) followed by its release, against a baseline
   measured in the same run on the same database: a plain transaction inserting one row.
   Prints the ratios (goal >= 0.5). On PostgreSQL twice: a pool that hands out devices (a local
   hub on PostgreSQL; the pool is locked whole) and one that only counts GPUs ("PG, counts":
   Kubernetes, the production set-up; people are admitted in parallel).
2. The service's resident memory with 1,000 users and 100,000 past allocations in the ledger
   (goal under 200 MB), and the time to build and render the admin page (goal under 1 s). The
   hub's user directory is a stand-in list here (no hub runs in this benchmark).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
from sqlalchemy import Column, Integer, MetaData, String, Table

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpulab.hub.quota.ledger import AdmissionRefused, DeviceInfo, Ledger, Request  # noqa: E402
from gpulab.hub.quota.rows import AllocationRow  # noqa: E402
from gpulab.hub.quota.policy import Quota  # noqa: E402


def p99(xs):
    return statistics.quantiles(xs, n=100)[98]


def contention(url: str, threads: int, requests: int, devices: bool = True,
               repeats: int = 3) -> dict:
    ledger = Ledger(url)
    ledger.migrate()
    if devices:
        ledger.sync_inventory(DeviceInfo(i) for i in range(8))
    else:  # Kubernetes' pool: counts GPUs, the scheduler places them
        ledger.ensure_pool(assigns_devices=False)
    ledger.set_quota("default", "", Quota(2), actor="bench")
    users = [f"u{i}" for i in range(threads)]
    meta = MetaData()
    plain = Table(f"bench_plain_{uuid.uuid4().hex[:6]}", meta, Column("id", Integer, primary_key=True),
                  Column("holder", String(64)))
    meta.create_all(ledger.engine)

    def admit(i):
        t = time.perf_counter()
        try:
            a = ledger.admit(Request(users[i % threads], "job", uuid.uuid4().hex[:10], 1))
        except AdmissionRefused:  # a refusal is a decision too: same transaction, same locks
            return time.perf_counter() - t
        ledger.release(a.id)
        return time.perf_counter() - t

    def insert(i):
        t = time.perf_counter()
        with ledger.engine.begin() as conn:
            conn.execute(plain.insert().values(holder=uuid.uuid4().hex[:10]))
        return time.perf_counter() - t

    runs: dict[str, list[dict]] = {"plain insert": [], "admission": []}
    for r in range(repeats):  # alternated, so that drift on the machine hits both alike
        order = (("plain insert", insert), ("admission", admit))
        for name, fn in (order if r % 2 == 0 else order[::-1]):
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(fn, range(threads)))  # warm the connection pool
                t0 = time.perf_counter()
                lat = list(pool.map(fn, range(requests)))
                wall = time.perf_counter() - t0
            runs[name].append({"per_s": requests / wall, "p99_ms": p99(lat) * 1000})
    ledger.engine.dispose()
    return {name: {k: statistics.median(x[k] for x in xs) for k in ("per_s", "p99_ms")}
            for name, xs in runs.items()}


def report(db: str, r: dict) -> None:
    a, b = r["admission"], r["plain insert"]
    print(f"{db:10s} admission {a['per_s']:7.0f}/s p99 {a['p99_ms']:6.1f} ms | plain insert "
          f"{b['per_s']:7.0f}/s p99 {b['p99_ms']:6.1f} ms | throughput ratio "
          f"{a['per_s'] / b['per_s']:.2f} (goal >= 0.5), p99 ratio {b['p99_ms'] / a['p99_ms']:.2f}")


class StandInDirectory:
    """The hub's user list, as the service would read it from the hub API."""

    def __init__(self, users):
        self._users = users

    async def users(self):
        return self._users

    async def groups_of(self, name):
        return []


def at_scale() -> None:
    from gpulab.hub.service.pages import _pages, page_context
    from gpulab.hub.service.quotas import overview

    proc = psutil.Process()
    base = proc.memory_info().rss
    with tempfile.TemporaryDirectory() as d:
        ledger = Ledger(f"sqlite:///{d}/ledger.sqlite")
        ledger.migrate()
        ledger.sync_inventory(DeviceInfo(i) for i in range(8))
        rng = random.Random(1)
        now = time.time()
        names = [f"user{i:04d}" for i in range(1000)]
        rows = []
        for i in range(100_000):
            start = now - rng.uniform(0, 40 * 86400)
            rows.append(dict(id=uuid.uuid4().hex, pool="local", kind=rng.choice(["notebook", "job"]),
                             holder=f"h{i}", user=rng.choice(names), gpus=rng.choice([1, 2, 4]),
                             model=None, devices="[]", started_at=start,
                             ended_at=start + rng.uniform(60, 8 * 3600), end_reason="bench"))
        with ledger.engine.begin() as conn:
            conn.execute(AllocationRow.__table__.insert(), rows)
        for g in range(20):
            ledger.set_quota("group", f"group{g}", Quota(2 + g % 4), actor="bench")
        del rows
        users = [{"name": n, "groups": [f"group{i % 20}"], "admin": False} for i, n in enumerate(names)]

        class H:  # what `overview` reads from a handler
            pass

        h = H()
        h.ledger, h.directory, h.settings = ledger, StandInDirectory(users), {}
        t0 = time.perf_counter()
        o = asyncio.run(overview(h))
        ctx = page_context(hub_prefix="/hub/", service_prefix="/services/gpulab/",
                           model={"name": "admin", "admin": True}, xsrf="x", admin=True,
                           path="/services/gpulab/admin")
        html = _pages.get_template("admin.html").render(**ctx, o=o)
        took = time.perf_counter() - t0
        rss = proc.memory_info().rss
    print(f"service at scale: 1,000 users, 100,000 past allocations: RSS {rss / 2**20:.0f} MiB "
          f"(goal < 200 MB; {base / 2**20:.0f} MiB before loading), admin page built and "
          f"rendered in {took:.2f} s (goal < 1 s), {len(html) / 1024:.0f} KiB of HTML")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=20)
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--repeats", type=int, default=3,
                   help="measurements of each, alternated; the medians are reported")
    p.add_argument("--no-postgres", action="store_true")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        report("SQLite", contention(f"sqlite:///{d}/bench.sqlite", args.threads, args.requests,
                                       repeats=args.repeats))
    if not args.no_postgres:
        from tests.pg import PostgresServer

        pg = PostgresServer().start()
        try:
            report("PostgreSQL", contention(pg.create_database("bench"), args.threads,
                                            args.requests, repeats=args.repeats))
            report("PG, counts", contention(pg.create_database("bench_counts"), args.threads,
                                            args.requests, devices=False, repeats=args.repeats))
        finally:
            pg.stop()
    at_scale()
    return 0


if __name__ == "__main__":
    sys.exit(main())
