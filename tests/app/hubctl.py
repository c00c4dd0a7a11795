"""Drive a real `gpulab up` (JupyterHub + configurable-http-proxy) over HTTP, as a person's
browser would: sign up, get approved, log in, start and stop servers, run code in a kernel."""

from __future__ import annotations

import http.cookiejar
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.parse
import uuid
from pathlib import Path

import requests
import requests.adapters
import websocket

from gpulab.hub.machine.processes import pid_alive as pid_exists  # noqa: F401 (used by tests)

GPULAB = str(Path(sys.executable).with_name("gpulab"))

_getaddrinfo = socket.getaddrinfo


def _loopback_names(host, *args, **kwargs):
    """``localhost`` and every ``*.localhost`` name are 127.0.0.1, as browsers (and curl)
    resolve them without DNS (RFC 6761); this machine's resolver does not know the
    subdomains, so a hub with ``--subdomain-host http://localhost:<port>`` (its servers on
    ``<name>.localhost``) is reached by this process's requests and websockets too."""
    name = host.decode() if isinstance(host, bytes) else host
    if isinstance(name, str):
        name = name.rstrip(".").lower()
        if name == "localhost" or name.endswith(".localhost"):
            host = "127.0.0.1"
    return _getaddrinfo(host, *args, **kwargs)


socket.getaddrinfo = _loopback_names


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subdomains_by_default() -> bool:
    """Whether test hubs run as `gpulab up` does by default on loopback, each server on a host
    of its own (``http://<name>.localhost:<port>``): yes, unless GPULAB_TEST_SUBDOMAINS=0 runs
    them all on one origin (``--no-subdomains``)."""
    return os.environ.get("GPULAB_TEST_SUBDOMAINS", "1") != "0"


class Hub:
    """A `gpulab up` on free ports. With `subdomains` (`gpulab up`'s default on loopback, and
    the tests' unless `subdomains_by_default` says no), the hub is at
    ``http://localhost:<port>``, each person's server at ``http://<name>.localhost:<port>`` and
    the gpulab service at ``http://gpulab--service.localhost:<port>`` (JupyterHub's names);
    without, ``--no-subdomains``: all on ``http://127.0.0.1:<port>``."""

    def __init__(self, data_dir: Path, *extra: str, subdomains: bool | None = None):
        self.data_dir = data_dir
        self.port, self.hub_port, self.api_port = free_port(), free_port(), free_port()
        self.service_port = free_port()
        self.subdomains = subdomains_by_default() if subdomains is None else subdomains
        self.url = f"http://{'localhost' if self.subdomains else '127.0.0.1'}:{self.port}"
        # with subdomains, gpulab up's own default (it binds 127.0.0.1)
        self.extra = list(extra) + ([] if self.subdomains else ["--no-subdomains"])
        self.proc = None

    def host_of(self, label: str) -> str:
        """``http://<label>.localhost:<port>`` with subdomains, else the hub's own address."""
        return f"http://{label}.localhost:{self.port}" if self.subdomains else self.url

    def user_url(self, name: str, server: str = "") -> str:
        """The base URL of `name`'s server (``…/user/<name>/[<server>/]``)."""
        from jupyterhub.utils import subdomain_hook_idna

        # the hub's own escaping of names in URLs (jupyterhub.utils.url_escape_path)
        path, srv = (urllib.parse.quote(n, safe="@~") for n in (name, server))
        host = (f"http://{subdomain_hook_idna(name, 'localhost', 'user')}:{self.port}"
                if self.subdomains else self.url)
        return f"{host}/user/{path}/{srv + '/' if srv else ''}"

    @property
    def service_url(self) -> str:
        """The gpulab service's base URL (``…/services/gpulab/``)."""
        return self.host_of("gpulab--service") + "/services/gpulab/"

    def start(self, timeout: float = 60):
        self.log = open(self.data_dir.parent / f"up-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [GPULAB, "up", "--data-dir", str(self.data_dir), "--port", str(self.port),
             "--hub-port", str(self.hub_port), "--proxy-api-port", str(self.api_port),
             "--service-port", str(self.service_port),
             *self.extra],
            stdout=self.log, stderr=subprocess.STDOUT,
            # an input that is not /dev/null, as a terminal is: nothing started by the hub
            # may read it (tests/app/test_local_hub.py)
            stdin=subprocess.PIPE,
        )
        try:
            return self._wait_ready(timeout)
        except BaseException:
            # a hub that did not answer in time is stopped here: the fixture that failed
            # never stops it, and its folder goes with the test's
            self.stop()
            raise

    def _wait_ready(self, timeout: float):
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"gpulab up exited {self.proc.returncode}: {self.output()[-3000:]}")
            try:
                # the hub, and the gpulab service behind it, both answer
                if (requests.get(self.url + "/hub/api/", timeout=2).ok and requests.get(
                        self.service_api + "openapi.json", timeout=2).ok):
                    return self
            except (requests.ConnectionError, requests.Timeout):
                pass  # not listening yet, or too busy starting to answer within 2 s
            time.sleep(0.3)
        raise TimeoutError(self.output()[-3000:])

    @property
    def service_api(self) -> str:
        return self.service_url + "api/v1/"

    def output(self) -> str:
        return (self.data_dir.parent / f"up-{self.port}.log").read_text(errors="replace")

    def stop(self, sig=signal.SIGINT, timeout: float = 60):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc and self.proc.stdin:
            self.proc.stdin.close()
        self.log.close()

    @property
    def admin_password(self) -> str:
        return (self.data_dir / "admin_password").read_text().strip()


class SourceAddress(requests.adapters.HTTPAdapter):
    """Connections from a loopback address of its own (any of 127.0.0.0/8 on Linux), so that
    the proxy, and the hub behind it, see a client of another address."""

    def __init__(self, ip: str):
        self.ip = ip
        super().__init__()

    def init_poolmanager(self, *args, **kwargs):
        kwargs["source_address"] = (self.ip, 0)
        super().init_poolmanager(*args, **kwargs)


_return_ok_domain = http.cookiejar.DefaultCookiePolicy.return_ok_domain


def _localhost_cookies(policy, cookie, request):
    """Cookies as a browser keeps them: one set for ``Domain=localhost`` (JupyterHub's session
    cookie with subdomains) goes back to ``localhost`` and to ``*.localhost``, which Python's
    policy (it files hosts without a dot under ``<host>.local``) never sends back. Patched
    on the class: requests copies a session's cookies into a jar of the default policy."""
    host = urllib.parse.urlsplit(request.get_full_url()).hostname or ""
    if cookie.domain == ".localhost" and ("." + host).endswith(".localhost"):
        return True
    return _return_ok_domain(policy, cookie, request)


http.cookiejar.DefaultCookiePolicy.return_ok_domain = _localhost_cookies


class Browser:
    """A requests session that behaves like a logged-in browser (cookies + xsrf); with
    `source`, its connections come from that loopback address (`SourceAddress`)."""

    def __init__(self, hub: Hub, name: str, source: str | None = None):
        self.hub, self.name, self.s = hub, name, requests.Session()
        if source:
            self.s.mount("http://", SourceAddress(source))

    def _xsrf(self) -> str:
        if "_xsrf" not in self.s.cookies:
            self.s.get(self.hub.url + "/hub/login")
        return self.s.cookies.get("_xsrf", path="/hub/") or self.s.cookies.get("_xsrf")

    def post_form(self, path, data, **kw):
        return self.s.post(self.hub.url + path, data={**data, "_xsrf": self._xsrf()}, **kw)

    def signup(self, password):
        return self.post_form("/hub/signup", {"username": self.name, "signup_password": password,
                                              "signup_password_confirmation": password})

    def login(self, password):
        r = self.post_form("/hub/login", {"username": self.name, "password": password},
                           allow_redirects=False)
        assert r.status_code == 302, (r.status_code, r.text[:500])
        return r

    def approve(self, name, action="approve", **kw):
        """As an admin: approve `name`'s sign-up (``action="withdraw"``: withdraw it) as the
        Authorize button of /hub/authorize does, a form POST with the hub's XSRF token."""
        return self.post_form(f"/hub/authorize/{name}", {"action": action}, **kw)

    def api(self, method, path, **kw):
        headers = {"X-XSRFToken": self._xsrf(), **kw.pop("headers", {})}
        return self.s.request(method, self.hub.url + "/hub/api" + path, headers=headers, **kw)

    def start_server(self, server="", options=None, wait=True):
        r = self.api("POST", f"/users/{self.name}/servers/{server}", json=options or {})
        if r.status_code >= 400 or not wait:
            return r
        self.wait_ready(server)
        return r

    def wait_ready(self, server="", timeout=90):
        deadline = time.time() + timeout
        while time.time() < deadline:
            info = self.api("GET", f"/users/{self.name}").json()
            srv = info.get("servers", {}).get(server)
            if srv and srv.get("ready"):
                return srv
            time.sleep(0.5)
        raise TimeoutError(f"server {self.name}/{server} not ready")

    def stop_server(self, server=""):
        r = self.api("DELETE", f"/users/{self.name}/servers/{server}")
        assert r.status_code in (202, 204), r.text
        deadline = time.time() + 60
        while time.time() < deadline:
            info = self.api("GET", f"/users/{self.name}").json()
            if server not in info.get("servers", {}):
                return
            time.sleep(0.5)
        raise TimeoutError("server did not stop")

    def token(self) -> str:
        if not hasattr(self, "_token"):
            r = self.api("POST", f"/users/{self.name}/tokens", json={"note": "tests"})
            assert r.status_code == 201, r.text
            self._token = r.json()["token"]
        return self._token

    def service(self, method, path, token=None, **kw):
        """A request to the gpulab service's API with this person's token (or `token`)."""
        headers = {"Authorization": f"token {token or self.token()}", **kw.pop("headers", {})}
        return requests.request(method, self.hub.service_api + path, headers=headers, **kw)

    def run_in_kernel(self, code: str, server="", timeout=60) -> str:
        """Run `code` in a new kernel of the server; return what it printed."""
        base = self.hub.user_url(self.name, server)
        h = {"Authorization": f"token {self.token()}"}
        k = requests.post(base + "api/kernels", headers=h, json={"name": "python3"})
        assert k.status_code == 201, (k.status_code, k.text)
        kid = k.json()["id"]
        ws = websocket.create_connection(
            base.replace("http", "ws", 1) + f"api/kernels/{kid}/channels",
            header=[f"Authorization: token {self.token()}"], timeout=timeout)
        msg_id = uuid.uuid4().hex
        ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": "execute_request", "username": "t",
                       "session": uuid.uuid4().hex, "version": "5.3"},
            "parent_header": {}, "metadata": {}, "channel": "shell",
            "content": {"code": code, "silent": False, "store_history": False,
                        "user_expressions": {}, "allow_stdin": False},
        }))
        out, deadline = [], time.time() + timeout
        try:
            while time.time() < deadline:
                m = json.loads(ws.recv())
                if m.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                t = m["msg_type"]
                if t == "stream":
                    out.append(m["content"]["text"])
                elif t == "error":
                    raise AssertionError("kernel error: " + "\n".join(m["content"]["traceback"]))
                elif t == "status" and m["content"]["execution_state"] == "idle":
                    return "".join(out)
        finally:
            ws.close()
            requests.delete(base + f"api/kernels/{kid}", headers=h)
        raise TimeoutError("kernel did not answer")

