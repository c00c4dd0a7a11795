"""Notebook-side gpulab: what code running inside a user's server can ask about itself.

The widgets, magics and the training runtime arrive with the jobs API; today this package
tells a notebook which GPUs its server was given.
"""

from __future__ import annotations

import json
import os


def gpus() -> list[dict]:
    """The GPUs this server was given: index, uuid, model, memory_mib and simulated.

    Read from ``GPULAB_GPUS``, which the spawner sets; [] outside a gpulab server or on a
    CPU-only profile.
    """
    raw = os.environ.get("GPULAB_GPUS", "")
    if not raw:
        return []
    try:
        value = json.loads(raw)
    except ValueError as e:
        raise RuntimeError(f"GPULAB_GPUS is not valid JSON: {e}") from e
    return value if isinstance(value, list) else []


def shared_dir() -> str | None:
    """This user's folder on the shared storage (``GPULAB_USER_DIR``), if any."""
    return os.environ.get("GPULAB_USER_DIR") or None
