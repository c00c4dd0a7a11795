"""gpulab at organisation scale (issue 40): a spawn storm, many running servers, and the
service's pages and passes, LocalGPUSpawner against JupyterHub's stock LocalProcessSpawner.

Both configurations run under the same `gpulab up` (same proxy, culler, gpulab service and
settings, ``--no-isolation``); only the spawner class differs (bench/spawn.py's stock
configuration). Servers are stood in for by `bench/scale_standin.py`: one process answering
for every server (its URL, ``api``, ``api/status``, activity posted to the hub), each server
itself a ``sleep`` the spawner starts, polls and stops, so 1,000 of them fit beside the hub.

For each configuration, in a fresh hub:

1. ``--people`` hub users;
2. a storm: ``--storm`` spawns sent at once; each spawn's time from request to ready, the
   failed starts (refused, or not ready within ``--timeout``), the 429s the hub answered
   (JupyterHub's ``concurrent_spawn_limit``; retried after the time it asks);
3. more servers, ``--fill-window`` spawns in flight at a time, up to ``--servers`` running;
4. ``--rest`` seconds of steady activity: the idle culler looking every few seconds, the
   stand-in posting activity, the service's reconciler, and a ``--active-people`` share of
   the people reading ``me``, ``jobs`` and ``queue`` and submitting 1-GPU jobs that queue
   behind one job holding every GPU; the hub's, service's and proxy's CPU (percent of one
   core) and resident memory over it.

Then, in the gpulab run only (the service is the same for both spawners): the admin page
and My GPUs (first page) at ``--page-users`` hub users, and the service at ``--people``
users, the running servers and ``--past-allocations`` closed allocations in the ledger: its
RSS and one reconciler pass (the service's own `close_orphaned_notebooks`, with the hub
read as it reads it).

    python bench/scale.py                      # quick: 300 people, storm 200, 250 servers
    python bench/scale.py --people 2000 --servers 1000 --page-users 10000 \\
        --past-allocations 100000 --rest 120   # the issue's sizes (tens of minutes)
    python bench/scale.py --only-pages --page-users 10000 --past-allocations 100000
                                               # the service's figures alone (minutes)
    python bench/scale.py --kube ...           # bench/scale_kube.py (the Kubernetes half)

Goals (issue 40): storm 0 failed and p99 <= 1.2x stock's; hub CPU at rest <= 1.1x stock's;
service RSS < 250 MB and reconciler pass < 1 s at 2,000 users / 1,000 servers / 100,000
past allocations; admin page and My GPUs < 1 s at 10,000 users.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import requests

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from tests.app.hubctl import Browser, Hub  # noqa: E402

STOCK = '''
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
'''
#: both configurations: the stand-in's shim for a server
STANDIN = '''
c.Spawner.cmd = ["/bin/sh", {shim!r}]
c.Spawner.args = []
c.Spawner.environment = {{"SCALE_SPOOL": {spool!r}}}
c.Spawner.http_timeout = 120
c.Spawner.start_timeout = 300
'''

SLEEPER = "import time\ntime.sleep(3600)\n"


def pct(values, q):
    values = sorted(values)
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


class Run:
    def __init__(self, kind: str, args):
        self.kind, self.args = kind, args
        # not below /tmp: a server's private /tmp would hide the spool
        self.dir = Path(tempfile.mkdtemp(prefix=f"gpulab-scale-{kind}-", dir="/var/tmp"))
        os.chmod(self.dir, 0o711)
        self.spool = self.dir / "spool"
        self.spool.mkdir(mode=0o777)
        data = self.dir / "data"
        data.mkdir(mode=0o711)
        config = STANDIN.format(shim=str(self.spool / "shim.sh"), spool=str(self.spool))
        if kind == "stock":
            config = STOCK.format(homes=str(data / "homes")) + config
        (data / "gpulab_config.py").write_text(config)
        self.hub = Hub(data, "--simulated-gpus", "4", "--no-isolation",
                       "--idle-timeout", str(args.idle_timeout), "--cull-every", "10",
                       "--log-level", "WARN")
        self.standin = None

    def __enter__(self):
        self.standin = subprocess.Popen(
            [sys.executable, str(ROOT / "bench" / "scale_standin.py"), str(self.spool),
             "--activity-every", str(self.args.activity_every)],
            stdout=open(self.dir / "standin.log", "wb"), stderr=subprocess.STDOUT)
        try:
            self.hub.start(timeout=120)
            self.admin = Browser(self.hub, "admin")
            self.admin.login(self.hub.admin_password)
            self.token = self.admin.token()
        except BaseException:
            # `with` calls no __exit__ when __enter__ fails: the stand-in would go on
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc):
        self.hub.stop(timeout=300)
        if self.standin is not None:
            self.standin.terminate()
            self.standin.wait(30)
        if self.args.keep:
            print(f"  (kept {self.dir})")
        else:
            shutil.rmtree(self.dir, ignore_errors=True)

    def api(self, method, path, headers=None, **kw):
        return requests.request(method, self.hub.url + "/hub/api" + path,
                                headers={"Authorization": f"token {self.token}", **(headers or {})},
                                timeout=120, **kw)

    def make_users(self, names):
        for i in range(0, len(names), 500):
            r = self.api("POST", "/users", json={"usernames": names[i:i + 500]})
            assert r.status_code in (201, 409), r.text

    def ready(self) -> set[str]:
        out, offset = set(), 0
        while True:
            r = self.api("GET", f"/users?state=ready&limit=200&offset={offset}"
                         "&include_stopped_servers=0",
                         headers={"Accept": "application/jupyterhub-pagination+json"})
            page = r.json()
            out.update(u["name"] for u in page["items"])
            nxt = page["_pagination"]["next"]
            if not nxt:
                return out
            offset = nxt["offset"]

    # -- processes ---------------------------------------------------------------------

    def procs(self) -> dict[str, psutil.Process]:
        hub = psutil.Process(self.hub.proc.pid)
        out = {"hub": hub}
        for p in hub.children(recursive=True):
            try:
                cmd = " ".join(p.cmdline())
            except psutil.Error:
                continue
            if "gpulab.hub.service" in cmd and "service" not in out:
                out["service"] = p
            elif "configurable-http-proxy" in cmd and "proxy" not in out:
                out["proxy"] = p
        return out

    # -- spawning ----------------------------------------------------------------------

    async def spawn_all(self, names, timeout: float) -> dict:
        """Send a spawn for each of `names` at once; each one's seconds to ready (None:
        failed) and the 429s met on the way."""
        from tornado.httpclient import AsyncHTTPClient, HTTPRequest

        client = AsyncHTTPClient(max_clients=len(names) + 10)
        started: dict[str, float] = {}
        done: dict[str, float | None] = {}
        refused = {"429": 0, "other": {}}

        async def one(name):
            t0 = time.perf_counter()
            started[name] = t0
            while True:
                r = await client.fetch(HTTPRequest(
                    self.hub.url + f"/hub/api/users/{name}/server", method="POST",
                    # gpulab: the CPU-only profile (the GPUs are a job's; people's jobs queue)
                    body=json.dumps({"profile": "cpu"} if self.kind == "gpulab" else {}),
                    headers={"Authorization": f"token {self.token}"}, request_timeout=timeout),
                    raise_error=False)
                if r.code == 429 and time.perf_counter() - t0 < timeout:
                    refused["429"] += 1
                    await asyncio.sleep(float(r.headers.get("Retry-After", "2")))
                    continue
                if r.code not in (201, 202):
                    why = f"{r.code} {(r.body or b'').decode(errors='replace')[:160]}"
                    refused["other"][why] = refused["other"].get(why, 0) + 1
                    done[name] = None
                return

        async def watch():
            deadline = time.perf_counter() + timeout
            while len(done) < len(names) and time.perf_counter() < deadline:
                ready = await asyncio.to_thread(self.ready)
                now = time.perf_counter()
                for n in names:
                    if n not in done and n in ready and n in started:
                        done[n] = now - started[n]
                await asyncio.sleep(0.2)

        await asyncio.gather(watch(), *(one(n) for n in names))
        times = [done.get(n) for n in names]
        return {"times": [t for t in times if t is not None],
                "failed": sum(t is None for t in times), "429": refused["429"],
                "other": refused["other"]}

    async def fill(self, names, timeout: float, window: int) -> dict:
        """Start a server for each of `names`, `window` spawns in flight at a time (a new
        one sent as soon as one is ready): each spawn's POST, then, if the hub answered
        202 (still starting), that one person's model every second until the server is
        ready or gone. Only fills: the storm is what measures spawn times (it reads the
        list of ready servers every 0.2 s, which a fill of 800 need not)."""
        from tornado.httpclient import AsyncHTTPClient, HTTPRequest

        client = AsyncHTTPClient(max_clients=window + 10)
        gate = asyncio.Semaphore(window)
        times, failed = [], {}
        headers = {"Authorization": f"token {self.token}"}
        body = json.dumps({"profile": "cpu"} if self.kind == "gpulab" else {})

        def fail(why):
            failed[why] = failed.get(why, 0) + 1

        async def one(name):
            async with gate:
                t0 = time.perf_counter()
                while True:
                    r = await client.fetch(HTTPRequest(
                        self.hub.url + f"/hub/api/users/{name}/server", method="POST",
                        body=body, headers=headers, request_timeout=timeout), raise_error=False)
                    if r.code == 429 and time.perf_counter() - t0 < timeout:
                        await asyncio.sleep(float(r.headers.get("Retry-After", "2")))
                        continue
                    break
                if r.code == 201:
                    times.append(time.perf_counter() - t0)
                    return
                if r.code != 202:
                    return fail(f"{r.code} {(r.body or b'').decode(errors='replace')[:160]}")
                while time.perf_counter() - t0 < timeout:
                    await asyncio.sleep(1)
                    r = await client.fetch(HTTPRequest(
                        self.hub.url + f"/hub/api/users/{name}", headers=headers,
                        request_timeout=timeout), raise_error=False)
                    server = json.loads(r.body).get("servers", {}).get("") if r.code == 200 \
                        else {"pending": "?"}
                    if server and server.get("ready"):
                        times.append(time.perf_counter() - t0)
                        return
                    if not server or not server.get("pending"):
                        return fail("stopped while starting")
                fail("not ready in time")

        await asyncio.gather(*(one(n) for n in names))
        return {"times": times, "failed": failed}

    # -- steady activity ---------------------------------------------------------------

    def person_tokens(self, names) -> dict[str, str]:
        out = {}
        for n in names:
            r = self.api("POST", f"/users/{n}/tokens", json={"note": "scale bench"})
            out[n] = r.json()["token"]
        return out

    async def steady(self, people: dict[str, str], seconds: float) -> dict:
        """`people` read ``me``, ``jobs``, ``queue`` and submit a queued job now and then."""
        from tornado.httpclient import AsyncHTTPClient, HTTPRequest

        client = AsyncHTTPClient(max_clients=50)
        counts = {"reads": 0, "read_errors": 0, "submitted": 0, "submit_codes": {}}
        read_times = []
        end = time.monotonic() + seconds

        async def person(name, token, k):
            await asyncio.sleep(k % 10)  # spread over the first 10 s
            n = 0
            while time.monotonic() < end:
                for path in ("me", "jobs", "queue"):
                    t0 = time.perf_counter()
                    r = await client.fetch(HTTPRequest(
                        self.hub.service_api + path, headers={"Authorization": f"token {token}"},
                        request_timeout=60), raise_error=False)
                    read_times.append(time.perf_counter() - t0)
                    counts["reads" if r.code == 200 else "read_errors"] += 1
                if n % 3 == 0:
                    spec = {"name": f"q{n}-{uuid.uuid4().hex[:6]}",
                            "strategy": "multi-worker-mirrored", "replicas": {"worker": 1},
                            "resources": {"worker": {"gpus": 1}}, "source": SLEEPER}
                    r = await client.fetch(HTTPRequest(
                        self.hub.service_api + "jobs", method="POST", body=json.dumps(spec),
                        headers={"Authorization": f"token {token}",
                                 "Content-Type": "application/json"}, request_timeout=60),
                        raise_error=False)
                    counts["submitted"] += 1
                    counts["submit_codes"][r.code] = counts["submit_codes"].get(r.code, 0) + 1
                n += 1
                await asyncio.sleep(10)

        await asyncio.gather(*(person(n, t, k) for k, (n, t) in enumerate(people.items())))
        counts["read_p50"] = pct(read_times, 50)
        counts["read_p99"] = pct(read_times, 99)
        return counts

    def cpu(self, procs) -> dict[str, float]:
        out = {}
        for k, p in procs.items():
            try:
                t = p.cpu_times()
                out[k] = t.user + t.system
            except psutil.Error:
                out[k] = float("nan")
        return out


class Profile:
    """py-spy sampling `procs` (``--profile``) while the block runs: collapsed stacks in
    ``<dir>/<kind>-<phase>-<name>.txt``, and the frames most often on the stack printed."""

    def __init__(self, args, kind: str, phase: str, procs: dict):
        self.args, self.kind, self.phase, self.procs = args, kind, phase, procs
        self.running = []

    def __enter__(self):
        if not self.args.profile:
            return self
        spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
        self.args.profile.mkdir(parents=True, exist_ok=True)
        for name in ("hub", "service"):
            if name not in self.procs:
                continue
            out = self.args.profile / f"{self.kind}-{self.phase}-{name}.txt"
            self.running.append((name, out, subprocess.Popen(
                [spy, "record", "--pid", str(self.procs[name].pid), "--rate", "50",
                 "--format", "raw", "--nonblocking", "--output", str(out)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)))
        time.sleep(1)
        return self

    def __exit__(self, *exc):
        import collections
        import signal

        for name, out, proc in self.running:
            proc.send_signal(signal.SIGINT)
            proc.wait(60)
            if not out.exists():
                continue
            inclusive, total = collections.Counter(), 0
            for line in out.read_text().splitlines():
                stack, _, n = line.rpartition(" ")
                if not n.isdigit():  # a frame's name with a space in it, split by py-spy
                    continue
                frames = [f for f in stack.split(";") if f]
                total += int(n)
                for f in set(frames):
                    if "gpulab" in f or "jupyterhub" in f or "sqlalchemy" in f:
                        inclusive[f] += int(n)
            print(f"    profile {self.kind} {self.phase} {name} ({out.name}, {total} samples): "
                  "most on the stack:")
            for f, n in inclusive.most_common(self.args.profile_top):
                print(f"      {100 * n / max(total, 1):5.1f} %  {f}")


def measure(kind: str, args) -> dict:
    out = {"kind": kind}
    with Run(kind, args) as run:
        names = [f"p{i:05d}" for i in range(args.people)]
        run.make_users(names)
        procs = run.procs()
        # one job holds every GPU: the people's jobs queue behind it
        blocker = run.admin.service("POST", "jobs", json={
            "name": "holds-all", "strategy": "multi-worker-mirrored", "replicas": {"worker": 1},
            "resources": {"worker": {"gpus": 4}}, "source": SLEEPER})
        out["blocker"] = blocker.status_code
        # 2. the storm
        storm = names[:args.storm]
        t0 = time.perf_counter()
        cpu0 = run.cpu(procs)
        with Profile(args, kind, "storm", procs):
            res = asyncio.run(run.spawn_all(storm, args.timeout))
        wall = time.perf_counter() - t0
        cpu1 = run.cpu(procs)
        out["storm"] = {**res, "wall": wall, "p50": pct(res["times"], 50),
                        "p99": pct(res["times"], 99),
                        "hub_cpu": 100 * (cpu1["hub"] - cpu0["hub"]) / wall}
        print(f"  {kind}: storm of {len(storm)}: p50 {out['storm']['p50']:.2f} s, p99 "
              f"{out['storm']['p99']:.2f} s, failed {res['failed']}, 429s {res['429']}, other "
              f"{res['other']}, {wall:.1f} s in all, hub CPU {out['storm']['hub_cpu']:.0f} %",
              flush=True)
        # 3. up to --servers running
        more = names[args.storm:args.servers]
        t0 = time.perf_counter()
        r = asyncio.run(run.fill(more, args.timeout, args.fill_window))
        fill = r["times"]
        out["fill_failed"] = r["failed"]
        running = len(run.ready())
        out["running"] = running
        print(f"  {kind}: {running} servers running ({len(more)} more in "
              f"{time.perf_counter() - t0:.0f} s, {args.fill_window} at a time: p50 "
              f"{pct(fill, 50):.2f} s; failed {sum(r['failed'].values())} {r['failed']})",
              flush=True)
        # 4. steady activity
        time.sleep(5)
        active = names[:max(1, int(args.active_people * args.people))]
        tokens = run.person_tokens(active)
        rss0 = {k: p.memory_info().rss for k, p in procs.items()}
        t0 = time.perf_counter()
        cpu0 = run.cpu(procs)
        with Profile(args, kind, "steady", procs):
            act = asyncio.run(run.steady(tokens, args.rest))
        wall = time.perf_counter() - t0
        cpu1 = run.cpu(procs)
        # the figure compared: seconds of CPU each process used over the window (load on
        # the shared machine stretches wall time far more than it changes CPU time)
        out["rest_cpu_s"] = {k: cpu1[k] - cpu0[k] for k in procs}
        out["rest_wall"] = wall
        out["rest"] = {k: 100 * (cpu1[k] - cpu0[k]) / wall for k in procs}
        out["rss"] = {k: p.memory_info().rss for k, p in procs.items()}
        out["activity"] = act
        out["running_after"] = len(run.ready())
        print(f"  {kind}: {args.rest:.0f} s steady with {running} servers, "
              f"{len(active)} people active ({wall:.1f} s): CPU s " +
              ", ".join(f"{k} {v:.2f}" for k, v in out["rest_cpu_s"].items()) + "; CPU % " +
              ", ".join(f"{k} {v:.1f}" for k, v in out["rest"].items()) + "; RSS MiB " +
              ", ".join(f"{k} {v / 2**20:.0f}" for k, v in out["rss"].items()) +
              f" (hub before {rss0['hub'] / 2**20:.0f}); reads {act['reads']} "
              f"(errors {act['read_errors']}, p50 {act['read_p50'] * 1000:.0f} ms, p99 "
              f"{act['read_p99'] * 1000:.0f} ms), jobs {act['submit_codes']}; "
              f"{out['running_after']} still running", flush=True)
        if kind == "gpulab":
            out["service"] = service_figures(run, names, args)
        # the service's jobs outlive the hub (they are not the hub's servers): stop them
        for job in run.admin.service("GET", "jobs?all=1&limit=1000").json().get("jobs", []):
            run.admin.service("POST", f"jobs/{job['name']}/stop?user={job['user']}")
    return out


def measure_pages(args) -> dict:
    """``--only-pages``: a gpulab hub with ``--people`` people, ``--active-people`` of them
    with a 1-GPU job queued behind one that holds every GPU, then `service_figures`."""
    out = {"kind": "gpulab"}
    with Run("gpulab", args) as run:
        names = [f"p{i:05d}" for i in range(args.people)]
        run.make_users(names)
        blocker = run.admin.service("POST", "jobs", json={
            "name": "holds-all", "strategy": "multi-worker-mirrored", "replicas": {"worker": 1},
            "resources": {"worker": {"gpus": 4}}, "source": SLEEPER})
        out["blocker"] = blocker.status_code
        active = names[:max(1, int(args.active_people * args.people))]
        tokens = run.person_tokens(active)
        codes: dict[int, int] = {}
        for n, token in tokens.items():
            r = requests.post(run.hub.service_api + "jobs", headers={
                "Authorization": f"token {token}"}, timeout=60, json={
                "name": f"q-{uuid.uuid4().hex[:6]}", "strategy": "multi-worker-mirrored",
                "replicas": {"worker": 1}, "resources": {"worker": {"gpus": 1}},
                "source": SLEEPER})
            codes[r.status_code] = codes.get(r.status_code, 0) + 1
        print(f"  gpulab: {len(names)} people, {len(tokens)} queued jobs {codes}", flush=True)
        procs = run.procs()
        try:
            with Profile(args, "gpulab", "pages", procs):
                out["service"] = service_figures(run, names, args)
                out["service"]["polls"] = asyncio.run(polls(run, tokens, args.poll_seconds))
        finally:  # the service's jobs outlive the hub: stopped whatever happened
            for job in run.admin.service("GET", "jobs?all=1&limit=1000").json().get("jobs", []):
                run.admin.service("POST", f"jobs/{job['name']}/stop?user={job['user']}")
    return out


async def polls(run: Run, tokens: dict[str, str], seconds: float) -> dict:
    """Everyone in `tokens` reading ``GET queue`` and ``GET jobs`` over and over for
    `seconds`: reads per second and their p50/p99, and the service's CPU meanwhile."""
    from tornado.httpclient import AsyncHTTPClient, HTTPRequest

    client = AsyncHTTPClient(max_clients=50)
    times, errors = [], 0
    svc = run.procs().get("service")
    end = time.monotonic() + seconds

    async def person(token):
        nonlocal errors
        while time.monotonic() < end:
            for path in ("queue", "jobs"):
                t0 = time.perf_counter()
                r = await client.fetch(HTTPRequest(
                    run.hub.service_api + path, headers={"Authorization": f"token {token}"},
                    request_timeout=60), raise_error=False)
                times.append(time.perf_counter() - t0)
                errors += r.code != 200

    c0, t0 = svc.cpu_times(), time.perf_counter()
    await asyncio.gather(*(person(t) for t in tokens.values()))
    wall, c1 = time.perf_counter() - t0, svc.cpu_times()
    out = {"reads": len(times), "per_s": len(times) / wall, "errors": errors,
           "p50": pct(times, 50), "p99": pct(times, 99),
           "cpu": 100 * (c1.user + c1.system - c0.user - c0.system) / wall}
    print(f"  {len(tokens)} people polling queue and jobs for {seconds:.0f} s: "
          f"{out['per_s']:.0f} reads/s (errors {errors}), p50 {out['p50'] * 1000:.0f} ms, p99 "
          f"{out['p99'] * 1000:.0f} ms; service CPU {out['cpu']:.0f} % of a core", flush=True)
    return out


def service_figures(run: Run, names, args) -> dict:
    """The service's pages at --page-users hub users, its RSS and a reconciler pass with
    --past-allocations closed allocations in the ledger."""
    from gpulab.hub.quota.ledger import Ledger
    from gpulab.hub.service.hubapi import HubDirectory
    from gpulab.hub.service.reconciler import close_orphaned_notebooks

    out = {}
    ledger = Ledger(f"sqlite:///{run.hub.data_dir / 'gpulab.sqlite'}")
    if args.past_allocations:
        from gpulab.hub.quota.rows import AllocationRow

        pool = ledger.pool
        now = time.time()
        rows = [{"id": uuid.uuid4().hex, "pool": pool, "kind": ("notebook", "job")[i % 2],
                 "holder": f"h{i}", "user": names[i % len(names)], "gpus": 1 + i % 2,
                 "model": None, "devices": json.dumps([i % 4]),
                 "started_at": now - 60 * 86400 * (i + 1) / args.past_allocations,
                 "ended_at": now - 60 * 86400 * (i + 1) / args.past_allocations + 3600,
                 "end_reason": "released", "max_runtime": None}
                for i in range(args.past_allocations)]
        with ledger.engine.begin() as conn:
            for i in range(0, len(rows), 5000):
                conn.execute(AllocationRow.__table__.insert(), rows[i:i + 5000])
    # people the hub has, for the pages (beyond those already made)
    if args.page_users > len(names):
        run.make_users([f"u{i:05d}" for i in range(args.page_users - len(names))])
    # a person's My GPUs, and the admin page, first page; each load past the directory's
    # cache (5 s): the first waits for the hub's whole list (the service last read a small
    # one: it waits when a read is quick); later ones show the list as last read while a
    # newer one is read in the background (the hub's list is slow to read at this size)
    admin_times, mine_times, base_times = [], [], []
    person_token = run.api("POST", f"/users/{names[0]}/tokens", json={}).json()["token"]
    for i in range(args.page_loads + 1):
        t0 = time.perf_counter()
        r = run.admin.s.get(run.hub.service_url + "admin", timeout=120)
        admin_times.append(time.perf_counter() - t0)
        assert r.status_code == 200, (r.status_code, r.text[:300])
        size = len(r.content)
        if i == 1:
            print(f"    the page says how old its list is: {'People as read' in r.text}",
                  flush=True)
        t0 = time.perf_counter()
        r2 = requests.get(run.hub.service_api + "me",
                          headers={"Authorization": f"token {person_token}"}, timeout=120)
        mine_times.append(time.perf_counter() - t0)
        assert r2.status_code == 200, r2.text
        # the baseline: the hub's own first page of users, authenticated (its admin panel's)
        t0 = time.perf_counter()
        r3 = run.api("GET", "/users?offset=0&limit=50",
                     headers={"Accept": "application/jupyterhub-pagination+json"})
        base_times.append(time.perf_counter() - t0)
        assert r3.status_code == 200, r3.text
        time.sleep(6)  # past the directory's cache: a read of the hub is due each time
    served = admin_times[1:]
    out["admin_page"] = {"s": statistics.median(served), "max": max(served), "cold": admin_times[0],
                         "n": len(served), "bytes": size, "users": args.page_users}
    out["my_gpus_api"] = {"s": statistics.median(mine_times), "max": max(mine_times)}
    out["baseline"] = {"s": statistics.median(base_times)}
    # the service's memory after those reads, and a reconciler pass as the service runs it
    svc = run.procs().get("service")
    out["service_rss"] = svc.memory_info().rss if svc else float("nan")
    directory = HubDirectory(run.hub.url + "/hub/api", run.token)
    passes = []
    for _ in range(3):
        t0 = time.perf_counter()
        closed = asyncio.run(close_orphaned_notebooks(ledger, directory, grace=3600))
        passes.append(time.perf_counter() - t0)
    out["reconciler"] = {"s": statistics.median(passes), "closed": len(closed or ())}
    print(f"  gpulab service at {args.page_users} hub users: admin page (first page) "
          f"{out['admin_page']['s']:.2f} s ({size / 1024:.0f} KiB; slowest "
          f"{out['admin_page']['max']:.2f} s; cold {out['admin_page']['cold']:.2f} s), "
          f"My GPUs (me) {out['my_gpus_api']['s']:.3f} s; "
          f"service RSS {out['service_rss'] / 2**20:.0f} MiB with "
          f"{args.past_allocations} past allocations; reconciler pass "
          f"{out['reconciler']['s']:.3f} s", flush=True)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--people", type=int, default=300, help="hub users (default 300)")
    p.add_argument("--storm", type=int, default=200, help="spawns sent at once (default 200)")
    p.add_argument("--servers", type=int, default=250,
                   help="servers running for the steady phase (default 250)")
    p.add_argument("--fill-window", type=int, default=100,
                   help="spawns in flight while filling up to --servers (default 100: "
                        "JupyterHub's concurrent_spawn_limit)")
    p.add_argument("--rest", type=float, default=60, help="seconds of steady activity")
    p.add_argument("--active-people", type=float, default=0.05,
                   help="share of people reading and submitting jobs in the steady phase")
    p.add_argument("--activity-every", type=float, default=60,
                   help="seconds between a server's activity posts (singleuser: 300)")
    p.add_argument("--idle-timeout", type=int, default=3600,
                   help="the culler's idle timeout (it looks every 10 s)")
    p.add_argument("--timeout", type=float, default=300, help="seconds a spawn may take")
    p.add_argument("--page-users", type=int, default=1000,
                   help="hub users for the admin page and My GPUs figures (issue: 10000)")
    p.add_argument("--poll-seconds", type=float, default=20,
                   help="--only-pages: seconds of the queued people polling queue and jobs")
    p.add_argument("--page-loads", type=int, default=5,
                   help="admin page loads after the first (each 6 s apart; median printed)")
    p.add_argument("--past-allocations", type=int, default=10000,
                   help="closed allocations in the ledger (issue: 100000)")
    p.add_argument("--only", choices=["gpulab", "stock"], help="one configuration only")
    p.add_argument("--only-pages", action="store_true",
                   help="only the service's figures (admin page, My GPUs, GET queue/jobs, "
                        "RSS, reconciler) in one gpulab hub: no storm, no servers, no stock run")
    p.add_argument("--keep", action="store_true", help="keep the data folders (logs)")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="sample the hub and the service with py-spy in the storm and the "
                        "steady phase (collapsed stacks in DIR; the top frames printed)")
    p.add_argument("--profile-top", type=int, default=15)
    p.add_argument("--kube", action="store_true",
                   help="the Kubernetes half instead (bench/scale_kube.py, its own flags after --)")
    args, rest = p.parse_known_args()
    if args.kube:
        try:
            kube = importlib.import_module("bench.scale_kube")
        except ModuleNotFoundError as e:
            if e.name not in ("bench.scale_kube", "bench"):
                raise
            print("bench/scale_kube.py (the Kubernetes half of the scale benchmark) is not "
                  "in this tree.", file=sys.stderr)
            return 2
        return kube.main(rest)
    if rest:
        p.error(f"unrecognized arguments: {' '.join(rest)}")
    args.servers = max(args.servers, args.storm)
    args.people = max(args.people, args.servers)

    results = {}
    if args.only_pages:
        results["gpulab"] = measure_pages(args)
    for kind in ([] if args.only_pages else [args.only] if args.only else ["stock", "gpulab"]):
        results[kind] = measure(kind, args)
    if len(results) == 2:
        s, g = results["stock"], results["gpulab"]
        print(f"\nstorm of {args.storm}: p99 LocalGPUSpawner {g['storm']['p99']:.2f} s, "
              f"LocalProcessSpawner {s['storm']['p99']:.2f} s, ratio "
              f"{g['storm']['p99'] / s['storm']['p99']:.2f} (goal <= 1.2); p50 ratio "
              f"{g['storm']['p50'] / s['storm']['p50']:.2f}; failed {g['storm']['failed']} / "
              f"{s['storm']['failed']} (goal 0)")
        print(f"hub CPU at rest with {g['running']} / {s['running']} servers: "
              f"{g['rest_cpu_s']['hub']:.2f} / {s['rest_cpu_s']['hub']:.2f} s of CPU in "
              f"{args.rest:.0f} s, ratio "
              f"{g['rest_cpu_s']['hub'] / max(s['rest_cpu_s']['hub'], 0.01):.2f} (goal <= 1.1; "
              f"{g['rest']['hub']:.1f} % / {s['rest']['hub']:.1f} % of a core over "
              f"{g['rest_wall']:.1f} / {s['rest_wall']:.1f} s)")
        print(f"hub RSS: {g['rss']['hub'] / 2**20:.0f} / {s['rss']['hub'] / 2**20:.0f} MiB, "
              f"ratio {g['rss']['hub'] / s['rss']['hub']:.2f}")
    if "gpulab" in results:
        v = results["gpulab"]["service"]
        a, base = v["admin_page"], v["baseline"]
        print(f"service: RSS {v['service_rss'] / 2**20:.0f} MiB (goal < 250 MB), reconciler "
              f"pass {v['reconciler']['s']:.3f} s (goal < 1 s); admin page "
              f"{a['s']:.2f} s (median of {a['n']}; cold, the first read of the hub's "
              f"{a['users']} users waited for: {a['cold']:.2f} s), My GPUs "
              f"{v['my_gpus_api']['s']:.3f} s at {a['users']} users (goal < 1 s); the hub's own "
              f"first page of users (GET /hub/api/users?limit=50) {base['s']:.3f} s: admin page "
              f"{a['s'] / base['s']:.1f}x of it")
    return 0


if __name__ == "__main__":
    sys.exit(main())
