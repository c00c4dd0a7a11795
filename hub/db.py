"""The database under the quota ledger and the job tables: the engine and the migrations.

One SQL database holds both (SQLite in WAL mode by default, PostgreSQL in production). Its
tables derive from `Base`; Alembic's scripts are in ``hub/migrations`` (`alembic_config`),
run by `gpulab.hub.quota.ledger.Ledger.migrate`.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import create_engine, event
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
    # (`_Direct`); under one snapshot per transaction, taken before the pool's lock is granted,
    # two admissions hand out one GPU
    return create_engine(url, echo=echo, pool_pre_ping=True, pool_size=10, max_overflow=20,
                         isolation_level="READ COMMITTED")


def alembic_config(url: str):
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(Path(__file__).with_name("migrations")))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg
