"""GPU spawning for gpulab: profiles, the GPU inventory, the shared spawner mixin and spawners.

- `LocalGPUSpawner`: local processes bound to whole GPUs (the embedded default).
- `KubeGPUSpawner` (``gpulab.spawner.kube``): pods in each user's namespace on a cluster; imported
  on first use, so the local hub does not load the Kubernetes client.
- `GPUSpawnerMixin`: admission through the quota ledger, release and state, shared with the
  Kubernetes spawner.
"""

from .inventory import GPU, GPUInventory
from .local import LocalGPUSpawner
from .mixin import GPULedger, GPUSpawnerMixin, SpawnRefused
from .profiles import GPUProfile, ProfileError, parse_profiles


def __getattr__(name):
    if name == "KubeGPUSpawner":
        from .kube import KubeGPUSpawner

        return KubeGPUSpawner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GPU",
    "GPUInventory",
    "GPULedger",
    "GPUProfile",
    "GPUSpawnerMixin",
    "KubeGPUSpawner",
    "LocalGPUSpawner",
    "ProfileError",
    "SpawnRefused",
    "parse_profiles",
]
