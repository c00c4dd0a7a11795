"""The client and the ``gpulab`` command given only the hub's address, on a hub with services
on hosts of their own (``gpulab up --subdomain-host``): they find the service on JupyterHub's
host for it, ``gpulab--service.<hub host>``, and reach ``*.localhost`` names on loopback
without the process's resolver knowing them (extensions/client.py)."""

import json
import os
import socket
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gpulab.extensions import client as client_mod
from gpulab.extensions.client import Client, GpulabError, is_loopback_name, service_host
from tests.app import hubctl

GPULAB = str(Path(sys.executable).with_name("gpulab"))
HTML = b"<!DOCTYPE HTML><html><body>404 Not Found</body></html>"


class SubdomainHub:
    """The proxy and hub of ``gpulab up --subdomain-host http://localhost:<port>`` as they
    answer (checked against a real one): on the hub's host, a GET of ``/services/…`` is
    redirected to ``http://localhost:<port>/hub/services/…`` and a POST refused with a page;
    on ``gpulab--service.localhost:<port>`` the service answers JSON. With `subdomains`
    False, the service is at ``/services/gpulab/`` on every host (the default layout).
    Every request is recorded as (method, host, path, token)."""

    def __init__(self, subdomains: bool = True, hub_host: str = "localhost"):
        self.requests: list[tuple] = []
        self.jobs: list[str] = []
        hub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, status, body=b"", ctype="text/html", location=None):
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                if location:
                    self.send_header("Location", location)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _answer(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                host = self.headers.get("Host", "")
                token = self.headers.get("Authorization", "").removeprefix("token ")
                hub.requests.append((self.command, host.split(":")[0], self.path, token))
                service = host.startswith("gpulab--service.") or not subdomains
                if self.path.startswith("/services/gpulab/") and not service:
                    if self.command == "GET":
                        return self._send(302, location=f"http://{hub_host}:{hub.port}/hub"
                                          + self.path)
                    return self._send(403, HTML)  # the hub's XSRF check of a POST, as a page
                if not self.path.startswith("/services/gpulab/api/v1/"):
                    return self._send(404, HTML)
                path = self.path[len("/services/gpulab/api/v1/"):]
                if path == "me":
                    out, status = {"user": "ann", "quota_text": "2 GPUs", "holdings": []}, 200
                elif path == "jobs" and self.command == "POST":
                    hub.jobs.append(body["name"])
                    out, status = {"name": body["name"], "state": "Queued"}, 202
                elif path == "jobs":
                    out, status = {"jobs": [{"name": n} for n in hub.jobs]}, 200
                else:
                    out, status = {"status": 404, "message": "You have no job named 'x'."}, 404
                self._send(status, json.dumps(out).encode(), "application/json")

            do_GET = do_POST = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.url = f"http://localhost:{self.port}"
        self.service = f"http://gpulab--service.localhost:{self.port}/services/gpulab/"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def seen(self):
        return [(m, h, p) for m, h, p, _ in self.requests]


@pytest.fixture
def real_resolver(monkeypatch):
    """This process's resolver as the system's (the tests' hub helpers teach it
    ``*.localhost``); the client must reach those names without it."""
    monkeypatch.setattr(socket, "getaddrinfo", hubctl._getaddrinfo)
    for name in ("GPULAB_URL", "GPULAB_TOKEN", "GPULAB_SERVICE_URL", "JUPYTERHUB_API_TOKEN",
                 "JUPYTERHUB_PUBLIC_HUB_URL"):
        monkeypatch.delenv(name, raising=False)
    try:
        socket.getaddrinfo("gpulab--service.localhost", 80)
    except socket.gaierror:
        return
    pytest.skip("this machine's resolver knows *.localhost: nothing to show")


@pytest.fixture
def hub(real_resolver):
    h = SubdomainHub()
    yield h
    h.server.shutdown()


def test_the_services_host_is_jupyterhubs():
    from jupyterhub.utils import subdomain_hook_idna

    from gpulab.hub.service import SERVICE_NAME

    assert client_mod.SERVICE_NAME == SERVICE_NAME
    assert service_host("localhost") == subdomain_hook_idna(SERVICE_NAME, "localhost", "service")
    assert service_host("lab.example.org") == "gpulab--service.lab.example.org"


@pytest.mark.parametrize("name, loopback", [
    ("localhost", True), ("gpulab--service.localhost", True), ("ann.LOCALHOST.", True),
    ("localhost.example.org", False), ("mylocalhost", False), ("127.0.0.1", False),
    ("lab.example.org", False), ("", False)])
def test_only_localhost_and_its_subdomains_are_loopback(name, loopback):
    assert is_loopback_name(name) is loopback


def test_the_client_finds_the_service_on_its_own_host(hub):
    gl = Client(hub_url=hub.url, token="tok")
    assert gl.me()["quota_text"] == "2 GPUs"
    assert gl.url == hub.service
    assert hub.seen() == [("GET", "localhost", "/services/gpulab/api/v1/me"),
                          ("GET", "gpulab--service.localhost", "/services/gpulab/api/v1/me")]
    assert socket.getaddrinfo is hubctl._getaddrinfo  # the process's resolver is untouched
    with pytest.raises(socket.gaierror):
        socket.getaddrinfo("gpulab--service.localhost", hub.port)

    # remembered for the process: a new client goes straight there
    again = Client(hub_url=hub.url, token="tok")
    assert again.jobs() == []
    assert hub.seen()[2:] == [("GET", "gpulab--service.localhost", "/services/gpulab/api/v1/jobs")]
    # the service's own 404 is its answer, not "not here"
    with pytest.raises(GpulabError, match="no job named 'x'") as e:
        again.job("x").status()
    assert e.value.status == 404


def test_a_first_post_is_sent_once_to_the_service(hub):
    gl = Client(hub_url=hub.url, token="tok")
    job = gl.submit({"name": "digits", "strategy": "single", "replicas": {"worker": 1},
                     "source": "print(1)"})
    assert job.view["state"] == "Queued" and hub.jobs == ["digits"]
    assert [r for r in hub.requests if r[0] == "POST"][-1][1] == "gpulab--service.localhost"
    # the question that found it (a GET of the service's path on the hub) carried no token
    probes = [r for r in hub.requests if r[:2] == ("GET", "localhost")]
    assert probes and all(token == "" for *_, token in probes)


def test_the_hub_by_its_address_is_enough(hub):
    """``--url http://127.0.0.1:<port>``: the hub's redirect names its host."""
    gl = Client(hub_url=f"http://127.0.0.1:{hub.port}/", token="tok")
    assert gl.me()["user"] == "ann"
    assert gl.url == hub.service


def test_gpulab_service_url_wins(hub, monkeypatch):
    monkeypatch.setenv("GPULAB_SERVICE_URL", hub.url + "/services/gpulab/")
    monkeypatch.setenv("GPULAB_URL", hub.url)
    gl = Client(token="tok")
    assert gl.url == hub.url + "/services/gpulab/"
    with pytest.raises(GpulabError):
        gl.me()
    assert all(h == "localhost" for _, h, _ in hub.seen())  # never looked elsewhere


def test_gpulab_url_is_enough(hub, monkeypatch):
    monkeypatch.setenv("GPULAB_URL", hub.url)
    assert Client(token="tok").me()["user"] == "ann"


def test_the_default_layout_asks_once(real_resolver):
    h = SubdomainHub(subdomains=False)
    try:
        gl = Client(hub_url=h.url, token="tok")
        assert gl.me()["user"] == "ann"
        assert gl.url == h.url + "/services/gpulab/"
        assert h.seen() == [("GET", "localhost", "/services/gpulab/api/v1/me")]
    finally:
        h.server.shutdown()


@pytest.mark.parametrize("hub_host", ["localhost", "127.0.0.1"])
def test_the_gpulab_command_with_only_the_hubs_url(hub, hub_host):
    """A fresh process, as a person runs it: its resolver does not know *.localhost."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GPULAB_", "JUPYTERHUB_"))}
    url = f"http://{hub_host}:{hub.port}"
    hub.jobs.append("mnist")
    out = subprocess.run([GPULAB, "jobs", "list", "--url", url, "--token", "tok", "--json"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "mnist" in out.stdout
    out = subprocess.run([GPULAB, "quota", "show", "--url", url, "--token", "tok", "--json"],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["quota_text"] == "2 GPUs"


def test_service_url_finds_the_service_for_links(hub):
    assert Client(hub_url=hub.url, token="tok").service_url() == hub.service


class Redirector:
    """A front that sends every request elsewhere (a hub that moved, e.g. to ``https``)."""

    def __init__(self, to: str):
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                self.send_response(301)
                self.send_header("Location", to + self.path)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://localhost:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()


def test_a_redirect_elsewhere_than_the_hubs_pages_is_followed(real_resolver):
    h = SubdomainHub(subdomains=False)
    front = Redirector(h.url)
    try:
        gl = Client(hub_url=front.url, token="tok")
        assert gl.me()["user"] == "ann" and gl.url == h.url + "/services/gpulab/"
    finally:
        front.server.shutdown()
        h.server.shutdown()


def test_a_service_host_that_cannot_be_reached_is_said_with_what_to_do(real_resolver):
    """A hub on a name without a wildcard DNS record for its services' hosts: the error
    names the host tried and GPULAB_SERVICE_URL."""
    h = SubdomainHub(hub_host="lab.invalid")
    try:
        with pytest.raises(GpulabError) as e:
            Client(hub_url=f"http://127.0.0.1:{h.port}", token="tok").me()
        assert e.value.kind == "elsewhere"
        assert f"http://gpulab--service.lab.invalid:{h.port}/services/gpulab/" in str(e.value)
        assert "GPULAB_SERVICE_URL" in str(e.value)
        assert not h.jobs and all(host == "127.0.0.1" for _, host, _ in h.seen())
        # the command says the same
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("GPULAB_", "JUPYTERHUB_"))}
        out = subprocess.run([GPULAB, "quota", "show", "--url", f"http://127.0.0.1:{h.port}",
                              "--token", "tok"], env=env, capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 1 and "Traceback" not in out.stderr
        assert "gpulab--service.lab.invalid" in out.stderr
        assert "GPULAB_SERVICE_URL" in out.stderr
    finally:
        h.server.shutdown()


def test_over_https_the_certificate_is_checked_for_the_name_asked(real_resolver, tmp_path):
    """``https://gpulab--service.localhost``: connected on loopback, the certificate still
    checked against that name (not the address), before the token is sent."""
    import ssl
    import shutil

    if not shutil.which("openssl"):
        pytest.skip("no openssl to make a certificate")
    cert, key = tmp_path / "c.pem", tmp_path / "k.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=gpulab--service.localhost", "-keyout", str(key),
                    "-out", str(cert), "-addext", "subjectAltName=DNS:gpulab--service.localhost"],
                   check=True, capture_output=True)
    h = SubdomainHub()
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    h.server.socket = ctx.wrap_socket(h.server.socket, server_side=True)
    try:
        url = f"https://gpulab--service.localhost:{h.port}/services/gpulab/"
        gl = Client(url, token="tok", ca_file=str(cert))
        assert gl.me()["user"] == "ann"
        assert h.requests[-1][3] == "tok"
        n = len(h.requests)
        other = Client(f"https://ann.localhost:{h.port}/services/gpulab/", token="tok",
                       ca_file=str(cert))
        with pytest.raises(GpulabError) as e:
            other.me()
        assert e.value.kind == "unreachable" and "certificate" in str(e.value).lower()
        assert len(h.requests) == n  # the token was never sent
    finally:
        h.server.shutdown()
