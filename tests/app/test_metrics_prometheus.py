"""A real Prometheus (Debian's ``prometheus``, started here on loopback with a scrape every
second) scrapes a real `gpulab up`: the gpulab service's ``/services/gpulab/metrics`` and the
hub's ``/hub/metrics`` with a token of the scope ``read:metrics``, and the service again with
a person's plain token and with a wrong one. While jobs and notebook servers run and wait,
the query behind each panel of the Grafana dashboard (helm-values/grafana/) gives the series
it should through Prometheus' HTTP API; the scrapes with the other tokens get nothing.

The GPUs here are simulated: nothing measures their usage, so the usage panels' queries run
and come back empty while ``gpulab_gpu_held_info{measured="false"}`` says why."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import requests

from tests.app.hubctl import free_port

from .test_jobs_api import SLEEPER, mw, wait_state

pytestmark = pytest.mark.app

DASHBOARD = Path(__file__).resolve().parents[2] / "helm-values" / "grafana" / "gpulab-dashboard.json"
#: what the dashboard's Grafana variables stand for in these queries
VARIABLES = {"$__rate_interval": "10s", "$__range_s": "60", "$__range": "1m", "$user": ".*",
             "$model": ".*"}


class Prometheus:
    """Debian's Prometheus on a loopback port, its storage in a temporary folder."""

    def __init__(self, scrape_configs: list[dict]):
        self.dir = Path(tempfile.mkdtemp(prefix="gpulab-prom-"))
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {"global": {"scrape_interval": "1s", "scrape_timeout": "1s",
                             "evaluation_interval": "1s"},
                  "scrape_configs": scrape_configs}
        self.config = self.dir / "prometheus.yml"
        self.config.write_text(json.dumps(config))  # JSON is YAML
        self.config.chmod(0o600)  # it holds tokens
        self.log = open(self.dir / "prometheus.log", "wb")
        binary = shutil.which("prometheus")
        assert binary, "Debian's prometheus is missing: scripts/test.sh installs it"
        self.proc = subprocess.Popen(
            [binary, f"--config.file={self.config}", f"--storage.tsdb.path={self.dir / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.output()
            try:
                if requests.get(self.url + "/-/ready", timeout=1).ok:
                    return
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        raise TimeoutError(self.output())

    def output(self) -> str:
        return (self.dir / "prometheus.log").read_text(errors="replace")[-3000:]

    def query(self, expr: str) -> list[dict]:
        r = requests.get(self.url + "/api/v1/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


class LoopbackNames:
    """What a DNS record does for a real deployment's Prometheus: with subdomains the service
    answers on a host of its own (``gpulab--service.localhost``), which browsers and Python's
    client map to loopback but Prometheus' resolver does not. Prometheus is given this as its
    ``proxy_url``: a forward proxy, on loopback, that sends each request to the hub's port
    with the request's own Host (so routing, tokens and answers are the hub's, unchanged)."""

    def __init__(self, hub_port: int):
        import http.server
        import threading
        import urllib.parse

        class Forward(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # Prometheus asks "GET http://host:port/path" of its proxy
                url = urllib.parse.urlsplit(self.path)
                if not (url.hostname == "localhost" or
                        (url.hostname or "").endswith(".localhost")):
                    self.send_error(403, "only *.localhost names")
                    return
                path = url.path + (f"?{url.query}" if url.query else "")
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("proxy-connection", "connection")}
                try:
                    r = requests.get(f"http://127.0.0.1:{hub_port}{path}", headers=headers,
                                     timeout=10, allow_redirects=False)
                except requests.RequestException as e:
                    self.send_error(502, str(e))
                    return
                body = r.content
                self.send_response(r.status_code)
                for k, v in r.headers.items():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection",
                                         "content-encoding"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forward)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


def scrape(job: str, path: str, hub, token: str, proxy: LoopbackNames | None = None) -> dict:
    """A scrape job of `path` on the host that serves it: the service's own host with
    subdomains (reached through `proxy`), the hub's otherwise."""
    base = hub.service_url if path.startswith("/services/") else hub.url
    config = {"job_name": job, "metrics_path": path,
              "authorization": {"type": "Bearer", "credentials": token},
              "static_configs": [{"targets": [base.split("://", 1)[1].split("/", 1)[0]]}]}
    if proxy is not None and hub.subdomains:
        config["proxy_url"] = proxy.url
    return config


def panel_queries() -> list[tuple[str, str]]:
    out = []
    for p in json.loads(DASHBOARD.read_text())["panels"]:
        for t in p.get("targets", []):
            expr = t["expr"]
            for var, value in VARIABLES.items():
                expr = expr.replace(var, value)
            out.append((p["title"], expr))
    return out


def labels(result: list[dict], name: str) -> set:
    return {r["metric"].get(name) for r in result}


def values(result: list[dict], **match) -> list[float]:
    return [float(r["value"][1]) for r in result
            if all(r["metric"].get(k) == v for k, v in match.items())]


#: what each panel's query must show here (a test of its result), by panel title; one
#: panel's second query is "<title> #2"
EXPECTED = {
    "GPUs by state": lambda r: labels(r, "state") == {"held", "draining", "free"}
    and values(r, state="held") == [3.0] and values(r, state="free") == [1.0],
    "Share of the pool in use": lambda r: [round(v, 2) for v in values(r)] == [0.75],
    "Waiting in the GPU queue": lambda r: values(r, kind="job") == [1.0]
    and values(r, kind="notebook") == [1.0],
    "Waiting in the GPU queue #2": lambda r: values(r, kind="job") == [4.0]
    and values(r, kind="notebook") == [1.0],
    "Longest wait now": lambda r: values(r, kind="job")[0] > 0,
    # nothing has started through the queue yet: every bucket is there, at 0
    "Queue wait times": lambda r: "+Inf" in labels(r, "le") and set(values(r)) == {0.0},
    "Wait time, 90th percentile": lambda r: labels(r, "kind") == {"job", "notebook"}
    and all(math.isnan(v) for v in values(r)),
    # the counters, from both endpoints: the hub counts notebook servers, the service jobs
    "Admissions": lambda r: {("job", "now"), ("job", "queued"), ("notebook", "now"),
                             ("notebook", "queued")}
    <= {(m["metric"].get("kind"), m["metric"].get("how")) for m in r},
    "Refusals by reason": lambda r: {("job", "never_fits"), ("notebook", "line_ahead")} <= {
        (m["metric"].get("kind"), m["metric"].get("reason")) for m in r},
    "Jobs by state": lambda r: "Queued" in labels(r, "state")
    and labels(r, "state") & {"Pending", "Starting", "Running"},
    "Job outcomes and restarts": lambda r: "Stopped" in labels(r, "state"),
    "Job outcomes and restarts #2": lambda r: values(r) == [0.0],
    "GPUs held per person": lambda r: values(r, user="ann") == [2.0]
    and values(r, user="bob") == [1.0] and "carl" not in labels(r, "user"),
    "GPUs held per group": lambda r: values(r, group="gpulab-metrics-vision") == [3.0],
    "GPU-hours in the time range": lambda r: {"ann", "bob"} <= labels(r, "user")
    and all(0 < v < 1 for v in values(r)),
    "GPU-hour budgets used": lambda r: labels(r, "user") == {"ann"}
    and 0 < values(r, user="ann")[0] < 0.01,
    # simulated GPUs: no usage to read, and the panel that says which
    "Utilisation of held GPUs": lambda r: r == [],
    "Memory of held GPUs": lambda r: r == [],
    "Idle held GPUs": lambda r: r == [],
    "Held GPUs without a usage reading": lambda r: {
        (m["metric"]["user"], m["metric"]["kind"], m["metric"]["holder"], m["value"][1])
        for m in r} == {("ann", "job", "held", "2"), ("bob", "notebook", "gpu", "1")},
}


def wait_for(test, what: str, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while True:
        last = test()
        if last:
            return last
        assert time.monotonic() < deadline, f"{what}: not seen in {timeout} s"
        time.sleep(0.3)


def test_prometheus_scrapes_what_the_dashboard_shows_and_wrong_tokens_get_nothing(
        hub, admin, users):
    ann, bob, carl = users["ann"], users["bob"], users["carl"]
    # a token of the scope read:metrics alone (what a Prometheus gets)
    r = admin.api("POST", "/users/admin/tokens", json={"scopes": ["read:metrics"],
                                                       "note": "prometheus"})
    assert r.status_code == 201, r.text
    metrics_token = r.json()["token"]
    metrics = hub.service_url + "metrics"

    # the endpoint's own answers: no token 401, a wrong one 401, a person's 403; no series
    for token, status in ((None, 401), ("not-a-token", 401), (ann.token(), 403)):
        got = requests.get(metrics, headers={"Authorization": f"Bearer {token}"} if token
                           else {}, timeout=30)
        assert got.status_code == status, (token, got.status_code, got.text)
        assert "gpulab_" not in got.text and got.json()["status"] == status
    assert requests.get(metrics, headers={"Authorization": f"Bearer {metrics_token}"},
                        timeout=30).status_code == 200

    # the world the panels should show: a group, a budget, work that runs, waits, is refused
    assert admin.api("POST", "/groups/gpulab-metrics-vision",
                     json={"users": ["ann", "bob"]}).status_code == 201
    assert admin.service("PUT", "quotas/users/ann", json={
        "max_gpus": 4, "gpu_hours": 100, "window_hours": 24}).status_code == 200
    r = ann.service("POST", "jobs", json=mw("held", workers=2, gpus=1, source=SLEEPER))
    assert r.status_code == 201, r.text
    # the hub answers a start when the server is up or after its slow_spawn_timeout (10 s):
    # the starts are asked in threads, and the test goes on once the ledger has them
    starts = ThreadPoolExecutor(2)
    bobs = starts.submit(bob.start_server, "gpu", {"profile": "gpu-1"}, wait=False)
    wait_for(lambda: any(h["kind"] == "notebook" for h in
                         bob.service("GET", "me").json()["holdings"]), "bob's notebook GPUs")
    r = carl.service("POST", "jobs", json=mw("big", workers=2, gpus=2, source=SLEEPER))
    assert r.status_code == 202 and r.json()["state"] == "Queued", r.text
    # a notebook server that waits in line behind carl's job
    carls = starts.submit(carl.start_server, "waits", {"profile": "gpu-1",
                                                       "gpu_wait_minutes": 5}, wait=False)
    wait_for(lambda: [e["holder"] for e in carl.service("GET", "queue").json()["entries"]
                      if e["kind"] == "notebook"] == ["waits"], "carl's notebook in line")
    r = ann.service("POST", "jobs", json=mw("huge", workers=5, gpus=1, source=SLEEPER))
    assert r.status_code == 409, r.text
    # a server that may not wait, while others wait: refused (counted by the hub)
    r = bob.start_server("now", {"profile": "gpu-1"})
    assert r.status_code == 409, r.text
    r = bob.service("POST", "jobs", json=mw("gone", workers=1, gpus=1, source=SLEEPER))
    assert r.status_code == 202 and r.json()["state"] == "Queued", r.text
    assert bob.service("POST", "jobs/gone/stop").status_code == 200

    names = LoopbackNames(hub.port)
    prom = Prometheus([
        scrape("gpulab", "/services/gpulab/metrics", hub, metrics_token, names),
        scrape("jupyterhub", "/hub/metrics", hub, metrics_token, names),
        scrape("gpulab-person", "/services/gpulab/metrics", hub, ann.token(), names),
        scrape("gpulab-wrong", "/services/gpulab/metrics", hub, "not-a-token", names),
    ])
    try:
        # every target scraped a few times (the rates need two samples in their range)
        wait_for(lambda: (ups := prom.query("count_over_time(up[1m])")) and {
            r["metric"]["job"] for r in ups if float(r["value"][1]) >= 3} == {
            "gpulab", "jupyterhub", "gpulab-person", "gpulab-wrong"}, "three scrapes each")
        up = {r["metric"]["job"]: r["value"][1] for r in prom.query("up")}
        assert up == {"gpulab": "1", "jupyterhub": "1", "gpulab-person": "0",
                      "gpulab-wrong": "0"}, up
        # the scrapes with a person's token and a wrong one stored no series at all
        assert prom.query('count by (job) ({job=~"gpulab-person|gpulab-wrong", '
                          '__name__=~"gpulab_.*"})') == []

        seen: dict[str, int] = {}
        for title, expr in panel_queries():
            n = seen[title] = seen.get(title, 0) + 1
            key = title if n == 1 else f"{title} #{n}"
            check = EXPECTED[key]
            last = []

            def ok():
                last[:] = prom.query(expr)
                return check(last)

            try:
                wait_for(ok, key, timeout=15)
            except AssertionError:
                raise AssertionError(f"panel {key!r}: {expr}\ngave {last}") from None
        assert set(EXPECTED) == {k for k in EXPECTED if k.split(" #")[0] in seen}
        # the hub's answers to the two starts: bob's started (or is starting), carl's waits
        assert bobs.result().status_code in (201, 202), bobs.result().text
        assert carls.result().status_code == 202, carls.result().text
    finally:
        prom.stop()
        names.close()
        starts.shutdown()
        ann.service("POST", "jobs/held/stop")
        carl.service("POST", "jobs/big/stop")
        for person, server in ((bob, "gpu"), (bob, "now"), (carl, "waits")):
            person.api("DELETE", f"/users/{person.name}/servers/{server}",
                       json={"remove": True})
