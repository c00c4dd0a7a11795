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

Where the figures come from is a *usage source* (`UsageSource`): `NvmlSource` (this machine's
driver, the default), `StandInSource` (a JSON file an operator or a test writes, the figures
of simulated GPUs, so that GPU-idle culling can be exercised without a GPU) and `DcgmSource`
(NVIDIA's DCGM exporter on Kubernetes: its Prometheus page, ``DCGM_FI_DEV_GPU_UTIL`` and
``DCGM_FI_DEV_FB_USED`` labelled with the pod and namespace that hold each GPU, which
`pod_owner` maps back to the holder's server or job). `UsageSampler` reads whichever source
in its one thread; `PoolUsage` is what the service shows.

This module needs only the standard library and, where GPUs exist, ``pynvml``
(nvidia-ml-py): the GPU check runs it on a machine that has neither JupyterHub nor gpulab's
other dependencies.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from dataclasses import dataclass, field

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
    #: where the figures came from: ``nvml``, ``stand-in`` or ``dcgm``
    source: str = "nvml"
    #: DCGM: the GPU's number on its node, the pod holding it and the pod's namespace
    gpu: int | None = None
    pod: str = ""
    namespace: str = ""

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


@dataclass
class Readings:
    """One round of a source's figures: by GPU UUID (NVML, DCGM), by device number (the
    stand-in source) and, from DCGM, each GPU with the pod that holds it."""

    by_uuid: dict[str, Usage] = field(default_factory=dict)
    by_index: dict[int, Usage] = field(default_factory=dict)
    pods: tuple[Usage, ...] = ()


class UsageSource:
    """Where figures come from. `open` runs once in the sampler's thread (False: nothing
    can be read here), `read` every interval (it may block: it runs in that thread, never
    on an event loop), `close` at the end."""

    name = ""

    def open(self) -> bool:
        return True

    def read(self) -> Readings:  # pragma: no cover - every source defines it
        raise NotImplementedError

    def close(self) -> None:
        pass


class NvmlSource(UsageSource):
    """This machine's GPUs `uuids`, through NVML (``pynvml``, or the stand-in `nvml`)."""

    name = "nvml"

    def __init__(self, uuids, nvml=None):
        self.uuids = tuple(u for u in uuids if u)
        self._nvml = nvml

    def open(self) -> bool:
        if not self.uuids:
            return False
        if self._nvml is None:
            try:
                import pynvml
            except ImportError:
                return False
            self._nvml = pynvml
        try:
            self._nvml.nvmlInit()
        except Exception as e:
            log.info("GPU usage is not measured: NVML did not start (%s)", e)
            return False
        return True

    def read(self) -> Readings:
        return Readings(by_uuid=read_usage(self._nvml, self.uuids))

    def close(self) -> None:
        try:
            self._nvml.nvmlShutdown()
        except Exception:
            pass


class StandInSource(UsageSource):
    """Figures written into a JSON file, by device number: the usage of simulated GPUs, for
    tests and demonstrations (``c.GPUInventory.usage_source = "stand-in"``)::

        {"0": {"gpu_percent": 0, "memory_used_mib": 300, "memory_total_mib": 16384}}

    Only the file's owner can drive it: a file that is not a regular file, is a link, is
    owned by an account other than root or this process's, or is writable by its group or
    by others, is not read (logged once), so that nobody else can make a server look busy or
    idle. A missing file, or a device it does not name, is "not measured"."""

    name = "stand-in"

    def __init__(self, path):
        self.path = str(path)
        self._told = ""

    def _complain(self, why: str) -> Readings:
        if why != self._told:
            log.warning("Stand-in GPU usage file %s is not read: %s", self.path, why)
            self._told = why
        return Readings()

    def read(self) -> Readings:
        import json
        import os
        import stat

        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            return Readings()
        except OSError as e:
            return self._complain(str(e))
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                return self._complain("not a regular file")
            if info.st_uid not in (0, os.geteuid()):
                return self._complain("owned by another account")
            if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
                return self._complain("writable by others")
            with os.fdopen(os.dup(fd), "rb") as f:
                raw = f.read(1 << 20)
        finally:
            os.close(fd)
        try:
            figures = json.loads(raw or b"{}")
            now = time.time()
            out = {}
            for key, v in figures.items():
                out[int(key)] = Usage(uuid="", gpu_percent=int(v.get("gpu_percent", 0)),
                                      memory_used_mib=int(v.get("memory_used_mib", 0)),
                                      memory_total_mib=int(v.get("memory_total_mib", 0)),
                                      at=now, source=self.name)
        except (ValueError, TypeError, AttributeError) as e:
            return self._complain(f"not the expected JSON ({e})")
        self._told = ""
        return Readings(by_index=out)


# -- DCGM exporter (Kubernetes)

_LINE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)(?:\s+\S+)?\s*$')
_LABEL = re.compile(r'\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*"((?:[^"\\]|\\.)*)"\s*,?')
#: the DCGM fields read: utilisation (percent), framebuffer used and free (MiB)
DCGM_UTIL, DCGM_FB_USED, DCGM_FB_FREE = "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE"


def _labels(text: str) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(text):
        m = _LABEL.match(text, pos)
        if m is None:
            raise ValueError(f"bad labels: {text[pos:pos + 40]!r}")
        out[m.group(1)] = (m.group(2).replace("\\\\", "\x00").replace('\\"', '"')
                           .replace("\\n", "\n").replace("\x00", "\\"))
        pos = m.end()
    return out


def parse_dcgm(text: str, now: float | None = None) -> list[Usage]:
    """The GPUs on a DCGM exporter's page (Prometheus' text format): one `Usage` per GPU
    (``gpu`` and ``UUID`` labels) with its utilisation, memory used and total (used + free,
    MiB) and, where the exporter runs with its Kubernetes mapping, the ``pod`` and
    ``namespace`` that hold it. Comments, other metrics and lines that are not samples are
    skipped; a GPU with no utilisation sample is left out."""
    now = time.time() if now is None else now
    gpus: dict[tuple, dict] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None or m.group(1) not in (DCGM_UTIL, DCGM_FB_USED, DCGM_FB_FREE):
            continue
        try:
            labels = _labels(m.group(2) or "")
            value = float(m.group(3))
        except ValueError:
            continue
        key = (labels.get("Hostname", ""), labels.get("UUID", ""), labels.get("gpu", ""))
        entry = gpus.setdefault(key, {"labels": labels})
        entry[m.group(1)] = value
        for k in ("pod", "namespace"):  # a later line of the same GPU may carry them
            if labels.get(k) and not entry["labels"].get(k):
                entry["labels"][k] = labels[k]
    out = []
    for (_, uuid, gpu), e in gpus.items():
        if DCGM_UTIL not in e:
            continue
        used = int(e.get(DCGM_FB_USED, 0))
        labels = e["labels"]
        out.append(Usage(uuid=uuid, gpu_percent=int(e[DCGM_UTIL]), memory_used_mib=used,
                         memory_total_mib=used + int(e.get(DCGM_FB_FREE, 0)), at=now,
                         source="dcgm", gpu=int(gpu) if gpu.isdigit() else None,
                         pod=labels.get("pod", ""), namespace=labels.get("namespace", "")))
    return out


class DcgmSource(UsageSource):
    """NVIDIA's DCGM exporter's metrics at `url` (``c.GPUInventory.dcgm_url``, e.g.
    ``http://nvidia-dcgm-exporter.gpu-operator:9400/metrics``), read over HTTP in the
    sampler's thread with a `timeout`."""

    name = "dcgm"

    def __init__(self, url: str, timeout: float = 5.0):
        self.url, self.timeout = url, timeout
        self._failing = False

    def read(self) -> Readings:
        import urllib.request

        try:
            with urllib.request.urlopen(self.url, timeout=self.timeout) as r:  # noqa: S310
                text = r.read(16 << 20).decode("utf-8", "replace")
        except Exception as e:
            if not self._failing:
                log.warning("DCGM exporter at %s not read: %s", self.url, e)
                self._failing = True
            return Readings()
        self._failing = False
        found = parse_dcgm(text)
        return Readings(by_uuid={u.uuid: u for u in found if u.uuid}, pods=tuple(found))


def _plain_slug(name: str) -> str:
    return name.lower()


def pod_owner(usage: Usage, allocations, *, namespace_template: str = "gpulab-{username}",
              pod_template: str = "jupyter-{user_server}", slug=_plain_slug):
    """The open allocation among `allocations` (ledger `Allocation`s) whose pod holds the GPU
    of `usage` (a DCGM figure with ``pod`` and ``namespace``), or None.

    Pods are named as gpulab names them: a notebook server's as KubeSpawner's
    `pod_template` (``jupyter-{user_server}``: ``<user>`` for a default server,
    ``<user>--<server>`` for a named one), a training replica's as its JobSet's pods
    (``<job>-<role>-<i>-<j>-<suffix>``), both in the person's namespace (`namespace_template`).
    `slug` escapes a name as KubeSpawner does (the service passes KubeSpawner's own)."""
    if not usage.pod:
        return None
    for a in allocations:
        user = slug(a.user)
        if usage.namespace and usage.namespace != namespace_template.format(username=user):
            continue
        if a.kind == "notebook":
            server = user if a.holder in ("", "default") else f"{user}--{slug(a.holder)}"
            if usage.pod == pod_template.format(user_server=server, username=user):
                return a
        elif a.kind == "job" and _replica_pod(a.holder, usage.pod):
            return a
    return None


#: the roles of a training job's replicas (`gpulab.extensions.contract`), the word after the
#: job's name in its pods' names
REPLICA_ROLES = ("chief", "ps", "worker", "evaluator")


def _replica_pod(job: str, pod: str) -> bool:
    """Whether `pod` is a replica pod of `job` (``<job>-<role>-[<i>-]<index>-<suffix>``), so
    that job ``digits`` does not take the pods of job ``digits-big``."""
    if not pod.startswith(job + "-"):
        return False
    parts = pod[len(job) + 1:].split("-")
    return len(parts) >= 3 and parts[0] in REPLICA_ROLES and parts[-2].isdigit()


class UsageSampler:
    """Reads a usage source every `interval` seconds in a daemon thread (by default NVML
    over `uuids`; `source`: any `UsageSource`).

    `snapshot()` returns the latest figures by UUID at once (never waits for the source),
    `readings()` all of them. The thread starts with the first call (so a process that never
    shows usage never loads NVML) and stops with `close()`. With nothing to read (no driver,
    no GPUs, no ``pynvml``) it stays empty and `available` is False. `rounds` counts the
    reads done (the benchmark's and the tests' clock).
    """

    def __init__(self, uuids=(), interval: float = 5.0, nvml=None, source: UsageSource | None = None):
        self.uuids = tuple(u for u in uuids if u)
        self.interval = max(0.05, float(interval))
        self.source = source if source is not None else NvmlSource(self.uuids, nvml=nvml)
        self._latest = Readings()
        self._lock = threading.Lock()
        self._started = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.available = bool(self.uuids) or source is not None
        self.rounds = 0

    def _run(self) -> None:
        if not self.source.open():
            self.available = False
            return
        try:
            while not self._stop.is_set():
                try:
                    figures = self.source.read()
                except Exception:  # a source's bug must not end the sampling for good
                    log.exception("GPU usage source %s failed", self.source.name)
                    figures = Readings()
                with self._lock:
                    self._latest = figures
                    self.rounds += 1
                self._stop.wait(self.interval)
        finally:
            self.source.close()

    def start(self) -> None:
        with self._lock:
            if self._started or not self.available:
                return
            self._started = True
        self._thread = threading.Thread(target=self._run, name="gpulab-gpu-usage", daemon=True)
        self._thread.start()

    def readings(self) -> Readings:
        self.start()
        with self._lock:
            return self._latest

    def snapshot(self) -> dict[str, Usage]:
        return dict(self.readings().by_uuid)

    def wait_first(self, timeout: float = 5.0) -> dict[str, Usage]:
        """The first complete reading (for the GPU check and tests), or what there is."""
        self.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.available:
            with self._lock:
                if self.rounds and self._latest.by_uuid:
                    return dict(self._latest.by_uuid)
            time.sleep(0.05)
        return self.snapshot()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def device_usage(index: int, uuid: str, simulated: bool, figures: dict[str, Usage],
                 by_index: dict[int, Usage] | None = None) -> dict:
    """What the API says about one device: its figures, or why there are none.

    ``{"device": 0, "measured": true, "gpu_percent": 37, "memory_used_mib": 12000,
    "memory_total_mib": 81559, "at": ..., "source": "nvml", "text": "GPU 0: 37% busy, 11.7
    of 79.6 GiB"}``, or ``{"device": 0, "measured": false, "why": "simulated", "text": ...}``
    (``"simulated"``: a stand-in GPU, nothing to measure; ``"not measured"``: NVML is not
    available here or could not read this GPU). `by_index`: the stand-in source's figures,
    which a simulated GPU shows too (``"source": "stand-in"``, ``"simulated": true``)."""
    if by_index and (usage := by_index.get(index)) is not None:
        entry = {"device": index, "measured": True, **usage.to_dict(), "source": usage.source,
                 "simulated": simulated}
    elif simulated:
        entry = {"device": index, "measured": False, "why": "simulated"}
    elif (usage := figures.get(uuid)) is None:
        entry = {"device": index, "measured": False, "why": "not measured"}
    else:
        entry = {"device": index, "measured": True, **usage.to_dict(), "source": usage.source}
    # the words every page, the CLI and the JobView show, written once here
    entry["text"] = usage_text(entry)
    return entry


def usage_text(entry: dict) -> str:
    """``"GPU 0: 37% busy, 11.7 of 79.6 GiB"`` / ``"GPU 0: simulated (nothing to measure)"``
    / ``"GPU 0: 37% busy, 0.3 of 16.0 GiB (stand-in figures, simulated GPU)"``."""
    head = f"GPU {entry['device']}"
    if not entry.get("measured"):
        if entry.get("why") == "simulated":
            return f"{head}: simulated (nothing to measure)"
        return f"{head}: usage not measured"
    text = (f"{head}: {entry['gpu_percent']}% busy, "
            f"{entry['memory_used_mib'] / 1024:.1f} of {entry['memory_total_mib'] / 1024:.1f} GiB")
    if entry.get("source") == "stand-in":
        text += " (stand-in figures, simulated GPU)" if entry.get("simulated") else " (stand-in figures)"
    return text


def usage_source(settings: dict | None, uuids=(), nvml=None) -> UsageSource | None:
    """The source `settings` name (``GPUInventory.usage_settings``: ``{"source": "nvml" |
    "stand-in" | "dcgm", "stand_in_file": ..., "dcgm_url": ...}``); None for NVML, the
    sampler's default."""
    settings = settings or {}
    kind = settings.get("source") or "nvml"
    if kind == "stand-in":
        return StandInSource(settings["stand_in_file"])
    if kind == "dcgm":
        return DcgmSource(settings["dcgm_url"])
    return None


class PoolUsage:
    """The figures of a ledger pool's devices, by device number, for the gpulab service.

    `devices` are the pool's device records (index, uuid, simulated); with NVML only real ones
    are sampled. `entries([0, 3])` gives `device_usage` for each, at once; `entries_for(a)`
    those of an allocation (its devices, or on Kubernetes the GPUs DCGM sees in its pods,
    `pod_owner`). `source`: another `UsageSource` than NVML (the stand-in, DCGM);
    `owner_of(usage, allocations)`: how DCGM's pods map to holders."""

    def __init__(self, devices, interval: float = 5.0, nvml=None, source: UsageSource | None = None,
                 owner_of=None):
        self.devices = {d.index: d for d in devices}
        self.owner_of = owner_of or pod_owner
        real = [d.uuid for d in devices if not d.simulated]
        if source is not None and interval:
            self.sampler = UsageSampler(real, interval, source=source)
        else:
            self.sampler = UsageSampler(real, interval, nvml=nvml) if real and interval else None

    @property
    def source(self) -> str:
        return self.sampler.source.name if self.sampler is not None else ""

    def readings(self) -> Readings:
        return self.sampler.readings() if self.sampler is not None else Readings()

    def entries(self, indexes, readings: Readings | None = None) -> list[dict]:
        r = self.readings() if readings is None else readings
        out = []
        for i in indexes:
            d = self.devices.get(i)
            out.append(device_usage(i, d.uuid if d else "", bool(d and d.simulated), r.by_uuid,
                                    r.by_index))
        return out

    def entries_for(self, alloc, allocations=None, readings: Readings | None = None) -> list[dict]:
        """The figures of an allocation's GPUs: by its devices, or (a counting pool, DCGM)
        those of the GPUs in its pods; `allocations`: the open ones it is told apart from."""
        r = self.readings() if readings is None else readings
        if alloc.devices:
            return self.entries(alloc.devices, r)
        others = allocations if allocations is not None else [alloc]
        out = []
        for u in r.pods:
            owner = self.owner_of(u, others)
            if owner is not None and owner.id == alloc.id:
                out.append(self._pod_entry(u, len(out)))
        return out

    def by_allocation(self, allocations, readings: Readings | None = None) -> dict[str, list[dict]]:
        """`entries_for` of every allocation at once (the culler's round): each DCGM figure's
        owner is looked up once, not once per allocation."""
        r = self.readings() if readings is None else readings
        out = {a.id: (self.entries(a.devices, r) if a.devices else []) for a in allocations}
        counting = [a for a in allocations if not a.devices]
        if counting and r.pods:
            for u in r.pods:
                owner = self.owner_of(u, counting)
                if owner is not None:
                    out[owner.id].append(self._pod_entry(u, len(out[owner.id])))
        return out

    @staticmethod
    def _pod_entry(u: Usage, n: int) -> dict:
        entry = {"device": u.gpu if u.gpu is not None else n, "measured": True, **u.to_dict(),
                 "source": u.source, "pod": u.pod, "namespace": u.namespace}
        entry["text"] = usage_text(entry)
        return entry

    def close(self) -> None:
        if self.sampler is not None:
            self.sampler.close()
