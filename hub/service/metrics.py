"""``/services/gpulab/metrics``: the pool, the queue and people's use in Prometheus' format.

Authenticated as JupyterHub's own ``/hub/metrics`` is: the token (``Authorization: Bearer
<token>`` or ``token <token>``, as Prometheus sends ``authorization: credentials``) must carry
the scope ``read:metrics`` (JupyterHub's admin role has it; a role such as ``prometheus`` with
``scopes: [read:metrics]`` gives a token only that), or gpulab's ``custom:gpulab:admin``.
Without a token: 401; with a token lacking both scopes: 403; neither gets any series.

Most series are read from the ledger at scrape time by one `LedgerCollector` (a handful of
aggregate queries in a worker thread, no query per person: 100 held GPUs and 1,000 people
answer in milliseconds, ``bench/metrics.py``); the events the ledger does not keep
(admissions, refusals by reason, jobs' outcomes) are counters incremented where they happen
(`gpulab.hub.quota.events`; the hub counts notebook servers' at ``/hub/metrics``).

The series (every name a dashboard may use is in `SERIES`):

``gpulab_gpus{state, model}``
    the pool's GPUs by state: ``held`` (by a server or a job), ``draining`` (held by work the
    queue is preempting: they come back soon) and ``free``. A counting pool (Kubernetes,
    where the devices are the nodes') has no ``free``.
``gpulab_user_gpus_held{user, kind}``, ``gpulab_group_gpus_held{group}``
    GPUs held now per person (notebook or job) and per hub group (a person in two groups
    counts in both).
``gpulab_queue_waiting{kind}``, ``gpulab_queue_waiting_gpus{kind}``, ``gpulab_queue_oldest_wait_seconds{kind}``
    the queue now (held entries included).
``gpulab_queue_wait_seconds{kind}`` (histogram)
    how long work that started through the queue waited, from the ledger's history.
``gpulab_admissions_total{kind, how}``, ``gpulab_refusals_total{kind, reason}``, ``gpulab_job_outcomes_total{state}``
    counters of events (this process: jobs; the hub's ``/hub/metrics``: notebook servers).
``gpulab_jobs{state}``, ``gpulab_job_restarts_total``
    the jobs the ledger keeps, by state, and their replicas' restarts.
``gpulab_user_gpu_hours{user}``, ``gpulab_user_gpu_hours_budget{user}``
    GPU-hours used in the window of the person's budget, and the budget, for people with a
    budget who hold GPUs, used some in their window or have a quota of their own.
``gpulab_gpu_held_info{device, model, user, kind, holder, measured}``
    1 for each held device; ``measured="false"`` where nothing reads its usage (simulated
    GPUs, no NVML, a counting pool).
``gpulab_gpu_utilization_percent``, ``gpulab_gpu_memory_used_bytes``, ``gpulab_gpu_memory_total_bytes`` ``{device, model, user, kind, holder}``
    each held GPU's usage where it is measured (`held_gpu_usage`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import (CounterMetricFamily, GaugeMetricFamily,
                                    HistogramMetricFamily)
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest
from sqlalchemy import case, func, select
from tornado import web

from gpulab.hub.jobs.store import JobRow, ReplicaRow
from gpulab.hub.quota import events
from gpulab.hub.quota.ledger import Allocation, Ledger
from gpulab.hub.quota.policy import effective_quota
from gpulab.hub.quota.rows import AllocationRow, Device, QuotaRow
from gpulab.hub.quota.waiting import QueueEntryRow
from gpulab.hub.service import ADMIN_SCOPE
from gpulab.hub.service.base import Base

log = logging.getLogger("gpulab.service.metrics")

#: JupyterHub's scope for ``/hub/metrics``; the gpulab service asks for the same
METRICS_SCOPE = "read:metrics"
MIB = 1024 * 1024
#: the buckets of ``gpulab_queue_wait_seconds``: from seconds to a day
WAIT_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800, 3600, 7200, 14400, 43200, 86400)

#: every series name the endpoint may show (a histogram's and a counter's with their
#: suffixes), what a dashboard's queries may name (tests/unit/test_grafana_dashboard.py)
SERIES = frozenset({
    "gpulab_gpus", "gpulab_user_gpus_held", "gpulab_group_gpus_held",
    "gpulab_queue_waiting", "gpulab_queue_waiting_gpus", "gpulab_queue_oldest_wait_seconds",
    "gpulab_queue_wait_seconds_bucket", "gpulab_queue_wait_seconds_count",
    "gpulab_queue_wait_seconds_sum",
    "gpulab_admissions_total", "gpulab_refusals_total", "gpulab_job_outcomes_total",
    # prometheus_client's time each counter's labels were first used
    "gpulab_admissions_created", "gpulab_refusals_created", "gpulab_job_outcomes_created",
    "gpulab_jobs", "gpulab_job_restarts_total",
    "gpulab_user_gpu_hours", "gpulab_user_gpu_hours_budget",
    "gpulab_gpu_held_info", "gpulab_gpu_utilization_percent",
    "gpulab_gpu_memory_used_bytes", "gpulab_gpu_memory_total_bytes",
})


@dataclass
class Snapshot:
    """What one scrape read from the ledger (`read_snapshot`, in a worker thread)."""

    devices: list = field(default_factory=list)  # (index, model, simulated)
    allocations: list[Allocation] = field(default_factory=list)
    #: the allocation ids of work being preempted (their GPUs: ``draining``)
    draining: set = field(default_factory=set)
    waiting: list = field(default_factory=list)  # (kind, gpus, submitted_at)
    waits: dict = field(default_factory=dict)  # kind -> (bucket counts, count, sum)
    jobs: dict = field(default_factory=dict)  # state -> count
    restarts: int = 0
    quotas: list = field(default_factory=list)  # (scope, name, Quota)
    #: GPU-hours per person in each budget window: ``{window hours: {user: hours}}``
    used: dict = field(default_factory=dict)
    now: float = 0.0


def read_snapshot(ledger: Ledger, now: float | None = None) -> Snapshot:
    """The ledger's part of a scrape, in one read-only session: a few aggregate queries over
    the pool's devices, open allocations, live queue entries, the queue's history (one
    grouped scan), the jobs by state and the quotas; never a query per person."""
    now = time.time() if now is None else now
    snap = Snapshot(now=now)
    pool = ledger.pool
    with ledger.Reader() as s:
        snap.devices = [tuple(r) for r in s.execute(
            select(Device.index, Device.model, Device.simulated).where(Device.pool == pool)
            .order_by(Device.index))]
        snap.allocations = [Allocation.of(r) for r in s.scalars(
            select(AllocationRow).where(AllocationRow.pool == pool,
                                        AllocationRow.ended_at.is_(None)))]
        live = s.execute(select(QueueEntryRow.kind, QueueEntryRow.state, QueueEntryRow.gpus,
                                QueueEntryRow.submitted_at, QueueEntryRow.allocation_id)
                         .where(QueueEntryRow.pool == pool,
                                QueueEntryRow.state.in_(("waiting", "preempting")))).all()
        snap.waiting = [(k, g, at) for k, st, g, at, _ in live if st == "waiting"]
        snap.draining = {a for _, st, _, _, a in live if st == "preempting" and a}
        wait = AllocationRow.started_at - QueueEntryRow.submitted_at
        rows = s.execute(
            select(QueueEntryRow.kind,
                   *[func.sum(case((wait <= b, 1), else_=0)) for b in WAIT_BUCKETS],
                   func.count(), func.sum(wait))
            .join(AllocationRow, AllocationRow.id == QueueEntryRow.allocation_id)
            .where(QueueEntryRow.pool == pool).group_by(QueueEntryRow.kind)).all()
        n = len(WAIT_BUCKETS)
        snap.waits = {r[0]: ([int(x or 0) for x in r[1:1 + n]], int(r[1 + n]),
                             float(r[2 + n] or 0.0)) for r in rows}
        snap.jobs = {st: int(c) for st, c in s.execute(
            select(JobRow.state, func.count()).group_by(JobRow.state))}
        snap.restarts = int(s.scalar(select(func.coalesce(func.sum(ReplicaRow.restarts), 0)))
                            or 0)
        snap.quotas = [(r.scope, r.name, r.quota()) for r in s.scalars(select(QuotaRow))]
        windows = {q.window_hours for _, _, q in snap.quotas
                   if q.gpu_hours is not None and q.window_hours}
        for hours in sorted(windows):  # one grouped sum per window length (usually one)
            snap.used[hours] = gpu_hours_by_person(s, now - hours * 3600, now)
    return snap


def gpu_hours_by_person(s, since: float, until: float) -> dict[str, float]:
    """GPU-hours per person in ``[since, until]`` summed by the database (one row per
    person, not one per allocation; open allocations count to `until`), as
    `Ledger.usage` counts them."""
    a = AllocationRow
    end = func.coalesce(a.ended_at, until)
    span = (case((end < until, end), else_=until)
            - case((a.started_at > since, a.started_at), else_=since))
    rows = s.execute(select(a.user, func.sum(a.gpus * span)).where(
        a.gpus > 0, a.started_at < until, end > since).group_by(a.user))
    return {who: float(total or 0.0) / 3600.0 for who, total in rows}


def held_gpu_usage(usage, allocations: list[Allocation]) -> list[tuple[Allocation, dict]]:
    """``(allocation, entry)`` for each device an allocation holds, the entry being what the
    pages show for it (`gpulab.hub.machine.gpuusage.PoolUsage.entries`: ``measured``,
    ``gpu_percent``, ``memory_used_mib``, ``memory_total_mib``, or ``why`` not). The one
    place the metrics read GPU usage: a source `PoolUsage` gains (DCGM, a stand-in) shows here
    too. `usage` None (not measured by this service): every entry unmeasured."""
    out = []
    for a in allocations:
        if not a.devices:
            continue
        entries = (usage.entries(a.devices) if usage is not None else
                   [{"device": i, "measured": False, "why": "not measured"} for i in a.devices])
        out.extend((a, e) for e in entries)
    return out


class LedgerCollector:
    """A `prometheus_client` collector over the snapshot the handler read for this scrape
    (`collect` runs no query: the handler reads the ledger in a thread first and hands the
    snapshot over in `collect_from`)."""

    def __init__(self):
        self._snapshot: Snapshot | None = None
        self._groups: dict[str, list[str]] = {}
        self._usage = []

    def describe(self):  # no series at registration (they come from the snapshot)
        return []

    def collect_from(self, snapshot: Snapshot, groups: dict[str, list[str]], usage) -> None:
        self._snapshot, self._groups, self._usage = snapshot, groups, usage

    def collect(self):
        snap = self._snapshot
        if snap is None:
            return
        yield from _pool(snap)
        yield from _people(snap, self._groups)
        yield from _queue(snap)
        yield from _jobs(snap)
        yield from _budgets(snap, self._groups)
        yield from _telemetry(snap, self._usage)


def _pool(snap: Snapshot):
    g = GaugeMetricFamily("gpulab_gpus", "The pool's GPUs by state (held, draining, free) "
                          "and model", labels=["state", "model"])
    counts: dict[tuple[str, str], int] = {}
    models = {i: m for i, m, _ in snap.devices}
    if snap.devices:
        state = {i: "free" for i in models}
        for a in snap.allocations:
            for i in a.devices:
                state[i] = "draining" if a.id in snap.draining else "held"
        for i, st in state.items():
            key = (st, models.get(i, ""))
            counts[key] = counts.get(key, 0) + 1
        for m in set(models.values()):  # every state of every model, 0 included
            for st in ("held", "draining", "free"):
                counts.setdefault((st, m), 0)
    else:  # a counting pool: what is held, by the model asked for
        for a in snap.allocations:
            key = ("draining" if a.id in snap.draining else "held", a.model or "")
            counts[key] = counts.get(key, 0) + a.gpus
    for (st, m), n in sorted(counts.items()):
        g.add_metric([st, m], n)
    yield g


def _people(snap: Snapshot, groups: dict[str, list[str]]):
    u = GaugeMetricFamily("gpulab_user_gpus_held", "GPUs held now per person, by notebook "
                          "servers and by jobs", labels=["user", "kind"])
    by: dict[tuple[str, str], int] = {}
    per_user: dict[str, int] = {}
    for a in snap.allocations:
        if a.gpus:
            by[(a.user, a.kind)] = by.get((a.user, a.kind), 0) + a.gpus
            per_user[a.user] = per_user.get(a.user, 0) + a.gpus
    for (who, kind), n in sorted(by.items()):
        u.add_metric([who, kind], n)
    yield u
    g = GaugeMetricFamily("gpulab_group_gpus_held", "GPUs held now by the members of each "
                          "hub group", labels=["group"])
    by_group: dict[str, int] = {}
    for who, n in per_user.items():
        for grp in groups.get(who, ()):
            by_group[grp] = by_group.get(grp, 0) + n
    for grp, n in sorted(by_group.items()):
        g.add_metric([grp], n)
    yield g


def _queue(snap: Snapshot):
    kinds = ("notebook", "job")
    n = GaugeMetricFamily("gpulab_queue_waiting", "Entries waiting in the GPU queue now "
                          "(held ones included)", labels=["kind"])
    gp = GaugeMetricFamily("gpulab_queue_waiting_gpus", "GPUs the waiting entries ask for",
                           labels=["kind"])
    old = GaugeMetricFamily("gpulab_queue_oldest_wait_seconds", "How long the longest-waiting "
                            "entry has waited (0: none waits)", labels=["kind"])
    for kind in kinds:
        mine = [w for w in snap.waiting if w[0] == kind]
        n.add_metric([kind], len(mine))
        gp.add_metric([kind], sum(w[1] for w in mine))
        old.add_metric([kind], max((snap.now - w[2] for w in mine), default=0.0))
    yield from (n, gp, old)
    h = HistogramMetricFamily("gpulab_queue_wait_seconds", "How long work that started "
                              "through the queue waited for its GPUs", labels=["kind"])
    for kind in kinds:
        counts, count, total = snap.waits.get(kind, ([0] * len(WAIT_BUCKETS), 0, 0.0))
        buckets = [(str(float(b)), c) for b, c in zip(WAIT_BUCKETS, counts)]
        h.add_metric([kind], buckets + [("+Inf", count)], total)
    yield h


def _jobs(snap: Snapshot):
    j = GaugeMetricFamily("gpulab_jobs", "Training jobs the ledger keeps, by state",
                          labels=["state"])
    for st, c in sorted(snap.jobs.items()):
        j.add_metric([st], c)
    yield j
    yield CounterMetricFamily("gpulab_job_restarts", "Restarts of training jobs' replicas",
                              value=snap.restarts)


def _budgets(snap: Snapshot, groups: dict[str, list[str]]):
    used = GaugeMetricFamily("gpulab_user_gpu_hours", "GPU-hours a person used in the window "
                             "of their GPU-hour budget", labels=["user"])
    budget = GaugeMetricFamily("gpulab_user_gpu_hours_budget", "A person's GPU-hour budget "
                               "over its window", labels=["user"])
    default, by_group, own = None, {}, {}
    for scope, name, q in snap.quotas:
        if scope == "default":
            default = q
        elif scope == "group":
            by_group[name] = q
        else:
            own[name] = q
    if snap.used:
        people = ({who for used in snap.used.values() for who in used}
                  | {a.user for a in snap.allocations if a.gpus} | set(own))
        for who in sorted(people):
            mine = {g: by_group[g] for g in groups.get(who, ()) if g in by_group}
            quota, _ = effective_quota(default, mine, own.get(who))
            if quota is None or quota.gpu_hours is None or not quota.window_hours:
                continue
            hours = snap.used.get(quota.window_hours, {}).get(who, 0.0)
            used.add_metric([who], round(hours, 4))
            budget.add_metric([who], quota.gpu_hours)
    yield used
    yield budget


def _telemetry(snap: Snapshot, usage_entries):
    labels = ["device", "model", "user", "kind", "holder"]
    info = GaugeMetricFamily("gpulab_gpu_held_info", "1 for each held GPU, with who holds it "
                             "and whether its usage is measured", labels=labels + ["measured"])
    util = GaugeMetricFamily("gpulab_gpu_utilization_percent", "Percent of the last sample "
                             "period a kernel ran on the held GPU (NVML)", labels=labels)
    mem = GaugeMetricFamily("gpulab_gpu_memory_used_bytes", "Memory in use on the held GPU",
                            labels=labels)
    total = GaugeMetricFamily("gpulab_gpu_memory_total_bytes", "Memory of the held GPU",
                              labels=labels)
    models = {i: m for i, m, _ in snap.devices}
    for a, e in usage_entries:
        values = [str(e["device"]), models.get(e["device"], a.model or ""), a.user, a.kind,
                  a.holder]
        info.add_metric(values + [str(bool(e.get("measured"))).lower()], 1)
        if e.get("measured"):
            util.add_metric(values, e["gpu_percent"])
            mem.add_metric(values, e["memory_used_mib"] * MIB)
            total.add_metric(values, e["memory_total_mib"] * MIB)
    yield from (info, util, mem, total)


def make_registry() -> tuple[CollectorRegistry, LedgerCollector]:
    """The service's own registry: the ledger's collector and the event counters (not the
    process's default registry, whose platform and GC series are the hub's business)."""
    registry = CollectorRegistry(auto_describe=False)
    collector = LedgerCollector()
    registry.register(collector)
    for counter in events.COUNTERS:
        registry.register(counter)
    return registry, collector


class MetricsHandler(Base):
    """``GET /services/gpulab/metrics``: Prometheus' text format, for a token with
    ``read:metrics`` (or ``custom:gpulab:admin``); 401 without one, 403 with a token lacking
    them."""

    async def get(self):
        model = await self.hub_auth.get_user(self, sync=False)
        if not model:
            raise web.HTTPError(401, "Send a hub API token with the scope read:metrics "
                                "(header 'Authorization: Bearer <token>').")
        if not (self.hub_auth.check_scopes({METRICS_SCOPE}, model)
                or self.hub_auth.check_scopes({ADMIN_SCOPE}, model)):
            raise web.HTTPError(403, f"Metrics need the scope {METRICS_SCOPE}.")
        body = await scrape(self.settings)
        self.set_header("Content-Type", CONTENT_TYPE_LATEST)
        self.set_header("Cache-Control", "no-store")
        self.finish(body)

    def write_error(self, status_code, **kwargs):
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = (exc.log_message if isinstance(exc, web.HTTPError) and exc.log_message
                   else self._reason)
        if status_code >= 500:
            message = "Internal error in the gpulab service; see its log."
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.finish(json.dumps({"status": status_code, "message": message}))


async def scrape(settings) -> bytes:
    """One scrape: the hub's groups as last read (`HubDirectory.users_now`, never waited
    for once read), the ledger in a worker thread, then the text, also in the thread."""
    registry, collector, lock = settings["metrics"]
    try:
        users = await settings["directory"].users_now()
    except Exception as e:  # the hub does not answer: the series without groups
        log.warning("Metrics without groups: the hub's users could not be read (%s)", e)
        users = []
    groups = {u["name"]: u["groups"] for u in users if u["groups"]}
    ledger, usage = settings["ledger"], settings.get("gpu_usage")

    def read() -> bytes:
        snap = read_snapshot(ledger)
        with lock:  # one scrape at a time renders the shared collector
            collector.collect_from(snap, groups, held_gpu_usage(usage, snap.allocations))
            return generate_latest(registry)

    return await asyncio.to_thread(read)
