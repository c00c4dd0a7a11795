"""Without subdomains (``gpulab up --no-subdomains``, or bound to an address with no
``--subdomain-host``), the hub refuses what it can
tell a page of a person's server sent (issue 33.3, `gpulab.hub.deploy.userpages`): the page of
eve's server (`test_user_pages_browser.ATTACK`, served the same way) that does not pose as a
hub page reads no token through a frame (``frame-ancestors 'none'``), and its requests to the
hub's API are refused with 403 whatever token it holds; eve stays no admin. The admin's own
links from the lab to the hub (top-level navigations) still work.

What this does not stop (a page that changes its address to one below ``/hub/`` first, or
scripts a hub window it opened) is said in the README; only subdomains stop it
(`test_user_pages_browser.py`)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import hub_with_config
from tests.e2e.conftest import chromium, page  # noqa: F401 (fixtures)

from .test_user_pages_browser import open_as_admin, serve_attack, stop_serving

pytestmark = [pytest.mark.security, pytest.mark.e2e]


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    """The hub and every server on one origin, http://127.0.0.1:<port> (--no-subdomains)."""
    yield from hub_with_config(workdir, prefix, "", subdomains=False)


def test_one_origin_refuses_the_plain_page_of_eves_server(page, hub, admin, eve):
    assert not hub.subdomains
    # gpulab up said what stays open, and the way out
    out = hub.output()
    assert "gpulab: WARNING people's servers share the hub's web origin" in out
    assert f"Leave out --no-subdomains (then http://localhost:{hub.port})" in out
    url, pid = serve_attack(eve, hub, sneaky=False)
    try:
        got = open_as_admin(page, hub, url)
    finally:
        stop_serving(eve, pid)
    assert page.evaluate("location.pathname").startswith("/user/eve/proxy/")
    # every change the page sent was refused by the hub, before any of its handlers
    assert got["patch-hub"] == "403" and got["patch-relative"] == "403", got
    assert not got["frame"].startswith("read token"), got
    user = admin.api("GET", "/users/eve").json()
    assert user["admin"] is False and "admin" not in user["roles"], user
    assert "Refused PATCH /hub/api/users/eve" in hub.output()
    # the hub's own pages still work, and a top-level link from a server's page to the hub
    # (the lab's "Hub Control Panel") is followed
    page.goto(hub.url + "/hub/home")
    assert page.url.startswith(hub.url + "/hub/home")
    page.goto(url.rsplit("/", 1)[0] + "/")  # the directory listing of eve's page server
    with page.expect_response(re.compile(r".*/hub/home$")) as answer:
        page.evaluate("location.href = '/hub/home'")
    assert answer.value.status == 200
