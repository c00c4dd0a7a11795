"""What GPU telemetry and GPU-idle culling cost the gpulab service (issue 39: "sampling adds
< 1% CPU to the service").

    python bench/telemetry.py [--gpus 100] [--users 1000] [--seconds 30] [--interval 5]

A cluster-sized case: `--gpus` GPUs on a DCGM exporter's page (dcgm-exporter's format, every
counter it exports by default, so the parser reads ~14 lines per GPU), each held by a
notebook or a job of one of `--users` people in a real SQLite ledger, the culler in ``stop``
mode over all of them. The exporter runs in a process of its own (its CPU is not the
service's), as it would.

1. Per round: the CPU time of one sampling round (HTTP read + parse) and one culling round
   (ledger read, owner labels, policy), averaged over 30 rounds, and the share of one core
   that makes at `--interval` seconds.
2. Over `--seconds` of wall time, the process's CPU (user + system) of an event loop that
   only ticks (the baseline, as the service's own timers do) and of the same loop with the
   sampler and the culler running at `--interval`, measured in the same run; the difference
   is what telemetry adds (goal < 1% of one core).

Nothing here fails on a number: it prints them.
"""

from __future__ import annotations

import argparse
import asyncio
import http.server
import multiprocessing
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpulab.hub.machine.gpuusage import DcgmSource, PoolUsage  # noqa: E402
from gpulab.hub.quota.idle import IdleRule, IdleSettings  # noqa: E402
from gpulab.hub.quota.ledger import Ledger, Request  # noqa: E402
from gpulab.hub.quota.policy import Quota  # noqa: E402

COUNTERS = ["SM_CLOCK", "MEM_CLOCK", "GPU_TEMP", "POWER_USAGE", "TOTAL_ENERGY_CONSUMPTION",
            "PCIE_REPLAY_COUNTER", "GPU_UTIL", "MEM_COPY_UTIL", "ENC_UTIL", "DEC_UTIL",
            "XID_ERRORS", "FB_FREE", "FB_USED", "NVLINK_BANDWIDTH_TOTAL"]


def page(holders: list[tuple[str, str, str]]) -> bytes:
    """The exporter's page: each GPU with the namespace and pod of its holder."""
    out = []
    for counter in COUNTERS:
        name = f"DCGM_FI_DEV_{counter}"
        out += [f"# HELP {name} {counter}.", f"# TYPE {name} gauge"]
        for i, (ns, pod, _) in enumerate(holders):
            labels = (f'gpu="{i % 8}",UUID="GPU-{i:08d}-0000-0000-0000-000000000000",'
                      f'pci_bus_id="00000000:{i % 8:02X}:00.0",device="nvidia{i % 8}",'
                      f'modelName="NVIDIA H100 80GB HBM3",Hostname="node-{i // 8}",'
                      f'DCGM_FI_DRIVER_VERSION="550.54.15",container="c",namespace="{ns}",'
                      f'pod="{pod}"')
            value = {"GPU_UTIL": i % 3, "FB_USED": 1000 + i, "FB_FREE": 80000}.get(counter, 7)
            out.append(f"{name}{{{labels}}} {value}")
    return ("\n".join(out) + "\n").encode()


def serve(body: bytes, port_out) -> None:
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    s = http.server.HTTPServer(("127.0.0.1", 0), H)
    port_out.put(s.server_address[1])
    s.serve_forever()


class Directory:
    """The hub's users as the service's cached directory gives them (no hub runs here)."""

    def __init__(self, users):
        self._users = [{"name": u, "groups": ["team"], "admin": False} for u in users]

    async def users(self):
        return self._users

    async def stop_server(self, user, server):  # never reached: nothing is idle long enough
        raise AssertionError("no server is stopped in this benchmark")


def cpu() -> float:
    t = os.times()
    return t.user + t.system


async def window(seconds: float, culler=None, usage=None) -> float:
    """CPU seconds this process used over `seconds` of an event loop with a 0.5 s timer (as
    the service's own), with the sampler and the culler running when given."""
    from tornado.ioloop import PeriodicCallback

    pc = PeriodicCallback(lambda: None, 500)
    pc.start()
    if usage is not None:
        usage.sampler.start()
    if culler is not None:
        culler.start(usage.sampler.interval)
    c0 = cpu()
    await asyncio.sleep(seconds)
    used = cpu() - c0
    pc.stop()
    if culler is not None:
        culler._pc.stop()
    return used


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gpus", type=int, default=100)
    ap.add_argument("--users", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--interval", type=float, default=5.0)
    args = ap.parse_args()

    from gpulab.hub.service.idle import IdleCuller

    tmp = tempfile.mkdtemp(prefix="gpulab-bench-telemetry-")
    ledger = Ledger(f"sqlite:///{tmp}/ledger.sqlite", pool="kubernetes")
    ledger.migrate()
    ledger.ensure_pool(assigns_devices=False)
    ledger.set_quota("default", "", Quota(max_gpus=8), actor="bench")
    users = [f"user{i:04d}" for i in range(args.users)]
    holders = []
    for i in range(args.gpus):
        user = users[i % args.users]
        if i % 4 == 3:  # a quarter of the GPUs are job replicas
            holders.append((f"gpulab-{user}", f"train{i}-worker-0-x{i}", user))
            ledger.admit(Request(user, "job", f"train{i}", 1))
        else:
            holders.append((f"gpulab-{user}", f"jupyter-{user}--s{i}", user))
            ledger.admit(Request(user, "notebook", f"s{i}", 1))
    body = page(holders)
    q = multiprocessing.Queue()
    exporter = multiprocessing.Process(target=serve, args=(body, q), daemon=True)
    exporter.start()
    url = f"http://127.0.0.1:{q.get(timeout=10)}/metrics"
    print(f"{args.gpus} GPUs held by {args.gpus} servers and jobs of {args.users} people; "
          f"DCGM page {len(body) / 1024:.0f} KiB; sampling every {args.interval:g} s")

    settings = IdleSettings(IdleRule(mode="stop", idle_seconds=3600, warn_seconds=600))

    def fresh():
        usage = PoolUsage([], args.interval, source=DcgmSource(url))
        return usage, IdleCuller(ledger, usage, Directory(users), settings)

    # 1. per round
    usage, culler = fresh()
    src = usage.sampler.source
    rounds = 30
    c0 = cpu()
    for _ in range(rounds):
        readings = src.read()
    read_ms = (cpu() - c0) / rounds * 1000
    usage.sampler._latest = readings
    usage.sampler._started = True  # the readings above stand; no thread in this part
    loop = asyncio.new_event_loop()
    c0 = cpu()
    for _ in range(rounds):
        loop.run_until_complete(culler.tick())
    tick_ms = (cpu() - c0) / rounds * 1000
    assert len(readings.pods) == args.gpus, len(readings.pods)
    per_round = read_ms + tick_ms
    print(f"per round: sampling {read_ms:.1f} ms CPU, culling {tick_ms:.1f} ms CPU: "
          f"{per_round / (args.interval * 1000) * 100:.2f}% of one core at {args.interval:g} s "
          "(goal < 1%)")

    # 2. over a window, baseline and telemetry in the same run
    base = loop.run_until_complete(window(args.seconds))
    usage, culler = fresh()
    with_t = loop.run_until_complete(window(args.seconds, culler, usage))
    usage.close()
    added = (with_t - base) / args.seconds * 100
    print(f"over {args.seconds:g} s: baseline loop {base / args.seconds * 100:.2f}% CPU, with "
          f"sampling and culling {with_t / args.seconds * 100:.2f}%: telemetry adds "
          f"{added:.2f}% of one core (goal < 1%)")
    exporter.terminate()
    exporter.join(5)


if __name__ == "__main__":
    main()
