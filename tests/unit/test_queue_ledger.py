"""gpulab.hub.quota.waiting: the queue in the ledger's database (SQLite here; PostgreSQL in
tests/app/test_queue_concurrency.py), with the ledger's own admissions beside it."""

from __future__ import annotations

import threading

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from gpulab.hub.db import Base
from gpulab.hub.quota.ledger import BadRequest, DeviceInfo, Ledger, NotEnoughGPUs, Request
from gpulab.hub.quota.policy import Quota
from gpulab.hub.quota.waiting import Queue, QueueRefused

H = 3600.0
T = 1_000_000.0


@pytest.fixture
def ledger(tmp_path):
    lg = Ledger(f"sqlite:///{tmp_path}/ledger.sqlite")
    lg.migrate()
    lg.sync_inventory([DeviceInfo(i, model="H100") for i in range(4)])
    lg.set_quota("default", "", Quota(4), actor="admin")
    return lg


def req(user, holder, gpus, kind="job", **kw):
    return Request(user=user, kind=kind, holder=holder, gpus=gpus, **kw)


def test_the_queue_table_is_in_the_migrations(ledger):
    with ledger.engine.connect() as conn:
        assert compare_metadata(MigrationContext.configure(conn), Base.metadata) == []


def test_what_can_never_run_is_refused_at_once(ledger):
    q = Queue(ledger)
    with pytest.raises(QueueRefused, match="this machine has 4"):
        q.enqueue(req("ann", "big", 5))
    ledger.set_quota("user", "ann", Quota(2), actor="admin")
    with pytest.raises(QueueRefused, match="your quota is 2 GPUs at once"):
        q.enqueue(req("ann", "three", 3))
    with pytest.raises(BadRequest):
        q.enqueue(req("ann", "zero", 0))
    with pytest.raises(BadRequest, match="max_runtime"):
        q.enqueue(req("ann", "x", 1), max_runtime=float("inf"))
    assert q.entries() == []


def test_a_pass_admits_in_the_ledger_and_the_rest_waits_with_its_place(ledger):
    q = Queue(ledger)
    held = ledger.admit(req("bob", "nb", 3, kind="notebook"), now=T)
    a = q.enqueue(req("ann", "one", 1), now=T + 1)
    b = q.enqueue(req("ann", "two", 2), now=T + 2)
    p = q.schedule(now=T + 3)
    assert [(e.id, al.devices) for e, al in p.started] == [(a.id, (3,))]
    # the allocation is the ledger's own: a direct admission sees the GPU as taken
    with pytest.raises(NotEnoughGPUs):
        ledger.admit(req("cyd", "c", 1), now=T + 4)
    [waiting] = q.entries(now=T + 4)
    assert waiting.id == b.id and waiting.position == 1 and waiting.estimated_start is None
    assert "2 GPUs at once: 0 of 4 are free" in waiting.reason
    # the GPUs come back: the next pass starts it
    ledger.release(held.id, now=T + 5)
    p = q.schedule(now=T + 6)
    assert [e.id for e, _ in p.started] == [b.id] and len(p.started[0][1].devices) == 2
    assert q.entries() == []


def test_the_same_holder_cannot_wait_twice_or_wait_while_it_holds(ledger):
    q = Queue(ledger)
    q.enqueue(req("ann", "j", 1))
    with pytest.raises(BadRequest, match="already waits"):
        q.enqueue(req("ann", "j", 1))
    ledger.admit(req("ann", "k", 1))
    with pytest.raises(BadRequest, match="already holds"):
        q.enqueue(req("ann", "k", 1))


def test_the_line_survives_a_restart(ledger, tmp_path):
    Queue(ledger).enqueue(req("ann", "j", 1, groups=("lab",)), priority=2, max_runtime=H)
    again = Queue(Ledger(ledger.url))
    [e] = again.entries()
    assert (e.user, e.holder, e.priority, e.max_runtime, e.position) == ("ann", "j", 2, H, 1)


def test_budgets_wait_instead_of_refusing(ledger):
    ledger.set_quota("user", "ann", Quota(4, gpu_hours=1.0, window_hours=24), actor="admin")
    a = ledger.admit(req("ann", "old", 1), now=T - 2 * H)
    ledger.release(a.id, now=T - H + 1)  # ~1 GPU-hour used in the window
    q = Queue(ledger)
    e = q.enqueue(req("ann", "new", 1), now=T)
    assert q.schedule(now=T).started == []
    [w] = q.entries(now=T)
    assert w.id == e.id and "GPU-hour budget" in w.reason
    ledger.set_quota("user", "ann", Quota(4, gpu_hours=5.0, window_hours=24), actor="admin")
    assert [x.id for x, _ in q.schedule(now=T + 1).started] == [e.id]


def test_fair_share_from_the_ledgers_history(ledger):
    # ann used four GPUs for the last day; bob nothing: bob's later entry goes first
    a = ledger.admit(req("ann", "past", 4), now=T - 24 * H)
    ledger.release(a.id, now=T - 10)
    q = Queue(ledger, half_life_hours=24)
    first = q.enqueue(req("ann", "a1", 4), now=T)
    second = q.enqueue(req("bob", "b1", 4), now=T + 1)
    assert [e.id for e in q.entries(now=T + 2)] == [second.id, first.id]
    assert [e.id for e, _ in q.schedule(now=T + 2).started] == [second.id]


def test_borrowing_preemption_and_requeue(ledger):
    ledger.set_quota("user", "ann", Quota(1), actor="admin")
    ledger.set_quota("user", "bob", Quota(3), actor="admin")
    q = Queue(ledger)
    mine = q.enqueue(req("ann", "mine", 1), now=T)
    extra = q.enqueue(req("ann", "extra", 3), preemptible=True, now=T + 1)
    started = q.schedule(now=T + 2).started
    assert {e.id: e.borrowed for e, _ in started} == {mine.id: False, extra.id: True}
    alloc = {e.id: a for e, a in started}
    # bob's work within his quota needs three GPUs: ann's borrowed job is preempted
    b = q.enqueue(req("bob", "b", 3), now=T + 3)
    p = q.schedule(now=T + 4)
    assert p.started == [] and [(a.id, "Preempted" in why) for a, why in p.preempt] == \
        [(alloc[extra.id].id, True)]
    # while it stops, a second pass preempts nothing more and bob is next
    assert q.schedule(now=T + 5).preempt == []
    [bw] = q.entries(now=T + 5)
    assert bw.id == b.id and bw.estimated_start == T + 5
    # the caller stops it, releases and requeues: bob starts; ann's job waits again, saying why
    ledger.release(alloc[extra.id].id, "preempted", now=T + 6)
    assert q.requeue(extra.id) is not None
    assert [e.id for e, _ in q.schedule(now=T + 7).started] == [b.id]
    [back] = q.entries(now=T + 8)
    assert back.id == extra.id and back.reason.startswith("Preempted")
    assert back.submitted_at == T + 1  # its old place


def test_admins_hold_release_top_and_cancel_with_an_audit(ledger):
    ledger.admit(req("zed", "all", 4), now=T)
    q = Queue(ledger)
    a = q.enqueue(req("ann", "a", 1), now=T + 1)
    b = q.enqueue(req("bob", "b", 1), now=T + 2)
    assert q.act(a.id, "hold", "admin").held
    assert [(e.id, e.position) for e in q.entries()] == [(b.id, 1), (a.id, None)]
    q.act(a.id, "release", "admin")
    q.act(b.id, "top", "admin")
    assert [e.id for e in q.entries()] == [b.id, a.id]
    assert q.act(a.id, "cancel", "admin").state == "cancelled"
    assert [e.id for e in q.entries()] == [b.id]
    actions = [json_new["action"] for json_new in (r["new"] for r in ledger.audit())
               if json_new and "action" in json_new]
    assert actions == ["cancel", "top", "release", "hold"]
    # the owner cancelling their own entry is not an admin action
    assert q.cancel(b.id, "bob").state == "cancelled"
    assert len([r for r in ledger.audit() if r["scope"] == "queue"]) == 4
    with pytest.raises(BadRequest):
        q.act(b.id, "explode", "admin")
    assert q.act(b.id, "hold", "admin") is None  # no longer waiting


def test_a_notebook_that_waits_too_long_expires(ledger):
    ledger.admit(req("zed", "all", 4), now=T)
    q = Queue(ledger)
    nb = q.enqueue(req("ann", "", 1, kind="notebook"), wait_until=T + 60, now=T)
    assert q.schedule(now=T + 30).expired == []
    [gone] = q.schedule(now=T + 61).expired
    assert gone.id == nb.id and "longest wait" in gone.reason
    assert q.entries() == []


def test_concurrent_passes_and_admissions_never_hand_a_gpu_out_twice(ledger):
    q = Queue(ledger)
    for i in range(12):
        q.enqueue(req(f"u{i % 4}", f"j{i}", 1 + i % 2))
    errors = []

    def passes():
        try:
            for _ in range(10):
                q.schedule()
        except Exception as e:  # pragma: no cover - the assertion below shows it
            errors.append(e)

    def admissions(n):
        for i in range(10):
            try:
                a = ledger.admit(req(f"d{n}", f"x{i}", 1))
                ledger.release(a.id)
            except NotEnoughGPUs:
                pass

    threads = [threading.Thread(target=passes) for _ in range(3)] + \
        [threading.Thread(target=admissions, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    held = [d for a in ledger.open_allocations() for d in a.devices]
    assert len(held) == len(set(held)) and len(held) <= 4


def test_a_model_prefix_waits_and_starts_as_profiles_match_models(tmp_path):
    """A notebook profile may name a prefix of the product (``NVIDIA-H100`` for
    ``NVIDIA-H100-80GB-HBM3``): the hub's and the service's queue (`queue_of`) match it as
    the ledger's admission does, instead of refusing it as a model the machine lacks."""
    from gpulab.hub.quota.waiting import GPUQueue, queue_of

    lg = Ledger(f"sqlite:///{tmp_path}/models.sqlite")
    lg.migrate()
    lg.sync_inventory([DeviceInfo(0, model="NVIDIA-H100-80GB-HBM3")])
    held = lg.admit(req("bob", "j", 1))
    queue = queue_of(lg, GPUQueue())
    e = queue.enqueue(req("ann", "default", 1, kind="notebook", model="NVIDIA-H100"))
    assert queue.entries()[0].position == 1
    with pytest.raises(QueueRefused, match="NVIDIA-A10"):  # a model the machine lacks
        queue.enqueue(req("ann", "other", 1, kind="notebook", model="NVIDIA-A10"))
    lg.release(held.id)
    assert [s.id for s, _ in queue.schedule().started] == [e.id]


def test_estimates_count_the_time_limit_of_work_admitted_at_once(ledger):
    # issue 37: a job admitted at once (no queue entry) with max_runtime 300 holds the GPUs;
    # the wait behind it is estimated from its limit, which its allocation keeps
    q = Queue(ledger)
    held = ledger.admit(req("bob", "fast", 4, max_runtime=300.0), now=T)
    assert held.max_runtime == 300.0 and ledger.get(held.id).max_runtime == 300.0
    w = q.enqueue(req("ann", "next", 2), max_runtime=600.0, now=T + 10)
    (e,) = q.entries(now=T + 100)
    assert e.id == w.id and e.estimated_start == T + 300
    assert "estimated start" in e.reason
    # a notebook holding them has no limit: unknown, and the reason says why
    ledger.release(held.id, now=T + 120)
    nb = ledger.admit(req("bob", "nb", 4, kind="notebook"), now=T + 130)
    assert nb.max_runtime is None
    (e,) = q.entries(now=T + 140)
    assert e.estimated_start is None
    assert "a notebook using them has no time limit" in e.reason
    # work a pass admits keeps the limit its entry had
    ledger.release(nb.id, now=T + 150)
    q.schedule(now=T + 160)
    (alloc,) = [a for a in ledger.open_allocations() if a.holder == "next"]
    assert alloc.max_runtime == 600.0


def test_many_reads_of_the_line_cost_one_plan_and_each_sees_only_their_own(ledger):
    """``GET queue`` and ``GET jobs`` read the line (`Queue.entries`) on every poll; the plan
    is shared for a second while nothing changed (issue 40: 26 % of the service's samples
    under steady load were plans), the filter by person is each read's own: ann never sees
    bob's entry through it, and any write (a submission here, another process's, a release)
    plans again at the next read."""
    q = Queue(ledger)
    ledger.admit(req("cyd", "all", 4), now=T)
    a = q.enqueue(req("ann", "a1", 1), now=T + 1)
    b = q.enqueue(req("bob", "b1", 1), now=T + 2)
    readers = ["ann", "bob", None] * 8
    seen: dict[int, list] = {}
    start = threading.Barrier(len(readers))

    def read(i, who):
        start.wait()
        seen[i] = q.entries(who, now=T + 3)

    threads = [threading.Thread(target=read, args=(i, w)) for i, w in enumerate(readers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert q.plans == 1
    for i, who in enumerate(readers):
        want = {"ann": [a.id], "bob": [b.id], None: [a.id, b.id]}[who]
        assert [e.id for e in seen[i]] == want, (who, seen[i])
    assert [e.position for e in q.entries(None, now=T + 3)] == [1, 2] and q.plans == 1
    # bob's own new submission shows in his next read
    b2 = q.enqueue(req("bob", "b2", 1), now=T + 3)
    assert [e.id for e in q.entries("bob", now=T + 3)] == [b.id, b2.id] and q.plans == 2
    assert [e.id for e in q.entries("ann", now=T + 3)] == [a.id] and q.plans == 2
    # a write by another process (the hub's spawner queues a notebook): seen in the database
    other = Queue(ledger)
    nb = other.enqueue(req("ann", "nb", 1, kind="notebook"), now=T + 3)
    assert [e.id for e in q.entries("ann", now=T + 3)] == [a.id, nb.id] and q.plans == 3
    # a release: the GPUs are free, the reads say so at once
    ledger.release(ledger.open_allocations(user="cyd")[0].id, now=T + 3)
    assert q.entries("ann", now=T + 3)[0].reason.startswith("Its GPUs are free")
    assert q.plans == 4
    # and a second later (estimates move with the clock) it plans again
    q.entries("ann", now=T + 3.5)
    assert q.plans == 4
    q.entries("ann", now=T + 4.5)
    assert q.plans == 5
