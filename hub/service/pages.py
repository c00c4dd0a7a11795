"""The gpulab service's pages: the user page, the admin page, and error pages in
JupyterHub's look (`ErrorPages`), with `page_context` (what the templates read) and the
template environment (`_pages`)."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from urllib.parse import quote

import jupyterhub
from jinja2 import ChoiceLoader, Environment, FileSystemLoader, PrefixLoader, select_autoescape
from jupyterhub._data import DATA_FILES_PATH
from jupyterhub.services.auth import HubOAuthCallbackHandler, UserNotAllowed
from jupyterhub.utils import url_path_join
from tornado import httputil, web

from gpulab.hub.service import ADMIN_SCOPE
from gpulab.hub.service.base import AppHubAuth, Base, log, mark_cluster_kinds
from gpulab.hub.service.quotas import (ADMIN_PAGE_USERS, _usage, inventory_view, overview,
                                       user_view)
from gpulab.hub.service.queue import entry_view

#: the admin page shows the first this many entries of the GPU queue (the API pages the rest)
ADMIN_PAGE_QUEUE = 200

_TEMPLATES = Path(__file__).parent.parent / "templates"
_HUB_TEMPLATES = Path(DATA_FILES_PATH) / "templates"
_pages = Environment(
    loader=ChoiceLoader([
        FileSystemLoader(_TEMPLATES / "service"),
        FileSystemLoader(_TEMPLATES / "jupyterhub"),
        PrefixLoader({"templates": FileSystemLoader(_HUB_TEMPLATES)}),
        FileSystemLoader(_HUB_TEMPLATES),
    ]),
    autoescape=select_autoescape(["html"]),
)



# -- pages ---------------------------------------------------------------------------------


class PageError(web.HTTPError):
    """An error on a page: ``message`` says what happened, ``hint`` names the advice that
    ``error.html`` gives on what to do next (``admin-only``, ``not-allowed``, ``not-found``,
    ``login``; others get the advice for their status)."""

    def __init__(self, status: int, message: str, hint: str = ""):
        super().__init__(status, "%s", message)
        self.message, self.hint = message, hint


class PageUser:
    """What JupyterHub's ``page.html`` reads of the user (`name`, `json_escaped_name`)."""

    def __init__(self, name: str):
        self.name = name
        self.json_escaped_name = json.dumps(quote(name, safe="@~"))[1:-1]


def page_context(*, hub_prefix: str, service_prefix: str, model: dict | None, xsrf: str = "",
                 admin: bool = False, path: str = "") -> dict:
    """What gpulab's pages and JupyterHub's ``page.html`` under them read: `model` is the
    hub's user model of who asks (None: nobody logged in), `admin` whether they are a gpulab
    admin, `path` the page's own path."""
    hub, prefix = hub_prefix, service_prefix
    hub_admin = bool(model and model.get("admin"))

    def static_url(path: str, include_version: bool = True) -> str:
        # the hub's static files, through the proxy (the service serves none)
        return hub + "static/" + path + (f"?v={jupyterhub.__version__}" if include_version else "")

    return {
        # JupyterHub's page.html: its links are the hub's (base_url is the hub's prefix)
        "base_url": hub, "static_url": static_url, "logout_url": hub + "logout",
        "login_url": hub + "login?next=" + quote(prefix), "no_spawner_check": True,
        "user": PageUser(model["name"]) if model else None, "admin_access": hub_admin,
        "parsed_scopes": {"admin-ui"} if hub_admin else set(), "xsrf_token": xsrf,
        # the hub's "Services" menu: the gpulab service is not in it (its "display" is
        # false; "GPUs" is its link), as on the hub's own pages
        "services": [],
        # gpulab's own
        "prefix": prefix, "hub_prefix": hub, "xsrf": xsrf, "admin": bool(model) and admin,
        "page": path,
        # what gpulab's navigation links (jupyterhub/page.html) read
        "gpulab_prefix": prefix, "gpulab_admin": bool(model) and admin, "gpulab_page": path,
    }


class ErrorPages:
    """Pages in JupyterHub's look, errors included: every error of a page handler (and of the
    OAuth callback, and of an unknown page) is ``error.html`` saying what happened and what to
    do next; the API's handlers answer JSON (`APIHandler.write_error`)."""

    def page_context(self) -> dict:
        model = getattr(self, "_hub_auth_user_cache", None)
        xsrf = self.xsrf_token
        return page_context(
            hub_prefix=self.settings["hub_prefix"], service_prefix=self.settings["service_prefix"],
            model=model, xsrf=xsrf.decode() if isinstance(xsrf, bytes) else xsrf,
            admin=bool(model) and bool(self.hub_auth.check_scopes({ADMIN_SCOPE}, model)),
            path=self.request.path)

    def render_page(self, name: str, **ctx):
        self.finish(_pages.get_template(name).render(**{**self.page_context(), **ctx}))

    def write_error(self, status_code, **kwargs):
        exc = kwargs.get("exc_info", (None, None, None))[1]
        hint = getattr(exc, "hint", "")
        message = getattr(exc, "message", None)
        if message is None and isinstance(exc, web.HTTPError) and exc.log_message:
            message = exc.log_message % exc.args if exc.args else exc.log_message
        if status_code >= 500 and status_code != 503:  # 503: a state said on purpose
            message = "Something went wrong in the gpulab service; its log has the details."
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.set_header("Cache-Control", "no-store")
        try:
            self.render_page("error.html", status_code=status_code,
                             status_message=httputil.responses.get(status_code, "Error"),
                             message=message or "", hint=hint,
                             at=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
        except Exception:  # never a second error while telling of the first
            log.exception("Could not render the error page for %s", status_code)
            self.finish(f"<!doctype html><title>{status_code}</title><h1>{status_code}: "
                        f"{httputil.responses.get(status_code, 'Error')}</h1>")


class PageHandler(ErrorPages, Base):
    async def prepare(self):
        # who is asking, without blocking the event loop; a person the hub knows but who may
        # not use the service gets the error page, not a redirect loop through the login
        model = await self.hub_auth.get_user(self, sync=False)
        self._hub_auth_user_cache = None
        if model:
            try:
                self._hub_auth_user_cache = self.check_hub_user(model)
            except UserNotAllowed:
                raise PageError(403, f"Your hub account '{model['name']}' may not use the "
                                "gpulab service.", hint="not-allowed") from None


async def mark_clusters(handler, holdings: list[dict], entries: list[dict]) -> None:
    """Holdings and queue entries of held clusters (issue 38) say ``cluster``, not ``job``
    (`mark_cluster_kinds`); every holding says how long it has been held (``held_for``:
    ``1:02:03``)."""
    from gpulab.extensions.jobmodel import format_duration

    now = time.time()
    for h in holdings:
        if h.get("since"):
            h["held_for"] = format_duration(max(0.0, now - h["since"]))
    await mark_cluster_kinds(handler, holdings, entries)


class UserPage(PageHandler):
    @web.authenticated
    async def get(self):
        me = self.current_user["name"]
        view = await user_view(self, me)
        inventory = await asyncio.to_thread(inventory_view, self.ledger, _usage(self))
        queue = getattr(self.settings.get("jobs"), "queue", None)
        now = time.time()
        waiting = ([entry_view(e, now) for e in await asyncio.to_thread(
            queue.entries, me, now)] if queue is not None else [])
        holdings = view.get("holdings") or []
        for h in holdings:
            h.setdefault("user", me)
        await mark_clusters(self, holdings, waiting)
        culler = self.settings.get("idle_culler")
        from gpulab.hub.service.idle import recent_stops

        idle = culler.view(me) if culler is not None else None
        stopped = await asyncio.to_thread(recent_stops, self.ledger, me)
        self.render_page("user.html", me=view, inventory=inventory, waiting=waiting,
                         idle=idle, idle_stopped=stopped)


class AdminPage(PageHandler):
    @web.authenticated
    async def get(self):
        if not self.is_gpulab_admin:
            raise PageError(403, "The GPU admin page is for gpulab admins: they set quotas "
                            "and see everyone's GPUs.", hint="admin-only")
        # one page of people, as the hub's own admin panel pages its users
        search = self.get_query_argument("q", "")[:255]
        o = await overview(self, search, self.int_arg("offset", 0, 0, 2**31 - 1),
                           self.int_arg("limit", ADMIN_PAGE_USERS, 1, 500))
        queue = getattr(self.settings.get("jobs"), "queue", None)
        o["queue_enabled"] = queue is not None
        now = time.time()
        entries = await asyncio.to_thread(queue.entries, None, now) if queue is not None else []
        o["queue"] = [entry_view(e, now) for e in entries[:ADMIN_PAGE_QUEUE]]
        o["queue_total"] = len(entries)
        # GPU-idle culling's warnings, by allocation id (the holdings they are about)
        culler = self.settings.get("idle_culler")
        o["idle"] = dict(culler.notices) if culler is not None else {}
        holdings = []
        for u in o.get("users", []):
            for h in u.get("holdings", []):
                h.setdefault("user", u.get("name"))
                holdings.append(h)
        await mark_clusters(self, holdings, o["queue"])
        self.render_page("admin.html", o=o)


class NotFoundHandler(PageHandler):
    """Every path the service has no route for: JSON under the API, a page elsewhere."""

    async def prepare(self):
        path = self.request.path
        if path.startswith(url_path_join(self.settings["service_prefix"], "api/")):
            self.set_status(404)
            self.set_header("Content-Type", "application/json; charset=utf-8")
            self.finish(json.dumps({"status": 404, "message": f"No such gpulab endpoint: {path}"}))
            return
        if path + "/" == self.settings["service_prefix"]:
            self.redirect(self.settings["service_prefix"])
            return
        await super().prepare()
        raise PageError(404, f"There is no gpulab page at {path}.", hint="not-found")


class OAuthCallbackHandler(ErrorPages, AppHubAuth, HubOAuthCallbackHandler):
    """The hub's OAuth callback; its errors (a login refused, stale or forged: 400, 403) are
    pages too, saying to log in again."""

    def write_error(self, status_code, **kwargs):
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, web.HTTPError) and status_code < 500 and not getattr(exc, "hint", ""):
            exc.hint = "login"
        super().write_error(status_code, **kwargs)
