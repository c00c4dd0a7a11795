"""Hostile input to the gpulab service (issue 13 items 1 and 2), through the HTTP API of a
real `gpulab up`: eve plants FIFOs, sockets and huge files in place of her job's logs and sends
bodies no field may hold; each costs her a 4xx at once, vic's requests meanwhile answer
quickly, and nothing is left half-made (no job, no folder, no used-up name)."""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest

pytestmark = pytest.mark.security

DONE = "print('done', flush=True)\n"


def job(name, **extra):
    return {"name": name, "strategy": "multi-worker-mirrored", "replicas": {"worker": 1},
            "source": DONE, **extra}


def wait_final(person, name, timeout=180):
    deadline = time.time() + timeout
    while time.time() < deadline:
        view = person.service("GET", f"jobs/{name}").json()
        if view["state"] in ("Succeeded", "Failed", "Stopped"):
            return view
        time.sleep(0.3)
    raise TimeoutError(f"job {name} did not end: {view}")


@pytest.fixture(scope="module")
def eve_job(eve):
    r = eve.service("POST", "jobs", json=job("planted"))
    assert r.status_code in (200, 201, 202), r.text
    view = wait_final(eve, "planted")
    assert view["state"] == "Succeeded", view
    return view


def _timed(fn):
    t0 = time.monotonic()
    r = fn()
    return r, time.monotonic() - t0


@pytest.mark.parametrize("plant", [
    "mkfifo {log}",
    "python3 -c 'import socket,sys; s=socket.socket(socket.AF_UNIX); s.bind(sys.argv[1])' {log}",
    "ln -s /etc/shadow {log}",
], ids=["fifo", "socket", "symlink"])
def test_a_planted_log_costs_only_its_owner_a_4xx(eve, vic, eve_job, plant):
    log = f"{eve_job['job_dir']}/logs/worker-0.log"
    eve.sh(f"rm -f {log} && " + plant.format(log=log), check=True)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        attack = pool.submit(_timed, lambda: eve.service(
            "GET", "jobs/planted/logs/worker-0?follow=1", timeout=60))
        slowest = 0.0
        while not attack.done():
            r, took = _timed(lambda: vic.service("GET", "me", timeout=30))
            assert r.status_code == 200
            slowest = max(slowest, took)
        r, took = attack.result()
    assert r.status_code == 409 and r.json()["field"] == "replica", r.text
    assert "not a plain file" in r.json()["message"] or "link" in r.json()["message"]
    assert took < 5, f"the refusal took {took:.1f} s"
    assert slowest < 2, f"vic waited {slowest:.1f} s while eve attacked"
    # the job's own view still answers (its progress is read from the same log)
    assert eve.service("GET", "jobs/planted").status_code == 200


def test_a_huge_sparse_log_is_read_a_bounded_piece_at_a_time(eve, eve_job):
    log = f"{eve_job['job_dir']}/logs/worker-0.log"
    eve.sh(f"rm -f {log} && truncate -s 10G {log}", check=True)
    r, took = _timed(lambda: eve.service("GET", "jobs/planted/logs/worker-0", timeout=60))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["size"] == 10 * 2**30 and body["offset"] <= 2**20
    assert took < 10


def _raw(person, method, path, data: bytes):
    return person.service(method, path, data=data,
                          headers={"Content-Type": "application/json"}, timeout=60)


HOSTILE_JOBS = [
    ("nested", b"[" * 100_000, "body"),
    ("surrogate-source", json.dumps(job("s1", source="print('\ud800')")).encode(), "source"),
    ("surrogate-env", json.dumps(job("s2", env={"A": "\ud800"})).encode(), "env.A"),
    ("surrogate-args", json.dumps(job("s3", args=["\ud800"])).encode(), "args[0]"),
    ("nul-script", json.dumps(job("n1", script="a\u0000.py", source=None)).encode(), "script"),
    ("nul-env", json.dumps(job("n2", env={"A": "x\u0000y"})).encode(), "env.A"),
    ("nul-args", json.dumps(job("n3", args=["x\u0000"])).encode(), "args[0]"),
    ("memory-overflow", json.dumps(job("m1", resources={"worker": {
        "memory": "9" * 400 + "Ti"}})).encode(), "resources.worker.memory"),
    ("infinite", b'{"name": "i1", "strategy": "multi-worker-mirrored", "max_runtime": 1e400}',
     "max_runtime"),
    ("huge-count", json.dumps(job("h1", replicas={"worker": 10**400})).encode(),
     "replicas.worker"),
]


@pytest.mark.parametrize("body,field", [(b, f) for _, b, f in HOSTILE_JOBS],
                         ids=[i for i, _, _ in HOSTILE_JOBS])
def test_hostile_job_bodies_get_400_naming_the_field_and_leave_nothing(eve, hub, body, field):
    before = {j["name"] for j in eve.service("GET", "jobs").json()["jobs"]}
    r = _raw(eve, "POST", "jobs", body)
    assert r.status_code == 400, (r.status_code, r.text[:500])
    assert r.json()["field"] == field, r.text
    assert {j["name"] for j in eve.service("GET", "jobs").json()["jobs"]} == before
    folder = hub.data_dir / "shared" / "users" / "eve" / "jobs"
    names = {"s1", "s2", "s3", "n1", "n2", "n3", "m1", "i1", "h1"}
    assert not names & {p.name for p in folder.iterdir()} if folder.exists() else True


def test_the_names_of_refused_jobs_stay_free(eve):
    r = eve.service("POST", "jobs", json=job("s1"))
    assert r.status_code in (200, 201, 202), r.text
    assert wait_final(eve, "s1")["state"] == "Succeeded"


def test_an_admin_quota_edit_with_a_hostile_body_gets_400(admin):
    r = _raw(admin, "PUT", "quotas/users/vic", b"[" * 60_000)  # under the body limit
    assert r.status_code == 400 and r.json()["field"] == "body", r.text
    r = _raw(admin, "PUT", "quotas/users/vic", b'{"max_gpus": 1e400}')
    assert r.status_code == 400, r.text
    assert admin.service("GET", "quotas").status_code == 200
    assert all(q.get("name") != "vic" for q in admin.service("GET", "quotas").json()["quotas"])


def test_an_oversized_body_gets_413_naming_the_body(eve):
    r = _raw(eve, "POST", "jobs", b"x" * (4 * 2**20))
    assert r.status_code == 413 and r.json()["field"] == "body", (r.status_code, r.text[:300])
    assert eve.service("GET", "me").status_code == 200
