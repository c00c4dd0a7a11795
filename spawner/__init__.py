"""GPU spawning for gpulab: profiles, the GPU inventory, the shared spawner mixin and spawners.

- `LocalGPUSpawner`: local processes bound to whole GPUs (the embedded default).
- `GPUSpawnerMixin`: admission through the quota ledger, release and state, shared with the
  Kubernetes spawner.
"""

from .inventory import GPU, GPUInventory
from .local import LocalGPUSpawner
from .mixin import GPULedger, GPUSpawnerMixin, SpawnRefused
from .profiles import GPUProfile, ProfileError, parse_profiles

__all__ = [
    "GPU",
    "GPUInventory",
    "GPULedger",
    "GPUProfile",
    "GPUSpawnerMixin",
    "LocalGPUSpawner",
    "ProfileError",
    "SpawnRefused",
    "parse_profiles",
]
