"""The rules of a job's fate (`gpulab.hub.jobs.rules`) as tables: each row is a situation the
supervisors meet, and what must follow."""

import signal

import pytest

from gpulab.extensions.contract import EXIT_CONFIG, EXIT_INFRA, EXIT_PROGRAM
from gpulab.hub.jobs.rules import (
    EXIT_UNKNOWN,
    Decision,
    Replica,
    RoleJob,
    decide_kube,
    decide_local,
    error_summary,
    exit_words,
)

PS = "parameter-server"
MW = "multi-worker-mirrored"
RUN = ("Running", None)
OK = ("Succeeded", 0)


def fail(code, restarts=0):
    return ("Failed", code, restarts)


def replicas(**states):
    """``chief=RUN, ps0=fail(-9), worker1=(state, code, restarts)`` -> the rules' mapping."""
    out = {}
    for key, value in states.items():
        role = key.rstrip("0123456789")
        index = int(key[len(role):] or 0)
        state, code, *rest = value
        out[(role, index)] = Replica(role, index, state, code, rest[0] if rest else 0,
                                     reason=exit_words(code) if state == "Failed" else "")
    return out


def local(strategy, reps, retries=2, max_runtime=None, now=100.0, started=0.0):
    return decide_local(strategy, reps, retries=retries, started=started,
                        max_runtime=max_runtime, now=now)


PS_TABLE = [
    # (what happened, replicas, retries) -> (outcome state or None, restarted, blamed)
    ("all running", dict(chief=RUN, ps0=RUN, worker0=RUN), 2, (None, set(), None)),
    ("chief done", dict(chief=OK, ps0=RUN, worker0=RUN), 2, ("Succeeded", set(), None)),
    ("chief raised", dict(chief=fail(EXIT_PROGRAM), ps0=RUN, worker0=RUN), 2,
     ("Failed", set(), "chief-0")),
    ("chief bad config", dict(chief=fail(EXIT_CONFIG), ps0=RUN, worker0=RUN), 2,
     ("Failed", set(), "chief-0")),
    ("chief lost its cluster", dict(chief=fail(EXIT_INFRA), ps0=RUN, worker0=RUN), 2,
     (None, {("chief", 0)}, None)),
    ("a worker killed", dict(chief=RUN, ps0=RUN, worker0=fail(-9), worker1=RUN), 2,
     (None, {("worker", 0)}, None)),
    ("a ps died and the chief lost it", dict(chief=fail(EXIT_INFRA), ps0=fail(-9), worker0=RUN),
     2, (None, {("chief", 0), ("ps", 0)}, None)),
    ("a ps died, the chief raised meanwhile: the ps is the cause, both restart",
     dict(chief=fail(EXIT_PROGRAM), ps0=fail(-9), worker0=RUN), 2,
     (None, {("chief", 0), ("ps", 0)}, None)),
    ("a worker killed, out of retries, others train on",
     dict(chief=RUN, ps0=RUN, worker0=fail(-9, 2), worker1=RUN), 2, (None, set(), None)),
    ("every worker dead, out of retries",
     dict(chief=RUN, ps0=RUN, worker0=fail(-9, 1), worker1=fail(-9, 1)), 2,
     ("Failed", set(), None)),
    ("a ps dead, out of retries", dict(chief=RUN, ps0=fail(-9, 2), worker0=RUN), 2,
     ("Failed", set(), None)),
    ("no retries at all: a killed worker among others is tolerated",
     dict(chief=RUN, ps0=RUN, worker0=fail(-9), worker1=RUN), 0, (None, set(), None)),
]


@pytest.mark.parametrize("what,states,retries,want", PS_TABLE, ids=[r[0] for r in PS_TABLE])
def test_parameter_server_rules(what, states, retries, want):
    d = local(PS, replicas(**states), retries=retries)
    state, restart, blame = want
    assert (d.outcome[0] if d.outcome else None, set(d.restart), d.blame) == (state, restart, blame)


MW_TABLE = [
    ("all running", dict(worker0=RUN, worker1=RUN), 2, (None, set(), None)),
    ("one done, one running", dict(worker0=OK, worker1=RUN), 2, (None, set(), None)),
    ("all done", dict(worker0=OK, worker1=OK), 2, ("Succeeded", set(), None)),
    ("one raised: the program's error is not retried",
     dict(worker0=RUN, worker1=fail(EXIT_PROGRAM)), 2, ("Failed", set(), "worker-1")),
    ("one killed: all restart together", dict(worker0=RUN, worker1=fail(-9)), 2,
     (None, {("worker", 0), ("worker", 1)}, None)),
    ("peers lost: all restart together", dict(worker0=fail(EXIT_INFRA), worker1=fail(-9)), 2,
     (None, {("worker", 0), ("worker", 1)}, None)),
    ("killed after two rounds of restarts", dict(worker0=fail(-9, 2), worker1=RUN), 2,
     ("Failed", set(), None)),
    ("gone while adopted (exit unknown): restarted like a kill",
     dict(worker0=fail(EXIT_UNKNOWN), worker1=RUN), 1,
     (None, {("worker", 0), ("worker", 1)}, None)),
]


@pytest.mark.parametrize("what,states,retries,want", MW_TABLE, ids=[r[0] for r in MW_TABLE])
def test_multi_worker_rules(what, states, retries, want):
    d = local(MW, replicas(**states), retries=retries)
    state, restart, blame = want
    assert (d.outcome[0] if d.outcome else None, set(d.restart), d.blame) == (state, restart, blame)


def test_reasons_name_the_replicas_and_the_retries():
    d = local(MW, replicas(worker0=fail(-9, 2), worker1=RUN), retries=2)
    assert d.outcome == ("Failed", "worker-0 failed (killed by SIGKILL) after 2 restarts of the "
                         "workers (retries: 2)")
    d = local(PS, replicas(chief=RUN, ps0=fail(-9, 2), worker0=RUN), retries=2)
    assert d.outcome == ("Failed", "out of retries (2) after ps-0 failed")
    d = local(PS, replicas(chief=fail(EXIT_PROGRAM), ps0=RUN, worker0=RUN))
    assert d.outcome[1] == ("the chief failed: the program raised an error (exit 1); see its "
                            "log (logs/chief-0.log)")


@pytest.mark.parametrize("started,now,want", [(0, 59, None), (0, 61, "Failed"), (50, 109, None)])
def test_max_runtime_ends_a_job_that_goes_on(started, now, want):
    d = local(PS, replicas(chief=RUN, ps0=RUN, worker0=RUN), max_runtime=60, started=started,
              now=now)
    assert (d.outcome[0] if d.outcome else None) == want
    if want:
        assert d.outcome[1] == "stopped after max_runtime (60 s)"


def test_an_outcome_wins_over_max_runtime():
    d = local(MW, replicas(worker0=OK, worker1=OK), max_runtime=60, now=1000)
    assert d.outcome == ("Succeeded", "all workers finished")


def test_no_decision_is_the_empty_one():
    assert local(MW, replicas(worker0=RUN)) == Decision()


KUBE_TABLE = [
    ("running", PS, {"chief": RoleJob(), "worker": RoleJob()}, {}, None),
    ("chief complete", PS, {"chief": RoleJob("Complete"), "worker": RoleJob()}, {},
     ("Succeeded", "the chief finished")),
    ("workers complete (multi-worker)", MW, {"worker": RoleJob("Complete")}, {},
     ("Succeeded", "all workers finished")),
    ("worker Job complete under parameter-server is not the end", PS,
     {"chief": RoleJob(), "worker": RoleJob("Complete")}, {}, None),
    ("deadline", MW, {"worker": RoleJob("Failed", "DeadlineExceeded")}, {},
     ("Failed", "stopped after max_runtime (600 s)")),
    ("program error: not retried", PS, {"chief": RoleJob("Failed", "PodFailurePolicy")},
     {("chief", 0): ("Failed", "the program raised an error (exit 1)")},
     ("Failed", "chief-0 failed: the program raised an error (exit 1); this is not retried "
      "(see its log: gpulab jobs logs digits chief-0)")),
    ("backoff used up", MW, {"worker": RoleJob("Failed", "BackoffLimitExceeded")},
     {("worker", 0): ("Running", "running"),
      ("worker", 1): ("Starting", "restarting after: killed by SIGKILL")},
     ("Failed", "the worker replicas failed and the 3 retries are used up "
      "(worker-1: killed by SIGKILL)")),
    ("a role Job is gone (None) while the lead runs", PS, {"chief": RoleJob(), "ps": None}, {},
     None),
]


@pytest.mark.parametrize("what,strategy,roles,reps,want", KUBE_TABLE,
                         ids=[r[0] for r in KUBE_TABLE])
def test_kubernetes_rules(what, strategy, roles, reps, want):
    assert decide_kube(strategy, "digits", roles, reps, retries=3, max_runtime=600) == want


@pytest.mark.parametrize("code,words", [
    (None, "running"), (0, "exited 0"), (EXIT_INFRA, "lost its cluster (a ps or peer went away)"),
    (-signal.SIGKILL, "killed by SIGKILL"), (EXIT_UNKNOWN, "gone (exit code unknown)"),
    (EXIT_PROGRAM, "the program raised an error (exit 1)"),
    (EXIT_CONFIG, "bad job configuration (exit 2)"), (3, "exited 3"),
])
def test_exit_words(code, words):
    assert exit_words(code) == words


def test_error_summary_is_the_persons_frame_and_the_exception():
    log = (b'GPULAB_PROGRESS {"step": 1}\nTraceback (most recent call last):\n'
           b'  File "/usr/lib/python3/dist-packages/x.py", line 9, in f\n'
           b'  File "/data/users/ann/jobs/d/source.py", line 3, in <module>\n'
           b'ZeroDivisionError: division by zero\n')
    assert error_summary(log) == "ZeroDivisionError: division by zero (source.py, line 3)"
    assert error_summary(b"all fine\n") == ""


# -- a held cluster (issue 38): ps and workers for the notebook kernel -----------------------

@pytest.mark.parametrize("states, retries, outcome, restart", [
    (dict(ps0=RUN, worker0=RUN, worker1=RUN), 2, None, set()),
    # a lost worker is restarted; the coordinator carries on meanwhile
    (dict(ps0=RUN, worker0=fail(-9), worker1=RUN), 2, None, {("worker", 0)}),
    (dict(ps0=RUN, worker0=("Running", None, 1), worker1=fail(-9)), 2, None, {("worker", 1)}),
    (dict(ps0=RUN, worker0=fail(-9, 1), worker1=fail(-9)), 2, None, {("worker", 0)}),
    # out of restarts: it goes on with the workers it has, and fails with none left
    (dict(ps0=RUN, worker0=fail(-9, 2), worker1=RUN), 2, None, set()),
    (dict(ps0=RUN, worker0=fail(-9, 2), worker1=fail(-9)), 2, "every worker was lost", set()),
    # a lost ps ends it: its variables are gone; the reason says what to do
    (dict(ps0=fail(-9), worker0=RUN), 2, "ps-0 was lost (killed by SIGKILL)", set()),
    (dict(ps0=RUN, ps1=fail(EXIT_PROGRAM), worker0=fail(-9)), 5, "ps-1 was lost", set()),
], ids=["serving", "worker-lost", "second-worker-lost", "retries-for-one-of-two", "no-retries-left-goes-on",
        "no-workers-left", "ps-lost", "ps-lost-first"])
def test_a_held_cluster_restarts_workers_and_ends_without_its_ps(states, retries, outcome,
                                                                 restart):
    d = decide_local(PS, replicas(**states), retries=retries, started=0, max_runtime=None,
                     now=1, kind="cluster")
    if outcome is None:
        assert d.outcome is None and d.restart == frozenset(restart)
    else:
        assert d.outcome[0] == "Failed" and outcome in d.outcome[1]
        if "ps" in outcome:
            assert "restore it from your last checkpoint" in d.outcome[1]
            assert d.blame == outcome.split(" ")[0]


def test_a_held_cluster_never_succeeds_and_keeps_its_time_limit():
    # no chief: nothing finishes it but a stop, a loss or its time limit
    by = replicas(ps0=RUN, worker0=OK)
    assert decide_local(PS, by, retries=1, started=0, max_runtime=None, now=1,
                        kind="cluster").restart == {("worker", 0)}
    d = decide_local(PS, replicas(ps0=RUN, worker0=RUN), retries=1, started=0, max_runtime=10,
                     now=11, kind="cluster")
    assert d.outcome == ("Failed", "stopped after max_runtime (10 s)")
