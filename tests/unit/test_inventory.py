"""The NVML path with a stand-in module: no physical GPU can be present here."""

from types import SimpleNamespace

from gpulab.spawner.inventory import GPUInventory, discover_gpus


class FakeNVML:
    """Stands in for pynvml on a machine with two GPUs (mock: no GPU exists here)."""

    def nvmlInit(self):
        pass

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetCount(self):
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetName(self, h):
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, h):
        return f"GPU-{h}-uuid"

    def nvmlDeviceGetMemoryInfo(self, h):
        return SimpleNamespace(total=80 * 1024**3)


class NoDriver(FakeNVML):
    """Stands in for pynvml where the NVIDIA driver is missing."""

    def nvmlInit(self):
        raise OSError("libnvidia-ml.so.1 not found")


def test_nvml_inventory():
    gpus = discover_gpus(FakeNVML())
    assert [(g.index, g.uuid, g.model, g.memory_mib, g.simulated) for g in gpus] == [
        (0, "GPU-0-uuid", "NVIDIA-H100-80GB-HBM3", 81920, False),
        (1, "GPU-1-uuid", "NVIDIA-H100-80GB-HBM3", 81920, False),
    ]


def test_no_driver_means_no_gpus():
    assert discover_gpus(NoDriver()) == []


def test_simulated_fallback_is_labelled():
    inv = GPUInventory(source="simulated", simulated_gpus=3)
    gpus = inv.discover()
    assert len(gpus) == 3 and all(g.simulated for g in gpus)
    assert "simulated" in gpus[0].label
    assert GPUInventory(source="simulated", simulated_gpus=0).discover() == []
