"""Files inside a user's folder, opened by a privileged service without following links.

The gpulab service runs as root when users are isolated, and writes job folders, logs and
source files into folders that belong to the users. A user could replace any of those paths
with a symbolic link (to ``/etc/shadow``, to another user's folder); a root process that
followed it would write, chown or read someone else's file. So every path below a user's
folder is walked one component at a time with ``openat(..., O_NOFOLLOW)``: a link anywhere
on the way is refused (`UnsafePath`), and there is no window between a check and the use.
Files are opened non-blocking and checked with ``fstat`` before use: a FIFO, socket or device
node planted in place of a log is refused at once instead of hanging the service. These are
blocking calls (a slow disk): call them from a thread, never on an event loop.
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
from collections.abc import Sequence
from pathlib import Path

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafePath(OSError):
    """A path below a user's folder is a link, or not what it should be."""


def _parts(rel: str | Sequence[str]) -> list[str]:
    parts = rel.split("/") if isinstance(rel, str) else list(rel)
    for p in parts:
        if p in ("", ".", "..") or "/" in p or "\0" in p:
            raise UnsafePath(errno.EINVAL, f"bad path component {p!r}")
    return parts


def open_dir(root: Path, rel: str | Sequence[str] = (), *, create: bool = False,
             owner: tuple[int, int] | None = None, mode: int = 0o700) -> int:
    """An fd of the folder ``root/rel``, made (mode `mode`, owned by `owner`) if `create`."""
    fd = os.open(root, _DIR)
    try:
        for name in _parts(rel):
            if create:
                try:
                    os.mkdir(name, mode, dir_fd=fd)
                    if owner is not None:
                        os.chown(name, *owner, dir_fd=fd, follow_symlinks=False)
                except FileExistsError:
                    pass
            try:
                nxt = os.open(name, _DIR, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise UnsafePath(e.errno, f"{name} is a link or not a folder") from None
                raise
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def open_file(root: Path, rel: str | Sequence[str], flags: int, *,
              owner: tuple[int, int] | None = None, mode: int = 0o600) -> int:
    """An fd of the regular file ``root/rel`` (opened with `flags`, never through a link)."""
    *folders, name = _parts(rel)
    dfd = open_dir(root, folders)
    try:
        try:
            # O_NONBLOCK: a FIFO planted by the user must not hang the open (a reader waits
            # for a writer forever); sockets and FIFOs without a peer fail with ENXIO
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
                         | os.O_NOCTTY, mode, dir_fd=dfd)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise UnsafePath(e.errno, f"{name} is a link") from None
            if e.errno == errno.ENXIO:
                raise UnsafePath(e.errno, f"{name} is not a plain file") from None
            raise
    finally:
        os.close(dfd)
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink > 1:
        os.close(fd)
        raise UnsafePath(errno.EPERM, f"{name} is not a plain file")
    # a plain file: blocking mode again (it changes nothing for files, but the fd may be
    # handed to a child process as its output)
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    if owner is not None and flags & os.O_CREAT:
        os.fchown(fd, *owner)
    return fd


def write_text(root: Path, rel: str | Sequence[str], text: str, *,
               owner: tuple[int, int] | None = None) -> None:
    """Write `text` to the plain file ``root/rel`` (made if missing). It is emptied only
    once `open_file` has checked it: ``O_TRUNC`` would empty a planted hard link's other
    name (someone else's file) before the check could refuse it."""
    fd = open_file(root, rel, os.O_WRONLY | os.O_CREAT, owner=owner)
    with open(fd, "w", encoding="utf-8") as f:
        os.ftruncate(fd, 0)
        f.write(text)


def read_bytes(root: Path, rel: str | Sequence[str], offset: int = 0,
               limit: int = 1 << 20) -> tuple[bytes, int]:
    """Up to `limit` bytes from `offset`, and the file's size; (b"", 0) if it is missing."""
    try:
        fd = open_file(root, rel, os.O_RDONLY)
    except FileNotFoundError:
        return b"", 0
    with open(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if offset >= size:
            return b"", size
        f.seek(offset)
        return f.read(min(limit, size - offset)), size


def read_tail(root: Path, rel: str | Sequence[str], limit: int) -> bytes:
    """The last `limit` bytes of a file below `root` (b"" if it is missing)."""
    try:
        fd = open_file(root, rel, os.O_RDONLY)
    except FileNotFoundError:
        return b""
    with open(fd, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        f.seek(max(0, size - limit))
        return f.read(limit)
