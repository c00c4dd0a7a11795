"""An admin in a browser reaches the gpulab admin page from the hub's own navigation ("GPU
admin" on the hub's pages too, and gpulab not repeated under "Services"), lowers a user's
quota there, and sees the "Effective quota" column and the audit trail follow the save in
place, without a reload; the user's next 2-GPU spawn is refused with the quota message;
raising it again lets the spawn through."""

import re

import pytest

from .test_lab_browser import login

pytestmark = pytest.mark.e2e


def set_override(page, user, max_gpus):
    """Save a user's override and wait until the page says it is saved: no reload (a mark
    on the page's window would be lost by one)."""
    page.evaluate("window.gpulabNoReload = true")
    form = page.locator(f"tr[data-user='{user}'] form.quota")
    form.locator("input[name=max_gpus]").fill(str(max_gpus))
    form.locator("button[name=save]").click()
    form.locator(".msg.ok").wait_for()
    assert page.evaluate("window.gpulabNoReload") is True


def test_admin_page_quota_edit_reaches_the_spawn(page, hub, users):
    ann = users["ann"]
    login(page, hub, "admin", hub.admin_password)
    page.wait_for_url(re.compile(r".*/hub/.*"))
    page.goto(hub.url + "/hub/home")
    # the hub's own page: "GPUs" and, for a gpulab admin, "GPU admin" in its navigation; the
    # service is not listed again under "Services"
    nav = page.locator("nav.navbar")
    assert nav.locator("#gpulab-nav").inner_text() == "GPUs"
    assert nav.locator("#gpulab-admin-nav").inner_text() == "GPU admin"
    services = nav.locator(".dropdown-menu a.dropdown-item")
    assert [t.strip() for t in services.all_inner_texts()] == []
    page.click("#gpulab-admin-nav")
    page.wait_for_url(re.compile(r".*/services/gpulab/admin"))
    assert page.locator("#gpulab-admin-nav.active").count() == 1
    assert page.locator("tr[data-user='ann']").is_visible()
    # the primary button in the hub's orange (its Bootstrap theme's btn-jupyter), not blue
    save = page.locator("tr[data-user='ann'] form.quota button[name=save]")
    assert save.evaluate("b => getComputedStyle(b).backgroundColor") == "rgb(243, 117, 36)"
    assert page.locator(".gpulab-simulated").first.inner_text() == "Simulated"

    # validation happens on the server and is shown inline, nothing stored
    form = page.locator("tr[data-user='ann'] form.quota")
    form.locator("input[name=max_gpus]").fill("2")
    form.locator("input[name=gpu_hours]").fill("10")
    form.locator("button[name=save]").click()
    form.locator(".msg.error").wait_for()
    assert "window_hours" in form.locator(".msg").inner_text()

    page.reload()
    # something typed in another row stays through a save (nothing reloads)
    page.locator("tr[data-user='bob'] input[name=max_gpus]").fill("7")
    effective = page.locator("tr[data-user='ann'] td.effective")
    before = effective.inner_text()  # without an override
    set_override(page, "ann", 1)
    assert effective.inner_text() == "1 GPU at once (user)"
    assert page.locator("tr[data-user='bob'] input[name=max_gpus]").input_value() == "7"
    newest = page.locator("#audit tbody tr").first
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d", newest.locator("td.when").inner_text())
    assert "admin" in newest.inner_text() and "user 'ann'" in newest.inner_text()
    assert newest.locator("td.new").inner_text() == "1 GPU at once"
    assert form.locator("button[name=unset]").is_visible()
    r = ann.start_server("", {"profile": "gpu-2"})
    assert r.status_code == 409 and "your quota is 1 GPU at once" in r.json()["message"]

    set_override(page, "ann", 2)
    assert effective.inner_text() == "2 GPUs at once (user)"
    assert newest.locator("td.old").inner_text() == "1 GPU at once"
    assert newest.locator("td.new").inner_text() == "2 GPUs at once"
    assert ann.start_server("", {"profile": "gpu-2"}).status_code in (201, 202)
    page.reload()
    # which devices ann's server holds, and their model (issue 14)
    held = page.locator("tr[data-user='ann'] td.held").inner_text()
    assert re.search(r"notebook 'default' \(2\): GPU \d, \d \S", held), held
    audit = page.locator("#audit").inner_text()
    assert "admin" in audit and "user 'ann'" in audit
    assert "1 GPU at once" in audit and "2 GPUs at once" in audit  # the quotas in words
    ann.stop_server()

    # Unset, in place too: back to what applies without an override
    page.evaluate("window.gpulabNoReload = true")
    form.locator("button[name=unset]").click()
    form.locator(".msg.ok", has_text="unset").wait_for()
    assert page.evaluate("window.gpulabNoReload") is True
    assert effective.inner_text() == before
    assert form.locator("input[name=max_gpus]").input_value() == ""
    assert form.locator("button[name=unset]").is_hidden()
    assert newest.locator("td.new").inner_text() == "unset"
