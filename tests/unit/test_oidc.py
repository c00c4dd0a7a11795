"""gpulab.hub.deploy.oidc: GenericOAuthenticator settings from an issuer's discovery document."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from oauthenticator.generic import GenericOAuthenticator
from traitlets.config import Config

from gpulab.hub.deploy.oidc import DiscoveryError, discover, oidc_config

ISSUER = "https://keycloak.example.org/realms/lab"
DOC = {
    "issuer": ISSUER,
    "authorization_endpoint": ISSUER + "/protocol/openid-connect/auth",
    "token_endpoint": ISSUER + "/protocol/openid-connect/token",
    "userinfo_endpoint": ISSUER + "/protocol/openid-connect/userinfo",
}


def test_oidc_config_fills_generic_oauthenticator():
    c = oidc_config(Config(), issuer=ISSUER, client_id="gpulab", client_secret="s",
                    allowed_groups=["gpulab-users"], discovery=DOC,
                    callback_url="https://gpulab.example.org/hub/oauth_callback")
    assert c.JupyterHub.authenticator_class == "generic-oauth"
    auth = GenericOAuthenticator(config=c)  # the traits accept the values, in any order
    assert (auth.authorize_url, auth.token_url, auth.userdata_url) == (
        DOC["authorization_endpoint"], DOC["token_endpoint"], DOC["userinfo_endpoint"])
    assert auth.username_claim == "preferred_username"
    assert auth.manage_groups and auth.auth_state_groups_key == "oauth_user.groups"
    assert auth.allowed_groups == {"gpulab-users"} and auth.admin_groups == {"gpulab-admins"}
    assert auth.allow_all is False
    assert auth.oauth_callback_url == "https://gpulab.example.org/hub/oauth_callback"


@pytest.fixture
def served():
    """A loopback HTTP server answering the discovery path with ``served.doc``."""
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            body = json.dumps(Handler.doc).encode()
            self.send_response(200 if self.path.endswith("openid-configuration") else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    Handler.doc = {**DOC, "issuer": url}
    yield url, Handler
    server.shutdown()


def test_discover_reads_and_checks_the_document(served):
    url, handler = served
    assert discover(url + "/")["token_endpoint"] == DOC["token_endpoint"]
    handler.doc = DOC  # another issuer's document
    with pytest.raises(DiscoveryError, match="names issuer"):
        discover(url)
    handler.doc = {"issuer": url}
    with pytest.raises(DiscoveryError, match="lacks authorization_endpoint"):
        discover(url)


def test_discover_unreachable_issuer():
    with pytest.raises(DiscoveryError, match="cannot read"):
        discover("http://127.0.0.1:9", timeout=2)
