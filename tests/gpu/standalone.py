"""gpulab's GPU-reading modules for the GPU checks, loaded from this checkout alone.

A lent GPU machine has the driver, ``pynvml`` and ``traitlets`` (and TensorFlow or PyTorch for
the load), but neither JupyterHub nor gpulab's other dependencies, and gpulab is not
installed there. `load_machine_modules` makes bare packages over the checkout's folders, so
that ``hub/machine/inventory.py`` and ``hub/machine/gpuusage.py`` import, and with them the
two standard-library-only modules of the quota layer that the inventory names
(``gpulab.hub.quota.queue`` and ``policy``); no package's ``__init__`` runs.
"""

from __future__ import annotations

import importlib
import sys
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _package(name: str, folder: Path | None) -> types.ModuleType:
    if name in sys.modules:
        return sys.modules[name]
    pkg = types.ModuleType(name)
    pkg.__path__ = [str(folder)] if folder is not None else []
    sys.modules[name] = pkg
    return pkg


def load_machine_modules():
    """``(inventory, gpuusage)`` of this checkout."""
    try:  # gpulab installed here (the development machine): use it as it is
        import gpulab.hub.machine.gpuusage as gpuusage
        import gpulab.hub.machine.inventory as inventory
        return inventory, gpuusage
    except ImportError:
        pass
    for name in ("gpulab", "gpulab.hub", "gpulab.hub.quota", "gpulab.hub.machine"):
        sys.modules.pop(name, None)
    _package("gpulab", None)
    _package("gpulab.hub", ROOT / "hub")
    _package("gpulab.hub.quota", ROOT / "hub" / "quota")
    _package("gpulab.hub.machine", ROOT / "hub" / "machine")
    return (importlib.import_module("gpulab.hub.machine.inventory"),
            importlib.import_module("gpulab.hub.machine.gpuusage"))
