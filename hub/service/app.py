"""The gpulab service: quotas, GPU holdings and usage over REST, an admin page and a user page.

A JupyterHub managed service at ``/services/gpulab/`` (``python -m gpulab.hub.service.app``),
tornado handlers authenticated by the hub (`HubOAuthenticated`: browser cookies through
OAuth, or ``Authorization: token …``).

Permissions are JupyterHub scopes: every request needs ``access:services!service=gpulab``;
the custom scope ``custom:gpulab:admin`` (granted by the ``gpulab-admin`` role to the first
admin and to the group ``gpulab-admins``) is needed to see other people or change quotas.
Anonymous API requests get 401; tokens without the scopes get 403.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import math
import logging
import os
import signal
import ssl
import sys
import time
from pathlib import Path
from urllib.parse import quote

import jupyterhub
from jinja2 import ChoiceLoader, Environment, FileSystemLoader, PrefixLoader, select_autoescape
from jupyterhub._data import DATA_FILES_PATH
from jupyterhub.services.auth import (HubOAuth, HubOAuthCallbackHandler, HubOAuthenticated,
                                      UserNotAllowed)
from jupyterhub.utils import url_path_join
from tornado import httputil, web
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.ioloop import IOLoop, PeriodicCallback

from gpulab.hub.quota.ledger import AdmissionRefused, Ledger
from gpulab.hub.quota.policy import Quota, QuotaError, parse_quota

log = logging.getLogger("gpulab.service")

from gpulab.hub.service import ACCESS_SCOPE, ADMIN_SCOPE, SERVICE_NAME  # noqa: F401
DAY = 24 * 3600
MAX_BODY = 64 * 1024
#: the largest request body the service reads at all (see `main`)
MAX_BUFFERED_BODY = 16 * 2**20
#: the deepest nesting of lists and objects a request body may have
MAX_JSON_DEPTH = 32


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def check_json_values(value, path: str = "body", depth: int = 0) -> None:
    """Refuse (`FieldError` 400, naming the field) what JSON can carry but no field may hold:
    nesting deeper than `MAX_JSON_DEPTH`, strings (keys too) with NUL or lone surrogates (not
    UTF-8 text: nothing could store them), numbers that are not finite (``1e400``)."""
    if depth > MAX_JSON_DEPTH:
        raise FieldError(400, path, f"The request body is nested too deeply (at most "
                         f"{MAX_JSON_DEPTH} levels).")
    if isinstance(value, str):
        if "\0" in value:
            raise FieldError(400, path, f"'{path}' holds a NUL character.")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise FieldError(400, path, f"'{path}' is not valid Unicode text (a lone "
                             "surrogate).") from None
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise FieldError(400, path, f"'{path}' must be a finite number.")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_json_values(k, path, depth + 1)
            check_json_values(v, k if path == "body" else f"{path}.{k}", depth + 1)
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_json_values(v, f"{path}[{i}]", depth + 1)

#: gpulab's pages extend JupyterHub's own ``page.html`` (its navigation, Bootstrap 5 and dark
#: mode), found as the hub finds it: gpulab's hub templates first (the "GPUs" link in the
#: navigation), then JupyterHub's, also as ``templates/<name>`` (what gpulab's hub
#: ``page.html`` extends). Their CSS and JavaScript come from the hub's static files
#: (``<hub prefix>static/``, `ErrorPages.page_context`), which the proxy routes to the hub.
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


class HubDirectory:
    """Users and groups as the hub knows them, read with the service's own token."""

    def __init__(self, api_url: str, token: str, ttl: float = 5.0):
        self.api_url, self.token, self.ttl = api_url.rstrip("/"), token, ttl
        self._cache: tuple[float, list[dict]] | None = None
        self._lock = asyncio.Lock()

    async def _get(self, path: str):
        req = HTTPRequest(self.api_url + path, headers={"Authorization": f"token {self.token}"},
                          request_timeout=20)
        resp = await AsyncHTTPClient().fetch(req)
        return json.loads(resp.body)

    async def _all_users(self) -> list[dict]:
        """Every user model the hub lists, page by page (active servers only)."""
        models, offset = [], 0
        while True:
            page = await self._get(f"/users?offset={offset}&limit=200&include_stopped_servers=0")
            items = page["items"] if isinstance(page, dict) else page
            models.extend(items)
            if not isinstance(page, dict) or not page.get("_pagination", {}).get("next"):
                return models
            offset = page["_pagination"]["next"]["offset"]

    async def users(self) -> list[dict]:
        async with self._lock:
            if self._cache and time.monotonic() - self._cache[0] < self.ttl:
                return self._cache[1]
            users = [{"name": u["name"], "groups": sorted(u.get("groups", [])),
                      "admin": bool(u.get("admin"))} for u in await self._all_users()]
            self._cache = (time.monotonic(), users)
            return users

    async def active_servers(self) -> set[tuple[str, str]] | None:
        """``(user, server)`` of every server the hub has running or starting or stopping
        (``"default"`` for a user's default server, as the ledger names it), or None when the
        hub does not show servers to this service's token (no ``read:servers``)."""
        active = set()
        for u in await self._all_users():
            if "servers" not in u:
                return None
            active.update((u["name"], name or "default") for name in u["servers"])
        return active

    async def groups_of(self, name: str) -> list[str]:
        for u in await self.users():
            if u["name"] == name:
                return u["groups"]
        try:
            model = await self._get(f"/users/{quote(name, safe='')}")
        except Exception:
            return []
        return sorted(model.get("groups", []))

    def forget(self) -> None:
        self._cache = None


class Base(HubOAuthenticated, web.RequestHandler):
    @property
    def ledger(self) -> Ledger:
        return self.settings["ledger"]

    @property
    def directory(self) -> HubDirectory:
        return self.settings["directory"]

    @property
    def hub_scopes(self):
        return {ACCESS_SCOPE}

    @property
    def is_gpulab_admin(self) -> bool:
        user = self.current_user
        return bool(user) and bool(self.hub_auth.check_scopes({ADMIN_SCOPE}, user))


class APIHandler(Base):
    """JSON in, JSON out; every error is ``{"status": …, "message": …, "field"?: …}``."""

    async def prepare(self):
        model = await self.hub_auth.get_user(self, sync=False)
        if not model:
            raise web.HTTPError(401, "Log in to the hub, or send a hub API token "
                                "(header 'Authorization: token <token>').")
        if not self.hub_auth.check_scopes(self.hub_scopes, model):
            raise web.HTTPError(403, f"This token lacks the scope {ACCESS_SCOPE}.")
        self._hub_auth_user_cache = model
        self.current_user = model

    def set_default_headers(self):
        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.set_header("Cache-Control", "no-store")

    def write_error(self, status_code, **kwargs):
        exc = kwargs.get("exc_info", (None, None, None))[1]
        message = getattr(exc, "message", None)
        if message is None and isinstance(exc, web.HTTPError) and exc.log_message:
            message = exc.log_message % exc.args if exc.args else exc.log_message
        message = message or self._reason
        body = {"status": status_code, "message": message}
        if getattr(exc, "field", None):
            body["field"] = exc.field
        if status_code >= 500 and status_code != 503:  # 503: a state said on purpose
            body["message"] = "Internal error in the gpulab service; see its log."
        self.finish(json.dumps(body))

    def require_admin(self):
        if not self.is_gpulab_admin:
            raise web.HTTPError(403, f"This needs the scope {ADMIN_SCOPE} (a gpulab admin).")

    def json_body(self, limit: int = MAX_BODY):
        if len(self.request.body) > limit:
            raise FieldError(413, "body", "The request body is too large.")
        try:
            body = json.loads(self.request.body or b"null", parse_constant=_no_constant)
        except RecursionError:
            raise FieldError(400, "body", "The request body is nested too deeply (at most "
                             f"{MAX_JSON_DEPTH} levels).") from None
        except (ValueError, UnicodeDecodeError) as e:
            raise FieldError(400, "body", f"The request body is not valid JSON: {e}.") from None
        check_json_values(body)
        return body

    def send(self, obj, status=200):
        self.set_status(status)
        self.finish(json.dumps(obj))

    def int_arg(self, name: str, default: int, lo: int, hi: int) -> int:
        raw = self.get_query_argument(name, None)
        if raw is None:
            return default
        try:
            value = int(raw)
        except ValueError:
            raise FieldError(400, name, f"'{name}' must be a whole number, got {raw!r}.") from None
        if not lo <= value <= hi:
            raise FieldError(400, name, f"'{name}' must be from {lo} to {hi}, got {value}.")
        return value


class FieldError(web.HTTPError):
    """A 4xx whose ``message`` is for people and whose ``field`` names the bad input."""

    def __init__(self, status: int, field: str, message: str):
        super().__init__(status, "%s", message)
        self.field = field
        self.message = message


# -- views shared by the API and the pages ------------------------------------------------


async def user_view(handler: Base, name: str, now: float | None = None) -> dict:
    now = time.time() if now is None else now
    ledger = handler.ledger
    groups = await handler.directory.groups_of(name)
    quota, source = ledger.effective(name, groups)
    held = ledger.open_allocations(user=name)
    return {
        "user": name,
        "groups": groups,
        "quota": quota.as_dict() if quota else None,
        "quota_source": source,
        "quota_text": quota.describe() if quota else "no limit but free GPUs",
        "holdings": [_holding(a, _usage(handler)) for a in held if a.gpus],
        "gpus_held": sum(a.gpus for a in held),
        "usage_gpu_hours": {
            "7d": round(ledger.usage(now - 7 * DAY, now, user=name).get(name, 0.0), 3),
            "30d": round(ledger.usage(now - 30 * DAY, now, user=name).get(name, 0.0), 3),
        },
    }


def _usage(handler: Base):
    """The service's `PoolUsage` (None: GPU usage is not measured by this service)."""
    return handler.settings.get("gpu_usage")


def _holding(a, usage=None) -> dict:
    """One open allocation; with `usage`, how busy each of its devices is now (NVML)."""
    return {"id": a.id, "kind": a.kind, "name": a.holder, "gpus": a.gpus,
            "devices": list(a.devices), "since": a.started_at,
            "usage": usage.entries(a.devices) if usage is not None else []}


def inventory_view(ledger: Ledger, usage=None) -> dict:
    devices = ledger.devices()
    held = {i for a in ledger.open_allocations() for i in a.devices}
    return {"total": len(devices), "free": len([d for d in devices if d.index not in held]),
            "simulated": any(d.simulated for d in devices),
            # whether real GPUs' usage is read (NVML on this machine)
            "usage_measured": usage is not None and usage.sampler is not None}


async def overview(handler: Base) -> dict:
    """Everything the admin page shows: users, groups, default quota, audit trail."""
    now = time.time()
    ledger = handler.ledger
    users = await handler.directory.users()
    open_allocs = ledger.open_allocations()
    models = {d.index: d.model for d in ledger.devices()}
    u7 = ledger.usage(now - 7 * DAY, now)
    u30 = ledger.usage(now - 30 * DAY, now)
    rows = {q["scope"] + ":" + q["name"]: q for q in ledger.quotas()}
    known = {u["name"] for u in users}
    # people the hub no longer lists but who still hold GPUs or have history stay visible
    for name in sorted(({a.user for a in open_allocs} | set(u30)) - known):
        users.append({"name": name, "groups": [], "admin": False})
    out_users = []
    groups: dict[str, dict] = {}
    for u in users:
        quota, source = ledger.effective(u["name"], u["groups"])
        mine = [a for a in open_allocs if a.user == u["name"] and a.gpus]
        out_users.append({
            "name": u["name"], "groups": u["groups"],
            "quota": quota.as_dict() if quota else None, "quota_source": source,
            "quota_text": quota.describe() if quota else "no limit",
            "override": rows.get("user:" + u["name"]),
            # which devices, of which models: the admin sees who holds GPU 3
            "holdings": [{**_holding(a, _usage(handler)), "models": sorted({models[i] for i in a.devices
                                                            if models.get(i)})}
                         for a in mine],
            "gpus_held": sum(a.gpus for a in mine),
            "gpu_hours_7d": round(u7.get(u["name"], 0.0), 2),
            "gpu_hours_30d": round(u30.get(u["name"], 0.0), 2),
        })
        for g in u["groups"]:
            entry = groups.setdefault(g, {"name": g, "members": [], "gpus_held": 0,
                                          "gpu_hours_7d": 0.0, "gpu_hours_30d": 0.0})
            entry["members"].append(u["name"])
            entry["gpus_held"] += sum(a.gpus for a in mine)
            entry["gpu_hours_7d"] += u7.get(u["name"], 0.0)
            entry["gpu_hours_30d"] += u30.get(u["name"], 0.0)
    for key, q in rows.items():
        if q["scope"] == "group":
            groups.setdefault(q["name"], {"name": q["name"], "members": [], "gpus_held": 0,
                                          "gpu_hours_7d": 0.0, "gpu_hours_30d": 0.0})
    for g in groups.values():
        g["quota"] = rows.get("group:" + g["name"])
        g["gpu_hours_7d"] = round(g["gpu_hours_7d"], 2)
        g["gpu_hours_30d"] = round(g["gpu_hours_30d"], 2)
    return {
        "users": sorted(out_users, key=lambda u: u["name"]),
        "groups": sorted(groups.values(), key=lambda g: g["name"]),
        "default": rows.get("default:"),
        "inventory": inventory_view(ledger, _usage(handler)),
        # every field of a change (GPU-hours too), in the words of the quota column
        "audit": [{**a, "old_text": Quota(**a["old"]).describe() if a["old"] else "—",
                   "new_text": Quota(**a["new"]).describe() if a["new"] else "unset"}
                  for a in ledger.audit(50)],
    }


# -- REST API ------------------------------------------------------------------------------


class MeHandler(APIHandler):
    async def get(self):
        view = await user_view(self, self.current_user["name"])
        view["inventory"] = inventory_view(self.ledger, _usage(self))
        view["admin"] = self.is_gpulab_admin
        backend = self.settings.get("jobs")
        view["jobs"] = None if backend is None else {
            "backend": backend.name, "images": list(self.settings["job_limits"].allowed_images),
            "available": not backend.unavailable, "reason": backend.unavailable or ""}
        self.send(view)


class QuotasHandler(APIHandler):
    async def get(self):
        self.require_admin()
        self.send({"quotas": self.ledger.quotas()})


class QuotaHandler(APIHandler):
    """``/quotas/default``, ``/quotas/users/<name>``, ``/quotas/groups/<name>``."""

    def _target(self, kind: str, name: str | None) -> tuple[str, str]:
        self.require_admin()
        scope = {"default": "default", "users": "user", "groups": "group"}[kind]
        name = name or ""
        if scope != "default" and not 1 <= len(name) <= 255:
            raise FieldError(400, "name", f"A {scope} name must have 1 to 255 characters.")
        return scope, name

    async def get(self, kind, name=None):
        scope, name = self._target(kind, name)
        q = self.ledger.quota_of(scope, name)
        if q is None:
            raise web.HTTPError(404, f"No {scope} quota is set" + (f" for '{name}'." if name else "."))
        self.send({"scope": scope, "name": name, **q.as_dict()})

    async def put(self, kind, name=None):
        scope, name = self._target(kind, name)
        try:
            quota = parse_quota(self.json_body())
            # writes wait for the ledger's lock: in a worker thread, never on the event loop
            row = await asyncio.to_thread(self.ledger.set_quota, scope, name, quota,
                                          self.current_user["name"])
        except QuotaError as e:
            raise FieldError(400, e.field, e.message) from None
        self.settings["on_quota_change"](scope, name)
        self.send(row)

    async def delete(self, kind, name=None):
        scope, name = self._target(kind, name)
        if not await asyncio.to_thread(self.ledger.unset_quota, scope, name,
                                       self.current_user["name"]):
            raise web.HTTPError(404, f"No {scope} quota is set" + (f" for '{name}'." if name else "."))
        self.settings["on_quota_change"](scope, name)
        self.set_status(204)
        self.finish()


class AllocationsHandler(APIHandler):
    async def get(self):
        who = self.get_query_argument("user", None)
        if not self.is_gpulab_admin:
            if who not in (None, self.current_user["name"]):
                raise web.HTTPError(403, "You may only see your own allocations.")
            who = self.current_user["name"]
        allocs = self.ledger.open_allocations(user=who)
        self.send({"allocations": [a.as_dict() for a in allocs]})


class UsageHandler(APIHandler):
    async def get(self):
        days = self.int_arg("days", 7, 1, 366)
        now = time.time()
        if not self.is_gpulab_admin:
            name = self.current_user["name"]
            hours = self.ledger.usage(now - days * DAY, now, user=name).get(name, 0.0)
            self.send({"days": days, "users": {name: round(hours, 3)}, "groups": {}})
            return
        users = self.ledger.usage(now - days * DAY, now)
        groups: dict[str, float] = {}
        for u in await self.directory.users():
            for g in u["groups"]:
                groups[g] = groups.get(g, 0.0) + users.get(u["name"], 0.0)
        self.send({"days": days, "users": {k: round(v, 3) for k, v in sorted(users.items())},
                   "groups": {k: round(v, 3) for k, v in sorted(groups.items())}})


class AuditHandler(APIHandler):
    async def get(self):
        self.require_admin()
        self.send({"audit": self.ledger.audit(self.int_arg("limit", 100, 1, 1000))})


# -- training jobs -------------------------------------------------------------------------


class JobsBase(APIHandler):
    @property
    def backend(self):
        backend = self.settings.get("jobs")
        if backend is None:
            raise web.HTTPError(503, "Training jobs are not configured on this hub.")
        return backend

    def owner(self) -> str:
        """Whose jobs: your own; an admin may name another user with ?user=."""
        who = self.get_query_argument("user", None)
        me = self.current_user["name"]
        if who is None or who == me:
            return me
        if not self.is_gpulab_admin:
            raise web.HTTPError(403, "You may only see and act on your own jobs.")
        return who

    def job_or_404(self, name: str) -> dict:
        job = self.backend.get(self.owner(), name)
        if job is None:
            raise web.HTTPError(404, f"You have no job named '{name}'.")
        return job


class JobsHandler(JobsBase):
    async def get(self):
        if self.get_query_argument("all", "") in ("1", "true") :
            self.require_admin()
            self.send({"jobs": self.backend.list()})
            return
        self.send({"jobs": self.backend.list(self.owner())})

    async def post(self):
        from gpulab.hub.jobs.local import JobError
        from gpulab.hub.jobs.spec import SpecError, parse_spec

        if self.backend.unavailable:
            raise web.HTTPError(503, self.backend.unavailable)
        limits = self.settings["job_limits"]
        body = self.json_body(limit=limits.max_source_bytes + MAX_BODY)
        try:
            spec = parse_spec(body, limits)
        except SpecError as e:
            raise FieldError(400, e.field, e.message) from None
        me = self.current_user["name"]
        groups = tuple(await self.directory.groups_of(me))
        try:
            job = await self.backend.submit(me, groups, spec)
        except AdmissionRefused as e:
            raise FieldError(e.status, "resources", f"Job '{spec.name}' was not started: {e.message}") from None
        except JobError as e:
            raise FieldError(e.status, e.field or "body", e.message) from None
        self.send(job, 201)


class JobHandler(JobsBase):
    async def get(self, name):
        job = await self.backend.detail(self.owner(), name)
        if job is None:
            raise web.HTTPError(404, f"You have no job named '{name}'.")
        from gpulab.hub.jobs.local import FINAL

        usage = _usage(self)
        if usage is not None and job.get("state") not in FINAL:
            for r in job.get("replicas", ()):
                if r.get("devices"):  # how busy the replica's GPUs are now
                    r["usage"] = usage.entries(r["devices"])
        self.send(job)


class JobStopHandler(JobsBase):
    async def post(self, name):
        self.job_or_404(name)
        self.send(await self.backend.stop(self.owner(), name, actor=self.current_user["name"]))


class JobLogsHandler(JobsBase):
    """A replica's log from ``offset`` (at most 1 MiB a call); with ``follow=1`` waits up to
    20 s for more while the job runs. ``offset`` in the answer is where to ask next."""

    async def get(self, name, replica):
        from gpulab.hub.jobs.local import JobError

        offset = self.int_arg("offset", 0, 0, 2**62)
        follow = self.get_query_argument("follow", "") in ("1", "true")
        owner = self.owner()
        deadline = time.monotonic() + 20
        while True:
            try:
                if inspect.iscoroutinefunction(self.backend.read_log):
                    text, size, done = await self.backend.read_log(owner, name, replica, offset)
                else:  # in a thread: it reads a file in the person's folder (local backend)
                    text, size, done = await asyncio.to_thread(
                        self.backend.read_log, owner, name, replica, offset)
            except JobError as e:
                raise FieldError(e.status, e.field or "name", e.message) from None
            if text or not follow or done or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        self.send({"replica": replica, "offset": offset + len(text), "size": size,
                   "text": text.decode(errors="replace"), "done": done})


class OpenAPIHandler(web.RequestHandler):
    def get(self):
        from gpulab.hub.service.openapi import openapi_document

        self.set_header("Content-Type", "application/json; charset=utf-8")
        self.finish(json.dumps(openapi_document(self.settings["service_prefix"])))


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
        "services": [{"name": SERVICE_NAME, "href": prefix}] if model else [],
        # gpulab's own
        "prefix": prefix, "hub_prefix": hub, "xsrf": xsrf, "admin": bool(model) and admin,
        "page": path,
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


class UserPage(PageHandler):
    @web.authenticated
    async def get(self):
        view = await user_view(self, self.current_user["name"])
        self.render_page("user.html", me=view, inventory=inventory_view(self.ledger, _usage(self)))


class AdminPage(PageHandler):
    @web.authenticated
    async def get(self):
        if not self.is_gpulab_admin:
            raise PageError(403, "The GPU admin page is for gpulab admins: they set quotas "
                            "and see everyone's GPUs.", hint="admin-only")
        self.render_page("admin.html", o=await overview(self))


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


class OAuthCallbackHandler(ErrorPages, HubOAuthCallbackHandler):
    """The hub's OAuth callback; its errors (a login refused, stale or forged: 400, 403) are
    pages too, saying to log in again."""

    def write_error(self, status_code, **kwargs):
        exc = kwargs.get("exc_info", (None, None, None))[1]
        if isinstance(exc, web.HTTPError) and status_code < 500 and not getattr(exc, "hint", ""):
            exc.hint = "login"
        super().write_error(status_code, **kwargs)


def make_app(ledger: Ledger, prefix: str, hub_prefix: str, directory: HubDirectory,
             on_quota_change=None, jobs=None, job_limits=None,
             tls: "ServiceTLS | None" = None, gpu_usage=None) -> web.Application:
    """The service's tornado application; with `tls`, its calls to the hub (token checks)
    go over mutual TLS with the service's own certificate, verifying the hub's; with
    `gpu_usage` (a `PoolUsage`), holdings and replicas say how busy their GPUs are."""
    from gpulab.hub.jobs.spec import DEFAULT_LIMITS

    api = url_path_join(prefix, "api/v1")
    name = r"([^/]+)"
    if jobs is not None:  # the bounds a backend applies as it admits (replicas per person…)
        jobs.limits = job_limits or DEFAULT_LIMITS
    return web.Application(
        [
            (prefix, UserPage),
            (url_path_join(prefix, "admin"), AdminPage),
            (url_path_join(prefix, "oauth_callback"), OAuthCallbackHandler),
            (url_path_join(api, "me"), MeHandler),
            (url_path_join(api, "quotas"), QuotasHandler),
            (url_path_join(api, "quotas/(default)"), QuotaHandler),
            (url_path_join(api, f"quotas/(users|groups)/{name}"), QuotaHandler),
            (url_path_join(api, "allocations"), AllocationsHandler),
            (url_path_join(api, "usage"), UsageHandler),
            (url_path_join(api, "audit"), AuditHandler),
            (url_path_join(api, "jobs"), JobsHandler),
            (url_path_join(api, f"jobs/{name}"), JobHandler),
            (url_path_join(api, f"jobs/{name}/stop"), JobStopHandler),
            (url_path_join(api, f"jobs/{name}/logs/{name}"), JobLogsHandler),
            (url_path_join(api, "openapi.json"), OpenAPIHandler),
        ],
        ledger=ledger,
        directory=directory,
        service_prefix=prefix,
        hub_prefix=hub_prefix,
        hub_auth=HubOAuth(cache_max_age=5, access_scopes={ACCESS_SCOPE},
                          **(tls.hub_auth_kwargs() if tls else {})),
        cookie_secret=os.urandom(32),
        xsrf_cookies=False,  # HubOAuth checks xsrf on cookie-authenticated requests itself
        default_handler_class=NotFoundHandler,
        on_quota_change=on_quota_change or (lambda scope, name: directory.forget()),
        jobs=jobs,
        job_limits=job_limits or DEFAULT_LIMITS,
        gpu_usage=gpu_usage,
    )


RECONCILE_ENV = "GPULAB_RECONCILE_SECONDS"
USAGE_ENV = "GPULAB_USAGE_SECONDS"


def usage_from_env(ledger: Ledger, env=None):
    """A `PoolUsage` over the pool's real GPUs, read every ``GPULAB_USAGE_SECONDS`` (default
    5; 0: not measured). A counting pool (Kubernetes: no device numbers, the GPUs are on the
    nodes) has nothing this process can read."""
    from gpulab.spawner.gpuusage import PoolUsage

    env = os.environ if env is None else env
    interval = float(env.get(USAGE_ENV) or 5)
    devices = ledger.devices()
    if not interval or not devices:
        return None
    return PoolUsage(devices, interval)


class ServiceTLS:
    """The service's side of the hub's internal TLS, from what the hub gives it.

    ``GPULAB_SSL_KEYFILE`` / ``GPULAB_SSL_CERTFILE``: the service's own key and certificate,
    signed by the hub's CA (`gpulab.hub.deploy.localhub.service_certificate`), served to every client and
    shown to the hub as a client certificate; ``GPULAB_SSL_CLIENT_CA``: the bundle of the hub's
    internal CAs, the only clients accepted (the hub, the proxy, notebook servers' kernels with
    their server's certificate); ``GPULAB_SSL_HUB_CA``: the hub's CA alone, the only one that
    may answer for the hub's API. Without them (the service run without ``internal_ssl``) the
    service speaks plain HTTP as before.
    """

    def __init__(self, keyfile: str, certfile: str, client_ca: str, hub_ca: str):
        self.keyfile, self.certfile, self.client_ca, self.hub_ca = keyfile, certfile, client_ca, hub_ca

    @classmethod
    def from_env(cls, env=None) -> "ServiceTLS | None":
        env = os.environ if env is None else env
        names = ("GPULAB_SSL_KEYFILE", "GPULAB_SSL_CERTFILE", "GPULAB_SSL_CLIENT_CA",
                 "GPULAB_SSL_HUB_CA")
        values = [env.get(n, "") for n in names]
        if not any(values):
            return None
        missing = [n for n, v in zip(names, values) if not v]
        if missing:
            raise RuntimeError("Incomplete TLS settings for the gpulab service: "
                               + ", ".join(missing) + " not set")
        return cls(*values)

    def server_context(self):
        """TLS for the service's port: its certificate, and a client certificate of one of
        the hub's CAs required from every client."""
        from jupyterhub.utils import make_ssl_context

        return make_ssl_context(self.keyfile, self.certfile, cafile=self.client_ca,
                                purpose=ssl.Purpose.CLIENT_AUTH)

    def hub_auth_kwargs(self) -> dict:
        return {"keyfile": self.keyfile, "certfile": self.certfile, "client_ca": self.hub_ca}

    def configure_http_client(self) -> None:
        """Every call of this process to the hub (users, groups, servers) verifies the hub."""
        AsyncHTTPClient.configure(None, defaults={
            "ca_certs": self.hub_ca, "client_key": self.keyfile, "client_cert": self.certfile,
            "validate_cert": True})


async def close_orphaned_notebooks(ledger: Ledger, directory: HubDirectory,
                                   grace: float) -> list | None:
    """Close the open notebook allocations whose server the hub no longer has.

    A hub that stops or crashes in the middle of a spawn (a ``helm upgrade`` while a GPU image
    is being pulled, the hub pod evicted) never learns that the server it was starting is gone,
    so the GPUs admitted for it would stay held for ever. The hub's own list of servers is the
    truth: an allocation whose ``(user, server)`` the hub does not list as running, starting or
    stopping is closed. An allocation younger than ``grace`` seconds is left alone (it may
    belong to a spawn that began after the hub's list was read). Returns the closed
    allocations, or None when the hub's list could not be read (then nothing is closed).
    """
    try:
        active = await directory.active_servers()
    except Exception as e:  # the hub restarting: try again next time
        log.warning("Could not list the hub's servers (%s); no notebook allocation closed", e)
        return None
    if active is None:
        log.warning("The hub does not show servers to the gpulab service (no read:servers "
                    "scope); notebook allocations of vanished servers are not closed")
        return None
    now = time.time()
    closed = []
    for a in ledger.open_allocations(kind="notebook"):
        if (a.user, a.holder) in active or now - a.started_at < grace:
            continue
        done = await asyncio.to_thread(ledger.release, a.id,
                                       "server gone: the hub no longer has it")
        if done is not None:
            log.warning("Closed the allocation of %s's server '%s' (%d GPUs): the hub no "
                        "longer has that server", a.user, a.holder, a.gpus)
            closed.append(done)
    return closed


def start_notebook_reconciler(ledger: Ledger, directory: HubDirectory,
                              interval: float) -> PeriodicCallback | None:
    """Run `close_orphaned_notebooks` every ``interval`` seconds (0: never); the grace for
    young allocations is the interval, at least 30 s."""
    if interval <= 0:
        return None
    grace = max(30.0, interval)
    busy = False

    async def tick():
        nonlocal busy
        if busy:
            return
        busy = True
        try:
            await close_orphaned_notebooks(ledger, directory, grace)
        except Exception:
            log.exception("Notebook allocation reconciler failed; retrying")
        finally:
            busy = False

    pc = PeriodicCallback(tick, interval * 1000)
    pc.start()
    return pc


def local_backend_from_env(ledger: Ledger):
    """The local job backend, from what `gpulab up` passes in the environment."""
    shared = os.environ.get("GPULAB_SHARED_DIR")
    if not shared:
        return None
    from gpulab.spawner.accounts import ensure_account, prepare_user_folder, safe_name, system_username

    from gpulab.hub.jobs.local import LocalJobBackend, UserAccount, runtime_problem

    isolate = os.environ.get("GPULAB_ISOLATE") == "1"
    prefix = os.environ.get("GPULAB_USER_PREFIX", "jupyter-")

    def account(user: str) -> UserAccount:
        # the spawner's mapping and checks (gpulab.spawner.accounts): an account or folder
        # made for another hub user is never used (AccountConflict)
        folder = Path(shared) / "users" / safe_name(user)
        if not isolate:
            prepare_user_folder(folder, None)
            return UserAccount(user, folder)
        entry = ensure_account(system_username(prefix, user), user)
        prepare_user_folder(folder, entry)
        return UserAccount(user, folder, entry.pw_uid, entry.pw_gid, entry.pw_dir)

    python = os.environ.get("GPULAB_JOB_PYTHON") or sys.executable
    backend = LocalJobBackend(ledger, account, python=python)
    backend.unavailable = runtime_problem(python)
    if backend.unavailable:
        log.error("%s", backend.unavailable)
    return backend


def kube_backend_from_env(ledger: Ledger):
    """The Kubernetes job backend when the hub asks for it (``GPULAB_JOB_BACKEND=kubernetes``,
    settings in ``GPULAB_KUBE_JOBS``, see `gpulab.hub.jobs.kube.backend_settings`)."""
    if os.environ.get("GPULAB_JOB_BACKEND") != "kubernetes":
        return None
    from gpulab.hub.jobs.kube import SETTINGS_ENV, KubeJobBackend

    return KubeJobBackend.from_settings(ledger, os.environ.get(SETTINGS_ENV))


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="[%(levelname)1.1s %(asctime)s gpulab-service] %(message)s")
    from urllib.parse import urlparse

    url = urlparse(os.environ["JUPYTERHUB_SERVICE_URL"])
    prefix = os.environ.get("JUPYTERHUB_SERVICE_PREFIX", f"/services/{SERVICE_NAME}/")
    hub_prefix = os.environ.get("JUPYTERHUB_BASE_URL", "/") + "hub/"
    ledger = Ledger(os.environ["GPULAB_LEDGER_URL"], pool=os.environ.get("GPULAB_LEDGER_POOL", "local"))
    ledger.migrate()
    tls = ServiceTLS.from_env()
    if tls is not None:
        tls.configure_http_client()
    directory = HubDirectory(os.environ["JUPYTERHUB_API_URL"], os.environ["JUPYTERHUB_API_TOKEN"])
    jobs = kube_backend_from_env(ledger) or local_backend_from_env(ledger)
    from gpulab.hub.jobs.spec import limits_from_json

    app = make_app(ledger, prefix, hub_prefix, directory, jobs=jobs,
                   job_limits=limits_from_json(os.environ.get("GPULAB_JOB_LIMITS")), tls=tls,
                   gpu_usage=usage_from_env(ledger))
    if jobs is not None:
        jobs.recover()
        IOLoop.current().add_callback(jobs.ensure_supervisor)
    start_notebook_reconciler(ledger, directory, float(os.environ.get(RECONCILE_ENV) or 60))
    # tornado buffers a body whole before a handler sees it (100 MB by default): bound it.
    # Up to this size an oversized body gets the handlers' clear 413 (`json_body`); past it
    # tornado refuses the request from its Content-Length alone, before reading it
    app.listen(url.port, url.hostname, max_body_size=MAX_BUFFERED_BODY,
               ssl_options=tls.server_context() if tls is not None else None)
    # The hub manages this process; if the hub dies (kill -9), go too, so that the next
    # `gpulab up` finds the port free and starts a fresh service.
    hub_pid = os.getppid()

    def exit_if_orphaned():
        if os.getppid() != hub_pid:
            log.warning("The hub (pid %s) is gone; the gpulab service stops.", hub_pid)
            IOLoop.current().stop()

    PeriodicCallback(exit_if_orphaned, 500).start()

    def stop(sig: signal.Signals) -> None:
        # the hub stops its services with SIGINT (Ctrl-C reaches this process too): a line
        # in the log, not a KeyboardInterrupt traceback; training jobs go on (see jobs.py)
        log.info("gpulab service: %s, stopping", sig.name)
        IOLoop.current().stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        IOLoop.current().asyncio_loop.add_signal_handler(sig, stop, sig)
    log.info("gpulab service at %s%s (ledger %s)", url.geturl(), prefix, ledger.engine.url.render_as_string(hide_password=True))
    IOLoop.current().start()


if __name__ == "__main__":
    main()
