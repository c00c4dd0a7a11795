"""The counters of events, incremented where the events happen, for Prometheus.

What the ledger keeps (who holds which GPU, who waits, the jobs' states) is read at scrape
time by the gpulab service's collector (`gpulab.hub.service.metrics`); what it does not keep
is counted here as it happens: admissions (now, or into the queue), refusals by reason and
the jobs' outcomes. The counters live in `prometheus_client`'s default registry of the
process that counts: in the hub (notebook servers' admissions, counted by the spawner) that
is the registry JupyterHub's own ``/hub/metrics`` shows; in the gpulab service (training
jobs) its ``/services/gpulab/metrics`` shows them. Both endpoints name the series alike, so
a dashboard's ``sum by (kind, reason) (rate(gpulab_refusals_total[5m]))`` adds the two up.
"""

from __future__ import annotations

from prometheus_client import Counter

from gpulab.hub.quota.ledger import BadRequest, NotEnoughGPUs, QuotaExceeded

ADMISSIONS = Counter(
    "gpulab_admissions", "GPU work admitted: how='now' (GPUs at once) or 'queued' (it waits "
    "in the queue; its start is counted in gpulab_queue_wait_seconds)", ["kind", "how"])
REFUSALS = Counter(
    "gpulab_refusals", "GPU work refused, by reason (quota, no_free_gpus, line_ahead, "
    "never_fits, replica_bound, bad_request, refused)", ["kind", "reason"])
JOB_OUTCOMES = Counter(
    "gpulab_job_outcomes", "Training jobs that ended, by their final state", ["state"])

#: every counter of this module (the gpulab service registers them in its registry)
COUNTERS = (ADMISSIONS, REFUSALS, JOB_OUTCOMES)


def refusal_reason(e: BaseException) -> str:
    """The ``reason`` label of a refusal: a class may name its own (``metric_reason``)."""
    own = getattr(e, "metric_reason", None)
    if own:
        return own
    if isinstance(e, QuotaExceeded):
        return "quota"
    if isinstance(e, NotEnoughGPUs):
        return "no_free_gpus"
    if isinstance(e, BadRequest):
        return "bad_request"
    return "refused"


def admitted(kind: str, how: str = "now") -> None:
    ADMISSIONS.labels(kind=kind, how=how).inc()


def refused(kind: str, e: BaseException) -> None:
    REFUSALS.labels(kind=kind, reason=refusal_reason(e)).inc()


def job_ended(state: str) -> None:
    JOB_OUTCOMES.labels(state=state).inc()
