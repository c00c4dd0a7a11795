"""The Kueue job backend's pure parts: Kueue's and JobSet's states in words, what a person's
Kueue objects should say, the settings that choose the backend, a job over quota refused at
once, and the ledger adopting what Kueue admitted. (Against the real Kueue and JobSet:
tests/cluster/test_queueing.py.)"""

import json
import time
from types import SimpleNamespace

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
from gpulab.hub.cluster.kueuemirror import KueueMirror, Wanted, node_gpus, wanted
from gpulab.hub.cluster.kueueobjects import ordinal, pending_position


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
    assert waiting_words(pending, 2).startswith(
        "waiting for GPUs in the cluster's queue (2nd in line): couldn't assign")
    assert waiting_words(pending, 1).startswith("waiting for GPUs in the cluster's queue (next in line)")
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
    assert wanted(None, "none", budget_used=0) == Wanted(None, None, False)  # the pool
    q = Quota(max_gpus=4)
    assert wanted(q, "user", budget_used=0) == Wanted(4, None, False)
    assert wanted(q, "group 'ml team'", budget_used=0) == Wanted(4, "ml team", False)
    budget = Quota(max_gpus=4, gpu_hours=10.0, window_hours=24)
    assert wanted(budget, "default", budget_used=9.9).hold is False
    assert wanted(budget, "default", budget_used=10.0).hold is True


def test_the_settings_choose_the_backend_and_the_spawners_kueue_reaches_it(tmp_path):
    c = Config()
    c.KubeGPUSpawner.kueue = True
    c.KubeGPUSpawner.kueue_gpus = 12
    c.KueueJobBackend.local_queue = "team"
    raw = backend_settings(c)
    assert json.loads(raw) == {"kueue": True, "kueue_gpus": 12, "local_queue": "team"}
    b = backend_from_settings(Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}"), raw)
    assert type(b) is KueueJobBackend and b.local_queue == "team" and b.launches_queued
    assert b.kueue_gpus == 12
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
    with pytest.raises(AdmissionRefused, match="asks for 3 GPUs; your quota is 2 GPUs at once. "
                       "Ask for fewer, mark it preemptible to borrow idle GPUs, or ask an admin"):
        b._admission(req, spec(3))
    assert b._admission(req, spec(3, preemptible=True)) is None  # may borrow
    assert b._admission(Request(user="ann", kind="job", holder="j", gpus=2), spec(2)) is None
    assert b._admission(Request(user="bob", kind="job", holder="j", gpus=9), spec(9)) is None
    assert ledger.open_allocations() == []  # Kueue admits; nothing is held at submit


async def test_a_priority_is_refused_before_anything_is_made(tmp_path):
    """In Kueue a priority would also decide whose work is preempted, across people: a job
    with one is refused with a 400 that says so, before a row or an object exists; 0 is
    the default and passes that check."""
    from gpulab.hub.jobs.base import JobError

    ledger = Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}", pool="kubernetes")
    ledger.migrate()
    b = KueueJobBackend(ledger)
    with pytest.raises(JobError) as e:
        await b.submit("ann", (), parse_spec({"name": "j", "strategy": "multi-worker-mirrored", "script": "t.py", "priority": 50}))
    assert e.value.status == 400 and e.value.field == "priority"
    assert "wait in the order you submit them" in e.value.message
    assert b.list() == [] and ledger.open_allocations() == []
    await b._prepare("ann", (), parse_spec({"name": "j", "strategy": "multi-worker-mirrored", "script": "t.py", "priority": 0}))


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


def test_where_a_workload_stands_in_its_queue():
    def w(name, created, *conds, queue="gpulab", priority=None):
        spec = {"queueName": queue}
        if priority is not None:
            spec["priority"] = priority
        return {"metadata": {"name": name, "uid": name, "creationTimestamp": created},
                "spec": spec, "status": {"conditions": list(conds)}}

    running = w("run", "2026-01-01T00:00:00Z", cond("Admitted", "True"))
    a = w("a", "2026-01-01T00:00:02Z")
    b = w("b", "2026-01-01T00:00:01Z")
    urgent = w("urgent", "2026-01-01T00:00:09Z", priority=10)
    done = w("done", "2026-01-01T00:00:00Z", cond("Finished", "True"))
    other = w("other", "2026-01-01T00:00:00Z", queue="gpulab-preemptible")
    every = [running, a, b, urgent, done, other]
    assert [pending_position(every, x) for x in (urgent, b, a)] == [1, 2, 3]
    assert pending_position(every, running) is None and pending_position(every, None) is None
    assert pending_position(every, other) == 1
    assert [ordinal(n) for n in (1, 2, 3, 4, 11, 12, 13, 21, 22, 101)] == [
        "1st", "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "101st"]


def test_a_request_over_the_per_request_cap_is_refused_at_once(tmp_path):
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}", pool="kubernetes")
    ledger.migrate()
    ledger.set_quota("user", "ann", Quota(max_gpus=8, max_per_request=2), actor="admin")
    b = KueueJobBackend(ledger)
    spec = parse_spec({"name": "j", "strategy": "multi-worker-mirrored", "replicas": {"worker": 4},
                       "resources": {"worker": {"gpus": 1}}, "script": "t.py", "preemptible": True})
    with pytest.raises(AdmissionRefused, match="at most 2 in one request"):
        b._admission(Request(user="ann", kind="job", holder="j", gpus=4), spec)


def test_one_switch_for_the_spawner_and_the_backend():
    c = Config()
    c.KubeJobBackend.kueue = True  # the spawner's pods would not be queued: refused
    with pytest.raises(ValueError, match="set c.KubeGPUSpawner.kueue only"):
        backend_settings(c)
    for name, value in (("kueue_gpus", 8), ("kueue_gpu_models", True)):
        c = Config()
        setattr(c.KubeJobBackend, name, value)  # the two quota mirrors would write two pools
        with pytest.raises(ValueError, match=f"set c.KubeGPUSpawner.{name} only"):
            backend_settings(c)
        setattr(c.KubeGPUSpawner, name, value)  # the same: fine
        assert json.loads(backend_settings(c))[name] == value


def test_the_pool_counts_the_gpus_of_schedulable_nodes():
    def node(gpus, unschedulable=False, ready="True"):
        n = {"status": {"allocatable": {"cpu": "8"} if gpus is None
                        else {"nvidia.com/gpu": gpus},
                        "conditions": [{"type": "Ready", "status": ready}]}}
        if unschedulable:
            n["spec"] = {"unschedulable": True}
        return n

    assert [node_gpus(node(g)) for g in ("8", "0", None, "-2", "lots")] == [8, 0, 0, 0, 0]
    assert node_gpus(node("8", unschedulable=True)) == 0
    assert node_gpus(node("8", ready="Unknown")) == 0
    assert node_gpus({"status": {"allocatable": {"nvidia.com/gpu": "8"}}}) == 0  # no Ready


class _Resp:
    def __init__(self, body):
        self.body = body

    async def read(self):
        return json.dumps(self.body).encode()


class _Core:
    def __init__(self, nodes):
        self.nodes, self.lists = nodes, 0

    async def list_node(self, **kw):
        self.lists += 1
        return _Resp({"items": self.nodes})


class _Custom:
    def __init__(self):
        self.applied = []

    async def patch_cluster_custom_object(self, group, version, plural, name, body, **kw):
        self.applied.append((plural, name, body))


async def test_the_mirror_applies_the_pool_when_it_changes_and_an_operators_pool_as_it_is(
        tmp_path):
    """One pool of any model by default. Split by model: a flavor each (the nodes' product
    label) and their sum as the quota's resource; applied again when the nodes change; a new
    model re-applies everyone's queues (they list the models' flavors). An operator's fixed
    pool is one count of any model, and no node is listed for it."""
    import logging

    from gpulab.hub.cluster.kueueobjects import QUOTA_RESOURCE, gpu_flavor_name

    ledger = Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}", pool="kubernetes")
    ledger.migrate()

    def gpu_node(gpus, model="NVIDIA-H100"):
        return {"metadata": {"labels": {"nvidia.com/gpu.product": model} if model else {}},
                "status": {"allocatable": {"nvidia.com/gpu": gpus},
                           "conditions": [{"type": "Ready", "status": "True"}]}}

    h100 = gpu_flavor_name("NVIDIA-H100")
    # one pool of any model (the default)
    core, custom = _Core([gpu_node("8"), gpu_node("4", "NVIDIA-A10")]), _Custom()
    m = KueueMirror(ledger, custom, core, interval=60, log=logging.getLogger("t"), capacity_seconds=0)
    await m.sync_capacity()
    assert [(p, n) for p, n, _ in custom.applied] == [
        ("resourceflavors", "gpulab-default"), ("workloadpriorityclasses", "gpulab-preemptible"),
        ("resourceflavors", "gpulab-gpu"), ("cohorts", "gpulab")]
    assert m.capacity == {None: 12}
    gpus, _ = custom.applied[-1][2]["spec"]["resourceGroups"]
    assert gpus["flavors"] == [{"name": "gpulab-gpu", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "12"}]}]

    # split by model
    core, custom = _Core([gpu_node("8"), gpu_node("8")]), _Custom()
    m = KueueMirror(ledger, custom, core, interval=60, log=logging.getLogger("t"),
                    capacity_seconds=0, by_model=True)
    await m.sync_capacity()
    assert [(p, n) for p, n, _ in custom.applied] == [
        ("resourceflavors", "gpulab-default"), ("workloadpriorityclasses", "gpulab-preemptible"),
        ("resourceflavors", "gpulab-quota"), ("resourceflavors", h100), ("cohorts", "gpulab")]
    gpus, quota, _ = custom.applied[-1][2]["spec"]["resourceGroups"]
    assert gpus["flavors"] == [{"name": h100, "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "16"}]}]
    assert quota["flavors"] == [{"name": "gpulab-quota", "resources": [{"name": QUOTA_RESOURCE, "nominalQuota": "16"}]}]
    custom.applied.clear()
    await m.sync_capacity()  # the same nodes: nothing applied
    assert custom.applied == [] and core.lists == 2
    core.nodes.append(gpu_node("4"))
    m.applied["gpulab-ann"] = "what was applied"
    await m.sync_capacity()
    assert [(p, n) for p, n, _ in custom.applied] == [("cohorts", "gpulab")]
    assert m.capacity == {"NVIDIA-H100": 20} and m.applied  # the same models: queues as they are
    custom.applied.clear()
    core.nodes += [gpu_node("4", "NVIDIA-A10"), gpu_node("2", None)]
    await m.sync_capacity()
    a10 = gpu_flavor_name("NVIDIA-A10")
    assert [(p, n) for p, n, _ in custom.applied] == [
        ("resourceflavors", a10), ("resourceflavors", "gpulab-gpu"), ("cohorts", "gpulab")]
    gpus, quota, _ = custom.applied[-1][2]["spec"]["resourceGroups"]
    assert [(f["name"], f["resources"][0]["nominalQuota"]) for f in gpus["flavors"]] == [
        (a10, "4"), (h100, "20"), ("gpulab-gpu", "2")]
    assert quota["flavors"][0]["resources"][0]["nominalQuota"] == "26"
    assert m.applied == {}  # new models: everyone's queues are applied again

    fixed = KueueMirror(ledger, _Custom(), _Core([]), interval=60, log=logging.getLogger("t"),
                        pool=6, by_model=True)
    await fixed.sync_capacity()
    assert fixed.core.lists == 0 and fixed.capacity == {None: 6}
    gpus, _ = fixed.custom.applied[-1][2]["spec"]["resourceGroups"]  # a count of any model
    assert gpus["flavors"] == [{"name": "gpulab-gpu", "resources": [{"name": "nvidia.com/gpu", "nominalQuota": "6"}]}]


class _Kueue:
    """Kueue's objects as an API server keeps them, for two mirrors (the hub's, the
    service's) at once: server-side apply makes or changes, delete removes (404 when gone)."""

    def __init__(self):
        self.objects: dict[tuple, dict] = {}
        self.lists = 0

    def client(self):
        server = self

        class Client:
            async def patch_cluster_custom_object(self, group, version, plural, name, body, **kw):
                server.objects[(plural, None, name)] = body

            async def patch_namespaced_custom_object(self, group, version, ns, plural, name, body,
                                                     **kw):
                server.objects[(plural, ns, name)] = body

            async def delete_cluster_custom_object(self, group, version, plural, name, **kw):
                server.delete(plural, None, name)

            async def delete_namespaced_custom_object(self, group, version, ns, plural, name, **kw):
                server.delete(plural, ns, name)

            async def list_cluster_custom_object(self, group, version, plural, label_selector,
                                                 **kw):
                server.lists += 1
                assert label_selector == "app.kubernetes.io/managed-by=gpulab"
                return _Resp({"items": [o for (p, _, _), o in server.objects.items()
                                        if p == plural]})

        return Client()

    def delete(self, plural, ns, name):
        from kubernetes_asyncio.client.rest import ApiException

        if self.objects.pop((plural, ns, name), None) is None:
            raise ApiException(status=404, reason="Not Found")

    def queues(self):
        return sorted((p, ns, n) for p, ns, n in self.objects if p in ("clusterqueues", "localqueues"))


async def test_a_person_who_left_loses_their_queues_and_no_mirror_makes_them_again(tmp_path):
    """The hub removes a departed person's ClusterQueues and LocalQueues; the service's
    mirror, which applied them too, forgets the person before it would apply them again (an
    admin's quota edit), and a returning person is given new queues at their next job."""
    import logging
    import time

    ledger = Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}", pool="kubernetes")
    ledger.migrate()
    ledger.set_quota("user", "ann", Quota(max_gpus=2), actor="admin")
    kueue = _Kueue()
    log = logging.getLogger("t")
    hub = KueueMirror(ledger, kueue.client(), _Core([]), interval=60, log=log, pool=4)
    service = KueueMirror(ledger, kueue.client(), _Core([]), interval=60, log=log, pool=4)
    for m in (hub, service):
        await m.register("gpulab-ann", "ann", (), "ann")
        await m.register("gpulab-bob", "bob", (), "bob")
        m._task.cancel()
    mine = [("clusterqueues", None, "gpulab-ann"), ("clusterqueues", None, "gpulab-ann.preemptible"),
            ("localqueues", "gpulab-ann", "gpulab"), ("localqueues", "gpulab-ann", "gpulab-preemptible")]
    assert set(mine) <= set(kueue.queues())

    assert await hub.remove("gpulab-ann") == 4
    assert not set(mine) & set(kueue.queues()) and "gpulab-ann" not in hub.users
    assert await hub.remove("gpulab-ann") == 0  # gone already: not an error

    # nothing changed, the queues listed lately: the service's pass asks nothing
    service._gone_checked = time.monotonic()
    lists = kueue.lists
    assert await service.sync() == 0 and kueue.lists == lists
    # the admin edits ann's quota: the service's pass lists the queues first, forgets her
    ledger.set_quota("user", "ann", Quota(max_gpus=3), actor="admin")
    assert await service.sync() == 0
    assert kueue.lists == lists + 1
    assert "gpulab-ann" not in service.users and "gpulab-ann" not in service.applied
    assert not set(mine) & set(kueue.queues())
    assert "gpulab-bob" in service.applied  # the others stay mirrored
    # nothing changed since: no list until capacity_seconds have passed
    assert await service.sync() == 0 and kueue.lists == lists + 1
    service._gone_checked -= service.capacity_seconds
    await service.sync()
    assert kueue.lists == lists + 2

    # ann comes back: her first job applies her queues anew, with her quota of now
    await service.register("gpulab-ann", "ann", (), "ann")
    assert set(mine) <= set(kueue.queues())
    limit = kueue.objects[("clusterqueues", None, "gpulab-ann")]["spec"]["resourceGroups"][0]
    assert limit["flavors"][0]["resources"][0]["borrowingLimit"] == "3"


async def test_a_pass_reads_the_ledger_a_fixed_number_of_times_however_many_people(
        tmp_path, monkeypatch):
    """The mirror's pass reads everyone's quotas in one query and the GPU-hours used in one
    query per budget window, not one per person (bench/scale_kube.py: 1,001 queries a pass
    at 1,000 people); what it wants for each is what a registration (one person's own reads)
    wants. Would fail if the per-person usage query came back."""
    import logging

    ledger = Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}", pool="kubernetes")
    ledger.migrate()
    ledger.set_quota("default", "", Quota(max_gpus=1, gpu_hours=5, window_hours=24), actor="a")
    people = [f"p{i:02d}" for i in range(40)]
    for i, p in enumerate(people[:30]):
        ledger.set_quota("user", p, Quota(max_gpus=2, gpu_hours=1,
                                          window_hours=168 if i % 2 else 24), actor="a")
    ledger.set_quota("group", "team", Quota(max_gpus=3), actor="a")
    now = time.time()
    for p in ("p01", "p02", "p35"):  # budgets used up (p35: the default's budget)
        ledger.adopt(Request(user=p, kind="job", holder="x", gpus=8), now=now - 3600)
    m = KueueMirror(ledger, _Custom(), _Core([]), interval=60, log=logging.getLogger("t"), pool=8)
    for p in people:
        m.users[f"gpulab-{p}"] = (p, ("team",) if p == "p39" else (), p)
    calls = []
    scans = []

    class Rows(list):  # counts the passes over the quota rows
        def __iter__(self):
            scans.append(1)
            return super().__iter__()

    for name in ("quotas", "usage", "effective"):
        real = getattr(Ledger, name)

        def spy(self, *a, _real=real, _name=name, **kw):
            calls.append(_name)
            got = _real(self, *a, **kw)
            return Rows(got) if _name == "quotas" else got

        monkeypatch.setattr(Ledger, name, spy)
    everyone = m._wanted(list(m.users))
    assert sorted(calls) == ["quotas", "usage", "usage"]  # two budget windows
    assert len(scans) == 1  # the rows indexed once, not scanned once per person
    one_by_one = {ns: m._wanted([ns])[ns] for ns in m.users}
    assert everyone == one_by_one
    assert [ns for ns, w in everyone.items() if w.hold] == [
        "gpulab-p01", "gpulab-p02", "gpulab-p35"]
    assert everyone["gpulab-p39"] == Wanted(3, "team", False)


# -- the pass that follows Kueue, on caches as the shared watches fill them -----------------

class _Cache:
    def __init__(self):
        self.resources = {}


def _wl(uid, *conditions, active=True):
    return {"metadata": {"name": f"jobset-{uid}", "namespace": "gpulab-ann",
                         "labels": {"kueue.x-k8s.io/job-uid": uid}},
            "spec": {"queueName": "gpulab", "active": active},
            "status": {"conditions": list(conditions)}}


def _js(name, uid, *conditions):
    return {"metadata": {"name": name, "namespace": "gpulab-ann", "uid": uid},
            "status": {"conditions": list(conditions)}}


def _pod(job, role, index, phase):
    return {"metadata": {"name": f"{job}-{role}-0-{index}", "namespace": "gpulab-ann",
                         "creationTimestamp": "2026-01-01T00:00:00Z",
                         "labels": {"gpulab.io/job": job, "gpulab.io/role": role,
                                    "batch.kubernetes.io/job-completion-index": str(index)}},
            "status": {"phase": phase}}


@pytest.fixture
async def following(tmp_path, monkeypatch):
    """A KueueJobBackend with one Queued 2-GPU job 'j' of ann, its watches' caches filled by
    the test, and JobSet deletions recorded instead of sent."""
    ledger = Ledger(f"sqlite:///{tmp_path / 'l.sqlite'}", pool="kubernetes")
    ledger.migrate()
    b = KueueJobBackend(ledger)
    spec = parse_spec({"name": "j", "strategy": "multi-worker-mirrored", "replicas": {"worker": 2},
                       "resources": {"worker": {"gpus": 1}}, "script": "t.py"})
    b.store.record(job_id="id1", user="ann", spec=spec, allocation=None, job_dir="/x",
                   replicas=b._replica_rows(spec, None))
    b._jobsets_r, b._workloads_r, b._pods_r = _Cache(), _Cache(), _Cache()
    deleted = []

    async def delete(ns, name):
        deleted.append((ns, name))

    monkeypatch.setattr(b, "_delete_parent", delete)
    b.deleted = deleted
    return b


async def test_the_ledger_opens_at_kueues_admission_and_closes_at_eviction_and_end(following):
    b = following
    b._jobsets_r.resources["gpulab-ann/j"] = _js("j", "u1")
    b._workloads_r.resources["gpulab-ann/w"] = _wl("u1", cond(
        "QuotaReserved", "False", message="insufficient unused quota for nvidia.com/gpu"))
    await b.reconcile()
    view = b.get("ann", "j")
    assert view["state"] == "Queued"
    assert view["reason"] == ("waiting for GPUs in the cluster's queue (next in line): "
                              "insufficient unused quota for nvidia.com/gpu")
    assert b.ledger.open_allocations() == []

    b._workloads_r.resources["gpulab-ann/w"] = _wl("u1", cond(
        "Admitted", "True", lastTransitionTime="2026-01-01T00:00:10Z"))
    for i in range(2):
        b._pods_r.resources[f"p{i}"] = _pod("j", "worker", i, "Running")
    await b.reconcile()
    assert b.get("ann", "j")["state"] == "Running"
    (a,) = b.ledger.open_allocations()
    assert (a.gpus, a.started_at) == (2, 1767225610.0)  # from the Admitted condition's time

    b._workloads_r.resources["gpulab-ann/w"] = _wl("u1", cond("Admitted", "True"), cond(
        "Evicted", "True", reason="Preempted", message="Preempted to accommodate a workload"))
    await b.reconcile()
    view = b.get("ann", "j")
    assert view["state"] == "Queued" and view["reason"].startswith("waiting for GPUs again: Preempted")
    assert b.ledger.open_allocations() == []

    b._workloads_r.resources["gpulab-ann/w"] = _wl("u1", cond("Admitted", "True"))
    await b.reconcile()
    assert [x.gpus for x in b.ledger.open_allocations()] == [2]  # admitted again
    b._jobsets_r.resources["gpulab-ann/j"] = _js("j", "u1", cond("Completed", "True"))
    await b.reconcile()
    view = b.get("ann", "j")
    assert (view["state"], view["reason"]) == ("Succeeded", "completed")
    assert b.ledger.open_allocations() == []


async def test_a_deactivated_workload_fails_the_job_and_a_lost_jobset_is_said(following):
    b = following
    b._jobsets_r.resources["gpulab-ann/j"] = _js("j", "u1")
    b._workloads_r.resources["gpulab-ann/w"] = _wl("u1", cond(
        "Evicted", "True", reason="InactiveWorkload", message="The workload is deactivated"),
        active=False)
    await b.reconcile()
    view = b.get("ann", "j")
    assert view["state"] == "Failed"
    assert view["reason"] == "taken out of the cluster's queue: The workload is deactivated"
    assert b.deleted == [("gpulab-ann", "j")]


async def test_an_admission_the_job_can_no_longer_take_is_given_back(following, monkeypatch):
    b = following
    b._jobsets_r.resources["gpulab-ann/j"] = _js("j", "u1")
    b._workloads_r.resources["gpulab-ann/w"] = _wl("u1", cond("Admitted", "True"))
    monkeypatch.setattr(b.store, "admit_queued", lambda *a: False)  # stopped meanwhile
    await b.reconcile()
    assert b.ledger.open_allocations() == []


async def test_a_restart_stays_counted_when_the_failed_pod_is_gone(following):
    """A replica's restarts count its failed pods; the cluster removes a failed pod once its
    replacement runs (seen on the real node of the cluster tier), and the count stays."""
    b = following
    b._jobsets_r.resources["gpulab-ann/j"] = _js("j", "u1")
    b._workloads_r.resources["gpulab-ann/w"] = _wl("u1", cond("Admitted", "True"))
    b._pods_r.resources["p0"] = _pod("j", "worker", 0, "Running")
    b._pods_r.resources["p1"] = _pod("j", "worker", 1, "Failed")
    await b.reconcile()
    assert [r["restarts"] for r in b.get("ann", "j")["replicas"]] == [0, 1]
    # its replacement is made: the restart's record (issue 34), kept once the pod is gone
    b._pods_r.resources["p1"]["status"]["containerStatuses"] = [
        {"state": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]
    b._pods_r.resources["p1b"] = _pod("j", "worker", 1, "Running")
    b._pods_r.resources["p1b"]["metadata"].update(name="j-worker-0-1-b",
                                                  creationTimestamp="2026-01-01T00:01:00Z")
    await b.reconcile()
    history = [r["restart_history"] for r in b.get("ann", "j")["replicas"]]
    assert history == [[], [{"restart": 1, "attempt": 2, "at": 1767225660.0, "exit_code": 137,
                             "signal": "SIGKILL", "oom_killed": True,
                             "reason": "killed: out of memory (OOM); ask for more memory",
                             "pod": "j-worker-0-1"}]]
    del b._pods_r.resources["p1"]
    await b.reconcile()
    view = b.get("ann", "j")
    assert view["state"] == "Running" and [r["restarts"] for r in view["replicas"]] == [0, 1]
    assert [r["restart_history"] for r in view["replicas"]] == history
    b._jobsets_r.resources["gpulab-ann/j"] = _js("j", "u1", cond("Completed", "True"))
    await b.reconcile()
    assert [r["restarts"] for r in b.get("ann", "j")["replicas"]] == [0, 1]
    assert [r["restart_history"] for r in b.get("ann", "j")["replicas"]] == history


async def test_an_end_seen_late_counts_the_gpus_until_kubernetes_end_only(following):
    """A service that was down sees an eviction and an end late: the allocations close at
    the times Kubernetes stamped (the GPU-hours stop there), never before they opened nor in
    the future."""
    b = following
    b._jobsets_r.resources["gpulab-ann/j"] = _js("j", "u1")
    b._workloads_r.resources["gpulab-ann/w"] = _wl("u1", cond(
        "Admitted", "True", lastTransitionTime="2026-01-01T00:00:10Z"))
    await b.reconcile()
    (first,) = b.ledger.open_allocations()
    b._workloads_r.resources["gpulab-ann/w"] = _wl("u1", cond("Admitted", "True"), cond(
        "Evicted", "True", reason="Preempted", lastTransitionTime="2026-01-01T01:00:10Z"))
    await b.reconcile()
    assert b.ledger.get(first.id).ended_at == 1767229210.0  # one hour after admission

    b._workloads_r.resources["gpulab-ann/w"] = _wl("u1", cond(
        "Admitted", "True", lastTransitionTime="2026-01-01T02:00:00Z"))
    await b.reconcile()
    (second,) = b.ledger.open_allocations()
    assert second.started_at == 1767232800.0
    b._jobsets_r.resources["gpulab-ann/j"] = _js("j", "u1", cond(
        "Completed", "True", lastTransitionTime="2026-01-01T02:30:00Z"))
    await b.reconcile()
    assert b.get("ann", "j")["state"] == "Succeeded"
    assert b.ledger.get(second.id).ended_at == 1767234600.0
    hours = sum((a.ended_at - a.started_at) * a.gpus for a in (b.ledger.get(first.id), b.ledger.get(second.id)))
    assert hours / 3600 == 3.0  # 2 GPUs for one hour, then for half an hour


async def test_a_stamp_out_of_bounds_is_clamped(following):
    """A condition time before the allocation opened (clock skew) or in the future closes it
    when it opened, or now."""
    b = following
    b._jobsets_r.resources["gpulab-ann/j"] = _js("j", "u1")
    b._workloads_r.resources["gpulab-ann/w"] = _wl("u1", cond(
        "Admitted", "True", lastTransitionTime="2026-01-01T00:00:10Z"))
    await b.reconcile()
    (a,) = b.ledger.open_allocations()
    b._jobsets_r.resources["gpulab-ann/j"] = _js("j", "u1", cond(
        "Failed", "True", message="boom", lastTransitionTime="2025-12-31T00:00:00Z"))
    await b.reconcile()
    assert b.ledger.get(a.id).ended_at == a.started_at
    job, _ = b.store.read("id1")
    assert job.finished_at == a.started_at
    unheld = SimpleNamespace(allocation_id=None)
    assert b._seen_late(unheld, "2999-01-01T00:00:00Z", 1000.0) == 1000.0
    assert b._seen_late(unheld, "not a time", 1234.5) == 1234.5
    assert b._seen_late(unheld, None, 1234.5) == 1234.5
