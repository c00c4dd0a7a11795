"""The local driver of the job workflow: one process per replica on this machine.

The workflow (`gpulab.hub.jobs.base.JobBackend`) admits the job's GPUs through the ledger as
one request (the sum over replicas: all or nothing), records it and releases the GPUs when the
job ends in any way; this driver starts the replicas, watches their exits and acts on what
`gpulab.hub.jobs.rules.decide_local` decides.

Local backend
-------------
Each replica is ``python -m gpulab.extensions.runtime <script> <args>`` on a loopback port,
in a process group of its own, with ``TF_CONFIG`` naming every replica's address and
``CUDA_VISIBLE_DEVICES`` its share of the job's GPUs (where the machine's GPUs are simulated,
also ``TF_ENABLED_DEVICE_TYPES=CPU``: TensorFlow then looks for no CUDA driver, which is not
there, and logs no ``failed call to cuInit``). As root with isolation on, replicas run
as the user's own system account (the same one as their notebook server). The job folder is
``<shared>/users/<user>/jobs/<job>/``: ``source.py`` (when the spec gave code text; with
``files``, ``code/source.py`` and the files beside it in ``code/``, the entry point's folder
and so on every replica's import path; written as root without following links, owned by
the person, a name never more than one plain component: see `gpulab.hub.jobs.spec`),
``logs/<role>-<index>.log`` (and ``logs/<role>-<index>.exit``, the exit code the runtime
writes as it ends), and what the program writes through the runtime's helpers (TensorBoard
summaries under ``tensorboard/``, checkpoints under ``checkpoints/``).

The sandbox (as root; `gpulab.hub.machine.sandbox`, `gpulab.hub.machine.cgroups`), set up in each
replica between ``fork`` and ``exec`` while it is still root, then it drops to the account:

- **one network namespace per job** holding only loopback, made when the job starts
  (``/run/gpulab/netns/<job id>``) and joined by every replica: the replicas reach each other
  on 127.0.0.1, and nothing outside the job reaches their TensorFlow servers, which run any
  graph they are sent (they have no authentication). Replicas cannot reach the machine's own
  loopback services (the hub, the gpulab service) or the network either: they need none.
- **a private /tmp per job** (a mount namespace per replica; all replicas of the job bind the
  same folder, owned by the person, mode 0700, under root's 0700 ``tmp_root``), removed with
  the job.
- **private IPC per replica**: an IPC namespace of its own (System V shared memory,
  semaphores, message queues) and a fresh tmpfs on ``/dev/shm`` as large as the replica's
  memory limit (the kernel's default, half the RAM, where it has none): data loaders' shared
  buffers fit, nobody else sees or squats them, and they count against the replica's memory.
- **a /proc per replica that shows only the person's own processes** (``hidepid=invisible``):
  nobody's command lines or environments but their own.
- **a control group per replica**, limits or not: the role's ``cpu`` / ``memory`` or the
  operator's defaults (``c.GPUJobs.default_cpu`` / ``default_memory``), a bound on its
  processes and threads (``c.GPUJobs.pids_per_replica``), the device allow-list of its GPUs,
  and stop kills the whole group (``setsid`` grandchildren too). ``RLIMIT_NPROC``
  (``c.GPUJobs.max_user_processes``) bounds the account's processes as a whole, also where
  no groups can be made. The group nests in the person's own, beside their notebook
  servers', whose memory and CPU limit bounds all their work together
  (``c.LocalGPUSpawner.person_mem_limit`` / ``person_cpu_limit``, handed over by the hub in
  the job limits), and the replica starts with ``oom_score_adj`` 500
  (``c.LocalGPUSpawner.oom_score_adj``): the kernel's OOM killer takes it before the hub.
- **the working directory** (the job folder) entered after dropping privileges, through a
  descriptor opened without following links (never ``Popen(cwd=...)``, which runs as root).
- **an environment built from an allow-list** (`replica_env`): never a copy of the service's,
  which holds the service's own hub token.

A held cluster (kind ``cluster``, issue 38: parameter servers and workers whose coordinator
is the person's notebook kernel) runs the same way, with these differences: every replica
runs ``python -m gpulab.extensions.runtime`` with ``GPULAB_KIND=cluster`` and no program
(each serves a ``tf.distribute.Server`` for its task); as root its replicas join **the
person's own network namespace** (`gpulab.hub.machine.personnet`, the one their notebook
servers run in, ``/run/gpulab/netns/person-<hub>-<name>``) instead of a namespace of the job,
on ports this backend picks free inside it as the cluster starts (kept across a worker's
restart), so the person's kernels reach the servers on ``127.0.0.1`` and nobody else's
process can (the servers run any graph they are sent). A cluster needs a running server of
its person (it is refused with 409 otherwise), and ends when their last server stops (its
namespace is gone). The view gives the addresses (``cluster``: ``{"ps": [...], "worker":
[...]}``). Its rules are `gpulab.hub.jobs.rules.decide_cluster`.

Admission also bounds a person's active replicas across their jobs
(``c.GPUJobs.max_replicas_per_user``), GPU-less jobs included. A submit that fails after
admission undoes everything in one place (`LocalJobBackend._undo`): processes, sandbox, rows,
GPUs; nothing stays "Admitted".

Supervision (every half second, over this process's own children; the rules are
`gpulab.hub.jobs.rules.decide_local`):

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
import errno
import json
import logging
import os
import pwd
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from gpulab.extensions import contract
from gpulab.extensions.contract import lead_replica
from gpulab.hub.machine import sandbox
from gpulab.hub.machine.accounts import AccountError
from gpulab.hub.machine.userdisk import DiskError
from gpulab.hub.machine.cgroups import (limit_user_processes, local_cgroups, memory_bytes,
                                    person_unit, set_oom_score_adj)
from gpulab.hub.machine.personnet import free_ports_inside

from gpulab.hub.machine import safefs
from gpulab.extensions.joblog import restart_marker, restart_record
from gpulab.hub.jobs.base import (JobBackend, JobError, add_restart, job_view,
                                  restart_history)
from gpulab.hub.jobs.rules import (
    EXIT_UNKNOWN,
    Decision,
    PROGRAM_ERRORS,
    decide_local,
    error_summary,
    exit_words,
    names,
)
from gpulab.hub.jobs.spec import SOURCE_NAME, JobLimits, JobSpec
from gpulab.hub.jobs.store import JobRow
from gpulab.hub.quota.ledger import Allocation, Ledger
from gpulab.hub.quota.waiting import Queue

log = logging.getLogger("gpulab.jobs")

#: variables a replica takes from the service's environment (nothing else is copied: the
#: service's own hub token and settings must never reach a person's program)
ENV_ALLOW = ("PATH", "LANG", "LANGUAGE", "TZ")
ENV_ALLOW_PREFIXES = ("LC_",)
#: how a replica's reason begins when its control group counted an out-of-memory kill
OOM_WORDS = "killed: out of memory"
#: the private /tmp folders of running jobs (root's, mode 0700; one folder per job)
TMP_ROOT = Path("/var/lib/gpulab/tmp")


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


def cluster_addresses(replicas) -> dict[str, list[str]]:
    """``{"ps": ["127.0.0.1:port", ...], "worker": [...]}`` of a cluster's replica rows: where
    its person's kernels reach its servers (on loopback in the person's namespace)."""
    found: dict[str, list[tuple[int, str]]] = {}
    for r in replicas:
        found.setdefault(r.role, []).append((r.index, f"127.0.0.1:{r.port}"))
    return {role: [a for _, a in sorted(found[role])] for role in ("ps", "worker")
            if role in found}


def replica_env(base: dict[str, str], *, spec: JobSpec, job_name: str, job_dir: str,
                user_dir: str, role: str, index: int, cluster: dict, devices: list[int],
                account: tuple[str, str] | None = None, cuda: bool = True) -> dict[str, str]:
    """A replica's whole environment, built from an allow-list (no I/O).

    From `base` (the service's environment) only `ENV_ALLOW` / `ENV_ALLOW_PREFIXES`; then the
    spec's own ``env`` (which `JobSpec` keeps off gpulab's names); then gpulab's variables.
    `account`: (user name, home) of the system account the replica runs as, if any.
    `cuda`: whether the machine has real GPUs. Without (its GPUs are simulated), TensorFlow is
    told to use the CPU alone (``TF_ENABLED_DEVICE_TYPES=CPU``, unless the spec's ``env``
    says otherwise): it then calls no ``cuInit`` of a CUDA driver that is not installed, whose
    failure it would log as an error (``failed call to cuInit ... (303)``) in every replica.
    ``CUDA_VISIBLE_DEVICES`` still names the replica's (simulated) GPUs.
    """
    env = {k: v for k, v in base.items() if k in ENV_ALLOW or k.startswith(ENV_ALLOW_PREFIXES)}
    env.setdefault("PATH", "/usr/local/bin:/usr/bin:/bin")
    env.update(spec.env)
    visible = ",".join(str(d) for d in devices)
    env.update({
        "TF_CONFIG": json.dumps({"cluster": cluster, "task": {"type": role, "index": index}}),
        "GPULAB_STRATEGY": spec.strategy,
        "GPULAB_KIND": spec.kind,
        "GPULAB_JOB_NAME": job_name,
        "GPULAB_JOB_DIR": job_dir,
        "GPULAB_USER_DIR": user_dir,
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": visible,
        "NVIDIA_VISIBLE_DEVICES": visible or "void",
        "PYTHONUNBUFFERED": "1",
    })
    if not cuda:
        env.setdefault("TF_ENABLED_DEVICE_TYPES", "CPU")
    if account is not None:
        name, home = account
        env.update({"USER": name, "LOGNAME": name, "HOME": home})
    elif "HOME" in base:
        env["HOME"] = base["HOME"]
    return env


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


def _size(n: int) -> str:
    """Bytes in words for people: ``12Gi``, ``512Mi``."""
    for unit, size in (("Ti", 2**40), ("Gi", 2**30), ("Mi", 2**20), ("Ki", 2**10)):
        if n >= size:
            value = n / size
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.1f}{unit}"
    return str(n)


class LocalJobBackend(JobBackend):
    name = "local"

    def __init__(self, ledger: Ledger, accounts, *, python: str = sys.executable,
                 poll_interval: float = 0.5, stop_grace: float = 10.0,
                 limits: JobLimits | None = None, sandboxed: bool | None = None,
                 tmp_root: Path = TMP_ROOT, netns_root: Path = sandbox.NETNS_DIR,
                 queue: Queue | None = None):
        self._setup_workflow(ledger, queue)
        self.accounts = accounts  # callable: user name -> UserAccount
        #: people's disks on the shared storage (`gpulab.hub.machine.userdisk.PersonDisks`), made
        #: and mounted before their replicas start; None: no disk limits here
        self.disks = None
        self.python = python
        self.poll_interval = poll_interval
        self.stop_grace = stop_grace
        if limits is not None:
            self.limits = limits
        # namespaces need root: as root every job gets them (or does not start)
        self.sandboxed = os.geteuid() == 0 if sandboxed is None else sandboxed
        self.tmp_root = Path(tmp_root)
        self.netns_root = Path(netns_root)
        # the processes of this service's replicas; the supervisor's thread, launches and
        # stops use it under the workflow's lock
        self._procs: dict[tuple[str, str, int], psutil.Popen | psutil.Process] = {}

    @property
    def supervise_interval(self) -> float:
        return self.poll_interval

    # -- queries -------------------------------------------------------------------------

    def _view(self, job: JobRow, replicas, detail: bool = False) -> dict:
        view = job_view(job, replicas)
        if view["kind"] == contract.CLUSTER:  # where the owner's kernels reach its servers
            view["cluster"] = cluster_addresses(replicas)
        if detail and view["kind"] != contract.CLUSTER:  # the lead replica's progress, from its log in the person's folder
            view["progress"] = read_progress(job, lead_replica(view["strategy"]))
        return view

    def _read_replica_log(self, job: JobRow, replica: str, offset: int,
                          limit: int) -> tuple[bytes, int, bool]:
        # in a thread, after the transaction: a slow or hostile file never holds the ledger
        try:
            data, size = safefs.read_bytes(*_in_job(job.job_dir, "logs", f"{replica}.log"),
                                           offset, limit)
        except OSError as e:
            raise JobError(f"The log of {replica} cannot be read: {e.strerror}.", 409,
                           "replica") from None
        return data, size, contract.is_final(job.state)

    # -- submit: the workflow's hooks ------------------------------------------------------

    async def _prepare(self, user: str, groups: tuple[str, ...],
                       spec: JobSpec) -> tuple[UserAccount, Path | None]:
        try:  # may create the account (useradd): in a thread
            account = await asyncio.to_thread(self.accounts, user)
        except AccountError as e:  # e.g. the mapped account belongs to someone else
            raise JobError(f"Your jobs cannot run: {e}", 403) from None
        if self.disks is not None:
            try:  # their folder on their own disk, as their quota sizes it (mkfs, mount)
                await asyncio.to_thread(self.disks.prepare, user, groups)
            except DiskError as e:
                raise JobError(f"Your job cannot start: your disk on the shared storage: "
                               f"{e.message}", e.status) from None
        if spec.is_cluster:
            self._check_cluster_network(user)
        script = None
        if spec.script is not None:
            script = (account.folder / spec.script).resolve()
            if not script.is_relative_to(account.folder.resolve()):
                raise JobError("script: must be inside your own folder.", field="script")
            if not script.is_file():
                raise JobError(f"script: there is no file {spec.script} in your folder.",
                               field="script")
        return account, script

    def _job_dir(self, user: str, spec: JobSpec, prepared) -> str:
        account, _ = prepared
        return str(account.folder / "jobs" / spec.name)

    def _replica_rows(self, spec: JobSpec, allocation: Allocation | None) -> list[dict]:
        """Each replica's port and share of the devices (none yet while the job waits)."""
        rows, devices = [], list(allocation.devices) if allocation is not None else []
        for role, index in spec.replica_names():
            n = spec.gpus_of(role)
            mine, devices = devices[:n], devices[n:]
            rows.append(dict(role=role, index=index, port=free_port(), devices=json.dumps(mine)))
        return rows

    async def _launch(self, job_id: str, user: str, groups, spec: JobSpec, prepared) -> None:
        # (the workflow holds the lock: the supervisor's thread reads the same process table)
        account, script = prepared
        await asyncio.to_thread(self._start_job, job_id, account, spec, script)

    def _start_job(self, job_id: str, account: UserAccount, spec: JobSpec, script) -> None:
        self._prepare_dir(account, spec)
        self._make_sandbox(job_id, account, spec)
        if spec.is_cluster and self.sandboxed:
            self._pick_cluster_ports(job_id, account)
        self._start_all(job_id, script)

    # -- a held cluster: in the person's own network namespace ------------------------------

    def person_netns(self, user: str) -> str | None:
        """The name of `user`'s network namespace (their notebook servers'), under
        ``netns_root``; None where the hub gave no person tag (no person-level namespaces)."""
        tag = self.limits.person_tag
        return person_unit(tag, user) if tag else None

    def _check_cluster_network(self, user: str) -> None:
        """A cluster runs in its person's namespace: refuse one that has none to run in."""
        if not self.sandboxed:
            return  # not root: jobs and clusters alike listen on the machine's loopback
        name = self.person_netns(user)
        if name is None:
            raise JobError("kind: clusters need the notebooks' private network (the hub's "
                           "c.LocalGPUSpawner.private_network) to keep their servers yours "
                           "alone; this hub has none. Run a training job instead.", 409, "kind")
        if not (self.netns_root / name).exists():
            raise JobError("kind: a cluster's servers live in your notebook server's private "
                           "network, so only your kernels reach them: start your server "
                           "first, then hold the cluster from a notebook.", 409, "kind")

    def _pick_cluster_ports(self, job_id: str, account: UserAccount) -> None:
        """Each replica's port, free inside the person's namespace now (ports chosen on the
        machine's side say nothing about it)."""
        with self.ledger.Session.begin() as s:
            job, reps = self.store.load(s, job_id)
            path = self.netns_root / self.person_netns(job.user)
            for r, port in zip(reps, free_ports_inside(path, len(reps))):
                r.port = port

    def _launch_error(self, e: BaseException, spec: JobSpec) -> JobError:
        if isinstance(e, safefs.UnsafePath):
            return JobError(f"name: jobs/{spec.name} in your folder holds a link or "
                            "something that is not a folder or plain file, or was moved "
                            f"while the job started ({e.strerror}); gpulab does not follow "
                            "links there. Remove it, or choose another name.", 409, "name")
        return super()._launch_error(e, spec)

    async def _unlaunch(self, job_id: str, user: str, spec: JobSpec) -> None:
        """Its processes and their groups, its sandbox (the workflow holds the lock)."""
        await asyncio.to_thread(self._unlaunch_now, job_id, spec)

    def _unlaunch_now(self, job_id: str, spec: JobSpec) -> None:
        self._kill_job_processes(job_id)
        self._remove_groups(job_id, spec)
        self._remove_sandbox(job_id)

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
        # simulated GPUs: TensorFlow is told there is no CUDA (read before the transaction; a
        # pool that lists no devices is left alone: it may count real GPUs it does not list)
        pool = self.ledger.devices()
        cuda = not pool or any(not d.simulated for d in pool)
        # read alone, the processes started outside any transaction (a write transaction
        # held the database's write lock, SQLite's for everyone, while they started), then
        # what started written in one short one
        job, reps = self.store.read(job_id)
        spec = JobSpec.model_validate_json(job.spec)
        account = self.accounts(job.user)
        held = spec.is_cluster
        cluster = {}
        for r in reps:
            if r.role != "evaluator":
                cluster.setdefault(r.role, []).append((r.index, f"127.0.0.1:{r.port}"))
        cluster = {k: [a for _, a in sorted(v)] for k, v in cluster.items()}
        job_dir = Path(job.job_dir)
        program = script or job_dir.joinpath(*code_parts(spec))
        if script is None and spec.script is not None:
            program = account.folder / spec.script
        if held:  # a cluster's replicas only serve
            program = None
        started: dict[tuple[str, int], tuple[int, float]] = {}
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
            history = restart_history(r) if only is not None else []
            marker = (restart_marker(r.role, r.index, history[-1])
                      if history and history[-1].get("restart") == r.restarts else None)
            proc = self._spawn(job, spec, r, cluster, program, account, marker, cuda=cuda)
            self._procs[(job_id, r.role, r.index)] = proc
            started[key] = (proc.pid, proc.create_time())
        with self.ledger.Session.begin() as s:
            job, reps = self.store.load(s, job_id)
            for r in reps:
                if (r.role, r.index) in started:
                    r.pid, r.pid_started = started[(r.role, r.index)]
                    r.state, r.reason, r.exit_code = "Running", "", None
            job.state = "Running"
            job.started_at = job.started_at or time.time()
            job.reason = "all replicas started"

    def _spawn(self, job, spec, r, cluster, program, account, marker: str | None = None,
               cuda: bool = True):
        """Start one replica, its output appended to its log (after ``marker``, a line that
        says why a restarted attempt starts, on a line of its own); ``cuda`` False: the pool's
        GPUs are simulated (TensorFlow is told to use the CPU)."""
        devices = json.loads(r.devices)
        env = replica_env(
            dict(os.environ), spec=spec, job_name=job.name, job_dir=job.job_dir,
            user_dir=str(account.folder), role=r.role, index=r.index, cluster=cluster,
            devices=devices, cuda=cuda,
            account=(pwd.getpwuid(account.uid).pw_name, account.home or "/")
            if account.uid is not None else None)
        owner = (account.uid, account.gid) if account.uid is not None else None
        with _their_folder():
            logfile = os.fdopen(safefs.open_file(
                *_in_job(job.job_dir, "logs", f"{r.role}-{r.index}.log"),
                os.O_RDWR | os.O_CREAT | os.O_APPEND, owner=owner), "ab", buffering=0)
        if marker is not None:
            try:
                size = os.fstat(logfile.fileno()).st_size
                # the attempt before may have ended mid-line (a progress bar): a line apart
                sep = b"" if size == 0 or os.pread(logfile.fileno(), 1, size - 1) == b"\n" else b"\n"
                logfile.write(sep + marker.encode() + b"\n")
            except OSError as e:
                log.warning("Job %s/%s: no restart line in the log of %s-%s: %s", job.user,
                            job.name, r.role, r.index, e)
        folder, job_path = _in_job(job.job_dir)
        group = self._replica_group(job.id, spec, r.role, r.index, devices, job.user)
        # a job's own namespace; a cluster's: its person's, where their kernels are
        netns = (sandbox.open_netns(self.person_netns(job.user) if spec.is_cluster else job.id,
                                    self.netns_root) if self.sandboxed else None)
        tmp = self.tmp_root / job.id
        # the replica's /dev/shm holds up to its memory limit (its pages count against it)
        shm = memory_bytes(self.limits.memory_of(spec.resources.get(r.role)))
        user_name = pwd.getpwuid(account.uid).pw_name if account.uid is not None else None
        nproc = self.limits.max_user_processes
        oom = self.limits.oom_score_adj
        # the child says on this pipe when the job folder was not there to enter (the person
        # moved or swapped it since it was made): Popen itself only says preexec failed
        moved_r, moved_w = os.pipe()
        os.set_blocking(moved_r, False)

        def preexec():  # in the child, as root; a failure is written to the replica's log
            try:
                os.setsid()  # one process group per replica
                if group is not None:
                    group.join()  # limits, GPU devices, and stop reaches all it starts
                set_oom_score_adj(oom)  # as root: the person cannot lower it (issue 36)
                if netns is not None:
                    sandbox.join_netns(netns)  # the job's loopback-only network
                    # the job's own /tmp; the replica's own IPC, /dev/shm, and a /proc
                    # that shows only the person's processes
                    sandbox.private_tmp(tmp, keep=[folder], ipc=True, shm_size=shm,
                                        hide_pids=True)
                if account.uid is not None:
                    limit_user_processes(nproc)  # as root still: RLIMIT_NPROC (issue 36)
                    os.setgid(account.gid)
                    os.initgroups(user_name, account.gid)
                    os.setuid(account.uid)
                os.umask(0o022)  # the person's usual mask, not `gpulab up`'s private 077
                # as the person: the job folder, never through a link
                try:
                    sandbox.enter_dir(folder, job_path)
                except OSError:
                    os.write(moved_w, b"!")
                    raise
            except BaseException as e:
                os.write(2, f"gpulab: the replica could not be started: {e}\n".encode())
                raise

        try:
            with open(os.devnull) as devnull:
                command = [self.python, "-m", "gpulab.extensions.runtime"]
                if program is not None:
                    command += [str(program), *spec.args]
                return psutil.Popen(
                    command,
                    env=env, stdout=logfile, stderr=subprocess.STDOUT, stdin=devnull,
                    preexec_fn=preexec, close_fds=True,
                )
        except subprocess.SubprocessError as e:  # the reason is in the log
            try:  # the child wrote it (or not) before it said preexec failed
                moved = os.read(moved_r, 1) == b"!"
            except BlockingIOError:
                moved = False
            if moved:
                raise safefs.UnsafePath(errno.ENOENT, "the job folder changed while gpulab "
                                        "started the job") from e
            raise JobError(f"{r.role}-{r.index} could not be started: "
                           f"{self._start_error(job.job_dir, r) or e}", 500) from e
        finally:
            logfile.close()
            if netns is not None:
                os.close(netns)
            os.close(moved_w)
            os.close(moved_r)

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

    def _make_sandbox(self, job_id: str, account: UserAccount, spec: JobSpec) -> None:
        if not self.sandboxed:
            return
        owner = (account.uid, account.gid) if account.uid is not None else None
        try:
            if not spec.is_cluster:  # a cluster joins its person's namespace instead
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
                       devices: list[int], user: str):
        """A fresh control group for one replica, limits or not: the role's ``cpu`` /
        ``memory`` or the operator's defaults, and only its own GPUs' device nodes, inside
        `user`'s person-level group (where the hub named it: `JobLimits.person_tag`). None
        where groups cannot be made here (`gpulab.hub.machine.cgroups.local_cgroups` logs why)."""
        cgroups, _ = local_cgroups()
        if cgroups is None:
            return None
        res = spec.resources.get(role)
        unit = self._unit(job_id, role, index)
        cgroups.find(unit).remove(kill=True)  # a restarted replica starts in a clean group
        lim = self.limits
        return cgroups.make(unit, memory=memory_bytes(lim.memory_of(res)),
                            cpus=lim.cpu_of(res), gpus=devices,
                            pids=lim.pids_per_replica or None,
                            person=person_unit(lim.person_tag, user) if lim.person_tag else None,
                            person_memory=lim.person_memory or None,
                            person_cpus=lim.person_cpu or None)

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

    # -- supervision: the workflow's hooks -------------------------------------------------

    async def _supervise_pass(self) -> bool:
        # in a thread: stopping a replica (up to stop_grace seconds) never stalls the API
        return await asyncio.to_thread(self._supervise_once)

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
        active = self._active_to_supervise()
        for job_id in active:
            try:
                self._supervise_job(job_id)
            except Exception:  # one job's trouble never stalls the supervision of the others
                log.exception("Supervising job %s failed; next pass tries again", job_id)
        return bool(active)

    def _exit_reason(self, job_id: str, spec: JobSpec, r) -> str:
        """A replica's exit in words, an out-of-memory kill named with its limit."""
        if r.exit_code == -signal.SIGKILL and self._oom_killed(job_id, r.role, r.index):
            res = spec.resources.get(r.role)
            whose = (f"the {r.role} role's memory limit"
                     if res is not None and res.memory is not None
                     else "the default memory limit of replicas")
            why = f"{whose} is {self.limits.memory_of(res)}"
            if self.limits.person_tag and self.limits.person_memory:
                why += (", and all your servers and replicas together may use "
                        f"{_size(self.limits.person_memory)}")
            return f"{OOM_WORDS} ({why})"
        return exit_words(r.exit_code)

    @staticmethod
    def _restart_record(r, failed, now: float) -> dict:
        """The record of a replica's restart: how its attempt ended (exit code, signal,
        out of memory where its control group counted an OOM kill), or that it was stopped
        to restart with the ``failed`` ones (a multi-worker job restarts all its workers)."""
        if r.state == "Failed":  # `_exit_reason` read the group's OOM count as it exited
            return restart_record(restart=r.restarts, at=now, exit_code=r.exit_code,
                                  reason=r.reason, oom_killed=r.reason.startswith(OOM_WORDS))
        if r.state == "Succeeded":  # it had finished; the others need it again
            return restart_record(restart=r.restarts, at=now, exit_code=0,
                                  reason=f"had finished; restarted with {names(failed)}")
        return restart_record(restart=r.restarts, at=now, exit_code=None,
                              reason=f"stopped to restart with {names(failed)}")

    def _supervise_job(self, job_id: str) -> None:
        """Record the exits of a job's replicas, ask the rules what follows, and do it."""
        with self.ledger.Session.begin() as s:
            job, reps = self.store.load(s, job_id)
            spec = JobSpec.model_validate_json(job.spec)
            for r in reps:
                if r.state != "Running":
                    continue
                code = self._exit_of((job_id, r.role, r.index), job.job_dir)
                if code is None:
                    continue
                r.exit_code = code
                r.state = "Succeeded" if code == 0 else "Failed"
                r.reason = self._exit_reason(job_id, spec, r)
                log.info("Job %s/%s replica %s-%s exited %s", job.user, job.name, r.role,
                         r.index, code)
            decision = decide_local(spec.strategy, {(r.role, r.index): r for r in reps},
                                    retries=spec.retries,
                                    started=job.started_at or job.created_at,
                                    max_runtime=spec.max_runtime, now=time.time(),
                                    kind=spec.kind)
            if (decision.outcome is None and spec.is_cluster
                    and not self._person_network_held(job, reps)):
                decision = Decision(outcome=("Stopped", "your notebook server stopped: its "
                                             "network, where the cluster's servers were, "
                                             "is gone"))
            if decision.restart and decision.outcome is None:
                by = {(r.role, r.index): r for r in reps}
                now = time.time()
                failed = [k for k in decision.restart if by[k].state == "Failed"]
                for k in decision.restart:
                    r = by[k]
                    r.restarts += 1
                    add_restart(r, self._restart_record(r, failed, now))
                    log.info("Job %s/%s replica %s-%s: restart %d (%s)", job.user, job.name,
                             r.role, r.index, r.restarts, r.reason or "with the others")
                job.reason = f"restarting {names(decision.restart)}"
        if decision.outcome is not None:
            state, reason = decision.outcome
            if decision.blame is not None:  # after the transaction: the log is the person's file
                try:
                    error = error_summary(safefs.read_tail(
                        *_in_job(job.job_dir, "logs", f"{decision.blame}.log"), 64 * 1024))
                except OSError:  # a link or a FIFO in its place: the job fails all the same
                    error = ""
                if error:
                    reason = f"{reason}. {error}"
            self._kill_job_processes(job_id)
            self._finish(job_id, state, reason)
        elif decision.restart:
            self._restart(job_id, decision.restart)

    def _person_network_held(self, job: JobRow, reps) -> bool:
        """Whether a cluster's replicas still run in the namespace their person's servers
        have now (False once the person's last server stopped, or a new one made it anew)."""
        if not self.sandboxed or self.person_netns(job.user) is None:
            return True
        try:
            st = os.stat(self.netns_root / self.person_netns(job.user))
        except FileNotFoundError:
            return False
        for r in reps:
            if r.state == "Running" and r.pid:
                try:
                    ns = os.stat(f"/proc/{r.pid}/ns/net")
                except OSError:
                    continue
                return (ns.st_dev, ns.st_ino) == (st.st_dev, st.st_ino)
        return True

    def _restart(self, job_id: str, restart) -> None:
        for k in restart:  # MWMS restarts all workers: stop the survivors first
            self._kill((job_id, *k), grace=2)
        try:
            self._start_all(job_id, None, only=set(restart))
        except Exception as e:  # e.g. the job folder was swapped for a link meanwhile
            log.warning("Job %s: a restart failed: %s", job_id, e)
            why = (f"its folder holds a link or something that is not a folder or plain "
                   f"file ({e.strerror})" if isinstance(e, safefs.UnsafePath)
                   else getattr(e, "message", None) or str(e))
            self._kill_job_processes(job_id)
            self._finish(job_id, "Failed", f"could not restart {names(restart)}: {why}")

    def _release(self, job: JobRow, spec: JobSpec) -> None:
        # everything the job left (its groups: setsid daemons too) is ended before the job
        # is final and its GPUs free: nobody sees free GPUs that a process of the job uses
        self._remove_groups(job.id, spec)
        self._remove_sandbox(job.id)

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
        """SIGTERM to every replica of the job at once, one grace for them all (TensorFlow's
        multi-worker runtime catches SIGTERM and goes on), then `_kill` what is left."""
        keys = [k for k in self._procs if k[0] == job_id]
        for key in keys:
            proc = self._procs[key]
            try:
                pgid = os.getpgid(proc.pid)
                if pgid == proc.pid:  # its own group (setsid): everything it started too
                    os.killpg(pgid, signal.SIGTERM)
                else:
                    proc.send_signal(signal.SIGTERM)
            except (OSError, psutil.Error):  # gone already
                pass
        deadline = time.monotonic() + self.stop_grace
        for key in keys:
            try:
                self._procs[key].wait(max(0.0, deadline - time.monotonic()))
            except (psutil.Error, OSError):  # still running (`_kill` ends it), or gone
                pass
        for key in keys:
            self._kill(key, grace=0.1)

    async def _halt(self, view: dict) -> None:
        # under the workflow's lock (stop): no supervision pass restarts what is killed
        await asyncio.to_thread(self._kill_job_processes, view["id"])

    # -- recovery after a restart of the service -------------------------------------------

    def _recover_active(self) -> None:
        """Re-adopt each active job whose replicas all still run (by pid and start time);
        any other is Failed (lost), its survivors killed. Then the sandboxes left by ended
        jobs are removed."""
        for job, reps in self.store.active():
            if job.state == "Queued":  # it waits in the queue, which kept its place
                continue
            live, gone = {}, []
            for r in reps:
                if r.state != "Running":
                    continue
                try:
                    p = psutil.Process(r.pid)
                    if (abs(p.create_time() - r.pid_started) < 1
                            and p.status() != psutil.STATUS_ZOMBIE):
                        live[(job.id, r.role, r.index)] = p
                        continue
                except psutil.NoSuchProcess:
                    pass
                gone.append(f"{r.role}-{r.index}")
            self._procs.update(live)
            if not live and not gone:  # admitted, but the service died before it started
                self._finish(job.id, "Failed", "lost: the gpulab service restarted before the "
                             "job's replicas started")
            elif gone:
                self._kill_job_processes(job.id)
                self._finish(job.id, "Failed", "lost: the gpulab service restarted and "
                             f"{', '.join(gone)} had stopped meanwhile")
            else:
                log.info("Re-adopted job %s with %d running replicas", job.name, len(live))
        self._clean_sandboxes()

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
        for job_id in self.store.ended_among(set(sandbox.netns_names(self.netns_root)) | set(tmps)):
            log.info("Removing the sandbox left by job %s", job_id)
            self._remove_sandbox(job_id)


__all__ = ["EXIT_UNKNOWN", "PROGRAM_ERRORS", "JobError", "LocalJobBackend", "UserAccount",
           "error_summary", "replica_env", "runtime_problem"]
