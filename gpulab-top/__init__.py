"""gpulab: a multi-user JupyterHub for teams that share GPUs.

The code lives in the sub-packages ``gpulab.hub``, ``gpulab.spawner`` and
``gpulab.extensions`` (each mapped from its own folder in pyproject.toml). This file only makes
``%load_ext gpulab`` work in a notebook: it loads the notebook extension, the
``%%gpulab_train`` cell magic (`gpulab.extensions.magics`). The folder is named
``gpulab-top`` so that it can never be imported from the repository's root in place of the
installed package.

``gpulab.cluster(ps=2, workers=4, gpus_per_worker=1)`` holds parameter servers and workers
that this notebook kernel coordinates (`gpulab.extensions.cluster`; issue 38). Importing
``gpulab`` imports neither TensorFlow nor the hub.
"""


def cluster(ps: int = 1, workers: int = 1, gpus_per_worker: int = 0, **kwargs):
    """Hold a training cluster for this kernel: see `gpulab.extensions.cluster.cluster`."""
    from gpulab.extensions.cluster import cluster as hold

    return hold(ps, workers, gpus_per_worker, **kwargs)


def load_ipython_extension(ipython) -> None:
    """``%load_ext gpulab``: the same as ``%load_ext gpulab.extensions``."""
    from gpulab.extensions.magics import load_ipython_extension as load

    load(ipython)
