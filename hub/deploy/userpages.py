"""The hub's guard against pages of people's servers, where all share one web origin.

Without ``JupyterHub.subdomain_host`` (``gpulab up --subdomain-host``), a page that a person's
server serves (``/user/<name>/files/x.html``, ``/user/<name>/proxy/<port>/``) runs on the
hub's own origin: the browser lets its script read the hub's pages, XSRF token included, and
send the hub requests with the cookies of whoever opened it (issue 33.3). The only real fix
is an origin per server (the README, Users and isolation). Where there is none, the hub
refuses what it can tell came from such a page:

- a request whose ``Referer`` is a page below ``/user/``, unless it is a top-level navigation
  that reads (``GET`` of a document: the lab's "Hub Control Panel" and log-out links);
- a request that changes something (not ``GET``/``HEAD``/``OPTIONS``) sent by a browser
  (``Sec-Fetch-Site``) from the same origin without a ``Referer``, or with ``Origin: null``
  (a page that hid where it came from: the hub's own pages always send one).

What this cannot stop, and why subdomains are the answer: a page on the hub's origin can change
its own address to one below ``/hub/`` (``history.replaceState``) before it sends anything,
and it can open a hub page in a window of its own and script that window. Headers the hub
adds make the second harder (``frame-ancestors 'none'``: no hub page in a frame;
``Cross-Origin-Opener-Policy: same-origin``: a hub page opened from a server's page loses
its opener, in browsers that honour it on this origin), but none stops the first.
JupyterHub's own documentation says the same: "Subdomains are the only way to reliably
isolate user servers from each other" (docs: explanation/websecurity).
"""

from __future__ import annotations

import logging
from urllib.parse import urlsplit

from tornado import web
from traitlets import Bool

log = logging.getLogger("JupyterHub")

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
#: headers the hub's pages get where servers share its origin (see the module's docstring)
SINGLE_ORIGIN_HEADERS = {
    "Content-Security-Policy": "frame-ancestors 'none'",
    "Cross-Origin-Opener-Policy": "same-origin",
}


def from_user_pages(method: str, headers, host: str, user_prefix: str = "/user/") -> str | None:
    """Why a request to the hub (its `method`, `headers`, the `host` it was sent to) looks sent
    by a page of a person's server below `user_prefix` (None: it does not)."""
    referer = headers.get("Referer", "")
    fetch_site = headers.get("Sec-Fetch-Site", "")
    if referer:
        try:
            ref = urlsplit(referer)
        except ValueError:
            return "its Referer is not a URL"
        if ref.netloc.lower() == host.lower() and ref.path.startswith(user_prefix):
            navigation = (headers.get("Sec-Fetch-Mode", "navigate") == "navigate"
                          and headers.get("Sec-Fetch-Dest", "document") == "document")
            if method.upper() not in SAFE_METHODS or not navigation:
                return f"it was sent by a page of a person's server ({ref.path[:80]})"
        return None
    if method.upper() in SAFE_METHODS:
        return None
    if headers.get("Origin", "") == "null":
        return "it was sent by a page that hides its origin (Origin: null)"
    if fetch_site == "same-origin":
        return "it was sent by a page of this origin that hides its address (no Referer)"
    return None


class RefusedHandler(web.RequestHandler):
    """403 with the reason, before anything of the hub's runs (no XSRF check: nothing is done)."""

    def initialize(self, why: str):
        self.why = why

    def check_xsrf_cookie(self):
        pass

    def prepare(self):
        log.warning("Refused %s %s: %s", self.request.method, self.request.path, self.why)
        self.set_status(403)
        self.set_header("Content-Type", "application/json; charset=UTF-8")
        for name, value in SINGLE_ORIGIN_HEADERS.items():
            self.set_header(name, value)
        self.finish({"status": 403, "message": (
            f"The hub refused this request: {self.why}. Pages served by people's servers share "
            "the hub's address here, so the hub does not act on what they send; open the hub "
            "in its own tab. (An operator can give each server an origin of its own: gpulab "
            "up --subdomain-host.)")})


def static_files_for_every_host(base: type) -> type:
    """The hub's static-file handler `base`, its files readable from every origin: with
    subdomain_host the gpulab service's pages (on a host of their own) use the hub's CSS,
    scripts and fonts, and browsers fetch fonts with CORS. They are the same public files for
    everyone (no cookies are needed or read)."""

    class SharedStaticFiles(base):
        gpulab_shared = True

        def set_extra_headers(self, path):
            super().set_extra_headers(path)
            self.set_header("Access-Control-Allow-Origin", "*")

    return SharedStaticFiles


class UserPagesGuard(web.Application):
    """The hub's tornado application, refusing requests from pages of people's servers
    (`from_user_pages`) before any handler of the hub's sees them."""

    user_prefix = "/user/"

    def find_handler(self, request, **kwargs):
        why = from_user_pages(request.method, request.headers, request.host, self.user_prefix)
        if why:
            return self.get_handler_delegate(request, RefusedHandler, {"why": why})
        return super().find_handler(request, **kwargs)


class ToTheHubsHost(web.RequestHandler):
    """A browser's page request to the hub on another name than its own: 302 to the same
    path and query on ``subdomain_host``, where the hub's cookies (set for that domain) work."""

    def initialize(self, base: str):
        self.base = base

    def get(self):
        self.redirect(self.base + self.request.uri)

    head = get


class BrowsersToTheHubsHost(web.Application):
    """The hub's application with ``subdomain_host``: a browser that opens the hub under another
    name (``http://127.0.0.1:8000``, the address ``gpulab up`` listens on; the address of the
    machine) is sent to the hub's own (``http://localhost:8000``), since its login cookie is
    for that domain and would not be kept. Only top-level page loads (``Sec-Fetch-Mode:
    navigate``) without an ``Authorization`` header move: API clients, the proxy and tokens
    are answered where they asked."""

    base = ""
    domain = ""

    def find_handler(self, request, **kwargs):
        host = (request.host_name or "").lower().rstrip(".")
        if (request.method in ("GET", "HEAD") and self.domain
                and request.headers.get("Sec-Fetch-Mode") == "navigate"
                and "Authorization" not in request.headers
                and host != self.domain and not host.endswith("." + self.domain)):
            return self.get_handler_delegate(request, ToTheHubsHost, {"base": self.base})
        return super().find_handler(request, **kwargs)


def refuse_user_pages_trait() -> Bool:
    """``refuse_user_pages`` of gpulab's hubs (`gpulab.hub.deploy.localhub.GpulabHub`,
    `gpulab.hub.deploy.kubehub.GpulabKubeHub`)."""
    return Bool(
        True,
        help="""Where people's servers share the hub's web origin (no
        ``c.JupyterHub.subdomain_host``: ``gpulab up --no-subdomains``, or bound to an address
        without ``--subdomain-host``; the chart without ``subdomain_host``), refuse requests
        that the hub can tell a page of a person's server sent (a ``Referer`` below
        ``/user/``; a change sent without one) with 403, and send the hub's pages with
        ``frame-ancestors 'none'`` and ``Cross-Origin-Opener-Policy: same-origin``
        (`gpulab.hub.deploy.userpages`). A speed bump, not a wall: only subdomains give each
        server an origin of its own. Ignored with ``subdomain_host``. Default True. Example:
        ``c.GpulabHub.refuse_user_pages = False`` (the chart's hub: ``GpulabKubeHub``)
        """,
    ).tag(config=True)


def user_pages_application(hub, refuse: bool) -> web.Application | None:
    """The Tornado application of gpulab's JupyterHub `hub` (its ``init_tornado_application``),
    as web origins ask: with ``subdomain_host`` the hub's static files for every origin, the
    "GPUs" link to the service's own host, and `BrowsersToTheHubsHost`; on
    one origin with `refuse`, a `UserPagesGuard` with `SINGLE_ORIGIN_HEADERS` on the hub's
    pages; else None (JupyterHub's own)."""
    if hub.subdomain_host:
        hub.tornado_settings["static_handler_class"] = static_files_for_every_host(
            hub.tornado_settings["static_handler_class"])
        # the hub's "GPUs" link (templates/jupyterhub/page.html): the service's own host,
        # port included (the service is not in the "Services" menu, whose list has it)
        from gpulab.hub.service import SERVICE_NAME

        service = hub._service_map.get(SERVICE_NAME)
        if service is not None and service.host:
            template_vars = dict(hub.tornado_settings.get("template_vars") or {})
            template_vars.setdefault("gpulab_service_url", service.host + service.prefix)
            hub.tornado_settings["template_vars"] = template_vars
        app = BrowsersToTheHubsHost(hub.handlers, **hub.tornado_settings)
        app.base = hub.subdomain_host.rstrip("/")
        app.domain = (urlsplit(hub.subdomain_host).hostname or "").lower()
        return app
    if not refuse:
        return None
    from jupyterhub.utils import url_path_join

    headers = hub.tornado_settings.setdefault("headers", {})
    for name, value in SINGLE_ORIGIN_HEADERS.items():
        headers.setdefault(name, value)
    app = UserPagesGuard(hub.handlers, **hub.tornado_settings)
    app.user_prefix = url_path_join(hub.base_url, "user/")
    hub.log.warning("People's servers share the hub's web origin (no subdomain_host): "
                    "the hub refuses requests it can tell their pages sent, which a "
                    "determined page gets past (README, Users and isolation)")
    return app
