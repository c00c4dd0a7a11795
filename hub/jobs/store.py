"""The job tables (``jobs``, ``job_replicas``) and every SQL statement on them, in one place.

A job row keeps the spec (JSON), its state and reason in words, the allocation holding its
GPUs and its folder; a replica row its state, exit code, restarts and, locally, its process
(pid and start time, which guard against pid reuse), port and devices, and each of its
restarts (``restart_log``: when, which attempt, why). Jobs are kept as
history after they end: a person's job names are unique for good (``uq_jobs_user_name``).

`JobStore` is what the job workflow (`gpulab.hub.jobs.base`) and its drivers use: short
transactions, never held across a process start, an API request or a read of a person's
file. The tables are created by the ledger's migrations (``0002_jobs``, ``0004_restart_history``).
"""

from __future__ import annotations

import time
from typing import Iterable

from sqlalchemy import Float, ForeignKey, Integer, String, Text, UniqueConstraint, delete, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Mapped, mapped_column

from gpulab.extensions.contract import ACTIVE, FINAL
from gpulab.hub.db import Base
from gpulab.hub.jobs.spec import JobSpec
from gpulab.hub.quota.ledger import Allocation, Ledger


class JobRow(Base):
    """A training job and its history (kept after it ends)."""

    __tablename__ = "jobs"
    __table_args__ = (UniqueConstraint("user", "name", name="uq_jobs_user_name"),)
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    user: Mapped[str] = mapped_column(String(255), index=True)
    name: Mapped[str] = mapped_column(String(64))
    backend: Mapped[str] = mapped_column(String(32))
    spec: Mapped[str] = mapped_column(Text)  # JSON
    state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str] = mapped_column(Text, default="")
    allocation_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    job_dir: Mapped[str] = mapped_column(Text, default="")
    created_at: Mapped[float] = mapped_column(Float)
    started_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    finished_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class ReplicaRow(Base):
    __tablename__ = "job_replicas"
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    role: Mapped[str] = mapped_column(String(16), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    state: Mapped[str] = mapped_column(String(16), default="Pending")
    reason: Mapped[str] = mapped_column(Text, default="")
    pid: Mapped[int] = mapped_column(Integer, default=0)
    pid_started: Mapped[float] = mapped_column(Float, default=0.0)  # guards against pid reuse
    port: Mapped[int] = mapped_column(Integer, default=0)
    devices: Mapped[str] = mapped_column(Text, default="[]")
    restarts: Mapped[int] = mapped_column(Integer, default=0)
    exit_code: Mapped[int | None] = mapped_column(Integer, nullable=True)
    #: each restart (JSON list of `gpulab.extensions.joblog.restart_record`), oldest first
    restart_log: Mapped[str] = mapped_column(Text, default="[]", server_default="[]")


#: replica states a job's end turns into "Stopped"
LIVE_REPLICA_STATES = ("Pending", "Starting", "Running")


class NameTaken(Exception):
    """The person already has a job of that name (a concurrent submit took it first)."""


class JobStore:
    """The SQL of one backend's jobs (``backend`` is its ``name``) over the ledger's
    database. Queries by a person's job name look at that backend's jobs; the name rule and
    the replica bound look at all of the person's jobs."""

    def __init__(self, ledger: Ledger, backend: str):
        self.ledger = ledger
        self.backend = backend

    # -- reads ---------------------------------------------------------------------------

    @staticmethod
    def load(s, job_id: str) -> tuple[JobRow | None, list[ReplicaRow]]:
        """A job and its replicas, in session ``s``."""
        job = s.get(JobRow, job_id)
        reps = s.scalars(select(ReplicaRow).where(ReplicaRow.job_id == job_id)).all()
        return job, list(reps)

    def read(self, job_id: str) -> tuple[JobRow | None, list[ReplicaRow]]:
        with self.ledger.Reader() as s:
            return self.load(s, job_id)

    def find(self, user: str, name: str) -> tuple[JobRow | None, list[ReplicaRow]]:
        """A person's job by name (this backend's), with its replicas."""
        with self.ledger.Reader() as s:
            job = s.scalar(select(JobRow).where(JobRow.user == user, JobRow.name == name,
                                                JobRow.backend == self.backend))
            if job is None:
                return None, []
            return job, self.load(s, job.id)[1]

    def all(self, user: str | None = None) -> list[tuple[JobRow, list[ReplicaRow]]]:
        """This backend's jobs (a person's, or everyone's), newest first."""
        with self.ledger.Reader() as s:
            q = (select(JobRow).where(JobRow.backend == self.backend)
                 .order_by(JobRow.created_at.desc()))
            if user is not None:
                q = q.where(JobRow.user == user)
            return [(j, self.load(s, j.id)[1]) for j in s.scalars(q)]

    def active(self) -> list[tuple[JobRow, list[ReplicaRow]]]:
        """This backend's active jobs with their replicas."""
        with self.ledger.Reader() as s:
            q = select(JobRow).where(JobRow.state.in_(ACTIVE), JobRow.backend == self.backend)
            return [(j, self.load(s, j.id)[1]) for j in s.scalars(q)]

    def active_specs(self) -> list[tuple[str, str, str]]:
        """``(user, name, spec JSON)`` of this backend's active jobs: one query, no replicas."""
        with self.ledger.Reader() as s:
            return [tuple(r) for r in s.execute(select(JobRow.user, JobRow.name, JobRow.spec)
                                                .where(JobRow.state.in_(ACTIVE),
                                                       JobRow.backend == self.backend))]

    def active_owners(self) -> list[tuple[str, str]]:
        """``(user, name)`` of this backend's active jobs, waiting ones too."""
        with self.ledger.Reader() as s:
            return [tuple(r) for r in s.execute(select(JobRow.user, JobRow.name).where(
                JobRow.state.in_(ACTIVE), JobRow.backend == self.backend))]

    def active_ids(self, started: bool = False) -> list[str]:
        """This backend's active jobs; ``started``: not those that wait in the queue."""
        states = [x for x in ACTIVE if x != "Queued"] if started else list(ACTIVE)
        with self.ledger.Reader() as s:
            return list(s.scalars(select(JobRow.id).where(JobRow.state.in_(states),
                                                          JobRow.backend == self.backend)))

    def name_taken(self, user: str, name: str) -> bool:
        """Whether the person has a job of that name, on any backend, ended or not."""
        with self.ledger.Reader() as s:
            return s.scalar(select(JobRow.id).where(JobRow.user == user,
                                                    JobRow.name == name)) is not None

    def active_replicas(self, user: str) -> int:
        """The replicas of the person's active jobs, on every backend."""
        with self.ledger.Reader() as s:
            specs = s.scalars(select(JobRow.spec).where(JobRow.user == user,
                                                        JobRow.state.in_(ACTIVE))).all()
        return sum(JobSpec.model_validate_json(x).replica_count for x in specs)

    def active_allocations(self) -> set[str]:
        """The allocations held by active jobs (of every backend)."""
        with self.ledger.Reader() as s:
            return set(s.scalars(select(JobRow.allocation_id).where(JobRow.state.in_(ACTIVE))))

    def ended_among(self, job_ids: Iterable[str]) -> list[str]:
        """Those of ``job_ids`` that are known and no longer active."""
        ids = list(job_ids)
        if not ids:
            return []
        with self.ledger.Reader() as s:
            return list(s.scalars(select(JobRow.id).where(JobRow.id.in_(ids),
                                                          JobRow.state.not_in(ACTIVE))))

    # -- writes --------------------------------------------------------------------------

    def record(self, *, job_id: str, user: str, spec: JobSpec, allocation: Allocation | None,
               job_dir: str, replicas: list[dict], now: float | None = None) -> None:
        """A new job and its replicas (``replicas``: the columns of each replica row besides
        ``job_id``, in `JobSpec.replica_names` order): Admitted with its ``allocation``, or
        Queued without one. Raises `NameTaken` when a concurrent submit took the name first."""
        queued = allocation is None
        try:
            with self.ledger.Session.begin() as s:
                s.add(JobRow(id=job_id, user=user, name=spec.name, backend=self.backend,
                             spec=spec.model_dump_json(),
                             state="Queued" if queued else "Admitted",
                             reason="waiting for GPUs" if queued
                             else f"{_gpus(spec.total_gpus)} admitted",
                             allocation_id=None if queued else allocation.id, job_dir=job_dir,
                             created_at=time.time() if now is None else now))
                s.flush()
                for columns in replicas:
                    s.add(ReplicaRow(job_id=job_id, **columns))
        except IntegrityError as e:
            raise NameTaken(spec.name) from e

    def admit_queued(self, job_id: str, allocation: Allocation, replicas: list[dict]) -> bool:
        """A Queued job got its GPUs from the queue: Admitted with ``allocation``, each
        replica's columns (devices, port) as given. False when it no longer waits."""
        with self.ledger.Session.begin() as s:
            job, reps = self.load(s, job_id)
            if job is None or job.state != "Queued":
                return False
            job.state, job.allocation_id = "Admitted", allocation.id
            job.reason = f"{_gpus(allocation.gpus)} admitted from the queue"
            by = {(r.role, r.index): r for r in reps}
            for columns in replicas:
                r = by[(columns["role"], columns["index"])]
                for k, v in columns.items():
                    setattr(r, k, v)
        return True

    def note_queued(self, job_id: str, reason: str) -> bool:
        """A Queued job's reason (why it waits) as the cluster's queue says it now. False
        when it no longer waits."""
        with self.ledger.Session.begin() as s:
            job = s.get(JobRow, job_id)
            if job is None or job.state != "Queued":
                return False
            job.reason = reason[:1000]
        return True

    def requeue(self, job_id: str, reason: str, at: float | None = None) -> bool:
        """A preempted job back to Queued: its replicas Pending (their restarts kept), its
        GPUs released in the same commit (``at``: when it was preempted; default now). False
        when it was not active."""
        with self.ledger.Session.begin() as s:
            job, reps = self.load(s, job_id)
            if job is None or job.state in FINAL:
                return False
            alloc, job.allocation_id = job.allocation_id, None
            # max_runtime counts from the next start (the time it ran so far is not kept)
            job.state, job.reason, job.started_at = "Queued", reason, None
            for r in reps:
                r.state, r.reason, r.pid, r.pid_started, r.exit_code = (
                    "Pending", "preempted: waits with its job", 0, 0.0, None)
            if alloc:
                self.ledger.release(alloc, "job preempted", now=at, session=s)
        return True

    def remove(self, job_id: str) -> None:
        """A job that never started, forgotten (its submit was undone)."""
        with self.ledger.Session.begin() as s:
            s.execute(delete(ReplicaRow).where(ReplicaRow.job_id == job_id))
            s.execute(delete(JobRow).where(JobRow.id == job_id))

    def finish(self, job_id: str, state: str, reason: str, at: float | None = None) -> bool:
        """The job final, its live replicas stopped and its GPUs released, in one commit:
        nobody sees a finished job that still holds GPUs. ``at``: when it ended (default now;
        earlier for an end seen late, e.g. by a service that was down). False when it was
        already final."""
        with self.ledger.Session.begin() as s:
            job, reps = self.load(s, job_id)
            if job is None or job.state in FINAL:
                return False
            job.state, job.reason, job.finished_at = state, reason, time.time() if at is None else at
            for r in reps:
                if r.state in LIVE_REPLICA_STATES:
                    r.state, r.reason = "Stopped", "stopped with the job"
            if job.allocation_id:
                self.ledger.release(job.allocation_id, f"job {state.lower()}", now=at, session=s)
        return True


def _gpus(n: int) -> str:
    """``1 GPU``, ``2 GPUs`` (a job's reason, read by people)."""
    return f"{n} GPU{'' if n == 1 else 's'}"
