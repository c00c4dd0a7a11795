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
``recover``
    at start-up: the driver re-adopts or gives up its active jobs (`_recover_active`), then
    the allocations of jobs that no longer run are closed: nothing leaks.
``read_log``
    finds the person's job and replica (404s in words), then the driver reads the bytes
    (`_read_replica_log`), off the event loop.

What a job's fate is (succeeded, failed, restart which replicas) is decided by pure functions
in `gpulab.hub.jobs.rules`; the drivers observe and act. Drivers: `gpulab.hub.jobs.local`
(processes under the users' accounts) and `gpulab.hub.jobs.kube` (Kubernetes Jobs).
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Any

from gpulab.extensions.contract import FINAL, lead_replica
from gpulab.hub.jobs.spec import DEFAULT_LIMITS, ROLES, JobLimits, JobSpec
from gpulab.hub.jobs.store import JobRow, JobStore, NameTaken, ReplicaRow
from gpulab.hub.quota.ledger import Allocation, Ledger, Request

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


def job_view(job: JobRow, replicas: list[ReplicaRow]) -> dict:
    """The view of a job the API, the CLI and the notebook client show (without progress)."""
    spec = json.loads(job.spec)
    return {
        "id": job.id, "name": job.name, "user": job.user, "backend": job.backend,
        "strategy": spec["strategy"], "state": job.state, "reason": job.reason,
        "gpus": JobSpec.model_validate(spec).total_gpus,
        "created_at": job.created_at, "started_at": job.started_at,
        "finished_at": job.finished_at, "job_dir": job.job_dir,
        "replicas": [
            {"role": r.role, "index": r.index, "name": f"{r.role}-{r.index}", "state": r.state,
             "reason": r.reason, "restarts": r.restarts, "exit_code": r.exit_code,
             "devices": json.loads(r.devices)}
            for r in sorted(replicas, key=lambda r: (ROLES.index(r.role), r.index))
        ],
        "spec": spec,
    }


class JobBackend:
    """The job workflow the service calls; a driver subclass fills the hooks below.

    The service's calls: ``async submit(user, groups, spec) -> view``; ``list(user | None)``
    and ``get(user, name) -> view | None`` (sync: the service runs them in a thread);
    ``async detail(user, name)``; ``async read_log(user, name, replica, offset, limit) ->
    (bytes, size, done)``; ``async stop(user, name, actor) -> view``; ``recover()`` at
    start-up; ``ensure_supervisor()`` (with a running event loop); ``async shutdown()``.
    """

    #: the backend's name in the job rows (``local``, ``kubernetes``)
    name = ""
    ledger: Ledger
    #: the operator's job limits (``c.GPUJobs``), set by the service
    limits: JobLimits = DEFAULT_LIMITS
    #: why no job can run here (said by the API, the launcher and the CLI), or None
    unavailable: str | None = None
    #: whether a job whose launch failed is kept as Failed (history), or forgotten
    keeps_failed_launches = False

    def _setup_workflow(self, ledger: Ledger) -> None:
        """The workflow's state; a driver's ``__init__`` calls it."""
        self.ledger = ledger
        self.store = JobStore(ledger, self.name)
        self._task: asyncio.Task | None = None
        #: supervision passes and stops exclude each other
        self._lock = asyncio.Lock()
        #: the name rule, the replica bound and the admission of one submit at a time
        self._admitting = asyncio.Lock()
        #: jobs being launched: supervision leaves them alone until `_launch` returns
        self._launching: set[str] = set()

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

    def _replica_rows(self, spec: JobSpec, allocation: Allocation) -> list[dict]:
        """The columns of each replica's row besides ``job_id``."""
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
        """A job's view; ``detail``: for one job (``get``), not the list."""
        return job_view(job, replicas)

    # -- queries -------------------------------------------------------------------------

    def list(self, user: str | None = None) -> list[dict]:
        return [self._view(j, reps) for j, reps in self.store.all(user)]

    def get(self, user: str, name: str) -> dict | None:
        job, replicas = self.store.find(user, name)
        if job is None:
            return None
        # a view may read a log (progress): after the transaction, never in it
        return self._view(job, replicas, detail=True)

    async def detail(self, user: str, name: str) -> dict | None:
        """One job's view for someone looking at it (``GET jobs/<name>``): `get`, plus what
        only such a look is worth fetching (a driver may override it)."""
        return await asyncio.to_thread(self.get, user, name)

    async def read_log(self, user: str, name: str, replica: str, offset: int = 0,
                       limit: int = 1 << 20) -> tuple[bytes, int, bool]:
        """(up to ``limit`` bytes of a replica's log from ``offset``, its size, job finished)."""
        job, replicas = await asyncio.to_thread(self.store.find, user, name)
        if job is None:
            raise JobError(f"You have no job named '{name}'.", 404)
        names = [f"{r.role}-{r.index}" for r in replicas]
        if replica not in names:
            raise JobError(f"Job '{name}' has no replica '{replica}'; it has "
                           f"{', '.join(sorted(names))}.", 404, "replica")
        if asyncio.iscoroutinefunction(self._read_replica_log):
            return await self._read_replica_log(job, replica, offset, limit)
        return await asyncio.to_thread(self._read_replica_log, job, replica, offset, limit)

    # -- submit --------------------------------------------------------------------------

    def _check_new_name(self, user: str, name: str) -> None:
        if self.store.name_taken(user, name):
            raise JobError(f"name: you already have a job named '{name}' (jobs are "
                           "kept as history); choose another name.", 409, "name")

    def _check_replica_bound(self, user: str, spec: JobSpec) -> None:
        """Refuse a job that would take `user`'s active replicas (all backends, all their
        jobs) over ``max_replicas_per_user``. Called where admissions are serialized."""
        bound = self.limits.max_replicas_per_user
        if not bound:
            return
        active = self.store.active_replicas(user)
        if active + spec.replica_count > bound:
            raise JobError(f"replicas: at most {bound} replicas of your jobs may run at once; "
                           f"{active} are active now and this job has {spec.replica_count}. "
                           "Wait for a job to finish, stop one, or ask for fewer replicas.",
                           409, "replicas")

    def _admit_and_record(self, user: str, groups: tuple[str, ...], spec: JobSpec,
                          prepared: Any) -> tuple[str, Allocation]:
        """The name rule, the replica bound, the admission and the rows (in a thread, under
        ``_admitting``): a second submit of one name is told so, not refused GPUs, and
        concurrent submits of one person cannot pass the bound together."""
        self._check_new_name(user, spec.name)
        self._check_replica_bound(user, spec)
        # the whole job's GPUs in one transaction, or nothing at all (the ledger's refusal
        # reaches the service as it is)
        allocation = self.ledger.admit(Request(user=user, kind="job", holder=spec.name,
                                               gpus=spec.total_gpus, groups=groups))
        job_id = uuid.uuid4().hex
        try:
            self.store.record(job_id=job_id, user=user, spec=spec, allocation=allocation,
                              job_dir=self._job_dir(user, spec, prepared),
                              replicas=self._replica_rows(spec, allocation))
        except NameTaken:
            self.ledger.release(allocation.id, "job not recorded")
            raise JobError(f"name: you already have a job named '{spec.name}'; choose "
                           "another name.", 409, "name") from None
        except BaseException:
            self.ledger.release(allocation.id, "job not recorded")
            raise
        return job_id, allocation

    async def submit(self, user: str, groups: tuple[str, ...], spec: JobSpec) -> dict:
        prepared = await self._prepare(user, groups, spec)
        async with self._admitting:
            job_id, allocation = await asyncio.to_thread(
                self._admit_and_record, user, groups, spec, prepared)
            self._launching.add(job_id)
        try:
            await self._launch(job_id, user, groups, spec, prepared)
        except BaseException as e:
            error = self._launch_error(e, spec)
            if error.status >= 500 and not isinstance(e, JobError):
                log.error("Job %s/%s failed to start", user, spec.name, exc_info=e)
            await self._undo(job_id, allocation.id, user, spec, error.reason)
            if isinstance(e, (KeyboardInterrupt, SystemExit, asyncio.CancelledError)):
                raise
            raise error from (None if e is error else e)
        finally:
            self._launching.discard(job_id)
        self.ensure_supervisor()
        return await asyncio.to_thread(self.get, user, spec.name)

    async def _undo(self, job_id: str, allocation_id: str, user: str, spec: JobSpec,
                    why: str) -> None:
        """Everything a submit did after admission, undone (the one place for it): the
        driver's leftovers, then the rows (or the job kept as Failed) and its GPUs. The job's
        folder stays (it is the person's, and may have been there before)."""
        try:
            await self._unlaunch(job_id, user, spec)
        except Exception:
            log.exception("Undoing the launch of job %s failed", job_id)
        try:
            if self.keeps_failed_launches:
                await asyncio.to_thread(self._finish, job_id, "Failed",
                                        f"could not be created: {why}")
            else:
                await asyncio.to_thread(self.store.remove, job_id)
        except Exception:
            log.exception("Undoing job %s failed; it is marked failed instead", job_id)
            await asyncio.to_thread(self._finish, job_id, "Failed", "could not start")
        finally:
            await asyncio.to_thread(self.ledger.release, allocation_id, "job failed to start")

    # -- supervision ---------------------------------------------------------------------

    def ensure_supervisor(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._supervise_forever())

    async def _supervise_forever(self) -> None:
        await self._start_supervising()
        while True:
            try:
                async with self._lock:
                    more = await self._supervise_pass()
                if not more:
                    self._task = None
                    return
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("Job supervision (%s) failed; retrying", self.name)
            await asyncio.sleep(self.supervise_interval)

    def _active_to_supervise(self) -> list[str]:
        """The active jobs of this backend that no submit is launching now."""
        return [j for j in self.store.active_ids() if j not in self._launching]

    # -- ending --------------------------------------------------------------------------

    async def stop(self, user: str, name: str, actor: str | None = None) -> dict:
        view = await asyncio.to_thread(self.get, user, name)
        if view is None:
            raise JobError(f"No job '{name}'.", 404)
        if view["state"] in FINAL:
            return view
        async with self._lock:  # no supervision pass restarts what is being stopped
            await self._halt(view)
            await asyncio.to_thread(self._finish, view["id"], "Stopped",
                                    "stopped by " + (actor or user))
        return await asyncio.to_thread(self.get, user, name)

    def _finish(self, job_id: str, state: str, reason: str) -> None:
        """End a job (sync; in a thread): first the driver frees what it held (processes'
        groups, sandboxes), then the job is final and its GPUs free in one commit."""
        job, _ = self.store.read(job_id)
        if job is None or job.state in FINAL:
            return
        self._release(job, JobSpec.model_validate_json(job.spec))
        if self.store.finish(job_id, state, reason):
            log.info("Job %s/%s: %s (%s)", job.user, job.name, state, reason)

    def recover(self) -> None:
        """At start-up (sync): the driver's re-adoption, then the allocations of jobs that no
        longer run (e.g. the service died between admission and the rows) are closed."""
        self._recover_active()
        self.ledger.close_orphans("job", self.store.active_allocations(),
                                  "job gone at service start-up")

    async def shutdown(self) -> None:
        """Stop supervising; the jobs keep running (a restarted service picks them up)."""
        if self._task:
            self._task.cancel()
            self._task = None
        await self._stop_supervising()


def lead_of(spec: JobSpec | dict) -> tuple[str, int]:
    """(role, index) of the replica whose log and progress are the job's."""
    strategy = spec["strategy"] if isinstance(spec, dict) else spec.strategy
    role, index = lead_replica(strategy).rsplit("-", 1)
    return role, int(index)
