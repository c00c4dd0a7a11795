"""The handler base of the gpulab service: `Base` (the hub's authentication, the ledger and
the hub directory of the application's settings), `APIHandler` (JSON in, JSON out, one place
where errors become status codes and JSON bodies), `FieldError`, and the checks every JSON
request body passes (`check_json_values`)."""

from __future__ import annotations

import asyncio
import json
import logging
import math

from jupyterhub.services.auth import HubOAuthenticated
from tornado import web

from gpulab.hub.quota.ledger import AdmissionRefused, Ledger
from gpulab.hub.service import ACCESS_SCOPE, ADMIN_SCOPE
from gpulab.hub.service.hubapi import HubDirectory

log = logging.getLogger("gpulab.service")

DAY = 24 * 3600
MAX_BODY = 64 * 1024
#: the largest request body the service reads at all (see `main`)
MAX_BUFFERED_BODY = 16 * 2**20
#: the deepest nesting of lists and objects a request body may have
MAX_JSON_DEPTH = 32
#: list APIs: the page size when a request names none, and the largest a request may ask for
PAGE_DEFAULT = 200
PAGE_MAX = 1000


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


class AppHubAuth:
    """Every handler of the service asks the hub through the application's one `HubOAuth`
    (``settings["hub_auth"]``: its 5 s cache, its access scope, its TLS files), never through
    the process-wide ``HubOAuth.instance()`` that `HubOAuthenticated` falls back to: that one
    keeps a token's answer for 300 s, so a token revoked in the hub, or the token of an
    account deleted there, went on working at the service for five minutes."""

    @property
    def hub_auth(self):  # read-only: no handler swaps in another
        return self.settings["hub_auth"]


class Base(AppHubAuth, HubOAuthenticated, web.RequestHandler):
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

    def _handle_request_exception(self, e: BaseException) -> None:
        """The one mapping of the job workflow's and the ledger's refusals to answers (as
        jupyter_server's managers raise ``HTTPError`` once): `JobError` (`JobNotFound`: 404)
        and `AdmissionRefused` become a `FieldError` of their status and words; the rest is
        tornado's (an ``HTTPError`` its status, anything else a 500)."""
        from gpulab.hub.jobs.base import JobError

        if isinstance(e, JobError):
            answer = FieldError(e.status, e.field or self.job_error_field, e.message)
        elif isinstance(e, AdmissionRefused):
            words = (f"Job '{self.submitting}' was not started: {e.message}"
                     if self.submitting else e.message)
            answer = FieldError(e.status, "resources", words)
        else:
            return super()._handle_request_exception(e)
        try:
            raise answer from e
        except FieldError:
            super()._handle_request_exception(answer)

    #: the field a `JobError` that names none is about
    job_error_field = "body"
    #: the name of the job a POST submits (its refusal says so)
    submitting: str | None = None

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

    def page_args(self, default: int = PAGE_DEFAULT, most: int = PAGE_MAX) -> tuple[int, int]:
        """``(offset, limit)`` of a list request (``?offset=&limit=``): whole numbers,
        ``limit`` from 1 to `most`, ``offset`` from 0; anything else is a 400 naming the
        field."""
        return self.int_arg("offset", 0, 0, 2**31 - 1), self.int_arg("limit", default, 1, most)

    def send_page(self, key: str, items: list, offset: int, limit: int,
                  total: int | None = None, **extra) -> None:
        """One page of a list: ``{key: items[offset:offset+limit], "_pagination": {offset,
        limit, total, next}}`` (JupyterHub's shape: ``next`` is ``{"offset": n}`` or null).
        `items` is the whole list, or, with `total`, the page already cut."""
        if total is None:
            total, items = len(items), items[offset:offset + limit]
        nxt = offset + len(items)
        self.send({key: items, **extra, "_pagination": {
            "offset": offset, "limit": limit, "total": total,
            "next": {"offset": nxt, "limit": limit} if nxt < total and items else None}})


class FieldError(web.HTTPError):
    """A 4xx whose ``message`` is for people and whose ``field`` names the bad input."""

    def __init__(self, status: int, field: str, message: str):
        super().__init__(status, "%s", message)
        self.field = field
        self.message = message


async def mark_cluster_kinds(handler, holdings: list[dict], entries: list[dict]) -> None:
    """Holdings and queue entries of held clusters (issue 38) say ``cluster``, not ``job``:
    the ledger and the queue hold a cluster's GPUs as a job's. A holding names its person in
    ``user``; an entry in ``user`` and ``holder``. One read of the active jobs' kinds, and
    none when nothing shown is a job's."""
    backend = handler.settings.get("jobs")
    if backend is None or not hasattr(backend, "active_clusters") or not any(
            x.get("kind") == "job" for x in (*holdings, *entries)):
        return
    held = await asyncio.to_thread(backend.active_clusters)
    if not held:
        return
    for h in holdings:
        if h.get("kind") == "job" and (h.get("user"), h.get("name")) in held:
            h["kind"] = "cluster"
    for e in entries:
        if e.get("kind") == "job" and (e.get("user"), e.get("holder")) in held:
            e["kind"] = "cluster"
