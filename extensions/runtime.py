"""The gpulab training runtime: the entry point of every replica of a training job.

Run as ``python -m gpulab.extensions.runtime <program.py> [args...]`` (the job backends do this,
with the job folder as the working directory). From ``TF_CONFIG`` and ``GPULAB_STRATEGY`` it
decides what this replica is:

- ``parameter-server``: a ``ps`` or ``worker`` task starts a ``tf.distribute.Server`` and serves
  until it is stopped; the ``chief`` is the coordinator: it waits until every ps and worker
  accepts connections (plain TCP, no TensorFlow) and runs the program, where `strategy` is a
  ``ParameterServerStrategy``; an ``evaluator`` runs the program, where `strategy` is
  TensorFlow's default strategy.
- ``multi-worker-mirrored``: every ``worker`` (and a ``chief``, if the cluster names one) runs
  the program, where `strategy` is a ``MultiWorkerMirroredStrategy``; an ``evaluator`` runs it
  with the default strategy.
- a **cluster** (``GPULAB_KIND=cluster``, issue 38: parameter servers and workers held for a
  notebook kernel, which is the coordinator): ``TF_CONFIG`` names only ``ps`` and ``worker``
  tasks, every replica serves a ``tf.distribute.Server`` for its task (protocol grpc) until
  it is stopped, says ``gpulab runtime: <task> serving at <address>`` when it does, and no
  program is run (a program argument, if any, is ignored).

**The program is the first to touch TensorFlow.** A replica that runs the program neither
imports TensorFlow nor builds a strategy before it: the program's own set-up
(``tf.config.set_logical_device_configuration``, ``tf.config.experimental.set_memory_growth``,
``tf.config.set_visible_devices``, ``tf.config.threading.*``, mixed precision, XLA), which
TensorFlow refuses once it is initialised, runs as it does standalone. gpulab's strategy is made
on the first call of `strategy` (call it after that set-up and before any other TensorFlow
operation, as TensorFlow wants for ``MultiWorkerMirroredStrategy``). A program that makes its
own strategy from ``TF_CONFIG`` (as TensorFlow's tutorials do) gets the job's cluster, and a
``MirroredStrategy`` gets the replica's GPUs (``CUDA_VISIBLE_DEVICES``).

The program runs as ``__main__`` with ``sys.argv = [program, *args]``. It sets
``GRPC_FAIL_FAST=use_caller`` (errors from a lost peer surface instead of being retried
forever) and ``TF_USE_LEGACY_KERAS=1`` (``tf.keras`` is tf-keras 2, whose ``Model.fit`` works
under both strategies; Keras 3 does not) before TensorFlow is imported.

Exit codes, which the job backends act on:

============  ================================================================================
``0``         success (``EXIT_OK``)
``1``         the program raised an exception; its traceback is on stderr (``EXIT_PROGRAM``)
``2``         bad configuration: ``TF_CONFIG`` missing or invalid, unknown strategy or task
              type, program file missing; one line on stderr, no traceback (``EXIT_CONFIG``)
``75``        the cluster was lost: a ps or a peer went away, or did not come up within
              ``GPULAB_CLUSTER_TIMEOUT`` seconds (``EXIT_INFRA``; EX_TEMPFAIL): restart and
              resume from the last checkpoint
``-15/143``   stopped by SIGTERM (the default action is kept: the replica ends at once)
other         what the program passed to ``sys.exit``
============  ================================================================================

The exit code is read from the way the program ended (its exception's TensorFlow error type
or message, see `is_infra_error`), without importing TensorFlow. Every code but a signal's is
also written to ``$GPULAB_JOB_DIR/logs/<role>-<index>.exit`` as the replica ends (a stale one
is removed as it starts), for a job service that re-adopted the replica after a restart of its
own and so cannot wait for it.

Helpers for the program (``from gpulab.extensions import runtime``): `strategy`, `logdir`,
`checkpoint_dir`, `writable_dir`, `is_chief`, `task`, `report`. Outside a gpulab job (no
``TF_CONFIG``) they describe a single process, so a script can be tried in a notebook first:
the default strategy, and ``tensorboard/`` and ``checkpoints/`` under the current folder.

Importing this module does not import TensorFlow; only `strategy` does, and a ps or worker of
a parameter-server job (which runs no program). Importing it sets ``TF_USE_LEGACY_KERAS=1`` and
``GRPC_FAIL_FAST=use_caller`` unless they are set already, so import it before TensorFlow is
first used.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

# the exit codes (0 done; 1 the program raised, traceback on stderr; 2 bad configuration:
# TF_CONFIG, GPULAB_STRATEGY, task type or program file, one line and no traceback; 75 the
# cluster was lost: restart, resume from the last checkpoint), the strategies, the roles and
# the progress line are the job contract's, shared with the hub
from .contract import (  # noqa: E402
    CLUSTER,
    JOB,
    KINDS,
    EXIT_CONFIG,
    EXIT_INFRA,
    EXIT_OK,
    EXIT_PROGRAM,
    PROGRESS_PREFIX,
    ROLES,
    STRATEGIES,
    parse_progress_line,
)
#: seconds the coordinator waits for every ps and worker to accept connections
DEFAULT_CLUSTER_TIMEOUT = 300.0

#: environment set before TensorFlow is imported
TF_ENVIRONMENT = {"GRPC_FAIL_FAST": "use_caller", "TF_USE_LEGACY_KERAS": "1"}

#: TensorFlow error types that mean a peer went away
INFRA_ERROR_TYPES = frozenset({"UnavailableError", "AbortedError", "PSUnavailableError"})
#: phrases in other TensorFlow errors that mean a peer went away or was replaced
INFRA_ERROR_PHRASES = (
    "socket closed",
    "connection reset by peer",
    "connection refused",
    "failed to connect to all addresses",
    "stream removed",
    "unable to find a context_id",
    "unable to find the relevant tensor remote_handle",
    "cluster check alive failed",
    "primary device is not remote",
)


class ConfigError(Exception):
    """A replica's configuration is unusable; the message is one line for the person."""


@dataclass(frozen=True)
class ReplicaConfig:
    """What this process is in its job, parsed from the environment (see `config_from_env`)."""

    strategy: str | None  # None: not in a gpulab job (a single process)
    task_type: str = "chief"
    task_index: int = 0
    cluster: dict[str, list[str]] = field(default_factory=dict)
    job_name: str | None = None
    job_dir: str | None = None
    #: ``job`` or ``cluster`` (``GPULAB_KIND``): a cluster's replicas only serve
    kind: str = JOB

    @property
    def in_job(self) -> bool:
        return self.strategy is not None

    @property
    def is_chief(self) -> bool:
        if not self.in_job:
            return True
        if self.task_type == "chief":
            return True
        # multi-worker-mirrored without a chief: worker 0 is the chief
        return (self.strategy == "multi-worker-mirrored" and "chief" not in self.cluster
                and self.task_type == "worker" and self.task_index == 0)

    @property
    def runs_program(self) -> bool:
        """Whether this replica runs the program (ps and workers of parameter-server serve,
        and every replica of a cluster)."""
        if self.kind == CLUSTER:
            return False
        return not (self.strategy == "parameter-server" and self.task_type in ("ps", "worker"))

    @property
    def name(self) -> str:
        return f"{self.task_type}-{self.task_index}"


# -- configuration (pure) ---------------------------------------------------------------------


def parse_tf_config(raw: str | None) -> tuple[dict[str, list[str]], str, int]:
    """Validate a ``TF_CONFIG`` value; return ``(cluster, task_type, task_index)``.

    Raises `ConfigError` with a one-line message naming what is wrong.
    """
    if raw is None or not raw.strip():
        raise ConfigError("TF_CONFIG is not set; this entry point runs one replica of a gpulab "
                          "job (to try the program alone, run it with python directly)")
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise ConfigError(f"TF_CONFIG is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ConfigError("TF_CONFIG must be a JSON object with 'cluster' and 'task'")
    cluster, task = value.get("cluster"), value.get("task")
    if not isinstance(cluster, dict) or not cluster:
        raise ConfigError("TF_CONFIG 'cluster' must be an object mapping roles to address lists")
    for role, addresses in cluster.items():
        if role not in ROLES or role == "evaluator":
            raise ConfigError(f"TF_CONFIG cluster has an unknown role '{role}'; roles are "
                              "chief, ps and worker")
        if (not isinstance(addresses, list) or not addresses
                or not all(isinstance(a, str) and _is_address(a) for a in addresses)):
            raise ConfigError(f"TF_CONFIG cluster '{role}' must be a non-empty list of "
                              "'host:port' addresses")
    if not isinstance(task, dict):
        raise ConfigError("TF_CONFIG 'task' must be an object with 'type' and 'index'")
    task_type, task_index = task.get("type"), task.get("index", 0)
    if task_type not in ROLES:
        raise ConfigError(f"TF_CONFIG task type {task_type!r} is unknown; it must be one of "
                          f"{', '.join(ROLES)}")
    if isinstance(task_index, bool) or not isinstance(task_index, int) or task_index < 0:
        raise ConfigError(f"TF_CONFIG task index {task_index!r} must be an integer >= 0")
    if task_type != "evaluator":
        n = len(cluster.get(task_type, []))
        if task_index >= n:
            raise ConfigError(f"TF_CONFIG task {task_type}-{task_index} is not in the cluster "
                              f"(it has {n} {task_type} address(es))")
    return cluster, task_type, task_index


def validate_cluster(strategy: str, cluster: dict[str, list[str]], task_type: str,
                     kind: str = JOB) -> None:
    """Check that the cluster's roles fit the strategy (and the kind: a held cluster is ps
    and workers only); raise `ConfigError` if not."""
    if strategy not in STRATEGIES:
        raise ConfigError(f"GPULAB_STRATEGY {strategy!r} is unknown; it must be one of "
                          f"{', '.join(STRATEGIES)}")
    if kind not in KINDS:
        raise ConfigError(f"GPULAB_KIND {kind!r} is unknown; it must be one of "
                          f"{', '.join(KINDS)}")
    if kind == CLUSTER:
        if strategy != "parameter-server":
            raise ConfigError("a cluster (GPULAB_KIND=cluster) is parameter-server")
        if set(cluster) - {"ps", "worker"} or task_type not in ("ps", "worker"):
            raise ConfigError("a cluster (GPULAB_KIND=cluster) has only ps and worker tasks: "
                              "the notebook kernel that holds it is the coordinator")
        for role in ("ps", "worker"):
            if not cluster.get(role):
                raise ConfigError(f"a cluster needs at least one {role} in TF_CONFIG's cluster")
        return
    if strategy == "parameter-server":
        if len(cluster.get("chief", [])) != 1:
            raise ConfigError("parameter-server needs exactly one chief (the coordinator) in "
                              "TF_CONFIG's cluster")
        for role in ("ps", "worker"):
            if not cluster.get(role):
                raise ConfigError(f"parameter-server needs at least one {role} in TF_CONFIG's "
                                  "cluster")
    else:
        if "ps" in cluster or task_type == "ps":
            raise ConfigError("multi-worker-mirrored has no ps tasks; use workers (and "
                              "optionally one chief)")
        if not cluster.get("worker") and not cluster.get("chief"):
            raise ConfigError("multi-worker-mirrored needs at least one worker in TF_CONFIG's "
                              "cluster")
        if len(cluster.get("chief", [])) > 1:
            raise ConfigError("TF_CONFIG's cluster may name at most one chief")


def config_from_env(env) -> ReplicaConfig:
    """This replica's configuration from a mapping like ``os.environ``.

    Without ``TF_CONFIG`` (and ``GPULAB_STRATEGY``) the process is not in a gpulab job: a
    single process that is its own chief. With ``TF_CONFIG`` but no ``GPULAB_STRATEGY`` (a
    cluster launched by other means), a cluster with ps tasks is parameter-server, any other
    multi-worker-mirrored. Raises `ConfigError` on an invalid configuration.
    """
    raw, strategy = env.get("TF_CONFIG"), env.get("GPULAB_STRATEGY")
    job_name, job_dir = env.get("GPULAB_JOB_NAME") or None, env.get("GPULAB_JOB_DIR") or None
    kind = env.get("GPULAB_KIND") or JOB
    if not (raw or "").strip() and not strategy:
        return ReplicaConfig(strategy=None, job_name=job_name, job_dir=job_dir)
    cluster, task_type, task_index = parse_tf_config(raw)
    if not strategy:  # a TF_CONFIG made elsewhere: ps tasks mean parameter-server
        strategy = "parameter-server" if "ps" in cluster else "multi-worker-mirrored"
    validate_cluster(strategy, cluster, task_type, kind)
    return ReplicaConfig(strategy=strategy, task_type=task_type, task_index=task_index,
                         cluster=cluster, job_name=job_name, job_dir=job_dir, kind=kind)


def _is_address(a: str) -> bool:
    host, sep, port = a.rpartition(":")
    return bool(host and sep and port.isdigit() and 0 < int(port) < 65536)


# -- paths (pure) -------------------------------------------------------------------------------


def job_dir_of(cfg: ReplicaConfig, cwd: str | None = None) -> Path:
    """The job folder (``GPULAB_JOB_DIR``), or the current folder outside a job."""
    return Path(cfg.job_dir or cwd or os.getcwd()).absolute()


def logdir_of(cfg: ReplicaConfig, cwd: str | None = None) -> Path:
    return job_dir_of(cfg, cwd) / "tensorboard"


def checkpoint_dir_of(cfg: ReplicaConfig, cwd: str | None = None) -> Path:
    return job_dir_of(cfg, cwd) / "checkpoints"


def exit_file_of(cfg: ReplicaConfig) -> Path | None:
    """``$GPULAB_JOB_DIR/logs/<role>-<index>.exit``: where a replica leaves its exit code for a
    job service that did not start it (one re-adopted after a restart); None outside a job."""
    if not cfg.in_job or not cfg.job_dir:
        return None
    return Path(cfg.job_dir) / "logs" / f"{cfg.name}.exit"


def writable_dir_of(cfg: ReplicaConfig, path: str | os.PathLike, tmp: str | None = None) -> Path:
    """`path` on the chief; a throw-away per-task folder for the other replicas.

    As the TensorFlow multi-worker guide advises: every MultiWorkerMirroredStrategy worker must
    take part in saving (the variables are synchronised), but only the chief's files are kept.
    """
    path = Path(path)
    if cfg.is_chief:
        return path
    job = cfg.job_name or "job"
    return Path(tmp or tempfile.gettempdir()) / f"gpulab-{job}-{cfg.name}-{os.getpid()}" / path.name


# -- exit codes (pure) ------------------------------------------------------------------------


def _chain(exc: BaseException):
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        yield from (e for e in (getattr(exc, "original_exception", None),) if e is not None)
        exc = exc.__cause__ or exc.__context__


def is_infra_error(exc: BaseException) -> bool:
    """Whether an exception (or one it was raised from) means a peer of the cluster went away.

    By TensorFlow's error types (``UnavailableError``, ``AbortedError`` and the coordinator's
    ``PSUnavailableError``, subclasses included), and for other TensorFlow errors by phrases of
    lost or replaced peers ("Socket closed", "Unable to find a context_id", ...). A user's own
    error (ValueError, InvalidArgumentError from a bad shape, ...) is not.
    """
    for e in _chain(exc):
        names = {k.__name__ for k in type(e).__mro__}
        if names & INFRA_ERROR_TYPES:
            return True
        if type(e).__module__.startswith("tensorflow") and "OpError" in names:
            text = str(e).lower()
            if any(p in text for p in INFRA_ERROR_PHRASES):
                return True
    return False


def exit_code_for(exc: BaseException | None) -> int:
    """The exit code for the way the program ended: None (it returned), or its exception."""
    if exc is None:
        return EXIT_OK
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return EXIT_OK
        return code if isinstance(code, int) else EXIT_PROGRAM
    if isinstance(exc, KeyboardInterrupt):
        return 130
    return EXIT_INFRA if is_infra_error(exc) else EXIT_PROGRAM


# -- progress lines (pure) --------------------------------------------------------------------


def _metric(v):
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int):
        return v
    try:
        f = float(v)
    except (TypeError, ValueError):
        return str(v)
    if not math.isfinite(f):
        return None
    if f.is_integer() and hasattr(v, "dtype") and "int" in str(v.dtype):
        return int(f)
    return float(f"{f:.6g}")


def progress_line(step: int, total: int | None = None, **metrics) -> str:
    """``GPULAB_PROGRESS {"step": 120, "total": 600, "loss": 0.31}`` (one line, JSON).

    Metrics are converted to plain numbers (numpy and TensorFlow scalars included; 6
    significant digits; NaN and infinities become null).
    """
    step = int(step)
    if step < 0:
        raise ValueError(f"step must be >= 0, not {step}")
    record = {"step": step}
    if total is not None:
        record["total"] = int(total)
    for key, value in metrics.items():
        if key in ("step", "total", "time"):
            raise ValueError(f"'{key}' is reserved in a progress line")
        record[key] = _metric(value)
    record["time"] = round(time.time(), 3)
    return PROGRESS_PREFIX + json.dumps(record, separators=(", ", ": "))


# -- helpers for the program ------------------------------------------------------------------

_strategy = None


def _config() -> ReplicaConfig:
    try:
        return config_from_env(os.environ)
    except ConfigError as e:
        raise RuntimeError(f"gpulab runtime: {e}") from None


def configure_environment(env=None, force: bool = False) -> None:
    """Set `TF_ENVIRONMENT` in `env` (``os.environ``): only where unset unless `force`."""
    env = os.environ if env is None else env
    for key, value in TF_ENVIRONMENT.items():
        if force:
            env[key] = value
        else:
            env.setdefault(key, value)


def strategy():
    """The ready ``tf.distribute`` strategy of this replica (the same object on every call).

    ParameterServerStrategy on a parameter-server chief, MultiWorkerMirroredStrategy on a
    multi-worker-mirrored worker, TensorFlow's default strategy on an evaluator or outside a
    gpulab job. Build and compile the model inside ``with strategy().scope():``.

    It is made on the first call, not before the program: do TensorFlow's set-up (logical
    devices, memory growth, visible devices, threads, mixed precision, XLA) first, then call
    it before any other TensorFlow operation (TensorFlow configures a MultiWorkerMirroredStrategy's
    coordination service only in a process that has run no operation yet).
    """
    global _strategy
    if _strategy is None:
        cfg = _config()
        _strategy = _make_strategy(cfg)
        if cfg.in_job:
            _say(f"{cfg.name} made {type(_strategy).__name__} for runtime.strategy()")
    return _strategy


def logdir() -> str:
    """The job's TensorBoard folder, ``$GPULAB_JOB_DIR/tensorboard`` (created).

    The same folder on every replica: give it to ``tf.keras.callbacks.TensorBoard``, which
    keeps the summaries of replicas other than the chief apart (and deletes them) itself. A
    custom loop writing ``tf.summary`` should write to ``writable_dir(logdir())``. Outside a
    job: ``./tensorboard``.
    """
    return _made(logdir_of(_config()))


def checkpoint_dir() -> str:
    """The job's checkpoint folder, ``$GPULAB_JOB_DIR/checkpoints`` (created).

    The same folder on every replica, so that every replica restores the chief's checkpoint:
    give it to ``tf.keras.callbacks.BackupAndRestore`` (which writes the chief's checkpoints
    under ``chief/`` and the others' into temporary folders itself). A custom loop saving with
    ``tf.train.CheckpointManager`` should save to ``writable_dir(checkpoint_dir())`` and restore
    from ``checkpoint_dir()``. Outside a job: ``./checkpoints``.
    """
    return _made(checkpoint_dir_of(_config()))


def writable_dir(path) -> str:
    """`path` on the chief; a throw-away folder of this task on the others (created)."""
    return _made(writable_dir_of(_config(), path))


def is_chief() -> bool:
    """Whether this replica is the chief: the parameter-server coordinator, the
    multi-worker-mirrored chief (worker 0 when there is none), or a process outside a job."""
    return _config().is_chief


def task() -> tuple[str, int]:
    """``(task type, index)`` of this replica, e.g. ``("worker", 1)``; ``("chief", 0)`` outside
    a job."""
    cfg = _config()
    return cfg.task_type, cfg.task_index


def report(step: int, total: int | None = None, **metrics) -> None:
    """Print one progress line to stdout for the job view, e.g.
    ``GPULAB_PROGRESS {"step": 120, "total": 600, "loss": 0.31, "time": 1767000000.0}``.

    `step` counts training steps (or epochs) done, `total` is how many there will be; the
    metrics are numbers. Every replica that calls it prints; the job view reads the chief's log
    (worker 0's under multi-worker-mirrored).
    """
    print(progress_line(step, total, **metrics), flush=True)


def _made(path: Path) -> str:
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


# -- the replica ------------------------------------------------------------------------------


def wait_for_cluster(addresses: dict[str, str], timeout: float, log=None) -> list[str]:
    """Wait until every ``name -> host:port`` accepts TCP connections; return the names that
    did not within `timeout` seconds."""
    deadline = time.monotonic() + timeout
    waiting = dict(addresses)
    announced = False
    while waiting:
        for name, address in list(waiting.items()):
            host, _, port = address.rpartition(":")
            try:
                with socket.create_connection((host, int(port)), timeout=1):
                    del waiting[name]
            except OSError:
                pass
        if not waiting or time.monotonic() >= deadline:
            break
        if not announced and log:
            log(f"waiting for {', '.join(sorted(waiting))} to come up")
            announced = True
        time.sleep(0.25)
    return sorted(waiting)


def _make_strategy(cfg: ReplicaConfig):
    configure_environment()
    import tensorflow as tf

    if not cfg.in_job or cfg.task_type == "evaluator":
        return tf.distribute.get_strategy()
    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    if cfg.strategy == "parameter-server":
        if cfg.task_type != "chief":
            raise RuntimeError(f"gpulab runtime: a parameter-server {cfg.task_type} serves "
                               "and does not run the program")
        return tf.distribute.ParameterServerStrategy(resolver)
    if _tensorflow_ran():
        _say("runtime.strategy() was first called after the program's first TensorFlow "
             "operation; call it earlier (after tf.config set-up, before any tensor or "
             "dataset is made), as TensorFlow wants for MultiWorkerMirroredStrategy")
    return tf.distribute.MultiWorkerMirroredStrategy(cluster_resolver=resolver)


def _tensorflow_ran() -> bool:
    """Whether TensorFlow's eager context is initialised (an operation has run), best effort."""
    try:
        from tensorflow.python.eager import context
    except ImportError:
        return False
    return getattr(context.context(), "_context_handle", None) is not None


def _say(message: str) -> None:
    print(f"gpulab runtime: {message}", file=sys.stderr, flush=True)


def _serve(cfg: ReplicaConfig) -> int:
    import tensorflow as tf

    resolver = tf.distribute.cluster_resolver.TFConfigClusterResolver()
    server = tf.distribute.Server(resolver.cluster_spec(), job_name=cfg.task_type,
                                  task_index=cfg.task_index, protocol="grpc", start=True)
    _say(f"{cfg.name} serving at {cfg.cluster[cfg.task_type][cfg.task_index]}")
    server.join()  # until the replica is stopped
    return EXIT_OK


def _run_program(cfg: ReplicaConfig, program: str, args: list[str]) -> int:
    """Run the program as ``__main__``; the exit code from the way it ended.

    Nothing here touches TensorFlow: the program is the first to (see the module's doc).
    """
    import runpy
    import traceback

    try:
        if cfg.strategy == "parameter-server" and cfg.task_type == "chief":
            peers = {f"{role}-{i}": a for role in ("ps", "worker")
                     for i, a in enumerate(cfg.cluster[role])}
            timeout = float(os.environ.get("GPULAB_CLUSTER_TIMEOUT") or DEFAULT_CLUSTER_TIMEOUT)
            missing = wait_for_cluster(peers, timeout, _say)
            if missing:
                _say(f"{', '.join(missing)} did not come up within {timeout:g} s; "
                     f"exit {EXIT_INFRA} (cluster lost)")
                return EXIT_INFRA
        _say(f"{cfg.name} running {program}{_device_note(os.environ)}")
        sys.argv = [program, *args]
        sys.path.insert(0, str(Path(program).resolve().parent))
        runpy.run_path(program, run_name="__main__")
    except BaseException as e:  # noqa: BLE001 - the exit code is the classification
        code = exit_code_for(e)
        if isinstance(e, SystemExit):
            if not isinstance(e.code, (int, type(None))):
                print(e.code, file=sys.stderr, flush=True)
            return code
        traceback.print_exc()
        if code == EXIT_INFRA:
            _say(f"the cluster was lost ({type(e).__name__}); exit {EXIT_INFRA}: restart the "
                 "job's replicas and resume from the last checkpoint")
        else:
            _say(f"the program raised {type(e).__name__}; exit {code}")
        return code
    return EXIT_OK


def _device_note(env) -> str:
    """A word on the replica's GPUs where they are simulated: TensorFlow is told to use the CPU
    (``TF_ENABLED_DEVICE_TYPES=CPU``, set by the local job backend; see
    `gpulab.hub.jobs.local.replica_env`)."""
    visible = env.get("CUDA_VISIBLE_DEVICES") or ""
    if env.get("TF_ENABLED_DEVICE_TYPES", "").strip().upper() == "CPU" and visible:
        return (f" (GPU {visible} simulated: no CUDA here, TensorFlow uses the CPU)"
                if "," not in visible else
                f" (GPUs {visible} simulated: no CUDA here, TensorFlow uses the CPU)")
    return ""


def _record_exit(cfg: ReplicaConfig | None, code: int | None) -> None:
    """Leave `code` in the replica's exit file (None: remove a stale one). Best effort."""
    path = exit_file_of(cfg) if cfg is not None else None
    if path is None or not path.parent.is_dir():  # no logs/: not started by a job backend
        return
    try:
        if code is None:
            path.unlink(missing_ok=True)
        else:
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            tmp.write_text(f"{code}\n")
            os.replace(tmp, path)
    except OSError as e:
        _say(f"could not write {path}: {e}")


def main(argv: list[str] | None = None) -> int:
    """Run this replica: ``main([program, *args])``; returns the exit code.

    Every code it returns is also left in ``$GPULAB_JOB_DIR/logs/<role>-<index>.exit`` (see
    `exit_file_of`); a replica ended by a signal leaves none.
    """
    argv = sys.argv[1:] if argv is None else argv
    cfg = None
    try:
        held = os.environ.get("GPULAB_KIND") == CLUSTER  # serves only: no program
        if not held and (not argv or argv[0].startswith("-")):
            raise ConfigError("usage: python -m gpulab.extensions.runtime <program.py> [args...]")
        program, args = (argv[0], list(argv[1:])) if argv else ("", [])
        cfg = config_from_env(os.environ)
        if not cfg.in_job:
            parse_tf_config(os.environ.get("TF_CONFIG"))  # raises: TF_CONFIG is not set
        _record_exit(cfg, None)  # a restarted replica: the last run's code no longer holds
        if cfg.runs_program and not Path(program).is_file():
            raise ConfigError(f"the program {program} does not exist (working directory "
                              f"{os.getcwd()})")
    except ConfigError as e:
        _say(f"bad configuration: {e}")
        _record_exit(cfg, EXIT_CONFIG)
        return EXIT_CONFIG
    configure_environment(force=True)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # stop means stop, even inside server.join()
    if cfg.runs_program:
        code = _run_program(cfg, program, args)
    else:
        try:
            code = _serve(cfg)
        except Exception as e:  # noqa: BLE001 - e.g. the port is taken
            import traceback

            traceback.print_exc()
            code = EXIT_INFRA if is_infra_error(e) else EXIT_PROGRAM
    _record_exit(cfg, code)
    return code


configure_environment()

if __name__ == "__main__":
    # run the functions of the importable module, so that the program's
    # ``from gpulab.extensions import runtime`` shares its state (the strategy, once made)
    from gpulab.extensions import runtime as _runtime

    sys.exit(_runtime.main())
