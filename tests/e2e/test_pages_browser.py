"""gpulab's pages in a real browser (issue 14): they look like the hub's own (navigation,
Bootstrap 5, dark mode shared with the hub's pages, the person's name and Logout), a person who
is no admin opening the admin page gets a styled page that leads to their own, a quota error
points at the input it names, and TensorBoard behind the hub loads its fonts without a 404
and without asking Google Fonts (which this machine cannot reach)."""

import re

import pytest

from tests.conftest import PASSWORD

from .test_lab_browser import login

pytestmark = pytest.mark.e2e


def login_as(page, hub, name, password):
    page.context.clear_cookies()  # one browser for the module: nobody is logged in before
    login(page, hub, name, password)
    page.wait_for_url(re.compile(r".*/(hub|user)/.*"))


def watch(page):
    """Every response of the page (url, status) and every request that failed."""
    seen = {"responses": [], "failed": [], "requests": []}
    page.on("request", lambda r: seen["requests"].append(r.url))
    page.on("response", lambda r: seen["responses"].append((r.url, r.status)))
    page.on("requestfailed", lambda r: seen["failed"].append(r.url))
    return seen


def test_pages_in_the_hubs_look_with_dark_mode(page, hub, users, admin):
    login_as(page, hub, "admin", hub.admin_password)
    seen = watch(page)
    page.goto(hub.service_url + "admin")
    page.wait_for_load_state("networkidle")
    bad = [(u, s) for u, s in seen["responses"] if s >= 400] + seen["failed"]
    assert not bad, bad  # the hub's CSS and scripts resolve through the proxy
    assert any("/hub/static/css/style.min.css" in u for u, _ in seen["responses"])
    nav = page.locator("nav.navbar")
    assert nav.locator("#gpulab-nav").is_visible() and nav.locator("#logout").is_visible()
    assert "admin" in nav.locator("#login_widget").inner_text()
    assert page.evaluate("getComputedStyle(document.querySelector('nav.navbar')).display") == "flex"
    assert page.evaluate("getComputedStyle(document.querySelector('#users')).borderCollapse") == \
        "collapse"

    # dark mode: the hub's toggle, remembered across pages (the hub's own too)
    before = page.evaluate("document.documentElement.dataset.bsTheme")
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    page.click("#dark-theme-toggle")
    after = page.evaluate("document.documentElement.dataset.bsTheme")
    assert {before, after} == {"light", "dark"}
    assert page.evaluate("getComputedStyle(document.body).backgroundColor") != background
    page.goto(hub.url + "/hub/home")
    if not hub.subdomains:  # the choice is kept per origin (localStorage)
        assert page.evaluate("document.documentElement.dataset.bsTheme") == after
    page.goto(hub.service_url)
    assert page.evaluate("document.documentElement.dataset.bsTheme") == after
    page.click("#dark-theme-toggle")  # back as it was for the next tests

    # Logout is the hub's, and it ends the admin's every session on the hub (issue 33.6):
    # the other one, over HTTP, is logged out too
    assert admin.api("GET", "/users/admin").status_code == 200
    page.click("#logout")
    page.wait_for_url(re.compile(r".*/hub/(login|logout).*"))
    assert admin.api("GET", "/users/admin").status_code == 403
    admin.s.cookies.clear()  # as a browser with the dead cookies thrown away, for the next tests
    admin.login(hub.admin_password)


def test_a_quota_error_points_at_the_field_it_names(page, hub, users, admin):
    login_as(page, hub, "admin", hub.admin_password)
    page.goto(hub.service_url + "admin")
    form = page.locator("tr[data-user='bob'] form.quota")
    # every input's label shows the name the API and its errors use
    for field in ("max_gpus", "max_per_request", "gpu_hours", "window_hours", "disk"):
        label = form.locator("label", has=page.locator(f"input[name={field}]"))
        assert field in label.locator("code").inner_text()
    form.locator("input[name=max_gpus]").fill("2")
    form.locator("input[name=gpu_hours]").fill("10")
    form.locator("button[name=save]").click()
    form.locator(".msg.error").wait_for()
    message = form.locator(".msg").inner_text()
    assert "'window_hours'" in message, message
    marked = form.locator("input.is-invalid")
    assert marked.count() == 1 and marked.get_attribute("name") == "window_hours"
    assert marked.evaluate("el => el === document.activeElement")
    # fixed, the mark goes and the quota is stored
    form.locator("input[name=window_hours]").fill("168")
    form.locator("button[name=save]").click()
    form.locator(".msg.ok").wait_for()
    page.wait_for_load_state("load")
    page.locator("tr[data-user='bob'] td.effective", has_text="10 GPU-hours").wait_for()
    # a disk limit in words the service does not read: the disk input is marked
    form = page.locator("tr[data-user='bob'] form.quota")
    form.locator("input[name=disk]").fill("20 X")
    form.locator("button[name=save]").click()
    form.locator(".msg.error").wait_for()
    assert "'disk'" in form.locator(".msg").inner_text()
    assert form.locator("input.is-invalid").get_attribute("name") == "disk"
    form.locator("input[name=disk]").fill("64M")
    form.locator("button[name=save]").click()
    form.locator(".msg.ok").wait_for()
    page.wait_for_load_state("load")
    page.locator("tr[data-user='bob'] td.effective", has_text="64 MiB disk").wait_for()
    # the input shows the stored limit as it reads it back
    assert page.locator("tr[data-user='bob'] input[name=disk]").input_value() == "64M"
    assert admin.service("DELETE", "quotas/users/bob").status_code == 204


def test_a_person_on_the_admin_page_is_shown_the_way_to_their_own(page, hub, users):
    login_as(page, hub, "ann", PASSWORD)
    seen = watch(page)
    r = page.goto(hub.service_url + "admin")
    assert r.status == 403
    page.wait_for_load_state("networkidle")
    assert not [(u, s) for u, s in seen["responses"] if s >= 400 and "/static/" in u]
    assert page.locator("#gpulab-error h1").inner_text() == "403: Forbidden"
    assert "ann" in page.locator("#login_widget").inner_text()
    assert page.locator("#logout").is_visible()
    nxt = page.locator("#error-next")
    assert "Only gpulab admins can change quotas" in nxt.inner_text()
    nxt.locator("a", has_text="My GPUs").click()
    page.wait_for_url(hub.service_url)
    assert page.locator("h1").inner_text() == "My GPUs"
    assert page.locator("#gpulab-admin-nav").count() == 0

    page.goto(hub.service_url + "no-such-page")
    assert page.locator("#gpulab-error h1").inner_text() == "404: Not Found"


def test_tensorboard_fonts_load_behind_the_hub(page, hub, users):
    ann = users["ann"]
    assert ann.start_server("", {"profile": "cpu"}).status_code in (201, 202)
    try:
        login_as(page, hub, "ann", PASSWORD)
        seen = watch(page)
        page.goto(hub.user_url("ann") + "tensorboard/", timeout=120_000)
        page.locator("tb-webapp").wait_for(state="attached", timeout=120_000)
        page.wait_for_function("() => document.fonts.status === 'loaded'", timeout=60_000)
        page.wait_for_load_state("networkidle", timeout=60_000)
        fonts = [(u, s) for u, s in seen["responses"] if re.search(r"\.(woff2?|ttf)\b", u)]
        assert fonts, seen["responses"][:20]  # the page does use its Roboto
        assert all(s == 200 and "/user/ann/tensorboard/font-roboto/" in u for u, s in fonts), fonts
        assert not [u for u in seen["requests"] if "fonts.googleapis.com" in u
                    or "fonts.gstatic.com" in u]
        assert not [u for u in seen["failed"] if "font" in u], seen["failed"]
        assert page.evaluate("document.fonts.check('12px Roboto')")
    finally:
        ann.stop_server("")
