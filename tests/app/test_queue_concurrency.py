"""The queue under contention, on SQLite and on a real PostgreSQL server.

20 people put 200 requests in line at once (each thread on its own database connection) while
scheduling passes run in three other threads, direct admissions come in beside them, and the
work that started ends at random. Afterwards every entry has started (the line drains once
GPUs come back), and the ledger's whole history shows no one over their quota and no GPU with
two holders at any instant (`check_history` of the admission contention test).
"""

from __future__ import annotations

import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpulab.hub.quota.ledger import AdmissionRefused, DeviceInfo, Ledger, Request
from gpulab.hub.quota.policy import Quota
from gpulab.hub.quota.waiting import Queue
from tests.app.test_ledger_concurrency import GPUS, QUOTA, USERS, check_history

REQUESTS = 200


def run_queue_contention(url: str):
    ledger = Ledger(url)
    ledger.migrate()
    ledger.sync_inventory(DeviceInfo(i) for i in range(GPUS))
    for user, q in QUOTA.items():
        ledger.set_quota("user", user, Quota(q), actor="test")
    queue = Queue(ledger, half_life_hours=1)
    rng = random.Random(11)
    items = [(USERS[i % len(USERS)], f"j{i}", rng.choice([1, 1, 2])) for i in range(REQUESTS)]
    items = [(u, h, min(g, QUOTA[u])) for u, h, g in items]
    entries, started = {}, []
    lock = threading.Lock()
    stop = threading.Event()

    def enqueue(item):
        user, holder, gpus = item
        e = queue.enqueue(Request(user, "job", holder, gpus))
        with lock:
            entries[e.id] = e

    def passes():
        while not stop.is_set():
            p = queue.schedule()
            with lock:
                started.extend(a for _, a in p.started)

    def finisher():
        r = random.Random(3)
        while not stop.is_set():
            with lock:
                a = started.pop(r.randrange(len(started))) if started else None
            if a is None:
                time.sleep(0.001)
                continue
            ledger.release(a.id, "done")

    def direct(n):
        for i in range(10):
            try:
                a = ledger.admit(Request(USERS[n], "notebook", f"nb{i}", 1))
            except AdmissionRefused:
                continue
            ledger.release(a.id, "done")

    workers = [threading.Thread(target=passes) for _ in range(3)] + [threading.Thread(
        target=finisher)]
    for t in workers:
        t.start()
    try:
        with ThreadPoolExecutor(max_workers=20) as pool:
            list(pool.map(enqueue, items))
            list(pool.map(direct, range(5)))
        deadline = time.monotonic() + 120
        while queue.entries() and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        stop.set()
        for t in workers:
            t.join()
    return ledger, queue, entries


def check(ledger, queue, entries):
    assert queue.entries() == [], "the line did not drain"
    rows = check_history(ledger)
    by_holder = {(a.user, a.holder) for a in rows if a.kind == "job"}
    assert all((e.user, e.holder) in by_holder for e in entries.values())
    assert len(entries) == REQUESTS
    assert all(len(a.devices) == a.gpus for a in rows)


def test_queue_contention_on_sqlite(tmp_path):
    ledger, queue, entries = run_queue_contention(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    check(ledger, queue, entries)


@pytest.mark.postgres
def test_queue_contention_on_postgresql(postgres):
    url = postgres.create_database("queue_contention")
    ledger, queue, entries = run_queue_contention(url)
    check(ledger, queue, entries)
    ledger.engine.dispose()
