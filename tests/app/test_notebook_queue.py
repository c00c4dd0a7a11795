"""A GPU notebook waits in the GPU queue on a real `gpulab up` (LocalGPUSpawner): it is
pending (202) while it waits, the queue API and the spawn-pending page's progress events say
where it stands, it starts by itself when its GPUs come back (its wait not counted against a
short ``start_timeout``), and a wait that is left or that expires fails with the reason and
holds nothing."""

import json
import time

import pytest
import requests

from tests.conftest import hub_with_config

from .test_jobs_api import SLEEPER, holdings, mw, wait_state

pytestmark = pytest.mark.app

#: a start_timeout shorter than the wait below: the wait must not count against it
START_TIMEOUT = 15
CONFIG = f"c.Spawner.start_timeout = {START_TIMEOUT}\n"


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    yield from hub_with_config(workdir, prefix, CONFIG, gpus=2)


def progress(person, server, until, timeout=60) -> list[dict]:
    """The spawn-pending page's events of `server` (JupyterHub's progress stream), read until
    one satisfies `until` or the stream ends (a spawn that failed or is ready)."""
    url = f"{person.hub.url}/hub/api/users/{person.name}/servers/{server}/progress"
    seen = []
    with requests.get(url, headers={"Authorization": f"token {person.token()}"}, stream=True,
                      timeout=timeout) as r:
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + timeout
        for line in r.iter_lines(decode_unicode=True):
            if line and line.startswith("data:"):
                event = json.loads(line[len("data:"):])
                seen.append(event)
                if until(event) or event.get("failed") or event.get("ready"):
                    return seen
            if time.monotonic() > deadline:
                break
    return seen


def my_entries(person) -> list[dict]:
    line = person.service("GET", "queue").json()
    assert line["enabled"], line
    return line["entries"]


def remove(person, *names) -> None:
    """Remove refused named servers (a person may have 5)."""
    for name in names:
        r = person.api("DELETE", f"/users/{person.name}/servers/{name}", json={"remove": True})
        assert r.status_code in (202, 204), r.text


def servers(person) -> dict:
    return person.api("GET", f"/users/{person.name}").json().get("servers", {})


def test_a_notebook_waits_for_its_gpus_and_starts_when_they_come_back(hub, users, admin):
    ann, bob = users["ann"], users["bob"]
    assert admin.service("PUT", "quotas/users/ann", json={"max_gpus": 1}).status_code == 200
    # ann's one GPU is held by her job
    r = ann.service("POST", "jobs", json=mw("holder", workers=1, gpus=1, source=SLEEPER))
    assert r.status_code == 201, r.text
    wait_state(ann, "holder", ("Running",))

    # a bad wait is refused in words; one that could never run is refused at once
    bad = ann.start_server("bad", {"profile": "gpu-1", "gpu_wait_minutes": 7})
    assert bad.status_code == 400, bad.text
    assert "'gpu_wait_minutes' (how long your server may wait for busy GPUs, in minutes; " \
           "0: don't wait) must be one of 0, 5, 15, 60, got 7" in bad.json()["message"]
    never = ann.start_server("huge", {"profile": "gpu-2", "gpu_wait_minutes": 5})
    assert never.status_code == 409 and "quota" in never.json()["message"], never.text
    dont = ann.start_server("now", {"profile": "gpu-1"})  # don't wait: refused as before
    assert dont.status_code == 409, dont.text
    remove(ann, "bad", "huge", "now")

    asked = time.monotonic()
    r = ann.start_server("wait", {"profile": "gpu-1", "gpu_wait_minutes": 5}, wait=False)
    assert r.status_code == 202, r.text
    [entry] = my_entries(ann)
    assert (entry["kind"], entry["holder"], entry["position"], entry["gpus"]) == (
        "notebook", "wait", 1, 1), entry
    assert "quota" in entry["reason"], entry
    assert servers(ann)["wait"]["pending"] == "spawn"
    events = progress(ann, "wait", lambda e: e.get("message", "").startswith(
        "Waiting for GPUs: next in line"))
    waiting = events[-1]
    assert waiting["message"].startswith("Waiting for GPUs: next in line"), events
    assert "quota" in waiting["message"] and "Leave the queue</a>" in waiting["html_message"]
    assert [h["name"] for h in holdings(ann)] == ["holder"]  # the server holds nothing yet

    # longer than start_timeout in line: the wait does not count against it
    time.sleep(max(0.0, START_TIMEOUT + 3 - (time.monotonic() - asked)))
    assert servers(ann)["wait"]["pending"] == "spawn"
    assert ann.service("POST", "jobs/holder/stop").status_code == 200
    freed = time.monotonic()
    # a pass every second admits it (measured apart from the server's own start, which
    # takes 10-25 s on a loaded two-core machine and is not the queue's doing)
    while not any(h["kind"] == "notebook" for h in holdings(ann)):
        assert time.monotonic() - freed < 5, "not admitted 5 s after its GPUs came back"
        time.sleep(0.05)
    ann.wait_ready("wait", timeout=60)
    held = holdings(ann)
    assert [(h["kind"], h["name"], h["gpus"]) for h in held] == [("notebook", "wait", 1)], held
    assert my_entries(ann) == []

    # a second wait, left through the service's API (its owner only): fails with the words
    r = ann.start_server("second", {"profile": "gpu-1", "gpu_wait_minutes": 15}, wait=False)
    assert r.status_code == 202, r.text
    [entry] = my_entries(ann)
    assert entry["holder"] == "second"
    assert bob.service("POST", f"queue/{entry['id']}/cancel").status_code == 404
    assert bob.service("POST", f"queue/{entry['id']}/hold").status_code == 403
    # as the My GPUs page does it: ann's service cookie and the page's XSRF token
    page = ann.s.get(hub.service_url, timeout=60).text
    assert f'<form class="queue-leave" data-entry="{entry["id"]}"' in page, page[-3000:]
    assert "Leave the queue</button>" in page
    xsrf = json.loads(page.split("XSRF = ", 1)[1].split(",", 1)[0])
    left = ann.s.post(f"{hub.service_url}api/v1/queue/{entry['id']}/cancel",
                      headers={"X-XSRFToken": xsrf}, timeout=60)
    assert left.status_code == 200 and left.json()["state"] == "cancelled", left.text
    assert ann.service("POST", f"queue/{entry['id']}/cancel").status_code == 404  # gone
    failed = progress(ann, "second", lambda e: False)[-1]
    assert failed.get("failed") and "You left the queue" in failed["message"], failed
    assert "second" not in servers(ann)
    assert [h["name"] for h in holdings(ann)] == ["wait"] and my_entries(ann) == []
    audit = admin.service("GET", "audit").json()["audit"]
    assert not any(a["name"] == "ann/notebook/second" for a in audit)  # her own: not audited
    remove(ann, "second")

    # a wait that expires fails with the reason. The shortest wait offered is 5 min: the
    # test moves the entry's deadline to now in the ledger's database (what 5 minutes would
    # do), and the hub's next pass expires it
    r = ann.start_server("third", {"profile": "gpu-1", "gpu_wait_minutes": 5}, wait=False)
    assert r.status_code == 202, r.text
    [entry] = my_entries(ann)
    from sqlalchemy import update

    from gpulab.hub.quota.ledger import Ledger
    from gpulab.hub.quota.waiting import QueueEntryRow

    ledger = Ledger(f"sqlite:///{hub.data_dir / 'gpulab.sqlite'}")
    with ledger.Session.begin() as s:
        s.execute(update(QueueEntryRow).where(QueueEntryRow.id == entry["id"])
                  .values(wait_until=time.time()))
    failed = progress(ann, "third", lambda e: False)[-1]
    assert failed.get("failed") and "The longest wait chosen passed before GPUs were free" \
        in failed["message"], failed
    assert "third" not in servers(ann)
    assert [h["name"] for h in holdings(ann)] == ["wait"] and my_entries(ann) == []

    # the server that came through the queue stops: GPUs and entry gone
    ann.stop_server("wait")
    assert holdings(ann) == []
    admin.service("DELETE", "quotas/users/ann")


def test_a_wait_behind_work_with_a_time_limit_has_an_estimated_start(hub, users, admin,
                                                                      workdir):
    """Issue 37: ann's job with ``max_runtime`` 300 holds both GPUs; bob's job (no limit of
    its own: it gets the operator's default, a day) waits with an estimated start at her
    job's limit, in the job's JSON, the queue API and ``gpulab jobs show``; ann's notebook
    waits for her quota and its reason names her job and when its limit ends."""
    import os
    import subprocess

    from gpulab.extensions.jobmodel import queue_text

    from tests.app.hubctl import GPULAB

    ann, bob = users["ann"], users["bob"]
    for who in ("ann", "bob"):
        assert admin.service("PUT", f"quotas/users/{who}", json={"max_gpus": 2}).status_code \
            == 200
    try:
        before = time.time()
        r = ann.service("POST", "jobs", json=mw("digits-3", workers=1, gpus=2, source=SLEEPER,
                                                  max_runtime=300))
        assert r.status_code == 201, r.text
        wait_state(ann, "digits-3", ("Running",))
        r = bob.service("POST", "jobs", json=mw("next", workers=1, gpus=1, source=SLEEPER))
        assert r.status_code == 202, r.text
        job = bob.service("GET", "jobs/next").json()
        assert job["state"] == "Queued" and job["spec"]["max_runtime"] == 86400, job
        start = job["queue"]["estimated_start"]
        assert before + 300 <= start <= time.time() + 300, (before, start, job)
        assert "estimated start" in job["queue"]["reason"], job
        assert "start unknown" not in job["reason"] and "ann" not in job["reason"], job
        [entry] = my_entries(bob)
        assert entry["estimated_start"] == start, entry
        assert "starts in about 5 min" in queue_text(job), queue_text(job)
        page = bob.s.get(hub.service_url, timeout=60).text  # My GPUs
        assert f'<span class="eta" data-at="{start}">' in page, page[-3000:]
        env = {**os.environ, "GPULAB_URL": hub.url, "GPULAB_TOKEN": bob.token()}
        shown = subprocess.run([GPULAB, "jobs", "show", "next"], env=env, capture_output=True,
                               text=True, timeout=120)
        assert shown.returncode == 0, shown.stderr
        assert "Queued (next in line · starts in about 5 min (" in shown.stdout, shown.stdout

        # ann's notebook waits for her quota, held by her own job: named, with its end
        r = ann.start_server("nb", {"profile": "gpu-1", "gpu_wait_minutes": 5}, wait=False)
        assert r.status_code == 202, r.text
        [entry] = my_entries(ann)
        assert "in use by your job 'digits-3' (2 GPUs, its time limit ends in about 5 min)" \
            in entry["reason"], entry
        assert entry["estimated_start"] is not None and entry["estimated_start"] >= start - 5
        events = progress(ann, "nb", lambda e: "your job 'digits-3'" in e.get("message", ""))
        assert "your job 'digits-3' (2 GPUs" in events[-1]["message"], events
        assert "starts in about 5 min" in events[-1]["message"], events
    finally:
        if "nb" in servers(ann):
            ann.stop_server("nb")
            remove(ann, "nb")
        for person, name in ((bob, "next"), (ann, "digits-3")):
            person.service("POST", f"jobs/{name}/stop")
        for who in ("ann", "bob"):
            admin.service("DELETE", f"quotas/users/{who}")
    assert holdings(ann) == [] and holdings(bob) == []
