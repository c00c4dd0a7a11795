"""The quota ledger: quotas, GPU allocations and the audit trail, in one SQL database.

SQLAlchemy 2 with Alembic migrations (`gpulab.hub.db`); SQLite in WAL mode by
default, PostgreSQL in production. Both the hub (notebook servers) and the gpulab service
(training jobs, quota edits) write here.

Admission is one transaction: first a lock (on SQLite ``BEGIN IMMEDIATE`` serialises
writers; on PostgreSQL the pool's row ``FOR UPDATE`` where the pool hands out devices, else a
per-person advisory lock, see `_PgTx.lock_and_read`), then the effective quota, the user's
current holdings, the GPU-hours used in the quota's window and the free devices are read, and
the allocation is written, so concurrent requests can never exceed a quota or hand a GPU out
twice. A request is admitted whole or refused whole. A release is one ``UPDATE``. Both run
prebuilt statements on the DBAPI connection (`_Direct`): on PostgreSQL an admission is two
round trips (locks and reads; insert and commit), a release one.

Times are seconds since the epoch (floats), the same on every database.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
import uuid
import weakref
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterable

from sqlalchemy import (
    BigInteger,
    bindparam,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
    any_,
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
from sqlalchemy.orm import Mapped, Session, mapped_column, sessionmaker

from gpulab.hub.db import Base, alembic_config, make_engine
from gpulab.hub.quota.policy import (Holding, Quota, QuotaError, effective_disk, effective_quota,
                                     refusal)

log = logging.getLogger("gpulab.ledger")

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


@dataclass(frozen=True)
class Allocation:
    id: str
    pool: str
    kind: str
    holder: str
    user: str
    gpus: int
    model: str | None
    devices: tuple[int, ...]
    started_at: float
    ended_at: float | None = None
    end_reason: str = ""
    max_runtime: float | None = None

    @classmethod
    def of(cls, row: AllocationRow) -> "Allocation":
        return cls(row.id, row.pool, row.kind, row.holder, row.user, row.gpus, row.model,
                   tuple(json.loads(row.devices or "[]")), row.started_at, row.ended_at,
                   row.end_reason, row.max_runtime)

    @property
    def open(self) -> bool:
        return self.ended_at is None

    def as_dict(self) -> dict:
        return {
            "id": self.id, "kind": self.kind, "holder": self.holder, "user": self.user,
            "gpus": self.gpus, "model": self.model, "devices": list(self.devices),
            "started_at": self.started_at, "ended_at": self.ended_at,
            "end_reason": self.end_reason,
        }


@dataclass(frozen=True)
class DeviceInfo:
    index: int
    uuid: str = ""
    model: str = ""
    memory_mib: int = 0
    simulated: bool = False


@dataclass(frozen=True)
class Request:
    user: str
    kind: str  # notebook | job
    holder: str
    gpus: int
    groups: tuple[str, ...] = ()
    model: str | None = None
    model_matches: Callable[[str | None, str], bool] | None = field(default=None, compare=False)
    #: the work's time limit in seconds (None: none), kept with its allocation
    max_runtime: float | None = None


class AdmissionRefused(Exception):
    """Base of the refusals; ``message`` is written for the person asking."""

    status = 409

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class QuotaExceeded(AdmissionRefused):
    pass


class NotEnoughGPUs(AdmissionRefused):
    def __init__(self, message: str, *, requested: int, free: int, matching: int):
        super().__init__(message)
        self.requested, self.free, self.matching = requested, free, matching


class BadRequest(AdmissionRefused):
    status = 400


def _exact_model(wanted: str | None, model: str) -> bool:
    return wanted is None or wanted == model


class Ledger:
    """The ledger over one database; thread-safe (a session per call)."""

    def __init__(self, url: str, *, pool: str = "local", echo: bool = False):
        self.url = url
        self.pool = pool
        self.engine = make_engine(url, echo=echo)
        #: write sessions (``Session.begin()``): on SQLite the threads of one process take
        #: turns on a lock before ``BEGIN IMMEDIATE``, so they queue in the process instead of
        #: polling the database's lock with SQLite's busy handler (sleeps of up to 100 ms that
        #: made admission's p99 latency seconds under contention); other processes (the hub,
        #: the gpulab service) still wait on the database's lock itself
        self.Session = _Writers(sessionmaker(self.engine, expire_on_commit=False),
                                threading.RLock() if url.startswith("sqlite") else None)
        #: admission and release: prebuilt statements on the DBAPI connection, same lock
        self._direct = _Direct(self.engine, self.Session.lock)
        #: sessions that only read: on SQLite they take no write lock (a deferred ``BEGIN``
        #: reads a WAL snapshot), so a reader never waits for an admission nor holds one up
        self.Reader = sessionmaker(self.engine.execution_options(gpulab_read_only=True),
                                   expire_on_commit=False)

    # -- schema --------------------------------------------------------------------------

    def migrate(self) -> None:
        """Bring the schema to the newest revision (Alembic ``upgrade head``)."""
        from alembic import command

        with self.engine.begin() as conn:
            cfg = alembic_config(self.url)
            cfg.attributes["connection"] = conn
            command.upgrade(cfg, "head")

    def ensure_pool(self, assigns_devices: bool = True) -> None:
        with self.Session.begin() as s:
            row = s.get(Pool, self.pool)
            if row is None:
                s.add(Pool(name=self.pool, assigns_devices=int(assigns_devices)))
            else:
                row.assigns_devices = int(assigns_devices)

    def sync_inventory(self, devices: Iterable[DeviceInfo]) -> None:
        """Record the pool's devices (the hub does this at start-up)."""
        devices = list(devices)
        self.ensure_pool(assigns_devices=True)
        with self.Session.begin() as s:
            existing = {d.index: d for d in s.scalars(select(Device).where(Device.pool == self.pool))}
            for d in devices:
                row = existing.pop(d.index, None) or Device(pool=self.pool, index=d.index)
                row.uuid, row.model, row.memory_mib = d.uuid, d.model, d.memory_mib
                row.simulated = int(d.simulated)
                s.add(row)
            for gone in existing.values():
                s.delete(gone)

    def devices(self) -> list[DeviceInfo]:
        with self.Reader() as s:
            rows = s.scalars(select(Device).where(Device.pool == self.pool).order_by(Device.index))
            return [DeviceInfo(r.index, r.uuid, r.model, r.memory_mib, bool(r.simulated))
                    for r in rows]

    # -- quotas --------------------------------------------------------------------------

    def quotas(self) -> list[dict]:
        with self.Reader() as s:
            rows = s.scalars(select(QuotaRow).order_by(QuotaRow.scope, QuotaRow.name))
            return [_quota_dict(r) for r in rows]

    def quota_of(self, scope: str, name: str = "") -> Quota | None:
        with self.Reader() as s:
            row = s.scalar(select(QuotaRow).where(QuotaRow.scope == scope, QuotaRow.name == name))
            return row.quota() if row else None

    def set_quota(self, scope: str, name: str, quota: Quota, actor: str) -> dict:
        _check_scope(scope, name)
        with self.Session.begin() as s:
            row = s.scalar(select(QuotaRow).where(QuotaRow.scope == scope, QuotaRow.name == name))
            old = row.quota().as_dict() if row else None
            now = time.time()
            if row is None:
                row = QuotaRow(scope=scope, name=name)
                s.add(row)
            row.max_gpus, row.max_per_request = quota.max_gpus, quota.max_per_request
            row.gpu_hours, row.window_hours = quota.gpu_hours, quota.window_hours
            row.disk = quota.disk
            row.updated_at, row.updated_by = now, actor
            s.add(AuditRow(at=now, actor=actor, scope=scope, name=name,
                           old=json.dumps(old) if old else None, new=json.dumps(quota.as_dict())))
            s.flush()
            return _quota_dict(row)

    def unset_quota(self, scope: str, name: str, actor: str) -> bool:
        _check_scope(scope, name)
        with self.Session.begin() as s:
            row = s.scalar(select(QuotaRow).where(QuotaRow.scope == scope, QuotaRow.name == name))
            if row is None:
                return False
            s.add(AuditRow(at=time.time(), actor=actor, scope=scope, name=name,
                           old=json.dumps(row.quota().as_dict()), new=None))
            s.delete(row)
            return True

    def audit(self, limit: int = 100) -> list[dict]:
        with self.Reader() as s:
            rows = s.scalars(select(AuditRow).order_by(AuditRow.id.desc()).limit(limit))
            return [
                {"at": r.at, "actor": r.actor, "scope": r.scope, "name": r.name,
                 "old": json.loads(r.old) if r.old else None,
                 "new": json.loads(r.new) if r.new else None}
                for r in rows
            ]

    def effective(self, user: str, groups: Iterable[str], s=None):
        """``(quota or None, source)`` for `user` in `groups` (`s`: a session or connection
        of the caller's transaction)."""
        args = {"user": user, "groups": sorted(set(groups))}
        if s is None:
            with self.Reader() as own:
                return _effective(own.execute(_SEL_QUOTAS, args).all())
        return _effective(s.execute(_SEL_QUOTAS, args).all())

    def disk_limit(self, user: str, groups: Iterable[str]) -> tuple[int | None, str]:
        """``(bytes or None, source)``: the disk limit of `user` in `groups` on the shared
        storage (`gpulab.hub.quota.policy.effective_disk`)."""
        args = {"user": user, "groups": sorted(set(groups))}
        with self.Reader() as s:
            return effective_disk(*_split(s.execute(_SEL_QUOTAS, args).all()))

    # -- allocations ---------------------------------------------------------------------
    # admission and release are prebuilt SQL statements (SQLAlchemy Core, run on the DBAPI
    # connection: `_Direct`), not ORM units of work: they hold the database's write lock, so
    # every statement, round trip and object less while holding it is throughput
    # (bench/admission.py)

    def admit(self, req: Request, now: float | None = None) -> Allocation:
        """Admit `req` whole, or raise `QuotaExceeded` / `NotEnoughGPUs` / `BadRequest`."""
        if req.kind not in KINDS:
            raise BadRequest(f"Unknown holder kind {req.kind!r}.")
        if not isinstance(req.gpus, int) or isinstance(req.gpus, bool) or req.gpus < 0:
            raise BadRequest(f"A GPU count must be a whole number, 0 or more (got {req.gpus!r}).")
        matches = req.model_matches or _exact_model
        with self._direct.transaction() as tx:
            # on PostgreSQL a pool that hands out devices is locked only for the insert, which
            # picks the free devices itself (`_PgTx.insert_first_free`); where they were taken
            # meanwhile, again with the pool locked before the reads
            for pool_locked in tx.attempts:
                alloc = self._admit(tx, req, matches, pool_locked, now)
                if alloc is not None:
                    break
        devices = list(alloc.devices)
        log.info("Admitted %s %s/%s: %d GPU(s) %s", req.kind, req.user, req.holder, req.gpus,
                 devices)
        return alloc

    def _admit(self, tx, req: Request, matches, pool_locked: bool, now: float | None):
        """One attempt of `admit` in `tx`: the allocation (committed), or None where the
        devices chosen were taken before the pool's lock was granted (nothing written)."""
        # the locks, then what admission reads (`_SqliteTx` / `_PgTx.lock_and_read`)
        known, assigns, open_rows, quota_rows, device_rows = tx.lock_and_read(
            self.pool, req.user, req.groups, pool_locked)
        # the clock is read under the lock and after the open allocations: every release
        # this admission saw has an earlier end, so the history never shows a device or
        # a quota used twice at once (releases take no lock)
        now = time.time() if now is None else now
        mine = [r for r in open_rows if r.user == req.user]
        if any(r.kind == req.kind and r.holder == req.holder for r in mine):
            raise BadRequest(f"{req.kind} '{req.holder}' already holds GPUs.")
        quota, source = _effective(quota_rows)
        used = 0.0
        if quota is not None and quota.gpu_hours is not None and req.gpus:
            since = now - quota.window_hours * 3600
            used = _sum_gpu_hours(tx.used(since, now, req.user), since, now)[req.user]
        why = refusal(quota, source, req.gpus,
                      [Holding(r.kind, r.holder, r.gpus) for r in mine if r.gpus], used)
        if why:
            raise QuotaExceeded(why)
        devices: list[int] = []
        row = dict(id=uuid.uuid4().hex, pool=self.pool, kind=req.kind, holder=req.holder,
                   user=req.user, gpus=req.gpus, model=req.model, started_at=now,
                   max_runtime=req.max_runtime)
        if req.gpus and assigns:
            matching = [_Dev(i, m) for i, m in device_rows if matches(req.model, m)]
            if not pool_locked:
                # the pool's lock is taken for the insert, which picks the free devices
                # itself; too few: again with the lock, reading who holds which (`open_rows`
                # holds only the person's own here), to admit or to say why not
                got = tx.insert_first_free(row, [d.index for d in matching])
                if got is None:
                    return None
                return Allocation(row["id"], self.pool, req.kind, req.holder, req.user,
                                  req.gpus, req.model, tuple(got[0]), got[1],
                                  max_runtime=req.max_runtime)
            held = {i for r in open_rows for i in r.devices}
            free = [d.index for d in matching if d.index not in held]
            if len(free) < req.gpus:
                raise NotEnoughGPUs(
                    _not_enough(req, matching, free, open_rows),
                    requested=req.gpus, free=len(free), matching=len(matching))
            devices = free[: req.gpus]
        # a pool nobody declared counts GPUs (`ensure_pool` declares it)
        tx.write_and_commit(None if known else self.pool, dict(
            row, devices=json.dumps(devices), ended_at=None, end_reason=""))
        return Allocation(row["id"], self.pool, req.kind, req.holder, req.user, req.gpus,
                          req.model, tuple(devices), now, max_runtime=req.max_runtime)

    def adopt(self, req: Request, now: float | None = None) -> Allocation:
        """The allocation of GPUs an outside scheduler (Kueue) has admitted already: recorded
        as it is, without a quota or device check (that scheduler enforced the quota gpulab
        mirrors to it), so that usage, GPU-hours and the admin page count it. Where the
        holder has an open allocation, that one is returned (a second look at one admission
        records nothing)."""
        if req.kind not in KINDS:
            raise BadRequest(f"Unknown holder kind {req.kind!r}.")
        now = time.time() if now is None else now
        with self.Session.begin() as s:
            row = s.scalar(select(AllocationRow).where(
                AllocationRow.pool == self.pool, AllocationRow.user == req.user,
                AllocationRow.kind == req.kind, AllocationRow.holder == req.holder,
                AllocationRow.ended_at.is_(None)).limit(1))
            if row is not None:
                return Allocation.of(row)
            if s.get(Pool, self.pool) is None:
                s.add(Pool(name=self.pool, assigns_devices=0))
                s.flush()
            row = AllocationRow(id=uuid.uuid4().hex, pool=self.pool, kind=req.kind,
                                holder=req.holder, user=req.user, gpus=req.gpus,
                                model=req.model, devices="[]", started_at=now, ended_at=None,
                                end_reason="", max_runtime=req.max_runtime)
            s.add(row)
            s.flush()
            alloc = Allocation.of(row)
        log.info("Adopted %s %s/%s: %d GPU(s) admitted by the cluster's queue", req.kind,
                 req.user, req.holder, req.gpus)
        return alloc

    def release(self, alloc_id: str, reason: str = "released", now: float | None = None,
                session: Session | None = None):
        """Close an allocation; closing an unknown or closed one is a no-op (returns None).

        ``session``: a write transaction of the caller's, so that the allocation closes in the
        same commit as the caller's own rows (a job's final state and its GPUs together)."""
        # one UPDATE: it locks the row (a second release of the same allocation waits, then
        # finds it closed); an admission running meanwhile counts it as still held, which
        # errs on the safe side
        now = time.time() if now is None else now
        args = {"alloc": alloc_id, "at": now, "why": reason[:255]}
        if session is None:
            with self._direct.transaction() as tx:
                row = tx.close_and_commit(args)
        else:
            row = session.connection().execute(_CLOSE, args).first()
        if row is None:
            return None
        row = _allocation(row)
        log.info("Released %s %s/%s (%s)", row.kind, row.user, row.holder, reason)
        return row

    def get(self, alloc_id: str) -> Allocation | None:
        with self.Reader() as s:
            row = s.get(AllocationRow, alloc_id)
            return Allocation.of(row) if row else None

    def open_allocations(self, user: str | None = None, kind: str | None = None) -> list[Allocation]:
        with self.Reader() as s:
            q = select(AllocationRow).where(AllocationRow.pool == self.pool,
                                            AllocationRow.ended_at.is_(None))
            if user is not None:
                q = q.where(AllocationRow.user == user)
            if kind is not None:
                q = q.where(AllocationRow.kind == kind)
            return [Allocation.of(r) for r in s.scalars(q.order_by(AllocationRow.started_at))]

    def close_orphans(self, kind: str, keep: set[str], reason: str) -> list[Allocation]:
        """Close the open allocations of `kind` whose id is not in `keep` (reconciler)."""
        closed = []
        for a in self.open_allocations(kind=kind):
            if a.id not in keep:
                done = self.release(a.id, reason)
                if done is not None:
                    closed.append(done)
                    log.warning("Closed orphaned %s allocation %s/%s: %s", kind, a.user,
                                a.holder, reason)
        return closed

    # -- usage ---------------------------------------------------------------------------

    def usage(self, since: float, until: float | None = None, user: str | None = None) -> dict[str, float]:
        """GPU-hours per user between `since` and `until` (open allocations count to now)."""
        until = time.time() if until is None else until
        with self.Reader() as s:
            return dict(self._gpu_hours(s, since, until, user=user))

    def _gpu_hours(self, s: Session, since: float, until: float, user: str | None = None):
        args = {"since": since, "until": until}
        if user is None:
            return _sum_gpu_hours(s.execute(_SEL_USED, args), since, until)
        return _sum_gpu_hours(s.execute(_SEL_USED_OF, {**args, "user": user}), since, until)


_A, _D, _P, _Q = (AllocationRow.__table__, Device.__table__, Pool.__table__,
                  QuotaRow.__table__)


# admission's and release's statements, built once (building one costs more than running it
# on SQLite), and compiled once per database for the DBAPI connection (`_Direct`)
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


_SEL_QUOTAS = _sel_quotas(_Q.c.name.in_(bindparam("groups", expanding=True)))
#: the same with the groups as one parameter, the same statement for any number of groups:
#: a PostgreSQL array, a JSON list on SQLite
_SEL_QUOTAS_PG = _sel_quotas(_Q.c.name == any_(bindparam("groups", type_=ARRAY(String))))
_SEL_QUOTAS_SQLITE = _sel_quotas(_Q.c.name.in_(
    select(literal_column("value")).select_from(func.json_each(bindparam("groups")))))
_SEL_DEVICES = select(_D.c.index, _D.c.model).where(_D.c.pool == bindparam("pool")).order_by(
    _D.c.index)
_USED_END = func.coalesce(_A.c.ended_at, bindparam("until", type_=Float))
_SEL_USED = select(_A.c.user, _A.c.gpus, _A.c.started_at, _USED_END).where(
    _A.c.gpus > 0, _A.c.started_at < bindparam("until", type_=Float),
    _USED_END > bindparam("since", type_=Float))
_SEL_USED_OF = _SEL_USED.where(_A.c.user == bindparam("user"))
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
_CLOSE = (_A.update().where(_A.c.id == bindparam("alloc"), _A.c.ended_at.is_(None))
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


class _Direct:
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
                          used=_SEL_USED_OF, insert_pool=_INSERT_POOL,
                          insert=_INSERT_ALLOCATION, close=_CLOSE)
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
        got = self._run(names, dict(key=_person_key(pool, user), pool=pool, user=user,
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


def _person_key(pool: str, user: str) -> int:
    """The advisory lock's key of one person's admissions to one pool."""
    return int.from_bytes(hashlib.blake2b(f"{pool}\0{user}".encode(), digest_size=8).digest(),
                          "big", signed=True)


def _open(row) -> "_Open":
    user, kind, holder, gpus, devices = row
    return _Open(user, kind, holder, gpus, json.loads(devices or "[]"))


def _allocation(row) -> Allocation:
    """An `Allocation` from a row of the allocations table's columns, in their order."""
    return Allocation(*row[:7], tuple(json.loads(row[7] or "[]")), *row[8:])


def _effective(rows):
    """`effective_quota` of the rows `_SEL_QUOTAS` reads."""
    return effective_quota(*_split(rows))


def _split(rows):
    """``(default, {group: quota}, own)`` of the rows `_SEL_QUOTAS` reads."""
    default, mine, by_group = None, None, {}
    for scope, name, *numbers in rows:
        quota = Quota(*numbers)
        if scope == "default":
            default = quota
        elif scope == "user":
            mine = quota
        else:
            by_group[name] = quota
    return default, by_group, mine


def _sum_gpu_hours(rows, since: float, until: float) -> dict[str, float]:
    """GPU-hours per user in ``[since, until]`` of the rows `_SEL_USED` reads."""
    totals: dict[str, float] = _Zero()
    for who, gpus, start, stop in rows:
        span = min(stop, until) - max(start, since)
        if span > 0:
            totals[who] = totals.get(who, 0.0) + gpus * span / 3600.0
    return totals


@dataclass(frozen=True)
class _Open:
    """An open allocation as admission reads it."""

    user: str
    kind: str
    holder: str
    gpus: int
    devices: list


@dataclass(frozen=True)
class _Dev:
    index: int
    model: str


class _Writers:
    """A sessionmaker whose ``begin()`` holds the process's write lock (SQLite) around the
    transaction; calling it makes a plain session as the sessionmaker does."""

    def __init__(self, maker: sessionmaker, lock: threading.RLock | None):
        # no lock (PostgreSQL: the database queues writers itself): a context that does nothing
        self.maker, self.lock = maker, lock if lock is not None else nullcontext()

    def __call__(self, **kw) -> Session:
        return self.maker(**kw)

    @contextmanager
    def begin(self):
        with self.lock, self.maker.begin() as s:
            yield s


class _Zero(dict):
    def __missing__(self, key):
        return 0.0


def _quota_dict(r: QuotaRow) -> dict:
    return {"scope": r.scope, "name": r.name, **r.quota().as_dict(),
            "updated_at": r.updated_at, "updated_by": r.updated_by}


def _check_scope(scope: str, name: str) -> None:
    if scope not in ("default", "group", "user"):
        raise QuotaError("scope", f"Unknown quota scope {scope!r}.")
    if scope == "default" and name:
        raise QuotaError("name", "The default quota has no name.")
    if scope != "default" and (not name or len(name) > 255):
        raise QuotaError("name", f"A {scope} quota needs a {scope} name (1-255 characters).")


def _not_enough(req: Request, matching, free: list[int], open_rows) -> str:
    gpus = "GPU" if req.gpus == 1 else "GPUs"
    of_model = f" of model {req.model}" if req.model else ""
    if not matching:
        return f"This machine has no GPU{of_model}."
    if req.gpus > len(matching):
        return (f"This request needs {req.gpus} {gpus}{of_model}, but this machine has only "
                f"{len(matching)}.")
    indices = {d.index for d in matching}
    mine, others = [], 0
    for r in open_rows:
        n = sum(1 for i in r.devices if i in indices)
        if not n:
            continue
        if r.user == req.user:
            what = f"server '{r.holder}'" if r.kind == "notebook" else f"job '{r.holder}'"
            mine.append(f"{what} ({n})")
        else:
            others += n
    parts = []
    if mine:
        parts.append("your " + ", ".join(mine))
    if others:
        parts.append(f"{others} held by other users")
    held = len(matching) - len(free)
    return (
        f"Not enough free GPUs{of_model}: this request needs {req.gpus}, {len(free)} of "
        f"{len(matching)} {'is' if len(free) == 1 else 'are'} free. In use ({held}): "
        f"{'; '.join(parts)}. Stop one of your servers or jobs, ask for fewer GPUs, or try "
        "again later."
    )
