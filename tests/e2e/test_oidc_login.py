"""Login through a real OpenID Connect provider (oidc-provider-mock, on loopback) in Chromium:
`gpulab up` with `gpulab.hub.deploy.oidc.oidc_config` in its gpulab_config.py sends the person to the
provider, they sign in there and land in the hub; their group from the token is their JupyterHub
group and gives them that group's GPU quota. Someone outside the allowed groups is refused."""

import json
import re
import secrets
import subprocess
import sys
import time
from urllib.parse import quote

import pytest
import requests

from tests.app.hubctl import Hub, free_port

pytestmark = pytest.mark.e2e

PEOPLE = {
    "dana": {"preferred_username": "dana", "email": "dana@example.org",
             "groups": ["gpulab-users", "vision"]},
    "eve": {"preferred_username": "eve", "email": "eve@example.org", "groups": ["visitors"]},
}


@pytest.fixture(scope="module")
def provider(workdir):
    """The OpenID Connect provider (its issuer URL), with the people's claims registered."""
    port = free_port()
    issuer = f"http://127.0.0.1:{port}"
    log = open(workdir / "oidc-provider.log", "ab")
    proc = subprocess.Popen([sys.executable, "-m", "oidc_provider_mock", "--host", "127.0.0.1",
                             "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 30
        while True:
            try:
                if requests.get(issuer + "/.well-known/openid-configuration", timeout=2).ok:
                    break
            except requests.ConnectionError:
                pass
            assert proc.poll() is None and time.time() < deadline, \
                (workdir / "oidc-provider.log").read_text()[-2000:]
            time.sleep(0.2)
        for sub, claims in PEOPLE.items():
            r = requests.put(f"{issuer}/users/{quote(sub)}", json=claims, timeout=10)
            assert r.status_code == 204, r.text
        yield issuer
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


@pytest.fixture(scope="module")
def oidc_hub(workdir, prefix, provider):
    """`gpulab up` whose gpulab_config.py logs people in through the provider, plus a service
    token with the gpulab admin scope for the test's own admin calls."""
    data = workdir / "oidc-data"
    data.mkdir(mode=0o711)
    token = secrets.token_hex(16)
    config = data / "gpulab_config.py"
    config.write_text(f"""\
from gpulab.hub.deploy.oidc import oidc_config

oidc_config(c, issuer={provider!r}, client_id="gpulab", client_secret="not-a-secret",
            allowed_groups=["gpulab-users"], admin_groups=["gpulab-admins"],
            login_service="Lab identity")

c.JupyterHub.services = [{{"name": "test-admin", "api_token": {token!r}}}]
c.JupyterHub.load_roles = [{{
    "name": "test-admin", "services": ["test-admin"],
    "scopes": ["custom:gpulab:admin", "access:services!service=gpulab", "list:users",
               "read:users", "read:groups"],
}}]
""")
    config.chmod(0o600)
    h = Hub(data, "--simulated-gpus", "4", "--user-prefix", prefix).start()
    h.token = token
    yield h
    h.stop()


def admin_call(hub, method, url, **kw):
    return requests.request(method, url, headers={"Authorization": f"token {hub.token}"},
                            timeout=20, **kw)


def sign_in_at_provider(page, hub, provider, sub):
    page.goto(hub.url + "/hub/login")
    page.get_by_text("Sign in with Lab identity").click()
    page.wait_for_url(re.compile(re.escape(provider) + r"/oauth2/authorize.*"))  # redirected
    page.get_by_placeholder("sub").fill(sub)
    page.get_by_role("button", name="Authorize").click()


def test_oidc_login_brings_the_group_and_its_quota(page, oidc_hub, provider):
    hub = oidc_hub
    sign_in_at_provider(page, hub, provider, "dana")
    # back in the hub, logged in: the spawn form of gpulab (redirect_to_server)
    page.wait_for_url(re.compile(re.escape(hub.url) + r"/hub/(spawn|home).*"))
    assert page.locator("#gpulab-spawn-form").is_visible()

    # the groups of the token are the person's JupyterHub groups
    r = admin_call(hub, "GET", hub.url + "/hub/api/users/dana")
    assert r.status_code == 200, r.text
    assert set(r.json()["groups"]) == {"gpulab-users", "vision"}
    assert r.json()["admin"] is False

    # an admin gives the group "vision" 3 GPUs; dana's own page of the service says so
    r = admin_call(hub, "PUT", hub.service_api + "quotas/groups/vision", json={"max_gpus": 3})
    assert r.status_code == 200, r.text
    # the service's own page logs the browser in to the service (OAuth with the hub) ...
    page.goto(hub.service_url)
    page.wait_for_url(re.compile(re.escape(hub.service_url) + r".*"))
    assert "dana" in page.locator("body").inner_text()
    # ... and then its API answers the browser, as the person
    page.goto(hub.service_api + "me")
    me = json.loads(page.locator("body").inner_text())
    assert "user" in me, me
    assert me["user"] == "dana" and set(me["groups"]) == {"gpulab-users", "vision"}
    assert me["quota_source"] == "group 'vision'" and me["quota"]["max_gpus"] == 3


def test_someone_outside_the_allowed_groups_is_refused(page, oidc_hub, provider):
    hub = oidc_hub
    page.goto(hub.url + "/hub/logout")
    sign_in_at_provider(page, hub, provider, "eve")
    page.wait_for_url(re.compile(re.escape(hub.url) + r"/hub/oauth_callback.*"))
    assert "403" in page.locator("body").inner_text()
    assert admin_call(hub, "GET", hub.url + "/hub/api/users/eve").status_code == 404
