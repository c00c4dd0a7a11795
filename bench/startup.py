"""Start-up to the login page and Ctrl-C of `gpulab up`, against a bare `jupyterhub`.

Both are started the same way (a process with the same configurable-http-proxy, the hub and
proxy ports, a fresh data folder per round) and stopped the same way (SIGINT, as Ctrl-C
sends); the baseline is JupyterHub's stock LocalProcessSpawner running servers as the hub's
own account, so gpulab runs with ``--no-isolation`` too (as bench/spawn.py does).

    python bench/startup.py [--rounds 3]

Each round, for each of the two:
  first start   process start to ``/hub/login`` answering 200, on an empty data folder
                (gpulab: database migrations, the admin account, internal TLS certificates)
  Ctrl-C, 0     SIGINT to the process's exit, no server running
  restart       start-up again on the same data folder (the common case)
  Ctrl-C, 2     SIGINT to exit with two running servers (of two people)

Prints the median and range of each, and gpulab's ratio to the baseline's median. Rounds
alternate the two so that drift on the machine hits both alike.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.app.hubctl import GPULAB, free_port  # noqa: E402

TOKEN = secrets.token_hex(16)

#: the bench's own admin token, as a service of the hub (both hubs)
BENCH_SERVICE = f'''
c.JupyterHub.services = [{{"name": "bench", "api_token": {TOKEN!r}}}]
c.JupyterHub.load_roles = [{{"name": "bench", "services": ["bench"],
                            "scopes": ["admin:users", "admin:servers", "read:users"]}}]
'''

STOCK_CONFIG = '''
import os, sys
from jupyterhub.spawner import LocalProcessSpawner

class StockSpawner(LocalProcessSpawner):
    """JupyterHub's LocalProcessSpawner, running servers as the hub's account."""
    def make_preexec_fn(self, name):
        return None
    def user_env(self, env):
        env["HOME"] = os.path.join({homes!r}, self.user.name)
        os.makedirs(env["HOME"], exist_ok=True)
        return env

c.JupyterHub.spawner_class = StockSpawner
c.JupyterHub.authenticator_class = "dummy"
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
c.Spawner.popen_kwargs = {{"stdin": __import__("subprocess").DEVNULL}}
if os.geteuid() == 0:
    c.Spawner.args = ["--ServerApp.allow_root=True"]
c.JupyterHub.ip = "127.0.0.1"
c.JupyterHub.port = {port}
c.JupyterHub.hub_port = {hub_port}
c.ConfigurableHTTPProxy.api_url = "http://127.0.0.1:{api_port}"
c.ConfigurableHTTPProxy.command = [{chp!r}]
c.JupyterHub.db_url = "sqlite:///{data}/jupyterhub.sqlite"
c.JupyterHub.cookie_secret_file = "{data}/cookie_secret"
c.ConfigurableHTTPProxy.pid_file = "{data}/proxy.pid"
'''


class Run:
    """One hub: ``gpulab`` (`gpulab up`) or ``stock`` (a bare `jupyterhub`)."""

    def __init__(self, kind: str):
        self.kind = kind
        self.dir = Path(tempfile.mkdtemp(prefix=f"gpulab-bench-up-{kind}-"))
        os.chmod(self.dir, 0o711)
        self.data = self.dir / "data"
        self.data.mkdir(mode=0o711)
        self.port, self.hub_port, self.api_port = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = None
        chp = shutil.which("configurable-http-proxy", path=str(Path(sys.executable).parent)
                           + os.pathsep + os.environ.get("PATH", ""))
        if kind == "stock":
            (self.data / "jupyterhub_config.py").write_text(STOCK_CONFIG.format(
                homes=str(self.data / "homes"), port=self.port, hub_port=self.hub_port,
                api_port=self.api_port, chp=chp, data=self.data) + BENCH_SERVICE)
            self.argv = [str(Path(sys.executable).with_name("jupyterhub")), "-f",
                         str(self.data / "jupyterhub_config.py")]
        else:
            (self.data / "gpulab_config.py").write_text(BENCH_SERVICE)
            self.argv = [GPULAB, "up", "--data-dir", str(self.data), "--port", str(self.port),
                         "--hub-port", str(self.hub_port), "--proxy-api-port",
                         str(self.api_port), "--service-port", str(free_port()),
                         "--simulated-gpus", "2", "--no-isolation", "--idle-timeout", "0"]

    def start(self, timeout: float = 120) -> float:
        """Seconds from the process's start to the login page answering 200."""
        self.log = open(self.dir / "up.log", "ab")
        t0 = time.monotonic()
        self.proc = subprocess.Popen(self.argv, cwd=self.data, stdout=self.log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.PIPE)
        while time.monotonic() - t0 < timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.kind} exited {self.proc.returncode}: "
                                   f"{(self.dir / 'up.log').read_text()[-2000:]}")
            try:
                if requests.get(self.url + "/hub/login", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except requests.ConnectionError:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"{self.kind}: no login page after {timeout} s")

    def api(self, method: str, path: str, **kw):
        return requests.request(method, self.url + "/hub/api" + path,
                                headers={"Authorization": f"token {TOKEN}"}, timeout=30, **kw)

    def start_servers(self, names: list[str], timeout: float = 120) -> None:
        r = self.api("POST", "/users", json={"usernames": names})
        assert r.status_code in (201, 409), r.text
        for name in names:
            r = self.api("POST", f"/users/{name}/server", json={})
            assert r.status_code in (201, 202), r.text
        deadline = time.monotonic() + timeout
        for name in names:
            while True:
                server = self.api("GET", f"/users/{name}").json().get("servers", {}).get("")
                if server and server.get("ready"):
                    break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.kind}: {name}'s server not ready")
                time.sleep(0.2)

    def interrupt(self, timeout: float = 120) -> float:
        """Seconds from SIGINT (Ctrl-C) to the process's exit."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        took = time.monotonic() - t0
        self.proc.stdin.close()
        self.log.close()
        return took

    def cleanup(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


STEPS = ("first start", "Ctrl-C, 0 servers", "restart", "Ctrl-C, 2 servers")


def one_round(kind: str, round_no: int) -> dict[str, float]:
    run = Run(kind)
    try:
        out = {"first start": run.start()}
        out["Ctrl-C, 0 servers"] = run.interrupt()
        out["restart"] = run.start()
        run.start_servers([f"b{round_no}a", f"b{round_no}b"])
        out["Ctrl-C, 2 servers"] = run.interrupt()
        return out
    finally:
        run.cleanup()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    times: dict[str, dict[str, list[float]]] = {k: {s: [] for s in STEPS}
                                                for k in ("stock", "gpulab")}
    for r in range(args.rounds):
        for kind in (("stock", "gpulab") if r % 2 == 0 else ("gpulab", "stock")):
            got = one_round(kind, r)
            print(f"round {r + 1} {kind:6}: " + ", ".join(f"{s} {got[s]:.2f} s" for s in STEPS),
                  flush=True)
            for s in STEPS:
                times[kind][s].append(got[s])
    print(f"\n{'':20} {'jupyterhub (median, range)':>30} {'gpulab up (median, range)':>30} "
          f"{'ratio':>6}")
    for s in STEPS:
        cells = []
        for kind in ("stock", "gpulab"):
            v = times[kind][s]
            cells.append(f"{statistics.median(v):.2f} s ({min(v):.2f}-{max(v):.2f})")
        ratio = statistics.median(times["gpulab"][s]) / statistics.median(times["stock"][s])
        print(f"{s:20} {cells[0]:>30} {cells[1]:>30} {ratio:6.2f}")
    print(f"\n{args.rounds} rounds; {os.cpu_count()} CPUs; load average "
          f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
