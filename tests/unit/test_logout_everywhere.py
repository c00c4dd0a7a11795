"""Logging out ends the person's hub sessions on Kubernetes too, where the chart runs the stock
``jupyterhub`` app (not `GpulabHub`): `kubernetes_config` wraps whatever authenticator the chart's
values name, and the real-node test logs out of that hub with a copied cookie."""

from __future__ import annotations

from jupyterhub.auth import DummyAuthenticator
from jupyterhub.handlers.login import LogoutHandler
from oauthenticator.generic import GenericOAuthenticator
from oauthenticator.oauth2 import OAuthLogoutHandler
from traitlets.config import Config

from gpulab.hub.deploy.auth import EndSessionsOnLogout, end_sessions_at_logout
from gpulab.hub.deploy.kubernetes import kubernetes_config


def _kube(c: Config, tmp_path) -> Config:
    return kubernetes_config(c, ledger_url="postgresql+psycopg://gpulab:pw@db/gpulab",
                             service_ip="10.0.0.1", config_dir=tmp_path / "service")


def _logout(authenticator) -> type:
    routes = {spec[0]: spec[1] for spec in authenticator.get_handlers(None)}
    return routes["/logout"]


def test_the_charts_oauth_login_keeps_its_logout_and_ends_sessions(tmp_path):
    c = Config()
    c.JupyterHub.authenticator_class = "generic-oauth"  # helm-values/values.yaml
    c.GenericOAuthenticator.client_id = "gpulab"
    _kube(c, tmp_path)
    cls = c.JupyterHub.authenticator_class
    assert issubclass(cls, GenericOAuthenticator) and cls.__name__ == "GenericOAuthenticator"
    authenticator = cls(config=c)
    assert authenticator.client_id == "gpulab"  # c.GenericOAuthenticator still applies
    logout = _logout(authenticator)
    assert issubclass(logout, OAuthLogoutHandler) and issubclass(logout, EndSessionsOnLogout)
    # its other routes are the authenticator's own
    routes = [spec[0] for spec in authenticator.get_handlers(None)]
    assert routes == ["/oauth_login", "/oauth_callback", "/logout"]


def test_an_authenticator_without_a_logout_route_gets_one(tmp_path):
    c = Config()
    c.JupyterHub.authenticator_class = "dummy"
    _kube(c, tmp_path)
    assert issubclass(c.JupyterHub.authenticator_class, DummyAuthenticator)
    assert _logout(c.JupyterHub.authenticator_class(config=c)) is EndSessionsOnLogout


def test_the_default_authenticator_and_a_second_call(tmp_path):
    c = Config()
    end_sessions_at_logout(c)  # JupyterHub's default, PAM
    first = c.JupyterHub.authenticator_class
    end_sessions_at_logout(c)
    assert c.JupyterHub.authenticator_class is first and first.__name__ == "PAMAuthenticator"
    logout = _logout(first(config=c))
    assert issubclass(logout, LogoutHandler) and issubclass(logout, EndSessionsOnLogout)
