"""Training jobs: the backend interface and the local backend (one process per replica).

The service validates a `JobSpec`, then a backend admits the job's GPUs through the ledger as
one request (the sum over replicas: all or nothing), starts the replicas, supervises them and
releases the GPUs when the job ends in any way.

Local backend
-------------
Each replica is ``python -m gpulab.extensions.runtime <script> <args>`` on a loopback port,
in a process group of its own, with ``TF_CONFIG`` naming every replica's address and
``CUDA_VISIBLE_DEVICES`` its share of the job's GPUs. As root with isolation on, replicas run
as the user's own system account (the same one as their notebook server). The job folder is
``<shared>/users/<user>/jobs/<job>/``: ``source.py`` (when the spec gave code text; with
``files``, ``code/source.py`` and the files beside it in ``code/``, the entry point's folder
and so on every replica's import path; written as root without following links, owned by
the person, a name never more than one plain component: see `gpulab.hub.jobs.spec`),
``logs/<role>-<index>.log`` (and ``logs/<role>-<index>.exit``, the exit code the runtime
writes as it ends), and what the program writes through the runtime's helpers (TensorBoard
summaries under ``tensorboard/``, checkpoints under ``checkpoints/``).

The sandbox (as root; `gpulab.spawner.sandbox`, `gpulab.spawner.cgroups`), set up in each
replica between ``fork`` and ``exec`` while it is still root, then it drops to the account:

- **one network namespace per job** holding only loopback, made when the job starts
  (``/run/gpulab/netns/<job id>``) and joined by every replica: the replicas reach each other
  on 127.0.0.1, and nothing outside the job reaches their TensorFlow servers, which run any
  graph they are sent (they have no authentication). Replicas cannot reach the machine's own
  loopback services (the hub, the gpulab service) or the network either: they need none.
- **a private /tmp per job** (a mount namespace per replica; all replicas of the job bind the
  same folder, owned by the person, mode 0700, under root's 0700 ``tmp_root``), removed with
  the job.
- **a control group per replica**, limits or not: the role's ``cpu`` / ``memory`` or the
  operator's defaults (``c.GPUJobs.default_cpu`` / ``default_memory``), the device allow-list
  of its GPUs, and stop kills the whole group (``setsid`` grandchildren too).
- **the working directory** (the job folder) entered after dropping privileges, through a
  descriptor opened without following links (never ``Popen(cwd=...)``, which runs as root).
- **an environment built from an allow-list** (`replica_env`): never a copy of the service's,
  which holds the service's own hub token.

Admission also bounds a person's active replicas across their jobs
(``c.GPUJobs.max_replicas_per_user``), GPU-less jobs included. A submit that fails after
admission undoes everything in one place (`LocalJobBackend._undo`): processes, sandbox, rows,
GPUs; nothing stays "Admitted".

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
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil
from sqlalchemy import delete, select
from sqlalchemy.exc import IntegrityError

from gpulab.extensions import contract
from gpulab.extensions.contract import ACTIVE, EXIT_INFRA, FINAL, PROGRESS_PREFIX, lead_replica
from gpulab.spawner import sandbox
from gpulab.spawner.accounts import AccountError
from gpulab.spawner.cgroups import local_cgroups, memory_bytes

from gpulab.spawner import safefs
from gpulab.hub.jobs.spec import DEFAULT_LIMITS, ROLES, SOURCE_NAME, JobLimits, JobSpec
from gpulab.hub.quota.ledger import JobRow, Ledger, ReplicaRow, Request

log = logging.getLogger("gpulab.jobs")

#: a replica adopted after a service restart that is gone: its exit code cannot be known
EXIT_UNKNOWN = -1000
#: variables a replica takes from the service's environment (nothing else is copied: the
#: service's own hub token and settings must never reach a person's program)
ENV_ALLOW = ("PATH", "LANG", "LANGUAGE", "TZ")
ENV_ALLOW_PREFIXES = ("LC_",)
#: the private /tmp folders of running jobs (root's, mode 0700; one folder per job)
TMP_ROOT = Path("/var/lib/gpulab/tmp")


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


@contextmanager
def _their_folder():
    """Around writes into a person's job folder: a folder of theirs that vanishes as it is
    used (they moved or swapped it meanwhile, e.g. for a link and back) is `safefs.UnsafePath`,
    like a link found in place, so the person hears it (409), not an internal error."""
    try:
        yield
    except (FileNotFoundError, NotADirectoryError) as e:
        raise safefs.UnsafePath(e.errno, f"{e.filename or 'a folder'} changed while gpulab "
                                "wrote to it") from None


def code_parts(spec: JobSpec) -> list[str]:
    """Where a spec's code text is kept, below the job folder: ``["source.py"]`` alone, or
    ``["code", "source.py"]`` when it has ``files`` (they go in ``code/`` beside it)."""
    return ["code", SOURCE_NAME] if spec.files else [SOURCE_NAME]


def read_progress(job: JobRow, replica: str, tail: int = 64 * 1024) -> dict | None:
    """The last progress line in a replica's log (``{"step": …, "total": …, …}``), if any."""
    try:
        lines = safefs.read_tail(*_in_job(job.job_dir, "logs", f"{replica}.log"), tail)
    except OSError:
        return None
    return last_progress(lines)


def last_progress(log_text: bytes) -> dict | None:
    """The last well-formed progress line (``GPULAB_PROGRESS {"step": …}``) of a log's bytes."""
    return contract.last_progress(log_text.decode(errors="replace"))


def replica_env(base: dict[str, str], *, spec: JobSpec, job_name: str, job_dir: str,
                user_dir: str, role: str, index: int, cluster: dict, devices: list[int],
                account: tuple[str, str] | None = None) -> dict[str, str]:
    """A replica's whole environment, built from an allow-list (no I/O).

    From `base` (the service's environment) only `ENV_ALLOW` / `ENV_ALLOW_PREFIXES`; then the
    spec's own ``env`` (which `JobSpec` keeps off gpulab's names); then gpulab's variables.
    `account`: (user name, home) of the system account the replica runs as, if any.
    """
    env = {k: v for k, v in base.items() if k in ENV_ALLOW or k.startswith(ENV_ALLOW_PREFIXES)}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update(spec.env)
    visible = ",".join(str(d) for d in devices)
    env.update({
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": role, "index": index}}),
        "GPULAB_STRATEGY": spec.strategy,
        "GPULAB_JOB_NAME": job_name,
        "GPULAB_JOB_DIR": job_dir,
        "GPULAB_USER_DIR": user_dir,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": visible,
        "NVIDIA_VISIBLE_DEVICES": visible or "void",
        "PYTHONUNBUFFERED": "1",
    })
    if account is not None:
        name, home = account
        env.update({"USER": name, "LOGNAME": name, "HOME": home})
    elif "HOME" in base:
        env["HOME"] = base["HOME"]
    return env


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
        view["progress"] = read_progress(job, lead_replica(spec["strategy"]))
    return view


#: what a training replica imports, and how a person calls it
_RUNTIME_MODULES = {"gpulab.extensions.runtime": "gpulab", "tensorflow": "TensorFlow",
                    "tf_keras": "tf-keras"}


def runtime_problem(python: str) -> str | None:
    """Why training replicas cannot run with `python`, in words for people, or None. The
    modules are found, not imported (importing TensorFlow takes seconds)."""
    code = ("import importlib.util as u\n"
            "def found(m):\n"
            "    try:\n"
            "        return u.find_spec(m) is not None\n"
            "    except ImportError:  # its parent package is missing\n"
            "        return False\n"
            f"print(' '.join(m for m in {list(_RUNTIME_MODULES)!r} if not found(m)))")
    try:
        out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"Training is off on this hub: its Python for training ({python}) does not run ({e})."
    missing = [_RUNTIME_MODULES[m] for m in out.stdout.split() if m in _RUNTIME_MODULES]
    if out.returncode != 0:
        return (f"Training is off on this hub: its Python for training ({python}) failed: "
                f"{out.stderr.strip()[-300:]}")
    if not missing:
        return None
    names = missing[0] if len(missing) == 1 else ", ".join(missing[:-1]) + " and " + missing[-1]
    return (f"Training is off on this hub: {names} cannot be imported by its "
            f"Python for training ({python}). The hub's admin installs "
            f"{'it' if len(missing) == 1 else 'them'}: `bash scripts/run.sh` again (it installs "
            f"gpulab[tf]), or `{python} -m pip install 'gpulab[tf]'`, then restarts gpulab.")


class JobBackend:
    """The job backend interface the service calls (`LocalJobBackend`, and
    `gpulab.hub.jobs.kube.KubeJobBackend`); the job history and its views come from the
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
    #: the operator's job limits (``c.GPUJobs``), set by the service (`make_app`)
    limits: JobLimits = DEFAULT_LIMITS
    #: why no job can run here (said by the API, the launcher and the CLI), or None
    unavailable: str | None = None

    def _load(self, s, job_id: str):
        job = s.get(JobRow, job_id)
        reps = s.scalars(select(ReplicaRow).where(ReplicaRow.job_id == job_id)).all()
        return job, reps

    def _view(self, job: JobRow, replicas: list[ReplicaRow], detail: bool = False) -> dict:
        """A job's view; ``detail``: for one job (``get``), not the list."""
        return _job_view(job, replicas, progress=detail)

    def list(self, user: str | None = None) -> list[dict]:
        with self.ledger.Reader() as s:
            q = select(JobRow).where(JobRow.backend == self.name).order_by(JobRow.created_at.desc())
            if user is not None:
                q = q.where(JobRow.user == user)
            return [self._view(j, self._load(s, j.id)[1]) for j in s.scalars(q)]

    def get(self, user: str, name: str) -> dict | None:
        with self.ledger.Reader() as s:
            job = s.scalar(select(JobRow).where(JobRow.user == user, JobRow.name == name,
                                                JobRow.backend == self.name))
            if job is None:
                return None
            replicas = self._load(s, job.id)[1]
        # the view reads the lead replica's log (progress): after the transaction, never in it
        return self._view(job, replicas, detail=True)

    async def detail(self, user: str, name: str) -> dict | None:
        """One job's view for someone looking at it (``GET jobs/<name>``): `get`, plus what
        only such a look is worth fetching (a backend may override it). In a thread: it reads
        a file in the person's folder."""
        return await asyncio.to_thread(self.get, user, name)

    def _check_new_name(self, user: str, name: str) -> None:
        with self.ledger.Reader() as s:
            if s.scalar(select(JobRow.id).where(JobRow.user == user, JobRow.name == name)):
                raise JobError(f"name: you already have a job named '{name}' (jobs are "
                               "kept as history); choose another name.", 409, "name")

    def _check_replica_bound(self, user: str, spec: JobSpec) -> None:
        """Refuse a job that would take `user`'s active replicas (all backends, all their
        jobs) over ``max_replicas_per_user``. Call it where admissions are serialized."""
        bound = self.limits.max_replicas_per_user
        if not bound:
            return
        with self.ledger.Reader() as s:
            specs = s.scalars(select(JobRow.spec).where(JobRow.user == user,
                                                        JobRow.state.in_(ACTIVE))).all()
        active = sum(JobSpec.model_validate_json(x).replica_count for x in specs)
        if active + spec.replica_count > bound:
            raise JobError(f"replicas: at most {bound} replicas of your jobs may run at once; "
                           f"{active} are active now and this job has {spec.replica_count}. "
                           "Wait for a job to finish, stop one, or ask for fewer replicas.",
                           409, "replicas")


class LocalJobBackend(JobBackend):
    name = "local"

    def __init__(self, ledger: Ledger, accounts, *, python: str = sys.executable,
                 poll_interval: float = 0.5, stop_grace: float = 10.0,
                 limits: JobLimits | None = None, sandboxed: bool | None = None,
                 tmp_root: Path = TMP_ROOT, netns_root: Path = sandbox.NETNS_DIR):
        self.ledger = ledger
        self.accounts = accounts  # callable: user name -> UserAccount
        self.python = python
        self.poll_interval = poll_interval
        self.stop_grace = stop_grace
        if limits is not None:
            self.limits = limits
        # namespaces need root: as root every job gets them (or does not start)
        self.sandboxed = os.geteuid() == 0 if sandboxed is None else sandboxed
        self.tmp_root = Path(tmp_root)
        self.netns_root = Path(netns_root)
        self._procs: dict[tuple[str, str, int], psutil.Popen | psutil.Process] = {}
        self._task: asyncio.Task | None = None
        self._lock = asyncio.Lock()

    # -- queries -------------------------------------------------------------------------

    def read_log(self, user: str, name: str, replica: str, offset: int = 0,
                 limit: int = 1 << 20) -> tuple[bytes, int, bool]:
        """(up to `limit` bytes of a replica's log from `offset`, its size, job finished)."""
        with self.ledger.Reader() as s:
            job = s.scalar(select(JobRow).where(JobRow.user == user, JobRow.name == name))
            if job is None:
                raise JobError(f"You have no job named '{name}'.", 404)
            names = [f"{r.role}-{r.index}" for r in self._load(s, job.id)[1]]
            job_dir, done = job.job_dir, job.state in FINAL
        if replica not in names:
            raise JobError(f"Job '{name}' has no replica '{replica}'; it has "
                           f"{', '.join(sorted(names))}.", 404, "replica")
        # the file is read after the transaction (a slow or hostile file never holds the
        # ledger), and the service calls this in a thread
        try:
            data, size = safefs.read_bytes(*_in_job(job_dir, "logs", f"{replica}.log"),
                                           offset, limit)
        except OSError as e:
            raise JobError(f"The log of {replica} cannot be read: {e.strerror}.", 409,
                           "replica") from None
        return data, size, done

    # -- submit --------------------------------------------------------------------------

    async def submit(self, user: str, groups: tuple[str, ...], spec: JobSpec) -> dict:
        try:  # may create the account (useradd): in a thread
            account = await asyncio.to_thread(self.accounts, user)
        except AccountError as e:  # e.g. the mapped account belongs to someone else
            raise JobError(f"Your jobs cannot run: {e}", 403) from None
        script = None
        if spec.script is not None:
            script = (account.folder / spec.script).resolve()
            if not script.is_relative_to(account.folder.resolve()):
                raise JobError("script: must be inside your own folder.", field="script")
            if not script.is_file():
                raise JobError(f"script: there is no file {spec.script} in your folder.",
                               field="script")
        async with self._lock:  # the supervisor thread reads the same process table
            # admissions are serialized here: the per-person replica bound and the name
            # cannot be raced (a second submit of one name is told so, not refused GPUs)
            self._check_new_name(user, spec.name)
            self._check_replica_bound(user, spec)
            await asyncio.to_thread(self._admit_and_start, user, groups, spec, account, script)
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
            self._make_sandbox(job_id, account)
            self._start_all(job_id, script)
        except BaseException as e:
            self._undo(job_id, allocation.id, spec)
            if isinstance(e, JobError):
                raise
            if isinstance(e, safefs.UnsafePath):
                raise JobError(f"name: jobs/{spec.name} in your folder holds a link or "
                               f"something that is not a folder or plain file ({e.strerror}); "
                               "gpulab does not follow links there. Remove it, or choose "
                               "another name.", 409, "name") from None
            if isinstance(e, IntegrityError):  # a concurrent submit took the name first
                raise JobError(f"name: you already have a job named '{spec.name}'; choose "
                               "another name.", 409, "name") from None
            log.exception("Job %s/%s failed to start", user, spec.name)
            raise JobError(f"The job could not be started: {e}", 500) from e

    def _undo(self, job_id: str, allocation_id: str, spec: JobSpec) -> None:
        """Everything a submit did after admission, undone (the one place for it): its
        processes and their groups, its sandbox, its rows and its GPUs. The job folder stays
        (it is the person's, and may have been there before)."""
        try:
            self._kill_job_processes(job_id)
            self._remove_groups(job_id, spec)
            self._remove_sandbox(job_id)
            with self.ledger.Session.begin() as s:
                s.execute(delete(ReplicaRow).where(ReplicaRow.job_id == job_id))
                s.execute(delete(JobRow).where(JobRow.id == job_id))
        except Exception:
            log.exception("Undoing job %s failed; it is marked failed instead", job_id)
            self._finish(job_id, "Failed", "could not start")
        finally:
            self.ledger.release(allocation_id, "job failed to start")

    def _prepare_dir(self, account: UserAccount, spec: JobSpec) -> None:
        """The job's folder in the user's own folder, owned by them (never through a link)."""
        owner = (account.uid, account.gid) if account.uid is not None else None
        with _their_folder():
            for sub in ("logs", "checkpoints", "tensorboard"):
                os.close(safefs.open_dir(account.folder, ["jobs", spec.name, sub],
                                         create=True, owner=owner))
            if spec.source is None:
                return
            where = ["jobs", spec.name, *code_parts(spec)[:-1]]
            if spec.files:  # code/: the entry point's folder, on the replicas' import path
                os.close(safefs.open_dir(account.folder, where, create=True, owner=owner))
            # each name is one plain component (`JobSpec`); safefs refuses links on the way
            for name, text in ((SOURCE_NAME, spec.source), *spec.files.items()):
                safefs.write_text(account.folder, [*where, name], text, owner=owner)

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
            program = script or job_dir.joinpath(*code_parts(spec))
            if script is None and spec.script is not None:
                program = account.folder / spec.script
            for r in reps:
                key = (r.role, r.index)
                if only is not None and key not in only:
                    continue
                with _their_folder():
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
        devices = json.loads(r.devices)
        env = replica_env(
            dict(os.environ), spec=spec, job_name=job.name, job_dir=job.job_dir,
            user_dir=str(account.folder), role=r.role, index=r.index, cluster=cluster,
            devices=devices,
            account=(pwd.getpwuid(account.uid).pw_name, account.home or "/")
            if account.uid is not None else None)
        owner = (account.uid, account.gid) if account.uid is not None else None
        with _their_folder():
            logfile = os.fdopen(safefs.open_file(
                *_in_job(job.job_dir, "logs", f"{r.role}-{r.index}.log"),
                os.O_WRONLY | os.O_CREAT | os.O_APPEND, owner=owner), "ab", buffering=0)
        folder, job_path = _in_job(job.job_dir)
        group = self._replica_group(job.id, spec, r.role, r.index, devices)
        netns = sandbox.open_netns(job.id, self.netns_root) if self.sandboxed else None
        tmp = self.tmp_root / job.id
        user_name = pwd.getpwuid(account.uid).pw_name if account.uid is not None else None

        def preexec():  # in the child, as root; a failure is written to the replica's log
            try:
                os.setsid()  # one process group per replica
                if group is not None:
                    group.join()  # limits, GPU devices, and stop reaches all it starts
                if netns is not None:
                    sandbox.join_netns(netns)  # the job's loopback-only network
                    sandbox.private_tmp(tmp, keep=[folder])  # the job's own /tmp
                if account.uid is not None:
                    os.setgid(account.gid)
                    os.initgroups(user_name, account.gid)
                    os.setuid(account.uid)
                os.umask(0o022)  # the person's usual mask, not `gpulab up`'s private 077
                # as the person: the job folder, never through a link
                sandbox.enter_dir(folder, job_path)
            except BaseException as e:
                os.write(2, f"gpulab: the replica could not be started: {e}\n".encode())
                raise

        try:
            with open(os.devnull) as devnull:
                return psutil.Popen(
                    [self.python, "-m", "gpulab.extensions.runtime", str(program), *spec.args],
                    env=env, stdout=logfile, stderr=subprocess.STDOUT, stdin=devnull,
                    preexec_fn=preexec, close_fds=True,
                )
        except subprocess.SubprocessError as e:  # the reason is in the log
            raise JobError(f"{r.role}-{r.index} could not be started: "
                           f"{self._start_error(job.job_dir, r) or e}", 500) from e
        finally:
            logfile.close()
            if netns is not None:
                os.close(netns)

    @staticmethod
    def _start_error(job_dir: str, r) -> str:
        """The reason a replica's ``preexec`` wrote to its log, if any."""
        try:
            tail = safefs.read_tail(*_in_job(job_dir, "logs", f"{r.role}-{r.index}.log"), 2048)
        except OSError:
            return ""
        for line in reversed(tail.decode(errors="replace").splitlines()):
            if line.startswith("gpulab: "):
                return line.removeprefix("gpulab: ")
        return ""

    # -- the job's sandbox: network namespace and private /tmp ------------------------------

    def _make_sandbox(self, job_id: str, account: UserAccount) -> None:
        if not self.sandboxed:
            return
        owner = (account.uid, account.gid) if account.uid is not None else None
        try:
            sandbox.make_netns(job_id, self.netns_root)
            sandbox.make_private_dir(self.tmp_root, job_id, owner)
        except OSError as e:
            raise JobError("The job could not be started: its sandbox could not be made "
                           f"({e}). Ask the operator: gpulab runs jobs as root with network "
                           "and mount namespaces.", 500) from e

    def _remove_sandbox(self, job_id: str) -> None:
        if not self.sandboxed:
            return
        try:
            sandbox.remove_netns(job_id, self.netns_root)
        except OSError:
            log.exception("Could not remove the network namespace of job %s", job_id)
        sandbox.remove_private_dir(self.tmp_root, job_id)

    # -- control groups: one per replica (limits, GPU devices, clean stop) -----------------

    @staticmethod
    def _unit(job_id: str, role: str, index: int) -> str:
        return f"job-{job_id}-{role}-{index}"

    def _replica_group(self, job_id: str, spec: JobSpec, role: str, index: int,
                       devices: list[int]):
        """A fresh control group for one replica, limits or not: the role's ``cpu`` /
        ``memory`` or the operator's defaults, and only its own GPUs' device nodes. None
        where groups cannot be made here (`gpulab.spawner.cgroups.local_cgroups` logs why)."""
        cgroups, _ = local_cgroups()
        if cgroups is None:
            return None
        res = spec.resources.get(role)
        unit = self._unit(job_id, role, index)
        cgroups.find(unit).remove(kill=True)  # a restarted replica starts in a clean group
        return cgroups.make(unit, memory=memory_bytes(self.limits.memory_of(res)),
                            cpus=self.limits.cpu_of(res), gpus=devices)

    def _oom_killed(self, job_id: str, role: str, index: int) -> bool:
        cgroups, _ = local_cgroups()
        return cgroups is not None and cgroups.find(self._unit(job_id, role, index)).oom_kills() > 0

    def _kill_group(self, job_id: str, role: str, index: int) -> None:
        cgroups, _ = local_cgroups()
        if cgroups is not None:
            cgroups.find(self._unit(job_id, role, index)).remove(kill=True)

    def _remove_groups(self, job_id: str, spec: JobSpec) -> None:
        for role, index in spec.replica_names():
            self._kill_group(job_id, role, index)

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
        with self.ledger.Reader() as s:
            active = s.scalars(select(JobRow.id).where(JobRow.state.in_(ACTIVE),
                                                       JobRow.backend == self.name)).all()
        for job_id in active:
            try:
                self._supervise_job(job_id)
            except Exception:  # one job's trouble never stalls the supervision of the others
                log.exception("Supervising job %s failed; next pass tries again", job_id)
        return bool(active)

    def _supervise_job(self, job_id: str) -> None:
        restart: set[tuple[str, int]] = set()
        outcome = None
        blame = None  # the replica whose program error fails the job
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
                    res = spec.resources.get(r.role)
                    whose = (f"the {r.role} role's memory limit"
                             if res is not None and res.memory is not None
                             else "the default memory limit of replicas")
                    r.reason = (f"killed: out of memory ({whose} is "
                                f"{self.limits.memory_of(res)})")
                log.info("Job %s/%s replica %s-%s exited %s", job.user, job.name, r.role,
                         r.index, code)
            if spec.strategy == "parameter-server":
                # each replica restarted is a retry (they fail and restart one by one)
                can_retry = sum(r.restarts for r in reps) < spec.retries
                chief = by[("chief", 0)]
                dead_ps = [k for k, r in by.items() if k[0] == "ps" and r.state != "Running"]
                if chief.state == "Succeeded":
                    outcome = ("Succeeded", "the chief finished")
                elif chief.state == "Failed" and chief.exit_code != EXIT_INFRA and not dead_ps:
                    outcome = ("Failed", f"the chief failed: {chief.reason}; see its log "
                               "(logs/chief-0.log)")
                    blame = "chief-0"
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
                # all workers restart together: one restart of them all is one retry
                rounds = max((r.restarts for r in workers), default=0)
                failed = [r for r in workers if r.state == "Failed"]
                raised = [r for r in failed if r.exit_code in PROGRAM_ERRORS]
                if all(r.state == "Succeeded" for r in workers):
                    outcome = ("Succeeded", "all workers finished")
                elif raised:  # the program's own error: running it again would raise again
                    r = raised[0]
                    outcome = ("Failed", f"worker-{r.index} failed: {r.reason}; see its log "
                               f"(logs/worker-{r.index}.log)")
                    blame = f"worker-{r.index}"
                elif failed:  # killed, or lost its peers: the workers restart together
                    if rounds < spec.retries:
                        restart = {(r.role, r.index) for r in workers}
                    else:
                        names = ", ".join(f"worker-{r.index}" for r in failed)
                        outcome = ("Failed", f"{names} failed ({failed[0].reason}) after "
                                   f"{rounds} restart{'s' if rounds != 1 else ''} of the "
                                   f"workers (retries: {spec.retries})")
            started = job.started_at or job.created_at
            if outcome is None and spec.max_runtime and time.time() > started + spec.max_runtime:
                outcome = ("Failed", f"stopped after max_runtime ({spec.max_runtime} s)")
            if restart and outcome is None:
                for k in restart:
                    by[k].restarts += 1
                job.reason = f"restarting {', '.join(f'{a}-{b}' for a, b in sorted(restart))}"
        if outcome is not None:
            if blame is not None:  # read after the transaction: the log is the person's file
                try:
                    error = error_summary(safefs.read_tail(
                        *_in_job(job.job_dir, "logs", f"{blame}.log"), 64 * 1024))
                except OSError:  # a link or a FIFO in its place: the job fails all the same
                    error = ""
                if error:
                    outcome = (outcome[0], f"{outcome[1]}. {error}")
            self._kill_job_processes(job_id)
            self._finish(job_id, *outcome)
        elif restart:
            for k in restart:  # MWMS restarts all workers: stop the survivors first
                self._kill((job_id, *k), grace=2)
            try:
                self._start_all(job_id, None, only=restart)
            except Exception as e:  # e.g. the job folder was swapped for a link meanwhile
                log.warning("Job %s: a restart failed: %s", job_id, e)
                why = (f"its folder holds a link or something that is not a folder or plain "
                       f"file ({e.strerror})" if isinstance(e, safefs.UnsafePath)
                       else getattr(e, "message", None) or str(e))
                self._kill_job_processes(job_id)
                self._finish(job_id, "Failed", f"could not restart "
                             f"{', '.join(f'{a}-{b}' for a, b in sorted(restart))}: {why}")

    def _finish(self, job_id: str, state: str, reason: str) -> None:
        if not job_id:
            return
        with self.ledger.Reader() as s:
            job = s.get(JobRow, job_id)
            if job is None:
                return
            spec = JobSpec.model_validate_json(job.spec)
        # first everything the job left (its groups: setsid daemons too) is ended, then the
        # job is final and its GPUs free in one commit: nobody sees a finished job that still
        # holds GPUs, nor free GPUs that a process of the job still uses
        self._remove_groups(job_id, spec)
        self._remove_sandbox(job_id)
        with self.ledger.Session.begin() as s:
            job, reps = self._load(s, job_id)
            job.state, job.reason, job.finished_at = state, reason, time.time()
            for r in reps:
                if r.state == "Running":
                    r.state, r.reason = "Stopped", "stopped with the job"
            if job.allocation_id:
                self.ledger.release(job.allocation_id, f"job {state.lower()}", session=s)
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
        if pgid is not None:  # anything the replica left in its process group
            try:
                os.killpg(pgid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        # and in its control group: what left the process group (setsid) cannot leave that
        self._kill_group(*key)

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
            await asyncio.to_thread(self._finish, job["id"], "Stopped",
                                    "stopped by " + (actor or user))
        return await asyncio.to_thread(self.get, user, name)

    # -- recovery after a restart of the service -------------------------------------------

    def recover(self) -> None:
        with self.ledger.Reader() as s:
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
        self._clean_sandboxes()
        # allocations of jobs that no longer run (e.g. the service died between admission
        # and writing the job) are closed: nothing leaks
        with self.ledger.Reader() as s:
            keep = set(s.scalars(select(JobRow.allocation_id).where(JobRow.state.in_(ACTIVE))))
        self.ledger.close_orphans("job", keep, "job gone at service start-up")

    def _clean_sandboxes(self) -> None:
        """Remove the namespaces and /tmp folders left by this ledger's jobs that no longer
        run (the service died as one ended). Those of other deployments on the machine, whose
        ids this ledger does not know, are left alone."""
        if not self.sandboxed:
            return
        try:
            tmps = os.listdir(self.tmp_root)
        except FileNotFoundError:
            tmps = []
        names = set(sandbox.netns_names(self.netns_root)) | set(tmps)
        if not names:
            return
        with self.ledger.Reader() as s:
            ended = s.scalars(select(JobRow.id).where(JobRow.id.in_(names),
                                                      JobRow.state.not_in(ACTIVE))).all()
        for job_id in ended:
            log.info("Removing the sandbox left by job %s", job_id)
            self._remove_sandbox(job_id)

    async def shutdown(self) -> None:
        """Leave replicas running (a restarted service re-adopts them)."""
        if self._task:
            self._task.cancel()


#: exit codes of the runtime that mean the program itself failed (1: it raised, 2: bad
#: configuration), which no restart mends: the job fails at once
PROGRAM_ERRORS = (1, 2)


#: frames of a traceback that are not the person's code: installed packages, Python's own, and
#: gpulab's runtime (its own path: a person's files live below a data folder that is often
#: ``/var/lib/gpulab``, and on Kubernetes below ``/gpulab/job-source``, so "/gpulab/" is theirs)
_NOT_THEIR_CODE = ("site-packages", "dist-packages", "/usr/lib/python", "<frozen",
                   "/gpulab/extensions/", "/extensions/runtime.py")


def error_summary(log: bytes, limit: int = 400) -> str:
    """The error at the end of a replica's log, for the job's reason: the exception line of
    the last Python traceback and the line of the person's code it came from, e.g.
    ``ModuleNotFoundError: No module named 'mnist_setup' (source.py, line 3)``; '' if the
    log ends without one."""
    lines = [ln for ln in log.decode(errors="replace").splitlines()
             if not ln.startswith((PROGRESS_PREFIX, "gpulab runtime:"))]
    start = max((i for i, ln in enumerate(lines)
                 if ln.startswith("Traceback (most recent call last):")), default=None)
    if start is None:
        return ""
    where, error = "", ""
    for ln in lines[start + 1:]:
        m = re.match(r'\s*File "([^"]+)", line (\d+)', ln)
        if m and not any(x in m.group(1) for x in _NOT_THEIR_CODE):  # the person's frame
            where = f"{Path(m.group(1)).name}, line {m.group(2)}"
        elif ln and not ln[0].isspace():
            error = ln.strip()  # the last such line: the exception raised
    if not error:
        return ""
    text = f"{error} ({where})" if where else error
    return text if len(text) <= limit else text[: limit - 1] + "…"


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

