"""gpulab: a multi-user JupyterHub for teams that share GPUs.

The code lives in the sub-packages ``gpulab.hub``, ``gpulab.spawner`` and
``gpulab.extensions`` (each mapped from its own folder in pyproject.toml). This file only makes
``%load_ext gpulab`` work in a notebook: it loads the notebook extension, the
``%%gpulab_train`` cell magic (`gpulab.extensions.magics`). The folder is named
``gpulab-top`` so that it can never be imported from the repository's root in place of the
installed package.
"""


def load_ipython_extension(ipython) -> None:
    """``%load_ext gpulab``: the same as ``%load_ext gpulab.extensions``."""
    from gpulab.extensions.magics import load_ipython_extension as load

    load(ipython)
