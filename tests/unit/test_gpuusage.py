"""GPU usage from NVML: the reading, the sampler and the words shown.

NVML itself needs a physical GPU, so these tests hand the code a stand-in module with NVML's
calls (the same calls `pynvml` offers); `tests/gpu/check_nvml.py` runs the same code against
the real driver on a machine with a GPU.
"""

import threading
import time
from types import SimpleNamespace

import pytest

from gpulab.hub.machine.gpuusage import PoolUsage, UsageSampler, device_usage, read_usage, usage_text
from gpulab.hub.machine.inventory import GPUInventory

MIB = 1024 * 1024


class FakeNVML:
    """A stand-in for pynvml (no GPU here): devices by UUID with settable figures."""

    class NVMLError(Exception):
        pass

    def __init__(self, devices: dict[str, tuple[int, int, int]], init_fails=False):
        self.devices = dict(devices)  # uuid -> (gpu %, used MiB, total MiB)
        self.init_fails = init_fails
        self.inits = self.shutdowns = self.reads = 0
        self.read_event = threading.Event()

    def nvmlInit(self):
        if self.init_fails:
            raise self.NVMLError("Driver Not Loaded")
        self.inits += 1

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetHandleByUUID(self, uuid):
        if uuid not in self.devices:
            raise self.NVMLError("Not Found")
        return uuid

    def nvmlDeviceGetUtilizationRates(self, handle):
        self.reads += 1
        self.read_event.set()
        return SimpleNamespace(gpu=self.devices[handle][0], memory=0)

    def nvmlDeviceGetMemoryInfo(self, handle):
        _, used, total = self.devices[handle]
        return SimpleNamespace(used=used * MIB, total=total * MIB, free=(total - used) * MIB)


def test_read_usage_reads_each_gpu_and_leaves_out_one_it_cannot_read():
    nvml = FakeNVML({"GPU-a": (37, 12000, 81559), "GPU-b": (0, 0, 81559)})
    got = read_usage(nvml, ["GPU-a", "GPU-gone", "GPU-b"], now=100.0)
    assert set(got) == {"GPU-a", "GPU-b"}
    assert got["GPU-a"].to_dict() == {"gpu_percent": 37, "memory_used_mib": 12000,
                                      "memory_total_mib": 81559, "at": 100.0}


def test_the_words_for_measured_simulated_and_unreadable_gpus():
    nvml = FakeNVML({"GPU-a": (37, 12000, 81559)})
    figures = read_usage(nvml, ["GPU-a"], now=1.0)
    measured = device_usage(2, "GPU-a", False, figures)
    assert measured["measured"] is True and measured["gpu_percent"] == 37
    assert measured["text"] == "GPU 2: 37% busy, 11.7 of 79.6 GiB"
    sim = device_usage(0, "GPU-simulated-0000", True, figures)
    assert sim == {"device": 0, "measured": False, "why": "simulated",
                   "text": "GPU 0: simulated (nothing to measure)"}
    lost = device_usage(1, "GPU-lost", False, figures)
    assert lost["why"] == "not measured" and lost["text"] == usage_text(lost) == \
        "GPU 1: usage not measured"


def test_the_sampler_reads_in_its_own_thread_and_readers_never_wait():
    nvml = FakeNVML({"GPU-a": (10, 100, 1000)})
    s = UsageSampler(["GPU-a"], interval=0.5, nvml=nvml)
    try:
        assert nvml.inits == 0  # nothing loaded until someone asks
        first = s.wait_first(timeout=5)
        assert first["GPU-a"].gpu_percent == 10 and nvml.inits == 1
        nvml.devices["GPU-a"] = (90, 500, 1000)
        deadline = time.monotonic() + 5
        while s.snapshot()["GPU-a"].gpu_percent != 90:
            assert time.monotonic() < deadline, "the sampler never read again"
            time.sleep(0.05)
        # a reader never calls NVML itself: a snapshot costs no read
        reads = nvml.reads
        for _ in range(100):
            s.snapshot()
        assert nvml.reads - reads <= 2  # at most the thread's own reads meanwhile
    finally:
        s.close()
    assert nvml.shutdowns == 1


def test_no_driver_means_no_figures_and_no_error():
    s = UsageSampler(["GPU-a"], interval=0.5, nvml=FakeNVML({}, init_fails=True))
    try:
        assert s.wait_first(timeout=2) == {}
        assert s.available is False
    finally:
        s.close()


def test_pool_usage_by_device_number():
    dev = SimpleNamespace
    devices = [dev(index=0, uuid="GPU-a", simulated=False), dev(index=1, uuid="GPU-b",
                                                                  simulated=False)]
    nvml = FakeNVML({"GPU-a": (50, 2048, 4096)})  # GPU-b is not readable
    pool = PoolUsage(devices, interval=0.5, nvml=nvml)
    try:
        pool.sampler.wait_first(timeout=5)
        got = pool.entries([0, 1, 7])
        assert [e["measured"] for e in got] == [True, False, False]
        assert got[0]["text"] == "GPU 0: 50% busy, 2.0 of 4.0 GiB"
    finally:
        pool.close()
    # simulated pools start no thread at all
    sim = PoolUsage([dev(index=0, uuid="GPU-simulated-0000", simulated=True)], interval=5)
    assert sim.sampler is None
    assert sim.entries([0])[0]["why"] == "simulated"


@pytest.mark.parametrize("interval", [0.0, 5.0])
def test_inventory_usage_of_simulated_gpus_is_empty(interval):
    inv = GPUInventory(source="simulated", simulated_gpus=2, usage_interval=interval)
    assert inv.usage() == {} and inv._sampler is None
