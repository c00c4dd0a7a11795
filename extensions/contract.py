"""The training-job contract, written once: what the hub (the jobs API, both job backends, the
CLI) and the notebook side (the client, the widgets, the magic, and the runtime every replica
runs) must agree on.

- the strategies and the roles of a job, and which replica leads (its log and progress are
  the job's);
- the states of a job: active ones, final ones;
- the runtime's exit codes, which decide whether a replica is restarted;
- the progress line a replica prints and the service reads;
- the job-name rule (a DNS-1035 label: it names Kubernetes objects too).

Standard library only: it is imported inside training replicas (before TensorFlow), in
notebook kernels and in the hub's processes alike.
"""

from __future__ import annotations

import json
import re

PARAMETER_SERVER = "parameter-server"
MULTI_WORKER = "multi-worker-mirrored"
STRATEGIES = (PARAMETER_SERVER, MULTI_WORKER)
#: what a spec asks for: a job runs the person's program on every replica; a cluster holds
#: parameter servers and workers for the notebook kernel that coordinates them (no chief)
JOB = "job"
CLUSTER = "cluster"
KINDS = (JOB, CLUSTER)
#: the roles in the order replicas are listed (and numbered within a role from 0)
ROLES = ("chief", "ps", "worker", "evaluator")

#: Queued: waiting in the GPU queue (no GPUs yet; ``view["queue"]`` says where it stands)
ACTIVE = ("Queued", "Admitted", "Starting", "Running")
FINAL = ("Succeeded", "Failed", "Stopped")
STATES = ACTIVE + FINAL

#: the runtime's exit codes (`gpulab.extensions.runtime`): done; the program raised (a restart
#: would raise again: the job fails at once); a bad configuration (likewise); the cluster was
#: lost, a ps or peer went away (EX_TEMPFAIL: restart and resume from the checkpoint)
EXIT_OK = 0
EXIT_PROGRAM = 1
EXIT_CONFIG = 2
EXIT_INFRA = 75
#: the exits that no restart can mend
EXIT_NOT_RETRIED = (EXIT_PROGRAM, EXIT_CONFIG)

#: a replica's progress, one line of JSON after this prefix (``runtime.report``)
PROGRESS_PREFIX = "GPULAB_PROGRESS "

NAME_RE = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


def lead_replica(strategy: str) -> str:
    """The replica whose log and progress are the job's: the chief under parameter-server
    (it runs the program), worker 0 under multi-worker (it acts as chief)."""
    return "chief-0" if strategy == PARAMETER_SERVER else "worker-0"


def is_final(state: str | None) -> bool:
    return state in FINAL


def parse_progress_line(line: str) -> dict | None:
    """The record of a progress line (``GPULAB_PROGRESS {"step": 120, …}``), or None when the
    line is something else or malformed (a program may print anything)."""
    line = line.strip()
    if not line.startswith(PROGRESS_PREFIX):
        return None
    try:
        value = json.loads(line[len(PROGRESS_PREFIX):])
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("step"), int):
        return None
    return value


def last_progress(log_text: str) -> dict | None:
    """The last well-formed progress record of a log, or None."""
    for line in reversed(log_text.splitlines()):
        record = parse_progress_line(line)
        if record is not None:
            return record
    return None
