"""The ledger's hand-compiled SQL fast path: admission's and release's statements, built
once from the tables (`gpulab.hub.quota.rows`) and compiled once per database, run on the
DBAPI connection (`Direct`): on PostgreSQL an admission is two round trips (`_PgTx`: the
locks and reads; the insert and the commit), on SQLite one transaction under ``BEGIN
IMMEDIATE`` (`_SqliteTx`); a release is one ``UPDATE``. `gpulab.hub.quota.ledger.Ledger`
decides what is admitted; this module only reads and writes for it, fast."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import weakref
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable

from sqlalchemy import (
    BigInteger,
    Float,
    Integer,
    String,
    any_,
    bindparam,
    exists,
    func,
    literal_column,
    or_,
    select,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.engine import Engine
from sqlalchemy.exc import DBAPIError

from gpulab.hub.quota.rows import AllocationRow, Device, Pool, QuotaRow

log = logging.getLogger("gpulab.ledger")

_A, _D, _P, _Q = (AllocationRow.__table__, Device.__table__, Pool.__table__,
                  QuotaRow.__table__)


# admission's and release's statements, built once (building one costs more than running it
# on SQLite), and compiled once per database for the DBAPI connection (`Direct`)
_SEL_POOL = select(_P.c.assigns_devices).where(_P.c.name == bindparam("pool"))
#: PostgreSQL: the person's lock, and whether the pool exists (NULL: it does not)
_LOCK_PERSON = select(func.pg_advisory_xact_lock(bindparam("key", type_=BigInteger)),
                      _SEL_POOL.scalar_subquery())
#: PostgreSQL: the pool's row, locked, where the pool hands out devices (no row: it counts)
_LOCK_POOL = (select(_P.c.assigns_devices)
              .where(_P.c.name == bindparam("pool"), _P.c.assigns_devices != 0)
              .with_for_update())
#: the open allocations admission needs: everyone's where the pool hands out devices (who
#: holds which device), else the person's own (their quota covers their own holdings)
_SEL_OPEN_FOR = select(_A.c.user, _A.c.kind, _A.c.holder, _A.c.gpus, _A.c.devices).where(
    _A.c.pool == bindparam("pool"), _A.c.ended_at.is_(None),
    or_(_A.c.user == bindparam("user"),
        exists().where(_P.c.name == bindparam("pool"), _P.c.assigns_devices != 0)))
#: PostgreSQL, before the pool's lock: the person's own open allocations (their quota covers
#: them; which devices are free the insert finds out itself, `_INSERT_FIRST_FREE_PG`)
_SEL_OPEN_OF = select(_A.c.user, _A.c.kind, _A.c.holder, _A.c.gpus, _A.c.devices).where(
    _A.c.pool == bindparam("pool"), _A.c.ended_at.is_(None), _A.c.user == bindparam("user"))
_QUOTA_COLUMNS = (_Q.c.scope, _Q.c.name, _Q.c.max_gpus, _Q.c.max_per_request, _Q.c.gpu_hours,
                  _Q.c.window_hours, _Q.c.disk)


def _sel_quotas(in_groups):
    """The default quota, the person's and their groups' (`in_groups`: the name test)."""
    return select(*_QUOTA_COLUMNS).where(or_(
        _Q.c.scope == "default",
        (_Q.c.scope == "user") & (_Q.c.name == bindparam("user")),
        (_Q.c.scope == "group") & in_groups))


SEL_QUOTAS = _sel_quotas(_Q.c.name.in_(bindparam("groups", expanding=True)))
#: every quota row (default, groups, people): what `Ledger.effective_of` splits for many
#: people at once (the table holds a row per override, not per person)
SEL_ALL_QUOTAS = select(*_QUOTA_COLUMNS)
#: the same with the groups as one parameter, the same statement for any number of groups:
#: a PostgreSQL array, a JSON list on SQLite
_SEL_QUOTAS_PG = _sel_quotas(_Q.c.name == any_(bindparam("groups", type_=ARRAY(String))))
_SEL_QUOTAS_SQLITE = _sel_quotas(_Q.c.name.in_(
    select(literal_column("value")).select_from(func.json_each(bindparam("groups")))))
_SEL_DEVICES = select(_D.c.index, _D.c.model).where(_D.c.pool == bindparam("pool")).order_by(
    _D.c.index)
_USED_END = func.coalesce(_A.c.ended_at, bindparam("until", type_=Float))
SEL_USED = select(_A.c.user, _A.c.gpus, _A.c.started_at, _USED_END).where(
    _A.c.gpus > 0, _A.c.started_at < bindparam("until", type_=Float),
    _USED_END > bindparam("since", type_=Float))
SEL_USED_OF = SEL_USED.where(_A.c.user == bindparam("user"))
#: a pool nobody declared, made by its first admission; on PostgreSQL two first admissions
#: may run at once (different people; or one person's, whose lock statement read the pool's
#: row in a snapshot taken before the lock was granted): the second finds the row made
_INSERT_POOL = _P.insert()
_INSERT_POOL_PG = pg_insert(_P).on_conflict_do_nothing(index_elements=[_P.c.name])
#: PostgreSQL, the pool locked: the allocation with the first `gpus` of `candidates` that no
#: open allocation holds, where there are that many. It starts at `started_at` (the admission's
#: clock, read before the lock) or, where a device it takes was released later than that, at
#: that release: the history never shows a device held twice at once
_INSERT_FIRST_FREE_PG = text("""
WITH recent AS (
    SELECT CAST(a.devices AS jsonb) AS devices, a.ended_at FROM allocations a
    WHERE a.pool = :pool AND (a.ended_at IS NULL OR a.ended_at > :started_at)
), free AS (
    SELECT c.i, c.o FROM unnest(CAST(:candidates AS integer[])) WITH ORDINALITY AS c(i, o)
    WHERE NOT EXISTS (SELECT 1 FROM recent r
                      WHERE r.ended_at IS NULL AND r.devices @> to_jsonb(c.i))
    ORDER BY c.o LIMIT :gpus
), pick AS (
    SELECT json_agg(free.i ORDER BY free.o)::text AS devices, count(*) AS n,
           GREATEST(:started_at, (SELECT max(r.ended_at) FROM recent r, free f
                                  WHERE r.devices @> to_jsonb(f.i))) AS started_at
    FROM free
)
INSERT INTO allocations (id, pool, kind, holder, "user", gpus, model, devices, started_at,
                         ended_at, end_reason, max_runtime)
SELECT :id, :pool, :kind, :holder, :user, :gpus, :model, pick.devices, pick.started_at, NULL, '',
       CAST(:max_runtime AS double precision)
FROM pick WHERE pick.n = :gpus
RETURNING devices, started_at""").bindparams(bindparam("started_at", type_=Float),
                                 bindparam("candidates", type_=ARRAY(Integer)))
_INSERT_ALLOCATION = _A.insert()
CLOSE = (_A.update().where(_A.c.id == bindparam("alloc"), _A.c.ended_at.is_(None))
          .values(ended_at=bindparam("at"), end_reason=bindparam("why")).returning(*_A.c))


class _Sql:
    """A Core statement compiled once for one database, run on the DBAPI connection."""

    __slots__ = ("text", "names", "fixed")

    def __init__(self, stmt, dialect):
        compiled = stmt.compile(dialect=dialect)
        self.text = compiled.string
        #: the parameters' order where the DBAPI's are positional (SQLite's ``?``)
        self.names = compiled.positiontup
        #: the statement's own values (the ``'default'`` of a ``scope = 'default'``)
        self.fixed = {k: v for k, v in compiled.params.items() if v is not None}

    def __call__(self, **values):
        args = {**self.fixed, **values}
        return self.text, args if self.names is None else [args[n] for n in self.names]


#: the transaction's ends in a `_PgTx` query (`_Statements.batch`)
_BEGIN = "BEGIN ISOLATION LEVEL READ COMMITTED"
_COMMIT = "COMMIT"
#: the statements `_PgTx` runs, prepared on each connection before its first use
_PG_PREPARED = ("lock_person", "lock_pool", "open", "open_mine", "quotas", "devices",
                "used", "insert_first_free", "insert", "insert_pool", "close")
_PLACEHOLDER = re.compile(r"%\((\w+)\)s|%%")


class _Batch:
    """Statements joined into one query string, with their fixed values."""

    __slots__ = ("text", "fixed")

    def __init__(self, text: str, fixed: dict):
        self.text, self.fixed = text, fixed


class _Statements(dict):
    """The `_Sql` statements of one database by name, and the batches of them that `_PgTx`
    sends as one query (built once each).

    Where `prepared` names statements (PostgreSQL), a batch runs them as ``EXECUTE
    gpulab_<name>(<values>)`` of server-side prepared statements: the server parses each
    once per connection, not at every admission (and plans it as for any prepared
    statement), and the values are arguments, not part of a statement's text. `prepare` is
    the query that prepares them all; `ready` the connections it ran on."""

    def __init__(self, statements: dict, dialect, prepared: Iterable[str] = ()):
        super().__init__((name, _Sql(stmt, dialect)) for name, stmt in statements.items())
        self._batches: dict[tuple, _Batch] = {}
        self._execute: dict[str, str] = {}
        prepares = []
        for name in prepared:
            order: list[str] = []

            def numbered(m, order=order):
                if m.group(1) is None:  # ``%%``: a literal percent sign
                    return "%"
                if m.group(1) not in order:
                    order.append(m.group(1))
                return f"${order.index(m.group(1)) + 1}"

            body = _PLACEHOLDER.sub(numbered, self[name].text)
            prepares.append(f"PREPARE gpulab_{name} AS {body}")
            args = ", ".join(f"%({n})s" for n in order)
            self._execute[name] = f"EXECUTE gpulab_{name}({args})"
        self.prepare = ";\n".join(prepares)
        self.ready: weakref.WeakSet = weakref.WeakSet()

    def batch(self, names: tuple) -> _Batch:
        got = self._batches.get(names)
        if got is None:
            texts, fixed = [], {}
            for name in names:
                if name in (_BEGIN, _COMMIT):
                    texts.append(name)
                    continue
                one = self[name]
                for key, value in one.fixed.items():
                    # two statements compiled apart may name their own values alike
                    # (``assigns_devices_1``): they must mean the same value
                    if fixed.setdefault(key, value) != value:
                        raise RuntimeError(f"{names}: {key!r} is {fixed[key]!r} and {value!r}")
                texts.append(self._execute.get(name, one.text))
            got = self._batches[names] = _Batch(";\n".join(texts), fixed)
        return got


class Direct:
    """Admission and release on the DBAPI connection itself, without SQLAlchemy's
    ``Connection`` (measured: SQLAlchemy's execution costs more than SQLite's own work for these
    small statements, see bench/admission.py). The statements are the Core ones above, compiled
    once; the connection comes from the engine's pool (pinged where it sat idle, `gpulab.hub.db`).

    On SQLite the process's write lock (`_Writers`) is held around the transaction, which begins
    with ``BEGIN IMMEDIATE`` (the database's write lock). On PostgreSQL each step is one round
    trip, its statements sent as one query (`_PgTx`): the ``BEGIN``, the locks and the reads
    together, then the insert with the ``COMMIT``; a release is ``BEGIN``, ``UPDATE …
    RETURNING``, ``COMMIT`` in one. The reads still run after the locks are granted: the
    server runs the statements one after another, and each statement of a read-committed
    transaction reads a snapshot taken when it starts."""

    def __init__(self, engine: Engine, lock):
        self.engine, self.lock = engine, lock
        self.pg = engine.dialect.name == "postgresql"
        statements = dict(pool=_SEL_POOL, open=_SEL_OPEN_FOR, devices=_SEL_DEVICES,
                          used=SEL_USED_OF, insert_pool=_INSERT_POOL,
                          insert=_INSERT_ALLOCATION, close=CLOSE)
        if self.pg:
            statements.update(lock_person=_LOCK_PERSON, lock_pool=_LOCK_POOL,
                              open_mine=_SEL_OPEN_OF, quotas=_SEL_QUOTAS_PG,
                              insert_first_free=_INSERT_FIRST_FREE_PG,
                              insert_pool=_INSERT_POOL_PG)
        else:
            statements.update(quotas=_SEL_QUOTAS_SQLITE)
        self.sql = _Statements(statements, engine.dialect, _PG_PREPARED if self.pg else ())

    @contextmanager
    def transaction(self):
        """A `_PgTx` or `_SqliteTx` on a connection of the pool; rolled back on any error (a
        refusal too: nothing was written). The database's errors are raised as SQLAlchemy's
        (``sqlalchemy.exc.IntegrityError``, ``OperationalError``, … with the driver's as
        ``orig``), as a ``Connection`` raises them, and a lost connection is dropped."""
        dialect = self.engine.dialect
        kind = _PgTx if self.pg else _SqliteTx
        with self.lock:
            raw = self.engine.raw_connection()
            c = raw.driver_connection
            try:
                try:
                    yield kind(c, self.sql)
                except BaseException as e:
                    from_db = isinstance(e, dialect.loaded_dbapi.Error)
                    lost = from_db and (dialect.is_disconnect(e, raw, None)
                                        or kind.unprepared(e))
                    if not lost:
                        try:
                            c.rollback()
                        except Exception:  # a broken connection
                            lost = True
                        else:
                            lost = not _put_back(kind, c)
                    if lost:  # the pool drops it
                        raw.invalidate(e if isinstance(e, Exception) else None)
                    if from_db:
                        raise DBAPIError.instance(
                            None, None, e, dialect.loaded_dbapi.Error, hide_parameters=True,
                            connection_invalidated=lost, dialect=dialect) from e
                    raise
                else:
                    if not _put_back(kind, c):
                        raw.invalidate()
            finally:
                raw.close()


def _put_back(kind, c) -> bool:
    """``kind.put_back(c)``; False where the connection cannot be handed back as it was
    given (the pool then drops it)."""
    try:
        kind.put_back(c)
    except Exception:
        log.exception("A ledger connection could not be put back; it is dropped")
        return False
    return True


class _SqliteTx:
    #: one attempt: ``BEGIN IMMEDIATE`` serializes every writer, the pool is always locked
    attempts = (True,)

    def __init__(self, c, sql):
        self.c, self.sql = c, sql

    def lock_and_read(self, pool: str, user: str, groups, pool_locked: bool = True):
        """``(pool known, hands out devices, open rows, quota rows, device rows)``"""
        c, sql = self.c, self.sql
        c.execute("BEGIN IMMEDIATE")  # the database's write lock: admissions are serialized
        kind = c.execute(*sql["pool"](pool=pool)).fetchone()
        assigns = bool(kind and kind[0])
        return (
            kind is not None, assigns,
            [_open(r) for r in c.execute(*sql["open"](pool=pool, user=user))],
            c.execute(*sql["quotas"](user=user, groups=json.dumps(sorted(set(groups))))).fetchall(),
            c.execute(*sql["devices"](pool=pool)).fetchall() if assigns else [])

    def used(self, since: float, until: float, user: str):
        return self.c.execute(*self.sql["used"](since=since, until=until, user=user)).fetchall()

    def write_and_commit(self, new_pool: str | None, allocation: dict) -> None:
        if new_pool is not None:
            self.c.execute(*self.sql["insert_pool"](name=new_pool, assigns_devices=0))
        self.c.execute(*self.sql["insert"](**allocation))
        self.c.execute("COMMIT")

    @staticmethod
    def put_back(c) -> None:
        pass

    @staticmethod
    def unprepared(e: Exception) -> bool:
        return False

    def close_and_commit(self, args: dict):
        self.c.execute("BEGIN IMMEDIATE")
        rows = self.c.execute(*self.sql["close"](**args)).fetchall()
        self.c.execute("COMMIT")
        return rows[0] if rows else None


class _PgTx:
    """Admission and release on PostgreSQL, each step one round trip of the simple query
    protocol: the transaction's statements travel as one query string (``BEGIN``, the locks
    and the reads; the insert and ``COMMIT``), each an ``EXECUTE`` of a statement prepared on
    the connection before its first use (`_Statements`), its arguments bound on the client by
    psycopg's ``ClientCursor``, which quotes each as a literal (never text spliced in by
    hand). The server runs them one after another, and each statement of a read-committed
    transaction reads a snapshot taken when it starts, so the reads see every commit made
    before the locks were granted.

    Measured against psycopg's pipeline mode (the same statements, the same round trips, one
    thread): per admission and release, the client's CPU 0.95 against 0.62 ms, the server's
    0.62 against 0.58 ms (a pool that hands out devices; one that counts GPUs 0.78 against
    0.47 and 0.50 against 0.35 ms). Under contention admission is bound by the client's CPU
    (bench/admission.py: 20 threads of one process, 2 cores). One cost: where a statement
    fails, the server's log (``log_min_error_statement``) shows the ``EXECUTE`` with its
    arguments (names of people, groups and jobs), where the extended protocol showed
    placeholders.

    The connection is in autocommit mode while it runs them (the transaction is in the text,
    ``BEGIN ISOLATION LEVEL READ COMMITTED``); `put_back` puts it back for the pool."""

    #: first without the pool's lock (`insert_first_free` takes it), then, where the devices
    #: chosen were taken meanwhile, with it
    attempts = (False, True)

    def __init__(self, c, sql):
        from psycopg import ClientCursor
        from psycopg.pq import ExecStatus

        c.autocommit = True  # no implicit ``BEGIN`` round trip: the query text begins it
        self.c, self.sql, self.cur = c, sql, ClientCursor(c)
        self.rows = ExecStatus.TUPLES_OK  # a statement's result that has rows
        if c not in sql.ready:  # a new connection: one round trip more, once
            self.cur.execute(sql.prepare)
            sql.ready.add(c)

    def _run(self, names, values: dict) -> list:
        """Run the statements `names` (keys of ``sql``, or raw SQL for ``BEGIN`` and
        ``COMMIT``) as one query; the rows of each (None where it returns none)."""
        batch, cur = self.sql.batch(names), self.cur
        try:
            cur.execute(batch.text, {**batch.fixed, **values})
        except Exception as e:
            # the prepared statements were dropped since this connection last ran them (a
            # ``DEALLOCATE ALL`` or ``DISCARD ALL`` by someone else between two transactions:
            # nothing of this one has run yet): prepared anew, and the query once more
            if names[0] != _BEGIN or not self.unprepared(e):
                raise
            log.info("The ledger's prepared statements were gone on a connection; preparing")
            self.c.rollback()
            cur.execute(self.sql.prepare)
            cur.execute(batch.text, {**batch.fixed, **values})
        out = []
        while True:  # (``description`` would build the columns' objects each time)
            out.append(cur.fetchall() if cur.pgresult.status == self.rows else None)
            if not cur.nextset():
                return out

    def lock_and_read(self, pool: str, user: str, groups, pool_locked: bool):
        """``(pool known, hands out devices, open rows, quota rows, device rows)``; one round
        trip. The locks: the person's (advisory), and where `pool_locked` the pool's row if it
        hands out devices (`_LOCK_POOL`). The person's lock serializes their admissions, which
        is all their quota needs (their holdings change otherwise only by releases). A pool
        that only counts GPUs (Kubernetes: the scheduler places them) needs nothing more, so
        different people are admitted in parallel; one that hands out devices is locked whole,
        for the reads (`pool_locked`) or only for the insert (`insert_first_free`). Without
        the pool's lock only the person's own open allocations are read: the insert finds
        the free devices itself, and where too few are, the reads with the lock say why."""
        names = (_BEGIN, "lock_person", "lock_pool", "open", "quotas", "devices") if pool_locked \
            else (_BEGIN, "lock_person", "open_mine", "quotas", "devices")
        got = self._run(names, dict(key=person_key(pool, user), pool=pool, user=user,
                                    groups=sorted(set(groups))))
        person, open_rows, quotas, devices = got[1], got[-3], got[-2], got[-1]
        known = person[0][1]
        assigns = bool(got[2]) if pool_locked else bool(known)
        return (known is not None, assigns, [_open(r) for r in open_rows], quotas,
                devices if assigns else [])

    def insert_first_free(self, row: dict, candidates: list[int]):
        """Lock the pool, insert the allocation with the first ``row['gpus']`` of
        `candidates` (device indices, in order) that no open allocation holds, and commit:
        one round trip, the pool locked only while the server runs the insert. ``(devices,
        start)``, or None where too few were free (the transaction then wrote nothing).

        The start is ``row['started_at']`` (the admission's clock, read before the lock) or
        the latest release of a device taken, where that is later: the history must never
        show a device held twice at once (see `Ledger._admit`)."""
        got = self._run(("lock_pool", "insert_first_free", _COMMIT),
                        dict(row, candidates=candidates))[1]
        return (json.loads(got[0][0]), got[0][1]) if got else None

    def used(self, since: float, until: float, user: str):
        return self._run(("used",), dict(since=since, until=until, user=user))[0]

    def write_and_commit(self, new_pool: str | None, allocation: dict) -> None:
        if new_pool is None:
            self._run(("insert", _COMMIT), allocation)
        else:
            self._run(("insert_pool", "insert", _COMMIT),
                      dict(allocation, name=new_pool, assigns_devices=0))

    def close_and_commit(self, args: dict):
        # ``BEGIN``, the ``UPDATE`` and ``COMMIT`` in one round trip, in a transaction of the
        # engine's isolation (an autocommitted statement would run at the server's default)
        rows = self._run((_BEGIN, "close", _COMMIT), args)[1]
        return rows[0] if rows else None

    @staticmethod
    def put_back(c) -> None:
        """Hand the connection back as the pool gave it (not autocommitting)."""
        c.autocommit = False

    @staticmethod
    def unprepared(e: Exception) -> bool:
        """Whether `e` says the connection's prepared statements are gone (a ``DEALLOCATE
        ALL`` or ``DISCARD ALL``, as a pooler in front of the server may send) or half there.
        At a transaction's start `_run` prepares them again; elsewhere the pool drops the
        connection, and the next one prepares them anew."""
        return getattr(e, "sqlstate", None) in ("26000", "42P05")


def person_key(pool: str, user: str) -> int:
    """The advisory lock's key of one person's admissions to one pool."""
    return int.from_bytes(hashlib.blake2b(f"{pool}\0{user}".encode(), digest_size=8).digest(),
                          "big", signed=True)


def _open(row) -> "_Open":
    user, kind, holder, gpus, devices = row
    return _Open(user, kind, holder, gpus, json.loads(devices or "[]"))


@dataclass(frozen=True)
class _Open:
    """An open allocation as admission reads it."""

    user: str
    kind: str
    holder: str
    gpus: int
    devices: list
