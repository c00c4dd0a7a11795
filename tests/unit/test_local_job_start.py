"""A local job's replicas start outside any database transaction: while each replica's
process starts, the hub and the service can still write to the ledger (SQLite has one writer:
a write transaction held across the starts made every other writer wait for them).

A real `LocalJobBackend` on a SQLite ledger with one GPU; each replica's start is a ``sleep``
(the process the backend records and later stops), after a write tried from another
connection that may not wait."""

from __future__ import annotations

import sqlite3

import psutil

from gpulab.hub.jobs.local import LocalJobBackend, UserAccount
from gpulab.hub.jobs.spec import parse_spec
from gpulab.hub.quota.waiting import Queue
from tests.unit.test_queued_job_recovery import ledger  # noqa: F401 (a fixture: one GPU)

SPEC = {"name": "two", "strategy": "parameter-server", "replicas": {"chief": 1, "ps": 1, "worker": 1},
        "resources": {"worker": {"gpus": 1}}, "source": "print(1)"}


async def test_replicas_start_while_others_may_write_to_the_ledger(ledger, tmp_path, monkeypatch):
    (tmp_path / "ann").mkdir()
    b = LocalJobBackend(ledger, lambda user: UserAccount(user, tmp_path / user),
                        sandboxed=False, queue=Queue(ledger))
    writes = []

    def spawn(job, spec, r, *args, **kwargs):
        other = sqlite3.connect(tmp_path / "ledger.sqlite", timeout=0.2, isolation_level=None)
        try:
            other.execute("BEGIN IMMEDIATE")  # another writer, now
            other.execute("ROLLBACK")
            writes.append((r.role, "written"))
        except sqlite3.OperationalError as e:  # "database is locked"
            writes.append((r.role, str(e)))
        finally:
            other.close()
        return psutil.Popen(["sleep", "60"])

    monkeypatch.setattr(b, "_spawn", spawn)
    try:
        view = await b.submit("ann", (), parse_spec(SPEC))
        assert view["state"] == "Running", view
        assert sorted(writes) == [("chief", "written"), ("ps", "written"), ("worker", "written")], writes
        job, reps = b.store.find("ann", "two")
        assert {r.pid for r in reps} == {p.pid for p in b._procs.values()}  # recorded
        assert {r.state for r in reps} == {"Running"}
    finally:
        await b.stop("ann", "two")
        await b.shutdown()
