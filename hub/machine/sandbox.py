"""Namespaces and a safe working directory for local notebook servers and training replicas.

As root, gpulab starts each person's processes in a sandbox made of Linux namespaces, set up in
the child between ``fork`` and ``exec`` (``preexec_fn``, still root, before it drops to the
person's account):

- **a private /tmp** (`private_tmp`): a mount namespace of the process's own, where every mount
  is a slave of the machine's (mounts made later outside still reach it, nothing made inside
  leaks out) and a folder made for it (`make_private_dir`: owned by the person, mode 0700, in a
  root-owned 0700 folder nobody else can enter) is bind-mounted over ``/tmp``. It is what
  systemd's ``PrivateTmp`` does: fixed paths such as ``/tmp/my_working_dir`` in TensorFlow's
  tutorials neither collide with nor leak to other people.
- **private IPC** (`private_tmp` with ``ipc=True``): an IPC namespace of the process's own
  (System V shared memory, semaphores and message queues; POSIX message queues, with a fresh
  ``mqueue`` on ``/dev/mqueue``) and a fresh ``tmpfs`` on ``/dev/shm`` (POSIX shared memory,
  ``multiprocessing``'s and PyTorch's data loaders' buffers), as systemd's ``PrivateIPC``:
  nobody else sees, reads or squats a name there. Its size (`shm_options`) is the process's
  memory limit where it has one, else the kernel's default for tmpfs (half the RAM): its
  pages are charged to the process's control group whatever the size, so the memory limit
  bounds it anyway, and a small fixed size (Docker's 64 MB) breaks data loaders.
- **a /proc that shows only the person's own processes** (`private_tmp` with
  ``hide_pids=True``): a new procfs instance mounted on ``/proc`` with ``hidepid=2``
  ("invisible", per instance since Linux 5.8), as systemd's ``ProtectProc=invisible``: other
  people's processes, their command lines and environments, are not listed and cannot be
  opened. The rest of ``/proc`` (``cpuinfo``, ``meminfo``, ``sys``, the NVIDIA driver's files)
  stays as it was: ``subset=pid`` would hide it and break TensorFlow and psutil.
- **a network namespace per training job** (`make_netns` as root when the job starts, `join_netns`
  in each replica): it holds only the loopback interface, so the job's replicas reach each other
  on 127.0.0.1 and nothing outside the job reaches their TensorFlow gRPC servers (which run any
  graph they are sent: they have no authentication). The namespace is kept alive by a bind
  mount of its ``nsfs`` file under ``/run/gpulab/netns/`` (as ``ip netns`` does under
  ``/run/netns/``) and goes with `remove_netns`. Replicas cannot reach the machine's own
  loopback services either (the hub, the gpulab service): that is intended. A person's
  notebook servers share one such namespace, made and joined the same way
  (`gpulab.hub.machine.personnet` adds the hub's relays in and out; `socket_in_netns` makes their
  sockets inside it).
- **the working directory entered as the person** (`enter_dir`): after dropping privileges,
  through a descriptor opened one component at a time without following links
  (`gpulab.hub.machine.safefs`), never with ``Popen(cwd=...)``, which runs ``chdir`` as root before
  ``preexec_fn``.

Python 3.11 has no ``os.unshare`` / ``os.setns``: they are called through ctypes on the C
library, loaded at import (never in a forked child).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import os
import shutil
import socket
import stat
import struct
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path

CLONE_NEWNS = 0x00020000
CLONE_NEWNET = 0x40000000
CLONE_NEWIPC = 0x08000000
MS_NOSUID = 2
MS_NODEV = 4
MS_NOEXEC = 8
MS_BIND = 4096
MS_REC = 16384
MS_PRIVATE = 1 << 18
MS_SLAVE = 1 << 19
MNT_DETACH = 2
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1

#: where gpulab keeps the network namespaces of running jobs (one file per job)
NETNS_DIR = Path("/run/gpulab/netns")

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                        ctypes.c_void_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.setns.argtypes = [ctypes.c_int, ctypes.c_int]


class SandboxError(OSError):
    """A namespace could not be made or entered (the message says which call and why)."""


def _check(ret: int, what: str) -> None:
    if ret != 0:
        e = ctypes.get_errno()
        raise SandboxError(e, f"{what}: {os.strerror(e)}")


def _b(path: str | os.PathLike | None) -> bytes | None:
    return None if path is None else os.fsencode(path)


def unshare(flags: int) -> None:
    """unshare(2) for this process (or thread, for ``CLONE_NEWNET``)."""
    _check(_libc.unshare(flags), f"unshare({flags:#x})")


def setns(fd: int, nstype: int) -> None:
    """setns(2): move this process (thread) into the namespace open as ``fd``."""
    _check(_libc.setns(fd, nstype), f"setns({nstype:#x})")


def mount(source: str | os.PathLike | None, target: str | os.PathLike,
          fstype: str | None = None, flags: int = 0, data: str | None = None) -> None:
    _check(_libc.mount(_b(source), _b(target), _b(fstype), flags,
                       None if data is None else ctypes.c_char_p(data.encode())),
           f"mount {source or fstype or ''} on {target}")


def umount(target: str | os.PathLike, flags: int = MNT_DETACH) -> None:
    _check(_libc.umount2(_b(target), flags), f"umount {target}")


# -- private /tmp ------------------------------------------------------------------------

#: the mount options of the private /proc: other people's processes are invisible
PROC_OPTIONS = "hidepid=2"
_PROC_FLAGS = MS_NOSUID | MS_NODEV | MS_NOEXEC
_SHM_FLAGS = MS_NOSUID | MS_NODEV


def shm_options(size: int | None) -> str:
    """The mount options of a private ``/dev/shm`` of ``size`` bytes (None or 0: the kernel's
    default for tmpfs, half the RAM): world-writable with the sticky bit, as ``/dev/shm`` is
    everywhere (only the process's own tree sees it)."""
    if size is not None and size < 0:
        raise ValueError(f"a /dev/shm size is a number of bytes, not {size}")
    return "mode=1777" + (f",size={int(size)}" if size else "")


def private_tmp(source_dir: str | os.PathLike | None, keep: Iterable[str | os.PathLike] = (), *,
                ipc: bool = False, shm_size: int | None = None,
                hide_pids: bool = False) -> None:
    """Give this process a mount namespace of its own whose ``/tmp`` is ``source_dir``.

    Call it in ``preexec_fn`` as root, before dropping privileges (the namespace and the
    mount need ``CAP_SYS_ADMIN``); everything the process starts inherits it. Every mount is
    made a slave first, so the bind mount never propagates back to the machine, while mounts
    and unmounts made outside later still reach the process. ``source_dir`` must be a folder
    the person cannot replace by a link (`make_private_dir` makes one).

    ``keep``: folders the process still needs at their usual path though they lie below
    ``/tmp`` (a data folder made with ``mktemp -d``, as the tests do): each is bound back in
    place inside the private ``/tmp``, the way there made by root without following links.
    Folders not below ``/tmp`` are left alone (they stay visible anyway).

    ``source_dir`` None: ``/tmp`` stays the machine's (only the other parts below are made).

    ``ipc``: an IPC namespace of its own too, a fresh tmpfs on ``/dev/shm`` of ``shm_size``
    bytes (`shm_options`) and a fresh ``mqueue`` on ``/dev/mqueue`` where that folder exists.
    ``hide_pids``: a new procfs on ``/proc`` that lists only the processes of the process's
    own account (`PROC_OPTIONS`; mounted last, as root, so it sees the rest here).
    """
    unshare(CLONE_NEWNS | (CLONE_NEWIPC if ipc else 0))
    mount(None, "/", None, MS_REC | MS_SLAVE)
    if ipc:
        mount("tmpfs", "/dev/shm", "tmpfs", _SHM_FLAGS, shm_options(shm_size))
        if os.path.isdir("/dev/mqueue"):
            mount("mqueue", "/dev/mqueue", "mqueue", _PROC_FLAGS)
    if source_dir is not None:
        _bind_tmp(source_dir, keep)
    if hide_pids:
        mount("proc", "/proc", "proc", _PROC_FLAGS, PROC_OPTIONS)


def _bind_tmp(source_dir, keep) -> None:
    """Bind ``source_dir`` on ``/tmp`` and the ``keep`` folders back in place (`private_tmp`)."""
    kept = []
    try:
        for path in keep:
            parts = _below_tmp(path)
            if parts:  # opened in the new namespace, before /tmp is covered
                kept.append((parts, os.open(path, _DIR)))
        mount(source_dir, "/tmp", None, MS_BIND)
        for parts, fd in kept:
            target = os.open("/tmp", _DIR)
            try:
                for name in parts:
                    try:
                        os.mkdir(name, 0o711, dir_fd=target)
                        made = True
                    except FileExistsError:
                        made = False
                    nxt = os.open(name, _DIR, dir_fd=target)  # a link there: ELOOP/ENOTDIR
                    os.close(target)
                    target = nxt
                    if made:  # passable by the person whatever this process's umask
                        os.fchmod(target, 0o711)
                mount(f"/proc/self/fd/{fd}", f"/proc/self/fd/{target}", None, MS_BIND | MS_REC)
            finally:
                os.close(target)
    finally:
        for _, fd in kept:
            os.close(fd)


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _below_tmp(path: str | os.PathLike) -> list[str]:
    """The components of ``path`` below ``/tmp`` ([] if it is not below it)."""
    parts = Path(os.path.abspath(path)).parts
    return list(parts[2:]) if parts[:2] == ("/", "tmp") else []


def make_private_dir(parent: str | os.PathLike, name: str,
                     owner: tuple[int, int] | None = None) -> Path:
    """``parent/name``, a folder owned by ``owner`` with mode 0700, made if missing.

    ``parent`` is made (and kept) owned by root (this process) with mode 0700: only root
    passes through it, so nobody can swap ``name`` for a link or look into someone else's
    folder; the person reaches theirs only where it is mounted (``/tmp``). Raises `SandboxError`
    when ``parent`` or ``name`` is a link or belongs to someone else.
    """
    parent = Path(parent)
    _own_folder(parent)
    if "/" in name or name in ("", ".", ".."):
        raise SandboxError(errno.EINVAL, f"bad folder name {name!r}")
    pfd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        try:
            os.mkdir(name, 0o700, dir_fd=pfd)
        except FileExistsError:
            pass
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=pfd)
        try:
            if owner is not None:
                os.fchown(fd, *owner)
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
    except OSError as e:
        if isinstance(e, SandboxError):
            raise
        raise SandboxError(e.errno or errno.EPERM,
                           f"cannot make {parent / name}: {e.strerror or e}") from e
    finally:
        os.close(pfd)
    return parent / name


def remove_private_dir(parent: str | os.PathLike, name: str) -> None:
    """Remove ``parent/name`` and all in it (links are removed, never followed)."""
    try:
        shutil.rmtree(Path(parent) / name)  # fd-based on Linux: safe against link swaps
    except FileNotFoundError:
        pass


def _own_folder(path: Path, mode: int = 0o700) -> None:
    """Make ``path`` (and missing parents) a folder of this process's user, mode ``mode``."""
    path.mkdir(mode=mode, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid():
        raise SandboxError(errno.EPERM, f"{path} is not a folder of uid {os.geteuid()}")
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)


# -- a network namespace per job ---------------------------------------------------------

def make_netns(name: str, base: str | os.PathLike = NETNS_DIR) -> Path:
    """A new network namespace holding only loopback (up), kept at ``base/name``.

    Made in a short-lived thread of its own (a network namespace belongs to a thread), so this
    process stays where it is. Needs root. Raises `SandboxError` with the reason.
    """
    base = Path(base)
    _own_folder(base, 0o755)
    path = base / name
    if path.exists():
        remove_netns(name, base)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o444)
    os.close(fd)
    errors: list[BaseException] = []

    def make():
        try:
            unshare(CLONE_NEWNET)
            mount(f"/proc/self/task/{threading.get_native_id()}/ns/net", path, None, MS_BIND)
            _loopback_up()
        except BaseException as e:  # reported by the caller
            errors.append(e)

    t = threading.Thread(target=make, name=f"netns-{name}", daemon=True)
    t.start()
    t.join()
    if errors:
        remove_netns(name, base)
        e = errors[0]
        raise SandboxError(getattr(e, "errno", None) or errno.EPERM,
                           f"cannot make a network namespace for {name}: {e}") from e
    return path


def _loopback_up() -> None:
    """Set ``lo`` up in this thread's network namespace (SIOCSIFFLAGS)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH22x", b"lo", 0)
        flags = struct.unpack("16sH22x", fcntl.ioctl(s.fileno(), _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s.fileno(), _SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | _IFF_UP))


def open_netns(name: str, base: str | os.PathLike = NETNS_DIR) -> int:
    """An fd of the job's network namespace, for `join_netns` in a child (close it after)."""
    return os.open(Path(base) / name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)


def join_netns(fd: int) -> None:
    """Enter the network namespace open as ``fd`` (in ``preexec_fn``, as root)."""
    setns(fd, CLONE_NEWNET)


def remove_netns(name: str, base: str | os.PathLike = NETNS_DIR) -> None:
    """Forget the job's network namespace (it ends once no process is left in it)."""
    path = Path(base) / name
    try:
        umount(path, MNT_DETACH)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOENT):
            raise
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def socket_in_netns(path: str | os.PathLike, family: int = socket.AF_INET,
                    type: int = socket.SOCK_STREAM) -> socket.socket:
    """A new socket of the network namespace kept at ``path`` (a `make_netns` file).

    A socket belongs for good to the namespace of the thread that made it: it is made in a
    short-lived thread that joins the namespace (as `make_netns` makes one), so this process
    stays where it is and may then bind, listen, accept or connect with it from any thread.
    Needs root (``setns``). Raises `SandboxError` with the reason.
    """
    made: list[socket.socket] = []
    errors: list[BaseException] = []

    def make():
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                setns(fd, CLONE_NEWNET)
            finally:
                os.close(fd)
            made.append(socket.socket(family, type))
        except BaseException as e:  # reported by the caller
            errors.append(e)

    t = threading.Thread(target=make, name="netns-socket", daemon=True)
    t.start()
    t.join()
    if errors:
        e = errors[0]
        raise SandboxError(getattr(e, "errno", None) or errno.EPERM,
                           f"cannot make a socket in the network namespace {path}: {e}") from e
    return made[0]


def netns_names(base: str | os.PathLike = NETNS_DIR) -> list[str]:
    """The names of the namespaces kept under ``base`` (for clean-up at start-up)."""
    try:
        return sorted(os.listdir(base))
    except FileNotFoundError:
        return []


# -- the working directory, entered as the person ----------------------------------------

def enter_dir(root: str | os.PathLike, rel: str | Sequence[str] = ()) -> None:
    """``chdir`` into ``root/rel`` without following links below ``root``.

    Call it after dropping privileges (in ``preexec_fn``, last): the walk runs with the
    person's own rights, one ``openat(O_NOFOLLOW)`` per component, and ends in ``fchdir``.
    """
    from gpulab.hub.machine import safefs  # the one O_NOFOLLOW walker

    fd = safefs.open_dir(Path(root), rel)
    try:
        os.fchdir(fd)
    finally:
        os.close(fd)
