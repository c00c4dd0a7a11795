"""A page on another site, opened by the logged-in admin in a real browser, changes nothing
in the hub (issue 33.4): it makes the browser GET the approval links (frames and a top-level
navigation, which carry the admin's cookies and skip JupyterHub's XSRF check for GETs), POST
forms without the XSRF token it cannot read, and frame the gpulab service's admin page. The
sign-up stays pending, the admin stays approved, the frame stays empty; the admin's own
authorization page still approves with its buttons.

The attacker's site is a plain HTTP server on another port of 127.0.0.1: another origin, but
the same site, so that the browser sends the hub's cookies (SameSite=Lax) with every request
of it, frames and POSTs included, as it would for a page under the hub's own host name."""

from __future__ import annotations

import functools
import http.server
import re
import threading

import pytest

from tests.app.hubctl import Browser, free_port
from tests.conftest import PASSWORD

from .test_lab_browser import login

pytestmark = pytest.mark.e2e

ATTACK = """<!doctype html><title>cute cats</title>
<iframe name="get1" src="{hub}/hub/authorize/pendy"></iframe>
<iframe name="get2" src="{hub}/hub/authorize/admin"></iframe>
<iframe name="get3" src="{hub}/hub/discard/pendy"></iframe>
<iframe name="sink1"></iframe><iframe name="sink2"></iframe><iframe name="sink3"></iframe>
<form id="f1" method="post" action="{hub}/hub/authorize/pendy" target="sink1">
  <input type="hidden" name="action" value="approve"></form>
<form id="f2" method="post" action="{hub}/hub/authorize/admin" target="sink2">
  <input type="hidden" name="action" value="withdraw"></form>
<form id="f3" method="post" action="{hub}/hub/discard/pendy" target="sink3"></form>
<iframe name="framed" src="{hub}/services/gpulab/admin" width="800" height="400"></iframe>
<script>
  for (const f of ["f1", "f2", "f3"]) document.getElementById(f).submit();
  const opts = {{mode: "no-cors", credentials: "include"}};
  Promise.allSettled([
    fetch("{hub}/hub/authorize/pendy", {{...opts, method: "POST",
          body: new URLSearchParams({{action: "approve"}})}}),
    fetch("{hub}/hub/authorize/admin", {{...opts, method: "POST",
          body: new URLSearchParams({{action: "withdraw"}})}}),
    fetch("{hub}/hub/authorize/pendy", opts),
  ]).then(() => {{ document.body.dataset.fetched = "yes"; }});
</script>
"""
#: a top-level navigation to the old toggle link, and a top-level form POST
NAVIGATE = """<!doctype html><script>location = "{hub}/hub/authorize/pendy";</script>"""
POST = """<!doctype html><form id="f" method="post" action="{hub}/hub/authorize/pendy">
<input type="hidden" name="action" value="approve"></form>
<script>document.getElementById("f").submit();</script>"""


@pytest.fixture
def attacker_site(tmp_path, hub):
    """The attacker's web site: its pages at http://127.0.0.1:<another port>/."""
    for name, text in (("cats.html", ATTACK), ("go.html", NAVIGATE), ("post.html", POST)):
        (tmp_path / name).write_text(text.format(hub=hub.url))
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(10)


def approval_of(page, hub, name) -> str:
    """The "Is authorized?" cell of `name` on the authorization page ('' if no sign-up)."""
    page.goto(hub.url + "/hub/authorize")
    row = page.locator(f"tr#{name}")
    return row.locator("td").nth(2).inner_text().strip() if row.count() else ""


def test_a_page_on_another_site_changes_no_approval(page, hub, attacker_site):
    assert Browser(hub, "pendy").signup(PASSWORD).status_code == 200
    login(page, hub, "admin", hub.admin_password)
    page.wait_for_url(re.compile(r".*/hub/.*"))
    page.goto(hub.service_url + "admin")  # logged in to the service too
    page.locator("#users").wait_for()
    assert approval_of(page, hub, "pendy") == "No"

    # the admin opens the attacker's page
    page.goto(attacker_site + "/cats.html")
    page.locator("body[data-fetched='yes']").wait_for()
    page.wait_for_load_state("networkidle")
    framed = page.frame(name="framed").url
    assert approval_of(page, hub, "pendy") == "No"
    assert approval_of(page, hub, "admin") == "Yes"
    # a top-level navigation to the old link shows the question, and changes nothing
    page.goto(attacker_site + "/go.html")
    page.wait_for_url(re.compile(r".*/hub/authorize/pendy$"))
    page.locator("#gpulab-confirm[data-action='approve']").wait_for()
    # a top-level form POST without the token is refused
    with page.expect_response(re.compile(r".*/hub/authorize/pendy$")) as answer:
        page.goto(attacker_site + "/post.html")
    assert answer.value.status == 403

    assert approval_of(page, hub, "pendy") == "No"  # neither approved nor discarded
    assert approval_of(page, hub, "admin") == "Yes"
    assert page.locator("tr#admin form").count() == 0  # no Unauthorize button for an admin
    fresh = Browser(hub, "admin")
    fresh.login(hub.admin_password)  # the admin can still log in
    # and the service's admin page refused to be framed by another site (an error page)
    assert not framed.startswith(hub.url), framed

    # the admin's own page approves, with its button (a form with the XSRF token)
    page.goto(hub.url + "/hub/authorize")
    page.locator("form[action$='authorize/pendy'] button", has_text="Authorize").click()
    page.locator("form[action$='authorize/pendy'] button", has_text="Unauthorize").wait_for()
    assert approval_of(page, hub, "pendy") == "Yes"
