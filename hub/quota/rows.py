"""The quota ledger's tables (SQLAlchemy 2 ORM rows; their migrations are
``hub/migrations``): GPU pools and their devices, quotas and their audit trail, allocations.
`gpulab.hub.quota.ledger.Ledger` is the API over them; `gpulab.hub.quota.fastpath` runs
admission's and release's statements on them directly."""

from __future__ import annotations

from sqlalchemy import BigInteger, Float, ForeignKey, Index, Integer, String, Text, UniqueConstraint
from sqlalchemy.orm import Mapped, mapped_column

from gpulab.hub.db import Base
from gpulab.hub.quota.policy import Quota

KINDS = ("notebook", "job")


class Pool(Base):
    """A set of GPUs handed out together; its row is the admission lock."""

    __tablename__ = "pools"
    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    #: whether the pool hands out device indices (local) or only counts (Kubernetes)
    assigns_devices: Mapped[int] = mapped_column(Integer, default=1)


class Device(Base):
    __tablename__ = "devices"
    pool: Mapped[str] = mapped_column(ForeignKey("pools.name"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    uuid: Mapped[str] = mapped_column(String(128), default="")
    model: Mapped[str] = mapped_column(String(128), default="")
    memory_mib: Mapped[int] = mapped_column(Integer, default=0)
    simulated: Mapped[int] = mapped_column(Integer, default=0)


class QuotaRow(Base):
    __tablename__ = "quotas"
    __table_args__ = (UniqueConstraint("scope", "name", name="uq_quotas_scope_name"),)
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    scope: Mapped[str] = mapped_column(String(16))  # default | group | user
    name: Mapped[str] = mapped_column(String(255), default="")
    max_gpus: Mapped[int] = mapped_column(Integer)
    max_per_request: Mapped[int | None] = mapped_column(Integer, nullable=True)
    gpu_hours: Mapped[float | None] = mapped_column(Float, nullable=True)
    window_hours: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: the person's disk on the shared storage, bytes (None: this quota sets none)
    disk: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    updated_at: Mapped[float] = mapped_column(Float)
    updated_by: Mapped[str] = mapped_column(String(255), default="")

    def quota(self) -> Quota:
        return Quota(self.max_gpus, self.max_per_request, self.gpu_hours, self.window_hours,
                     self.disk)


class AuditRow(Base):
    __tablename__ = "quota_audit"
    id: Mapped[int] = mapped_column(Integer, primary_key=True, autoincrement=True)
    at: Mapped[float] = mapped_column(Float, index=True)
    actor: Mapped[str] = mapped_column(String(255))
    scope: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(255), default="")
    old: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON
    new: Mapped[str | None] = mapped_column(Text, nullable=True)  # JSON


class AllocationRow(Base):
    __tablename__ = "allocations"
    __table_args__ = (
        Index("ix_allocations_open", "ended_at", "pool"),
        Index("ix_allocations_user_time", "user", "started_at"),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    pool: Mapped[str] = mapped_column(ForeignKey("pools.name"))
    kind: Mapped[str] = mapped_column(String(16))  # notebook | job
    holder: Mapped[str] = mapped_column(String(255))
    user: Mapped[str] = mapped_column(String(255))
    gpus: Mapped[int] = mapped_column(Integer)
    model: Mapped[str | None] = mapped_column(String(128), nullable=True)
    devices: Mapped[str] = mapped_column(Text, default="[]")  # JSON list of indices
    started_at: Mapped[float] = mapped_column(Float)
    ended_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    end_reason: Mapped[str] = mapped_column(String(255), default="")
    #: the work's time limit in seconds (a job's ``max_runtime``); None: none (a notebook).
    #: The queue's estimates read it: the GPUs come back by ``started_at + max_runtime``.
    max_runtime: Mapped[float | None] = mapped_column(Float, nullable=True)
