"""gpulab.hub.quota.queue: the queue's policy as tables, and simulated weeks on a simulated clock.

The policy is a pure function, so each rule is one row: fair share, gang admission, EASY
backfill that never delays the head, borrowing and the order of preemption, GPU-hour budgets,
what is refused at once. The simulations run the same `plan` pass after pass over days of a
simulated clock in well under a second.
"""

from __future__ import annotations

import math

import pytest

from gpulab.hub.quota.policy import Quota
from gpulab.hub.quota.queue import (Device, Person, Running, Settings, Waiting, decayed_usage,
                                    fair_share, order, plan, refusal_now)

H = 3600.0
H100 = [Device(i, "H100") for i in range(4)]
NOW = 1_000_000.0


def job(id, user, gpus, t=0.0, **kw):
    return Waiting(id, user, kw.pop("kind", "job"), gpus, NOW + t, **kw)


def run(id, user, devices, started=-H, **kw):
    return Running(id, user, kw.pop("kind", "job"), tuple(devices), NOW + started, **kw)


def q(n, **kw):
    return Quota(n, **kw)


# ---------------------------------------------------------------------------- fair share

def test_fair_share_factor_is_slurms_classic_one():
    f = fair_share({"a": Person(q(4), usage=0.0), "b": Person(q(4), usage=0.0)})
    assert f == {"a": 1.0, "b": 1.0}
    f = fair_share({"a": Person(q(4), usage=5.0), "b": Person(q(4), usage=5.0)})
    assert f["a"] == pytest.approx(0.5) and f["b"] == pytest.approx(0.5)
    f = fair_share({"a": Person(q(4), usage=9.0), "b": Person(q(4), usage=1.0)})
    assert f["a"] == pytest.approx(2 ** (-0.9 / 0.5)) and f["b"] == pytest.approx(2 ** (-0.2))
    # the share follows the quota unless set: a quota twice as large halves the weight of use
    f = fair_share({"a": Person(q(2), usage=1.0), "b": Person(q(6), usage=3.0)})
    assert f["a"] == pytest.approx(f["b"])
    f = fair_share({"a": Person(q(2), share=6.0, usage=3.0), "b": Person(q(6), usage=3.0)})
    assert f["a"] == pytest.approx(f["b"])


def test_decayed_usage_weighs_by_age_with_the_half_life():
    # one GPU for the last hour, half-life one hour: integral of 2**(-age/h) over [0, h]
    got = decayed_usage([("a", 1, NOW - H, None)], NOW, H)
    assert got["a"] == pytest.approx(0.5 / math.log(2))
    # the same hour a half-life earlier counts half; two GPUs count double
    older = decayed_usage([("a", 2, NOW - 2 * H, NOW - H)], NOW, H)["a"]
    assert older == pytest.approx(got["a"])
    assert decayed_usage([("b", 1, NOW, NOW)], NOW, H) == {"b": 0.0}
    with pytest.raises(ValueError):
        decayed_usage([], NOW, 0)


ORDER_ROWS = [
    # (name, queue, people, expected order)
    ("less recent use goes first",
     [job("a1", "a", 1, 0), job("b1", "b", 1, 10)],
     {"a": Person(q(4), usage=3.0), "b": Person(q(4), usage=1.0)}, ["b1", "a1"]),
    ("equal use: submit order",
     [job("b1", "b", 1, 10), job("a1", "a", 1, 0)],
     {"a": Person(q(4)), "b": Person(q(4))}, ["a1", "b1"]),
    ("within a person: priority, then submit order",
     [job("a1", "a", 1, 0), job("a2", "a", 1, 5, priority=3), job("a3", "a", 1, 1)],
     {"a": Person(q(4))}, ["a2", "a1", "a3"]),
    ("an admin's move to the top beats fair share; earlier moves first",
     [job("a1", "a", 1, 0), job("b1", "b", 1, 1, top=NOW + 50), job("b2", "b", 1, 2, top=NOW + 40)],
     {"a": Person(q(4)), "b": Person(q(4), usage=100.0)}, ["b2", "b1", "a1"]),
    ("held entries last",
     [job("a1", "a", 1, 0, held=True), job("b1", "b", 1, 1)],
     {"a": Person(q(4)), "b": Person(q(4), usage=9.0)}, ["b1", "a1"]),
]


@pytest.mark.parametrize("name,queue,people,expected", ORDER_ROWS, ids=[r[0] for r in ORDER_ROWS])
def test_order(name, queue, people, expected):
    assert [w.id for w in order(queue, people)] == expected


# --------------------------------------------------------------------- one pass, as tables

def started(p):
    return {s.id: s.devices for s in p.start}


def test_gang_starts_whole_or_not_at_all():
    p = plan(H100, [run("r", "x", [0, 1])], [job("g", "a", 3)], {"a": Person(q(4))}, NOW)
    assert p.start == []
    assert p.waiting["g"].position == 1
    assert "3 GPUs" in p.waiting["g"].reason and "2 of 4 are free" in p.waiting["g"].reason
    p = plan(H100, [run("r", "x", [0, 1])], [job("g", "a", 2)], {"a": Person(q(4))}, NOW)
    assert started(p) == {"g": (2, 3)}


BACKFILL = [
    # 4 H100: GPU 0 ends in 1 h, GPU 1 in 2 h, GPU 2 has no time limit, GPU 3 free.
    # The head asks for 2: it is promised GPUs 3 and 0, at NOW + 1 h.
    ("ends before the reservation: may use a reserved GPU", dict(max_runtime=0.5 * H), True),
    ("ends exactly at the reservation", dict(max_runtime=1.0 * H), True),
    ("would end after the reservation: waits", dict(max_runtime=1.5 * H), False),
    ("no time limit: waits", dict(), False),
]


@pytest.mark.parametrize("name,small,starts", BACKFILL, ids=[r[0] for r in BACKFILL])
def test_backfill_never_delays_the_head(name, small, starts):
    running = [run("r0", "x", [0], max_runtime=2 * H), run("r1", "x", [1], max_runtime=3 * H),
               run("r2", "x", [2])]
    queue = [job("head", "a", 2, 0), job("small", "b", 1, 10, **small)]
    people = {"a": Person(q(4)), "b": Person(q(4), usage=1.0), "x": Person(q(4))}
    p = plan(H100, running, queue, people, NOW)
    assert "head" not in started(p)
    assert p.waiting["head"].estimated_start == NOW + H
    assert p.waiting["head"].position == 1
    assert ("small" in started(p)) is starts
    if not starts:
        assert p.waiting["small"].position == 2
        assert p.waiting["small"].ahead == 1 and p.waiting["small"].ahead_gpus == 2


def test_unknown_reservation_time_keeps_reserved_gpus_free():
    # the head waits on work without a time limit: nothing may take its free GPU, not even
    # a short job (the unlimited work might end any moment)
    running = [run("r", "x", [0, 1, 2])]
    queue = [job("head", "a", 2), job("short", "b", 1, 5, max_runtime=60)]
    p = plan(H100, running, queue, {"a": Person(q(4)), "b": Person(q(4), usage=1.0)}, NOW)
    assert p.start == []
    assert p.waiting["head"].estimated_start is None
    assert "no time limit" in p.waiting["head"].reason


def test_backfill_outside_the_reservation_and_on_other_models():
    devices = H100 + [Device(4, "A100"), Device(5, "A100")]
    running = [run("r", "x", [0, 1], max_runtime=2 * H)]
    queue = [job("head", "a", 4, 0, model="H100"), job("a100", "b", 2, 1, model="A100"),
             job("anymodel", "c", 1, 2)]
    people = {"a": Person(q(8)), "b": Person(q(8), usage=1.0), "c": Person(q(8), usage=2.0)}
    p = plan(devices, running, queue, people, NOW)
    assert started(p) == {"a100": (4, 5)}  # GPUs 2 and 3 are the head's
    assert p.waiting["anymodel"].position == 2


def test_estimates_follow_the_line():
    running = [run("r", "x", [0, 1, 2, 3], max_runtime=2 * H)]  # ends NOW + 1 h
    queue = [job("first", "a", 4, 0, max_runtime=3 * H), job("second", "b", 2, 1, max_runtime=H)]
    p = plan(H100, running, queue, {"a": Person(q(4)), "b": Person(q(4), usage=1.0)}, NOW)
    assert p.waiting["first"].estimated_start == NOW + H
    assert p.waiting["second"].estimated_start == NOW + 4 * H
    assert [p.waiting[i].position for i in ("first", "second")] == [1, 2]


def test_quota_waits_with_its_reason_and_the_person_is_not_the_head():
    running = [run("mine", "a", [0, 1], max_runtime=2 * H)]
    queue = [job("a2", "a", 1, 0), job("b4", "b", 2, 1)]
    p = plan(H100, running, queue, {"a": Person(q(2)), "b": Person(q(4), usage=5.0)}, NOW)
    # a's entry waits for a's own work; b's is not kept from the free GPUs by it
    assert started(p) == {"b4": (2, 3)}
    assert p.waiting["a2"].reason.startswith("Waits for your quota: 2 of your 2 GPUs are in use")
    assert p.waiting["a2"].estimated_start == NOW + H


def test_budget_waits_instead_of_being_refused():
    budget = q(4, gpu_hours=10.0, window_hours=24)
    queue = [job("a1", "a", 1, 0), job("b1", "b", 1, 1)]
    people = {"a": Person(budget, budget_used=10.0), "b": Person(q(4), usage=9.0)}
    p = plan(H100, [], queue, people, NOW)
    assert started(p) == {"b1": (0,)}
    assert "GPU-hour budget" in p.waiting["a1"].reason and "10 of your 10" in p.waiting["a1"].reason
    assert p.waiting["a1"].estimated_start is None


def test_held_entries_wait_and_take_no_place():
    p = plan(H100, [], [job("a1", "a", 1, held=True), job("b1", "b", 1, 1)],
             {"a": Person(q(4)), "b": Person(q(4))}, NOW)
    assert started(p) == {"b1": (0,)}
    assert p.waiting["a1"].position is None and "Held by an admin" in p.waiting["a1"].reason
    assert p.order == ["b1", "a1"]


BORROW = [
    # a's quota is 1 and a holds 1: the second job is beyond quota
    ("preemptible job borrows an idle GPU", dict(preemptible=True), Settings(), True),
    ("not preemptible: waits for quota", dict(), Settings(), False),
    ("borrowing off: waits", dict(preemptible=True), Settings(borrowing=False), False),
    ("a notebook never borrows", dict(preemptible=True, kind="notebook"), Settings(), False),
]


@pytest.mark.parametrize("name,extra,settings,borrows", BORROW, ids=[r[0] for r in BORROW])
def test_borrowing(name, extra, settings, borrows):
    p = plan(H100, [run("a0", "a", [0])], [job("a1", "a", 1, **extra)], {"a": Person(q(1))},
             NOW, settings)
    if borrows:
        assert p.start[0].id == "a1" and p.start[0].borrowed
    else:
        assert p.start == [] and "quota" in p.waiting["a1"].reason


def test_borrowing_never_takes_a_reserved_gpu():
    running = [run("r", "x", [0, 1, 2], max_runtime=2 * H)]
    queue = [job("head", "b", 2, 0), job("borrow", "a", 1, 1, preemptible=True, max_runtime=60)]
    people = {"a": Person(q(0)), "b": Person(q(4)), "x": Person(q(4))}
    p = plan(H100, running, queue, people, NOW)
    assert p.start == []


def borrowed(id, user, devices, started, **kw):
    return run(id, user, devices, started, preemptible=True, borrowed=True, **kw)


PREEMPT = [
    # b (quota 2, holds nothing) needs 2 GPUs; all 4 are held by a (quota 2).
    ("youngest borrowed job first, only as many as needed",
     [run("a-in", "a", [0, 1]), borrowed("old", "a", [2], -2 * H), borrowed("new", "a", [3], -H)],
     [job("b2", "b", 1)], ["new"]),
    ("two borrowed jobs when one is not enough",
     [run("a-in", "a", [0, 1]), borrowed("old", "a", [2], -2 * H), borrowed("new", "a", [3], -H)],
     [job("b2", "b", 2)], ["new", "old"]),
    ("work within quota is never preempted",
     [run("a-in", "a", [0, 1]), run("a-in2", "a", [2, 3])], [job("b2", "b", 2)], []),
    ("notebooks are never preempted",
     [run("a-in", "a", [0, 1]), borrowed("nb", "a", [2, 3], -H, kind="notebook")],
     [job("b2", "b", 2)], []),
    ("nothing stopped in vain when it would not be enough",
     [run("a-in", "a", [0, 1, 2]), borrowed("new", "a", [3], -H)], [job("b2", "b", 2)], []),
    ("started borrowing, now within quota: a's other work ended",
     [borrowed("was", "a", [0, 1], -H), run("c-in", "c", [2])], [job("b2", "b", 2)], []),
]


@pytest.mark.parametrize("name,running,queue,victims", PREEMPT, ids=[r[0] for r in PREEMPT])
def test_preemption_order(name, running, queue, victims):
    people = {"a": Person(q(2)), "b": Person(q(2)), "c": Person(q(2))}
    p = plan(H100, running, queue, people, NOW)
    assert [v.id for v in p.preempt] == victims
    assert p.start == []
    if victims:
        assert p.waiting[queue[0].id].estimated_start == NOW
        assert "being stopped" in p.waiting[queue[0].id].reason
        assert all("resumes from its last checkpoint" in v.reason for v in p.preempt)
        assert all("a" not in v.reason.split() and "b" not in v.reason.split() for v in p.preempt)


def test_work_being_preempted_is_not_preempted_twice_and_counts_as_coming_back():
    running = [run("a-in", "a", [0, 1]), borrowed("old", "a", [2], -2 * H),
               Running("new", "a", "job", (3,), NOW - H, preemptible=True, borrowed=True,
                       stopping=True)]
    people = {"a": Person(q(2)), "b": Person(q(2))}
    p = plan(H100, running, [job("b1", "b", 1)], people, NOW)
    assert p.preempt == [] and p.waiting["b1"].estimated_start == NOW
    p = plan(H100, running, [job("b2", "b", 2)], people, NOW)
    assert [v.id for v in p.preempt] == ["old"]


def test_a_borrowing_entry_preempts_nobody():
    running = [run("a-in", "a", [0, 1]), borrowed("x", "a", [2, 3], -H)]
    queue = [job("c", "c", 1, preemptible=True)]  # c's quota is 0: it could only borrow
    p = plan(H100, running, queue, {"a": Person(q(2)), "c": Person(q(0))}, NOW)
    assert p.preempt == [] and p.start == []


REFUSE = [
    (5, None, q(8), "this machine has 4"),
    (2, "A100", q(8), "of model 'A100'; this machine has 0"),
    (3, None, q(8, max_per_request=2), "at most 2 in one request"),
    (3, None, q(2), "your quota is 2 GPUs at once"),
    (2, None, q(2), None),
    (4, "H100", None, None),
]


@pytest.mark.parametrize("gpus,model,quota,expected", REFUSE)
def test_what_can_never_run_is_refused_at_once(gpus, model, quota, expected):
    got = refusal_now(gpus, model, quota, H100)
    if expected is None:
        assert got is None
    else:
        assert expected in got


def test_a_preemptible_job_may_ask_beyond_its_quota_but_not_beyond_the_machine():
    assert refusal_now(3, None, q(2), H100, borrows=True) is None
    assert "at most 2 in one request" in refusal_now(3, None, q(4, max_per_request=2), H100,
                                                     borrows=True)
    assert "this machine has 4" in refusal_now(5, None, q(2), H100, borrows=True)


# ----------------------------------------------------------------------------- simulations

class Sim:
    """Passes of `plan` on a simulated clock: jobs run exactly their runtime."""

    def __init__(self, devices, people_quota, half_life=24 * H, step=300.0):
        self.devices, self.quota, self.half_life, self.step = devices, people_quota, half_life, step
        self.t = NOW
        self.queue: dict[str, Waiting] = {}
        self.runtime: dict[str, float] = {}
        self.running: dict[str, Running] = {}
        self.history: list[tuple[str, int, float, float | None]] = []
        self.started_at: dict[str, float] = {}
        self.n = 0

    def submit(self, user, gpus, runtime, max_runtime=None):
        self.n += 1
        w = Waiting(f"{user}{self.n}", user, "job", gpus, self.t, max_runtime=max_runtime)
        self.queue[w.id] = w
        self.runtime[w.id] = runtime
        return w.id

    def tick(self):
        self.t += self.step
        for r in list(self.running.values()):
            if r.started_at + self.runtime[r.id] <= self.t:
                del self.running[r.id]
                self.history.append((r.user, r.gpus, r.started_at, r.started_at + self.runtime[r.id]))
        live = [(r.user, r.gpus, r.started_at, None) for r in self.running.values()]
        usage = decayed_usage(self.history + live, self.t, self.half_life)
        people = {u: Person(qt, usage=usage.get(u, 0.0)) for u, qt in self.quota.items()}
        p = plan(self.devices, self.running.values(), self.queue.values(), people, self.t)
        for s in p.start:
            w = self.queue.pop(s.id)
            self.running[w.id] = Running(w.id, w.user, "job", s.devices, self.t, w.max_runtime)
            self.started_at[w.id] = self.t
        return p

    def gpu_hours(self, since, until):
        out = {}
        rows = self.history + [(r.user, r.gpus, r.started_at, None) for r in self.running.values()]
        for user, gpus, a, b in rows:
            b = self.t if b is None else b
            lo, hi = max(a, since), min(b, until)
            if hi > lo:
                out[user] = out.get(user, 0.0) + gpus * (hi - lo) / H
        return out


def test_a_week_of_fair_share_with_one_person_submitting_ten_times_more():
    sim = Sim(H100, {"heavy": q(4), "light": q(4)}, step=1800.0)
    # both keep a backlog all week: light submits one four-hour one-GPU job an hour (the whole
    # machine's worth), heavy ten times as many
    for hour in range(7 * 24):
        sim.submit("light", 1, 4 * H)
        for _ in range(10):
            sim.submit("heavy", 1, 4 * H)
        for _ in range(int(H / sim.step)):
            sim.tick()
            users = {w.user for w in sim.queue.values()}
            assert users == {"light", "heavy"}  # both have work queued throughout
    used = sim.gpu_hours(NOW, sim.t)
    total = used["heavy"] + used["light"]
    assert total == pytest.approx(4 * 7 * 24, rel=0.03)  # the machine was never idle
    assert abs(used["heavy"] - used["light"]) <= 0.10 * total / 2, used


def small_stream(sim, hours, top=False):
    """A new one-GPU job every 10 minutes, each running 55 minutes (limit 1 h): the GPUs
    come back one at a time, and a small job is always waiting for each."""
    for _ in range(int(hours * H / sim.step)):
        if sim.t % 600 < sim.step:
            w = sim.queue[sim.submit("small", 1, 55 * 60, max_runtime=H)]
            if top:  # an admin keeps putting the small person's work first
                sim.queue[w.id] = Waiting(w.id, w.user, w.kind, w.gpus, w.submitted_at,
                                          max_runtime=w.max_runtime, top=sim.t)
        sim.tick()


def test_a_job_needing_every_gpu_starts_within_a_bound_while_small_jobs_keep_arriving():
    sim = Sim(H100, {"big": q(4), "small": q(4)})
    small_stream(sim, 2)  # all four GPUs busy, ending at different times
    assert len(sim.running) == 4 and len({r.started_at for r in sim.running.values()}) == 4
    big = sim.submit("big", 4, 2 * H, max_runtime=3 * H)
    submitted = sim.t
    small_stream(sim, 6)
    # the small jobs' time limit bounds the wait (plus one pass)
    assert big in sim.started_at, "the big job never started"
    assert sim.started_at[big] - submitted <= H + sim.step
    # and small work went on before and after it
    assert sum(1 for i in sim.started_at if i.startswith("small")) > 12


def test_without_the_reservation_the_big_job_would_starve():
    """The bound above is the reservation's doing: with the same arrivals but the big job
    never at the head (an admin moves each small job to the top), it never starts."""
    sim = Sim(H100, {"big": q(4), "small": q(4)})
    small_stream(sim, 2)
    big = sim.submit("big", 4, 2 * H, max_runtime=3 * H)
    small_stream(sim, 6, top=True)
    assert big not in sim.started_at
    assert sim.queue[big].id == big


def test_every_entry_of_a_long_line_gets_its_own_place():
    queue = [job(f"w{i}", f"u{i % 50}", 1 + i % 3, i, max_runtime=H) for i in range(10_000)]
    people = {f"u{i}": Person(q(4), usage=float(i)) for i in range(50)}
    running = [run("r", "x", [0, 1, 2, 3], max_runtime=2 * H)]
    p = plan(H100, running, queue, people, NOW)  # bench/gpu_queue.py times this pass
    assert len(p.waiting) == 10_000 and p.start == []
    assert sorted(pl.position for pl in p.waiting.values()) == list(range(1, 10_001))
    # the line follows fair share: the person with the least use leads it
    assert p.order[0] == "w0" and p.waiting["w0"].estimated_start == NOW + H
