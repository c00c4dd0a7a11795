"""The gpulab service's Prometheus series (`gpulab.hub.service.metrics`) from a real SQLite
ledger: what each series says about the pool, the queue, people, jobs and budgets, parsed
back with prometheus_client's own parser. The endpoint behind the hub's authentication, and
a real Prometheus scraping it, are tests/app/test_metrics_prometheus.py."""

from __future__ import annotations

import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from gpulab.hub.machine.gpuusage import PoolUsage
from gpulab.hub.quota import events
from gpulab.hub.quota.ledger import DeviceInfo, Ledger, QuotaExceeded, Request
from gpulab.hub.quota.policy import Quota
from gpulab.hub.quota.waiting import Queue, QueueRefused
from gpulab.hub.service.metrics import SERIES, held_gpu_usage, make_registry, read_snapshot
from prometheus_client import generate_latest

from tests.unit.test_gpuusage import FakeNVML


@pytest.fixture
def ledger(tmp_path):
    lg = Ledger(f"sqlite:///{tmp_path}/ledger.sqlite")
    lg.migrate()
    lg.sync_inventory([DeviceInfo(i, uuid=f"GPU-{i}", model="H100" if i < 3 else "A100")
                       for i in range(4)])
    lg.set_quota("default", "", Quota(4), actor="admin")
    return lg


def render(ledger, groups=None, usage=None) -> dict[str, list]:
    """``{series name: [(labels, value)]}`` of one scrape."""
    registry, collector = make_registry()
    snap = read_snapshot(ledger)
    collector.collect_from(snap, groups or {}, held_gpu_usage(usage, snap.allocations))
    out: dict[str, list] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def value(series, name, **labels):
    found = [v for lab, v in series.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
    assert len(found) == 1, (name, labels, series.get(name))
    return found[0]


def test_gpus_by_state_and_model_people_groups_and_the_queue(ledger):
    q = Queue(ledger)
    ledger.admit(Request("ann", "notebook", "default", 1, model="H100"))
    ledger.admit(Request("bob", "job", "train", 2, model="H100"))
    q.enqueue(Request("carl", "job", "big", 4), now=time.time() - 30)
    s = render(ledger, groups={"ann": ["vision"], "bob": ["vision", "nlp"]})
    assert value(s, "gpulab_gpus", state="held", model="H100") == 3
    assert value(s, "gpulab_gpus", state="free", model="H100") == 0
    assert value(s, "gpulab_gpus", state="free", model="A100") == 1
    assert value(s, "gpulab_gpus", state="draining", model="A100") == 0
    assert value(s, "gpulab_user_gpus_held", user="ann", kind="notebook") == 1
    assert value(s, "gpulab_user_gpus_held", user="bob", kind="job") == 2
    assert value(s, "gpulab_group_gpus_held", group="vision") == 3
    assert value(s, "gpulab_group_gpus_held", group="nlp") == 2
    assert value(s, "gpulab_queue_waiting", kind="job") == 1
    assert value(s, "gpulab_queue_waiting_gpus", kind="job") == 4
    assert value(s, "gpulab_queue_waiting", kind="notebook") == 0
    assert 29 <= value(s, "gpulab_queue_oldest_wait_seconds", kind="job") < 60
    # every device held is listed with its holder; simulated or unread: not measured
    assert {lab["holder"] for lab, _ in s["gpulab_gpu_held_info"]} == {"default", "train"}
    assert {lab["measured"] for lab, _ in s["gpulab_gpu_held_info"]} == {"false"}
    assert "gpulab_gpu_utilization_percent" not in s
    assert set(s) <= SERIES, set(s) - SERIES


def test_waits_of_work_that_started_through_the_queue_and_draining_gpus(ledger):
    q = Queue(ledger, borrowing=True)
    t0 = time.time() - 100
    ledger.admit(Request("ann", "job", "a", 4))
    q.enqueue(Request("bob", "job", "b", 2), now=t0)
    for a in ledger.open_allocations():
        ledger.release(a.id)
    q.schedule()  # bob's job starts after ~100 s in line
    s = render(ledger)
    assert value(s, "gpulab_queue_wait_seconds_count", kind="job") == 1
    assert value(s, "gpulab_queue_wait_seconds_bucket", kind="job", le="60.0") == 0
    assert value(s, "gpulab_queue_wait_seconds_bucket", kind="job", le="120.0") == 1
    assert 99 <= value(s, "gpulab_queue_wait_seconds_sum", kind="job") < 130
    assert value(s, "gpulab_queue_wait_seconds_count", kind="notebook") == 0
    # bob's entry being preempted: its GPUs are draining, not held
    entry = q.of_holder("bob", "job", "b")
    from gpulab.hub.quota.waiting import QueueEntryRow

    with ledger.Session.begin() as sess:
        sess.get(QueueEntryRow, entry.id).state = "preempting"
    s = render(ledger)
    assert value(s, "gpulab_gpus", state="draining", model="H100") == 2
    assert value(s, "gpulab_gpus", state="held", model="H100") == 0


def test_gpu_hours_against_budgets_without_a_query_per_person(ledger):
    ledger.set_quota("group", "students", Quota(2, gpu_hours=10, window_hours=24), "admin")
    ledger.set_quota("user", "carl", Quota(1, gpu_hours=5, window_hours=24), "admin")
    now = time.time()
    a = ledger.admit(Request("ann", "job", "old", 2), now=now - 3 * 3600)
    ledger.release(a.id, now=now - 3600)  # 2 GPUs for 2 hours: 4 GPU-hours
    ledger.admit(Request("dan", "job", "x", 1))  # default quota: no budget, no series
    s = render(ledger, groups={"ann": ["students"], "dan": []})
    assert value(s, "gpulab_user_gpu_hours", user="ann") == pytest.approx(4.0, abs=0.01)
    assert value(s, "gpulab_user_gpu_hours_budget", user="ann") == 10
    assert value(s, "gpulab_user_gpu_hours", user="carl") == 0
    assert value(s, "gpulab_user_gpu_hours_budget", user="carl") == 5
    assert not [lab for lab, _ in s.get("gpulab_user_gpu_hours", []) if lab["user"] == "dan"]


def test_held_gpus_usage_is_labelled_with_who_holds_them(ledger):
    nvml = FakeNVML({"GPU-0": (37, 12000, 81559), "GPU-1": (0, 100, 81559)})
    usage = PoolUsage(ledger.devices(), interval=0.5, nvml=nvml)
    try:
        usage.sampler.wait_first()
        ledger.admit(Request("ann", "notebook", "default", 2, model="H100"))
        s = render(ledger, usage=usage)
    finally:
        usage.close()
    assert value(s, "gpulab_gpu_utilization_percent", device="0", user="ann",
                 kind="notebook", holder="default", model="H100") == 37
    assert value(s, "gpulab_gpu_utilization_percent", device="1", user="ann") == 0
    assert value(s, "gpulab_gpu_memory_used_bytes", device="0") == 12000 * 1024 * 1024
    assert value(s, "gpulab_gpu_memory_total_bytes", device="1") == 81559 * 1024 * 1024
    assert value(s, "gpulab_gpu_held_info", device="0", measured="true") == 1


def test_event_counters_count_refusals_by_reason_and_outcomes(ledger):
    before = render(ledger)

    def count(s, name, **labels):
        found = [v for lab, v in s.get(name, []) if all(lab.get(k) == x for k, x in labels.items())]
        return sum(found)

    events.refused("job", QuotaExceeded("over"))
    events.refused("job", QueueRefused("never"))
    events.admitted("job", "queued")
    events.job_ended("Succeeded")
    after = render(ledger)
    for name, labels in [("gpulab_refusals_total", {"kind": "job", "reason": "quota"}),
                         ("gpulab_refusals_total", {"kind": "job", "reason": "never_fits"}),
                         ("gpulab_admissions_total", {"kind": "job", "how": "queued"}),
                         ("gpulab_job_outcomes_total", {"state": "Succeeded"})]:
        assert count(after, name, **labels) == count(before, name, **labels) + 1, name
