"""gpulab.hub.quota.queue: the estimated start of waiting work, as a table (issue 37).

Each row: the running work (GPUs, start, time limit, kind), the line ahead (requests and their
own limits), the entry asked about → the earliest time it could start under the queue's gang
and first-fit rules (`plan`'s estimate), or None with the words saying why. `plan` is a pure
function: no clock, no database.
"""

from __future__ import annotations

import pytest

from gpulab.hub.quota.policy import Quota
from gpulab.hub.quota.queue import Device, Person, Running, Waiting, plan

H = 3600.0
NOW = 1_000_000.0
GPUS4 = [Device(i, "H100") for i in range(4)]


def running(id, devices, started=0.0, limit=None, kind="job", user="x", holder=""):
    """Work on `devices` that started `started` seconds before NOW with time limit `limit`."""
    return Running(id, user, kind, tuple(devices), NOW - started, limit, holder=holder)


def waiting(id, gpus, limit=None, t=0.0, user="a", kind="job", holder=""):
    return Waiting(id, user, kind, gpus, NOW + t, max_runtime=limit, holder=holder)


PEOPLE = {u: Person(Quota(4), usage=i) for i, u in enumerate(["a", "b", "c", "x", "y"])}

#: (id, running, line (first is ahead), asked about, expected start or None, words in reason)
ESTIMATES = [
    ("a 300 s job alone frees enough GPUs",
     [running("j", [0, 1], started=100, limit=300), running("nb", [2, 3], kind="notebook")],
     [waiting("w", 2)], "w", NOW + 200, "estimated start"),
    ("the second GPU to come back decides a gang of two",
     [running("j1", [0], started=0, limit=600), running("j2", [1], started=0, limit=1200),
      running("j3", [2, 3], started=0, limit=3000)],
     [waiting("w", 2)], "w", NOW + 1200, "estimated start"),
    ("a notebook in the way has no time limit",
     [running("nb", [0, 1, 2], kind="notebook")],
     [waiting("w", 2)], "w", None, "a notebook using them has no time limit"),
    ("a job without a limit in the way",
     [running("j", [0, 1, 2, 3])],
     [waiting("w", 1)], "w", None, "a job using them has no time limit"),
    ("behind the line: the head's own limit counts",
     [running("j", [0, 1, 2, 3], started=0, limit=H)],
     [waiting("head", 4, limit=2 * H, user="b"), waiting("w", 2, t=1, user="c")],
     "w", NOW + 3 * H, "behind earlier work in line"),
    ("behind a head without a limit: unknown, and says so",
     [running("j", [0, 1, 2, 3], started=0, limit=H)],
     [waiting("head", 4, user="b"), waiting("w", 2, t=1, user="c")],
     "w", None, "the job ahead of it in line has no time limit"),
    ("first fit: GPUs the head does not take are counted",
     [running("j1", [0, 1], started=0, limit=H), running("j2", [2, 3], started=0, limit=3 * H)],
     [waiting("head", 2, limit=H, user="b"), waiting("w", 2, t=1, user="c", limit=5 * H)],
     "w", NOW + 2 * H, "behind earlier work in line"),
    ("running work past its limit is expected back now",
     [running("j", [0, 1, 2, 3], started=2 * H, limit=H)],
     [waiting("w", 4)], "w", NOW, "estimated start"),
]


@pytest.mark.parametrize("name,run,line,asked,start,words", ESTIMATES,
                         ids=[r[0] for r in ESTIMATES])
def test_estimated_start(name, run, line, asked, start, words):
    p = plan(GPUS4, run, line, PEOPLE, NOW)
    place = p.waiting[asked]
    assert place.estimated_start == start
    assert words in place.reason
    if start is None:
        assert "start unknown: " in place.reason
    # the words never name another person
    assert all(f"'{u}'" not in place.reason for u in PEOPLE)


#: a notebook that waits for its person's quota names their own work that holds it
QUOTA = [
    ("their job with a limit: named, with when it ends",
     [running("j", [0, 1], started=0, limit=300, user="a", holder="digits-3")],
     NOW + 300,
     "Waits for your quota: 2 of your 2 GPUs are in use by your job 'digits-3' (2 GPUs, its "
     "time limit ends in about 5 min); it starts when enough of your own work ends."),
    ("their notebook without a limit: unknown, named",
     [running("n", [0], user="a", kind="notebook", holder="big"),
      running("j", [1], started=0, limit=H, user="a", holder="short")],
     None,
     "in use by your job 'short' (1 GPU, its time limit ends in about 1.0 h), your notebook "
     "'big' (1 GPU, no time limit: stop it to free them)"),
]


@pytest.mark.parametrize("name,run,start,words", QUOTA, ids=[r[0] for r in QUOTA])
def test_a_quota_wait_names_the_persons_own_work(name, run, start, words):
    people = {"a": Person(Quota(2))}
    p = plan(GPUS4, run, [waiting("nb", 2, kind="notebook", holder="")], people, NOW)
    place = p.waiting["nb"]
    assert place.estimated_start == start
    assert words in place.reason
    assert ("start unknown: your own work holding it has no time limit" in place.reason) \
        is (start is None)


def test_own_work_started_in_the_same_pass_is_named():
    # the person's job starts on free GPUs and fills their quota; their notebook behind it
    # is told that job holds it
    line = [waiting("j", 2, limit=600, user="a", holder="digits-3"),
            waiting("nb", 1, t=1, user="a", kind="notebook")]
    p = plan(GPUS4, [], line, {"a": Person(Quota(2))}, NOW)
    assert [s.id for s in p.start] == ["j"]
    assert p.waiting["nb"].estimated_start == NOW + 600
    assert "by your job 'digits-3' (2 GPUs, its time limit ends in about 10 min)" \
        in p.waiting["nb"].reason


def test_the_words_never_name_another_persons_work():
    # bob's job (named) and notebook hold every GPU; ann's entries are told why they wait,
    # never what bob's work is called
    run = [running("j", [0, 1], started=0, limit=600, user="bob", holder="secret-job"),
           running("n", [2, 3], user="bob", kind="notebook", holder="secret-nb")]
    line = [waiting("w4", 4, user="a"), waiting("w1", 1, t=1, user="a", kind="notebook")]
    p = plan(GPUS4, run, line, {"a": Person(Quota(4)), "bob": Person(Quota(4))}, NOW)
    for place in p.waiting.values():
        assert "secret" not in place.reason and "bob" not in place.reason, place.reason
    assert "a notebook using them has no time limit" in p.waiting["w4"].reason
