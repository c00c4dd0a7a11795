"""GPU spawning for gpulab: profiles, the shared spawner mixin and spawners (the GPU inventory,
accounts, sandboxes and cgroups they stand on are `gpulab.hub.machine`'s; namespaces and
Kubernetes objects `gpulab.hub.cluster`'s).

- `LocalGPUSpawner`: local processes bound to whole GPUs (the embedded default).
- `KubeGPUSpawner` (``gpulab.spawner.kube``): pods in each user's namespace on a cluster; imported
  on first use, so the local hub does not load the Kubernetes client.
- `GPUSpawnerMixin`: admission through the quota ledger, release and state, shared with the
  Kubernetes spawner.
"""

from .local import LocalGPUSpawner
from .mixin import GPUSpawnerMixin, SpawnRefused
from .profiles import GPUProfile, ProfileError, parse_profiles


def __getattr__(name):
    if name == "KubeGPUSpawner":
        from .kube import KubeGPUSpawner

        return KubeGPUSpawner
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "GPUProfile",
    "GPUSpawnerMixin",
    "KubeGPUSpawner",
    "LocalGPUSpawner",
    "ProfileError",
    "SpawnRefused",
    "parse_profiles",
]
