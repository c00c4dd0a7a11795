"""A failure inside a page of the gpulab service (here: the hub's user list cannot be read) is
a 500 page in the hub's look that says what to do, never a traceback or a bare status; the
same failure in the API is JSON. The service runs in this process over HTTP; who asks is
given by replacing the hub's token check (a running hub is in tests/app/test_pages.py)."""

import json
import os
from unittest import mock

import pytest
from tornado.httpclient import AsyncHTTPClient
from tornado.httpserver import HTTPServer
from tornado.testing import bind_unused_port

from gpulab.hub.service import app as service
from gpulab.hub.quota.ledger import Ledger

PREFIX = "/services/gpulab/"
ADMIN = {"kind": "user", "name": "root", "admin": True,
         "scopes": [service.ACCESS_SCOPE, service.ADMIN_SCOPE]}


class BrokenDirectory:  # the hub's API does not answer
    async def users(self):
        raise ConnectionRefusedError("hub API down")

    async def users_recent(self):
        raise ConnectionRefusedError("hub API down")

    async def groups_of(self, name):
        raise ConnectionRefusedError("hub API down")

    def forget(self):
        pass


@pytest.fixture
async def base_url(tmp_path):
    env = {"JUPYTERHUB_API_TOKEN": "x", "JUPYTERHUB_API_URL": "http://127.0.0.1:1/hub/api",
           "JUPYTERHUB_CLIENT_ID": "service-gpulab", "JUPYTERHUB_SERVICE_PREFIX": PREFIX}
    ledger = Ledger(f"sqlite:///{tmp_path / 'ledger.sqlite'}")
    ledger.migrate()

    async def get_user(self, handler, *, sync=True):
        return ADMIN

    with mock.patch.dict(os.environ, env), \
            mock.patch.object(service.HubOAuth, "get_user", get_user):
        app = service.make_app(ledger, PREFIX, "/hub/", BrokenDirectory())
        sock, port = bind_unused_port()
        server = HTTPServer(app)
        server.add_sockets([sock])
        yield f"http://127.0.0.1:{port}{PREFIX}"
        server.stop()


async def test_a_page_that_fails_is_a_500_page(base_url):
    r = await AsyncHTTPClient().fetch(base_url + "admin", raise_error=False)
    html = r.body.decode()
    assert r.code == 500 and r.headers["Content-Type"].startswith("text/html")
    assert 'data-status="500"' in html and "500: Internal Server Error" in html
    assert "Something went wrong in the gpulab service" in html
    assert "Reload the page in a moment" in html and "Traceback" not in html
    assert 'class="navbar' in html and "/hub/static/css/style.min.css" in html
    assert "hub API down" not in html  # what failed inside is for the log, not the page


async def test_the_same_failure_in_the_api_is_json(base_url):
    r = await AsyncHTTPClient().fetch(base_url + "api/v1/me", raise_error=False)
    assert r.code == 500 and r.headers["Content-Type"].startswith("application/json")
    assert json.loads(r.body)["message"] == "Internal error in the gpulab service; see its log."
