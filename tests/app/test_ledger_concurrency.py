"""Admission under contention, on SQLite and on a real PostgreSQL server.

20 users send 200 admission requests at once (each on its own database connection, from a
thread pool) against small quotas and a small inventory, releasing some as they go. From the
ledger's full history afterwards: at no instant did a user hold more than their quota, and
no device ever had two holders at once.
"""

import random
import uuid
from concurrent.futures import ThreadPoolExecutor

import pytest

from gpulab.hub.quota.ledger import AdmissionRefused, DeviceInfo, Ledger, Request
from gpulab.hub.quota.policy import Quota

USERS = [f"u{i:02d}" for i in range(20)]
QUOTA = {u: (1 if i % 3 == 0 else 2) for i, u in enumerate(USERS)}
GPUS = 6
REQUESTS = 200


def run_contention(url: str, devices: bool = True):
    ledger = Ledger(url)
    ledger.migrate()
    if devices:
        ledger.sync_inventory(DeviceInfo(i) for i in range(GPUS))
    else:  # a pool that only counts GPUs (Kubernetes): people are admitted in parallel
        ledger.ensure_pool(assigns_devices=False)
    for user, q in QUOTA.items():
        ledger.set_quota("user", user, Quota(q), actor="test")
    rng = random.Random(7)
    plan = [(rng.choice(USERS), rng.choice([1, 1, 2]), rng.random() < 0.95) for _ in range(REQUESTS)]

    def one(item):
        user, gpus, release = item
        try:
            a = ledger.admit(Request(user, rng.choice(["notebook", "job"]), uuid.uuid4().hex[:8], gpus))
        except AdmissionRefused:
            return "refused"
        if release:
            ledger.release(a.id, "test")
        return "admitted"

    with ThreadPoolExecutor(max_workers=20) as pool:
        outcomes = list(pool.map(one, plan))
    return ledger, outcomes


def check_history(ledger: Ledger):
    from sqlalchemy import select

    from gpulab.hub.quota.ledger import Allocation
    from gpulab.hub.quota.rows import AllocationRow

    with ledger.Session() as s:
        rows = [Allocation.of(r) for r in s.scalars(select(AllocationRow))]
    end = float("inf")
    events = []
    for a in rows:
        events.append((a.started_at, 1, a))
        events.append((a.ended_at if a.ended_at is not None else end, 0, a))
    events.sort(key=lambda e: (e[0], e[1]))  # at equal times, releases first
    held: dict[str, int] = {}
    owner: dict[int, str] = {}
    for _, starting, a in events:
        if starting:
            held[a.user] = held.get(a.user, 0) + a.gpus
            assert held[a.user] <= QUOTA[a.user], f"{a.user} held {held[a.user]} > quota"
            for d in a.devices:
                assert d not in owner, f"GPU {d} held by {owner[d]} and {a.id} at once"
                owner[d] = a.id
        else:
            held[a.user] -= a.gpus
            for d in a.devices:
                owner.pop(d, None)
    assert all(0 <= d < GPUS for a in rows for d in a.devices)
    return rows


def test_contention_on_sqlite(tmp_path):
    ledger, outcomes = run_contention(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    rows = check_history(ledger)
    assert outcomes.count("admitted") == len(rows) and "refused" in outcomes
    assert len(rows) >= 20
    assert all(len(a.devices) == a.gpus for a in rows)


@pytest.mark.postgres
def test_contention_on_postgresql(postgres):
    url = postgres.create_database("contention")
    ledger, outcomes = run_contention(url)
    rows = check_history(ledger)
    assert outcomes.count("admitted") == len(rows) and "refused" in outcomes
    assert len(rows) >= 20
    assert all(len(a.devices) == a.gpus for a in rows)
    ledger.engine.dispose()


@pytest.mark.postgres
def test_contention_on_postgresql_counting_pool(postgres):
    """Kubernetes' pool (counts, no devices): per-person locks, quotas still never exceeded."""
    url = postgres.create_database("contention_counting")
    ledger, outcomes = run_contention(url, devices=False)
    rows = check_history(ledger)
    assert outcomes.count("admitted") == len(rows) and "refused" in outcomes
    assert len(rows) >= 20 and all(a.devices == () for a in rows)
    ledger.engine.dispose()


@pytest.mark.postgres
def test_admission_rules_on_postgresql(postgres):
    """The PostgreSQL path has statements of its own (one round trip of locks and reads): the
    same rules as on SQLite (tests/unit/test_ledger.py) on a real server."""
    from gpulab.hub.quota.ledger import BadRequest, NotEnoughGPUs, QuotaExceeded

    ledger = Ledger(postgres.create_database("rules"))
    ledger.migrate()
    ledger.sync_inventory(DeviceInfo(i, model="A10" if i < 2 else "H100") for i in range(4))
    ledger.set_quota("default", "", Quota(1), actor="admin")
    ledger.set_quota("group", "staff", Quota(3), actor="admin")
    ledger.set_quota("group", "big", Quota(4, gpu_hours=3, window_hours=24), actor="admin")
    t0 = 1_000_000.0
    a = ledger.admit(Request("ann", "notebook", "default", 1), now=t0)
    with pytest.raises(QuotaExceeded, match=r"\(the default quota\)"):
        ledger.admit(Request("ann", "job", "j1", 1))
    with pytest.raises(BadRequest):
        ledger.admit(Request("ann", "notebook", "default", 1, groups=("staff",)))
    # the most generous of the person's groups
    b = ledger.admit(Request("ann", "job", "j1", 2, groups=("staff", "big"), model="H100"), now=t0)
    assert b.devices == (2, 3) and a.devices == (0,)
    with pytest.raises(NotEnoughGPUs, match="of model H100"):
        ledger.admit(Request("bob", "notebook", "default", 1, model="H100"))
    assert ledger.release(b.id, now=t0 + 3600).ended_at == t0 + 3600
    assert ledger.release(b.id) is None
    with pytest.raises(QuotaExceeded, match="3 of your 3 GPU-hours"):  # 2 + 1 (ann's notebook)
        ledger.admit(Request("ann", "job", "j2", 1, groups=("big",)), now=t0 + 3600)
    assert ledger.usage(t0, t0 + 3600)["ann"] == pytest.approx(3.0)
    # a pool nobody declared counts GPUs
    other = Ledger(ledger.url, pool="elsewhere")
    c = other.admit(Request("ann", "notebook", "default", 1))
    assert c.devices == () and other.get(c.id).open
    ledger.engine.dispose()
    other.engine.dispose()


def _waiting(conn, dbname: str, n: int) -> list[int]:
    """The pids of `n` backends of `dbname` waiting on a lock (polled until there are; `conn`
    autocommits: in a transaction pg_stat_activity is read once)."""
    import time

    deadline = time.time() + 30
    while time.time() < deadline:
        pids = [r[0] for r in conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = %s AND wait_event_type = 'Lock'",
            (dbname,)).fetchall()]
        if len(pids) >= n:
            return pids
        time.sleep(0.02)
    raise TimeoutError(f"fewer than {n} backends waiting on a lock")


@pytest.mark.postgres
def test_first_admissions_into_a_new_pool_on_postgresql(postgres):
    """Two admissions of one person into a pool that has no row yet (a counting pool nobody
    declared) at once: the person's lock serializes them, and the second finds the pool the
    first made. Its lock statement read the pool's row before the lock was granted, so it too
    tried to make the pool and failed with a raw unique violation (a 500)."""
    import threading

    import psycopg

    from gpulab.hub.quota.fastpath import person_key

    url = postgres.create_database("newpool")
    ledger = Ledger(url, pool="fresh")
    ledger.migrate()
    ledger.set_quota("user", "ann", Quota(2), actor="test")
    ledger.set_quota("user", "bob", Quota(1), actor="test")
    out: dict = {}
    with psycopg.connect(f"dbname=newpool user=gpulab host={postgres.sock}",
                         autocommit=True) as x:
        keys = [person_key("fresh", u) for u in ("ann", "bob")]
        for k in keys:  # both people's admissions wait on their lock, then go at once
            x.execute("SELECT pg_advisory_lock(%s)", (k,))

        def admit(user, holder):
            try:
                out[user, holder] = ledger.admit(Request(user, "notebook", holder, 1))
            except BaseException as e:  # noqa: BLE001 - the test looks at it
                out[user, holder] = e

        threads = [threading.Thread(target=admit, args=a)
                   for a in (("ann", "a1"), ("ann", "a2"), ("bob", "b1"), ("bob", "b2"))]
        for t in threads:
            t.start()
        _waiting(x, "newpool", 4)
        for k in keys:
            x.execute("SELECT pg_advisory_unlock(%s)", (k,))
        for t in threads:
            t.join()
    assert [type(out["ann", h]).__name__ for h in ("a1", "a2")] == ["Allocation"] * 2, out
    bobs = sorted(type(out["bob", h]).__name__ for h in ("b1", "b2"))
    assert bobs == ["Allocation", "QuotaExceeded"], out
    assert len(ledger.open_allocations()) == 3
    ledger.engine.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize("level", ["repeatable read", "serializable"])
def test_contention_on_postgresql_whose_default_isolation_is_stricter(postgres, level):
    """A DBA may make REPEATABLE READ (or SERIALIZABLE) the database's default. Admission reads
    after its locks and relies on read committed's snapshot per statement: under a snapshot
    taken at the transaction's first statement (before the pool's lock is granted) two
    admissions handed out the same GPU (serializable: raw serialization failures, 500s). The
    ledger's connections are read committed whatever the server's default."""
    import psycopg

    name = "strict_" + level.replace(" ", "_")
    url = postgres.create_database(name)
    with psycopg.connect(f"dbname={name} user=gpulab host={postgres.sock}",
                         autocommit=True) as x:
        x.execute(f"ALTER DATABASE {name} SET default_transaction_isolation TO '{level}'")
    ledger, outcomes = run_contention(url)
    rows = check_history(ledger)
    assert outcomes.count("admitted") == len(rows) and len(rows) >= 20
    ledger.engine.dispose()


@pytest.mark.postgres
def test_lost_connections_on_postgresql(postgres):
    """The server ends the connection of a release (waiting on the allocation's row) and of an
    admission (waiting on the pool's row): each fails with SQLAlchemy's OperationalError, its
    connection is dropped, the next calls work, and every connection the ledger gives back to
    the pool is idle, out of pipeline mode, not autocommitting."""
    import threading

    import psycopg
    import sqlalchemy.exc
    from psycopg.pq import PipelineStatus, TransactionStatus
    from sqlalchemy import event

    from gpulab.hub.quota.ledger import QuotaExceeded

    ledger = Ledger(postgres.create_database("lost"))
    ledger.migrate()
    ledger.sync_inventory(DeviceInfo(i) for i in range(2))
    ledger.set_quota("user", "ann", Quota(1), actor="test")
    returned = []

    @event.listens_for(ledger.engine, "reset")
    def _returned(dbapi_conn, _record, _state):  # before the pool's own rollback
        returned.append((dbapi_conn.info.transaction_status, dbapi_conn.pgconn.pipeline_status,
                         dbapi_conn.autocommit))

    a = ledger.admit(Request("ann", "notebook", "a", 1))
    with pytest.raises(QuotaExceeded):
        ledger.admit(Request("ann", "job", "j", 1))
    out = {}
    dsn = f"dbname=lost user=gpulab host={postgres.sock}"
    with psycopg.connect(dsn, autocommit=True) as x, psycopg.connect(dsn, autocommit=True) as y:
        for what, lock, call in (
                ("release", ("SELECT 1 FROM allocations WHERE id = %s FOR UPDATE", (a.id,)),
                 lambda: ledger.release(a.id)),
                ("admit", ("SELECT 1 FROM pools WHERE name = 'local' FOR UPDATE", ()),
                 lambda: ledger.admit(Request("bob", "notebook", "b", 1)))):
            x.execute("BEGIN")
            x.execute(*lock)

            def run(call=call, what=what):
                try:
                    out[what] = call()
                except BaseException as e:  # noqa: BLE001 - the test looks at it
                    out[what] = e

            t = threading.Thread(target=run)
            t.start()
            (pid,) = _waiting(y, "lost", 1)
            y.execute("SELECT pg_terminate_backend(%s)", (pid,))
            t.join()
            x.execute("ROLLBACK")
    for what in ("release", "admit"):
        assert isinstance(out[what], sqlalchemy.exc.OperationalError), out[what]
        assert isinstance(out[what].orig, psycopg.OperationalError)
    assert ledger.release(a.id).ended_at is not None  # the release had not happened
    assert ledger.admit(Request("bob", "notebook", "b", 1)).devices == (0,)
    assert returned and all(r == (TransactionStatus.IDLE, PipelineStatus.OFF, False)
                            for r in returned), returned
    ledger.engine.dispose()


def test_a_connection_dropped_while_idle_is_replaced_unseen_on_postgresql(postgres, monkeypatch):
    """The engine pings a pooled connection only where it sat idle (`gpulab.hub.db`): one the
    server dropped meanwhile is replaced before anyone uses it; one in use a moment ago is
    handed out without a round trip."""
    import psycopg
    from sqlalchemy import event

    from gpulab.hub import db

    ledger = Ledger(postgres.create_database("idle"))
    ledger.migrate()
    ledger.sync_inventory(DeviceInfo(i) for i in range(2))
    pings = []
    ping = ledger.engine.dialect.do_ping
    monkeypatch.setattr(ledger.engine.dialect, "do_ping",
                        lambda c: pings.append(c.info.backend_pid) or ping(c))
    checkouts = []
    event.listen(ledger.engine, "checkout", lambda c, r, p: checkouts.append(c.info.backend_pid))

    a = ledger.admit(Request("ann", "notebook", "a", 1))
    ledger.release(a.id)  # in use a moment ago: no ping
    assert len(checkouts) == 2 and pings == []

    dsn = f"dbname=idle user=gpulab host={postgres.sock}"
    with psycopg.connect(dsn, autocommit=True) as x:
        gone = {pid for (pid,) in x.execute(
            "SELECT pid FROM pg_stat_activity WHERE datname = 'idle' AND pid <> pg_backend_pid()")}
        x.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                  "WHERE datname = 'idle' AND pid <> pg_backend_pid()")
    assert checkouts[-1] in gone
    monkeypatch.setattr(db, "IDLE_PING_SECONDS", 0.0)
    b = ledger.admit(Request("bob", "notebook", "b", 1))  # the dead one is pinged, replaced
    assert b.devices == (0,)
    assert len(pings) == 1 and checkouts[-1] not in gone
    ledger.engine.dispose()


@pytest.mark.postgres
@pytest.mark.parametrize("conforming", ["on", "off"])
def test_names_and_times_reach_postgresql_exactly(postgres, conforming):
    """Admission sends its values to PostgreSQL as literals that psycopg's ClientCursor quotes
    (`_PgTx`): names that look like SQL (quotes, backslashes, a semicolon, a comment) are
    stored as they are and run nothing, also where a DBA turned ``standard_conforming_strings``
    off (backslashes then escape in plain literals); groups with such names go through the
    group quota; times come back to the last bit (a float written as a literal is read back
    exactly)."""
    import psycopg

    name = f"literals_{conforming}"
    url = postgres.create_database(name)
    with psycopg.connect(f"dbname={name} user=gpulab host={postgres.sock}",
                         autocommit=True) as x:
        x.execute(f"ALTER DATABASE {name} SET standard_conforming_strings TO {conforming}")
    ledger = Ledger(url)
    ledger.migrate()
    with ledger.engine.connect() as conn:  # the setting is in force on the ledger's connections
        assert conn.exec_driver_sql("SHOW standard_conforming_strings").scalar() == conforming
    ledger.sync_inventory(DeviceInfo(i, model="A'10\\") for i in range(3))
    ledger.set_quota("default", "", Quota(0), actor="test")
    user = "o'brien\\"
    group = "staff'); DROP TABLE quotas; --"
    ledger.set_quota("group", group, Quota(2), actor="test")
    holder = "x'; DELETE FROM allocations; --\\'"
    now = 1_765_000_000.123_456_7 + 2 ** -20  # not a short decimal
    a = ledger.admit(Request(user, "job", holder, 2, groups=(group, "{a,b}", "'"),
                             model="A'10\\"), now=now)
    assert (a.user, a.holder, a.devices, a.started_at) == (user, holder, (0, 1), now)
    got = ledger.get(a.id)
    assert (got.user, got.holder, got.model, got.started_at) == (user, holder, "A'10\\", now)
    # the quota came from the group whose name looks like SQL (the default allows none)
    with pytest.raises(AdmissionRefused, match="2 of your 2 GPUs"):
        ledger.admit(Request(user, "notebook", "n", 1, groups=(group,)))
    end = now + 1e-6
    closed = ledger.release(a.id, "why'; --", now=end)
    assert (closed.ended_at, closed.end_reason) == (end, "why'; --")
    with psycopg.connect(f"dbname={name} user=gpulab host={postgres.sock}") as x:
        assert x.execute("SELECT count(*) FROM quotas").fetchone()[0] == 2
        assert x.execute("SELECT count(*) FROM allocations").fetchone()[0] == 1
    # a device released at `end` starts the next allocation no earlier than `end`
    b = ledger.admit(Request(user, "job", "again", 1, groups=(group,), model="A'10\\"),
                     now=now)
    assert b.devices == (0,) and b.started_at == end
    ledger.engine.dispose()


@pytest.mark.postgres
def test_prepared_statements_last_and_come_back_after_a_discard(postgres, caplog):
    """Admission's statements are prepared once per connection (`_Statements`): sessions of
    others on the same pooled connection (readers end in a ROLLBACK, writers in a COMMIT) leave
    them be; where someone drops them between two transactions (``DEALLOCATE ALL``, or a
    pooler's ``DISCARD ALL``), the next admission or release prepares them again unseen."""
    import logging

    from sqlalchemy import text

    ledger = Ledger(postgres.create_database("prepared"))
    ledger.migrate()
    ledger.sync_inventory(DeviceInfo(i) for i in range(2))
    ledger.set_quota("default", "", Quota(2), actor="test")
    caplog.set_level(logging.INFO, logger="gpulab.ledger")
    for i in range(8):  # one thread: one pooled connection, shared by everything below
        a = ledger.admit(Request("ann", "job", f"j{i}", 1))
        assert ledger.get(a.id).open and len(ledger.open_allocations("ann")) == 1
        ledger.set_quota("user", "bob", Quota(1 + i % 2), actor="test")
        ledger.usage(0.0)
        assert ledger.release(a.id).ended_at is not None
    assert ledger.engine.pool.checkedin() == 1
    with ledger.engine.connect() as conn:
        names = conn.execute(text("SELECT name FROM pg_prepared_statements")).scalars().all()
    assert "gpulab_lock_person" in names and "gpulab_close" in names
    assert "were gone" not in caplog.text
    a = ledger.admit(Request("ann", "job", "before-deallocate", 2))
    with ledger.engine.connect() as conn:
        conn.execute(text("DEALLOCATE ALL"))
        conn.commit()
    assert ledger.release(a.id).ended_at is not None  # prepared again, then released
    assert caplog.text.count("were gone") == 1
    with ledger.engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        conn.execute(text("DISCARD ALL"))
    b = ledger.admit(Request("ann", "job", "after-discard", 2))
    assert b.devices == (0, 1) and caplog.text.count("were gone") == 2
    assert ledger.engine.pool.checkedin() == 1  # the same connection all along
    ledger.engine.dispose()


@pytest.mark.parametrize("where", ["sqlite", "postgresql"])
def test_an_allocation_keeps_its_time_limit(where, tmp_path, request):
    """Issue 37: the queue estimates from an allocation's time limit; every insert path keeps
    it (PostgreSQL's first try inserts with its own statement, `_INSERT_FIRST_FREE_PG`)."""
    if where == "sqlite":
        url = f"sqlite:///{tmp_path}/ledger.sqlite"
    else:
        url = request.getfixturevalue("postgres").create_database("limits")
    ledger = Ledger(url)
    ledger.migrate()
    ledger.sync_inventory(DeviceInfo(i) for i in range(2))
    job = ledger.admit(Request("ann", "job", "fast", 1, max_runtime=300.0))
    notebook = ledger.admit(Request("ann", "notebook", "default", 1))
    assert (job.max_runtime, notebook.max_runtime) == (300.0, None)
    assert {a.holder: a.max_runtime for a in ledger.open_allocations()} == {
        "fast": 300.0, "default": None}
    assert ledger.release(job.id).max_runtime == 300.0
