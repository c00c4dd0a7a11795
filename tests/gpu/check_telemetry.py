"""The GPU check of gpulab's telemetry (issue 39): real NVML figures while a small TensorFlow
job trains, compared with ``nvidia-smi``.

Run it on a machine with an NVIDIA GPU, its driver, ``pynvml`` (nvidia-ml-py), ``traitlets``
and TensorFlow with CUDA (``pip install tensorflow[and-cuda]``):
``python3 tests/gpu/check_telemetry.py [--seconds 40] [--out result.json]``. gpulab need not
be installed: ``tests/gpu/standalone.py`` loads ``hub/machine/gpuusage.py`` from this
checkout.

What it checks, on GPU 0:
1. Idle (before the job): gpulab's `UsageSampler` (NVML, the service's default source) and
   ``nvidia-smi --query-gpu`` read at the same moments agree on the memory in use (within
   64 MiB or 2%) and both see a GPU that is not busy.
2. While a small Keras model trains on it (a subprocess with only GPU 0 visible, as a
   replica is started): the utilisation both report rises (gpulab's median above 20%), the
   two medians differ by at most 25 points (the driver samples over 1/6 s to 1 s, the two
   reads are not the same instant), the memory in use agrees within 64 MiB or 2% at each
   paired read, and grows by at least 256 MiB over idle; `PoolUsage.entries` says "% busy".
3. After the job: the memory comes back within 256 MiB of idle.
Exit status 0 when all hold; 1 with the failed checks named; 3 when there is no GPU here;
4 when TensorFlow cannot use the GPU here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from standalone import load_machine_modules  # noqa: E402

#: the job: a small convolutional model on random images, trained for `seconds`
JOB = r"""
import sys, time
import numpy as np
import tensorflow as tf
gpus = tf.config.list_physical_devices("GPU")
if not gpus:
    print("NO-GPU", flush=True)
    sys.exit(4)
seconds = float(sys.argv[1])
x = np.random.rand(4096, 64, 64, 3).astype("float32")
y = np.random.randint(0, 10, 4096)
model = tf.keras.Sequential([
    tf.keras.Input((64, 64, 3)),
    tf.keras.layers.Conv2D(64, 3, activation="relu"),
    tf.keras.layers.Conv2D(64, 3, activation="relu"),
    tf.keras.layers.MaxPooling2D(),
    tf.keras.layers.Conv2D(128, 3, activation="relu"),
    tf.keras.layers.GlobalAveragePooling2D(),
    tf.keras.layers.Dense(10),
])
model.compile("adam", tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))
print("TRAINING", flush=True)
end = time.time() + seconds
while time.time() < end:
    model.fit(x, y, batch_size=256, epochs=1, verbose=0)
print("DONE", flush=True)
"""

SMI_FIELDS = "index,uuid,utilization.gpu,memory.used,memory.total"


def smi(index: int) -> dict | None:
    """``nvidia-smi``'s figures of GPU `index` now (MiB, percent)."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={SMI_FIELDS}",
                              "--format=csv,noheader,nounits", f"--id={index}"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    parts = [p.strip() for p in out.strip().split(",")]
    if len(parts) != 5:
        return None
    return {"index": int(parts[0]), "uuid": parts[1], "gpu_percent": int(parts[2]),
            "memory_used_mib": int(parts[3]), "memory_total_mib": int(parts[4])}


def close_mib(a: int, b: int) -> bool:
    return abs(a - b) <= max(64, 0.02 * max(a, b))


def paired(sampler, uuid: str, index: int, n: int, every: float) -> list[dict]:
    """`n` reads of gpulab's latest figure and of nvidia-smi, `every` seconds apart."""
    out = []
    for _ in range(n):
        ours = sampler.snapshot().get(uuid)
        theirs = smi(index)
        if ours is not None and theirs is not None:
            out.append({"gpulab": ours.to_dict(), "nvidia_smi": theirs})
        time.sleep(every)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=40.0, help="how long the job trains")
    ap.add_argument("--python", default=sys.executable, help="the Python with TensorFlow")
    ap.add_argument("--out", help="write the figures as JSON here")
    args = ap.parse_args()
    result: dict = {"checks": []}
    ok = True

    def check(name, good, **facts):
        nonlocal ok
        ok &= bool(good)
        result["checks"].append({"check": name, "ok": bool(good), **facts})
        print(("PASS " if good else "FAIL ") + name + (f" {facts}" if facts else ""), flush=True)

    first = smi(0)
    if first is None:
        print("no NVIDIA GPU here (nvidia-smi reads none): nothing to check")
        return 3
    import pynvml

    inventory, gpuusage = load_machine_modules()
    uuid = first["uuid"]
    sampler = gpuusage.UsageSampler([uuid], interval=0.5)
    sampler.wait_first(timeout=10)
    time.sleep(1.0)

    idle = paired(sampler, uuid, 0, 6, 0.5)
    result["idle"] = idle
    check("NVML is read and nvidia-smi answers while idle", len(idle) >= 4, pairs=len(idle))
    check("idle: memory in use agrees with nvidia-smi",
          all(close_mib(p["gpulab"]["memory_used_mib"], p["nvidia_smi"]["memory_used_mib"])
              for p in idle), pairs=[(p["gpulab"]["memory_used_mib"],
                                      p["nvidia_smi"]["memory_used_mib"]) for p in idle])
    check("idle: memory total agrees with nvidia-smi",
          all(close_mib(p["gpulab"]["memory_total_mib"], p["nvidia_smi"]["memory_total_mib"])
              for p in idle))
    idle_mem = statistics.median(p["gpulab"]["memory_used_mib"] for p in idle) if idle else 0

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(first["index"]),
           "TF_CPP_MIN_LOG_LEVEL": "2", "TF_FORCE_GPU_ALLOW_GROWTH": "true"}
    job = subprocess.Popen([args.python, "-c", JOB, str(args.seconds)], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = []
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            line = job.stdout.readline()
            if not line:
                break
            log.append(line.rstrip())
            if line.startswith(("TRAINING", "NO-GPU")):
                break
        if not any(x.startswith("TRAINING") for x in log):
            job.wait(60)
            print("\n".join(log[-30:]))
            print("TensorFlow did not train on the GPU here (see its output above)")
            return 4
        time.sleep(5.0)  # past the first epoch's graph building
        busy = paired(sampler, uuid, 0, max(6, int((args.seconds - 10) / 1.0)), 1.0)
        pool = gpuusage.PoolUsage([types.SimpleNamespace(index=first["index"], uuid=uuid,
                                                          simulated=False)], interval=0.5)
        pool.sampler.wait_first(timeout=10)
        time.sleep(1.0)
        entry = pool.entries([first["index"]])[0]
        pool.close()
    finally:
        rest, _ = job.communicate(timeout=args.seconds + 120)
        log += rest.splitlines()
    result["busy"], result["entry"], result["job_log_tail"] = busy, entry, log[-20:]
    ours = [p["gpulab"]["gpu_percent"] for p in busy]
    theirs = [p["nvidia_smi"]["gpu_percent"] for p in busy]
    check("the job ran to its end", job.returncode == 0, returncode=job.returncode)
    check("busy: gpulab sees the GPU working (median > 20%)",
          ours and statistics.median(ours) > 20, gpulab=ours)
    check("busy: utilisation agrees with nvidia-smi (medians within 25 points)",
          ours and theirs and abs(statistics.median(ours) - statistics.median(theirs)) <= 25,
          gpulab=ours, nvidia_smi=theirs)
    check("busy: memory in use agrees with nvidia-smi at each read",
          busy and all(close_mib(p["gpulab"]["memory_used_mib"],
                                 p["nvidia_smi"]["memory_used_mib"]) for p in busy),
          pairs=[(p["gpulab"]["memory_used_mib"], p["nvidia_smi"]["memory_used_mib"])
                 for p in busy])
    grown = max((p["gpulab"]["memory_used_mib"] for p in busy), default=0) - idle_mem
    check("busy: the job's memory shows (at least 256 MiB over idle)", grown >= 256,
          grown_mib=grown)
    check("the pages' words say how busy it is",
          entry["measured"] and "% busy" in entry["text"], text=entry["text"])
    time.sleep(3.0)
    after = paired(sampler, uuid, 0, 3, 0.5)
    check("after the job: the memory comes back",
          after and all(p["gpulab"]["memory_used_mib"] - idle_mem <= 256 for p in after),
          after=[p["gpulab"]["memory_used_mib"] for p in after], idle=idle_mem)
    sampler.close()
    result["device"] = first
    result["nvml_driver"] = _text(pynvml.nvmlSystemGetDriverVersion()) if _init(pynvml) else ""
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


def _init(pynvml) -> bool:
    try:
        pynvml.nvmlInit()
        return True
    except Exception:
        return False


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


if __name__ == "__main__":
    sys.exit(main())
