"""The training job spec: what a person asks for when they launch distributed TensorFlow.

A pydantic v2 model (part of the service's OpenAPI document). Every rule that TensorFlow or
gpulab imposes is checked here, before anything is admitted or started, with a message that
names the field:

- ``parameter-server``: exactly 1 ``chief`` (the coordinator that runs the user's code),
  ``ps`` >= 1, ``worker`` >= 1, optional ``evaluator``;
- ``multi-worker-mirrored``: ``worker`` >= 1, no chief, no ps (worker 0 is the chief);
- all workers get the same GPU count (one ``resources.worker`` for the role);
- the code is either ``script`` (a path inside the user's own folder, no ``..``) or
  ``source`` (code text, stored in the job folder), never both; with ``source``, ``files``
  may carry more files (``{name: text}``) placed beside it, on every replica's import path:
  plain ASCII names (`FILE_NAME_RE`: no folders, no ``..``, no leading dot, nothing that
  could leave the job's code folder), at most ``max_files``, the whole code at most
  ``max_source_bytes``;
- ``kind`` ``cluster`` (issue 38): parameter servers and workers held for the notebook kernel
  that asked, which is the coordinator: strategy ``parameter-server``, no chief, no evaluator,
  ``ps`` >= 1, ``worker`` >= 1, and no code (``script``, ``source``, ``files``, ``args``);
- ``env`` cannot set what gpulab sets (``TF_CONFIG``, ``CUDA_VISIBLE_DEVICES``, ``GPULAB_*``…).

`GPUJobs` holds the operator's limits (``c.GPUJobs.*``), carried to the gpulab service as JSON
(`GPUJobs.limits_json`, `limits_from_json`): the spec limits checked here, and the bounds a
backend applies as it admits a job (``default_cpu`` / ``default_memory`` for replicas whose
role names none, ``max_replicas_per_user``, ``pids_per_replica``, ``max_user_processes``: see
`gpulab.hub.jobs.local`). The hub adds the person-level bounds and the replicas'
``oom_score_adj``, whose settings are the notebook spawner's (``c.LocalGPUSpawner.person_*``,
``oom_score_adj``: one value for a person's servers and replicas alike;
`gpulab.hub.deploy.localhub.person_bounds`).
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import PurePosixPath
from typing import Literal

from traitlets import Float, Int, List, TraitError, Unicode, default, validate
from traitlets.config import Configurable
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gpulab.extensions.contract import CLUSTER, JOB, KINDS, NAME_RE, ROLES, STRATEGIES
from gpulab.hub.machine.cgroups import default_pids, default_user_processes, memory_bytes

from gpulab.hub.quota.policy import MAX_GPUS

RESERVED_ENV = {"TF_CONFIG", "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER",
                "GRPC_FAIL_FAST", "TF_USE_LEGACY_KERAS", "JUPYTERHUB_API_TOKEN", "PYTHONPATH",
                "LD_PRELOAD", "LD_LIBRARY_PATH", "PATH", "HOME", "USER"}
RESERVED_PREFIXES = ("GPULAB_", "JUPYTERHUB_")
#: a name in a spec's ``files``: one plain file name of ASCII letters, digits, ``_``, ``.`` and
#: ``-``, not starting with a dot (no folders, no ``..``, no hidden files, no look-alike
#: Unicode), at most 100 characters; a valid Kubernetes ConfigMap key as well
FILE_NAME_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}")
#: the name the entry point (``source``) is stored under, and what Python makes beside it
SOURCE_NAME = "source.py"
RESERVED_FILE_NAMES = {SOURCE_NAME, "__pycache__"}


@dataclass(frozen=True)
class JobLimits:
    """Limits on job specs; an admin sets them as ``c.GPUJobs.*`` (see `GPUJobs`)."""

    max_name_length: int = 40  # leaves room for "-worker-12" and Kubernetes suffixes
    max_replicas: int = 32
    max_gpus_per_replica: int = 8
    max_source_bytes: int = 256 * 1024  # ``source`` and ``files`` together
    max_files: int = 64  # entries of ``files``
    max_runtime: int = 7 * 24 * 3600
    #: the time limit of a job whose spec sets no ``max_runtime`` (0: none)
    default_max_runtime: int = 24 * 3600
    max_args: int = 64
    max_env: int = 64
    max_retries: int = 10
    allowed_images: tuple[str, ...] = field(default_factory=tuple)
    # bounds applied at admission (local backend), not checks on one spec:
    default_cpu: float = 2.0  # CPUs of a replica whose role sets no ``cpu``; 0: unlimited
    default_memory: str = "8Gi"  # memory of a replica whose role sets none; "": unlimited
    max_replicas_per_user: int = 32  # replicas of one person's active jobs together; 0: no bound
    # processes and threads of one replica (its control group); 0: no bound
    pids_per_replica: int = field(default_factory=lambda: default_pids(512, 4))
    max_user_processes: int = 0  # RLIMIT_NPROC of the person's account; 0: left as it is
    # the person-level group all of one person's servers and replicas nest in (as root): the
    # hub's tag in its name (`gpulab.hub.machine.cgroups.person_unit`; '': replicas get none) and
    # its limits, in bytes and CPUs (0: none). Their one owner is the hub's
    # ``c.LocalGPUSpawner.person_mem_limit`` / ``person_cpu_limit``, handed over by the hub
    person_tag: str = ""
    person_memory: int = 0
    person_cpu: float = 0.0
    # oom_score_adj of replicas (``c.LocalGPUSpawner.oom_score_adj``, handed over by the hub)
    oom_score_adj: int = 500
    # held clusters (issue 38): seconds without a renewal of the kernel's lease before the
    # cluster ends, and without a step dispatched (0: no idle limit)
    cluster_lease_timeout: int = 90
    cluster_idle_timeout: int = 3600

    def cpu_of(self, res: Resources | None) -> float | None:
        """The CPU limit of a replica whose role asks for `res` (None: not limited)."""
        if res is not None and res.cpu is not None:
            return res.cpu
        return self.default_cpu or None

    def with_time_limit(self, spec: "JobSpec") -> "JobSpec":
        """`spec` with ``default_max_runtime`` as its ``max_runtime`` where it sets none."""
        if spec.max_runtime is not None or self.default_max_runtime <= 0:
            return spec
        return spec.model_copy(update={
            "max_runtime": min(self.default_max_runtime, self.max_runtime)})

    def memory_of(self, res: Resources | None) -> str | None:
        """The memory limit (``8Gi``) of a replica whose role asks for `res` (None: none)."""
        if res is not None and res.memory is not None:
            return res.memory
        return self.default_memory or None


DEFAULT_LIMITS = JobLimits()


def limits_from_json(raw: str | None) -> JobLimits:
    """`JobLimits` from the JSON the hub hands the service (`GpulabService.job_limits` in its
    config file; without it ``GPULAB_JOB_LIMITS``)."""
    if not raw:
        return DEFAULT_LIMITS
    values = json.loads(raw)
    values["allowed_images"] = tuple(values.get("allowed_images", ()))
    return JobLimits(**values)


#: bounds of a spec's numbers (beyond them nothing sensible runs, and the database's integers end)
MAX_ROLE_REPLICAS = 1024
MAX_MEMORY_BYTES = 2**50  # 1 PiB
MAX_RUNTIME = 10 * 366 * 24 * 3600  # ten years, in seconds
MAX_RETRIES = 1000


class SpecError(ValueError):
    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field, self.message = field, message


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class Replicas(Strict):
    chief: int = Field(0, ge=0, le=1, description="1 for parameter-server, 0 otherwise")
    ps: int = Field(0, ge=0, le=MAX_ROLE_REPLICAS)
    worker: int = Field(1, ge=0, le=MAX_ROLE_REPLICAS)
    evaluator: int = Field(0, ge=0, le=1)


class Resources(Strict):
    gpus: int = Field(0, ge=0, le=MAX_GPUS, description="GPUs of each replica of the role")
    cpu: float | None = Field(None, gt=0, le=1024)
    memory: str | None = Field(None, pattern=r"^[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?$",
                               description="e.g. 8Gi")

    @field_validator("memory")
    @classmethod
    def _memory(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                size = memory_bytes(v)
            except (ValueError, OverflowError):
                size = None
            if size is None or size > MAX_MEMORY_BYTES:
                raise ValueError(f"must be at most {MAX_MEMORY_BYTES // 2**40}Ti")
        return v


class JobSpec(Strict):
    name: str = Field(..., description="DNS-1035 label: lower-case letters, digits and '-'")
    kind: Literal[KINDS] = Field(
        JOB, description="'job': gpulab runs your program on every replica (the default); "
        "'cluster': parameter servers and workers held for your notebook kernel, which "
        "coordinates them itself (TensorFlow's ClusterCoordinator): strategy "
        "parameter-server, no chief, no code")
    strategy: Literal[STRATEGIES]
    replicas: Replicas = Field(default_factory=Replicas)
    resources: dict[Literal["chief", "ps", "worker", "evaluator"], Resources] = Field(
        default_factory=dict)
    script: str | None = Field(None, description="path of a .py file inside your own folder")
    source: str | None = Field(None, description="Python code, stored in the job folder; "
                               "the entry point when the spec has files")
    files: dict[str, str] = Field(
        default_factory=dict,
        description="more files of the program (with 'source' only): {name: text}, placed "
                    "beside the entry point on every replica's import path (e.g. "
                    "{'mnist_setup.py': '...'}); a name is one plain file name of ASCII "
                    "letters, digits, '_', '.' and '-', not starting with '.', not 'source.py'",
        json_schema_extra={"propertyNames": {"pattern": "^" + FILE_NAME_RE.pattern + "$"},
                           "maxProperties": DEFAULT_LIMITS.max_files})
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    max_runtime: int | None = Field(None, gt=0, le=MAX_RUNTIME,
                                    description="seconds; the job is stopped after (without "
                                    "it: the operator's c.GPUJobs.default_max_runtime, a day "
                                    "by default)")
    retries: int = Field(2, ge=0, le=MAX_RETRIES,
                         description="restarts of failed replicas before the job fails")
    image: str | None = Field(None, description="container image (Kubernetes backend)")
    wait: bool = Field(True, description="when the GPUs are busy, wait in the queue (state "
                       "Queued, answered 202) rather than be refused; false: start now or "
                       "be refused (409)")
    priority: int = Field(0, ge=-100, le=100, description="order among your own queued "
                          "work (higher first); others' work is ordered by fair share. Refused (400) where "
                          "the cluster's queue is Kueue, which cannot order one person's work "
                          "without preempting others'")
    preemptible: bool = Field(False, description="may borrow GPUs idle beyond your quota; "
                              "stopped (SIGTERM) and queued again when in-quota work needs "
                              "them, then resumed from its last checkpoint")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not NAME_RE.match(v):
            raise ValueError("must be a DNS-1035 label: start with a lower-case letter, then "
                             "lower-case letters, digits or '-', not ending in '-'")
        return v

    @field_validator("script")
    @classmethod
    def _script(cls, v: str | None) -> str | None:
        if v is None:
            return v
        p = PurePosixPath(v)
        if p.is_absolute() or ".." in p.parts or not v.strip():
            raise ValueError("must be a relative path inside your own folder, without '..'")
        if p.suffix != ".py":
            raise ValueError("must name a .py file")
        return str(p)

    @field_validator("files")
    @classmethod
    def _files(cls, v: dict[str, str]) -> dict[str, str]:
        for name in v:
            shown = repr(name if len(name) <= 60 else name[:60] + "…")
            if not FILE_NAME_RE.fullmatch(name):
                raise ValueError(
                    f"{shown} is not a plain file name: use ASCII letters, digits, '_', '.' "
                    "and '-' (at most 100, not starting with '.'); no folders, no '..'")
            if name in RESERVED_FILE_NAMES:
                raise ValueError(f"{shown} is reserved: the entry point ('source') is stored "
                                 f"as {SOURCE_NAME}")
        return v

    @field_validator("env")
    @classmethod
    def _env(cls, v: dict[str, str]) -> dict[str, str]:
        for k in v:
            if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*$", k):
                raise ValueError(f"{k!r} is not a variable name")
            if k in RESERVED_ENV or k.startswith(RESERVED_PREFIXES):
                raise ValueError(f"{k} is set by gpulab and cannot be overridden")
        return v

    @model_validator(mode="after")
    def _shape(self):
        r = self.replicas
        if self.kind == CLUSTER:
            return self._cluster_shape()
        if self.strategy == "parameter-server":
            if r.chief != 1:
                raise ValueError("replicas.chief: a parameter-server job has exactly 1 chief")
            if r.ps < 1:
                raise ValueError("replicas.ps: a parameter-server job needs at least 1 ps")
            if r.worker < 1:
                raise ValueError("replicas.worker: a parameter-server job needs at least 1 worker")
        else:
            if r.chief or r.ps:
                raise ValueError("replicas.chief: a multi-worker-mirrored job has only workers "
                                 "(worker 0 acts as chief); set chief and ps to 0")
            if r.worker < 1:
                raise ValueError("replicas.worker: a multi-worker-mirrored job needs at least 1 worker")
        for role in self.resources:
            if getattr(r, role) == 0:
                raise ValueError(f"resources.{role}: this job has no {role} replicas")
        if (self.script is None) == (self.source is None):
            raise ValueError("script: give either 'script' (a file in your folder) or 'source' "
                             "(code text), not both and not neither")
        if self.source is not None and not self.source.strip():
            raise ValueError("source: the code is empty")
        if self.files and self.source is None:
            raise ValueError("files: more files go with 'source' (the entry point's text), not "
                             "with 'script' (a script's own folder is on its import path)")
        return self

    def _cluster_shape(self):
        r = self.replicas
        if self.strategy != "parameter-server":
            raise ValueError("strategy: a cluster is parameter servers and workers that your "
                             "kernel coordinates: use strategy 'parameter-server'")
        if r.chief:
            raise ValueError("replicas.chief: a cluster has no chief: the notebook kernel that "
                             "holds it is the coordinator; set chief to 0")
        if r.ps < 1:
            raise ValueError("replicas.ps: a cluster needs at least 1 ps")
        if r.worker < 1:
            raise ValueError("replicas.worker: a cluster needs at least 1 worker")
        if r.evaluator:
            raise ValueError("replicas.evaluator: a cluster has no evaluator; evaluate in "
                             "your notebook")
        for role in self.resources:
            if getattr(r, role) == 0:
                raise ValueError(f"resources.{role}: this cluster has no {role} replicas")
        for field_name in ("script", "source"):
            if getattr(self, field_name) is not None:
                raise ValueError(f"{field_name}: a cluster runs no program of its own: your "
                                 "kernel sends it the steps (use kind 'job' to run a program)")
        if self.files or self.args:
            which = "files" if self.files else "args"
            raise ValueError(f"{which}: a cluster runs no program of its own")
        return self

    @property
    def is_cluster(self) -> bool:
        return self.kind == CLUSTER

    @property
    def code_bytes(self) -> int:
        """Bytes of code the spec carries: ``source`` and ``files`` together (UTF-8)."""
        return (len((self.source or "").encode()) +
                sum(len(t.encode()) for t in self.files.values()))

    # -- derived -----------------------------------------------------------------------

    def count(self, role: str) -> int:
        return getattr(self.replicas, role)

    def gpus_of(self, role: str) -> int:
        res = self.resources.get(role)
        return res.gpus if res else 0

    @property
    def total_gpus(self) -> int:
        return sum(self.count(r) * self.gpus_of(r) for r in ROLES)

    @property
    def replica_count(self) -> int:
        return sum(self.count(r) for r in ROLES)

    def replica_names(self) -> list[tuple[str, int]]:
        return [(role, i) for role in ROLES for i in range(self.count(role))]


def parse_spec(body, limits: JobLimits = DEFAULT_LIMITS) -> JobSpec:
    """A `JobSpec` from an API body, or `SpecError` naming the first bad field."""
    if not isinstance(body, dict):
        raise SpecError("body", "A job spec must be a JSON object.")
    try:
        spec = JobSpec.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        loc = ".".join(str(x) for x in err["loc"] if x != "[key]") or "body"
        msg = err["msg"].removeprefix("Value error, ")
        m = re.match(r"^([a-z_.]+): (.*)$", msg)
        if m and not err["loc"]:  # whole-spec rules name their field first
            loc, msg = m.group(1), m.group(2)
        if err["type"] == "extra_forbidden":
            msg = f"unknown field '{err['loc'][-1]}'"
        raise SpecError(loc, f"{loc}: {msg}") from None
    _check_limits(spec, limits)
    return spec


def _check_limits(spec: JobSpec, lim: JobLimits) -> None:
    if len(spec.name) > lim.max_name_length:
        raise SpecError("name", f"name: at most {lim.max_name_length} characters")
    n = sum(spec.count(r) for r in ROLES)
    if n > lim.max_replicas:
        raise SpecError("replicas", f"replicas: at most {lim.max_replicas} replicas in one job, "
                        f"this one has {n}")
    for role, res in spec.resources.items():
        if res.gpus > lim.max_gpus_per_replica:
            raise SpecError(f"resources.{role}.gpus", f"resources.{role}.gpus: at most "
                            f"{lim.max_gpus_per_replica} GPUs per replica")
    if len(spec.files) > lim.max_files:
        raise SpecError("files", f"files: at most {lim.max_files} files, this spec has "
                        f"{len(spec.files)}")
    if spec.code_bytes > lim.max_source_bytes:
        where = "files" if spec.files else "source"
        what = "source and files together" if spec.files else "source"
        raise SpecError(where, f"{where}: at most {lim.max_source_bytes} bytes of code "
                        f"({what}: {spec.code_bytes}); put larger programs in your folder "
                        "and use 'script'")
    if spec.max_runtime is not None and spec.max_runtime > lim.max_runtime:
        raise SpecError("max_runtime", f"max_runtime: at most {lim.max_runtime} seconds")
    if len(spec.args) > lim.max_args or any(len(a) > 4096 for a in spec.args):
        raise SpecError("args", f"args: at most {lim.max_args} arguments of 4096 characters")
    if len(spec.env) > lim.max_env or any(len(v) > 4096 for v in spec.env.values()):
        raise SpecError("env", f"env: at most {lim.max_env} variables of 4096 characters")
    if spec.retries > lim.max_retries:
        raise SpecError("retries", f"retries: at most {lim.max_retries}")
    if spec.image is not None and spec.image not in lim.allowed_images:
        allowed = ", ".join(lim.allowed_images) or "none: this deployment sets the image"
        raise SpecError("image", f"image: {spec.image!r} is not allowed (allowed: {allowed})")


def limit_settings() -> list[str]:
    """The fields of `JobLimits` an admin sets as ``c.GPUJobs.<name>``."""
    return [f.name for f in fields(JobLimits) if f.name in GPUJobs.class_traits(config=True)]


class GPUJobs(Configurable):
    """Limits on the training jobs people submit (checked before anything is admitted)."""

    max_replicas = Int(DEFAULT_LIMITS.max_replicas, help="""
        Most replicas (chief, ps, workers, evaluator together) in one job (default 32).
        Example: ``c.GPUJobs.max_replicas = 16``
        """).tag(config=True)
    max_gpus_per_replica = Int(DEFAULT_LIMITS.max_gpus_per_replica, help="""
        Most GPUs one replica may ask for (default 8).""").tag(config=True)
    max_source_bytes = Int(DEFAULT_LIMITS.max_source_bytes, help="""
        Most bytes of code a spec may carry as ``source`` and ``files`` together (default
        262144, 256 KiB); larger programs go in the person's folder (``script``).""").tag(config=True)
    max_runtime = Int(DEFAULT_LIMITS.max_runtime, help="""
        Most seconds a spec's ``max_runtime`` may ask for (default 604800, a week).""").tag(
        config=True)
    default_max_runtime = Int(DEFAULT_LIMITS.default_max_runtime, help="""
        The time limit, in seconds, of a job whose spec gives no ``max_runtime`` (default
        86400, a day), as a Slurm partition's ``DefaultTime`` gives one: the job is stopped at
        it as at an explicit ``max_runtime`` (state Failed, "stopped after max_runtime"), and
        the queue can then estimate when the GPUs of running work come back, so waiting work
        gets an estimated start. A day fits most training runs here and still bounds a
        forgotten one; longer runs ask for it with ``max_runtime`` (up to
        ``c.GPUJobs.max_runtime``, which also caps this). 0: no default (such jobs run until
        they end, and work waiting behind them has no estimated start).
        Example: ``c.GPUJobs.default_max_runtime = 6 * 3600``
        """).tag(config=True)
    max_retries = Int(DEFAULT_LIMITS.max_retries, help="""
        Most restarts of failed replicas a spec may ask for (default 10).""").tag(config=True)
    allowed_images = List(Unicode(), help="""
        Container images a job may name (Kubernetes backend); default none: jobs run in
        the deployment's image. Example: ``c.GPUJobs.allowed_images = ["gpulab/singleuser:1"]``
        """).tag(config=True)
    default_cpu = Float(DEFAULT_LIMITS.default_cpu, help="""
        CPUs a training replica may use when its role sets no ``cpu`` (local backend,
        enforced with a control group as root; default 2.0; 0 leaves such replicas
        unlimited). GPU-less jobs pass every GPU quota, so this is what bounds them.
        Example: ``c.GPUJobs.default_cpu = 4``
        """).tag(config=True)
    default_memory = Unicode(DEFAULT_LIMITS.default_memory, help="""
        Memory a training replica may use when its role sets no ``memory`` (local backend,
        enforced with a control group as root; a replica over it is killed and the job says
        so): a size such as ``8Gi`` or ``512Mi`` (default ``8Gi``; ``""`` leaves such
        replicas unlimited). Example: ``c.GPUJobs.default_memory = "16Gi"``
        """).tag(config=True)
    max_replicas_per_user = Int(DEFAULT_LIMITS.max_replicas_per_user, help="""
        Most replicas one person's active jobs may have together (admitted, starting or
        running; default 32; 0: no bound). A job that would go over it is refused whole
        (HTTP 409, field ``replicas``), GPU-less or not.
        Example: ``c.GPUJobs.max_replicas_per_user = 16``
        """).tag(config=True)

    pids_per_replica = Int(help="""
        Most processes and threads one training replica may hold together (local backend,
        enforced by its control group's ``pids`` controller as root: v1 ``pids.max`` or v2
        ``pids.max``; a fork or new thread beyond it fails with EAGAIN, and a fork bomb stops
        there instead of taking every process number of the machine). Default 512, or 4 per
        CPU on machines with more than 128 CPUs: a TensorFlow process starts about two threads
        per CPU (9 on a 2-CPU machine), so a replica's own threads and the programs it runs
        fit many times over. 0: no bound.
        Example: ``c.GPUJobs.pids_per_replica = 2048``
        """).tag(config=True)

    @default("pids_per_replica")
    def _pids_per_replica_default(self):
        return default_pids(512, 4)

    max_user_processes = Int(help="""
        ``RLIMIT_NPROC`` of the account a training replica runs as (local backend, as root):
        the most processes and threads of that person's account together, in every server
        and replica, the second line against a fork bomb where control groups cannot be made.
        Default: a quarter of what the kernel can hold (the smaller of ``pid_max`` and
        ``threads-max``; 8,192 where ``pid_max`` is 32,768), at least 1,024. Under ``gpulab
        up`` it follows ``c.LocalGPUSpawner.max_user_processes`` unless set here (the hub
        warns when both are set and differ: they bound the same account). 0: left as it is.
        Example: ``c.GPUJobs.max_user_processes = 4096``
        """).tag(config=True)

    @default("max_user_processes")
    def _max_user_processes_default(self):
        return default_user_processes()

    cluster_lease_timeout = Int(DEFAULT_LIMITS.cluster_lease_timeout, help="""
        Seconds a held cluster (``gpulab.cluster(...)`` in a notebook, kind ``cluster``)
        lives without a renewal of its lease by the notebook kernel that holds it (default
        90). The kernel renews it every third of this time from a thread of its own while it
        runs, waiting in the queue too; when the kernel shuts down, is restarted or its server
        stops or is culled, the renewals stop and the cluster is stopped this long after, its
        GPUs back in the pool (a restarted kernel re-attaches to a cluster still held with
        ``gpulab.cluster(name=...)``). Shorter gives GPUs back sooner; longer rides out a
        kernel too busy to renew (the renewals run in a thread, so only a kernel stuck outside
        Python misses them). Example: ``c.GPUJobs.cluster_lease_timeout = 300``
        """).tag(config=True)
    cluster_idle_timeout = Int(DEFAULT_LIMITS.cluster_idle_timeout, help="""
        Seconds a running held cluster may go without a step dispatched to it by its kernel
        (``ClusterCoordinator.schedule``, which ``Model.fit`` under the strategy also calls)
        before it is stopped and its GPUs come back (default 3600, an hour; 0: never for
        idleness). The kernel reports the time since it last dispatched with each renewal of
        its lease. Example: ``c.GPUJobs.cluster_idle_timeout = 1800``
        """).tag(config=True)

    python = Unicode("", help="""
        The Python that runs training replicas (local backend): it must import gpulab,
        TensorFlow and tf-keras (``pip install 'gpulab[tf]'`` there). Default: gpulab's own,
        which `bash scripts/run.sh` installs with TensorFlow. Where it cannot import them,
        the hub offers no training and says why (launcher, API, CLI).
        Example: ``c.GPUJobs.python = "/opt/tf-cuda/bin/python"``
        """).tag(config=True)

    @validate("default_memory")
    def _valid_memory(self, proposal):
        value = proposal["value"]
        if value and not re.fullmatch(r"[0-9]+(\.[0-9]+)?(Ki|Mi|Gi|Ti|K|M|G|T)?", value):
            raise TraitError(f"GPUJobs.default_memory: {value!r} is not a size such as 8Gi")
        return value

    def limits(self) -> JobLimits:
        """The `JobLimits` these settings give: each of its fields that is a setting here
        (`JobLimits` holds the defaults, the traits here the help; nothing is listed twice)."""
        values = {name: getattr(self, name) for name in limit_settings()}
        values["allowed_images"] = tuple(values["allowed_images"])
        # a default time limit is never longer than the longest one may ask for
        values["default_max_runtime"] = max(0, min(self.default_max_runtime, self.max_runtime))
        return JobLimits(**values)

    def limits_json(self) -> str:
        return json.dumps(asdict(self.limits()))
