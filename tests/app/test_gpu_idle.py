"""GPU-idle culling end to end on a real `gpulab up` (issue 39): the stand-in usage source
(``<data>/gpu-usage.json``, written here as the operator would) drives the two simulated GPUs.

A server whose GPU sits idle is warned on My GPUs and in the audit trail, then stopped through
the hub, its GPU given back, with the reason on My GPUs and in the audit trail; a server kept
for an hour is left alone meanwhile; a keep past the operator's limit gets a 400 that says the
limit. Short clocks (idle 10 s, warned 8 s before: a wide window to see the warning on a
loaded machine) keep it to seconds.
"""

import json
import os
import time

import pytest

from tests.conftest import hub_with_config

from .test_service_api import gpulab_cli as cli

pytestmark = pytest.mark.app

CONFIG = """
c.GPUInventory.usage_source = "stand-in"
c.GPUInventory.usage_interval = 0.5
c.GPUIdle.mode = "stop"
c.GPUIdle.threshold_percent = 5
c.GPUIdle.idle_seconds = 10
c.GPUIdle.warn_seconds = 8
c.GPUIdle.keep_max_hours = 2
"""


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    yield from hub_with_config(workdir, prefix, CONFIG, gpus=2)


def set_usage(hub, percents: dict[int, int]) -> None:
    """Write the stand-in file as its owner (root, mode 0600), atomically."""
    path = hub.data_dir / "gpu-usage.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({str(i): {"gpu_percent": p, "memory_used_mib": 256,
                                        "memory_total_mib": 16384}
                               for i, p in percents.items()}))
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)


def device_of(person) -> int:
    [h] = person.service("GET", "me").json()["holdings"]
    return h["devices"][0]


def wait_for(what, check, timeout=40, every=0.25):
    deadline = time.time() + timeout
    while time.time() < deadline:
        value = check()
        if value:
            return value
        time.sleep(every)
    pytest.fail(f"timed out waiting for {what}")


def test_an_idle_server_is_warned_then_stopped_and_a_kept_one_is_not(hub, users, admin):
    ann, bob = users["ann"], users["bob"]
    set_usage(hub, {0: 90, 1: 90})
    for p in (ann, bob):
        r = p.start_server("", {"profile": "gpu-1"})
        assert r.status_code in (201, 202), r.text
    a_dev, b_dev = device_of(ann), device_of(bob)
    # the figures reach the holdings (My GPUs' "GPU use now" column, the API)
    wait_for("the stand-in figures", lambda: "90% busy" in json.dumps(
        bob.service("GET", "me").json()["holdings"][0]["usage"]))
    page = bob.s.get(hub.service_url, timeout=30).text
    assert "stand-in figures, simulated GPU" in page
    # the spawn form's machine line (the hub's own sampler reads the same file)
    wait_for("the spawn form's figures", lambda: "90% busy, 0.2 of 16.0 GiB (stand-in" in
             ann.s.get(hub.url + "/hub/spawn/ann/second", timeout=30).text)

    # keep: bounded by the operator's limit, with words; then granted
    r = ann.service("POST", "servers/default/keep", json={"hours": 3})
    assert r.status_code == 400 and "at most 2 hours" in r.json()["message"], r.text
    r = ann.service("POST", "servers/default/keep", json={"hours": "soon"})
    assert r.status_code == 400 and r.json()["field"] == "hours", r.text
    r = ann.service("POST", "servers/nosuch/keep", json={"hours": 1})
    assert r.status_code == 404, r.text
    # nobody keeps another person's server (that one would then hold its GPU idle for ever)
    r = ann.service("POST", "servers/default/keep?user=bob", json={"hours": 1})
    assert r.status_code == 403, r.text
    # the CLI, as a person types it: over the limit said in words, then granted
    r = cli("keep", "--hours", "5", token=ann.token(), hub=hub)
    assert r.returncode == 1 and "at most 2 hours" in r.stderr and "Traceback" not in r.stderr
    r = cli("keep", "--hours", "1", token=ann.token(), hub=hub)
    assert r.returncode == 0 and "ann's server 'default' is kept until" in r.stdout, r.stderr
    kept = ann.service("GET", "idle").json()["kept"]
    assert kept and kept[0]["kept_until"] > time.time() + 3000 and kept[0]["server"] == "default"
    assert bob.service("GET", "idle").json()["kept"] == []  # ann's keep is hers alone

    # both GPUs go idle: bob is warned, then stopped; ann (kept) is neither
    set_usage(hub, {a_dev: 0, b_dev: 1})
    notice = wait_for("bob's warning", lambda: bob.service("GET", "idle").json()["notices"])
    assert "will be stopped" in notice[0]["text"] and notice[0]["can_keep"]
    page = bob.s.get(hub.service_url, timeout=30).text
    assert "idle-notice" in page and "will be stopped" in page
    admin_page = admin.s.get(hub.service_url + "admin", timeout=30).text
    assert "GPUs idle: to be stopped" in admin_page
    wait_for("bob's server to stop",
             lambda: not bob.api("GET", "/users/bob").json()["servers"])
    assert ann.service("GET", "idle").json()["notices"] == []
    assert ann.api("GET", "/users/ann").json()["servers"]
    assert bob.service("GET", "me").json()["holdings"] == []

    # the reason: My GPUs and the audit trail
    stopped = bob.service("GET", "idle").json()["stopped"]
    assert stopped and "below 5% use" in stopped[0]["new"]["text"]
    page = bob.s.get(hub.service_url, timeout=30).text
    assert "Stopped for idle GPUs" in page and "GPU-idle culling" in page
    audit = admin.service("GET", "audit?limit=20").json()["audit"]
    rows = [(a["scope"], a["name"], a["new"]["action"]) for a in audit if a["scope"] == "idle"]
    assert ("idle", "bob/notebook/default", "stopped") in rows
    assert ("idle", "bob/notebook/default", "warned") in rows
    assert ("idle", "ann/notebook/default", "kept") in rows
    # the GPU came back: only ann's allocation is open, bob's closed with the reason
    held = admin.service("GET", "allocations").json()["allocations"]
    assert [(a["user"], a["devices"]) for a in held] == [("ann", [a_dev])]
    # nobody sees another person's idle state; an admin may
    assert ann.service("GET", "idle?user=bob").status_code == 403
    assert admin.service("GET", "idle?user=bob").status_code == 200
    ann.stop_server()
