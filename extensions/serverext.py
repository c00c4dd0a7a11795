"""gpulab's Jupyter server extension: TensorBoard behind the hub, for every notebook server.

Enabled on install (``etc/jupyter/jupyter_server_config.d/gpulab.json``, as jupyterlab-git
does). Three things:

- Every person finds gpulab's examples in their folder (`offer_examples`: a copy of their own,
  made at the server's first start), with a ready notebook, ``examples/Train a model.ipynb``,
  that JupyterLab's launcher card "Train a model" opens (the small JupyterLab extension in
  ``jupyter-config/labextension``, installed into ``share/jupyter/labextensions``).

- TensorBoard is a jupyter-server-proxy server process (`tensorboard_server`, registered
  with the ``jupyter_serverproxy_servers`` entry point): ``<server prefix>tensorboard/``
  starts it on first use over the person's training runs (``$GPULAB_USER_DIR/jobs``, where
  every job writes ``<job>/tensorboard/``) and JupyterLab's launcher has a TensorBoard card.
  TensorBoard serves no TCP port at all (on a shared machine a loopback port is open to every
  account, and TensorBoard has no login): it listens on a Unix socket in a fresh 0700 folder
  of the server's own account (jupyter-server-proxy's ``unix_socket``, `serve_tensorboard`),
  so the only way in is through the person's own server, behind the hub's login.
- TensorBoard's own ``%tensorboard`` magic works in the kernels this server starts, with no TCP
  port either (`gpulab.extensions.tbmagic`): ``TENSORBOARD_BINARY`` names a launcher that runs
  the magic's TensorBoard on a Unix socket in a fresh 0700 folder of the server's account, and
  ``TENSORBOARD_PROXY_URL`` (``<prefix>gpulab-tensorboard/%PORT%/``) points the magic's iframe
  at this server's authenticated route to that socket.

GPU-idle warnings of the gpulab service reach JupyterLab as notifications
(`gpulab.extensions.idlenotice`: ``<prefix>gpulab/idle``, with a "Keep for N hours" button).

It also keeps the hub's answer for a token only `TOKEN_CACHE_SECONDS` (`bound_token_cache`):
a token revoked at the hub stops opening the server seconds later, not after JupyterHub's
default of five minutes.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

#: where TensorBoard is served, below the server's prefix
TENSORBOARD_PATH = "tensorboard"
#: how long a notebook server keeps the hub's answer for a token (JupyterHub's default: 300 s)
TOKEN_CACHE_SECONDS = 5


def runs_dir(env=None) -> str:
    """The folder TensorBoard reads: the person's jobs on shared storage (made if missing)."""
    env = os.environ if env is None else env
    base = env.get("GPULAB_USER_DIR") or os.getcwd()
    path = Path(base) / "jobs"
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


#: the folder of a person's copy of gpulab's examples, in their own folder
EXAMPLES = "examples"
#: the ready notebook among them, which JupyterLab's launcher card "Train a model" opens
READY_NOTEBOOK = "Train a model.ipynb"
#: the page-config key that tells the card where that notebook is (below the server's root)
PAGE_CONFIG_KEY = "gpulabTrainNotebook"


def installed_examples() -> Path:
    """Where gpulab's examples are installed (``<prefix>/share/gpulab/examples``:
    pyproject.toml's data-files), read-only for everyone."""
    return Path(sys.prefix) / "share" / "gpulab" / EXAMPLES


def offer_examples(env=None, source: Path | None = None) -> Path | None:
    """Copy gpulab's examples (`installed_examples`, or `source`) into the person's folder
    (``$GPULAB_USER_DIR/examples``) where nothing of that name is there yet: run by the
    server as the person's own account at its start, so the copy is theirs (to change, and to
    run as jobs: a job's ``script`` is a file in their folder) and nothing is written as root
    into a folder they control. A folder (or file, or link) named ``examples`` that is there
    already is left alone; a person who deletes it gets a fresh copy at the next start.
    Returns the folder made, or None."""
    import shutil

    env = os.environ if env is None else env
    base = env.get("GPULAB_USER_DIR")
    source = installed_examples() if source is None else source
    if not base or not source.is_dir():
        return None
    target = Path(base) / EXAMPLES
    if os.path.lexists(target):
        return None
    # copied beside it, then renamed into place: a server that dies half-way leaves no
    # half copy under the name (a rename onto an existing name fails: the person's wins)
    partial = Path(base) / f".{EXAMPLES}-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(source, partial, symlinks=True,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    try:
        if not os.path.lexists(target):
            os.rename(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return target if target.is_dir() else None


def ready_notebook_path(root_dir: str, env=None) -> str | None:
    """The ready notebook (``$GPULAB_USER_DIR/examples/Train a model.ipynb``) as JupyterLab
    names it: its path below the server's `root_dir`; None where it is missing or not below
    the root (a server whose root is elsewhere, e.g. a home folder on Kubernetes): then
    there is no card."""
    env = os.environ if env is None else env
    base = env.get("GPULAB_USER_DIR")
    if not base or not root_dir:
        return None
    notebook = Path(base) / EXAMPLES / READY_NOTEBOOK
    try:
        if not notebook.is_file():
            return None
        return notebook.resolve().relative_to(Path(root_dir).resolve()).as_posix()
    except (OSError, ValueError):
        return None


def tensorboard_proxy_url(env=None, base_url: str | None = None) -> str | None:
    """``TENSORBOARD_PROXY_URL`` for a server whose prefix is ``JUPYTERHUB_SERVICE_PREFIX``
    (or `base_url` outside a hub): the route of the magic's TensorBoards (`tbmagic`), never
    jupyter-server-proxy's ``proxy/<port>/``, which would need a TCP port."""
    from gpulab.extensions import tbmagic

    env = os.environ if env is None else env
    prefix = env.get("JUPYTERHUB_SERVICE_PREFIX") or base_url
    if not prefix:
        return None
    return tbmagic.proxy_url(prefix)


def tensorboard_server() -> dict:
    """The jupyter-server-proxy entry for TensorBoard (``jupyter_serverproxy_servers``).

    ``unix_socket: True``: jupyter-server-proxy makes a new folder with ``mkdtemp`` (mode 0700,
    the server's account) and connects to ``<folder>/socket``, where `serve_tensorboard`
    listens; no other account can enter the folder, let alone connect.
    """
    icon = Path(__file__).with_name("static") / "tensorboard.svg"

    def command(unix_socket):
        return [sys.executable, "-m", "gpulab.extensions.serverext", "--unix-socket",
                unix_socket, "--logdir", runs_dir(), "--reload_interval", "5"]

    return {
        "command": command,
        "unix_socket": True,
        "timeout": 90,  # TensorBoard takes a while to start on a busy machine
        "new_browser_tab": False,
        "launcher_entry": {"title": "TensorBoard", "icon_path": str(icon)},
    }


from gpulab.extensions.tbserver import (  # noqa: E402,F401  (their old home)
    fonts_behind_proxy, relative_fonts, unix_socket_server_class, without_data_server)


def serve_tensorboard(argv: list[str] | None = None) -> int:
    """``python -m gpulab.extensions.serverext --unix-socket PATH <tensorboard flags>``:
    TensorBoard on a Unix socket (its other flags as TensorBoard's own; ``--host`` and
    ``--port`` are refused, there is no TCP port; no data server either, `without_data_server`)."""
    import argparse

    from tensorboard import default, program

    parser = argparse.ArgumentParser(prog="gpulab-tensorboard")
    parser.add_argument("--unix-socket", required=True)
    args, rest = parser.parse_known_args(argv)
    if any(a.split("=")[0] in ("--host", "--port", "--bind_all") for a in rest):
        parser.error("TensorBoard here listens on a Unix socket only (no --host/--port)")
    os.umask(0o077)  # the socket file itself is the account's alone too
    tb = program.TensorBoard(plugins=default.get_plugins(),
                             server_class=unix_socket_server_class(args.unix_socket))
    tb.configure(argv=["tensorboard", *rest])
    without_data_server(tb)
    return tb.main()


def _jupyter_server_extension_points():
    return [{"module": "gpulab.extensions.serverext"}]


def setup_tensorboard_magic(serverapp) -> str:
    """Make TensorBoard's ``%tensorboard`` magic serve on Unix sockets in a fresh 0700 folder
    (`tbmagic`) for the kernels this server starts (they inherit the server's environment), and
    route ``<prefix>gpulab-tensorboard/<key>/`` to them. Both variables are set whatever the
    environment held: a ``TENSORBOARD_PROXY_URL`` naming a port would not match the magic's
    keys, and a ``TENSORBOARD_BINARY`` of TensorBoard itself would open a TCP port."""
    from gpulab.extensions import tbmagic

    folder = tbmagic.make_magic_dir()
    launcher = tbmagic.write_launcher(folder)
    os.environ["TENSORBOARD_BINARY"] = launcher
    os.environ["TENSORBOARD_PROXY_URL"] = tensorboard_proxy_url(
        base_url=serverapp.base_url)
    serverapp.web_app.add_handlers(".*", [tbmagic.handler_spec(serverapp.base_url, folder)])
    return folder


def bound_token_cache(serverapp) -> int | None:
    """Keep the hub's answer for a token (or for a browser's OAuth cookie) `TOKEN_CACHE_SECONDS`
    in this server: JupyterHub's ``HubOAuth`` keeps it 300 s, so a token its owner revoked at
    the hub (or one of an account the admin deleted) went on opening the server, its kernels
    and files, for five minutes. An operator's own ``c.HubOAuth.cache_max_age`` (or
    ``HubAuth``'s) stands. Returns the bound in force, or None outside JupyterHub (no
    ``hub_auth``: nothing to bound)."""
    auth = getattr(getattr(serverapp, "identity_provider", None), "hub_auth", None)
    if auth is None:
        return None
    config = serverapp.config
    if any("cache_max_age" in dict.get(config, section, {}) for section in ("HubOAuth", "HubAuth")):
        return auth.cache_max_age
    auth.cache_max_age = TOKEN_CACHE_SECONDS
    # the cache may be made already, with the bound it had then
    auth.cache.max_age = auth.cache.purge_interval = TOKEN_CACHE_SECONDS
    return TOKEN_CACHE_SECONDS


def _load_jupyter_server_extension(serverapp) -> None:
    try:
        examples = offer_examples()
    except OSError as e:  # a full disk, a read-only folder: the server starts all the same
        serverapp.log.warning("gpulab: could not copy the examples into your folder: %s", e)
    else:
        if examples is not None:
            serverapp.log.info("gpulab: gpulab's examples copied to %s", examples)
    # JupyterLab's page config tells the card "Train a model" which notebook to open
    ready = ready_notebook_path(serverapp.root_dir)
    if ready is not None:
        serverapp.web_app.settings.setdefault("page_config_data", {})[PAGE_CONFIG_KEY] = ready
    bound = bound_token_cache(serverapp)
    if bound is not None:
        serverapp.log.info("gpulab: the hub's answer for a token is kept %d s", bound)
    folder = setup_tensorboard_magic(serverapp)
    # GPU-idle warnings in JupyterLab (the labextension's idle-notice plugin asks here)
    from gpulab.extensions import idlenotice

    serverapp.web_app.add_handlers(".*", idlenotice.handlers(serverapp.base_url))
    serverapp.log.info("gpulab: %%tensorboard magic at %s on Unix sockets in %s",
                       os.environ["TENSORBOARD_PROXY_URL"], folder)
    serverapp.log.info("gpulab: TensorBoard at %s%s/ over %s", serverapp.base_url,
                       TENSORBOARD_PATH, os.environ.get("GPULAB_USER_DIR", "(no GPULAB_USER_DIR)"))


if __name__ == "__main__":
    sys.exit(serve_tensorboard())
