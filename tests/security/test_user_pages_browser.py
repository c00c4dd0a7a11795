"""A page served by eve's own server, opened by the logged-in admin in Chromium, changes
nothing in the hub (issue 33.3): the hub runs with ``--subdomain-host http://localhost:<port>``,
so eve's server is at ``eve.localhost`` and the hub at ``localhost``, two origins.

Eve serves the page the way the issue reproduced it: a small HTTP server started from her own
kernel, behind her server's ``/user/eve/proxy/<port>/`` (jupyter-server-proxy). The page first
poses as a hub page (``history.replaceState`` to ``/hub/home``, which defeats any Referer
check on one origin), then tries to read the hub's XSRF token and cookies (fetch, a frame, a
pop-up it scripts) and to make eve an admin through the admin's session (``PATCH
/hub/api/users/eve``, with whatever token it found, from its own window and from the hub
windows it opened), both at the hub's address and at relative ``/hub/`` paths. Afterwards eve
is no admin, and the page read no token. On one origin (the code before this test) the same
page made eve an admin.

``test_user_pages_fallback_browser.py`` checks what the hub still refuses without subdomains.
"""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import hub_with_config
from tests.e2e.conftest import chromium, page  # noqa: F401 (fixtures)
from tests.e2e.test_lab_browser import login

pytestmark = [pytest.mark.security, pytest.mark.e2e]

#: the attacker's page; {hub} is the hub's address, {sneaky} whether it poses as a hub page
ATTACK = """<!doctype html><title>loss curves</title>
<button id="go">show the plot</button>
<script>
const HUB = {hub!r};
const got = {{}};
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));
async function attempt(name, fn) {{
  try {{ got[name] = String(await fn()).slice(0, 300); }}
  catch (e) {{ got[name] = "error: " + e; }}
}}
function tokenIn(text) {{
  const m = /xsrf_token: "([^"]+)"/.exec(text || "");
  return m ? m[1] : "";
}}
const makeAdmin = (fetcher, base, token) => fetcher(base + "/hub/api/users/eve", {{
  method: "PATCH", credentials: "include",
  headers: {{"X-XSRFToken": token, "Content-Type": "application/json"}},
  body: JSON.stringify({{admin: true}})}}).then((r) => r.status);
document.getElementById("go").onclick = async () => {{
  if ({sneaky}) history.replaceState(null, "", "/hub/home");  // Referer: a hub page
  let token = "";
  for (const base of [HUB, ""]) {{
    const tag = base ? "hub" : "relative";
    await attempt("read-" + tag, async () => {{
      const r = await fetch(base + "/hub/home", {{credentials: "include"}});
      const t = tokenIn(await r.text());
      if (base) token = token || t;  // at a relative path, the page's own origin answers
      return r.status + (t ? " token" : " no token");
    }});
    await attempt("patch-" + tag, () => makeAdmin(fetch, base, token));
    await attempt("form-" + tag, async () => {{
      const r = await fetch(base + "/hub/api/users/eve", {{method: "POST", mode: "no-cors",
        credentials: "include", body: JSON.stringify({{admin: true}})}});
      return r.type + " " + r.status;
    }});
  }}
  await attempt("cookie", () => document.cookie);
  // a hub page in a frame, then in a pop-up: read its token, and act as that page
  await attempt("frame", () => new Promise((resolve) => {{
    const f = document.createElement("iframe");
    f.onload = async () => {{
      try {{
        const t = f.contentWindow.jhdata.xsrf_token;
        token = token || t;
        resolve("read " + (t ? "token" : "nothing") + "; patch " +
                await makeAdmin(f.contentWindow.fetch.bind(f.contentWindow), HUB, t));
      }} catch (e) {{ resolve("error: " + e); }}
    }};
    f.src = HUB + "/hub/home";
    document.body.appendChild(f);
    setTimeout(() => resolve("timeout"), 8000);
  }}));
  await attempt("popup", async () => {{
    const w = window.open(HUB + "/hub/home", "hubwin");
    if (!w) return "blocked";
    for (let i = 0; i < 40; i++) {{
      try {{ if (w.jhdata) break; }} catch (e) {{ await sleep(100); continue; }}
      await sleep(100);
    }}
    try {{
      const t = w.jhdata.xsrf_token;
      token = token || t;
      return "read " + (t ? "token" : "nothing") + "; patch " +
             await makeAdmin(w.fetch.bind(w), HUB, t);
    }} catch (e) {{ return "error: " + e; }}
  }});
  got.token = token ? "found" : "";
  document.body.dataset.result = JSON.stringify(got);
}};
</script>
"""

#: eve's kernel serves the page: a folder of hers, http.server on a free loopback port
SERVE = """
import os, socket, subprocess, sys
os.makedirs("attack", exist_ok=True)
with open("attack/plot.html", "w") as f:
    f.write({page!r})
s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
p = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1",
                      "--directory", "attack"], stdout=subprocess.DEVNULL,
                     stderr=subprocess.DEVNULL, start_new_session=True)
import time, urllib.request
for _ in range(100):
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{{port}}/plot.html", timeout=1); break
    except OSError:
        time.sleep(0.1)
print(port, p.pid)
"""


@pytest.fixture(scope="module")
def hub(workdir, prefix):
    """The hub at http://localhost:<port>, people's servers at <name>.localhost."""
    yield from hub_with_config(workdir, prefix, "", subdomains=True)


def serve_attack(eve, hub, sneaky: bool) -> tuple[str, int]:
    """Eve's page, served by her kernel behind her server's proxy: (its URL, the pid)."""
    text = ATTACK.format(hub=hub.url, sneaky="true" if sneaky else "false")
    port, pid = eve.run_in_kernel(SERVE.format(page=text)).split()
    return hub.user_url("eve") + f"proxy/{port}/plot.html", int(pid)


def stop_serving(eve, pid: int) -> None:
    eve.run_in_kernel(f"import os, signal\nos.kill({pid}, signal.SIGKILL)\n")


def open_as_admin(page, hub, url: str) -> dict:
    """The admin, logged in, opens `url` and clicks its button; what the page found."""
    login(page, hub, "admin", hub.admin_password)
    page.wait_for_url(re.compile(r".*/hub/.*"))
    page.goto(url)
    if "oauth2/authorize" in page.url:  # the hub asks the admin whether to open eve's server
        page.locator("form input[type=submit], form button[type=submit]").first.click()
    page.locator("#go").click()
    page.locator("body[data-result]").wait_for(timeout=60_000)
    return json.loads(page.locator("body").get_attribute("data-result"))


def test_a_page_of_eves_server_cannot_act_as_the_admin(page, hub, admin, eve):
    url, pid = serve_attack(eve, hub, sneaky=True)
    try:
        assert url.startswith(f"http://eve.localhost:{hub.port}/user/eve/proxy/"), url
        got = open_as_admin(page, hub, url)
    finally:
        stop_serving(eve, pid)
    # the page ran (it is eve's), on an origin of its own
    assert page.evaluate("location.host") == f"eve.localhost:{hub.port}"
    # it read no token and none of the hub's cookies; the hub refused every change
    assert got["token"] == "", got
    hub_cookies = [c["value"] for c in page.context.cookies(hub.url + "/hub/")]
    assert hub_cookies, "the admin has no hub cookies: not logged in?"
    assert not [v for v in hub_cookies if v in got["cookie"]], got
    for key, value in got.items():
        assert not re.fullmatch(r"(patch )?2\d\d", value.split("; ")[-1]), (key, got)
    user = admin.api("GET", "/users/eve").json()
    assert user["admin"] is False, user
    assert "admin" not in user["roles"], user
    # the admin's session still works
    page.goto(hub.url + "/hub/home")
    assert page.url.startswith(hub.url + "/hub/home"), page.url


def test_the_hub_opened_by_its_address_moves_to_its_host(page, hub):
    """gpulab up listens on 127.0.0.1; its hub is http://localhost:<port>, whose cookies a page
    of 127.0.0.1 would not get: a browser that opens the address is sent to the host, path and
    query kept, and logs in there."""
    assert hub.subdomains
    page.context.clear_cookies()  # logged out (the admin logged in above)
    page.goto(f"http://127.0.0.1:{hub.port}/hub/login?next=%2Fhub%2Fhome")
    assert page.url == f"{hub.url}/hub/login?next=%2Fhub%2Fhome", page.url
    page.fill("input[name=username]", "admin")
    page.fill("input[name=password]", hub.admin_password)
    page.click("input[type=submit], button[type=submit]")
    page.wait_for_url(re.compile(re.escape(hub.url) + r"/hub/(home|spawn).*"))
