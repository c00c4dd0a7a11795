"""TensorBoard's own ``%tensorboard`` magic, without a TCP port.

TensorBoard's notebook magic (``%load_ext tensorboard``; tensorboard/notebook.py and
tensorboard/manager.py) starts ``tensorboard <args>`` and shows an iframe at
``TENSORBOARD_PROXY_URL`` with ``%PORT%`` replaced by the port the new TensorBoard wrote into
its info file. Stock TensorBoard listens on a TCP port: on a shared machine every local account
can connect to it, and TensorBoard has no login. gpulab keeps the magic as it is and changes
only where its TensorBoard listens:

- The server extension sets ``TENSORBOARD_BINARY`` (which the magic runs instead of
  ``tensorboard``) for its kernels to a launcher (`write_launcher`) in a fresh 0700 folder of
  the server's account. The launcher (`main`) runs TensorBoard with the person's own arguments
  on the Unix socket ``<folder>/<key>.sock``; ``--host``, ``--port`` and ``--bind_all`` bind
  nothing (there is no TCP server at all), and TensorBoard's fast data server (a gRPC server
  on a loopback TCP port) is not started (``serverext.without_data_server``).
- The *key* is a small number that stands in for the port everywhere the magic looks: in
  TensorBoard's info file (so reuse by cache key, ``notebook.display(port=...)`` and
  ``notebook.list()`` keep working), and in ``%PORT%``. ``--port N`` asks for key N; otherwise
  the first free key from 6006 (`claim_key`: a key is held by an ``flock`` for the life of its
  TensorBoard).
- ``TENSORBOARD_PROXY_URL`` is ``<server prefix>gpulab-tensorboard/%PORT%/``, served by
  `MagicTensorBoardHandler`: jupyter-server-proxy's proxy handler (authenticated like every
  other handler of the server, so only the server's owner gets through the hub) over the socket
  of that key in the server's own folder.

Why this is sound: only the server's account can enter the 0700 folder, so only the person's
own processes (their server, kernels, terminals) can connect to a socket or place one; the
handler serves only ``<its own folder>/<number>.sock`` (the folder is fixed when the server
starts, never read from a request or the kernel's environment). TensorBoard's info folder
(``/tmp/.tensorboard-info``) may be shared with other accounts, but a planted info file can at
most make the magic show another key of the person's own folder.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shlex
import shutil
import stat
import sys
import tempfile

#: below the server's prefix: ``<prefix>gpulab-tensorboard/<key>/``
MAGIC_PATH = "gpulab-tensorboard"
#: keys tried, in order, when ``%tensorboard`` names no ``--port``: TensorBoard's own default
FIRST_KEY = 6006
KEYS = 100


def proxy_url(prefix: str) -> str:
    """``TENSORBOARD_PROXY_URL`` for a server whose URL prefix is `prefix`."""
    return prefix.rstrip("/") + "/" + MAGIC_PATH + "/%PORT%/"


def socket_path(folder: str, key: int) -> str:
    return os.path.join(folder, f"{int(key)}.sock")


def launcher_script(python: str, folder: str) -> str:
    """The text of the launcher named by ``TENSORBOARD_BINARY``: a POSIX shell script (a
    ``#!`` line to the interpreter could exceed the kernel's length limit in a deep venv)."""
    return ("#!/bin/sh\n"
            "# gpulab: TensorBoard's %tensorboard magic on a Unix socket (no TCP port)\n"
            f"exec {shlex.quote(python)} -m gpulab.extensions.tbmagic {shlex.quote(folder)} "
            '"$@"\n')


def make_magic_dir() -> str:
    """A fresh folder for the magic's sockets and launcher: 0700, the server's account
    (``mkdtemp``), under the server's own temporary folder; removed when the server's
    process exits (a stop ends the server normally; every start makes a new one)."""
    folder = tempfile.mkdtemp(prefix="gpulab-tensorboard-magic-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def write_launcher(folder: str, python: str | None = None) -> str:
    """Write the launcher into `folder` (created new, never through a link); its path."""
    path = os.path.join(folder, "tensorboard")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o700)
    with os.fdopen(fd, "w") as f:
        f.write(launcher_script(python or sys.executable, folder))
    return path


def check_private(folder: str) -> None:
    """Refuse to serve unless `folder` is a real folder of this account that no one else may
    enter (checked on the opened folder, not on its name)."""
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise PermissionError(
            f"{folder} is not a private folder of this account (uid {st.st_uid}, mode "
            f"{stat.S_IMODE(st.st_mode):o}): TensorBoard would be reachable by others")


def claim_key(folder: str, requested: int | None) -> tuple[int, int]:
    """A key no live TensorBoard of this folder holds, and the descriptor whose ``flock``
    holds it (keep it open as long as the socket serves). `requested` (``--port``, when > 0)
    is that key or nothing, as a taken TCP port would be."""
    from tensorboard.program import TensorBoardServerException

    if requested:
        if not 0 < requested <= 0xFFFF:
            raise TensorBoardServerException(f"TensorBoard cannot use port {requested}")
        candidates = [requested]
    else:
        candidates = range(FIRST_KEY, FIRST_KEY + KEYS)
    for key in candidates:
        fd = os.open(os.path.join(folder, f"{key}.lock"),
                     os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        return key, fd
    if requested:
        raise TensorBoardServerException(
            f"TensorBoard could not bind to port {requested}, it was already in use")
    raise TensorBoardServerException(
        f"TensorBoard could not find a free port from {FIRST_KEY} to {FIRST_KEY + KEYS - 1}")


def server_factory(folder: str):
    """TensorBoard's ``server_class``: on a Unix socket in `folder`, under a claimed key."""
    from gpulab.extensions.tbserver import unix_socket_server_class

    def make(wsgi_app, flags):
        key, lock = claim_key(folder, flags.port)
        server = unix_socket_server_class(socket_path(folder, key), key)(wsgi_app, flags)
        server.gpulab_key_lock = lock  # the key is ours while this process lives
        return server

    return make


def main(argv: list[str] | None = None) -> int:
    """``python -m gpulab.extensions.tbmagic FOLDER <tensorboard arguments>`` (the launcher):
    TensorBoard with the magic's arguments, unchanged (they make its cache key, which the magic
    matches), served on a Unix socket in FOLDER."""
    from tensorboard import default, program

    from gpulab.extensions.tbserver import without_data_server

    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        print("usage: python -m gpulab.extensions.tbmagic FOLDER [tensorboard flags]",
              file=sys.stderr)
        return 2
    folder, args = argv[0], argv[1:]
    try:
        check_private(folder)
    except OSError as e:
        print(f"ERROR: {e}", file=sys.stderr)
        return 1
    os.umask(0o077)  # the socket and lock files are the account's alone too
    tb = program.TensorBoard(plugins=default.get_plugins(), server_class=server_factory(folder))
    tb.configure(argv=["tensorboard", *args])
    without_data_server(tb)  # its gRPC port would be open to every account
    return tb.main()


def handler_spec(base_url: str, folder: str):
    """The server extension's route for the magic's TensorBoards (one row for
    ``web_app.add_handlers``)."""
    from jupyter_server.utils import url_path_join

    return (url_path_join(base_url, MAGIC_PATH, r"(\d{1,5})(/.*|)"), magic_handler_class(),
            {"folder": folder, "absolute_url": False})


_HANDLER = None


def magic_handler_class():
    """`MagicTensorBoardHandler`, made on first use: it needs tornado and jupyter-server-proxy,
    which the launcher (`main`) does not import."""
    global _HANDLER
    if _HANDLER is None:
        _HANDLER = _make_handler_class()
    return _HANDLER


def _make_handler_class():
    from jupyter_server_proxy.handlers import LocalProxyHandler
    from tornado import web

    class MagicTensorBoardHandler(LocalProxyHandler):
        """``<prefix>gpulab-tensorboard/<key>/...``: the magic's TensorBoard of that key,
        through its Unix socket. Authentication is jupyter-server-proxy's (``prepare``: the
        server's owner, as for every handler of the server); the socket is only ever one in the
        server's own folder."""

        def initialize(self, folder: str):
            self.folder = folder

        def _use_socket(self, key: str) -> None:
            path = socket_path(self.folder, int(key))
            if not os.path.exists(path):
                raise web.HTTPError(404, f"no TensorBoard {int(key)} of this server's "
                                         "%tensorboard magic is running")
            self.unix_socket = path
            self.proxy_base = f"{MAGIC_PATH}/{int(key)}"

        async def http_get(self, port, proxied_path):
            if not proxied_path:  # TensorBoard's page uses relative links
                self.redirect(self.request.path + "/"
                              + ("?" + self.request.query if self.request.query else ""))
                return
            return await self.proxy(port, proxied_path)

        def proxy(self, port, proxied_path):
            self._use_socket(port)
            return super().proxy(port, proxied_path)

        async def open(self, port, proxied_path):
            self._use_socket(port)
            return await super().open(port, proxied_path)

    return MagicTensorBoardHandler


if __name__ == "__main__":
    sys.exit(main())
