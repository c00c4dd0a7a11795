"""A light stand-in for many single-user servers at once (bench/scale.py).

JupyterHub's own tests stand in for a notebook server with ``mocksu``, a whole Python process
per server: 1,000 of them would not fit beside the hub. Here the spawner starts, for each
server, a shell that writes its environment to a spool folder and becomes ``sleep`` (``SHIM``:
a process the spawner polls, signals and waits for, as it would the real server, at about
1 MB each); this one process reads the spool and answers for every server on the address and
port the hub gave it, with the server's own internal-TLS certificate, what JupyterHub checks:

- the server's URL (``wait_up``: any answer with ``X-JupyterHub-Version``), and its ``api``
  (``/api``, ``/api/status``: what `jupyterhub.singleuser` answers the hub and the culler);
- activity: every ``--activity-every`` seconds it posts the server's last activity to the
  hub (``JUPYTERHUB_ACTIVITY_URL``, with the server's token and client certificate), as
  `jupyterhub.singleuser` does; a share of the servers (``--active-share``) stay busy, the
  others report their start only (the idle culler sees them idle).

When a server's ``sleep`` ends (the hub stopped it), its port closes.

    python bench/scale_standin.py SPOOL [--activity-every 60] [--active-share 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import ssl
import sys
import time
from pathlib import Path
from urllib.parse import urlparse

import jupyterhub
from tornado import web
from tornado.httpclient import AsyncHTTPClient, HTTPRequest
from tornado.httpserver import HTTPServer

SHIM = """#!/bin/sh
# a server for bench/scale_standin.py: its environment to the spool, then a process to poll
f="$SCALE_SPOOL/$$"
env | grep -E '^(JUPYTERHUB_[A-Z_]*|SCALE_[A-Z_]*)=' > "$f.tmp" && mv "$f.tmp" "$f.reg"
exec sleep 2147483647
"""


class Server(web.RequestHandler):
    def initialize(self, info):
        self.info = info

    def get(self, path=""):
        self.set_header("X-JupyterHub-Version", jupyterhub.__version__)
        self.set_header("Content-Type", "application/json")
        if path.rstrip("/").endswith("api/status"):
            self.finish(json.dumps({"started": self.info["started"], "connections": 0,
                                    "kernels": 0, "last_activity": self.info["last"]}))
        elif path.rstrip("/").endswith("api"):
            self.finish(json.dumps({"version": "2.0.0"}))
        else:
            self.finish(json.dumps({"server": self.info["name"]}))


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).isoformat().replace(
        "+00:00", "Z")


class Standin:
    def __init__(self, spool: Path, activity_every: float, active_share: float):
        self.spool, self.activity_every, self.active_share = spool, activity_every, active_share
        self.servers: dict[int, dict] = {}
        self.count = 0
        self.http = AsyncHTTPClient(max_clients=50)

    def adopt(self, reg: Path) -> None:
        env = dict(line.split("=", 1) for line in reg.read_text().splitlines() if "=" in line)
        pid = int(reg.stem)
        reg.unlink()
        url = urlparse(env["JUPYTERHUB_SERVICE_URL"])
        ctx = None
        if url.scheme == "https":
            ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH,
                                             cafile=env["JUPYTERHUB_SSL_CLIENT_CA"])
            ctx.load_cert_chain(env["JUPYTERHUB_SSL_CERTFILE"], env["JUPYTERHUB_SSL_KEYFILE"])
            ctx.verify_mode = ssl.CERT_OPTIONAL
        self.count += 1
        now = time.time()
        info = {"name": env.get("JUPYTERHUB_SERVER_NAME", ""), "env": env, "started": iso(now),
                "last": iso(now), "busy": (self.count * self.active_share) % 1 < self.active_share
                and self.active_share > 0}
        app = web.Application([(r"/(.*)", Server, {"info": info})])
        server = HTTPServer(app, ssl_options=ctx)
        server.listen(url.port, url.hostname)
        info["http"] = server
        self.servers[pid] = info
        asyncio.ensure_future(self.activity(info))

    async def activity(self, info) -> None:
        """Post the server's activity to the hub, as jupyterhub.singleuser does."""
        env = info["env"]
        url = env.get("JUPYTERHUB_ACTIVITY_URL")
        if not url:
            return
        if info["busy"]:
            info["last"] = iso(time.time())
        name = info["name"]
        body = {"servers": {name: {"last_activity": info["last"]}}, "last_activity": info["last"]}
        kw = {}
        if url.startswith("https:"):
            kw = dict(ca_certs=env["JUPYTERHUB_SSL_CLIENT_CA"],
                      client_cert=env["JUPYTERHUB_SSL_CERTFILE"],
                      client_key=env["JUPYTERHUB_SSL_KEYFILE"])
        try:
            await self.http.fetch(HTTPRequest(
                url, method="POST", body=json.dumps(body), request_timeout=30,
                headers={"Authorization": f"token {env['JUPYTERHUB_API_TOKEN']}",
                         "Content-Type": "application/json"}, **kw))
        except Exception as e:  # the hub busy, or the server stopped meanwhile
            print(f"activity of {env.get('JUPYTERHUB_USER')}: {e}", file=sys.stderr, flush=True)

    async def run(self) -> None:
        last_check = last_activity = time.monotonic()
        while True:
            for entry in os.scandir(self.spool):
                if entry.name.endswith(".reg"):
                    try:
                        self.adopt(Path(entry.path))
                    except Exception as e:
                        print(f"could not stand in for {entry.name}: {e!r}", file=sys.stderr,
                              flush=True)
            now = time.monotonic()
            if now - last_check > 1:
                last_check = now
                for pid in list(self.servers):
                    try:
                        os.kill(pid, 0)
                        gone = Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
                    except (ProcessLookupError, FileNotFoundError):
                        gone = True
                    if gone:
                        self.servers.pop(pid)["http"].stop()
                (self.spool / "standin.count").write_text(str(len(self.servers)))
            if now - last_activity > self.activity_every:
                last_activity = now
                for info in list(self.servers.values()):
                    asyncio.ensure_future(self.activity(info))
            await asyncio.sleep(0.02)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("spool", type=Path)
    p.add_argument("--activity-every", type=float, default=60.0)
    p.add_argument("--active-share", type=float, default=0.5)
    a = p.parse_args()
    a.spool.mkdir(parents=True, exist_ok=True)
    (a.spool / "shim.sh").write_text(SHIM)
    os.chmod(a.spool / "shim.sh", 0o755)
    asyncio.run(Standin(a.spool, a.activity_every, a.active_share).run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
