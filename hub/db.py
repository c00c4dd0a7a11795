"""The database under the quota ledger and the job tables: the engine and the migrations.

One SQL database holds both (SQLite in WAL mode by default, PostgreSQL in production). Its
tables derive from `Base`; Alembic's scripts are in ``hub/migrations`` (`alembic_config`),
run by `gpulab.hub.quota.ledger.Ledger.migrate`.
"""

from __future__ import annotations

import math
import sqlite3
import time
from pathlib import Path

from sqlalchemy import create_engine, event, exc
from sqlalchemy.engine import Engine
from sqlalchemy.orm import DeclarativeBase


class Base(DeclarativeBase):
    pass


def make_engine(url: str, echo: bool = False) -> Engine:
    if url.startswith("sqlite"):
        engine = create_engine(url, echo=echo, connect_args={"timeout": 60})

        @event.listens_for(engine, "connect")
        def _sqlite_connect(dbapi_conn, _record):
            dbapi_conn.isolation_level = None  # SQLAlchemy emits BEGIN itself (below)
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA busy_timeout=60000")
            cur.execute("PRAGMA foreign_keys=ON")
            try:  # the queue sums decayed GPU use in SQL (`Queue._decayed_usage`)
                cur.execute("SELECT exp(0)")
            except sqlite3.OperationalError:  # an SQLite built without its math functions
                dbapi_conn.create_function("exp", 1, math.exp, deterministic=True)
            cur.close()

        @event.listens_for(engine, "begin")
        def _sqlite_begin(conn):
            # writers take the database lock at BEGIN: admission reads and writes atomically;
            # `Ledger.Reader` sessions read a snapshot without it
            if conn.get_execution_options().get("gpulab_read_only"):
                conn.exec_driver_sql("BEGIN")
            else:
                conn.exec_driver_sql("BEGIN IMMEDIATE")

        return engine
    # read committed whatever the server's default (a DBA may make it repeatable read or
    # serializable): admission reads after its locks, each statement in a snapshot of its own
    # (`gpulab.hub.quota.fastpath.Direct`); under one snapshot per transaction, taken before
    # the pool's lock is granted, two admissions hand out one GPU.
    # psycopg's own statement preparing off: the ledger prepares its admission statements on
    # each connection (`gpulab.hub.quota.fastpath._Statements`), and psycopg sends ``DEALLOCATE
    # ALL`` at every ROLLBACK of a connection where it has prepared statements of its own
    # (which also wipes its own count of uses, so that sessions that end in a rollback, the
    # readers, seldom reached its threshold of five anyway)
    engine = create_engine(url, echo=echo, pool_size=10, max_overflow=20,
                           isolation_level="READ COMMITTED",
                           connect_args={"prepare_threshold": None})
    _ping_when_idle(engine)
    return engine


#: a pooled PostgreSQL connection idle for longer than this is pinged before it is handed out
IDLE_PING_SECONDS = 1.0


def _ping_when_idle(engine: Engine) -> None:
    """SQLAlchemy's ``pool_pre_ping``, but only for a connection that sat in the pool for
    longer than `IDLE_PING_SECONDS`: one that was in use a moment ago is handed out without
    a round trip. Under load (bench/admission.py) that is a ping less for every admission and
    every release; a quiet service pings as before, so a connection the server dropped while
    it was idle (a restart, an idle timeout, a proxy) is replaced before anyone uses it. One
    that dies within the second after its last use fails that one transaction, which is
    rolled back and its connection dropped (`gpulab.hub.quota.fastpath.Direct`, SQLAlchemy's
    ``Connection``)."""

    @event.listens_for(engine, "checkin")
    def _checked_in(_dbapi_conn, record):
        if record is not None:
            record.info["gpulab_idle_since"] = time.monotonic()

    @event.listens_for(engine, "checkout")
    def _checked_out(dbapi_conn, record, _proxy):
        since = record.info.get("gpulab_idle_since")
        if since is None or time.monotonic() - since <= IDLE_PING_SECONDS:
            return  # new, or in use a moment ago
        try:
            engine.dialect.do_ping(dbapi_conn)
        except engine.dialect.loaded_dbapi.Error as e:
            # the pool drops this connection and checks out another (up to three tries)
            raise exc.DisconnectionError(f"a pooled connection is gone: {e}") from e


def alembic_config(url: str):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).with_name("migrations")))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg
