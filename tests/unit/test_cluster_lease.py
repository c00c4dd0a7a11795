"""A held cluster's life (issue 38), the backend-neutral part (`JobBackend.lease` and
`_cluster_lifecycle_pass`): it ends when the kernel's lease lapses, waiting in line too, and
when the kernel says it has dispatched no step for the operator's idle time; a renewal keeps
it; only clusters take leases.

A real `LocalJobBackend` on a SQLite ledger with one GPU, held by a notebook of bob's so that
the cluster waits in line and no process starts (the idle case marks it Running by hand)."""

from __future__ import annotations

import dataclasses
import time

import pytest

from gpulab.hub.jobs.base import JobError
from gpulab.hub.jobs.local import LocalJobBackend, UserAccount
from gpulab.hub.jobs.spec import DEFAULT_LIMITS, parse_spec
from gpulab.hub.jobs.store import JobRow
from gpulab.hub.quota.ledger import DeviceInfo, Ledger, Request
from gpulab.hub.quota.waiting import Queue

CLUSTER = {"name": "held", "kind": "cluster", "strategy": "parameter-server",
           "replicas": {"ps": 1, "worker": 1}, "resources": {"worker": {"gpus": 1}}}


@pytest.fixture
def ledger(tmp_path):
    lg = Ledger(f"sqlite:///{tmp_path}/ledger.sqlite")
    lg.migrate()
    lg.sync_inventory([DeviceInfo(0)])
    return lg


@pytest.fixture
async def queued(ledger, tmp_path):
    """ann's cluster, Queued behind bob's notebook; the backend with a 60 s lease."""
    (tmp_path / "ann").mkdir()
    b = LocalJobBackend(ledger, lambda user: UserAccount(user, tmp_path / user),
                        sandboxed=False, queue=Queue(ledger))
    b.limits = dataclasses.replace(DEFAULT_LIMITS, cluster_lease_timeout=60,
                                   cluster_idle_timeout=600)
    nb = ledger.admit(Request("bob", "notebook", "nb", 1))
    view = await b.submit("ann", (), parse_spec(CLUSTER))
    assert view["state"] == "Queued" and view["kind"] == "cluster", view
    assert view["cluster"] == {"ps": [view["cluster"]["ps"][0]],
                               "worker": [view["cluster"]["worker"][0]]}
    yield b
    await b.shutdown()
    ledger.release(nb.id)


async def lifecycle(b):
    async with b._lock:
        await b._cluster_lifecycle_pass()


async def test_a_renewed_lease_keeps_a_cluster_and_a_lapsed_one_ends_it(queued, ledger):
    b = queued
    view = await b.lease("ann", "held", 0)
    assert view["lease"] == {"timeout": 60, "idle_timeout": 600}
    await lifecycle(b)
    assert b.get("ann", "held")["state"] == "Queued"
    b.limits = dataclasses.replace(b.limits, cluster_lease_timeout=0)  # time passes
    await b.lease("ann", "held", 0)
    await lifecycle(b)
    view = b.get("ann", "held")
    assert view["state"] == "Stopped" and "lease lapsed" in view["reason"], view
    assert Queue(ledger).of_holder("ann", "job", "held") is None  # it left the line
    with pytest.raises(JobError) as e:
        await b.lease("ann", "held", 0)
    assert e.value.status == 409 and "has ended" in e.value.message


async def test_a_cluster_idle_past_the_operators_time_ends(queued, ledger):
    b = queued
    await b.shutdown()  # (no supervision pass: no process runs here)
    b.ensure_supervisor = lambda: None
    with ledger.Session.begin() as s:  # as if it had started an hour ago
        s.query(JobRow).filter_by(user="ann", name="held").update(
            {"state": "Running", "started_at": time.time() - 3600})
    await b.lease("ann", "held", 599)
    await lifecycle(b)
    assert b.get("ann", "held")["state"] == "Running"
    await b.lease("ann", "held", 601)
    await lifecycle(b)
    view = b.get("ann", "held")
    assert view["state"] == "Stopped" and "idle" in view["reason"], view
    assert "cluster_idle_timeout" in view["reason"]


async def test_waiting_in_line_is_not_idleness(queued, ledger):
    b = queued
    await b.shutdown()
    b.ensure_supervisor = lambda: None
    with ledger.Session.begin() as s:  # it waited long and has just started
        s.query(JobRow).filter_by(user="ann", name="held").update(
            {"state": "Running", "started_at": time.time() - 5})
    await b.lease("ann", "held", 5000)  # the kernel's count began when it asked
    await lifecycle(b)
    assert b.get("ann", "held")["state"] == "Running"


async def test_only_a_persons_own_clusters_take_leases(queued):
    b = queued
    with pytest.raises(JobError) as e:
        await b.lease("eve", "held", 0)
    assert e.value.status == 404
    assert b.active_clusters() == {("ann", "held")}


async def test_the_api_says_cluster_for_a_held_clusters_place_in_line(queued):
    """`GET queue` and `me` (through `mark_cluster_kinds`) name a held cluster's entry and
    holding ``cluster`` (the queue and the ledger hold it as a job's); a plain job of the same
    person stays ``job``, and the same name of another person is not taken for it."""
    from types import SimpleNamespace

    from gpulab.hub.service.base import mark_cluster_kinds
    from gpulab.hub.service.queue import entry_view

    b = queued
    plain = await b.submit("ann", (), parse_spec({
        "name": "plain", "strategy": "multi-worker-mirrored", "replicas": {"worker": 1},
        "source": "print(1)",
        "resources": {"worker": {"gpus": 1}}}))
    assert plain["state"] == "Queued", plain
    now = time.time()
    entries = [entry_view(e, now) for e in b.queue.entries(None, now)]
    holdings = [{"kind": "job", "user": "ann", "name": "held"},
                {"kind": "job", "user": "eve", "name": "held"},
                {"kind": "notebook", "user": "ann", "name": "held"}]
    await mark_cluster_kinds(SimpleNamespace(settings={"jobs": b}), holdings, entries)
    assert sorted((e["holder"], e["kind"]) for e in entries if e["user"] == "ann") == [
        ("held", "cluster"), ("plain", "job")], entries
    assert [h["kind"] for h in holdings] == ["cluster", "job", "notebook"]
    await b.stop("ann", "plain")
