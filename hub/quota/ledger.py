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
prebuilt statements on the DBAPI connection (`gpulab.hub.quota.fastpath`, the hand-compiled
SQL): on PostgreSQL an admission is two round trips (locks and reads; insert and commit), a
release one. The tables are `gpulab.hub.quota.rows`'; this module is the API over them.

Times are seconds since the epoch (floats), the same on every database.
"""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Iterable

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from gpulab.hub.db import alembic_config, make_engine
from gpulab.hub.quota.fastpath import (CLOSE, SEL_ALL_QUOTAS, SEL_QUOTAS, SEL_USED, SEL_USED_OF,
                                       Direct)
from gpulab.hub.quota.policy import (Holding, Quota, QuotaError, effective_disk, effective_quota,
                                     refusal)
from gpulab.hub.quota.rows import KINDS, AllocationRow, AuditRow, Device, Pool, QuotaRow

log = logging.getLogger("gpulab.ledger")


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
        self._direct = Direct(self.engine, self.Session.lock)
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

    def audit(self, limit: int = 100, offset: int = 0) -> list[dict]:
        with self.Reader() as s:
            rows = s.scalars(select(AuditRow).order_by(AuditRow.id.desc()).offset(offset)
                             .limit(limit))
            return [
                {"at": r.at, "actor": r.actor, "scope": r.scope, "name": r.name,
                 "old": json.loads(r.old) if r.old else None,
                 "new": json.loads(r.new) if r.new else None}
                for r in rows
            ]

    def record(self, actor: str, scope: str, name: str, new: dict, now: float | None = None) -> None:
        """An event in the audit trail that is not a quota change (scope ``idle``: a server
        or job warned, stopped or kept for its idle GPUs; `name` ``<user>/<kind>/<holder>``)."""
        with self.Session.begin() as s:
            s.add(AuditRow(at=time.time() if now is None else now, actor=actor[:255],
                           scope=scope[:16], name=name[:255], old=None, new=json.dumps(new)))

    def events(self, scope: str, name_prefix: str = "", limit: int = 20) -> list[dict]:
        """The newest audit rows of `scope` whose name starts with `name_prefix`."""
        with self.Reader() as s:
            q = select(AuditRow).where(AuditRow.scope == scope)
            if name_prefix:
                q = q.where(AuditRow.name.startswith(name_prefix, autoescape=True))
            rows = s.scalars(q.order_by(AuditRow.id.desc()).limit(limit))
            return [{"at": r.at, "actor": r.actor, "scope": r.scope, "name": r.name,
                     "new": json.loads(r.new) if r.new else None} for r in rows]

    def audit_count(self) -> int:
        with self.Reader() as s:
            return s.scalar(select(func.count()).select_from(AuditRow))

    def effective(self, user: str, groups: Iterable[str], s=None):
        """``(quota or None, source)`` for `user` in `groups` (`s`: a session or connection
        of the caller's transaction)."""
        args = {"user": user, "groups": sorted(set(groups))}
        if s is None:
            with self.Reader() as own:
                return _effective(own.execute(SEL_QUOTAS, args).all())
        return _effective(s.execute(SEL_QUOTAS, args).all())

    def effective_of(self, people: dict[str, Iterable[str]], s=None) -> dict[str, tuple]:
        """``{user: (quota or None, source)}`` for each ``user: groups`` of `people`, from
        one read of the quota table, not a query per person (the queue pass, the admin page
        and the reconciler ask for hundreds at once); `s` as in `effective`."""
        if not people:
            return {}
        if s is None:
            with self.Reader() as own:
                rows = own.execute(SEL_ALL_QUOTAS).all()
        else:
            rows = s.execute(SEL_ALL_QUOTAS).all()
        default, own_rows, by_group = None, {}, {}
        for scope, name, *numbers in rows:
            quota = Quota(*numbers)
            if scope == "default":
                default = quota
            elif scope == "user":
                own_rows[name] = quota
            else:
                by_group[name] = quota
        return {user: effective_quota(default, {g: by_group[g] for g in set(groups)
                                                if g in by_group}, own_rows.get(user))
                for user, groups in people.items()}

    def disk_limit(self, user: str, groups: Iterable[str]) -> tuple[int | None, str]:
        """``(bytes or None, source)``: the disk limit of `user` in `groups` on the shared
        storage (`gpulab.hub.quota.policy.effective_disk`)."""
        args = {"user": user, "groups": sorted(set(groups))}
        with self.Reader() as s:
            return effective_disk(*_split(s.execute(SEL_QUOTAS, args).all()))

    # -- allocations ---------------------------------------------------------------------
    # admission and release are prebuilt SQL statements (SQLAlchemy Core, run on the DBAPI
    # connection: `Direct`), not ORM units of work: they hold the database's write lock, so
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
            row = session.connection().execute(CLOSE, args).first()
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

    def usage_windows(self, sinces: Iterable[float], until: float) -> list[dict[str, float]]:
        """`usage` (everyone's) for each of `sinces` up to `until`, from one read of the
        allocations since the earliest (the admin page's 7 and 30 days: one pass over the
        history, not two)."""
        from sqlalchemy import case, literal

        sinces = list(sinces)
        a = AllocationRow.__table__.c
        end = func.coalesce(a.ended_at, literal(until))
        end_in = case((end > until, literal(until)), else_=end)
        # summed in the database, per person: 100,000 rows are not carried into Python
        parts = [func.sum(case((end > since, a.gpus * (end_in - case(
            (a.started_at < since, literal(since)), else_=a.started_at))), else_=0))
            for since in sinces]
        q = select(a.user, *parts).where(a.gpus > 0, a.started_at < until,
                                         end > min(sinces)).group_by(a.user)
        out = [_Zero() for _ in sinces]
        with self.Reader() as s:
            for user, *sums in s.execute(q):
                for d, v in zip(out, sums):
                    if v:
                        d[user] = v / 3600.0
        return out

    def _gpu_hours(self, s: Session, since: float, until: float, user: str | None = None):
        args = {"since": since, "until": until}
        if user is None:
            return _sum_gpu_hours(s.execute(SEL_USED, args), since, until)
        return _sum_gpu_hours(s.execute(SEL_USED_OF, {**args, "user": user}), since, until)


def _allocation(row) -> Allocation:
    """An `Allocation` from a row of the allocations table's columns, in their order."""
    return Allocation(*row[:7], tuple(json.loads(row[7] or "[]")), *row[8:])


def _effective(rows):
    """`effective_quota` of the rows `SEL_QUOTAS` reads."""
    return effective_quota(*_split(rows))


def _split(rows):
    """``(default, {group: quota}, own)`` of the rows `SEL_QUOTAS` reads."""
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
    """GPU-hours per user in ``[since, until]`` of the rows `SEL_USED` reads."""
    totals: dict[str, float] = _Zero()
    for who, gpus, start, stop in rows:
        span = min(stop, until) - max(start, since)
        if span > 0:
            totals[who] = totals.get(who, 0.0) + gpus * span / 3600.0
    return totals


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
