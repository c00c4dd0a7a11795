"""Spawn time and hub memory: LocalGPUSpawner against JupyterHub's stock LocalProcessSpawner.

Both run under the same `gpulab up` hub (same proxy, same settings, same data layout); only the
spawner class differs. The stock configuration is JupyterHub's LocalProcessSpawner with the
same command, running servers as the hub's own account (as `--no-isolation` does for gpulab,
because the stock spawner would need a system account per user).

    python bench/spawn.py [--spawns 6] [--rounds 2] [--servers 20]

Prints the median time from spawn request to server ready for each, their ratio (goal <=
1.10), and the hub's resident memory with `--servers` running servers (goal ratio <= 1.15).
Rounds alternate the two configurations so that drift on the machine hits both alike.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil
import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.app.hubctl import Browser, Hub  # noqa: E402

STOCK_CONFIG = '''
import os, sys
from jupyterhub.spawner import LocalProcessSpawner

class StockSpawner(LocalProcessSpawner):
    """JupyterHub's LocalProcessSpawner, running servers as the hub's account."""
    def make_preexec_fn(self, name):
        return None
    async def move_certs(self, paths):
        return paths  # internal_ssl: servers run as the hub's account, which has them
    def user_env(self, env):
        env["HOME"] = os.path.join({homes!r}, self.user.name)
        os.makedirs(env["HOME"], exist_ok=True)
        return env

c.JupyterHub.spawner_class = StockSpawner
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
if os.geteuid() == 0:
    c.Spawner.args = ["--ServerApp.allow_root=True"]
'''


class Run:
    def __init__(self, kind: str, gpus: int):
        self.kind = kind
        self.dir = Path(tempfile.mkdtemp(prefix=f"gpulab-bench-{kind}-"))
        os.chmod(self.dir, 0o711)
        data = self.dir / "data"
        if kind == "stock":
            data.mkdir(mode=0o711)
            (data / "gpulab_config.py").write_text(STOCK_CONFIG.format(homes=str(data / "homes")))
        self.hub = Hub(data, "--simulated-gpus", str(gpus), "--no-isolation", "--idle-timeout", "0")
        self.options = {"profile": "gpu-1"} if kind == "gpulab" else {}

    def __enter__(self):
        self.hub.start()
        self.admin = Browser(self.hub, "admin")
        self.admin.login(self.hub.admin_password)
        return self

    def __exit__(self, *exc):
        self.hub.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def make_users(self, names):
        r = self.admin.api("POST", "/users", json={"usernames": names})
        assert r.status_code in (201, 409), r.text

    def spawn(self, name: str) -> float:
        t0 = time.perf_counter()
        r = self.admin.api("POST", f"/users/{name}/server", json=self.options)
        assert r.status_code in (201, 202), (self.kind, r.status_code, r.text)
        while True:
            info = self.admin.api("GET", f"/users/{name}").json()
            if info["servers"].get("", {}).get("ready"):
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > 120:
                raise TimeoutError(f"{self.kind}: {name} not ready")
            time.sleep(0.05)

    def stop(self, name: str) -> None:
        r = self.admin.api("DELETE", f"/users/{name}/server")
        assert r.status_code in (202, 204), r.text
        while self.admin.api("GET", f"/users/{name}").json()["servers"]:
            time.sleep(0.1)

    def hub_rss(self) -> int:
        return psutil.Process(self.hub.proc.pid).memory_info().rss


def spawn_times(kind: str, n: int) -> list[float]:
    with Run(kind, gpus=n) as run:
        names = [f"s{i:02d}" for i in range(n)]
        run.make_users(names)
        times = []
        for name in names:
            times.append(run.spawn(name))
            run.stop(name)
        return times


def memory(kind: str, servers: int) -> tuple[int, int]:
    with Run(kind, gpus=servers) as run:
        names = [f"m{i:02d}" for i in range(servers)]
        run.make_users(names)
        before = run.hub_rss()
        for name in names:
            run.spawn(name)
        time.sleep(3)  # let the hub settle (activity, proxy updates)
        return before, run.hub_rss()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spawns", type=int, default=6, help="spawns per configuration per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--servers", type=int, default=20, help="running servers for the memory figure")
    args = p.parse_args()

    times = {"gpulab": [], "stock": []}
    for r in range(args.rounds):
        for kind in (("gpulab", "stock") if r % 2 == 0 else ("stock", "gpulab")):
            t = spawn_times(kind, args.spawns)
            times[kind] += t
            print(f"round {r + 1} {kind:7s} spawn→ready: " + " ".join(f"{x:.2f}" for x in t), flush=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\nmedian spawn→ready  LocalGPUSpawner {med['gpulab']:.2f} s   "
          f"LocalProcessSpawner {med['stock']:.2f} s   ratio {med['gpulab'] / med['stock']:.3f} "
          "(goal <= 1.10)")

    mem = {k: memory(k, args.servers) for k in ("stock", "gpulab")}
    for k, (before, after) in mem.items():
        print(f"hub RSS {k:7s}: {before / 2**20:.0f} MiB idle, {after / 2**20:.0f} MiB with "
              f"{args.servers} servers")
    print(f"hub RSS ratio with {args.servers} servers: {mem['gpulab'][1] / mem['stock'][1]:.3f} "
          "(goal <= 1.15)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
