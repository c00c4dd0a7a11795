"""An admin in a browser lowers a user's quota on the gpulab admin page; the user's next 2-GPU
spawn is refused with the quota message; raising it again lets the spawn through."""

import re

import pytest

from .test_lab_browser import login

pytestmark = pytest.mark.e2e


def set_override(page, user, max_gpus):
    form = page.locator(f"tr[data-user='{user}'] form.quota")
    form.locator("input[name=max_gpus]").fill(str(max_gpus))
    form.locator("button[name=save]").click()
    form.locator(".msg.ok").wait_for()
    page.wait_for_load_state("load")


def test_admin_page_quota_edit_reaches_the_spawn(page, hub, users):
    ann = users["ann"]
    login(page, hub, "admin", hub.admin_password)
    page.wait_for_url(re.compile(r".*/hub/.*"))
    page.goto(hub.url + "/hub/home")
    page.click("#gpulab-nav")  # the hub's navigation leads to the gpulab pages
    page.wait_for_url(re.compile(r".*/services/gpulab/.*"))
    page.click("text=GPU admin")
    page.wait_for_url(re.compile(r".*/services/gpulab/admin"))
    assert page.locator("tr[data-user='ann']").is_visible()

    # validation happens on the server and is shown inline, nothing stored
    form = page.locator("tr[data-user='ann'] form.quota")
    form.locator("input[name=max_gpus]").fill("2")
    form.locator("input[name=gpu_hours]").fill("10")
    form.locator("button[name=save]").click()
    form.locator(".msg.error").wait_for()
    assert "window_hours" in form.locator(".msg").inner_text()

    page.reload()
    set_override(page, "ann", 1)
    page.locator("tr[data-user='ann'] td.effective", has_text="1 GPU at once").wait_for()
    r = ann.start_server("", {"profile": "gpu-2"})
    assert r.status_code == 409 and "your quota is 1 GPU at once" in r.json()["message"]

    set_override(page, "ann", 2)
    assert ann.start_server("", {"profile": "gpu-2"}).status_code in (201, 202)
    page.reload()
    # which devices ann's server holds, and their model (issue 14)
    held = page.locator("tr[data-user='ann'] td.held").inner_text()
    assert re.search(r"notebook 'default' \(2\): GPU \d, \d \S", held), held
    audit = page.locator("#audit").inner_text()
    assert "admin" in audit and "user 'ann'" in audit
    assert "1 GPU at once" in audit and "2 GPUs at once" in audit  # the quotas in words
    ann.stop_server()
