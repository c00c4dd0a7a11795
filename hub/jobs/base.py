"""One workflow for training jobs, two drivers.

`JobBackend` owns what every job goes through, in the order it happens, and the service calls
only it:

``submit``
    the driver's checks (`_prepare`), then, serialized in this process, the name rule, the
    person's replica bound, the admission of the job's GPUs whole through the ledger and the
    job's rows (`gpulab.hub.jobs.store`); then the driver starts it (`_launch`). A launch that
    fails is undone in one place (`_undo`): the driver's leftovers (`_unlaunch`), then the
    rows (or the job is kept as Failed with the reason, where the driver keeps such history)
    and the GPUs. Nothing stays "Admitted".
``supervise``
    one task per backend runs `_supervise_pass` every `supervise_interval` seconds under the
    backend's lock (which stops also take: a stop never races a restart).
``stop``
    the driver ends the job's replicas (`_halt`), then `_finish`.
``_finish``
    the driver frees what the job held on the machine or cluster (`_release`), then the job
    is final, its replicas stopped and its GPUs released in one commit.
``lease``
    a held cluster (kind ``cluster``, issue 38) lives while the notebook kernel that holds it
    renews its lease (``POST jobs/<name>/lease``, from a daemon thread of the kernel, with how
    long no step was dispatched): each supervision round (`_cluster_lifecycle_pass`) stops a
    cluster whose lease lapsed (``c.GPUJobs.cluster_lease_timeout`` seconds without a renewal:
    the kernel, or its server, went away) or that has been idle too long
    (``c.GPUJobs.cluster_idle_timeout``), and its GPUs come back. Leases are kept in the
    service's memory: after a restart of the service every held cluster gets a fresh one.
``recover``
    at start-up: the driver re-adopts or gives up its active jobs (`_recover_active`), then
    the allocations of jobs that no longer run are closed: nothing leaks.
``read_log``
    finds the person's job and replica (404s in words), then the driver reads the bytes
    (`_read_replica_log`), off the event loop; ``read_log_text`` gives them as a terminal
    shows them (`gpulab.extensions.joblog`), for every driver alike.

What a job's fate is (succeeded, failed, restart which replicas) is decided by pure functions
in `gpulab.hub.jobs.rules`; the drivers observe and act. Drivers: `gpulab.hub.jobs.local`
(processes under the users' accounts) and `gpulab.hub.jobs.kube` (Kubernetes Jobs).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import Any

from gpulab.extensions.contract import ACTIVE, CLUSTER, FINAL, JOB, lead_replica
from gpulab.extensions.joblog import LINE_BACK, open_line_start, render_text
from gpulab.hub.jobs.spec import DEFAULT_LIMITS, ROLES, JobLimits, JobSpec
from gpulab.hub.jobs.store import JobRow, JobStore, NameTaken, ReplicaRow
from gpulab.hub.quota import events
from gpulab.hub.quota.ledger import AdmissionRefused, Allocation, Ledger, Request
from gpulab.hub.quota.waiting import Entry, Queue, QueueRefused

log = logging.getLogger("gpulab.jobs")


class JobError(Exception):
    """A job request refused or failed, in words for the person (``status``: the HTTP status
    the service answers with; ``field``: the spec field it is about, if any)."""

    status = 400

    def __init__(self, message: str, status: int | None = None, field: str | None = None,
                 reason: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        #: the words for the job's own reason, where the job is kept (default: ``message``)
        self.reason = message if reason is None else reason
        if status:
            self.status = status


class JobNotFound(JobError):
    """The person has no job of that name (the service answers 404)."""

    status = 404

    def __init__(self, name: str):
        super().__init__(f"You have no job named '{name}'.", 404, "name")
        self.name = name


def job_view(job: JobRow, replicas: list[ReplicaRow]) -> dict:
    """The view of a job the API, the CLI and the notebook client show (without progress)."""
    spec = json.loads(job.spec)
    return {
        "id": job.id, "name": job.name, "user": job.user, "backend": job.backend,
        "kind": spec.get("kind") or JOB, "strategy": spec["strategy"], "state": job.state, "reason": job.reason,
        "gpus": JobSpec.model_validate(spec).total_gpus,
        "created_at": job.created_at, "started_at": job.started_at,
        "finished_at": job.finished_at, "job_dir": job.job_dir,
        "replicas": [
            {"role": r.role, "index": r.index, "name": f"{r.role}-{r.index}", "state": r.state,
             "reason": r.reason, "restarts": r.restarts,
             "restart_history": restart_history(r), "exit_code": r.exit_code,
             "devices": json.loads(r.devices)}
            for r in sorted(replicas, key=lambda r: (ROLES.index(r.role), r.index))
        ],
        "spec": spec,
    }


def restart_history(r: ReplicaRow) -> list[dict]:
    """A replica's restarts (`gpulab.extensions.joblog.restart_record` each), oldest first."""
    try:
        found = json.loads(r.restart_log or "[]")
    except ValueError:
        return []
    return found if isinstance(found, list) else []


def add_restart(r: ReplicaRow, record: dict) -> None:
    """Append a restart to a replica's row (in the caller's transaction)."""
    r.restart_log = json.dumps([*restart_history(r), record])


class JobBackend:
    """The job workflow the service calls; a driver subclass fills the hooks below
    (``# -- hooks a driver fills``) and overrides none of the workflow's methods (`WORKFLOW`,
    each of which says so), as oauthenticator's ``OAuthenticator`` keeps its ``authenticate``.

    The service's calls: ``async submit(user, groups, spec) -> view``; ``list(user | None)``
    and ``get(user, name) -> view | None`` (sync: the service runs them in a thread);
    ``async detail(user, name)``; ``async read_log(user, name, replica, offset, limit) ->
    (bytes, size, done)``; ``async stop(user, name, actor) -> view``; ``recover()`` at
    start-up; ``ensure_supervisor()`` (with a running event loop); ``async shutdown()``.
    """

    #: the workflow's methods, which drivers do not override (each says so;
    #: tests/unit/test_driver_boundary.py checks the drivers): a driver fills the hooks
    WORKFLOW = ('submit', 'list', 'get', 'view', 'detail', 'read_log', 'read_log_text', 'stop',
                'recover', 'shutdown', 'ensure_supervisor', 'active_owners', '_setup_workflow',
                '_with_places', '_check_new_name', '_check_replica_bound', '_admit_and_record',
                '_admit_or_queue', '_launch_or_undo', '_undo', '_supervise_round',
                '_supervise_forever', '_active_to_supervise', '_queue_pass', '_start_queued',
                '_preempt', '_finish', 'lease', '_cluster_lifecycle_pass',
                'active_clusters')

    #: the backend's name in the job rows (``local``, ``kubernetes``)
    name = ""
    ledger: Ledger
    #: the operator's job limits (``c.GPUJobs``), set by the service
    limits: JobLimits = DEFAULT_LIMITS
    #: why no job can run here (said by the API, the launcher and the CLI), or None
    unavailable: str | None = None
    #: whether a job whose launch failed is kept as Failed (history), or forgotten
    keeps_failed_launches = False
    #: whether a Queued job is launched at once (the cluster's queue, Kueue, admits it and
    #: the driver follows), rather than when gpulab's own queue admits it
    launches_queued = False

    def _setup_workflow(self, ledger: Ledger, queue: Queue | None = None) -> None:
        """The workflow's state; a driver's ``__init__`` calls it. With a `queue`, GPU work
        that does not fit now waits in it (Queued) instead of being refused.
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        self.ledger = ledger
        self.queue = queue
        self.store = JobStore(ledger, self.name)
        self._task: asyncio.Task | None = None
        self._round: asyncio.Future | None = None  # the supervision round under way
        #: supervision passes and stops exclude each other
        self._lock = asyncio.Lock()
        #: the name rule, the replica bound and the admission of one submit at a time
        self._admitting = asyncio.Lock()
        #: jobs being launched: supervision leaves them alone until `_launch` returns
        self._launching: set[str] = set()
        #: held clusters' leases: job id -> (monotonic time it lapses, seconds idle as the
        #: kernel last said, monotonic time it said so)
        self._leases: dict[str, tuple[float, float, float]] = {}

    # -- hooks a driver fills ------------------------------------------------------------

    @property
    def supervise_interval(self) -> float:
        """Seconds between supervision passes."""
        raise NotImplementedError

    async def _prepare(self, user: str, groups: tuple[str, ...], spec: JobSpec) -> Any:
        """Checks before admission (raise `JobError`); returns what `_launch` needs."""
        return None

    def _job_dir(self, user: str, spec: JobSpec, prepared: Any) -> str:
        raise NotImplementedError

    def _replica_rows(self, spec: JobSpec, allocation: Allocation | None) -> list[dict]:
        """The columns of each replica's row besides ``job_id`` (``allocation`` None: the
        job is queued; called again with its allocation when it starts)."""
        raise NotImplementedError

    async def _launch(self, job_id: str, user: str, groups: tuple[str, ...], spec: JobSpec,
                      prepared: Any) -> None:
        """Start the recorded job (raise to have it undone)."""
        raise NotImplementedError

    async def _unlaunch(self, job_id: str, user: str, spec: JobSpec) -> None:
        """Remove whatever a failed `_launch` left running or made."""

    def _launch_error(self, e: BaseException, spec: JobSpec) -> JobError:
        """What the person is told when `_launch` raised ``e``."""
        if isinstance(e, JobError):
            return e
        return JobError(f"The job could not be started: {e}", 500)

    async def _supervise_pass(self) -> bool:
        """One pass over the active jobs; returns whether supervision should go on."""
        raise NotImplementedError

    async def _start_supervising(self) -> None:
        """Before the first pass (e.g. start watches)."""

    async def _stop_supervising(self) -> None:
        """At shutdown, after the supervision task is cancelled."""

    async def _halt(self, view: dict) -> None:
        """End a job's replicas (stop), before it is marked Stopped."""
        raise NotImplementedError

    def _release(self, job: JobRow, spec: JobSpec) -> None:
        """Free what an ending job held on the machine (sync; before it is marked final)."""

    def _recover_active(self) -> None:
        """At start-up: re-adopt the active jobs that still run, finish the others."""

    def _read_replica_log(self, job: JobRow, replica: str, offset: int, limit: int):
        """(bytes from ``offset``, size, done) of a replica's log; may be a coroutine
        function (then it is awaited) or sync (then it runs in a thread)."""
        raise NotImplementedError

    def _view(self, job: JobRow, replicas: list[ReplicaRow], detail: bool = False) -> dict:
        """A job's view; ``detail``: for one job (``get``), not the list. For a held cluster
        (``view["kind"] == "cluster"``) the driver adds ``view["cluster"]``: ``{"ps":
        ["host:port", ...], "worker": [...]}``, where the owner's kernels reach its servers
        (the service shows it to the owner alone)."""
        return job_view(job, replicas)

    async def _detail(self, view: dict) -> dict:
        """One job's view (`get`'s) with what only someone looking at it is worth fetching
        (`detail`; the Kubernetes driver: its progress, from the lead replica's log)."""
        return view

    def _admission(self, req: Request, spec: JobSpec) -> Allocation | None:
        """The admission choice at submit (in a worker thread, submits serialized): the job's
        allocation now, or None: it is recorded Queued (raise `AdmissionRefused` to refuse
        it). Default: gpulab's ledger and queue (`_admit_or_queue`). The Kueue driver's:
        always Queued (Kueue admits it), refused only when it could never fit the quota."""
        return self._admit_or_queue(req, spec)

    # -- queries -------------------------------------------------------------------------

    def list(self, user: str | None = None) -> list[dict]:
        """Drivers should not override this method (the workflow's; they fill the hooks)."""
        return self._with_places([self._view(j, reps) for j, reps in self.store.all(user)])

    def active_clusters(self) -> set[tuple[str, str]]:
        """``(user, name)`` of every held cluster not yet final (sync), for the pages that
        show GPU holdings and the queue, where a cluster's allocation is a job's.
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        # one query of the specs alone (no replicas); only specs naming a cluster are parsed
        return {(user, name) for user, name, spec in self.store.active_specs()
                if CLUSTER in spec and json.loads(spec).get("kind") == CLUSTER}

    def active_owners(self) -> list[tuple[str, str]]:
        """``(user, name)`` of every job not yet final, waiting ones too (sync).
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        return self.store.active_owners()

    def get(self, user: str, name: str) -> dict | None:
        """Drivers should not override this method (the workflow's; they fill the hooks)."""
        job, replicas = self.store.find(user, name)
        if job is None:
            return None
        # a view may read a log (progress): after the transaction, never in it
        return self._with_places([self._view(job, replicas, detail=True)])[0]

    def _with_places(self, views: list[dict]) -> list[dict]:
        """Queued jobs' views with where they stand (``queue``: position, estimated start,
        the work ahead, why they wait), computed now from the whole line.
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        queued = [v for v in views if v["state"] == "Queued"]
        if not queued or self.queue is None:
            return views
        users = {v["user"] for v in queued}
        by = {(e.user, e.holder): e for e in self.queue.entries()
              if e.kind == "job" and e.user in users}
        for v in queued:
            e = by.get((v["user"], v["name"]))
            v["queue"] = None if e is None else queue_place(e)
            if e is not None and e.reason:
                v["reason"] = e.reason
        return views

    async def view(self, user: str, name: str) -> dict:
        """One job's view for someone looking at it (`detail`); `JobNotFound` if there is
        no such job.
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        view = await self.detail(user, name)
        if view is None:
            raise JobNotFound(name)
        return view

    async def detail(self, user: str, name: str) -> dict | None:
        """One job's view for someone looking at it (``GET jobs/<name>``): `get`, plus what
        only such a look is worth fetching (the driver's `_detail`); None: no such job.
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        view = await asyncio.to_thread(self.get, user, name)
        return None if view is None else await self._detail(view)

    async def read_log(self, user: str, name: str, replica: str, offset: int = 0,
                       limit: int = 1 << 20) -> tuple[bytes, int, bool]:
        """(up to ``limit`` bytes of a replica's log from ``offset``, its size, job finished).
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        job, replicas = await asyncio.to_thread(self.store.find, user, name)
        if job is None:
            raise JobNotFound(name)
        names = [f"{r.role}-{r.index}" for r in replicas]
        if replica not in names:
            raise JobError(f"Job '{name}' has no replica '{replica}'; it has "
                           f"{', '.join(sorted(names))}.", 404, "replica")
        if asyncio.iscoroutinefunction(self._read_replica_log):
            return await self._read_replica_log(job, replica, offset, limit)
        return await asyncio.to_thread(self._read_replica_log, job, replica, offset, limit)

    async def read_log_text(self, user: str, name: str, replica: str, offset: int = 0,
                            raw: bool = False, limit: int = 1 << 20) -> dict:
        """A piece of a replica's log for a reader (the log API's answer): ``text`` as a
        terminal shows it (`gpulab.extensions.joblog.render`), from ``from``: the start of
        the line still open at ``offset`` (at most `LINE_BACK` before it), so that a line
        redrawn across reads comes whole, in its newest state, and the reader replaces its
        own open line with it; ``offset``: where to ask next; ``size``; ``done``. With
        ``raw``: the bytes from ``offset`` as they are (``from`` == ``offset``).
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        back = 0 if raw else min(offset, LINE_BACK)
        data, size, done = await self.read_log(user, name, replica, offset - back, limit + back)
        before, data = data[:back], data[back:]
        start = offset - back + open_line_start(before, offset == back) if back else offset
        text = (data if raw else before[start - (offset - back):] + data).decode(errors="replace")
        if not raw:  # up to 1 MiB of anyone's bytes: off the event loop
            text = await asyncio.to_thread(render_text, text)
        return {"replica": replica, "offset": offset + len(data), "from": start, "size": size,
                "text": text, "done": done}

    # -- submit --------------------------------------------------------------------------

    def _check_new_name(self, user: str, name: str) -> None:
        """Drivers should not override this method (the workflow's; they fill the hooks)."""
        if self.store.name_taken(user, name):
            raise JobError(f"name: you already have a job named '{name}' (jobs are "
                           "kept as history); choose another name.", 409, "name")

    def _check_replica_bound(self, user: str, spec: JobSpec) -> None:
        """Refuse a job that would take `user`'s active replicas (all backends, all their
        jobs) over ``max_replicas_per_user``. Called where admissions are serialized.
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        bound = self.limits.max_replicas_per_user
        if not bound:
            return
        active = self.store.active_replicas(user)
        if active + spec.replica_count > bound:
            events.REFUSALS.labels(kind="job", reason="replica_bound").inc()
            raise JobError(f"replicas: at most {bound} replicas of your jobs may run at once; "
                           f"{active} are active now and this job has {spec.replica_count}. "
                           "Wait for a job to finish, stop one, or ask for fewer replicas.",
                           409, "replicas")

    def _admit_and_record(self, user: str, groups: tuple[str, ...], spec: JobSpec,
                          prepared: Any) -> tuple[str, Allocation]:
        """The name rule, the replica bound, the admission and the rows (in a thread, under
        ``_admitting``): a second submit of one name is told so, not refused GPUs, and
        concurrent submits of one person cannot pass the bound together.
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        self._check_new_name(user, spec.name)
        self._check_replica_bound(user, spec)
        req = Request(user=user, kind="job", holder=spec.name, gpus=spec.total_gpus,
                      groups=groups, max_runtime=spec.max_runtime)
        try:
            allocation = self._admission(req, spec)
        except AdmissionRefused as e:
            events.refused("job", e)
            raise
        events.admitted("job", "now" if allocation is not None else "queued")
        job_id = uuid.uuid4().hex
        try:
            self.store.record(job_id=job_id, user=user, spec=spec, allocation=allocation,
                              job_dir=self._job_dir(user, spec, prepared),
                              replicas=self._replica_rows(spec, allocation))
        except BaseException as e:
            if allocation is not None:
                self.ledger.release(allocation.id, "job not recorded")
            else:
                self.queue.forget(user, "job", spec.name, "job not recorded")
            if isinstance(e, NameTaken):
                raise JobError(f"name: you already have a job named '{spec.name}'; choose "
                               "another name.", 409, "name") from None
            raise
        return job_id, allocation

    def _admit_or_queue(self, req: Request, spec: JobSpec) -> Allocation | None:
        """The whole job's GPUs in one transaction (the ledger's refusal reaches the service
        as it is), or, with a queue, None: the job waits in line. Nobody jumps the line: while
        anyone waits, new GPU work queues behind them (or, with ``wait: false``, is refused).
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        if self.queue is None or req.gpus == 0:
            return self.ledger.admit(req)
        waiting = self.queue.waiting_count()
        refusal = None
        if not waiting:
            try:
                return self.ledger.admit(req)
            except AdmissionRefused as e:
                if not spec.wait:
                    raise
                refusal = e
        elif not spec.wait:
            ahead = AdmissionRefused(
                f"{waiting} request{'s' if waiting != 1 else ''} already wait{'' if waiting != 1 else 's'} "
                "for GPUs, and this one asked not to wait (wait: false). Submit it without "
                "that to take its place in the queue.")
            ahead.metric_reason = "line_ahead"  # its refusals' label (gpulab_refusals_total)
            raise ahead
        try:
            self.queue.enqueue(req, priority=spec.priority, max_runtime=spec.max_runtime,
                               preemptible=spec.preemptible)
        except QueueRefused as e:  # it could never run: refused at once, as without a queue
            never = refusal or AdmissionRefused(e.message)
            never.metric_reason = e.metric_reason  # counted as never fitting, in any words
            raise never from None
        return None

    async def submit(self, user: str, groups: tuple[str, ...], spec: JobSpec) -> dict:
        # a spec without a time limit gets the operator's default (``c.GPUJobs``), enforced
        # as an explicit one is, and counted by the queue's estimates
        """Drivers should not override this method (the workflow's; they fill the hooks)."""
        spec = self.limits.with_time_limit(spec)
        prepared = await self._prepare(user, groups, spec)
        async with self._admitting:
            job_id, allocation = await asyncio.to_thread(
                self._admit_and_record, user, groups, spec, prepared)
            self._launching.add(job_id)
        try:
            if allocation is not None or self.launches_queued:
                # under the lock: no supervision pass or stop meets a half-launched job
                async with self._lock:
                    await self._launch_or_undo(job_id, allocation and allocation.id, user,
                                               groups, spec, prepared,
                                               keep=self.keeps_failed_launches)
        finally:
            self._launching.discard(job_id)
        self.ensure_supervisor()  # a queued job starts from a supervision pass
        return await asyncio.to_thread(self.get, user, spec.name)

    async def _launch_or_undo(self, job_id: str, allocation_id: str | None, user: str, groups,
                              spec: JobSpec, prepared: Any, keep: bool) -> None:
        """`_launch` (with the lock held); if it raises, `_undo` and raise the person's error.
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        try:
            await self._launch(job_id, user, groups, spec, prepared)
        except BaseException as e:
            error = self._launch_error(e, spec)
            if error.status >= 500 and not isinstance(e, JobError):
                log.error("Job %s/%s failed to start", user, spec.name, exc_info=e)
            await self._undo(job_id, allocation_id, user, spec, error.reason, keep=keep)
            if isinstance(e, (KeyboardInterrupt, SystemExit, asyncio.CancelledError)):
                raise
            raise error from (None if e is error else e)

    async def _undo(self, job_id: str, allocation_id: str | None, user: str, spec: JobSpec,
                    why: str, keep: bool = False) -> None:
        """Everything a submit did after admission, undone (the one place for it): the
        driver's leftovers, then the rows (or the job kept as Failed) and its GPUs. The job's
        folder stays (it is the person's, and may have been there before).
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        try:
            await self._unlaunch(job_id, user, spec)
        except Exception:
            log.exception("Undoing the launch of job %s failed", job_id)
        try:
            if keep:
                await asyncio.to_thread(self._finish, job_id, "Failed",
                                        f"could not be created: {why}")
            else:
                await asyncio.to_thread(self.store.remove, job_id)
        except Exception:
            log.exception("Undoing job %s failed; it is marked failed instead", job_id)
            await asyncio.to_thread(self._finish, job_id, "Failed", "could not start")
        finally:
            if allocation_id is not None:  # None: a job the cluster's queue had not admitted
                await asyncio.to_thread(self.ledger.release, allocation_id,
                                        "job failed to start")

    # -- supervision ---------------------------------------------------------------------

    def ensure_supervisor(self) -> None:
        """Drivers should not override this method (the workflow's; they fill the hooks)."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._supervise_forever())

    async def _supervise_round(self) -> bool:
        """One round under the lock: the queue's pass, then the supervision pass; whether
        there is more to supervise.
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        async with self._lock:
            if self.queue is not None:
                await self._queue_pass()
            more = await self._supervise_pass()
            await self._cluster_lifecycle_pass()
            if not more and self.queue is not None:  # queued jobs wait for passes
                more = bool(await asyncio.to_thread(self.store.active_ids))
        return more

    async def _supervise_forever(self) -> None:
        """Drivers should not override this method (the workflow's; they fill the hooks)."""
        await self._start_supervising()
        while True:
            # each round a task of its own, which `shutdown` lets finish: a cancel would stop
            # only the waiting, not what the round runs in worker threads (a queue pass could
            # admit a job after the stop)
            self._round = asyncio.ensure_future(self._supervise_round())
            try:
                if not await asyncio.shield(self._round):
                    self._task = None
                    return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("Job supervision (%s) failed; retrying", self.name)
            await asyncio.sleep(self.supervise_interval)

    def _active_to_supervise(self) -> list[str]:
        """The active jobs of this backend that no submit is launching now: the started ones
        (not Queued), or with ``launches_queued`` the Queued ones too (the cluster's queue,
        not a gpulab pass, admits them).
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        return [j for j in self.store.active_ids(started=not self.launches_queued)
                if j not in self._launching]

    # -- the queue -----------------------------------------------------------------------

    async def _queue_pass(self) -> None:
        """One scheduling pass of the queue (with the lock held), then this backend's jobs
        brought in line with the queue's state: a Queued job whose entry was admitted starts,
        a running job whose entry is being preempted stops and waits again. The pass that
        admitted or preempted may have been another process's (the hub runs passes while a
        notebook waits): the queue's rows, not one pass's answer, say what to do.
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        await asyncio.to_thread(self.queue.schedule)
        entries = await asyncio.to_thread(self.queue.holders, "job")
        if not entries:
            return
        for job, _ in await asyncio.to_thread(self.store.active):
            entry = entries.get((job.user, job.name))
            if entry is None:
                continue
            if job.state == "Queued" and entry.state == "admitted":
                allocation = await asyncio.to_thread(self.ledger.get, entry.allocation_id)
                if allocation is not None and allocation.open:
                    await self._start_queued(entry, allocation)
                else:  # its GPUs went back before it started: in line again, in its place
                    await asyncio.to_thread(self.queue.requeue, entry.id,
                                            "Its GPUs went back before it started; it waits "
                                            "again in its place.")
            elif (job.state != "Queued" and entry.state == "preempting"
                  and entry.allocation_id == job.allocation_id):
                allocation = await asyncio.to_thread(self.ledger.get, entry.allocation_id)
                if allocation is not None:
                    await self._preempt(allocation, entry.reason)

    async def _start_queued(self, entry: Entry, allocation: Allocation) -> None:
        """Drivers should not override this method (the workflow's; they fill the hooks)."""
        job, _ = await asyncio.to_thread(self.store.find, entry.user, entry.holder)
        if job is None or job.state != "Queued":  # stopped meanwhile: the GPUs go back
            await asyncio.to_thread(self.ledger.release, allocation.id, "job no longer waits")
            await asyncio.to_thread(self.queue.forget, entry.user, "job", entry.holder,
                                    "job no longer waits")
            return
        spec = JobSpec.model_validate_json(job.spec)
        admitted = await asyncio.to_thread(self.store.admit_queued, job.id, allocation,
                                           self._replica_rows(spec, allocation))
        if not admitted:
            await asyncio.to_thread(self.ledger.release, allocation.id, "job no longer waits")
            return
        log.info("Job %s/%s starts from the queue", job.user, job.name)
        try:
            prepared = await self._prepare(job.user, (), spec)
            await self._launch_or_undo(job.id, allocation.id, job.user, (), spec, prepared,
                                       keep=True)
        except JobError as e:
            await asyncio.to_thread(self._finish, job.id, "Failed", f"could not start: {e.reason}")
        except Exception as e:
            log.exception("Job %s/%s could not start from the queue", job.user, job.name)
            await asyncio.to_thread(self._finish, job.id, "Failed", f"could not start: {e}")

    async def _preempt(self, allocation: Allocation, why: str) -> None:
        """Stop a preemptible job that borrowed GPUs (SIGTERM first, so that it can save),
        and put it back in line: it resumes from its last checkpoint when it starts again.
        ``why``: the queue's words for its owner ("Preempted: …").
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        job, reps = await asyncio.to_thread(self.store.find, allocation.user, allocation.holder)
        entry = await asyncio.to_thread(self.queue.of_holder, allocation.user, "job",
                                        allocation.holder)
        if job is None or job.state not in ACTIVE or job.allocation_id != allocation.id:
            log.warning("Preemption of %s/%s: no such running job", allocation.user,
                        allocation.holder)
            return
        reason = why if why.startswith("Preempted") else (
            f"Preempted: {why} It waits in the queue again and resumes from its last checkpoint.")
        log.info("Preempting job %s/%s: %s", job.user, job.name, why)
        await self._halt(job_view(job, reps))
        await asyncio.to_thread(self._release, job, JobSpec.model_validate_json(job.spec))
        await asyncio.to_thread(self.store.requeue, job.id, reason)
        if entry is not None:
            await asyncio.to_thread(self.queue.requeue, entry.id, reason)

    # -- held clusters: the kernel's lease -------------------------------------------------

    async def lease(self, user: str, name: str, idle_for: float = 0.0) -> dict:
        """The kernel holding `user`'s cluster `name` renews its lease (for
        ``c.GPUJobs.cluster_lease_timeout`` seconds more) and says how long no step was
        dispatched (``idle_for``); the cluster's view. 404: no such job; 409: not a held
        cluster, or it has ended.
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        view = await asyncio.to_thread(self.get, user, name)
        if view is None:
            raise JobNotFound(name)
        if view.get("kind") != CLUSTER:
            raise JobError(f"'{name}' is a training job, not a held cluster: only clusters "
                           "have leases.", 409, "name")
        if view["state"] in FINAL:
            raise JobError(f"The cluster '{name}' has ended ({view['state']}: "
                           f"{view['reason']}).", 409, "name")
        now = time.monotonic()
        self._leases[view["id"]] = (now + self.limits.cluster_lease_timeout,
                                    max(0.0, float(idle_for)), now)
        self.ensure_supervisor()
        # how often to renew, and the idle limit (the kernel shows neither as a setting)
        view["lease"] = {"timeout": self.limits.cluster_lease_timeout,
                         "idle_timeout": self.limits.cluster_idle_timeout}
        return view

    def _lease_of(self, job_id: str) -> tuple[float, float, float]:
        """A cluster's lease; one it has none of yet (just held, or the service restarted)
        starts now, for a whole lease time."""
        now = time.monotonic()
        return self._leases.setdefault(job_id, (now + self.limits.cluster_lease_timeout, 0.0,
                                                now))

    async def _cluster_lifecycle_pass(self) -> None:
        """Stop each held cluster whose lease lapsed or that is idle past the operator's time
        (with the lock held, in the supervision round).
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        lim = self.limits
        now = time.monotonic()
        ending = []
        for job, _ in await asyncio.to_thread(self.store.active):
            if json.loads(job.spec).get("kind") != CLUSTER:
                continue
            until, idle, said = self._lease_of(job.id)
            if now > until:
                ending.append((job, f"its lease lapsed: the notebook kernel that held it sent "
                               f"no heartbeat for {lim.cluster_lease_timeout} s (it shut down, "
                               "or its server stopped)"))
            elif (lim.cluster_idle_timeout and job.state == "Running"
                  # idle since it last dispatched, but never before it started (waiting in
                  # line is not idleness)
                  and min(idle + (now - said), time.time() - (job.started_at or time.time()))
                  > lim.cluster_idle_timeout):
                ending.append((job, f"idle: no step was dispatched to it for "
                               f"{lim.cluster_idle_timeout} s (c.GPUJobs.cluster_idle_timeout)"))
        for job, why in ending:
            view = await asyncio.to_thread(self.get, job.user, job.name)
            if view is None or view["state"] in FINAL:
                continue
            log.info("Cluster %s/%s ends: %s", job.user, job.name, why)
            await self._halt(view)
            await asyncio.to_thread(self._finish, job.id, "Stopped", why)
            self._leases.pop(job.id, None)

    # -- ending --------------------------------------------------------------------------

    async def stop(self, user: str, name: str, actor: str | None = None,
                   reason: str | None = None) -> dict:
        """Stop a job (its reason: ``stopped by <actor>``, or `reason`).
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        view = await asyncio.to_thread(self.get, user, name)
        if view is None:
            raise JobNotFound(name)
        if view["state"] in FINAL:
            return view
        async with self._lock:  # no supervision pass restarts what is being stopped
            await self._halt(view)
            await asyncio.to_thread(self._finish, view["id"], "Stopped",
                                    reason or "stopped by " + (actor or user))
        return await asyncio.to_thread(self.get, user, name)

    def _finish(self, job_id: str, state: str, reason: str, at: float | None = None) -> None:
        """End a job (sync; in a thread): first the driver frees what it held (processes'
        groups, sandboxes), then the job is final and its GPUs free in one commit (``at``:
        when it ended, default now).
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        job, _ = self.store.read(job_id)
        if job is None or job.state in FINAL:
            return
        self._release(job, JobSpec.model_validate_json(job.spec))
        if self.store.finish(job_id, state, reason, at):
            events.job_ended(state)
            log.info("Job %s/%s: %s (%s)", job.user, job.name, state, reason)
        if self.queue is not None:  # it leaves the line, waiting or holding
            self.queue.forget(job.user, "job", job.name, f"job {state.lower()}")

    def recover(self) -> None:
        """At start-up (sync): the driver's re-adoption, then the allocations of jobs that no
        longer run (e.g. the service died between admission and the rows) are closed.
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        self._recover_active()
        keep = set(self.store.active_allocations())
        if self.queue is not None:  # admitted by a pass, not started yet: `_queue_pass` will
            keep |= {e.allocation_id for e in self.queue.holders("job").values()
                     if e.state == "admitted" and e.allocation_id}
        self.ledger.close_orphans("job", keep, "job gone at service start-up")

    async def shutdown(self) -> None:
        """Stop supervising; the jobs keep running (a restarted service picks them up).
        Drivers should not override this method (the workflow's; they fill the hooks)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
        running, self._round = self._round, None
        if running is not None:  # the round under way ends first: nothing acts after the stop
            await asyncio.gather(running, return_exceptions=True)
        await self._stop_supervising()


def queue_place(e: Entry) -> dict:
    """Where a queued job stands, for its view (``view["queue"]``): position None when an
    admin holds it."""
    return {"position": e.position, "estimated_start": e.estimated_start, "ahead": e.ahead,
            "ahead_gpus": e.ahead_gpus, "reason": e.reason, "held": e.held,
            "preemptible": e.preemptible, "submitted_at": e.submitted_at}


def lead_of(spec: JobSpec | dict) -> tuple[str, int]:
    """(role, index) of the replica whose log and progress are the job's."""
    strategy = spec["strategy"] if isinstance(spec, dict) else spec.strategy
    kind = spec.get("kind") if isinstance(spec, dict) else spec.kind
    if kind == CLUSTER:  # no chief: its first worker
        return "worker", 0
    role, index = lead_replica(strategy).rsplit("-", 1)
    return role, int(index)
