"""The NVML path with a stand-in module: no physical GPU can be present here."""

from types import SimpleNamespace

from gpulab.hub.machine.inventory import GPUInventory, discover_gpus


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

    def nvmlDeviceGetMinorNumber(self, h):
        return 2 * h + 1  # /dev/nvidia1, /dev/nvidia3: minors need not equal indexes


class NoDriver(FakeNVML):
    """Stands in for pynvml where the NVIDIA driver is missing."""

    def nvmlInit(self):
        raise OSError("libnvidia-ml.so.1 not found")


def test_nvml_inventory():
    gpus = discover_gpus(FakeNVML())
    assert [(g.index, g.uuid, g.model, g.memory_mib, g.simulated, g.minor) for g in gpus] == [
        (0, "GPU-0-uuid", "NVIDIA-H100-80GB-HBM3", 81920, False, 1),
        (1, "GPU-1-uuid", "NVIDIA-H100-80GB-HBM3", 81920, False, 3),
    ]


def test_no_driver_means_no_gpus():
    assert discover_gpus(NoDriver()) == []


def test_simulated_fallback_is_labelled():
    inv = GPUInventory(source="simulated", simulated_gpus=3)
    gpus = inv.discover()
    assert len(gpus) == 3 and all(g.simulated for g in gpus)
    assert "simulated" in gpus[0].label
    assert GPUInventory(source="simulated", simulated_gpus=0).discover() == []
    assert [g.minor for g in gpus] == [0, 1, 2]


class NoMinorNumber(FakeNVML):
    """Stands in for an NVML without nvmlDeviceGetMinorNumber: the driver's /proc record."""

    def nvmlDeviceGetMinorNumber(self, h):
        raise AttributeError("nvmlDeviceGetMinorNumber")


def test_minor_numbers_from_the_drivers_record(tmp_path, monkeypatch):
    from gpulab.hub.machine import inventory

    for bus, uuid, minor in (("0000:17:00.0", "GPU-0-uuid", 4), ("0000:65:00.0", "GPU-1-uuid", 7)):
        (tmp_path / bus).mkdir()
        (tmp_path / bus / "information").write_text(
            f"Model: \t\t NVIDIA H100\nIRQ:   \t\t 100\nGPU UUID: \t {uuid}\n"
            f"Video BIOS: \t ??.??.??.??.??\nBus Type: \t PCIe\nDevice Minor: \t {minor}\n")
    real = inventory._proc_minor
    monkeypatch.setattr(inventory, "_proc_minor", lambda uuid: real(uuid, str(tmp_path)))
    assert [g.minor for g in discover_gpus(NoMinorNumber())] == [4, 7]
