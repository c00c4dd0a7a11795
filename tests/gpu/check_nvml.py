"""The GPU check of gpulab's NVML code, for a machine with a real NVIDIA GPU.

Run it where a GPU and its driver are (the development workplace's GPU machine, or any
NVIDIA host): ``python3 tests/gpu/check_nvml.py [--out result.json]``. It needs ``pynvml``
(nvidia-ml-py), ``traitlets`` and, for the load it puts on the GPU, PyTorch; not JupyterHub
nor the rest of gpulab: it loads ``hub/machine/inventory.py`` and ``hub/machine/gpuusage.py`` from
this checkout without the machine package's other modules (``tests/gpu/standalone.py``).

What it checks, against the real driver:
1. `discover_gpus` finds every GPU `nvidia-smi -L` lists, with its UUID, model (as a
   Kubernetes label spells it), memory and device-node minor number, none simulated;
   `GPUInventory` (source "auto") takes them rather than simulated ones.
2. `GPUInventory.usage()` / `UsageSampler` / `PoolUsage`: idle, then while a matrix-product
   loop runs on GPU 0 with 8 GiB allocated: utilization rises above 50% and the memory in use
   by at least 7 GiB, and the words the pages show say so.
Exit status 0 when all hold; 1 with the failed check named; 3 when there is no GPU here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def load_machine_modules():
    """``inventory`` and ``gpuusage`` from this checkout (`standalone`: no gpulab install)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from standalone import load_machine_modules as load

    return load()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    result: dict = {"checks": []}

    def check(name, ok, **facts):
        result["checks"].append({"check": name, "ok": bool(ok), **facts})
        print(("PASS " if ok else "FAIL ") + name + (f" {facts}" if facts else ""), flush=True)
        return ok

    try:
        smi = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
        listed = [line for line in smi.stdout.splitlines() if line.startswith("GPU ")]
    except (OSError, subprocess.TimeoutExpired):
        listed = []
    if not listed:
        print("no NVIDIA GPU here (nvidia-smi lists none): nothing to check")
        return 3
    import pynvml

    inventory, gpuusage = load_machine_modules()
    ok = True
    gpus = inventory.discover_gpus(pynvml)
    result["gpus"] = [g.to_dict() for g in gpus]
    ok &= check("discover_gpus finds every GPU nvidia-smi lists", len(gpus) == len(listed),
                found=len(gpus), listed=len(listed))
    for g, line in zip(gpus, listed):
        ok &= check(f"GPU {g.index} UUID and model as nvidia-smi says",
                    g.uuid in line and not g.simulated and " " not in g.model
                    and g.model.replace("-", " ") in line, model=g.model, line=line)
        ok &= check(f"GPU {g.index} memory and minor number", g.memory_mib > 1024 and g.minor >= 0,
                    memory_mib=g.memory_mib, minor=g.minor)
    inv = inventory.GPUInventory(source="auto", usage_interval=0.5)
    ok &= check("GPUInventory (auto) takes the real GPUs",
                [g.uuid for g in inv.gpus] == [g.uuid for g in gpus])

    import torch

    gpu0 = gpus[0]
    idle = gpuusage.UsageSampler([gpu0.uuid], interval=0.5).wait_first(timeout=10)
    ok &= check("usage is read while idle", gpu0.uuid in idle,
                idle=idle[gpu0.uuid].to_dict() if gpu0.uuid in idle else None)
    inv.usage()  # starts the inventory's own sampler, as the hub's spawn page does
    dev = torch.device("cuda:0")
    block = torch.empty(8 * 1024**3, dtype=torch.uint8, device=dev)  # 8 GiB held
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    stop = threading.Event()

    def load():
        while not stop.is_set():
            for _ in range(20):
                a @ a
            torch.cuda.synchronize()

    t = threading.Thread(target=load, daemon=True)
    t.start()
    samples = []
    try:
        time.sleep(2.0)
        for _ in range(8):
            fig = inv.usage().get(gpu0.uuid)
            if fig is not None:
                samples.append(fig.to_dict())
            time.sleep(0.5)
        pool = gpuusage.PoolUsage([types.SimpleNamespace(index=g.index, uuid=g.uuid,
                                                          simulated=False) for g in gpus],
                                  interval=0.5)
        pool.sampler.wait_first(timeout=10)
        time.sleep(1.0)
        entry = pool.entries([gpu0.index])[0]
        pool.close()
    finally:
        stop.set()
        t.join(timeout=30)
    del block
    result["idle"] = idle[gpu0.uuid].to_dict() if gpu0.uuid in idle else None
    result["busy_samples"] = samples
    result["busy_entry"] = entry
    busiest = max((s["gpu_percent"] for s in samples), default=0)
    grown = max((s["memory_used_mib"] for s in samples), default=0) - \
        (result["idle"] or {}).get("memory_used_mib", 0)
    ok &= check("utilization rises above 50% under a matrix-product loop", busiest > 50,
                busiest=busiest)
    ok &= check("memory in use grows by at least 7 GiB with 8 GiB allocated", grown >= 7 * 1024,
                grown_mib=grown)
    ok &= check("the pages' words say how busy it is",
                entry["measured"] and entry["text"].startswith(f"GPU {gpu0.index}: ")
                and "% busy" in entry["text"], text=entry["text"])
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
