"""Login through an OpenID Connect provider (Keycloak, Dex, Azure AD, Google, …).

`oidc_config` fills OAuthenticator's `GenericOAuthenticator` from the provider's discovery
document (``<issuer>/.well-known/openid-configuration``): the authorize, token and userinfo
endpoints, the user name claim, and the groups claim that becomes the person's JupyterHub groups
(``manage_groups``), hence their gpulab group quotas. Locally, in ``<data-dir>/gpulab_config.py``::

    from gpulab.hub.deploy.oidc import oidc_config
    oidc_config(c, issuer="https://keycloak.example.org/realms/lab",
                client_id="gpulab", client_secret="...",
                allowed_groups=["gpulab-users"], admin_groups=["gpulab-admins"])

and start with ``gpulab up --admin-user <your user name at the provider>``. On Kubernetes the
same in ``hub.extraConfig`` (or the static ``hub.config.GenericOAuthenticator`` of
helm-values/values.yaml). Only members of ``allowed_groups`` or ``admin_groups`` get in.
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Iterable

from traitlets.config import Config

from gpulab.hub.deploy.local import ADMIN_GROUP

WELL_KNOWN = "/.well-known/openid-configuration"


class DiscoveryError(RuntimeError):
    """The issuer's discovery document is missing, unreadable or not for this issuer."""


def discover(issuer: str, timeout: float = 10) -> dict:
    """The provider's discovery document, checked to belong to ``issuer``."""
    url = issuer.rstrip("/") + WELL_KNOWN
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (operator's URL)
            doc = json.loads(resp.read())
    except (OSError, ValueError) as e:
        raise DiscoveryError(f"cannot read the OpenID Connect discovery document {url}: {e}") from e
    if not isinstance(doc, dict):
        raise DiscoveryError(f"{url} is not a discovery document")
    if str(doc.get("issuer", "")).rstrip("/") != issuer.rstrip("/"):
        raise DiscoveryError(f"{url} names issuer {doc.get('issuer')!r}, not {issuer!r}")
    missing = [k for k in ("authorization_endpoint", "token_endpoint", "userinfo_endpoint")
               if not doc.get(k)]
    if missing:
        raise DiscoveryError(f"{url} lacks {', '.join(missing)}")
    return doc


def oidc_config(
    c: Config,
    *,
    issuer: str,
    client_id: str,
    client_secret: str = "",
    callback_url: str = "",
    username_claim: str = "preferred_username",
    groups_claim: str = "groups",
    allowed_groups: Iterable[str] = (),
    admin_groups: Iterable[str] = (ADMIN_GROUP,),
    scope: Iterable[str] = ("openid", "profile", "email"),
    login_service: str = "",
    discovery: dict | None = None,
) -> Config:
    """Make ``c`` log people in through the OpenID Connect provider ``issuer``; returns ``c``.

    ``username_claim``: the claim that becomes the JupyterHub user name (Keycloak and Dex:
    ``preferred_username``; ``email`` or ``sub`` elsewhere). ``groups_claim``: the userinfo
    claim listing the person's groups (add ``"groups"`` to ``scope`` for Dex). Members of
    ``admin_groups`` are hub admins; ``gpulab-admins`` (the default) is also the group whose
    members manage GPU quotas. ``callback_url``: ``https://<host>/hub/oauth_callback``; ''
    derives it from each request's host. ``discovery``: the discovery document, if already read
    (otherwise it is fetched from the issuer, once, when the configuration is loaded).
    """
    doc = discovery if discovery is not None else discover(issuer)
    c.JupyterHub.authenticator_class = "generic-oauth"
    g = c.GenericOAuthenticator
    g.client_id = client_id
    g.client_secret = client_secret
    if callback_url:
        g.oauth_callback_url = callback_url
    g.authorize_url = doc["authorization_endpoint"]
    g.token_url = doc["token_endpoint"]
    g.userdata_url = doc["userinfo_endpoint"]
    g.scope = list(scope)
    g.username_claim = username_claim
    g.login_service = login_service or "OpenID Connect"
    # the person's groups, as the provider says at each login, are their JupyterHub groups
    g.manage_groups = True
    g.auth_state_groups_key = f"oauth_user.{groups_claim}"
    g.allowed_groups = set(allowed_groups)
    g.admin_groups = set(admin_groups)
    # nobody else: not every account of the provider is a member of the team
    g.allow_all = False
    return c
