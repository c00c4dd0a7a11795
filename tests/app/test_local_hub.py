"""The local deployment through its real interfaces: `gpulab up` (JupyterHub with
configurable-http-proxy), the hub's HTTP API and spawn form, and code run in the servers."""

import json
import os
import re
import signal
import time

import pytest

from .hubctl import pid_exists

pytestmark = pytest.mark.app

PROBE = (
    "import os, json, pwd\n"
    "print(json.dumps({'cuda': os.environ.get('CUDA_VISIBLE_DEVICES'),"
    " 'gpus': json.loads(os.environ.get('GPULAB_GPUS', '[]')),"
    " 'user': pwd.getpwuid(os.getuid()).pw_name, 'server_pid': os.getppid(),"
    " 'user_dir': os.environ.get('GPULAB_USER_DIR'), 'cwd': os.getcwd(),"
    " 'legacy_keras': os.environ.get('TF_USE_LEGACY_KERAS'),"
    " 'tf_devices': os.environ.get('TF_ENABLED_DEVICE_TYPES')}))"
)


def probe(browser, server=""):
    return json.loads(browser.run_in_kernel(PROBE, server).strip().splitlines()[-1])


def devices(p):
    return set(p["cuda"].split(",")) if p["cuda"] else set()


def test_unapproved_and_unknown_people_cannot_log_in(hub):
    from .hubctl import Browser

    stranger = Browser(hub, "mallory")
    r = stranger.post_form("/hub/login", {"username": "mallory", "password": "whatever1"},
                           allow_redirects=False)
    assert r.status_code != 302
    assert stranger.api("GET", "/users/mallory").status_code in (401, 403)


def test_the_banner_says_what_one_origin_leaves_open(hub):
    """On loopback `gpulab up` puts each server on a host of its own by default and says
    nothing of origins; with --no-subdomains it warns that people's servers share the hub's
    web origin and says how to end it (README, Users and isolation)."""
    out = hub.output()
    if hub.subdomains:
        assert "share the hub's web origin" not in out
        assert f"gpulab: open http://localhost:{hub.port}/ in a browser" in out
    else:
        assert "gpulab: WARNING people's servers share the hub's web origin" in out
        assert f"Leave out --no-subdomains (then http://localhost:{hub.port})" in out


def test_spawn_form_lists_profiles_with_free_gpus(users, hub):
    r = users["ann"].s.get(hub.url + "/hub/spawn")
    assert r.status_code == 200
    assert 'value="gpu-2"' in r.text and 'value="cpu"' in r.text
    assert "4 of 4 GPUs free" in r.text and "simulated" in r.text
    assert 'class="badge text-bg-warning gpulab-simulated"' in r.text  # JupyterHub 5's Bootstrap


def test_spawn_form_disables_profiles_over_the_quota(users, hub, admin):
    """Issue 14: a profile over the person's quota cannot be chosen (it was refused only
    after Start), and the form says why."""
    import re

    assert admin.service("PUT", "quotas/users/carl", json={"max_gpus": 1}).status_code == 200
    try:
        page = users["carl"].s.get(hub.url + "/hub/spawn").text
        radios = dict(re.findall(r'<input type="radio" name="profile" id="profile-([\w-]+)"'
                                 r'[^>]*?(disabled)?>', page))
        assert radios["gpu-1"] == "" and radios["cpu"] == ""
        assert radios["gpu-2"] == "disabled" and radios["gpu-4"] == "disabled"
        # more than the quota itself: no stop would help, and the reason says so
        assert "more than your quota allows (1 at once)" in page
    finally:
        admin.service("DELETE", "quotas/users/carl")


def test_servers_get_disjoint_gpus(users, prefix):
    ann, bob = users["ann"], users["bob"]
    assert ann.start_server("big", {"profile": "gpu-2"}).status_code in (201, 202)
    assert bob.start_server("", {"profile": "gpu-1"}).status_code in (201, 202)
    pa, pb = probe(ann, "big"), probe(bob)
    assert len(devices(pa)) == 2 and len(devices(pb)) == 1
    assert devices(pa).isdisjoint(devices(pb))
    assert [g["simulated"] for g in pa["gpus"]] == [True, True]
    assert {str(g["index"]) for g in pa["gpus"]} == devices(pa)
    assert pa["user_dir"].endswith("/users/ann")
    assert pa["legacy_keras"] == "1"  # tf.keras as training jobs have it (tf-keras 2)
    # simulated GPUs: TensorFlow uses the CPU and logs no failed cuInit (issue 34)
    assert pa["tf_devices"] == pb["tf_devices"] == "CPU"
    if os.geteuid() == 0:
        assert pa["user"] == prefix + "ann" and pb["user"] == prefix + "bob"


def test_exhaustion_is_refused_with_a_message(users):
    carl = users["carl"]
    r = carl.start_server("", {"profile": "gpu-2"})
    assert r.status_code == 409, r.text
    msg = r.json()["message"]
    assert "Not enough free GPUs" in msg and "1 of 4 is free" in msg
    assert "3 held by other users" in msg
    assert not re.search(r"\b(ann|bob|big)\b", msg)
    info = carl.api("GET", "/users/carl").json()
    assert info["servers"] == {}  # nothing half-started


def test_a_refusal_from_the_spawn_form_is_a_warning_without_traceback(users, hub, admin):
    """Issue 14: a quota refusal is the person's business, not an error of the hub: one
    WARNING line in the hub's log, no traceback (JupyterHub logs form failures with one)."""
    ann = users["ann"]
    assert admin.service("PUT", "quotas/users/ann", json={"max_gpus": 0}).status_code == 200
    try:
        before = len(hub.output())
        r = ann.s.post(hub.url + "/hub/spawn/ann/refused",
                       data={"profile": "gpu-1", "_xsrf": ann._xsrf()})
        assert r.status_code == 409 and "Quota exceeded" in r.text, r.text[:300]
        time.sleep(0.5)  # the log is written by another process
        log = hub.output()[before:]
        assert "Quota exceeded" in log and "Traceback" not in log, log[-3000:]
        refusal_lines = [ln for ln in log.splitlines() if "Quota exceeded" in ln]
        assert refusal_lines and all(ln.startswith("[W ") for ln in refusal_lines
                                     if ln.startswith("[")), refusal_lines
    finally:
        admin.service("DELETE", "quotas/users/ann")


def test_own_holdings_are_named_in_the_refusal(users):
    ann = users["ann"]
    r = ann.start_server("second", {"profile": "gpu-2"})
    assert r.status_code == 409
    assert "your server 'big' (2)" in r.json()["message"]


@pytest.mark.parametrize(
    "options,expected",
    [
        ({"profile": "gpu-99"}, "There is no profile 'gpu-99'"),
        ({"profile": "gpu-1", "gpus": 3}, "Unknown server option(s): gpus"),
        ({"profile": -1}, "'profile' must be a profile name"),
    ],
    ids=["unknown-profile", "tampered-gpu-count", "negative"],
)
def test_bad_options_are_refused(users, options, expected):
    carl = users["carl"]
    r = carl.start_server("", options)
    assert r.status_code == 400, r.text
    assert expected in r.json()["message"]
    assert carl.api("GET", "/users/carl").json()["servers"] == {}


def test_tampered_form_is_refused(users, hub):
    carl = users["carl"]
    r = carl.post_form("/hub/spawn/carl", {"profile": "gpu-99"})
    assert r.status_code == 400
    assert "There is no profile" in r.text
    r = carl.post_form("/hub/spawn/carl", {"profile": "gpu-1", "gpus": "-3"})
    # the form is read as JupyterHub reads it; the start refuses what gpulab does not know
    assert r.status_code == 400 and "Unknown server option(s): gpus" in r.text
    assert carl.api("GET", "/users/carl").json()["servers"] == {}


@pytest.mark.skipif(os.geteuid() != 0, reason="isolation needs root")
def test_users_cannot_read_each_others_folders(users, hub):
    ann = users["ann"]
    out = ann.run_in_kernel(
        "import os\n"
        "bob = os.path.join(os.path.dirname(os.environ['GPULAB_USER_DIR']), 'bob')\n"
        "try:\n    os.listdir(bob); print('READ')\nexcept PermissionError: print('DENIED')\n"
        "ds = os.path.join(os.environ['GPULAB_SHARED_DIR'], 'datasets')\n"
        "print('DS-READ' if os.access(ds, os.R_OK) else 'DS-NOREAD')\n"
        "print('DS-WRITE' if os.access(ds, os.W_OK) else 'DS-NOWRITE')\n",
        "big",
    )
    assert out.split() == ["DENIED", "DS-READ", "DS-NOWRITE"]
    st = os.stat(hub.data_dir / "shared" / "users" / "bob")
    assert oct(st.st_mode & 0o777) == "0o700"


def test_stop_releases_gpus(users):
    ann, carl = users["ann"], users["carl"]
    ann.stop_server("big")
    assert carl.start_server("", {"profile": "gpu-2"}).status_code in (201, 202)
    assert len(devices(probe(carl))) == 2
    carl.stop_server("")


def test_killed_server_releases_gpus(users):
    bob, carl = users["bob"], users["carl"]
    pid = probe(bob)["server_pid"]
    os.kill(pid, signal.SIGKILL)
    # all four GPUs: only possible once bob's dead server's GPU came back
    r = carl.start_server("all", {"profile": "gpu-4"})
    assert r.status_code in (201, 202), r.text
    assert len(devices(probe(carl, "all"))) == 4
    carl.stop_server("all")


def test_a_server_does_not_read_the_hubs_terminal(users, hub):
    """Issue 14: a server's standard input is /dev/null, not the input of `gpulab up` (a
    terminal: another person's process could read what the operator types, and Jupyter asked
    there whether to shut down on Ctrl-C, which held every stop for 10 s)."""
    ann = users["ann"]
    assert ann.start_server("stdin", {"profile": "cpu"}).status_code in (201, 202)
    pid = probe(ann, "stdin")["server_pid"]
    assert not os.readlink(f"/proc/{hub.proc.pid}/fd/0").startswith("/dev/null")
    assert os.readlink(f"/proc/{pid}/fd/0") == "/dev/null"
    ann.stop_server("stdin")


def test_hub_restart_keeps_assignments_and_ctrl_c_stops_servers(users, hub):
    ann, bob = users["ann"], users["bob"]
    deadline = time.time() + 30  # the hub notices bob's killed server
    while "" in bob.api("GET", "/users/bob").json()["servers"] and time.time() < deadline:
        time.sleep(0.5)
    assert ann.start_server("", {"profile": "gpu-2"}).status_code in (201, 202)
    before = probe(ann)
    # the hub crashes; its servers keep running
    hub.stop(signal.SIGKILL)
    assert pid_exists(before["server_pid"])
    hub.start()
    # the same session cookie still works after the restart: nothing was lost
    after = probe(ann)
    assert devices(after) == devices(before) and after["server_pid"] == before["server_pid"]
    r = bob.start_server("", {"profile": "gpu-4"})
    assert r.status_code == 409 and "2 of 4 are free" in r.json()["message"]
    # Ctrl-C: the hub stops every server it started, says which, and exits 0 (issue 37:
    # without the interpreter's slow teardown, `gpulab.hub.service.exit_at_once`)
    hub.stop(signal.SIGINT)
    deadline = time.time() + 30
    while pid_exists(before["server_pid"]) and time.time() < deadline:
        time.sleep(0.3)
    assert not pid_exists(before["server_pid"])
    assert hub.proc.returncode == 0
    stopping = hub.output().rsplit("Received signal SIGINT", 1)[1]
    assert re.search(r"Stopping \d+ server\(s\): (\S+, )*ann\b", stopping), stopping[-2000:]
    assert "...done" in stopping and "gpulab service: SIGINT, stopping" in stopping
    hub.start()  # for the module fixture's teardown


def test_sigterm_stops_servers_and_exits_0(users, hub, admin):
    """What `systemctl stop gpulab` does (the unit's KillMode=mixed: SIGTERM to the hub
    alone): the hub stops every server itself and exits 0, so the unit ends as stopped, not
    failed, with nothing left for systemd's SIGKILL."""
    ann = users["ann"]
    assert ann.start_server("", {"profile": "gpu-1"}).status_code in (201, 202)
    server_pid = admin.api("GET", "/users/ann").json()["servers"][""]["state"]["pid"]
    assert pid_exists(server_pid)
    hub.proc.send_signal(signal.SIGTERM)
    assert hub.proc.wait(60) == 0, hub.output()[-2000:]
    deadline = time.time() + 10  # the server's process, no longer the hub's child, is reaped
    while pid_exists(server_pid) and time.time() < deadline:
        time.sleep(0.2)
    assert not pid_exists(server_pid)
    hub.start()  # for the module fixture's teardown
