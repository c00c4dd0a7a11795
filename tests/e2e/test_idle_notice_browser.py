"""A person's JupyterLab warns them that their server's GPU sits idle (issue 39): the
notification (JupyterLab 4's, from the labextension's idle-notice plugin) says when the server
will be stopped and has a "Keep for 2 hours" button; clicked, the server is kept (the gpulab
service says so) and the warning is gone. The stand-in usage source drives the simulated GPU;
the clocks are short (warned 5 s after the GPU goes idle) but leave a wide window before the
stop (90 s), so a loaded machine still sees the warning."""

import re
import time

import pytest
import requests

from tests.app.hubctl import Browser
from tests.app.test_gpu_idle import device_of, set_usage, wait_for
from tests.conftest import PASSWORD, hub_with_config

from .test_lab_browser import login

pytestmark = pytest.mark.e2e

CONFIG = """
c.GPUInventory.usage_source = "stand-in"
c.GPUInventory.usage_interval = 0.5
c.GPUIdle.mode = "stop"
c.GPUIdle.threshold_percent = 5
c.GPUIdle.idle_seconds = 90
c.GPUIdle.warn_seconds = 85
c.GPUIdle.keep_max_hours = 2
"""


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    yield from hub_with_config(workdir, prefix, CONFIG, gpus=1)


@pytest.fixture(scope="module")
def dee(hub):
    admin = Browser(hub, "admin")
    admin.login(hub.admin_password)
    b = Browser(hub, "dee")
    assert b.signup(PASSWORD).status_code == 200
    assert admin.approve("dee").status_code == 200
    b.login(PASSWORD)
    return b


def test_lab_notifies_an_idle_gpu_server_and_keeps_it(page, hub, dee):
    set_usage(hub, {0: 90})
    r = dee.start_server("", {"profile": "gpu-1"})
    assert r.status_code in (201, 202), r.text
    server = hub.user_url("dee", "")
    auth = {"Authorization": f"token {dee.token()}"}
    # the server extension's door: nothing to say while the GPU works
    answer = requests.get(server + "gpulab/idle", headers=auth, timeout=30)
    assert answer.status_code == 200, answer.text
    assert answer.json() == {"server": "default", "enabled": True, "notices": [],
                             "kept_until": None, "keep_max_hours": 2}
    # an unauthenticated caller gets nothing
    assert requests.get(server + "gpulab/idle", timeout=30,
                        allow_redirects=False).status_code in (302, 403)

    set_usage(hub, {device_of(dee): 0})
    wait_for("dee's warning", lambda: dee.service("GET", "idle").json()["notices"])
    answer = requests.get(server + "gpulab/idle", headers=auth, timeout=30).json()
    [notice] = answer["notices"]
    assert notice["stop_at"] > time.time() and notice["can_keep"] and notice["gpus"] == 1
    # past the operator's limit: the service's 400 and its words come back through the door
    r = requests.post(server + "gpulab/idle/keep", headers=auth, json={"hours": 3}, timeout=30)
    assert r.status_code == 400 and "at most 2 hours" in r.json()["message"], r.text
    r = requests.post(server + "gpulab/idle/keep", headers=auth, data="soon", timeout=30)
    assert r.status_code == 400 and r.json()["field"] == "hours", r.text

    # the lab shows the warning at start, with the stop time and the Keep button
    login(page, hub, "dee", PASSWORD)
    page.wait_for_url(re.compile(r".*/hub/(home|spawn|user).*|.*/user/dee/.*"))
    page.goto(hub.url + "/hub/user/dee/lab")
    page.wait_for_url(re.compile(r".*/user/dee/lab.*"), timeout=60_000)
    toast = page.locator(".Toastify__toast", has_text="GPUs idle")
    toast.first.wait_for(timeout=60_000)
    assert "will be stopped at" in toast.first.inner_text()
    toast.first.get_by_role("button", name="Keep for 2 hours").click()
    page.locator(".Toastify__toast", has_text="kept until").first.wait_for(timeout=30_000)
    toast.first.wait_for(state="detached", timeout=30_000)

    idle = dee.service("GET", "idle").json()
    assert idle["notices"] == []
    [kept] = idle["kept"]
    assert kept["server"] == "default" and kept["kept_until"] > time.time() + 7000
    answer = requests.get(server + "gpulab/idle", headers=auth, timeout=30).json()
    assert answer["notices"] == [] and answer["kept_until"] == kept["kept_until"]
    dee.stop_server()
