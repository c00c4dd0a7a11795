"""The GPU queue in the ledger's database: entries that wait for GPUs, and scheduling passes.

Work that could run later but not now waits here instead of being refused. An entry is a
`Request` of the ledger plus what the queue's policy needs (`gpulab.hub.quota.queue`:
priority, time limit, preemptible, a notebook's longest wait); it lives in the
``queue_entries`` table, so the line survives restarts of the service and of the hub.

`Queue.schedule` is one pass, in one write transaction of the ledger (the same lock as an
admission: on SQLite ``BEGIN IMMEDIATE``, on PostgreSQL the pool's row ``FOR UPDATE``): it reads
the devices, the open allocations, the waiting entries, quotas and recent usage, runs
`gpulab.hub.quota.queue.plan`, and writes the allocations of the entries that start in the same
commit as their new state. Direct admissions (`Ledger.admit`) and passes therefore never hand a
GPU out twice. What a pass decided to preempt is returned to the caller, which stops that work
and calls `Queue.requeue` once its GPUs are released.

Places in line, estimated starts and reasons are computed when read (`Queue.entries`: the same
pure pass on a read-only snapshot), so they are never stale.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from typing import Callable, Mapping

from sqlalchemy import Float, Index, Integer, String, Text, case, func, literal, select
from sqlalchemy.orm import Mapped, mapped_column
import traitlets as t
from traitlets.config import Configurable

from gpulab.hub.db import Base
from gpulab.hub.quota import queue as policy
from gpulab.hub.quota.fastpath import person_key
from gpulab.hub.quota.ledger import Allocation, BadRequest, Ledger, Request
from gpulab.hub.quota.rows import KINDS, AllocationRow, AuditRow, Device, Pool, QuotaRow

log = logging.getLogger("gpulab.queue")

#: an entry's states: waiting in line; admitted (its allocation holds the GPUs); preempting
#: (its work is being stopped to make room; it waits again once `requeue`d); cancelled;
#: expired (a notebook's longest wait passed)
STATES = ("waiting", "admitted", "preempting", "cancelled", "expired")
ACTIONS = ("hold", "release", "top", "cancel")
#: the reason of an entry its owner took out of line (a waiting notebook's start fails so)
LEFT_REASON = "You left the queue."
#: seconds a read of the line (`Queue.entries`: places, estimated starts, reasons) is reused
#: while nothing it depends on changed: many people polling ``GET queue`` and ``GET jobs``
#: cost one plan a second (a change in any process, seen in `Queue._stamp`, plans again)
PLAN_TTL = 1.0


class QueueEntryRow(Base):
    __tablename__ = "queue_entries"
    __table_args__ = (
        Index("ix_queue_entries_pool_state", "pool", "state"),
        Index("ix_queue_entries_holder", "user", "kind", "holder"),
        Index("ix_queue_entries_allocation", "allocation_id"),
    )
    id: Mapped[str] = mapped_column(String(32), primary_key=True)
    pool: Mapped[str] = mapped_column(String(64))
    user: Mapped[str] = mapped_column(String(255))
    groups: Mapped[str] = mapped_column(Text, default="[]")  # JSON list, as of the request
    kind: Mapped[str] = mapped_column(String(16))  # notebook | job
    holder: Mapped[str] = mapped_column(String(255))
    gpus: Mapped[int] = mapped_column(Integer)
    model: Mapped[str | None] = mapped_column(String(128), nullable=True)
    submitted_at: Mapped[float] = mapped_column(Float)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    max_runtime: Mapped[float | None] = mapped_column(Float, nullable=True)
    preemptible: Mapped[int] = mapped_column(Integer, default=0)
    wait_until: Mapped[float | None] = mapped_column(Float, nullable=True)
    held: Mapped[int] = mapped_column(Integer, default=0)
    top_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    state: Mapped[str] = mapped_column(String(16))
    allocation_id: Mapped[str | None] = mapped_column(String(32), nullable=True)
    borrowed: Mapped[int] = mapped_column(Integer, default=0)
    reason: Mapped[str] = mapped_column(Text, default="")
    updated_at: Mapped[float] = mapped_column(Float)


@dataclass(frozen=True)
class Entry:
    id: str
    user: str
    kind: str
    holder: str
    gpus: int
    model: str | None
    submitted_at: float
    priority: int
    max_runtime: float | None
    preemptible: bool
    wait_until: float | None
    held: bool
    top_at: float | None
    state: str
    allocation_id: str | None
    borrowed: bool
    reason: str
    #: from the current pass, for waiting entries
    position: int | None = None
    estimated_start: float | None = None
    ahead: int = 0
    ahead_gpus: int = 0

    @classmethod
    def of(cls, r: QueueEntryRow) -> "Entry":
        return cls(r.id, r.user, r.kind, r.holder, r.gpus, r.model, r.submitted_at, r.priority,
                   r.max_runtime, bool(r.preemptible), r.wait_until, bool(r.held), r.top_at,
                   r.state, r.allocation_id, bool(r.borrowed), r.reason)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Pass:
    """What one scheduling pass did."""

    started: list[tuple[Entry, Allocation]]
    #: allocations whose work the caller stops, with the reason to show its owner
    preempt: list[tuple[Allocation, str]]
    expired: list[Entry]


class QueueRefused(BadRequest):
    """A request that can never run (more GPUs than the machine or the quota allows)."""

    metric_reason = "never_fits"  # its refusals' label (`gpulab.hub.quota.events`)


class Queue:
    """The queue of one ledger's pool. Thread-safe as the ledger is (a session per call)."""

    def __init__(self, ledger: Ledger, *, half_life_hours: float = 168.0, borrowing: bool = True,
                 group_shares: Mapping[str, float] | None = None,
                 matches: Callable[[str | None, str], bool] = policy.exact_model,
                 plan_ttl: float = PLAN_TTL):
        if not half_life_hours > 0:
            raise ValueError("half_life_hours must be positive")
        self.ledger = ledger
        self.pool = ledger.pool
        self.half_life = half_life_hours * 3600.0
        self.settings = policy.Settings(borrowing=borrowing)
        self.group_shares = dict(group_shares or {})
        self.matches = matches
        self.plan_ttl = plan_ttl
        #: the line as last planned for a read: (stamp, now, every entry with its place)
        self._line: tuple[tuple, float, list[Entry]] | None = None
        self._line_lock = threading.Lock()
        #: how many times the line was planned for a read (the tests count them)
        self.plans = 0
        self._writes = 0  # this object's own writes (part of the stamp: exact in-process)

    @contextmanager
    def _writing(self):
        """A write transaction of the ledger; a read of the line after it plans again."""
        try:
            with self.ledger.Session.begin() as s:
                yield s
        finally:
            self._writes += 1

    # -- entries ---------------------------------------------------------------------------

    def enqueue(self, req: Request, *, priority: int = 0, max_runtime: float | None = None,
                preemptible: bool = False, wait_until: float | None = None,
                now: float | None = None) -> Entry:
        """Put `req` in line; `QueueRefused` where it can never run, `BadRequest` where the
        same holder already waits or holds GPUs."""
        if req.kind not in KINDS:
            raise BadRequest(f"Unknown holder kind {req.kind!r}.")
        if not isinstance(req.gpus, int) or isinstance(req.gpus, bool) or req.gpus < 1:
            raise BadRequest(f"A queued request asks for 1 GPU or more (got {req.gpus!r}).")
        if max_runtime is not None and not (isinstance(max_runtime, (int, float))
                                            and math.isfinite(max_runtime) and max_runtime > 0):
            raise BadRequest("max_runtime must be a positive number of seconds.")
        now = time.time() if now is None else now
        with self._writing() as s:
            self._lock(s)
            devices = self._devices(s)
            quota, source = self.ledger.effective(req.user, req.groups, s)
            can_borrow = req.kind == "job" and self.settings.borrowing
            why = policy.refusal_now(req.gpus, req.model, quota, devices, self.matches,
                                     borrows=bool(preemptible) and can_borrow,
                                     can_borrow=can_borrow and not preemptible, source=source)
            if why:
                raise QueueRefused(why)
            busy = s.scalar(select(QueueEntryRow.id).where(
                QueueEntryRow.pool == self.pool, QueueEntryRow.user == req.user,
                QueueEntryRow.kind == req.kind, QueueEntryRow.holder == req.holder,
                QueueEntryRow.state.in_(("waiting", "preempting"))).limit(1))
            holds = s.scalar(select(AllocationRow.id).where(
                AllocationRow.pool == self.pool, AllocationRow.user == req.user,
                AllocationRow.kind == req.kind, AllocationRow.holder == req.holder,
                AllocationRow.ended_at.is_(None)).limit(1))
            if busy or holds:
                raise BadRequest(f"{req.kind} '{req.holder}' already "
                                 f"{'waits for' if busy else 'holds'} GPUs.")
            row = QueueEntryRow(
                id=uuid.uuid4().hex, pool=self.pool, user=req.user,
                groups=json.dumps(sorted(set(req.groups))), kind=req.kind, holder=req.holder,
                gpus=req.gpus, model=req.model, submitted_at=now, priority=int(priority),
                max_runtime=max_runtime, preemptible=int(bool(preemptible) and req.kind == "job"),
                wait_until=wait_until, held=0, top_at=None, state="waiting", allocation_id=None,
                borrowed=0, reason="", updated_at=now)
            s.add(row)
            s.flush()
            entry = Entry.of(row)
        log.info("Queued %s %s/%s: %d GPU(s)", req.kind, req.user, req.holder, req.gpus)
        return entry

    def get(self, entry_id: str) -> Entry | None:
        with self.ledger.Reader() as s:
            row = s.get(QueueEntryRow, entry_id)
            return Entry.of(row) if row is not None and row.pool == self.pool else None

    def entries(self, user: str | None = None, now: float | None = None) -> list[Entry]:
        """The waiting, held and preempting entries in the order of the line, each with its
        place, estimated start and the reason it waits (of everyone, or of `user`: the line
        is planned for everyone and shared, the filter is each caller's own).

        The plan is reused for `plan_ttl` seconds of `now` while `_stamp` (read first, in
        the same read) is unchanged: an entry, an allocation or a quota written by any
        process plans again, so a person's own submission shows in their next read."""
        now = time.time() if now is None else now
        line = self._planned(now)
        return list(line) if user is None else [e for e in line if e.user == user]

    def _planned(self, now: float) -> list[Entry]:
        with self.ledger.Reader() as s:
            stamp = (self._writes, *s.execute(self._stamp_sql()).one())
            # one plan at a time: callers that asked meanwhile take the one just made
            with self._line_lock:
                hit = self._line
                if hit is not None and hit[0] == stamp and 0 <= now - hit[1] < self.plan_ttl:
                    return hit[2]
                state = self._read(s, now)
                line = self._annotate(state, now)
                self.plans += 1
                self._line = (stamp, now, line)
                return line

    def _stamp_sql(self):
        """One statement whose row changes when anything the line's plan reads changes: the
        live entries (their number and newest change: every write sets ``updated_at``), the
        open allocations (number, newest start; a release lowers the number), the quotas
        (number, newest change) and the devices."""
        live = (QueueEntryRow.pool == self.pool,
                QueueEntryRow.state.in_(("waiting", "admitted", "preempting")))
        held = (AllocationRow.ended_at.is_(None), AllocationRow.pool == self.pool)
        return select(
            select(func.count()).select_from(QueueEntryRow).where(*live).scalar_subquery(),
            select(func.max(QueueEntryRow.updated_at)).where(*live).scalar_subquery(),
            select(func.count()).select_from(AllocationRow).where(*held).scalar_subquery(),
            select(func.max(AllocationRow.started_at)).where(*held).scalar_subquery(),
            select(func.count()).select_from(QuotaRow).scalar_subquery(),
            select(func.max(QuotaRow.updated_at)).scalar_subquery(),
            select(func.count()).select_from(Device).where(
                Device.pool == self.pool).scalar_subquery())

    def _annotate(self, state: "_State", now: float) -> list[Entry]:
        plan = self._plan(state, now)
        by_id = {e.id: e for e in state.entries}
        starting = {st.id for st in plan.start}
        out, position, ahead_gpus = [], 0, 0
        for eid in plan.order:
            e = by_id[eid]
            place = plan.waiting.get(eid)
            if eid in starting:  # its GPUs are free: the next pass starts it
                position += 1
                e = replace(e, position=position, estimated_start=now, ahead=position - 1,
                            ahead_gpus=ahead_gpus,
                            reason="Its GPUs are free: it starts in a moment.")
            elif place.position is None:  # held
                e = replace(e, reason=place.reason)
            else:
                position += 1
                e = replace(e, position=position, estimated_start=place.estimated_start,
                            ahead=position - 1, ahead_gpus=ahead_gpus,
                            reason=_join(e.reason, place.reason))
            if e.position is not None:
                ahead_gpus += e.gpus
            out.append(e)
        return out

    # -- a pass --------------------------------------------------------------------------

    def schedule(self, now: float | None = None) -> Pass:
        """One scheduling pass: start what may start, say what to preempt, expire notebooks
        that waited past their longest wait."""
        fixed = now
        # a pass that changes nothing (most of them: the service's supervisor runs one every
        # few seconds) leaves the reads' plan (`entries`) as it is
        with self.ledger.Session.begin() as s:
            locked = self._lock(s, people=True)
            now = time.time() if fixed is None else fixed
            expired = []
            for row in s.scalars(select(QueueEntryRow).where(
                    QueueEntryRow.pool == self.pool, QueueEntryRow.state == "waiting",
                    QueueEntryRow.wait_until.is_not(None), QueueEntryRow.wait_until <= now)):
                row.state, row.updated_at = "expired", now
                row.reason = ("The longest wait chosen passed before GPUs were free; "
                              "nothing was started.")
                expired.append(Entry.of(row))
            s.flush()
            state = self._read(s, now, locked)
            # the clock again after the reads: every release they saw ended before it, so the
            # history never shows a GPU held twice at once (releases take no lock)
            now = time.time() if fixed is None else fixed
            plan = self._plan(state, now)
            rows = {r.id: r for r in s.scalars(select(QueueEntryRow).where(
                QueueEntryRow.id.in_([st.id for st in plan.start])))} if plan.start else {}
            started = []
            for st in plan.start:
                row = rows[st.id]
                alloc = AllocationRow(
                    id=uuid.uuid4().hex, pool=self.pool, kind=row.kind, holder=row.holder,
                    user=row.user, gpus=row.gpus, model=row.model,
                    devices=json.dumps(list(st.devices)), started_at=now, ended_at=None,
                    end_reason="", max_runtime=row.max_runtime)
                s.add(alloc)
                row.state, row.allocation_id, row.borrowed = "admitted", alloc.id, int(st.borrowed)
                row.reason, row.updated_at = "", now
                started.append((Entry.of(row), Allocation.of(alloc)))
            preempt = []
            if plan.preempt:
                victims = {v.id: v.reason for v in plan.preempt}
                for row in s.scalars(select(QueueEntryRow).where(
                        QueueEntryRow.allocation_id.in_(list(victims)))):
                    row.state, row.reason, row.updated_at = "preempting", victims[row.allocation_id], now
                for a in s.scalars(select(AllocationRow).where(
                        AllocationRow.id.in_(list(victims)))):
                    preempt.append((Allocation.of(a), victims[a.id]))
        if started or preempt or expired:
            self._writes += 1
        for e, a in started:
            log.info("Started from the queue: %s %s/%s on %s%s", e.kind, e.user, e.holder,
                     list(a.devices), " (borrowed)" if e.borrowed else "")
        for a, _why in preempt:
            log.info("Preempting %s %s/%s", a.kind, a.user, a.holder)
        return Pass(started, preempt, expired)

    def requeue(self, entry_id: str, reason: str = "", now: float | None = None) -> Entry | None:
        """Put preempted (or otherwise stopped) admitted work back in line, in its old place:
        its submit time is kept. Its allocation must be released first."""
        now = time.time() if now is None else now
        with self._writing() as s:
            row = s.get(QueueEntryRow, entry_id)
            if row is None or row.state not in ("admitted", "preempting"):
                return None
            row.state, row.allocation_id, row.borrowed = "waiting", None, 0
            row.reason = reason or row.reason
            row.updated_at = now
            s.flush()
            return Entry.of(row)

    def done(self, entry_id: str) -> None:
        """An admitted entry's work ended for good: it leaves the queue's view."""
        with self._writing() as s:
            row = s.get(QueueEntryRow, entry_id)
            if row is not None and row.state in ("admitted", "preempting"):
                row.state, row.updated_at = "cancelled", time.time()

    def of_holder(self, user: str, kind: str, holder: str) -> Entry | None:
        """The entry of a holder (a person's job or server) that waits, holds GPUs through
        the queue or is being preempted; None if it has none."""
        with self.ledger.Reader() as s:
            row = s.scalar(select(QueueEntryRow).where(
                QueueEntryRow.pool == self.pool, QueueEntryRow.user == user,
                QueueEntryRow.kind == kind, QueueEntryRow.holder == holder,
                QueueEntryRow.state.in_(("waiting", "admitted", "preempting")))
                .order_by(QueueEntryRow.updated_at.desc()).limit(1))
            return Entry.of(row) if row is not None else None

    def holders(self, kind: str) -> dict[tuple[str, str], Entry]:
        """The live entries (waiting, admitted, preempting) of one kind, by (user, holder):
        what a driver reconciles its work with."""
        with self.ledger.Reader() as s:
            rows = s.scalars(select(QueueEntryRow).where(
                QueueEntryRow.pool == self.pool, QueueEntryRow.kind == kind,
                QueueEntryRow.state.in_(("waiting", "admitted", "preempting")))
                .order_by(QueueEntryRow.updated_at))
            return {(r.user, r.holder): Entry.of(r) for r in rows}

    def waiting_count(self) -> int:
        """How many entries of this pool wait (held ones included)."""
        with self.ledger.Reader() as s:
            return s.scalar(select(func.count()).select_from(QueueEntryRow).where(
                QueueEntryRow.pool == self.pool, QueueEntryRow.state == "waiting")) or 0

    def forget(self, user: str, kind: str, holder: str, reason: str) -> None:
        """A holder's work ended for good (stopped, failed, done): its entry, whatever its
        state, leaves the line."""
        now = time.time()
        with self._writing() as s:
            for row in s.scalars(select(QueueEntryRow).where(
                    QueueEntryRow.pool == self.pool, QueueEntryRow.user == user,
                    QueueEntryRow.kind == kind, QueueEntryRow.holder == holder,
                    QueueEntryRow.state.in_(("waiting", "admitted", "preempting")))):
                row.state, row.reason, row.updated_at = "cancelled", reason, now

    def forget_notebooks_except(self, keep: set[str], reason: str) -> int:
        """At a hub's start: no start that waited survived it, so every notebook entry but
        those admitted for an allocation in `keep` (the servers it restored) leaves the
        line; returns how many."""
        now, n = time.time(), 0
        with self._writing() as s:
            for row in s.scalars(select(QueueEntryRow).where(
                    QueueEntryRow.pool == self.pool, QueueEntryRow.kind == "notebook",
                    QueueEntryRow.state.in_(("waiting", "admitted", "preempting")))):
                if row.allocation_id is None or row.allocation_id not in keep:
                    row.state, row.reason, row.updated_at = "cancelled", reason, now
                    n += 1
        return n

    # -- people and admins ---------------------------------------------------------------

    def cancel(self, entry_id: str, actor: str, reason: str = "Cancelled.") -> Entry | None:
        """Take a waiting entry out of line (its owner, or an admin: audited when not the
        owner). None when it is not waiting."""
        return self._act(entry_id, actor, "cancel", reason)

    def act(self, entry_id: str, action: str, actor: str) -> Entry | None:
        """An admin's `hold`, `release`, `top` or `cancel` of a waiting entry, audited."""
        if action not in ACTIONS:
            raise BadRequest(f"Unknown action {action!r}; one of {', '.join(ACTIONS)}.")
        return self._act(entry_id, actor, action, f"Cancelled by an admin ({actor}).")

    def _act(self, entry_id: str, actor: str, action: str, reason: str) -> Entry | None:
        now = time.time()
        with self._writing() as s:
            row = s.get(QueueEntryRow, entry_id)
            if row is None or row.pool != self.pool or row.state != "waiting":
                return None
            old = {"held": bool(row.held), "top_at": row.top_at, "state": row.state}
            if action == "hold":
                row.held = 1
            elif action == "release":
                row.held = 0
            elif action == "top":
                row.top_at, row.held = now, 0
            else:
                row.state, row.reason = "cancelled", reason
            row.updated_at = now
            if actor != row.user:
                s.add(AuditRow(at=now, actor=actor, scope="queue",
                               name=f"{row.user}/{row.kind}/{row.holder}",
                               old=json.dumps(old), new=json.dumps(
                                   {"action": action, "held": bool(row.held),
                                    "top_at": row.top_at, "state": row.state})))
            s.flush()
            return Entry.of(row)

    # -- reading -------------------------------------------------------------------------

    def _lock(self, s, people: bool = False) -> set[str] | None:
        """The admission locks in the transaction `s`. On SQLite the transaction's ``BEGIN
        IMMEDIATE`` is the lock (None: everyone's). On PostgreSQL, with `people`, first the
        person locks of everyone waiting (an admission holds its person's lock while it
        checks their quota, and takes the pool's afterwards: taking them in the same order
        cannot deadlock), then the pool's row, as an admission to a pool that hands out
        devices takes it; returns the people locked (a pass starts only their entries)."""
        locked = None
        if people and s.bind.dialect.name == "postgresql":
            users = sorted(s.scalars(select(QueueEntryRow.user).where(
                QueueEntryRow.pool == self.pool, QueueEntryRow.state == "waiting").distinct()))
            for user in users:
                s.execute(select(func.pg_advisory_xact_lock(person_key(self.pool, user))))
            locked = set(users)
        if s.execute(select(Pool.name).where(Pool.name == self.pool).with_for_update()).first() \
                is None:
            s.add(Pool(name=self.pool, assigns_devices=1))
            s.flush()
        return locked

    def _devices(self, s) -> list[policy.Device]:
        return [policy.Device(i, m) for i, m in s.execute(
            select(Device.index, Device.model).where(Device.pool == self.pool)
            .order_by(Device.index))]

    def _read(self, s, now: float, locked: set[str] | None = None) -> "_State":
        """What a pass decides on; with `locked`, only those people's entries wait (the
        others, who came after the locks were taken, wait for the next pass)."""
        devices = self._devices(s)
        entry_rows = list(s.scalars(select(QueueEntryRow).where(
            QueueEntryRow.pool == self.pool,
            QueueEntryRow.state.in_(("waiting", "admitted", "preempting")))))
        by_alloc = {r.allocation_id: r for r in entry_rows if r.allocation_id}
        open_rows = list(s.scalars(select(AllocationRow).where(
            AllocationRow.pool == self.pool, AllocationRow.ended_at.is_(None))))
        running = []
        for a in open_rows:
            e = by_alloc.get(a.id)
            # its time limit: kept with the allocation (admitted at once or by a pass), or
            # that of the entry it was admitted from (allocations older than the column)
            limit = a.max_runtime if a.max_runtime is not None else (
                e.max_runtime if e is not None else None)
            running.append(policy.Running(
                a.id, a.user, a.kind, tuple(json.loads(a.devices or "[]")), a.started_at,
                limit,
                bool(e.preemptible) if e is not None else False,
                bool(e.borrowed) if e is not None else False,
                stopping=e is not None and e.state == "preempting", holder=a.holder))
        if locked is not None:
            entry_rows = [r for r in entry_rows if r.state != "waiting" or r.user in locked]
        waiting = [r for r in entry_rows if r.state == "waiting"]
        groups = {}
        for r in sorted(entry_rows, key=lambda r: r.submitted_at):
            groups[r.user] = json.loads(r.groups or "[]")
        users = {r.user for r in waiting} | {a.user for a in open_rows}
        # everyone's quota from one read, and the history summed per person in the database
        # (decayed use, GPU-hours of each budget's window): no query per person
        # (tests/unit/test_scale_paths.py counts them), and no row of the history carried into
        # Python (bench/scale.py --only-pages --profile, 100,000 past allocations: reading
        # the 58,000 of the last five half-lives was 60 % of the service's samples)
        quotas = self.ledger.effective_of({u: groups.get(u, ()) for u in users}, s)
        usage = self._decayed_usage(s, users, now)
        windows = {u: now - q.window_hours * 3600 for u, (q, _) in quotas.items()
                   if u in users and q is not None and q.gpu_hours is not None}
        used = self._window_usage(s, windows, now)
        people = {}
        for user in users:
            quota, _ = quotas[user]
            shares = [self.group_shares[g] for g in groups.get(user, ()) if g in self.group_shares]
            people[user] = policy.Person(quota, max(shares) if shares else None,
                                         usage.get(user, 0.0), used.get(user, 0.0))
        entries = [Entry.of(r) for r in entry_rows if r.state in ("waiting",)]
        return _State(devices, running, entries, people)

    def _decayed_usage(self, s, users: set[str], now: float) -> dict[str, float]:
        """`policy.decayed_usage` of `users`' history (use that ended in the last five
        half-lives, or runs on: older weighs less than 1/32), summed per person by the
        database (their rows found by the person's index)."""
        if not users:
            return {}
        a = AllocationRow.__table__.c
        k = policy.LN2 / self.half_life
        end = func.coalesce(a.ended_at, literal(now))
        end_in = case((end > now, literal(now)), else_=end)
        # the integral of 2 ** (-(now - t) / half_life) over [start, end], per GPU
        weight = (func.exp((end_in - now) * k) - func.exp((a.started_at - now) * k)) / k
        q = select(a.user, func.sum(a.gpus * weight)).where(
            a.user.in_(sorted(users)), a.gpus > 0, end_in > a.started_at,
            a.ended_at.is_(None) | (a.ended_at > now - 5 * self.half_life)).group_by(a.user)
        return {user: (v or 0.0) / 3600.0 for user, v in s.execute(q)}

    def _window_usage(self, s, windows: dict[str, float], now: float) -> dict[str, float]:
        """GPU-hours of each person in `windows` from their window's start to `now` (open
        allocations to `now`), summed by the database: one column per distinct start."""
        if not windows:
            return {}
        a = AllocationRow.__table__.c
        starts = sorted(set(windows.values()))
        end = func.coalesce(a.ended_at, literal(now))
        end_in = case((end > now, literal(now)), else_=end)
        parts = [func.sum(case((end > st, a.gpus * (end_in - case(
            (a.started_at < st, literal(st)), else_=a.started_at))), else_=0)) for st in starts]
        q = select(a.user, *parts).where(a.gpus > 0, a.started_at < now, end > starts[0],
                                         a.user.in_(sorted(windows))).group_by(a.user)
        column = {st: i for i, st in enumerate(starts)}
        out = {}
        for user, *sums in s.execute(q):
            v = sums[column[windows[user]]]
            out[user] = max(0.0, v or 0.0) / 3600.0
        return out

    def _plan(self, state: "_State", now: float) -> policy.Plan:
        line = [policy.Waiting(e.id, e.user, e.kind, e.gpus, e.submitted_at, e.model, e.priority,
                               e.max_runtime, e.preemptible, e.held, e.top_at, e.holder)
                for e in state.entries]
        return policy.plan(state.devices, state.running, line, state.people, now, self.settings,
                           self.matches)


@dataclass
class _State:
    devices: list[policy.Device]
    running: list[policy.Running]
    entries: list[Entry]
    people: dict[str, policy.Person]


def _join(old: str, new: str) -> str:
    """A preempted entry keeps saying so while it waits again."""
    return f"{old} {new}" if old and old.startswith("Preempted") else new




class GPUQueue(Configurable):
    """The GPU queue's policy settings (``c.GPUQueue.*`` in the hub's configuration; the hub
    hands them to the gpulab service in its config file). The local deployment's training jobs
    and GPU notebooks wait in this queue; on Kubernetes, queueing is Kueue's."""

    enabled = t.Bool(True, help="""
        Whether GPU work that does not fit now waits in the queue (state Queued) instead of
        being refused. False: every request is admitted now or refused, as without a queue
        (a job's ``wait: false`` asks for that per job). Default True.
        Example: ``c.GPUQueue.enabled = False``""").tag(config=True)
    half_life_hours = t.Float(168.0, help="""
        Half-life of past GPU use in the fair-share order, in hours (default 168: a week): a
        person's GPU-hours of a week ago weigh half as much as today's. Must be positive.
        Example: ``c.GPUQueue.half_life_hours = 24``""").tag(config=True)
    borrowing = t.Bool(True, help="""
        Whether preemptible jobs (``preemptible: true``) may borrow GPUs that are idle beyond
        their owner's quota; they are stopped (SIGTERM, then resumed from their checkpoint)
        when in-quota work needs the GPUs. Default True.
        Example: ``c.GPUQueue.borrowing = False``""").tag(config=True)
    group_shares = t.Dict(value_trait=t.Float(), help="""
        Fair-share weights of groups (a person in several takes the largest); a person's own
        GPU quota is their weight otherwise. Default: none.
        Example: ``c.GPUQueue.group_shares = {"vision": 2.0, "nlp": 1.0}``""").tag(config=True)

    longest_notebook_wait_minutes = t.Int(60, help="""
        The longest a notebook server (LocalGPUSpawner) may wait in the queue for busy GPUs,
        in minutes (default 60). The spawn form offers "don't wait" and waits of 5, 15 and 60
        minutes up to this; the REST API's ``gpu_wait_minutes`` takes the same values. 0: GPU
        notebooks never wait (refused when their GPUs are busy, as without a queue). A
        waiting server's ``start_timeout`` is raised by its wait. Kubernetes notebooks never
        wait. Example: ``c.GPUQueue.longest_notebook_wait_minutes = 15``""").tag(config=True)

    @t.validate("longest_notebook_wait_minutes")
    def _not_negative(self, proposal):
        if proposal["value"] < 0:
            raise t.TraitError("c.GPUQueue.longest_notebook_wait_minutes must be 0 or more")
        return proposal["value"]

    @t.validate("half_life_hours")
    def _positive(self, proposal):
        if not proposal["value"] > 0:
            raise t.TraitError("c.GPUQueue.half_life_hours must be positive")
        return proposal["value"]

    def settings_json(self) -> str:
        """These settings as JSON, for the gpulab service (`queue_from_json`)."""
        return json.dumps({"enabled": self.enabled, "half_life_hours": self.half_life_hours,
                           "borrowing": self.borrowing, "group_shares": self.group_shares},
                          sort_keys=True)


def queue_of(ledger: Ledger, settings: GPUQueue) -> Queue | None:
    """The queue of `ledger`'s pool with `settings`, or None when the queue is off. Models
    match as the spawner's profiles match them (a profile may name a prefix of the product,
    `gpulab.hub.quota.queue.model_matches`), in every process that runs passes."""
    if not settings.enabled:
        return None
    return Queue(ledger, half_life_hours=settings.half_life_hours,
                 borrowing=settings.borrowing, group_shares=settings.group_shares,
                 matches=policy.model_matches)


def queue_from_json(ledger: Ledger, raw: str | None) -> Queue | None:
    """The queue of `ledger`'s pool with the settings of `GPUQueue.settings_json` (empty: the
    defaults), or None when the queue is off."""
    return queue_of(ledger, GPUQueue(**json.loads(raw)) if raw else GPUQueue())
