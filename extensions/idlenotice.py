"""GPU-idle warnings inside JupyterLab: the notebook server's own door to the gpulab service.

``GET <base_url>gpulab/idle`` answers this server's GPU-idle warnings (the gpulab service's
``GET /api/v1/idle``, narrowed to this server, `for_this_server`); ``POST
<base_url>gpulab/idle/keep`` ``{"hours": 2}`` keeps this server from the culler (the service's
``POST /api/v1/servers/<name>/keep``, bounded there by ``c.GPUIdle.keep_max_hours``). Both are
Jupyter server API handlers, behind the server's own login (and XSRF check for the POST), so
JupyterLab calls them same-origin; the server calls the service with its own token
(`gpulab.extensions.client.Client`, run in a thread: it blocks). The service's 4xx answers come
back with their status and message (``{"message", "field"?}``); a service that cannot be
reached is a 502 with words.

JupyterLab's plugin ``gpulab-launcher:idle-notice`` (``jupyter-config/labextension``) polls the
GET and shows each warning once as a notification with a "Keep for N hours" button.
"""

from __future__ import annotations

import asyncio
import json
import os
from urllib.parse import quote

#: the routes, below the server's base URL
IDLE_PATH = "gpulab/idle"
KEEP_PATH = "gpulab/idle/keep"
#: how long the server waits for the service
TIMEOUT = 15.0


def server_name(env=None) -> str:
    """This server's name as the gpulab service names it (``default`` for the default one)."""
    env = os.environ if env is None else env
    return env.get("JUPYTERHUB_SERVER_NAME") or "default"


def for_this_server(view: dict, server: str) -> dict:
    """The service's ``GET idle`` answer (`view`) narrowed to `server`: its warnings
    (``id``, ``text``, ``stop_at``, ``can_keep``, ``gpus``, ``idle_since``), its keep
    (``kept_until`` or None), the operator's ``keep_max_hours`` and whether culling is on."""
    notices = [{k: n.get(k) for k in ("id", "text", "stop_at", "can_keep", "gpus",
                                      "idle_since")}
               for n in (view.get("notices") or [])
               if n.get("kind") == "notebook" and n.get("name") == server]
    kept = [k.get("kept_until") for k in (view.get("kept") or []) if k.get("server") == server]
    return {"server": server, "enabled": bool(view.get("enabled")), "notices": notices,
            "kept_until": max(kept) if kept else None,
            "keep_max_hours": view.get("keep_max_hours") or 0}


def handlers(base_url: str) -> list:
    """The rows for ``web_app.add_handlers``."""
    from jupyter_server.utils import url_path_join

    get, keep = _handler_classes()
    return [(url_path_join(base_url, IDLE_PATH), get),
            (url_path_join(base_url, KEEP_PATH), keep)]


_CLASSES = None


def _handler_classes():
    global _CLASSES
    if _CLASSES is None:
        _CLASSES = _make_handler_classes()
    return _CLASSES


def _make_handler_classes():
    from jupyter_server.base.handlers import APIHandler
    from tornado import web

    from gpulab.extensions.client import Client, GpulabError

    class _Base(APIHandler):
        async def ask(self, method: str, path: str, body=None):
            try:
                return await asyncio.to_thread(Client(timeout=TIMEOUT).request, method, path,
                                               body)
            except GpulabError as e:
                if e.status is not None and 400 <= e.status < 500:
                    status, answer = e.status, {"message": e.message}
                    if e.field:
                        answer["field"] = e.field
                else:
                    status, answer = 502, {"message": f"The gpulab service did not answer: "
                                                      f"{e.message}"}
                self.set_status(status)
                self.finish(json.dumps(answer))
                return None

    class IdleNoticeHandler(_Base):
        """``GET gpulab/idle``: this server's GPU-idle warnings."""

        @web.authenticated
        async def get(self):
            view = await self.ask("GET", "idle")
            if view is not None:
                self.finish(json.dumps(for_this_server(view, server_name())))

    class IdleKeepHandler(_Base):
        """``POST gpulab/idle/keep`` ``{"hours": N}``: keep this server from the culler."""

        @web.authenticated
        async def post(self):
            try:
                body = json.loads(self.request.body or b"null")
            except ValueError:
                body = None
            if not isinstance(body, dict) or "hours" not in body:
                self.set_status(400)
                self.finish(json.dumps({"message": 'Send {"hours": <number>}.',
                                        "field": "hours"}))
                return
            answer = await self.ask("POST", f"servers/{quote(server_name(), safe='')}/keep",
                                    {"hours": body["hours"]})
            if answer is not None:
                self.finish(json.dumps(answer))

    return IdleNoticeHandler, IdleKeepHandler
