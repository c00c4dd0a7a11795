"""A notebook server keeps the hub's answer for a token 5 s, not JupyterHub's 300 s
(`gpulab.extensions.serverext.bound_token_cache`); an operator's own setting stands. The
revoked token refused by a real server: tests/security/test_servers_isolation.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from traitlets.config import Config

from gpulab.extensions.serverext import TOKEN_CACHE_SECONDS, bound_token_cache


@pytest.fixture
def hub_env(monkeypatch):
    monkeypatch.setenv("JUPYTERHUB_API_TOKEN", "x")
    monkeypatch.setenv("JUPYTERHUB_API_URL", "http://127.0.0.1:1/hub/api")


def _server(config: Config, hub_auth_made_first: bool = False):
    from jupyterhub.services.auth import HubOAuth

    auth = HubOAuth(config=config)
    if hub_auth_made_first:
        auth.cache["token:x"] = {"name": "vic"}  # the cache exists, with 300 s
    return SimpleNamespace(config=config, identity_provider=SimpleNamespace(hub_auth=auth))


@pytest.mark.parametrize("made_first", [False, True])
def test_the_default_300_s_becomes_5(hub_env, made_first):
    app = _server(Config(), made_first)
    assert app.identity_provider.hub_auth.cache_max_age == 300  # JupyterHub's default
    assert bound_token_cache(app) == TOKEN_CACHE_SECONDS == 5
    auth = app.identity_provider.hub_auth
    assert auth.cache_max_age == 5 and auth.cache.max_age == 5


@pytest.mark.parametrize("section", ["HubOAuth", "HubAuth"])
def test_an_operators_setting_stands(hub_env, section):
    config = Config({section: {"cache_max_age": 60}})
    app = _server(config)
    assert bound_token_cache(app) == 60
    assert app.identity_provider.hub_auth.cache.max_age == 60


def test_outside_jupyterhub_nothing_to_bound():
    app = SimpleNamespace(config=Config(), identity_provider=SimpleNamespace())
    assert bound_token_cache(app) is None
