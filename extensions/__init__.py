"""Notebook-side gpulab: what code running inside a user's server can ask about itself.

`gpus` and `shared_dir` tell a notebook what its server was given. The training runtime
(`gpulab.extensions.runtime`, the entry point of every job replica) also lends its helpers
here: ``strategy``, ``logdir``, ``checkpoint_dir``, ``writable_dir``, ``is_chief``, ``task``
and ``report``, loaded on first use, so ``import gpulab.extensions`` never imports TensorFlow.

The notebook side is loaded on first use too (never in a job's replicas): ``Client``,
``GpulabError`` (`gpulab.extensions.client`), ``TrainingLauncher``, ``JobView``,
``JobsList``, ``TensorBoard`` (`gpulab.extensions.widgets`), and
``%load_ext gpulab.extensions`` registers the ``%%gpulab_train`` cell magic
(`gpulab.extensions.magics`).
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


_RUNTIME_HELPERS = ("strategy", "logdir", "checkpoint_dir", "writable_dir", "is_chief", "task",
                    "report")


_NOTEBOOK_NAMES = {"Client": "client", "GpulabError": "client", "TrainingLauncher": "widgets",
                   "JobView": "widgets", "JobsList": "widgets", "TensorBoard": "widgets",
                   "ClusterLauncher": "widgets", "Cluster": "cluster"}


def __getattr__(name: str):
    if name in _RUNTIME_HELPERS:
        from . import runtime

        return getattr(runtime, name)
    if name in _NOTEBOOK_NAMES:
        import importlib

        return getattr(importlib.import_module(f"{__name__}.{_NOTEBOOK_NAMES[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__():
    return sorted([*globals(), *_RUNTIME_HELPERS, *_NOTEBOOK_NAMES])


def load_ipython_extension(ipython) -> None:
    """``%load_ext gpulab.extensions``: the ``%%gpulab_train`` cell magic."""
    from .magics import load_ipython_extension as load

    load(ipython)
