"""GPU spawning for gpulab: profiles, the GPU inventory, the shared spawner mixin and spawners.

- `LocalGPUSpawner`: local processes bound to whole GPUs (the embedded default).
- `GPUSpawnerMixin`: admission, release and state shared with the Kubernetes spawner.
"""

from .allocator import GPUAllocator, Holder, InsufficientGPUs
from .inventory import GPU, GPUInventory
from .local import LocalGPUSpawner
from .mixin import GPUSpawnerMixin, SpawnRefused
from .profiles import GPUProfile, ProfileError, parse_profiles

__all__ = [
    "GPU",
    "GPUAllocator",
    "GPUInventory",
    "GPUProfile",
    "GPUSpawnerMixin",
    "Holder",
    "InsufficientGPUs",
    "LocalGPUSpawner",
    "ProfileError",
    "SpawnRefused",
    "parse_profiles",
]
