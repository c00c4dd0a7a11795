"""The gpulab service's pages over HTTP, as a browser gets them through the hub's proxy: in
JupyterHub's own page (its navigation, CSS and scripts from the hub's static files, the
person's name, Logout), errors as pages that say what happened and what to do next (the API
keeps answering JSON), and people approved by the admin who have not logged in yet are on the
admin page and take a quota (page, API, CLI) before their first login (issue 14)."""

import re
import subprocess
import time

import pytest
import requests

from tests.conftest import PASSWORD

from .hubctl import GPULAB, Browser

pytestmark = pytest.mark.app


def page(who: Browser, path: str) -> requests.Response:
    """A page of the service with the person's hub login (the OAuth dance is followed)."""
    return who.s.get(who.hub.service_url + path, timeout=60)


def hub_pages(hub) -> str:
    """How the service's pages link the hub's: a path, or with subdomains (the service on a
    host of its own) the hub's public address."""
    return hub.url + "/hub/" if hub.subdomains else "/hub/"


def assert_hub_look(r: requests.Response, hub, name: str):
    html, h = r.text, hub_pages(hub)
    assert r.headers["Content-Type"].startswith("text/html"), r.headers
    assert 'class="navbar' in html and 'id="gpulab-nav"' in html  # the hub's navigation
    assert re.search(r'<span class="me-1">\s*' + re.escape(name) + r"\s*</span>", html)
    assert 'id="logout"' in html and f'href="{h}logout"' in html
    assert 'id="dark-theme-toggle"' in html
    # CSS and scripts are the hub's, and resolve through the proxy
    assets = re.findall(r'(?:href|src)="' + re.escape(h) + r'(static/[^"]+)"', html)
    assert any("css/style.min.css" in a for a in assets), assets
    assert any("js/darkmode.js" in a for a in assets), assets
    for asset in assets:
        got = requests.get(hub.url + "/hub/" + asset, timeout=30)
        assert got.status_code == 200, (asset, got.status_code)


def test_pages_look_like_the_hubs(hub, users, admin):
    r = page(users["ann"], "")
    assert r.status_code == 200 and "<h1>My GPUs</h1>" in r.text
    assert_hub_look(r, hub, "ann")
    assert 'id="gpulab-admin-nav"' not in r.text  # no admin link for ann
    r = page(admin, "admin")
    assert r.status_code == 200 and "<h1>GPU admin</h1>" in r.text
    assert_hub_look(r, hub, "admin")
    assert 'id="gpulab-admin-nav"' in r.text and f'href="{hub_pages(hub)}admin"' in r.text


def test_the_hubs_own_pages_lead_to_gpulab(hub, users, admin):
    """Issue 37: "GPU admin" is in the navigation of the hub's own pages too (for gpulab
    admins), and the service is not repeated under the hub's "Services" menu."""
    home = admin.s.get(hub.url + "/hub/home", timeout=30)
    assert home.status_code == 200
    # the service's pages: beside the hub's, or with subdomains on the service's own host
    base = hub.service_url if hub.subdomains else "/hub/../services/gpulab/"
    assert f'id="gpulab-nav" href="{base}">GPUs</a>' in home.text
    assert f'id="gpulab-admin-nav" href="{base}admin">GPU admin' in home.text
    mine = users["ann"].s.get(hub.url + "/hub/home", timeout=30)
    assert 'id="gpulab-nav"' in mine.text and 'id="gpulab-admin-nav"' not in mine.text
    for r in (home, mine, page(admin, "admin"), page(users["ann"], "")):
        assert ">Services</a>" not in r.text and ">gpulab</a>" not in r.text


def test_a_non_admin_on_the_admin_page_gets_a_page_saying_where_to_go(hub, users):
    r = page(users["ann"], "admin")
    assert r.status_code == 403
    assert_hub_look(r, hub, "ann")
    assert 'data-status="403"' in r.text and "403: Forbidden" in r.text
    nxt = re.search(r'<p id="error-next">(.*?)</p>', r.text, re.S).group(1)
    assert "Only gpulab admins can change quotas" in nxt
    assert '<a href="/services/gpulab/">My GPUs</a>' in nxt


def test_an_unknown_page_is_a_404_page_and_an_unknown_endpoint_json(hub, users):
    r = page(users["ann"], "nope")
    assert r.status_code == 404 and 'data-status="404"' in r.text
    assert_hub_look(r, hub, "ann")
    assert "There is no gpulab page at /services/gpulab/nope." in r.text
    r = page(users["ann"], "api/v1/nope")
    assert r.status_code == 404 and r.headers["Content-Type"].startswith("application/json")
    assert "No such gpulab endpoint" in r.json()["message"]
    # the API's own errors stay JSON too, in a browser session as with a token
    r = page(users["ann"], "api/v1/quotas")
    assert r.status_code == 403 and "custom:gpulab:admin" in r.json()["message"]
    # the service's address without its slash leads to it
    r = users["ann"].s.get(hub.service_url.rstrip("/"), allow_redirects=False, timeout=30)
    assert r.status_code in (301, 302) and r.headers["Location"].endswith("/services/gpulab/")


@pytest.mark.parametrize("query,status", [("error=access_denied", 400),
                                          ("code=x&state=forged", 403)],
                         ids=["refused", "forged-state"])
def test_a_broken_login_is_a_page_that_says_to_log_in_again(hub, query, status):
    r = requests.get(hub.service_url + "oauth_callback?" + query, timeout=30)
    assert r.status_code == status and f'data-status="{status}"' in r.text
    assert 'class="navbar' in r.text and "/hub/static/css/style.min.css" in r.text
    assert 'id="login"' in r.text  # nobody logged in: the hub's Login button
    assert "log in anew" in r.text


def test_an_approved_user_who_never_logged_in_takes_a_quota(hub, admin):
    dora = Browser(hub, "dora")
    assert dora.signup(PASSWORD).status_code == 200
    before = page(admin, "admin").text
    assert "data-user=\"dora\"" not in before  # a sign-up not approved yet is nobody
    r = admin.approve("dora")
    assert r.status_code == 200
    # a hub user now, never logged in: on the admin page, with a quota form
    assert admin.api("GET", "/users/dora").json()["last_activity"] is None
    deadline = time.time() + 15  # the service reads the hub's users at most every 5 s
    while 'tr data-user="dora"' not in (r := page(admin, "admin")).text and time.time() < deadline:
        time.sleep(0.5)
    assert 'tr data-user="dora"' in r.text, r.text[-3000:]
    assert re.search(r'<tr data-user="dora">.*?<form class="quota" data-kind="users" '
                     r'data-name="dora"', r.text, re.S)
    # the CLI takes the name without --force
    r = subprocess.run([GPULAB, "quota", "set", "--user", "dora", "--max-gpus", "1",
                        "--url", hub.url, "--token", admin.token()],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "set user quota dora: 1 GPU at once" in r.stdout, r.stderr
    # and it applies from the first login
    dora.login(PASSWORD)
    me = dora.service("GET", "me").json()
    assert me["quota"]["max_gpus"] == 1 and me["quota_source"] == "user"
    r = dora.start_server("", {"profile": "gpu-2"})
    assert r.status_code == 409 and "your quota is 1 GPU at once" in r.json()["message"]
    admin.service("DELETE", "quotas/users/dora")


def test_the_admin_page_pages_and_searches_its_users(hub, users, admin):
    """Issue 40: the admin page shows a page of people (``?offset=&limit=``) and finds them
    by name or group (``?q=``), as the hub's admin panel does; a bad page is a 400 page."""
    r = page(admin, "admin?limit=1")
    assert r.status_code == 200
    first = re.findall(r'<tr data-user="([^"]+)"', r.text)
    assert len(first) == 1 and 'id="user-range" class="muted">1–1 of ' in r.text and ">Next</a>" in r.text
    r = page(admin, "admin?limit=1&offset=1")
    second = re.findall(r'<tr data-user="([^"]+)"', r.text)
    assert len(second) == 1 and second != first and ">Previous</a>" in r.text
    r = page(admin, "admin?q=BO")
    assert re.findall(r'<tr data-user="([^"]+)"', r.text) == ["bob"]
    assert "matching &#39;BO&#39;" in r.text or "matching 'BO'" in r.text
    assert "Nobody matches" in page(admin, "admin?q=no-such-person").text
    bad = page(admin, "admin?limit=0")
    assert bad.status_code == 400 and "must be from 1 to 500, got 0" in bad.text
