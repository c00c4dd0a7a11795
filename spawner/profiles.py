"""GPU profiles in KubeSpawner's ``profile_list`` shape, so one list serves both modes.

A profile is a KubeSpawner profile (z2jh ``singleuser.profileList`` entry)::

    {
        "display_name": "2 GPUs (H100)",
        "slug": "gpu-2",                       # optional, derived from display_name
        "description": "For multi-GPU work",
        "default": True,
        "kubespawner_override": {
            "extra_resource_limits": {"nvidia.com/gpu": "2"},
            "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100"},
            "cpu_limit": 8,
            "mem_limit": "32G",
        },
    }

The GPU count is the ``nvidia.com/gpu`` resource limit and the GPU model the
``nvidia.com/gpu.product`` node selector. Override keys are KubeSpawner trait names
(``node_selector``, not ``nodeSelector``): a misspelt key is a configuration error.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field

GPU_RESOURCE = "nvidia.com/gpu"
GPU_MODEL_LABEL = "nvidia.com/gpu.product"

# Override keys that LocalGPUSpawner applies; every other KubeSpawner trait is accepted and
# only used in Kubernetes mode.
LOCAL_OVERRIDES = {
    "extra_resource_limits",
    "extra_resource_guarantees",
    "node_selector",
    "cpu_limit",
    "cpu_guarantee",
    "mem_limit",
    "mem_guarantee",
    "environment",
    "default_url",
}


class ProfileError(ValueError):
    """A profile list that cannot be used; the message names the profile and the key."""


@dataclass(frozen=True)
class GPUProfile:
    slug: str
    display_name: str
    description: str
    gpus: int
    model: str | None
    cpu_limit: float | None
    mem_limit: str | None
    default: bool
    override: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def summary(self) -> str:
        """E.g. "2 GPUs (NVIDIA-H100), 8 CPUs, 32G memory" or "no GPU"."""
        parts = []
        if self.gpus:
            parts.append(
                f"{self.gpus} GPU{'s' if self.gpus != 1 else ''}"
                + (f" ({self.model})" if self.model else "")
            )
        else:
            parts.append("no GPU")
        if self.cpu_limit:
            cpus = f"{self.cpu_limit:g}"
            parts.append(f"{cpus} CPU{'s' if cpus != '1' else ''}")
        if self.mem_limit:
            parts.append(f"{self.mem_limit} memory")
        return ", ".join(parts)


def slugify(name: str) -> str:
    """A slug like KubeSpawner's: lower case, runs of other characters become one dash."""
    slug = re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")
    return slug or "profile"


@functools.lru_cache(maxsize=1)
def _kubespawner_traits() -> frozenset[str]:
    """KubeSpawner's trait names. Importing kubespawner (its Kubernetes client) costs a
    process about 40 MiB, so callers ask only for keys that are not local ones."""
    try:
        from kubespawner import KubeSpawner
    except ImportError:  # pragma: no cover - kubespawner is a dependency
        return frozenset(LOCAL_OVERRIDES)
    return frozenset(KubeSpawner.class_trait_names())


def _gpu_count(value, where: str) -> int:
    try:
        text = str(value).strip()
        if not re.fullmatch(r"\d+", text):
            raise ValueError
        return int(text)
    except (TypeError, ValueError):
        raise ProfileError(
            f"{where}: the {GPU_RESOURCE} limit must be a whole number >= 0, got {value!r}."
        ) from None


def parse_profile(entry: dict, position: int, known_traits: set[str] | None = None) -> GPUProfile:
    where = f"profile_list[{position}]"
    if not isinstance(entry, dict):
        raise ProfileError(f"{where}: a profile must be a mapping, got {type(entry).__name__}.")
    name = entry.get("display_name")
    if not isinstance(name, str) or not name.strip():
        raise ProfileError(f"{where}: 'display_name' is required.")
    where = f"profile {name!r}"
    slug = entry.get("slug") or slugify(name)
    if not re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?", slug):
        raise ProfileError(f"{where}: slug {slug!r} must be lower-case letters, digits and dashes.")
    override = entry.get("kubespawner_override") or {}
    if not isinstance(override, dict):
        raise ProfileError(f"{where}: 'kubespawner_override' must be a mapping.")
    unknown = sorted(k for k in override if k not in LOCAL_OVERRIDES)
    if unknown:  # other KubeSpawner traits (an image, volumes…): a profile list for both modes
        known = known_traits if known_traits is not None else _kubespawner_traits()
        unknown = [k for k in unknown if k not in known]
    if unknown:
        raise ProfileError(
            f"{where}: unknown kubespawner_override key(s) {', '.join(unknown)} "
            "(keys are KubeSpawner trait names, e.g. node_selector, extra_resource_limits)."
        )
    limits = override.get("extra_resource_limits") or {}
    gpus = _gpu_count(limits.get(GPU_RESOURCE, 0), where)
    selector = override.get("node_selector") or {}
    model = selector.get(GPU_MODEL_LABEL) or None
    cpu = override.get("cpu_limit")
    if cpu is not None:
        try:
            cpu = float(cpu)
        except (TypeError, ValueError):
            raise ProfileError(f"{where}: cpu_limit must be a number, got {cpu!r}.") from None
        if cpu <= 0:
            raise ProfileError(f"{where}: cpu_limit must be > 0, got {cpu!r}.")
    mem = override.get("mem_limit")
    return GPUProfile(
        slug=slug,
        display_name=name.strip(),
        description=str(entry.get("description") or ""),
        gpus=gpus,
        model=model,
        cpu_limit=cpu,
        mem_limit=str(mem) if mem is not None else None,
        default=bool(entry.get("default")),
        override=dict(override),
    )


def parse_profiles(profile_list: list) -> list[GPUProfile]:
    """Validate a whole profile list; raises `ProfileError` naming the first bad entry."""
    if not isinstance(profile_list, list):
        raise ProfileError("profile_list must be a list of profiles.")
    profiles = [parse_profile(p, i) for i, p in enumerate(profile_list)]
    seen: set[str] = set()
    for p in profiles:
        if p.slug in seen:
            raise ProfileError(f"Two profiles have the slug {p.slug!r}; slugs must be unique.")
        seen.add(p.slug)
    if sum(p.default for p in profiles) > 1:
        raise ProfileError("More than one profile is marked default.")
    return profiles


def default_profile_list(total_gpus: int) -> list[dict]:
    """The profiles offered when none are configured: CPU only, then 1, 2, 4, 8 GPUs."""
    profiles = [
        {
            "display_name": "CPU only",
            "slug": "cpu",
            "description": "A server without GPUs, for editing and small jobs.",
        }
    ]
    for n in (1, 2, 4, 8):
        if n <= total_gpus:
            profiles.append(
                {
                    "display_name": f"{n} GPU" + ("s" if n > 1 else ""),
                    "slug": f"gpu-{n}",
                    "kubespawner_override": {"extra_resource_limits": {GPU_RESOURCE: str(n)}},
                    **({"default": True} if n == 1 else {}),
                }
            )
    if total_gpus == 0:
        profiles[0]["default"] = True
    return profiles


def choose_profile(profiles: list[GPUProfile], slug: str | None) -> GPUProfile:
    """The profile named by `slug`, or the default (first) one when `slug` is None."""
    if not profiles:
        raise ProfileError("No profiles are configured.")
    if slug is None:
        return next((p for p in profiles if p.default), profiles[0])
    for p in profiles:
        if p.slug == slug:
            return p
    raise LookupError(slug)
