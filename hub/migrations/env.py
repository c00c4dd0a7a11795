"""Alembic environment of the gpulab ledger (run through `gpulab.hub.quota.ledger.Ledger.migrate`)."""

from alembic import context
from sqlalchemy import create_engine

from gpulab.hub.db import Base
import gpulab.hub.quota.rows  # noqa: F401  the tables
import gpulab.hub.quota.waiting  # noqa: F401
import gpulab.hub.jobs.store  # noqa: F401

config = context.config
target_metadata = Base.metadata


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata,
                          render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(config.get_main_option("sqlalchemy.url"))
    with engine.connect() as conn:
        context.configure(connection=conn, target_metadata=target_metadata, render_as_batch=True)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    context.configure(url=config.get_main_option("sqlalchemy.url"), target_metadata=target_metadata,
                      literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()
else:
    run_migrations_online()
