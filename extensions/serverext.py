"""gpulab's Jupyter server extension: TensorBoard behind the hub, for every notebook server.

Enabled on install (``etc/jupyter/jupyter_server_config.d/gpulab.json``, as jupyterlab-git
does). Two things:

- TensorBoard is a jupyter-server-proxy server process (`tensorboard_server`, registered
  with the ``jupyter_serverproxy_servers`` entry point): ``<server prefix>tensorboard/``
  starts it on first use over the person's training runs (``$GPULAB_USER_DIR/jobs``, where
  every job writes ``<job>/tensorboard/``) and JupyterLab's launcher has a TensorBoard card.
  It is behind the hub's login like everything in the server: only its owner reaches it.
- ``TENSORBOARD_PROXY_URL`` is set from ``JUPYTERHUB_SERVICE_PREFIX`` (``<prefix>proxy/%PORT%/``)
  for the kernels this server starts, so TensorBoard's own ``%tensorboard`` magic shows its
  iframe through the same proxy instead of an unreachable ``localhost`` port.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: where TensorBoard is served, below the server's prefix
TENSORBOARD_PATH = "tensorboard"


def runs_dir(env=None) -> str:
    """The folder TensorBoard reads: the person's jobs on shared storage (made if missing)."""
    env = os.environ if env is None else env
    base = env.get("GPULAB_USER_DIR") or os.getcwd()
    path = Path(base) / "jobs"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def tensorboard_proxy_url(env=None) -> str | None:
    """``TENSORBOARD_PROXY_URL`` for a server whose prefix is ``JUPYTERHUB_SERVICE_PREFIX``."""
    env = os.environ if env is None else env
    prefix = env.get("JUPYTERHUB_SERVICE_PREFIX")
    if not prefix:
        return None
    return prefix.rstrip("/") + "/proxy/%PORT%/"


def tensorboard_server() -> dict:
    """The jupyter-server-proxy entry for TensorBoard (``jupyter_serverproxy_servers``)."""
    icon = Path(__file__).with_name("static") / "tensorboard.svg"

    def command(port):
        return [sys.executable, "-m", "tensorboard.main", "--logdir", runs_dir(),
                "--host", "127.0.0.1", "--port", str(port), "--reload_interval", "5"]

    return {
        "command": command,
        "timeout": 90,  # TensorBoard takes a while to start on a busy machine
        "new_browser_tab": False,
        "launcher_entry": {"title": "TensorBoard", "icon_path": str(icon)},
    }


def _jupyter_server_extension_points():
    return [{"module": "gpulab.extensions.serverext"}]


def _load_jupyter_server_extension(serverapp) -> None:
    url = tensorboard_proxy_url()
    if url and "TENSORBOARD_PROXY_URL" not in os.environ:
        os.environ["TENSORBOARD_PROXY_URL"] = url  # kernels inherit the server's environment
    serverapp.log.info("gpulab: TensorBoard at %s%s/ over %s", serverapp.base_url,
                       TENSORBOARD_PATH, os.environ.get("GPULAB_USER_DIR", "(no GPULAB_USER_DIR)"))
