"""A GPU notebook that waits in the queue (LocalGPUSpawner): the ``gpu_wait_minutes`` option,
the wait loop's decisions and messages, and the loop itself against a real SQLite ledger and
queue (the spawner made in-process: no server is started, only its GPUs are admitted)."""

import asyncio
import time
from types import SimpleNamespace

import pytest
from traitlets.config import Config

from gpulab.hub.quota.ledger import Request
from gpulab.hub.quota.waiting import LEFT_REASON, Entry, GPUQueue, Queue
from gpulab.hub.machine.inventory import GPUInventory
from gpulab.spawner.local import LocalGPUSpawner
from gpulab.hub.quota.settings import GPULedger
from gpulab.spawner.mixin import OptionRefused, SpawnRefused, hub_ledger
from gpulab.spawner.profiles import OptionError, options_from_formdata
from gpulab.spawner.queuewait import (WAIT_KEY, allowed_waits, decide, parse_wait_minutes,
                                      progress_message)


# -- the option --------------------------------------------------------------------------------

@pytest.mark.parametrize("value, minutes", [
    (0, 0), (5, 5), (15, 15), (60, 60), ("15", 15), (["5"], 5), (" 60 ", 60),
], ids=["0", "5", "15", "60", "text", "form-list", "spaces"])
def test_allowed_waits_are_read(value, minutes):
    assert parse_wait_minutes({WAIT_KEY: value}, 60) == minutes


@pytest.mark.parametrize("value", [7, -5, 61, 120, True, 5.0, "5 min", "", None, [5, 15],
                                   {"m": 5}, "9" * 50, "\u00b2", "\u0665", "\uff15"],
                         ids=["7", "negative", "61", "120", "bool", "float", "words", "empty",
                              "null", "list", "object", "huge", "superscript", "arabic-indic",
                              "fullwidth"])
def test_other_values_are_refused_with_the_allowed_ones(value):
    with pytest.raises(OptionError) as e:
        parse_wait_minutes({WAIT_KEY: value}, 60)
    assert str(e.value).startswith("'gpu_wait_minutes' (how long your server may wait for busy "
                                   "GPUs, in minutes; 0: don't wait) must be one of 0, 5, 15, "
                                   "60, got ")
    assert len(str(e.value)) < 250  # a huge value is cut short


def test_the_operators_cap_limits_the_choices():
    assert allowed_waits(60) == (0, 5, 15, 60)
    assert allowed_waits(30) == (0, 5, 15)
    assert allowed_waits(0) == (0,)
    assert parse_wait_minutes({}, 60) == 0  # absent: don't wait, as before
    with pytest.raises(OptionError, match=r"must be one of 0, 5, 15, got 60"):
        parse_wait_minutes({WAIT_KEY: 60}, 15)
    with pytest.raises(OptionError, match="this hub does not let servers wait for busy GPUs"):
        parse_wait_minutes({WAIT_KEY: 5}, 0)
    assert parse_wait_minutes({WAIT_KEY: 0}, 0) == 0


def test_the_cap_is_a_documented_trait_that_refuses_negatives():
    assert GPUQueue().longest_notebook_wait_minutes == 60
    c = Config()
    c.GPUQueue.longest_notebook_wait_minutes = 15
    assert GPUQueue(config=c).longest_notebook_wait_minutes == 15
    with pytest.raises(Exception, match="must be 0 or more"):
        GPUQueue(longest_notebook_wait_minutes=-1)


# -- the loop's decisions and messages ------------------------------------------------------

def entry(**kw) -> Entry:
    base = dict(id="e" * 32, user="ann", kind="notebook", holder="default", gpus=1, model=None,
                submitted_at=1000.0, priority=0, max_runtime=None, preemptible=False,
                wait_until=None, held=False, top_at=None, state="waiting", allocation_id=None,
                borrowed=False, reason="")
    base.update(kw)
    return Entry(**base)


def test_the_loop_waits_adopts_or_fails_with_the_reason():
    assert decide(entry()) == ("wait", "")
    assert decide(entry(state="admitted", allocation_id="a" * 32)) == ("admitted", "")
    expired = entry(state="expired", reason="The longest wait chosen passed before GPUs were "
                                            "free; nothing was started.")
    assert decide(expired) == ("refused", expired.reason)
    assert decide(entry(state="cancelled", reason=LEFT_REASON)) == (
        "refused", "You left the queue: your server was not started, and it holds no GPUs.")
    what, message = decide(entry(state="cancelled", reason="Cancelled by an admin (root)."))
    assert what == "refused" and message == (
        "Your server is out of the GPU queue: Cancelled by an admin (root). It was not "
        "started, and it holds no GPUs.")
    assert decide(None)[0] == "refused"


def test_the_pending_page_says_where_the_server_stands():
    now = time.mktime((2026, 1, 5, 13, 53, 0, 0, 0, -1))
    e = entry(position=2, estimated_start=now + 12 * 60, ahead_gpus=4,
              reason="Waits for free GPUs: 0 of 4 are free.", wait_until=now + 27 * 60)
    assert progress_message(e, now) == (
        "Waiting for GPUs: 2nd in line · starts in about 12 min (14:05) · 4 GPUs of work "
        "ahead · Waits for free GPUs: 0 of 4 are free · you wait until 14:20")
    first = entry(position=1, estimated_start=None, ahead_gpus=0, reason="")
    assert progress_message(first, now) == "Waiting for GPUs: next in line · start unknown"


# -- the spawner: options, form, and the wait against a real ledger ----------------------------

@pytest.fixture
def config(tmp_path):
    c = Config()
    c.GPULedger.db_url = f"sqlite:///{tmp_path / 'gpulab.sqlite'}"
    c.GPUInventory.source = "simulated"
    c.GPUInventory.simulated_gpus = 1
    c.LocalGPUSpawner.profile_list = [
        {"display_name": "CPU only", "slug": "cpu", "default": True},
        {"display_name": "1 GPU", "slug": "gpu-1",
         "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "1"}}},
        {"display_name": "2 GPUs", "slug": "gpu-2",
         "kubespawner_override": {"extra_resource_limits": {"nvidia.com/gpu": "2"}}},
    ]
    GPULedger.clear_instance()
    GPUInventory.clear_instance()
    yield c
    GPULedger.clear_instance()
    GPUInventory.clear_instance()


async def until(check, what: str, timeout: float = 30.0):
    """Poll ``check`` (every 20 ms) until it is true; fail after ``timeout`` seconds (a loaded
    machine, as CI's, may take seconds where a quiet one takes milliseconds)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def spawner(config, options=None) -> LocalGPUSpawner:
    """ann's default server (no hub: only what admission and the form need of it)."""
    user = SimpleNamespace(name="ann", id=1, groups=[], url="/user/ann/")
    s = LocalGPUSpawner(config=config, user=user)
    s.gpu_queue_poll_seconds = 0.05
    s.user_options = options or {}
    return s


def test_the_option_passes_strict_validation_and_bad_values_get_400(config):
    s = spawner(config)
    assert s.gpu_strict_options
    assert s.gpu_selection({"profile": "gpu-1", WAIT_KEY: 15}).profile.slug == "gpu-1"
    with pytest.raises(OptionRefused) as e:
        s.gpu_selection({"profile": "gpu-1", WAIT_KEY: 7})
    assert e.value.status_code == 400 and "must be one of 0, 5, 15, 60, got 7" in \
        e.value.jupyterhub_message
    with pytest.raises(OptionRefused, match="Unknown server option"):  # others still refused
        s.gpu_selection({"profile": "gpu-1", "gpus": 2})


def test_the_form_field_is_read_and_checked(config):
    s = spawner(config)
    assert s.options_from_form({"profile": ["gpu-1"], WAIT_KEY: ["5"]}) == {
        "profile": "gpu-1", WAIT_KEY: 5}
    for bad in ("600", "\u00b2", "\u0665"):  # "²" once reached int(): a 500
        # the form is only read (the base class's contract); the start refuses it (400)
        options = s.options_from_form({"profile": ["gpu-1"], WAIT_KEY: [bad]})
        with pytest.raises(SpawnRefused) as e:
            s.gpu_selection(options)
        assert e.value.status_code == 400, bad
    # KubeSpawner's reading knows nothing of it: another field
    assert options_from_formdata({"profile": ["gpu-1"], WAIT_KEY: ["5"]})[1] == [WAIT_KEY]


async def test_the_form_offers_waits_and_lets_a_busy_profile_be_chosen(config):
    s = spawner(config, options={"profile": "gpu-1", WAIT_KEY: 15})
    ledger = await asyncio.to_thread(hub_ledger, config)
    held = ledger.admit(Request(user="bob", kind="job", holder="j", gpus=1))
    try:
        page = await s.render_gpu_form()
    finally:
        ledger.release(held.id)
    assert '<select class="form-select form-select-sm w-auto" id="gpu_wait_minutes" ' \
           'name="gpu_wait_minutes">' in page
    assert '<option value="15" selected>wait up to 15 min</option>' in page
    assert "don't wait" in page.replace("&#39;", "'")
    assert "busy now: only 0 free now; it can wait in the queue" in page
    # more GPUs than the machine has never starts: still not selectable
    assert "unavailable: this machine has 1 matching GPU(s)" in page


async def test_the_form_offers_no_wait_when_the_queue_is_off(config):
    config.GPUQueue.enabled = False
    s = spawner(config)
    assert s.gpu_wait_choices() == (0,)
    assert "gpu_wait_minutes" not in await s.render_gpu_form()
    with pytest.raises(OptionRefused, match="does not let servers wait"):
        s.gpu_selection({"profile": "gpu-1", WAIT_KEY: 5})


def test_the_wait_is_added_to_start_timeout_for_that_start(config):
    config.Spawner.start_timeout = 90
    s = spawner(config)
    assert s.start_timeout == 90
    s.user_options = {"profile": "gpu-1", WAIT_KEY: 5}
    assert s.start_timeout == 90 + 300
    s.user_options = {"profile": "gpu-1", WAIT_KEY: 5}  # the same options again: no change
    assert s.start_timeout == 90 + 300
    s._gpu_restore_start_timeout()
    assert s.start_timeout == 90
    s.user_options = {"profile": "gpu-1", WAIT_KEY: 5}  # set again for the next start
    assert s.start_timeout == 390
    s.user_options = {"profile": "gpu-1"}
    assert s.start_timeout == 90
    s.user_options = {"profile": "gpu-1", WAIT_KEY: "bad"}  # refused by start, not here
    assert s.start_timeout == 90


async def test_a_waiting_start_adopts_the_gpus_when_they_come_back(config):
    ledger = await asyncio.to_thread(hub_ledger, config)
    job = ledger.admit(Request(user="bob", kind="job", holder="j", gpus=1))
    s = spawner(config, options={"profile": "gpu-1", WAIT_KEY: 5})
    profile = s._apply_profile(s.gpu_selection())
    task = asyncio.ensure_future(s.admit_gpus(profile))
    await until(lambda: s.gpu_queue_entry, "the start in line")
    queue = Queue(ledger)
    [mine] = queue.entries("ann")
    assert mine.holder == "default" and mine.position == 1 and mine.kind == "notebook"
    assert mine.wait_until == pytest.approx(time.time() + 300, abs=10)
    events = s.progress()
    assert (await events.__anext__())["message"] == "Spawning server..."
    waiting = await events.__anext__()
    assert waiting["message"].startswith("Waiting for GPUs: next in line")
    assert "Leave the queue</a>" in waiting["html_message"]
    assert waiting["gpulab_queue"] == {"entry": mine.id}
    ledger.release(job.id)
    gpus = await asyncio.wait_for(task, 10)
    assert [g.index for g in gpus] == [0] and s.gpu_claim_id
    assert (await asyncio.wait_for(events.__anext__(), 5))["message"] == \
        "GPUs are free: starting your server."
    await events.aclose()
    assert queue.get(mine.id).state == "admitted"
    await s.release_gpus_async()
    await s._gpu_forget_queue_entry("server stopped")  # what stop does
    assert queue.get(mine.id).state == "cancelled"
    assert ledger.open_allocations() == []


async def test_a_cancelled_wait_leaves_the_line_and_holds_nothing(config):
    ledger = await asyncio.to_thread(hub_ledger, config)
    job = ledger.admit(Request(user="bob", kind="job", holder="j", gpus=1))
    s = spawner(config, options={"profile": "gpu-1", WAIT_KEY: 5})
    task = asyncio.ensure_future(s.admit_gpus(s._apply_profile(s.gpu_selection())))
    await until(lambda: s.gpu_queue_entry, "the start in line")
    entry_id = s.gpu_queue_entry
    task.cancel()  # start_timeout, or the hub stopping the pending server
    with pytest.raises(asyncio.CancelledError):
        await task
    queue = Queue(ledger)
    await until(lambda: queue.get(entry_id).state == "cancelled", "the entry cancelled")
    assert queue.get(entry_id).state == "cancelled" and queue.entries() == []
    ledger.release(job.id)
    queue.schedule()
    assert ledger.open_allocations() == [] and not s.gpu_claim_id


async def test_leaving_the_line_fails_the_start_with_the_words(config):
    ledger = await asyncio.to_thread(hub_ledger, config)
    job = ledger.admit(Request(user="bob", kind="job", holder="j", gpus=1))
    s = spawner(config, options={"profile": "gpu-1", WAIT_KEY: 5})
    task = asyncio.ensure_future(s.admit_gpus(s._apply_profile(s.gpu_selection())))
    await until(lambda: s.gpu_queue_entry, "the start in line")
    assert Queue(ledger).cancel(s.gpu_queue_entry, "ann", LEFT_REASON) is not None
    with pytest.raises(SpawnRefused) as e:
        await asyncio.wait_for(task, 10)
    assert e.value.status_code == 409
    assert e.value.jupyterhub_message.startswith("You left the queue")
    ledger.release(job.id)
    assert ledger.open_allocations() == [] and not s.gpu_claim_id


async def test_what_could_never_run_and_dont_wait_are_refused_at_once(config):
    ledger = await asyncio.to_thread(hub_ledger, config)
    job = ledger.admit(Request(user="bob", kind="job", holder="j", gpus=1))
    try:
        s = spawner(config, options={"profile": "gpu-1"})  # don't wait
        with pytest.raises(SpawnRefused) as e:
            await s.admit_gpus(s._apply_profile(s.gpu_selection()))
        assert e.value.status_code == 409 and "Cannot start with profile '1 GPU'" in \
            e.value.jupyterhub_message
        s = spawner(config, options={"profile": "gpu-2", WAIT_KEY: 5})  # more than exist
        with pytest.raises(SpawnRefused) as e:
            await s.admit_gpus(s._apply_profile(s.gpu_selection()))
        assert e.value.status_code == 409 and not s.gpu_queue_entry
        assert Queue(ledger).entries() == []
    finally:
        ledger.release(job.id)


async def test_a_notebook_that_may_wait_queues_behind_whoever_waits(config):
    """Free GPUs are not taken ahead of the line: a start that may wait queues (as a job
    does), one that does not is refused while anyone waits (as a job with ``wait: false``),
    and admitted once nobody waits."""
    config.GPUInventory.simulated_gpus = 2
    ledger = await asyncio.to_thread(hub_ledger, config)
    queue = Queue(ledger)
    job = ledger.admit(Request(user="bob", kind="job", holder="j", gpus=1))
    ahead = queue.enqueue(Request(user="bob", kind="job", holder="big", gpus=2))
    s = spawner(config, options={"profile": "gpu-1", WAIT_KEY: 5})
    # a pass decides, in the fair-share order (bob's GPU-hours put ann first): the free GPU
    # is hers, through the line (her entry is admitted, not skipped past it), and bob's job,
    # which needs both, waits for it
    assert len(await asyncio.wait_for(s.admit_gpus(s._apply_profile(s.gpu_selection())), 30)) == 1
    (entry,) = queue.holders("notebook").values()
    assert (entry.user, entry.state) == ("ann", "admitted")
    assert [(e.holder, e.position) for e in queue.entries()] == [("big", 1)]
    await s.release_gpus_async()
    await s._gpu_forget_queue_entry("server stopped")
    # don't wait: one GPU is free, but bob's job waits for it: refused with the words
    now = spawner(config, options={"profile": "gpu-1"})
    with pytest.raises(SpawnRefused) as e:
        await now.admit_gpus(now._apply_profile(now.gpu_selection()))
    assert e.value.status_code == 409, e.value.jupyterhub_message
    assert "1 request already waits for GPUs" in e.value.jupyterhub_message
    assert '"If the GPUs are busy"' in e.value.jupyterhub_message
    assert not now.gpu_claim_id and not now.gpu_queue_entry
    assert [h.holder for h in ledger.open_allocations(user="ann")] == []
    # nobody waits: it starts now, as without a queue
    queue.cancel(ahead.id, "bob")
    assert len(await now.admit_gpus(now._apply_profile(now.gpu_selection()))) == 1
    await now.release_gpus_async()
    ledger.release(job.id)


def test_waits_the_hub_did_not_survive_leave_the_line(config):
    ledger = hub_ledger(config)
    queue = Queue(ledger)
    gone = queue.enqueue(Request(user="ann", kind="notebook", holder="a", gpus=1))
    kept = queue.enqueue(Request(user="ann", kind="notebook", holder="b", gpus=1))
    job = queue.enqueue(Request(user="bob", kind="job", holder="j", gpus=1))
    queue.schedule()  # one GPU: the first in line is admitted
    admitted = queue.get(gone.id)
    assert admitted.state == "admitted"
    assert queue.forget_notebooks_except(set(), "the hub restarted") == 2
    assert {queue.get(e.id).state for e in (gone, kept)} == {"cancelled"}
    assert queue.get(job.id).state == "waiting"  # jobs are the service's
    ledger.release(admitted.allocation_id)
    restored = queue.enqueue(Request(user="ann", kind="notebook", holder="c", gpus=1))
    queue.cancel(job.id, "bob")
    queue.schedule()
    alloc = queue.get(restored.id).allocation_id
    assert queue.forget_notebooks_except({alloc}, "the hub restarted") == 0
    assert queue.get(restored.id).state == "admitted"
    ledger.release(alloc)
