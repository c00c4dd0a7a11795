"""`GPULedger`: where the hub and the gpulab service keep the quota ledger (``c.GPULedger``):
its database, its pool of GPUs and how often the service reconciles it. The hub's process
opens it with `gpulab.spawner.mixin.hub_ledger`."""

from __future__ import annotations

from traitlets import Float, Unicode
from traitlets.config import SingletonConfigurable

from gpulab.hub.quota.ledger import Ledger


class GPULedger(SingletonConfigurable):
    """Where the hub keeps its quota ledger (quotas, GPU allocations, audit trail)."""

    db_url = Unicode(
        "sqlite:///gpulab.sqlite",
        help="""SQLAlchemy URL of the quota ledger, shared by the hub and the gpulab service:
        ``sqlite:///<path>`` (the local default, ``<data-dir>/gpulab.sqlite``) or
        ``postgresql+psycopg://user:password@host/db`` in production.
        """,
    ).tag(config=True)

    pool = Unicode(
        "local",
        help="""Name of this hub's GPU pool in the ledger (``local`` for the embedded
        deployment, ``kubernetes`` for a cluster).""",
    ).tag(config=True)

    reconcile_interval = Float(
        60.0,
        help="""Seconds between two passes of the gpulab service over the open notebook
        allocations, closing those whose server the hub no longer has (a hub stopped in the
        middle of a spawn), and over the training jobs, stopping those of people whose hub
        account was deleted; 0 turns it off. Allocations younger than this (at least 30 s) are
        left alone.""",
    ).tag(config=True)

    _ledger: Ledger | None = None
