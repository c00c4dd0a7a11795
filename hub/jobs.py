"""Training jobs: the backend interface and the local backend (one process per replica).

The service validates a `JobSpec`, then a backend admits the job's GPUs through the ledger as
one request (the sum over replicas: all or nothing), starts the replicas, supervises them and
releases the GPUs when the job ends in any way.

Local backend
-------------
Each replica is ``python -m gpulab.extensions.runtime <script> <args>`` on a free loopback
port, in a process group of its own, with ``TF_CONFIG`` naming every replica's address and
``CUDA_VISIBLE_DEVICES`` its share of the job's GPUs. As root with isolation on, replicas run
as the user's own system account (the same one as their notebook server). The job folder is
``<shared>/users/<user>/jobs/<job>/``: ``source.py`` (when the spec gave code text),
``logs/<role>-<index>.log`` (and ``logs/<role>-<index>.exit``, the exit code the runtime
writes as it ends), and what the program writes through the runtime's helpers (TensorBoard
summaries under ``tensorboard/``, checkpoints under ``checkpoints/``).

Supervision (every half second, over this process's own children):

- parameter-server: the job succeeds when the chief exits 0 (ps and workers are then
  stopped). A worker that dies is restarted while retries last. A ps that dies is restarted,
  and the chief, which then loses its cluster and exits with the runtime's infrastructure
  code, is restarted too: it resumes from the last checkpoint. A chief failing with its own
  error fails the job.
- multi-worker-mirrored: the job succeeds when every worker exits 0; when one fails, all are
  restarted together (from the last checkpoint) while retries last.
- ``max_runtime`` stops the job; stop is SIGTERM to each replica's process group, then SIGKILL.

Supervision runs in a worker thread, so stopping a replica (up to ``stop_grace`` seconds)
never stalls the service's API.

A restart of the service re-adopts a job whose replicas all still run (by pid and start
time), and marks any other unfinished job ``Failed`` (lost) with its survivors killed and its
GPUs released: no orphans, no leaks. An adopted replica is not this process's child, so its
exit code is read from the ``.exit`` file the runtime leaves.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import psutil
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from gpulab.spawner.cgroups import local_cgroups, memory_bytes

from . import safefs
from .jobspec import ROLES, JobSpec
from .ledger import JobRow, Ledger, ReplicaRow, Request

log = logging.getLogger("gpulab.jobs")

#: the runtime's exit code for lost infrastructure (a peer went away), see gpulab.extensions.runtime
EXIT_INFRA = 75
#: a replica adopted after a service restart that is gone: its exit code cannot be known
EXIT_UNKNOWN = -1000
#: the line a replica prints (``gpulab.extensions.runtime.report``) to say how far it is
PROGRESS_PREFIX = "GPULAB_PROGRESS "
ACTIVE = ("Admitted", "Starting", "Running")
FINAL = ("Succeeded", "Failed", "Stopped")


class JobError(Exception):
    status = 400

    def __init__(self, message: str, status: int | None = None, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field
        if status:
            self.status = status


@dataclass
class UserAccount:
    """Where a user's files are and which account runs their processes."""

    name: str
    folder: Path
    uid: int | None = None  # None: the service's own account
    gid: int | None = None
    home: str | None = None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _in_job(job_dir: str, *names: str) -> tuple[Path, list[str]]:
    """(the owner's folder, the path below it) of a file of the job, for `safefs`."""
    job_dir = Path(job_dir)
    return job_dir.parent.parent, [job_dir.parent.name, job_dir.name, *names]


def read_progress(job: JobRow, replica: str, tail: int = 64 * 1024) -> dict | None:
    """The last progress line in a replica's log (``{"step": …, "total": …, …}``), if any."""
    try:
        lines = safefs.read_tail(*_in_job(job.job_dir, "logs", f"{replica}.log"), tail)
    except OSError:
        return None
    return last_progress(lines)


def last_progress(log_text: bytes) -> dict | None:
    """The last well-formed progress line (``GPULAB_PROGRESS {"step": …}``) of a log."""
    for line in reversed(log_text.decode(errors="replace").splitlines()):
        if line.startswith(PROGRESS_PREFIX):
            try:
                value = json.loads(line[len(PROGRESS_PREFIX):])
            except ValueError:
                continue
            if isinstance(value, dict) and isinstance(value.get("step"), int):
                return value
    return None


def _lead_replica(spec: dict) -> str:
    """The replica whose progress is the job's: the chief, or worker 0 without one."""
    return "chief-0" if spec["strategy"] == "parameter-server" else "worker-0"


def _job_view(job: JobRow, replicas: list[ReplicaRow], progress: bool = False) -> dict:
    spec = json.loads(job.spec)
    view = {
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
    if progress:
        view["progress"] = read_progress(job, _lead_replica(spec))
    return view


class JobBackend:
    """The job backend interface the service calls (`LocalJobBackend`, and
    `gpulab.hub.kubejobs.KubeJobBackend`); the job history and its views come from the
    ledger's job tables, shared here.

    - ``async submit(user, groups, spec) -> view``: admit the job's GPUs whole (or raise the
      ledger's refusal, or `JobError`), start it;
    - ``list(user | None)``, ``get(user, name) -> view | None``: from the ledger;
      ``async detail(user, name)``: the view of one job someone is looking at;
    - ``read_log(user, name, replica, offset, limit) -> (bytes, size, done)`` (may be async);
    - ``async stop(user, name, actor) -> view``; ``recover()`` at start-up;
      ``ensure_supervisor()`` (with a running event loop); ``async shutdown()``.
    """

    name = ""
    ledger: Ledger

    def _load(self, s, job_id: str):
        job = s.get(JobRow, job_id)
        reps = s.scalars(select(ReplicaRow).where(ReplicaRow.job_id == job_id)).all()
        return job, reps

    def _view(self, job: JobRow, replicas: list[ReplicaRow], detail: bool = False) -> dict:
        """A job's view; ``detail``: for one job (``get``), not the list."""
        return _job_view(job, replicas, progress=detail)

    def list(self, user: str | None = None) -> list[dict]:
        with self.ledger.Session() as s:
            q = select(JobRow).where(JobRow.backend == self.name).order_by(JobRow.created_at.desc())
            if user is not None:
                q = q.where(JobRow.user == user)
            return [self._view(j, self._load(s, j.id)[1]) for j in s.scalars(q)]

    def get(self, user: str, name: str) -> dict | None:
        with self.ledger.Session() as s:
            job = s.scalar(select(JobRow).where(JobRow.user == user, JobRow.name == name,
                                                JobRow.backend == self.name))
            return self._view(job, self._load(s, job.id)[1], detail=True) if job else None

    async def detail(self, user: str, name: str) -> dict | None:
        """One job's view for someone looking at it (``GET jobs/<name>``): `get`, plus what
        only such a look is worth fetching (a backend may override it)."""
        return self.get(user, name)

    def _check_new_name(self, user: str, name: str) -> None:
        with self.ledger.Session() as s:
            if s.scalar(select(JobRow.id).where(JobRow.user == user, JobRow.name == name)):
                raise JobError(f"name: you already have a job named '{name}' (jobs are "
                               "kept as history); choose another name.", 409, "name")


class LocalJobBackend(JobBackend):
    name = "local"

    def __init__(self, ledger: Ledger, accounts, *, python: str = sys.executable,
                 poll_interval: float = 0.5, stop_grace: float = 10.0):
        self.ledger = ledger
        self.accounts = accounts  # callable: user name -> UserAccount
        self.python = python
        self.poll_interval = poll_interval
        self.stop_grace = stop_grace
        self._procs: dict[tuple[str, str, int], psutil.Popen | psutil.Process] = {}
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    # -- queries -------------------------------------------------------------------------

    def read_log(self, user: str, name: str, replica: str, offset: int = 0,
                 limit: int = 1 << 20) -> tuple[bytes, int, bool]:
        """(up to `limit` bytes of a replica's log from `offset`, its size, job finished)."""
        with self.ledger.Session() as s:
            job = s.scalar(select(JobRow).where(JobRow.user == user, JobRow.name == name))
            if job is None:
                raise JobError(f"You have no job named '{name}'.", 404)
            names = [f"{r.role}-{r.index}" for r in self._load(s, job.id)[1]]
            if replica not in names:
                raise JobError(f"Job '{name}' has no replica '{replica}'; it has "
                               f"{', '.join(sorted(names))}.", 404, "replica")
            try:
                data, size = safefs.read_bytes(*_in_job(job.job_dir, "logs", f"{replica}.log"),
                                               offset, limit)
            except OSError as e:
                raise JobError(f"The log of {replica} cannot be read: {e.strerror}.", 409,
                               "replica") from None
            return data, size, job.state in FINAL

    # -- submit --------------------------------------------------------------------------

    async def submit(self, user: str, groups: tuple[str, ...], spec: JobSpec) -> dict:
        account = self.accounts(user)
        script = None
        if spec.script is not None:
            script = (account.folder / spec.script).resolve()
            if not script.is_relative_to(account.folder.resolve()):
                raise JobError("script: must be inside your own folder.", field="script")
            if not script.is_file():
                raise JobError(f"script: there is no file {spec.script} in your folder.",
                               field="script")
        self._check_new_name(user, spec.name)
        async with self._lock:  # the supervisor thread reads the same process table
            self._admit_and_start(user, groups, spec, account, script)
        self.ensure_supervisor()
        return self.get(user, spec.name)

    def _admit_and_start(self, user, groups, spec: JobSpec, account: UserAccount, script) -> None:
        # admission: the whole job's GPUs in one transaction, or nothing at all
        allocation = self.ledger.admit(Request(user=user, kind="job", holder=spec.name,
                                               gpus=spec.total_gpus, groups=groups))
        job_dir = account.folder / "jobs" / spec.name
        job_id = uuid.uuid4().hex
        try:
            self._prepare_dir(account, spec)
            devices = list(allocation.devices)
            now = time.time()
            with self.ledger.Session.begin() as s:
                s.add(JobRow(id=job_id, user=user, name=spec.name, backend=self.name,
                             spec=spec.model_dump_json(), state="Admitted",
                             reason=f"{spec.total_gpus} GPU(s) admitted",
                             allocation_id=allocation.id, job_dir=str(job_dir), created_at=now))
                s.flush()
                for role, index in spec.replica_names():
                    n = spec.gpus_of(role)
                    mine, devices = devices[:n], devices[n:]
                    s.add(ReplicaRow(job_id=job_id, role=role, index=index, port=free_port(),
                                     devices=json.dumps(mine)))
            self._start_all(job_id, script)
        except BaseException as e:
            self.ledger.release(allocation.id, "job failed to start")
            self._kill_job_processes(job_id)
            if isinstance(e, JobError):
                raise
            if isinstance(e, safefs.UnsafePath):
                raise JobError(f"name: jobs/{spec.name} in your folder is a link or not a "
                               f"folder ({e.strerror}); gpulab does not follow links there. "
                               "Remove it, or choose another name.", 409, "name") from None
            if isinstance(e, IntegrityError):  # a concurrent submit took the name first
                raise JobError(f"name: you already have a job named '{spec.name}'; choose "
                               "another name.", 409, "name") from None
            log.exception("Job %s/%s failed to start", user, spec.name)
            self._finish(job_id, "Failed", f"could not start: {e}")
            raise JobError(f"The job could not be started: {e}", 500) from e

    def _prepare_dir(self, account: UserAccount, spec: JobSpec) -> None:
        """The job's folder in the user's own folder, owned by them (never through a link)."""
        owner = (account.uid, account.gid) if account.uid is not None else None
        for sub in ("logs", "checkpoints", "tensorboard"):
            os.close(safefs.open_dir(account.folder, ["jobs", spec.name, sub], create=True,
                                     owner=owner))
        if spec.source is not None:
            safefs.write_text(account.folder, ["jobs", spec.name, "source.py"], spec.source,
                              owner=owner)

    def _start_all(self, job_id: str, script: Path | None, only: set | None = None) -> None:
        with self.ledger.Session.begin() as s:
            job, reps = self._load(s, job_id)
            spec = JobSpec.model_validate_json(job.spec)
            account = self.accounts(job.user)
            cluster = {}
            for r in reps:
                if r.role != "evaluator":
                    cluster.setdefault(r.role, []).append((r.index, f"127.0.0.1:{r.port}"))
            cluster = {k: [a for _, a in sorted(v)] for k, v in cluster.items()}
            job_dir = Path(job.job_dir)
            program = script or (job_dir / "source.py")
            if script is None and spec.script is not None:
                program = account.folder / spec.script
            for r in reps:
                key = (r.role, r.index)
                if only is not None and key not in only:
                    continue
                logs = safefs.open_dir(*_in_job(job.job_dir, "logs"))
                try:
                    os.unlink(f"{r.role}-{r.index}.exit", dir_fd=logs)
                except FileNotFoundError:
                    pass
                finally:
                    os.close(logs)
                proc = self._spawn(job, spec, r, cluster, program, account)
                self._procs[(job_id, r.role, r.index)] = proc
                r.pid, r.pid_started = proc.pid, proc.create_time()
                r.state, r.reason, r.exit_code = "Running", "", None
            job.state = "Running"
            job.started_at = job.started_at or time.time()
            job.reason = "all replicas started"

    def _spawn(self, job, spec, r, cluster, program, account):
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("JUPYTERHUB_", "GPULAB_LEDGER", "TF_", "CUDA_"))}
        env.update(spec.env)
        devices = ",".join(str(d) for d in json.loads(r.devices))
        env.update({
            "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": r.role, "index": r.index}}),
            "GPULAB_STRATEGY": spec.strategy,
            "GPULAB_JOB_NAME": job.name,
            "GPULAB_JOB_DIR": job.job_dir,
            "GPULAB_USER_DIR": str(account.folder),
            "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
            "CUDA_VISIBLE_DEVICES": devices,
            "NVIDIA_VISIBLE_DEVICES": devices or "void",
            "PYTHONUNBUFFERED": "1",
        })
        if account.home:
            env["HOME"] = account.home
        owner = (account.uid, account.gid) if account.uid is not None else None
        logfile = os.fdopen(safefs.open_file(
            *_in_job(job.job_dir, "logs", f"{r.role}-{r.index}.log"),
            os.O_WRONLY | os.O_CREAT | os.O_APPEND, owner=owner), "ab", buffering=0)

        group = self._limits_group(job.id, spec, r.role, r.index)

        def preexec():
            os.setsid()  # one process group per replica: stop reaches the whole tree
            if group is not None:
                group.join()  # its CPU and memory limits, before dropping to the user
            if account.uid is not None:
                os.setgid(account.gid)
                os.initgroups(pwd.getpwuid(account.uid).pw_name, account.gid)
                os.setuid(account.uid)

        try:
            return psutil.Popen(
                [self.python, "-m", "gpulab.extensions.runtime", str(program), *spec.args],
                env=env, cwd=job.job_dir, stdout=logfile, stderr=subprocess.STDOUT,
                stdin=open(os.devnull), preexec_fn=preexec, close_fds=True,
            )
        finally:
            logfile.close()

    # -- CPU and memory limits (control groups, as for notebook servers) ------------------

    @staticmethod
    def _unit(job_id: str, role: str, index: int) -> str:
        return f"job-{job_id}-{role}-{index}"

    def _limits_group(self, job_id: str, spec: JobSpec, role: str, index: int):
        """A fresh control group with the role's ``cpu`` / ``memory``, or None (no limits, or
        none enforceable here: `gpulab.spawner.cgroups.local_cgroups` logs why once)."""
        res = spec.resources.get(role)
        if res is None or (res.cpu is None and res.memory is None):
            return None
        cgroups, _ = local_cgroups()
        if cgroups is None:
            return None
        unit = self._unit(job_id, role, index)
        cgroups.find(unit).remove(kill=True)  # a restarted replica starts with a clean count
        return cgroups.make(unit, memory=memory_bytes(res.memory), cpus=res.cpu)

    def _oom_killed(self, job_id: str, role: str, index: int) -> bool:
        cgroups, _ = local_cgroups()
        return cgroups is not None and cgroups.find(self._unit(job_id, role, index)).oom_kills() > 0

    def _remove_limits_groups(self, job_id: str, spec: JobSpec) -> None:
        if not any(r.cpu is not None or r.memory is not None for r in spec.resources.values()):
            return
        cgroups, _ = local_cgroups()
        if cgroups is None:
            return
        for role in ROLES:
            for index in range(spec.count(role)):
                cgroups.find(self._unit(job_id, role, index)).remove(kill=True)

    # -- supervision ---------------------------------------------------------------------

    def ensure_supervisor(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._supervise_forever())

    async def _supervise_forever(self) -> None:
        while True:
            try:
                async with self._lock:
                    if not await asyncio.to_thread(self._supervise_once):
                        self._task = None
                        return
            except Exception:
                log.exception("Job supervision failed; retrying")
            await asyncio.sleep(self.poll_interval)

    def _exit_of(self, key, job_dir: str) -> int | None:
        """None while the replica runs, else its exit code (`EXIT_UNKNOWN` if unknowable)."""
        proc = self._procs.get(key)
        if isinstance(proc, psutil.Popen):
            return proc.poll()
        if proc is not None:
            try:
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    return None
            except psutil.NoSuchProcess:
                pass
        # not our child (adopted after a restart): the code the runtime left as it ended
        try:
            data, _ = safefs.read_bytes(*_in_job(job_dir, "logs", f"{key[1]}-{key[2]}.exit"),
                                        0, 32)
            return int(data.strip())
        except (OSError, ValueError):
            return EXIT_UNKNOWN

    def _supervise_once(self) -> bool:
        """One pass over the active jobs; returns whether any job is still active."""
        with self.ledger.Session() as s:
            active = s.scalars(select(JobRow.id).where(JobRow.state.in_(ACTIVE),
                                                       JobRow.backend == self.name)).all()
        for job_id in active:
            self._supervise_job(job_id)
        return bool(active)

    def _supervise_job(self, job_id: str) -> None:
        restart: set[tuple[str, int]] = set()
        outcome = None
        with self.ledger.Session.begin() as s:
            job, reps = self._load(s, job_id)
            spec = JobSpec.model_validate_json(job.spec)
            by = {(r.role, r.index): r for r in reps}
            for r in reps:
                if r.state != "Running":
                    continue
                code = self._exit_of((job_id, r.role, r.index), job.job_dir)
                if code is None:
                    continue
                r.exit_code = code
                r.state = "Succeeded" if code == 0 else "Failed"
                r.reason = _exit_words(code)
                if code == -signal.SIGKILL and self._oom_killed(job_id, r.role, r.index):
                    r.reason = (f"killed: out of memory (the {r.role} role's memory limit is "
                                f"{spec.resources[r.role].memory})")
                log.info("Job %s/%s replica %s-%s exited %s", job.user, job.name, r.role,
                         r.index, code)
            used = sum(r.restarts for r in reps)
            can_retry = used < spec.retries
            if spec.strategy == "parameter-server":
                chief = by[("chief", 0)]
                dead_ps = [k for k, r in by.items() if k[0] == "ps" and r.state != "Running"]
                if chief.state == "Succeeded":
                    outcome = ("Succeeded", "the chief finished")
                elif chief.state == "Failed" and chief.exit_code != EXIT_INFRA and not dead_ps:
                    outcome = ("Failed", f"the chief failed: {chief.reason}; see its log "
                               "(logs/chief-0.log)")
                else:
                    wanted = set(dead_ps)
                    if chief.state == "Failed":
                        wanted.add(("chief", 0))
                    wanted |= {k for k, r in by.items() if k[0] == "worker" and r.state == "Failed"}
                    if wanted:
                        if can_retry:
                            restart = wanted
                        elif dead_ps or chief.state == "Failed" or all(
                                r.state == "Failed" for k, r in by.items() if k[0] == "worker"):
                            # (with workers left the coordinator trains on without the dead)
                            outcome = ("Failed", f"out of retries ({spec.retries}) after "
                                       f"{', '.join(f'{a}-{b}' for a, b in sorted(wanted))} failed")
            else:
                workers = [r for r in reps if r.role == "worker"]
                if all(r.state == "Succeeded" for r in workers):
                    outcome = ("Succeeded", "all workers finished")
                elif any(r.state == "Failed" for r in workers):
                    failed = ", ".join(f"worker-{r.index}" for r in workers if r.state == "Failed")
                    if can_retry:
                        restart = {(r.role, r.index) for r in workers}
                    else:
                        why = next(r.reason for r in workers if r.state == "Failed")
                        outcome = ("Failed", f"{failed} failed ({why}) and the {spec.retries} "
                                   "retries are used up")
            started = job.started_at or job.created_at
            if outcome is None and spec.max_runtime and time.time() > started + spec.max_runtime:
                outcome = ("Failed", f"stopped after max_runtime ({spec.max_runtime} s)")
            if restart and outcome is None:
                for k in restart:
                    by[k].restarts += 1
                job.reason = f"restarting {', '.join(f'{a}-{b}' for a, b in sorted(restart))}"
        if outcome is not None:
            self._kill_job_processes(job_id)
            self._finish(job_id, *outcome)
        elif restart:
            for k in restart:  # MWMS restarts all workers: stop the survivors first
                self._kill((job_id, *k), grace=2)
            self._start_all(job_id, None, only=restart)

    def _finish(self, job_id: str, state: str, reason: str) -> None:
        if not job_id:
            return
        with self.ledger.Session.begin() as s:
            job, reps = self._load(s, job_id)
            if job is None:
                return
            job.state, job.reason, job.finished_at = state, reason, time.time()
            for r in reps:
                if r.state == "Running":
                    r.state, r.reason = "Stopped", "stopped with the job"
            alloc = job.allocation_id
            spec = JobSpec.model_validate_json(job.spec)
        self._remove_limits_groups(job_id, spec)
        if alloc:
            self.ledger.release(alloc, f"job {state.lower()}")
        log.info("Job %s: %s (%s)", job_id, state, reason)

    def _kill(self, key, grace: float | None = None) -> None:
        proc = self._procs.pop(key, None)
        if proc is None:
            return
        grace = self.stop_grace if grace is None else grace
        try:
            pgid = os.getpgid(proc.pid)
        except (ProcessLookupError, OSError):
            pgid = None
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                if pgid is not None and pgid == proc.pid:
                    os.killpg(pgid, sig)
                else:
                    proc.send_signal(sig)
            except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
                pass
            try:
                proc.wait(grace if sig == signal.SIGTERM else 5)
                break
            except (psutil.TimeoutExpired, psutil.NoSuchProcess):
                continue
            except Exception:
                break
        if pgid is not None:  # anything the replica left in its group
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def _kill_job_processes(self, job_id: str) -> None:
        for key in [k for k in self._procs if k[0] == job_id]:
            self._kill(key)

    async def stop(self, user: str, name: str, actor: str | None = None) -> dict:
        job = self.get(user, name)
        if job is None:
            raise JobError(f"No job '{name}'.", 404)
        if job["state"] in FINAL:
            return job
        async with self._lock:
            await asyncio.to_thread(self._kill_job_processes, job["id"])
            self._finish(job["id"], "Stopped", "stopped by " + (actor or user))
        return self.get(user, name)

    # -- recovery after a restart of the service -------------------------------------------

    def recover(self) -> None:
        with self.ledger.Session() as s:
            jobs = s.scalars(select(JobRow).where(JobRow.state.in_(ACTIVE),
                                                  JobRow.backend == self.name)).all()
            plans = []
            for job in jobs:
                reps = self._load(s, job.id)[1]
                plans.append((job.id, job.name, [(r.role, r.index, r.pid, r.pid_started, r.state)
                                                 for r in reps]))
        for job_id, name, reps in plans:
            live, gone = {}, []
            for role, index, pid, started, state in reps:
                if state != "Running":
                    continue
                try:
                    p = psutil.Process(pid)
                    if abs(p.create_time() - started) < 1 and p.status() != psutil.STATUS_ZOMBIE:
                        live[(job_id, role, index)] = p
                        continue
                except psutil.NoSuchProcess:
                    pass
                gone.append(f"{role}-{index}")
            if gone:
                self._procs.update(live)
                self._kill_job_processes(job_id)
                self._finish(job_id, "Failed", "lost: the gpulab service restarted and "
                             f"{', '.join(gone)} had stopped meanwhile")
            else:
                self._procs.update(live)
                log.info("Re-adopted job %s with %d running replicas", name, len(live))
        # allocations of jobs that no longer run (e.g. the service died between admission
        # and writing the job) are closed: nothing leaks
        with self.ledger.Session() as s:
            keep = set(s.scalars(select(JobRow.allocation_id).where(JobRow.state.in_(ACTIVE))))
        self.ledger.close_orphans("job", keep, "job gone at service start-up")

    async def shutdown(self) -> None:
        """Leave replicas running (a restarted service re-adopts them)."""
        if self._task:
            self._task.cancel()


def _exit_words(code: int | None) -> str:
    if code is None:
        return "running"
    if code == 0:
        return "exited 0"
    if code == EXIT_INFRA:
        return "lost its cluster (a ps or peer went away)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return "gone (exit code unknown)"
    if code == 1:
        return "the program raised an error (exit 1)"
    if code == 2:
        return "bad job configuration (exit 2)"
    return f"exited {code}"

