"""The machine's GPUs: read with NVML where GPUs exist, simulated where none do.

`discover_gpus` is a pure function over an NVML-like module so that tests can hand it a
stand-in; `GPUInventory` is the hub-wide configurable that holds the result.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from traitlets import CaselessStrEnum, Float, Integer, Unicode, default
from traitlets.config import SingletonConfigurable

# the queue's and the profiles' one rule (the quota layer's, so that the queue matches models
# as profiles do); imported from here by the spawner's modules
from gpulab.hub.quota.queue import model_matches, normalize_model  # noqa: F401,E402

SIMULATED_MODEL = "Simulated-GPU"


@dataclass(frozen=True)
class GPU:
    """One GPU of this machine, as handed to servers and jobs."""

    index: int
    uuid: str
    model: str
    memory_mib: int
    simulated: bool
    #: the minor number of its device node ``/dev/nvidia<minor>`` (major 195), which the
    #: kernel's device allow-list of a server or replica names; simulated GPUs use the index
    minor: int = -1

    def __post_init__(self):
        if self.minor < 0:
            object.__setattr__(self, "minor", self.index)

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def label(self) -> str:
        """A short description for people, e.g. "GPU 1: NVIDIA-H100 (80 GiB)"."""
        what = f"{self.model} (simulated)" if self.simulated else self.model
        if self.memory_mib:
            what += f", {self.memory_mib // 1024} GiB"
        return f"GPU {self.index}: {what}"


def discover_gpus(nvml) -> list[GPU]:
    """Read the GPUs through an NVML module (``pynvml``); [] when there is no driver or GPU."""
    try:
        nvml.nvmlInit()
    except Exception:
        return []
    try:
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(handle)
            uuid = nvml.nvmlDeviceGetUUID(handle)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            try:
                minor = int(nvml.nvmlDeviceGetMinorNumber(handle))
            except Exception:  # not every NVML build has it: the driver's own record
                minor = _proc_minor(uuid.decode() if isinstance(uuid, bytes) else uuid)
            gpus.append(
                GPU(
                    index=i,
                    uuid=uuid.decode() if isinstance(uuid, bytes) else uuid,
                    model=normalize_model(name.decode() if isinstance(name, bytes) else name),
                    memory_mib=int(mem.total) // (1024 * 1024),
                    simulated=False,
                    minor=i if minor is None else minor,
                )
            )
        return gpus
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _proc_minor(uuid: str, root: str = "/proc/driver/nvidia/gpus") -> int | None:
    """The "Device Minor" the NVIDIA driver lists for the GPU `uuid`, or None."""
    import glob

    for info in glob.glob(f"{root}/*/information"):
        try:
            fields = dict(
                (k.strip(), v.strip())
                for k, _, v in (line.partition(":") for line in open(info).read().splitlines())
            )
        except OSError:
            continue
        if fields.get("GPU UUID") == uuid and fields.get("Device Minor", "").isdigit():
            return int(fields["Device Minor"])
    return None


def simulated_gpus(count: int, model: str = SIMULATED_MODEL, memory_mib: int = 0) -> list[GPU]:
    """`count` stand-in GPUs, labelled as simulated in every place they appear."""
    return [
        GPU(
            index=i,
            uuid=f"GPU-simulated-{i:04d}",
            model=normalize_model(model),
            memory_mib=memory_mib,
            simulated=True,
            minor=i,
        )
        for i in range(count)
    ]


class GPUInventory(SingletonConfigurable):
    """The GPUs this hub hands out (one per hub process)."""

    source = CaselessStrEnum(
        ["auto", "nvml", "simulated"],
        default_value="auto",
        help="""Where the GPU list comes from.

        - ``auto`` (default): the GPUs NVML reports; simulated GPUs where NVML finds none.
        - ``nvml``: NVML only; a machine without GPUs then offers none.
        - ``simulated``: always simulated GPUs, even where real ones exist.

        Example: ``c.GPUInventory.source = "simulated"``
        """,
    ).tag(config=True)

    simulated_gpus = Integer(
        4,
        min=0,
        help="""How many simulated GPUs stand in where no real GPU is found (default 4; 0 allowed).

        Simulated GPUs are numbered from 0, shown as simulated in the spawn form, the API and
        the ``GPULAB_GPUS`` variable, and give processes ``CUDA_VISIBLE_DEVICES`` as real ones
        would. Servers and job replicas on them also get ``TF_ENABLED_DEVICE_TYPES=CPU``:
        TensorFlow then runs on the CPU without looking for a CUDA driver (which would log
        ``failed call to cuInit`` as an error). Example: ``c.GPUInventory.simulated_gpus = 8``
        """,
    ).tag(config=True)

    simulated_model = Unicode(
        SIMULATED_MODEL,
        help="""Model name of the simulated GPUs (default ``Simulated-GPU``).

        Set it to a real product label (e.g. ``NVIDIA-H100``) to try profiles that select a
        model. Example: ``c.GPUInventory.simulated_model = "NVIDIA-H100"``
        """,
    ).tag(config=True)

    simulated_memory_mib = Integer(
        0, min=0, help="Memory reported for each simulated GPU, in MiB (default 0: unknown)."
    ).tag(config=True)

    usage_interval = Float(
        5.0,
        min=0,
        help="""How often, in seconds, NVML is asked how busy each real GPU is and how much of
        its memory is used (default 5; 0: never). The figures appear beside each holding on the
        spawn page, the admin page, the user page, the API and a job's replicas. Simulated GPUs
        have nothing to measure and say so. Example: ``c.GPUInventory.usage_interval = 10``
        """,
    ).tag(config=True)

    usage_source = CaselessStrEnum(
        ["nvml", "stand-in", "dcgm"],
        default_value="nvml",
        help="""Where the GPU usage figures (utilisation, memory) come from, read every
        `usage_interval` seconds by the gpulab service and by the hub.

        - ``nvml`` (default): this machine's driver; simulated GPUs say "simulated".
        - ``stand-in``: the JSON file `usage_stand_in_file`, by device number
          (``{"0": {"gpu_percent": 0, "memory_used_mib": 300, "memory_total_mib": 16384}}``),
          for simulated GPUs: tests and demonstrations of GPU-idle culling (``c.GPUIdle``).
          Only a file owned by root or the hub's account and not writable by others is read.
        - ``dcgm``: NVIDIA's DCGM exporter on Kubernetes (`dcgm_url`); each GPU is labelled
          with the pod that holds it and so with its server or job.

        Example: ``c.GPUInventory.usage_source = "dcgm"``
        """,
    ).tag(config=True)

    usage_stand_in_file = Unicode(
        "",
        help="""The stand-in usage file (``usage_source = "stand-in"``); default: empty, which
        means ``<data-dir>/gpu-usage.json`` in `gpulab up`.
        Example: ``c.GPUInventory.usage_stand_in_file = "/srv/gpulab/gpu-usage.json"``
        """,
    ).tag(config=True)

    dcgm_url = Unicode(
        "",
        help="""The DCGM exporter's metrics URL (``usage_source = "dcgm"``), Prometheus' text
        format with ``DCGM_FI_DEV_GPU_UTIL``, ``DCGM_FI_DEV_FB_USED`` and
        ``DCGM_FI_DEV_FB_FREE`` and the exporter's ``pod``/``namespace`` labels (its
        Kubernetes mapping, on by default in the GPU operator). Example:
        ``c.GPUInventory.dcgm_url = "http://nvidia-dcgm-exporter.gpu-operator.svc:9400/metrics"``
        """,
    ).tag(config=True)

    def usage_settings(self) -> dict:
        """The usage source's settings, for the gpulab service
        (`gpulab.hub.machine.gpuusage.usage_source`)."""
        if self.usage_source == "stand-in" and not self.usage_stand_in_file:
            raise ValueError("c.GPUInventory.usage_source = 'stand-in' needs "
                             "c.GPUInventory.usage_stand_in_file.")
        if self.usage_source == "dcgm" and not self.dcgm_url:
            raise ValueError("c.GPUInventory.usage_source = 'dcgm' needs c.GPUInventory.dcgm_url.")
        return {"source": self.usage_source, "stand_in_file": self.usage_stand_in_file,
                "dcgm_url": self.dcgm_url}

    @default("source")
    def _source_default(self):
        import os

        return os.environ.get("GPULAB_GPU_SOURCE", "auto")

    def discover(self) -> list[GPU]:
        gpus: list[GPU] = []
        if self.source in ("auto", "nvml"):
            try:
                import pynvml
            except ImportError:  # pragma: no cover - nvidia-ml-py is a dependency
                pynvml = None
            if pynvml is not None:
                gpus = discover_gpus(pynvml)
        if self.source == "simulated" or (self.source == "auto" and not gpus):
            gpus = simulated_gpus(
                self.simulated_gpus, self.simulated_model, self.simulated_memory_mib
            )
        return gpus

    _gpus: list[GPU] | None = None

    @property
    def gpus(self) -> list[GPU]:
        """The GPU list, read once per process."""
        if self._gpus is None:
            self._gpus = self.discover()
            kind = "simulated" if any(g.simulated for g in self._gpus) else "NVML"
            self.log.info(
                "GPU inventory (%s): %s", kind, ", ".join(g.label for g in self._gpus) or "none"
            )
        return self._gpus

    _sampler = None

    def usage(self) -> dict:
        """The latest NVML figures of this machine's real GPUs, by UUID ({} where none are
        measured); the first call starts the sampling thread and never waits for NVML."""
        return dict(self.usage_readings().by_uuid)

    def usage_readings(self):
        """The latest `gpulab.hub.machine.gpuusage.Readings` of `usage_source` (the stand-in
        file's figures by device number too); never waits for the source."""
        from .gpuusage import Readings, UsageSampler, usage_source

        real = [g.uuid for g in self.gpus if not g.simulated]
        stand_in = self.usage_source == "stand-in" and self.usage_stand_in_file
        source = (usage_source(self.usage_settings()) if stand_in
                  else None)  # DCGM's figures are the service's (pods, not this machine)
        if not self.usage_interval or (not real and source is None):
            return Readings()
        if self._sampler is None:
            self._sampler = UsageSampler(real, self.usage_interval, source=source)
        return self._sampler.readings()

    def by_index(self, index: int) -> GPU | None:
        for gpu in self.gpus:
            if gpu.index == index:
                return gpu
        return None


def gpus_json(gpus) -> str:
    """The ``GPULAB_GPUS`` value: a JSON list of index, uuid, model, memory_mib, simulated."""
    return json.dumps([g.to_dict() for g in gpus])


def gpu_minor(index: int) -> int:
    """The device-node minor of this machine's GPU `index` (the hub-wide `GPUInventory`;
    the index itself for simulated GPUs and for an index it does not know)."""
    gpu = GPUInventory.instance().by_index(index)
    return index if gpu is None else gpu.minor
