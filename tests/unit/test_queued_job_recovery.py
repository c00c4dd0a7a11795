"""A queued job that a scheduling pass admitted, but whose start had not run yet when the
service stopped, starts after the restart (attacker review of issue 17): the restart does not
close its GPUs as an orphan's, and where they went back anyway it waits again in its place
instead of staying Queued outside the line for ever.

A real `LocalJobBackend` on a SQLite ledger with one GPU; nothing is launched (the GPU is
held by someone else whenever a pass could start the job), so no process starts."""

from __future__ import annotations

import pytest

from gpulab.hub.jobs.local import LocalJobBackend, UserAccount
from gpulab.hub.jobs.spec import parse_spec
from gpulab.hub.quota.ledger import DeviceInfo, Ledger, Request
from gpulab.hub.quota.waiting import Queue

SPEC = {"name": "later", "strategy": "multi-worker-mirrored", "replicas": {"worker": 1},
        "resources": {"worker": {"gpus": 1}}, "source": "print(1)"}


@pytest.fixture
def ledger(tmp_path):
    lg = Ledger(f"sqlite:///{tmp_path}/ledger.sqlite")
    lg.migrate()
    lg.sync_inventory([DeviceInfo(0)])
    return lg


def backend(ledger, tmp_path) -> LocalJobBackend:
    return LocalJobBackend(ledger, lambda user: UserAccount(user, tmp_path / user),
                           sandboxed=False, queue=Queue(ledger))


async def test_an_admitted_queued_job_survives_a_restart_and_waits_again_if_its_gpus_went(
        ledger, tmp_path):
    (tmp_path / "ann").mkdir()
    before = backend(ledger, tmp_path)
    nb = ledger.admit(Request("bob", "notebook", "nb", 1))
    view = await before.submit("ann", (), parse_spec(SPEC))
    assert view["state"] == "Queued" and view["queue"]["position"] == 1, view
    await before.shutdown()  # the service stops (its supervisor with it)

    # bob's notebook ends; a pass (the hub's, while a notebook waits) admits ann's job
    ledger.release(nb.id)
    assert [e.holder for e, _ in Queue(ledger).schedule().started] == ["later"]
    entry = Queue(ledger).of_holder("ann", "job", "later")
    assert entry.state == "admitted"

    after = backend(ledger, tmp_path)  # the service starts again
    after.recover()
    allocation = ledger.get(entry.allocation_id)
    assert allocation is not None and allocation.open, allocation  # not closed as an orphan

    # were its GPUs given back before it started (by hand here; bob takes the GPU again),
    # the next pass puts it back in line rather than leaving it Queued outside it
    ledger.release(entry.allocation_id, "gone")
    nb = ledger.admit(Request("bob", "notebook", "nb", 1))
    async with after._lock:
        await after._queue_pass()
    assert Queue(ledger).of_holder("ann", "job", "later").state == "waiting"
    view = after.get("ann", "later")
    assert view["state"] == "Queued" and view["queue"]["position"] == 1, view
    assert "Waits for 1 GPU" in view["reason"], view  # the line's own words again
    await after.stop("ann", "later")
    await after.shutdown()
    ledger.release(nb.id)
    assert ledger.open_allocations() == []


async def test_a_stop_waits_for_the_pass_under_way(ledger, tmp_path, monkeypatch):
    """The queue's pass runs in a worker thread; a stop that only cancelled would return
    while it goes on (and may admit a job after the stop: this test file's first test failed
    so once, on a loaded machine). `shutdown` returns after the round under way ends."""
    import asyncio
    import threading
    import time

    (tmp_path / "ann").mkdir()
    b = backend(ledger, tmp_path)
    ledger.admit(Request("bob", "notebook", "nb", 1))
    in_pass, ended = threading.Event(), []
    schedule = b.queue.schedule

    def slow_schedule():
        in_pass.set()
        time.sleep(0.5)
        try:
            return schedule()
        finally:
            ended.append(time.monotonic())

    monkeypatch.setattr(b.queue, "schedule", slow_schedule)
    await b.submit("ann", (), parse_spec(SPEC))  # Queued; starts the supervisor
    assert await asyncio.to_thread(in_pass.wait, 10)
    await b.shutdown()
    stopped = time.monotonic()
    assert ended and ended[0] <= stopped  # the pass ended before the stop returned
