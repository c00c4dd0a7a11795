"""The ledger on SQLite: migrations, admission, release, budgets, usage and the audit trail."""

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from gpulab.hub.db import Base
from gpulab.hub.quota.ledger import (
    BadRequest,
    DeviceInfo,
    Ledger,
    NotEnoughGPUs,
    QuotaExceeded,
    Request,
)
from gpulab.hub.quota.policy import Quota, QuotaError


@pytest.fixture
def ledger(tmp_path):
    lg = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    lg.migrate()
    lg.sync_inventory(DeviceInfo(i, f"GPU-{i}", "NVIDIA-A10" if i < 2 else "NVIDIA-H100")
                      for i in range(4))
    return lg


def test_migrations_create_exactly_the_models(ledger):
    with ledger.engine.connect() as conn:
        diff = compare_metadata(MigrationContext.configure(conn), Base.metadata)
    assert diff == []


def test_migrate_twice_is_harmless(ledger):
    ledger.migrate()
    assert len(ledger.devices()) == 4


def test_admission_hands_out_distinct_devices_and_releases(ledger):
    a = ledger.admit(Request("ann", "notebook", "default", 2))
    b = ledger.admit(Request("bob", "job", "digits-1", 2))
    assert set(a.devices).isdisjoint(b.devices) and len(a.devices + b.devices) == 4
    with pytest.raises(NotEnoughGPUs) as e:
        ledger.admit(Request("carl", "notebook", "default", 1))
    assert "0 of 4 are free" in e.value.message and "4 held by other users" in e.value.message
    assert "ann" not in e.value.message and "bob" not in e.value.message
    assert ledger.release(a.id).ended_at is not None
    assert ledger.release(a.id) is None  # twice: no-op
    assert ledger.admit(Request("carl", "notebook", "default", 2)).devices == a.devices


def test_model_is_respected(ledger):
    a = ledger.admit(Request("ann", "notebook", "default", 2, model="NVIDIA-H100"))
    assert a.devices == (2, 3)
    with pytest.raises(NotEnoughGPUs, match="of model NVIDIA-H100"):
        ledger.admit(Request("bob", "notebook", "default", 1, model="NVIDIA-H100"))


def test_one_holder_cannot_hold_twice(ledger):
    ledger.admit(Request("ann", "notebook", "x", 1))
    with pytest.raises(BadRequest):
        ledger.admit(Request("ann", "notebook", "x", 1))


def test_quota_from_group_and_override(ledger):
    ledger.set_quota("default", "", Quota(1), actor="admin")
    ledger.set_quota("group", "staff", Quota(3), actor="admin")
    ledger.admit(Request("ann", "notebook", "default", 1))
    with pytest.raises(QuotaExceeded, match=r"1 of your 1 GPU \(the default quota\) is in use: notebook 'default'"):
        ledger.admit(Request("ann", "job", "j1", 1))
    ledger.admit(Request("ann", "job", "j1", 2, groups=("staff",)))
    ledger.set_quota("user", "ann", Quota(0), actor="admin")
    with pytest.raises(QuotaExceeded):
        ledger.admit(Request("ann", "job", "j2", 1, groups=("staff",)))
    quota, source = ledger.effective("ann", ["staff"])
    assert quota == Quota(0) and source == "user"


def test_budget_counts_past_and_open_allocations(ledger):
    ledger.set_quota("user", "ann", Quota(4, gpu_hours=3, window_hours=24), actor="admin")
    t0 = 1_000_000.0
    a = ledger.admit(Request("ann", "notebook", "default", 2), now=t0)
    ledger.release(a.id, now=t0 + 3600)  # 2 GPU-hours
    b = ledger.admit(Request("ann", "job", "j", 1), now=t0 + 3600)  # still under budget
    # one hour later: 2 + 1 = 3 GPU-hours used, the budget is spent
    with pytest.raises(QuotaExceeded, match="3 of your 3 GPU-hours"):
        ledger.admit(Request("ann", "job", "k", 1), now=t0 + 7200)
    assert ledger.get(b.id).open  # running work continues
    assert ledger.usage(t0, t0 + 7200)["ann"] == pytest.approx(3.0)
    # the window moves on: the first allocation falls out of it
    ledger.release(b.id, now=t0 + 7200)
    assert ledger.admit(Request("ann", "job", "k", 1), now=t0 + 24 * 3600 + 3600)


def test_audit_trail_records_old_and_new(ledger):
    ledger.set_quota("group", "staff", Quota(2), actor="root")
    ledger.set_quota("group", "staff", Quota(4, max_per_request=2), actor="admin")
    assert ledger.unset_quota("group", "staff", actor="admin")
    assert not ledger.unset_quota("group", "staff", actor="admin")
    trail = ledger.audit()
    assert [(t["actor"], t["old"] and t["old"]["max_gpus"], t["new"] and t["new"]["max_gpus"])
            for t in trail] == [("admin", 4, None), ("admin", 2, 4), ("root", None, 2)]


@pytest.mark.parametrize("scope,name", [("user", ""), ("default", "x"), ("planet", "x")])
def test_bad_scopes(ledger, scope, name):
    with pytest.raises(QuotaError):
        ledger.set_quota(scope, name, Quota(1), actor="admin")


def test_orphans_are_closed(ledger):
    keep = ledger.admit(Request("ann", "notebook", "a", 1))
    gone = ledger.admit(Request("ann", "notebook", "b", 1))
    job = ledger.admit(Request("ann", "job", "j", 1))
    closed = ledger.close_orphans("notebook", {keep.id}, "test")
    assert [c.id for c in closed] == [gone.id]
    assert ledger.get(job.id).open and ledger.get(keep.id).open


def test_readers_take_no_write_lock(ledger):
    """A read (a user's ``GET me``, a job list) never waits for a writer holding the lock,
    and never holds one up: on SQLite readers begin a deferred transaction."""
    import threading
    import time

    from sqlalchemy import text

    ledger.admit(Request(user="ann", kind="notebook", holder="default", gpus=1))
    holding, done = threading.Event(), threading.Event()

    def writer():
        with ledger.Session.begin() as s:  # BEGIN IMMEDIATE: the write lock
            s.execute(text("select 1"))
            holding.set()
            done.wait(10)

    t = threading.Thread(target=writer)
    t.start()
    try:
        assert holding.wait(10)
        started = time.monotonic()
        assert [a.user for a in ledger.open_allocations()] == ["ann"]
        assert ledger.quotas() == [] and ledger.usage(0)["ann"] >= 0
        assert ledger.effective("ann", ["g"]) == (None, "none")
        assert time.monotonic() - started < 1
    finally:
        done.set()
        t.join()


def test_database_errors_are_sqlalchemys(tmp_path):
    """Admission and release run on the DBAPI connection, but a database's error still reaches
    callers as SQLAlchemy's (``sqlalchemy.exc.OperationalError``, ``IntegrityError``, … with
    the driver's as ``orig``), as before: callers catch those, not sqlite3's or psycopg's."""
    import sqlite3

    import sqlalchemy.exc

    lg = Ledger(f"sqlite:///{tmp_path / 'empty.sqlite'}")  # never migrated: no tables
    with pytest.raises(sqlalchemy.exc.OperationalError, match="no such table") as e:
        lg.admit(Request("ann", "notebook", "default", 1))
    assert isinstance(e.value.orig, sqlite3.OperationalError)
    with pytest.raises(sqlalchemy.exc.OperationalError, match="no such table"):
        lg.release("nope")
    lg.migrate()  # the connections went back to the pool in a usable state
    assert lg.admit(Request("ann", "notebook", "default", 0)).gpus == 0
