"""The rules that decide a training job's fate, as pure functions (no I/O, no clock): what
a replica's exit means, when a job has succeeded or failed, which replicas are restarted, and
the error a failed job reports. Each driver observes its replicas its own way (child
processes and ``.exit`` files locally, role Jobs and pods on Kubernetes) and asks these
functions what follows; ``tests/unit/test_job_rules.py`` states them as tables.

The two drivers differ where their platforms do, and only there:

- **local** (`decide_local`): gpulab restarts replicas itself. Parameter-server: a worker or
  ps that dies is restarted while retries last (each replica restarted is one retry), a chief
  that lost its cluster (`EXIT_INFRA`) too; the chief's own error fails the job.
  Multi-worker: all workers restart together (one retry per round) unless one raised.
  A held cluster (kind ``cluster``, issue 38; `decide_cluster`): a lost worker is restarted
  while retries last (TensorFlow's ``ClusterCoordinator`` carries on without it meanwhile and
  uses it again once it is back), and without retries the cluster goes on with the workers
  it has until none is left; a lost ps ends the cluster as Failed with what to do (the
  variables it held are gone: restore from the checkpoint in a new cluster).
- **kubernetes** (`decide_kube`): the Job controller restarts pods (``backoffLimit`` is the
  spec's ``retries``; the pod failure policy fails the program's own errors at once); gpulab
  reads the role Jobs' conditions.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Protocol

from gpulab.extensions.contract import (
    CLUSTER,
    JOB,
    EXIT_INFRA,
    EXIT_NOT_RETRIED,
    PARAMETER_SERVER,
    PROGRESS_PREFIX,
    lead_replica,
)

#: a replica adopted after a service restart that is gone: its exit code cannot be known
EXIT_UNKNOWN = -1000
#: exit codes of the runtime that mean the program itself failed (1: it raised, 2: bad
#: configuration), which no restart mends: the job fails at once
PROGRAM_ERRORS = EXIT_NOT_RETRIED

Key = tuple[str, int]


class ReplicaFacts(Protocol):
    """What the rules read of a replica (a ``ReplicaRow`` or a `Replica`)."""

    role: str
    index: int
    state: str
    exit_code: int | None
    restarts: int
    reason: str


@dataclass
class Replica:
    """A replica as the rules see it (for callers without a row, and the tables' tests)."""

    role: str
    index: int
    state: str = "Running"
    exit_code: int | None = None
    restarts: int = 0
    reason: str = ""


@dataclass(frozen=True)
class Decision:
    """What follows a pass: the job's ``outcome`` (state, reason) if it ends, the replicas to
    ``restart`` otherwise, and ``blame``: the replica whose log holds the error that fails
    the job (its `error_summary` is added to the reason)."""

    outcome: tuple[str, str] | None = None
    restart: frozenset[Key] = field(default_factory=frozenset)
    blame: str | None = None


def names(keys) -> str:
    return ", ".join(f"{role}-{index}" for role, index in sorted(keys))


def past_max_runtime(*, started: float, max_runtime: int | None, now: float) -> bool:
    return bool(max_runtime) and now > started + max_runtime


def decide_local(strategy: str, replicas: Mapping[Key, ReplicaFacts], *, retries: int,
                 started: float, max_runtime: int | None, now: float,
                 kind: str = JOB) -> Decision:
    """The local driver's rules, over replicas whose exits are already recorded (``state``
    Running, Succeeded or Failed with ``exit_code``); ``kind`` ``cluster``: `decide_cluster`."""
    if kind == CLUSTER:
        decision = decide_cluster(replicas, retries)
    elif strategy == PARAMETER_SERVER:
        decision = _parameter_server(replicas, retries)
    else:
        decision = _multi_worker(replicas, retries)
    if decision.outcome is None and past_max_runtime(started=started, max_runtime=max_runtime,
                                                     now=now):
        return Decision(outcome=("Failed", f"stopped after max_runtime ({max_runtime} s)"))
    return decision


#: what a person does when a parameter server of their cluster is lost (the cell says it)
PS_LOST_ADVICE = ("The variables it held are gone, so the cluster cannot go on: hold a new "
                  "cluster (gpulab.cluster(...)), build the model under its strategy and "
                  "restore it from your last checkpoint (tf.train.Checkpoint(...).restore("
                  "tf.train.latest_checkpoint(folder))), then train on.")


def decide_cluster(by: Mapping[Key, ReplicaFacts], retries: int) -> Decision:
    """A held cluster's rules: it never succeeds (it ends when stopped); a lost ps fails it
    (`PS_LOST_ADVICE`); a lost worker is restarted while retries last (each restart one);
    without retries it goes on with the workers left, and fails when none is."""
    lost_ps = sorted(k for k, r in by.items() if k[0] == "ps" and r.state != "Running")
    if lost_ps:
        role, index = lost_ps[0]
        why = by[lost_ps[0]].reason or "exited"
        return Decision(outcome=("Failed", f"{role}-{index} was lost ({why}). "
                                 + PS_LOST_ADVICE), blame=f"{role}-{index}")
    lost = {k for k, r in by.items() if k[0] == "worker" and r.state != "Running"}
    if not lost:
        return Decision()
    budget = retries - sum(r.restarts for r in by.values())
    if budget > 0:  # as many as the retries left allow, lowest first
        return Decision(restart=frozenset(sorted(lost)[:budget]))
    if all(r.state != "Running" for k, r in by.items() if k[0] == "worker"):
        return Decision(outcome=("Failed", f"every worker was lost and the {retries} restarts "
                                 f"are used up (last: {names(lost)})"))
    return Decision()  # the coordinator trains on with the workers left


def _parameter_server(by: Mapping[Key, ReplicaFacts], retries: int) -> Decision:
    # each replica restarted is a retry (they fail and restart one by one)
    can_retry = sum(r.restarts for r in by.values()) < retries
    chief = by[("chief", 0)]
    dead_ps = [k for k, r in by.items() if k[0] == "ps" and r.state != "Running"]
    if chief.state == "Succeeded":
        return Decision(outcome=("Succeeded", "the chief finished"))
    if chief.state == "Failed" and chief.exit_code != EXIT_INFRA and not dead_ps:
        return Decision(outcome=("Failed", f"the chief failed: {chief.reason}; see its log "
                                 "(logs/chief-0.log)"), blame="chief-0")
    wanted = set(dead_ps)
    if chief.state == "Failed":
        wanted.add(("chief", 0))
    wanted |= {k for k, r in by.items() if k[0] == "worker" and r.state == "Failed"}
    if not wanted:
        return Decision()
    if can_retry:
        return Decision(restart=frozenset(wanted))
    if dead_ps or chief.state == "Failed" or all(
            r.state == "Failed" for k, r in by.items() if k[0] == "worker"):
        return Decision(outcome=("Failed", f"out of retries ({retries}) after "
                                 f"{names(wanted)} failed"))
    # with workers left the coordinator trains on without the dead
    return Decision()


def _multi_worker(by: Mapping[Key, ReplicaFacts], retries: int) -> Decision:
    workers = [r for k, r in sorted(by.items()) if k[0] == "worker"]
    # all workers restart together: one restart of them all is one retry
    rounds = max((r.restarts for r in workers), default=0)
    failed = [r for r in workers if r.state == "Failed"]
    raised = [r for r in failed if r.exit_code in PROGRAM_ERRORS]
    if all(r.state == "Succeeded" for r in workers):
        return Decision(outcome=("Succeeded", "all workers finished"))
    if raised:  # the program's own error: running it again would raise again
        r = raised[0]
        return Decision(outcome=("Failed", f"worker-{r.index} failed: {r.reason}; see its "
                                 f"log (logs/worker-{r.index}.log)"), blame=f"worker-{r.index}")
    if not failed:
        return Decision()
    if rounds < retries:  # killed, or lost its peers: the workers restart together
        return Decision(restart=frozenset((r.role, r.index) for r in workers))
    return Decision(outcome=("Failed", f"{', '.join(f'worker-{r.index}' for r in failed)} "
                             f"failed ({failed[0].reason}) after {rounds} restart"
                             f"{'s' if rounds != 1 else ''} of the workers (retries: {retries})"))


@dataclass(frozen=True)
class RoleJob:
    """A role's Kubernetes Job as the rules see it: ``finished`` is None, "Complete" or
    "Failed"; ``failed_reason`` the reason of its Failed condition (``DeadlineExceeded``,
    ``PodFailurePolicy``, ``BackoffLimitExceeded``)."""

    finished: str | None = None
    failed_reason: str = ""


def decide_kube(strategy: str, job: str, roles: Mapping[str, RoleJob | None],
                replicas: Mapping[Key, tuple[str, str]], *, retries: int,
                max_runtime: int | None) -> tuple[str, str] | None:
    """The Kubernetes driver's outcome (state, reason) from the role Jobs' conditions, or None
    while the job goes on. ``replicas``: (state, reason) of each replica's newest pod, as
    `gpulab.hub.jobs.kube.pod_words` says it (a pod being replaced reads "restarting after: …")."""
    def failures(role: str) -> list[tuple[str, str]]:
        return [(f"{r}-{i}", why.removeprefix("restarting after: "))
                for (r, i), (st, why) in sorted(replicas.items())
                if r == role and (st == "Failed" or "after:" in why)]

    for role, obj in roles.items():
        if obj is None or obj.finished != "Failed":
            continue
        if obj.failed_reason == "DeadlineExceeded":
            return ("Failed", f"stopped after max_runtime ({max_runtime} s)")
        failed = failures(role)
        if obj.failed_reason == "PodFailurePolicy":  # not worth a retry
            who, why = failed[0] if failed else (f"{role}-0", "failed")
            return ("Failed", f"{who} failed: {why}; this is not retried "
                    f"(see its log: gpulab jobs logs {job} {who})")
        return ("Failed", f"the {role} replicas failed and the {retries} retries are used up"
                + (f" ({failed[-1][0]}: {failed[-1][1]})" if failed else ""))
    lead = lead_replica(strategy).rsplit("-", 1)[0]
    if roles.get(lead) is not None and roles[lead].finished == "Complete":
        return ("Succeeded", "the chief finished" if lead == "chief" else "all workers finished")
    return None


def exit_words(code: int | None) -> str:
    """A replica's exit in words for people."""
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
