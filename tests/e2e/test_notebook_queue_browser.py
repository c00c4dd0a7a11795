"""A person in Chromium starts a GPU notebook while the machine's one GPU is busy: the spawn
form lets them choose the busy profile and a wait, the spawn-pending page shows the server's
place in the GPU queue (with a way to leave the line), and when the job holding the GPU ends
the server starts by itself and the page moves on to it."""

import re

import pytest

from tests.app.hubctl import Browser
from tests.app.test_jobs_api import SLEEPER, mw, wait_state
from tests.conftest import PASSWORD, hub_with_config

from .test_lab_browser import login

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    yield from hub_with_config(workdir, prefix, "", gpus=1)


@pytest.fixture(scope="module")
def gil(hub):
    admin = Browser(hub, "admin")
    admin.login(hub.admin_password)
    b = Browser(hub, "gil")
    assert b.signup(PASSWORD).status_code == 200
    assert admin.approve("gil").status_code == 200
    b.login(PASSWORD)
    return b


def test_a_notebook_waits_in_line_on_its_page_and_starts_by_itself(page, hub, gil):
    r = gil.service("POST", "jobs", json=mw("busy", workers=1, gpus=1, source=SLEEPER))
    assert r.status_code == 201, r.text
    wait_state(gil, "busy", ("Running",))

    login(page, hub, "gil", PASSWORD)
    page.wait_for_url(re.compile(r".*/hub/spawn.*"))
    form = page.locator("#gpulab-spawn-form")
    one = form.locator(".gpulab-profile[data-profile='gpu-1']")
    assert "busy now: only 0 free now; it can wait in the queue" in " ".join(
        one.inner_text().split())
    page.check("#profile-gpu-1")
    wait = form.locator("select#gpu_wait_minutes")
    assert wait.locator("option").all_inner_texts() == [
        "don't wait", "wait up to 5 min", "wait up to 15 min", "wait up to 60 min"]
    wait.select_option("5")
    page.click("input[type=submit], button[type=submit]")

    # the pending page: the server's place in line, updated from the queue
    page.wait_for_url(re.compile(r".*/hub/spawn-pending/gil.*"), timeout=30_000)
    message = page.locator("#progress-message")
    page.wait_for_function(
        "el => el.textContent.startsWith('Waiting for GPUs: next in line')",
        arg=message.element_handle(), timeout=30_000)
    assert "GPU" in message.inner_text()
    leave = message.locator("a.gpulab-leave-queue")
    assert leave.inner_text() == "Leave the queue"
    # the service's pages: with subdomains on the service's own host
    assert leave.get_attribute("href") == (
        hub.service_url if hub.subdomains else "/services/gpulab/") + "#queue"
    [entry] = gil.service("GET", "queue").json()["entries"]
    assert (entry["kind"], entry["holder"], entry["position"]) == ("notebook", "default", 1)

    # the job ends: the server starts by itself and the page moves on to it
    assert gil.service("POST", "jobs/busy/stop").status_code == 200
    page.wait_for_url(re.compile(r".*/user/gil/.*"), timeout=60_000)
    held = gil.service("GET", "me").json()["holdings"]
    assert [(h["kind"], h["gpus"]) for h in held] == [("notebook", 1)], held
    gil.stop_server("")
