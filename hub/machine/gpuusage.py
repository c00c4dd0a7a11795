"""How busy each real GPU is and how much of its memory is in use, read with NVML.

People want to see whether the GPUs they hold are working (a notebook holding an idle GPU, a
job stuck in its input pipeline); admins want the same for everyone's. NVML reports both per
device: utilization is the percentage of the last sample period in which a kernel ran, memory
the bytes allocated on the device. Each device is held by one server or one replica at a time
(the ledger hands devices out exclusively), so a device's figures are its holder's.

`read_usage` is a pure function over an NVML-like module (tests hand it a stand-in; the GPU
check in ``tests/gpu`` runs it on a real one). `UsageSampler` reads in a daemon thread every
few seconds and keeps the latest figures, so that a page or an API call never waits for the
driver (NVML calls take milliseconds, but a wedged driver can take seconds): readers get the
last snapshot at once. Simulated GPUs have nothing to measure and say so.

This module needs only the standard library and, where GPUs exist, ``pynvml``
(nvidia-ml-py): the GPU check runs it on a machine that has neither JupyterHub nor gpulab's
other dependencies.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass

log = logging.getLogger(__name__)

MIB = 1024 * 1024


@dataclass(frozen=True)
class Usage:
    """One GPU's figures at one moment."""

    uuid: str
    #: percent of the last sample period (1/6 s to 1 s, by the driver) in which a kernel ran
    gpu_percent: int
    memory_used_mib: int
    memory_total_mib: int
    at: float

    def to_dict(self) -> dict:
        return {"gpu_percent": self.gpu_percent, "memory_used_mib": self.memory_used_mib,
                "memory_total_mib": self.memory_total_mib, "at": round(self.at, 3)}


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def read_usage(nvml, uuids, now: float | None = None) -> dict[str, Usage]:
    """Utilization and memory of each GPU in `uuids` (NVML must be initialized).

    A GPU NVML cannot read (gone, lost, or a UUID of another machine) is left out rather than
    failing the others; the caller shows it as not measured."""
    now = time.time() if now is None else now
    out: dict[str, Usage] = {}
    for uuid in uuids:
        try:
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid)
            util = nvml.nvmlDeviceGetUtilizationRates(handle)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
        except Exception as e:  # NVMLError and its kin: one bad device is not all of them
            log.debug("NVML could not read %s: %s", uuid, e)
            continue
        out[uuid] = Usage(uuid=uuid, gpu_percent=int(util.gpu),
                          memory_used_mib=int(mem.used) // MIB,
                          memory_total_mib=int(mem.total) // MIB, at=now)
    return out


class UsageSampler:
    """Reads `uuids` with NVML every `interval` seconds in a daemon thread.

    `snapshot()` returns the latest figures at once (never waits for NVML). The thread starts
    with the first `snapshot()` (so a process that never shows usage never loads NVML) and
    stops with `close()`. With no NVML (no driver, no GPUs, no ``pynvml``) it stays empty and
    `available` is False.
    """

    def __init__(self, uuids, interval: float = 5.0, nvml=None):
        self.uuids = tuple(u for u in uuids if u)
        self.interval = max(0.5, float(interval))
        self._nvml = nvml
        self._latest: dict[str, Usage] = {}
        self._lock = threading.Lock()
        self._started = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.available = bool(self.uuids)

    def _load(self):
        if self._nvml is None:
            try:
                import pynvml
            except ImportError:
                return None
            self._nvml = pynvml
        try:
            self._nvml.nvmlInit()
        except Exception as e:
            log.info("GPU usage is not measured: NVML did not start (%s)", e)
            return None
        return self._nvml

    def _run(self) -> None:
        nvml = self._load()
        if nvml is None:
            self.available = False
            return
        try:
            while not self._stop.is_set():
                figures = read_usage(nvml, self.uuids)
                with self._lock:
                    self._latest = figures
                self._stop.wait(self.interval)
        finally:
            try:
                nvml.nvmlShutdown()
            except Exception:
                pass

    def start(self) -> None:
        with self._lock:
            if self._started or not self.uuids:
                return
            self._started = True
        self._thread = threading.Thread(target=self._run, name="gpulab-gpu-usage", daemon=True)
        self._thread.start()

    def snapshot(self) -> dict[str, Usage]:
        self.start()
        with self._lock:
            return dict(self._latest)

    def wait_first(self, timeout: float = 5.0) -> dict[str, Usage]:
        """The first complete reading (for the GPU check and tests), or what there is."""
        self.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.available:
            with self._lock:
                if self._latest:
                    return dict(self._latest)
            time.sleep(0.05)
        return self.snapshot()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def device_usage(index: int, uuid: str, simulated: bool, figures: dict[str, Usage]) -> dict:
    """What the API says about one device: its figures, or why there are none.

    ``{"device": 0, "measured": true, "gpu_percent": 37, "memory_used_mib": 12000,
    "memory_total_mib": 81559, "at": ..., "text": "GPU 0: 37% busy, 11.7 of 79.6 GiB"}``, or
    ``{"device": 0, "measured": false, "why": "simulated", "text": ...}`` (``"simulated"``: a
    stand-in GPU, nothing to measure; ``"not measured"``: NVML is not available here or
    could not read this GPU)."""
    if simulated:
        entry = {"device": index, "measured": False, "why": "simulated"}
    elif (usage := figures.get(uuid)) is None:
        entry = {"device": index, "measured": False, "why": "not measured"}
    else:
        entry = {"device": index, "measured": True, **usage.to_dict()}
    # the words every page, the CLI and the JobView show, written once here
    entry["text"] = usage_text(entry)
    return entry


def usage_text(entry: dict) -> str:
    """``"GPU 0: 37% busy, 11.7 of 79.6 GiB"`` / ``"GPU 0: simulated (nothing to measure)"``."""
    head = f"GPU {entry['device']}"
    if not entry.get("measured"):
        if entry.get("why") == "simulated":
            return f"{head}: simulated (nothing to measure)"
        return f"{head}: usage not measured"
    return (f"{head}: {entry['gpu_percent']}% busy, "
            f"{entry['memory_used_mib'] / 1024:.1f} of {entry['memory_total_mib'] / 1024:.1f} GiB")


class PoolUsage:
    """The figures of a ledger pool's devices, by device number, for the gpulab service.

    `devices` are the pool's device records (index, uuid, simulated); only real ones are
    sampled. `entries([0, 3])` gives `device_usage` for each, at once."""

    def __init__(self, devices, interval: float = 5.0, nvml=None):
        self.devices = {d.index: d for d in devices}
        real = [d.uuid for d in devices if not d.simulated]
        self.sampler = UsageSampler(real, interval, nvml=nvml) if real and interval else None

    def entries(self, indexes) -> list[dict]:
        figures = self.sampler.snapshot() if self.sampler is not None else {}
        out = []
        for i in indexes:
            d = self.devices.get(i)
            out.append(device_usage(i, d.uuid if d else "", bool(d and d.simulated), figures))
        return out

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
