"""The Kueue job backend's pure parts: Kueue's and JobSet's states in words, what a person's
Kueue objects should say, the settings that choose the backend, a job over quota refused at
once, and the ledger adopting what Kueue admitted. (Against the real Kueue and JobSet:
tests/cluster/test_queueing.py.)"""

import json

import pytest
from traitlets.config import Config

from gpulab.hub.jobs.kube import KubeJobBackend, backend_settings
from gpulab.hub.jobs.kueue import (
    KueueJobBackend,
    backend_from_settings,
    jobset_ended,
    waiting_words,
    workload_admitted,
)
from gpulab.hub.jobs.spec import parse_spec
from gpulab.hub.quota.ledger import AdmissionRefused, Ledger, Request
from gpulab.hub.quota.policy import Quota
from gpulab.spawner.kueuemirror import UNLIMITED, Wanted, wanted


def cond(type_, status, **kw):
    return {"type": type_, "status": status, **kw}


def obj(*conditions):
    return {"status": {"conditions": list(conditions)}}


def test_a_workload_is_admitted_only_while_admitted_and_not_evicted():
    assert not workload_admitted(None)
    assert not workload_admitted(obj(cond("QuotaReserved", "False")))
    assert workload_admitted(obj(cond("QuotaReserved", "True"), cond("Admitted", "True")))
    assert not workload_admitted(obj(cond("Admitted", "True"), cond("Evicted", "True")))


def test_why_a_job_waits_is_kueues_reason_in_words():
    assert waiting_words(None) == ("waiting for GPUs: the cluster's queue has not taken it "
                                   "in yet")
    pending = obj(cond("QuotaReserved", "False", message="couldn't assign flavors to pod set "
                       "worker: insufficient unused quota for nvidia.com/gpu"))
    assert waiting_words(pending) == (
        "waiting for GPUs in the cluster's queue: couldn't assign flavors to pod set worker: "
        "insufficient unused quota for nvidia.com/gpu")
    assert waiting_words(obj(cond("QuotaReserved", "False"))) == \
        "waiting for GPUs in the cluster's queue"
    evicted = obj(cond("Evicted", "True", reason="Preempted",
                       message="Preempted to accommodate a workload (UID: x) due to reclamation"))
    assert waiting_words(evicted).startswith("waiting for GPUs again: Preempted to accommodate")


def test_a_jobsets_end_is_its_condition():
    assert jobset_ended(obj()) is None
    assert jobset_ended(obj(cond("Completed", "True"))) == ("Succeeded", "completed")
    assert jobset_ended(obj(cond("Failed", "True", reason="FailedJobs",
                                 message="jobset failed due to reaching max restarts"))) == \
        ("Failed", "jobset failed due to reaching max restarts")
    assert jobset_ended(obj(cond("Completed", "False"), cond("Failed", "False"))) is None


def test_what_a_persons_kueue_objects_say():
    assert wanted(None, "none", budget_used=0) == Wanted(UNLIMITED, None, False)
    q = Quota(max_gpus=4)
    assert wanted(q, "user", budget_used=0) == Wanted(4, None, False)
    assert wanted(q, "group 'ml team'", budget_used=0) == Wanted(4, "ml team", False)
    budget = Quota(max_gpus=4, gpu_hours=10.0, window_hours=24)
    assert wanted(budget, "default", budget_used=9.9).hold is False
    assert wanted(budget, "default", budget_used=10.0).hold is True


def test_the_settings_choose_the_backend_and_the_spawners_kueue_reaches_it(tmp_path):
    c = Config()
    c.KubeGPUSpawner.kueue = True
    c.KueueJobBackend.local_queue = "team"
    raw = backend_settings(c)
    assert json.loads(raw) == {"kueue": True, "local_queue": "team"}
    b = backend_from_settings(Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}"), raw)
    assert type(b) is KueueJobBackend and b.local_queue == "team" and b.launches_queued
    plain = backend_from_settings(Ledger(f"sqlite:///{tmp_path / 'm.sqlite'}"), "{}")
    assert type(plain) is KubeJobBackend and not plain.kueue


def test_a_job_over_the_persons_quota_is_refused_at_once(tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}", pool="kubernetes")
    ledger.migrate()
    ledger.set_quota("user", "ann", Quota(max_gpus=2), actor="admin")
    b = KueueJobBackend(ledger)

    def spec(gpus, **kw):
        return parse_spec({"name": "j", "strategy": "multi-worker-mirrored",
                           "replicas": {"worker": gpus}, "resources": {"worker": {"gpus": 1}},
                           "script": "t.py", **kw})

    req = Request(user="ann", kind="job", holder="j", gpus=3)
    with pytest.raises(AdmissionRefused, match="asks for 3 GPUs and your quota is 2"):
        b._admit_or_queue(req, spec(3))
    assert b._admit_or_queue(req, spec(3, preemptible=True)) is None  # may borrow
    assert b._admit_or_queue(Request(user="ann", kind="job", holder="j", gpus=2), spec(2)) is None
    assert b._admit_or_queue(Request(user="bob", kind="job", holder="j", gpus=9), spec(9)) is None
    assert ledger.open_allocations() == []  # Kueue admits; nothing is held at submit


def test_the_ledger_adopts_what_kueue_admitted_once_and_counts_it(tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}", pool="kubernetes")
    ledger.migrate()
    ledger.set_quota("user", "ann", Quota(max_gpus=1), actor="admin")
    req = Request(user="ann", kind="job", holder="big", gpus=2)
    a = ledger.adopt(req, now=1000.0)  # over the ledger's quota: Kueue decided, it is recorded
    assert (a.gpus, a.devices, a.open) == (2, (), True)
    assert ledger.adopt(req, now=2000.0).id == a.id  # a second look records nothing
    ledger.release(a.id, "job succeeded", now=1000.0 + 1800)
    assert ledger.usage(0, 5000.0)["ann"] == pytest.approx(1.0)  # 2 GPUs for half an hour
    assert ledger.adopt(req, now=3000.0).id != a.id  # admitted again (after a preemption)
